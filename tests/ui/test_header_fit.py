"""The header at 80x24 with three endpoints: the endpoints give way (URL and model, then names), never the
second line with the mode, the cap and the counters, nor the run clock and the run's state (what is on
screen is checked, not the widget's text: a first line that wrapped used to push the second one out)."""

from __future__ import annotations

import tomllib

import pytest

from cerevisor_tui.commands.console import demo_text, run_handle
from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.theme_files import load_themes
from tests.ui.conftest import emit_as_engine, engine_of
from tests.ui.scenes import NOW, RUN_ID, T0

ENDPOINTS = [
    {"name": "gpu-a", "kind": "local", "base_url": "http://10.0.0.11:8000/v1",
     "model": "meta-llama/Llama-3.1-70B-Instruct"},
    {"name": "gpu-b", "kind": "local", "base_url": "http://10.0.0.12:8000/v1", "model": "Qwen/Qwen3-32B"},
    {"name": "api", "kind": "hosted", "base_url": "https://api.example.com/v1", "model": "gpt-4o-mini"},
]


def three_endpoints(mode: str) -> CerevisorApp:
    """The demo workflow spread over two local servers and a hosted API, twelve seconds in: every agent of
    the first wave running, one of them on its second attempt after a failure."""
    data = tomllib.loads(demo_text())
    data["run"]["mode"] = mode
    data["endpoints"] = ENDPOINTS
    for i, agent in enumerate(data["agents"]):
        agent["endpoint"] = ENDPOINTS[i % 3]["name"]
    config = validate(data, file="three endpoints")
    engine = Engine(config, run_id=RUN_ID, run_dir=f"/runs/{RUN_ID}")
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    engine.emit(ev.WaveStarted(T0, 0, [a.name for a in engine.waves[0]]))
    for name in ("gpu-a", "gpu-b"):
        engine.emit(ev.ServerSample(T0 + 1, name, True, "vllm", running=1.0, waiting=0.0))
    for agent in engine.waves[0]:
        st = engine.agents[agent.name]
        emit_as_engine(engine, ev.AgentStarted(T0 + 1, st.name, 1, 1, st.turns, st.endpoint, 600.0, 600.0))
        emit_as_engine(engine, ev.FirstToken(T0 + 2, st.name, 1, 1, 1.0))
    return app


async def screen_lines(app: CerevisorApp, pilot) -> list[str]:
    app.screen.refresh_status()
    await pilot.pause()
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.mark.anyio
@pytest.mark.parametrize("mode, badge", [("parallel", " PARALLEL  cap 4 "), ("auto", " AUTO ")])
async def test_three_endpoints_at_80x24_keep_mode_cap_counters_and_the_run_clock_on_screen(mode, badge):
    app = three_endpoints(mode)
    async with app.run_test(size=(80, 24)) as pilot:
        first, second, third = (await screen_lines(app, pilot))[:3]
        assert second.startswith(" " + badge)
        assert "wave 1/2" in second and "3 running 0 queued 0 done 0 failed" in second and "tok/s" in second
        assert "gpu-a" in first and "gpu-b" in first and "api" in first and "run 0:12" in first
        assert "10.0.0.11" not in first  # the URLs and models gave way
        assert "1 agents" in third  # the header is two lines, the agents pane right below

        engine_of(app).stop("operator")  # the run's state keeps its place too
        lines = await screen_lines(app, pilot)
        assert "run 0:12  STOPPING" in lines[0] and lines[1].startswith(" " + badge)

        await pilot.resize_terminal(50, 24)  # narrower: the health dots alone, still the clock
        lines = await screen_lines(app, pilot)
        assert " ●●○ 3 endpoints  run 0:12  STOPPING" in lines[0]  # two servers up, the hosted API not probed
        assert lines[1].startswith(" " + badge)

        await pilot.resize_terminal(200, 30)  # wide: each endpoint's URL and model
        lines = await screen_lines(app, pilot)
        assert "gpu-a http://10.0.0.11:8000/v1 · meta-llama/Llama-3.1-70B-Instruct" in lines[0]
        assert "api https://api.example.com/v1 · gpt-4o-mini" in lines[0] and "run 0:12" in lines[0]
