"""The probe dialog: offers to measure an endpoint before more agents run at once, sweeps it in a worker
(the engine speaks HTTP, not us), shows each level as it completes, and applies the recommended cap.
With agents on the endpoint, the engine replays conversations shaped like theirs (conversation mode) and
the table shows the server's prefix-cache hit rate per level.

While the probe measures, new admissions wait (running agents go on), so it measures the server rather
than our own growing load and nothing more starts at a cap that may be past the cliff. Esc cancels it:
the worker's cancellation closes its requests, and admissions resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static
from textual.worker import Worker, WorkerState

from cerevisor_tui.ui.format import fmt_rate, fmt_seconds

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

OFFER, RUNNING, DONE, FAILED = "offer", "running", "done", "failed"
DIALOG_KEYS = frozenset({"enter", "space", "tab", "shift+tab", "left", "right", "escape"})
"""Keys the offer keeps; any other key skips the offer and does its usual job on the console."""


def probe_bound(app: CerevisorApp, endpoint: str) -> int:
    """The highest concurrency the sweep may reach: the endpoint's own max_concurrency (at least 2)."""
    return max(2, app.engine.endpoints[endpoint].max_concurrency)


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
        self.levels: list[Any] = []
        self.result: Any = None
        self.progress = ""
        self.error = ""
        self._worker: Worker[Any] | None = None

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
        engine = app.engine
        title = self.query_one("#probe-title", Static)
        body = self.query_one("#probe-body", Static)
        if self.state == OFFER:
            mode = engine.scheduler.mode
            agents = sum(1 for st in engine.agents.values() if st.endpoint == endpoint)
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
            title.update(f"Probe of {endpoint}: {r.recommended_mode}, cap {r.recommended_concurrency}")
            body.update(r.reason or "")
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
            apply.label = f"Apply {self.result.recommended_mode}, cap {self.result.recommended_concurrency} (enter)"
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
            queued = "-" if level.server_waiting_max is None else str(level.server_waiting_max)
            hits = level.prefix_hit_rate
            note = "◀ recommended" if level.concurrency == best else (f"{level.failed} failed" if level.failed else "")
            style = f"bold {self.app.colour('success')}" if level.concurrency == best else ""
            table.add_row(str(level.concurrency), fmt_rate(level.output_tokens_per_s), fmt_seconds(level.ttft_p50_s),
                          fmt_seconds(level.ttft_p95_s), queued,
                          *((("-" if hits is None else f"{hits:.0%}"),) if conversations else ()), note, style=style)
        return table

    # ---- the probe ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self.state = RUNNING
        self._worker = self.run_worker(self._probe(), name="probe", group="probe", exit_on_error=False)

    async def _probe(self) -> Any:
        engine = self.app.engine
        held = not engine.scheduler.paused
        if held:
            engine.pause()
        try:
            return await engine.probe(self.endpoint, on_progress=self._on_progress, on_level=self._on_level,
                                      max_concurrency=probe_bound(self.app, self.endpoint))
        finally:
            if held and engine.scheduler.paused and not engine.stopping:
                engine.resume()

    def _on_progress(self, line: str) -> None:
        self.progress = line
        if self.state == RUNNING:
            self.query_one("#probe-body", Static).update(line)

    def _on_level(self, level: Any) -> None:
        self.levels.append(level)
        self._show_levels()

    def _show_levels(self) -> None:
        levels = self.query_one("#probe-levels", Static)
        levels.display = bool(self.levels)
        levels.update(self._table())

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker is not self._worker:
            return
        if event.state == WorkerState.SUCCESS:
            self.result = event.worker.result
            self.levels = list(self.result.levels)
            self.app.probed[self.endpoint] = self.result
            self.state = DONE
        elif event.state == WorkerState.ERROR:
            self.error = self._failure(event.worker.error)
            self.state = FAILED
        else:
            return
        self._redraw()

    def _failure(self, error: BaseException | None) -> str:
        """What went wrong, in the operator's words (the innermost error of a task group)."""
        while isinstance(error, BaseExceptionGroup) and error.exceptions:
            error = error.exceptions[0]
        closed = isinstance(error, RuntimeError) and "closed" in str(error)  # httpx: the run closed its client
        if closed or self.app.model.finished is not None or self.app.engine.stopping:
            return ("The run ended while probing, and its connections with it. "
                    "Probe the server alone with `cerevisor-tui probe URL`.")
        return (str(error) or type(error).__name__) if error is not None else "unknown error"

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
        engine = self.app.engine
        engine.set_concurrency(r.recommended_concurrency)
        if engine.scheduler.mode != r.recommended_mode:
            engine.set_mode(r.recommended_mode)
        self.dismiss(None)
        self.app.notify(f"{self.endpoint}: {r.recommended_mode}, cap {r.recommended_concurrency} (from the probe)",
                        timeout=4)

    def action_close(self) -> None:
        if self.state == RUNNING and self._worker is not None and not self._worker.is_finished:
            self._worker.cancel()  # closes the probe's requests on the way out
            self.app.notify(f"Probe of {self.endpoint} cancelled.", timeout=3)
        self.dismiss(None)

    def on_key(self, event: events.Key) -> None:
        """The offer never swallows a console key: any key but the dialog's skips it and does its job."""
        if self.state != OFFER or event.key in DIALOG_KEYS:
            return
        event.stop()
        event.prevent_default()
        self.dismiss(None)
        self.app.simulate_key(event.key)
