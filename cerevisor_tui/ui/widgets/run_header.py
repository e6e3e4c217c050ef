"""The header: endpoints and their health, the mode badge, the cap, agent counts, throughput, wave."""

from __future__ import annotations

from collections import Counter

from rich.text import Text
from textual.widgets import Static

from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.format import ACTIVE, fmt_clock, fmt_rate
from cerevisor_tui.ui.model import UiModel

MODE_ROLES = {"sequential": "secondary", "parallel": "primary", "auto": "accent"}


class RunHeader(Static):
    """Two lines, redrawn from the engine's state only when their text changes."""

    DEFAULT_CSS = """
    RunHeader {
        height: 2;
        background: $panel;
        color: $foreground;
        padding: 0 1;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple = ()

    def sync(self, engine: Engine, model: UiModel, now: float, *, simulated: bool, error: str = "") -> bool:
        """Redraw if anything shown changed; returns whether it did."""
        sched = engine.scheduler
        counts = Counter(st.status for st in engine.agents.values())
        running = sum(counts[s] for s in ACTIVE)
        queued = counts["queued"]
        health = tuple((name, model.servers[name].healthy if name in model.servers else None)
                       for name in engine.endpoints)
        rate = model.tokens_per_s(now)
        elapsed = (now - engine.started_at) if engine.started_at else 0.0
        if model.finished is not None:
            elapsed = model.finished.t - engine.started_at
        state = (sched.mode, sched.max_concurrency, sched.effective_cap, sched.paused, running, queued,
                 counts["completed"], counts["failed"], counts["killed"], round(rate, 1), engine.wave,
                 int(elapsed), health, simulated, model.finished is not None, engine.stopping, error,
                 tuple(engine.models.get(n, "") for n in engine.endpoints))
        if state == self._shown:
            return False
        self._shown = state
        # two lines, always: no layout pass needed
        self.update(self._compose_text(engine, model, state, simulated, rate, elapsed, error), layout=False)
        return True

    def _c(self, name: str) -> str:
        return self.app.colour(name)  # type: ignore[attr-defined]

    def _compose_text(self, engine: Engine, model: UiModel, state: tuple, simulated: bool, rate: float,
                elapsed: float, error: str) -> Text:
        (mode, cap, effective, paused, running, queued, done, failed, killed, _, wave, _, health,
         _, finished, stopping, _, _) = state
        bg = self._c("background") or "black"
        line1 = Text(no_wrap=True, overflow="ellipsis")
        line1.append("cerevisor", style=f"bold {self._c('primary')}")
        if simulated:
            line1.append(" ")
            line1.append(" SIMULATED ", style=f"bold {bg} on {self._c('warning')}")
        for name, healthy in health:
            ep = engine.endpoints[name]
            dot, colour = ("●", "success") if healthy else ("●", "error") if healthy is False else ("○", "text-muted")
            line1.append("  ")
            line1.append(dot, style=self._c(colour))
            line1.append(f" {name}", style="bold")
            model_id = engine.models.get(name) or ep.model
            detail = ep.kind if ep.kind == "simulated" else engine.base_urls.get(name, ep.base_url)
            line1.append(f" {detail}" + (f" · {model_id}" if model_id else ""), style=self._c("text-muted"))

        line1.append(f"  run {fmt_clock(elapsed)}", style=self._c("text-muted"))
        if error:
            line1.append(f"  engine stopped: {error}", style=f"bold {self._c('error')}")
        elif finished:
            colour = self._c("warning") if failed + killed else self._c("success")
            line1.append("  FINISHED", style=f"bold {colour}")
        elif stopping:
            line1.append("  STOPPING", style=f"bold {self._c('warning')}")

        line2 = Text(no_wrap=True, overflow="ellipsis")
        line2.append(f" {mode.upper()} ", style=f"bold {bg} on {self._c(MODE_ROLES.get(mode, 'primary'))}")
        line2.append(f" cap {effective}" if mode == "sequential" else f" cap {cap}", style="bold")
        if paused and not stopping:
            line2.append(" ")
            line2.append(" PAUSED ", style=f"bold {bg} on {self._c('stall-warn')}")
        waves = len(engine.waves)
        line2.append(f"  wave {max(wave, 0) + 1}/{waves}" if wave >= 0 else f"  wave -/{waves}")
        line2.append("  ")
        line2.append(f"{running} running", style=f"bold {self._c('success')}" if running else "")
        line2.append(f" {queued} queued {done} done ")
        bad = failed + killed
        line2.append(f"{failed} failed" + (f" {killed} killed" if killed else ""),
                     style=f"bold {self._c('error')}" if bad else "")
        line2.append(f"  {fmt_rate(rate)} tok/s", style="bold")
        return Text("\n").join([line1, line2])
