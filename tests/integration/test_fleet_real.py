"""A fleet of real servers: two vLLM (CPU) replicas of the tiny model, placed on by the run itself as one
`[[pools]]` table, and behind vLLM's own router (`vllm-router --policy consistent_hash`, which keeps a
session on one worker by its X-Session-ID header).

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

from tests.conftest import until
from tests.integration import servers
from tests.integration.checks import engine_for, killed_where_vllm_could_act, run_engine
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
        "run": {"warmup": "off", "mode": "parallel", "max_concurrency": AGENTS, "metrics_interval_s": 0.5},
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

    # the run read both replicas behind the router, as the load pane shows them (a read that timed out on a
    # busy box makes a sample without that worker's numbers: the figures are checked on the complete ones)
    samples = [e for e in seen if e.kind == "ServerSample"]
    assert samples and all([w.url for w in s.workers] == [r.root_url for r in replicas] for s in samples)
    complete = [s for s in samples if all(w.healthy and w.kv_cache_tokens for w in s.workers)]
    assert complete, samples[-1]
    assert all(s.healthy and s.kv_cache_tokens == sum(w.kv_cache_tokens for w in s.workers) for s in complete)
    assert all(s.running == sum(w.running for w in s.workers) for s in complete)
    assert any(s.prefix_hit_rate for s in samples), "no sample saw the replicas' prefix hits"


@pytest.mark.anyio
async def test_a_kill_through_the_router_aborts_the_request_on_its_worker(router: ServerProcess, replicas):
    _, seen, ran_out = await killed_where_vllm_could_act(replicas, {
        "endpoints": [{"name": "fleet", "base_url": router.base_url, "kind": "local", "model": MODEL,
                       "metrics_urls": [r.root_url for r in replicas]}],
        "agents": [{"name": "long", "prompt": "Write a very long story.", "max_tokens": 1900, "retries": 0}],
    })
    rid = next(e.request_id for e in seen if e.kind == "AgentStarted")
    worker = received_by(replicas, [rid])[rid]
    assert len(worker) == 1, f"request {rid} reached {worker}"
    replica = next(r for r in replicas if r.name == worker[0])
    aborted = f"Request chatcmpl-{rid} aborted"
    await until(lambda: aborted in replica.log_text(),
                lambda: f"{replica.name} to log the abort ({aborted!r}; {ran_out}):\n{replica.log_tail()}",
                timeout=30, interval=0.2)
    assert not re.search(rf"Request chatcmpl-{re.escape(rid)} aborted",
                         next(r for r in replicas if r is not replica).log_text())

def pool_config(replicas: tuple[ServerProcess, ...], *, max_tokens: int, retries: int = 0) -> dict:
    return {
        "run": {"warmup": "off", "mode": "parallel", "max_concurrency": AGENTS, "metrics_interval_s": 0.5},
        "stall": {"first_byte_timeout_s": 300.0, "idle_timeout_s": 120.0},
        "endpoints": [{"name": r.name, "base_url": r.base_url, "kind": "local", "model": MODEL} for r in replicas],
        "pools": [{"name": "replicas", "endpoints": [r.name for r in replicas]}],
        "agents": [{"name": f"agent{i}", "endpoint": "replicas", "prompt": _long_prompt(i), "max_tokens": max_tokens,
                    "retries": retries, "turns": ["Go on.", "Sum it up."]} for i in range(AGENTS)],
    }


@pytest.mark.anyio
async def test_a_pool_of_two_replicas_keeps_each_agent_on_one_and_spreads_them(replicas):
    served_before = {r.name: r.metric("vllm:request_success_total") for r in replicas}
    engine = engine_for(pool_config(replicas, max_tokens=16))
    code, seen = await run_engine(engine, timeout_s=900)
    assert code == 0, [e for e in seen if e.kind == "AgentFinished" and e.status != "completed"]
    started = [e for e in seen if e.kind == "AgentStarted"]
    assert len(started) == AGENTS * TURNS
    where = received_by(replicas, [e.request_id for e in started])
    on: dict[str, set[str]] = defaultdict(set)
    for e in started:
        assert where[e.request_id] == [e.endpoint], (e.request_id, e.endpoint, where[e.request_id])  # sent where told
        on[e.agent].add(e.endpoint)
    assert all(len(members) == 1 for members in on.values()), on  # every turn of an agent on one replica
    agents_on = {r.name: sum(1 for members in on.values() if r.name in members) for r in replicas}
    assert min(agents_on.values()) > 0 and max(agents_on.values()) <= 1.5 * min(agents_on.values()), agents_on
    # each replica's own count of the requests it served: three turns of each of its agents
    served = {r.name: r.metric("vllm:request_success_total") - served_before[r.name] for r in replicas}
    assert served == {name: TURNS * n for name, n in agents_on.items()}, (served, agents_on)
    placed = [e for e in seen if e.kind == "AgentPlaced"]
    assert len(placed) == AGENTS and not any(e.moved_from for e in placed)


@pytest.mark.anyio
async def test_a_replica_killed_mid_run_has_its_agents_placed_again_and_they_complete(pool: Pool, replicas):
    """Runs last in this module: it kills replica-b (SIGKILL, its whole process group) once one of its agents
    has finished a turn, while the others are mid-answer. Each of its agents moves to replica-a at its next
    attempt and completes there. A later test that needs replica-b gets a fresh one from the pool."""
    a, b = replicas
    engine = engine_for(pool_config(replicas, max_tokens=200, retries=2))
    on: dict[str, str] = {}
    killed_at: list[float] = []

    def on_event(event) -> None:
        if event.kind == "AgentPlaced":
            on[event.agent] = event.endpoint
        elif event.kind == "TurnFinished" and on.get(event.agent) == b.name and not killed_at:
            b.kill()
            killed_at.append(event.t)

    code, seen = await run_engine(engine, on_event, timeout_s=900)
    assert killed_at, "no agent of replica-b finished a turn"
    assert code == 0, [(e.agent, e.status, e.error) for e in seen if e.kind == "AgentFinished"]
    moved = [e for e in seen if e.kind == "AgentPlaced" and e.moved_from]
    assert moved and all(e.moved_from == b.name and e.endpoint == a.name and "prefix" in e.reason for e in moved)
    after = [e for e in seen if e.kind == "AgentStarted" and e.t > killed_at[0]]
    on_b = {e.agent for e in seen if e.kind == "AgentPlaced" and e.endpoint == b.name and not e.moved_from}
    unfinished = {e.agent for e in after} & on_b
    assert unfinished and unfinished <= {e.agent for e in moved}  # every agent of b still running was moved
    # and replica-a received their turns after the move
    moved_requests = [e.request_id for e in after if e.agent in unfinished and e.endpoint == a.name]
    assert moved_requests and all(received_by((a,), [rid])[rid] == [a.name] for rid in moved_requests)
    statuses = {e.agent: e.status for e in seen if e.kind == "AgentFinished"}
    assert statuses == {f"agent{i}": "completed" for i in range(AGENTS)}
