"""The deadline rules, as pure functions of times: where an attempt's stall window starts and how long it is,
and which warnings on the way to a deadline are due. The engine's watchdog decides by them and the console's
mirror draws its countdown by them, so the two cannot drift apart.

Every time is a `time.monotonic()` value of the run's host, passed in: tests drive the rules with any clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

Phase = Literal["first_byte", "idle"]


class Window(NamedTuple):
    """The stall window an attempt is in: its phase, when it began, and how long it is (extensions aside)."""

    phase: Phase
    base: float
    window_s: float


def stream_window(*, sent_at: float, last_alive: float, first_token_at: float | None, by_bytes: bool,
                  first_byte_s: float, idle_s: float) -> Window:
    """An attempt is in its first-byte window from the request's sending until its first sign of life (a token;
    with liveness "bytes" any byte), then in an idle window from its last sign of life."""
    if first_token_at is None and not (by_bytes and last_alive > sent_at):
        return Window("first_byte", sent_at, first_byte_s)
    return Window("idle", last_alive, idle_s)


def warnings_due(fractions: Sequence[float], base: float, total_s: float, now: float) -> int:
    """How many of the warnings at `fractions` (ascending) of a `total_s` window from `base` are due at `now`:
    after an extension or a policy change, the warnings still ahead re-arm and the ones passed stay given."""
    return sum(1 for f in fractions if now >= base + f * total_s)


def next_look(fractions: Sequence[float], warned: int, base: float, total_s: float) -> float:
    """When a deadline's watcher must look next: its next warning, or the deadline itself."""
    if warned < len(fractions):
        return min(base + total_s, base + fractions[warned] * total_s)
    return base + total_s
