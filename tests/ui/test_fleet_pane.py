"""The load pane shows the fleet: a row per endpoint and per worker behind a router, the totals, and the GPUs
of the run's box; one endpoint without workers keeps its one-line form. Fed the engine's events, as an
attached console is."""

from __future__ import annotations

import tomllib

import msgspec
import pytest

from cerevisor_tui.commands.console import demo_text, run_handle
from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.theme_files import load_themes
from cerevisor_tui.ui.widgets.load_pane import LoadPane, fleet_rows, gpu_lines
from tests.conftest import until
from tests.ui.conftest import emit_as_engine
from tests.ui.scenes import NOW, RUN_ID, T0

GiB = 2**30
ENDPOINTS = [
    {"name": "box-a", "kind": "local", "base_url": "http://10.0.0.11:8000/v1", "model": "m"},
    {"name": "box-b", "kind": "local", "base_url": "http://10.0.0.12:8000/v1", "model": "m"},
    {"name": "router", "kind": "local", "base_url": "http://10.0.0.20:8080/v1", "model": "m",
     "metrics_urls": ["http://10.0.0.21:8000", "http://10.0.0.22:8000"]},
]


def fleet_app(endpoints: list[dict]) -> tuple[CerevisorApp, Engine]:
    data = tomllib.loads(demo_text())
    data["endpoints"] = endpoints
    for i, agent in enumerate(data["agents"]):
        agent["endpoint"] = endpoints[i % len(endpoints)]["name"]
    config = validate(data, file="fleet")
    engine = Engine(config, run_id=RUN_ID, run_dir=f"/runs/{RUN_ID}")
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    engine.emit(ev.WaveStarted(T0, 0, [a.name for a in engine.waves[0]]))
    for agent in engine.waves[0]:
        st = engine.agents[agent.name]
        emit_as_engine(engine, ev.AgentStarted(T0 + 1, st.name, 1, 1, st.turns, st.endpoint, 600.0, 600.0))
    return app, engine


def worker(url: str, healthy: bool, running: float | None, waiting: float | None, kv: float | None,
           prefix: float | None, queries: float | None, detail: str = "") -> ev.WorkerSample:
    return ev.WorkerSample(url, healthy, running, waiting, kv, prefix, queries, None, detail)


def samples(engine: Engine) -> None:
    engine.emit(ev.ServerSample(T0 + 2, "box-a", True, "vllm", running=3.0, waiting=0.0, kv_cache_usage=0.41,
                                prefix_hit_rate=0.9, prefix_queries=1000.0))
    engine.emit(ev.ServerSample(T0 + 2, "box-b", False, "unknown", detail="health: connection refused"))
    engine.emit(ev.ServerSample(
        T0 + 2, "router", True, "vllm", running=2.0, waiting=1.0, kv_cache_usage=0.55, prefix_hit_rate=0.6,
        prefix_queries=3000.0, detail="1 of 2 workers down",
        workers=[worker("http://10.0.0.21:8000", True, 2.0, 1.0, 0.55, 0.6, 3000.0),
                 worker("http://10.0.0.22:8000", False, None, None, None, None, None, "health: connection refused")]))


def pane_text(app: CerevisorApp, part: str) -> str:
    return str(app.screen.query_one(LoadPane).query_one(part).content)


@pytest.mark.anyio
async def test_a_row_per_endpoint_and_worker_and_the_totals():
    app, engine = fleet_app(ENDPOINTS)
    samples(engine)
    rows = {(r.name, r.worker, r.total): r for r in fleet_rows(app.mirror)}
    a, b, router = rows["box-a", False, False], rows["box-b", False, False], rows["router", False, False]
    up, down = rows["10.0.0.21:8000", True, False], rows["10.0.0.22:8000", True, False]
    total = rows["total", False, True]
    assert [r.name for r in fleet_rows(app.mirror)] == [
        "box-a", "box-b", "router", "10.0.0.21:8000", "10.0.0.22:8000", "total"]  # workers under their router
    assert (a.health, a.running, a.kv, a.agents) == ("up", 3.0, 0.41, 1)  # one demo agent of wave 1 on each
    assert (b.health, b.running, b.detail) == ("down", None, "health: connection refused")
    assert (router.health, router.waiting, router.detail) == ("up", 1.0, "1 of 2 workers down")
    assert (up.health, up.running, up.agents) == ("up", 2.0, None)  # the router places agents, not we
    assert (down.health, down.running) == ("down", None)
    # the workers are counted once (in their router's row); KV is the fullest server's; prefix hits are
    # weighed by the lookups each server made: (0.9 x 1000 + 0.6 x 3000) / 4000
    assert (total.running, total.waiting, total.kv, total.agents) == (5.0, 1.0, 0.55, 3)
    assert total.prefix == pytest.approx(0.675)

    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        app.screen.query_one(LoadPane).sync(app.mirror, NOW)
        lines = pane_text(app, "#servers").splitlines()
        assert lines[0].split() == ["endpoint", "health", "running", "waiting", "KV", "prefix", "agents"]
        assert lines[1].split() == ["box-a", "up", "3", "0", "41%", "90%", "1"]
        assert lines[2].split()[:7] == ["box-b", "down", "-", "-", "-", "-", "1"]
        assert lines[2].endswith("health: connection refused")
        assert lines[4].startswith("  10.0.0.21:8000") and lines[4].split() == ["10.0.0.21:8000", "up", "2", "1",
                                                                              "55%", "60%"]
        assert lines[6].split() == ["total", "5", "1", "55%", "68%", "3"]


@pytest.mark.anyio
async def test_one_endpoint_keeps_its_line_and_no_gpu_row_until_the_run_reads_them():
    app, engine = fleet_app(ENDPOINTS[:1])
    engine.emit(ev.ServerSample(T0 + 2, "box-a", True, "vllm", running=3.0, waiting=0.0, kv_cache_usage=0.41,
                                prefix_hit_rate=0.9))
    assert fleet_rows(app.mirror) == ()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        pane = app.screen.query_one(LoadPane)
        pane.sync(app.mirror, NOW)
        assert pane_text(app, "#servers") == "box-a running 3  waiting 0  KV 41%  prefix hit 90%"
        assert not pane.query_one("#gpus").display


@pytest.mark.anyio
async def test_gpu_rows_follow_each_sample_and_say_why_when_none_is_read():
    app, engine = fleet_app(ENDPOINTS)
    gpus = [ev.GpuReading(0, "NVIDIA H100 80GB HBM3", 0.87, 71 * GiB, 80 * GiB, 512.3, 700.0, 63),
            ev.GpuReading(1, "NVIDIA H100 80GB HBM3", 0.0, 1 * GiB, 80 * GiB)]
    async with app.run_test(size=(120, 40)):
        pane = app.screen.query_one(LoadPane)
        engine.emit(ev.GpuSample(T0 + 2, gpus=gpus))
        pane.sync(app.mirror, NOW)
        await until(lambda: pane.query_one("#gpus").display)
        assert pane_text(app, "#gpus").splitlines() == [
            "GPU 0 NVIDIA H100 80GB HBM3  util 87%  mem 71.0/80.0 GiB  power 512/700 W  63°C",
            "GPU 1 NVIDIA H100 80GB HBM3  util 0%  mem 1.0/80.0 GiB  power -  -",  # what NVML did not report
        ]
        engine.emit(ev.GpuSample(T0 + 4, gpus=[msgspec.structs.replace(gpus[0], utilization=0.12)]))  # refreshed with the metrics
        pane.sync(app.mirror, NOW)
        assert "util 12%" in pane_text(app, "#gpus")
    assert gpu_lines(ev.GpuSample(T0, error="no NVIDIA driver: Driver Not Loaded")) == (
        "GPUs  not read: no NVIDIA driver: Driver Not Loaded",)
    assert gpu_lines(None) == ()


def test_the_mirror_keeps_fleet_and_gpu_samples_from_the_journal_form():
    """An attached console gets events as JSON: the workers and GPUs survive the trip."""
    app, engine = fleet_app(ENDPOINTS)
    samples(engine)
    engine.emit(ev.GpuSample(T0 + 2, error="no NVIDIA driver"))
    from cerevisor_tui.ui.mirror import RunMirror

    copy = RunMirror()
    copy.feed_records([e.to_dict() for e in (engine.started_event(T0), *app.mirror.samples.values(),
                                               app.mirror.gpus)])
    assert fleet_rows(copy)[3:5] == fleet_rows(app.mirror)[3:5]
    assert copy.gpus is not None and copy.gpus.error == "no NVIDIA driver"
