"""Routed endpoints: an endpoint that is a router lists its workers (`metrics_urls`), and the run reads each
worker's /health and /metrics for the load pane (ServerSample.workers) and for the busy check at a deadline.

The router here is a small TCP proxy on loopback, as a router is to its clients: /health answers, /metrics
does not speak for its workers (404 here; vllm-router passes its first worker's through), and each chat
request is forwarded whole to one worker (in turn) and its answer streamed back; the workers are
simulators. Nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from tests.conftest import free_port, http_head, read_request


class Router:
    """Forward each POST to the next worker in turn (one request per connection), answer /health itself,
    and 404 its /metrics. Records each request head."""

    def __init__(self, workers: list[SimServer]) -> None:
        self.ports = itertools.cycle([w.port for w in workers])
        self.heads: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader)
            self.heads.append(request.split(b"\r\n\r\n", 1)[0])
            if request.startswith(b"GET /health"):
                writer.write(http_head(200, "application/json", length=2) + b"{}")
            elif request.startswith(b"GET /metrics"):
                writer.write(http_head(404, "text/plain", length=0))
            else:
                await self._forward(request, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _forward(self, request: bytes, writer: asyncio.StreamWriter) -> None:
        head, body = request.split(b"\r\n\r\n", 1)
        lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", next(self.ports))
        up_writer.write(b"\r\n".join([*lines, b"connection: close"]) + b"\r\n\r\n" + body)
        await up_writer.drain()
        try:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            up_writer.close()

    async def __aenter__(self) -> Router:
        self._server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def routed_engine(router: Router, workers: list[str], *, agents: int, max_tokens: int, stall: dict | None = None,
                  api_key_env: str = "") -> Engine:
    return Engine(validate({
        "run": {"mode": "parallel", "max_concurrency": agents, "metrics_interval_s": 0.1},
        "stall": stall or {},
        "endpoints": [{"name": "fleet", "kind": "local", "base_url": router.base_url, "model": "sim-model",
                       "metrics_urls": workers, "api_key_env": api_key_env}],
        "agents": [{"name": f"a{i}", "prompt": f"p{i}", "max_tokens": max_tokens, "retries": 0}
                   for i in range(agents)],
    }))


class MetricsLess:
    """A worker that answers /health but has no /metrics; records each request head."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader)
            self.heads.append(request.split(b"\r\n\r\n", 1)[0])
            if request.startswith(b"GET /health"):
                writer.write(http_head(200, "application/json", length=2) + b"{}")
            else:
                writer.write(http_head(404, "text/plain", length=0))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the run's client closed a kept-alive connection without a request (at the run's end)
        finally:
            writer.close()


@pytest.mark.anyio
async def test_each_worker_behind_a_router_is_read_and_the_fleet_is_their_sum(monkeypatch):
    monkeypatch.setenv("FLEET_KEY", "sk-fleet-secret-1234")
    odd = MetricsLess()
    odd_server = await asyncio.start_server(odd.serve, "127.0.0.1", 0)
    odd_url = f"http://127.0.0.1:{odd_server.sockets[0].getsockname()[1]}"
    fast = SimSettings(tokens_per_s=25, ttft_s=0.05)
    try:
        async with SimServer(fast) as w1, SimServer(fast) as w2, Router([w1, w2]) as router:
            dead = f"http://127.0.0.1:{free_port()}"
            urls = [f"http://127.0.0.1:{w1.port}", f"http://127.0.0.1:{w2.port}/v1", odd_url, dead]
            engine = routed_engine(router, urls, agents=4, max_tokens=30, api_key_env="FLEET_KEY")
            seen = []
            engine.subscribe(seen.append)
            assert await engine.run() == 0
    finally:
        odd_server.close()
    samples = [e for e in seen if e.kind == "ServerSample"]
    assert samples and all([w.url for w in s.workers] == urls for s in samples)  # in config order
    assert all(s.workers[3].detail == "health: connection refused" for s in samples)
    # (a read that timed out, on a box busy enough, makes a sample short of that worker: not these)
    samples = [s for s in samples if all(w.healthy for w in s.workers[:3])]
    assert samples
    for s in samples:  # the fleet's figures are its workers' together, from the same reads
        assert s.running == sum(w.running or 0 for w in s.workers)
        assert s.waiting == sum(w.waiting or 0 for w in s.workers)
        assert s.kv_cache_tokens == s.workers[0].kv_cache_tokens + s.workers[1].kv_cache_tokens
        assert s.healthy and s.server_kind == "vllm"  # the router answers and workers are up
        assert s.detail == "1 of 4 workers down"
        assert [w.healthy for w in s.workers] == [True, True, True, False]
        assert s.workers[2].detail == "metrics: HTTP 404" and s.workers[2].running is None
    # the router spread the 4 agents over both workers: each was seen busy
    assert any(s.workers[0].running for s in samples) and any(s.workers[1].running for s in samples)
    # the router's /metrics was never asked; the key went to the endpoint, never to a worker
    assert not any(h.startswith(b"GET /metrics") for h in router.heads)
    assert any(b"Bearer sk-fleet-secret-1234" in h for h in router.heads if h.startswith(b"POST"))
    assert odd.heads and not any(b"sk-fleet-secret" in h for h in odd.heads)


@pytest.mark.parametrize("listed", [True, False], ids=["workers-listed", "router-only"])
@pytest.mark.anyio
async def test_the_busy_check_reads_the_workers_queues(listed: bool):
    """Each worker runs one sequence at a time: the other requests wait in its queue. At the first-byte
    deadline only the workers' /metrics can say so; the router's cannot, so without `metrics_urls` the
    waiting agents are killed."""
    slow = SimSettings(max_num_seqs=1, tokens_per_s=60, ttft_s=0.05)
    async with SimServer(slow) as w1, SimServer(slow) as w2, Router([w1, w2]) as router:
        urls = [f"http://127.0.0.1:{w1.port}", f"http://127.0.0.1:{w2.port}"] if listed else []
        engine = routed_engine(router, urls, agents=4, max_tokens=30, stall={
            "first_byte_timeout_s": 0.4, "idle_timeout_s": 5.0, "extend_s": 0.4, "max_extensions": 20})
        seen = []
        engine.subscribe(seen.append)
        code = await engine.run()
    extended = [e for e in seen if e.kind == "StallExtended"]
    killed = [e for e in seen if e.kind == "AgentKilled"]
    if listed:
        assert code == 0 and not killed, [(k.agent, k.reason) for k in killed]
        assert extended and all("waiting" in e.reason for e in extended)
    else:
        assert code == 1 and not extended
        assert killed and all(k.deadline == "first_byte" for k in killed)


def test_workers_combined_sum_counts_and_capacity_and_take_the_fullest_kv():
    from cerevisor_tui.endpoints.metrics import MetricsSnapshot, combine

    a = MetricsSnapshot("vllm", requests_running=2, requests_waiting=0, kv_cache_usage=0.3, prefix_cache_queries=100.0,
                        prefix_cache_hits=90.0, kv_cache_size_tokens=4096, models=("tiny",))
    b = MetricsSnapshot("vllm", requests_running=1, requests_waiting=3, kv_cache_usage=0.8, kv_cache_size_tokens=4096,
                        models=("tiny", "other"))
    fleet = combine([a, b])
    assert fleet is not None
    assert (fleet.requests_running, fleet.requests_waiting, fleet.kv_cache_usage) == (3, 3, 0.8)
    assert (fleet.kv_cache_size_tokens, fleet.prefix_cache_queries, fleet.models) == (8192, 100.0, ("tiny", "other"))
    assert fleet.preemptions is None  # none of them reports it: unknown, not 0
    assert fleet.busy_reason() == "server busy: 3 requests waiting"
    assert combine([]) is None


@pytest.mark.anyio
async def test_the_fleet_is_down_with_its_router_or_all_its_workers_and_loading_while_they_all_load():
    from cerevisor_tui.endpoints.client import build_client
    from cerevisor_tui.endpoints.metrics import read_routed

    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    async with SimServer(SimSettings()) as up, SimServer(SimSettings(cold_start_s=60)) as loading, \
            build_client(4) as client:
        up_url, loading_url = f"http://127.0.0.1:{up.port}", f"http://127.0.0.1:{loading.port}"

        # the router does not answer: the fleet is unreachable, yet its workers' queues are still read
        routed = await read_routed(client, f"{dead[0]}/v1", client, [up_url])
        assert not routed.fleet.reachable and routed.fleet.error == "router health: connection refused"
        assert routed.fleet.metrics is not None and routed.fleet.metrics.kind == "vllm"
        assert [w.reachable for w in routed.workers] == [True]

        # the router answers (a simulator stands in), every worker that answers is loading: loading, not down
        routed = await read_routed(client, up.base_url, client, [loading_url, dead[1]])
        assert routed.fleet.loading and routed.fleet.busy_reason == "server loading model"
        assert routed.fleet.error == "2 of 2 workers down"

        # no worker answers at all: the router's 200 does not make the fleet healthy
        routed = await read_routed(client, up.base_url, client, dead)
        assert routed.fleet.reachable and not routed.fleet.loading and routed.fleet.health_status == 503
        assert routed.fleet.error == "2 of 2 workers down" and routed.fleet.metrics is None


def test_metrics_urls_are_checked_where_the_config_says_them():
    from cerevisor_tui.config import ConfigError

    def problem(**endpoint) -> str:
        with pytest.raises(ConfigError) as caught:
            validate({"endpoints": [{"name": "fleet", "base_url": "http://10.0.0.20:8080/v1", **endpoint}]},
                     file="fleet.toml")
        return str(caught.value)

    assert problem(metrics_urls=["http://10.0.0.21:8000", "10.0.0.22:8000"]) == (
        "fleet.toml: endpoints[0] (fleet).metrics_urls: [1] '10.0.0.22:8000': must start with http:// or https://")
    assert "a worker is listed twice" in problem(metrics_urls=["http://10.0.0.21:8000"] * 2)
    assert 'metrics_urls are read only on a kind "local" endpoint' in problem(
        kind="hosted", metrics_urls=["http://10.0.0.21:8000"])
