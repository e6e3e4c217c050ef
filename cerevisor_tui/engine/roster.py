"""The run's agents (workflow agents and gateway sessions alike), by name and by the endpoint each is on, how
each one's end is told, and where the run is in its life. Ports the run's parts share instead of the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.state import AgentState
from cerevisor_tui.engine.status import move
from cerevisor_tui.kinds import FinalStatus


@dataclass
class RunLife:
    """Where the run is: the wave running, why it is stopping ("" : it is not), and whether it has ended."""

    wave: int = -1
    stopping: str = ""
    stop_status: FinalStatus = "cancelled"  # what the agents a stop leaves unfinished end as
    ended: bool = False  # the run has sent its RunFinished: nothing more happens, nothing more is told
    background: anyio.abc.TaskGroup | None = None  # the run's long-lived tasks (monitors, probes), while it runs


class Roster:
    """The run's agents by name (`agents`) and by the endpoint each is on now (`on`: a pool's agent joins its
    member's list once placed); `finish` is the one way an agent ends."""

    def __init__(self, emit: Callable[[ev.Event], None], clock: Clock) -> None:
        self.emit = emit
        self.clock = clock
        self.agents: dict[str, AgentState] = {}
        self.on: dict[str, list[AgentState]] = {}
        self.after_finish: Callable[[], None] = lambda: None  # told after each agent's end (the budget's check)

    def add(self, st: AgentState) -> AgentState:
        st.on_status = self.tell_status
        self.agents[st.name] = st
        if not st.pool:
            self.on.setdefault(st.endpoint, []).append(st)
        return st

    def remove(self, st: AgentState) -> None:
        if self.agents.get(st.name) is st:
            del self.agents[st.name]
        if st.endpoint in self.on:
            self.on[st.endpoint] = [a for a in self.on[st.endpoint] if a is not st]

    def place(self, st: AgentState, member: str) -> None:
        """A pool's agent is on `member` now."""
        if st in self.on.get(st.endpoint, ()):
            self.on[st.endpoint].remove(st)
        st.endpoint = member
        self.on.setdefault(member, []).append(st)

    def tell_status(self, st: AgentState) -> None:
        self.emit(ev.AgentStatus(self.clock.now(), st.name, st.status))

    def finish(self, st: AgentState, status: FinalStatus, reason: str, output: str = "",
               inputs: dict[str, str] | None = None) -> None:
        move(st, status)
        st.error, st.output = reason, output
        st.current = None
        st.finished_at = self.clock.now()
        self.emit(ev.AgentFinished(st.finished_at, st.name, status, reason, output, inputs or {}))
        self.after_finish()

    async def arrived(self, st: AgentState) -> bool:
        """Wait for a scripted agent's arrival (engine/script.py) before it is queued, holding no slot meanwhile;
        False when it has ended instead: skipped for its script's reason, or killed by the operator while it
        waited. A run that stops meanwhile is its caller's to say."""
        assert st.script is not None
        reason = ""
        with anyio.CancelScope() as scope:
            st.scope = scope  # what a stop or a kill cancels
            reason = await st.script.arrive()
        st.scope = None
        if scope.cancelled_caught:
            if st.end_status is not None and st.end_status != "cancelled":
                self.finish(st, st.end_status, st.end_reason)
                return False
            return True  # the run is stopping: its caller ends the agent as the stop says
        if reason:
            self.finish(st, "skipped", reason)
            return False
        return True

    def reset(self, st: AgentState) -> None:
        """A failed or killed agent, to run again."""
        move(st, "reset")
        st.error, st.output, st.end_status, st.end_reason = "", "", None, ""
        st.retries_used = 0
        st.turn = 0
        st.messages = []
