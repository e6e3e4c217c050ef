"""The engine: runs a workflow's waves through the scheduler, one conversation per agent, and tells
everything it does as events; commands change it live.

The engine owns no clock but `time.monotonic()` and no UI: a console, a headless printer, a journal
and a report all subscribe to the same events. Its parts, each in a module of its own and handed what it
needs of the engine's state: the endpoints' connections (engine/connections.py), the server monitor
(engine/monitor.py), the stall watchdog (engine/watchdog.py) and each agent's conversation and attempts
(engine/conversation.py). This module keeps the commands, the waves, auto mode's feed and the run loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import secrets
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from pydantic import ValidationError

from cerevisor_tui.config.graph import OUTPUT_REF, wave_levels
from cerevisor_tui.config.models import AgentConfig, Config, EndpointConfig, ResolvedStall, resolve_stall
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.errors import EndpointError
from cerevisor_tui.endpoints.metrics import ServerStatus
from cerevisor_tui.engine import load
from cerevisor_tui.engine.auto import AutoController, Change, Signals
from cerevisor_tui.engine.connections import Connections, api_key, wants_stream_process
from cerevisor_tui.engine.conversation import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    RETRY_AFTER_CAP_S,
    WAIT_BACKOFF_CAP_S,
    AgentEnded,
    Conversations,
    Subscriber,
    TurnFigures,
    request_id,
)
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.engine.placement import HOSTED_DOWN_S, MemberLoad, Placement
from cerevisor_tui.engine.scheduler import Scheduler
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.toolcalls import AskPolicy, ToolCalls, ToolMemory
from cerevisor_tui.engine.watchdog import BusyCheck, Watchdog, fmt_s
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
                 completed: dict[str, str] | None = None, history: list[dict[str, Any]] | None = None,
                 spent_usd: float = 0.0, stream_process: bool = False, ask: AskPolicy = "operator") -> None:
        self.config = config
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
        self.policies: dict[str, ResolvedStall] = {
            ep.name: resolve_stall(config.stall, ep) for ep in config.endpoints
        }
        self.scheduler = Scheduler(
            config.run.mode, config.run.max_concurrency, {ep.name: ep.max_concurrency for ep in config.endpoints},
            pools={p.name: list(p.endpoints) for p in config.pools}, place=self._place,
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
            if not st.pool:  # a pool's agent joins its member's list once placed
                self._agents_on.setdefault(st.endpoint, []).append(st)
        # what each endpoint's turns measured (rejections, TTFTs, tokens per character and per answer): auto's figures
        self.figures: dict[str, TurnFigures] = {ep.name: TurnFigures() for ep in config.endpoints}
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
        self._wave_group: anyio.abc.TaskGroup | None = None
        # every form of the run's API keys, taken out of whatever text enters the run (config/secrets.py)
        # (and the variables the MCP servers are given: a server's own token must not reach the screen either)
        self.scrub = Scrubber.from_env([*(ep.api_key_env for ep in config.endpoints),
                                        *(name for server in config.mcp_servers for name in server.env)])
        # MCP tool servers, those an agent lists: started when the run opens, ended with it (tools/manager.py).
        # `ask`: what a tool call its server's rules `ask` about gets: the operator's answer, or headless, deny
        # or approve. A resumed run takes its earlier calls' results and "for the run" approvals from the journal.
        used = {tool.split(".", 1)[0] for agent in config.agents for tool in agent.tools}
        self.tool_servers = McpServers(config.mcp_servers, used, log_dir=run_dir)
        self.tools = ToolCalls(self.tool_servers, emit=self.emit, scrub=self.scrub, ask=ask,
                               memory=_tool_memory(run_dir) if used else None)
        # The run's parts, each handed what it needs of the engine's state (the same objects, not copies).
        self.connections = Connections(config, self.emit, stream_process=stream_process)
        self.base_urls = self.connections.base_urls  # the simulator's, once it is started
        self.models = self.connections.models  # configured, or resolved from /v1/models
        self.monitor = ServerMonitor(config, self.connections, self.emit, self.projected_context)
        # KV load per endpoint: the configured estimate, replaced by the server's own capacity when it reports one
        self.load = self.monitor.load
        self.load_notes = self.monitor.load_notes
        self.last_sample = self.monitor.last_sample
        self.server_status = self.monitor.status
        self.server_status_at = self.monitor.status_at
        self.watchdog = Watchdog(self.policies, self.emit)
        self.conversations = Conversations(
            run_id=self.run_id, endpoints=self.endpoints, policies=self.policies, connections=self.connections,
            watchdog=self.watchdog, figures=self.figures, emit=self.emit, subscribers=self._subscribers,
            scrub=self.scrub, render=self.render, stopping=lambda: self.stopping, relocate=self.relocate,
            tools=self.tools)
        self.conversations.run_cost_usd = spent_usd  # a resumed run's spending counts on from the journal's

    @property
    def run_cost_usd(self) -> float:
        """What the run's requests cost so far on priced endpoints."""
        return self.conversations.run_cost_usd

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
    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, event: ev.Event) -> None:
        if self.scrub:  # no key configured: nothing to look for
            event = self.scrub.record(event)
        for subscriber in self._subscribers:
            subscriber(event)

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
                return self.set_stall_policy(self._named_endpoint(endpoint), _checked_stall(policy))
            case cmd.Stop(reason=reason):
                return self.stop(reason)
            case cmd.Probe(endpoint=endpoint, max_concurrency=cap):
                return self.start_probe(self._named_endpoint(endpoint), cap)
            case cmd.CancelProbe(endpoint=endpoint):
                return self.cancel_probe(self._named_endpoint(endpoint))
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
                self._apply_auto(name, ctl.resume())
        self._refresh_load()

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
        """Kill an agent's running attempt (no retry follows), or drop it from the queue; in a tool call, the
        call is cancelled and the model told so."""
        st = self.agents[name]
        if st.status in FINAL:
            return False
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
        self.emit(ev.StallPolicyChanged(time.monotonic(), endpoint, policy.model_dump()))
        for st in self._agents_on.get(endpoint, ()):
            if st.current is not None:
                st.current.look_again()  # the watchdog recomputes the deadline under the new policy now
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
        self.conversations.budget_usd = self.config.run.budget_usd
        self.conversations.on_budget = self._budget_reached
        async with AsyncExitStack() as stack:
            await self.connections.open(stack)
            await self.tool_servers.open(stack)
            self.emit(self.started_event(time.monotonic()))
            if 0 < self.config.run.budget_usd <= self.run_cost_usd:  # a resumed run already spent it
                self._budget_reached(self.run_cost_usd)
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
            agents={st.name: {"endpoint": st.pool or st.endpoint, "wave": st.wave, "turns": st.turns,
                              **({"pool": st.pool} if st.pool else {})}
                    for st in self.agents.values()},
            reused=list(self.completed_before), auto_ceiling=self.auto_ceiling, paused=self.scheduler.paused,
            effective_cap=self.scheduler.effective_cap,
        )

    async def _start_background(self, group: anyio.abc.TaskGroup) -> None:
        """Tasks that live as long as the run: each local endpoint's /health and /metrics, polled; the box's GPUs."""
        for ep in self.config.endpoints:
            if ep.kind != "hosted":
                group.start_soon(self.monitor.run, ep.name, self._on_sample)
            group.start_soon(self._auto_loop, ep.name)
        group.start_soon(self.monitor.run_gpus)
        if self.busy_check is None:
            self.busy_check = self.monitor.busy

    async def read_server(self, endpoint: str) -> ServerStatus:
        """One look at the endpoint's /health and /metrics (see ServerMonitor.read)."""
        return await self.monitor.read(endpoint)

    async def probe(self, endpoint: str, *, on_progress: Callable[[str], None] | None = None,
                    on_level: Callable[[Any], None] | None = None, max_concurrency: int | None = None) -> Any:
        """Run `cerevisor-tui probe` against one of the run's endpoints (for the console); returns a ProbeResult.

        Only while the run is open (its HTTP clients exist). Raises EndpointError when the endpoint is unusable.
        """
        from cerevisor_tui.endpoints.probe import ProbeSettings, probe_conversations

        if endpoint not in self.connections.clients:
            raise EndpointError(endpoint, "the run is not open: probe it with `cerevisor-tui probe URL`")
        ep = self.endpoints[endpoint]
        settings = ProbeSettings(max_concurrency=max_concurrency or max(2, ep.max_concurrency),
                                 extra_body=ep.extra_body)
        # shaped like this endpoint's agents (their prompts, turns, growing conversations); none: single requests
        agents = [st.config for st in self._agents_on.get(endpoint, ())]
        return await probe_conversations(
            self.connections.clients[endpoint], self.base_urls[endpoint], agents, model=self.models.get(endpoint) or None,
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
            if sent is None or msgspec.structs.replace(sent, t=event.t) != event:
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
        if self._background is None or self.stopping or endpoint not in self.connections.clients:
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
        figures = self.figures[endpoint]
        ttfts = sorted(figures.ttfts)
        watched = self.endpoints[endpoint].kind != "hosted"
        kv_tokens = sample.kv_cache_tokens if sample is not None else None
        if not kv_tokens and self.load.get(endpoint) is not None:
            kv_tokens = self.load[endpoint].kv_capacity_tokens
        return Signals(
            t=time.monotonic(), tokens=sum(st.tokens for st in states),
            running=self.scheduler.running_by_endpoint.get(endpoint, 0), queued=self.scheduler.queued_for(endpoint),
            cold=sum(1 for st in states if st.started_at is not None and st.ttft_s is None and st.status not in FINAL),
            errors=figures.rejections, ttft_p50=ttfts[len(ttfts) // 2] if ttfts else None,
            sample=self.monitor.samples[endpoint],
            server_ok=(sample.healthy if sample is not None else False) if watched else None,
            waiting=sample.waiting if sample else None, server_running=sample.running if sample else None,
            kv_usage=sample.kv_cache_usage if sample else None, preemptions=sample.preemptions if sample else None,
            prefix_hit_rate=sample.prefix_hit_rate if sample else None, kv_tokens=kv_tokens,
            slots=sample.slots_total if sample else None, context_tokens=self.projected_context(endpoint),
            turn_tokens=figures.answer_length(),
        )

    def projected_context(self, endpoint: str) -> float | None:
        """The mean full length, in tokens, of the conversations of `endpoint`'s agents still to run or running
        in the current wave: what each has sent so far by the server's own count, plus its turns to come (at
        the measured tokens per character) and their answers (at the measured answer length)."""
        figures = self.figures[endpoint]
        per_char = figures.tokens_per_char()
        measured = figures.answer_length()
        total, count = 0.0, 0
        for st in self._agents_on.get(endpoint, ()):
            if st.status in FINAL or (st.wave != self.wave and st.status == "pending"):
                continue
            cfg = st.config
            answer = measured if measured is not None else cfg.max_tokens
            texts = [cfg.prompt, *cfg.turns]
            if st.turns_done:
                base = st.last_prompt_tokens + st.last_completion_tokens
                rest = texts[st.turns_done:]
            else:
                base, rest = len(cfg.system) * per_char, texts
            total += base + sum(map(len, rest)) * per_char + answer * len(rest)
            count += 1
        return total / count if count else None

    def _apply_auto(self, endpoint: str, change: Change) -> None:
        self.scheduler.set_endpoint_cap(endpoint, change.cap)
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, change.cap, s.paused,
                                        endpoint=endpoint, reason=change.reason, ceiling=self.auto_ceiling,
                                        total_cap=s.effective_cap))
        self._refresh_load(endpoint)

    async def _server_busy(self, endpoint: str, since: float = -math.inf) -> str | None:
        """The run's own busy check (ServerMonitor.busy)."""
        return await self.monitor.busy(endpoint, since)

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
        status: FinalStatus = "completed"
        reason = ""
        with anyio.CancelScope() as scope:
            st.scope = scope
            try:
                try:
                    async with self.scheduler.slot(st.name, st.pool or st.endpoint) as where:
                        if st.pool:
                            self._placed(st, where)
                        st.started_at = time.monotonic()
                        self._refresh_load(st.endpoint)
                        await self.conversations.run(st)
                finally:
                    self._refresh_load(st.endpoint)
            except AgentEnded as end:
                status, reason = end.status, end.reason
        st.scope = None
        if scope.cancelled_caught:
            status, reason = st.end_status or "cancelled", st.end_reason or "cancelled"
        if status == "completed":
            self._finish(st, status, reason, st.output, self.agent_inputs(st.config))
        else:
            self._finish(st, status, reason)

    def _finish(self, st: AgentState, status: FinalStatus, reason: str, output: str = "",
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
            "endpoint": cfg.endpoint if self.config.agent_pool(cfg) else ep.name,  # a pool: any member will do
            "model": ep.model,  # as configured: "" is the first /v1/models lists
            "max_tokens": str(cfg.max_tokens),
            "temperature": str(cfg.temperature),
            "extra_body": json.dumps({**ep.extra_body, **cfg.extra_body}, sort_keys=True),
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

    def _budget_reached(self, spent_usd: float) -> None:
        """[run] budget_usd is spent: admissions pause (running agents finish, nothing is killed); the operator
        may resume past it."""
        self.pause()
        self.emit(ev.RunNotice(time.monotonic(), f"Budget reached: ${spent_usd:.4f} of ${self.config.run.budget_usd:g} "
                               "spent. No new agent is admitted; running agents finish. Resume (p, in a console: "
                               f"cerevisor-tui attach {self.run_id}) to go on past it, or stop the run "
                               f"(cerevisor-tui stop {self.run_id}).", "warning", "Budget reached"))

    # ---- pools ------------------------------------------------------------------------------------
    def member_loads(self, pool: str) -> list[MemberLoad]:
        """What placement weighs of each member of `pool` now: our agents there, its cap, its last sample."""
        loads = []
        for name in self.placement.members(pool):
            sample = self.last_sample.get(name)
            loads.append(MemberLoad(name, self.scheduler.running_by_endpoint.get(name, 0),
                                    self.scheduler.endpoint_cap(name), sample.waiting if sample else None,
                                    sample.kv_cache_usage if sample else None))
        return loads

    def _place(self, agent: str, pool: str) -> str | None:
        """The scheduler asks: the member of `pool` that `agent`, admitted now, goes to (None: none has room)."""
        chosen = self.placement.choose(pool, self.member_loads(pool), time.monotonic())
        return chosen.name if chosen is not None else None

    def _placed(self, st: AgentState, member: str, moved_from: str = "", reason: str = "") -> None:
        if st in self._agents_on.get(st.endpoint, ()):
            self._agents_on[st.endpoint].remove(st)
        st.endpoint = member
        self._agents_on.setdefault(member, []).append(st)
        self.emit(ev.AgentPlaced(time.monotonic(), st.name, member, st.pool, moved_from, reason))

    def relocate(self, st: AgentState, refused: str = "") -> bool:
        """Move a pool's agent off its member when that member is down: `refused` is why its connection was just
        refused (the member is marked down by it), else the agent moves only if its member is already marked
        down (a failed health check). Returns whether it moved; it stays where it is when no other member is up."""
        member, now = st.endpoint, time.monotonic()
        if not st.pool:
            return False
        if refused:
            until = now + HOSTED_DOWN_S if self.endpoints[member].kind == "hosted" else math.inf
            if self.placement.mark_down(member, f"refused a connection: {refused}", until=until):
                self._tell_down(member)
        elif not self.placement.is_down(member, now):
            return False
        target = self.placement.move_target(st.pool, self.member_loads(st.pool), member, now)
        if target is None:
            return False
        self.scheduler.move(st.name, target.name)
        why = self.placement.down.get(member, "down")
        self._placed(st, target.name, member, f"moved from {member}, which {why}; its prefix cache there is lost "
                                              f"and {target.name} computes the conversation afresh")
        self._refresh_load(member)
        self._refresh_load(target.name)
        return True

    def _on_sample(self, endpoint: str) -> None:
        """After each server sample: a pool member's health decides whether placement counts it as down."""
        sample = self.last_sample.get(endpoint)
        if sample is not None and self.placement.pools_of(endpoint):
            if sample.healthy:
                if self.placement.mark_up(endpoint):
                    self.emit(ev.RunNotice(time.monotonic(), f"{endpoint} is healthy again: pool agents may be "
                                           "placed on it", "information", "Pool member up"))
            elif self.placement.mark_down(endpoint, f"failed its health check ({sample.detail or 'unhealthy'})"):
                self._tell_down(endpoint)
        self._refresh_load(endpoint)

    def _tell_down(self, member: str) -> None:
        self.emit(ev.RunNotice(time.monotonic(), f"{member} {self.placement.down[member]}: no new agent goes "
                               "there, and its agents move at their next attempt", "warning", "Pool member down"))

    # ---- endpoints ----------------------------------------------------------------------------
    def endpoint_summaries(self) -> list[dict[str, Any]]:
        """Endpoints as the report shows them: never the key, only the variable's name."""
        return [
            {"name": ep.name, "kind": ep.kind, "base_url": self.base_urls.get(ep.name, ep.base_url),
             "model": self.models.get(ep.name, ep.model), "max_concurrency": ep.max_concurrency,
             "api_key_env": ep.api_key_env, "stall": self.policies[ep.name].model_dump(),
             **({"price_in_per_mtok": ep.price_in_per_mtok, "price_out_per_mtok": ep.price_out_per_mtok}
                if ep.priced else {})}
            for ep in self.config.endpoints
        ]

    def _emit_cap(self) -> None:
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, s.effective_cap, s.paused,
                                        total_cap=s.effective_cap))
        self._refresh_load()

    @staticmethod
    def _mode_note(mode: Mode) -> str:
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


def _tool_memory(run_dir: str) -> ToolMemory | None:
    """What an earlier run in this run directory got from its tools (a resumed run); None: nothing."""
    if not run_dir or not (Path(run_dir) / "events.jsonl").is_file():
        return None
    from cerevisor_tui.engine.sinks.journal import read_records

    try:
        records, _ = read_records(run_dir)
    except Exception:  # noqa: BLE001 - unreadable: the journal's own reader says so; calls simply run again
        return None
    return ToolMemory.from_records(records)


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


def _checked_stall(policy: dict[str, Any]) -> ResolvedStall:
    """A stall policy from a command, checked as `[stall]` is; ValueError names the key that does not."""
    try:
        return ResolvedStall.model_validate(policy)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "policy"
        raise ValueError(f"set_stall: {where}: {first['msg']}") from None
