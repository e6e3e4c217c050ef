"""The server-busy extension: at a deadline, requests waiting in the server's own queue extend it."""

from __future__ import annotations

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer


def engine_for(url: str, *, max_extensions: int, busy: bool = True) -> Engine:
    return Engine(validate({
        "run": {"mode": "parallel", "max_concurrency": 3, "metrics_interval_s": 0.2},
        "stall": {"first_byte_timeout_s": 0.5, "idle_timeout_s": 2.0, "extend_s": 0.5,
                  "max_extensions": max_extensions, "extend_when_server_busy": busy},
        "endpoints": [{"name": "box", "base_url": url}],
        "agents": [{"name": f"a{i}", "prompt": f"p{i}", "max_tokens": 30, "retries": 0} for i in range(3)],
    }))


@pytest.mark.anyio
async def test_waiting_in_the_server_queue_extends_up_to_max_extensions_then_kills():
    async with SimServer(SimSettings(max_num_seqs=1, tokens_per_s=12, ttft_s=0.05)) as srv:
        engine = engine_for(srv.base_url, max_extensions=2)
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    extended = [e for e in seen if e.kind == "StallExtended"]
    killed = [e for e in seen if e.kind == "AgentKilled"]
    assert extended and all("requests waiting" in e.reason or "request waiting" in e.reason for e in extended)
    assert all(e.deadline == "first_byte" for e in extended)
    per_agent = {}
    for e in extended:
        per_agent[e.agent] = max(per_agent.get(e.agent, 0), e.extensions)
    assert max(per_agent.values()) == 2  # never more than max_extensions
    assert killed and all(k.deadline == "first_byte" for k in killed)
    assert all(per_agent.get(k.agent) == 2 for k in killed)  # killed only once the extensions ran out
    assert any(e.kind == "ServerSample" and e.waiting and e.server_kind == "vllm" for e in seen)


@pytest.mark.anyio
async def test_with_enough_extensions_queued_agents_complete():
    async with SimServer(SimSettings(max_num_seqs=1, tokens_per_s=60, ttft_s=0.05)) as srv:
        engine = engine_for(srv.base_url, max_extensions=10)
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert any(e.kind == "StallExtended" for e in seen)
    assert not any(e.kind == "AgentKilled" for e in seen)


@pytest.mark.anyio
async def test_without_the_extension_a_queued_agent_is_killed_at_its_deadline():
    async with SimServer(SimSettings(max_num_seqs=1, tokens_per_s=60, ttft_s=0.05)) as srv:
        engine = engine_for(srv.base_url, max_extensions=10, busy=False)
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    assert not any(e.kind == "StallExtended" for e in seen)
    assert any(e.kind == "AgentKilled" and e.deadline == "first_byte" for e in seen)
