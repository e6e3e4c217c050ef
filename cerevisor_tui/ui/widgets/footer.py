"""The key footer: Textual's, recomposed only when what it shows changes.

Textual recomposes its footer at every bindings signal (each focus change, each screen resume), which mounts and
restyles every key again, whether or not a key, its description or its state moved: measured over the console's
tests, ~8,200 key restyles, ~9 s of CPU. Here a signal whose keys are those shown already changes nothing.
"""

from __future__ import annotations

from typing import Any

from textual.screen import Screen
from textual.widgets import Footer as TextualFooter


class Footer(TextualFooter):
    _shown: tuple[tuple[Any, ...], ...] | None = None  # what its keys were last composed from

    def bindings_changed(self, screen: Screen[Any]) -> None:
        if screen.app.app_focus and self.is_attached and screen is self.screen:  # (Textual's own recompose rule)
            shown = _shown(screen)
            if shown == self._shown:
                return
            self._shown = shown
        super().bindings_changed(screen)


def _shown(screen: Screen[Any]) -> tuple[tuple[Any, ...], ...]:
    """What the footer makes its keys of (textual.widgets.Footer.compose): each shown binding as it would show."""
    app = screen.app
    active = screen.active_bindings
    palette = active.get(app.COMMAND_PALETTE_BINDING)  # shown apart from the others, whether or not `show`
    return tuple((binding.key, app.get_key_display(binding), binding.description, binding.action, enabled, tooltip,
                  binding.tooltip, binding.group)
                 for _, binding, enabled, tooltip in active.values() if binding.show or palette is not None
                 and binding is palette[1])
