"""The stall watchdog: each attempt's two deadlines (first byte, then idle), the warnings on the way to them,
and at a deadline the question to the server (loading? queueing? then extend) before the kill.

It reads the endpoint's stall policy afresh at each look, so `Engine.set_stall` changes running attempts too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio

from cerevisor_tui.config.models import ResolvedStall
from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.deadlines import (
    PrefillLook,
    estimate_look,
    fmt_s,
    next_look,
    prefill_look,
    stream_window,
    warnings_due,
)
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.state import AgentState, Attempt, ToolCall
from cerevisor_tui.engine.status import move, phase_of

BusyCheck = Callable[[str, float], Awaitable[str | None]]  # (endpoint, since): a look older than `since` cannot say
"""Asked at a deadline with the endpoint's name: why the server is busy (loading, queueing), or None."""
BUSY_CHECK_TIMEOUT_S = 2.0  # a busy check that takes longer says nothing: the attempt is judged without it


class Watchdog:
    """Watches a run's attempts under each endpoint's live stall policy; warnings, extensions and kills are
    told through `emit`. `busy_check` answers at a deadline (None: never extend for a busy server)."""

    def __init__(self, policies: Mapping[str, ResolvedStall], emit: Callable[[ev.Event], None],
                 clock: Clock = MONOTONIC) -> None:
        self.policies = policies  # the engine's own: `set_stall` replaces an endpoint's entry
        self.emit = emit
        self.clock = clock
        self.busy_check: BusyCheck | None = None
        # (endpoint, since): the server's sign of life since then, in words ("KV use climbing"; "": none); None: never asked
        self.server_life: Callable[[str, float], str] | None = None

    async def watch(self, st: AgentState, att: Attempt, policy: ResolvedStall) -> None:
        """The stall watchdog of one attempt: warnings at fractions of the deadline, then extend or kill.
        The policy is the endpoint's current one at each look (`set_stall` changes it live)."""
        monotonic = self.clock.now
        seen_base: float | None = None
        while True:
            now = monotonic()
            changed = self.policies[st.endpoint] is not policy
            policy = self.policies[st.endpoint]
            fractions = policy.warn_at
            phase, base, window = stream_window(
                sent_at=att.sent_at, last_alive=att.last_alive, first_token_at=att.first_token_at,
                by_bytes=policy.liveness == "bytes", first_byte_s=policy.first_byte_timeout_s,
                idle_s=policy.idle_timeout_s)
            if policy.liveness == "bytes" and att.stream is not None and att.stream.last_byte_at > base:
                base = att.last_alive = att.stream.last_byte_at
            if base != seen_base:  # a sign of life: the window starts again, warnings re-arm
                if seen_base is not None:  # (not at the first look: an extension given before it stands)
                    att.extra_s = 0.0
                    att.warned = 0
                seen_base = base
            total = window + att.extra_s
            if changed:  # a longer window re-arms the warnings it moved ahead; a shorter one gives its due ones now
                att.warned = min(att.warned, warnings_due(fractions, base, total, now))
            att.phase = phase
            att.deadline_at = base + total
            att.base = base
            while att.warned < len(fractions) and now >= base + fractions[att.warned] * total:
                fraction = fractions[att.warned]
                att.warned += 1
                if phase == "first_byte" and self.prefilling(att, policy, now):
                    continue  # its prefill moves: the deadline goes as far as that projects, warned of by none
                st.stall_warnings += 1
                move(st, "warned")
                self.emit(ev.StallWarning(now, st.name, att.number, phase, fraction, max(0.0, att.deadline_at - now),
                                          att.deadline_at))
            if now >= att.deadline_at and phase == "first_byte" and att.prefill is not None:
                look = self.prefill(st, att, policy, now)
                if look.action == "kill":
                    att.kill(phase, look.reason)
                    return
                if look.action == "extend":
                    continue
            if now >= att.deadline_at and phase == "first_byte" and att.prefill is None and att.estimate is not None \
                    and policy.extend_when_server_busy and self.estimated(st, att, now):
                continue
            if now >= att.deadline_at:
                reason = await self.busy_reason(st, att, policy)
                if reason:
                    att.extensions += 1
                    att.extra_s += policy.extend_s
                    att.deadline_at += policy.extend_s
                    att.warned = warnings_due(fractions, base, total + policy.extend_s, now)
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
            delay = max(0.0, next_look(fractions, att.warned, base, total) - monotonic()) + 0.001
            with anyio.CancelScope() as att.nap, self.clock.move_on_after(delay):
                if phase == "first_byte" and not att.alive.is_set():
                    await att.alive.wait()
                else:
                    await anyio.sleep_forever()
            att.nap = None

    @staticmethod
    def prefilling(att: Attempt, policy: ResolvedStall, now: float) -> bool:
        """The attempt's prefill is moving, by the server's word: its deadline would be extended at this moment."""
        p = att.prefill
        return p is not None and prefill_look(now=now, total=p.total, processed=p.processed, rate_tok_s=p.rate_tok_s,
                                              advanced_at=p.advanced_at, idle_s=policy.idle_timeout_s,
                                              started_at=att.sent_at).action == "extend"

    def prefill(self, st: AgentState, att: Attempt, policy: ResolvedStall, now: float) -> PrefillLook:
        """At a first-byte deadline, the prefill the server tells of (prompt_progress): extend the deadline as far
        as its projected end (told as a StallExtended that says how far it is), or say it is stuck."""
        p = att.prefill
        assert p is not None
        look = prefill_look(now=now, total=p.total, processed=p.processed, rate_tok_s=p.rate_tok_s,
                            advanced_at=p.advanced_at, idle_s=policy.idle_timeout_s, started_at=att.sent_at)
        if look.action == "extend":
            extend_s = look.deadline_at - att.deadline_at
            att.extra_s += extend_s
            att.deadline_at = look.deadline_at
            # the projection is the deadline: no warnings on the way to it (a stuck prefill says so at its kill)
            att.warned = len(policy.warn_at)
            move(st, "calm_prefill")
            self.emit(ev.StallExtended(now, st.name, att.number, "first_byte", extend_s, look.reason,
                                       att.deadline_at, att.extensions))
        return look

    def estimated(self, st: AgentState, att: Attempt, now: float) -> bool:
        """At a first-byte deadline, a prefill the server tells nothing of: extended while the endpoint's measured
        rate says the prompt is still plausibly prefilling and the server shows life (its KV use climbing). Like
        the busy check, only with `extend_when_server_busy`: an estimate is not the server's word."""
        e = att.estimate
        assert e is not None
        alive = self.server_life(st.endpoint, e.looked_at) if self.server_life is not None else ""
        e.looked_at = now
        look = estimate_look(now=now, sent_at=e.sent_at, total=e.total, cached=e.cached, rate_tok_s=e.rate_tok_s,
                             alive=alive)
        if look.action != "extend":
            return False
        extend_s = look.deadline_at - att.deadline_at
        att.extra_s += extend_s
        att.deadline_at = look.deadline_at
        # an estimate is not the server's word: the warnings still ahead of the new deadline re-arm
        att.warned = warnings_due(self.policies[st.endpoint].warn_at, att.base, att.deadline_at - att.base, now)
        self.emit(ev.StallExtended(now, st.name, att.number, "first_byte", extend_s, look.reason, att.deadline_at,
                                   att.extensions))
        return True

    async def busy_reason(self, st: AgentState, att: Attempt, policy: ResolvedStall) -> str | None:
        """The seam for the server-busy extension: ask the endpoint whether it is loading or queueing."""
        if not policy.extend_when_server_busy or att.extensions >= policy.max_extensions or self.busy_check is None:
            return None
        with self.clock.move_on_after(BUSY_CHECK_TIMEOUT_S):
            return await self.busy_check(st.endpoint, att.base)  # the silence began at att.base
        return None

    def extend(self, st: AgentState, att: Attempt, seconds: float | None = None) -> None:
        """The operator's extension: the attempt's current deadline moves later by `seconds` (default the
        policy's extend_s), and only the warnings still ahead of the new deadline re-arm."""
        policy = self.policies[st.endpoint]
        seconds = seconds if seconds is not None else policy.extend_s
        att.extra_s += seconds
        att.deadline_at += seconds
        now = self.clock.now()
        att.warned = warnings_due(policy.warn_at, att.base, att.deadline_at - att.base, now)
        self.emit(ev.StallExtended(now, st.name, att.number, att.phase, seconds, "extended by operator",
                                   att.deadline_at, att.extensions, by_operator=True))
        move(st, phase_of(att.first_token_at))


async def watch_tool(st: AgentState, call: ToolCall, emit: Callable[[ev.Event], None], clock: Clock) -> None:
    """A tool call's deadline on the run's clock: ToolCallWarning at each `warn_at` fraction of it, then the call is
    cancelled."""
    monotonic = clock.now
    while True:
        now = monotonic()
        total = call.deadline_at - call.started_at
        while call.warned < len(call.warn_at) and now >= call.started_at + call.warn_at[call.warned] * total:
            fraction = call.warn_at[call.warned]
            call.warned += 1
            emit(ev.ToolCallWarning(now, st.name, call.call_id, fraction, max(0.0, call.deadline_at - now)))
        if now >= call.deadline_at:
            call.kill("timeout", f"no result after {fmt_s(now - call.started_at)} (tool_timeout_s)")
            return
        next_at = next_look(call.warn_at, call.warned, call.started_at, total)
        with anyio.CancelScope() as call.nap, clock.move_on_after(max(0.0, next_at - monotonic()) + 0.001):
            await anyio.sleep_forever()
        call.nap = None


def extend_tool(st: AgentState, call: ToolCall, seconds: float, emit: Callable[[ev.Event], None],
                attempt: int, clock: Clock) -> None:
    """The operator's extension of a running tool call: its deadline moves later by `seconds`; the warnings
    still ahead of the new deadline re-arm. Told as a StallExtended of deadline "tool"."""
    call.deadline_at += seconds
    now = clock.now()
    call.warned = warnings_due(call.warn_at, call.started_at, call.deadline_at - call.started_at, now)
    emit(ev.StallExtended(now, st.name, attempt, "tool", seconds, "tool call extended by operator",
                          call.deadline_at, 0, by_operator=True))
    call.look_again()
