"""Pure KV-cache capacity math: model and GPU presets, bytes per token, conversations that fit, zones.

No I/O beyond reading the packaged preset data; callers read config.json files themselves and pass the
parsed dict to `model_from_hf_config`.
"""

from cerevisor_tui.capacity.errors import CapacityError, ModelConfigError, UnknownPresetError
from cerevisor_tui.capacity.estimate import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_PREFILL_MFU,
    DEFAULT_RELOAD_GB_PER_S,
    DEFAULT_RUNTIME_RESERVE_GIB,
    CliffCost,
    KvEstimate,
    Zone,
    duration_text,
    estimate,
)
from cerevisor_tui.capacity.hf_config import model_from_hf_config
from cerevisor_tui.capacity.kv import KvLayout, bytes_per_token, kv_layout
from cerevisor_tui.capacity.presets import get_gpu, get_model, list_gpus, list_models
from cerevisor_tui.capacity.specs import KV_DTYPES, GpuSpec, ModelSpec

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_PREFILL_MFU",
    "DEFAULT_RELOAD_GB_PER_S",
    "DEFAULT_RUNTIME_RESERVE_GIB",
    "KV_DTYPES",
    "CapacityError",
    "CliffCost",
    "GpuSpec",
    "KvEstimate",
    "KvLayout",
    "ModelConfigError",
    "ModelSpec",
    "UnknownPresetError",
    "Zone",
    "bytes_per_token",
    "duration_text",
    "estimate",
    "get_gpu",
    "get_model",
    "kv_layout",
    "list_gpus",
    "list_models",
    "model_from_hf_config",
]
