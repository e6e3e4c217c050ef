"""The engine: runs a workflow's waves through the scheduler, one conversation per agent, and tells
everything it does as events; commands change it live.

The engine owns no clock but `time.monotonic()` and no UI: a console, a headless printer, a journal
and a report all subscribe to the same events. Its parts, each in a module of its own and handed what it
needs of the engine's state: the endpoints' connections (engine/connections.py), the server monitor
(engine/monitor.py), the stall watchdog (engine/watchdog.py) and each agent's conversation and attempts
(engine/conversation.py). This module keeps the commands, the waves, auto mode's feed and the run loop.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from cerevisor_tui.config.graph import OUTPUT_REF, wave_levels
from cerevisor_tui.config.models import Config, EndpointConfig, ResolvedStall, resolve_stall
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine import load, resume
from cerevisor_tui.engine.attempt import Attempts, Budget, TurnFigures
from cerevisor_tui.engine.auto import AutoController, Change
from cerevisor_tui.engine.auto_feed import AutoFeed
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.connections import Connections, api_key, wants_stream_process
from cerevisor_tui.engine.console_probe import ConsoleProbes
from cerevisor_tui.engine.conversation import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    RETRY_AFTER_CAP_S,
    WAIT_BACKOFF_CAP_S,
    AgentEnded,
    Conversations,
    Subscriber,
    request_id,
)
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.engine.placement import Placement
from cerevisor_tui.engine.pools import Pools
from cerevisor_tui.engine.scheduler import Scheduler
from cerevisor_tui.engine.sessions import Sessions
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.status import move
from cerevisor_tui.engine.toolcalls import AskPolicy, ToolCalls
from cerevisor_tui.engine.warmup import warm_up
from cerevisor_tui.engine.watchdog import BusyCheck, Watchdog, fmt_s
from cerevisor_tui.engine.wedge import WedgeWatch
from cerevisor_tui.kinds import FINAL, MODES, FinalStatus, Mode
from cerevisor_tui.tools.manager import McpServers

if TYPE_CHECKING:
    from cerevisor_tui.endpoints.worker import StreamWorker

# What other modules, tests and benchmarks import from here, wherever it lives now.
__all__ = [
    "BACKOFF_BASE_S", "BACKOFF_CAP_S", "FINAL", "RETRY_AFTER_CAP_S", "WAIT_BACKOFF_CAP_S", "AgentState", "Attempt",
    "BusyCheck", "Engine", "Subscriber", "api_key", "fmt_s", "new_run_id", "request_id", "wants_stream_process",
]


def new_run_id() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


class Engine:
    """Run one workflow. Subscribe before `run()`; call commands from the same event loop at any time."""

    def __init__(self, config: Config, *, run_id: str | None = None, run_dir: str = "",
                 resumed: resume.JournalState | None = None, stream_process: bool = False,
                 ask: AskPolicy = "operator", clock: Clock = MONOTONIC) -> None:
        self.config = config
        self.clock = clock  # what the deadlines are measured on: the host's monotonic clock, or a test's
        self.run_id = run_id or new_run_id()
        self.run_dir = run_dir
        self.waves = wave_levels(config.agents)
        self.agents: dict[str, AgentState] = {}
        for wave, level in enumerate(self.waves):
            for agent in level:
                pool = config.agent_pool(agent)
                self.agents[agent.name] = AgentState(agent, config.agent_endpoint(agent).name, wave,
                                                     pool=pool.name if pool else "", on_status=self._tell_status)
        self.endpoints = {ep.name: ep for ep in config.endpoints}
        # pools: each agent of one is placed on a member when admitted and stays there (engine/placement.py)
        self.placement = Placement(config.pools)
        self.pools = Pools(self)
        self.policies: dict[str, ResolvedStall] = {
            ep.name: resolve_stall(config.stall, ep) for ep in config.endpoints
        }
        self.scheduler = Scheduler(
            config.run.mode, config.run.max_concurrency, {ep.name: ep.max_concurrency for ep in config.endpoints},
            pools={p.name: list(p.endpoints) for p in config.pools}, place=self.pools.place,
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
        self.agents_on: dict[str, list[AgentState]] = {ep.name: [] for ep in config.endpoints}
        for st in self.agents.values():
            if not st.pool:  # a pool's agent joins its member's list once placed
                self.agents_on.setdefault(st.endpoint, []).append(st)
        # what each endpoint's turns measured (rejections, TTFTs, tokens per character and per answer): auto's figures
        self.figures: dict[str, TurnFigures] = {ep.name: TurnFigures() for ep in config.endpoints}
        self._load_sent: dict[str, ev.LoadChanged] = {}  # the last LoadChanged of each endpoint
        self.background: anyio.abc.TaskGroup | None = None  # the run's long-lived tasks (monitors, probes)
        self.probes = ConsoleProbes(self)  # the console's probes of the run's endpoints
        # external sessions, the gateway's (engine/sessions.py): a run that serves a gateway goes on after its
        # waves, until it is stopped
        self.sessions = Sessions(self)
        self.hold_open = config.gateway is not None
        if config.gateway is not None:
            self.sessions.release_after_s = config.gateway.release_after_s
            self.sessions.forget_after_s = config.gateway.forget_after_s
            self.sessions.max_per_key = config.gateway.max_sessions_per_key
        self._stop_asked: anyio.Event | None = None
        self.auto_feed = AutoFeed(self)
        self.wave = -1
        self.started_at = 0.0
        self.stopping = ""
        self.stop_status: FinalStatus = "cancelled"  # what the agents a stop leaves unfinished end as
        # How many consoles are attached, for a run in the foreground (`run`): once its budget is spent and what
        # runs has finished, with none attached to resume it, it ends. None: the run's consoles are expected (a
        # detached run, a console's own): a spent budget waits for one to resume or stop it.
        self.consoles_attached: Callable[[], int] | None = None
        self._budget_spent: float | None = None  # what was spent when the budget paused admissions; None: it has not
        self.ended = False  # the run has sent its RunFinished: nothing more happens, nothing more is told
        # Agents a resumed run already completed: their answers are reused, they are never sent again, unless
        # what they would run with now (prompt, endpoint, ...) is not what they ran with: then they and every
        # agent downstream of them run again, each with its reason (an AgentRerun at the start of the run).
        # `resumed`: what the run directory's journal says (engine/resume.py read_journal, one pass over it).
        resumed = resumed or resume.JournalState(self.run_id)
        self.completed_before = dict(resumed.completed)
        self.recorded_inputs = resumed.inputs
        self.rerun = resume.plan_resume(config, self.waves, self.completed_before, self.recorded_inputs)
        for name in self.rerun:
            del self.completed_before[name]
        # the reused agents' recorded events: their figures carry into the report
        self._history = [e for e in resumed.history if getattr(e, "agent", None) not in self.rerun]
        self.report = Report()
        self._subscribers: list[Subscriber] = [self.report]
        self.subscriber_failures: dict[int, int] = {}  # by id(subscriber): how often each has raised
        self._wave_group: anyio.abc.TaskGroup | None = None
        # every form of the run's API keys, taken out of whatever text enters the run (config/secrets.py)
        # (and the variables the MCP servers are given: a server's own token must not reach the screen either)
        self.scrub = Scrubber.from_env([*(ep.api_key_env for ep in config.endpoints),
                                        *(name for server in config.mcp_servers for name in server.env),
                                        *(config.gateway.keys_env if config.gateway is not None else ())])
        # MCP tool servers, those an agent lists: started when the run opens, ended with it (tools/manager.py).
        # `ask`: what a tool call its server's rules `ask` about gets: the operator's answer, or headless, deny
        # or approve. A resumed run takes its earlier calls' results and "for the run" approvals from the journal.
        used = {tool.split(".", 1)[0] for agent in config.agents for tool in agent.tools}
        self.tool_servers = McpServers(config.mcp_servers, used, log_dir=run_dir, scrub=self.scrub)
        self.tools = ToolCalls(self.tool_servers, emit=self.emit, scrub=self.scrub, ask=ask,
                               memory=resumed.tools)
        # The run's parts, each handed what it needs of the engine's state (the same objects, not copies).
        self.connections = Connections(config, self.emit, stream_process=stream_process)
        self.base_urls = self.connections.base_urls  # the simulator's, once it is started
        self.models = self.connections.models  # configured, or resolved from /v1/models
        self.monitor = ServerMonitor(config, self.connections, self.emit, self.auto_feed.projected_context)
        # KV load per endpoint: the configured estimate, replaced by the server's own capacity when it reports one
        self.load = self.monitor.load
        self.load_notes = self.monitor.load_notes
        self.last_sample = self.monitor.last_sample
        self.watchdog = Watchdog(self.policies, self.emit, clock)
        self.wedges = WedgeWatch(self)  # wedged servers, judged after each sample (engine/wedge.py)
        # the one owner of a running attempt, a workflow agent's or a gateway session's (engine/attempt.py); a
        # resumed run's spending counts on from the journal's
        self.budget = Budget(config.run.budget_usd, resumed.spent_usd, on_near=self._budget_near, on_reached=self._budget_reached)
        self.attempts = Attempts(endpoints=self.endpoints, policies=self.policies, figures=self.figures,
                                 emit=self.emit, subscribers=self._subscribers,
                                 subscriber_failed=self.subscriber_failed, scrub=self.scrub, budget=self.budget,
                                 context_limit=self.connections.context_limit, clock=clock)
        self.attempts.on_timings = self.monitor.add_timings  # llama.cpp's timings: its latency panel
        self.conversations = Conversations(
            run_id=self.run_id, endpoints=self.endpoints, policies=self.policies, connections=self.connections,
            watchdog=self.watchdog, figures=self.figures, attempts=self.attempts, emit=self.emit, scrub=self.scrub,
            render=self.render, stopping=lambda: self.stopping, relocate=self.pools.relocate, tools=self.tools,
            escape=self.pools.failed)
        # an agent that had not completed goes on after the turns it had answered (a completed one's are not kept)
        self.conversations.recorded_turns = resumed.turns
        self.sessions.before = resumed.sessions  # a gateway's sessions go on from what they had done
        self.conversations.replay = self.report.replay
        self.conversations.request_prefix = resume.request_prefix(self.run_id, run_dir)

    @property
    def run_cost_usd(self) -> float:
        """What the run's requests cost so far on priced endpoints, agents' and sessions' alike."""
        return self.budget.spent_usd

    @property
    def stream_process(self) -> bool:
        """Whether the agents' streams are read by a worker process (endpoints/worker.py) rather than in this loop."""
        return self.connections.stream_process

    @property
    def stream_process_problem(self) -> str:
        """Why the stream worker could not start, if it could not (the run then reads in this process)."""
        return self.connections.stream_process_problem

    @property
    def stream_worker(self) -> StreamWorker | None:
        """The process reading the agents' streams while a run is going with `stream_process` on."""
        return self.connections.worker

    @property
    def busy_check(self) -> BusyCheck | None:
        """Asked at a stall deadline whether the server is busy; the run sets the monitor's unless one is set."""
        return self.watchdog.busy_check

    @busy_check.setter
    def busy_check(self, check: BusyCheck | None) -> None:
        self.watchdog.busy_check = check

    # ---- events -------------------------------------------------------------------------------
    @property
    def subscribers(self) -> list[Subscriber]:
        """The live list of subscribers: the hot paths hand token deltas to each directly (emit()'s frame skipped)."""
        return self._subscribers

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, event: ev.Event) -> None:
        if self.scrub:  # no key configured: nothing to look for
            event = self.scrub.record(event)
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except Exception as exc:  # no subscriber's failure ends the run, nor keeps the others from hearing
                self.subscriber_failed(subscriber, event, exc)

    def subscriber_failed(self, subscriber: Subscriber, event: ev.Event, exc: Exception) -> None:
        """A subscriber raised (in `emit`, or handed a token delta directly): said once, on stderr (a detached
        run's run.log) and as a RunNotice, and counted. One whose output is gone (an OSError: a closed pipe or
        terminal, a full disk) is dropped, as it would fail on every event; any other (a value it did not expect)
        is kept for the events it can take."""
        key = id(subscriber)
        failures = self.subscriber_failures.get(key, 0) + 1
        self.subscriber_failures[key] = failures
        dropped = isinstance(exc, OSError)
        if dropped:  # replaced in place: a loop over the live list (emit's, a hot path's) goes on unharmed
            self._subscribers[:] = [_dropped if s is subscriber else s for s in self._subscribers]
        if failures > 1:
            return
        name = getattr(subscriber, "__qualname__", None) or type(subscriber).__name__
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        then = "it is dropped: nothing more goes to it" if dropped else "it keeps the events it can take"
        line = self.scrub(f"{name} failed on {event.kind} ({what}); the run goes on, {then}")
        with contextlib.suppress(OSError, ValueError):  # stderr may be gone with the terminal
            print(f"cerevisor-tui run: {line}", file=sys.stderr, flush=True)
        self.emit(ev.RunNotice(time.monotonic(), line, "warning", "A subscriber failed"))

    # ---- commands (live) ----------------------------------------------------------------------
    def handle(self, command: cmd.Command) -> Any:
        """Carry out an operator's command (contract/commands.py), from the console or the control socket;
        returns a small JSON-able value that says what it did, or raises ValueError (one line, for the
        client) for an agent or endpoint this run does not have, or a value out of its bounds."""
        match cmd.checked(command):
            case cmd.SetMode(mode=mode):
                self.set_mode(mode)
                return mode
            case cmd.CycleMode():
                return self.cycle_mode()
            case cmd.SetConcurrency(cap=cap):
                self.set_concurrency(cap)
                return self.scheduler.max_concurrency
            case cmd.NudgeCap(delta=delta):
                return self.nudge_cap(delta)
            case cmd.Pause():
                return self.pause()
            case cmd.Resume():
                return self.resume()
            case cmd.Kill(agent=agent, reason=reason):
                return self.kill(self._named_agent(agent), reason)
            case cmd.Release(agent=agent):
                return self.sessions.release(self._named_agent(agent))
            case cmd.Extend(agent=agent, seconds=seconds):
                return self.extend(self._named_agent(agent), seconds)
            case cmd.Retry(agent=agent):
                return self.retry(self._named_agent(agent))
            case cmd.Approve(agent=agent, call_id=call_id, scope=scope):
                self.approve(self._named_agent(agent), call_id, scope)
                return scope
            case cmd.Deny(agent=agent, call_id=call_id):
                return self.deny(self._named_agent(agent), call_id)
            case cmd.SetStall(endpoint=endpoint, policy=policy):
                return self.set_stall_policy(self._named_endpoint(endpoint), policy)
            case cmd.Stop(reason=reason):
                return self.stop(reason)
            case cmd.Probe(endpoint=endpoint, max_concurrency=cap):
                return self.probes.start(self._named_endpoint(endpoint), cap)
            case cmd.CancelProbe(endpoint=endpoint):
                return self.probes.cancel(self._named_endpoint(endpoint))
        raise ValueError(f"this run does not take {type(command).__name__}")

    def _tell_status(self, st: AgentState) -> None:
        self.emit(ev.AgentStatus(time.monotonic(), st.name, st.status))

    def _named_agent(self, name: str) -> str:
        if name not in self.agents:
            raise ValueError(f"no agent named {name!r} in this run")
        return name

    def _named_endpoint(self, name: str) -> str:
        if name not in self.endpoints:
            raise ValueError(f"no endpoint named {name!r} in this run")
        return name

    def set_mode(self, mode: Mode) -> None:
        """Switch sequential/parallel/auto now; running agents are never stopped by it."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        entering_auto = mode == "auto" and self.scheduler.mode != "auto"
        self.scheduler.set_mode(mode)
        self.emit(ev.ModeChanged(time.monotonic(), mode, self.scheduler.effective_cap, self._mode_note(mode)))
        if entering_auto and self.started_at:
            for name, ctl in self.auto.items():
                self.auto_feed.apply(name, ctl.resume())
        self.refresh_load()

    def cycle_mode(self) -> Mode:
        mode = MODES[(MODES.index(self.scheduler.mode) + 1) % len(MODES)]
        self.set_mode(mode)
        return mode

    def set_concurrency(self, cap: int) -> None:
        """Move the parallel cap; lowering it only holds admissions until fewer are running."""
        self.scheduler.set_cap(cap)
        self._emit_cap()

    def set_auto_ceiling(self, ceiling: int) -> None:
        """Auto mode's ceiling: no endpoint's live cap goes above it (nor above the endpoint's own max_cap)."""
        self.auto_ceiling = min(cmd.MAX_CAP, max(1, int(ceiling)))  # `+` held down stops at the largest cap
        for name, ctl in self.auto.items():
            change = ctl.set_ceiling(self.auto_ceiling)
            if change is not None:
                self.auto_feed.apply(name, change)
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, s.effective_cap, s.paused,
                                        reason=f"auto ceiling {self.auto_ceiling} (operator)",
                                        ceiling=self.auto_ceiling, total_cap=s.effective_cap))
        self.refresh_load()

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
        self._budget_spent = None  # resumed past its budget: the operator's call, the run goes on
        self.scheduler.set_paused(False)
        self._emit_cap()

    def kill(self, name: str, reason: str = "killed by operator") -> bool:
        """Kill an agent's running attempt (no retry follows), or drop it from the queue; in a tool call, the
        call is cancelled and the model told so."""
        st = self.agents[name]
        if st.status in FINAL:
            return False
        if name in self.sessions.by_name:
            return self.sessions.kill(name, reason)
        if st.status == "tool" and self.tools.kill(name, reason):
            return True
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
        if name in self.sessions.by_name:
            return self.sessions.extend(name, seconds)
        if st.status == "tool":
            return self.tools.extend(st, seconds if seconds is not None else self.policies[st.endpoint].extend_s)
        att = st.current
        if att is None or st.status in FINAL:
            return False
        self.watchdog.extend(st, att, seconds)
        return True

    def approve(self, name: str, call_id: str, scope: str = "once") -> None:
        """Let the agent's tool call that waits for approval run, once or for the rest of the run."""
        self.tools.approve(name, call_id, scope)

    def deny(self, name: str, call_id: str) -> None:
        """Refuse the agent's tool call that waits for approval."""
        self.tools.deny(name, call_id)

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
        self.emit(ev.StallPolicyChanged(time.monotonic(), endpoint, policy))
        for st in self.agents_on.get(endpoint, ()):
            if st.current is not None:
                st.current.look_again()  # the watchdog recomputes the deadline under the new policy now
        return True

    def retry(self, name: str) -> str:
        """Restart a running agent's attempt now, or run a failed/killed agent of the current wave again."""
        st = self.agents[name]
        if name in self.sessions.by_name:  # refused, so an attached console says it as it says any refusal
            raise ValueError(f"{name} is a gateway session: it is retried by its harness, never by the gateway")
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

    def stop(self, reason: str = "run stopped", *, status: FinalStatus = "cancelled") -> None:
        """Stop the run: no more admissions; running and queued agents end as `status` (cancelled), connections
        closed."""
        if self.stopping or self.ended:
            return
        self.stopping, self.stop_status = reason, status
        self.scheduler.set_paused(True)
        self.emit(ev.RunStopping(time.monotonic(), reason))
        self.sessions.stop(reason)
        if self._stop_asked is not None:
            self._stop_asked.set()
        for st in self.agents.values():
            if st.status not in FINAL and st.scope is not None:
                st.end_status, st.end_reason = status, reason
                if st.current is not None:
                    st.current.kill("operator", reason, by_operator=True)
                st.scope.cancel()

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> int:
        """Run every wave; returns the exit code (0 all completed, 1 some failed or were killed)."""
        self.started_at = time.monotonic()
        self._stop_asked = anyio.Event()
        async with AsyncExitStack() as stack:
            await self.connections.open(stack)
            await self.tool_servers.open(stack)
            self.emit(self.started_event(time.monotonic()))
            if 0 < self.config.run.budget_usd <= self.run_cost_usd:  # a resumed run already spent it
                self._budget_reached(self.run_cost_usd)
            if self.stream_process_problem:
                self.emit(ev.RunNotice(time.monotonic(), f"{self.stream_process_problem}. Reading the streams in "
                                       "this process instead.", "warning", "Stream worker"))
            self.refresh_load()
            if self._history:
                self.report.replay(self._history)
            for name, why in self.rerun.items():
                self.emit(ev.AgentRerun(time.monotonic(), name, why))
            if self.scheduler.mode == "auto":
                for name, ctl in self.auto.items():
                    self.auto_feed.apply(name, Change(ctl.cap, ctl.start_reason))
            async with anyio.create_task_group() as background:
                self.background = background
                await self._start_background(background)
                # each endpoint's agents are admitted when its own warm-up ends; the waves start now
                await background.start(functools.partial(warm_up, self.config, self.connections, self.policies,
                                                         self.emit, self.conversations.request_prefix,
                                                         self.scheduler, self.wedges, reused=self.completed_before))
                for wave, level in enumerate(self.waves):
                    if self.stopping:
                        self._cancel_rest(wave)
                        break
                    await self._run_wave(wave, [self.agents[a.name] for a in level])
                if self.hold_open and not self.stopping:  # a gateway's run serves until it is stopped
                    await self._stop_asked.wait()
                background.cancel_scope.cancel()
            self.background = None
        self.sessions.finish()
        workflow = [st for st in self.agents.values() if st.name not in self.sessions.by_name]
        code = 0 if all(st.status == "completed" for st in workflow) else 1
        if self.stopping and not (self.hold_open and not workflow):  # a gateway alone ends by being stopped
            code = 1
        end = time.monotonic()
        self.report.finish(end)
        self.ended = True
        self.emit(ev.RunFinished(end, self.run_id, code, self.report.totals()))
        return code

    def in_flight(self) -> list[ev.TokenDelta]:
        """Each running attempt's answer so far, as one TokenDelta at its last sign of life (for a console that
        attaches mid-answer: the journal has only finished answers)."""
        return [ev.TokenDelta(att.last_alive, st.name, att.number, "".join(att.parts), "".join(att.thinking),
                              "".join(att.tools), att.tokens)
                for st in self.agents.values()
                if (att := st.current) is not None and (att.parts or att.thinking or att.tools)]

    def started_event(self, t: float) -> ev.RunStarted:
        """The run's RunStarted: its plan (waves, agents, endpoints) and settings, as a console first sees it."""
        return ev.RunStarted(
            t, self.run_id, self.scheduler.mode, self.scheduler.max_concurrency,
            [[a.name for a in level] for level in self.waves], self.endpoint_summaries(), self.run_dir,
            self._mode_note(self.scheduler.mode),
            agents={st.name: ev.AgentPlan(st.pool or st.endpoint, st.wave, st.turns, st.pool)
                    for st in self.agents.values()},
            reused=list(self.completed_before), auto_ceiling=self.auto_ceiling, paused=self.scheduler.paused,
            effective_cap=self.scheduler.effective_cap,
        )

    async def _start_background(self, group: anyio.abc.TaskGroup) -> None:
        """Tasks that live as long as the run: each local endpoint's /health and /metrics, polled; the box's GPUs."""
        for ep in self.config.endpoints:
            if ep.kind != "hosted":
                group.start_soon(self.monitor.run, ep.name, self._on_sample)
            group.start_soon(self.auto_feed.run, ep.name)
        group.start_soon(self.monitor.run_gpus)
        self.sessions.started(group)
        if self.busy_check is None:
            self.busy_check = self.monitor.busy
        if self.watchdog.server_life is None:  # an estimated prefill is extended while the server shows life
            self.watchdog.server_life = self.monitor.shows_life

    def _on_sample(self, endpoint: str) -> None:
        """After each server sample: the wedge rules first (a wedged pool member stays down), then the pools."""
        self.wedges.on_sample(endpoint)
        self.pools.on_sample(endpoint)

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
            est, "" if est else self.load_notes.get(endpoint, ""),
            load.cap_warning(endpoint, cap, est))

    def refresh_load(self, endpoint: str | None = None) -> None:
        """Send a LoadChanged for each endpoint (or `endpoint`) whose load, as shown, changed."""
        for name in (endpoint,) if endpoint is not None else self.endpoints:
            event = self.load_event(name)
            sent = self._load_sent.get(name)
            if sent is None or msgspec.structs.replace(sent, t=event.t) != event:
                self._load_sent[name] = event
                self.emit(event)

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
                    self._finish(st, self.stop_status, self.stopping)
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
                    self._finish(st, self.stop_status, self.stopping)

    async def _run_agent(self, st: AgentState) -> None:
        if self.stopping:  # spawned in the same instant the run was stopped
            self._finish(st, self.stop_status, self.stopping)
            return
        move(st, "queued")
        self.emit(ev.AgentQueued(time.monotonic(), st.name, st.wave))
        if self.stopping:  # stopped by that very event (a journal that could not write it): no scope to cancel yet
            self._finish(st, self.stop_status, self.stopping)
            return
        status: FinalStatus = "completed"
        reason = ""
        with anyio.CancelScope() as scope:
            st.scope = scope
            try:
                try:
                    async with self.scheduler.slot(st.name, st.pool or st.endpoint) as where:
                        if st.pool:
                            self.pools.placed(st, where)
                        st.started_at = time.monotonic()
                        self.refresh_load(st.endpoint)
                        await self.conversations.run(st)
                finally:
                    self.refresh_load(st.endpoint)
            except AgentEnded as end:
                status, reason = end.status, end.reason
        st.scope = None
        if scope.cancelled_caught:
            status, reason = st.end_status or "cancelled", st.end_reason or "cancelled"
        if status == "completed":
            self._finish(st, status, reason, st.output, resume.agent_inputs(self.config, st.config, self.render))
        else:
            self._finish(st, status, reason)

    def _finish(self, st: AgentState, status: FinalStatus, reason: str, output: str = "",
                inputs: dict[str, str] | None = None) -> None:
        move(st, status)
        st.error, st.output = reason, output
        st.current = None
        st.finished_at = time.monotonic()
        self.emit(ev.AgentFinished(time.monotonic(), st.name, status, reason, output, inputs or {}))
        self.end_if_budget_spent()

    def _reset(self, st: AgentState) -> None:
        move(st, "reset")
        st.error, st.output, st.end_status, st.end_reason = "", "", None, ""
        st.retries_used = 0
        st.turn = 0
        st.messages = []

    def render(self, text: str) -> str:
        """Insert dependencies' final answers for {{ name.output }}."""
        return OUTPUT_REF.sub(lambda m: self.agents[m.group(1)].output, text)

    def _budget_reached(self, spent_usd: float) -> None:
        """[run] budget_usd is spent: admissions pause (running agents finish, nothing is killed); the operator
        may resume past it. A run in the foreground with no console attached ends once what runs has finished."""
        self.pause()
        self._budget_spent = spent_usd
        then = (" With no console attached by the time they have, the run ends there: the agents not admitted are "
                "skipped." if self.consoles_attached is not None else "")
        self.emit(ev.RunNotice(time.monotonic(), f"Budget reached: ${spent_usd:.4f} of ${self.config.run.budget_usd:g} "
                               f"spent. No new agent is admitted; running agents finish.{then} Resume (p, in a console: "
                               f"cerevisor-tui attach {self.run_id}) to go on past it, or stop the run "
                               f"(cerevisor-tui stop {self.run_id}).", "warning", "Budget reached"))
        self.end_if_budget_spent()

    def _budget_near(self, spent_usd: float) -> None:
        """80% of [run] budget_usd is spent: said once, before admissions pause at all of it."""
        limit = self.config.run.budget_usd
        self.emit(ev.RunNotice(time.monotonic(), f"Budget: ${spent_usd:.4f} of ${limit:g} spent ({spent_usd / limit:.0%}). "
                               "At all of it no new agent or session request is admitted.", "warning", "Budget"))

    def budget_refusal(self) -> str:
        """Why a gateway session's request is refused for the run's budget ("" when it is not): held by the budget
        and not resumed past it by the operator."""
        if self._budget_spent is None or not self.scheduler.paused:
            return ""
        return (f"the run's budget is spent (${self.run_cost_usd:.4f} of ${self.config.run.budget_usd:g}, "
                "[run] budget_usd); the operator may resume past it")

    def end_if_budget_spent(self) -> None:
        """A foreground run held by its spent budget, with nothing running and no console attached to resume it,
        waits for no one: it ends, and the agents it never admitted are skipped, with the budget as the reason."""
        if (self._budget_spent is None or self.consoles_attached is None or not self.scheduler.paused
                or self.scheduler.running or self.stopping or self.ended or self.consoles_attached()):
            return
        self.stop(f"budget reached (${self._budget_spent:.4f} of ${self.config.run.budget_usd:.4f})",
                  status="skipped")

    # ---- endpoints ----------------------------------------------------------------------------
    def endpoint_summaries(self) -> list[ev.EndpointSummary]:
        """Endpoints as consoles and the report show them: never the key, only the variable's name."""
        return [
            ev.EndpointSummary(ep.name, ep.kind, self.base_urls.get(ep.name, ep.base_url),
                               self.models.get(ep.name, ep.model), ep.max_concurrency, ep.api_key_env,
                               self.policies[ep.name], ep.price_in_per_mtok if ep.priced else 0.0,
                               ep.price_out_per_mtok if ep.priced else 0.0)
            for ep in self.config.endpoints
        ]

    def _emit_cap(self) -> None:
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, s.effective_cap, s.paused,
                                        total_cap=s.effective_cap))
        self.refresh_load()

    @staticmethod
    def _mode_note(mode: Mode) -> str:
        return "each endpoint's cap follows what its server sustains; +/- move the ceiling" if mode == "auto" else ""



def _dropped(event: ev.Event) -> None:
    """Stands where a subscriber was dropped (Engine.subscriber_failed): hears nothing."""


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
