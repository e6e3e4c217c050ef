"""The approval prompt: a tool call the server's rules `ask` about, with its arguments; the operator approves
it once, approves the tool for the rest of the run, or denies it (the model is told the operator denied it).
Esc leaves it waiting; the inbox and `y` bring it back."""

from __future__ import annotations

import json
from typing import Literal, get_args

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from cerevisor_tui.contract import events as ev

Decision = Literal["once", "run", "deny"]
DECISIONS: tuple[Decision, ...] = get_args(Decision)


def pretty_arguments(arguments: str) -> str:
    """The call's JSON arguments indented for reading; as they came when they are not JSON (or were cut)."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


class ApprovalScreen(ModalScreen[Decision | None]):
    """Dismisses with "once", "run", "deny", or None (later)."""

    BINDINGS = [
        Binding("o", "decide('once')", "Approve once", id="approval_once", tooltip="Run this call"),
        Binding("a", "decide('run')", "Approve for the run", id="approval_run",
                tooltip="Run this call and every later call of this tool, for the rest of the run"),
        Binding("d", "decide('deny')", "Deny", id="approval_deny",
                tooltip="Do not run it: the model is told the operator denied it"),
        Binding("escape", "decide(None)", "Later", id="approval_later", tooltip="Leave it waiting"),
    ]

    def __init__(self, request: ev.ApprovalRequested) -> None:
        super().__init__()
        self.request = request

    def compose(self) -> ComposeResult:
        r = self.request
        with Vertical(id="approval-dialog"):
            yield Static(f"{r.agent} asks to run {r.server}.{r.tool}", id="approval-title", markup=False)
            with VerticalScroll(id="approval-arguments"):
                yield Static(pretty_arguments(r.arguments) or "(no arguments)", markup=False)
            with Horizontal(id="approval-buttons"):
                yield Button("Approve once (o)", variant="primary", id="once")
                yield Button("For the run (a)", variant="warning", id="run")
                yield Button("Deny (d)", variant="error", id="deny")
                yield Button("Later (esc)", id="later")

    def on_mount(self) -> None:
        self.query_one("#once", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(next((decision for decision in DECISIONS if decision == event.button.id), None))

    def action_decide(self, decision: Decision | None) -> None:
        self.dismiss(decision)
