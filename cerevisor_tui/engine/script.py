"""Scripted agents: an agent of the run whose turns come from a script rather than its config's text (a replay's
session, commands/replay.py). The script says when the agent arrives, the gap before each turn, and each turn's
whole request; everything else (admission, mode and cap, attempts, the watchdog, retries, the journal, the report)
is the run's, as for any agent (the wait for its arrival is engine/roster.py's `Roster.arrived`).

A turn's messages are built when it is sent and let go after its answer: an agent holds one prompt at a time (the
one a retry resends), never its conversation's every turn, and the journal records the script's reference for a
turn's prompt (a replay's block ids and length) rather than its text.
"""

from __future__ import annotations

from typing import Any, Protocol


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

    def context_tokens(self) -> int:
        """The conversation's whole length at its end, in tokens (its last prompt and answer): what Auto's KV
        projection counts for it."""
        ...

    def reference(self, turn: int) -> str:
        """What the journal records as the turn's user message: enough to name the prompt, not its text."""
        ...
