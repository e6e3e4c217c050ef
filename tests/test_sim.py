"""The simulator over real loopback HTTP: API shapes, scheduling, cold start, faults, disconnects, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import anyio
import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import SimServer, start_in_thread
from tests.conftest import until

pytestmark = pytest.mark.anyio

FAST = dict(tokens_per_s=400.0, ttft_s=0.0)


def chat_body(content: str = "hello there", max_tokens: int | None = 8, stream: bool = True, **extra) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content}], "stream": stream, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_lines(client: httpx.AsyncClient, url: str, body: dict) -> list[str]:
    async with client.stream("POST", url + "/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return [line async for line in r.aiter_lines() if line]


def contents(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data: {") and "broken" not in line:
            obj = json.loads(line[6:])
            for c in obj["choices"]:
                if "content" in c["delta"] and c["delta"]["content"]:
                    out.append(c["delta"]["content"])
    return out


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert found, f"{name} not in metrics"
    return float(found[1])


async def test_stream_shape_usage_and_plain_response_agree():
    async with SimServer(SimSettings(**FAST, seed=7)) as srv, httpx.AsyncClient() as client:
        lines = await stream_lines(client, srv.base_url, chat_body(max_tokens=6))
        first = json.loads(lines[0][6:])
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][6:])
        assert usage["choices"] == []
        final = json.loads(lines[-3][6:])
        assert final["choices"][0]["finish_reason"] == "length"
        words = contents(lines)
        assert len(words) == 6
        assert usage["usage"]["completion_tokens"] == 6
        assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6

        r = await client.post(srv.base_url + "/chat/completions", json=chat_body(max_tokens=6, stream=False))
        whole = r.json()
        assert whole["object"] == "chat.completion"
        assert whole["choices"][0]["message"]["content"] == "".join(words)
        assert whole["usage"] == usage["usage"]

        # No max_tokens: the default length, and the model "stops" by itself.
        lines = await stream_lines(client, srv.base_url, chat_body(max_tokens=None))
        assert len(contents(lines)) == 128
        assert json.loads(lines[-3][6:])["choices"][0]["finish_reason"] == "stop"


async def test_health_models_and_vllm_errors():
    async with SimServer(SimSettings(**FAST, max_model_len=100), model="m1") as srv, httpx.AsyncClient() as c:
        assert (await c.get(srv.root_url + "/health")).status_code == 200
        models = (await c.get(srv.base_url + "/models")).json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "m1"
        assert models["data"][0]["owned_by"] == "cerevisor-sim"
        assert models["data"][0]["max_model_len"] == 100
        r = await c.post(srv.base_url + "/chat/completions", json=chat_body(model="nope"))
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The model `nope` does not exist."
        r = await c.post(srv.base_url + "/chat/completions", json={**chat_body(max_tokens=99), "model": "m1"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "maximum context length is 100 tokens" in err["message"]


async def test_same_seed_same_text_other_seed_other_text():
    async def text(seed: int, prompt: str) -> str:
        async with SimServer(SimSettings(**FAST, seed=seed)) as srv, httpx.AsyncClient() as c:
            r = await c.post(srv.base_url + "/chat/completions", json=chat_body(prompt, 12, stream=False))
            return r.json()["choices"][0]["message"]["content"]

    a = await text(1, "plan the release")
    assert a == await text(1, "plan the release")
    assert a != await text(2, "plan the release")
    assert a != await text(1, "plan the migration")


async def test_max_num_seqs_caps_running_and_queues_the_rest():
    settings = SimSettings(tokens_per_s=50.0, ttft_s=0.0, max_num_seqs=4)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        seen: list[tuple[float, float]] = []

        async def sample() -> None:
            for _ in range(40):
                m = (await c.get(srv.root_url + "/metrics")).text
                seen.append((metric(m, "vllm:num_requests_running"), metric(m, "vllm:num_requests_waiting")))
                if seen[-1] == (4.0, 8.0):
                    return
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(stream_lines, c, srv.base_url, chat_body(f"task {i}", 5))
            await anyio.sleep(0.02)
            tg.start_soon(sample)
        assert max(r for r, _ in seen) == 4
        assert (4.0, 8.0) in seen
        assert srv.state.max_running_seen == 4
        assert srv.state.running == 0 and srv.state.waiting == 0
        assert srv.state.requests_total == 12


async def test_cold_start_answers_503_then_serves_the_held_request():
    async with SimServer(SimSettings(**FAST, cold_start_s=0.4)) as srv, httpx.AsyncClient() as c:
        r = await c.get(srv.root_url + "/health")
        assert r.status_code == 503
        lines = await stream_lines(c, srv.base_url, chat_body(max_tokens=3))
        # held until the cold start ended, however long the 503 above took on a loaded machine
        assert time.monotonic() - srv.state.started_at >= 0.4
        assert lines[-1] == "data: [DONE]"
        assert (await c.get(srv.root_url + "/health")).status_code == 200


async def test_stall_keeps_alive_and_holds_the_slot():
    settings = SimSettings(**FAST, stall_after_tokens=3, keepalive_s=0.05)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        got: list[str] = []
        with anyio.move_on_after(0.6):
            async with c.stream("POST", srv.base_url + "/chat/completions", json=chat_body(max_tokens=20)) as r:
                async for line in r.aiter_lines():
                    if line:
                        got.append(line)
        assert len(contents(got)) == 3
        assert got.count(": keep-alive") >= 4
        assert "data: [DONE]" not in got
        await until(lambda: srv.state.running == 0, "closing the stream to free the stalled request")
        assert srv.state.aborted_total == 1


async def test_keepalive_while_waiting_in_queue():
    settings = SimSettings(tokens_per_s=40.0, ttft_s=0.0, max_num_seqs=1, keepalive_s=0.05)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_lines, c, srv.base_url, chat_body("first", 10))
            await until(lambda: srv.state.running == 1, "the first request to run")
            lines = await stream_lines(c, srv.base_url, chat_body("second", 2))
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert lines[:first_data].count(": keep-alive") >= 2


async def test_drop_cuts_the_connection_without_done():
    async with SimServer(SimSettings(**FAST, drop_after_tokens=3)) as srv, httpx.AsyncClient() as c:
        got: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with c.stream("POST", srv.base_url + "/chat/completions", json=chat_body(max_tokens=10)) as r:
                async for line in r.aiter_lines():
                    got.append(line)
        assert len(contents(got)) == 3
        assert "data: [DONE]" not in got
        assert srv.state.running == 0
        assert srv.state.dropped_total == 1


async def test_fail_first_with_429_and_retry_after():
    async with SimServer(SimSettings(**FAST, fail_first=2, fail_status=429)) as srv, httpx.AsyncClient() as c:
        for _ in range(2):
            r = await c.post(srv.base_url + "/chat/completions", json=chat_body(stream=False))
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await c.post(srv.base_url + "/chat/completions", json=chat_body(stream=False))
        assert r.status_code == 200


async def test_malformed_chunk_after_n_tokens():
    async with SimServer(SimSettings(**FAST, malformed_after_tokens=2)) as srv, httpx.AsyncClient() as c:
        lines = await stream_lines(c, srv.base_url, chat_body(max_tokens=5))
        bad = lines.index('data: {"id": broken')
        assert len(contents(lines[:bad])) == 2
        assert len(contents(lines)) == 5
        assert lines[-1] == "data: [DONE]"


async def test_client_disconnect_frees_the_slot_within_a_second():
    async with SimServer(SimSettings(tokens_per_s=50.0, ttft_s=0.0)) as srv, httpx.AsyncClient() as c:
        async with c.stream("POST", srv.base_url + "/chat/completions", json=chat_body(max_tokens=1000)) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data:")
                if n >= 3:
                    break
            assert srv.state.running == 1
        await until(lambda: srv.state.running == 0, "closing the stream to free the request")
        assert srv.state.aborted_total == 1
        m = (await c.get(srv.root_url + "/metrics")).text
        assert metric(m, "cerevisor_sim:aborted_requests_total") == 1


async def test_speed_scales_time():
    """Each duration is the shortest of three requests: a loaded host only ever adds to a wall-clock time."""
    async def duration(speed: float) -> float:
        settings = SimSettings(tokens_per_s=80.0, ttft_s=0.05, speed=speed)
        took = []
        async with SimServer(settings) as srv, httpx.AsyncClient() as c:
            for _ in range(3):
                started = time.monotonic()
                await c.post(srv.base_url + "/chat/completions", json=chat_body(max_tokens=16, stream=False))
                took.append(time.monotonic() - started)
        return min(took)

    slow, fast = await duration(1.0), await duration(10.0)
    assert 0.22 < slow < 0.45  # 0.05 s TTFT + 16 tokens at 80/s
    # 10x nominally (0.025 s); a loaded machine adds fixed HTTP overhead, so only ask for a clear speed-up
    assert fast < slow / 2.5


async def test_many_streams_at_once_and_batch_slowdown():
    settings = SimSettings(tokens_per_s=100.0, ttft_s=0.0, max_num_seqs=256, speed=4.0)
    async with SimServer(settings) as srv, httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as c:
        results: list[int] = []

        async def one(i: int) -> None:
            results.append(len(contents(await stream_lines(c, srv.base_url, chat_body(f"agent {i}", 20)))))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in range(120):
                tg.start_soon(one, i)
        took = time.monotonic() - started
        assert results == [20] * 120
        assert srv.state.max_running_seen > 100
        # 20 tokens at 100/s / 4 = 0.05 s alone; a batch of ~120 decodes ~3.4x slower per sequence.
        assert took > 0.1


async def test_metrics_have_vllm_names_and_cache_config():
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        body = chat_body("x" * 400, 4, stream=False)
        for _ in range(2):
            await c.post(srv.base_url + "/chat/completions", json=body)
        m = (await c.get(srv.root_url + "/metrics")).text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            metric(m, name)
        assert metric(m, "vllm:generation_tokens_total") == 8
        assert metric(m, "vllm:prefix_cache_hits_total") > 0  # the second request reused the first's blocks
        assert metric(m, "vllm:prefix_cache_queries_total") >= metric(m, "vllm:prefix_cache_hits_total")
        info = re.search(r"^vllm:cache_config_info\{(.*)\} 1\.0$", m, re.M)
        assert info and 'block_size="16"' in info[1] and "num_gpu_blocks=" in info[1]
        assert 'model_name="sim-model"' in m


def test_start_in_thread_records_the_bearer_key():
    handle = start_in_thread(SimSettings(**FAST))
    try:
        r = httpx.post(handle.base_url + "/chat/completions", json=chat_body(stream=False),
                       headers={"Authorization": "Bearer sk-test-123", "X-Cerevisor-Agent": "alice"})
        assert r.status_code == 200
        assert handle.state.requests[-1]["authorization"] == "Bearer sk-test-123"
        assert handle.state.requests_by_agent["alice"] == 1
    finally:
        handle.stop()


def test_cli_serves_health_and_stops_on_sigint():
    proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "sim", "--port", "0", "--speed", "5"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stderr.readline()
        assert "(SIMULATED" in line
        url = re.search(r"on (http://\S+/v1)", line)[1]
        assert httpx.get(url[:-3] + "/health").status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_port_in_use_and_bad_option_exit_2():
    async def main() -> None:
        async with SimServer(SimSettings()) as srv:
            out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cerevisor_tui", "sim",
                                                           "--port", str(srv.port)], capture_output=True, text=True)
            assert out.returncode == 2
            assert "port already in use" in out.stderr and "Traceback" not in out.stderr

    asyncio.run(main())
    out = subprocess.run([sys.executable, "-m", "cerevisor_tui", "sim", "--max-num-seqs", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--max-num-seqs" in out.stderr


async def test_accepted_connections_get_tcp_nodelay():
    """bind_socket (the simulator's and the gateway's listening socket) says TCP in its proto, so asyncio sets
    TCP_NODELAY on what it accepts: without it uvicorn's headers and first body chunk wait out the client's
    delayed ACK, 40 ms on every streamed answer."""
    import socket

    from cerevisor_tui.sim.server import bind_socket

    accepted: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handler, sock=bind_socket())
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        await reader.read()  # the server closed it: the handler has run
        writer.close()
    assert accepted and accepted[0] != 0
