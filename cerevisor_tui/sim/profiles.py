"""Turn SimSettings (and an optional model+GPU profile) into the numbers the simulated engine runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim.scheduler import EngineParams

GIB = 1024**3
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_BYTES_PER_TOKEN = 131072  # Llama-3.1-8B, bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes
DEFAULT_PREFILL_TOKENS_PER_S = 20000.0


class ProfileError(ValueError):
    """An unknown or unusable --profile."""


@dataclass(frozen=True)
class ProfileNumbers:
    """What a model+GPU preset says about a server."""

    kv_cache_tokens: int
    bytes_per_token: int
    max_model_len: int
    tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    reload_tokens_per_s: float | None = None
    max_num_seqs: int | None = None
    description: str = ""
    # a study's set-up fixes these too (sim/presets.py STUDIES); None: the settings' own
    cpu_offload_gib: float | None = None
    batch_slowdown: float | None = None
    ttft_s: float | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class SimServerSpec:
    """Everything a simulated server needs: engine parameters and KV geometry."""

    params: EngineParams
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_token: int
    profile: str
    description: str

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def profile_numbers(name: str) -> ProfileNumbers:
    """The numbers of a profile name; the one place that knows about presets."""
    from cerevisor_tui.sim import presets

    return presets.lookup(name)


def _own(settings: SimSettings, prof: ProfileNumbers | None, name: str) -> Any:
    """A setting the operator gave, else the profile's number for it, else the setting's default."""
    found = getattr(prof, name, None) if prof else None
    return getattr(settings, name) if found is None or name in settings.model_fields_set else found


def resolve(settings: SimSettings) -> SimServerSpec:
    """Combine settings and profile: an explicit setting wins over the profile's number."""
    prof = profile_numbers(settings.profile) if settings.profile else None
    fields = settings.model_fields_set
    max_model_len = settings.max_model_len or (prof.max_model_len if prof else DEFAULT_MAX_MODEL_LEN)
    max_num_seqs = settings.max_num_seqs
    if prof and prof.max_num_seqs and "max_num_seqs" not in fields:
        max_num_seqs = prof.max_num_seqs
    tokens_per_s = settings.tokens_per_s
    if prof and prof.tokens_per_s and "tokens_per_s" not in fields:
        tokens_per_s = prof.tokens_per_s
    prefill = settings.prefill_tokens_per_s or (
        prof.prefill_tokens_per_s if prof and prof.prefill_tokens_per_s else DEFAULT_PREFILL_TOKENS_PER_S
    )
    bytes_per_token = settings.kv_bytes_per_token or (prof.bytes_per_token if prof else DEFAULT_BYTES_PER_TOKEN)
    bs = _own(settings, prof, "block_size")
    if settings.kv_cache_tokens:
        kv_tokens = settings.kv_cache_tokens
    elif prof:
        kv_tokens = prof.kv_cache_tokens
    else:
        kv_tokens = max_num_seqs * max_model_len
    if kv_tokens < max_model_len:
        if settings.max_model_len:
            raise ProfileError(
                f"max_model_len {max_model_len} does not fit in a KV cache of {kv_tokens} tokens"
            )
        max_model_len = kv_tokens  # vLLM would refuse to start; the simulator shrinks the limit instead
    num_gpu_blocks = kv_tokens // bs
    cpu_offload_gib = settings.cpu_offload_gib
    if prof and prof.cpu_offload_gib is not None and "cpu_offload_gib" not in fields:
        cpu_offload_gib = prof.cpu_offload_gib
    cpu_tokens = int(cpu_offload_gib * GIB / bytes_per_token)
    if prof and prof.reload_tokens_per_s and "cpu_bandwidth_gib_s" not in fields:
        reload_rate = prof.reload_tokens_per_s
    else:
        reload_rate = settings.cpu_bandwidth_gib_s * GIB / bytes_per_token
    params = EngineParams(
        speed=settings.speed,
        tokens_per_s=tokens_per_s,
        ttft_s=_own(settings, prof, "ttft_s"),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=_own(settings, prof, "max_num_batched_tokens"),
        batch_slowdown=_own(settings, prof, "batch_slowdown"),
        prefill_tokens_per_s=prefill,
        reload_tokens_per_s=reload_rate,
        stall_after_tokens=settings.stall_after_tokens,
        wedge_after_s=settings.wedge_after_s,
        preempt_loop_tokens=settings.preempt_loop_tokens,
    )
    return SimServerSpec(
        params=params,
        max_model_len=max_model_len,
        block_size=bs,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=cpu_tokens // bs,
        bytes_per_token=bytes_per_token,
        profile=settings.profile,
        description=prof.description if prof else "generic",
    )
