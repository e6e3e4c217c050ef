"""A client of a run's control socket (protocol.py): the attached console, `stop`, the tests.

`ControlClient.connect(run_dir)` says hello; `run(on_event)` reads until the server says bye or the
connection ends, handing each event (an engine event object) to `on_event` and each reply to the command
that waits for it. `command(name, **args)` sends a command and waits for its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from cerevisor_tui.engine import events as ev
from cerevisor_tui.supervisor.protocol import LINE_LIMIT, PROTOCOL, ProtocolError, decode, encode, socket_of

CONNECT_WAIT_S = 5.0


class _TokenDeltaLine(msgspec.Struct):
    event: ev.TokenDelta  # the line's other keys ("type", the event's "event") are skipped


_decode_token_delta_line = msgspec.json.Decoder(_TokenDeltaLine).decode
_TOKEN_DELTA_LINE = b'{"type":"event","event":{"event":"TokenDelta",'
_EVENT_LINE = b'{"type":"event",'


def read_event(line: bytes) -> ev.Event | None:
    """The event an event line carries (None when it is one of a kind this version does not know); raises
    ProtocolError for a line that is not JSON.

    A TokenDelta line as the server writes it (nine in ten under load) is decoded by msgspec straight into
    the event, its fields checked against the dataclass: with it the console's side took 9.7 us of CPU an
    event (reading, decoding and the RunMirror's 2.8), 24.4 with json.loads and from_dict for every event
    (benchmarks/event_channel.py, medians of 5 rounds). Any other line, or one that does not fit, takes
    the general way."""
    if line.startswith(_TOKEN_DELTA_LINE):
        try:
            return _decode_token_delta_line(line).event
        except msgspec.DecodeError:
            pass
    message = decode(line)
    if message["type"] != "event":
        raise ProtocolError(f"not an event: {message['type']}")
    return ev.from_dict(message.get("event") or {})


class AttachError(Exception):
    """The run cannot be attached to: one line says why."""


class CommandFailed(Exception):
    """The run refused or could not carry out a command: its own one-line reason."""


class ControlClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: dict[str, Any]) -> None:
        self.reader, self.writer, self.hello = reader, writer, hello
        self.bye = ""  # the server's reason, once it said bye
        self.live = False  # the replay is over
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
            raise AttachError(f"cannot reach run {run_dir.name} at {path}: {exc or 'no answer'}") from None
        try:
            writer.write(encode({"type": "hello", "protocol": PROTOCOL, "replay": replay}))
            hello = decode(await asyncio.wait_for(reader.readline(), CONNECT_WAIT_S))
        except (OSError, TimeoutError, ProtocolError, ValueError) as exc:
            writer.close()
            raise AttachError(f"run {run_dir.name} did not answer: {exc or 'no answer'}") from None
        if hello.get("type") != "hello":
            writer.close()
            raise AttachError(f"run {run_dir.name} refused: {hello.get('reason') or hello}")
        return cls(reader, writer, hello)

    async def run(self, on_event: Callable[[ev.Event], None], on_live: Callable[[], None] | None = None) -> str:
        """Read until the end; returns why it ended (the server's bye, or "connection lost")."""
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    return self.bye or "connection lost"
                try:
                    if line.startswith(_EVENT_LINE):  # nearly every line: straight to the event
                        event, message = read_event(line), None
                    else:
                        message = decode(line)
                except ProtocolError:
                    continue
                if message is None or message["type"] == "event":
                    if message is not None:
                        event = ev.from_dict(message.get("event") or {})
                    if event is not None:
                        on_event(event)
                    continue
                kind = message["type"]
                if kind == "reply":
                    future = self._waiting.pop(message.get("id"), None)
                    if future is not None and not future.done():
                        if message.get("ok"):
                            future.set_result(message.get("value"))
                        else:
                            future.set_exception(CommandFailed(str(message.get("error") or "failed")))
                elif kind == "live":
                    self.live = True
                    if on_live is not None:
                        on_live()
                elif kind == "bye":
                    self.bye = str(message.get("reason") or "the run closed the connection")
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            return self.bye or f"connection lost: {exc}"
        finally:
            self.closed.set()
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(CommandFailed(self.bye or "the connection to the run ended"))
            self._waiting.clear()

    def send(self, name: str, **args: Any) -> asyncio.Future[Any]:
        """Send a command; the future gets its reply's value (or CommandFailed). Needs `run()` reading."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.closed.is_set():
            future.set_exception(CommandFailed(self.bye or "the connection to the run ended"))
            return future
        ident = next(self._ids)
        self._waiting[ident] = future
        try:
            self.writer.write(encode({"type": "command", "id": ident, "name": name, "args": args}))
        except (OSError, RuntimeError) as exc:
            self._waiting.pop(ident, None)
            future.set_exception(CommandFailed(f"cannot send to the run: {exc}"))
        return future

    async def command(self, name: str, **args: Any) -> Any:
        return await self.send(name, **args)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class RemoteControl:
    """The console's RunControl (ui/control.py) over a run's control socket. A command is sent at once and
    answered later: it returns None (what it changed comes back as events), and a refusal is told to
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

    def _send(self, name: str, **args: Any) -> None:
        client = self.client
        if client is None:
            self.on_error(self.refusal)
            return None

        def done(future: asyncio.Future[Any]) -> None:
            if not future.cancelled() and future.exception() is not None:
                self.on_error(str(future.exception()))

        client.send(name, **args).add_done_callback(done)
        return None

    def set_mode(self, mode: str) -> None:
        return self._send("set_mode", mode=mode)

    def cycle_mode(self) -> None:
        return self._send("cycle_mode")

    def set_concurrency(self, cap: int) -> None:
        return self._send("set_concurrency", cap=cap)

    def nudge_cap(self, delta: int) -> None:
        return self._send("nudge_cap", delta=delta)

    def pause(self) -> None:
        return self._send("pause")

    def resume(self) -> None:
        return self._send("resume")

    def kill(self, agent: str, reason: str = "killed by operator") -> None:
        return self._send("kill", agent=agent, reason=reason)

    def extend(self, agent: str, seconds: float | None = None) -> None:
        return self._send("extend", agent=agent, seconds=seconds)

    def retry(self, agent: str) -> None:
        return self._send("retry", agent=agent)

    def approve(self, agent: str, call_id: str, scope: str = "once") -> None:
        return self._send("approve", agent=agent, call_id=call_id, scope=scope)

    def deny(self, agent: str, call_id: str) -> None:
        return self._send("deny", agent=agent, call_id=call_id)

    def set_stall(self, endpoint: str, policy: dict[str, Any]) -> None:
        return self._send("set_stall", endpoint=endpoint, policy=policy)

    def stop(self, reason: str = "run stopped") -> None:
        return self._send("stop", reason=reason)

    def probe(self, endpoint: str, max_concurrency: int | None = None) -> None:
        return self._send("probe", endpoint=endpoint, max_concurrency=max_concurrency)

    def cancel_probe(self, endpoint: str) -> None:
        return self._send("cancel_probe", endpoint=endpoint)
