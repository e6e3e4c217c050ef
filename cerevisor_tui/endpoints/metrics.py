"""Read a model server's own numbers: /metrics (vLLM, llama.cpp, SGLang), /health and llama.cpp's /slots.

Parsing is pure (`parse_metrics`, `parse_slots`, `prefix_hit_rate`) and kept apart from fetching
(`read_server`), so fixtures of real scraped text test it without a server.

Aggregation over label sets (several models, data-parallel engines, SGLang ranks): counts of
requests, preemptions, prefix-cache counters and KV blocks are summed; usage ratios (KV use, SGLang's
cache hit rate) take the maximum, because the fullest engine is the one nearest the cliff.
Missing values are None, never 0.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from cerevisor_tui.endpoints import bounds
from cerevisor_tui.endpoints.client import is_refused, request_scrubber
from cerevisor_tui.endpoints.errors import descriptors_exhausted
from cerevisor_tui.endpoints.latency import LatencyScrape, parse_latency
from cerevisor_tui.endpoints.tiers import TierSnapshot, parse_tiers

ServerKind = Literal["vllm", "llamacpp", "sglang", "unknown"]

DEFAULT_TIMEOUT_S = 2.0

# vLLM renamed some metrics over time; the first name found wins.
_VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_VLLM_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one scrape of /metrics says, in the same terms for every server kind."""

    kind: ServerKind
    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_cache_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    preemptions: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    models: tuple[str, ...] = ()
    latency: LatencyScrape | None = None  # the latency panel's histograms and counters (endpoints/latency.py)
    # the counters that move while the server works (engine/wedge.py): tokens generated and prompt tokens
    # counted server-wide (llama.cpp counts its generated tokens only as a request ends, so its decode calls
    # stand in), prompt tokens computed chunk by chunk during a prefill (SGLang's realtime_tokens_total
    # {mode="prefill_compute"}, the simulator's computed_prompt_tokens; vLLM shows it as KV use climbing),
    # and the requests waiting for KV room (vLLM's waiting_by_reason{capacity})
    generated: float | None = None
    prompt_tokens: float | None = None
    prefill_tokens: float | None = None
    waiting_capacity: int | None = None
    tiers: TierSnapshot | None = None  # KV kept beyond GPU memory: CPU offload, LMCache, HiCache (endpoints/tiers.py)

    def busy_reason(self) -> str | None:
        """'server busy: 3 requests waiting', or None when nothing waits in the server's queue."""
        if self.requests_waiting:
            noun = "request" if self.requests_waiting == 1 else "requests"
            return f"server busy: {self.requests_waiting} {noun} waiting"
        return None


@dataclass(frozen=True)
class SlotsStatus:
    """llama.cpp's /slots: how many of its parallel slots exist and how many are generating."""

    total: int
    processing: int

    @property
    def idle(self) -> int:
        return self.total - self.processing


@dataclass(frozen=True)
class ServerStatus:
    """One look at a server: health, metrics and (llama.cpp) slots, whatever it answered."""

    base_url: str
    reachable: bool
    health_status: int | None = None
    loading: bool = False
    loading_message: str | None = None
    metrics: MetricsSnapshot | None = None
    slots: SlotsStatus | None = None
    error: str | None = None
    refused: bool = False  # /health's connection was refused: nothing listens there (yet)

    @property
    def kind(self) -> ServerKind:
        return self.metrics.kind if self.metrics else "unknown"

    @property
    def busy_reason(self) -> str | None:
        """Why a slow first token is the server's doing, for the stall watchdog; None when not busy."""
        if self.loading:
            return "server loading model"
        return self.metrics.busy_reason() if self.metrics else None

    @property
    def busy(self) -> bool:
        return self.busy_reason is not None


class _Samples:
    """Sample values by sample name (counters keep their `_total`), `_created` timestamps dropped."""

    def __init__(self, families: Iterable[Any]) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)
        self.labels: dict[str, list[dict[str, str]]] = defaultdict(list)
        self.family_names: set[str] = set()
        for family in families:
            self.family_names.add(family.name)
            for sample in family.samples:
                value = bounds.metric(sample.value)
                if sample.name.endswith("_created") or value is None:  # a value no server keeps: absent
                    continue
                self.values[sample.name].append(value)
                self.labels[sample.name].append(dict(sample.labels))

    def first(self, names: Iterable[str]) -> str | None:
        return next((name for name in names if name in self.values), None)

    def sum(self, *names: str) -> float | None:
        name = self.first(names)
        return None if name is None else sum(self.values[name])

    def max(self, *names: str) -> float | None:
        name = self.first(names)
        return None if name is None else max(self.values[name])

    def sum_where(self, name: str, key: str, value: str) -> float | None:
        """The sum of `name`'s samples whose label `key` is `value`; None when it has none."""
        found = [v for v, labels in zip(self.values.get(name, ()), self.labels.get(name, ()), strict=True)
                 if labels.get(key) == value]
        return sum(found) if found else None


def _int(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _label_int(value: str | None) -> int | None:
    try:
        number = bounds.metric(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None
    return None if number is None else int(number)


def detect_kind(names: Iterable[str]) -> ServerKind:
    """The server kind from the metric names it exposes."""
    prefixes = {name.split(":", 1)[0] for name in names if ":" in name}
    for kind in ("vllm", "llamacpp", "sglang"):
        if kind in prefixes:
            return kind
    return "unknown"


def _parse(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def _families(text: str) -> list[Any]:
    """Parse the text; if a line is malformed, drop the lines that do not parse alone and keep the rest."""
    try:
        return _parse(text)
    except (ValueError, TypeError, IndexError):
        pass
    kept = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            kept.append(line)
            continue
        try:
            _parse(line + "\n")
        except (ValueError, TypeError, IndexError):
            continue
        kept.append(line)
    try:
        return _parse("\n".join(kept) + "\n")
    except (ValueError, TypeError, IndexError):
        return []


def _vllm(samples: _Samples) -> MetricsSnapshot:
    blocks = size = tokens = None
    for labels in samples.labels.get("vllm:cache_config_info", []):
        engine_blocks = _label_int(labels.get("num_gpu_blocks"))
        engine_size = _label_int(labels.get("block_size"))
        engine_tokens = _label_int(labels.get("kv_cache_size_tokens"))
        if engine_tokens is None and engine_blocks is not None and engine_size is not None:
            engine_tokens = engine_blocks * engine_size
        if engine_blocks is not None:
            blocks = (blocks or 0) + engine_blocks
        if engine_tokens is not None:
            tokens = (tokens or 0) + engine_tokens
        size = size or engine_size
    return MetricsSnapshot(
        kind="vllm",
        requests_running=_int(samples.sum("vllm:num_requests_running")),
        requests_waiting=_int(samples.sum("vllm:num_requests_waiting")),
        kv_cache_usage=samples.max(*_VLLM_KV_USAGE),
        prefix_cache_queries=samples.sum(*_VLLM_PREFIX_QUERIES),
        prefix_cache_hits=samples.sum(*_VLLM_PREFIX_HITS),
        preemptions=_int(samples.sum("vllm:num_preemptions_total", "vllm:num_preemptions")),
        num_gpu_blocks=blocks,
        block_size=size,
        kv_cache_size_tokens=tokens,
        models=_models(samples),
        generated=samples.sum("vllm:generation_tokens_total"),
        prompt_tokens=samples.sum("vllm:prompt_tokens_total"),
        waiting_capacity=_int(samples.sum_where("vllm:num_requests_waiting_by_reason", "reason", "capacity")),
        prefill_tokens=samples.sum("cerevisor_sim:computed_prompt_tokens_total"),
    )


def _llamacpp(samples: _Samples) -> MetricsSnapshot:
    # Current llama-server has no KV gauge (see /slots); older builds exported kv_cache_usage_ratio.
    # Its prompt_tokens_total excludes the tokens reused from the prompt cache, counted apart.
    cached = samples.sum("llamacpp:prompt_tokens_cached_total")
    computed = samples.sum("llamacpp:prompt_tokens_total")
    return MetricsSnapshot(
        kind="llamacpp",
        requests_running=_int(samples.sum("llamacpp:requests_processing")),
        requests_waiting=_int(samples.sum("llamacpp:requests_deferred")),
        kv_cache_usage=samples.max("llamacpp:kv_cache_usage_ratio"),
        prefix_cache_queries=None if cached is None or computed is None else cached + computed,
        prefix_cache_hits=cached,
        models=_models(samples),
        generated=samples.sum("llamacpp:n_decode_total"),
        prompt_tokens=computed,
    )


def _sglang(samples: _Samples) -> MetricsSnapshot:
    return MetricsSnapshot(
        kind="sglang",
        requests_running=_int(samples.sum("sglang:num_running_reqs")),
        requests_waiting=_int(samples.sum("sglang:num_queue_reqs")),
        kv_cache_usage=samples.max("sglang:token_usage"),
        prefix_cache_hit_rate=samples.max("sglang:cache_hit_rate"),
        preemptions=_int(samples.sum("sglang:total_retracted_reqs")),
        kv_cache_size_tokens=_int(samples.sum("sglang:max_total_num_tokens")),
        models=_models(samples),
        generated=samples.sum("sglang:generation_tokens_total"),
        prompt_tokens=samples.sum("sglang:prompt_tokens_total"),
        prefill_tokens=samples.sum_where("sglang:realtime_tokens_total", "mode", "prefill_compute"),
    )


def _models(samples: _Samples) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for label_sets in samples.labels.values():
        for labels in label_sets:
            name = labels.get("model_name")
            if name:
                seen.setdefault(name, None)
    return tuple(seen)


_SUFFIXES = ("_total", "_created")


def _base_name(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _line_name(line: str) -> str:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    return line.split("{", 1)[0].split(" ", 1)[0]


_WANTED = frozenset(_base_name(n) for n in (
    *_VLLM_KV_USAGE, *_VLLM_PREFIX_QUERIES, *_VLLM_PREFIX_HITS, "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_preemptions_total", "vllm:cache_config_info", "llamacpp:requests_processing", "llamacpp:requests_deferred",
    "llamacpp:kv_cache_usage_ratio", "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total",
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:max_total_num_tokens", "sglang:total_retracted_reqs",
    # what moves while the server works (engine/wedge.py)
    "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_waiting_by_reason",
    "llamacpp:n_decode_total", "sglang:generation_tokens_total", "sglang:prompt_tokens_total",
    "sglang:realtime_tokens_total", "cerevisor_sim:computed_prompt_tokens_total",
))


def _relevant(text: str) -> str:
    """Only the families we read: vLLM's /metrics is ~50 KB of histograms that would take the parser
    tens of milliseconds, on the same event loop as the stall watchdog."""
    return "\n".join(line for line in text.splitlines() if _base_name(_line_name(line)) in _WANTED) + "\n"


def parse_metrics(text: str) -> MetricsSnapshot:
    """A MetricsSnapshot from Prometheus text exposition (vLLM, llama.cpp, SGLang; anything else: unknown)."""
    families = _families(_relevant(text))
    samples = _Samples(families)
    kind = detect_kind(samples.family_names | set(samples.values))
    if kind == "unknown":  # a server kind we know, exposing none of the families we read
        kind = next((k for k in ("vllm", "llamacpp", "sglang") if f"\n{k}:" in text or text.startswith(f"{k}:")
                     or f" {k}:" in text), "unknown")
    if kind == "unknown":
        return MetricsSnapshot(kind="unknown")
    snapshot = {"vllm": _vllm, "llamacpp": _llamacpp, "sglang": _sglang}[kind](samples)
    return replace(snapshot, latency=parse_latency(text, kind), tiers=parse_tiers(text))


def prefix_counts(prev: MetricsSnapshot | None, cur: MetricsSnapshot) -> tuple[float, float] | None:
    """(hits, queries) of the prefix cache between two snapshots; None for a server without the counters.

    vLLM exposes cumulative counters, so these are their difference. A counter that went down means the
    server restarted: the current values then count from zero.
    """
    if cur.prefix_cache_queries is None or cur.prefix_cache_hits is None:
        return None
    queries, hits = cur.prefix_cache_queries, cur.prefix_cache_hits
    if prev is not None and prev.prefix_cache_queries is not None and prev.prefix_cache_hits is not None:
        if queries >= prev.prefix_cache_queries and hits >= prev.prefix_cache_hits:
            queries -= prev.prefix_cache_queries
            hits -= prev.prefix_cache_hits
    return hits, queries


def prefix_hit_rate(prev: MetricsSnapshot | None, cur: MetricsSnapshot) -> float | None:
    """Prefix-cache hits / queries between two snapshots (0..1); None when nothing was queried.

    SGLang exposes its own rate, which is returned as is.
    """
    counts = prefix_counts(prev, cur)
    if counts is None:
        return cur.prefix_cache_hit_rate
    hits, queries = counts
    if queries <= 0:
        return None
    return min(1.0, max(0.0, hits / queries))


def combine(snapshots: Iterable[MetricsSnapshot]) -> MetricsSnapshot | None:
    """The workers behind one router as one server: counts and KV capacity summed, KV use the fullest
    worker's (the one nearest its cliff); a value none of them reports stays None. None for no snapshots."""
    found = list(snapshots)
    if not found:
        return None

    def total(name: str) -> Any:
        values = [getattr(m, name) for m in found if getattr(m, name) is not None]
        return sum(values) if values else None

    def most(name: str) -> Any:
        values = [getattr(m, name) for m in found if getattr(m, name) is not None]
        return max(values) if values else None

    models: dict[str, None] = {}
    for m in found:
        models.update(dict.fromkeys(m.models))
    return MetricsSnapshot(
        kind=next((m.kind for m in found if m.kind != "unknown"), "unknown"),
        requests_running=total("requests_running"), requests_waiting=total("requests_waiting"),
        kv_cache_usage=most("kv_cache_usage"), prefix_cache_queries=total("prefix_cache_queries"),
        prefix_cache_hits=total("prefix_cache_hits"), prefix_cache_hit_rate=most("prefix_cache_hit_rate"),
        preemptions=total("preemptions"), num_gpu_blocks=total("num_gpu_blocks"), block_size=most("block_size"),
        kv_cache_size_tokens=total("kv_cache_size_tokens"), models=tuple(models),
        generated=total("generated"), prompt_tokens=total("prompt_tokens"), prefill_tokens=total("prefill_tokens"),
        waiting_capacity=total("waiting_capacity"),
    )


def parse_slots(data: Any) -> SlotsStatus | None:
    """llama.cpp's /slots JSON (a list of slots, each with `is_processing`); None if it is not that."""
    if isinstance(data, Mapping) and isinstance(data.get("slots"), list):
        data = data["slots"]
    if not isinstance(data, list):
        return None
    slots = [slot for slot in data if isinstance(slot, Mapping)]
    processing = 0
    for slot in slots:
        if "is_processing" in slot:
            processing += bool(slot["is_processing"])
        elif "state" in slot:  # older llama.cpp: state 0 idle, 1 processing
            processing += slot["state"] != 0
    return SlotsStatus(total=len(slots), processing=processing)


def server_root(base_url: str) -> str:
    """The server's root URL: the OpenAI base URL without its trailing /v1."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def read_server(
    client: httpx.AsyncClient, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ServerStatus:
    """Read /health, /metrics and (llama.cpp) /slots with short timeouts.

    Never raises for a server that lacks any of them: the status carries what it got and, in `error`,
    what went wrong. /health answering 503 means the server is still loading (llama.cpp says so in
    its body, `{"error": {"code": 503, "message": "Loading model"}}`; others use 503 for "not ready").
    """
    root = server_root(base_url)
    try:
        health = await _get(client, f"{root}/health", timeout_s)
    except httpx.HTTPError as exc:
        return ServerStatus(base_url=base_url, reachable=False, error=_scrubbed(client, f"health: {_describe(exc)}"),
                            refused=is_refused(exc))
    loading = health.status_code == 503
    errors: list[str] = []
    if health.status_code >= 400 and not loading:
        errors.append(f"health: HTTP {health.status_code}")
    metrics: MetricsSnapshot | None = None
    try:
        response = await _get(client, f"{root}/metrics", timeout_s)
        if response.status_code == 200:
            metrics = _parsed(f"{root}/metrics", response.text)
        else:
            errors.append(f"metrics: HTTP {response.status_code}")
    except httpx.HTTPError as exc:
        errors.append(f"metrics: {_describe(exc)}")
    slots: SlotsStatus | None = None
    if metrics is not None and metrics.kind == "llamacpp":
        try:
            response = await _get(client, f"{root}/slots", timeout_s)
            if response.status_code == 200:
                slots = parse_slots(response.json())
            else:
                errors.append(f"slots: HTTP {response.status_code}")
        except (httpx.HTTPError, ValueError) as exc:
            errors.append(f"slots: {_describe(exc)}")
    return ServerStatus(
        base_url=base_url,
        reachable=True,
        health_status=health.status_code,
        loading=loading,
        loading_message=_scrubbed(client, _loading_message(health)) if loading else None,
        metrics=metrics,
        slots=slots,
        error=_scrubbed(client, "; ".join(errors)) or None,
    )


_LAST_TEXT: dict[str, tuple[str, MetricsSnapshot]] = {}
_LAST_TEXTS_KEPT = 64  # URLs: a run's endpoints and workers; a process that reads more keeps the latest


def _parsed(url: str, text: str) -> MetricsSnapshot:
    """`parse_metrics(text)`, or the snapshot of the text `url` gave last time when this is the same text: an idle
    llama-server (or any server whose numbers did not move) answers every look with the text it gave before."""
    last = _LAST_TEXT.get(url)
    if last is not None and last[0] == text:
        return last[1]
    snapshot = parse_metrics(text)
    if last is None and len(_LAST_TEXT) >= _LAST_TEXTS_KEPT:
        del _LAST_TEXT[next(iter(_LAST_TEXT))]  # the URL read first
    _LAST_TEXT[url] = (text, snapshot)
    return snapshot


_BUILT: weakref.WeakKeyDictionary[httpx.AsyncClient, dict[tuple[str, float], httpx.Request]] = \
    weakref.WeakKeyDictionary()


async def _get(client: httpx.AsyncClient, url: str, timeout_s: float) -> httpx.Response:
    """GET `url` with a request built once per client and URL: a GET through `client.get` spent ~40% of its CPU
    building the same request again (the URL parsed, the client's headers and cookies merged), for each of a
    look's two or three reads every metrics_interval_s."""
    built = _BUILT.setdefault(client, {})
    request = built.get((url, timeout_s))
    if request is None:
        request = built[(url, timeout_s)] = client.build_request("GET", url, timeout=httpx.Timeout(timeout_s))
    return await client.send(request)


@dataclass(frozen=True)
class RoutedStatus:
    """One look at a router and the workers behind it: `fleet` is the whole as one server (the router's
    health, the workers' metrics combined), `workers` each worker's own status, in the configured order."""

    fleet: ServerStatus
    workers: tuple[ServerStatus, ...]


async def read_routed(
    client: httpx.AsyncClient, base_url: str, worker_client: httpx.AsyncClient, worker_urls: Iterable[str],
    *, timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RoutedStatus:
    """Read a router's /health and each worker's /health and /metrics (at once, with short timeouts).

    A router's /metrics does not speak for the fleet (vllm-router 0.1.17 passes its first worker's through),
    so the workers' are read instead (`worker_client`, which carries no API key: vLLM serves /health and
    /metrics without one, and a key is not sent where the operator did not point the endpoint). The fleet is healthy while
    the router answers and at least one worker is up; it is loading while every worker that answers is.
    Never raises.
    """
    urls = list(worker_urls)
    workers: list[ServerStatus | None] = [None] * len(urls)

    async def one(i: int, url: str) -> None:
        try:
            workers[i] = await read_server(worker_client, url, timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - one worker's nonsense must not hide the others
            workers[i] = ServerStatus(base_url=url, reachable=False, error=f"unreadable: {exc}"[:200])

    async with anyio.create_task_group() as group:
        for i, url in enumerate(urls):
            group.start_soon(one, i, url)
    statuses = tuple(w for w in workers if w is not None)
    root = server_root(base_url)
    try:
        health = await _get(client, f"{root}/health", timeout_s)
    except httpx.HTTPError as exc:
        fleet = ServerStatus(base_url=base_url, reachable=False,
                             error=_scrubbed(client, f"router health: {_describe(exc)}"),
                             metrics=combine(w.metrics for w in statuses if w.metrics is not None))
        return RoutedStatus(fleet, statuses)
    answering = [w for w in statuses if w.reachable]
    up = [w for w in answering if not w.loading and (w.health_status or 0) < 400]
    errors = [f"router health: HTTP {health.status_code}"] if health.status_code >= 400 else []
    if len(up) < len(statuses):
        errors.append(f"{len(statuses) - len(up)} of {len(statuses)} workers down")
    loading = bool(answering) and all(w.loading for w in answering)
    # the router's answer unless it is fine and no worker is up: then the fleet is as good as down
    status = health.status_code if health.status_code >= 400 or up or loading else 503
    return RoutedStatus(ServerStatus(
        base_url=base_url, reachable=True, health_status=status, loading=loading,
        loading_message=next((w.loading_message for w in answering if w.loading_message), None) if loading else None,
        metrics=combine(w.metrics for w in statuses if w.metrics is not None),
        error=_scrubbed(client, "; ".join(errors)) or None,
    ), statuses)


def _scrubbed(client: httpx.AsyncClient, text: str | None) -> str | None:
    """`text` (the server's words, or the library's) without the client's API key: a server may echo it."""
    if not text:
        return text
    scrub = request_scrubber(client.headers)
    return scrub(text) if scrub else text


def _loading_message(response: httpx.Response) -> str | None:
    """The server's own words for why it is not ready (llama.cpp: 'Loading model')."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    return str(message) if message else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.ConnectError):
        return "this process is out of file descriptors" if descriptors_exhausted(exc) else "connection refused"
    return str(exc) or type(exc).__name__
