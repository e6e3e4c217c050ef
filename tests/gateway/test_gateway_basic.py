from __future__ import annotations

import json

import httpx
import pytest

from cerevisor_tui.contract import events as ev
from tests.conftest import until

from .conftest import chat, gateway_config, post, served

pytestmark = pytest.mark.anyio


async def test_chat_streamed_passes_through_and_is_a_session():
    async with served() as s, httpx.AsyncClient() as client:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 6}
        async with client.stream("POST", s.url + "/chat/completions", json=body,
                                 headers={"X-Session-ID": "alpha"}) as r:
            assert r.status_code == 200
            assert r.headers["x-accel-buffering"] == "no"
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        frames = [f for f in raw.split(b"\n\n") if f and not f.startswith(b":")]  # (keep-alive comments)
        assert frames[-1] == b"data: [DONE]"
        words = [json.loads(f[6:])["choices"][0]["delta"].get("content") for f in frames[:-1]
                 if json.loads(f[6:])["choices"]]
        assert len([w for w in words if w]) == 6
        opened = s.of(ev.SessionOpened)
        assert [(o.agent, o.source) for o in opened] == [("alpha", "x-session-id")]
        turns = s.of(ev.TurnFinished, "alpha")
        assert turns and turns[0].completion_tokens == 6


async def test_a_request_goes_to_the_endpoint_that_serves_its_model():
    endpoints = [{"name": "small", "kind": "simulated", "model": "small-model", "sim": {"speed": 50.0}},
                 {"name": "big", "kind": "simulated", "model": "big-model", "sim": {"speed": 50.0}}]
    async with served(endpoints=endpoints) as s, httpx.AsyncClient(timeout=30) as client:
        for model, session in (("big-model", "b"), ("small-model", "a")):
            r = await client.post(s.url + "/chat/completions", headers={"X-Session-ID": session},
                                  json={"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200 and r.json()["model"] == model
        assert {o.agent: o.endpoint for o in s.of(ev.SessionOpened)} == {"b": "big", "a": "small"}
        r = await client.post(s.url + "/chat/completions", json={"model": "gpt-4o", "messages": []})
        assert r.status_code == 404
        assert r.json()["error"]["message"].startswith("model 'gpt-4o' is not served here (served: big-model, "
                                                       "small-model)")


async def test_a_workflows_agents_and_the_sessions_share_one_cap():
    # cap 1: the workflow's agent holds the only slot, so a session's first request waits for it to finish
    config = gateway_config(
        run={"mode": "parallel", "max_concurrency": 1},
        endpoints=[{"name": "sim", "kind": "simulated", "model": "sim-model",
                    "sim": {"tokens_per_s": 20.0, "ttft_s": 0.0}}],
        agents=[{"name": "writer", "prompt": "write", "max_tokens": 20}])
    async with served(config) as s, httpx.AsyncClient(timeout=60) as client:
        await until(lambda: s.of(ev.FirstToken, "writer"), "the workflow's agent to stream")
        r = await client.post(s.url + "/chat/completions", headers={"X-Session-ID": "outside"},
                              json={"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        [done] = s.of(ev.AgentFinished, "writer")
        [sent] = s.of(ev.AgentStarted, "outside")
        assert done.status == "completed" and sent.t >= done.t  # admitted only once the agent gave its slot back
        assert sent.queued_s > 0
        assert s.engine.scheduler.max_running == 1


async def test_a_pools_session_is_placed_once_and_stays_on_its_member():
    # two members of one pool; release_after_s = 0 gives each request its own admission, and placement a chance
    # to move it: a session must still come back to the member that holds its prefix
    members = [{"name": name, "kind": "simulated", "model": "sim-model", "sim": {"speed": 50.0}}
               for name in ("m1", "m2")]
    config = gateway_config(endpoints=members, pools=[{"name": "fleet", "endpoints": ["m1", "m2"]}],
                            gateway={"upstream": "fleet", "release_after_s": 0})
    async with served(config) as s, httpx.AsyncClient(timeout=30) as client:
        for turn in range(3):
            for session in ("a", "b", "c", "d"):
                r = await client.post(s.url + "/chat/completions", headers={"X-Session-ID": session},
                                      json={"model": "sim-model", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": f"{session} {turn}"}]})
                assert r.status_code == 200
        placed = {p.agent: p.endpoint for p in s.of(ev.AgentPlaced)}
        assert len(s.of(ev.AgentPlaced)) == 4 and set(placed) == {"a", "b", "c", "d"}  # once each, never moved
        for session, member in placed.items():
            assert {a.endpoint for a in s.of(ev.AgentStarted, session)} == {member}
        assert {o.endpoint for o in s.of(ev.SessionOpened)} == {"fleet"}


async def test_a_model_map_target_the_upstream_does_not_serve_is_named_at_start_and_in_each_refusal():
    # `gateway --model qwen3-coder` in front of a server of sim-model: said at start, and each request's 404 names
    # the gateway's own mapping as the problem, not the client's model
    async with served(sim={}, gateway={"model_map": {"*": "qwen3-coder"}}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        await s.server.gateway.resolve_models()
        problem = s.server.gateway.model_problem()
        assert "'qwen3-coder'" in problem and "served: sim-model" in problem
        answer = await post(client, s.url + "/chat/completions", chat(model="claude-sonnet-4"))
    assert answer.status == 404
    message = answer.json()["error"]["message"]
    assert "'claude-sonnet-4' goes to 'qwen3-coder'" in message and "does not serve (served: sim-model)" in message
    async with served(sim={}, gateway={"model_map": {"claude-*": "sim-model"}}) as s:
        await s.server.gateway.resolve_models()
        assert s.server.gateway.model_problem() == ""
