"""What a model and a GPU are, for KV-cache sizing: small frozen dataclasses and dtype sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cerevisor_tui.capacity.errors import CapacityError

GIB = 1024**3
MIB = 1024**2

AttentionKind = Literal["gqa", "mla"]

# Bytes per element. mxfp4 is 4-bit values plus one 8-bit scale per 32 values: 4.25 bits.
_DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "mxfp4": 4.25 / 8,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "fp8_ds_mla": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
}

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")


def normalize_dtype(name: str) -> str:
    """The canonical name of a dtype ('bf16' -> 'bfloat16'); raises CapacityError if unknown."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in _DTYPE_BYTES:
        known = ", ".join(sorted(set(_DTYPE_BYTES) | set(_DTYPE_ALIASES)))
        raise CapacityError(f"unknown dtype {name!r}: use one of {known}")
    return key


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype (mxfp4: 0.53125)."""
    return _DTYPE_BYTES[normalize_dtype(name)]


def kv_dtype_bytes(kv_dtype: str, model_dtype: str) -> int:
    """Bytes per cached K or V element. `auto` stores the KV cache in the model's dtype, as vLLM does."""
    key = kv_dtype.strip().lower()
    try:
        resolved = normalize_dtype(model_dtype) if key == "auto" else normalize_dtype(key)
    except CapacityError:
        resolved = key
    if resolved not in ("float32", "bfloat16", "float16", "fp8"):
        raise CapacityError(f"KV cache dtype {kv_dtype!r} is not one a server uses: give auto, fp16, bf16, fp8 or fp32")
    return int(_DTYPE_BYTES[resolved])


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape as far as the KV cache and the weights are concerned.

    `num_layers` counts every layer with a KV cache (a hybrid's linear-attention layers, whose state does not
    grow with the tokens, are left out); `sliding_layers` of them attend only to the last
    `sliding_window_tokens` tokens (gpt-oss: 12 of 24 with 128; Gemma-3-27B: 52 of 62 with 1024).
    MLA models (DeepSeek-V3/R1) cache one latent of `kv_lora_rank + qk_rope_head_dim` values per
    token and layer instead of K and V heads.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context_tokens: int | None
    dtype: str = "bfloat16"
    attention: AttentionKind = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    sliding_window_tokens: int | None = None
    sliding_layers: int = 0
    params: float | None = None
    active_params: float | None = None
    weight_dtype: str | None = None
    weights_gib: float | None = None
    weights_source: str = ""
    source: str = ""
    hf_repo: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    @property
    def full_layers(self) -> int:
        """Layers that keep every token of the conversation."""
        return self.num_layers - self.sliding_layers

    @property
    def weights_bytes(self) -> float | None:
        """Weight memory: the published size if known, else parameters x bytes per parameter."""
        if self.weights_gib is not None:
            return self.weights_gib * GIB
        if self.params is None:
            return None
        return self.params * dtype_bytes(self.weight_dtype or self.dtype)


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: its memory as the driver reports it, and rough speeds for the cliff estimates."""

    name: str
    memory_gib: float
    label: str = ""
    host_link_gb_per_s: float | None = None
    dense_bf16_tflops: float | None = None
    source: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)
