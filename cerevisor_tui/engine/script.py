"""Scripted agents: an agent of the run whose turns come from a script rather than its config's text (a replay's
session, commands/replay.py). The script says when the agent arrives, the gap before each turn, and each turn's
whole request; everything else (admission, mode and cap, attempts, the watchdog, retries, the journal, the report)
is the run's, as for any agent.

A turn's messages are built when it is sent and let go after its answer: an agent holds one prompt at a time (the
one a retry resends), never its conversation's every turn, and the journal records the script's reference for a
turn's prompt (a replay's block ids and length) rather than its text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import anyio

if TYPE_CHECKING:
    from cerevisor_tui.engine.roster import Roster
    from cerevisor_tui.engine.state import AgentState


class TurnScript(Protocol):
    """What a scripted agent's conversation asks of its script, turns numbered from 1."""

    @property
    def turns(self) -> int: ...

    async def arrive(self) -> str:
        """Wait until the agent is to be queued (its start, its parent's spawning answer); a reason not to run it
        at all ("" : it runs)."""
        ...

    async def before(self, turn: int) -> None:
        """The gap before `turn` is sent (the agent keeps its slot meanwhile, as a person or a tool call does)."""
        ...

    def messages(self, turn: int) -> list[dict[str, Any]]:
        """The turn's whole request, built now."""
        ...

    def max_tokens(self, turn: int) -> int: ...

    def reference(self, turn: int) -> str:
        """What the journal records as the turn's user message: enough to name the prompt, not its text."""
        ...


async def arrived(st: AgentState, script: TurnScript, roster: Roster) -> bool:
    """Wait for a scripted agent's arrival before it is queued (it holds no slot meanwhile); False when it has
    ended instead: skipped for its script's reason, or killed by the operator while it waited. A run that stops
    meanwhile is its caller's to say."""
    reason = ""
    with anyio.CancelScope() as scope:
        st.scope = scope  # what a stop or a kill cancels
        reason = await script.arrive()
    st.scope = None
    if scope.cancelled_caught:
        if st.end_status is not None and st.end_status != "cancelled":
            roster.finish(st, st.end_status, st.end_reason)
            return False
        return True  # the run is stopping: its caller ends the agent as the stop says
    if reason:
        roster.finish(st, "skipped", reason)
        return False
    return True
