"""Tool calls in the console: the call in flight in the agents table and the stream pane, and the operator's
answer to a call that needs approval."""

from __future__ import annotations

import inspect

import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.engine import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.supervisor.client import RemoteControl
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.control import RunControl
from cerevisor_tui.ui.theme_files import load_themes
from tests.ui.conftest import sim_config

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
    engine.emit(ev.AgentStarted(NOW - 10, "a", 1, 1, 1, "sim", 60.0, 30.0))
    engine.emit(ev.FirstToken(NOW - 9, "a", 1, 1, 1.0))
    return app, engine


@pytest.mark.anyio
async def test_a_tool_call_in_flight_shows_its_name_time_and_deadline_then_its_result_on_a_line(tmp_path):
    app, engine = shown(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        engine.emit(ev.ToolCallStarted(NOW - 3.2, "a", 1, 1, "call-1", "time", "get_current_time",
                                       '{"timezone": "UTC"}', deadline=NOW + 26.8, warn_at=(0.5, 0.8)))
        app.screen.refresh_status()
        app.screen.flush_streams()
        await pilot.pause()
        table = app.screen.table
        cells = table.row_texts("a")
        assert cells[2] == "tool: get_curr… 3.2s"  # the status column widened to 20; the note names it whole
        assert cells[-2] == "tool 0:27"
        assert cells[-1] == 'time.get_current_time {"timezone": "UTC"}'
        pane = app.screen.stream_pane
        assert pane.border_subtitle == "tool time.get_current_time · 3.2s · deadline in 0:27"
        assert '⚙ time.get_current_time {"timezone": "UTC"}' in app.mirror.stream("a").text()

        engine.emit(ev.ToolCallFinished(NOW - 0.5, "a", "call-1", "time", "get_current_time", "ok",
                                        '{"timezone": "UTC", "datetime": "2026-12-01T06:00:00+00:00"}', 2.7))
        app.screen.refresh_status()
        await pilot.pause()
        assert table.row_texts("a")[2] == "prefill"
        assert app.mirror.stream("a").text().endswith(
            '  ↳ ok in 2.7 s: {"timezone": "UTC", "datetime": "2026-12-01T06:00:00+00:00"}\n')


@pytest.mark.anyio
async def test_a_tool_call_past_its_last_warning_is_red_and_in_the_inbox(tmp_path):
    app, engine = shown(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        engine.emit(ev.ToolCallStarted(NOW - 9.5, "a", 1, 1, "call-1", "slow", "sleep", "{}", deadline=NOW + 0.5,
                                       warn_at=(0.5, 0.9)))
        engine.emit(ev.ToolCallWarning(NOW - 4.5, "a", "call-1", 0.5, 5.0))
        app.screen.refresh_status()
        assert "a" not in app.mirror.inbox.items
        engine.emit(ev.ToolCallWarning(NOW - 0.5, "a", "call-1", 0.9, 1.0))
        app.screen.refresh_status()
        await pilot.pause()
        row = app.screen.table.row("a")
        assert row is not None and row.level == "critical" and row.stall == "tool 0:01"
        assert app.mirror.inbox.items["a"].kind == "stall"
        assert app.screen.table.red == 1
        engine.emit(ev.ToolCallFinished(NOW, "a", "call-1", "slow", "sleep", "timeout", "no answer in 10 s", 10.0))
        assert "a" not in app.mirror.inbox.items


def test_an_attached_console_sends_every_command_the_in_process_one_does():
    for name, member in inspect.getmembers(RunControl, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = inspect.signature(member).parameters
        remote = inspect.signature(getattr(RemoteControl, name)).parameters
        assert list(ours) == list(remote), name
