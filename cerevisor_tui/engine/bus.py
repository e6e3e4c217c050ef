"""The run's event bus: every event the run tells goes to each subscriber in turn (the report, the journal, the
printer, the control socket, a console's mirror), scrubbed of the run's keys first. A subscriber that raises
never ends the run nor keeps the others from hearing: it is said once and counted, and one whose output is
gone is dropped."""

from __future__ import annotations

import contextlib
import sys

from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.attempt import Subscriber
from cerevisor_tui.engine.clock import Clock


class EventBus:
    def __init__(self, scrub: Scrubber, clock: Clock) -> None:
        self.scrub = scrub
        self.clock = clock
        # the live list: the hot paths hand token deltas to each subscriber directly (emit()'s frame skipped)
        self.subscribers: list[Subscriber] = []
        self.failures: dict[int, int] = {}  # by id(subscriber): how often each has raised

    def subscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.append(subscriber)

    def emit(self, event: ev.Event) -> None:
        if self.scrub:  # no key configured: nothing to look for
            event = self.scrub.record(event)
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception as exc:  # no subscriber's failure ends the run, nor keeps the others from hearing
                self.failed(subscriber, event, exc)

    def failed(self, subscriber: Subscriber, event: ev.Event, exc: Exception) -> None:
        """A subscriber raised (in `emit`, or handed a token delta directly): said once, on stderr (a detached
        run's run.log) and as a RunNotice, and counted. One whose output is gone (an OSError: a closed pipe or
        terminal, a full disk) is dropped, as it would fail on every event; any other (a value it did not expect)
        is kept for the events it can take."""
        key = id(subscriber)
        failures = self.failures.get(key, 0) + 1
        self.failures[key] = failures
        dropped = isinstance(exc, OSError)
        if dropped:  # replaced in place: a loop over the live list (emit's, a hot path's) goes on unharmed
            self.subscribers[:] = [_dropped if s is subscriber else s for s in self.subscribers]
        if failures > 1:
            return
        name = getattr(subscriber, "__qualname__", None) or type(subscriber).__name__
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        then = "it is dropped: nothing more goes to it" if dropped else "it keeps the events it can take"
        line = self.scrub(f"{name} failed on {event.kind} ({what}); the run goes on, {then}")
        with contextlib.suppress(OSError, ValueError):  # stderr may be gone with the terminal
            print(f"cerevisor-tui run: {line}", file=sys.stderr, flush=True)
        self.emit(ev.RunNotice(self.clock.now(), line, "warning", "A subscriber failed"))


def _dropped(event: ev.Event) -> None:
    """Stands where a subscriber was dropped (EventBus.failed): hears nothing."""
