"""Where to save the settings when the console has no config file: a path (a new file, or an existing one the
settings are merged into), or apply them to the run without saving."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static


class SaveToScreen(ModalScreen[str | None]):
    """Enter saves to the path typed (dismissed with it), `Apply only` dismisses with "" (apply, save nothing),
    esc with None (back to the form)."""

    BINDINGS = [
        Binding("escape", "cancel", "Back", id="save_to_back", tooltip="Back to the settings, nothing saved"),
    ]

    def __init__(self, suggested: str, note: str) -> None:
        """`note`: who reads the file at `suggested`."""
        super().__init__()
        self._suggested, self._note = suggested, note

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static("Save settings to a new file", id="dialog-title", markup=False)
            yield Static("This console has no config file. Where should the settings go? A file that exists keeps "
                         f"its other keys. {self._note}", id="dialog-question", markup=False)
            yield Input(self._suggested, id="save-to-path", compact=True)
            yield Static("", id="save-to-problem", markup=False)
            with Horizontal(id="dialog-buttons"):
                yield Button("Save (enter)", variant="primary", id="save")
                yield Button("Apply only", id="apply")
                yield Button("Back (esc)", id="back")

    def on_mount(self) -> None:
        field = self.query_one("#save-to-path", Input)
        field.cursor_blink = not self.app.is_headless
        field.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self._save()
        else:
            self.dismiss("" if event.button.id == "apply" else None)

    def _save(self) -> None:
        text = self.query_one("#save-to-path", Input).value.strip()
        problem = ""
        if not text:
            problem = "Type a path, or choose Apply only."
        elif Path(text).expanduser().is_dir():
            problem = f"{text} is a folder: name a file in it, e.g. {Path(text) / 'cerevisor.toml'}"
        if problem:
            self.query_one("#save-to-problem", Static).update(problem)
            return
        self.dismiss(text)

    def action_cancel(self) -> None:
        self.dismiss(None)
