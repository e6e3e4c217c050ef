"""The engine: runs a workflow's waves through the scheduler, one conversation per agent, and tells
everything it does as events; commands change it live.

Its parts are put together in engine/parts.py (the composition root), each handed the ports it uses; this
module keeps the waves, the run loop and the commands (`handle`), each carried out by the part that owns it.
"""

from __future__ import annotations

import functools
import secrets
from contextlib import AsyncExitStack
from datetime import datetime
from typing import Any

import anyio

from cerevisor_tui.config.models import Config, ResolvedStall, resolve_stall
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine import resume
from cerevisor_tui.engine.caps import mode_note
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.connections import api_key, wants_stream_process
from cerevisor_tui.engine.conversation import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    RETRY_AFTER_CAP_S,
    WAIT_BACKOFF_CAP_S,
    AgentEnded,
    Subscriber,
    request_id,
)
from cerevisor_tui.engine.gateway_settings import apply_gateway
from cerevisor_tui.engine.parts import RunParts
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.status import move
from cerevisor_tui.engine.toolcalls import AskPolicy
from cerevisor_tui.engine.warmup import warm_up
from cerevisor_tui.engine.watchdog import BusyCheck, fmt_s
from cerevisor_tui.kinds import FINAL, FinalStatus

# What other modules, tests and benchmarks import from here, wherever it lives now.
__all__ = [
    "BACKOFF_BASE_S", "BACKOFF_CAP_S", "FINAL", "RETRY_AFTER_CAP_S", "WAIT_BACKOFF_CAP_S", "AgentState", "Attempt",
    "BusyCheck", "Engine", "Subscriber", "api_key", "fmt_s", "new_run_id", "request_id", "wants_stream_process",
]


def new_run_id() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


class Engine(RunParts):
    """Run one workflow. Subscribe before `run()`; call commands from the same event loop at any time."""

    def __init__(self, config: Config, *, run_id: str | None = None, run_dir: str = "",
                 resumed: resume.JournalState | None = None, stream_process: bool = False,
                 ask: AskPolicy = "operator", clock: Clock = MONOTONIC) -> None:
        super().__init__(config, run_id=run_id or new_run_id(), run_dir=run_dir, resumed=resumed,
                         stream_process=stream_process, ask=ask, clock=clock)
        self.hold_open = config.gateway is not None  # a gateway's run serves after its waves, until it is stopped
        self.started_at = 0.0
        self._stop_asked: anyio.Event | None = None
        self._wave_group: anyio.abc.TaskGroup | None = None

    # ---- commands (live) ----------------------------------------------------------------------
    def handle(self, command: cmd.Command) -> Any:
        """Carry out an operator's command (contract/commands.py), from the console or the control socket;
        returns a small JSON-able value that says what it did, or raises ValueError (one line, for the
        client) for an agent or endpoint this run does not have, or a value out of its bounds."""
        caps = self.caps
        match cmd.checked(command):
            case cmd.SetMode(mode=mode):
                caps.set_mode(mode)
                return mode
            case cmd.CycleMode():
                return caps.cycle_mode()
            case cmd.SetConcurrency(cap=cap):
                caps.set_cap(cap)
                return self.scheduler.max_concurrency
            case cmd.NudgeCap(delta=delta):
                return caps.nudge(delta)
            case cmd.Pause():
                return caps.pause()
            case cmd.Resume():
                self.spending.resumed()  # past its budget: the operator's call, the run goes on
                return caps.pause(False)
            case cmd.Kill(agent=agent, reason=reason):
                return self.kill(self._named_agent(agent), reason)
            case cmd.Release(agent=agent):
                return self.sessions.release(self._named_agent(agent))
            case cmd.Extend(agent=agent, seconds=seconds):
                return self.extend(self._named_agent(agent), seconds)
            case cmd.Retry(agent=agent):
                return self.retry(self._named_agent(agent))
            case cmd.Approve(agent=agent, call_id=call_id, scope=scope):
                self.tools.approve(self._named_agent(agent), call_id, scope)
                return scope
            case cmd.Deny(agent=agent, call_id=call_id):
                return self.tools.deny(self._named_agent(agent), call_id)
            case cmd.SetStall(endpoint=endpoint, policy=policy):
                return self.set_stall_policy(self._named_endpoint(endpoint), policy)
            case cmd.SetGateway() as live:
                if self.config.gateway is None:
                    raise ValueError("this run serves no gateway")
                return apply_gateway(live, self.config.gateway, self.sessions, self.endpoint_states, self.emit,
                                     self.clock)
            case cmd.Stop(reason=reason):
                return self.stop(reason)
            case cmd.Probe(endpoint=endpoint, max_concurrency=cap):
                return self.probes.start(self._named_endpoint(endpoint), cap)
            case cmd.CancelProbe(endpoint=endpoint):
                return self.probes.cancel(self._named_endpoint(endpoint))
        raise ValueError(f"this run does not take {type(command).__name__}")

    def _named_agent(self, name: str) -> str:
        if name not in self.agents:
            raise ValueError(f"no agent named {name!r} in this run")
        return name

    def _named_endpoint(self, name: str) -> str:
        if name not in self.endpoints:
            raise ValueError(f"no endpoint named {name!r} in this run")
        return name

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
        self.emit(ev.StallPolicyChanged(self.clock.now(), endpoint, policy))
        for st in self.roster.on.get(endpoint, ()):
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
        if st.status in ("failed", "killed") and st.wave == self.life.wave and self._wave_group is not None:
            self.roster.reset(st)
            self._wave_group.start_soon(self._run_agent, st)
            return "queued again"
        if st.status in ("failed", "killed"):
            return "its wave has ended; use --resume to run it again"
        return f"nothing to retry ({st.status})"

    def stop(self, reason: str = "run stopped", status: FinalStatus = "cancelled") -> None:
        """Stop the run: no more admissions; running and queued agents end as `status` (cancelled), connections
        closed."""
        life = self.life
        if life.stopping or life.ended:
            return
        life.stopping, life.stop_status = reason, status
        self.scheduler.set_paused(True)
        self.emit(ev.RunStopping(self.clock.now(), reason))
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
        self.started_at = self.clock.now()
        self._stop_asked = anyio.Event()
        async with AsyncExitStack() as stack:
            await self.connections.open(stack)
            await self.tool_servers.open(stack)
            self.emit(self.started_event(self.clock.now()))
            self.spending.start()
            if self.connections.stream_process_problem:
                self.emit(ev.RunNotice(self.clock.now(), f"{self.connections.stream_process_problem}. Reading the "
                                       "streams in this process instead.", "warning", "Stream worker"))
            self.refresh_load()
            if self.history:
                self.report.replay(self.history)
            for name, why in self.rerun.items():
                self.emit(ev.AgentRerun(self.clock.now(), name, why))
            self.caps.start()
            async with anyio.create_task_group() as background:
                self.life.background = background
                self._start_background(background)
                # each endpoint's agents are admitted when its own warm-up ends; the waves start now
                await background.start(functools.partial(warm_up, self.config, self.connections, self.policies,
                                                         self.emit, self.conversations.request_prefix,
                                                         self.scheduler, self.wedges, reused=self.completed_before,
                                                         states=self.endpoint_states, clock=self.clock))
                for wave, level in enumerate(self.waves):
                    if self.life.stopping:
                        self._cancel_rest(wave)
                        break
                    await self._run_wave(wave, [self.agents[a.name] for a in level])
                if self.hold_open and not self.life.stopping:  # a gateway's run serves until it is stopped
                    await self._stop_asked.wait()
                background.cancel_scope.cancel()
            self.life.background = None
        self.sessions.finish()
        workflow = [st for st in self.agents.values() if st.name not in self.sessions.by_name]
        code = 0 if all(st.status == "completed" for st in workflow) else 1
        if self.life.stopping and not (self.hold_open and not workflow):  # a gateway alone ends by being stopped
            code = 1
        end = self.clock.now()
        self.report.finish(end)
        self.life.ended = True
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
        s = self.scheduler
        return ev.RunStarted(
            t, self.run_id, s.mode, s.max_concurrency, [[a.name for a in level] for level in self.waves],
            self.endpoint_summaries(), self.run_dir, mode_note(s.mode),
            agents={st.name: ev.AgentPlan(st.pool or st.endpoint, st.wave, st.turns, st.pool)
                    for st in self.agents.values()},
            reused=list(self.completed_before), auto_ceiling=self.caps.ceiling, paused=s.paused,
            effective_cap=s.effective_cap,
        )

    def endpoint_summaries(self) -> list[ev.EndpointSummary]:
        """Endpoints as consoles and the report show them: never the key, only the variable's name."""
        base_urls, models = self.connections.base_urls, self.connections.models  # the simulator's, resolved ones
        return [
            ev.EndpointSummary(ep.name, ep.kind, base_urls.get(ep.name, ep.base_url), models.get(ep.name, ep.model),
                               ep.max_concurrency, ep.api_key_env, self.policies[ep.name],
                               ep.price_in_per_mtok if ep.priced else 0.0, ep.price_out_per_mtok if ep.priced else 0.0)
            for ep in self.config.endpoints
        ]

    def _start_background(self, group: anyio.abc.TaskGroup) -> None:
        """Tasks that live as long as the run: each local endpoint's /health and /metrics, polled; the box's GPUs."""
        for ep in self.config.endpoints:
            if ep.kind != "hosted":
                group.start_soon(self.monitor.run, ep.name, self._on_sample)
            group.start_soon(self.auto_feed.run, ep.name)
        group.start_soon(self.monitor.run_gpus)
        self.sessions.started(group)
        if self.watchdog.busy_check is None:
            self.watchdog.busy_check = self.monitor.busy
        if self.watchdog.server_life is None:  # an estimated prefill is extended while the server shows life
            self.watchdog.server_life = self.monitor.shows_life

    def _on_sample(self, endpoint: str) -> None:
        """After each server sample: the wedge rules first (a wedged pool member stays down), then the pools."""
        self.wedges.on_sample(endpoint)
        self.pools.on_sample(endpoint)

    async def _run_wave(self, wave: int, states: list[AgentState]) -> None:
        self.life.wave = wave
        self.emit(ev.WaveStarted(self.clock.now(), wave, [st.name for st in states]))
        async with anyio.create_task_group() as group:
            self._wave_group = group
            for st in states:
                if st.name in self.completed_before:
                    self.roster.finish(st, "completed", "", self.completed_before[st.name],
                                       self.recorded_inputs.get(st.name, {}))
                    continue
                if self.life.stopping:
                    self.roster.finish(st, self.life.stop_status, self.life.stopping)
                    continue
                failed = [d for d in st.config.depends_on if self.agents[d].status != "completed"]
                if failed:
                    dep = self.agents[failed[0]]
                    self.roster.finish(st, "skipped", f"dependency {dep.name} {dep.status}")
                    continue
                group.start_soon(self._run_agent, st)
        self._wave_group = None
        self.emit(ev.WaveFinished(self.clock.now(), wave, {st.name: st.status for st in states}))

    def _cancel_rest(self, wave: int) -> None:
        """The run is stopping: every agent of the waves from `wave` on ends now, in one step (cancelled, or
        completed when a resumed run reuses its answer), without a wave's start, end or report rewrite each."""
        for level in self.waves[wave:]:
            for agent in level:
                st = self.agents[agent.name]
                if st.status in FINAL:
                    continue
                if st.name in self.completed_before:
                    self.roster.finish(st, "completed", "", self.completed_before[st.name],
                                       self.recorded_inputs.get(st.name, {}))
                else:
                    self.roster.finish(st, self.life.stop_status, self.life.stopping)

    async def _run_agent(self, st: AgentState) -> None:
        life = self.life
        if st.script is not None and not await self.roster.arrived(st):
            return
        if life.stopping:  # spawned in the same instant the run was stopped
            self.roster.finish(st, life.stop_status, life.stopping)
            return
        move(st, "queued")
        self.emit(ev.AgentQueued(self.clock.now(), st.name, st.wave))
        if life.stopping:  # stopped by that very event (a journal that could not write it): no scope to cancel yet
            self.roster.finish(st, life.stop_status, life.stopping)
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
                        st.started_at = self.clock.now()
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
            self.roster.finish(st, status, reason, st.output, resume.agent_inputs(self.config, st.config, self.render))
        else:
            self.roster.finish(st, status, reason)
