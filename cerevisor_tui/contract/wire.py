"""The control socket's messages, version 2: one JSON object per line (UTF-8, `\\n`-terminated), each a Struct
tagged by its "type", checked as it is read.

Client to server:
  {"type": "hello", "protocol": 2, "replay": true}    first; replay: false skips the run's past events
  {"type": "command", "id": 7, "command": {"name": "set_mode", "mode": "auto"}}    contract/commands.py
Server to client:
  {"type": "hello", "protocol": 2, "run_id": ..., "run_dir": ..., "pid": ..., "config": ..., "started_at": ...}
  {"type": "event", "event": {"event": "AgentStarted", "t": ..., ...}}   the event's line, as events.jsonl has it
                          (the replay ends with each running answer so far and the run's RunTally)
  {"type": "live"}        after the replay: what follows happens now
  {"type": "reply", "id": 7, "ok": true, "value": ...}   or "ok": false, "error": "one line"
  {"type": "bye", "reason": "..."}   the server closes the connection after it

Version 1 named a command and its arguments apart (`"name": ..., "args": {...}`); each side refuses the other's
version in its hello.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from cerevisor_tui.contract.commands import AnyCommand, Command, plain
from cerevisor_tui.contract.events import AnyEvent, Event

PROTOCOL = 2


class WireError(Exception):
    """The other side sent something this version does not understand."""


class Message(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    pass


class Hello(Message, tag="hello", frozen=True):
    """The client's first line."""

    protocol: int
    replay: bool = True


class CommandMessage(Message, tag="command", frozen=True):
    id: int
    command: AnyCommand


class Welcome(Message, tag="hello", frozen=True):
    """The server's answer to a hello it takes: which run this is."""

    protocol: int
    run_id: str
    run_dir: str
    pid: int
    config: str = ""
    started_at: float = 0.0


class EventMessage(Message, tag="event", frozen=True):
    event: AnyEvent


class Live(Message, tag="live", frozen=True):
    pass


class Reply(Message, tag="reply", frozen=True):
    id: int | None
    ok: bool
    value: Any = None
    error: str = ""


class Bye(Message, tag="bye", frozen=True):
    reason: str


ClientMessage = Union[Hello, CommandMessage]  # noqa: UP007
ServerMessage = Union[Welcome, EventMessage, Live, Reply, Bye]  # noqa: UP007


class _AnyCommandLine(msgspec.Struct):
    """What is left to read of a command line whose command does not check: its id, to refuse it by."""

    type: str = ""
    id: int | None = None


_encoder = msgspec.json.Encoder()
_client_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)
_loose_decoder = msgspec.json.Decoder(_AnyCommandLine)
EVENT_PREFIX = b'{"type":"event","event":'
NESTED = "a value nested too deeply"


def encode(message: Message) -> bytes:
    """A message's line, newline included."""
    return _encoder.encode(message) + b"\n"


def event_line(event: Event) -> bytes:
    """`encode(EventMessage(event))`, for an event already encoded (a journal line) or not."""
    return EVENT_PREFIX + _encoder.encode(event) + b"}\n"


def command_line(ident: int, command: Command) -> bytes:
    return encode(CommandMessage(ident, command))


def read_server(line: bytes) -> Welcome | EventMessage | Live | Reply | Bye:
    """A line from the server, checked; raises WireError saying why it is not one of its messages."""
    try:
        return _server_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise WireError(plain(str(exc))) from None
    except RecursionError:
        raise WireError(NESTED) from None


def read_client(line: bytes) -> Hello | CommandMessage:
    """A line from a client, checked; raises WireError saying why (with `.ident`, the command's id where the
    line is a command whose values do not check, so that the refusal answers it)."""
    try:
        return _client_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError) as exc:
        # msgspec checks Python's recursion limit as it descends into a value: a deep one inside a field it decodes
        # raises RecursionError, at a depth that depends on the caller's stack
        error = WireError(NESTED if isinstance(exc, RecursionError) else plain(str(exc)))
        try:
            loose = _loose_decoder.decode(line)
        except (msgspec.DecodeError, RecursionError):
            loose = None
        error.ident = loose.id if loose is not None and loose.type == "command" else None  # type: ignore[attr-defined]
        raise error from None
