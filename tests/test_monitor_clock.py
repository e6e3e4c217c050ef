"""The server monitor on the run's clock (engine/clock.py): it looks once per interval of that clock and stamps each
look with it, since the watchdog and the wedge rules judge its samples against attempts' times on the same clock;
against the built-in simulator, on a virtual clock that stands still while the host's runs on."""

from __future__ import annotations

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.clock import VirtualClock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.sim import SimServer

pytestmark = pytest.mark.anyio


async def test_the_monitor_looks_once_an_interval_of_the_runs_clock_and_stamps_its_samples_with_it() -> None:
    async with SimServer(SimSettings(tokens_per_s=100, ttft_s=0.0)) as sim:
        config = validate({"run": {"metrics_interval_s": 5.0},
                           "endpoints": [{"name": "box", "base_url": sim.base_url}],
                           "agents": [{"name": "a", "prompt": "p"}]})
        clock = VirtualClock(start=1000.0)
        monitor = ServerMonitor(config, Connections(config, lambda e: None), lambda e: None, lambda endpoint: None,
                                clock=clock)
        looked = anyio.Event()

        def on_sample(endpoint: str) -> None:
            looked.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(monitor.run, "box", on_sample)
                await looked.wait()
                assert monitor.status_at["box"] == 1000.0
                assert monitor.last_sample["box"].t == 1000.0
                looked = anyio.Event()
                await clock.advance(4.9)
                assert not looked.is_set() and monitor.samples["box"] == 1  # the host's seconds do not count
                await clock.advance(0.1)
                await looked.wait()
                assert monitor.samples["box"] == 2 and monitor.status_at["box"] == 1005.0
                group.cancel_scope.cancel()
