"""An in-process run's control: the console sends its commands straight to the engine's `handle`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cerevisor_tui.contract.commands import Command

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine


class LocalControl:
    """The console's RunControl (ui/control.py) for an engine in its own process. Call it from the engine's
    event loop; a command the run refuses raises ValueError, its one line."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine  # for the tests that compare the engine's own state with what the console shows

    def send(self, command: Command) -> Any:
        return self.engine.handle(command)
