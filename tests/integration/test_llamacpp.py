"""The product against a real llama.cpp llama-server (4 slots, --metrics, the tiny GGUF model)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import until
from tests.integration.checks import (
    engine_for,
    run_engine,
    run_workflow_through_proxy,
    timed_busy_check,
)
from tests.integration.conftest import cerevisor
from tests.integration.servers import MODEL, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_two_wave_workflow_reports_the_tokens_llama_server_counted(llama: ServerProcess, tmp_path, stream_process):
    def counters() -> tuple[float, float]:
        # prompt_tokens_total excludes tokens reused from the prompt cache; usage counts the whole prompt
        prompt = llama.metric("llamacpp:prompt_tokens_total") + llama.metric("llamacpp:prompt_tokens_cached_total")
        return prompt, llama.metric("llamacpp:tokens_predicted_total")

    run_workflow_through_proxy(llama, tmp_path, counters, stream_process=stream_process)


def test_probe_recommends_the_four_slots(llama: ServerProcess):
    proc = cerevisor("probe", llama.base_url, "--json", "--max-concurrency", "32")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["server_kind"] == "llamacpp" and result["model"] == MODEL
    assert result["max_model_len"] == 2048  # each slot's context: -c 8192 over -np 4
    assert result["kv_cache_tokens"] == 8192
    # 4 slots: within one doubling step of 4
    assert 2 <= result["recommended_concurrency"] <= 8, result
    assert result["recommended_mode"] == "parallel"
    assert result["levels"][-1]["concurrency"] <= 16  # it stopped past the knee, not at the top


@pytest.mark.anyio
async def test_a_deferred_request_has_its_first_byte_deadline_extended(llama: ServerProcess):
    """Eight long requests hold the four slots and the head of the queue; two agents sent then are
    deferred and get no byte at all (not even headers) until a slot frees. llamacpp:requests_deferred
    makes the watchdog extend their 1 s first-byte deadline instead of killing them, and they complete."""
    engine = engine_for({
        "run": {"warmup": "off", "mode": "parallel", "max_concurrency": 2, "metrics_interval_s": 0.25},
        "stall": {"first_byte_timeout_s": 1.0, "idle_timeout_s": 60.0, "extend_s": 60.0, "max_extensions": 5},
        "endpoints": [{"name": "llama", "base_url": llama.base_url, "model": MODEL}],
        "agents": [{"name": f"a{i}", "prompt": f"Tell story {i}.", "max_tokens": 32, "retries": 0} for i in range(2)],
    })

    # The blockers stream from curl processes, not from this event loop: eight streams of llama-server's
    # per-token events would take the CPU time the watchdog under test needs on a small machine.
    blockers = []
    try:
        for i in range(8):
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"Blocker {i}."}],
                               "max_tokens": 1900, "stream": True})
            blockers.append(subprocess.Popen(
                ["curl", "-sN", "-o", "/dev/null", "-H", "content-type: application/json", "-d", body,
                 f"{llama.base_url}/chat/completions"]))
        # all four slots busy: the agents queue behind the blockers still deferred, for a round at least
        await until(lambda: llama.metric("llamacpp:requests_processing") >= 4,
                    lambda: f"the blockers to fill the slots: {llama.metrics()}", timeout=60, interval=0.2)
        checks: list[tuple[float, str | None]] = []  # (seconds, answer) of each busy check at a deadline
        engine.watchdog.busy_check = timed_busy_check(engine, checks)
        code, seen = await run_engine(engine)
    finally:
        for blocker in blockers:
            blocker.kill()
            blocker.wait()
    killed = [(e.agent, e.reason) for e in seen if e.kind == "AgentKilled"]
    assert code == 0, f"killed: {killed}; busy checks (s, answer): {checks}"
    extended = [e for e in seen if e.kind == "StallExtended"]
    assert {e.agent for e in extended} == {"a0", "a1"}, extended
    assert all(e.deadline == "first_byte" and "waiting" in e.reason for e in extended), extended
    assert not any(e.kind == "AgentKilled" for e in seen)
    samples = [e for e in seen if e.kind == "ServerSample"]
    assert any(s.server_kind == "llamacpp" and s.waiting and s.slots_total == 4 for s in samples)
