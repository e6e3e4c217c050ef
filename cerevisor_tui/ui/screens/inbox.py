"""The attention inbox (`i`): every agent that needs the operator, newest first; enter goes to the agent (and
opens the approval prompt when a tool call waits), `d` dismisses an item, esc goes back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from cerevisor_tui.ui.format import fmt_clock
from cerevisor_tui.ui.inbox import AttentionItem

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

KIND_ROLES = {"approval": "warning", "killed": "error", "failed": "error", "endpoint": "warning",
              "stall": "stall-critical", "wedged": "error"}


class InboxScreen(ModalScreen[str | None]):
    """Dismisses with the agent to go to, or None."""

    app: CerevisorApp
    BINDINGS = [
        Binding("escape,i", "close", "Back", id="inbox_close", tooltip="Back to the agents"),
        Binding("d,delete", "dismiss_item", "Dismiss", id="inbox_dismiss",
                tooltip="Take the item out of the inbox (it comes back if the agent's state changes again)"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._version = -1
        self._items: list[AttentionItem] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="inbox-dialog"):
            yield Static("Needs you", id="inbox-title")
            yield OptionList(id="inbox-list")
            yield Static("enter: go to the agent and act · d: dismiss · esc: back", id="inbox-hint")

    def on_mount(self) -> None:
        self._fill()
        self.set_interval(0.5, self._fill, name="inbox-refresh")
        self.query_one(OptionList).focus()

    def _fill(self) -> None:
        inbox = self.app.mirror.inbox
        if inbox.version == self._version:
            return
        self._version = inbox.version
        options = self.query_one(OptionList)
        selected = options.highlighted
        keep = self._items[selected].agent if selected is not None and selected < len(self._items) else None
        self._items = inbox.newest_first()
        now = self.app.clock()
        options.clear_options()
        if not self._items:
            options.add_option(Option(Text("Nothing needs you now.", style=self.app.colour("text-muted")),
                                      disabled=True))
            return
        options.add_options([Option(self._line(item, now), id=item.agent) for item in self._items])
        names = [item.agent for item in self._items]
        options.highlighted = names.index(keep) if keep in names else 0

    def _line(self, item: AttentionItem, now: float) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{fmt_clock(now - item.t):>6} ago  ", style=self.app.colour("text-muted"))
        line.append(item.agent, style="bold")
        line.append("  ")
        line.append(item.label, style=f"bold {self.app.colour(KIND_ROLES.get(item.kind, 'warning'))}")
        line.append(f"  {item.text}")
        return line

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_dismiss_item(self) -> None:
        options = self.query_one(OptionList)
        index = options.highlighted
        if index is None or index >= len(self._items):
            return
        self.app.mirror.inbox.clear(self._items[index].agent)
        self._fill()

    def action_close(self) -> None:
        self.dismiss(None)
