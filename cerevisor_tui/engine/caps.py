"""The run's concurrency, the operator's and Auto's: the mode, the parallel cap, pause, and in auto mode each
endpoint's controller (engine/auto.py) under the operator's ceiling. Every change is applied to the scheduler
and told as ModeChanged or ConcurrencyChanged, here and nowhere else."""

from __future__ import annotations

from collections.abc import Callable

from cerevisor_tui.config.models import Config, EndpointConfig
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.auto import AutoController, Change
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.scheduler import Scheduler
from cerevisor_tui.kinds import MODES, Mode

AUTO_NOTE = "each endpoint's cap follows what its server sustains; +/- move the ceiling"


class Caps:
    def __init__(self, config: Config, scheduler: Scheduler, emit: Callable[[ev.Event], None],
                 refresh_load: Callable[[str | None], None], clock: Clock) -> None:
        self.scheduler = scheduler
        self.emit = emit
        self.refresh_load = refresh_load
        self.clock = clock
        self.running = False  # the run has begun: entering auto resumes the controllers
        auto = config.run.auto
        self.auto: dict[str, AutoController] = {}
        for ep in config.endpoints:
            start, why = (auto.start_cap, "[run.auto] start_cap") if auto.start_cap else _saved_probe_cap(ep)
            self.auto[ep.name] = AutoController(min_cap=auto.min_cap, max_cap=auto.max_cap or ep.max_concurrency,
                                                start_cap=start, start_why=why, kv_target=auto.kv_target,
                                                min_interactivity=auto.min_interactivity_tokens_s)
            scheduler.auto_caps[ep.name] = self.auto[ep.name].cap
        self.ceiling = max((c.max_cap for c in self.auto.values()), default=1)

    def set_mode(self, mode: Mode) -> None:
        """Switch sequential/parallel/auto now; running agents are never stopped by it."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        entering_auto = mode == "auto" and self.scheduler.mode != "auto"
        self.scheduler.set_mode(mode)
        self.emit(ev.ModeChanged(self.clock.now(), mode, self.scheduler.effective_cap, mode_note(mode), by="operator"))
        if entering_auto and self.running:
            for name, ctl in self.auto.items():
                self.apply(name, ctl.resume())
        self.refresh_load(None)

    def cycle_mode(self) -> Mode:
        mode = MODES[(MODES.index(self.scheduler.mode) + 1) % len(MODES)]
        self.set_mode(mode)
        return mode

    def start(self) -> None:
        """The run begins: in auto mode each controller's starting cap is applied and told."""
        self.running = True
        if self.scheduler.mode == "auto":
            for name, ctl in self.auto.items():
                self.apply(name, Change(ctl.cap, ctl.start_reason))

    def set_cap(self, cap: int) -> None:
        """Move the parallel cap; lowering it only holds admissions until fewer are running."""
        before = self.scheduler.max_concurrency
        self.scheduler.set_cap(cap)
        after = self.scheduler.max_concurrency
        self.tell(f"cap {before} -> {after}" if after != before else "", by="operator")

    def set_ceiling(self, ceiling: int) -> None:
        """Auto mode's ceiling: no endpoint's live cap goes above it (nor above the endpoint's own max_cap)."""
        self.ceiling = min(cmd.MAX_CAP, max(1, int(ceiling)))  # `+` held down stops at the largest cap
        for name, ctl in self.auto.items():
            change = ctl.set_ceiling(self.ceiling)
            if change is not None:
                self.apply(name, change)
        self.tell(f"auto ceiling {self.ceiling} (operator)", by="operator", ceiling=self.ceiling)

    def nudge(self, delta: int) -> int:
        """`+`/`-`: the parallel cap, or in auto mode the ceiling the controllers stay under; returns the new one."""
        if self.scheduler.mode == "auto":
            self.set_ceiling(self.ceiling + delta)
            return self.ceiling
        self.set_cap(self.scheduler.max_concurrency + delta)
        return self.scheduler.max_concurrency

    def pause(self, paused: bool = True) -> None:
        self.scheduler.set_paused(paused)
        self.tell()

    def apply(self, endpoint: str, change: Change) -> None:
        """What an endpoint's controller decided: its live cap, applied and told."""
        s = self.scheduler
        s.set_endpoint_cap(endpoint, change.cap)
        self.emit(ev.ConcurrencyChanged(self.clock.now(), s.max_concurrency, change.cap, s.paused,
                                        endpoint=endpoint, reason=change.reason, ceiling=self.ceiling,
                                        total_cap=s.effective_cap, by="auto"))
        self.refresh_load(endpoint)

    def tell(self, reason: str = "", by: ev.ChangedBy = "", ceiling: int = 0) -> None:
        """The run's cap as it is now, told (`ceiling`: auto's, when the change is about it)."""
        s = self.scheduler
        self.emit(ev.ConcurrencyChanged(self.clock.now(), s.max_concurrency, s.effective_cap, s.paused,
                                        reason=reason, ceiling=ceiling, total_cap=s.effective_cap, by=by))
        self.refresh_load(None)


def mode_note(mode: Mode) -> str:
    return AUTO_NOTE if mode == "auto" else ""


def _saved_probe_cap(ep: EndpointConfig) -> tuple[int, str]:
    """The cap the last probe of this endpoint recommended, if one was saved: auto mode starts there."""
    if not ep.base_url:
        return 0, ""
    try:
        from cerevisor_tui.endpoints.probe_store import saved_recommendation
    except ImportError:
        return 0, ""
    saved = saved_recommendation(ep.base_url, ep.model or None)
    if not saved or not saved.get("cap"):
        return 0, ""
    return int(saved["cap"]), f"the probe of {saved.get('saved_at', 'an earlier run')} recommended it"
