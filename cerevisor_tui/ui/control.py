"""What the console may ask of a run: its operator commands (contract/commands.py), sent one at a time.

The console holds one of these and never an engine: in-process it is the engine's own `handle`, for a
detached run a client of the run's control socket. What a command changes comes back as events (the
mirror, `ui/mirror.py`); a return value is a courtesy for a message, and is None where the transport
does not wait for the answer.
"""

from __future__ import annotations

from typing import Any, Protocol

from cerevisor_tui.contract.commands import Command


class RunControl(Protocol):
    def send(self, command: Command) -> Any: ...
