"""A gateway's sessions in the console: each a row after the workflow's agents (gw in its wave column, the
request it is on, its harness and model mapping), the time its request queued in the gateway apart from model
silence, each request's new messages and answer in its stream, a killed request that leaves the session going,
the header's count of sessions and where the gateway serves, the empty run that says where to point a harness,
and the keys k, e and r on a session."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.state import Attempt
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.model import raw_shape
from cerevisor_tui.ui.screens.confirm import ConfirmScreen, DetachScreen
from cerevisor_tui.ui.widgets.agent_table import agent_row
from cerevisor_tui.ui.widgets.run_header import session_counts
from tests.conftest import until
from tests.ui.conftest import engine_of
from tests.ui.scenes import GATEWAY_NOTICE, GATEWAY_URL, NOW, T0, build, build_gateway


def opened(name: str, harness: str = "claude-code 2.0.14") -> ev.SessionOpened:
    return ev.SessionOpened(T0, name, "X-Session-ID", harness, "chat", "sim")


def started(name: str, attempt: int, t: float, **fields: Any) -> ev.AgentStarted:
    return ev.AgentStarted(t, name, attempt, attempt, 0, "sim", 60.0, 10.0, **fields)


def texts(mirror: RunMirror, name: str, now: float = NOW) -> dict[str, str]:
    """The session's row as the table draws it (its cells by column)."""
    row = agent_row(mirror.agents[name], (0.5, 0.8), "", now)
    return {"wave": row.wave, "status": row.status, "turn": row.turn, "stall": row.stall, "note": row.note}


# ---- the mirror -------------------------------------------------------------------------------------------
def test_a_session_is_a_row_with_its_request_number_and_its_queue_time_apart_from_its_stall_clock():
    m = RunMirror()
    m(ev.RunStarted(T0, "r", "parallel", 4, [], []))
    m(opened("s1"))
    assert m.agents["s1"].session is not None and m.sessions == [m.agents["s1"]] and m.workflow_agents == []
    m(ev.MessageRecorded(T0, "s1", 1, 1, "user", "hi", raw={"role": "user", "content": "hi"}))
    m(ev.AgentStatus(T0, "s1", "queued"))
    m(ev.AgentQueued(T0, "s1", 0))
    assert texts(m, "s1", T0 + 3) == {"wave": "gw", "status": "queued", "turn": "req -", "stall": "",
                                      "note": "waiting for a slot 0:03"}
    # sent after 2.3 s in the gateway's queue: the first-byte clock runs from the sending, not from the arrival
    m(started("s1", 1, T0 + 2.3, queued_s=2.3, model_asked="claude-sonnet-4", model_sent="qwen3-coder"))
    m(ev.AgentStatus(T0 + 2.3, "s1", "prefill"))
    a = m.agents["s1"]
    assert a.queued_s == 2.3 and a.model_mapping == "claude-sonnet-4 → qwen3-coder"
    assert a.attempt is not None and a.attempt.deadline_at == T0 + 2.3 + 60.0
    row = texts(m, "s1", T0 + 3.3)
    assert row["turn"] == "req 1" and row["stall"] == "first 0:59" and "/0" not in row["turn"]
    m(ev.FirstToken(T0 + 3, "s1", 1, 1, 0.7))
    m(ev.TokenDelta(T0 + 3, "s1", 1, "Hello "))
    m(ev.TokenDelta(T0 + 3.5, "s1", 1, "there"))
    m(ev.TurnFinished(T0 + 4, "s1", 1, 1, 0, 12, 2, "stop", 0.7, 1.7))
    m(ev.MessageRecorded(T0 + 4, "s1", 1, 1, "assistant", "Hello there"))
    m(ev.AgentStatus(T0 + 4, "s1", "idle"))
    row = texts(m, "s1", T0 + 5)
    assert row["status"] == "idle" and row["turn"] == "req 1" and row["stall"] == ""  # no clock between requests
    text = m.streams["s1"].text()
    assert "▌ user · request 1\nhi\n" in text
    assert "▌ assistant · request 1 · queued 2.3 s · claude-sonnet-4 → qwen3-coder\nHello there" in text
    assert text.count("Hello there") == 1  # streamed, not written again whole
    m(ev.AgentStatus(T0 + 70, "s1", "released"))
    assert texts(m, "s1")["status"] == "released"


def test_each_request_shows_its_new_messages_whatever_their_role_and_shape():
    m = RunMirror()
    m(opened("s1"))
    m(ev.MessageRecorded(T0, "s1", 2, 2, "tool", "file text", raw={"role": "tool", "content": "file text"}))
    blocks = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}
    m(ev.MessageRecorded(T0, "s1", 2, 2, "user", "", raw=blocks))
    text = m.streams["s1"].text()
    assert "▌ tool · request 2\nfile text\n" in text and "▌ user · request 2\n[tool_result]\n" in text
    assert raw_shape({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]}) \
        == "[tool call: read_file]"
    assert raw_shape({"type": "function_call", "name": "shell", "arguments": "{}"}) == "[function_call: shell]"
    assert raw_shape({"role": "user", "content": "plain"}) == ""


def test_a_killed_request_says_why_and_the_session_goes_on():
    m = RunMirror()
    m(opened("s1"))
    m(started("s1", 1, T0))
    m(ev.TokenDelta(T0 + 1, "s1", 1, "partial "))
    m(ev.AgentKilled(T0 + 11, "s1", 1, "idle", "no output for 10 s after 1 tokens", 1))
    m(ev.AgentStatus(T0 + 11, "s1", "idle"))
    row = agent_row(m.agents["s1"], (), "", T0 + 12)
    assert row.status == "idle" and row.note == "request 1 killed: no output for 10 s after 1 tokens"
    assert row.note_role == "error" and row.stall == ""
    assert "✖ request 1 killed: no output for 10 s after 1 tokens (the session goes on" in m.streams["s1"].text()
    notice = m.take_notices()[-1]
    assert notice.title == "Request killed" and "The session goes on" in notice.message
    assert not m.inbox.items  # the harness decides what follows: nothing for the operator to do
    m(started("s1", 2, T0 + 20))  # its harness sent the next request: the kill is history
    assert "killed" not in agent_row(m.agents["s1"], (), "", T0 + 21).note
    # the run ends: the session ends with it (completed), shown as ended, never as failed or done
    m(ev.TurnFinished(T0 + 22, "s1", 2, 2, 0, 1, 1, "stop", 0.5, 2.0))
    m(ev.AgentStatus(T0 + 30, "s1", "completed"))
    m(ev.AgentFinished(T0 + 30, "s1", "completed", "session ended with the run"))
    assert agent_row(m.agents["s1"], (), "", T0 + 31).status == "ended"
    assert session_counts([a.status for a in m.sessions]) == (("sessions", 1), ("ended", 1))
    assert m.streams["s1"].text().endswith("■ session ended with the run\n")


def test_two_requests_in_flight_each_keep_their_tokens_and_clock():
    """A harness's side request (a small model's title, a sub-agent) runs beside its main one in one session."""
    m = RunMirror()
    m(opened("s1"))
    m(started("s1", 1, T0))
    m(ev.FirstToken(T0 + 1, "s1", 1, 1, 1.0))
    m(ev.TokenDelta(T0 + 1, "s1", 1, "main "))
    m(started("s1", 2, T0 + 2, model_asked="claude-haiku-4", model_sent="qwen3-coder"))
    m(ev.TokenDelta(T0 + 3, "s1", 1, "still main "))  # the first request's text, while the second is newest
    m(ev.FirstToken(T0 + 4, "s1", 2, 2, 2.0))
    m(ev.TokenDelta(T0 + 4, "s1", 2, "side "))
    a = m.agents["s1"]
    assert a.in_flight[1].tokens == 2 and a.in_flight[2].tokens == 1 and a.tokens == 3
    # one row: it describes its oldest request (the main turn: its clock, its mapping), the count shows the other
    assert a.attempt is a.in_flight[1] and a.model_mapping == ""
    m(ev.AgentStatus(T0 + 4, "s1", "streaming"))
    row = agent_row(a, (), "", T0 + 5)
    assert row.status == "streaming ×2" and row.turn == "req 1"
    m(ev.TurnFinished(T0 + 5, "s1", 2, 2, 0, 5, 1, "stop", 2.0, 3.0))  # the side request ends first
    assert a.attempt is a.in_flight[1] and a.attempt.last_alive == T0 + 3  # the main one runs on, its clock kept
    m(ev.TokenDelta(T0 + 6, "s1", 1, "end"))
    text = m.streams["s1"].text()
    assert "▌ assistant · request 1 (continued)\nstill main " in text
    assert text.rstrip().endswith("▌ assistant · request 1 (continued)\nend")
    m(ev.TurnFinished(T0 + 7, "s1", 1, 1, 0, 5, 3, "stop", 1.0, 7.0))
    assert a.attempt is None and not a.in_flight


def test_a_session_opened_before_the_run_said_who_runs_stays_and_the_gateway_notice_says_where():
    m = RunMirror()
    m(opened("early"))
    m(ev.RunStarted(T0, "r", "parallel", 4, [["a0"]], [], agents={"a0": ev.AgentPlan("sim", 0)}))
    assert list(m.agents) == ["a0", "early"]  # the workflow's agents first, then the sessions
    m(ev.RunNotice(T0, GATEWAY_NOTICE, "information", "Gateway"))
    assert m.serves_gateway and m.gateway == GATEWAY_NOTICE and not m.gateway_url  # the URL comes typed, not parsed
    m(ev.GatewayServing(T0, GATEWAY_URL, ["sim-model"], {"claude-*": "sim-model"}))
    assert m.gateway_url == GATEWAY_URL


# ---- on screen --------------------------------------------------------------------------------------------
async def screen_lines(app, pilot) -> list[str]:
    app.screen.refresh_status()
    await pilot.pause()
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.mark.anyio
async def test_sessions_on_screen_rows_header_and_the_selected_sessions_stream():
    app = build_gateway()
    async with app.run_test(size=(140, 36)) as pilot:
        lines = await screen_lines(app, pilot)
        screen = "\n".join(lines)
        assert f"gateway {GATEWAY_URL}" in lines[0] and "run 0:12" in lines[0]
        assert "4 sessions: 1 busy 1 idle 1 queued 1 released" in lines[1]
        assert "wave -/0" not in lines[1] and "0 running" not in lines[1]  # a run of sessions alone: no workflow
        assert "1 sessions" in lines[2] and "/0" not in screen
        table = app.screen.table
        main = table.row_texts("claude-main")
        assert main[:4] == ["claude-main", "gw", "streaming", "req 2"] and main[7] == "idle 0:10"
        assert main[8] == "claude-code 2.0.14 · claude-sonnet-4 → sim-model"
        codex = table.row_texts("codex-7f3a")
        assert codex[2:4] == ["idle", "req 1"] and codex[7] == "" and codex[8] == "request 1 killed: killed by operator"
        assert table.row_texts("aider")[2] == "released" and table.row_texts("aider")[8] == "aider"
        # a row named by a generated id (a fingerprint here) reads as its harness, a short id and what it is about
        late = table.row_texts("ses-9c1e")
        assert late[0] == "openai-python 9c1e"
        assert late[8] == 'waiting for a slot 0:03 · "Summarise the diff." · in …/work/shop · openai-python 1.99.0'

        pane = app.screen.stream_pane
        assert pane.border_title == "2 stream · claude-main · claude-code 2.0.14"
        assert pane.border_subtitle == "streaming · request 2 · queued 0.0 s · claude-sonnet-4 → sim-model"
        text = pane.view.text
        assert "▌ user · request 1\nRead README.md" in text and "▌ tool · request 2\nREADME.md: run" in text
        assert "▌ user · request 2\nNow sort them" in text
        await pilot.press("down")
        assert pane.border_subtitle == "idle · request 1 · queued 2.3 s · gpt-5-codex → sim-model"
        assert "✖ request 1 killed: killed by operator" in pane.view.text
        await pilot.press("down", "down")
        assert pane.border_subtitle == "queued · no request yet · next waiting for a slot 0:03"


@pytest.mark.anyio
async def test_a_gateway_without_sessions_says_where_to_point_a_harness():
    app = build_gateway(sessions=False)
    async with app.run_test(size=(80, 24)) as pilot:
        lines = await screen_lines(app, pilot)
        assert f"gateway {GATEWAY_URL}" in lines[0]
        assert "0 sessions" in lines[1] and "wave" not in lines[1]
        screen = "\n".join(lines)
        assert "Waiting for sessions: point a harness's base URL at" in screen
        stream = app.screen.stream_pane.view.text
        assert GATEWAY_NOTICE in stream and "becomes a row here" in stream

        engine = engine_of(app)  # the first session comes: its row takes the hint's place, its stream the notice's
        engine.sessions.open("s1", source="X-Session-ID", harness="claude-code 2.0.14", api="chat", endpoint="sim")
        await until(lambda: app.screen.table.row_count == 1 and app.screen.stream_pane.agent == "s1")
        lines = await screen_lines(app, pilot)
        assert "Waiting for sessions" not in "\n".join(lines) and "1 session " in lines[1]
        assert "gateway session from claude-code 2.0.14" in app.screen.stream_pane.view.text


@pytest.mark.anyio
async def test_a_new_session_adds_its_row_without_moving_the_operators_cursor():
    app = build_gateway()
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("down", "down")
        table, pane = app.screen.table, app.screen.stream_pane
        assert table.selected_agent == "aider" and pane.agent == "aider"
        engine_of(app).sessions.open("late", source="path", harness="", api="messages", endpoint="sim")
        await until(lambda: table.row_count == 5)
        app.screen.refresh_status()
        await pilot.pause()
        assert table.selected_agent == "aider" and pane.agent == "aider" and table.names[-1] == "late"
        assert "Add type hints to utils.py" in pane.view.text


class Refusing:
    """A control whose run refuses every command (as a run refuses what it does not do)."""

    def __init__(self) -> None:
        self.sent: list[cmd.Command] = []

    def send(self, command: cmd.Command, then: Any = None) -> None:
        self.sent.append(command)
        then(cmd.Answer(error=f"refused: {type(command).__name__}"))


def notified(app) -> list[str]:
    return [n.message for n in app._notifications]


@pytest.mark.anyio
async def test_keys_on_a_session_kill_its_request_extend_it_and_r_says_the_harness_retries():
    app = build_gateway()
    engine = engine_of(app)
    async with app.run_test(size=(120, 30)) as pilot:
        # r: the engine's answer, as it words it
        await pilot.press("r")
        await until(lambda: any("retried by its harness, never by the gateway" in m for m in notified(app)))

        # k on the streaming request: asks, then ends the request in flight (the session stays)
        session = engine.sessions.by_name["claude-main"]
        att = Attempt(2, 2, sent_at=T0 + 6, last_alive=T0 + 6)
        session.in_flight[2] = att
        await pilot.press("k")
        await until(lambda: isinstance(app.screen, ConfirmScreen))
        question = str(app.screen.query_one("#dialog-question").render())
        assert "End claude-main's request 2?" in question and "the session goes on" in question
        await pilot.press("y")
        await until(lambda: att.kill_reason == "killed by operator")

        # e extends it (the engine's watchdog takes it); with nothing in flight, the console says so
        await pilot.press("down")  # codex-7f3a: idle, its request killed
        await pilot.press("k")
        await until(lambda: any("codex-7f3a is idle: no request in flight to kill" in m and "l gives it back now" in m
                                for m in notified(app)))
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("e")
        await until(lambda: any("codex-7f3a has no request in flight to extend" in m for m in notified(app)))
        await pilot.press("down", "down")  # ses-9c1e: its request waits for a slot
        await pilot.press("k")
        await until(lambda: any("its next request waits for a slot" in m for m in notified(app)))

        # a run that refuses (its ValueError: in-process, or told back over the socket) is said, never a crash
        app.control = Refusing()
        await pilot.press("r")
        await until(lambda: any("refused: Retry" in m for m in notified(app)))
        await pilot.press("home", "e")  # claude-main: its request in flight
        await until(lambda: any("refused: Extend" in m for m in notified(app)))


def offers_release(app) -> bool:
    """The main screen's keys now (what its footer draws) include l, Release."""
    return any(b.binding.action == "release" for b in app.screen.active_bindings.values())


@pytest.mark.anyio
async def test_l_releases_an_idle_sessions_slot_after_asking_and_only_a_sessions_row_offers_it():
    app = build_gateway()
    engine = engine_of(app)
    async with app.run_test(size=(140, 30)) as pilot:
        await until(lambda: offers_release(app))  # a session's row: the footer names l
        # l on a request in flight: its slot is its request's
        await pilot.press("l")
        await until(lambda: any("claude-main has 1 request(s) in flight: it gives its slot back once idle" in m
                                for m in notified(app)))
        assert not isinstance(app.screen, ConfirmScreen)
        # l on the idle one: asks, then the run gives its slot back (its holder ends, as release_after_s would)
        await pilot.press("down")
        holder = engine.sessions.by_name["codex-7f3a"].holder = anyio.CancelScope()
        await pilot.press("l")
        await until(lambda: isinstance(app.screen, ConfirmScreen))
        question = str(app.screen.query_one("#dialog-question").render())
        assert "Give codex-7f3a's slot back now? The next session waiting runs" in question
        await pilot.press("y")
        await until(lambda: holder.cancel_called and any("codex-7f3a gave its slot back" in m for m in notified(app)))
        # one that holds none says so, and asks nothing
        await pilot.press("down")
        await pilot.press("l")
        await until(lambda: any("aider is released: it holds no slot" in m for m in notified(app)))
        assert not isinstance(app.screen, ConfirmScreen)


@pytest.mark.anyio
async def test_a_workflow_runs_footer_has_no_release_key():
    app = build("mid_run")
    async with app.run_test(size=(140, 30)) as pilot:
        await pilot.pause()
        assert not offers_release(app) and any(b.binding.action == "kill" for b in app.screen.active_bindings.values())
        await pilot.press("l")  # not a session: the key does nothing there
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen) and not notified(app)


@pytest.mark.anyio
async def test_leaving_an_attached_gateway_run_asks_even_with_no_session_open():
    app = build_gateway(sessions=False)
    app.attached = True

    async def serving() -> int:  # the run goes on elsewhere, as an attached console's follows it
        await asyncio.Event().wait()
        return 0

    app._run = serving
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("q")
        await until(lambda: isinstance(app.screen, DetachScreen))
        question = str(app.screen.query_one("#dialog-question").render())
        assert f"The gateway serves on {GATEWAY_URL}: 0 session(s) open" in question
        await pilot.press("escape")
        await until(lambda: not isinstance(app.screen, DetachScreen))
