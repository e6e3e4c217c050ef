"""An agent's status as a state machine: one table of `(status, happening) -> status`, and `move`, the only code
that sets an agent's status (a workflow agent's and a gateway session's alike).

A pair the table does not hold changes nothing: "the deadline was extended" moves a `stalling` agent back to its
attempt's phase and leaves any other as it is. A final status is left only by `reset` (the operator's rerun).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal, get_args

from cerevisor_tui.kinds import FINAL, STATUSES, FinalStatus, Status

if TYPE_CHECKING:
    from cerevisor_tui.engine.state import AgentState

Happening = Literal[
    "queued",  # it waits for a running slot
    "sent",  # a request went out (or a tool's result goes to the model next): the prompt's prefill
    "refused",  # a local endpoint refuses its port (loading): it waits within the first-byte window
    "token",  # a sign of life with text
    "warned",  # a stall warning
    "calm_prefill",  # a stalling attempt's deadline moved (prefill progress, the operator): back to its phase
    "calm_streaming",
    "retrying",  # its attempt failed and the turn is sent again after a backoff
    "approval",  # a tool call waits for the operator
    "tool",  # a tool call executes
    "wedged",  # its attempt waits on (or was killed by) a wedged server
    "unwedged_prefill",  # the server moves again: back to its attempt's phase
    "unwedged_streaming",
    "request_gone",  # a session's request left before it was sent, while its row said `waiting`
    "idle",  # a session's request ended and it keeps its slot
    "released",  # a session gave its slot back
    "completed", "failed", "killed", "skipped", "cancelled",  # the agent ended so
    "reset",  # the operator runs an ended agent again
]
HAPPENINGS: Final[tuple[Happening, ...]] = get_args(Happening)

_LIVE: Final = tuple(s for s in STATUSES if s not in FINAL)


def _table() -> dict[tuple[Status, Happening], Status]:
    table: dict[tuple[Status, Happening], Status] = {}

    def rule(happening: Happening, to: Status, sources: tuple[Status, ...] = _LIVE) -> None:
        for source in sources:
            table[(source, happening)] = to

    rule("queued", "queued")
    rule("sent", "prefill")
    rule("refused", "waiting")
    rule("token", "streaming")
    rule("warned", "stalling")
    rule("calm_prefill", "prefill", ("stalling",))
    rule("calm_streaming", "streaming", ("stalling",))
    rule("retrying", "retrying")
    rule("approval", "approval")
    rule("tool", "tool")
    rule("wedged", "wedged")
    rule("unwedged_prefill", "prefill", ("wedged",))
    rule("unwedged_streaming", "streaming", ("wedged",))
    rule("request_gone", "idle", ("waiting",))
    rule("idle", "idle")
    rule("released", "released")
    for final in get_args(FinalStatus):
        rule(final, final, STATUSES)  # an end is said over any status (a stop's over a completed agent's too)
    rule("reset", "pending", STATUSES)
    return table


TRANSITIONS: Final[dict[tuple[Status, Happening], Status]] = _table()
"""Every move an agent's status can make."""


def move(st: AgentState, happening: Happening) -> Status:
    """Apply `happening` to the agent's status, as the table says (AgentStatus told through the agent's
    `on_status`); returns the status it has now."""
    to = TRANSITIONS.get((st.status, happening))
    if to is not None and to != st.status:
        st._status = to
        if st.on_status is not None:
            st.on_status(st)
    return st.status


def phase_of(first_token_at: float | None, *, wedge: bool = False) -> Happening:
    """The happening that takes a stalling (or, with `wedge`, a wedged) agent back to its attempt's phase."""
    if wedge:
        return "unwedged_streaming" if first_token_at is not None else "unwedged_prefill"
    return "calm_streaming" if first_token_at is not None else "calm_prefill"
