"""The probe dialog: offers to measure an endpoint before more agents run at once, asks the run to sweep it
(the `probe` command: the engine speaks HTTP, not us), shows each level as its ProbeProgress arrives, and
applies the recommended cap. With agents on the endpoint, the engine replays conversations shaped like
theirs (conversation mode) and the table shows the server's prefix-cache hit rate per level.

While the probe measures, the engine holds new admissions (running agents go on), so it measures the
server rather than our own growing load and nothing more starts at a cap that may be past the cliff. Esc
cancels it (`cancel_probe`): its requests are closed, and admissions resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.format import fmt_rate, fmt_seconds
from cerevisor_tui.ui.mirror import ProbeView

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

OFFER, RUNNING, DONE, FAILED = "offer", "running", "done", "failed"
POLL_S = 0.1
"""How often a running probe's progress is looked for in the mirror."""
DIALOG_KEYS = frozenset({"enter", "space", "tab", "shift+tab", "left", "right", "escape"})
"""Keys the offer keeps; any other key skips the offer and does its usual job on the console."""


def probe_bound(app: CerevisorApp, endpoint: str) -> int:
    """The highest concurrency the sweep may reach: the endpoint's own max_concurrency (at least 2)."""
    ep = app.mirror.endpoints.get(endpoint)
    return max(2, ep.max_concurrency if ep is not None else 0)


class ProbeScreen(ModalScreen[None]):
    """`offer=True` asks first (Probe / Skip); otherwise the probe starts at once (the palette's way in)."""

    app: CerevisorApp
    BINDINGS = [
        Binding("escape", "close", "Close", id="probe_close",
                tooltip="Skip the offer, cancel a running probe (its requests are closed), or close"),
    ]

    def __init__(self, endpoint: str, *, offer: bool = False) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.state = OFFER if offer else RUNNING
        self.levels: list[ev.ProbeLevelSummary] = []
        self.result: ev.ProbeSummary | None = None
        self.progress = ""
        self.error = ""
        self._before: ProbeView | None = None  # the endpoint's last probe before this one was asked for
        self._view: ProbeView | None = None  # this probe, as the mirror follows it
        self._levels_shown = -1

    def compose(self) -> ComposeResult:
        with Vertical(id="probe-dialog"):
            yield Static(id="probe-title", markup=False)
            yield Static(id="probe-body", markup=False)
            yield Static(id="probe-levels")
            with Horizontal(id="probe-buttons"):
                yield Button("Probe (enter)", variant="primary", id="probe-start")
                yield Button("Apply", variant="success", id="probe-apply")
                yield Button("Skip (esc)", id="probe-close")

    def on_mount(self) -> None:
        if self.state == RUNNING:
            self._start()
        self._redraw()

    # ---- what it shows ----------------------------------------------------------------------------
    def _redraw(self) -> None:
        app, endpoint = self.app, self.endpoint
        mirror = app.mirror
        title = self.query_one("#probe-title", Static)
        body = self.query_one("#probe-body", Static)
        if self.state == OFFER:
            mode = mirror.mode
            agents = sum(1 for a in mirror.agents.values() if a.endpoint == endpoint)
            title.update(f"Probe {endpoint} before going {mode}?")
            what = (f"It replays conversations shaped like the {agents} agent{'s' * (agents != 1)} on it (each turn "
                    "resending the conversation so far)" if agents else "It sends short requests")
            body.update(f"{what} at concurrency 1, 2, 4, ... up to {probe_bound(app, endpoint)} "
                        "(bounded in requests and time) and recommends a cap"
                        + (" at which their prefixes stay cached between turns" if agents else "")
                        + ". New agents wait while it measures; running ones go on.")
        elif self.state == RUNNING:
            title.update(f"Probing {endpoint} ...")
            body.update(self.progress or "starting")
        elif self.state == DONE:
            r = self.result
            if r is not None:
                title.update(f"Probe of {endpoint}: {r.recommended_mode}, cap {r.recommended_concurrency}")
                body.update(r.reason)
        else:
            title.update(f"Probe of {endpoint} failed")
            body.update(self.error)
        self._show_levels()
        start = self.query_one("#probe-start", Button)
        apply = self.query_one("#probe-apply", Button)
        close = self.query_one("#probe-close", Button)
        start.display = self.state == OFFER
        apply.display = self.state == DONE
        close.label = {OFFER: "Skip (esc)", RUNNING: "Cancel (esc)"}.get(self.state, "Close (esc)")
        if self.state == DONE:
            r = self.result
            if r is not None:
                apply.label = f"Apply {r.recommended_mode}, cap {r.recommended_concurrency} (enter)"
            apply.focus()
        elif self.state == OFFER:
            start.focus()
        else:
            close.focus()

    def _table(self) -> Table | Text:
        if not self.levels:
            return Text("")
        muted = self.app.colour("text-muted")
        table = Table(box=None, padding=(0, 1), header_style=f"bold {muted}", pad_edge=False)
        conversations = any(level.conversations is not None for level in self.levels)
        labels = ("conc", "tok/s", "TTFT p50", "TTFT p95", "queued", *(("prefix hits",) if conversations else ()), "")
        for label in labels:
            table.add_column(label, justify="left" if label == "" else "right", no_wrap=True)
        best = self.result.recommended_concurrency if self.result is not None else None
        for level in self.levels:
            waiting = level.server_waiting_max
            queued = "-" if waiting is None else str(waiting)
            hits = level.prefix_hit_rate
            concurrency, failed = level.concurrency, level.failed
            note = "◀ recommended" if concurrency == best else (f"{failed} failed" if failed else "")
            style = f"bold {self.app.colour('success')}" if concurrency == best else ""
            table.add_row(str(concurrency), fmt_rate(level.output_tokens_per_s),
                          fmt_seconds(level.ttft_p50_s), fmt_seconds(level.ttft_p95_s), queued,
                          *((("-" if hits is None else f"{hits:.0%}"),) if conversations else ()), note, style=style)
        return table

    # ---- the probe ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self.state = RUNNING
        mirror = self.app.mirror
        self._before = mirror.probes.get(self.endpoint)
        self.app.command(cmd.Probe(endpoint=self.endpoint, max_concurrency=probe_bound(self.app, self.endpoint)))
        self._follow()
        self.set_interval(POLL_S, self._follow, name="probe-follow")

    def _follow(self) -> None:
        """Take up what the mirror learnt of this probe since the last look."""
        if self.state != RUNNING:
            return
        found = self.app.mirror.probes.get(self.endpoint)
        if found is None or (found is self._before and found.state != RUNNING):
            return  # its ProbeStarted has not come yet
        self._view = found
        if found.line != self.progress:
            self.progress = found.line
            self.query_one("#probe-body", Static).update(found.line)
        if len(found.levels) != self._levels_shown:
            self._levels_shown = len(found.levels)
            self.levels = list(found.levels)
            self._show_levels()
        if found.state == DONE:
            self.result = found.result
            self.levels = list(found.levels)
            self.state = DONE
        elif found.state == FAILED:
            self.error = found.error
            self.state = FAILED
        elif found.state != RUNNING:  # cancelled elsewhere
            self.dismiss(None)
            return
        else:
            return
        self._redraw()

    def _show_levels(self) -> None:
        levels = self.query_one("#probe-levels", Static)
        levels.display = bool(self.levels)
        levels.update(self._table())

    # ---- answers ----------------------------------------------------------------------------------
    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "probe-start":
            self._start()
            self._redraw()
        elif event.button.id == "probe-apply":
            self.action_apply()
        else:
            self.action_close()

    def action_apply(self) -> None:
        r = self.result
        if r is None:
            return
        app = self.app
        mode, cap = r.recommended_mode, r.recommended_concurrency
        app.command(cmd.SetConcurrency(cap=cap))
        if app.mirror.mode != mode:
            app.command(cmd.SetMode(mode=mode))
        self.dismiss(None)
        app.notice(f"{self.endpoint}: {mode}, cap {cap} (from the probe)", timeout=4)

    def action_close(self) -> None:
        if self.state == RUNNING:
            self.app.command(cmd.CancelProbe(endpoint=self.endpoint))  # closes the probe's requests
            self.state = "closed"
            self.app.notice(f"Probe of {self.endpoint} cancelled.", timeout=3)
        self.dismiss(None)

    def on_key(self, event: events.Key) -> None:
        """The offer never swallows a console key: any key but the dialog's skips it and does its job."""
        if self.state != OFFER or event.key in DIALOG_KEYS:
            return
        event.stop()
        event.prevent_default()
        self.dismiss(None)
        self.app.simulate_key(event.key)
