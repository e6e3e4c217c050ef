"""The console's picture of a run, built only from the run's events: what every widget reads.

A `RunMirror` is an event subscriber (`mirror(event)`), fed live in-process, over a run's control socket,
or from a finished run's `events.jsonl` (`feed_records`). It keeps the run (mode, caps, waves, pause,
stop), each agent (status, turn, its running attempt and the deadline that attempt is under, tokens,
TTFT, what its rate is computed from) and each endpoint (what it is, its stall policy, its load as the
engine judges it), plus the transcripts, throughput and trends of `UiModel`, which it extends.

Times are the run host's `time.monotonic()`: a console is on the same host (a Unix socket), so a
deadline is compared with the console's own clock as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.deadlines import Window, stream_window
from cerevisor_tui.text import printable
from cerevisor_tui.ui.inbox import Inbox
from cerevisor_tui.ui.model import ALERT, META, TOOL, Notice, UiModel

FINAL, ACTIVE = ev.FINAL, ev.ACTIVE

TOOL_ARGUMENTS_SHOWN = 500
"""Characters of a tool call's arguments the stream shows (the approval prompt shows them all)."""


@dataclass(eq=False, slots=True)
class AttemptView:
    """The running attempt of an agent, and its stall clock, by the watchdog's own rules (contract/deadlines.py)."""

    number: int
    turn: int
    sent_at: float
    first_byte_s: float  # the first-byte deadline's window
    idle_s: float  # the idle deadline's window
    last_alive: float  # the last sign of life (a token; with liveness "bytes" any byte that came as an event)
    by_bytes: bool = False  # the endpoint's liveness is "bytes": keep-alives are life too
    first_token_at: float | None = None
    tokens: int = 0  # streamed in this attempt, as token deltas told it
    extra_s: float = 0.0  # extensions of the window in force since `extra_base`
    extra_base: float = math.nan  # the base the extensions were given at: life since starts a fresh window
    prefill: ev.PrefillProgress | None = None  # how far its prompt is prefilled, before its first token

    @property
    def window(self) -> Window:
        """The stall window in force: "first_byte" until the first sign of life, then "idle"."""
        return stream_window(sent_at=self.sent_at, last_alive=self.last_alive, first_token_at=self.first_token_at,
                             by_bytes=self.by_bytes, first_byte_s=self.first_byte_s, idle_s=self.idle_s)

    @property
    def phase(self) -> str:
        return self.window.phase

    @property
    def base(self) -> float:
        """Where the deadline's window starts: the request's sending, or the last sign of life."""
        return self.window.base

    @property
    def deadline_at(self) -> float:
        """The absolute (monotonic) time the deadline in force fires, extensions included."""
        _, base, window_s = self.window
        return base + window_s + (self.extra_s if self.extra_base == base else 0.0)

    def deadline_is(self, deadline_at: float) -> None:
        """The engine said where the deadline is (a warning, an extension): take its word for this window."""
        _, base, window_s = self.window
        self.extra_s, self.extra_base = deadline_at - base - window_s, base


@dataclass(eq=False, slots=True)
class AgentView:
    """One agent as the events told it."""

    name: str
    endpoint: str
    wave: int
    turns: int
    status: str = "pending"
    turn: int = 0
    attempts: int = 0  # requests sent, over all turns
    tokens: int = 0  # streamed, over all attempts
    completion_tokens: int = 0  # of completed turns, as the server counted them
    decode_s: float = 0.0  # from first token to end, over completed turns that streamed
    decoded_tokens: int = 0  # the completion tokens of those turns
    ttft_s: float | None = None  # of its first answer
    stall_warnings: int = 0
    error: str = ""
    reused: bool = False  # a resumed run took its answer from the earlier run: never sent again
    started_at: float | None = None
    finished_at: float | None = None
    attempt: AttemptView | None = None  # the running attempt; None between attempts and at the end
    tool: ev.ToolCallStarted | None = None  # the tool call executing (status "tool")
    approval: ev.ApprovalRequested | None = None  # the tool call waiting for the operator (status "approval")
    pool: str = ""  # the pool it was placed from (its endpoint is the member)
    moved_from: str = ""  # the member it left because that member was down (its prefix cache there is lost)
    # meters (AgentMeters): prompt tokens sent and served from the prefix cache, context length, cost
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: its server does not say
    context_tokens: int = 0
    max_model_len: int = 0
    cost_usd: float = 0.0
    meter_warning: str = ""  # its context is nearly full, or its next turn will not fit
    # a gateway session (SessionOpened): its requests are its attempts, its `turn` the request's number
    session: ev.SessionOpened | None = None
    in_flight: dict[int, AttemptView] = field(default_factory=dict)  # a session's requests in flight, by attempt
    queued_at: float | None = None  # a session's next request waits in the gateway for a slot since (AgentQueued)
    queued_s: float | None = None  # how long its current (or last) request waited in the gateway: not model silence
    model_asked: str = ""  # the model its harness asked for in its current (or last) request, and the one sent
    model_sent: str = ""
    killed_request: tuple[int, str] | None = None  # its last request killed (number, reason), until the next starts
    queued_since: float | None = None  # a workflow agent waiting for a running slot since (AgentQueued)

    @property
    def label(self) -> str:
        """What its row is called: a session's title where its name is a harness's generated id, else its name."""
        return self.session.title if self.session is not None and self.session.title else self.name

    @property
    def model_mapping(self) -> str:
        """`claude-sonnet-4 → qwen3-coder` when a session's request went upstream under another model, else ""."""
        if self.model_asked and self.model_sent and self.model_asked != self.model_sent:
            return printable(f"{self.model_asked} → {self.model_sent}")
        return ""

    def attempt_of(self, number: int) -> AttemptView | None:
        """The running attempt an event names: a session may have several requests in flight at once."""
        att = self.attempt
        if att is None or att.number == number or not self.in_flight:
            return att
        return self.in_flight.get(number)

    def end_attempt(self, number: int) -> None:
        """An attempt ended: the running one is a session's oldest request still in flight, or none."""
        if self.in_flight:
            self.in_flight.pop(number, None)
            self.attempt = next(iter(self.in_flight.values()), None)
        else:
            self.attempt = None

    @property
    def context_fill(self) -> float | None:
        return self.context_tokens / self.max_model_len if self.max_model_len and self.context_tokens else None

    def meter_note(self, priced: bool = False) -> str:
        """Where a pool's agent runs and its meters, in one line; "" for an agent of a lone endpoint that is not
        priced and has nothing to flag (its line stays as it always was). A session's meters always show."""
        if self.meter_warning:
            return self.meter_warning
        if not (self.pool or priced or self.session is not None):
            return ""
        parts = [f"on {self.endpoint}" + (f" (moved from {self.moved_from}: prefix lost)" if self.moved_from else "")
                 if self.pool else ""]
        if self.cached_tokens is not None and self.prompt_tokens:
            parts.append(f"cache {self.cached_tokens / self.prompt_tokens:.0%}")
        if self.context_fill is not None:
            parts.append(f"ctx {self.context_fill:.0%}")
        if priced:
            parts.append(f"${self.cost_usd:.4f}")
        return " · ".join(p for p in parts if p)

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else None


@dataclass(eq=False)
class EndpointView:
    """One endpoint of the run: what it is (RunStarted), its stall policy, and its load as the engine judges it."""

    name: str
    kind: str = ""
    base_url: str = ""
    model: str = ""
    max_concurrency: int = 0
    stall: ev.StallPolicy | None = None  # None: not told (an older journal)
    load: ev.LoadChanged | None = None
    priced: bool = False  # it has a price per million tokens: its agents' rows show their cost
    warmup: str = ""  # "warming" (its warm-up request is out), "done", "failed"; "": not warmed
    cold_start_s: float | None = None  # its warm-up's time to first token
    warmup_error: str = ""
    latency: ev.LatencySample | None = None  # its latency panel, as last told

    @property
    def warn_at(self) -> tuple[float, ...]:
        return self.stall.warn_at if self.stall is not None else ()

    @property
    def by_bytes(self) -> bool:
        return self.stall is not None and self.stall.liveness == "bytes"


"""The first URL in the gateway's RunNotice: where it serves (the header shows it)."""


@dataclass(eq=False)
class ProbeView:
    """The last probe of one endpoint: running, done (with its result), failed or cancelled."""

    endpoint: str
    max_concurrency: int
    agents: int = 0
    state: str = "running"  # running | done | failed | cancelled
    line: str = ""
    levels: list[ev.ProbeLevelSummary] = field(default_factory=list)
    result: ev.ProbeSummary | None = None
    error: str = ""


@dataclass(eq=False)
class RunMirror(UiModel):
    """Everything the console shows of a run, from its events alone."""

    HANDLERS: ClassVar[tuple[str, ...]] = ("_on_", "_see_")

    agents: dict[str, AgentView] = field(default_factory=dict)
    endpoints: dict[str, EndpointView] = field(default_factory=dict)
    waves: list[list[str]] = field(default_factory=list)
    wave: int = -1  # the current wave (-1: none started yet)
    effective_cap: int = 0  # what may run at once now
    paused: bool = False
    stopping: str = ""  # why the run is stopping ("" while it is not)
    probes: dict[str, ProbeView] = field(default_factory=dict)
    plan_version: int = 0  # bumped when the run's agents are (re)announced: the agents pane is built again
    run_cost_usd: float = 0.0  # what the run's requests cost so far on priced endpoints
    inbox: Inbox = field(default_factory=Inbox)  # the agents that need the operator now
    _operator_kills: set[str] = field(default_factory=set)  # killed by an operator: no news to the inbox
    samples: dict[str, ev.ServerSample] = field(default_factory=dict)  # each endpoint's last, workers and all
    gpus: ev.GpuSample | None = None  # the run's box's GPUs, as last read; None: none read yet
    gateway: str = ""  # the run serves a gateway: its RunNotice's text (where it serves, what it routes)
    gateway_url: str = ""  # where it serves (GatewayServing); "" until it is told
    serves_gateway: bool = False  # GatewayServing, the gateway's notice or a session has come
    events_not_taken: int = 0  # events a handler failed on (RunMirror._not_taken): the first is shown as a notice

    def __call__(self, event: ev.Event) -> None:
        try:
            if event.kind == "TokenDelta":
                if event.tokens:  # type: ignore[attr-defined]
                    a = self.agents.get(event.agent)  # type: ignore[attr-defined]
                    if a is not None:
                        a.tokens += event.tokens  # type: ignore[attr-defined]
                        att = a.attempt
                        if att is not None and a.in_flight and att.number != event.attempt:  # type: ignore[attr-defined]
                            att = a.in_flight.get(event.attempt)  # type: ignore[attr-defined]
                        if att is not None:
                            att.tokens += event.tokens  # type: ignore[attr-defined]
                            att.last_alive = event.t
            UiModel.__call__(self, event)  # its handlers, then this class's (HANDLERS)
        except Exception as exc:  # one event it cannot take never stops the console from following the run
            self._not_taken(event, exc)

    def _not_taken(self, event: ev.Event, exc: Exception) -> None:
        """An event a handler failed on: counted, and the first said as a notice; the picture goes on without it."""
        self.events_not_taken += 1
        if self.events_not_taken == 1:
            self.notices.append(Notice(
                f"The console could not take a {event.kind} event ({type(exc).__name__}: {exc}); it goes on with "
                "the run's other events, and what this one said may be missing from the screen. The run itself is "
                "not affected; its journal and report are written by the run.", "warning", "Console"))

    def feed_records(self, records: Iterable[dict[str, Any]]) -> int:
        """Feed events in their JSON form (events.jsonl lines, parsed); returns how many were not events."""
        skipped = 0
        for record in records:
            try:
                event = ev.event_of(record)
            except ev.EventError:
                skipped += 1
            else:
                self(event)
        return skipped

    # ---- what widgets ask -----------------------------------------------------------------------------
    @property
    def stopping_or_finished(self) -> bool:
        return bool(self.stopping) or self.finished is not None

    def running_on(self, endpoint: str) -> int:
        """Our agents holding a running slot on `endpoint`."""
        return sum(1 for a in self.agents.values() if a.endpoint == endpoint and a.status in ACTIVE)

    def cap_warning(self) -> str:
        """The first endpoint's warning that the cap is past what fits in its KV memory ("" when none is)."""
        return next((ep.load.warning for ep in self.endpoints.values() if ep.load and ep.load.warning), "")

    def fit_below_cap(self) -> int | None:
        """The fewest conversations that fit on an endpoint whose cap is past them (the header's marker)."""
        fits = [ep.load.estimate.conversations_fit for ep in self.endpoints.values()
                if ep.load is not None and ep.load.warning and ep.load.estimate]
        return min(fits) if fits else None

    @property
    def sessions(self) -> list[AgentView]:
        """The gateway's sessions, in the order they came."""
        return [a for a in self.agents.values() if a.session is not None]

    @property
    def workflow_agents(self) -> list[AgentView]:
        """The run's own agents (its workflow's), without the gateway's sessions."""
        return [a for a in self.agents.values() if a.session is None]

    def endpoint_of(self, agent: str | None) -> str | None:
        a = self.agents.get(agent) if agent is not None else None
        return a.endpoint if a is not None else None

    # ---- the run ----------------------------------------------------------------------------------------
    def _see_RunStarted(self, e: ev.RunStarted) -> None:
        self.finished = None  # a resumed run goes on in the same journal
        self.stopping = ""
        self.notes.clear()  # an earlier run's notes ("cancelled: run stopped") are not this run's
        self.inbox.reset()
        self.wave = -1
        self.waves = [list(level) for level in e.waves]
        self.paused = e.paused
        self.effective_cap = e.effective_cap or (1 if e.mode == "sequential" else e.max_concurrency)
        if e.auto_ceiling:
            self.auto_ceiling = e.auto_ceiling
        self.endpoints = {}
        for summary in e.endpoints:
            self.endpoints[summary.name] = EndpointView(
                summary.name, summary.kind, summary.base_url or "", summary.model, summary.max_concurrency,
                summary.stall, priced=summary.priced)
        reused = set(e.reused)
        # a session the gateway opened before the run said who runs goes on; one of an earlier run has ended
        sessions = {name: a for name, a in self.agents.items() if a.session is not None and a.status not in FINAL}
        self.agents = {}
        for wave, level in enumerate(e.waves):
            for name in level:
                plan = e.agents.get(name)
                self.agents[name] = AgentView(name, plan.endpoint if plan else "", plan.wave if plan else wave,
                                              plan.turns if plan else 1, reused=name in reused)
        self.agents.update(sessions)
        self.plan_version += 1

    def _see_WaveStarted(self, e: ev.WaveStarted) -> None:
        self.wave = e.wave

    def _see_RunStopping(self, e: ev.RunStopping) -> None:
        self.stopping = e.reason

    def _see_RunNotice(self, e: ev.RunNotice) -> None:
        self.notices.append(Notice(e.message, e.severity, e.title))
        if e.title == "Gateway":
            self.serves_gateway, self.gateway = True, e.message

    def _see_GatewayServing(self, e: ev.GatewayServing) -> None:
        self.serves_gateway, self.gateway_url = True, e.url

    def _see_ModeChanged(self, e: ev.ModeChanged) -> None:
        self.effective_cap = e.effective_cap

    def _see_ConcurrencyChanged(self, e: ev.ConcurrencyChanged) -> None:
        self.paused = e.paused
        if e.total_cap:
            self.effective_cap = e.total_cap
        elif not e.endpoint:
            self.effective_cap = e.effective_cap

    # ---- agents -----------------------------------------------------------------------------------------
    def _agent(self, name: str) -> AgentView:
        found = self.agents.get(name)
        if found is None:  # a journal from before RunStarted said who runs: learn it as it comes
            found = self.agents[name] = AgentView(name, "", 0, 1)
            self.plan_version += 1
        return found

    def _see_SessionOpened(self, e: ev.SessionOpened) -> None:
        a = self._agent(e.agent)
        if a.session is None:
            self.plan_version += 1  # a new row (under the workflow's agents)
        a.session, a.endpoint, a.turns = e, e.endpoint, 0
        self.serves_gateway = True

    def _see_AgentStatus(self, e: ev.AgentStatus) -> None:
        a = self._agent(e.agent)
        if a.status == "stalling" and e.status != "stalling":
            self.inbox.clear(e.agent, "stall")  # life again, or an end that says more
        a.status = e.status

    def _see_AgentQueued(self, e: ev.AgentQueued) -> None:
        a = self._agent(e.agent)
        if a.session is not None:  # its next request waits for a slot; its requests so far stay counted
            a.queued_at = e.t
            return
        a.error, a.turn, a.attempt = "", 0, None  # (again, when the operator reruns it)
        a.queued_since = e.t
        self.inbox.clear(e.agent)
        self._operator_kills.discard(e.agent)

    def _see_AgentStarted(self, e: ev.AgentStarted) -> None:
        a = self._agent(e.agent)
        a.endpoint, a.turn, a.turns = e.endpoint, e.turn, e.turns
        a.attempts += 1
        a.tool = a.approval = None
        self.inbox.clear(e.agent, "killed", "failed", "stall", "approval")
        if a.started_at is None:
            a.started_at = e.t
        ep = self.endpoints.get(e.endpoint)
        att = AttemptView(e.attempt, e.turn, e.t, e.first_byte_deadline_s, e.idle_deadline_s, e.t,
                          ep.by_bytes if ep is not None else False)
        if a.session is None:
            a.attempt = att
            return
        a.queued_at, a.killed_request = None, None
        a.in_flight[e.attempt] = att
        if len(a.in_flight) == 1:  # the row describes its oldest request in flight (the main turn, not a side one)
            a.attempt, a.queued_s, a.model_asked, a.model_sent = att, e.queued_s, e.model_asked, e.model_sent

    def _see_PrefillProgress(self, e: ev.PrefillProgress) -> None:
        att = self._agent(e.agent).attempt_of(e.attempt)
        if att is not None and att.first_token_at is None:
            att.prefill = e

    def _see_EndpointWaiting(self, e: ev.EndpointWaiting) -> None:
        self.inbox.open(e.agent, "endpoint", f"{e.endpoint}: {e.reason}", e.t)

    def _see_FirstToken(self, e: ev.FirstToken) -> None:
        a = self._agent(e.agent)
        self.inbox.clear(e.agent, "endpoint", "stall", "wedged")
        if a.ttft_s is None and e.streamed:
            a.ttft_s = e.ttft_s
        att = a.attempt_of(e.attempt)
        if att is not None:
            att.first_token_at = att.last_alive = e.t

    def _see_KeepAlive(self, e: ev.KeepAlive) -> None:
        att = self._agent(e.agent).attempt_of(e.attempt)
        if att is not None and att.by_bytes:
            att.last_alive = e.t

    def _see_TurnFinished(self, e: ev.TurnFinished) -> None:
        a = self._agent(e.agent)
        a.turn, a.turns = e.turn, e.turns
        a.completion_tokens += e.completion_tokens
        if e.ttft_s is not None:
            a.decode_s += max(0.0, e.duration_s - e.ttft_s)
            a.decoded_tokens += e.completion_tokens
            if a.ttft_s is None:
                a.ttft_s = e.ttft_s
        att = a.attempt_of(e.attempt)
        if att is None or not att.tokens:  # its tokens never came as deltas (a journal): the count
            a.tokens += e.completion_tokens
        a.end_attempt(e.attempt)

    def _see_StallWarning(self, e: ev.StallWarning) -> None:
        a = self._agent(e.agent)
        a.stall_warnings += 1
        att = a.attempt_of(e.attempt)
        if att is not None:
            att.deadline_is(e.deadline_at)
        ep = self.endpoints.get(a.endpoint)
        warn_at = ep.warn_at if ep is not None else ()
        if not warn_at or e.fraction >= warn_at[-1]:  # past its last warning: killed next, unless someone acts
            what = "first token" if e.deadline == "first_byte" else "output"
            self.inbox.open(e.agent, "stall", f"no {what} for {e.fraction:.0%} of its deadline, "
                            f"{e.remaining_s:.0f} s left", e.t)

    def _see_StallExtended(self, e: ev.StallExtended) -> None:
        a = self._agent(e.agent)
        if e.deadline == "tool":  # the operator moved a running tool call's deadline, not the model's
            if a.tool is not None:
                a.tool = msgspec.structs.replace(a.tool, deadline=e.deadline_at)
            self.inbox.clear(e.agent, "stall")
            return
        att = a.attempt_of(e.attempt)
        if att is not None:
            att.deadline_is(e.deadline_at)
        self.inbox.clear(e.agent, "stall")

    def _see_AgentKilled(self, e: ev.AgentKilled) -> None:
        a = self._agent(e.agent)
        att = a.attempt_of(e.attempt)
        if att is None or not att.tokens:
            a.tokens += e.tokens
        if a.session is not None:  # the request ends; the session goes on (its harness decides what follows)
            a.killed_request = (att.turn if att is not None else a.turn, e.reason)
        a.end_attempt(e.attempt)
        self.inbox.clear(e.agent, "stall", "endpoint", "approval")  # what follows (a retry, its end) says more
        if e.deadline == "operator":
            self._operator_kills.add(e.agent)

    def _see_AgentRetrying(self, e: ev.AgentRetrying) -> None:
        a = self._agent(e.agent)
        a.attempt = None
        self.inbox.clear(e.agent, "stall", "approval")

    def _see_AgentFinished(self, e: ev.AgentFinished) -> None:
        a = self._agent(e.agent)  # its status came as AgentStatus; an older journal says it here alone
        a.status, a.error, a.attempt, a.finished_at = e.status, e.error, None, e.t
        a.tool = a.approval = None
        a.in_flight.clear()
        if e.status in ("killed", "failed") and not (e.status == "killed" and e.agent in self._operator_kills):
            self.inbox.open(e.agent, e.status, e.error or e.status, e.t)
        else:
            self.inbox.clear(e.agent)

    # ---- tool calls and approvals -------------------------------------------------------------------------
    def _see_ToolCallStarted(self, e: ev.ToolCallStarted) -> None:
        a = self._agent(e.agent)
        a.tool, a.approval = e, None
        self.inbox.clear(e.agent, "approval", "stall", "endpoint")
        arguments = e.arguments if len(e.arguments) <= TOOL_ARGUMENTS_SHOWN else e.arguments[:TOOL_ARGUMENTS_SHOWN] + "…"
        self.stream(e.agent).append(TOOL, f"\n⚙ {e.server}.{e.tool} {arguments}\n")

    def _see_ToolCallWarning(self, e: ev.ToolCallWarning) -> None:
        a = self._agent(e.agent)
        call = a.tool
        if call is None or call.call_id != e.call_id:
            return
        if not call.warn_at or e.fraction >= call.warn_at[-1]:
            self.inbox.open(e.agent, "stall", f"tool {call.server}.{call.tool}: {e.remaining_s:.0f} s to its "
                            "tool deadline", e.t)

    def _see_ToolCallFinished(self, e: ev.ToolCallFinished) -> None:
        a = self._agent(e.agent)
        if a.tool is not None and a.tool.call_id == e.call_id:
            a.tool = None
        self.inbox.clear(e.agent, "stall")
        result = f": {e.result}" if e.result else ""
        self.stream(e.agent).append(META if e.outcome == "ok" else ALERT,
                                    f"  ↳ {e.outcome} in {e.elapsed_s:.1f} s{result}\n")

    def _see_ApprovalRequested(self, e: ev.ApprovalRequested) -> None:
        a = self._agent(e.agent)
        a.approval = e
        arguments = e.arguments if len(e.arguments) <= TOOL_ARGUMENTS_SHOWN else e.arguments[:TOOL_ARGUMENTS_SHOWN] + "…"
        self.inbox.open(e.agent, "approval", f"{e.server}.{e.tool} {arguments}", e.t)
        self.stream(e.agent).append(ALERT, f"\n? {e.server}.{e.tool} needs approval: {arguments}\n")

    def _see_ApprovalDecided(self, e: ev.ApprovalDecided) -> None:
        a = self._agent(e.agent)
        if a.approval is not None and a.approval.call_id == e.call_id:
            a.approval = None
            self.inbox.clear(e.agent, "approval")
        what = {"once": "approved once", "run": "approved for the run", "deny": "denied"}[e.decision]
        self.stream(e.agent).append(META if e.decision != "deny" else ALERT,
                                    f"  {e.server}.{e.tool} {what} by {e.by}\n")

    # ---- pools and meters -------------------------------------------------------------------------------
    def _see_AgentPlaced(self, e: ev.AgentPlaced) -> None:
        a = self._agent(e.agent)
        a.endpoint, a.pool = e.endpoint, e.pool
        if e.moved_from:
            a.moved_from = e.moved_from
            self.notices.append(Notice(f"{e.agent}: {e.reason}", "warning", "Agent moved"))
            self.stream(e.agent).append(ALERT, f"\n↪ {e.reason}\n")  # its transcript says where it went on

    def _see_AgentMeters(self, e: ev.AgentMeters) -> None:
        a = self._agent(e.agent)
        a.prompt_tokens += e.prompt_tokens
        if e.cached_tokens is not None:
            a.cached_tokens = (a.cached_tokens or 0) + e.cached_tokens
        a.context_tokens, a.max_model_len, a.cost_usd = e.context_tokens, e.max_model_len, e.cost_usd
        a.meter_warning = e.warning
        self.run_cost_usd = e.run_cost_usd

    def meter_note(self, agent: str) -> str:
        """The agent's placement and meters in one line, for its row when nothing else is noted (AgentView.meter_note)."""
        a = self.agents.get(agent)
        if a is None:
            return ""
        ep = self.endpoints.get(a.endpoint)
        return a.meter_note(priced=ep is not None and ep.priced)

    def queue_positions(self) -> dict[str, int]:
        """Each workflow agent waiting for a running slot: its place in our queue for its endpoint (1: next), in
        the order they were queued (the scheduler's FIFO)."""
        waiting: dict[str, list[tuple[float, str]]] = {}
        for name, a in self.agents.items():
            if a.status == "queued" and a.session is None and a.queued_since is not None:
                waiting.setdefault(a.endpoint, []).append((a.queued_since, name))
        return {name: i for queue in waiting.values() for i, (_, name) in enumerate(sorted(queue), 1)}

    # ---- endpoints --------------------------------------------------------------------------------------
    def _endpoint(self, name: str) -> EndpointView:
        found = self.endpoints.get(name)
        if found is None:
            found = self.endpoints[name] = EndpointView(name)
        return found

    def _see_ModelResolved(self, e: ev.ModelResolved) -> None:
        self._endpoint(e.endpoint).model = e.model

    def _see_StallPolicyChanged(self, e: ev.StallPolicyChanged) -> None:
        ep = self._endpoint(e.endpoint)
        ep.stall = e.policy
        for a in self.agents.values():
            att = a.attempt
            if att is not None and a.endpoint == e.endpoint:
                # the watchdog measures the running attempt against the new windows from now on
                att.first_byte_s, att.idle_s = e.policy.first_byte_timeout_s, e.policy.idle_timeout_s
                att.by_bytes = ep.by_bytes

    def _see_WarmupStarted(self, e: ev.WarmupStarted) -> None:
        for name in e.endpoints:
            self._endpoint(name).warmup = "warming"

    def _see_EndpointWarmed(self, e: ev.EndpointWarmed) -> None:
        ep = self._endpoint(e.endpoint)
        ep.warmup = "done" if e.cold_start_s is not None else "failed"
        ep.cold_start_s, ep.warmup_error = e.cold_start_s, e.error

    def _see_LatencySample(self, e: ev.LatencySample) -> None:
        self._endpoint(e.endpoint).latency = e

    def _see_LoadChanged(self, e: ev.LoadChanged) -> None:
        self._endpoint(e.endpoint).load = e

    def _endpoint_health(self, e: ev.ServerSample) -> None:
        """An endpoint that says it is down puts its running agents in the inbox; up again takes them out."""
        if e.healthy is False:
            for a in self.agents.values():
                if a.endpoint == e.endpoint and a.status in ACTIVE and a.status not in ("tool", "approval"):
                    self.inbox.open(a.name, "endpoint", f"{e.endpoint} down" + (f": {e.detail}" if e.detail else ""),
                                    e.t)
        elif e.healthy and any(item.kind == "endpoint" for item in self.inbox.items.values()):
            for a in self.agents.values():
                if a.endpoint == e.endpoint:
                    self.inbox.clear(a.name, "endpoint")

    def _see_ServerSample(self, e: ev.ServerSample) -> None:
        self.samples[e.endpoint] = e
        self._endpoint_health(e)

    def _see_ServerWedged(self, e: ev.ServerWedged) -> None:
        """A wedged server puts the agents it killed in the inbox, with why; moving again takes them out."""
        if not e.over:
            for name in e.agents:
                self.inbox.open(name, "wedged", f"{e.endpoint}: {e.reason}", e.t)
        elif any(item.kind == "wedged" for item in self.inbox.items.values()):
            for a in self.agents.values():
                if a.endpoint == e.endpoint:
                    self.inbox.clear(a.name, "wedged")

    def _see_GpuSample(self, e: ev.GpuSample) -> None:
        self.gpus = e

    # ---- probes -----------------------------------------------------------------------------------------
    def _see_ProbeStarted(self, e: ev.ProbeStarted) -> None:
        self.probes[e.endpoint] = ProbeView(e.endpoint, e.max_concurrency, e.agents)

    def _see_ProbeProgress(self, e: ev.ProbeProgress) -> None:
        probe = self.probes.get(e.endpoint)
        if probe is None:
            return
        if e.line:
            probe.line = e.line
        if e.level is not None:
            probe.levels.append(e.level)

    def _see_ProbeFinished(self, e: ev.ProbeFinished) -> None:
        probe = self.probes.get(e.endpoint)
        if probe is None:
            probe = self.probes[e.endpoint] = ProbeView(e.endpoint, 0)
        if e.result is not None:
            probe.state, probe.result = "done", e.result
            probe.levels = list(e.result.levels or probe.levels)
        elif e.cancelled:
            probe.state = "cancelled"
        else:
            probe.state, probe.error = "failed", e.error
