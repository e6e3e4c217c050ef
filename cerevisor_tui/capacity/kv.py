"""KV-cache bytes per token, per GPU, for a model under tensor parallelism.

The model:
- MHA/GQA: each layer caches one K and one V vector per KV head: 2 x kv_heads x head_dim elements.
  Tensor parallelism splits the KV heads across GPUs (vLLM: `max(1, kv_heads // tp)` heads per GPU,
  so with more GPUs than KV heads, heads are replicated, not split further).
- MLA (DeepSeek-V3/R1): each layer caches one compressed latent of kv_lora_rank + qk_rope_head_dim
  elements per token (there is no separate K and V). vLLM keeps the whole latent on every
  tensor-parallel GPU: it is replicated, not split, so per-GPU cost does not fall as GPUs are added.
- Sliding-window layers (gpt-oss: alternate layers, window 128; Gemma-3: 5 local to 1 global,
  window 1024) keep at most their window of tokens per conversation. Their cost is a per-conversation
  constant once the conversation is longer than the window; only the full-attention layers grow with
  the context. `conversation_bytes_per_gpu` accounts for that, rounding each part up to whole blocks
  as a paged cache does. (vLLM also holds up to one prefill chunk beyond the window while a long
  prompt is being prefilled; this model ignores that transient.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cerevisor_tui.capacity.errors import CapacityError
from cerevisor_tui.capacity.specs import ModelSpec, kv_dtype_bytes


@dataclass(frozen=True)
class KvLayout:
    """What one token costs in KV cache on one GPU, split into full-attention and sliding-window layers."""

    full_bytes_per_token_per_gpu: int
    window_bytes_per_token_per_gpu: int
    window_tokens: int | None
    tensor_parallel: int
    kv_element_bytes: int
    replicated: bool
    bytes_per_token: int

    @property
    def bytes_per_token_per_gpu(self) -> int:
        """Per-GPU cost of a token while it is inside every layer's window (all layers count)."""
        return self.full_bytes_per_token_per_gpu + self.window_bytes_per_token_per_gpu

    @property
    def bytes_per_token_all_gpus(self) -> int:
        """What a token costs summed over the tensor-parallel GPUs (larger than `bytes_per_token` for MLA)."""
        return self.bytes_per_token_per_gpu * self.tensor_parallel

    @property
    def has_sliding_window(self) -> bool:
        return self.window_tokens is not None and self.window_bytes_per_token_per_gpu > 0

    def conversation_bytes_per_gpu(self, context_tokens: int, block_size: int = 16) -> int:
        """KV bytes one conversation of `context_tokens` holds on one GPU, in whole blocks."""
        full_tokens = _round_up(context_tokens, block_size)
        total = full_tokens * self.full_bytes_per_token_per_gpu
        if self.has_sliding_window:
            assert self.window_tokens is not None
            total += _round_up(min(context_tokens, self.window_tokens), block_size) * self.window_bytes_per_token_per_gpu
        return total


def _round_up(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def _per_layer_elements(model: ModelSpec, tensor_parallel: int) -> tuple[int, int, bool]:
    """Cached elements per token and layer: (on one GPU, for one copy of the model, replicated?)."""
    if model.attention == "mla":
        latent = model.kv_lora_rank + model.qk_rope_head_dim
        if latent <= 0:
            raise CapacityError(f"{model.name}: MLA needs kv_lora_rank and qk_rope_head_dim")
        return latent, latent, tensor_parallel > 1
    if model.num_kv_heads <= 0 or model.head_dim <= 0:
        raise CapacityError(f"{model.name}: needs num_key_value_heads and head_dim > 0")
    heads_per_gpu = max(1, model.num_kv_heads // tensor_parallel)
    replicated = tensor_parallel > model.num_kv_heads
    return 2 * heads_per_gpu * model.head_dim, 2 * model.num_kv_heads * model.head_dim, replicated


def kv_layout(model: ModelSpec, kv_dtype: str = "auto", tensor_parallel: int = 1) -> KvLayout:
    """The per-GPU KV layout of `model` with `tensor_parallel` GPUs and a KV dtype (auto, fp16, bf16, fp8)."""
    if tensor_parallel < 1:
        raise CapacityError(f"GPU count must be at least 1, got {tensor_parallel}")
    element_bytes = kv_dtype_bytes(kv_dtype, model.dtype)
    per_gpu, one_copy, replicated = _per_layer_elements(model, tensor_parallel)
    sliding = model.sliding_layers if model.sliding_window_tokens else 0
    full = model.num_layers - sliding
    return KvLayout(
        full_bytes_per_token_per_gpu=full * per_gpu * element_bytes,
        window_bytes_per_token_per_gpu=sliding * per_gpu * element_bytes,
        window_tokens=model.sliding_window_tokens if sliding else None,
        tensor_parallel=tensor_parallel,
        kv_element_bytes=element_bytes,
        replicated=replicated,
        bytes_per_token=model.num_layers * one_copy * element_bytes,
    )


def bytes_per_token(model: ModelSpec, kv_dtype: str = "auto") -> int:
    """KV bytes one token costs in one copy of the model, every layer counted (Llama-3.1-8B bf16: 131072)."""
    return kv_layout(model, kv_dtype, 1).bytes_per_token
