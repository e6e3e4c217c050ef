"""`cerevisor-tui estimate`: print how many conversations fit in GPU KV memory, and the zones beyond."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from cerevisor_tui.capacity import (
    CapacityError,
    KvEstimate,
    ModelSpec,
    UnknownPresetError,
    bytes_per_token,
    duration_text,
    estimate,
    get_gpu,
    get_model,
    list_gpus,
    list_models,
    model_from_hf_config,
)

PROG = "cerevisor-tui estimate"
SIM_MODEL = "sim-model"  # what `cerevisor-tui sim` serves; the README's examples name it


def _sim_model(exc: UnknownPresetError) -> str:
    """The simulator's model has no architecture to size: say where its KV cache comes from instead."""
    return (f"{exc.name!r} is the simulator's own model, not a preset: its KV cache is what `cerevisor-tui sim` is "
            "given (--kv-cache-tokens, or --profile MODEL@GPU, e.g. qwen3.6-35b-a3b@2xh100, sized by this estimate "
            "for MODEL); estimate MODEL itself, e.g. --model qwen3.6-35b-a3b (see `cerevisor-tui estimate --list`)")


def main(args: argparse.Namespace) -> int:
    out: TextIO = sys.stdout
    try:
        if getattr(args, "list", False):
            _print_presets(out, as_json=args.json)
            return 0
        result = estimate(
            _load_model(args),
            gpu=get_gpu(args.gpu) if args.gpu else None,
            gpus=args.gpus,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_memory_gib=args.kv_memory_gib,
            context_tokens=args.context,
            kv_dtype=args.kv_dtype,
            cpu_offload_gib=args.cpu_offload_gib,
            **_optional(args),
        )
    except UnknownPresetError as exc:
        simulated = (exc.kind, exc.name.strip().lower()) == ("model", SIM_MODEL)
        print(f"{PROG}: error: {_sim_model(exc) if simulated else exc}", file=sys.stderr)
        return 2
    except CapacityError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            json.dump(result.to_dict(), out, indent=2)
            out.write("\n")
        else:
            out.write(format_estimate(result))
        out.flush()
    except BrokenPipeError:
        # `estimate ... | head`: the reader left; stop quietly instead of a traceback at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _optional(args: argparse.Namespace) -> dict[str, Any]:
    """Flags that only pass through when given, so the library's defaults stay in one place."""
    names = ("runtime_reserve_gib", "block_size", "weights_gib", "reload_gb_per_s", "prefill_tokens_per_s")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _load_model(args: argparse.Namespace) -> ModelSpec:
    if args.model:
        return get_model(args.model)
    path = Path(args.model_config)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CapacityError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CapacityError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    try:
        return model_from_hf_config(config, name=path.name, source=str(path))
    except CapacityError as exc:
        raise CapacityError(f"{path}: {exc}") from None


def _gib(value: float) -> str:
    return f"{value:,.2f} GiB"


def _describe_model(model: ModelSpec) -> str:
    if model.attention == "mla":
        shape = f"MLA latent {model.kv_lora_rank}+{model.qk_rope_head_dim}"
    else:
        shape = f"{model.num_kv_heads} KV heads x {model.head_dim}"
    parts = [f"{model.num_layers} layers", shape]
    if model.sliding_layers and model.sliding_window_tokens:
        parts.append(f"{model.sliding_layers} layers with a {model.sliding_window_tokens:,}-token window")
    if model.max_context_tokens:
        parts.append(f"max context {model.max_context_tokens:,}")
    return f"{model.name} ({', '.join(parts)})"


def format_estimate(e: KvEstimate) -> str:
    """The human-readable report: one labelled line per figure, the configure line last but notes."""
    rows: list[tuple[str, str]] = [("model", _describe_model(e.model)), ("", f"source: {e.model.source}")]
    if e.gpu is not None:
        hardware = f"{e.gpus} x {e.gpu.name} ({_gib(e.gpu.memory_gib)} each)"
        rows.append(("hardware", hardware + (", tensor parallel" if e.gpus > 1 else "")))
    elif e.gpus > 1:
        rows.append(("hardware", f"{e.gpus} GPUs, tensor parallel"))
    rows.append(("KV dtype", f"{e.kv_dtype} ({e.layout.kv_element_bytes} bytes per element)"))
    if e.runtime_reserve_gib is not None and e.gpu is not None and e.weights_gib_per_gpu is not None:
        memory = (
            f"{_gib(e.kv_memory_gib_per_gpu)} per GPU = {e.gpu.memory_gib:.2f} x {e.gpu_memory_utilization:g} "
            f"- weights {e.weights_gib_per_gpu:.2f} - runtime reserve {e.runtime_reserve_gib:g}"
        )
    else:
        memory = f"{_gib(e.kv_memory_gib_per_gpu)} per GPU (as the server reported)"
    rows.append(("KV memory", memory))
    per_token = f"{e.bytes_per_token:,} bytes"
    if e.gpus > 1:
        per_token += f" ({e.bytes_per_token_per_gpu:,} per GPU{', replicated' if e.layout.replicated else ''})"
    rows.append(("bytes/token", per_token))
    capacity = f"{e.kv_capacity_tokens:,} tokens"
    if e.runtime_reserve_gib is None:
        capacity += "  (compare with vLLM's log: GPU KV cache size: N tokens)"
    rows.append(("KV capacity", capacity))
    rows.append(("context", f"{e.context_tokens:,} tokens per conversation"))
    rows.append(
        (
            "fit",
            f"{e.conversations_fit:,} conversation{'' if e.conversations_fit == 1 else 's'} "
            f"(vLLM: Maximum concurrency for {e.context_tokens:,} tokens per request: {e.max_concurrency_ratio:.2f}x)",
        )
    )
    for i, zone in enumerate(e.zones):
        rows.append(("zones" if i == 0 else "", f"{zone.name} {zone.range_text()}: {zone.meaning}"))
    if e.cpu_offload_gib > 0:
        rows.append(("CPU tier", f"{e.cpu_offload_gib:g} GiB holds {e.cpu_conversations:,} more conversations"))
    rows.append(
        (
            "cliff cost",
            f"per conversation: reload {duration_text(e.cliff.reload_s)}, recompute {duration_text(e.cliff.recompute_s)}",
        )
    )
    for assumption in e.cliff.assumptions:
        rows.append(("", assumption))
    if e.max_concurrency is None:  # not even one conversation fits: no cap to recommend (0 would be no cap)
        rows.append(("configure", "nothing: shorten the conversations (--context), use an fp8 KV cache "
                                  "(--kv-dtype fp8), or add GPU memory (--gpus, a larger --gpu)"))
    else:
        rows.append(("configure", f"max_concurrency = {e.max_concurrency}"))
    for note in e.notes:
        rows.append(("note", note))
    width = max(len(label) for label, _ in rows) + 2
    return "".join(f"{label:<{width}}{text}\n" for label, text in rows)


def _print_presets(out: TextIO, *, as_json: bool) -> None:
    models = list_models()
    gpus = list_gpus()
    if as_json:
        payload = {
            "models": [
                {
                    "name": m.name,
                    "hf_repo": m.hf_repo,
                    "bytes_per_token": bytes_per_token(m),
                    "max_context_tokens": m.max_context_tokens,
                    "weights_gib": round((m.weights_bytes or 0) / 1024**3, 2),
                    "source": m.source,
                }
                for m in models
            ],
            "gpus": [{"name": g.name, "memory_gib": round(g.memory_gib, 2), "label": g.label, "source": g.source} for g in gpus],
        }
        json.dump(payload, out, indent=2)
        out.write("\n")
        return
    out.write("models (KV bytes per token in the model's dtype, every layer counted; source: Hugging Face config.json)\n")
    out.write(f"  {'name':<18}{'bytes/token':>12}{'max context':>13}{'weights':>11}  hf repo\n")
    for m in models:
        weights = f"{(m.weights_bytes or 0) / 1024**3:.1f} GiB"
        context = f"{m.max_context_tokens:,}" if m.max_context_tokens else "-"
        out.write(f"  {m.name:<18}{bytes_per_token(m):>12,}{context:>13}{weights:>11}  {m.hf_repo}\n")
    out.write("\nGPUs (memory as the driver reports it)\n")
    for g in gpus:
        out.write(f"  {g.name:<18}{g.memory_gib:>8.1f} GiB  {g.label}\n")
    out.write("\nany Hugging Face config.json works too: cerevisor-tui estimate --model-config PATH ...\n")
