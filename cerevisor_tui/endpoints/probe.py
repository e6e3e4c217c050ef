"""Probe an endpoint: health, models, metrics kind, then a bounded concurrency sweep that finds the knee.

The sweep runs levels 1, 2, 4, ... up to `max_concurrency`. At each level, that many workers send short
streamed chat requests back to back (a closed loop), and the level reports aggregate output tokens/s
and TTFT p50/p95 while a poller reads the server's own running/waiting counts and KV use. The sweep
stops one level past the knee, which is the first of:

- the server queued requests for most of the level (vLLM `num_requests_waiting`, llama.cpp
  `requests_deferred`, SGLang `num_queue_reqs`) and never ran as many as were sent: the cap is
  what it ran at once;
- a doubling added less than `min_gain` throughput: the smaller level carries the same load;
- TTFT p95 blew up against level 1's: requests wait rather than run;
- requests failed (HTTP 429/5xx, broken streams): the server refuses more.

Everything is bounded: total requests (`max_requests`), total time (`max_seconds`) and each request
(`request_timeout_s`), so a probe never hangs on a wedged server. The caller owns the HTTP client
(`build_client(max_concurrency, api_key)` sizes it) and may follow the sweep through `on_progress`
and `on_level`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx

from cerevisor_tui.endpoints.client import DELTA, ChatStream, list_models
from cerevisor_tui.endpoints.errors import EndpointError
from cerevisor_tui.endpoints.metrics import ServerStatus, read_server

PROMPT = "Probe request {n}: count upward from 1 in words, separated by spaces, and do not stop."


class EndpointUnusable(EndpointError):
    """The probe could not use the endpoint at all: unreachable, refused, no model, or no answer."""


@dataclass(frozen=True)
class ProbeSettings:
    """Bounds and thresholds of one probe; the defaults are what `cerevisor-tui probe` uses."""

    max_concurrency: int = 64
    max_tokens: int = 64
    max_requests: int = 400
    max_seconds: float = 180.0
    request_timeout_s: float = 60.0
    rounds: int = 2  # requests per worker at each level
    min_requests_per_level: int = 4
    min_gain: float = 0.15  # a doubling that adds less throughput than this is past the knee
    ttft_blowup: float = 4.0  # TTFT p95 above this multiple of level 1's ...
    ttft_floor_s: float = 0.5  # ... and above this many seconds is past the knee
    waiting_share: float = 0.5  # share of server samples with requests waiting that counts as queueing
    poll_interval_s: float = 0.1
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.max_requests < self.min_requests_per_level + 1:
            raise ValueError(f"max_requests must be at least {self.min_requests_per_level + 1}")
        if self.max_seconds <= 0:
            raise ValueError("max_seconds must be positive")

    def levels(self) -> list[int]:
        """1, 2, 4, ... and max_concurrency itself when it is not a power of two."""
        out, c = [], 1
        while c < self.max_concurrency:
            out.append(c)
            c *= 2
        out.append(self.max_concurrency)
        return out

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests_per_level, self.rounds * concurrency)


@dataclass(frozen=True)
class ProbeLevel:
    """What one concurrency level measured."""

    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    stream_tokens_per_s: float | None  # median decode rate of one stream
    server_running_max: int | None = None
    server_waiting_max: int | None = None
    server_waiting_share: float | None = None  # share of samples with requests waiting
    kv_cache_usage_max: float | None = None
    complete: bool = True  # False: the time budget cut it short
    first_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("wall_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "stream_tokens_per_s",
                    "server_waiting_share", "kv_cache_usage_max"):
            if data[key] is not None:
                data[key] = round(data[key], 4)
        return data


@dataclass
class ProbeResult:
    """The whole probe: what the server is, the levels measured, and the recommendation with its reason."""

    base_url: str
    model: str
    server_kind: str = "unknown"
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    health: str = ""
    levels: list[ProbeLevel] = field(default_factory=list)
    recommended_concurrency: int = 1
    recommended_mode: str = "sequential"
    reason: str = ""
    stopped_because: str = ""  # knee | queue | ttft | errors | max_concurrency | max_requests | max_seconds
    total_requests: int = 0
    elapsed_s: float = 0.0
    settings: ProbeSettings = field(default_factory=ProbeSettings)

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "base_url": self.base_url,
            "server_kind": self.server_kind,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": self.kv_cache_tokens,
            "health": self.health,
            "levels": [level.to_dict() for level in self.levels],
            "recommended_concurrency": self.recommended_concurrency,
            "recommended_mode": self.recommended_mode,
            "reason": self.reason,
            "stopped_because": self.stopped_because,
            "total_requests": self.total_requests,
            "elapsed_s": round(self.elapsed_s, 3),
            "bounds": {"max_concurrency": s.max_concurrency, "max_tokens": s.max_tokens,
                       "max_requests": s.max_requests, "max_seconds": s.max_seconds,
                       "request_timeout_s": s.request_timeout_s},
        }


@dataclass
class _Request:
    sent_at: float
    first_at: float | None = None
    ended_at: float | None = None
    tokens: int = 0
    error: str = ""


class _ServerWatch:
    """Polls the server's own counters while a level runs."""

    def __init__(self) -> None:
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.kv: list[float] = []

    def add(self, status: ServerStatus) -> None:
        m = status.metrics
        if m is None:
            return
        running = m.requests_running
        if status.slots is not None and status.slots.total:
            running = status.slots.processing if running is None else max(running, status.slots.processing)
        if running is not None:
            self.running.append(running)
        if m.requests_waiting is not None:
            self.waiting.append(m.requests_waiting)
        if m.kv_cache_usage is not None:
            self.kv.append(m.kv_cache_usage)

    def waiting_share(self) -> float | None:
        if not self.waiting:
            return None
        return sum(1 for w in self.waiting if w > 0) / len(self.waiting)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


ProgressCallback = Callable[[str], None]
LevelCallback = Callable[[ProbeLevel], None]


async def probe(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str | None = None,
    settings: ProbeSettings | None = None,
    on_progress: ProgressCallback | None = None,
    on_level: LevelCallback | None = None,
    endpoint: str = "",
) -> ProbeResult:
    """Probe `base_url` (…/v1) and recommend a mode and cap; raises EndpointUnusable when it cannot.

    `on_progress` gets one line per step (health, model, each level as it starts); `on_level` gets
    each ProbeLevel as it completes. Cancel the surrounding scope to stop early.
    """
    settings = settings or ProbeSettings()
    endpoint = endpoint or base_url
    say = on_progress or (lambda line: None)
    started = time.monotonic()
    deadline = started + settings.max_seconds
    result = ProbeResult(base_url=base_url, model=model or "", settings=settings)

    status = await read_server(client, base_url)
    if not status.reachable:
        raise EndpointUnusable(endpoint, f"unreachable: {status.error or 'no answer'} (is the server running?)")
    result.health = _health_text(status)
    say(f"health: {result.health}")
    if status.loading:
        status = await _wait_loaded(client, base_url, deadline, say)
        result.health = _health_text(status)
    metrics = status.metrics
    result.server_kind = status.kind
    if metrics is not None and metrics.kv_cache_size_tokens:
        result.kv_cache_tokens = metrics.kv_cache_size_tokens

    try:
        listed = await list_models(client, endpoint, base_url)
    except EndpointError as exc:
        raise EndpointUnusable(endpoint, f"cannot list models: {exc.problem}") from None
    if not listed and not model:
        raise EndpointUnusable(endpoint, "/v1/models lists no model; pass --model")
    entry = next((m for m in listed if m.get("id") == model), None) if model else listed[0]
    if model and entry is None and listed:
        known = ", ".join(str(m["id"]) for m in listed[:5])
        raise EndpointUnusable(endpoint, f"model {model!r} is not served here (served: {known})")
    result.model = model or (str(entry["id"]) if entry else "")
    if entry is not None:
        result.max_model_len = _int(entry.get("max_model_len"))
    extra = f", max_model_len {result.max_model_len:,}" if result.max_model_len else ""
    kv = f", KV cache {result.kv_cache_tokens:,} tokens" if result.kv_cache_tokens else ""
    say(f"model: {result.model}{extra}; metrics: {result.server_kind}{kv}")

    watch_server = result.server_kind != "unknown"
    url = base_url.rstrip("/") + "/chat/completions"
    counter = iter(range(1, 1 << 30))

    async def one(max_tokens: int) -> _Request:
        n = next(counter)
        body = {"model": result.model, "messages": [{"role": "user", "content": PROMPT.format(n=n)}],
                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
        req = _Request(sent_at=time.monotonic())
        stream = ChatStream(client, endpoint, url, body, {"X-Cerevisor-Agent": "probe"})
        with anyio.move_on_after(settings.request_timeout_s) as scope:
            try:
                async for kind, _payload in stream.events():
                    if kind == DELTA and req.first_at is None:
                        req.first_at = time.monotonic()
            except EndpointError as exc:
                req.error = exc.problem
        if scope.cancelled_caught:
            req.error = f"no complete answer within {settings.request_timeout_s:g} s"
        req.ended_at = time.monotonic()
        req.tokens = stream.usage[1] if stream.usage else stream.tokens
        result.total_requests += 1
        return req

    if settings.warmup:
        say("warm-up request")
        req = None
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            req = await one(min(settings.max_tokens, 16))
            if req.error:
                raise EndpointUnusable(endpoint, f"a chat request failed: {req.error}")
        if req is None:
            raise EndpointUnusable(endpoint, f"no answer to a chat request within {settings.max_seconds:g} s")

    previous: ProbeLevel | None = None
    best: ProbeLevel | None = None
    for c in settings.levels():
        n_requests = settings.requests_at(c)
        if result.total_requests + n_requests > settings.max_requests:
            result.stopped_because = "max_requests"
            break
        if time.monotonic() >= deadline:
            result.stopped_because = "max_seconds"
            break
        say(f"level {c}: {n_requests} requests, {c} at a time")
        level = await _run_level(client, base_url, c, n_requests, one, settings, deadline, watch_server)
        if c == 1 and not level.requests:
            raise EndpointUnusable(endpoint, f"no chat request completed within {settings.max_seconds:g} s")
        if c == 1 and level.failed == level.requests:
            raise EndpointUnusable(endpoint, f"every chat request failed: {level.first_error}")
        result.levels.append(level)
        if on_level is not None:
            on_level(level)
        verdict = _past_knee(level, previous, result.levels[0], settings)
        if verdict is not None:
            result.stopped_because, result.recommended_concurrency, result.reason = verdict
            break
        if not level.complete:
            result.stopped_because = "max_seconds"
            break
        previous = level
        if best is None or level.output_tokens_per_s > best.output_tokens_per_s:
            best = level
    else:
        result.stopped_because = "max_concurrency"
    if result.stopped_because in ("max_concurrency", "max_requests", "max_seconds"):
        usable = [lv for lv in result.levels if lv.complete and not lv.failed]
        top = max(usable, key=lambda lv: lv.concurrency) if usable else None
        result.recommended_concurrency = top.concurrency if top else 1
        limit = {"max_concurrency": f"the highest level tried ({settings.max_concurrency})",
                 "max_requests": f"the request budget ({settings.max_requests} requests)",
                 "max_seconds": f"the time budget ({settings.max_seconds:g} s)"}[result.stopped_because]
        result.reason = (f"throughput still grew up to {result.recommended_concurrency} at once when the sweep "
                         f"reached {limit}; the server may carry more")
    result.recommended_mode = "sequential" if result.recommended_concurrency <= 1 else "parallel"
    result.elapsed_s = time.monotonic() - started
    return result


async def _run_level(client: httpx.AsyncClient, base_url: str, concurrency: int, n_requests: int,
                     one: Callable[[int], Any], settings: ProbeSettings, deadline: float,
                     watch_server: bool) -> ProbeLevel:
    done: list[_Request] = []
    watch = _ServerWatch()
    left = [n_requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            done.append(await one(settings.max_tokens))

    async def poll() -> None:
        while True:
            watch.add(await read_server(client, base_url, timeout_s=1.0))
            await anyio.sleep(settings.poll_interval_s)

    started = time.monotonic()
    with anyio.move_on_after(max(0.0, deadline - started)) as budget:
        async with anyio.create_task_group() as group:
            if watch_server:
                group.start_soon(poll)
            async with anyio.create_task_group() as workers:
                for _ in range(concurrency):
                    workers.start_soon(worker)
            group.cancel_scope.cancel()
    ok = [r for r in done if not r.error]
    failed = [r for r in done if r.error]
    ended = max((r.ended_at or started for r in done), default=time.monotonic())
    wall = max(1e-9, ended - started)
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.first_at - r.sent_at for r in ok if r.first_at is not None]
    rates = [(r.tokens - 1) / (r.ended_at - r.first_at) for r in ok
             if r.first_at is not None and r.ended_at is not None and r.tokens > 1 and r.ended_at > r.first_at]
    return ProbeLevel(
        concurrency=concurrency,
        requests=len(done),
        failed=len(failed),
        output_tokens=tokens,
        wall_s=wall,
        output_tokens_per_s=tokens / wall,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        stream_tokens_per_s=percentile(rates, 50),
        server_running_max=max(watch.running) if watch.running else None,
        server_waiting_max=max(watch.waiting) if watch.waiting else None,
        server_waiting_share=watch.waiting_share(),
        kv_cache_usage_max=max(watch.kv) if watch.kv else None,
        complete=not budget.cancelled_caught,
        first_error=failed[0].error if failed else "",
    )


def _past_knee(level: ProbeLevel, previous: ProbeLevel | None, first: ProbeLevel,
               settings: ProbeSettings) -> tuple[str, int, str] | None:
    """(stopped_because, recommended concurrency, why) when this level is past the knee, else None."""
    c = level.concurrency
    prev_c = previous.concurrency if previous else 1
    if level.failed:
        return ("errors", prev_c,
                f"at {c} at once {level.failed} of {level.requests} requests failed ({level.first_error}), "
                f"so {prev_c} is the most it carried cleanly")
    share = level.server_waiting_share
    ran = level.server_running_max
    # Requests wait a moment on arrival even below the cap; it is queueing only when the server also
    # ran fewer than were sent, for most of the level.
    if share is not None and share >= settings.waiting_share and ran is not None and ran < c and previous is not None:
        cap = max(prev_c, ran)
        return ("queue", cap,
                f"at {c} at once the server queued requests (up to {level.server_waiting_max} waiting) "
                f"while running at most {ran}, so more than {cap} only adds waiting")
    if previous is None:
        return None
    gain = level.output_tokens_per_s / previous.output_tokens_per_s - 1 if previous.output_tokens_per_s else math.inf
    if gain < settings.min_gain:
        return ("knee", prev_c,
                f"going from {prev_c} to {c} at once added {gain:+.0%} throughput "
                f"({previous.output_tokens_per_s:,.0f} -> {level.output_tokens_per_s:,.0f} tokens/s), "
                f"so {prev_c} carries the load")
    base = first.ttft_p95_s
    p95 = level.ttft_p95_s
    if base and p95 and p95 > settings.ttft_floor_s and p95 > settings.ttft_blowup * base:
        return ("ttft", prev_c,
                f"at {c} at once TTFT p95 rose to {p95:.2f} s from {base:.2f} s at 1, so requests wait "
                f"rather than run beyond {prev_c}")
    return None


async def _wait_loaded(client: httpx.AsyncClient, base_url: str, deadline: float,
                       say: ProgressCallback) -> ServerStatus:
    """Wait while /health says the server is loading, within the probe's time budget."""
    say("server is loading its model; waiting")
    while True:
        await anyio.sleep(1.0)
        status = await read_server(client, base_url)
        if status.reachable and not status.loading:
            return status
        if time.monotonic() >= deadline:
            raise EndpointUnusable(base_url, "the server was still loading its model when the time budget ran out")


def _health_text(status: ServerStatus) -> str:
    if status.loading:
        return f"loading ({status.loading_message or 'HTTP 503'})"
    if status.health_status is None:
        return "unknown"
    if status.health_status < 400:
        return "ok"
    return f"no /health (HTTP {status.health_status})"


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
