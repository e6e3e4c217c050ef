"""How many agent conversations a box carries in GPU KV memory, and what happens beyond that.

The memory model, per GPU (tensor parallelism puts the same number of KV blocks on every GPU):

    kv_memory = gpu_memory x utilization - weights / gpus - runtime_reserve

`runtime_reserve_gib` stands for what a server holds besides weights and KV: the activation peak of
a prefill chunk (including the logits), CUDA graphs, the CUDA context and NCCL buffers. Published
vLLM start-up logs put it between ~2.4 GiB (RTX 3090, vLLM V0, Llama-3.1-8B) and ~7 GiB (H100,
vLLM V1, 8192 batched tokens, 70B at tp=4); the default, 4 GiB per GPU, sits in that range. When the
server has already said what it has (vLLM logs `Available KV cache memory: X GiB` per GPU), pass
`kv_memory_gib` instead and the estimate matches the server's own `GPU KV cache size: N tokens`.

Capacity is counted as vLLM counts it: whole blocks of `block_size` tokens (16 on GPUs) per GPU.
For models with sliding-window layers the tokens that fit depend on the conversation length (see
`kv.py`), so `kv_capacity_tokens` is then the tokens held by as many conversations of
`context_tokens` as fit, which is also how vLLM reports such models.

Zones, by the number of concurrent conversations of `context_tokens` each:
- fits: all of them stay in GPU memory.
- cliff: GPU KV is full; the server evicts cached prefixes (and preempts requests), so an agent's
  next turn either recomputes its whole context or, with a CPU tier, reloads it from host memory.
- overflow: the CPU tier is full too, so evicted prefixes are recomputed again. Without a CPU tier
  there is no overflow zone: everything past `fits` is the cliff.

Reload and recompute times are per conversation and rough: reload moves each GPU's share over its
host link (PCIe Gen4 ~25 GB/s effective unless the GPU preset says otherwise); recompute is a
prefill at `gpus x dense BF16 TFLOPS x prefill_mfu / (2 x active parameters)` tokens per second,
ignoring attention FLOPs, so it flatters long contexts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from cerevisor_tui.capacity.errors import CapacityError
from cerevisor_tui.capacity.kv import KvLayout, kv_layout
from cerevisor_tui.capacity.specs import GIB, GpuSpec, ModelSpec, normalize_dtype

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_RUNTIME_RESERVE_GIB = 4.0
DEFAULT_BLOCK_SIZE = 16
DEFAULT_RELOAD_GB_PER_S = 25.0
DEFAULT_PREFILL_MFU = 0.4
# Beyond these an input is a typo (1e9 GPUs, inf GiB), not a box: refused, so no figure is nonsense
MAX_GPUS = 1024
MAX_CONTEXT_TOKENS = 1 << 30
MAX_GIB = float(1 << 24)  # 16 PiB: memory, weights, a CPU tier
MAX_BLOCK_SIZE = 1024
MAX_GB_PER_S = 1e5
MAX_PREFILL_TOKENS_PER_S = 1e12

ZoneName = Literal["fits", "cliff", "overflow"]


@dataclass(frozen=True)
class Zone:
    """A range of concurrent conversations (inclusive; `max_concurrency` None: no upper bound)."""

    name: ZoneName
    min_concurrency: int
    max_concurrency: int | None
    meaning: str

    def contains(self, concurrency: int) -> bool:
        upper_ok = self.max_concurrency is None or concurrency <= self.max_concurrency
        return concurrency >= self.min_concurrency and upper_ok

    def range_text(self) -> str:
        if self.max_concurrency is None:
            return f"{self.min_concurrency}+"
        if self.max_concurrency == self.min_concurrency:
            return str(self.min_concurrency)
        return f"{self.min_concurrency}-{self.max_concurrency}"


@dataclass(frozen=True)
class CliffCost:
    """What bringing back one evicted conversation costs: reload from the CPU tier or recompute."""

    reload_s: float | None
    recompute_s: float | None
    reload_gb_per_s: float
    prefill_tokens_per_s: float | None
    assumptions: tuple[str, ...]


@dataclass(frozen=True)
class KvEstimate:
    """The answer to "how many conversations of this length fit, and where is the cliff?"."""

    model: ModelSpec
    gpu: GpuSpec | None
    gpus: int
    kv_dtype: str
    layout: KvLayout
    context_tokens: int
    block_size: int
    kv_memory_gib_per_gpu: float
    kv_memory_source: str
    weights_gib_per_gpu: float | None
    runtime_reserve_gib: float | None
    gpu_memory_utilization: float | None
    kv_capacity_tokens: int
    conversations_fit: int
    max_concurrency_ratio: float
    cpu_offload_gib: float
    cpu_conversations: int
    zones: tuple[Zone, ...]
    cliff: CliffCost
    notes: tuple[str, ...]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token for one copy of the model, all layers (the textbook figure)."""
        return self.layout.bytes_per_token

    @property
    def bytes_per_token_per_gpu(self) -> int:
        return self.layout.bytes_per_token_per_gpu

    @property
    def conversation_bytes_per_gpu(self) -> int:
        return self.layout.conversation_bytes_per_gpu(self.context_tokens, self.block_size)

    @property
    def max_concurrency(self) -> int | None:
        """The endpoint `max_concurrency` to configure: every running conversation stays in GPU memory. None
        when not even one conversation fits: no cap makes that box work, and 0 is not a cap."""
        return self.conversations_fit or None

    def zone(self, name: ZoneName) -> Zone | None:
        return next((z for z in self.zones if z.name == name), None)

    def zone_for(self, concurrency: int) -> Zone:
        """The zone a number of concurrent conversations falls in (below 1 counts as the first zone)."""
        for zone in self.zones:
            if zone.contains(max(1, concurrency)):
                return zone
        return self.zones[-1]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the `estimate --json` output)."""
        return {
            "model": self.model.name,
            "model_source": self.model.source,
            "gpu": self.gpu.name if self.gpu else None,
            "gpus": self.gpus,
            "kv_dtype": self.kv_dtype,
            "context_tokens": self.context_tokens,
            "block_size": self.block_size,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_token_per_gpu": self.bytes_per_token_per_gpu,
            "kv_replicated_across_gpus": self.layout.replicated,
            "sliding_window_tokens": self.layout.window_tokens,
            "conversation_bytes_per_gpu": self.conversation_bytes_per_gpu,
            "kv_memory_gib_per_gpu": round(self.kv_memory_gib_per_gpu, 4),
            "kv_memory_source": self.kv_memory_source,
            "weights_gib_per_gpu": _round(self.weights_gib_per_gpu, 3),
            "runtime_reserve_gib": self.runtime_reserve_gib,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "conversations_fit": self.conversations_fit,
            "max_concurrency_ratio": round(self.max_concurrency_ratio, 4),
            "max_concurrency": self.max_concurrency,
            "cpu_offload_gib": self.cpu_offload_gib,
            "cpu_conversations": self.cpu_conversations,
            "zones": {
                name: (
                    {"min_concurrency": z.min_concurrency, "max_concurrency": z.max_concurrency, "meaning": z.meaning}
                    if (z := self.zone(name)) is not None
                    else None
                )
                for name in ("fits", "cliff", "overflow")
            },
            "reload_s": _round(self.cliff.reload_s, 3),
            "recompute_s": _round(self.cliff.recompute_s, 3),
            "reload_gb_per_s": self.cliff.reload_gb_per_s,
            "prefill_tokens_per_s": _round(self.cliff.prefill_tokens_per_s, 1),
            "assumptions": list(self.cliff.assumptions),
            "notes": list(self.notes),
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def estimate(
    model: ModelSpec,
    *,
    gpu: GpuSpec | None = None,
    gpus: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_memory_gib: float | None = None,
    context_tokens: int | None = None,
    kv_dtype: str = "auto",
    cpu_offload_gib: float = 0.0,
    runtime_reserve_gib: float = DEFAULT_RUNTIME_RESERVE_GIB,
    block_size: int = DEFAULT_BLOCK_SIZE,
    weights_gib: float | None = None,
    reload_gb_per_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
    prefill_mfu: float = DEFAULT_PREFILL_MFU,
) -> KvEstimate:
    """Size the KV cache of `model` on `gpus` x `gpu`, or in `kv_memory_gib` per GPU a server reported.

    `kv_memory_gib` (per GPU, as vLLM logs it) wins over the GPU's memory when both are given; the
    GPU preset then only supplies the link and compute speeds for the cliff times.
    """
    _check_inputs(gpus, gpu_memory_utilization, cpu_offload_gib, block_size, runtime_reserve_gib, prefill_mfu)
    _check_range("--kv-memory-gib", kv_memory_gib, 0.0, MAX_GIB, low_ok=False)
    _check_range("--weights-gib", weights_gib, 0.0, MAX_GIB)
    _check_range("--reload-gb-per-s", reload_gb_per_s, 0.0, MAX_GB_PER_S, low_ok=False)
    _check_range("--prefill-tokens-per-s", prefill_tokens_per_s, 0.0, MAX_PREFILL_TOKENS_PER_S, low_ok=False)
    context = context_tokens if context_tokens is not None else model.max_context_tokens
    if context is None:
        raise CapacityError(f"{model.name}: the config gives no max context length; give --context TOKENS")
    if context < 1:
        raise CapacityError(f"context must be at least 1 token, got {context}")
    _check_range("--context", context, 1, MAX_CONTEXT_TOKENS)
    layout = kv_layout(model, kv_dtype, gpus)
    resolved_kv_dtype = normalize_dtype(model.dtype) if kv_dtype.strip().lower() == "auto" else normalize_dtype(kv_dtype)
    notes: list[str] = []

    weights_per_gpu_gib = _weights_gib(model, weights_gib)
    if weights_per_gpu_gib is not None:
        weights_per_gpu_gib /= gpus
    if kv_memory_gib is not None:
        if kv_memory_gib <= 0:
            raise CapacityError(f"--kv-memory-gib must be positive, got {kv_memory_gib}")
        memory_gib = kv_memory_gib
        source = "reported by the server (per GPU)"
        used_reserve: float | None = None
        used_utilization: float | None = None
    elif gpu is not None:
        if weights_per_gpu_gib is None:
            raise CapacityError(
                f"{model.name}: the weights' size is unknown (config.json does not say it); "
                "give --weights-gib, or --kv-memory-gib from the server's log instead of --gpu"
            )
        budget = gpu.memory_gib * gpu_memory_utilization
        memory_gib = budget - weights_per_gpu_gib - runtime_reserve_gib
        if memory_gib <= 0:
            raise CapacityError(
                f"{model.name} does not fit on {gpus} x {gpu.name}: {gpu.memory_gib:.1f} GiB x {gpu_memory_utilization} "
                f"= {budget:.1f} GiB per GPU, weights {weights_per_gpu_gib:.1f} GiB per GPU and a runtime reserve of "
                f"{runtime_reserve_gib} GiB leave no KV memory; use more GPUs (--gpus) or a larger GPU"
            )
        source = "gpu memory x utilization - weights - runtime reserve"
        used_reserve = runtime_reserve_gib
        used_utilization = gpu_memory_utilization
    else:
        raise CapacityError("say where the KV cache lives: --gpu NAME [--gpus N], or --kv-memory-gib G from the server's log")

    memory_bytes = memory_gib * GIB
    conversation_bytes = layout.conversation_bytes_per_gpu(context, block_size)
    if layout.has_sliding_window:
        ratio = memory_bytes / conversation_bytes
        capacity_tokens = int(ratio * context)
        fit = int(ratio)
        notes.append(
            f"{model.sliding_layers} of {model.num_layers} layers keep only the last {layout.window_tokens:,} tokens: "
            f"capacity is counted for conversations of {context:,} tokens"
        )
    else:
        blocks = int(memory_bytes // (block_size * layout.bytes_per_token_per_gpu))
        capacity_tokens = blocks * block_size
        ratio = capacity_tokens / context
        fit = blocks // math.ceil(context / block_size)

    if model.max_context_tokens is not None and context > model.max_context_tokens:
        notes.append(f"{context:,} tokens is longer than the model's max context ({model.max_context_tokens:,})")
    if fit == 0:
        notes.append(
            f"not even one conversation of {context:,} tokens fits: the server would refuse this max length "
            f"(at most ~{capacity_tokens:,} tokens fit)"
        )
    if layout.replicated and model.attention == "mla":
        notes.append(
            f"MLA keeps the whole latent on each of the {gpus} GPUs (replicated, not split): more GPUs add KV room "
            "only by taking weights off each GPU"
        )
    elif layout.replicated:
        notes.append(f"{gpus} GPUs exceed the {model.num_kv_heads} KV heads: heads are replicated, not split further")

    cpu_conversations = 0
    if cpu_offload_gib > 0:
        cpu_conversations = int(cpu_offload_gib * GIB // (conversation_bytes * gpus))

    cliff = _cliff_cost(model, gpu, gpus, conversation_bytes, context, reload_gb_per_s, prefill_tokens_per_s, prefill_mfu)
    zones = _zones(fit, cpu_conversations, cpu_offload_gib, cliff)
    return KvEstimate(
        model=model,
        gpu=gpu,
        gpus=gpus,
        kv_dtype=resolved_kv_dtype,
        layout=layout,
        context_tokens=context,
        block_size=block_size,
        kv_memory_gib_per_gpu=memory_gib,
        kv_memory_source=source,
        weights_gib_per_gpu=weights_per_gpu_gib,
        runtime_reserve_gib=used_reserve,
        gpu_memory_utilization=used_utilization,
        kv_capacity_tokens=capacity_tokens,
        conversations_fit=fit,
        max_concurrency_ratio=ratio,
        cpu_offload_gib=cpu_offload_gib,
        cpu_conversations=cpu_conversations,
        zones=zones,
        cliff=cliff,
        notes=tuple(notes),
    )


def _check_inputs(
    gpus: int, utilization: float, cpu_offload_gib: float, block_size: int, reserve_gib: float, mfu: float
) -> None:
    if gpus < 1:
        raise CapacityError(f"--gpus must be at least 1, got {gpus}")
    if not 0 < utilization <= 1:
        raise CapacityError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if cpu_offload_gib < 0:
        raise CapacityError(f"--cpu-offload-gib cannot be negative, got {cpu_offload_gib}")
    if block_size < 1:
        raise CapacityError(f"--block-size must be at least 1, got {block_size}")
    if reserve_gib < 0:
        raise CapacityError(f"--runtime-reserve-gib cannot be negative, got {reserve_gib}")
    if not 0 < mfu <= 1:
        raise CapacityError(f"prefill MFU must be in (0, 1], got {mfu}")
    _check_range("--gpus", gpus, 1, MAX_GPUS)
    _check_range("--cpu-offload-gib", cpu_offload_gib, 0.0, MAX_GIB)
    _check_range("--block-size", block_size, 1, MAX_BLOCK_SIZE)
    _check_range("--runtime-reserve-gib", reserve_gib, 0.0, MAX_GIB)


def _check_range(flag: str, value: float | None, low: float, high: float, *, low_ok: bool = True) -> None:
    """A finite number within [low, high] ((low, high] without low_ok); None passes (not given)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise CapacityError(f"{flag} must be a finite number, got {value}")
    if value < low or (value == low and not low_ok):
        if low == 0:
            raise CapacityError(f"{flag} {'cannot be negative' if low_ok else 'must be positive'}, got {_plain(value)}")
        raise CapacityError(f"{flag} must be at least {_plain(low)}, got {_plain(value)}")
    if value > high:
        raise CapacityError(f"{flag} must be at most {_plain(high)}, got {_plain(value)}")


def _plain(value: float) -> str:
    """16,777,216 rather than 1.67772e+07; 1e+300 stays short."""
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _weights_gib(model: ModelSpec, override_gib: float | None) -> float | None:
    if override_gib is not None:
        if override_gib < 0:
            raise CapacityError(f"--weights-gib cannot be negative, got {override_gib}")
        return override_gib
    weights = model.weights_bytes
    return None if weights is None else weights / GIB


def _cliff_cost(
    model: ModelSpec,
    gpu: GpuSpec | None,
    gpus: int,
    conversation_bytes_per_gpu: int,
    context: int,
    reload_gb_per_s: float | None,
    prefill_tokens_per_s: float | None,
    mfu: float,
) -> CliffCost:
    assumptions: list[str] = []
    if reload_gb_per_s is None:
        if gpu is not None and gpu.host_link_gb_per_s:
            reload_gb_per_s = gpu.host_link_gb_per_s
            assumptions.append(f"reload at {reload_gb_per_s:g} GB/s per GPU ({gpu.name} host link, effective)")
        else:
            reload_gb_per_s = DEFAULT_RELOAD_GB_PER_S
            assumptions.append(f"reload at {reload_gb_per_s:g} GB/s per GPU (PCIe Gen4 x16, effective)")
    else:
        assumptions.append(f"reload at {reload_gb_per_s:g} GB/s per GPU (given)")
    if reload_gb_per_s <= 0:
        raise CapacityError(f"reload bandwidth must be positive, got {reload_gb_per_s}")
    # Every GPU reloads its own share over its own link, in parallel.
    reload_s = conversation_bytes_per_gpu / (reload_gb_per_s * 1e9)

    if prefill_tokens_per_s is not None:
        if prefill_tokens_per_s <= 0:
            raise CapacityError(f"prefill throughput must be positive, got {prefill_tokens_per_s}")
        assumptions.append(f"recompute at {prefill_tokens_per_s:,.0f} prefill tokens/s (given)")
    else:
        active = model.active_params or model.params
        if gpu is not None and gpu.dense_bf16_tflops and active:
            prefill_tokens_per_s = gpus * gpu.dense_bf16_tflops * 1e12 * mfu / (2 * active)
            assumptions.append(
                f"recompute at {prefill_tokens_per_s:,.0f} prefill tokens/s = {gpus} x {gpu.dense_bf16_tflops:g} TFLOPS x "
                f"{mfu:g} MFU / (2 x {_params_text(active)} active parameters), attention FLOPs ignored"
            )
        else:
            assumptions.append("recompute time unknown: give --prefill-tokens-per-s (or --gpu with a preset)")
    recompute_s = context / prefill_tokens_per_s if prefill_tokens_per_s else None
    return CliffCost(
        reload_s=reload_s,
        recompute_s=recompute_s,
        reload_gb_per_s=reload_gb_per_s,
        prefill_tokens_per_s=prefill_tokens_per_s,
        assumptions=tuple(assumptions),
    )


def duration_text(seconds: float | None) -> str:
    """'~54 ms', '~2.9 s', '~14 s', or 'unknown'."""
    if seconds is None:
        return "unknown"
    if seconds < 0.001:
        return "<1 ms"
    if seconds < 1:
        return f"~{seconds * 1000:.0f} ms"
    return f"~{seconds:.1f} s" if seconds < 10 else f"~{seconds:.0f} s"


def _params_text(params: float) -> str:
    return f"{params / 1e9:.1f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"


def _zones(fit: int, cpu_conversations: int, cpu_offload_gib: float, cliff: CliffCost) -> tuple[Zone, ...]:
    zones: list[Zone] = []
    if fit >= 1:
        zones.append(Zone("fits", 1, fit, "every conversation's KV stays in GPU memory"))
    first_cliff = fit + 1
    recompute = "recomputed" if cliff.recompute_s is None else f"recomputed ({duration_text(cliff.recompute_s)} per conversation)"
    if cpu_offload_gib > 0 and cpu_conversations > 0:
        last_cliff = fit + cpu_conversations
        zones.append(
            Zone(
                "cliff",
                first_cliff,
                last_cliff,
                f"GPU KV full: evicted prefixes are reloaded from the {cpu_offload_gib:g} GiB CPU tier "
                f"({duration_text(cliff.reload_s)} per conversation; recomputing takes {duration_text(cliff.recompute_s)})",
            )
        )
        zones.append(Zone("overflow", last_cliff + 1, None, f"CPU tier full too: evicted prefixes are {recompute}"))
    else:
        tier = " (the CPU tier is too small to hold one)" if cpu_offload_gib > 0 else " (no CPU tier)"
        zones.append(Zone("cliff", first_cliff, None, f"GPU KV full: evicted prefixes are {recompute}{tier}"))
    return tuple(zones)
