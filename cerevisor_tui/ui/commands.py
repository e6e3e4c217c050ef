"""The command palette provider (ctrl+p): every console action by name, with its key and what it does, plus
the actions without a key: probing an endpoint, and resuming the last run when it did not complete."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from cerevisor_tui.ui.keys import MAIN_BINDINGS, PALETTE_NAMES, effective_keys


class ConsoleCommands(Provider):
    """Offers each binding of the main screen; choosing one runs it as if its key were pressed."""

    def _commands(self) -> list[tuple[str, str, str]]:
        app = self.app
        keymap = getattr(app, "keymap", {})
        commands = [
            (PALETTE_NAMES.get(b.id or "", b.description), b.action, f"{b.tooltip}  (key: {effective_keys(b, keymap)})")
            for b in MAIN_BINDINGS
        ]
        mirror = getattr(app, "mirror", None)
        for name, ep in (mirror.endpoints.items() if mirror is not None else ()):
            commands.append((f"Probe endpoint {name}", f"probe({name!r})",
                             f"Sweep {name} at concurrency 1, 2, 4, ... with short requests and recommend a cap"
                             + (" (a hosted API: its requests may cost)" if ep.kind == "hosted" else "")))
        offer = getattr(app, "resume_offer", None)
        if offer is not None:
            commands.append(("Resume last run", "app.resume_last_run",
                             f"Stop this run and go on with {offer.run_id}: {offer.completed} of {offer.total} "
                             "agents completed there and are not sent again"))
        return commands

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
