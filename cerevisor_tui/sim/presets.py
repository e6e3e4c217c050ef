"""Simulator profiles: a model on some GPUs, as KV capacity and speed numbers.

A profile is named `MODEL@GPU` or `MODEL@NxGPU` (e.g. `qwen3.6-35b-a3b@2xh100`). The KV numbers come
from one function, `_kv_numbers`, so they can follow the capacity module's math.
"""

from __future__ import annotations

import re

from cerevisor_tui.sim.profiles import ProfileError, ProfileNumbers

GIB = 1024**3

# Built-in fallbacks: bytes per KV token, weights in GiB, max context; decode tok/s of one sequence on
# one H100-class GPU and prefill tok/s (rough public figures, for shape not for benchmarking).
_MODELS: dict[str, dict[str, float]] = {
    # Qwen3.6-35B-A3B-like hybrid MoE: 10 full-attention layers x 2 KV heads x 256 x bf16.
    "qwen3.6-35b-a3b": {"bytes_per_token": 20480, "weights_gib": 65.0, "max_model_len": 262144,
                        "tokens_per_s": 150.0, "prefill_tokens_per_s": 20000.0},
    # Qwen3-30B-A3B: 48 layers x 4 KV heads x 128 x 2 x bf16.
    "qwen3-30b-a3b": {"bytes_per_token": 98304, "weights_gib": 57.0, "max_model_len": 40960,
                      "tokens_per_s": 150.0, "prefill_tokens_per_s": 20000.0},
    "llama-3.1-8b": {"bytes_per_token": 131072, "weights_gib": 15.0, "max_model_len": 131072,
                     "tokens_per_s": 120.0, "prefill_tokens_per_s": 15000.0},
    "llama-3.1-70b": {"bytes_per_token": 327680, "weights_gib": 131.5, "max_model_len": 131072,
                      "tokens_per_s": 30.0, "prefill_tokens_per_s": 3000.0},
}
_GPUS: dict[str, float] = {"h100": 80.0, "h200": 141.0, "a100-80gb": 80.0, "a100-40gb": 40.0, "l4": 24.0,
                           "rtx-4090": 24.0, "b200": 180.0}
_GPU_SPEED = {"h100": 1.0, "h200": 1.2, "a100-80gb": 0.6, "a100-40gb": 0.6, "l4": 0.2, "rtx-4090": 0.4,
              "b200": 1.8}
_UTILIZATION = 0.9
_RESERVE_GIB_PER_GPU = 2.0

_NAME = re.compile(r"^(?P<model>[^@]+)@(?:(?P<n>\d+)x)?(?P<gpu>.+)$")


def names() -> list[str]:
    """Example profile names (any model preset @ any GPU preset works)."""
    return [f"{m}@{g}" for m in _MODELS for g in ("h100", "2xh100")]


def _kv_numbers(model: str, gpu: str, gpus: int) -> tuple[int, int, int]:
    """(bytes per token, KV capacity in tokens, max model len) for a model on `gpus` GPUs."""
    m = _MODELS[model]
    memory_gib = gpus * _GPUS[gpu] * _UTILIZATION - m["weights_gib"] - gpus * _RESERVE_GIB_PER_GPU
    if memory_gib <= 0:
        raise ProfileError(f"{model} does not fit on {gpus}x {gpu}: no memory left for the KV cache")
    bytes_per_token = int(m["bytes_per_token"])
    return bytes_per_token, int(memory_gib * GIB / bytes_per_token), int(m["max_model_len"])


def lookup(name: str) -> ProfileNumbers:
    found = _NAME.match(name.strip().lower())
    if not found:
        raise ProfileError(f"profile {name!r} is not MODEL@GPU or MODEL@NxGPU (e.g. qwen3.6-35b-a3b@2xh100)")
    model, gpu, gpus = found["model"], found["gpu"], int(found["n"] or 1)
    if model not in _MODELS:
        raise ProfileError(f"unknown model {model!r} in profile; known: {', '.join(sorted(_MODELS))}")
    if gpu not in _GPUS:
        raise ProfileError(f"unknown GPU {gpu!r} in profile; known: {', '.join(sorted(_GPUS))}")
    bytes_per_token, kv_tokens, max_len = _kv_numbers(model, gpu, gpus)
    m = _MODELS[model]
    speed = _GPU_SPEED[gpu]
    return ProfileNumbers(
        kv_cache_tokens=kv_tokens,
        bytes_per_token=bytes_per_token,
        max_model_len=min(max_len, kv_tokens),
        tokens_per_s=m["tokens_per_s"] * speed,
        prefill_tokens_per_s=m["prefill_tokens_per_s"] * speed * gpus,
        max_num_seqs=256,
        description=f"{model} on {gpus}x {gpu}: {kv_tokens} KV tokens",
    )
