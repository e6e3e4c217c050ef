"""The command palette provider (ctrl+p): every console action by name, with its key and what it does."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from cerevisor_tui.ui.keys import MAIN_BINDINGS, PALETTE_NAMES, effective_keys


class ConsoleCommands(Provider):
    """Offers each binding of the main screen; choosing one runs it as if its key were pressed."""

    def _commands(self) -> list[tuple[str, str, str]]:
        keymap = getattr(self.app, "keymap", {})
        return [
            (PALETTE_NAMES.get(b.id or "", b.description), b.action, f"{b.tooltip}  (key: {effective_keys(b, keymap)})")
            for b in MAIN_BINDINGS
        ]

    def _run(self, action: str) -> partial:
        return partial(self.app.run_action, action, self.screen)

    async def discover(self) -> Hits:
        for name, action, help_text in self._commands():
            yield DiscoveryHit(name, self._run(action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, action, help_text in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), self._run(action), text=name, help=help_text)
