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


PREFILL_GRACE_S = 2.0
"""The least a prefill's projection is given beyond its end: a batch that lands a little late is no stall."""
PREFILL_SLACK = 0.25
"""The share of a prefill's time left given beyond its projected end (a long prompt's later batches are slower)."""
PREFILL_MAX_TIMES = 3.0
"""The longest a prefill's progress holds a request's first byte back: this many times its projected prefill (the
whole prompt at its measured rate, or the idle window before there is a rate), from when it was sent."""
PREFILL_FROZEN_LOOK = 0.1
"""While a prefill's progress stands still, the deadline moves this share of the idle window at a time (at least
PREFILL_GRACE_S), up to the idle window from its last progress."""


class PrefillLook(NamedTuple):
    """What a deadline does with a prefill in progress: "extend" to `deadline_at`, "kill" (no progress for the
    idle window), or "none" (nothing to go by: the prefill is done, or there is no progress)."""

    action: Literal["extend", "kill", "none"]
    deadline_at: float
    reason: str


def prefill_look(*, now: float, total: int, processed: int, rate_tok_s: float | None, advanced_at: float,
                 idle_s: float, estimated: bool = False, started_at: float | None = None) -> PrefillLook:
    """At a first-byte deadline, with a prefill's progress: `processed` of `total` prompt tokens (cached ones
    included) as the server last said, `advanced_at` when `processed` last moved, at `rate_tok_s` (None: not
    measured yet).

    No progress for the idle window: stuck, kill. Otherwise the deadline moves only as far as the projected end
    (tokens left over the rate), with a slack; once the projection has passed without the prefill ending, or
    with no rate yet, in steps up to the idle window from the last progress. An `estimated` prefill (a server
    that says nothing of its own, its share from the endpoint's measured rate) is never killed by this rule.

    With `started_at` (when the request was sent), never past PREFILL_MAX_TIMES its projected prefill from then:
    a server whose progress creeps, or says a rate it does not keep, holds a request back no longer than that."""
    left = total - processed
    if total <= 0 or left <= 0:
        return PrefillLook("none", now, "")
    percent = f"~{processed / total:.0%} (est.)" if estimated else f"{processed / total:.0%}"
    silent_s = now - advanced_at
    stuck_at = advanced_at + idle_s
    if silent_s >= idle_s:
        if estimated:
            return PrefillLook("none", now, "")
        return PrefillLook("kill", now, f"no prefill progress for {fmt_s(silent_s)} (prefill {percent} of "
                                        f"{total:,} prompt tokens)")
    if started_at is not None and not estimated:
        projected_s = total / rate_tok_s if rate_tok_s else idle_s
        bound_at = started_at + PREFILL_MAX_TIMES * projected_s
        if now >= bound_at:
            return PrefillLook("kill", now, f"prefill {percent} after {fmt_s(now - started_at)}, "
                                            f"{PREFILL_MAX_TIMES:g}x its projected {fmt_s(projected_s)}")
        stuck_at = min(stuck_at, bound_at)
    if rate_tok_s is not None and rate_tok_s > 0:
        eta_s = left / rate_tok_s
        end = advanced_at + eta_s
        deadline = min(stuck_at, end + max(PREFILL_GRACE_S, PREFILL_SLACK * eta_s))
        if deadline > now:
            return PrefillLook("extend", deadline, f"prefill {percent}, {rate_tok_s:,.0f} tok/s, "
                                                   f"about {fmt_s(max(0.0, end - now))} left")
    deadline = min(stuck_at, now + max(PREFILL_GRACE_S, PREFILL_FROZEN_LOOK * idle_s))
    still = f"no progress for {fmt_s(silent_s)}" if silent_s >= PREFILL_GRACE_S else "no rate yet"
    return PrefillLook("extend", deadline, f"prefill {percent}, {still} (stuck after {fmt_s(idle_s)})")


def estimate_look(*, now: float, sent_at: float, total: int, cached: int, rate_tok_s: float,
                  alive: bool | str) -> PrefillLook:
    """At a first-byte deadline, for a server that tells no progress of its own (vLLM, SGLang): the prompt's
    `total` tokens (estimated), `cached` of them expected from the prefix cache, at the endpoint's measured
    prefill rate, from `sent_at`. While that estimate says the prompt is still plausibly prefilling (before its
    projected end and its slack) and the server shows life since the last look (`alive`: what moved, e.g. "KV use climbing"; True says KV use),
    the deadline moves to the end of that window; otherwise this rule says nothing ("none")."""
    if rate_tok_s <= 0 or total <= cached:
        return PrefillLook("none", now, "")
    eta_s = (total - cached) / rate_tok_s
    end = sent_at + eta_s
    limit = end + max(PREFILL_GRACE_S, PREFILL_SLACK * eta_s)
    if not alive or now >= limit:
        return PrefillLook("none", now, "")
    share = min(0.99, (cached + rate_tok_s * (now - sent_at)) / total)
    return PrefillLook("extend", limit, f"prefill ~{share:.0%} (est.), {rate_tok_s:,.0f} tok/s measured, "
                                        f"about {fmt_s(max(0.0, end - now))} left, "
                                        f"{alive if isinstance(alive, str) else 'KV use climbing'}")


def fmt_s(seconds: float) -> str:
    """Seconds as the operator reads them: 1800 s, 2.5 s, 0.25 s."""
    if seconds >= 10:
        return f"{seconds:.0f} s"
    return f"{seconds:.3g} s"
