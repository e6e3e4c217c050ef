"""An in-process run's control: the console sends its commands straight to the engine's `handle`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cerevisor_tui.contract.commands import Answer, Command

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine


class LocalControl:
    """The console's RunControl (ui/control.py) for an engine in its own process. Call it from the engine's
    event loop; `then` gets the run's answer at once, as a detached run's client gives it when the reply comes.
    A command the run refuses, sent without `then`, raises ValueError, its one line."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine  # for the tests that compare the engine's own state with what the console shows

    def send(self, command: Command, then: Callable[[Answer], None] | None = None) -> None:
        try:
            answer = Answer(self.engine.handle(command))
        except ValueError as exc:
            if then is None:
                raise
            answer = Answer(error=str(exc) or type(exc).__name__)
        if then is not None:
            then(answer)
