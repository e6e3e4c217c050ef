"""The headless printer: a readable line per event, or one JSON object per line with --jsonl.

A line is flushed at the end of the event loop's turn that told it, with the others of that turn (a busy
gateway's streams share a write), or at once outside a loop.

Its output may go away under a running run (`| head` exits, a `tee` dies, the terminal closes): the run
goes on. The printer then writes its lines on to its `spill` file (a foreground run's `run.log`), or to
nothing, and the dead output's descriptor is pointed at /dev/null, so no later write or the interpreter's
last flush fails on it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections import Counter
from pathlib import Path
from typing import TextIO

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.watchdog import fmt_s
from cerevisor_tui.text import printable

# Events that never make a line for people: checked first, as they come once per streamed chunk.
_SILENT = frozenset({"TokenDelta", "KeepAlive"})


class Printer:
    def __init__(self, out: TextIO | None = None, *, jsonl: bool = False, spill: Path | None = None) -> None:
        self.out = out or sys.stdout
        self.jsonl = jsonl
        self.spill = spill  # where the lines go on when `out` is gone; None: nowhere
        self.lost = ""  # why `out` was given up ("" while it is written)
        self.t0: float | None = None
        self._flush_due = False  # a flush is called at the end of this turn of the event loop

    def __call__(self, event: ev.Event) -> None:
        if self.jsonl:
            text = ev.encode_event(event).decode() + "\n"
        else:
            if event.kind in _SILENT:
                return
            if self.t0 is None:
                self.t0 = event.t
            line = self.describe(event)
            if not line:
                return
            # the one place a headless line is made printable: a client's or server's words set no title
            text = f"{event.t - self.t0:8.2f}s  {printable(line)}\n"
        try:
            self.out.write(text)
        except OSError as exc:  # EPIPE (a closed pipe), EIO (a closed terminal), ENOSPC ...
            self._give_up(exc, text)
            return
        if not self.jsonl and not self._flush_due:  # (--jsonl's reader takes a buffer at a time)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
            else:
                self._flush_due = True
                loop.call_soon(self.flush)

    def flush(self) -> None:
        """What is left in the buffer, written (at the end of a loop's turn; --jsonl's at the run's end); its output
        gone: given up, as in a write."""
        self._flush_due = False
        try:
            self.out.flush()
        except OSError as exc:
            self._give_up(exc)

    def _give_up(self, exc: OSError, text: str = "") -> None:
        """`out` failed: silence its descriptor, then go on in `spill` (once, from `text`, the line that failed),
        else write nothing more."""
        dead, self.lost = self.out, exc.strerror or type(exc).__name__
        silence(dead)
        self.out = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the printer's for the rest of the run
        spill, self.spill = self.spill, None
        if spill is None:
            return
        try:
            out = open(spill, "a", encoding="utf-8")  # noqa: SIM115
            out.write(f"cerevisor-tui run: its output was lost ({self.lost}); the run goes on, its lines follow here\n"
                      + text)
            out.flush()
        except OSError:
            return
        self.out = out

    @staticmethod
    def describe(e: ev.Event) -> str:
        """The event's line, "" for an event the log does not show."""
        line = _LINES.get(e.kind)
        return line(e) if line is not None else ""

    @staticmethod
    def _line_RunStarted(e: ev.RunStarted) -> str:
        eps = ", ".join(f"{d.name} ({d.kind}, {d.base_url})" for d in e.endpoints)
        note = f" [{e.note}]" if e.note else ""
        where = f", run dir {e.run_dir}" if e.run_dir else ""
        return f"run {e.run_id}: {sum(map(len, e.waves))} agents in {len(e.waves)} waves, mode {e.mode}, cap {e.max_concurrency}, endpoints {eps}{where}{note}"

    @staticmethod
    def _line_WaveStarted(e: ev.WaveStarted) -> str:
        if len(e.agents) > 10:  # a wide wave is a count, not a line of thousands of names
            return f"wave {e.wave} started: {len(e.agents):,} agents ({', '.join(e.agents[:3])}, ...)"
        return f"wave {e.wave} started: {', '.join(e.agents)}"

    @staticmethod
    def _line_WaveFinished(e: ev.WaveFinished) -> str:
        counts = Counter(e.statuses.values())  # counts, not names: the line stays short at 10,000 agents
        return f"wave {e.wave} finished: " + ", ".join(f"{n} {status}" for status, n in counts.most_common())

    @staticmethod
    def _line_SessionWaits(e: ev.SessionWaits) -> str:
        return f"{e.agent}: waits for a slot: {e.why}"

    @staticmethod
    def _line_SessionOpened(e: ev.SessionOpened) -> str:
        by = f" ({e.harness})" if e.harness else ""
        own = f" (its own id {e.own_id})" if e.own_id else ""
        about = f": {e.topic}" if e.topic else ""
        return f"{e.agent}: session opened{by}, named by {e.source}{own}, {e.api} API, on {e.endpoint}{about}"

    @staticmethod
    def _line_AgentStarted(e: ev.AgentStarted) -> str:
        if not e.turns:  # a gateway session's request: its model, and its time queued in the gateway
            model = f"{e.model_asked} as {e.model_sent}" if e.model_sent != e.model_asked else e.model_sent
            queued = f", queued {fmt_s(e.queued_s)}" if e.queued_s >= 0.05 else ""
            return (f"{e.agent}: request {e.attempt} ({model}) sent to {e.endpoint}{queued} "
                    f"(first-byte deadline {fmt_s(e.first_byte_deadline_s)}, idle {fmt_s(e.idle_deadline_s)})")
        again = f", attempt {e.attempt}" if e.attempt > 1 else ""  # attempts count within a turn: 2 is a retry
        if e.step:  # a tool loop's steps are attempts of the turn too: its step says more than its attempt
            again = f", step {e.step}"
        return (f"{e.agent}: turn {e.turn}/{e.turns}{again} sent to {e.endpoint} "
                f"(first-byte deadline {fmt_s(e.first_byte_deadline_s)}, idle {fmt_s(e.idle_deadline_s)})")

    @staticmethod
    def _line_AgentPlaced(e: ev.AgentPlaced) -> str:
        if e.moved_from:
            return f"{e.agent}: MOVED to {e.endpoint} (pool {e.pool}): {e.reason}"
        return f"{e.agent}: placed on {e.endpoint} (pool {e.pool})"

    @staticmethod
    def _line_AgentMeters(e: ev.AgentMeters) -> str:
        return f"{e.agent}: {e.warning}" if e.warning else ""

    @staticmethod
    def _line_ToolCallStarted(e: ev.ToolCallStarted) -> str:
        args = e.arguments if len(e.arguments) <= 120 else e.arguments[:119] + "…"
        return f"{e.agent}: tool {e.server}.{e.tool} {args}"

    @staticmethod
    def _line_ToolCallFinished(e: ev.ToolCallFinished) -> str:
        return (f"{e.agent}: tool {e.server + '.' if e.server else ''}{e.tool} {e.outcome.upper()} "
                f"in {fmt_s(e.elapsed_s)}: {e.result}")

    @staticmethod
    def _line_ToolCallWarning(e: ev.ToolCallWarning) -> str:
        return f"{e.agent}: TOOL WARNING {int(e.fraction * 100)}% of the tool deadline, {fmt_s(e.remaining_s)} left"

    @staticmethod
    def _line_ApprovalRequested(e: ev.ApprovalRequested) -> str:
        return f"{e.agent}: NEEDS APPROVAL {e.server}.{e.tool} {e.arguments[:120]}"

    @staticmethod
    def _line_ApprovalDecided(e: ev.ApprovalDecided) -> str:
        what = {"once": "approved once", "run": "approved for the run", "deny": "denied"}[e.decision]
        return f"{e.agent}: {e.server}.{e.tool} {what} ({e.by})"

    @staticmethod
    def _line_WarmupStarted(e: ev.WarmupStarted) -> str:
        return f"warming up: {', '.join(e.endpoints)} (one short request each, before its agents)"

    @staticmethod
    def _line_EndpointWarmed(e: ev.EndpointWarmed) -> str:  # a failure is the RunNotice that follows it
        return f"{e.endpoint}: warmed up, cold start {e.cold_start_s:.2f} s" if e.cold_start_s is not None else ""

    @staticmethod
    def _line_RunNotice(e: ev.RunNotice) -> str:
        return f"{e.severity.upper()}: {e.message}"

    @staticmethod
    def _line_EndpointWaiting(e: ev.EndpointWaiting) -> str:
        return f"{e.agent}: waiting for endpoint {e.endpoint} ({e.reason}); retry in {fmt_s(e.retry_in_s)}"

    @staticmethod
    def _line_FirstToken(e: ev.FirstToken) -> str:
        if not e.streamed:
            return f"{e.agent}: answer coming after {e.ttft_s:.2f} s, whole (not streamed: no first-token time)"
        return f"{e.agent}: first token after {e.ttft_s:.2f} s (turn {e.turn})"

    @staticmethod
    def _line_TurnFinished(e: ev.TurnFinished) -> str:
        if not e.answered:
            return (f"{e.agent}: request {e.attempt} ended without its answer ({e.finish_reason}) after "
                    f"{e.duration_s:.2f} s, {e.completion_tokens} tokens")
        if not e.turns:
            return (f"{e.agent}: request {e.attempt} done, {e.completion_tokens} tokens "
                    f"({e.finish_reason or 'no finish reason'}) in {e.duration_s:.2f} s")
        return (f"{e.agent}: turn {e.turn}/{e.turns} done, {e.completion_tokens} tokens "
                f"({e.finish_reason or 'no finish reason'}) in {e.duration_s:.2f} s")

    @staticmethod
    def _line_StallWarning(e: ev.StallWarning) -> str:
        what = "no first token" if e.deadline == "first_byte" else "no output"
        return f"{e.agent}: STALL WARNING {what}, {int(e.fraction * 100)}% of the {e.deadline} deadline, {fmt_s(e.remaining_s)} left"

    @staticmethod
    def _line_StallExtended(e: ev.StallExtended) -> str:
        return f"{e.agent}: {e.deadline} deadline extended by {fmt_s(e.extend_s)}: {e.reason}"

    @staticmethod
    def _line_AgentKilled(e: ev.AgentKilled) -> str:
        if e.deadline == "wedge":  # its reason names the wedge
            return f"{e.agent}: KILLED: {e.reason}"
        return f"{e.agent}: KILLED ({e.deadline} deadline): {e.reason}"

    @staticmethod
    def _line_ServerWedged(e: ev.ServerWedged) -> str:
        if e.over:
            return f"{e.endpoint}: no longer wedged: {e.reason}"
        killed = f"; killed {', '.join(e.agents)}" if len(e.agents) <= 10 else f"; killed {len(e.agents)} agents"
        return f"{e.endpoint}: WEDGED ({e.rule}): {e.reason}{killed if e.agents else ''}"

    @staticmethod
    def _line_EndpointState(e: ev.EndpointState) -> str:
        return f"{e.endpoint}: {e.state.upper()}" + (f": {e.why}" if e.why else "")

    @staticmethod
    def _line_AgentRetrying(e: ev.AgentRetrying) -> str:
        return f"{e.agent}: retrying as attempt {e.attempt} in {fmt_s(e.delay_s)}: {e.cause}"

    @staticmethod
    def _line_AgentRerun(e: ev.AgentRerun) -> str:
        return f"{e.agent}: completed before, runs again: {e.reason}"

    @staticmethod
    def _line_AgentFinished(e: ev.AgentFinished) -> str:
        why = f": {e.error}" if e.error else ""
        return f"{e.agent}: {e.status.upper()}{why}"

    @staticmethod
    def _line_ModeChanged(e: ev.ModeChanged) -> str:
        return f"mode {e.mode} (cap {e.effective_cap})" + (f" [{e.note}]" if e.note else "")

    @staticmethod
    def _line_ConcurrencyChanged(e: ev.ConcurrencyChanged) -> str:
        if e.endpoint:
            return f"{e.endpoint}: {e.reason or f'cap {e.effective_cap}'}"
        if e.reason:
            return f"{e.reason} (effective cap {e.effective_cap})"
        return f"cap {e.max_concurrency} (effective {e.effective_cap})" + (", admissions paused" if e.paused else "")

    @staticmethod
    def _line_RunFinished(e: ev.RunFinished) -> str:
        t = e.totals
        if t.sessions and not t.agents:
            return (f"run {e.run_id} finished: {t.sessions} gateway session{'s' * (t.sessions != 1)}, "
                    f"{t.output_tokens} output tokens in {t.wall_s:.1f} s"
                    + (f"; report {e.report_path}" if e.report_path else ""))
        # every agent in one count, so they add up to the total: a stopped run's cancelled ones too, and any that
        # never reached an end (none, unless the run broke off)
        unended = t.agents - t.completed - t.failed - t.killed - t.skipped - t.cancelled
        return (f"run {e.run_id} finished: {t.completed}/{t.agents} completed, {t.failed} failed, "
                f"{t.killed} killed, {t.skipped} skipped, {t.cancelled} cancelled"
                + (f", {unended} not started" if unended > 0 else "") + f", {t.output_tokens} output tokens in "
                f"{t.wall_s:.1f} s" + (f"; report {e.report_path}" if e.report_path else ""))


_LINES = ev.handlers(Printer, "_line_")


def silence(out: TextIO) -> None:
    """Point a dead output's descriptor at /dev/null: what is left in its buffer, and any later write or flush
    (the interpreter's own at exit), then goes nowhere instead of failing again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # (a StringIO has no descriptor)
        fd = out.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
