"""A client of a run's control socket (contract/wire.py): the attached console, `stop`, the tests.

`ControlClient.connect(run_dir)` says hello and trusts the answer only from the run itself (the same user, the
process supervisor.json names, serving this directory: supervisor/protocol.py `check_server`); `run(on_event)` reads until the server says bye or the
connection ends, handing each event to `on_event` and each reply to the command that waits for it.
`send(command)` sends a command (contract/commands.py) and gives a future of its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.commands import Answer, Command
from cerevisor_tui.contract.wire import (
    PROTOCOL,
    Bye,
    EventMessage,
    Hello,
    Live,
    Reply,
    Welcome,
    WireError,
    command_line,
    encode,
    read_server,
)
from cerevisor_tui.supervisor.protocol import LINE_LIMIT, check_server, check_user, socket_of

CONNECT_WAIT_S = 5.0


class AttachError(Exception):
    """The run cannot be attached to: one line says why."""


class CommandFailed(Exception):
    """The run refused or could not carry out a command: its own one-line reason."""


class ControlClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: Welcome) -> None:
        self.reader, self.writer, self.hello = reader, writer, hello
        self.bye = ""  # the server's reason, once it said bye
        self.live = False  # the replay is over
        self.unreadable = 0  # lines that were not messages of this version (an event of a kind it does not know)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.closed = asyncio.Event()

    @classmethod
    async def connect(cls, run_dir: Path, *, replay: bool = True) -> ControlClient:
        path = socket_of(run_dir)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(path), limit=LINE_LIMIT), CONNECT_WAIT_S)
        except FileNotFoundError:
            raise AttachError(f"run {run_dir.name} is not live (no control socket at {path})") from None
        except ConnectionRefusedError:
            raise AttachError(f"run {run_dir.name} is not live (nothing listens at {path})") from None
        except PermissionError:
            raise AttachError(f"not allowed to open {path}: the run belongs to another user") from None
        except (OSError, TimeoutError) as exc:
            raise AttachError(f"cannot reach run {run_dir.name} at {path}: {str(exc) or 'no answer'}") from None
        problem = check_user(writer.get_extra_info("socket"))
        if problem:  # another user's process: nothing is said to it, nothing taken from it as the run's
            writer.close()
            raise AttachError(f"run {run_dir.name} is not live, or not reachable safely: {problem}")
        try:
            writer.write(encode(Hello(PROTOCOL, replay)))
            hello = read_server(await asyncio.wait_for(reader.readline(), CONNECT_WAIT_S))
        except (OSError, TimeoutError, WireError, ValueError) as exc:
            writer.close()
            raise AttachError(f"run {run_dir.name} did not answer: {str(exc) or 'no answer'}") from None
        if not isinstance(hello, Welcome):
            writer.close()
            why = hello.reason if isinstance(hello, Bye) else f"a {type(hello).__name__} before its hello"
            raise AttachError(f"run {run_dir.name} refused: {why}")
        problem = check_server(run_dir, writer.get_extra_info("socket"), hello)
        if problem:  # another run's (a copy of its directory was asked for), or not a run's process
            writer.close()
            raise AttachError(f"run {run_dir.name} is not live, or not reachable safely: {problem}")
        return cls(reader, writer, hello)

    async def run(self, on_event: Callable[[ev.Event], None], on_live: Callable[[], None] | None = None,
                  on_unreadable: Callable[[str], None] | None = None) -> str:
        """Read until the end; returns why it ended (the server's bye, or "connection lost"). A line this version
        cannot read is counted, and the first one told to `on_unreadable` (why, in one line)."""
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    return self.bye or "connection lost"
                if not line.endswith(b"\n"):  # the end came mid-line: cut off (a run lets a client that fell
                    # behind go, and aborts it when it takes its last lines in too slowly), not a line of another version
                    return self.bye or "connection lost mid-event (the run may have let this console go: it fell behind)"
                try:
                    message = read_server(line)
                except WireError as exc:
                    self.unreadable += 1
                    if self.unreadable == 1 and on_unreadable is not None:
                        on_unreadable(str(exc))
                    continue
                if isinstance(message, EventMessage):  # nearly every line
                    on_event(message.event)
                elif isinstance(message, Reply):
                    future = self._waiting.pop(message.id, None) if message.id is not None else None
                    if future is not None and not future.done():
                        if message.ok:
                            future.set_result(message.value)
                        else:
                            future.set_exception(CommandFailed(message.error or "failed"))
                elif isinstance(message, Live):
                    self.live = True
                    if on_live is not None:
                        on_live()
                elif isinstance(message, Bye):
                    self.bye = message.reason or "the run closed the connection"
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            return self.bye or f"connection lost: {exc}"
        finally:
            self.closed.set()
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(CommandFailed(self.bye or "the connection to the run ended"))
            self._waiting.clear()

    def send(self, command: Command) -> asyncio.Future[Any]:
        """Send a command; the future gets its reply's value (or CommandFailed). Needs `run()` reading."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.closed.is_set():
            future.set_exception(CommandFailed(self.bye or "the connection to the run ended"))
            return future
        ident = next(self._ids)
        self._waiting[ident] = future
        try:
            self.writer.write(command_line(ident, command))
        except (OSError, RuntimeError) as exc:
            self._waiting.pop(ident, None)
            future.set_exception(CommandFailed(f"cannot send to the run: {exc}"))
        return future

    async def command(self, command: Command) -> Any:
        return await self.send(command)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class RemoteControl:
    """The console's RunControl (ui/control.py) over a run's control socket. A command is sent at once and
    answered later: `then` gets the run's answer when its reply comes, the same `Answer` an in-process run
    gives (a connection that ends first is a refusal that says so). Sent without `then`, a refusal is told to
    `on_error` in the run's own words. Unbound, or bound to nothing (a run that has ended, shown read-only),
    every command is refused with `refusal`."""

    def __init__(self, on_error: Callable[[str], None], refusal: str = "not connected to the run yet") -> None:
        self.client: ControlClient | None = None
        self.on_error = on_error
        self.refusal = refusal

    def bind(self, client: ControlClient | None, refusal: str = "") -> None:
        self.client = client
        if refusal:
            self.refusal = refusal

    def send(self, command: Command, then: Callable[[Answer], None] | None = None) -> None:
        client = self.client
        if client is None:
            self._answered(Answer(error=self.refusal), then)
            return

        def done(future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                return
            problem = future.exception()
            self._answered(Answer(future.result()) if problem is None else Answer(error=str(problem)), then)

        client.send(command).add_done_callback(done)

    def _answered(self, answer: Answer, then: Callable[[Answer], None] | None) -> None:
        if then is not None:
            then(answer)
        elif answer.refused:
            self.on_error(answer.error)
