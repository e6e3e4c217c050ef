"""The load pane's latency panel: each endpoint's p50/p95 of TTFT, inter-token latency, queue and prefill time,
its warm-up (`warming up`, then its cold start), and a decode-stall line, from the run's events alone; hidden
while no endpoint has any of them. Also from the journal form, as an attached console gets them."""

from __future__ import annotations

import tomllib

import pytest

from cerevisor_tui.commands.console import demo_text, run_handle
from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.theme_files import load_themes
from cerevisor_tui.ui.widgets.load_pane import LoadPane, latency_lines
from cerevisor_tui.ui.widgets.run_header import RunHeader
from tests.conftest import until
from tests.ui.scenes import NOW, RUN_ID, T0

ENDPOINTS = [
    {"name": "vllm", "kind": "local", "base_url": "http://10.0.0.11:8000/v1", "model": "m"},
    {"name": "llama", "kind": "local", "base_url": "http://10.0.0.12:8080/v1", "model": "m"},
]


def app_and_engine() -> tuple[CerevisorApp, Engine]:
    data = tomllib.loads(demo_text())
    data["endpoints"] = ENDPOINTS
    for i, agent in enumerate(data["agents"]):
        agent["endpoint"] = ENDPOINTS[i % 2]["name"]
    config = validate(data, file="latency")
    engine = Engine(config, run_id=RUN_ID, run_dir=f"/runs/{RUN_ID}")
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    return app, engine


VLLM_PANEL = ev.LatencySample(T0 + 5, "vllm", "histograms", 60.0, ttft=ev.Quantiles(0.12, 0.41, 30),
                              inter_token=ev.Quantiles(0.021, 0.035, 900), queue=ev.Quantiles(0.0, 0.012, 30),
                              prefill=ev.Quantiles(0.095, 0.3, 30), running=4.0)
LLAMA_PANEL = ev.LatencySample(T0 + 5, "llama", "timings", 60.0, ttft=ev.Quantiles(1.2, 3.4, 5),
                               prefill=ev.Quantiles(1.1, 3.3, 5), inter_token=None, decode_stall_s=12.0,
                               running=2.0)


def latency_text(app: CerevisorApp) -> str:
    return str(app.screen.query_one(LoadPane).query_one("#latency").content)


@pytest.mark.anyio
async def test_the_panel_shows_warming_up_then_the_cold_start_and_each_servers_figures():
    app, engine = app_and_engine()
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause()
        pane = app.screen.query_one(LoadPane)
        pane.sync(app.mirror, NOW)
        assert not pane.query_one("#latency").display  # nothing to show yet: the pane keeps its lines

        engine.emit(ev.WarmupStarted(T0 + 1, ["vllm", "llama"]))
        pane.sync(app.mirror, NOW)
        await until(lambda: pane.query_one("#latency").display, "the panel shown")
        assert latency_text(app).splitlines() == ["vllm latency p50/p95  warming up",
                                                  "llama latency p50/p95  warming up"]
        header = app.screen.query_one(RunHeader)
        header.sync(app.mirror, NOW)
        assert "warming up" in str(header.render()) and "wave -/" not in str(header.render())

        engine.emit(ev.EndpointWarmed(T0 + 3, "vllm", 2.31))
        engine.emit(ev.EndpointWarmed(T0 + 3, "llama", None, "HTTP 500"))
        engine.emit(VLLM_PANEL)
        engine.emit(LLAMA_PANEL)
        pane.sync(app.mirror, NOW)
        header.sync(app.mirror, NOW)
        assert "warming up" not in str(header.render()) and "wave -/" in str(header.render())
        assert latency_text(app).splitlines() == [
            "vllm latency p50/p95  TTFT 120/410 ms  ITL 21/35 ms  queue 0/12 ms  prefill 95/300 ms  cold start 2.31s",
            # llama.cpp tells no queue time: not shown; its ITL not seen yet: "-"
            "llama latency p50/p95  TTFT 1.2/3.4 s  ITL -  prefill 1.1/3.3 s  warm-up failed",
            "llama decode stalled 12s: 2 running, no token generated",
        ]


def test_the_panel_reads_the_same_from_the_journal_form():
    """An attached console gets the events as JSON lines: the figures survive the trip."""
    app, engine = app_and_engine()
    engine.emit(ev.EndpointWarmed(T0 + 3, "vllm", 2.31))
    engine.emit(VLLM_PANEL)
    attached = RunMirror()
    skipped = attached.feed_records([engine.started_event(T0).to_dict(), VLLM_PANEL.to_dict(),
                                     ev.EndpointWarmed(T0 + 3, "vllm", 2.31).to_dict()])
    assert skipped == 0
    assert latency_lines(attached) == latency_lines(app.mirror)
    assert latency_lines(attached)[0].endswith("cold start 2.31s")


def test_a_bound_reads_as_one_where_the_histogram_cannot_place_a_quantile_closer():
    mirror = RunMirror()
    queue = ev.Quantiles(0.3, 0.3, 30, "below", "below")
    ttft = ev.Quantiles(0.3, 0.41, 30, "below")
    slow = ev.Quantiles(20.0, 60.0, 30, p95_bound="above")
    mirror(ev.LatencySample(T0, "vllm", "histograms", 60.0, ttft=ttft, queue=queue, prefill=slow))
    assert latency_lines(mirror) == ("vllm latency p50/p95  TTFT <300/410 ms  ITL -  queue < 300 ms  "
                                     "prefill 20.0/>60.0 s",)


@pytest.mark.anyio
async def test_a_run_where_nothing_queued_shows_its_queue_time_under_the_first_bucket_not_an_interpolation(tmp_path):
    """The simulator keeps vLLM's queue-time buckets (the first `le="0.3"`); with room for every request nothing
    waits, and the console says `queue < 300 ms` where it used to interpolate 150/285 ms."""
    from tests.ui.conftest import EventLog, console, kind, sim_config

    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 40}],
                        run={"metrics_interval_s": 0.05, "warmup": "off"})
    app = console(config)
    log = EventLog(app.control.engine)  # type: ignore[attr-defined]
    async with app.run_test(size=(140, 40)):
        sample = await log.wait(lambda e: kind("LatencySample")(e) and e.queue is not None)
        assert (sample.queue.p50_bound, sample.queue.p95_bound) == ("below", "below")
        await until(lambda: "queue < 300 ms" in latency_text(app), lambda: latency_text(app))


@pytest.mark.anyio
async def test_once_the_run_has_finished_the_load_pane_says_finished_and_shows_no_live_figure(tmp_path):
    from cerevisor_tui.ui.widgets.load_pane import LoadPane
    from tests.ui.conftest import EventLog, console, kind, sim_config

    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 40}],
                        run={"metrics_interval_s": 0.05, "warmup": "off"})
    app = console(config)
    log = EventLog(app.control.engine)  # type: ignore[attr-defined]
    async with app.run_test(size=(140, 40)):
        pane = app.screen.query_one(LoadPane)

        def shown(part: str) -> str:
            return str(pane.query_one(part).content)

        await until(lambda: "running" in shown("#servers"), lambda: shown("#servers"))  # live while it runs
        await log.wait(kind("RunFinished"))
        await until(lambda: shown("#servers") == "sim finished", lambda: shown("#servers"))
        await until(lambda: shown("#throughput-label").startswith("finished  peak "), lambda: shown("#throughput-label"))
        assert "tok/s" not in shown("#throughput-label") and "total 40" in shown("#throughput-label")
        kv = shown("#kv-estimate")
        assert " of " not in kv and "FITS" not in kv and "conversations fit" in kv, kv
