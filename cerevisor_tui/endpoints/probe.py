"""Probe an endpoint: health, models, metrics kind, then a bounded concurrency sweep that finds the knee.

The sweep runs levels 1, 2, 4, ... up to `max_concurrency`. At each level, that many workers send short
streamed chat requests back to back (a closed loop) for at least `level_s` seconds, and the level
reports aggregate output tokens/s (counted while every worker is busy) and TTFT p50/p95, while a
poller reads the server's own running/waiting counts and KV use. The sweep stops past the knee:

- the server queued requests for most of the level (vLLM `num_requests_waiting`, llama.cpp
  `requests_deferred`, SGLang `num_queue_reqs`) and never ran as many as were sent: the cap is
  what it ran at once;
- `patience` levels in a row beat the best throughput so far by less than `min_gain` (only for a
  server without a queue gauge; one with it is swept on until it queues): the cap is the smallest
  level within `min_gain` of the best;
- TTFT p50 blew up against level 1's (again only without a queue gauge): requests wait rather
  than run;
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

SLICE_S = 0.5  # throughput is the median over slices this long
PROMPT = "Probe request {n}: count upward from 1 in words, separated by spaces, and do not stop."


class EndpointUnusable(EndpointError):
    """The probe could not use the endpoint at all: unreachable, refused, no model, or no answer."""


@dataclass(frozen=True)
class ProbeSettings:
    """Bounds and thresholds of one probe; the defaults are what `cerevisor-tui probe` uses."""

    max_concurrency: int = 64
    max_tokens: int = 64
    max_requests: int = 1000
    max_seconds: float = 180.0
    request_timeout_s: float = 60.0
    level_s: float = 2.0  # each level keeps sending for at least this long ...
    rounds: int = 2  # ... and at least this many requests per worker
    min_requests_per_level: int = 4
    min_gain: float = 0.15  # a level that beats the best so far by less than this is flat
    patience: int = 2  # flat levels in a row that end the sweep
    ttft_blowup: float = 4.0  # TTFT p50 above this multiple of level 1's ...
    ttft_floor_s: float = 0.5  # ... and above this many seconds is past the knee
    waiting_share: float = 0.25  # share of server samples with requests waiting that counts as queueing
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
        if self.level_s < 0:
            raise ValueError("level_s must not be negative")
        if self.patience < 1:
            raise ValueError("patience must be at least 1")

    def levels(self) -> list[int]:
        """1, 2, 4, ... and max_concurrency itself when it is not a power of two."""
        out, c = [], 1
        while c < self.max_concurrency:
            out.append(c)
            c *= 2
        out.append(self.max_concurrency)
        return out

    def requests_at(self, concurrency: int) -> int:
        """The fewest requests a level sends (it sends more while level_s has not passed)."""
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
    delta_at: list[float] = field(default_factory=list)

    def tokens_between(self, start: float, end: float) -> float:
        """Output tokens that arrived in [start, end]; a delta may carry several (usage says how many)."""
        if not self.delta_at:
            return 0.0
        per_delta = self.tokens / len(self.delta_at) if self.tokens and not self.error else 1.0
        return per_delta * sum(1 for t in self.delta_at if start <= t <= end)


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
        # vLLM and SGLang say max_model_len; llama-server gives each slot's context as meta.n_ctx.
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        result.max_model_len = _int(entry.get("max_model_len")) or _int(meta.get("n_ctx"))
        if result.kv_cache_tokens is None and status.slots is not None and meta.get("n_ctx"):
            # llama-server has no KV gauge; its cache holds every slot's context
            result.kv_cache_tokens = (_int(meta.get("n_ctx")) or 0) * status.slots.total or None
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
                    if kind == DELTA:
                        now = time.monotonic()
                        req.delta_at.append(now)
                        if req.first_at is None:
                            req.first_at = now
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
    flat = 0
    for c in settings.levels():
        left = settings.max_requests - result.total_requests
        if left < settings.requests_at(c):
            result.stopped_because = "max_requests"
            break
        if time.monotonic() >= deadline:
            result.stopped_because = "max_seconds"
            break
        say(f"level {c}: {c} at a time, {settings.requests_at(c)}+ requests, {settings.level_s:g}+ s")
        level = await _run_level(client, base_url, c, left, one, settings, deadline, watch_server)
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
            if verdict[0] in ("ttft", "errors") and len(result.levels) > 1:
                # below the level that failed or queued, throughput may have flattened earlier
                pick, why = _knee(result.levels[:-1], settings)
                if pick < result.recommended_concurrency:
                    result.recommended_concurrency = pick
                    result.reason += f"; and below that, {why}"
            break
        if not level.complete:
            result.stopped_because = "max_seconds"
            break
        best = max(result.levels[:-1], key=lambda lv: lv.output_tokens_per_s, default=None)
        flat = flat + 1 if best is not None and level.output_tokens_per_s < best.output_tokens_per_s * (
            1 + settings.min_gain) else 0
        # A server that reports its queue tells where its capacity ends; flat throughput before that is
        # as likely noise on the host as a knee, so only a server without that signal stops on it.
        if flat >= settings.patience and level.server_waiting_share is None:
            result.stopped_because = "knee"
            result.recommended_concurrency, result.reason = _knee(result.levels, settings)
            break
        previous = level
    else:
        result.stopped_because = "max_concurrency"
    if result.stopped_because in ("max_concurrency", "max_requests", "max_seconds"):
        usable = [lv for lv in result.levels if lv.complete and not lv.failed]
        pick, why = _knee(usable, settings) if usable else (1, "")
        if usable and pick < max(lv.concurrency for lv in usable):
            result.recommended_concurrency, result.reason = pick, why
        else:
            result.recommended_concurrency = pick
            limit = {"max_concurrency": f"the highest level tried ({settings.max_concurrency})",
                     "max_requests": f"the request budget ({settings.max_requests} requests)",
                     "max_seconds": f"the time budget ({settings.max_seconds:g} s)"}[result.stopped_because]
            result.reason = (f"throughput still grew up to {pick} at once when the sweep reached {limit}; "
                             "the server may carry more")
    result.recommended_mode = "sequential" if result.recommended_concurrency <= 1 else "parallel"
    result.elapsed_s = time.monotonic() - started
    return result


async def _run_level(client: httpx.AsyncClient, base_url: str, concurrency: int, budget: int,
                     one: Callable[[int], Any], settings: ProbeSettings, deadline: float,
                     watch_server: bool) -> ProbeLevel:
    """`concurrency` workers send requests back to back until the level has run long enough.

    Throughput is counted only while every worker still had a request to send (from the start to
    the moment the level stops sending), so the ragged end of the last requests does not dilute it.
    """
    done: list[_Request] = []
    watch = _ServerWatch()
    issued = [0]
    at_least = settings.requests_at(concurrency)
    started = time.monotonic()
    stopped_sending: list[float] = []

    def more() -> bool:
        if stopped_sending:
            return False
        enough = issued[0] >= at_least and time.monotonic() - started >= settings.level_s
        if enough or issued[0] >= budget:
            stopped_sending.append(time.monotonic())
            return False
        issued[0] += 1
        return True

    async def worker() -> None:
        while more():
            done.append(await one(settings.max_tokens))

    async def poll() -> None:
        while True:
            watch.add(await read_server(client, base_url, timeout_s=1.0))
            await anyio.sleep(settings.poll_interval_s)

    with anyio.move_on_after(max(0.0, deadline - started)) as cut:
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
    window_end = stopped_sending[0] if stopped_sending else ended
    window = window_end - started
    if window <= 0 or not any(r.delta_at for r in done):
        window_end, window = ended, max(1e-9, ended - started)
    # The median of short slices, not the mean of the window: a burst of other load on the host (or a
    # hiccup of the server) spoils a slice or two, not the level.
    n_slices = max(1, round(window / SLICE_S))
    width = window / n_slices
    slice_rates = [sum(r.tokens_between(started + i * width, started + (i + 1) * width) for r in done) / width
                   for i in range(n_slices)]
    ttfts = [r.first_at - r.sent_at for r in ok if r.first_at is not None]
    rates = [(r.tokens - 1) / (r.ended_at - r.first_at) for r in ok
             if r.first_at is not None and r.ended_at is not None and r.tokens > 1 and r.ended_at > r.first_at]
    return ProbeLevel(
        concurrency=concurrency,
        requests=len(done),
        failed=len(failed),
        output_tokens=sum(r.tokens for r in ok),
        wall_s=max(1e-9, ended - started),
        output_tokens_per_s=percentile(slice_rates, 50) or 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        stream_tokens_per_s=percentile(rates, 50),
        server_running_max=max(watch.running) if watch.running else None,
        server_waiting_max=max(watch.waiting) if watch.waiting else None,
        server_waiting_share=watch.waiting_share(),
        kv_cache_usage_max=max(watch.kv) if watch.kv else None,
        complete=not cut.cancelled_caught,
        first_error=failed[0].error if failed else "",
    )


def _knee(levels: list[ProbeLevel], settings: ProbeSettings) -> tuple[int, str]:
    """The smallest level within min_gain of the best throughput, and why."""
    best = max(levels, key=lambda lv: lv.output_tokens_per_s)
    floor = best.output_tokens_per_s / (1 + settings.min_gain)
    pick = min((lv for lv in levels if lv.output_tokens_per_s >= floor), key=lambda lv: lv.concurrency)
    beyond = [lv.concurrency for lv in levels if lv.concurrency > pick.concurrency]
    return pick.concurrency, (
        f"{pick.concurrency} at once gives {pick.output_tokens_per_s:,.0f} tokens/s, within "
        f"{settings.min_gain:.0%} of the best measured ({best.output_tokens_per_s:,.0f} at {best.concurrency}); "
        f"{', '.join(map(str, beyond)) or 'more'} at once added no more than that"
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
        cap = max(1, ran)
        return ("queue", cap,
                f"at {c} at once the server queued requests (up to {level.server_waiting_max} waiting) "
                f"while running at most {ran}, so more than {cap} only adds waiting")
    if previous is None:
        return None
    if share is not None:
        return None  # a server with a queue gauge says when it queues; slow first tokens alone are load
    # p50, not p95: a few slow first tokens are noise; most of them slow is a queue
    base = first.ttft_p50_s
    p50 = level.ttft_p50_s
    if base and p50 and p50 > settings.ttft_floor_s and p50 > settings.ttft_blowup * base:
        return ("ttft", prev_c,
                f"at {c} at once TTFT p50 rose to {p50:.2f} s from {base:.2f} s at 1, so requests wait "
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
