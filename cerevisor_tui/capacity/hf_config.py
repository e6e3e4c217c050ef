"""Turn a Hugging Face config.json (already parsed into a dict) into a ModelSpec.

Handled: MHA/GQA (`head_dim`, or `hidden_size / num_attention_heads` when absent), MLA
(`kv_lora_rank` + `qk_rope_head_dim`), sliding windows (`layer_types`, Gemma-3's
`sliding_window_pattern`, Gemma-2's alternation, Mistral-style all-layer windows unless
`use_sliding_window` is false), hybrids whose linear-attention layers keep a fixed-size state instead of a KV
cache (`layer_types` naming `linear_attention`: Qwen3.5/3.6, Qwen3-Next), multimodal configs that nest the language model under `text_config`
(also `llm_config`, `language_config`), and `torch_dtype`/`dtype` for the `auto` KV dtype.

Note: `auto` here means the dtype config.json names. vLLM's `--dtype auto` runs float32 checkpoints
in float16 on GPUs; for those, pass `--kv-dtype fp16` to match the server.

config.json does not state the parameter count; for the common decoder shapes (dense and MoE, not
MLA) it is estimated from the matrix sizes, which is within a few percent of the published counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cerevisor_tui.capacity.errors import CapacityError, ModelConfigError
from cerevisor_tui.capacity.specs import ModelSpec, normalize_dtype

_NESTED = ("text_config", "llm_config", "language_config")


def _flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(config)
    for key in _NESTED:
        nested = config.get(key)
        if isinstance(nested, Mapping) and "num_hidden_layers" not in config:
            merged.update(nested)
    return merged


def _int(config: Mapping[str, Any], *keys: str, required: str | None = None) -> int | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ModelConfigError(f"{required or keys[0]}: expected a non-negative number, got {value!r}")
        return int(value)
    if required:
        raise ModelConfigError(f"missing {required} (looked for {', '.join(keys)})")
    return None


def _sliding(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, int]:
    """(window tokens, number of sliding-window layers)."""
    window = _int(config, "sliding_window")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        sliding = sum(1 for t in layer_types if isinstance(t, str) and "sliding" in t)
        if sliding and not window:
            raise ModelConfigError("layer_types names sliding layers but sliding_window is missing")
        return (window if sliding else None), sliding
    if not window:
        return None, 0
    pattern = _int(config, "sliding_window_pattern")
    if pattern and pattern > 1:
        # Gemma-3: every `pattern`-th layer is global, the others are local.
        return window, num_layers - num_layers // pattern
    if config.get("model_type") == "gemma2":
        return window, (num_layers + 1) // 2
    if config.get("use_sliding_window") is False:
        return None, 0
    return window, num_layers


def _linear_layers(config: Mapping[str, Any], num_layers: int) -> int:
    """How many layers hold a fixed-size state (linear attention), not a KV cache that grows with the tokens."""
    layer_types = config.get("layer_types")
    if not isinstance(layer_types, list):
        return 0
    linear = sum(1 for t in layer_types if isinstance(t, str) and "linear" in t)
    if linear >= num_layers:
        raise ModelConfigError("layer_types names every layer linear attention: no KV cache to size")
    return linear


def _weight_dtype(config: Mapping[str, Any], dtype: str) -> str:
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return dtype
    method = str(quant.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    bits = quant.get("bits") or quant.get("w_bit")
    if bits == 4:
        return "int4"
    if bits == 8:
        return "int8"
    return dtype


def _estimate_params(config: Mapping[str, Any], layers: int, heads: int, kv_heads: int, head_dim: int) -> tuple[float, float] | None:
    """(all parameters, parameters active per token) from the matrix shapes, or None if unknown."""
    hidden = _int(config, "hidden_size")
    vocab = _int(config, "vocab_size")
    intermediate = _int(config, "intermediate_size")
    if not (hidden and vocab and intermediate):
        return None
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    experts = _int(config, "num_local_experts", "num_experts", "n_routed_experts") or 0
    if experts:
        expert_size = 3 * hidden * (_int(config, "moe_intermediate_size") or intermediate)
        per_token = _int(config, "num_experts_per_tok", "experts_per_token") or 1
        shared = 3 * hidden * (_int(config, "shared_expert_intermediate_size") or 0)
        shared += (_int(config, "n_shared_experts") or 0) * expert_size
        router = hidden * experts
        total = embeddings + layers * (attention + experts * expert_size + shared + router)
        active = embeddings + layers * (attention + per_token * expert_size + shared + router)
        return float(total), float(active)
    total = embeddings + layers * (attention + 3 * hidden * intermediate)
    return float(total), float(total)


def model_from_hf_config(config: Any, name: str = "config.json", source: str = "") -> ModelSpec:
    """A ModelSpec from a parsed Hugging Face config.json; raises ModelConfigError naming what is wrong."""
    if not isinstance(config, Mapping):
        raise ModelConfigError("config.json must hold a JSON object")
    flat = _flatten(config)
    layers = _int(flat, "num_hidden_layers", "n_layer", "num_layers", required="num_hidden_layers")
    assert layers is not None
    if layers == 0:
        raise ModelConfigError("num_hidden_layers is 0")
    raw_dtype = flat.get("torch_dtype") or flat.get("dtype") or "bfloat16"
    try:
        dtype = normalize_dtype(str(raw_dtype))
    except CapacityError as exc:
        raise ModelConfigError(f"torch_dtype: {exc}") from None
    max_context = _int(flat, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    window, sliding_layers = _sliding(flat, layers)
    common: dict[str, Any] = dict(
        name=name,
        num_layers=layers - _linear_layers(flat, layers),
        max_context_tokens=max_context,
        dtype=dtype,
        sliding_window_tokens=window,
        sliding_layers=sliding_layers,
        weight_dtype=_weight_dtype(flat, dtype),
        source=source or name,
    )

    if flat.get("kv_lora_rank"):
        rope = _int(flat, "qk_rope_head_dim", required="qk_rope_head_dim")
        return ModelSpec(
            **common,
            num_kv_heads=0,
            head_dim=0,
            attention="mla",
            kv_lora_rank=_int(flat, "kv_lora_rank") or 0,
            qk_rope_head_dim=rope or 0,
            weights_source="unknown: config.json does not give the parameter count of an MLA model",
        )

    heads = _int(flat, "num_attention_heads", "n_head", "num_heads", required="num_attention_heads")
    assert heads is not None
    if heads == 0:
        raise ModelConfigError("num_attention_heads is 0")
    kv_heads = _int(flat, "num_key_value_heads", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if flat.get("multi_query") else heads
    head_dim = _int(flat, "head_dim")
    if not head_dim:
        hidden = _int(flat, "hidden_size", "n_embd", "d_model", required="head_dim or hidden_size")
        assert hidden is not None
        head_dim = hidden // heads
    if kv_heads == 0 or head_dim == 0:
        raise ModelConfigError("num_key_value_heads and head_dim must be positive")
    counts = _estimate_params(flat, layers, heads, kv_heads, head_dim)
    return ModelSpec(
        **common,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention="gqa",
        params=counts[0] if counts else None,
        active_params=counts[1] if counts else None,
        weights_source="estimated from config.json matrix shapes" if counts else "unknown",
    )
