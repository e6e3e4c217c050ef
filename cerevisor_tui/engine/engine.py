"""The engine: runs a workflow's waves through the scheduler, streams each agent's turns, and watches
every attempt with two deadlines. Everything it does is told as events; commands change it live.

The engine owns no clock but `time.monotonic()` and no UI: a console, a headless printer, a journal
and a report all subscribe to the same events.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import secrets
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from cerevisor_tui.config.graph import OUTPUT_REF, wave_levels
from cerevisor_tui.config.models import AgentConfig, Config, EndpointConfig, ResolvedStall, resolve_stall
from cerevisor_tui.config.secrets import Scrubber, StreamScrubber, key_problem
from cerevisor_tui.endpoints.client import (
    DELTA,
    KEEPALIVE,
    ChatStream,
    build_client,
    list_models,
)
from cerevisor_tui.endpoints.errors import EndpointError, EndpointUnreachable, MissingApiKey
from cerevisor_tui.endpoints.metrics import MetricsSnapshot, ServerStatus, prefix_hit_rate, read_server
from cerevisor_tui.engine import events as ev
from cerevisor_tui.engine import load
from cerevisor_tui.engine.auto import AutoController, Change, Signals
from cerevisor_tui.engine.report import Report
from cerevisor_tui.engine.scheduler import MODES, Scheduler

if TYPE_CHECKING:
    from cerevisor_tui.endpoints.worker import RemoteStream, StreamWorker

Subscriber = Callable[[ev.Event], None]
BusyCheck = Callable[[str], Awaitable[str | None]]

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
RETRY_AFTER_CAP_S = 60.0
WAIT_BACKOFF_CAP_S = 5.0
FINAL = ev.FINAL
_TOKEN_DELTA_FIELDS = ("t", "agent", "attempt", "text", "reasoning", "tool", "tokens")  # what _stream fills in directly


def fmt_s(seconds: float) -> str:
    """Seconds as the operator reads them: 1800 s, 2.5 s, 0.25 s."""
    if seconds >= 10:
        return f"{seconds:.0f} s"
    return f"{seconds:.3g} s"


def new_run_id() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def request_id(run_id: str, agent: str, turn: int, attempt: int) -> str:
    """The id an attempt's request carries to the server (X-Request-Id): the run, the agent, turn and attempt."""
    return f"{run_id}.{agent}.t{turn}.a{attempt}"


@dataclass(eq=False)
class Attempt:
    """One streamed request of one turn, with its stall clock."""

    number: int
    turn: int
    sent_at: float
    last_alive: float = 0.0
    first_token_at: float | None = None
    tokens: int = 0
    phase: str = "first_byte"
    deadline_at: float = math.inf
    base: float = 0.0
    extra_s: float = 0.0
    extensions: int = 0
    warned: int = 0
    kill_reason: str = ""
    kill_deadline: str = ""
    by_operator: bool = False
    restart: bool = False
    stream: ChatStream | RemoteStream | None = None
    scope: anyio.CancelScope | None = None
    nap: anyio.CancelScope | None = None  # the watchdog's sleep: cancelled to make it look again at once
    # set at the first sign of life: the watchdog, asleep on the long first-byte deadline, moves to idle
    alive: anyio.Event = field(default_factory=anyio.Event)

    def kill(self, deadline: str, reason: str, *, by_operator: bool = False, restart: bool = False) -> None:
        if self.kill_reason:
            return
        self.kill_deadline, self.kill_reason = deadline, reason
        self.by_operator, self.restart = by_operator, restart
        if self.scope is not None:
            self.scope.cancel()


@dataclass(eq=False)
class AgentState:
    """What the engine knows of one agent now; read by the console, written only by the engine."""

    config: AgentConfig
    endpoint: str
    wave: int
    status: str = "pending"
    turn: int = 0
    attempts: int = 0  # requests sent, over all turns
    turn_attempts: dict[int, int] = field(default_factory=dict)  # turn -> its attempts so far (1: no retry yet)
    retries_used: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    decode_s: float = 0.0
    stall_warnings: int = 0
    error: str = ""
    output: str = ""
    current: Attempt | None = None
    scope: anyio.CancelScope | None = None
    end_status: str = ""
    end_reason: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    turns_done: int = 0
    last_prompt_tokens: int = 0  # what the server counted for the last completed turn
    last_completion_tokens: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def turns(self) -> int:
        return 1 + len(self.config.turns)

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else None


class _AttemptFailed(Exception):
    def __init__(self, status: str, reason: str, *, retryable: bool, retry_after_s: float | None = None,
                 restart: bool = False) -> None:
        super().__init__(reason)
        self.status, self.reason, self.retryable = status, reason, retryable
        self.retry_after_s, self.restart = retry_after_s, restart


class _AgentEnded(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class Engine:
    """Run one workflow. Subscribe before `run()`; call commands from the same event loop at any time."""

    def __init__(self, config: Config, *, run_id: str | None = None, run_dir: str = "",
                 completed: dict[str, str] | None = None, history: list[dict[str, Any]] | None = None,
                 stream_process: bool = False) -> None:
        self.config = config
        # the agents' streams read by a worker process (endpoints/worker.py) rather than in this loop
        self.stream_process = stream_process
        self.stream_process_problem = ""  # why the worker could not start, if it could not
        self.run_id = run_id or new_run_id()
        self.run_dir = run_dir
        self.waves = wave_levels(config.agents)
        self.agents: dict[str, AgentState] = {}
        for wave, level in enumerate(self.waves):
            for agent in level:
                self.agents[agent.name] = AgentState(agent, config.agent_endpoint(agent).name, wave)
        self.endpoints = {ep.name: ep for ep in config.endpoints}
        self.policies: dict[str, ResolvedStall] = {
            ep.name: resolve_stall(config.stall, ep) for ep in config.endpoints
        }
        self.scheduler = Scheduler(
            config.run.mode, config.run.max_concurrency, {ep.name: ep.max_concurrency for ep in config.endpoints}
        )
        # auto mode: a controller per endpoint (engine/auto.py) and what it is fed
        auto = config.run.auto
        self.auto: dict[str, AutoController] = {}
        for ep in config.endpoints:
            start, why = (auto.start_cap, "[run.auto] start_cap") if auto.start_cap else _saved_probe_cap(ep)
            self.auto[ep.name] = AutoController(min_cap=auto.min_cap, max_cap=auto.max_cap or ep.max_concurrency,
                                                start_cap=start, start_why=why, kv_target=auto.kv_target)
            self.scheduler.auto_caps[ep.name] = self.auto[ep.name].cap
        self.auto_ceiling = max((c.max_cap for c in self.auto.values()), default=1)
        self._agents_on: dict[str, list[AgentState]] = {ep.name: [] for ep in config.endpoints}
        for st in self.agents.values():
            self._agents_on.setdefault(st.endpoint, []).append(st)
        self._rejections: dict[str, int] = {ep.name: 0 for ep in config.endpoints}  # 429/503 answers
        self._ttfts: dict[str, deque[float]] = {ep.name: deque(maxlen=16) for ep in config.endpoints}
        # tokens per character, as the server counts them: [prompt tokens, characters sent]
        self._token_ratio: dict[str, list[float]] = {ep.name: [0.0, 0.0] for ep in config.endpoints}
        self._turn_tokens: dict[str, list[float]] = {ep.name: [0.0, 0.0] for ep in config.endpoints}
        self.last_sample: dict[str, ev.ServerSample] = {}
        self._samples: dict[str, int] = {ep.name: 0 for ep in config.endpoints}
        self.base_urls: dict[str, str] = {ep.name: ep.base_url for ep in config.endpoints}
        self.models: dict[str, str] = {ep.name: ep.model for ep in config.endpoints if ep.model}
        self.busy_check: BusyCheck | None = None
        # KV load per endpoint: the configured estimate, replaced by the server's own capacity when it reports one
        self.load: dict[str, load.LoadEstimate | None] = {}
        self.load_notes: dict[str, str] = {}
        for ep in config.endpoints:
            self.load[ep.name], self.load_notes[ep.name] = load.from_config(ep)
        self.server_status: dict[str, ServerStatus] = {}
        self.server_status_at: dict[str, float] = {}
        self._load_sent: dict[str, ev.LoadChanged] = {}  # the last LoadChanged of each endpoint
        self._background: anyio.abc.TaskGroup | None = None  # the run's long-lived tasks (monitors, probes)
        self._probes: dict[str, anyio.CancelScope] = {}  # endpoint -> its running probe
        self.wave = -1
        self.started_at = 0.0
        self.stopping = ""
        self.ended = False  # the run has sent its RunFinished: nothing more happens, nothing more is told
        # Agents a resumed run already completed: their answers are reused, they are never sent again, unless
        # what they would run with now (prompt, endpoint, ...) is not what they ran with: then they and every
        # agent downstream of them run again, each with its reason (an AgentRerun at the start of the run).
        self.completed_before = dict(completed or {})
        self.recorded_inputs: dict[str, dict[str, str]] = {
            e["agent"]: e["inputs"] for e in history or () if e.get("event") == "AgentFinished"
            and isinstance(e.get("agent"), str) and isinstance(e.get("inputs"), dict)}
        self.rerun = self._plan_resume()
        for name in self.rerun:
            del self.completed_before[name]
        # the reused agents' recorded events: their figures carry into the report
        self._history = [e for e in history or () if e.get("agent") not in self.rerun]
        self.report = Report()
        self._subscribers: list[Subscriber] = [self.report]
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._worker: StreamWorker | None = None
        self._model_locks: dict[str, anyio.Lock] = {}
        self._requeue: list[AgentState] = []
        self._wave_group: anyio.abc.TaskGroup | None = None
        self._rng = random.Random()
        # every form of the run's API keys, taken out of whatever text enters the run (config/secrets.py)
        self.scrub = Scrubber.from_env(ep.api_key_env for ep in config.endpoints)

    @property
    def stream_worker(self) -> StreamWorker | None:
        """The process reading the agents' streams while a run is going with `stream_process` on."""
        return self._worker

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, event: ev.Event) -> None:
        if self.scrub:  # no key configured: nothing to look for
            event = self.scrub.record(event)
        for subscriber in self._subscribers:
            subscriber(event)

    # ---- commands (live) ----------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        """Switch sequential/parallel/auto now; running agents are never stopped by it."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        entering_auto = mode == "auto" and self.scheduler.mode != "auto"
        self.scheduler.set_mode(mode)
        self.emit(ev.ModeChanged(time.monotonic(), mode, self.scheduler.effective_cap, self._mode_note(mode)))
        if entering_auto and self.started_at:
            for name, ctl in self.auto.items():
                self._apply_auto(name, ctl.resume())
        self._refresh_load()

    def cycle_mode(self) -> str:
        mode = MODES[(MODES.index(self.scheduler.mode) + 1) % len(MODES)]
        self.set_mode(mode)
        return mode

    def set_concurrency(self, cap: int) -> None:
        """Move the parallel cap; lowering it only holds admissions until fewer are running."""
        self.scheduler.set_cap(cap)
        self._emit_cap()

    def set_auto_ceiling(self, ceiling: int) -> None:
        """Auto mode's ceiling: no endpoint's live cap goes above it (nor above the endpoint's own max_cap)."""
        self.auto_ceiling = max(1, int(ceiling))
        for name, ctl in self.auto.items():
            change = ctl.set_ceiling(self.auto_ceiling)
            if change is not None:
                self._apply_auto(name, change)
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, s.effective_cap, s.paused,
                                        reason=f"auto ceiling {self.auto_ceiling} (operator)",
                                        ceiling=self.auto_ceiling, total_cap=s.effective_cap))
        self._refresh_load()

    def nudge_cap(self, delta: int) -> int:
        """`+`/`-`: the parallel cap, or in auto mode the ceiling the controllers stay under; returns the new one."""
        if self.scheduler.mode == "auto":
            self.set_auto_ceiling(self.auto_ceiling + delta)
            return self.auto_ceiling
        self.set_concurrency(self.scheduler.max_concurrency + delta)
        return self.scheduler.max_concurrency

    def pause(self) -> None:
        self.scheduler.set_paused(True)
        self._emit_cap()

    def resume(self) -> None:
        self.scheduler.set_paused(False)
        self._emit_cap()

    def kill(self, name: str, reason: str = "killed by operator") -> bool:
        """Kill an agent's running attempt (no retry follows), or drop it from the queue."""
        st = self.agents[name]
        if st.status in FINAL:
            return False
        if st.current is not None and st.current.scope is not None:
            st.current.kill("operator", reason, by_operator=True)
        elif st.scope is not None:
            st.end_status, st.end_reason = "killed", reason
            st.scope.cancel()
        else:
            return False
        return True

    def extend(self, name: str, seconds: float | None = None) -> bool:
        """Move the running attempt's current deadline later by `seconds` (default [stall].extend_s)."""
        st = self.agents[name]
        att = st.current
        if att is None or st.status in FINAL:
            return False
        seconds = seconds if seconds is not None else self.policies[st.endpoint].extend_s
        att.extra_s += seconds
        att.deadline_at += seconds
        # re-arm only the warnings still ahead of the new deadline
        total = att.deadline_at - att.base
        now = time.monotonic()
        att.warned = sum(1 for f in self.policies[st.endpoint].warn_at if att.base + f * total <= now)
        self.emit(ev.StallExtended(time.monotonic(), name, att.number, att.phase, seconds, "extended by operator",
                                   att.deadline_at, att.extensions, by_operator=True))
        if st.status == "stalling":
            st.status = "streaming" if att.first_token_at is not None else "prefill"
        return True

    def set_stall(self, config: Config) -> list[str]:
        """Take `config`'s `[stall]` and endpoint stall overrides now: new attempts get them, and the running
        ones' deadlines are measured against them from now on (a raised first-byte timeout saves an agent
        that is already waiting; a lowered one can end it at once; extensions already given stand). Returns
        the endpoints whose policy changed."""
        changed = []
        for name, ep in self.endpoints.items():
            new_ep = next((e for e in config.endpoints if e.name == name), ep)
            if self.set_stall_policy(name, resolve_stall(config.stall, new_ep)):
                changed.append(name)
        return changed

    def set_stall_policy(self, endpoint: str, policy: ResolvedStall) -> bool:
        """One endpoint's stall policy, now (see `set_stall`); returns whether it changed."""
        if policy == self.policies[endpoint]:
            return False
        self.policies[endpoint] = policy
        self.emit(ev.StallPolicyChanged(time.monotonic(), endpoint, policy.model_dump()))
        for st in self._agents_on.get(endpoint, ()):
            att = st.current
            if att is not None and att.nap is not None:
                att.nap.cancel()  # the watchdog recomputes the deadline under the new policy now
        return True

    def retry(self, name: str) -> str:
        """Restart a running agent's attempt now, or run a failed/killed agent of the current wave again."""
        st = self.agents[name]
        if st.current is not None and st.status not in FINAL:
            st.current.kill("operator", "restarted by operator", by_operator=True, restart=True)
            return "restarting"
        if st.status in ("failed", "killed") and st.wave == self.wave and self._wave_group is not None:
            self._reset(st)
            self._wave_group.start_soon(self._run_agent, st)
            return "queued again"
        if st.status in ("failed", "killed"):
            return "its wave has ended; use --resume to run it again"
        return f"nothing to retry ({st.status})"

    def stop(self, reason: str = "run stopped") -> None:
        """Stop the run: no more admissions; running and queued agents are cancelled, connections closed."""
        if self.stopping or self.ended:
            return
        self.stopping = reason
        self.scheduler.set_paused(True)
        self.emit(ev.RunStopping(time.monotonic(), reason))
        for st in self.agents.values():
            if st.status not in FINAL and st.scope is not None:
                st.end_status, st.end_reason = "cancelled", reason
                if st.current is not None:
                    st.current.kill("operator", reason, by_operator=True)
                st.scope.cancel()

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> int:
        """Run every wave; returns the exit code (0 all completed, 1 some failed or were killed)."""
        self.started_at = time.monotonic()
        async with AsyncExitStack() as stack:
            await self._open_endpoints(stack)
            self.emit(self.started_event(time.monotonic()))
            if self.stream_process_problem:
                self.emit(ev.RunNotice(time.monotonic(), f"{self.stream_process_problem}. Reading the streams in "
                                       "this process instead.", "warning", "Stream worker"))
            self._refresh_load()
            if self._history:
                self.report.replay(self._history)
            for name, why in self.rerun.items():
                self.emit(ev.AgentRerun(time.monotonic(), name, why))
            if self.scheduler.mode == "auto":
                for name, ctl in self.auto.items():
                    self._apply_auto(name, Change(ctl.cap, ctl.start_reason))
            async with anyio.create_task_group() as background:
                self._background = background
                await self._start_background(background)
                for wave, level in enumerate(self.waves):
                    if self.stopping:
                        self._cancel_rest(wave)
                        break
                    await self._run_wave(wave, [self.agents[a.name] for a in level])
                background.cancel_scope.cancel()
            self._background = None
        code = 0 if all(st.status in ("completed",) for st in self.agents.values()) else 1
        if self.stopping:
            code = 1
        end = time.monotonic()
        self.report.finish(end)
        self.ended = True
        self.emit(ev.RunFinished(end, self.run_id, code, self.report.totals()))
        return code

    def started_event(self, t: float) -> ev.RunStarted:
        """The run's RunStarted: its plan (waves, agents, endpoints) and settings, as a console first sees it."""
        return ev.RunStarted(
            t, self.run_id, self.scheduler.mode, self.scheduler.max_concurrency,
            [[a.name for a in level] for level in self.waves], self.endpoint_summaries(), self.run_dir,
            self._mode_note(self.scheduler.mode),
            agents={st.name: {"endpoint": st.endpoint, "wave": st.wave, "turns": st.turns}
                    for st in self.agents.values()},
            reused=list(self.completed_before), auto_ceiling=self.auto_ceiling, paused=self.scheduler.paused,
            effective_cap=self.scheduler.effective_cap,
        )

    async def _start_background(self, group: anyio.abc.TaskGroup) -> None:
        """Tasks that live as long as the run: each local endpoint's /health and /metrics, polled."""
        for ep in self.config.endpoints:
            if ep.kind != "hosted":
                group.start_soon(self._monitor, ep.name)
            group.start_soon(self._auto_loop, ep.name)
        if self.busy_check is None:
            self.busy_check = self._server_busy

    async def read_server(self, endpoint: str) -> ServerStatus:
        """One look at the endpoint's /health and /metrics; a server that answers nonsense is 'unknown', never a crash."""
        base_url = self.base_urls[endpoint]
        try:
            return await read_server(self._clients[endpoint], base_url)
        except Exception as exc:  # noqa: BLE001 - a monitoring read must never end the run
            return ServerStatus(base_url=base_url, reachable=False, error=f"unreadable: {exc}"[:200])

    async def _monitor(self, endpoint: str) -> None:
        previous: MetricsSnapshot | None = None
        while True:
            status = await self.read_server(endpoint)
            self.server_status[endpoint] = status
            self.server_status_at[endpoint] = time.monotonic()
            m = status.metrics
            detail = status.loading_message or ("loading" if status.loading else "") or (status.error or "")
            self.last_sample[endpoint] = sample = ev.ServerSample(
                time.monotonic(), endpoint, status.reachable and not status.loading and (status.health_status or 0) < 400,
                status.kind, _num(m.requests_running) if m else None, _num(m.requests_waiting) if m else None,
                m.kv_cache_usage if m else None,
                (prefix_hit_rate(previous, m) if m and previous else (m.prefix_cache_hit_rate if m else None)),
                _num(m.preemptions) if m else None, _num(m.kv_cache_size_tokens) if m else None, detail,
                slots_busy=status.slots.processing if status.slots else None,
                slots_total=status.slots.total if status.slots else None,
            )
            self._samples[endpoint] += 1
            self.emit(sample)
            previous = m or previous
            self._refresh_fit(endpoint, m.kv_cache_size_tokens if m is not None else None)
            self._refresh_load(endpoint)
            await anyio.sleep(self.config.run.metrics_interval_s)

    def _refresh_fit(self, endpoint: str, server_kv_tokens: float | None) -> None:
        """How many conversations fit: the server's own KV capacity when it reports one (else the configured
        estimate's), over the conversation length `[endpoints.capacity] context_tokens` gives, or else the
        one the agents' own conversations project to (their live context and their turns to come)."""
        current = self.load.get(endpoint)
        context = (self.endpoints[endpoint].capacity.context_tokens or int(self.projected_context(endpoint) or 0)
                   or (current.context_tokens if current else 0))
        if not context:
            return
        if server_kv_tokens:
            if (current is None or current.source != "server" or current.kv_capacity_tokens != server_kv_tokens
                    or current.context_tokens != context):
                self.load[endpoint] = load.from_server(server_kv_tokens, context, current)
        elif current is not None and current.context_tokens != context:
            self.load[endpoint] = dataclasses.replace(
                current, context_tokens=context, conversations_fit=current.kv_capacity_tokens // context)

    async def probe(self, endpoint: str, *, on_progress: Callable[[str], None] | None = None,
                    on_level: Callable[[Any], None] | None = None, max_concurrency: int | None = None) -> Any:
        """Run `cerevisor-tui probe` against one of the run's endpoints (for the console); returns a ProbeResult.

        Only while the run is open (its HTTP clients exist). Raises EndpointError when the endpoint is unusable.
        """
        from cerevisor_tui.endpoints.probe import ProbeSettings, probe_conversations

        if endpoint not in self._clients:
            raise EndpointError(endpoint, "the run is not open: probe it with `cerevisor-tui probe URL`")
        ep = self.endpoints[endpoint]
        settings = ProbeSettings(max_concurrency=max_concurrency or max(2, ep.max_concurrency))
        # shaped like this endpoint's agents (their prompts, turns, growing conversations); none: single requests
        agents = [st.config for st in self._agents_on.get(endpoint, ())]
        return await probe_conversations(
            self._clients[endpoint], self.base_urls[endpoint], agents, model=self.models.get(endpoint) or None,
            settings=settings, on_progress=on_progress, on_level=on_level, endpoint=endpoint,
            save=ep.kind != "simulated")  # the built-in simulator's port is new every run: nothing to remember

    def cap_warning(self) -> str | None:
        """Why the current cap is past what fits in an endpoint's KV memory, if it is."""
        for name, est in self.load.items():
            warning = load.cap_warning(name, self.scheduler.endpoint_cap(name), est)
            if warning:
                return warning
        return None

    def load_event(self, endpoint: str) -> ev.LoadChanged:
        """The endpoint's load as a console shows it: conversations in flight, their zone, the cap, the fit."""
        est = self.load.get(endpoint)
        sample = self.last_sample.get(endpoint)
        conversations = load.conversations_in_flight(
            self.scheduler.running_by_endpoint.get(endpoint, 0), sample.running if sample else None,
            sample.waiting if sample else None)
        cap = self.scheduler.endpoint_cap(endpoint)
        return ev.LoadChanged(
            time.monotonic(), endpoint, conversations, cap, est.zone(conversations) if est else "",
            dataclasses.asdict(est) if est else None, "" if est else self.load_notes.get(endpoint, ""),
            load.cap_warning(endpoint, cap, est))

    def _refresh_load(self, endpoint: str | None = None) -> None:
        """Send a LoadChanged for each endpoint (or `endpoint`) whose load, as shown, changed."""
        for name in (endpoint,) if endpoint is not None else self.endpoints:
            event = self.load_event(name)
            sent = self._load_sent.get(name)
            if sent is None or dataclasses.replace(sent, t=event.t) != event:
                self._load_sent[name] = event
                self.emit(event)

    # ---- probing from the console -----------------------------------------------------------------
    def start_probe(self, endpoint: str, max_concurrency: int | None = None) -> None:
        """Sweep one of the run's endpoints in the run's own task group; it says everything through
        ProbeStarted, ProbeProgress and ProbeFinished. New admissions wait while it measures (running
        agents go on), so it measures the server rather than our own growing load."""
        ep = self.endpoints[endpoint]
        bound = max_concurrency or max(2, ep.max_concurrency)
        agents = len(self._agents_on.get(endpoint, ()))
        if endpoint in self._probes:
            return  # one at a time per endpoint: the one running reports
        self.emit(ev.ProbeStarted(time.monotonic(), endpoint, bound, agents))
        if self._background is None or self.stopping or endpoint not in self._clients:
            self.emit(ev.ProbeFinished(time.monotonic(), endpoint, error=(
                f"The run is not open: probe {endpoint} with `cerevisor-tui probe URL`.")))
            return
        scope = self._probes[endpoint] = anyio.CancelScope()
        self._background.start_soon(self._probe_task, endpoint, bound, scope)

    def cancel_probe(self, endpoint: str) -> bool:
        """Cancel the endpoint's running probe (its requests are closed); returns whether one was running."""
        scope = self._probes.get(endpoint)
        if scope is None:
            return False
        scope.cancel()
        return True

    async def _probe_task(self, endpoint: str, bound: int, scope: anyio.CancelScope) -> None:
        held = not self.scheduler.paused
        if held:
            self.pause()
        result: Any = None
        error = ""

        def progress(line: str) -> None:
            self.emit(ev.ProbeProgress(time.monotonic(), endpoint, line=line))

        def level(found: Any) -> None:
            self.emit(ev.ProbeProgress(time.monotonic(), endpoint, level=found.to_dict()))

        try:
            with scope:
                result = await self.probe(endpoint, on_progress=progress, on_level=level, max_concurrency=bound)
        except Exception as exc:  # noqa: BLE001 - a probe that fails says why; the run goes on
            error = self._probe_failure(exc)
        finally:
            self._probes.pop(endpoint, None)
            if held and self.scheduler.paused and not self.stopping:
                self.resume()
            now = time.monotonic()
            if result is not None:
                self.emit(ev.ProbeFinished(now, endpoint, result=result.to_dict()))
            elif error:
                self.emit(ev.ProbeFinished(now, endpoint, error=error))
            elif scope.cancelled_caught:
                self.emit(ev.ProbeFinished(now, endpoint, cancelled=True))
            else:  # the run's own task group ended it
                self.emit(ev.ProbeFinished(now, endpoint, error=self._probe_failure(None)))

    def _probe_failure(self, error: BaseException | None) -> str:
        """What went wrong, in the operator's words (the innermost error of a task group)."""
        while isinstance(error, BaseExceptionGroup) and error.exceptions:
            error = error.exceptions[0]
        closed = isinstance(error, RuntimeError) and "closed" in str(error)  # httpx: the run closed its client
        if error is None or closed or self.stopping:
            return ("The run ended while probing, and its connections with it. "
                    "Probe the server alone with `cerevisor-tui probe URL`.")
        return str(error) or type(error).__name__

    # ---- auto mode --------------------------------------------------------------------------------
    async def _auto_loop(self, endpoint: str) -> None:
        """Feed the endpoint's controller while the run goes on; it acts only in auto mode."""
        ctl = self.auto[endpoint]
        tick = min(1.0, max(0.02, self.config.run.metrics_interval_s / 2))
        while True:
            await anyio.sleep(tick)
            if self.scheduler.mode == "auto" and not self.stopping:
                change = ctl.update(self.auto_signals(endpoint))
                if change is not None:
                    self._apply_auto(endpoint, change)

    def auto_signals(self, endpoint: str) -> Signals:
        """What the controller of `endpoint` sees now: the engine's own figures and the server's last sample."""
        states = self._agents_on.get(endpoint, [])
        sample = self.last_sample.get(endpoint)
        ttfts = sorted(self._ttfts[endpoint])
        watched = self.endpoints[endpoint].kind != "hosted"
        kv_tokens = sample.kv_cache_tokens if sample is not None else None
        if not kv_tokens and self.load.get(endpoint) is not None:
            kv_tokens = self.load[endpoint].kv_capacity_tokens
        produced, turns = self._turn_tokens[endpoint]
        return Signals(
            t=time.monotonic(), tokens=sum(st.tokens for st in states),
            running=self.scheduler.running_by_endpoint.get(endpoint, 0), queued=self.scheduler.queued_for(endpoint),
            cold=sum(1 for st in states if st.started_at is not None and st.ttft_s is None and st.status not in FINAL),
            errors=self._rejections[endpoint], ttft_p50=ttfts[len(ttfts) // 2] if ttfts else None,
            sample=self._samples[endpoint],
            server_ok=(sample.healthy if sample is not None else False) if watched else None,
            waiting=sample.waiting if sample else None, server_running=sample.running if sample else None,
            kv_usage=sample.kv_cache_usage if sample else None, preemptions=sample.preemptions if sample else None,
            prefix_hit_rate=sample.prefix_hit_rate if sample else None, kv_tokens=kv_tokens,
            slots=sample.slots_total if sample else None, context_tokens=self.projected_context(endpoint),
            turn_tokens=produced / turns if turns else None,
        )

    def projected_context(self, endpoint: str) -> float | None:
        """The mean full length, in tokens, of the conversations of `endpoint`'s agents still to run or running
        in the current wave: what each has sent so far by the server's own count, plus its turns to come (at
        the measured tokens per character) and their answers (at the measured answer length)."""
        prompt_tokens, chars = self._token_ratio[endpoint]
        per_char = prompt_tokens / chars if chars else 0.25
        produced, turns = self._turn_tokens[endpoint]
        total, count = 0.0, 0
        for st in self._agents_on.get(endpoint, ()):
            if st.status in FINAL or (st.wave != self.wave and st.status == "pending"):
                continue
            cfg = st.config
            answer = produced / turns if turns else cfg.max_tokens
            texts = [cfg.prompt, *cfg.turns]
            if st.turns_done:
                base = st.last_prompt_tokens + st.last_completion_tokens
                rest = texts[st.turns_done:]
            else:
                base, rest = len(cfg.system) * per_char, texts
            total += base + sum(map(len, rest)) * per_char + answer * len(rest)
            count += 1
        return total / count if count else None

    def _count_turn(self, st: AgentState, messages: list[dict[str, str]], prompt_tokens: int, completion_tokens: int,
                    ttft: float | None) -> None:
        """A completed turn's figures, for auto mode's projection of conversation lengths and its TTFT."""
        chars = sum(len(m["content"]) for m in messages)
        ratio = self._token_ratio[st.endpoint]
        if prompt_tokens:
            ratio[0] += prompt_tokens
            ratio[1] += chars
        st.turns_done = st.turn
        st.last_prompt_tokens = prompt_tokens or round(chars * (ratio[0] / ratio[1] if ratio[1] else 0.25))
        st.last_completion_tokens = completion_tokens
        answers = self._turn_tokens[st.endpoint]
        answers[0] += completion_tokens
        answers[1] += 1
        if ttft is not None:
            self._ttfts[st.endpoint].append(ttft)

    def _apply_auto(self, endpoint: str, change: Change) -> None:
        self.scheduler.set_endpoint_cap(endpoint, change.cap)
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, change.cap, s.paused,
                                        endpoint=endpoint, reason=change.reason, ceiling=self.auto_ceiling,
                                        total_cap=s.effective_cap))
        self._refresh_load(endpoint)

    async def _server_busy(self, endpoint: str) -> str | None:
        """Asked at a deadline: is the server loading its model, or are requests waiting in its queue?

        The monitor's recent sample answers at once when it can: a swamped server (the very case this check
        is for) can take seconds to answer a fresh /metrics read, and a late event loop adds its own. A
        sample that says busy stands for a while (a queue does not vanish in seconds); one that says not
        busy only while it is as fresh as the monitor makes them. Otherwise, or with no usable sample (no
        /metrics, an error), ask afresh.
        """
        if self.endpoints[endpoint].kind == "hosted":
            return None
        recent = self.server_status.get(endpoint)
        age = time.monotonic() - self.server_status_at.get(endpoint, -math.inf)
        interval = self.config.run.metrics_interval_s
        if recent is not None and recent.busy_reason and age <= max(10.0, 3 * interval):
            return recent.busy_reason
        if recent is not None and recent.reachable and recent.metrics is not None and age <= 1.5 * interval + 0.5:
            return None
        status = await self.read_server(endpoint)
        return status.busy_reason

    async def _run_wave(self, wave: int, states: list[AgentState]) -> None:
        self.wave = wave
        self.emit(ev.WaveStarted(time.monotonic(), wave, [st.name for st in states]))
        async with anyio.create_task_group() as group:
            self._wave_group = group
            for st in states:
                if st.name in self.completed_before:
                    self._finish(st, "completed", "", self.completed_before[st.name],
                                 self.recorded_inputs.get(st.name, {}))
                    continue
                if self.stopping:
                    self._finish(st, "cancelled", self.stopping)
                    continue
                failed = [d for d in st.config.depends_on if self.agents[d].status != "completed"]
                if failed:
                    dep = self.agents[failed[0]]
                    self._finish(st, "skipped", f"dependency {dep.name} {dep.status}")
                    continue
                group.start_soon(self._run_agent, st)
        self._wave_group = None
        self.emit(ev.WaveFinished(time.monotonic(), wave, {st.name: st.status for st in states}))

    def _cancel_rest(self, wave: int) -> None:
        """The run is stopping: every agent of the waves from `wave` on ends now, in one step (cancelled, or
        completed when a resumed run reuses its answer), without a wave's start, end or report rewrite each."""
        for level in self.waves[wave:]:
            for agent in level:
                st = self.agents[agent.name]
                if st.status in FINAL:
                    continue
                if st.name in self.completed_before:
                    self._finish(st, "completed", "", self.completed_before[st.name],
                                 self.recorded_inputs.get(st.name, {}))
                else:
                    self._finish(st, "cancelled", self.stopping)

    async def _run_agent(self, st: AgentState) -> None:
        if self.stopping:  # spawned in the same instant the run was stopped
            self._finish(st, "cancelled", self.stopping)
            return
        st.status = "queued"
        self.emit(ev.AgentQueued(time.monotonic(), st.name, st.wave))
        status, reason = "completed", ""
        with anyio.CancelScope() as scope:
            st.scope = scope
            try:
                try:
                    async with self.scheduler.slot(st.name, st.endpoint):
                        st.started_at = time.monotonic()
                        self._refresh_load(st.endpoint)
                        await self._conversation(st)
                finally:
                    self._refresh_load(st.endpoint)
            except _AgentEnded as end:
                status, reason = end.status, end.reason
        st.scope = None
        if scope.cancelled_caught:
            status, reason = st.end_status or "cancelled", st.end_reason or "cancelled"
        if status == "completed":
            self._finish(st, status, reason, st.output, self.agent_inputs(st.config))
        else:
            self._finish(st, status, reason)

    def _finish(self, st: AgentState, status: str, reason: str, output: str = "",
                inputs: dict[str, str] | None = None) -> None:
        st.status, st.error, st.output = status, reason, output
        st.current = None
        st.finished_at = time.monotonic()
        self.emit(ev.AgentFinished(time.monotonic(), st.name, status, reason, output, inputs or {}))

    def agent_inputs(self, cfg: AgentConfig, outputs: Mapping[str, str] | None = None) -> dict[str, str]:
        """What an agent runs with, as its AgentFinished records it: its texts as sent (its dependencies'
        answers inserted; `outputs` gives them, else the agents' own) as digests, the rest as values.
        A resumed run compares the keys both have, so a key added later does not rerun everything."""
        if outputs is None:
            render = self.render
        else:
            def render(text: str) -> str:
                return OUTPUT_REF.sub(lambda m: outputs.get(m.group(1), ""), text)
        ep = self.config.agent_endpoint(cfg)
        return {
            "system": _digest(cfg.system),
            "prompt": _digest(render(cfg.prompt)),
            "turns": _digest(json.dumps([render(text) for text in cfg.turns], ensure_ascii=False)),
            "depends_on": ", ".join(sorted(cfg.depends_on)),
            "endpoint": ep.name,
            "model": ep.model,  # as configured: "" is the first /v1/models lists
            "max_tokens": str(cfg.max_tokens),
            "temperature": str(cfg.temperature),
        }

    def _plan_resume(self) -> dict[str, str]:
        """The completed agents a resumed run sends again, and why: what they would run with changed, or a
        dependency of theirs runs (a changed answer upstream makes every answer downstream stale)."""
        reused = self.completed_before
        rerun: dict[str, str] = {}
        for level in self.waves:
            for cfg in level:
                if cfg.name not in reused:
                    continue
                dep = next((d for d in cfg.depends_on if d not in reused or d in rerun), None)
                if dep is not None:
                    rerun[cfg.name] = (f"its dependency {dep} runs again" if dep in rerun
                                       else f"its dependency {dep} had not completed")
                    continue
                before = self.recorded_inputs.get(cfg.name)
                if not before:
                    continue  # recorded before inputs were: reused as it is
                now = self.agent_inputs(cfg, reused)
                changes = [_input_change(key, str(before[key]), value) for key, value in now.items()
                           if key in before and str(before[key]) != value]
                if changes:
                    rerun[cfg.name] = ", ".join(changes)
        return rerun

    def _reset(self, st: AgentState) -> None:
        st.status, st.error, st.output, st.end_status, st.end_reason = "pending", "", "", "", ""
        st.retries_used = 0
        st.turn = 0
        st.messages = []

    def render(self, text: str) -> str:
        """Insert dependencies' final answers for {{ name.output }}."""
        return OUTPUT_REF.sub(lambda m: self.agents[m.group(1)].output, text)

    async def _conversation(self, st: AgentState) -> None:
        cfg = st.config
        messages: list[dict[str, str]] = []
        if cfg.system:
            messages.append({"role": "system", "content": cfg.system})
        user_turns = [cfg.prompt, *cfg.turns]
        answer = ""
        for turn, text in enumerate(user_turns):
            st.turn = turn + 1
            messages.append({"role": "user", "content": self.render(text)})
            self.emit(ev.MessageRecorded(time.monotonic(), st.name, st.turn_attempts.get(st.turn, 0) + 1, st.turn, "user",
                                         messages[-1]["content"]))
            answer = await self._turn(st, messages)
            messages.append({"role": "assistant", "content": answer})
        st.messages = messages
        st.output = answer

    async def _turn(self, st: AgentState, messages: list[dict[str, str]]) -> str:
        """One turn: its attempts are numbered within it (2 is its first retry or restart), and an operator's
        rerun of the agent goes on counting, so 'attempt 2' always means the turn was sent before."""
        while True:
            st.attempts += 1
            number = st.turn_attempts[st.turn] = st.turn_attempts.get(st.turn, 0) + 1
            try:
                return await self._attempt(st, messages, number)
            except _AttemptFailed as failure:
                if failure.restart:
                    continue
                if self.stopping:
                    raise _AgentEnded("cancelled", self.stopping) from None
                if not failure.retryable or st.retries_used >= st.config.retries:
                    raise _AgentEnded(failure.status, failure.reason) from None
                st.retries_used += 1
                delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (st.retries_used - 1)) * (0.5 + self._rng.random())
                if failure.retry_after_s is not None:
                    delay = max(delay, min(failure.retry_after_s, RETRY_AFTER_CAP_S))
                st.status = "retrying"
                self.emit(ev.AgentRetrying(time.monotonic(), st.name, number + 1, failure.reason, delay))
                await anyio.sleep(delay)

    async def _attempt(self, st: AgentState, messages: list[dict[str, str]], number: int) -> str:
        policy = self.policies[st.endpoint]
        now = time.monotonic()
        att = Attempt(number, st.turn, sent_at=now, last_alive=now,
                      deadline_at=now + policy.first_byte_timeout_s)
        st.current = att
        st.status = "prefill"
        self.emit(ev.AgentStarted(now, st.name, att.number, st.turn, st.turns, st.endpoint,
                                  policy.first_byte_timeout_s, policy.idle_timeout_s))
        parts: list[str] = []
        thinking: list[str] = []
        error: EndpointError | None = None
        with anyio.CancelScope() as scope:
            att.scope = scope
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch, st, att, policy)
                try:
                    await self._stream(st, att, messages, policy, parts, thinking)
                except EndpointError as exc:
                    error = exc
                group.cancel_scope.cancel()
        st.current = None
        answer = "".join(parts)
        if att.kill_reason or error is not None or scope.cancelled_caught:
            if parts or thinking:
                self.emit(ev.MessageRecorded(time.monotonic(), st.name, att.number, st.turn, "assistant", answer,
                                             "".join(thinking), partial=True))
            if att.kill_reason:
                if not att.restart:
                    self.emit(ev.AgentKilled(time.monotonic(), st.name, att.number, att.kill_deadline,
                                             att.kill_reason, att.tokens))
                status = "cancelled" if self.stopping else "killed"
                reason = att.kill_reason if att.by_operator else f"{att.kill_deadline} deadline: {att.kill_reason}"
                raise _AttemptFailed(status, reason, retryable=not att.by_operator, restart=att.restart)
            if error is not None:
                if error.status in (429, 503):
                    self._rejections[st.endpoint] += 1
                raise _AttemptFailed("failed", str(error), retryable=error.retryable, retry_after_s=error.retry_after_s)
            raise _AttemptFailed("cancelled", "cancelled", retryable=False)
        stream = att.stream
        usage = stream.usage if stream and stream.usage else None
        prompt_tokens = usage[0] if usage else 0
        completion_tokens = usage[1] if usage else att.tokens
        end = time.monotonic()
        st.prompt_tokens += prompt_tokens
        st.completion_tokens += completion_tokens
        ttft = att.first_token_at - att.sent_at if att.first_token_at is not None else None
        if att.first_token_at is not None:
            st.decode_s += end - att.first_token_at
        self._count_turn(st, messages, prompt_tokens, completion_tokens, ttft)
        self.emit(ev.MessageRecorded(end, st.name, att.number, st.turn, "assistant", answer, "".join(thinking)))
        self.emit(ev.TurnFinished(end, st.name, att.number, st.turn, st.turns, prompt_tokens, completion_tokens,
                                  stream.finish_reason if stream else "", ttft, end - att.sent_at))
        return answer

    async def _stream(self, st: AgentState, att: Attempt, messages: list[dict[str, str]], policy: ResolvedStall,
                      parts: list[str], thinking: list[str]) -> None:
        ep = self.endpoints[st.endpoint]
        client = self._clients[ep.name]
        name, number = st.name, att.number
        emit = self.emit
        # token deltas skip emit()'s frame: the same loop over the same (live) list of subscribers
        subscribers = self._subscribers
        # TokenDelta is a frozen dataclass, whose generated __init__ sets each field through
        # object.__setattr__: that was the costliest line of this loop. Its slots are filled through their
        # descriptors instead (the same object, a third of the time), as long as its fields are still these.
        new_event = object.__new__
        TokenDelta = ev.TokenDelta
        fast_delta = ("__slots__" in vars(TokenDelta) and not hasattr(TokenDelta, "__post_init__")
                      and [f.name for f in dataclasses.fields(TokenDelta)] == list(_TOKEN_DELTA_FIELDS))
        if fast_delta:
            set_t = ev.Event.t.__set__
            set_agent, set_attempt = TokenDelta.agent.__set__, TokenDelta.attempt.__set__
            set_text, set_reasoning, set_tool = TokenDelta.text.__set__, TokenDelta.reasoning.__set__, TokenDelta.tool.__set__
            set_tokens = TokenDelta.tokens.__set__
        monotonic = time.monotonic
        by_bytes = policy.liveness == "bytes"
        # With a key configured, each delta field is scrubbed with the tail of the one before held back, as an
        # echoed key may be split across deltas (config/secrets.py: StreamScrubber). Without one: one test.
        held = (self.scrub.stream(), self.scrub.stream(), self.scrub.stream()) if self.scrub else None
        # a header value must be ASCII: a non-ASCII agent name goes percent-encoded
        agent_header = name if name.isascii() else urllib.parse.quote(name, safe="")
        wait_s = 0.25
        while True:
            try:
                model = await self._model(ep)
                body = {
                    "model": model,
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": st.config.max_tokens,
                    "temperature": st.config.temperature,
                }
                url = self.base_urls[ep.name].rstrip("/") + "/chat/completions"
                # X-Request-Id names the attempt in the server's own logs (vLLM takes it as its request id:
                # "Aborted request(s) chatcmpl-<id>"); unique per run, agent, turn and attempt
                headers = {"X-Cerevisor-Agent": agent_header,
                           "X-Request-Id": request_id(self.run_id, agent_header, att.turn, number)}
                stream: ChatStream | RemoteStream = (
                    self._worker.stream(ep.name, url, body, headers) if self._worker is not None
                    else ChatStream(client, ep.name, url, body, headers))
                att.stream = stream
                async for kind, payload in stream.events():
                    if kind == DELTA:
                        now = monotonic()
                        att.last_alive = now
                        content, reasoning, tool, chunks = payload
                        if held is not None:
                            content, reasoning, tool = _held_back(held, content, reasoning, tool)
                        if att.first_token_at is None:
                            att.first_token_at = now
                            ttft = now - att.sent_at
                            if st.ttft_s is None:
                                st.ttft_s = ttft
                            st.status = "streaming"
                            att.alive.set()
                            emit(ev.FirstToken(now, name, number, st.turn, ttft))
                        elif st.status != "streaming":
                            st.status = "streaming"
                        att.tokens += chunks
                        st.tokens += chunks
                        if content:
                            parts.append(content)
                        if reasoning:
                            thinking.append(reasoning)
                        if fast_delta:
                            delta = new_event(TokenDelta)
                            set_t(delta, now)
                            set_agent(delta, name)
                            set_attempt(delta, number)
                            set_text(delta, content)
                            set_reasoning(delta, reasoning)
                            set_tool(delta, tool)
                            set_tokens(delta, chunks)
                        else:
                            delta = TokenDelta(now, name, number, content, reasoning, tool, chunks)
                        for subscriber in subscribers:
                            subscriber(delta)
                    elif kind == KEEPALIVE:
                        if by_bytes:
                            att.last_alive = monotonic()
                            att.alive.set()
                        emit(ev.KeepAlive(monotonic(), name, number))
                return
            except EndpointUnreachable as exc:
                exc.scrub(self.scrub)
                # A local server that is still loading refuses its port: wait inside the first-byte window.
                if ep.kind == "hosted" or att.first_token_at is not None:
                    raise
                st.status = "waiting"
                emit(ev.EndpointWaiting(monotonic(), name, number, ep.name, exc.problem, wait_s))
                await anyio.sleep(wait_s)
                wait_s = min(wait_s * 2, WAIT_BACKOFF_CAP_S)
            except EndpointError as exc:  # the server's words, or the worker's: never with a key in them
                raise exc.scrub(self.scrub) from None  # (the unscrubbed original must not ride along as context)
            finally:
                if held is not None and (held[0].carry or held[1].carry or held[2].carry):
                    # the stream ended (or broke) on text that could have begun a key and did not: it is text
                    tail = (held[0].flush(), held[1].flush(), held[2].flush())
                    if tail[0]:
                        parts.append(tail[0])
                    if tail[1]:
                        thinking.append(tail[1])
                    for subscriber in subscribers:
                        subscriber(TokenDelta(monotonic(), name, number, *tail, 0))

    async def _model(self, ep: EndpointConfig) -> str:
        """The model id to request: configured, or the first that /v1/models lists (asked once)."""
        if ep.name in self.models:
            return self.models[ep.name]
        lock = self._model_locks.setdefault(ep.name, anyio.Lock())
        async with lock:
            if ep.name not in self.models:
                listed = await list_models(self._clients[ep.name], ep.name, self.base_urls[ep.name])
                if not listed:
                    raise EndpointError(ep.name, "/v1/models lists no model; set model in the endpoint's config")
                self.models[ep.name] = str(listed[0]["id"])
                self.emit(ev.ModelResolved(time.monotonic(), ep.name, self.models[ep.name]))
        return self.models[ep.name]

    async def _watch(self, st: AgentState, att: Attempt, policy: ResolvedStall) -> None:
        """The stall watchdog of one attempt: warnings at fractions of the deadline, then extend or kill.
        The policy is the endpoint's current one at each look (`set_stall` changes it live)."""
        monotonic = time.monotonic
        seen_base = -1.0
        while True:
            now = monotonic()
            changed = self.policies[st.endpoint] is not policy
            policy = self.policies[st.endpoint]
            fractions = policy.warn_at
            if att.first_token_at is None and not (policy.liveness == "bytes" and att.last_alive > att.sent_at):
                phase, base, window = "first_byte", att.sent_at, policy.first_byte_timeout_s
            else:
                phase, base, window = "idle", att.last_alive, policy.idle_timeout_s
            if policy.liveness == "bytes" and att.stream is not None and att.stream.last_byte_at > base:
                base = att.last_alive = att.stream.last_byte_at
            if base != seen_base:  # a sign of life: the window starts again, warnings re-arm
                seen_base = base
                att.extra_s = 0.0
                att.warned = 0
            total = window + att.extra_s
            if changed:  # a longer window re-arms the warnings it moved ahead; a shorter one gives its due ones now
                att.warned = min(att.warned, sum(1 for f in fractions if now >= base + f * total))
            att.phase = phase
            att.deadline_at = base + total
            att.base = base
            while att.warned < len(fractions) and now >= base + fractions[att.warned] * total:
                fraction = fractions[att.warned]
                att.warned += 1
                st.stall_warnings += 1
                st.status = "stalling"
                self.emit(ev.StallWarning(now, st.name, att.number, phase, fraction, max(0.0, att.deadline_at - now),
                                          att.deadline_at))
            if now >= att.deadline_at:
                reason = await self._busy_reason(st, att, policy)
                if reason:
                    att.extensions += 1
                    att.extra_s += policy.extend_s
                    att.deadline_at += policy.extend_s
                    att.warned = sum(1 for f in fractions if base + f * (total + policy.extend_s) <= now)
                    self.emit(ev.StallExtended(monotonic(), st.name, att.number, phase, policy.extend_s, reason,
                                               att.deadline_at, att.extensions))
                    continue
                if att.last_alive > base or (policy.liveness == "bytes" and att.stream is not None
                                             and att.stream.last_byte_at > base):
                    # it came back to life while the server was asked (or while this busy loop caught up
                    # with bytes that had already arrived): not stalled after all
                    continue
                # measured now, after the busy check (which can take seconds), against the deadline in force
                elapsed, limit = monotonic() - base, att.deadline_at - base
                # named when the silence ran visibly past it (a slow busy check, a late loop), not for a tick's lag
                late = elapsed - limit > max(0.5, 0.1 * limit)
                deadline = f" (deadline {fmt_s(limit)})" if late and fmt_s(elapsed) != fmt_s(limit) else ""
                if phase == "first_byte":
                    why = f"no first token after {fmt_s(elapsed)}{deadline}"
                else:
                    why = f"no output for {fmt_s(elapsed)} after {att.tokens} tokens{deadline}"
                att.kill(phase, why)
                return
            next_at = att.deadline_at
            if att.warned < len(fractions):
                next_at = min(next_at, base + fractions[att.warned] * total)
            delay = max(0.0, next_at - monotonic()) + 0.001
            with anyio.CancelScope() as att.nap, anyio.move_on_after(delay):
                if phase == "first_byte" and not att.alive.is_set():
                    await att.alive.wait()
                else:
                    await anyio.sleep(delay)
            att.nap = None

    async def _busy_reason(self, st: AgentState, att: Attempt, policy: ResolvedStall) -> str | None:
        """The seam for the server-busy extension: ask the endpoint whether it is loading or queueing."""
        if not policy.extend_when_server_busy or att.extensions >= policy.max_extensions or self.busy_check is None:
            return None
        with anyio.move_on_after(2.0):
            return await self.busy_check(st.endpoint)
        return None

    # ---- endpoints ----------------------------------------------------------------------------
    async def _open_endpoints(self, stack: AsyncExitStack) -> None:
        cap = max(self.config.run.max_concurrency, *(ep.max_concurrency for ep in self.config.endpoints), 1)
        for ep in self.config.endpoints:
            key = api_key(ep)
            if ep.kind == "simulated" and not ep.base_url:
                from cerevisor_tui.sim import SimServer

                server = await stack.enter_async_context(SimServer(ep.sim, port=0))
                self.base_urls[ep.name] = server.base_url
            client = build_client(min(cap, ep.max_concurrency), key)
            self._clients[ep.name] = await stack.enter_async_context(client)
        if self.stream_process:
            from cerevisor_tui.endpoints.worker import StreamWorker

            worker = StreamWorker()
            for ep in self.config.endpoints:
                worker.add_client(ep.name, min(cap, ep.max_concurrency), ep.api_key_env)
            try:
                self._worker = await stack.enter_async_context(worker)
            except EndpointError as exc:  # a machine that cannot start it still runs, reading in this process
                self.stream_process_problem = exc.problem

    def endpoint_summaries(self) -> list[dict[str, Any]]:
        """Endpoints as the report shows them: never the key, only the variable's name."""
        return [
            {"name": ep.name, "kind": ep.kind, "base_url": self.base_urls.get(ep.name, ep.base_url),
             "model": self.models.get(ep.name, ep.model), "max_concurrency": ep.max_concurrency,
             "api_key_env": ep.api_key_env, "stall": self.policies[ep.name].model_dump()}
            for ep in self.config.endpoints
        ]

    def _emit_cap(self) -> None:
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, s.effective_cap, s.paused,
                                        total_cap=s.effective_cap))
        self._refresh_load()

    @staticmethod
    def _mode_note(mode: str) -> str:
        return "each endpoint's cap follows what its server sustains; +/- move the ceiling" if mode == "auto" else ""


def _saved_probe_cap(ep: EndpointConfig) -> tuple[int, str]:
    """The cap the last probe of this endpoint recommended, if one was saved: auto mode starts there."""
    if not ep.base_url:
        return 0, ""
    try:
        from cerevisor_tui.endpoints.probe_store import saved_recommendation
    except ImportError:
        return 0, ""
    saved = saved_recommendation(ep.base_url, ep.model or None)
    if not saved or not saved.get("cap"):
        return 0, ""
    return int(saved["cap"]), f"the probe of {saved.get('saved_at', 'an earlier run')} recommended it"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _input_change(key: str, before: str, now: str) -> str:
    """One changed input in the operator's words: texts by name, values from before to now."""
    if key in ("system", "prompt", "turns"):
        return f"{key} changed"
    if key == "depends_on":
        return f"depends_on [{before}] -> [{now}]"
    if key == "model":
        return f"model {before or '(the first listed)'} -> {now or '(the first listed)'}"
    return f"{key} {before} -> {now}"


def _num(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def api_key(ep: EndpointConfig) -> str | None:
    """The endpoint's API key, from the environment variable its config names (never from a file); one
    that cannot go in an HTTP header is refused, naming the variable, never showing the value."""
    if not ep.api_key_env:
        return None
    value = os.environ.get(ep.api_key_env)
    if not value:
        raise MissingApiKey(ep.name, f"environment variable {ep.api_key_env} (api_key_env) is not set")
    problem = key_problem(value)
    if problem:
        raise MissingApiKey(ep.name, f"environment variable {ep.api_key_env} (api_key_env) {problem}")
    return value


def _held_back(held: tuple[StreamScrubber, StreamScrubber, StreamScrubber], content: str, reasoning: str,
               tool: str) -> tuple[str, str, str]:
    """One delta's fields, scrubbed, less any tail that could begin a key (see StreamScrubber)."""
    if content or held[0].carry:
        content = held[0].feed(content)
    if reasoning or held[1].carry:
        reasoning = held[1].feed(reasoning)
    if tool or held[2].carry:
        tool = held[2].feed(tool)
    return content, reasoning, tool


def wants_stream_process(config: Config, *, console: bool) -> bool:
    """`[run] stream_process`: "auto" reads the streams in a second process in the console (where drawing
    competes with reading for the loop) when there is a second CPU to run it on."""
    setting = config.run.stream_process
    if setting == "auto":
        return console and (os.cpu_count() or 1) >= 2
    return setting == "on"
