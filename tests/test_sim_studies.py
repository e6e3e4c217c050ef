"""The simulator at the studies' scale: their presets, the bounded request log under 560 KB agent prompts, and
interactivity measured on the engine's clock (the calibration itself: benchmarks/study_calibration.py)."""

from __future__ import annotations

import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.replay.run import prompt_text
from cerevisor_tui.sim import SimServer, resolve
from cerevisor_tui.sim.presets import STUDIES, names


def test_study_presets_hold_the_studies_conversations_and_explicit_settings_win():
    plain, tiered = resolve(SimSettings(profile="tiered-h100")), resolve(SimSettings(profile="tiered-h100-cpu"))
    conversation = 12_000 + 7 * 2000 + 8 * 200  # the tiered study's, at its last turn
    assert plain.kv_cache_tokens // conversation == 66 and plain.num_cpu_blocks == 0  # ~64 in HBM
    assert tiered.num_cpu_blocks * tiered.block_size == tiered.kv_cache_tokens  # and as many again in CPU memory
    assert resolve(SimSettings(profile="tiered-h100-cpu", cpu_offload_gib=0)).num_cpu_blocks == 0
    agentx = resolve(SimSettings(profile="AgentX-12xGB300"))
    assert agentx.block_size == 64 and agentx.kv_cache_tokens >= 256 * 150_000
    assert resolve(SimSettings(profile="agentx-12xgb300", block_size=16)).block_size == 16
    assert set(STUDIES) <= set(names())


def test_the_agentx_slice_is_a_sixteenth_of_the_agentx_box_with_its_point_at_16_sessions():
    box, slice_ = resolve(SimSettings(profile="agentx-12xgb300")), resolve(SimSettings(profile="agentx-slice"))
    assert slice_.kv_cache_tokens * 16 == box.kv_cache_tokens and slice_.block_size == box.block_size
    assert slice_.params.prefill_tokens_per_s * 16 == box.params.prefill_tokens_per_s
    per_user_at_16 = slice_.params.tokens_per_s / (1 + slice_.params.batch_slowdown * 15)
    assert per_user_at_16 == pytest.approx(58.3)  # the AgentX point's p90 interactivity, at 16 sessions not 256


@pytest.mark.anyio
async def test_the_request_log_keeps_recent_bodies_and_drops_old_560kb_prompts():
    text = prompt_text(list(range(300)), 140_000, "s")  # a turn-43 agent prompt: 140K tokens, 560 KB
    async with SimServer(SimSettings(speed=1000, max_model_len=200_000, kv_cache_tokens=400_000)) as srv:
        log = srv.state.requests
        log.kept_bytes = 2 * 2**20
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(8):
                reply = await client.post(f"{srv.base_url}/chat/completions", json={
                    "model": "sim-model", "max_tokens": 1,
                    "messages": [{"role": "user", "content": f"{i} {text}"}]})
                assert reply.status_code == 200
    assert len(log) == 8 and all(entry["body_bytes"] > 560_000 for entry in log)
    kept = [entry for entry in log if entry["messages"] is not None]
    assert 1 <= len(kept) <= 3 and kept[-1] is log[-1]  # the latest, within 2 MiB
    assert log[-1]["messages"][0]["content"].startswith("7 ")
    assert log[0]["messages"] is None and log[0]["body"] is None and log[0]["headers"]  # the rest stays


@pytest.mark.anyio
async def test_each_requests_interactivity_is_taken_on_the_engine_clock():
    async with SimServer(SimSettings(speed=50, tokens_per_s=100, ttft_s=0)) as srv:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{srv.base_url}/chat/completions", json={
                "model": "sim-model", "max_tokens": 21, "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200
        # alone in the batch: one token each 1/100 s of engine time, whatever the host did meanwhile
        assert list(srv.state.engine.decode_rates) == [pytest.approx(100.0)]
