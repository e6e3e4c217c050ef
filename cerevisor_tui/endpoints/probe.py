"""Probe an endpoint: health, models, metrics kind, then a bounded concurrency sweep that finds the knee.

Two modes. Single-turn (`probe`): at each level 1, 2, 4, ... up to `max_concurrency`, that many workers
send short streamed chat requests back to back (a closed loop) for at least `level_s` seconds.
Conversation (`probe_conversations`): at each level, `conversations_at(level)` conversations shaped
like the workflow's agents (their system prompt and prompt sizes, their follow-up turns, the growing
conversation resent each turn, their max_tokens), that many at a time; each conversation's text starts
with its own nonce, so no cache hit crosses conversations or levels by accident. Either way a level
reports aggregate output tokens/s and TTFT p50/p95, while a poller reads the server's own running and
waiting counts and KV use, and /metrics read before and after the level gives its prefix-cache hit
rate and preemptions.

After each level the sweep asks a judge (endpoints/knee.py: `judge_single_turn`, `judge_conversations`,
pure functions of the levels measured so far) whether it is past the knee, and what cap to recommend
with which reason.

Everything is bounded: total requests (`max_requests`), total time (`max_seconds`) and each request
(`request_timeout_s`), so a probe never hangs on a wedged server. The caller owns the HTTP client
(`build_client(max_concurrency, api_key)` sizes it) and may follow the sweep through `on_progress`
and `on_level`. A finished probe saves its recommendation (endpoints/probe_store.py) unless told not to.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import httpx
import msgspec

from cerevisor_tui.config.graph import OUTPUT_REF
from cerevisor_tui.config.models import is_loopback
from cerevisor_tui.contract.events import ProbeBounds, ProbeSummary
from cerevisor_tui.endpoints.client import DELTA, ChatStream, list_models
from cerevisor_tui.endpoints.errors import EndpointError
from cerevisor_tui.endpoints.knee import (
    KneeSettings,
    ProbeLevel,
    Recommendation,
    RecommendedMode,
    StopReason,
    judge_conversations,
    judge_single_turn,
)

# Re-exported from knee.py: tests import them from here.
from cerevisor_tui.endpoints.knee import _knee as _knee
from cerevisor_tui.endpoints.knee import _past_knee as _past_knee
from cerevisor_tui.endpoints.knee import recommend_conversations as recommend_conversations
from cerevisor_tui.endpoints.metrics import MetricsSnapshot, ServerStatus, prefix_hit_rate, read_server, server_root

if TYPE_CHECKING:
    from cerevisor_tui.config.models import AgentConfig

SLICE_S = 0.5  # throughput is the median over slices this long
PROMPT = "Probe request {n}: count upward from 1 in words, separated by spaces, and do not stop."
CHARS_PER_TOKEN = 4  # what a {{ name.output }} stand-in assumes (English text, most tokenizers)
MIN_TOKENS_PER_S = 10.0  # conversation mode: a turn slower than this for its max_tokens has failed

ProbeMode = Literal["single-turn", "conversation"]


class EndpointUnusable(EndpointError):
    """The probe could not use the endpoint at all: unreachable, refused, no model, or no answer."""


@dataclass(frozen=True)
class ProbeSettings(KneeSettings):
    """Bounds and thresholds of one probe; the defaults are what `cerevisor-tui probe` uses. The knee's
    thresholds (and max_concurrency, max_requests, max_seconds) are KneeSettings'."""

    max_tokens: int = 64
    request_timeout_s: float = 60.0
    level_s: float = 2.0  # each level keeps sending for at least this long ...
    rounds: int = 2  # ... and at least this many requests per worker
    min_requests_per_level: int = 4
    poll_interval_s: float = 0.1
    warmup: bool = True
    # a server on this machine that refuses its port is still starting (vLLM opens it once its model is loaded):
    # asked again each second for this long, within max_seconds
    port_wait_s: float = 60.0
    # conversation mode
    min_conversations: int = 4  # a level runs max(this, its concurrency) conversations
    turn_max_tokens: int | None = None  # caps each turn's answer; None: each agent's own max_tokens
    extra_body: dict[str, Any] = field(default_factory=dict)  # the endpoint's own request parameters (config)

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
        if not 0 <= self.port_wait_s <= 86_400:
            raise ValueError("port_wait_s must be between 0 and 86400")
        if self.patience < 1:
            raise ValueError("patience must be at least 1")
        if self.min_conversations < 1:
            raise ValueError("min_conversations must be at least 1")
        if self.turn_max_tokens is not None and self.turn_max_tokens < 1:
            raise ValueError("turn_max_tokens must be at least 1")

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

    def conversations_at(self, concurrency: int) -> int:
        """Conversations a level runs in conversation mode, `concurrency` at a time."""
        return max(self.min_conversations, concurrency)


@dataclass
class ProbeResult:
    """The whole probe: what the server is, the levels measured, and the recommendation with its reason."""

    base_url: str
    model: str
    mode: ProbeMode = "single-turn"
    agents: int = 0  # conversation mode: agent shapes replayed
    server_kind: str = "unknown"
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    health: str = ""
    levels: list[ProbeLevel] = field(default_factory=list)
    recommended_concurrency: int = 1
    recommended_mode: RecommendedMode = "sequential"
    reason: str = ""
    stopped_because: StopReason | Literal[""] = ""
    total_requests: int = 0
    elapsed_s: float = 0.0
    settings: ProbeSettings = field(default_factory=ProbeSettings)

    def summary(self) -> ProbeSummary:
        """The probe as `probe --json` prints it and a console's probe tells it (ProbeFinished)."""
        s = self.settings
        return ProbeSummary(
            base_url=self.base_url, model=self.model, mode=self.mode, agents=self.agents, server_kind=self.server_kind,
            max_model_len=self.max_model_len, kv_cache_tokens=self.kv_cache_tokens, health=self.health,
            levels=list(self.levels), prefix_hits_reported=any(lv.prefix_hit_rate is not None for lv in self.levels),
            recommended_concurrency=self.recommended_concurrency, recommended_mode=self.recommended_mode,
            reason=self.reason, stopped_because=self.stopped_because, total_requests=self.total_requests,
            elapsed_s=round(self.elapsed_s, 3),
            bounds=ProbeBounds(max_concurrency=s.max_concurrency, max_tokens=s.max_tokens,
                               turn_max_tokens=s.turn_max_tokens, max_requests=s.max_requests,
                               max_seconds=s.max_seconds, request_timeout_s=s.request_timeout_s))

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.summary())


@dataclass(frozen=True)
class ConversationShape:
    """One agent's conversation as the probe replays it: its texts, its follow-ups, its answer length."""

    name: str
    system: str
    prompt: str
    turns: tuple[str, ...] = ()
    max_tokens: int = 256
    temperature: float = 0.7

    @property
    def requests(self) -> int:
        return 1 + len(self.turns)


def shapes_from_agents(agents: Sequence[AgentConfig]) -> list[ConversationShape]:
    """The agents' conversations, with each {{ name.output }} replaced by text as long as that agent's
    longest answer (its max_tokens), since the probe has no real answer to insert."""
    longest = {a.name: a.max_tokens for a in agents}

    def stand_in(text: str) -> str:
        return OUTPUT_REF.sub(lambda m: _filler(longest.get(m.group(1), 256) * CHARS_PER_TOKEN), text)

    return [ConversationShape(a.name, stand_in(a.system), stand_in(a.prompt), tuple(stand_in(t) for t in a.turns),
                              a.max_tokens, a.temperature) for a in agents]


def _filler(chars: int) -> str:
    return ("the result of that step was " * (chars // 28 + 1))[:chars]


def _stamped(text: str, nonce: str) -> str:
    """`nonce` first and the text shortened by as much, so a long text keeps its length."""
    keep = len(text) - len(nonce) if len(text) > 2 * len(nonce) else len(text)
    return nonce + text[:keep]


@dataclass
class _Request:
    sent_at: float
    first_at: float | None = None
    ended_at: float | None = None
    tokens: int = 0
    error: str = ""
    delta_at: list[float] = field(default_factory=list)
    text: str = ""  # the answer's content (conversation mode resends it)

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
Judge = Callable[..., Recommendation | None]


async def probe(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str | None = None,
    settings: ProbeSettings | None = None,
    on_progress: ProgressCallback | None = None,
    on_level: LevelCallback | None = None,
    endpoint: str = "",
    save: bool = True,
) -> ProbeResult:
    """Probe `base_url` (…/v1) with short single-turn requests and recommend a mode and cap; raises
    EndpointUnusable when it cannot.

    `on_progress` gets one line per step (health, model, each level as it starts); `on_level` gets
    each ProbeLevel as it completes. Cancel the surrounding scope to stop early. With `save`, the
    recommendation is remembered for this base URL and model (probe_store).
    """
    settings = settings or ProbeSettings()
    endpoint = endpoint or base_url
    say = on_progress or (lambda line: None)
    session = await _open(client, base_url, model, settings, say, endpoint)
    one = _short_requests(client, session, endpoint)

    async def run(c: int, left: int) -> ProbeLevel | None:
        if left < settings.requests_at(c):
            return None
        say(f"level {c}: {c} at a time, {settings.requests_at(c)}+ requests, {settings.level_s:g}+ s")
        return await _run_level(client, base_url, c, left, one, settings, session.deadline, session.watch_server)

    await _warm_up(one, settings, session.deadline, endpoint)
    await _sweep(session, run, judge_single_turn, on_level, endpoint)
    return _finish(session, save, say)


async def probe_conversations(
    client: httpx.AsyncClient,
    base_url: str,
    agents: Sequence[AgentConfig],
    *,
    model: str | None = None,
    settings: ProbeSettings | None = None,
    on_progress: ProgressCallback | None = None,
    on_level: LevelCallback | None = None,
    endpoint: str = "",
    save: bool = True,
) -> ProbeResult:
    """Probe `base_url` with conversations shaped like `agents` and recommend the cap at which their
    prefixes survive between turns and throughput holds; no agents: the single-turn `probe`.

    Conversation i of a level replays agent i modulo their number: its system prompt and first prompt,
    then each follow-up turn with the conversation so far (the answers included) resent, at most
    `turn_max_tokens` (else the agent's max_tokens) per answer. The rest is as for `probe`.
    """
    if not agents:
        return await probe(client, base_url, model=model, settings=settings, on_progress=on_progress,
                           on_level=on_level, endpoint=endpoint, save=save)
    settings = settings or ProbeSettings()
    endpoint = endpoint or base_url
    say = on_progress or (lambda line: None)
    shapes = shapes_from_agents(agents)
    session = await _open(client, base_url, model, settings, say, endpoint)
    result = session.result
    result.mode, result.agents = "conversation", len(shapes)
    probe_id = secrets.token_hex(4)

    async def converse(c: int, i: int, done: list[_Request]) -> None:
        shape = shapes[i % len(shapes)]
        nonce = f"[cerevisor probe {probe_id}, level {c}, conversation {i + 1}]\n"
        messages: list[dict[str, str]] = []
        if shape.system:
            messages.append({"role": "system", "content": _stamped(shape.system, nonce)})
        first = shape.prompt if shape.system else _stamped(shape.prompt, nonce)
        max_tokens = min(shape.max_tokens, settings.turn_max_tokens or shape.max_tokens)
        # an agent's long answer is no failure: each turn may take what MIN_TOKENS_PER_S needs for it
        timeout_s = max(settings.request_timeout_s, max_tokens / MIN_TOKENS_PER_S)
        session_id = f"probe-{probe_id}-{c}-{i + 1}"  # a router keeps the conversation on one server
        for n, user in enumerate((first, *shape.turns)):
            messages = [*messages, {"role": "user", "content": user}]
            body = {**settings.extra_body, "model": result.model, "messages": messages, "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
                    "temperature": shape.temperature}
            headers = {"X-Session-ID": session_id, "X-Request-ID": f"{session_id}-{n + 1}"}
            req = await _send(client, endpoint, session.url, body, timeout_s, headers)
            result.total_requests += 1
            done.append(req)
            if req.error:
                return
            messages = [*messages, {"role": "assistant", "content": req.text}]

    async def run(c: int, left: int) -> ProbeLevel | None:
        n = settings.conversations_at(c)
        needed = sum(shapes[i % len(shapes)].requests for i in range(n))
        if left < needed:
            return None
        say(f"level {c}: {n} conversations like the agents', {c} at a time ({needed} requests)")
        return await _run_conversation_level(client, base_url, c, n, converse, settings, session.deadline,
                                             session.watch_server)

    turns = sorted({s.requests for s in shapes})
    say(f"conversations: {len(shapes)} agent shape{'s' * (len(shapes) > 1)}, "
        f"{'-'.join(map(str, (turns[0], turns[-1]) if len(turns) > 1 else turns))} turns each")
    await _warm_up(_short_requests(client, session, endpoint), settings, session.deadline, endpoint)
    await _sweep(session, run, judge_conversations, on_level, endpoint)
    return _finish(session, save, say)


@dataclass
class _Session:
    """One probe under way: the result it fills and its bounds."""

    result: ProbeResult
    settings: ProbeSettings
    started: float
    deadline: float
    url: str
    watch_server: bool


async def _open(client: httpx.AsyncClient, base_url: str, model: str | None, settings: ProbeSettings,
                say: ProgressCallback, endpoint: str) -> _Session:
    """Health (waiting while the model loads), metrics kind and KV size, and the model to request."""
    started = time.monotonic()
    deadline = started + settings.max_seconds
    result = ProbeResult(base_url=base_url, model=model or "", settings=settings)

    status = await read_server(client, base_url)
    waited = ""
    if not status.reachable and status.refused and is_loopback(httpx.URL(base_url).host) and settings.port_wait_s > 0:
        status = await _wait_port(client, base_url, min(deadline, started + settings.port_wait_s), say)
        waited = f" for {time.monotonic() - started:.0f} s"
    if not status.reachable:
        raise EndpointUnusable(endpoint, f"unreachable{waited}: {status.error or 'no answer'} (is the server running?)")
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
        meta = found if isinstance(found := entry.get("meta"), dict) else {}
        result.max_model_len = _int(entry.get("max_model_len")) or _int(meta.get("n_ctx"))
        if result.kv_cache_tokens is None and status.slots is not None and meta.get("n_ctx"):
            # llama-server has no KV gauge; its cache holds every slot's context
            result.kv_cache_tokens = (_int(meta.get("n_ctx")) or 0) * status.slots.total or None
    extra = f", max_model_len {result.max_model_len:,}" if result.max_model_len else ""
    kv = f", KV cache {result.kv_cache_tokens:,} tokens" if result.kv_cache_tokens else ""
    say(f"model: {result.model}{extra}; metrics: {result.server_kind}{kv}")
    return _Session(result, settings, started, deadline, base_url.rstrip("/") + "/chat/completions",
                    watch_server=result.server_kind != "unknown")


def _short_requests(client: httpx.AsyncClient, session: _Session,
                    endpoint: str) -> Callable[[int], Awaitable[_Request]]:
    """Sends the single-turn probe's short requests (each its own numbered prompt), counting them."""
    counter = iter(range(1, 1 << 30))
    result = session.result

    async def one(max_tokens: int) -> _Request:
        body = {**session.settings.extra_body, "model": result.model,
                "messages": [{"role": "user", "content": PROMPT.format(n=next(counter))}],
                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
        req = await _send(client, endpoint, session.url, body, session.settings.request_timeout_s)
        result.total_requests += 1
        return req

    return one


async def _send(client: httpx.AsyncClient, endpoint: str, url: str, body: dict[str, Any], timeout_s: float,
                headers: dict[str, str] | None = None) -> _Request:
    """One streamed chat request, timed; its failure is in `error`, never raised."""
    req = _Request(sent_at=time.monotonic())
    text: list[str] = []
    stream = ChatStream(client, endpoint, url, body, {"X-Cerevisor-Agent": "probe", **(headers or {})})
    with anyio.move_on_after(timeout_s) as scope:
        try:
            async for kind, payload in stream.events():
                if kind == DELTA:
                    now = time.monotonic()
                    req.delta_at.append(now)
                    if req.first_at is None:
                        req.first_at = now
                    if payload and payload[0]:
                        text.append(payload[0])
        except EndpointError as exc:
            req.error = exc.problem
    if scope.cancelled_caught:
        req.error = f"no complete answer within {timeout_s:g} s"
    req.ended_at = time.monotonic()
    req.tokens = stream.usage[1] if stream.usage else stream.tokens
    req.text = "".join(text)
    return req


async def _warm_up(one: Callable[[int], Awaitable[_Request]], settings: ProbeSettings, deadline: float,
                   endpoint: str) -> None:
    """One short request first: a server that cannot answer at all is unusable, said plainly."""
    if not settings.warmup:
        return
    req = None
    with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
        req = await one(min(settings.max_tokens, 16))
        if req.error:
            raise EndpointUnusable(endpoint, f"a chat request failed: {req.error}")
    if req is None:
        raise EndpointUnusable(endpoint, f"no answer to a chat request within {settings.max_seconds:g} s")


async def _sweep(session: _Session, run: Callable[[int, int], Awaitable[ProbeLevel | None]], judge: Judge,
                 on_level: LevelCallback | None, endpoint: str) -> None:
    """Run levels until `judge` says the sweep is past the knee or a bound ends it; record its verdict."""
    result, settings = session.result, session.settings
    verdict: Recommendation | None = None
    ended: StopReason = "max_concurrency"
    for c in settings.levels():
        if time.monotonic() >= session.deadline:
            ended = "max_seconds"
            break
        level = await run(c, settings.max_requests - result.total_requests)
        if level is None:  # not enough requests left for this level
            ended = "max_requests"
            break
        if c == 1 and not level.requests:
            raise EndpointUnusable(endpoint, f"no chat request completed within {settings.max_seconds:g} s")
        if c == 1 and level.failed == level.requests:
            raise EndpointUnusable(endpoint, f"every chat request failed: {level.first_error}")
        result.levels.append(level)
        if on_level is not None:
            on_level(level)
        verdict = judge(result.levels, settings)
        if verdict is not None:
            break
    if verdict is None:
        verdict = judge(result.levels, settings, ended=ended)
    assert verdict is not None
    result.recommended_concurrency, result.reason = verdict.concurrency, verdict.reason
    result.stopped_because, result.recommended_mode = verdict.stopped_because, verdict.mode


def _finish(session: _Session, save: bool, say: ProgressCallback) -> ProbeResult:
    result = session.result
    result.elapsed_s = time.monotonic() - session.started
    if save:
        from cerevisor_tui.endpoints.probe_store import save_recommendation

        try:
            save_recommendation(result.base_url, result.model, result.recommended_concurrency, result.mode,
                                result.reason)
        except OSError as exc:  # the measurement stands; only its memory is lost
            say(f"could not save the recommendation: {exc.strerror or exc}")
    return result


async def _run_level(client: httpx.AsyncClient, base_url: str, concurrency: int, budget: int,
                     one: Callable[[int], Awaitable[_Request]], settings: ProbeSettings, deadline: float,
                     watch_server: bool) -> ProbeLevel:
    """`concurrency` workers send requests back to back until the level has run long enough.

    Throughput is counted only while every worker still had a request to send (from the start to
    the moment the level stops sending), so the ragged end of the last requests does not dilute it.
    """
    issued = 0
    at_least = settings.requests_at(concurrency)

    async def worker(run: _LevelRun) -> None:
        nonlocal issued
        while run.stopped_sending is None:
            enough = issued >= at_least and time.monotonic() - run.started >= settings.level_s
            if enough or issued >= budget:
                run.stopped_sending = time.monotonic()
                return
            issued += 1
            run.done.append(await one(settings.max_tokens))

    return await _measure_level(client, base_url, concurrency, worker=worker, workers=concurrency,
                                settings=settings, deadline=deadline, watch_server=watch_server)


async def _run_conversation_level(client: httpx.AsyncClient, base_url: str, concurrency: int, conversations: int,
                                  converse: Callable[[int, int, list[_Request]], Awaitable[None]],
                                  settings: ProbeSettings, deadline: float, watch_server: bool) -> ProbeLevel:
    """`concurrency` workers run `conversations` conversations, each taking the next when its own ends.

    As in a single-turn level, throughput is counted only while every worker still had a conversation
    (until the first found none left), so levels whose last conversations end raggedly compare fairly.
    """
    queue = iter(range(conversations))

    async def worker(run: _LevelRun) -> None:
        for i in queue:  # shared: each worker takes the next conversation not yet started
            await converse(concurrency, i, run.done)
        if run.stopped_sending is None:
            run.stopped_sending = time.monotonic()

    return await _measure_level(client, base_url, concurrency, worker=worker,
                                workers=min(concurrency, conversations), settings=settings, deadline=deadline,
                                watch_server=watch_server, conversations=conversations)


@dataclass
class _LevelRun:
    """A level under way: when it started, the requests it has sent, and when it stopped sending."""

    started: float
    done: list[_Request] = field(default_factory=list)
    stopped_sending: float | None = None  # the first worker found nothing left to send


async def _measure_level(client: httpx.AsyncClient, base_url: str, concurrency: int, *,
                         worker: Callable[[_LevelRun], Coroutine[Any, Any, None]], workers: int,
                         settings: ProbeSettings,
                         deadline: float, watch_server: bool, **counters: Any) -> ProbeLevel:
    """Run `workers` copies of `worker` within the probe's deadline while polling the server's counters,
    then the level's figures (`counters` added to them); throughput is counted until the level stopped
    sending, when it did."""
    watch = _ServerWatch()

    async def poll() -> None:
        while True:
            watch.add(await read_server(client, base_url, timeout_s=1.0))
            await anyio.sleep(settings.poll_interval_s)

    before = await _counters(client, base_url) if watch_server else None
    run = _LevelRun(started=time.monotonic())
    started = run.started
    with anyio.move_on_after(max(0.0, deadline - started)) as cut:
        async with anyio.create_task_group() as group:
            if watch_server:
                group.start_soon(poll)
            async with anyio.create_task_group() as crew:
                for _ in range(workers):
                    crew.start_soon(worker, run)
            group.cancel_scope.cancel()
    after = await _counters(client, base_url) if watch_server else None
    done = run.done
    ended = max((r.ended_at or started for r in done), default=time.monotonic())
    window = (ended if run.stopped_sending is None else run.stopped_sending) - started
    if window <= 0 or not any(r.delta_at for r in done):
        window = max(1e-9, ended - started)
    return _level(concurrency, done, watch, started, ended, window, complete=not cut.cancelled_caught,
                  counters={**_level_counters(before, after), **counters})


def _level(concurrency: int, done: list[_Request], watch: _ServerWatch, started: float, ended: float, window: float,
           *, complete: bool, counters: dict[str, Any]) -> ProbeLevel:
    """One level's figures from its requests: throughput as the median of short slices of `window` (a burst of
    other load on the host, or a hiccup of the server, spoils a slice or two, not the level)."""
    ok = [r for r in done if not r.error]
    failed = [r for r in done if r.error]
    n_slices = max(1, round(window / SLICE_S))
    width = window / n_slices
    slice_rates = [sum(r.tokens_between(started + i * width, started + (i + 1) * width) for r in done) / width
                   for i in range(n_slices)]
    ttfts = [r.first_at - r.sent_at for r in ok if r.first_at is not None]
    rates = [(r.tokens - 1) / (r.ended_at - r.first_at) for r in ok
             if r.first_at is not None and r.ended_at is not None and r.tokens > 1 and r.ended_at > r.first_at]
    hit_rate = counters.pop("prefix_hit_rate", None)
    return ProbeLevel(
        concurrency=concurrency,
        requests=len(done),
        failed=len(failed),
        output_tokens=sum(r.tokens for r in ok),
        wall_s=_rounded(max(1e-9, ended - started)),
        output_tokens_per_s=_rounded(percentile(slice_rates, 50) or 0.0),
        ttft_p50_s=_rounded(percentile(ttfts, 50)),
        ttft_p95_s=_rounded(percentile(ttfts, 95)),
        stream_tokens_per_s=_rounded(percentile(rates, 50)),
        server_running_max=max(watch.running) if watch.running else None,
        server_waiting_max=max(watch.waiting) if watch.waiting else None,
        server_waiting_share=_rounded(watch.waiting_share()),
        kv_cache_usage_max=_rounded(max(watch.kv) if watch.kv else None),
        complete=complete,
        first_error=failed[0].error if failed else "",
        prefix_hit_rate=_rounded(hit_rate),
        **counters,
    )


def _rounded(x: float | None) -> Any:
    """A level's figure as it is kept and reported: four decimals are more than a probe measures."""
    return None if x is None else round(x, 4)


async def _counters(client: httpx.AsyncClient, base_url: str) -> MetricsSnapshot | None:
    """The server's cumulative counters now (prefix cache, preemptions); None when it has no /metrics."""
    return (await read_server(client, base_url, timeout_s=2.0)).metrics


def _level_counters(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict[str, Any]:
    """A level's prefix-cache hit rate and preemptions, from the counters read before and after it."""
    if after is None:
        return {}
    preempted = None
    if before is not None and before.preemptions is not None and after.preemptions is not None:
        preempted = max(0, after.preemptions - before.preemptions)
    return {"prefix_hit_rate": prefix_hit_rate(before, after), "preemptions": preempted}


async def _wait_port(client: httpx.AsyncClient, base_url: str, until: float, say: ProgressCallback) -> ServerStatus:
    """Ask again each second while the server on this machine refuses its port, until `until`."""
    say(f"nothing listens at {server_root(base_url)} yet; waiting for the server to open its port")
    while True:
        await anyio.sleep(min(1.0, max(0.0, until - time.monotonic())))
        status = await read_server(client, base_url)
        if status.reachable or not status.refused or time.monotonic() >= until:
            return status


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
