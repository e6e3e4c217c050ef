"""How close an endpoint is to its KV-cache cliff: the estimate from config, refined by what the
server itself reports (vLLM's `cache_config_info` token capacity), and the zone of a running count."""

from __future__ import annotations

import json
from pathlib import Path

from cerevisor_tui.capacity import (
    CapacityError,
    KvEstimate,
    estimate,
    get_gpu,
    get_model,
    model_from_hf_config,
)
from cerevisor_tui.config.models import EndpointConfig
from cerevisor_tui.contract.events import LoadEstimate


def from_config(ep: EndpointConfig) -> tuple[LoadEstimate | None, str]:
    """The estimate an endpoint's `[endpoints.capacity]` table describes, or (None, why not)."""
    cap = ep.capacity
    if not cap.model:
        return None, "no [endpoints.capacity] model configured"
    try:
        path = Path(cap.model).expanduser()
        if cap.model.endswith(".json") or path.is_file():
            model = model_from_hf_config(json.loads(path.read_text(encoding="utf-8")), name=path.name, source=str(path))
        else:
            model = get_model(cap.model)
        gpu = get_gpu(cap.gpu) if cap.gpu else None
        if gpu is None and not cap.kv_memory_gib:
            return None, "capacity needs gpu or kv_memory_gib"
        est: KvEstimate = estimate(
            model, gpu=gpu, gpus=cap.gpus, gpu_memory_utilization=cap.gpu_memory_utilization,
            kv_memory_gib=cap.kv_memory_gib or None, context_tokens=cap.context_tokens or None,
            kv_dtype=cap.kv_dtype, cpu_offload_gib=cap.cpu_offload_gib,
        )
    except (CapacityError, OSError, ValueError) as exc:
        return None, f"estimate unavailable: {exc}"
    detail = f"{model.name} on {cap.gpus}x {gpu.name}" if gpu else f"{model.name}, {cap.kv_memory_gib:g} GiB KV"
    return LoadEstimate(est.conversations_fit, est.kv_capacity_tokens, est.context_tokens, est.cpu_conversations,
                        "estimate", detail), ""


def from_server(kv_cache_tokens: float, context_tokens: int, previous: LoadEstimate | None, *,
                cpu_conversations: int | None = None) -> LoadEstimate:
    """The server's own token capacity divided by the conversation length: measured, not guessed. Its CPU tier:
    `cpu_conversations` when the server reports the tier's size (endpoints/tiers.py), else the estimate's."""
    fit = int(kv_cache_tokens // max(1, context_tokens))
    cpu = cpu_conversations if cpu_conversations is not None else previous.cpu_conversations if previous else 0
    return LoadEstimate(fit, int(kv_cache_tokens), context_tokens, cpu, "server",
                        f"server reports {int(kv_cache_tokens):,} KV tokens")


def conversations_in_flight(ours: int, server_running: float | None, server_waiting: float | None) -> int:
    """Our conversations holding a slot on an endpoint, or what the server itself carries (running plus
    waiting) when it reports more: another client may share the box, and its conversations take KV too."""
    if server_running is None:
        return ours
    return max(ours, int(server_running + (server_waiting or 0)))


def cap_warning(endpoint: str, cap: int, est: LoadEstimate | None) -> str:
    """Why `cap` is past what fits in the endpoint's KV memory ("" when it is not)."""
    if est is None or cap <= est.conversations_fit:
        return ""
    return (f"cap {cap} on {endpoint} is past the {est.conversations_fit} conversations of "
            f"{est.context_tokens:,} tokens that fit in its KV memory ({est.detail}): beyond it, the cliff")
