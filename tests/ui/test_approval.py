"""Tool calls in the console: the call in flight in the agents table and the stream pane, and the operator's
answer to a call that needs approval."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.screens.approval import ApprovalScreen
from cerevisor_tui.ui.theme_files import load_themes
from tests.conftest import until
from tests.ui.conftest import FAST_SIM, EventLog, console, emit_as_engine, engine_of, kind, sim_config

T0 = 1000.0
NOW = 1100.0


def shown(tmp_path) -> tuple[CerevisorApp, Engine]:
    """One agent on the simulator, shown, not run: the test plays the engine's events at fixed times."""
    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "what time is it?"}])
    engine = Engine(config, run_id="tools", run_dir=str(tmp_path / "runs" / "tools"))
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    engine.emit(ev.WaveStarted(T0, 0, ["a"]))
    emit_as_engine(engine, ev.AgentStarted(NOW - 10, "a", 1, 1, 1, "sim", 60.0, 30.0))
    emit_as_engine(engine, ev.FirstToken(NOW - 9, "a", 1, 1, 1.0))
    return app, engine


@pytest.mark.anyio
async def test_a_tool_call_in_flight_shows_its_name_time_and_deadline_then_its_result_on_a_line(tmp_path):
    app, engine = shown(tmp_path)
    async with app.run_test(size=(120, 30)):
        emit_as_engine(engine, ev.ToolCallStarted(NOW - 3.2, "a", 1, 1, "call-1", "time", "get_current_time",
                                       '{"timezone": "UTC"}', deadline=NOW + 26.8, warn_at=(0.5, 0.8)))
        app.screen.refresh_status()
        app.screen.flush_streams()
        table = app.screen.table
        await until(lambda: table.row_texts("a")[2].startswith("tool"))
        cells = table.row_texts("a")
        assert cells[2] == "tool: get_curr… 3.2s"  # the status column widened to 20; the note names it whole
        assert cells[-2] == "tool 0:27"
        assert cells[-1] == 'time.get_current_time {"timezone": "UTC"}'
        pane = app.screen.stream_pane
        assert pane.border_subtitle == "tool time.get_current_time · 3.2s · deadline in 0:27"
        assert '⚙ time.get_current_time {"timezone": "UTC"}' in app.mirror.stream("a").text()

        emit_as_engine(engine, ev.ToolCallFinished(NOW - 0.5, "a", "call-1", "time", "get_current_time", "ok",
                                        '{"timezone": "UTC", "datetime": "2026-12-01T06:00:00+00:00"}', 2.7))
        app.screen.refresh_status()
        await until(lambda: table.row_texts("a")[2] == "prefill")
        assert app.mirror.stream("a").text().endswith(
            '  ↳ ok in 2.7 s: {"timezone": "UTC", "datetime": "2026-12-01T06:00:00+00:00"}\n')


@pytest.mark.anyio
async def test_a_tool_call_past_its_last_warning_is_red_and_in_the_inbox(tmp_path):
    app, engine = shown(tmp_path)
    async with app.run_test(size=(120, 30)):
        emit_as_engine(engine, ev.ToolCallStarted(NOW - 9.5, "a", 1, 1, "call-1", "slow", "sleep", "{}", deadline=NOW + 0.5,
                                       warn_at=(0.5, 0.9)))
        engine.emit(ev.ToolCallWarning(NOW - 4.5, "a", "call-1", 0.5, 5.0))
        app.screen.refresh_status()
        assert "a" not in app.mirror.inbox.items
        engine.emit(ev.ToolCallWarning(NOW - 0.5, "a", "call-1", 0.9, 1.0))
        app.screen.refresh_status()

        def critical() -> bool:
            row = app.screen.table.row("a")
            assert row is not None and row.level == "critical" and row.stall == "tool 0:01"
            return True

        await until(critical)
        assert app.mirror.inbox.items["a"].kind == "stall"
        assert app.screen.table.red == 1
        emit_as_engine(engine, ev.ToolCallFinished(NOW, "a", "call-1", "slow", "sleep", "timeout", "no answer in 10 s", 10.0))
        assert "a" not in app.mirror.inbox.items


FAKE_MCP = str(Path(__file__).parents[1] / "fixtures" / "mcp_fake.py")


def asking(tmp_path, *, tool_steps: int, tool: str = "echo", arguments: dict | None = None,
           server: dict | None = None) -> CerevisorApp:
    """The console over a real run: one agent whose model (the simulator) calls the fake MCP server's `tool`
    (`echo`, which its server's rules `ask` about) `tool_steps` times."""
    return console(validate({
        "run": {"run_dir": str(tmp_path / "runs"), "metrics_interval_s": 0.2},
        "stall": {"idle_timeout_s": 30.0, "extend_s": 100.0},
        "endpoints": [{"name": "sim", "kind": "simulated",
                       "sim": {**FAST_SIM, "tool_steps": tool_steps,
                               "tool_args": {tool: arguments or {"text": "hello"}}}}],
        "mcp_servers": [{"name": "fake", "command": sys.executable, "args": [FAKE_MCP], "ask": ["echo"],
                         **(server or {})}],
        "agents": [{"name": "a", "prompt": "use the tool", "tools": ["fake"], "max_tokens": 8, "retries": 0}],
    }))


async def answer(pilot, log: EventLog, key: str, number: int) -> None:
    """Wait for the run's `number`th approval request, open the prompt with y and answer with `key`."""
    await log.wait(lambda e: e.kind == "ApprovalRequested" and len(log.of("ApprovalRequested")) >= number)
    requested = log.of("ApprovalRequested")[number - 1]
    app = pilot.app
    await until(lambda: app.mirror.agents["a"].status == "approval")
    assert app.mirror.inbox.items["a"].kind == "approval"
    await pilot.press("y")
    await until(lambda: isinstance(app.screen, ApprovalScreen))
    assert app.screen.request.call_id == requested.call_id
    await pilot.press(key)
    await log.wait(kind("ApprovalDecided", "a", call_id=requested.call_id))


@pytest.mark.anyio
async def test_an_ask_call_approved_once_runs_and_the_next_call_asks_again(tmp_path):
    app = asking(tmp_path, tool_steps=2)
    log = EventLog(engine_of(app))
    async with app.run_test(size=(120, 30)) as pilot:
        await answer(pilot, log, "o", 1)
        await answer(pilot, log, "o", 2)
        await log.wait(kind("AgentFinished", "a"))
    decided = log.of("ApprovalDecided")
    assert [(e.decision, e.by) for e in decided] == [("once", "operator"), ("once", "operator")]
    assert [e.outcome for e in log.of("ToolCallFinished")] == ["ok", "ok"]
    assert log.of("AgentFinished")[0].status == "completed"
    assert "echo: hello" in log.of("ToolCallFinished")[0].result
    text = app.mirror.stream("a").text()
    assert text.count("fake.echo approved once by operator") == 2 and "↳ ok in" in text
    assert len(app.mirror.inbox) == 0


@pytest.mark.anyio
async def test_an_ask_call_approved_for_the_run_is_not_asked_about_again(tmp_path):
    app = asking(tmp_path, tool_steps=2)
    log = EventLog(engine_of(app))
    async with app.run_test(size=(120, 30)) as pilot:
        await answer(pilot, log, "a", 1)
        await log.wait(kind("AgentFinished", "a"))
    assert [(e.decision, e.by) for e in log.of("ApprovalDecided")] == [("run", "operator")]
    assert len(log.of("ApprovalRequested")) == 1
    assert [e.outcome for e in log.of("ToolCallFinished")] == ["ok", "ok"]
    assert log.of("AgentFinished")[0].status == "completed"


@pytest.mark.anyio
async def test_an_ask_call_denied_is_not_run_and_the_model_is_told(tmp_path):
    app = asking(tmp_path, tool_steps=1)
    log = EventLog(engine_of(app))
    async with app.run_test(size=(120, 30)) as pilot:
        await answer(pilot, log, "d", 1)
        await log.wait(kind("AgentFinished", "a"))
        await until(lambda: "fake.echo denied by operator" in app.mirror.stream("a").text())
    assert [(e.decision, e.by) for e in log.of("ApprovalDecided")] == [("deny", "operator")]
    finished = log.of("ToolCallFinished")
    assert [e.outcome for e in finished] == ["denied"] and "denied by the operator" in finished[0].result
    assert not log.of("ToolCallStarted")
    assert log.of("AgentFinished")[0].status == "completed"  # the model answered, told of the denial
    assert "fake.echo denied by operator" in app.mirror.stream("a").text()
    assert len(app.mirror.inbox) == 0


@pytest.mark.anyio
async def test_e_and_k_act_on_the_running_tool_call(tmp_path):
    app = asking(tmp_path, tool_steps=1, tool="hang", arguments={"seconds": 60},
                 server={"allow": ["hang"], "tool_timeout_s": 30.0})
    log = EventLog(engine_of(app))
    async with app.run_test(size=(120, 30)) as pilot:
        started = await log.wait(kind("ToolCallStarted", "a"))
        await until(lambda: app.mirror.agents["a"].status == "tool")
        await pilot.press("e")
        extended = await log.wait(kind("StallExtended", "a", deadline="tool"))
        assert extended.deadline_at == pytest.approx(started.deadline + 100.0)
        app.screen.refresh_status()

        def counts_to_the_new_deadline() -> bool:
            call = app.mirror.agents["a"].tool
            assert call is not None and call.deadline == extended.deadline_at  # the countdown counts to the new one
            assert app.screen.table.row_texts("a")[-2].startswith("tool 2:")
            return True

        await until(counts_to_the_new_deadline)
        await pilot.press("k")
        await pilot.pause()
        await pilot.press("y")  # the kill's confirmation
        finished = await log.wait(kind("ToolCallFinished", "a"))
        assert finished.outcome == "killed"
        await log.wait(kind("AgentFinished", "a"))
    assert log.of("AgentFinished")[0].status == "completed"  # the model was told and answered
    assert "↳ killed in" in app.mirror.stream("a").text()


def tools_scene() -> CerevisorApp:
    """Three agents at NOW: one in a tool call 3.2 s in, one whose call waits for approval, one waiting for
    its first token; fixed paths and a frozen clock, for the snapshots."""
    agents = ["researcher", "planner", "skeptic"]
    config = validate({
        "stall": {"first_byte_timeout_s": 60.0, "idle_timeout_s": 30.0},
        "endpoints": [{"name": "sim", "kind": "simulated", "sim": FAST_SIM}],
        "agents": [{"name": name, "prompt": "go"} for name in agents],
    })
    engine = Engine(config, run_id="20260101-120000-tools", run_dir="/runs/20260101-120000-tools")
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW,
                       themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    engine.emit(ev.WaveStarted(T0, 0, agents))
    for name in agents:
        emit_as_engine(engine, ev.AgentStarted(NOW - 10, name, 1, 1, 1, "sim", 60.0, 30.0))
    emit_as_engine(engine, ev.FirstToken(NOW - 9, "researcher", 1, 1, 1.0))
    emit_as_engine(engine, ev.ToolCallStarted(NOW - 3.2, "researcher", 1, 1, "c1", "time", "get_current_time",
                                   '{"timezone": "Europe/Paris"}', NOW + 26.8, (0.5, 0.8)))
    emit_as_engine(engine, ev.ApprovalRequested(NOW - 1, "planner", "c2", "files", "write_file",
                                     '{"path": "/tmp/report.md", "content": "# Report\\nAll good"}'))
    return app


def test_snapshot_a_tool_call_and_an_approval_at_80x24(snap_compare):
    """The status column widened (tool: NAME 3.2s, needs approval), the countdown still on screen, inbox 1 in the
    header, the stream pane's corner with the call in flight."""
    assert snap_compare(tools_scene(), terminal_size=(80, 24))


def test_snapshot_the_approval_prompt_at_80x24(snap_compare):
    assert snap_compare(tools_scene(), terminal_size=(80, 24), press=["n"])
