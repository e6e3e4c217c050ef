"""Read where a server keeps KV beyond GPU memory, from its /metrics: vLLM's native offload and tiering, LMCache,
SGLang's HiCache. Parsing is pure (`parse_tiers`), and `idle_tier_warning` compares two scrapes.

The names are the servers' own (their source, 2026-09):
- vLLM: `vllm:prefix_cache_{queries,hits}` (the GPU tier), `vllm:external_prefix_cache_{queries,hits}` (tokens the
  KV connector, here the CPU tier, served), `vllm:kv_offload_{store,load}_bytes` (GPU to CPU and back; before
  that `vllm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"|"CPU_to_GPU"}`), `vllm:kv_offload_cpu_cache_usage_perc`,
  `vllm:kv_offload_tiering_chunk_{queries,hits}{tier}` and `..._{write,read}_bytes{tier}` (the tier label is
  "0:primary" for the CPU tier, "1:fs" and so on for the tiers under it, v1/kv_offload/tiering/metrics.py), and
  the CPU tier's size as `kv_offloading_size` (GiB) among `vllm:cache_config_info`'s labels, turned into tokens
  with the same info's `kv_cache_memory_bytes` / `kv_cache_size_tokens` (one GPU's bytes per token).
- LMCache (lmcache/observability.py): `lmcache:num_{requested,hit,stored}_tokens`, beside vLLM's own GPU
  counters in the same exposition.
- SGLang (its metrics collector): `sglang:cached_tokens_total{cache_source="device"|"host"|...}`,
  `sglang:hicache_host_{used,total}_tokens`, `sglang:max_total_num_tokens`, and `sglang:prompt_tokens_total` as
  the tokens asked of the cache.

A value that is not finite or past any real server (more than 10^15 tokens or bytes) reads as absent, as in
endpoints/metrics.py: a broken exporter must not draw a zone of a billion conversations.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

TierSource = Literal["vllm", "lmcache", "sglang"]

GIB = 1024**3
MAX_COUNT = 1e15  # tokens or bytes; anything larger is a broken exporter, read as absent

# the CPU tier's label in vLLM's tiering metrics: tier index 0 is the primary (CPU) tier
VLLM_PRIMARY_TIER = "0:primary"

_PREFIXES = ("vllm:prefix_cache_", "vllm:external_prefix_cache_", "vllm:kv_offload_", "vllm:cache_config_info",
             "lmcache:", "sglang:cached_tokens", "sglang:hicache_host_", "sglang:max_total_num_tokens",
             "sglang:prompt_tokens")


@dataclass(frozen=True)
class TierCounts:
    """One tier as a scrape shows it. Counters are cumulative, as the server keeps them; None: not reported.

    `hits`/`queries` are prefix tokens served from this tier and asked of it (`unit` "chunks" for vLLM's tiers
    under the CPU one, which count offload chunks); `stored`/`loaded` are what moved into and out of it (bytes
    for vLLM, tokens for LMCache); `used_tokens`/`capacity_tokens`/`usage` its fill."""

    tier: str  # "gpu", "cpu", or the server's name of a tier under the CPU one ("1:fs")
    hits: float | None = None
    queries: float | None = None
    unit: str = "tokens"
    stored: float | None = None
    loaded: float | None = None
    used_tokens: float | None = None
    capacity_tokens: float | None = None
    usage: float | None = None


@dataclass(frozen=True)
class TierSnapshot:
    """The tiers one scrape reports, GPU first; None from `parse_tiers` for a server with no tier beyond GPU."""

    source: TierSource
    tiers: tuple[TierCounts, ...]

    def tier(self, name: str) -> TierCounts | None:
        return next((t for t in self.tiers if t.tier == name), None)

    @property
    def cpu_capacity_tokens(self) -> float | None:
        cpu = self.tier("cpu")
        return cpu.capacity_tokens if cpu else None


def _bounded(value: float | None) -> float | None:
    if value is None or not math.isfinite(value) or value < 0 or value > MAX_COUNT:
        return None
    return value


class _Samples:
    def __init__(self, families: Iterable[Any]) -> None:
        self.rows: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in families:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                self.rows[sample.name].append((dict(sample.labels), float(sample.value)))

    def has(self, *names: str) -> bool:
        return any(n in self.rows for n in names)

    def sum(self, name: str, **where: str) -> float | None:
        """The sum of `name`'s samples whose labels match `where` (values compared without case)."""
        found = [v for labels, v in self.rows.get(name, ())
                 if all(labels.get(k, "").lower() == w.lower() for k, w in where.items())]
        if not found or not all(math.isfinite(v) for v in found):
            return None
        return _bounded(sum(found))

    def max(self, name: str) -> float | None:
        found = [v for _, v in self.rows.get(name, ()) if math.isfinite(v)]
        return _bounded(max(found)) if found else None

    def label_values(self, name: str, key: str) -> list[str]:
        seen: dict[str, None] = {}
        for labels, _ in self.rows.get(name, ()):
            if key in labels:
                seen.setdefault(labels[key], None)
        return list(seen)


def _relevant(text: str) -> str:
    keep = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line
        if name.startswith(_PREFIXES):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _families(text: str) -> list[Any]:
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError):
        pass
    kept = []  # a malformed line: keep the others, as endpoints/metrics.py does
    for line in text.splitlines():
        try:
            list(text_string_to_metric_families(line + "\n"))
        except (ValueError, TypeError, IndexError):
            continue
        kept.append(line)
    try:
        return list(text_string_to_metric_families("\n".join(kept) + "\n"))
    except (ValueError, TypeError, IndexError):
        return []


def _label_float(value: str | None) -> float | None:
    try:
        return _bounded(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def _vllm_capacity(s: _Samples) -> tuple[float | None, float | None]:
    """(GPU KV tokens, CPU tier tokens) from cache_config_info, engines summed."""
    gpu = cpu = None
    for labels, _ in s.rows.get("vllm:cache_config_info", ()):
        tokens = _label_float(labels.get("kv_cache_size_tokens"))
        blocks, size = _label_float(labels.get("num_gpu_blocks")), _label_float(labels.get("block_size"))
        if tokens is None and blocks is not None and size is not None:
            tokens = blocks * size
        if tokens:
            gpu = (gpu or 0) + tokens
        offload_gib = _label_float(labels.get("kv_offloading_size"))
        memory = _label_float(labels.get("kv_cache_memory_bytes"))
        cpu_blocks = _label_float(labels.get("num_cpu_blocks"))
        if offload_gib and memory and tokens:
            cpu = (cpu or 0) + offload_gib * GIB / (memory / tokens)
        elif cpu_blocks and size:  # the simulator, and engines that count their CPU blocks
            cpu = (cpu or 0) + cpu_blocks * size
    return _bounded(gpu), _bounded(cpu)


def _vllm(s: _Samples) -> TierSnapshot | None:
    gpu_tokens, cpu_tokens = _vllm_capacity(s)
    stored = s.sum("vllm:kv_offload_store_bytes_total")
    loaded = s.sum("vllm:kv_offload_load_bytes_total")
    if stored is None and loaded is None:  # the connector's older names
        stored = s.sum("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU")
        loaded = s.sum("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU")
    usage = s.max("vllm:kv_offload_cpu_cache_usage_perc")
    chunks = "vllm:kv_offload_tiering_chunk_queries_total"
    labels = s.label_values(chunks, "tier")
    # vLLM exports the external prefix counters with or without a connector: alone, they show no tier
    if cpu_tokens is None and stored is None and loaded is None and usage is None and not labels:
        return None
    hits, queries = s.sum("vllm:external_prefix_cache_hits_total"), s.sum("vllm:external_prefix_cache_queries_total")
    unit = "tokens"
    if hits is None and VLLM_PRIMARY_TIER in labels:
        hits = s.sum("vllm:kv_offload_tiering_chunk_hits_total", tier=VLLM_PRIMARY_TIER)
        queries = s.sum(chunks, tier=VLLM_PRIMARY_TIER)
        unit = "chunks"
    tiers = [
        TierCounts("gpu", s.sum("vllm:prefix_cache_hits_total"), s.sum("vllm:prefix_cache_queries_total"),
                   capacity_tokens=gpu_tokens),
        TierCounts("cpu", hits, queries, unit, stored, loaded,
                   used_tokens=usage * cpu_tokens if usage is not None and cpu_tokens else None,
                   capacity_tokens=cpu_tokens, usage=usage),
    ]
    for label in labels:
        if label == VLLM_PRIMARY_TIER:
            continue
        tiers.append(TierCounts(
            label, s.sum("vllm:kv_offload_tiering_chunk_hits_total", tier=label), s.sum(chunks, tier=label), "chunks",
            s.sum("vllm:kv_offload_tiering_write_bytes_total", tier=label),
            s.sum("vllm:kv_offload_tiering_read_bytes_total", tier=label)))
    return TierSnapshot("vllm", tuple(tiers))


def _lmcache(s: _Samples) -> TierSnapshot:
    gpu_tokens, _ = _vllm_capacity(s)
    hits = s.sum("lmcache:num_hit_tokens_total")
    return TierSnapshot("lmcache", (
        TierCounts("gpu", s.sum("vllm:prefix_cache_hits_total"), s.sum("vllm:prefix_cache_queries_total"),
                   capacity_tokens=gpu_tokens),
        # LMCache counts a retrieve's hit tokens as loaded: what it served is what it sent back to the GPU
        TierCounts("cpu", hits, s.sum("lmcache:num_requested_tokens_total"), "tokens",
                   s.sum("lmcache:num_stored_tokens_total"), hits),
    ))


def _sglang(s: _Samples) -> TierSnapshot | None:
    total = _ranks(s, "sglang:hicache_host_total_tokens")
    sources = s.label_values("sglang:cached_tokens_total", "cache_source")
    if total is None and not [x for x in sources if x != "device"]:
        return None  # no hierarchical cache: the GPU is the only tier
    used = _ranks(s, "sglang:hicache_host_used_tokens")
    tiers = [
        TierCounts("gpu", s.sum("sglang:cached_tokens_total", cache_source="device"),
                   s.sum("sglang:prompt_tokens_total"), capacity_tokens=_ranks(s, "sglang:max_total_num_tokens")),
        TierCounts("cpu", s.sum("sglang:cached_tokens_total", cache_source="host"), used_tokens=used,
                   capacity_tokens=total, usage=used / total if used is not None and total else None),
    ]
    tiers += [TierCounts(src, s.sum("sglang:cached_tokens_total", cache_source=src))
              for src in sources if src not in ("device", "host")]
    return TierSnapshot("sglang", tuple(tiers))


def _ranks(s: _Samples, name: str) -> float | None:
    """A per-rank gauge summed over data-parallel ranks: tensor-parallel ranks repeat the same pool, so only
    tp_rank 0 counts (a sample without the label counts as is)."""
    rows = s.rows.get(name, ())
    firsts = [v for labels, v in rows if labels.get("tp_rank", "0") == "0"]
    if not firsts or not all(math.isfinite(v) for v in firsts):
        return None
    return _bounded(sum(firsts))


def parse_tiers(text: str) -> TierSnapshot | None:
    """The KV tiers a /metrics text reports; None when it reports none beyond GPU memory."""
    s = _Samples(_families(_relevant(text)))
    if s.has("lmcache:num_hit_tokens_total", "lmcache:num_requested_tokens_total"):
        return _lmcache(s)
    if any(name.startswith("sglang:") for name in s.rows):
        return _sglang(s)
    return _vllm(s)


def _moved(prev: float | None, cur: float | None) -> float:
    """How far a counter moved; a counter that went back (a restart) counts from zero."""
    if cur is None:
        return 0.0
    if prev is None or cur < prev:
        return cur
    return cur - prev


def idle_tier_warning(prev: TierSnapshot | None, cur: TierSnapshot) -> str:
    """A warning when a tier below the GPU stores without ever loading: it held data at the last scrape, lookups
    came since, and it has never served one since the server started (a misconfigured offload that recomputes
    every turn, or a tier too small to keep a turn's prefix until the next). "" otherwise."""
    if prev is None:
        return ""
    for t in cur.tiers:
        before = prev.tier(t.tier)
        if t.tier == "gpu" or before is None:
            continue
        held = before.stored or before.used_tokens  # SGLang has no store counter: its host pool fills
        if t.queries is not None:
            asked = _moved(before.queries, t.queries)
        else:
            asked = _moved(_gpu_queries(prev), _gpu_queries(cur))
        if held and asked > 0 and not t.hits and not t.loaded:
            return (f"{t.tier} tier stores but never loads: not one prefix served from it, so every returning "
                    "prefix is recomputed (check the offload config and the tier's size)")
    return ""


def _gpu_queries(snapshot: TierSnapshot) -> float | None:
    gpu = snapshot.tier("gpu")
    return gpu.queries if gpu else None

