"""The app's side of a lost terminal: a failed write reported from Textual's output thread (or a signal the
console's terminal watch hands over) stops the run cleanly and exits with its code; a stop asked for before
the app is mounted is not lost."""

from __future__ import annotations

import threading

import pytest

from tests.ui.conftest import EventLog, console, engine_of, kind, sim_config

SLOW = {"tokens_per_s": 5.0}


def slow_app(tmp_path):
    return console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 400}], sim=SLOW))


@pytest.mark.anyio
async def test_a_failed_terminal_write_from_another_thread_stops_the_run_and_exits_129(tmp_path):
    app = slow_app(tmp_path)
    log = EventLog(engine_of(app))
    async with app.run_test():
        await log.wait(kind("FirstToken", "a"))
        thread = threading.Thread(target=app.terminal_lost, args=("cannot write to it: Input/output error",))
        thread.start()
        finished = await log.wait(kind("AgentFinished", "a"))
        await app.workers.wait_for_complete()
    assert finished.status == "cancelled" and finished.error.startswith("console lost its terminal (cannot write")
    assert app.return_code == 129


@pytest.mark.anyio
async def test_a_signal_before_the_app_is_mounted_still_ends_it_with_the_signals_code(tmp_path):
    app = slow_app(tmp_path)
    app.stop_from_thread(143, "console stopped by SIGTERM")  # the watch heard it while Textual was starting
    log = EventLog(engine_of(app))
    async with app.run_test():
        await app.workers.wait_for_complete()
    assert app.return_code == 143
    assert [e.status for e in log.of("AgentFinished")] == ["cancelled"] and log.of("RunFinished")
