"""What the console may ask of a run: its operator commands (contract/commands.py), sent one at a time.

The console holds one of these and never an engine: in-process it is the engine's own `handle`, for a
detached run a client of the run's control socket. What a command changes comes back as events (the
mirror, `ui/mirror.py`); the run's answer (`Answer`: what it did, or why it refused) is the same either way,
given to `then` at once in-process and when the socket's reply comes for a detached run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cerevisor_tui.contract.commands import Answer, Command


class RunControl(Protocol):
    def send(self, command: Command, then: Callable[[Answer], None] | None = None) -> None: ...
