"""What the console keeps between redraws: per-agent transcripts, notes, throughput and server samples.

It is an engine subscriber called inline for every event, so it only appends to buffers and counts;
no widget is touched here. The screen's timers read it at 10-15 Hz and redraw what is visible.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cerevisor_tui.engine import events as ev

CONTENT, REASONING, TOOL, USER, META, ALERT = "content", "reasoning", "tool", "user", "meta", "alert"
"""Kinds of transcript text; the stream pane styles each (reasoning dimmed, alerts in the error colour)."""

STREAM_MAX_CHARS = 200_000
"""Per agent; past it the oldest text is dropped down to three quarters, so trims are rare."""
THROUGHPUT_BUCKET_S = 0.5
THROUGHPUT_WINDOW_S = 2.0
SPARKLINE_SAMPLES = 240


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

    def _trim(self) -> None:
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


@dataclass
class UiModel:
    """Engine subscriber: buffers and counters the console draws from."""

    streams: dict[str, AgentStream] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    keepalive_at: dict[str, float] = field(default_factory=dict)
    servers: dict[str, ServerView] = field(default_factory=dict)
    notices: list[Notice] = field(default_factory=list)
    throughput: deque[float] = field(default_factory=lambda: deque(maxlen=SPARKLINE_SAMPLES))
    tokens_total: int = 0
    samples_taken: int = 0
    run_id: str = ""
    run_dir: str = ""
    finished: ev.RunFinished | None = None
    version: int = 0  # bumped by every event but token deltas: rows and header may have changed
    _buckets: deque[list[float]] = field(default_factory=deque)
    _last_turn: dict[str, int] = field(default_factory=dict)
    _last_sample_at: float = -math.inf

    def stream(self, agent: str) -> AgentStream:
        found = self.streams.get(agent)
        if found is None:
            found = self.streams[agent] = AgentStream()
        return found

    # ---- the subscriber ---------------------------------------------------------------------------
    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.TokenDelta):
            stream = self.stream(event.agent)
            if event.reasoning:
                stream.append(REASONING, event.reasoning)
            if event.text:
                stream.append(CONTENT, event.text)
            if event.tool:
                stream.append(TOOL, event.tool)
            self._count(event.t, event.tokens)
            return
        if isinstance(event, ev.KeepAlive):
            self.keepalive_at[event.agent] = event.t  # shown: a server that is alive but sends no tokens
            return
        self.version += 1
        handler = getattr(self, "_on_" + event.kind, None)
        if handler is not None:
            handler(event)

    def _on_RunStarted(self, e: ev.RunStarted) -> None:
        self.run_id, self.run_dir = e.run_id, e.run_dir
        if e.note:
            self.notices.append(Notice(e.note))

    def _on_MessageRecorded(self, e: ev.MessageRecorded) -> None:
        # Assistant text already arrived token by token; only the user's side is written whole.
        if e.role == "user":
            stream = self.stream(e.agent)
            lead = "\n\n" if stream.chars else ""
            stream.append(USER, f"{lead}▌ user · turn {e.turn}\n")
            stream.append(USER, e.content + "\n")

    def _on_AgentStarted(self, e: ev.AgentStarted) -> None:
        stream = self.stream(e.agent)
        label = f"▌ assistant · turn {e.turn}/{e.turns}"
        # attempts count across turns; a second start of the same turn is a retry or restart
        if self._last_turn.get(e.agent) == e.turn:
            label += f" · attempt {e.attempt}"
        self._last_turn[e.agent] = e.turn
        stream.append(META, f"\n{label}\n")
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

    def _on_AgentKilled(self, e: ev.AgentKilled) -> None:
        self.notes[e.agent] = e.reason
        self.stream(e.agent).append(ALERT, f"\n✖ killed: {e.reason}\n")
        self.notices.append(Notice(f"{e.agent} killed: {e.reason}", "error", "Agent killed"))

    def _on_AgentRetrying(self, e: ev.AgentRetrying) -> None:
        self.notes[e.agent] = f"retrying in {e.delay_s:.1f} s: {e.cause}"
        self.stream(e.agent).append(ALERT, f"\n↻ retrying in {e.delay_s:.1f} s: {e.cause}\n")

    def _on_AgentFinished(self, e: ev.AgentFinished) -> None:
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

    def _on_ModeChanged(self, e: ev.ModeChanged) -> None:
        if e.note:
            self.notices.append(Notice(e.note))

    def _on_RunFinished(self, e: ev.RunFinished) -> None:
        self.finished = e

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

    def take_notices(self) -> list[Notice]:
        notices, self.notices = self.notices, []
        return notices
