"""Each endpoint's load as a console shows it (conversations in flight, their zone, the cap, the fit), told as a
LoadChanged whenever what it shows changes: after an admission, a cap's move, a server sample."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine import load
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.engine.scheduler import Scheduler


class LoadTeller:
    def __init__(self, endpoints: Iterable[str], scheduler: Scheduler, monitor: ServerMonitor,
                 emit: Callable[[ev.Event], None], clock: Clock) -> None:
        self.endpoints = list(endpoints)
        self.scheduler = scheduler
        self.monitor = monitor
        self.emit = emit
        self.clock = clock
        self._sent: dict[str, ev.LoadChanged] = {}  # the last LoadChanged of each endpoint

    def cap_warning(self) -> str | None:
        """Why the current cap is past what fits in an endpoint's KV memory, if it is."""
        for name, est in self.monitor.load.items():
            warning = load.cap_warning(name, self.scheduler.endpoint_cap(name), est)
            if warning:
                return warning
        return None

    def event(self, endpoint: str) -> ev.LoadChanged:
        """The endpoint's load now, as a console shows it."""
        est = self.monitor.load.get(endpoint)
        sample = self.monitor.last_sample.get(endpoint)
        conversations = load.conversations_in_flight(
            self.scheduler.running_by_endpoint.get(endpoint, 0), sample.running if sample else None,
            sample.waiting if sample else None)
        cap = self.scheduler.endpoint_cap(endpoint)
        return ev.LoadChanged(
            self.clock.now(), endpoint, conversations, cap, est.zone(conversations) if est else "",
            est, "" if est else self.monitor.load_notes.get(endpoint, ""),
            load.cap_warning(endpoint, cap, est))

    def refresh(self, endpoint: str | None = None) -> None:
        """Send a LoadChanged for each endpoint (or `endpoint`) whose load, as shown, changed."""
        for name in (endpoint,) if endpoint is not None else self.endpoints:
            event = self.event(name)
            sent = self._sent.get(name)
            if sent is None or msgspec.structs.replace(sent, t=event.t) != event:
                self._sent[name] = event
                self.emit(event)
