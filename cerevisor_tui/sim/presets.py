"""Simulator profiles: a model on some GPUs, as KV capacity and speed numbers.

A profile is named `MODEL@GPU` or `MODEL@NxGPU` (e.g. `qwen3-30b-a3b@2xh100`), with any model and
GPU preset of `cerevisor_tui.capacity`; the KV cache size, bytes per token, prefill speed and CPU
reload link come from the same estimate `cerevisor-tui estimate` prints, so the simulator's cliff
sits where the estimate says it does. Decode speed, which the estimate does not model, is a rough
memory-bandwidth figure defined here.
"""

from __future__ import annotations

import re

from cerevisor_tui.capacity import CapacityError, UnknownPresetError, estimate, get_gpu, get_model
from cerevisor_tui.sim.profiles import ProfileError, ProfileNumbers

# HBM bandwidth in TB/s, for decode speed only (public datasheets).
_HBM_TB_S = {"l4": 0.3, "a10g": 0.6, "a100-40gb": 1.55, "a100-80gb": 2.0, "h100": 3.35, "h200": 4.8,
             "b200": 8.0, "gb200": 8.0, "gb300": 8.0, "rtx-3090": 0.94, "rtx-4090": 1.0, "mi300x": 5.3}
_DECODE_EFFICIENCY = 0.3  # share of bandwidth a single sequence's decode achieves
_DECODE_CAP_TOKENS_S = 250.0  # kernels and scheduling bound small models long before bandwidth does

_NAME = re.compile(r"^(?P<model>[^@]+)@(?:(?P<n>\d+)x)?(?P<gpu>.+)$")


# The two studies' set-ups, calibrated so that a replay of their workloads lands on their published figures
# (benchmarks/study_calibration.py prints both side by side; docs/replay.md's calibration table names each source).
_TIERED_TOKENS = 64 * 28_672  # the study's 64 conversations of 12K + 7 x 2K prompt + 8 x 200 answer tokens
_TIERED_BYTES = 20_480  # qwen3.6-35b-a3b (a capacity preset): 10 attention layers x 2 KV heads x 256 x (K, V) x 2 bytes


def _tiered(cpu_offload_gib: float, description: str) -> ProfileNumbers:
    """The tiered study's box, with or without its CPU tier."""
    return ProfileNumbers(
        kv_cache_tokens=_TIERED_TOKENS, bytes_per_token=_TIERED_BYTES, max_model_len=262_144,
        tokens_per_s=180.0,  # one sequence's decode: 3B active parameters in FP8 on H100 HBM
        prefill_tokens_per_s=120_000.0, reload_tokens_per_s=50e9 / _TIERED_BYTES,  # PCIe 5 x16, ~50 GB/s
        max_num_seqs=256, batch_slowdown=0.02, ttft_s=0.02, max_num_batched_tokens=8192,
        cpu_offload_gib=cpu_offload_gib, description=description)


STUDIES: dict[str, ProfileNumbers] = {
    "tiered-h100": _tiered(0.0, "vLLM tiered offloading study: qwen3.6-35b-a3b (FP8) on one H100, no CPU tier; "
                                f"{_TIERED_TOKENS:,} KV tokens, 64 of its conversations"),
    "tiered-h100-cpu": _tiered(_TIERED_TOKENS * _TIERED_BYTES / 1024**3,
                               "vLLM tiered offloading study: qwen3.6-35b-a3b (FP8) on one H100 with a CPU tier of "
                               "64 more conversations"),
    "agentx-12xgb300": ProfileNumbers(
        # 256 sessions of ~150K tokens stay resident (prefix hits > 95%): KV for 320 of them
        kv_cache_tokens=320 * 150_000, bytes_per_token=46_080, max_model_len=1_048_576,
        tokens_per_s=90.0, prefill_tokens_per_s=600_000.0, reload_tokens_per_s=2e6,
        max_num_seqs=512, batch_slowdown=0.006, ttft_s=0.02, max_num_batched_tokens=65_536,
        block_size=64,  # FlashMLA's KV block
        description="vLLM AgentX study: a DeepSeek-V4-class model on 12 GB300, 256 agentic sessions"),
    # A sixteenth of that box, for what a 2-core replay cannot reach at 256 sessions (benchmarks/seed.py): a 16th
    # of its KV, prefill and batch budget, and a decode that slows 16x as fast with the batch, so its AgentX point
    # (58.3 tokens/s per user) falls at 16 sessions and its knee of goodput near 20, not 256 and 320
    "agentx-slice": ProfileNumbers(
        kv_cache_tokens=20 * 150_000, bytes_per_token=46_080, max_model_len=1_048_576,
        tokens_per_s=90.0, prefill_tokens_per_s=600_000.0 / 16, reload_tokens_per_s=2e6 / 16,
        max_num_seqs=32, batch_slowdown=(90.0 / 58.3 - 1) / 15, ttft_s=0.02, max_num_batched_tokens=65_536 // 16,
        block_size=64,
        description="a sixteenth of the AgentX box: KV for 20 agentic sessions, 58 tokens/s per user at 16"),
}


def names() -> list[str]:
    """Example profile names."""
    return ["qwen3.6-35b-a3b@2xh100", "qwen3-30b-a3b@2xh100", "llama-3.1-8b@h100", "llama-3.1-70b@4xh100",
            *STUDIES]


def lookup(name: str) -> ProfileNumbers:
    if name.strip().lower() in STUDIES:
        return STUDIES[name.strip().lower()]
    found = _NAME.match(name.strip().lower())
    if not found:
        raise ProfileError(f"profile {name!r} is not MODEL@GPU or MODEL@NxGPU (e.g. qwen3.6-35b-a3b@2xh100)")
    gpus = int(found["n"] or 1)
    try:
        model = get_model(found["model"])
        gpu = get_gpu(found["gpu"])
        est = estimate(model, gpu=gpu, gpus=gpus, context_tokens=min(model.max_context_tokens or 32768, 32768))
    except UnknownPresetError as exc:
        raise ProfileError(str(exc)) from None
    except CapacityError as exc:
        raise ProfileError(str(exc)) from None
    kv_tokens = est.kv_capacity_tokens
    max_len = min(model.max_context_tokens or 32768, kv_tokens)
    active = model.active_params or model.params or 8e9
    weight_bytes_per_gpu = active * 2 / gpus
    decode = _DECODE_EFFICIENCY * _HBM_TB_S.get(gpu.name, 2.0) * 1e12 / weight_bytes_per_gpu
    per_gpu = est.layout.bytes_per_token_per_gpu
    return ProfileNumbers(
        kv_cache_tokens=kv_tokens,
        bytes_per_token=est.layout.bytes_per_token_all_gpus,
        max_model_len=max_len,
        tokens_per_s=min(decode, _DECODE_CAP_TOKENS_S),
        prefill_tokens_per_s=est.cliff.prefill_tokens_per_s,
        reload_tokens_per_s=est.cliff.reload_gb_per_s * 1e9 / per_gpu,
        max_num_seqs=256,
        description=f"{model.name} on {gpus}x {gpu.name}: {kv_tokens:,} KV tokens",
    )
