"""The run's control socket (contract/wire.py, supervisor/protocol.py): every client gets the run's events, the past ones from the
journal and then each one live, and may send commands. It lives in the run's own process and event loop,
subscribed to the engine like the journal; a client that cannot keep up is dropped, never waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from cerevisor_tui.config.paths import write_json_atomic
from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.commands import Command
from cerevisor_tui.contract.wire import (
    EVENT_PREFIX,
    PROTOCOL,
    Bye,
    Hello,
    Live,
    Reply,
    Welcome,
    WireError,
    encode,
    event_line,
    read_client,
)
from cerevisor_tui.engine.sinks.journal import EVENTS_FILE
from cerevisor_tui.supervisor.protocol import (
    SUPERVISOR_FILE,
    peer_credentials,
    socket_path_for,
    started_by,
    supervisor_file,
)

HELLO_WAIT_S = 10.0
COMMAND_LINE_LIMIT = 1024 * 1024
"""The longest line a client may send (a hello, a command): what it reads is never a replayed answer."""
FLUSH_EVERY_S = 0.05
"""Events go to a client in one write at most this often (a reply at once, after the events before it), so
the attached console wakes once per write, not once per event. Events told when the last write is older than
this go at the end of the loop's turn that told them: a quiet run then writes in the turn it wakes for, not in a
second wake later. At 20 ms a stream read every 25 ms (a gateway's one request at 320 tokens/s) cost a write
and a loop turn for each of its token deltas, ~35 us each on a 2-core box, ~0.25 ms of each request. 50 ms stays
under the stream pane's 12 Hz draw, so each frame it draws still has the latest text; countdowns are absolute
times, so nothing drawn is late by it."""
CLIENT_BUFFER_MAX = 32 * 1024 * 1024
"""Bytes a client may have waiting in its socket's buffer, or held for it while its replay is sent; past it the
client is dropped (it reattaches)."""
REPLAY_CHUNK = 256 * 1024
"""The journal goes to an attaching client this many bytes at a time, each sent before the next is read: a
long run's journal (12 bytes an output token: 90 MB after an hour at 2,000 tokens/s) is never read or
buffered whole, and the run's loop goes on between chunks."""
CLIENTS_MAX = 32
"""Connections at once (consoles, `stop`, `ls`); one more is told so and closed."""
BUFFERED_MAX = 128 * 1024 * 1024
"""Bytes waiting for all clients together; past it the client furthest behind is dropped."""
CLOSE_WAIT_S = 2.0
"""A client being let go gets this long to take in what is pending and its bye; then its connection is aborted
(one that reads nothing would otherwise hold its socket and buffer until the run ends)."""

Dispatch = Callable[[Command], Any]
_TOKEN_DELTA = ev.TokenDelta


class _Client:
    __slots__ = ("writer", "pending", "replaying", "held", "counted")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[bytes] = []
        self.replaying = False  # the past is being sent: live events wait in `pending`
        self.held = 0  # bytes of them, counted up to pending[counted]
        self.counted = 0


def _behind(client: _Client) -> int:
    """Bytes waiting for a client: in its socket's buffer, and held for it while its replay is sent."""
    return client.writer.transport.get_write_buffer_size() + client.held


class ControlServer:
    """`await start()`, subscribe it to the engine (`engine.subscribe(server)`), `await close()` at the end.

    `dispatch(command)` carries out a command (`Engine.handle`) and returns a JSON-able value, or raises
    ValueError (or any exception) whose text goes back as the reply's error. `in_flight()` gives each running attempt's answer so
    far as events (`Engine.in_flight`): what a client attaching mid-answer gets after the journal. Then it gets
    the run's totals the journal does not hold (RunTally: the output tokens, counted here from every token delta
    the run emits), so a console that attaches late shows the run's figures, not the ones since it came.
    """

    def __init__(self, run_dir: Path, run_id: str, dispatch: Dispatch, *, config_path: str = "",
                 in_flight: Callable[[], list[ev.Event]] = list, journal_flush: Callable[[], None] = lambda: None,
                 buffer_max: int = CLIENT_BUFFER_MAX,
                 buffered_max: int = BUFFERED_MAX, clients_max: int = CLIENTS_MAX) -> None:
        # resolved: a client compares it with the directory it asked for (a copy of a run directory names our socket)
        self.run_dir, self.run_id, self.dispatch = Path(run_dir).resolve(), run_id, dispatch
        self.buffer_max, self.buffered_max, self.clients_max = buffer_max, buffered_max, clients_max
        self.config_path = config_path
        self.in_flight = in_flight
        self.journal_flush = journal_flush  # the lines the journal gathered this turn, written before a replay reads it
        self.events_path = self.run_dir / EVENTS_FILE
        self.path: Path | None = None
        self.started_at = time.time()
        self.resumed_at = 0.0
        self._connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._clients: list[_Client] = []
        self.on_client_gone: Callable[[], None] | None = None  # told after a client has left (`clients` is one less)
        self._flush_pending = False
        self._flushed_at = 0.0  # the loop's time of the last flush
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.output_tokens = 0  # streamed by the run so far (its token deltas' counts): the RunTally a client gets

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> Path:
        """Listen (socket mode 0600) and write supervisor.json; raises OSError when the socket cannot be made."""
        self._loop = asyncio.get_running_loop()
        path = socket_path_for(self.run_dir, self.run_id)
        with contextlib.suppress(FileNotFoundError):
            if path.is_socket():
                path.unlink()  # a dead run's socket (this run holds the run directory's lock)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=COMMAND_LINE_LIMIT)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self.path = path
        try:
            before = supervisor_file(self.run_dir)
        except ValueError:
            before = None
        if before is not None and before.run_id == self.run_id and 0 < before.started_at < self.started_at:
            self.started_at, self.resumed_at = before.started_at, self.started_at  # a resumed run: its first start
        write_json_atomic(self.run_dir / SUPERVISOR_FILE, {
            "pid": os.getpid(), "socket": str(path), "run_id": self.run_id, "protocol": PROTOCOL,
            "config": self.config_path, "started_at": self.started_at, "resumed_at": self.resumed_at,
            "by": started_by()})
        return path

    async def close(self, reason: str = "the run ended") -> None:
        """Send every client what is pending and a bye, close them and the socket."""
        if self._server is not None:
            self._server.close()
        self._flush()
        clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(OSError, RuntimeError):
                client.writer.write(encode(Bye(reason)))
        for client in clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.writer.drain(), CLOSE_WAIT_S)
            self._let_go(client.writer)
        # Each client's task ends by itself once its connection is closed. Only one that does not is cancelled:
        # Python 3.11's start_unix_server logs a cancelled client task as an error, with a traceback, in the
        # run's log, at the end of every run that had a console attached.
        tasks = [task for task in self._tasks if task is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        for task in tasks:
            task.cancel()
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()

    @property
    def clients(self) -> int:
        return len(self._clients)

    # ---- events -----------------------------------------------------------------------------------
    def __call__(self, event: ev.Event) -> None:
        if type(event) is _TOKEN_DELTA:  # (the class bound once: this runs for every token of the run)
            self.output_tokens += event.tokens
        if not self._clients:
            return
        line = event_line(event)
        for client in self._clients:
            client.pending.append(line)
        if not self._flush_pending and self._loop is not None:
            self._flush_pending = True
            wait_s = self._flushed_at + FLUSH_EVERY_S - self._loop.time()
            if wait_s <= 0:
                self._loop.call_soon(self._flush)
            else:
                self._loop.call_later(wait_s, self._flush)

    def _flush(self) -> None:
        """One write per client per FLUSH_EVERY_S at most: what the engine emitted meanwhile."""
        self._flush_pending = False
        if self._loop is not None:
            self._flushed_at = self._loop.time()
        for client in list(self._clients):
            if not client.pending:
                continue
            if client.replaying:  # its live events wait for the past; one that does not take the past in is let go
                client.held += sum(map(len, client.pending[client.counted:]))
                client.counted = len(client.pending)
                if client.held > self.buffer_max:
                    self._drop(client, "this client fell too far behind the run's events; attach again")
                continue
            data = b"".join(client.pending)
            client.pending.clear()
            try:
                client.writer.write(data)
            except (OSError, RuntimeError):
                self._drop(client, "")
                continue
            if client.writer.transport.get_write_buffer_size() > self.buffer_max:
                self._drop(client, "this client fell too far behind the run's events; attach again")
        total = sum(map(_behind, self._clients))
        while total > self.buffered_max and self._clients:
            furthest = max(self._clients, key=_behind)
            total -= _behind(furthest)
            self._drop(furthest, "the run's clients together fell too far behind its events, and this one furthest; "
                                 "attach again")

    def _drop(self, client: _Client, reason: str) -> None:
        with contextlib.suppress(ValueError):
            self._clients.remove(client)
        if reason:
            with contextlib.suppress(OSError, RuntimeError):
                client.writer.write(encode(Bye(reason)))
        self._let_go(client.writer)

    def _let_go(self, writer: asyncio.StreamWriter) -> None:
        """Close a client's connection: what is pending for it gets CLOSE_WAIT_S to go, then the connection is
        aborted (`close()` alone waits for a flush that a client that reads nothing never allows)."""
        writer.close()
        transport = writer.transport
        if transport.get_write_buffer_size() and self._loop is not None:
            self._loop.call_later(CLOSE_WAIT_S, transport.abort)

    async def _send_past(self, client: _Client, end: int, snapshot: list[bytes]) -> None:
        """The journal's first `end` bytes, a chunk at a time as the client takes them in, then `snapshot` (each
        running agent's answer so far, and the run's tally). Live events meanwhile wait in the client's `pending`."""
        writer = client.writer
        try:
            fh = open(self.events_path, "rb")
        except OSError:
            end = 0
        else:
            with fh:
                rest = b""
                while end > 0 and client in self._clients:
                    chunk = fh.read(min(REPLAY_CHUNK, end))
                    if not chunk:
                        break
                    end -= len(chunk)
                    data = rest + chunk
                    cut = data.rfind(b"\n") + 1 if end > 0 else len(data)
                    data, rest = data[:cut], data[cut:]
                    writer.write(b"".join([EVENT_PREFIX + raw + b"}\n" for raw in map(bytes.strip, data.split(b"\n"))
                                           if raw.startswith(b"{") and raw.endswith(b"}")]))
                    await writer.drain()
        writer.write(b"".join(snapshot))

    # ---- one client -------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        client: _Client | None = None
        self._connections += 1
        try:
            creds = peer_credentials(writer.get_extra_info("socket"))
            if creds is not None and creds[1] != os.getuid():
                writer.write(encode(Bye(f"refused: uid {creds[1]} is not the run's owner")))
                return
            if self._connections > self.clients_max:
                writer.write(encode(Bye(f"refused: this run has {self.clients_max} clients connected already, the "
                                        "most it takes; detach one and try again")))
                return
            try:
                hello = read_client(await asyncio.wait_for(reader.readline(), HELLO_WAIT_S))
            except (WireError, TimeoutError, ValueError) as exc:
                writer.write(encode(Bye(f"expected a hello: {str(exc) or 'none came'}")))
                return
            if not isinstance(hello, Hello) or hello.protocol != PROTOCOL:
                said = f"protocol {hello.protocol}" if isinstance(hello, Hello) else "a command before its hello"
                writer.write(encode(Bye(f"this run speaks protocol {PROTOCOL}, not {said}")))
                return
            writer.write(encode(Welcome(PROTOCOL, self.run_id, str(self.run_dir), os.getpid(), self.config_path,
                                        self.started_at)))
            client = _Client(writer)
            end, snapshot = 0, list[bytes]()
            if hello.replay:
                # In one step of the loop, no emit in between: the journal as it stands (what it gathered this
                # turn written first), each running agent's answer so far, and the client taken in, so that every
                # event after these goes to its `pending`: nothing is missed or doubled.
                self.journal_flush()
                with contextlib.suppress(OSError):
                    end = os.stat(self.events_path).st_size
                snapshot = [event_line(delta) for delta in self.in_flight()]
                snapshot.append(event_line(ev.RunTally(time.monotonic(), self.output_tokens)))
                client.replaying = True
            self._clients.append(client)
            if client.replaying:
                await self._send_past(client, end, snapshot)
                if client not in self._clients:
                    return
                client.replaying, client.held, client.counted = False, 0, 0
            client.pending.insert(0, encode(Live()))
            self._flush()
            await self._commands(reader, client)
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except (ValueError, asyncio.LimitOverrunError):  # a line over COMMAND_LINE_LIMIT
            with contextlib.suppress(OSError, RuntimeError):
                writer.write(encode(Bye(f"a line over {COMMAND_LINE_LIMIT // 1024} KiB: not a command of this run")))
        finally:
            self._connections -= 1
            if client is not None:
                with contextlib.suppress(ValueError):
                    self._clients.remove(client)
                if self.on_client_gone is not None:
                    self.on_client_gone()
            self._let_go(writer)
            if task is not None:
                self._tasks.discard(task)

    async def _commands(self, reader: asyncio.StreamReader, client: _Client) -> None:
        while True:
            line = await reader.readline()
            if not line:
                return
            try:
                message = read_client(line)
            except WireError as exc:
                client.pending.append(encode(Reply(getattr(exc, "ident", None), False, error=str(exc))))
                self._flush()
                continue
            if isinstance(message, Hello):
                continue
            try:
                reply = Reply(message.id, True, self.dispatch(message.command))
            except Exception as exc:  # noqa: BLE001 - any command's failure is the client's answer, not ours
                reply = Reply(message.id, False, error=str(exc) or type(exc).__name__)
            try:
                client.pending.append(encode(reply))
            except (TypeError, ValueError, msgspec.MsgspecError):  # a value with no JSON form: the command was done
                client.pending.append(encode(Reply(message.id, True)))
            self._flush()
