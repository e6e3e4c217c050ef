"""The agents pane's filter line (`/`, as in k9s and htop): what is typed filters the rows as it is typed;
enter keeps the filter and goes back to the rows, esc clears it."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input


class AgentFilter(Input):
    """Hidden until `/`; its value is the filter."""

    BINDINGS = [
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    DEFAULT_CSS = """
    AgentFilter {
        display: none;
        height: 1;
        border: none;
        padding: 0 1;
        background: $panel;
        &.-open {
            display: block;
        }
        &:focus {
            border: none;
            background-tint: $foreground 5%;
        }
    }
    """

    class Done(Message):
        """The operator left the filter line: with the filter kept (enter) or cleared (esc)."""

        def __init__(self, cleared: bool) -> None:
            super().__init__()
            self.cleared = cleared

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(placeholder="filter by name or status (enter keeps it, esc clears)", id=id)

    def open(self) -> None:
        self.add_class("-open")
        self.focus()

    def action_clear_filter(self) -> None:
        self.value = ""
        self.remove_class("-open")
        self.post_message(self.Done(cleared=True))

    async def action_submit(self) -> None:
        if not self.value.strip():
            self.remove_class("-open")
        self.post_message(self.Done(cleared=not self.value.strip()))
