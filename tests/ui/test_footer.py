"""The console's footer (ui/widgets/footer.py) on a small app in Textual's pilot: a focus change that leaves the
shown keys as they were keeps the same key widgets; a key whose state or text changes is shown changed."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Button
from textual.widgets._footer import FooterKey

from cerevisor_tui.ui.widgets.footer import Footer

pytestmark = pytest.mark.anyio


class Small(App[None]):
    BINDINGS = [Binding("p", "pause", "Pause"), Binding("k", "kill", "Kill")]

    def __init__(self) -> None:
        super().__init__()
        self.can_kill = True

    def compose(self) -> ComposeResult:
        yield Button("one", id="one")
        yield Button("two", id="two")
        yield Footer(show_command_palette=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return None if action == "kill" and not self.can_kill else True  # None: shown dimmed


def keys(app: Small) -> list[FooterKey]:
    return list(app.screen.query(FooterKey))


async def test_the_footer_keeps_its_keys_across_a_focus_change_and_shows_a_key_that_changed() -> None:
    app = Small()
    async with app.run_test(size=(80, 10)) as pilot:
        await pilot.pause()
        before = keys(app)
        assert [k.key for k in before] == ["p", "k"] and not any(k.has_class("-disabled") for k in before)

        app.query_one("#two", Button).focus()  # Textual's bindings signal; nothing the footer shows moved
        await pilot.pause()
        await pilot.pause()
        assert keys(app) == before  # the same widgets: not mounted and styled again

        app.can_kill = False
        app.refresh_bindings()
        await pilot.pause()
        await pilot.pause()
        after = keys(app)
        assert [k.key for k in after] == ["p", "k"]
        assert after[1].has_class("-disabled") and not after[0].has_class("-disabled")
