"""The server metrics reader: parsing real /metrics scrapes (fixtures) and reading a server over HTTP.

Fixtures in tests/fixtures/metrics/ are real text: vLLM 0.32 and llama.cpp scraped here from the peer
servers (/work/shared/peers), the others quoted from the public sources named in their first lines.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from cerevisor_tui.endpoints.client import build_client
from cerevisor_tui.endpoints.metrics import (
    MetricsSnapshot,
    ServerStatus,
    detect_kind,
    parse_metrics,
    parse_slots,
    prefix_hit_rate,
    read_server,
    server_root,
)

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def fixture(name: str) -> MetricsSnapshot:
    return parse_metrics((FIXTURES / name).read_text())


def test_every_metrics_fixture_names_its_source():
    for path in sorted(FIXTURES.glob("*.txt")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("#") and ("Source" in first or "Scraped" in first), path.name


# --- vLLM -------------------------------------------------------------------------------------------


def test_vllm_idle():
    m = fixture("vllm-0.32-idle.txt")
    assert m.kind == "vllm"
    assert (m.requests_running, m.requests_waiting, m.kv_cache_usage, m.preemptions) == (0, 0, 0.0, 0)
    assert (m.num_gpu_blocks, m.block_size, m.kv_cache_size_tokens) == (8192, 128, 1048576)
    assert m.models == ("tiny",)
    assert m.busy_reason() is None


def test_vllm_running_counts_prefix_cache_tokens():
    m = fixture("vllm-0.32-running.txt")
    assert m.requests_running == 3
    assert m.kv_cache_usage == pytest.approx(0.0013429373702844583)
    # Counters are exposed as vllm:prefix_cache_queries_total; the parser files them under the family
    # vllm:prefix_cache_queries, and the _created timestamps must not be summed in.
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (3371.0, 2560.0)


def test_vllm_under_pressure_is_busy():
    m = fixture("vllm-0.32-pressure.txt")
    assert (m.requests_running, m.requests_waiting, m.preemptions) == (4, 4, 4)
    assert m.kv_cache_usage == pytest.approx(0.6451612903225806)
    assert (m.num_gpu_blocks, m.kv_cache_size_tokens) == (32, 4096)
    assert m.busy_reason() == "server busy: 4 requests waiting"


def test_vllm_older_metric_names():
    m = fixture("vllm-0.8-production-stack-318.txt")
    assert m.kind == "vllm"
    assert m.kv_cache_usage == 0.0  # from vllm:gpu_cache_usage_perc
    assert (m.requests_running, m.requests_waiting) == (0, 0)
    assert m.preemptions is None and m.kv_cache_size_tokens is None  # not in the sample: None, not 0


def test_prefix_hit_rate_between_snapshots():
    idle, running = fixture("vllm-0.32-idle.txt"), fixture("vllm-0.32-running.txt")
    assert prefix_hit_rate(idle, running) == pytest.approx(2560 / 3371)
    assert prefix_hit_rate(running, running) is None  # nothing queried in between
    assert prefix_hit_rate(None, running) == pytest.approx(2560 / 3371)
    # A server restart resets the counters: the new values count from zero.
    restarted = MetricsSnapshot(kind="vllm", prefix_cache_queries=100.0, prefix_cache_hits=25.0)
    assert prefix_hit_rate(running, restarted) == pytest.approx(0.25)


def test_sums_over_engines_and_models_takes_max_usage():
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 0.0
vllm:num_requests_waiting{engine="1",model_name="a"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="a"} 2.0
vllm:num_preemptions_created{engine="0",model_name="a"} 1.7e9
vllm:num_preemptions_total{engine="1",model_name="a"} 5.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"""
    m = parse_metrics(text)
    assert (m.requests_running, m.requests_waiting, m.preemptions) == (5, 1, 7)
    assert m.kv_cache_usage == 0.75
    # Without kv_cache_size_tokens (older vLLM), tokens = blocks x block size, summed over engines.
    assert (m.num_gpu_blocks, m.block_size, m.kv_cache_size_tokens) == (2000, 16, 32000)
    assert m.busy_reason() == "server busy: 1 request waiting"


# --- SGLang, llama.cpp, others -------------------------------------------------------------------


def test_sglang_docs_sample():
    m = fixture("sglang-docs-llama-3.1-8b.txt")
    assert m.kind == "sglang"
    assert (m.requests_running, m.requests_waiting) == (162, 2826)
    assert m.kv_cache_usage == 0.28
    assert m.prefix_cache_hit_rate == pytest.approx(0.007507552643049313)
    assert prefix_hit_rate(None, m) == pytest.approx(0.007507552643049313)
    assert m.busy_reason() == "server busy: 2826 requests waiting"


def test_sglang_0_5_labels():
    m = fixture("sglang-0.5.1-issue-13485.txt")
    assert (m.kind, m.requests_running, m.kv_cache_usage) == ("sglang", 1, 0.0)
    assert m.requests_waiting is None  # the quoted lines stop before num_queue_reqs
    assert m.models == ("Qwen-32B",)


def test_llamacpp_scrape_has_requests_but_no_kv_gauge():
    busy = fixture("llamacpp-busy.txt")
    assert busy.kind == "llamacpp"
    assert (busy.requests_running, busy.requests_waiting) == (4, 2)  # 6 requests on 4 slots
    assert busy.kv_cache_usage is None
    assert busy.busy_reason() == "server busy: 2 requests waiting"
    idle = fixture("llamacpp-idle.txt")
    assert (idle.requests_running, idle.requests_waiting) == (0, 0)
    assert idle.busy_reason() is None


def test_llamacpp_prompt_cache_as_prefix_hit_rate():
    busy, after = fixture("llamacpp-busy.txt"), fixture("llamacpp-after.txt")
    # prompt_tokens_total excludes cached tokens: 136 -> 138 computed, 0 -> 66 reused.
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (138 + 66, 66)
    assert prefix_hit_rate(busy, after) == pytest.approx(66 / 68)


def test_llamacpp_slots():
    slots = parse_slots(json.loads((FIXTURES / "llamacpp-slots-busy.json").read_text()))
    assert slots is not None and (slots.total, slots.processing, slots.idle) == (4, 4, 0)
    idle = parse_slots(json.loads((FIXTURES / "llamacpp-slots-idle.json").read_text()))
    assert idle is not None and (idle.total, idle.processing) == (4, 0)
    assert parse_slots({"error": "nope"}) is None
    assert parse_slots([{"id": 0, "state": 1}, {"id": 1, "state": 0}]).processing == 1  # older field


def test_unknown_and_malformed_text():
    assert parse_metrics("# HELP x y\n# TYPE x gauge\nx 1\n").kind == "unknown"
    assert parse_metrics("").kind == "unknown"
    # A broken line ends the parse but keeps what came before it.
    text = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2\nthis is { not prometheus\n"
    assert parse_metrics(text).requests_waiting == 2
    assert detect_kind(["llamacpp:requests_processing", "process_cpu_seconds"]) == "llamacpp"


# --- reading a server -------------------------------------------------------------------------------


def test_server_root_drops_v1():
    assert server_root("http://h:8000/v1") == "http://h:8000"
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000") == "http://h:8000"


def transport(routes: dict[str, httpx.Response | Exception]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        route = routes.get(request.url.path)
        if isinstance(route, Exception):
            raise route
        return route if route is not None else httpx.Response(404, text="Not Found")

    return httpx.MockTransport(handle)


@pytest.mark.anyio
async def test_read_vllm_server_busy():
    routes = {"/health": httpx.Response(200), "/metrics": httpx.Response(200, text=(FIXTURES / "vllm-0.32-pressure.txt").read_text())}
    async with httpx.AsyncClient(transport=transport(routes)) as client:
        status = await read_server(client, "http://127.0.0.1:8031/v1")
    assert status.reachable and status.health_status == 200 and not status.loading
    assert status.kind == "vllm"
    assert status.busy and status.busy_reason == "server busy: 4 requests waiting"
    assert status.slots is None and status.error is None


@pytest.mark.anyio
async def test_read_llamacpp_loading_and_slots():
    # The body llama-server answered here while loading (fixture), on /health and /metrics alike.
    body = (FIXTURES / "llamacpp-health-loading.json").read_text()
    loading = {"/health": httpx.Response(503, text=body), "/metrics": httpx.Response(503, text=body)}
    async with httpx.AsyncClient(transport=transport(loading)) as client:
        status = await read_server(client, "http://127.0.0.1:8035/v1")
    assert status.loading and status.loading_message == "Loading model"
    assert status.busy_reason == "server loading model"
    assert status.metrics is None and "metrics: HTTP 503" in (status.error or "")

    ready = {"/health": httpx.Response(200, json={"status": "ok"}),
             "/metrics": httpx.Response(200, text=(FIXTURES / "llamacpp-busy.txt").read_text()),
             "/slots": httpx.Response(200, text=(FIXTURES / "llamacpp-slots-busy.json").read_text())}
    async with httpx.AsyncClient(transport=transport(ready)) as client:
        status = await read_server(client, "http://127.0.0.1:8035/v1")
    assert status.kind == "llamacpp" and status.slots is not None and status.slots.processing == 4
    assert status.busy_reason is not None and status.busy_reason.startswith("server busy:")


@pytest.mark.anyio
async def test_read_server_without_metrics_returns_what_it_has():
    routes = {"/health": httpx.Response(200)}  # /metrics: 404, as on a llama-server without --metrics
    async with httpx.AsyncClient(transport=transport(routes)) as client:
        status = await read_server(client, "http://127.0.0.1:9/v1")
    assert status.reachable and status.metrics is None and status.kind == "unknown"
    assert not status.busy and status.error == "metrics: HTTP 404"


@pytest.mark.anyio
async def test_read_server_never_raises_on_network_errors():
    refused = {"/health": httpx.ConnectError("refused")}
    async with httpx.AsyncClient(transport=transport(refused)) as client:
        status = await read_server(client, "http://127.0.0.1:9/v1")
    assert status == ServerStatus(base_url="http://127.0.0.1:9/v1", reachable=False, error="health: connection refused",
                                  refused=True)
    slow = {"/health": httpx.Response(200), "/metrics": httpx.ReadTimeout("slow")}
    async with httpx.AsyncClient(transport=transport(slow)) as client:
        status = await read_server(client, "http://127.0.0.1:9/v1", timeout_s=0.1)
    assert status.reachable and status.error == "metrics: timed out"


@pytest.mark.anyio
async def test_each_look_reads_the_server_afresh_through_one_client():
    """A look's GETs are built once per client and a text seen last time is not parsed again: over a real socket,
    numbers that move are read anew at each look, a text that stands still gives the same numbers, and every GET
    carries the client's key."""
    texts = [b"vllm:num_requests_waiting 1\n", b"vllm:num_requests_waiting 1\n", b"vllm:num_requests_waiting 3\n"]
    seen: list[tuple[bytes, bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                key = next((line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                            if line.lower().startswith(b"authorization:")), b"")
                seen.append((path, key))
                body = texts.pop(0) if path == b"/metrics" else b""
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, build_client(1, api_key="sk-look-test") as client:
        looks = [await read_server(client, f"http://127.0.0.1:{port}/v1") for _ in range(3)]
    assert [look.metrics.requests_waiting if look.metrics else None for look in looks] == [1, 1, 3]
    assert all(look.reachable and look.error is None for look in looks)
    assert seen == [(b"/health", b"Bearer sk-look-test"), (b"/metrics", b"Bearer sk-look-test")] * 3
