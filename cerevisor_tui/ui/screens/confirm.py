"""A yes/no question in a modal dialog; dismisses with True only on an explicit yes."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    """`y` confirms, `n`/esc declines; enter presses the focused button, which starts on the safe one (No)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm_yes", tooltip="Confirm"),
        Binding("n,escape", "answer(False)", "No", id="confirm_no", tooltip="Cancel"),
    ]

    def __init__(self, title: str, question: str, *, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self._title, self._question, self._yes, self._no = title, question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(self._title, id="dialog-title", markup=False)
            yield Static(self._question, id="dialog-question", markup=False)
            with Horizontal(id="dialog-buttons"):
                yield Button(f"{self._yes} (y)", variant="error", id="yes")
                yield Button(f"{self._no} (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class DetachScreen(ModalScreen[str | None]):
    """`q` in a console attached to a run: detach (the run goes on; the safe answer, focused first), stop the
    run, or stay. Dismisses with "detach", "stop" or None."""

    BINDINGS = [
        Binding("d", "choose('detach')", "Detach", id="detach_detach", tooltip="Leave; the run goes on"),
        Binding("s", "choose('stop')", "Stop run", id="detach_stop", tooltip="Stop the run for every console"),
        Binding("escape", "choose(None)", "Stay", id="detach_stay", tooltip="Back to the run"),
    ]

    def __init__(self, running: int, *, gateway: str | bool = "", sessions: int = 0) -> None:
        """`gateway`: the run serves one (its URL, or True where it is not known), with `sessions` open."""
        super().__init__()
        self._title = "Leave the run"
        if gateway:
            where = f" on {gateway}" if isinstance(gateway, str) else ""
            agents = f" and {running} agent(s) not finished" if running else ""
            self._question = (f"The gateway serves{where}: {sessions} session(s) open{agents}. Detach (it goes on "
                              "serving, `cerevisor-tui attach` comes back to it) or stop the run (for every "
                              "console; requests in flight get an error)?")
        else:
            self._question = (f"{running} agent(s) have not finished. Detach (the run goes on, `cerevisor-tui "
                              "attach` comes back to it) or stop the run (for every console)?")

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(self._title, id="dialog-title", markup=False)
            yield Static(self._question, id="dialog-question", markup=False)
            with Horizontal(id="dialog-buttons"):
                yield Button("Detach (d)", variant="primary", id="detach")
                yield Button("Stop run (s)", variant="error", id="stop")
                yield Button("Stay (esc)", id="stay")

    def on_mount(self) -> None:
        self.query_one("#detach", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id if event.button.id in ("detach", "stop") else None)

    def action_choose(self, choice: str | None) -> None:
        self.dismiss(choice)
