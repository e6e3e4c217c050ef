"""What the console keeps between redraws: per-agent transcripts, notes, throughput, server samples, and
each endpoint's cap changes and trend over the run.

It is an engine subscriber called inline for every event, so it only appends to buffers and counts;
no widget is touched here. The screen's timers read it at 10-15 Hz and redraw what is visible.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cerevisor_tui.contract import events as ev
from cerevisor_tui.text import printable

CONTENT, REASONING, TOOL, USER, META, ALERT = "content", "reasoning", "tool", "user", "meta", "alert"
"""Kinds of transcript text; the stream pane styles each (reasoning dimmed, alerts in the error colour)."""

STREAM_MAX_CHARS = 200_000
"""Per agent; past it the oldest text is dropped down to three quarters, so trims are rare."""
THROUGHPUT_BUCKET_S = 0.5
THROUGHPUT_WINDOW_S = 2.0
SPARKLINE_SAMPLES = 240
NOTICE_QUOTED = 160
"""Characters of the newest past notice the summary of a replay's notices quotes."""
CAP_HISTORY_MAX = 2000
"""Cap changes kept for the history screen (`a`); older ones are dropped (the journal keeps them all)."""
TREND_POINTS = 240
"""Points per endpoint trend; when full, neighbours merge in pairs, so it always spans the whole run."""
UNMONITORED_TREND_S = 2.0
"""How often an endpoint without server samples (hosted: no /metrics) gets a trend point."""


@dataclass(frozen=True, slots=True)
class StreamCursor:
    """How far a reader has read an AgentStream: (generation, piece, parts of that piece)."""

    generation: int = -1
    piece: int = 0
    parts: int = 0


class AgentStream:
    """A bounded transcript of one agent: runs ("pieces") of text of one kind, appended in place.

    Appending a token costs one list append; readers ask for what came after their cursor, so a
    flush renders only the new text. When the buffer is trimmed the generation changes and a reader
    starts over from the (shortened) beginning.
    """

    def __init__(self, max_chars: int = STREAM_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self.pieces: list[tuple[str, list[str]]] = []
        self.base = 0  # absolute index of pieces[0]
        self.chars = 0
        self.generation = 0
        self.version = 0  # bumped on every append: a cheap "anything new?" check
        self.dropped = 0  # characters trimmed away so far: `written` counts every character ever appended

    def append(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.pieces and self.pieces[-1][0] == kind:
            self.pieces[-1][1].append(text)
        else:
            self.pieces.append((kind, [text]))
        self.chars += len(text)
        self.version += 1
        if self.chars > self.max_chars:
            self._trim()

    @property
    def written(self) -> int:
        return self.chars + self.dropped

    def _trim(self) -> None:
        before = self.chars
        target = self.max_chars * 3 // 4
        while self.chars > target and len(self.pieces) > 1:
            _, parts = self.pieces.pop(0)
            self.chars -= sum(map(len, parts))
            self.base += 1
        if self.chars > target:  # one huge run: keep its tail
            kind, parts = self.pieces[0]
            text = "".join(parts)[-target:]
            self.pieces[0] = (kind, [text])
            self.chars = len(text)
        self.dropped += before - self.chars
        self.generation += 1

    def read(self, cursor: StreamCursor) -> tuple[StreamCursor, list[tuple[str, str]], bool]:
        """What came after `cursor`: (new cursor, [(kind, text)], reset). `reset`: start the view over."""
        reset = cursor.generation != self.generation or cursor.piece < self.base
        start_piece, start_part = (self.base, 0) if reset else (cursor.piece, cursor.parts)
        out: list[tuple[str, str]] = []
        index = start_piece - self.base
        for i in range(index, len(self.pieces)):
            kind, parts = self.pieces[i]
            skip = start_part if i == index else 0
            if skip < len(parts):
                out.append((kind, "".join(parts[skip:])))
        if self.pieces:
            end = StreamCursor(self.generation, self.base + len(self.pieces) - 1, len(self.pieces[-1][1]))
        else:
            end = StreamCursor(self.generation, self.base, 0)
        return end, out, reset

    def text(self) -> str:
        return "".join("".join(parts) for _, parts in self.pieces)

    def lead(self) -> str:
        """What goes before a new block so that one blank line sets it apart ("" at the start)."""
        if not self.pieces:
            return ""
        return "\n" if self.pieces[-1][1][-1].endswith("\n") else "\n\n"


@dataclass
class Notice:
    message: str
    severity: str = "information"  # information | warning | error
    title: str = ""


@dataclass
class ServerView:
    """The last sample of one endpoint."""

    healthy: bool | None = None
    server_kind: str = ""
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_hit_rate: float | None = None
    detail: str = ""
    slots_busy: int | None = None
    slots_total: int | None = None
    kv_cache_tokens: float | None = None  # the server's own KV capacity, when it reports one


@dataclass(frozen=True, slots=True)
class CapChange:
    """One change of the cap that says why (a ConcurrencyChanged with a reason, or a ModeChanged): an endpoint's
    auto cap, or a run-wide change (endpoint ""), and who made it."""

    t: float  # monotonic, as the event's
    endpoint: str
    cap: int  # the endpoint's new live cap; for a run-wide change, what the run may run now
    ceiling: int  # auto's ceiling, as the event carries it
    reason: str
    by: str = ""  # "operator", "auto"; "" not said (an older journal)


@dataclass(frozen=True, slots=True)
class TrendPoint:
    """One endpoint at one server sample: its cap, output tokens/s since the previous point, the server's
    queue and KV-cache use (None: not known)."""

    t: float
    cap: float | None
    tokens_per_s: float | None
    waiting: float | None
    kv_cache_usage: float | None


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def merge_points(points: list[TrendPoint]) -> TrendPoint:
    """Several consecutive points as one: the means of what is known, at the last one's time."""
    if len(points) == 1:
        return points[0]
    return TrendPoint(points[-1].t, _mean([p.cap for p in points]), _mean([p.tokens_per_s for p in points]),
                      _mean([p.waiting for p in points]), _mean([p.kv_cache_usage for p in points]))


class Trend:
    """One endpoint's points over the whole run, at most `max_points`: when full, neighbours merge in pairs
    and each later point stands for twice as many samples, so memory stays bounded and the oldest part of
    the run is never dropped, only drawn coarser."""

    def __init__(self, max_points: int = TREND_POINTS) -> None:
        self.max_points = max(2, max_points - max_points % 2)
        self._points: list[TrendPoint] = []
        self._pending: list[TrendPoint] = []  # samples of the next point, while one point stands for several
        self.stride = 1  # samples per point
        self.version = 0  # bumped by every sample
        self.last: TrendPoint | None = None  # the newest sample as it came, never merged

    def add(self, point: TrendPoint) -> None:
        self.version += 1
        self.last = point
        self._pending.append(point)
        if len(self._pending) < self.stride:
            return
        self._points.append(merge_points(self._pending))
        self._pending = []
        if len(self._points) >= self.max_points:
            self._points = [merge_points(self._points[i:i + 2]) for i in range(0, len(self._points), 2)]
            self.stride *= 2

    @property
    def points(self) -> list[TrendPoint]:
        """Oldest first; the last may stand for fewer samples than the others (the newest are shown at once)."""
        if self._pending:
            return [*self._points, merge_points(self._pending)]
        return list(self._points)

    def __len__(self) -> int:
        return len(self._points) + (1 if self._pending else 0)


@dataclass
class EndpointTrack:
    """What the console mirrors of one endpoint's cap and load over the run, from events."""

    max_concurrency: int = 0  # its own cap, from RunStarted (0: not known)
    monitored: bool = True  # hosted endpoints are not polled: no ServerSample comes
    auto_cap: int | None = None  # its live cap in auto mode, from its last ConcurrencyChanged
    last_change: CapChange | None = None
    tokens: int = 0  # output tokens streamed from it
    trend: Trend = field(default_factory=Trend)
    mark_t: float | None = None  # the last trend point's time, and the token count then
    mark_tokens: int = 0


def raw_shape(raw: dict[str, Any]) -> str:
    """What a client's message without text holds, in brackets: its blocks' types (`[tool_result]`) and the
    tools it calls (`[tool call: read_file]`), as far as the message's own keys say; "" when they say nothing."""
    parts: list[str] = []
    content = raw.get("content", raw.get("output"))
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("type"), str) and block["type"] not in parts:
                parts.append(block["type"])
    for call in raw.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        parts.append(f"tool call: {name}" if isinstance(name, str) else "tool call")
    if not parts and isinstance(raw.get("type"), str):  # a responses item: function_call, function_call_output
        name = raw.get("name")
        parts.append(raw["type"] + (f": {name}" if isinstance(name, str) else ""))
    return " ".join(f"[{part}]" for part in parts)


def _mode_hint(mode: str) -> str:
    """What the console adds to the engine's note on a mode: the key that shows auto at work."""
    return " (a: every cap change and its reason)" if mode == "auto" else ""


@dataclass
class UiModel:
    """Engine subscriber: buffers and counters the console draws from."""

    streams: dict[str, AgentStream] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    keepalive_at: dict[str, float] = field(default_factory=dict)
    servers: dict[str, ServerView] = field(default_factory=dict)
    endpoint_states: dict[str, ev.EndpointState] = field(default_factory=dict)  # each endpoint's, as the run says it
    notices: list[Notice] = field(default_factory=list)
    throughput: deque[float] = field(default_factory=lambda: deque(maxlen=SPARKLINE_SAMPLES))
    tokens_total: int = 0  # output tokens the run streamed: counted here, or as the run told them (RunTally)
    samples_taken: int = 0
    # the run's past is being fed (an attached console's replay, a finished run's journal): its token deltas are no
    # rate of now, and its notices are no news (one line sums them up when it is over: `replayed`)
    replaying: bool = False
    run_id: str = ""
    run_dir: str = ""
    finished: ev.RunFinished | None = None
    version: int = 0  # bumped by every event but token deltas: rows and header may have changed
    mode: str = ""
    run_cap: int = 0  # the parallel cap (auto's ceiling is `auto_ceiling`)
    started_at: float | None = None
    tracks: dict[str, EndpointTrack] = field(default_factory=dict)
    cap_changes: deque[CapChange] = field(default_factory=lambda: deque(maxlen=CAP_HISTORY_MAX))
    cap_changes_total: int = 0  # ever recorded; the deque keeps the newest CAP_HISTORY_MAX
    auto_ceiling: int | None = None  # as the last auto change carried it
    _agent_track: dict[str, EndpointTrack] = field(default_factory=dict)
    _buckets: deque[list[float]] = field(default_factory=deque)
    _last_turn: dict[str, int] = field(default_factory=dict)
    _answer_from: dict[str, int] = field(default_factory=dict)  # agent -> its stream's `written` at AgentStarted
    session_names: set[str] = field(default_factory=set)  # the gateway's sessions (SessionOpened)
    # a session's requests in flight: (agent, attempt) -> the request's number, and the attempt whose text its
    # stream is writing (a harness may have several requests in flight: each one's text goes under its header)
    _requests: dict[tuple[str, int], int] = field(default_factory=dict)
    _writing: dict[str, int] = field(default_factory=dict)
    _last_sample_at: float = -math.inf
    _table: dict[str, Callable[[Any], Any]] | None = field(default=None, init=False, repr=False, compare=False)  # kind -> handler
    HANDLERS: ClassVar[tuple[str, ...]] = ("_on_",)  # the prefixes of the methods that take an event kind

    def stream(self, agent: str) -> AgentStream:
        found = self.streams.get(agent)
        if found is None:
            found = self.streams[agent] = AgentStream()
        return found

    # ---- the subscriber ---------------------------------------------------------------------------
    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.TokenDelta):
            stream = self.stream(event.agent)
            writing = self._writing.get(event.agent)
            if writing is not None and writing != event.attempt:
                self._switch_request(stream, event.agent, event.attempt)
            if event.reasoning:
                stream.append(REASONING, event.reasoning)
            if event.text:
                stream.append(CONTENT, event.text)
            if event.tool:
                stream.append(TOOL, event.tool)
            if self.replaying:  # an answer so far, streamed over seconds: not a rate of now (RunTally counts it)
                return
            self._count(event.t, event.tokens)
            track = self._agent_track.get(event.agent)
            if track is not None:
                track.tokens += event.tokens
            return
        table = self._table
        if table is None:
            table = self._table = ev.handlers(self, *self.HANDLERS)
        if isinstance(event, ev.KeepAlive):
            self.keepalive_at[event.agent] = event.t  # shown: a server that is alive but sends no tokens
        else:
            self.version += 1
        handler = table.get(event.kind)
        if handler is not None:
            handler(event)

    def _on_RunStarted(self, e: ev.RunStarted) -> None:
        self.run_id, self.run_dir = e.run_id, e.run_dir
        self.mode, self.run_cap, self.started_at = e.mode, e.max_concurrency, e.t
        for summary in e.endpoints:
            track = self.track(summary.name)
            track.max_concurrency = summary.max_concurrency
            track.monitored = summary.kind != "hosted"
            track.mark_t = e.t
        if e.note:
            self.notices.append(Notice(e.note + _mode_hint(e.mode)))

    def track(self, endpoint: str) -> EndpointTrack:
        found = self.tracks.get(endpoint)
        if found is None:
            found = self.tracks[endpoint] = EndpointTrack()
        return found

    def _switch_request(self, stream: AgentStream, agent: str, attempt: int) -> None:
        """Another of a session's requests in flight streams now: its text goes on under its own header."""
        self._writing[agent] = attempt
        request = self._requests.get((agent, attempt))
        if request is not None:
            stream.append(META, f"\n▌ assistant · request {request} (continued)\n")

    def _on_SessionOpened(self, e: ev.SessionOpened) -> None:
        self.session_names.add(e.agent)
        stream = self.stream(e.agent)
        harness = f" from {e.harness}" if e.harness else ""
        stream.append(META, f"▌ gateway session{harness} · named by {e.source} · {e.api} API · on {e.endpoint}\n")
        about = " · ".join(p for p in (e.topic, f"its own session id {e.own_id}" if e.own_id else "") if p)
        if about:
            stream.append(META, f"▌ {printable(about)}\n")

    def _on_MessageRecorded(self, e: ev.MessageRecorded) -> None:
        if e.raw:  # a message a gateway session's client sent (new in this request): whatever its role
            stream = self.stream(e.agent)
            stream.append(USER, f"{stream.lead()}▌ {e.role} · request {e.turn}\n")
            text = e.content or raw_shape(e.raw)
            if text:
                stream.append(USER if e.content else META, text + "\n")
            return
        # Assistant text arrives token by token; an answer none of which streamed here (a console fed from the
        # journal, which keeps only whole answers) is written whole.
        if e.role == "assistant":
            stream = self.stream(e.agent)
            if stream.written == self._answer_from.pop(e.agent, -1):
                if e.reasoning:
                    stream.append(REASONING, e.reasoning + "\n")
                stream.append(CONTENT, e.content)
        if e.role == "user":
            stream = self.stream(e.agent)
            lead = "\n\n" if stream.chars else ""
            stream.append(USER, f"{lead}▌ user · turn {e.turn}\n")
            stream.append(USER, e.content + "\n")

    def _on_AgentStarted(self, e: ev.AgentStarted) -> None:
        stream = self.stream(e.agent)
        if not e.turns:  # a gateway session's request: the time it waited here is not the model's
            label = f"▌ assistant · request {e.turn} · queued {e.queued_s:.1f} s"
            if e.model_asked and e.model_sent and e.model_asked != e.model_sent:
                label += f" · {printable(e.model_asked)} → {printable(e.model_sent)}"
            self._requests[(e.agent, e.attempt)] = e.turn
            self._writing[e.agent] = e.attempt
        else:
            label = f"▌ assistant · turn {e.turn}/{e.turns}"
        # attempts count across turns; a second start of the same turn is a retry or restart
        if e.turns and self._last_turn.get(e.agent) == e.turn:
            label += f" · attempt {e.attempt}"
        self._last_turn[e.agent] = e.turn
        self._agent_track[e.agent] = self.track(e.endpoint)
        stream.append(META, f"\n{label}\n")
        self._answer_from[e.agent] = stream.written
        self.notes.pop(e.agent, None)

    def _on_EndpointWaiting(self, e: ev.EndpointWaiting) -> None:
        self.notes[e.agent] = f"waiting for {e.endpoint}: {e.reason}"

    def _on_FirstToken(self, e: ev.FirstToken) -> None:
        self.notes.pop(e.agent, None)

    def _on_StallWarning(self, e: ev.StallWarning) -> None:
        what = "first token" if e.deadline == "first_byte" else "output"
        self.notes[e.agent] = f"no {what} for {e.fraction:.0%} of its deadline"

    def _on_StallExtended(self, e: ev.StallExtended) -> None:
        self.notes[e.agent] = f"deadline +{e.extend_s:g} s: {e.reason}"
        self.notices.append(Notice(f"{e.agent}: deadline extended by {e.extend_s:g} s ({e.reason})"))

    def _on_TurnFinished(self, e: ev.TurnFinished) -> None:
        self._requests.pop((e.agent, e.attempt), None)

    def _on_AgentKilled(self, e: ev.AgentKilled) -> None:
        request = self._requests.pop((e.agent, e.attempt), None)
        if request is not None or e.agent in self.session_names:  # a session's request: the session goes on
            what = f"request {request}" if request is not None else "its request"
            self.notes[e.agent] = f"{what} killed: {e.reason}"
            self.stream(e.agent).append(ALERT, f"\n✖ {what} killed: {e.reason} (the session goes on; its "
                                               "harness decides what follows)\n")
            self.notices.append(Notice(f"{e.agent}: {what} killed: {e.reason}. The session goes on.", "error",
                                       "Request killed"))
            return
        self.notes[e.agent] = e.reason
        self.stream(e.agent).append(ALERT, f"\n✖ killed: {e.reason}\n")
        self.notices.append(Notice(f"{e.agent} killed: {e.reason}", "error", "Agent killed"))

    def _on_AgentRetrying(self, e: ev.AgentRetrying) -> None:
        self.notes[e.agent] = f"retrying in {e.delay_s:.1f} s: {e.cause}"
        self.stream(e.agent).append(ALERT, f"\n↻ retrying in {e.delay_s:.1f} s: {e.cause}\n")

    def _on_AgentFinished(self, e: ev.AgentFinished) -> None:
        self._writing.pop(e.agent, None)
        if e.agent in self.session_names:
            self.notes.pop(e.agent, None)
            self.stream(e.agent).append(META, f"\n■ {e.error or 'session ' + e.status}\n")
            return
        if e.status == "completed":
            self.notes.pop(e.agent, None)
        elif e.error:
            self.notes[e.agent] = e.error
            if e.status == "failed":
                self.stream(e.agent).append(ALERT, f"\n✖ failed: {e.error}\n")
                self.notices.append(Notice(f"{e.agent} failed: {e.error}", "error", "Agent failed"))

    def _on_ServerSample(self, e: ev.ServerSample) -> None:
        self.servers[e.endpoint] = ServerView(e.healthy, e.server_kind, e.running, e.waiting, e.kv_cache_usage,
                                              e.prefix_hit_rate, e.detail, e.slots_busy, e.slots_total,
                                              e.kv_cache_tokens)
        self._add_point(e.endpoint, e.t, e.waiting, e.kv_cache_usage)

    def _on_EndpointState(self, e: ev.EndpointState) -> None:
        self.endpoint_states[e.endpoint] = e

    def state_of(self, endpoint: str, now: float) -> tuple[str, str, int | None] | None:
        """An endpoint's state as shown: (state, why, whole seconds in it); None before anything says one. A run
        from before EndpointState (its journal): the last sample's health stands in, for how long not known."""
        told = self.endpoint_states.get(endpoint)
        if told is not None:
            return told.state, told.why, max(0, int(now - told.since))
        sample = self.servers.get(endpoint)
        if sample is None or sample.healthy is None:
            return None
        if sample.healthy:
            return "up", "", None
        return ("loading" if "load" in sample.detail.lower() else "down"), sample.detail, None

    def _on_ModeChanged(self, e: ev.ModeChanged) -> None:
        self.mode = e.mode
        if e.note:
            self.notices.append(Notice(e.note + _mode_hint(e.mode)))
        self._record_cap_change(CapChange(e.t, "", e.effective_cap, self.auto_ceiling or 0, f"mode {e.mode}", e.by))

    def _on_ConcurrencyChanged(self, e: ev.ConcurrencyChanged) -> None:
        if e.ceiling:
            self.auto_ceiling = e.ceiling
        if e.endpoint:
            self.track(e.endpoint).auto_cap = e.effective_cap
        else:
            self.run_cap = e.max_concurrency
        if e.reason:  # auto's changes and the operator's moves of a cap or auto's ceiling; not a pause
            change = CapChange(e.t, e.endpoint, e.effective_cap, e.ceiling or e.max_concurrency, e.reason, e.by)
            self._record_cap_change(change)
            if e.endpoint:
                self.track(e.endpoint).last_change = change

    def _record_cap_change(self, change: CapChange) -> None:
        self.cap_changes.append(change)
        self.cap_changes_total += 1

    @property
    def last_cap_change(self) -> CapChange | None:
        return self.cap_changes[-1] if self.cap_changes else None

    # ---- trends -------------------------------------------------------------------------------------
    def cap_of(self, endpoint: str) -> int | None:
        """The cap in force on `endpoint` as the events told it (None: not known yet)."""
        track = self.tracks.get(endpoint)
        if self.mode == "auto":
            return track.auto_cap if track is not None else None
        if self.mode == "sequential":
            return 1
        if not self.run_cap:
            return None
        limit = track.max_concurrency if track is not None and track.max_concurrency else self.run_cap
        return min(self.run_cap, limit)

    def _add_point(self, endpoint: str, t: float, waiting: float | None, kv: float | None) -> None:
        track = self.track(endpoint)
        rate = None
        if track.mark_t is not None and t > track.mark_t:
            rate = (track.tokens - track.mark_tokens) / (t - track.mark_t)
        track.mark_t, track.mark_tokens = t, track.tokens
        cap = self.cap_of(endpoint)
        track.trend.add(TrendPoint(t, None if cap is None else float(cap), rate, waiting, kv))

    def _on_RunTally(self, e: ev.RunTally) -> None:
        self.tokens_total = e.output_tokens  # the run's count, not this console's since it came

    def _on_RunFinished(self, e: ev.RunFinished) -> None:
        self.finished = e
        # a finished run's journal read back has no token deltas: its report's count (the server's) stands
        self.tokens_total = max(self.tokens_total, e.totals.output_tokens)

    # ---- throughput -------------------------------------------------------------------------------
    def _count(self, t: float, tokens: int) -> None:
        self.tokens_total += tokens
        slot = math.floor(t / THROUGHPUT_BUCKET_S) * THROUGHPUT_BUCKET_S
        if self._buckets and self._buckets[-1][0] == slot:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([slot, tokens])
            while len(self._buckets) > 2 * THROUGHPUT_WINDOW_S / THROUGHPUT_BUCKET_S:
                self._buckets.popleft()

    def tokens_per_s(self, now: float) -> float:
        """Aggregate output tokens per second over the last complete window."""
        end = math.floor(now / THROUGHPUT_BUCKET_S) * THROUGHPUT_BUCKET_S
        start = end - THROUGHPUT_WINDOW_S
        return sum(n for t, n in self._buckets if start <= t < end) / THROUGHPUT_WINDOW_S

    def sample(self, now: float) -> None:
        """Add one sparkline point per bucket interval (called from the redraw timer)."""
        if now - self._last_sample_at >= THROUGHPUT_BUCKET_S:
            self._last_sample_at = now
            self.throughput.append(self.tokens_per_s(now))
            self.samples_taken += 1
        if self.finished is None:  # endpoints that no monitor samples still get a trend point now and then
            for name, track in self.tracks.items():
                if not track.monitored and track.mark_t is not None and now - track.mark_t >= UNMONITORED_TREND_S:
                    self._add_point(name, now, None, None)

    def take_notices(self) -> list[Notice]:
        """The notices to show now; none while the run's past is fed (see `replayed`)."""
        if self.replaying:
            return []
        notices, self.notices = self.notices, []
        return notices

    def replayed(self) -> None:
        """The run's past has been fed: what follows happens now. Its notices, each a toast when it was news, are
        one line now, so that attaching to a long run does not bury the screen under its history."""
        self.replaying = False
        past, self.notices = self.notices, []
        if not past:
            return
        counts = [f"{n} {label}{'s' * (n != 1)}" for label, n in (
            ("error", sum(1 for p in past if p.severity == "error")),
            ("warning", sum(1 for p in past if p.severity == "warning"))) if n]
        newest = past[-1]
        said = printable(f"{newest.title}: {newest.message}" if newest.title else newest.message)
        said = said if len(said) <= NOTICE_QUOTED else said[:NOTICE_QUOTED - 1] + "…"
        where = f" (all in {self.run_dir}/events.jsonl)" if self.run_dir else ""
        self.notices.append(Notice(
            f"{len(past)} earlier notice{'s' * (len(past) != 1)} of this run"
            + (f" ({', '.join(counts)})" if counts else "") + f"{where}; the newest: {said}", "information",
            "Before this console"))
