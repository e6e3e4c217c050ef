"""Model and GPU presets, read from the TOML data files packaged in `capacity/data/`."""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Mapping
from importlib import resources
from typing import Any

from cerevisor_tui.capacity.errors import CapacityError, UnknownPresetError
from cerevisor_tui.capacity.specs import MIB, GpuSpec, ModelSpec, normalize_dtype

_SUFFIXES = ("-instruct", "-it", "-chat")


def _key(name: str) -> str:
    """Lookup key: lower case, no organisation prefix, '_' and spaces as '-'."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    return re.sub(r"[\s_]+", "-", key)


def _read(filename: str) -> dict[str, Any]:
    data = resources.files("cerevisor_tui.capacity").joinpath("data", filename).read_text(encoding="utf-8")
    return tomllib.loads(data)


def _model(name: str, entry: Mapping[str, Any]) -> ModelSpec:
    attention = entry.get("attention", "gqa")
    heads = int(entry.get("num_key_value_heads", entry.get("num_attention_heads", 0)))
    head_dim = int(entry.get("head_dim") or (entry["hidden_size"] // entry["num_attention_heads"]))
    return ModelSpec(
        name=name,
        num_layers=int(entry["num_hidden_layers"]) - int(entry.get("linear_layers", 0)),
        num_kv_heads=heads,
        head_dim=head_dim,
        max_context_tokens=entry.get("max_position_embeddings"),
        dtype=normalize_dtype(entry.get("torch_dtype", "bfloat16")),
        attention=attention,
        kv_lora_rank=int(entry.get("kv_lora_rank", 0)),
        qk_rope_head_dim=int(entry.get("qk_rope_head_dim", 0)),
        sliding_window_tokens=entry.get("sliding_window"),
        sliding_layers=int(entry.get("sliding_layers", 0)),
        params=entry.get("params"),
        active_params=entry.get("active_params"),
        weight_dtype=normalize_dtype(entry["weight_dtype"]) if "weight_dtype" in entry else None,
        weights_gib=entry.get("weights_gib"),
        weights_source=entry.get("weights_source", ""),
        source=entry["source"],
        hf_repo=entry.get("hf_repo", ""),
        aliases=tuple(entry.get("aliases", ())),
    )


def _gpu(name: str, entry: Mapping[str, Any]) -> GpuSpec:
    return GpuSpec(
        name=name,
        memory_gib=entry["memory_mib"] * MIB / 1024**3,
        label=entry.get("label", name),
        host_link_gb_per_s=entry.get("host_link_gb_per_s"),
        dense_bf16_tflops=entry.get("dense_bf16_tflops"),
        source=entry["source"],
        aliases=tuple(entry.get("aliases", ())),
    )


@functools.cache
def _models() -> dict[str, ModelSpec]:
    return {name: _model(name, entry) for name, entry in _read("models.toml")["models"].items()}


@functools.cache
def _gpus() -> dict[str, GpuSpec]:
    return {name: _gpu(name, entry) for name, entry in _read("gpus.toml")["gpus"].items()}


def _index(presets: Mapping[str, ModelSpec] | Mapping[str, GpuSpec]) -> dict[str, str]:
    index: dict[str, str] = {}
    for name, spec in presets.items():
        names = [name, *spec.aliases]
        if isinstance(spec, ModelSpec) and spec.hf_repo:
            names.append(spec.hf_repo)
        for alias in names:
            index[_key(alias)] = name
    return index


def _find(kind: str, name: str, presets: Mapping[str, Any]) -> Any:
    index = _index(presets)
    key = _key(name)
    candidates = [key] + [key[: -len(s)] for s in _SUFFIXES if key.endswith(s)]
    for candidate in candidates:
        if candidate in index:
            return presets[index[candidate]]
    raise UnknownPresetError(kind, name, presets.keys())


def get_model(name: str) -> ModelSpec:
    """The model preset called `name` (its preset name, an alias or its Hugging Face repo id)."""
    return _find("model", name, _models())


def get_gpu(name: str) -> GpuSpec:
    """The GPU preset called `name` (e.g. h100, a100-80gb, rtx-4090, mi300x)."""
    return _find("GPU", name, _gpus())


def list_models() -> list[ModelSpec]:
    return list(_models().values())


def list_gpus() -> list[GpuSpec]:
    return list(_gpus().values())


def check_presets() -> None:
    """Raise CapacityError if a packaged preset is inconsistent (used by the tests)."""
    for model in list_models():
        if model.sliding_layers and not model.sliding_window_tokens:
            raise CapacityError(f"{model.name}: sliding_layers without sliding_window")
        if model.weights_bytes is None:
            raise CapacityError(f"{model.name}: needs params or weights_gib")
        if not model.source:
            raise CapacityError(f"{model.name}: needs a source")
    for gpu in list_gpus():
        if gpu.memory_gib <= 0 or not gpu.source:
            raise CapacityError(f"{gpu.name}: needs memory_mib and a source")
