"""The attention inbox: what needs the operator (approval pending, killed, failed, endpoint down, a stall past
its last warning) is listed newest first, cleared when the run says it is over or the operator dismisses it,
counted in the header, and rings the terminal (bell, OSC 9, OSC 777) once per agent per state change.

The run's events go through the engine's own emit into the console's mirror, at fixed monotonic times
against a frozen clock."""

from __future__ import annotations

import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.inbox import Inbox, terminal_alert
from cerevisor_tui.ui.screens.approval import ApprovalScreen
from cerevisor_tui.ui.screens.inbox import InboxScreen
from cerevisor_tui.ui.theme_files import load_themes
from cerevisor_tui.ui.widgets.run_header import RunHeader
from tests.conftest import until
from tests.ui.conftest import emit_as_engine, sim_config

T0 = 1000.0
NOW = 1100.0
NAMES = ["a", "b", "c", "d", "e"]


def run(tmp_path, *, notify: bool = True) -> tuple[CerevisorApp, Engine]:
    """Five agents running on the simulator (shown, not run: the test plays the engine's events)."""
    config = sim_config(tmp_path, agents=[{"name": name, "prompt": "hi", "retries": 0} for name in NAMES],
                        run={"max_concurrency": 5}, stall={"first_byte_timeout_s": 100.0, "warn_at": [0.5, 0.9]},
                        ui={"notify": notify})
    engine = Engine(config, run_id="inbox", run_dir=str(tmp_path / "runs" / "inbox"))
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    engine.emit(ev.WaveStarted(T0, 0, NAMES))
    for name in NAMES:
        emit_as_engine(engine, ev.AgentStarted(NOW - 20, name, 1, 1, 1, "sim", 100.0, 60.0))
    return app, engine


def trouble(engine: Engine) -> None:
    """Four agents in four kinds of trouble, a first and d last."""
    engine.emit(ev.AgentKilled(NOW - 9, "a", 1, "idle", "no output for 30 s after 3 tokens", 3))
    engine.emit(ev.AgentFinished(NOW - 9, "a", "killed", "no output for 30 s after 3 tokens"))
    emit_as_engine(engine, ev.StallWarning(NOW - 8, "b", 1, "first_byte", 0.5, 50.0, NOW + 42))
    emit_as_engine(engine, ev.StallWarning(NOW - 7, "b", 1, "first_byte", 0.9, 10.0, NOW + 3))
    emit_as_engine(engine, ev.EndpointWaiting(NOW - 6, "c", 1, "sim", "connection refused", 1.0))
    emit_as_engine(engine, ev.ApprovalRequested(NOW - 5, "d", "call-1", "files", "write_file", '{"path": "/tmp/x"}'))


def refresh(app: CerevisorApp) -> None:
    app.screen.refresh_status()


def header(app: CerevisorApp) -> str:
    return str(app.screen.query_one(RunHeader).render())


@pytest.mark.anyio
async def test_the_inbox_lists_what_needs_the_operator_newest_first_and_clears_it(tmp_path):
    app, engine = run(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        emit_as_engine(engine, ev.StallWarning(NOW - 10, "e", 1, "first_byte", 0.5, 50.0, NOW + 40))  # not past the last
        trouble(engine)
        refresh(app)
        inbox = app.mirror.inbox
        await until(lambda: [(i.agent, i.kind) for i in inbox.newest_first()] == [
            ("d", "approval"), ("c", "endpoint"), ("b", "stall"), ("a", "killed")])
        assert "inbox 4" in header(app)
        assert len(app.rung) == 1  # four at once ring once, naming them
        assert app.rung[0].startswith("\x07\x1b]9;cerevisor: 4 agents need you: a killed, b stalling, c endpoint "
                                      "down, d needs approval\x07")
        assert app.screen.table.row_texts("d")[2] == "needs approval"

        await pilot.press("i")
        await until(lambda: isinstance(app.screen, InboxScreen))
        screen = app.screen
        lines = [str(screen.query_one("#inbox-list").get_option_at_index(i).prompt) for i in range(4)]
        assert lines[0].split()[2:5] == ["d", "needs", "approval"] and "files.write_file" in lines[0]
        assert [line.split()[2] for line in lines] == ["d", "c", "b", "a"]

        # the run says it is over: an extension, a first token, the operator's answer (from another console)
        engine.emit(ev.StallExtended(NOW - 1, "b", 1, "first_byte", 300.0, "extended by operator", NOW + 300, 1,
                                     by_operator=True))
        emit_as_engine(engine, ev.FirstToken(NOW - 1, "c", 1, 1, 19.0))
        engine.emit(ev.ApprovalDecided(NOW - 1, "d", "call-1", "files", "write_file", "deny", "operator"))
        await until(lambda: screen.query_one("#inbox-list").option_count == 1)  # the inbox screen's refresh (0.5 s)
        assert [i.agent for i in inbox.newest_first()] == ["a"]
        await pilot.press("d")  # the operator dismisses the killed agent's item
        await until(lambda: len(inbox) == 0)
        await pilot.press("escape")
        refresh(app)
        await until(lambda: "inbox" not in header(app))


@pytest.mark.anyio
async def test_a_new_item_rings_once_per_agent_per_state_change(tmp_path):
    app, engine = run(tmp_path)
    async with app.run_test():
        emit_as_engine(engine, ev.StallWarning(NOW - 8, "b", 1, "first_byte", 0.9, 10.0, NOW + 3))
        refresh(app)
        await until(lambda: len(app.rung) == 1)
        assert app.rung[0].startswith("\x07\x1b]9;cerevisor: b stalling: no first token for 90%")
        assert "\x1b]777;notify;cerevisor: b stalling;no first token" in app.rung[0]

        emit_as_engine(engine, ev.StallWarning(NOW - 4, "b", 1, "first_byte", 0.95, 5.0, NOW + 3))  # the same state
        refresh(app)
        refresh(app)  # a refresh rings then and there, if at all: nothing to wait for
        assert len(app.rung) == 1

        engine.emit(ev.AgentKilled(NOW - 1, "b", 1, "first_byte", "no first token after 100 s", 0))
        engine.emit(ev.AgentFinished(NOW - 1, "b", "killed", "no first token after 100 s"))
        refresh(app)
        await until(lambda: len(app.rung) == 2)
        assert "b killed" in app.rung[1]

        # opened and cleared between two refreshes: nothing to ring for
        emit_as_engine(engine, ev.StallWarning(NOW - 1, "c", 1, "first_byte", 0.9, 10.0, NOW + 9))
        emit_as_engine(engine, ev.FirstToken(NOW - 1, "c", 1, 1, 19.0))
        # news from long ago (a journal replayed to an attaching console) is listed, not rung
        engine.emit(ev.AgentFinished(NOW - 600, "e", "failed", "HTTP 500"))
        refresh(app)
        await until(lambda: "e" in app.mirror.inbox.items)
        assert len(app.rung) == 2


@pytest.mark.anyio
async def test_notify_false_keeps_the_terminal_quiet(tmp_path):
    app, engine = run(tmp_path, notify=False)
    async with app.run_test():
        trouble(engine)
        refresh(app)
        await until(lambda: len(app.mirror.inbox) == 4)
        assert not app.rung


@pytest.mark.anyio
async def test_n_goes_to_the_newest_item_then_the_next_and_opens_an_approval(tmp_path):
    app, engine = run(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        trouble(engine)
        refresh(app)
        await pilot.pause()
        await pilot.press("slash", "k", "i", "l", "l", "enter")  # a filter that hides d
        assert app.screen.table.names == ["a"]
        await pilot.press("n")
        await until(lambda: isinstance(app.screen, ApprovalScreen))
        assert app.screen.request.call_id == "call-1"
        assert app.screen.query_one("#approval-arguments").query_one("Static").render().plain == (
            '{\n  "path": "/tmp/x"\n}')
        await pilot.press("escape")  # later: it stays in the inbox
        table = app.screen.table
        assert table.selected_agent == "d" and table.filter == ""
        for expected in ("c", "b", "a", "d"):
            await pilot.press("n")
            await pilot.pause()
            if isinstance(app.screen, ApprovalScreen):
                await pilot.press("escape")
            assert table.selected_agent == expected
        assert len(app.mirror.inbox) == 4


def test_an_agents_open_item_gives_way_only_to_the_same_or_graver_trouble():
    inbox = Inbox()
    inbox.open("a", "approval", "files.write_file {}", 1.0)
    inbox.open("a", "endpoint", "sim down", 2.0)  # its endpoint's health does not hide the approval
    assert inbox.items["a"].kind == "approval"
    inbox.open("a", "killed", "killed by operator", 3.0)
    assert inbox.items["a"].kind == "killed"
    assert [i.kind for i in inbox.take_new()] == ["killed"]  # the approval was replaced before it rang
    inbox.clear("a", "stall")
    assert "a" in inbox.items
    inbox.clear("a")
    assert not inbox.items


def test_the_alert_cannot_break_out_of_its_escape_sequences():
    alert = terminal_alert("cerevisor: a;b failed", "HTTP 500\x07\x1b]0;pwned\x1b\\")
    assert alert == ("\x07\x1b]9;cerevisor: a,b failed: HTTP 500 ]0;pwned \\\x07"
                     "\x1b]777;notify;cerevisor: a,b failed;HTTP 500 ]0;pwned \\\x07")


@pytest.mark.anyio
async def test_enter_in_the_inbox_goes_to_the_agent_and_acts(tmp_path):
    app, engine = run(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        trouble(engine)
        refresh(app)
        await pilot.press("i", "down", "enter")  # the second newest: c, its endpoint down
        await until(lambda: not isinstance(app.screen, InboxScreen))
        assert app.screen.table.selected_agent == "c"
        await pilot.press("i", "enter")  # the newest: d's tool call, whose prompt opens
        await until(lambda: isinstance(app.screen, ApprovalScreen))
        assert app.screen.request.agent == "d"


@pytest.mark.anyio
async def test_an_agent_the_operator_killed_is_no_news(tmp_path):
    app, engine = run(tmp_path)
    async with app.run_test():
        engine.emit(ev.AgentKilled(NOW - 1, "a", 1, "operator", "killed by operator", 3))
        engine.emit(ev.AgentFinished(NOW - 1, "a", "killed", "killed by operator"))
        refresh(app)  # a refresh rings then and there, if at all: nothing to wait for
        assert "a" not in app.mirror.inbox.items and not app.rung
        # run again (r), then killed by its watchdog: that is news
        emit_as_engine(engine, ev.AgentQueued(NOW, "a", 0))
        emit_as_engine(engine, ev.AgentStarted(NOW, "a", 2, 1, 1, "sim", 100.0, 60.0))
        engine.emit(ev.AgentKilled(NOW, "a", 2, "first_byte", "no first token after 100 s", 0))
        engine.emit(ev.AgentFinished(NOW, "a", "killed", "no first token after 100 s"))
        refresh(app)
        await until(lambda: len(app.rung) == 1)
        assert app.mirror.inbox.items["a"].kind == "killed"


@pytest.mark.anyio
async def test_a_wedged_server_puts_the_agents_it_killed_in_the_inbox_until_they_or_it_move_again(tmp_path):
    app, engine = run(tmp_path)
    async with app.run_test(size=(120, 30)):
        inbox = app.mirror.inbox
        reason = "server wedged: no progress on any request for 45 s"
        engine.emit(ev.ServerWedged(NOW - 5, "sim", "frozen", reason, ["a", "b", "c"]))
        for name in ("a", "b", "c"):
            engine.emit(ev.AgentStatus(NOW - 5, name, "wedged"))
            engine.emit(ev.AgentKilled(NOW - 5, name, 1, "wedge", reason, 0))  # a kill does not hide why
            engine.emit(ev.AgentRetrying(NOW - 5, name, 2, reason, 1.0))
        refresh(app)
        assert [(i.agent, i.kind, i.text) for i in inbox.newest_first()] == [
            (name, "wedged", f"sim: {reason}") for name in ("c", "b", "a")]
        assert app.rung and "a server wedged" in app.rung[0]
        engine.emit(ev.AgentStatus(NOW - 4, "a", "wedged"))  # its retry waits on the wedged server
        refresh(app)
        await until(lambda: app.screen.table.row_texts("a")[2] == "wedged")
        # a stall warning of its retried attempt does not hide the wedge; its first token does
        emit_as_engine(engine, ev.AgentStarted(NOW - 4, "a", 2, 1, 1, "sim", 100.0, 60.0))
        emit_as_engine(engine, ev.StallWarning(NOW - 3, "a", 2, "first_byte", 0.9, 10.0, NOW + 5))
        assert inbox.items["a"].kind == "wedged"
        emit_as_engine(engine, ev.FirstToken(NOW - 2, "a", 2, 1, 2.0))
        assert "a" not in inbox.items
        # the server moves again: the rest are taken out; an agent's end says more than the wedge
        engine.emit(ev.AgentFinished(NOW - 2, "c", "killed", reason))
        engine.emit(ev.ServerWedged(NOW - 1, "sim", "frozen", "sim moves again", over=True))
        assert [(i.agent, i.kind) for i in inbox.newest_first()] == [("c", "killed")]
