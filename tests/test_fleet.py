"""Pools of endpoints and the headers routers keep affinity by (issue 12): config checks, X-Session-ID and
X-Request-ID on every request, each attempt's request id in the journal."""

from __future__ import annotations

import json

import pytest

from cerevisor_tui.config import ConfigError, SimSettings, validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.journal import Journal
from cerevisor_tui.sim import SimServer

FAST = SimSettings(tokens_per_s=2000, ttft_s=0.0)


def pool_config(**extra) -> dict:
    return {"endpoints": [{"name": "a", "base_url": "http://127.0.0.1:1/v1"},
                          {"name": "b", "base_url": "http://127.0.0.1:2/v1"}],
            "pools": [{"name": "fleet", "endpoints": ["a", "b"]}],
            "agents": [{"name": "x", "endpoint": "fleet", "prompt": "p"}], **extra}


def test_an_agent_may_name_a_pool_and_the_pool_defaults_to_least_loaded():
    config = validate(pool_config())
    assert config.pools[0].policy == "least-loaded"
    assert config.agent_pool(config.agents[0]).name == "fleet"
    assert config.endpoints[0].session_header == "X-Session-ID"


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"pools": [{"name": "fleet", "endpoints": ["a", "c"]}]}, "pools[0] (fleet).endpoints[1]", "unknown endpoint 'c'"),
    ({"pools": [{"name": "a", "endpoints": ["a", "b"]}]}, "pools[0] (a).name", "already the name"),
    ({"pools": [{"name": "fleet", "endpoints": ["a", "a"]}]}, "pools[0] (fleet).endpoints[1]", "listed twice"),
    ({"pools": [{"name": "fleet", "endpoints": []}]}, "pools[0] (fleet).endpoints", "at least 1"),
    ({"pools": [{"name": "fleet", "endpoints": ["a"], "policy": "random"}]}, "pools[0] (fleet).policy", "least-loaded"),
    ({"agents": [{"name": "x", "endpoint": "flet", "prompt": "p"}]}, "agents[0] (x).endpoint", "pools: fleet"),
])
def test_a_bad_pool_is_a_config_error_naming_the_key(change, key, words):
    with pytest.raises(ConfigError) as info:
        validate(pool_config(**change), file="team.toml")
    assert info.value.key == key and words in str(info.value) and "team.toml" in str(info.value)


def test_a_session_header_must_be_a_header_name():
    bad = pool_config()
    bad["endpoints"][0]["session_header"] = "X Session"
    with pytest.raises(ConfigError) as info:
        validate(bad, file="team.toml")
    assert info.value.key == "endpoints[0] (a).session_header"


@pytest.mark.anyio
@pytest.mark.parametrize(("header", "expect"), [({}, "x-session-id"), ({"session_header": "X-Affinity"}, "x-affinity"),
                                                ({"session_header": ""}, None)])
async def test_every_request_carries_the_agents_session_id(header, expect, stream_process, tmp_path):
    """Every turn and retry of an agent carries the same session id, <run id>/<agent>, under the endpoint's
    header name (none when it is empty), and a per-attempt X-Request-Id that the journal records."""
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0, fail_first=1, fail_status=503)) as srv:
        engine = Engine(validate({"endpoints": [{"name": "e", "base_url": srv.base_url, **header}],
                                  "agents": [{"name": "a", "prompt": "p", "turns": ["q"], "max_tokens": 4},
                                             {"name": "ä b", "prompt": "p", "max_tokens": 4}]}),
                        run_dir=str(tmp_path), stream_process=stream_process)
        journal = Journal(tmp_path, engine.report)
        journal.open()
        engine.subscribe(journal)
        try:
            assert await engine.run() == 0
        finally:
            journal.close()
        seen = srv.state.requests
    assert len(seen) == 4  # three turns and one retry of the 503
    agent_b = "%C3%A4%20b"  # a header value is ASCII: the name percent-encoded, as X-Cerevisor-Agent has it
    sessions = {(r["agent"], r["headers"].get(expect) if expect else None) for r in seen}
    if expect:
        assert sessions == {("a", f"{engine.run_id}/a"), (agent_b, f"{engine.run_id}/{agent_b}")}
    assert all("x-session-id" not in r["headers"] for r in seen) == (expect != "x-session-id")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    journaled = [e["request_id"] for e in events if e["event"] == "AgentStarted"]
    assert sorted(journaled) == sorted(r["request_id"] for r in seen) and len(set(journaled)) == 4
