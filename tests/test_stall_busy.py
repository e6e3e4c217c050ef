"""The server-busy extension: at a deadline, requests waiting in the server's own queue extend it."""

from __future__ import annotations

import asyncio

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer


def engine_for(url: str, *, max_extensions: int, busy: bool = True, extend_s: float = 0.5,
               idle_timeout_s: float = 2.0) -> Engine:
    return Engine(validate({
        "run": {"mode": "parallel", "max_concurrency": 3, "metrics_interval_s": 0.2},
        "stall": {"first_byte_timeout_s": 0.5, "idle_timeout_s": idle_timeout_s, "extend_s": extend_s,
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
    # extensions of 1 s and an idle deadline of 10 s: on a loaded host the simulator slows with it (the queued
    # agent waits longer than the 1 s the model takes), and no agent is ever silent once it streams
    async with SimServer(SimSettings(max_num_seqs=1, tokens_per_s=60, ttft_s=0.05)) as srv:
        engine = engine_for(srv.base_url, max_extensions=10, extend_s=1.0, idle_timeout_s=10.0)
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0, [e for e in seen if e.kind in ("AgentKilled", "AgentFinished")]
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


class _QuietServer:
    """/health 200, /metrics with an empty vLLM queue (or 404), and a stream that stops after one token;
    counts the reads of /metrics."""

    def __init__(self, metrics: bool) -> None:
        self.metrics = metrics
        self.metrics_reads = 0

    def metrics_body(self) -> bytes:
        return (b'vllm:num_requests_running{model_name="m"} 1.0\n'
                b'vllm:num_requests_waiting{model_name="m"} 0.0\n') if self.metrics else b""

    async def before_token(self) -> None:
        pass

    async def serve(self, reader, writer) -> None:
        from tests.conftest import chunk, http_head, read_request, sse_chunk

        try:
            request = await read_request(reader)
            if request.startswith(b"GET /metrics"):
                self.metrics_reads += 1
                body = self.metrics_body()
                writer.write(http_head(200 if self.metrics else 404, "text/plain", length=len(body)) + body)
            elif request.startswith(b"GET"):
                writer.write(http_head(200, "application/json", length=2) + b"{}")
            else:
                writer.write(http_head(200, "text/event-stream"))
                await writer.drain()
                await self.before_token()
                writer.write(chunk(sse_chunk("one")))
                await writer.drain()
                await reader.read()  # silent until the client gives up
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("metrics", [True, False], ids=["fresh-sample-not-busy", "no-metrics"])
@pytest.mark.anyio
async def test_a_fresh_not_busy_sample_answers_the_deadline_without_a_new_read(metrics: bool):
    """The monitor read /metrics at the start (every 30 s after): at the 1 s idle deadline, a sample that
    says 'no queue' and is fresh enough answers at once; without metrics the watchdog asks afresh."""
    quiet = _QuietServer(metrics)
    server = await asyncio.start_server(quiet.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        engine = Engine(validate({
            "run": {"metrics_interval_s": 30.0},
            "stall": {"first_byte_timeout_s": 5.0, "idle_timeout_s": 1.0, "extend_when_server_busy": True},
            "endpoints": [{"name": "box", "kind": "local", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}],
            "agents": [{"name": "a", "prompt": "p", "retries": 0}],
        }))
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    finally:
        server.close()
    killed = [e for e in seen if e.kind == "AgentKilled"]
    assert len(killed) == 1 and killed[0].deadline == "idle"
    assert quiet.metrics_reads == (1 if metrics else 2)


class _WaitingAtTheStartServer(_QuietServer):
    """/metrics says one request waits on its first read and none after; the answer's one token is sent only
    once the run has taken that sample in, then the stream is silent: the queue it saw was over before the
    silence."""

    def __init__(self) -> None:
        super().__init__(metrics=True)
        self.sampled = lambda: False  # whether the run has taken in that first sample (set by the test)

    def metrics_body(self) -> bytes:
        waiting = b"1.0" if self.metrics_reads == 1 else b"0.0"
        return (b'vllm:num_requests_running{model_name="m"} 0.0\n'
                b'vllm:num_requests_waiting{model_name="m"} ' + waiting + b"\n")

    async def before_token(self) -> None:
        while not self.sampled():  # the test's own loop: the sample is taken in before the token is sent
            await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_a_queue_seen_before_the_last_token_does_not_extend_the_silence_after_it():
    """The monitor's first sample said '1 waiting' (our own request, before its first token); at the idle
    deadline that sample is recent but older than the silence, so the watchdog asks afresh, hears no queue,
    and kills. (It once extended such a deadline by the stale sample: a flaky test_cli stall test.)"""
    server_state = _WaitingAtTheStartServer()
    server = await asyncio.start_server(server_state.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        engine = Engine(validate({
            "run": {"metrics_interval_s": 30.0},
            "stall": {"first_byte_timeout_s": 5.0, "idle_timeout_s": 1.0, "extend_when_server_busy": True,
                      "extend_s": 0.5, "max_extensions": 1},
            "endpoints": [{"name": "box", "kind": "local", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}],
            "agents": [{"name": "a", "prompt": "p", "retries": 0}],
        }))
        seen = []
        engine.subscribe(seen.append)
        server_state.sampled = lambda: any(e.kind == "ServerSample" for e in seen)
        assert await engine.run() == 1
    finally:
        server.close()
    assert not [e for e in seen if e.kind == "StallExtended"]
    killed = [e for e in seen if e.kind == "AgentKilled"]
    assert len(killed) == 1 and killed[0].deadline == "idle"
    assert any(e.kind == "ServerSample" and e.waiting == 1 for e in seen)  # the queue was seen, at the start
    assert server_state.metrics_reads == 2  # and asked again at the deadline
