"""The simulator's KV model at a small scale: prefix reuse, LRU eviction, the CPU tier, queueing, preemption."""

from __future__ import annotations

import re

import anyio
import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import ProfileError, SimServer, resolve
from cerevisor_tui.sim.kv import KvCache, KvHold
from cerevisor_tui.sim.scheduler import BatchEngine, EngineParams, Sequence
from cerevisor_tui.sim.text import block_hashes


def prompt(name: str, blocks: int, block_size: int = 4) -> str:
    """Text of exactly `blocks` full blocks (4 characters per token), unique to `name`."""
    unit = (name * 64)[: 4 * block_size]
    return "".join(f"{i:03d}" + unit[3:] for i in range(blocks))


def admit(kv: KvCache, text: str, extra_tokens: int = 0) -> tuple[KvHold, object]:
    hold = KvHold()
    hashes = block_hashes(text, kv.block_size)
    got = kv.try_admit(hashes, len(text) // 4 + extra_tokens, hold)
    return hold, got


def test_prefix_of_a_finished_turn_is_reused_by_the_next():
    kv = KvCache(num_blocks=100, block_size=4)
    first = prompt("a", 5)
    hold, got = admit(kv, first)
    assert got.gpu_hit_tokens == 0 and got.compute_tokens == 20
    kv.release(hold)
    assert kv.used_blocks == 0 and kv.cached_blocks == 5
    hold, got = admit(kv, first + prompt("b", 3))  # the next turn extends the conversation
    assert got.gpu_hit_tokens == 20 and got.compute_tokens == 12
    assert kv.hits_tokens == 20 and kv.queries_tokens == 20 + 32


def test_lru_eviction_then_cpu_tier_reload():
    for cpu_blocks, expect_cpu_hit in ((0, 0), (50, 12)):
        kv = KvCache(num_blocks=10, block_size=4, cpu_blocks=cpu_blocks)
        a = prompt("a", 4)
        hold, _ = admit(kv, a)
        kv.release(hold)
        hold, _ = admit(kv, prompt("b", 8))  # needs 9 blocks, 6 never used: evicts 3 of a's 4, tail first
        assert kv.evicted_blocks == 3
        kv.release(hold)
        hold, got = admit(kv, a)
        assert got.gpu_hit_tokens == 4  # a's first block survived in GPU memory
        assert got.cpu_hit_tokens == expect_cpu_hit
        assert got.compute_tokens == 12 - expect_cpu_hit


def test_admission_refuses_what_does_not_fit_and_grow_reports_full():
    kv = KvCache(num_blocks=8, block_size=4)
    hold_a, got = admit(kv, prompt("a", 5))  # 6 blocks with the first output token's room
    assert got is not None and kv.used_blocks == 6
    _, got = admit(kv, prompt("b", 3))
    assert got is None  # 4 blocks needed, 2 free
    assert kv.grow(hold_a, 28)  # 7 blocks
    assert kv.grow(hold_a, 32)
    assert not kv.grow(hold_a, 33)
    assert kv.usage == 1.0


@pytest.mark.anyio
async def test_engine_queues_when_full_and_preempts_to_grow():
    kv = KvCache(num_blocks=16, block_size=4)
    eng = BatchEngine(EngineParams(speed=1000.0, tokens_per_s=100.0, ttft_s=0.0, max_num_seqs=64), kv)
    seqs = [Sequence(prompt_tokens=8, hashes=block_hashes(prompt(f"s{i}", 2), 4), max_tokens=24,
                     notify_each_token=False) for i in range(8)]
    for s in seqs:
        eng.submit(s)
    peak_waiting = 0
    with anyio.fail_after(10):
        while not all(s.finished for s in seqs):
            peak_waiting = max(peak_waiting, len(eng.waiting))
            await anyio.sleep(0.001)
    await eng.close()
    assert [s.generated for s in seqs] == [24] * 8
    assert eng.preemptions_total > 0  # 8 x 3 blocks admitted, growing to 8 blocks each: someone must yield
    assert eng.max_running_seen <= 5
    assert peak_waiting > 0
    assert kv.used_blocks == 0


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)[1])


@pytest.mark.anyio
async def test_small_kv_server_shows_waiting_usage_and_preemptions_in_metrics():
    settings = SimSettings(tokens_per_s=200.0, ttft_s=0.0, kv_cache_tokens=256, max_num_seqs=32, speed=2.0)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        samples = []

        async def one(i: int) -> None:
            body = {"model": "sim-model", "max_tokens": 100,
                    "messages": [{"role": "user", "content": f"request {i} " + "x" * 60}]}
            r = await c.post(srv.base_url + "/chat/completions", json=body)
            assert r.json()["usage"]["completion_tokens"] == 100

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
            for _ in range(20):
                await anyio.sleep(0.02)
                samples.append((await c.get(srv.root_url + "/metrics")).text)
        assert max(_metric(m, "vllm:num_requests_waiting") for m in samples) > 0
        assert max(_metric(m, "vllm:kv_cache_usage_perc") for m in samples) > 0.8
        final = (await c.get(srv.root_url + "/metrics")).text
        assert _metric(final, "vllm:num_preemptions_total") == srv.state.preemptions_total > 0
        assert 'num_gpu_blocks="16"' in final and 'kv_cache_size_tokens="256"' in final
        assert srv.state.kv.used_blocks == 0


def test_profiles_resolve_and_explicit_numbers_win():
    spec = resolve(SimSettings(profile="qwen3.6-35b-a3b@2xh100", cpu_offload_gib=8))
    assert spec.num_gpu_blocks * 16 == spec.kv_cache_tokens
    assert 2_000_000 < spec.kv_cache_tokens < 5_000_000  # ~64 conversations of 12K + 8x4K fit
    assert spec.num_cpu_blocks == int(8 * 1024**3 / spec.bytes_per_token) // 16
    assert resolve(SimSettings(profile="qwen3.6-35b-a3b@2xh100", kv_cache_tokens=4096)).kv_cache_tokens == 4096
    small = resolve(SimSettings(kv_cache_tokens=1000))
    assert small.max_model_len == 1000  # the limit shrinks to what the cache holds
    with pytest.raises(ProfileError):
        resolve(SimSettings(profile="nope"))
    with pytest.raises(ProfileError):
        resolve(SimSettings(kv_cache_tokens=1000, max_model_len=2000))
