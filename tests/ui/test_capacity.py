"""The console's capacity points against the real engine and the simulator: the load pane's KV estimate
and zone, the cap warning, and the probe offered at the first switch to parallel (run, applied, cancelled)."""

from __future__ import annotations

import functools
import io

import pytest
from rich.console import Console
from textual.command import CommandPalette

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.load import LoadEstimate
from cerevisor_tui.sim import SimServer
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.screens.probe import ProbeScreen
from cerevisor_tui.ui.widgets.load_pane import LoadPane
from cerevisor_tui.ui.widgets.run_header import RunHeader
from tests.conftest import until
from tests.ui.conftest import FAST_SIM, EventLog, console, engine_of, kind, palette_offers, sim_config
from tests.ui.scenes import build

SLOW = {"tokens_per_s": 8.0}


def with_capacity(config, **capacity):
    data = config.model_dump()
    for ep in data["endpoints"]:
        ep["capacity"].update(capacity)
    return validate(data)


def main_screen(app) -> MainScreen:
    screen = app.screen_stack[0]
    assert isinstance(screen, MainScreen)
    return screen


def kv_text(app):
    return main_screen(app).query_one("#kv-estimate").content


def plain(renderable) -> str:
    out = Console(width=80, file=io.StringIO(), record=True)
    out.print(renderable)
    return out.export_text()


def header(app) -> str:
    return str(main_screen(app).query_one(RunHeader).render())


def record_notices(app) -> list[str]:
    """Every notice the console gives, kept (the app drops them when they time out, and shows one said again while
    it is still shown once)."""
    seen: list[str] = []
    notice = app.notice

    def recording(message: str, **kwargs) -> None:
        seen.append(message)
        notice(message, **kwargs)

    app.notice = recording
    return seen


def cap_notices(seen: list[str]) -> list[str]:
    return [m for m in seen if "conversations of" in m]


@pytest.fixture
def fast_probe(monkeypatch):
    """Short probe levels (2 requests or conversations, answers of 6 tokens), so a sweep takes about a second."""
    import cerevisor_tui.endpoints.probe as probe

    monkeypatch.setattr(probe, "ProbeSettings", functools.partial(
        probe.ProbeSettings, level_s=0.0, rounds=1, min_requests_per_level=2, warmup=False, max_tokens=6,
        min_conversations=2, turn_max_tokens=6))


@pytest.mark.anyio
async def test_load_pane_zone_follows_the_running_count_and_the_cap_warning_marks_and_notifies(tmp_path):
    # the simulator's KV holds 4,096 tokens; conversations of 2,048: 2 fit
    config = with_capacity(sim_config(tmp_path, agents=[{"name": f"a{i}", "prompt": "hi", "max_tokens": 400}
                                                        for i in range(4)],
                                      sim={**SLOW, "kv_cache_tokens": 4096}, run={"mode": "sequential"}),
                           context_tokens=2048)
    app = console(config)
    notices = record_notices(app)
    log = EventLog(engine_of(app))
    async with app.run_test(size=(80, 24)) as pilot:
        await log.wait(kind("ServerSample"))
        await until(lambda: engine_of(app).monitor.load["sim"] is not None)
        main_screen(app).refresh_status()
        text = kv_text(app)
        assert "sim FITS 1 of 2 conversations fit (server)" in str(text)
        assert any(app.colour("success") in str(span.style) for span in text.spans)  # the zone in its colour
        assert "> fit" not in header(app) and not cap_notices(notices)  # sequential: one at a time fits

        await pilot.press("m")  # parallel at cap 2: still within the fit; the probe is offered, on the hint line
        assert engine_of(app).scheduler.mode == "parallel"
        await until(lambda: main_screen(app).probe_offer == "sim")
        await pilot.press("plus")  # no dialog in the way: the key does its job
        assert isinstance(app.screen, MainScreen)
        assert engine_of(app).scheduler.max_concurrency == 3
        await until(lambda: cap_notices(notices) == [engine_of(app).load_teller.cap_warning()])
        assert "cap 3 > fit 2" in header(app)
        await until(lambda: engine_of(app).scheduler.running_by_endpoint["sim"] == 3)
        main_screen(app).refresh_status()
        text = kv_text(app)
        assert "sim CLIFF 3 of 2 conversations fit (server)  cap 3 > fit" in str(text)
        assert any(app.colour("warning") in str(span.style) for span in text.spans)

        await pilot.press("plus")  # higher still: a new notice
        await pilot.press("minus")  # lower but still past the fit: no new notice, the marker stays
        await pilot.press("m", "m")  # auto (same cap, same warning), then sequential (no warning)
        assert "> fit" not in header(app)
        await pilot.press("m")  # parallel again, past the fit: noticed again; the probe is not offered twice
        await until(lambda: len(cap_notices(notices)) == 3)
        assert isinstance(app.screen, MainScreen)
        assert "cap 3 > fit 2" in header(app)


@pytest.mark.anyio
async def test_load_pane_zones_and_why_there_is_no_estimate():
    app = build("mid_run")  # two agents in flight on sim
    async with app.run_test(size=(120, 30)) as pilot:
        pane = app.screen.query_one(LoadPane)
        engine = engine_of(app)
        cases = [(LoadEstimate(8, 65536, 8192), "FITS 2 of 8", "success"),
                 (LoadEstimate(1, 8192, 8192, cpu_conversations=4), "CLIFF 2 of 1", "warning"),
                 (LoadEstimate(0, 4096, 8192, cpu_conversations=1), "OVERFLOW 2 of 0", "error")]
        for estimate, shown, role in cases:
            engine.monitor.load["sim"] = estimate
            engine.emit(engine.load_teller.event("sim"))  # the engine judges the zone; the pane shows its word
            pane.sync(app.mirror, 1012.0)
            text = kv_text(app)
            assert shown in str(text)
            assert any(app.colour(role) in str(span.style) for span in text.spans)
        engine.monitor.load["sim"], engine.monitor.load_notes["sim"] = None, "no [endpoints.capacity] model configured"
        engine.emit(engine.load_teller.event("sim"))
        pane.sync(app.mirror, 1012.0)
        assert "capacity.context_tokens" in str(kv_text(app))  # the server reports its KV: say what is missing
        app.mirror.servers["sim"].kv_cache_tokens = None
        pane.sync(app.mirror, 1012.0)
        assert str(kv_text(app)) == "sim KV estimate -  no [endpoints.capacity] model configured"
        await pilot.pause()


@pytest.mark.anyio
async def test_first_switch_to_parallel_offers_the_probe_which_measures_and_applies_its_cap(tmp_path, fast_probe):
    config = sim_config(tmp_path, agents=[{"name": f"a{i}", "prompt": "hi", "max_tokens": 3000} for i in range(3)],
                        sim={"tokens_per_s": 20.0}, run={"mode": "sequential", "max_concurrency": 2})
    data = config.model_dump()
    data["endpoints"][0]["max_concurrency"] = 4  # the sweep: 1, 2, 4
    app = console(validate(data))
    log = EventLog(engine_of(app))
    async with app.run_test(size=(80, 24)) as pilot:
        await log.wait(kind("FirstToken"))
        await pilot.press("m")
        assert engine_of(app).scheduler.mode == "parallel"
        assert isinstance(app.screen, MainScreen)  # offered on the hint line, not in a dialog over the table
        hint = str(app.screen.query_one("#hint").render())
        assert hint.startswith("Probe sim before more agents run at once? P ")
        await pilot.press("P")
        offer = app.screen
        assert isinstance(offer, ProbeScreen) and offer.state == "offer"
        assert not main_screen(app).query_one("#hint").display
        assert "Probe sim before going parallel?" in str(offer.query_one("#probe-title").render())
        assert "concurrency 1, 2, 4, ... up to 4" in str(offer.query_one("#probe-body").render())

        await pilot.press("enter")
        await until(lambda: offer.state != "running")
        assert offer.state == "done", offer.error
        result = offer.result  # as ProbeFinished carried it
        levels = result.levels
        assert [lv.concurrency for lv in levels] == [1, 2, 4][:len(levels)]
        assert all(lv.requests >= 2 and lv.output_tokens > 0 for lv in levels)
        assert app.mirror.probes["sim"].state == "done" and app.mirror.probes["sim"].result is result
        assert [e.kind for e in log.seen if e.kind.startswith("Probe")][:1] == ["ProbeStarted"]
        assert log.of("ProbeFinished")[-1].result == result
        # new admissions waited while it measured, and resumed after
        assert [e.paused for e in log.of("ConcurrencyChanged")] == [True, False]
        assert not engine_of(app).scheduler.paused
        table = plain(offer.query_one("#probe-levels").content)
        assert "TTFT p50" in table and "recommended" in table

        await pilot.press("enter")  # "Apply <mode>, cap N" has the focus
        assert isinstance(app.screen, MainScreen)
        assert engine_of(app).scheduler.max_concurrency == result.recommended_concurrency
        assert engine_of(app).scheduler.mode == result.recommended_mode
        assert log.of("ConcurrencyChanged")[-1].max_concurrency == result.recommended_concurrency


@pytest.mark.anyio
async def test_palette_probe_runs_at_once_and_esc_cancels_it_closing_its_requests(tmp_path, fast_probe):
    async with SimServer(SimSettings(**{**FAST_SIM, "tokens_per_s": 4.0})) as srv:
        config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 400}])
        data = config.model_dump()
        data["endpoints"][0].update(kind="local", base_url=srv.base_url)
        app = console(validate(data))
        notices = record_notices(app)
        log = EventLog(engine_of(app))
        async with app.run_test(size=(80, 24)) as pilot:
            await log.wait(kind("FirstToken"))
            await pilot.press("ctrl+p")
            assert isinstance(app.screen, CommandPalette)
            await pilot.press(*"endpoint sim")  # not the offered probe's entry, which asks first
            await until(lambda: palette_offers(app, "Probe endpoint sim"))
            await pilot.press("enter")
            await until(lambda: isinstance(app.screen, ProbeScreen))
            assert app.screen.state == "running"
            await until(lambda: srv.state.requests_by_agent["probe"] >= 1)  # a probe request is streaming
            await pilot.press("escape")
            assert isinstance(app.screen, MainScreen)
            await until(lambda: srv.state.aborted_total >= 1)  # its request was closed, not left running
            await until(lambda: srv.state.running == 1)  # only the agent's request is left
            assert not engine_of(app).scheduler.paused
            await until(lambda: "Probe of sim cancelled." in notices)
            await until(lambda: app.mirror.probes["sim"].state == "cancelled")  # a cancelled probe leaves no result
            assert app.mirror.probes["sim"].result is None and log.of("ProbeFinished")[-1].cancelled
