"""A fleet of real servers: two vLLM (CPU) replicas of the tiny model behind vLLM's own router
(`vllm-router --policy consistent_hash`, which keeps a session on one worker by its X-Session-ID header).

What is checked is what the servers themselves say: which replica received each request (vLLM logs
`Received request chatcmpl-<our X-Request-Id>`), how many prompt tokens came from its prefix cache (the
usage chunk's `prompt_tokens_details.cached_tokens`, read off the wire by a recording proxy), and which
replica logged the abort of a killed request. The run reads each replica's /metrics through the router
endpoint's `metrics_urls`.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator

import pytest

from tests.integration import servers
from tests.integration.checks import engine_for, run_engine, until
from tests.integration.conftest import Pool
from tests.integration.servers import MODEL, ServerProcess
from tests.integration.usage_proxy import UsageProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

# --enable-log-requests: vLLM logs each request's id as it arrives and when it is aborted;
# --enable-prompt-tokens-details: each usage chunk says how many prompt tokens its prefix cache served
REPLICA_ARGS = ["--enable-log-requests", "--enable-prompt-tokens-details"]
AGENTS, TURNS = 8, 3


def _replica(pool: Pool, role: str):
    return lambda port: servers.vllm(port, pool.log_dir, REPLICA_ARGS, role)


@pytest.fixture(scope="module")
def replicas(pool: Pool) -> tuple[ServerProcess, ServerProcess]:
    """Two replicas of the tiny model (about 2 GB each), loading side by side."""
    for role in ("replica-a", "replica-b"):
        pool.start_early(role, _replica(pool, role))
    return (pool.get("replica-a", _replica(pool, "replica-a"), servers.VLLM_READY_S),
            pool.get("replica-b", _replica(pool, "replica-b"), servers.VLLM_READY_S))


@pytest.fixture
def router(pool: Pool, replicas: tuple[ServerProcess, ServerProcess]) -> Iterator[ServerProcess]:
    """vllm-router with consistent_hash over the two replicas, for one test."""
    try:
        server = servers.vllm_router(servers.free_port(), pool.log_dir, "consistent_hash", list(replicas))
    except servers.SetupMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    server.start()
    try:
        try:
            server.wait_ready(servers.ROUTER_READY_S)
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield server
    finally:
        server.stop()


class CachedTokens(UsageProxy):
    """The recording proxy, also keeping each agent's answers' cached prompt tokens, in the order they came."""

    def __init__(self, upstream_root: str) -> None:
        super().__init__(upstream_root)
        self.cached: dict[str, list[int]] = defaultdict(list)

    def _look(self, line: bytes, agent: str) -> None:
        super()._look(line, agent)
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                usage = json.loads(line[5:]).get("usage")
            except ValueError:
                return
            if usage:
                self.cached[agent].append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))


def _long_prompt(i: int) -> str:
    """About 600 tokens of the tiny model, its own from the first word: no two agents share a prefix block."""
    return f"Agent number {i} reporting. " + " ".join(f"item {i}-{k} is ready" for k in range(110))


def fleet_config(base_url: str, replicas: tuple[ServerProcess, ...]) -> dict:
    return {
        "run": {"mode": "parallel", "max_concurrency": AGENTS, "metrics_interval_s": 0.5},
        "stall": {"first_byte_timeout_s": 300.0, "idle_timeout_s": 120.0},
        "endpoints": [{"name": "fleet", "base_url": base_url, "kind": "local", "model": MODEL,
                       "metrics_urls": [r.root_url for r in replicas]}],
        "agents": [{"name": f"agent{i}", "prompt": _long_prompt(i), "max_tokens": 16, "retries": 0,
                    "turns": ["Go on.", "Sum it up."]} for i in range(AGENTS)],
    }


def received_by(replicas: tuple[ServerProcess, ...], request_ids: list[str]) -> dict[str, list[str]]:
    """Request id -> the replicas whose log says they received it (vLLM's `Received request chatcmpl-<id>:`)."""
    logs = {r.name: r.log_text() for r in replicas}
    return {rid: [name for name, text in logs.items() if f"Received request chatcmpl-{rid}:" in text]
            for rid in request_ids}


@pytest.mark.anyio
async def test_every_turn_of_an_agent_reaches_one_worker_through_the_router(router: ServerProcess, replicas):
    with CachedTokens(router.root_url) as proxy:
        engine = engine_for(fleet_config(proxy.base_url, replicas))
        code, seen = await run_engine(engine, timeout_s=900)
    assert code == 0, [e for e in seen if e.kind in ("AgentKilled", "AgentFinished") and e.status != "completed"]
    started = [e for e in seen if e.kind == "AgentStarted"]
    assert len(started) == AGENTS * TURNS and all(e.request_id for e in started)
    where = received_by(replicas, [e.request_id for e in started])
    assert all(len(names) == 1 for names in where.values()), where  # each request reached exactly one replica
    by_agent: dict[str, set[str]] = defaultdict(set)
    for e in started:
        by_agent[e.agent].update(where[e.request_id])
    assert {agent: len(names) for agent, names in by_agent.items()} == dict.fromkeys(by_agent, 1), by_agent

    # and the replica reused the conversation it already held: prefix-cache hits on every later turn
    assert set(proxy.cached) == set(by_agent)
    for agent, cached in proxy.cached.items():
        assert len(cached) == TURNS, (agent, cached)
        assert all(tokens > 0 for tokens in cached[1:]), (agent, cached)

    # the run read both replicas behind the router, as the load pane shows them
    samples = [e for e in seen if e.kind == "ServerSample"]
    assert samples and all([w["url"] for w in s.workers] == [r.root_url for r in replicas] for s in samples)
    assert all(s.healthy and all(w["healthy"] for w in s.workers) for s in samples), samples[-1]
    assert all(s.kv_cache_tokens == sum(w["kv_cache_tokens"] for w in s.workers) for s in samples)
    assert any(s.prefix_hit_rate for s in samples), "no sample saw the replicas' prefix hits"


@pytest.mark.anyio
async def test_a_kill_through_the_router_aborts_the_request_on_its_worker(router: ServerProcess, replicas):
    engine = engine_for({
        "endpoints": [{"name": "fleet", "base_url": router.base_url, "kind": "local", "model": MODEL,
                       "metrics_urls": [r.root_url for r in replicas]}],
        "agents": [{"name": "long", "prompt": "Write a very long story.", "max_tokens": 1900, "retries": 0}],
    })

    def on_event(event) -> None:
        if event.kind == "TokenDelta":
            engine.kill("long", "killed by the test")

    code, seen = await run_engine(engine, on_event)
    assert code == 1
    killed = [e for e in seen if e.kind == "AgentKilled"]
    assert len(killed) == 1 and killed[0].deadline == "operator"
    rid = next(e.request_id for e in seen if e.kind == "AgentStarted")
    worker = received_by(replicas, [rid])[rid]
    assert len(worker) == 1, f"request {rid} reached {worker}"
    replica = next(r for r in replicas if r.name == worker[0])
    aborted = f"Request chatcmpl-{rid} aborted"
    assert await until(lambda: aborted in replica.log_text(), 30), (
        f"{replica.name} did not log the abort ({aborted!r}):\n{replica.log_tail()}")
    assert await until(lambda: all(r.metric("vllm:num_requests_running") == 0 for r in replicas), 30)
    assert not re.search(rf"Request chatcmpl-{re.escape(rid)} aborted",
                         next(r for r in replicas if r is not replica).log_text())
