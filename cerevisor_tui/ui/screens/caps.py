"""The cap history (`a`): every cap change of the run, newest first, with its run time, endpoint, who made it and
why: auto mode's controllers at work, and the operator's changes of mode, of the cap and of auto's ceiling.

It reads the run's mirror of ConcurrencyChanged events, and redraws while open
when a change arrives.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from cerevisor_tui.ui.format import fmt_clock
from cerevisor_tui.ui.model import UiModel

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

SHOWN_MAX = 500
"""Rows drawn at most (the newest); the run's journal keeps every change."""
POLL_S = 0.5


def history_table(model: UiModel, *, muted: str = "", accent: str = "") -> Table | Text:
    """The changes as rows (time since the run started, endpoint, cap, who, reason), newest first."""
    if not model.cap_changes:
        return Text("No cap changes yet. Each change of the mode (m) or the cap (+/-) is listed here with who made "
                    "it; in auto mode each endpoint's controller sets its cap from what its server sustains, and "
                    "every change it makes is listed with its reason.", style=muted)
    table = Table.grid(padding=(0, 2))
    table.add_column(style=muted, no_wrap=True, justify="right")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(style=f"bold {accent}", no_wrap=True, justify="right")
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    table.add_row(Text("time"), Text("endpoint"), Text("cap"), Text("by"), Text("reason"), style=muted)
    start = model.started_at
    for change in islice(reversed(model.cap_changes), SHOWN_MAX):
        when = fmt_clock(int(change.t - start)) if start is not None else "-"  # run time, as the header counts it
        table.add_row(Text(when), Text(change.endpoint or "all"), Text(str(change.cap)), Text(change.by or "-"),
                      Text(change.reason))
    return table


class CapHistoryScreen(ModalScreen[None]):
    """Read-only; esc, q or a closes it."""

    app: CerevisorApp
    BINDINGS = [
        Binding("escape,q,a", "app.pop_screen", "Close", key_display="esc", id="caps_close",
                tooltip="Back to the console"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._shown = -1

    def compose(self) -> ComposeResult:
        with Vertical(id="caps-dialog"):
            yield Static(id="caps-title", markup=False)
            with VerticalScroll(id="caps-scroll"):
                yield Static(id="caps-body")
            yield Static("newest first · esc closes", id="caps-hint", markup=False)

    def on_mount(self) -> None:
        self.redraw()
        self.set_interval(POLL_S, self.redraw, name="caps-refresh")

    def redraw(self) -> None:
        """Draw the list again if a change arrived since it was last drawn."""
        model = self.app.mirror
        if model.cap_changes_total == self._shown:
            return
        self._shown = model.cap_changes_total
        total = model.cap_changes_total
        kept = min(len(model.cap_changes), SHOWN_MAX)
        title = f"Cap changes ({total})" if kept == total else f"Cap changes (the newest {kept} of {total})"
        self.query_one("#caps-title", Static).update(title)
        self.query_one("#caps-body", Static).update(
            history_table(model, muted=self.app.colour("text-muted"), accent=self.app.colour("accent")))
