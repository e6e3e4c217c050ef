"""Resuming the last run from the console: the run directory says which config it ran, the console offers
the last incomplete run of the same config, and resuming sends requests only for what did not complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.command import CommandPalette

from cerevisor_tui.commands import console as console_command
from cerevisor_tui.config import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.journal import Journal
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.sim import SimServer
from cerevisor_tui.ui.screens.confirm import ConfirmScreen
from cerevisor_tui.ui.theme_files import load_themes
from tests.conftest import until
from tests.ui.conftest import FAST_SIM, EventLog, engine_of, kind, palette_offers

OLD_RUN = "20250101-000000-0ld1"


def workflow(path: Path, base_url: str, runs_dir: Path) -> Path:
    path.write_text(f"""
[run]
mode = "parallel"
max_concurrency = 2
run_dir = "{runs_dir}"
metrics_interval_s = 0.2

[[endpoints]]
name = "box"
kind = "local"
base_url = "{base_url}"

[[agents]]
name = "a"
prompt = "first task"
max_tokens = 40

[[agents]]
name = "b"
prompt = "second task, after a said: {{{{ a.output }}}}"
depends_on = ["a"]
max_tokens = 4
""")
    return path


def earlier_run(runs_dir: Path, config_file: Path) -> Path:
    """The journal of a console run of `config_file` in which a completed and b failed."""
    run_dir = runs_dir / OLD_RUN
    journal = Journal(run_dir, Report())
    journal.open()
    for event in (
        ev.RunStarted(1.0, OLD_RUN, "parallel", 2, [["a"], ["b"]], [], str(run_dir)),
        ev.WaveStarted(1.0, 0, ["a"]),
        ev.AgentQueued(1.0, "a", 0),
        ev.AgentStarted(1.1, "a", 1, 1, 1, "box", 1800.0, 600.0),
        ev.TurnFinished(2.0, "a", 1, 1, 1, 12, 40, "stop", 0.1, 0.9),
        ev.AgentFinished(2.0, "a", "completed", "", "the answer of a"),
        ev.WaveFinished(2.0, 0, {"a": "completed"}),
        ev.WaveStarted(2.0, 1, ["b"]),
        ev.AgentQueued(2.0, "b", 1),
        ev.AgentStarted(2.1, "b", 1, 1, 1, "box", 1800.0, 600.0),
        ev.AgentFinished(3.0, "b", "failed", "HTTP 500 from box"),
        ev.WaveFinished(3.0, 1, {"b": "failed"}),
        ev.RunFinished(3.0, OLD_RUN, 1, ev.RunTotals(2, 1, 1, 0, 0, 0, 40, 2.0, 20.0, 1)),
    ):
        journal(event)
    journal.close()
    (run_dir / console_command.RUN_FILE).write_text(json.dumps(
        {"run_id": OLD_RUN, "config": str(config_file.resolve()), "started_at": "2025-01-01T00:00:00+00:00"}))
    return run_dir


@pytest.mark.anyio
async def test_console_offers_the_incomplete_last_run_and_resuming_sends_only_the_failed_agent(tmp_path):
    runs_dir = tmp_path / "runs"
    async with SimServer(SimSettings(**{**FAST_SIM, "tokens_per_s": 20.0})) as srv:  # an answer streams for 2 s
        config_file = workflow(tmp_path / "team.toml", srv.base_url, runs_dir)
        old_dir = earlier_run(runs_dir, config_file)

        setup = console_command.resolve_config(str(config_file))
        runs = console_command.ConsoleRuns(setup.config, runs_dir, console_command.config_key(setup))
        last = console_command.incomplete_last_run(runs_dir, runs.config_key, setup.config)
        assert last is not None and last.run_id == OLD_RUN and set(last.completed) == {"a"}
        fresh = runs.open_fresh()
        fresh_log = EventLog(fresh)
        app = console_command.build_app(setup, runs, fresh, last, themes=load_themes(None))
        try:
            async with app.run_test(size=(100, 30)) as pilot:
                await fresh_log.wait(kind("FirstToken", "a"))  # the fresh run has sent its first request
                await pilot.press("p")  # and holds b, so it is still going when we resume
                assert any(n.message.startswith(f"Last run {OLD_RUN} did not complete (1 of 2 agents done)")
                           and "Resume last run" in n.message for n in app._notifications)
                asked_before = dict(srv.state.requests_by_agent)

                await pilot.press("ctrl+p")
                assert isinstance(app.screen, CommandPalette)
                await pilot.press(*"resume last")
                await until(lambda: palette_offers(app, "Resume last run"))
                await pilot.press("enter")
                await until(lambda: isinstance(app.screen, ConfirmScreen))  # this run is still going: ask
                await pilot.press("y")
                assert not fresh_log.of("AgentStarted", "b")  # b was held: all the fresh run sent is a

                await until(lambda: engine_of(app) is not fresh)
                resumed = engine_of(app)
                assert resumed.run_id == OLD_RUN and resumed.run_dir == str(old_dir)
                await until(lambda: app.model.finished is not None)
                assert app.model.finished.exit_code == 0
                assert {n: st.status for n, st in resumed.agents.items()} == {"a": "completed", "b": "completed"}
                assert fresh.life.stopping and fresh.agents["b"].status == "cancelled"  # the fresh run was stopped
                asked_after = dict(srv.state.requests_by_agent)
                app.screen.refresh_status()
                assert app.screen.table.row_texts("b")[2] == "done"  # the console shows the resumed run
                assert app.screen.table.row_texts("a")[-1] == "answer reused from the earlier run"
                assert app.resume_offer is None  # offered once
        finally:
            runs.close()
        # a was answered in the earlier run and never asked again; b was asked once, with a's answer
        assert asked_after.get("a", 0) == asked_before.get("a", 0)
        assert asked_after["b"] == asked_before.get("b", 0) + 1
        last_body = next(r for r in reversed(srv.state.requests) if "second task" in json.dumps(r))
        assert "the answer of a" in json.dumps(last_body)

    # the same journal goes on; the report has both agents completed; and nothing is left to resume
    kinds = [json.loads(line)["event"] for line in (old_dir / "events.jsonl").read_text().splitlines()]
    assert kinds.count("RunStarted") == 2
    report = json.loads((old_dir / "report.json").read_text())
    assert {a["name"]: a["status"] for a in report["agents"]} == {"a": "completed", "b": "completed"}
    assert console_command.last_run_dir(runs_dir, runs.config_key) == old_dir  # resumed last
    assert console_command.incomplete_last_run(runs_dir, runs.config_key, setup.config) is None
