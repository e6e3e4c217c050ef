"""A stdio MCP server as a process and the (read, write) message streams the SDK's `ClientSession` speaks
over (the SDK's `Transport` seam), in place of the SDK's `stdio_client` for what it reads and where the
server's stderr goes.

- A message is one line of the server's stdout, gathered in bytes into one buffer, and never more than
  `max_message_bytes` of it: a longer one is let stream by unread and the request it answers gets an error
  that says its size. (The SDK's reader joins each chunk to all it holds and splits again, quadratic in a
  line's length: a 20 MB result took 12 s of a core, and 150 MB did not arrive within a 60 s tool deadline;
  benchmarks/mcp_stdio.py.)
- The server's stderr goes through the run's scrubber into its log file (a server given a key through `env`
  may log it), and the file is bounded (`ServerLog`).
- The way out is the SDK's: stdin closed, a grace period, then the server's process group terminated.
- Once the process has exited, `exit_text` says how, for the messages about a server that stopped.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from cerevisor_tui.config.secrets import Scrubber

MESSAGE_MAX_BYTES = 64 * 1024 * 1024
"""Longest message read from a stdio server (raised for a server whose max_result_chars needs more). A
result's text often comes twice in its message (as text content and as structured content): 10 MB of text is
a 20 MB message from the SDK's own server side."""
LOG_MAX_BYTES = 8 * 1024 * 1024
"""Size at which a server's log moves to `<log>.1` and a new one begins: at most twice this on disk."""
GRACE_S = 2.0  # after stdin closes, before the process group is terminated (the SDK's figures)
KILL_AFTER_S = 2.0  # after SIGTERM, before SIGKILL
_STDERR_TAIL_CHARS = 2000
_HEAD_BYTES = 4096  # what is kept of an over-long message to tell which request it answers
_TAIL_BYTES = 256

# the id of a JSON-RPC message, where it is its first member (after "jsonrpc") or its last
_HEAD_ID = re.compile(rb'\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')
_TAIL_ID = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")\s*\}\s*$')


def message_max_bytes(max_result_chars: int) -> int:
    """The bound on one message of a server whose results are cut at `max_result_chars`: 64 MiB, or room
    for a result that long twice over with every character JSON-escaped (6 bytes), when that is more."""
    return max(MESSAGE_MAX_BYTES, 12 * max_result_chars + 65536)


@dataclass
class _Over:
    """A message longer than the bound: its size, and enough of its ends to find its id."""

    size: int
    head: bytes
    tail: bytes = b""


class _Lines:
    """Splits a byte stream at line feeds, in time linear in its length; a line past `max_bytes` comes out as
    an `_Over` instead of its bytes, which are not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.buffer = bytearray()
        self.over: _Over | None = None

    def feed(self, chunk: bytes) -> list[bytearray | _Over]:
        out: list[bytearray | _Over] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = memoryview(chunk)[start : len(chunk) if end < 0 else end]
            if self.over is not None:
                self.over.size += len(piece)
                self.over.tail = (self.over.tail + bytes(piece[-_TAIL_BYTES:]))[-_TAIL_BYTES:]
            elif len(self.buffer) + len(piece) > self.max_bytes:
                head = bytes(self.buffer[:_HEAD_BYTES]) + bytes(piece[:_HEAD_BYTES])
                self.over = _Over(
                    len(self.buffer) + len(piece), head[:_HEAD_BYTES], bytes(piece[-_TAIL_BYTES:])
                )
                self.buffer = bytearray()
            else:
                self.buffer += piece
            if end < 0:
                return out
            if self.over is not None:
                out.append(self.over)
                self.over = None
            else:
                out.append(self.buffer)  # handed over, not copied: a message may be tens of MB
                self.buffer = bytearray()
            start = end + 1


class ServerLog:
    """A server's stderr file (none without a path), bounded: once it holds `max_bytes` it becomes
    `<name>.1` (replacing the one before) and a new file begins with a line that says where the rest went."""

    def __init__(self, path: Path | None, max_bytes: int = LOG_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.file: Any = None
        self.size = 0

    def open(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8", errors="replace")
            self.size = self.file.tell()
        except OSError:
            self.file = None

    def write(self, text: str) -> None:
        if self.file is None or not text:
            return
        size = len(text.encode("utf-8", "replace"))
        try:
            if self.size and self.size + size > self.max_bytes:
                self._rotate()
            self.file.write(text)
            self.file.flush()
            self.size += size
        except OSError:  # a full disk costs the server's log, never the run
            self.close()

    def _rotate(self) -> None:
        assert self.path is not None
        self.file.close()
        earlier = self.path.with_name(self.path.name + ".1")
        os.replace(self.path, earlier)
        self.file = open(self.path, "w", encoding="utf-8", errors="replace")
        note = (
            f"[cerevisor-tui: this log reached {self.max_bytes // (1024 * 1024)} MiB; its earlier part is in "
            f"{earlier.name}, and what came before that was dropped]\n"
        )
        self.file.write(note)
        self.size = len(note)

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None


class StdioServer:
    """One stdio server process: `connect()` starts it and yields the session's streams; afterwards
    `exit_text()` says how it ended, and `stderr_tail` holds the end of what it wrote to stderr (scrubbed)."""

    def __init__(
        self,
        command: str,
        args: list[str],
        env: dict[str, str],
        cwd: str | None,
        *,
        log: ServerLog,
        scrub: Scrubber,
        max_message_bytes: int = MESSAGE_MAX_BYTES,
    ) -> None:
        self.command = [command, *args]
        self.env = env
        self.cwd = cwd
        self.log = log
        self.scrub = scrub
        self.max_message_bytes = max_message_bytes
        self.process: Process | None = None
        self.stderr_tail = ""
        self.pending: set[Any] = set()  # ids of our requests not yet answered

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def exit_text(self) -> str:
        """How the process ended, with where its stderr is ("" while it runs)."""
        code = self.returncode
        if code is None:
            return ""
        if code < 0:
            try:
                how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        last = next((line.strip() for line in reversed(self.stderr_tail.splitlines()) if line.strip()), "")
        if len(last) > 200:
            last = last[:199] + "…"
        said = f"its stderr ends: {json.dumps(last, ensure_ascii=False)}" if last else "nothing on its stderr"
        where = f"; its log: {self.log.path}" if self.log.path is not None else ""
        return f"it {how} ({said}{where})"

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[tuple[Any, Any]]:
        from mcp.client.stdio import get_default_environment

        self.log.open()
        try:
            self.process = await anyio.open_process(
                self.command, env=get_default_environment() | self.env, cwd=self.cwd, start_new_session=True
            )
        except BaseException:
            self.log.close()
            raise
        read_send, read_stream = anyio.create_memory_object_stream[Any](0)
        write_stream, write_receive = anyio.create_memory_object_stream[Any](0)
        stderr_done = anyio.Event()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._read_stdout, read_send)
                group.start_soon(self._write_stdin, write_receive, read_send)
                group.start_soon(self._pump_stderr, stderr_done)
                try:
                    yield read_stream, write_stream
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._stop(stderr_done)
                        for stream in (read_stream, write_stream, read_send, write_receive):
                            await stream.aclose()
                    group.cancel_scope.cancel()
        finally:
            self.log.close()

    async def _read_stdout(self, send: Any) -> None:
        from mcp.shared.message import SessionMessage
        from mcp.types import JSONRPCError, JSONRPCResponse, jsonrpc_message_adapter

        assert self.process is not None and self.process.stdout is not None
        lines = _Lines(self.max_message_bytes)
        listening = True  # until the session is gone; the server's output is read to its end all the same
        try:
            async for chunk in self.process.stdout:
                for line in lines.feed(chunk):
                    if not listening:
                        continue
                    if isinstance(line, _Over):
                        messages: list[Any] = self._refusals(line)
                    elif not line.strip():
                        continue
                    else:
                        try:
                            message = jsonrpc_message_adapter.validate_json(line, by_name=False)
                        except ValueError as exc:
                            messages = [exc]
                        else:
                            if isinstance(message, JSONRPCResponse | JSONRPCError):
                                self.pending.discard(message.id)
                            messages = [SessionMessage(message)]
                    for message in messages:
                        if listening:
                            try:
                                await send.send(message)
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                listening = False
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass
        # the end of its stdout: mostly the server exiting; wait a little for its exit status, which the
        # messages about it name
        with anyio.move_on_after(GRACE_S):
            while self.process.returncode is None:
                await anyio.sleep(0.01)
        await send.aclose()

    def _refusals(self, over: _Over) -> list[Any]:
        """Errors for the request an over-long message answers (every waiting one, when it does not say which);
        none for a message of the server's own (a request or notification: dropped, and said in its log)."""
        from mcp.shared.message import SessionMessage
        from mcp.types import INTERNAL_ERROR, ErrorData, JSONRPCError

        limit_mib = self.max_message_bytes / (1024 * 1024)
        text = (
            f"the server's answer was {over.size:,} bytes, over the {limit_mib:g} MiB a message may be: "
            "it was not read"
        )
        found = _HEAD_ID.match(over.head) or _TAIL_ID.search(over.tail)
        ids: list[Any] = []
        if found:
            request_id = json.loads(found.group(1))
            ids = [request_id] if request_id in self.pending else []
        elif b'"method"' not in over.head[:200]:
            ids = list(self.pending)
        if not ids:
            self.log.write(
                f"[cerevisor-tui: a message of {over.size:,} bytes from this server was dropped, over "
                f"the {limit_mib:g} MiB bound]\n"
            )
        for request_id in ids:
            self.pending.discard(request_id)
        return [
            SessionMessage(
                JSONRPCError(jsonrpc="2.0", id=request_id, error=ErrorData(code=INTERNAL_ERROR, message=text))
            )
            for request_id in ids
        ]

    async def _write_stdin(self, receive: Any, read_send: Any) -> None:
        from mcp.types import JSONRPCNotification, JSONRPCRequest

        assert self.process is not None and self.process.stdin is not None
        try:
            async with receive:
                async for session_message in receive:
                    message = session_message.message
                    if isinstance(message, JSONRPCRequest):
                        self.pending.add(message.id)
                    elif (
                        isinstance(message, JSONRPCNotification)
                        and message.method == "notifications/cancelled"
                    ):
                        self.pending.discard((message.params or {}).get("requestId"))  # a call given up on
                    data = message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await self.process.stdin.send(data.encode("utf-8"))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            # the server no longer reads: end the session's reading too, so no request waits forever
            await read_send.aclose()

    async def _pump_stderr(self, done: anyio.Event) -> None:
        assert self.process is not None and self.process.stderr is not None
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        stream = self.scrub.stream() if self.scrub else None
        try:
            async for chunk in self.process.stderr:
                self._stderr(stream.feed(decode(chunk)) if stream else decode(chunk))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass
        finally:
            rest = decode(b"", final=True)
            self._stderr((stream.feed(rest) + stream.flush()) if stream else rest)
            done.set()

    def _stderr(self, text: str) -> None:
        if text:
            self.log.write(text)
            self.stderr_tail = (self.stderr_tail + text)[-_STDERR_TAIL_CHARS:]

    async def _stop(self, stderr_done: anyio.Event) -> None:
        """The SDK's order: close stdin, give the server GRACE_S to exit, then terminate its process group;
        then a moment for the rest of its stderr to reach the log."""
        from mcp.os.posix.utilities import terminate_posix_process_tree

        process = self.process
        assert process is not None and process.stdin is not None
        try:
            await process.stdin.aclose()
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        if not await _exited(process, GRACE_S):
            await terminate_posix_process_tree(process, KILL_AFTER_S)
            await _exited(process, KILL_AFTER_S)
        with anyio.move_on_after(0.5):
            await stderr_done.wait()


async def _exited(process: Process, timeout_s: float) -> bool:
    """Whether the process exited within `timeout_s` (its returncode polled: `wait()` would also wait for its
    pipes, which a child of it may hold open)."""
    with anyio.move_on_after(timeout_s):
        while process.returncode is None:
            await anyio.sleep(0.01)
    return process.returncode is not None
