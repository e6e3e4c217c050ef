"""The warm-up and the latency panel against a real llama-server (4 slots, --metrics, the tiny GGUF model): its
cold start is measured before wave 1, its streams' `timings` and its decode counter are where we read them."""

from __future__ import annotations

import pytest

from tests.integration.checks import engine_for, run_engine
from tests.integration.servers import MODEL, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.anyio
async def test_llama_servers_warm_up_and_timings_fill_the_latency_panel(llama: ServerProcess, stream_process):
    engine = engine_for({
        "run": {"mode": "parallel", "max_concurrency": 4, "metrics_interval_s": 0.25, "warmup": "on"},
        "endpoints": [{"name": "llama", "base_url": llama.base_url, "model": MODEL}],
        "agents": [{"name": f"a{i}", "prompt": f"Count to {i + 3}.", "max_tokens": 16} for i in range(4)],
    }, stream_process=stream_process)
    engine.hold_open = True  # until the panel has every request's timings

    def on_event(e) -> None:
        if e.kind == "LatencySample" and e.prefill is not None and e.prefill.count >= 4:
            engine.stop("panel complete")

    _, seen = await run_engine(engine, on_event)
    warmed = [e for e in seen if e.kind == "EndpointWarmed"]
    assert len(warmed) == 1 and warmed[0].cold_start_s is not None, warmed
    first_sent = min(e.t for e in seen if e.kind == "AgentStarted")
    assert warmed[0].t <= first_sent
    panel = [e for e in seen if e.kind == "LatencySample" and e.prefill is not None][-1]
    # llama-server's last chunk carries `timings`: each request's prompt_ms and predicted_per_token_ms
    assert panel.source == "timings" and panel.prefill.count >= 4
    assert panel.inter_token is not None and panel.inter_token.p50_s > 0
    assert panel.ttft is not None and panel.queue is None
    # the decode counter the stall line reads is one llama-server exports
    assert llama.metric("llamacpp:n_decode_total") > 0
    report = engine.report.to_dict()["endpoints"][0]
    assert report["cold_start_s"] == warmed[0].cold_start_s and report["latency"]["source"] == "timings"


@pytest.mark.anyio
async def test_vllms_histograms_fill_the_latency_panel(vllm_server: ServerProcess):
    engine = engine_for({
        "run": {"mode": "parallel", "max_concurrency": 4, "metrics_interval_s": 0.25, "warmup": "on"},
        "endpoints": [{"name": "vllm", "base_url": vllm_server.base_url, "model": MODEL}],
        "agents": [{"name": f"a{i}", "prompt": f"Count to {i + 3}.", "max_tokens": 16} for i in range(4)],
    })
    engine.hold_open = True

    def on_event(e) -> None:
        if e.kind == "LatencySample" and e.inter_token is not None and e.ttft is not None and e.ttft.count >= 5:
            engine.stop("panel complete")  # the warm-up and the four agents

    _, seen = await run_engine(engine, on_event)
    assert [e for e in seen if e.kind == "EndpointWarmed"][0].cold_start_s is not None
    panel = [e for e in seen if e.kind == "LatencySample" and e.ttft is not None][-1]
    # vLLM's own histograms, its names as this vLLM exports them
    assert panel.source == "histograms" and panel.ttft.count >= 5
    assert panel.inter_token is not None and panel.queue is not None and panel.prefill is not None
    assert 0 < panel.ttft.p50_s <= panel.ttft.p95_s
