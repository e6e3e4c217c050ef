"""The console's keys, driven with App.run_test against the real engine and the built-in simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from cerevisor_tui.ui.screens.confirm import ConfirmScreen
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.widgets.run_header import RunHeader
from tests.conftest import until
from tests.ui.conftest import EventLog, console, engine_of, kind, sim_config

SLOW = {"tokens_per_s": 8.0}  # a 400-token answer streams for ~50 s: long enough to act on


def header_text(app) -> str:
    return str(app.screen.query_one(RunHeader).render())


def row(app, agent: str) -> list[str]:
    table = app.screen.table
    return table.row_texts(agent)


async def select(pilot, agent: str) -> None:
    table = pilot.app.screen.table
    if agent not in table.names:  # its row comes at the next status refresh (4 Hz), late on a busy box: now
        pilot.app.screen.refresh_status()
    table.move_cursor(table.names.index(agent))
    await until(lambda: table.selected_agent == agent)


def slow_agent(tmp_path, stream_process: bool = False):
    """The console over one agent that streams slowly on the simulator: still running while keys are pressed."""
    return console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 400}], sim=SLOW),
                   stream_process=stream_process)


@pytest.mark.anyio
async def test_m_cycles_the_engines_mode_and_the_header_badge(tmp_path):
    app = slow_agent(tmp_path)
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:
        await log.wait(kind("RunStarted"))
        assert "PARALLEL" in header_text(app)
        await pilot.press("m")
        assert engine_of(app).scheduler.mode == "auto"
        assert "AUTO" in header_text(app) and "PARALLEL" not in header_text(app)
        await pilot.press("m")
        assert engine_of(app).scheduler.mode == "sequential"
        assert "SEQUENTIAL" in header_text(app)
        assert [e.mode for e in log.of("ModeChanged")] == ["auto", "sequential"]


@pytest.mark.anyio
async def test_plus_and_minus_move_the_engines_cap(tmp_path):
    app = slow_agent(tmp_path)
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:
        await log.wait(kind("RunStarted"))
        await pilot.press("plus")
        assert engine_of(app).scheduler.max_concurrency == 3
        assert "cap 3" in header_text(app)
        await pilot.press("minus", "minus", "minus", "minus")
        assert engine_of(app).scheduler.max_concurrency == 1  # never below one
        assert [e.max_concurrency for e in log.of("ConcurrencyChanged")] == [3, 2, 1, 1, 1]


@pytest.mark.anyio
async def test_k_asks_then_kills_the_selected_agent_and_r_runs_it_again(tmp_path, stream_process):
    agents = [{"name": "a", "prompt": "hi", "max_tokens": 400}, {"name": "b", "prompt": "hi", "max_tokens": 400}]
    app = console(sim_config(tmp_path, agents=agents, sim=SLOW), stream_process=stream_process)
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:
        await log.wait(kind("FirstToken", "b"))
        await select(pilot, "b")
        await pilot.press("k")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # declined: nothing happens
        assert isinstance(app.screen, MainScreen)
        assert engine_of(app).agents["b"].status == "streaming"

        await pilot.press("k")
        await pilot.press("y")
        killed = await log.wait(kind("AgentKilled", "b"))
        assert killed.deadline == "operator" and killed.reason == "killed by operator"
        await log.wait(kind("AgentFinished", "b"))
        assert engine_of(app).agents["b"].status == "killed"
        assert engine_of(app).agents["a"].status == "streaming"  # only the selected one
        app.screen.refresh_status()

        def shown_killed() -> bool:
            cells = row(app, "b")
            assert "killed" in cells and "killed by operator" in cells
            # the notification is a message: the app takes it in its own time
            assert any("b killed: killed by operator" in n.message for n in app._notifications)
            return True

        await until(shown_killed)

        await pilot.press("r")  # and run it again: its wave is still going
        again = await log.wait(kind("AgentStarted", "b", turn=1, attempt=2))
        assert again.attempt == 2 and engine_of(app).agents["b"].status in ("prefill", "streaming")


@pytest.mark.anyio
async def test_e_moves_the_stalled_agents_deadline_and_the_row_leaves_amber(tmp_path):
    # the simulator stops sending tokens after 3: the 8 s idle deadline starts counting down (amber at 0.4 s, the
    # deadline far enough past it for a loaded machine)
    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 50, "retries": 0}],
                        sim={"stall_after_tokens": 3}, stall={"idle_timeout_s": 8.0, "warn_at": [0.05, 0.9],
                                                              "extend_s": 30.0, "extend_when_server_busy": False})
    app = console(config)
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:
        warning = await log.wait(kind("StallWarning", "a"))
        att = engine_of(app).agents["a"].current
        assert att is not None and att.deadline_at == warning.deadline_at
        app.screen.refresh_status()
        assert app.screen.table.row("a").level == "warn"  # amber before the deadline
        before = att.deadline_at
        await pilot.press("e")
        extended = await log.wait(kind("StallExtended", "a"))
        assert extended.extend_s == 30.0 and extended.reason == "extended by operator"
        assert att.deadline_at == pytest.approx(before + 30.0)
        assert engine_of(app).agents["a"].status == "streaming"

        def left_amber() -> bool:  # once the console's mirror has taken the extension too
            app.screen.refresh_status()
            return app.screen.table.row("a").level == ""

        await until(left_amber, "the row out of amber")


@pytest.mark.anyio
async def test_p_holds_admissions_until_pressed_again(tmp_path):
    agents = [{"name": "a", "prompt": "hi", "max_tokens": 30}, {"name": "b", "prompt": "hi", "max_tokens": 5}]
    app = console(sim_config(tmp_path, agents=agents, run={"mode": "sequential"}, sim={"tokens_per_s": 40.0}))
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:
        await log.wait(kind("FirstToken", "a"))
        await pilot.press("p")
        assert engine_of(app).scheduler.paused
        assert "PAUSED" in header_text(app)
        await log.wait(kind("AgentFinished", "a"))
        scheduler = engine_of(app).scheduler
        # a's slot given back: unpaused, that release would have admitted b in the same call
        await until(lambda: scheduler.running == 0, "a's slot given back")
        assert scheduler.queued == 1
        assert engine_of(app).agents["b"].status == "queued"
        assert not log.of("AgentStarted", "b")
        await pilot.press("p")
        assert not engine_of(app).scheduler.paused
        await log.wait(kind("AgentStarted", "b"))


@pytest.mark.anyio
async def test_q_asks_while_agents_run_then_stops_the_engine_and_exits_with_the_runs_code(tmp_path, stream_process):
    app = slow_agent(tmp_path, stream_process)
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:
        await log.wait(kind("FirstToken", "a"))
        worker = engine_of(app).connections.worker
        assert (worker is not None) == stream_process
        pid = worker.pid if worker is not None else None
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen) and app.is_running
        await pilot.press("q", "y")
        finished = await log.wait(kind("RunFinished"))
        await until(lambda: app.return_code is not None)  # the console left with the run
    assert finished.exit_code == 1
    assert engine_of(app).agents["a"].status == "cancelled"
    assert app.return_code == 1  # the run's code: its agent did not complete (cancelled by the quit)
    if pid is not None:  # the stream worker ended with the run, and was reaped: not left behind
        assert worker.pid is None and not Path(f"/proc/{pid}").exists()
