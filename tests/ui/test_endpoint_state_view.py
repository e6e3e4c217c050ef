"""An upstream's state said, not waited on (issue 30): through the real app, a gateway in front of a port that never
opened answers a chat request with a 503 naming the endpoint within its grace and a second, and the header and the
load pane show the endpoint down, with why and since when; a state told later (loading, up) replaces it."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.gateway import serve_gateway

from ..conftest import free_port, until
from .conftest import EventLog, console, engine_of

pytestmark = pytest.mark.anyio
GRACE_S = 2.0


def header_text(app) -> str:
    return str(app.screen.query_one("#header").render())


async def test_a_gateway_whose_upstream_never_opened_says_503_in_its_grace_and_the_header_says_down(tmp_path):
    port = free_port()  # nothing listens there, ever
    config = validate({
        # the warm-up (on for a local endpoint) holds requests no longer than the grace either
        "run": {"run_dir": str(tmp_path / "runs"), "metrics_interval_s": 0.2},
        "endpoints": [{"name": "vllm0", "kind": "local", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}],
        "gateway": {"listen": "127.0.0.1:0", "down_after_s": GRACE_S, "keepalive_s": 30},
    })
    app = console(config)
    engine = engine_of(app)
    log = EventLog(engine)
    async with app.run_test(size=(120, 30)) as pilot:
        await log.wait(lambda e: isinstance(e, ev.RunStarted))
        server = await serve_gateway(engine, config.gateway)
        try:
            sent = time.monotonic()
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.post(server.url + "/chat/completions", headers={"X-Session-ID": "typo"},
                                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            took_s = time.monotonic() - sent
            assert answer.status_code == 503 and int(answer.headers["retry-after"]) > 0
            assert f"upstream vllm0 at http://127.0.0.1:{port}/v1 is down" in answer.json()["error"]["message"]
            assert took_s <= GRACE_S + 1.0  # said within the grace, not a backoff (or a first-byte window) later
            [down] = [e for e in log.seen if isinstance(e, ev.EndpointState)]  # told once
            assert down.state == "down" and f"connection refused at 127.0.0.1:{port}" in down.why

            said = re.compile(rf"vllm0 down \d+ s: connection refused at 127\.0\.0\.1:{port}")
            await until(lambda: said.search(header_text(app)), lambda: f"the header to say vllm0 is down: {header_text(app)}")
            await pilot.pause()
            pane = str(app.screen.query_one("#servers").render())
            assert "vllm0 down" in pane and f"127.0.0.1:{port}" in pane
        finally:
            await server.close()


async def test_a_state_told_later_replaces_the_one_shown(tmp_path):
    config = validate({
        "run": {"run_dir": str(tmp_path / "runs")},
        "endpoints": [{"name": "vllm0", "kind": "local", "base_url": "http://127.0.0.1:8399/v1", "model": "m"}],
        "agents": [{"name": "a", "prompt": "hi"}],
    })
    app = console(config, start_engine=False)
    engine = engine_of(app)
    async with app.run_test(size=(120, 30)) as pilot:
        now = time.monotonic()
        engine.emit(ev.EndpointState(now, "vllm0", "loading", "Loading model", now - 65))
        await until(lambda: "vllm0 loading 65 s: Loading model" in header_text(app) or
                    "vllm0 loading 66 s: Loading model" in header_text(app), lambda: header_text(app))
        engine.emit(ev.EndpointState(now, "vllm0", "up", "", now))
        await until(lambda: "vllm0 http://127.0.0.1:8399/v1 · m" in header_text(app), lambda: header_text(app))
        await pilot.pause()
