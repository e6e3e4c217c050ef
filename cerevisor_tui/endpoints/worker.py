"""Streaming in a process of its own: HTTP reads and SSE parsing on a second core, the console on the first.

At a full box's load (256 streams, 20,000+ tokens/s) reading the streams is most of a core: httpx hands
over one HTTP chunk per loop iteration, and a console that shares that loop waits behind every socket
that became readable, so a key press waits hundreds of milliseconds. `StreamWorker` starts
`python -m cerevisor_tui.endpoints.worker` and gives the engine `RemoteStream`s, which look like
`ChatStream` (the same `events()` items, `last_byte_at`, `usage`, `finish_reason`, the same errors) but
are read by the child with the same `ChatStream` code. The child sends what its streams yielded in one
loop iteration as one batch, so the console wakes once per batch, not once per socket.

Wire format, both ways: a 4-byte big-endian length, then a `marshal`led value (both ends run the same
interpreter). Parent to child: `("client", endpoint, concurrency, api_key_env)`, `("open", id, endpoint,
url, body, headers)`, `("cancel", id)`. Child to parent: a list of `(id, kind, payload)`; kinds are the
client's item kinds, plus BYTES (payload: bytes arrived without an item), END and ERROR. API keys never
cross the pipe: the child reads the variable its parent named from the environment it inherited. The
child exits when its stdin closes, so it cannot outlive the console.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import marshal
import os
import signal
import struct
import sys
import time
from collections.abc import AsyncGenerator
from typing import Any

from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.endpoints import errors
from cerevisor_tui.endpoints.client import DELTA, FINISH, TIMINGS, USAGE, ChatStream, build_client
from cerevisor_tui.kinds import BYTES, END, ERROR  # what only the worker's pipe carries

_HEADER = struct.Struct(">I")
_WRITE_HIGH_BYTES = 4 << 20  # the child stops reading sockets while this much is unread by the parent
_SWEEP_S = 0.05  # how often the child reports bytes that made no item yet
_READY = b"cerevisor-stream-worker ready\n"  # the child's first bytes, once its imports are done
_START_TIMEOUT_S = 30.0
_STOP_WAIT_S = 2.0  # after its stdin closes, how long the worker gets to close its connections
_STDERR_LINES = 20  # the child's last stderr lines kept for the message if it dies
_ERRORS = {cls.__name__: cls for cls in (errors.EndpointError, errors.EndpointUnreachable, errors.EndpointHTTPError,
                                          errors.StreamBroken, errors.ProtocolError, errors.MissingApiKey,
                                          errors.OutOfDescriptors)}


def _frame(value: Any) -> bytes:
    data = marshal.dumps(value)
    return _HEADER.pack(len(data)) + data


def _error_payload(exc: errors.EndpointError) -> tuple[str, str, int | None, float | None, bool]:
    name = type(exc).__name__ if type(exc).__name__ in _ERRORS else "EndpointError"
    return (name, exc.problem, exc.status, exc.retry_after_s, exc.retryable)


# ---- the parent's side ------------------------------------------------------------------------------
class RemoteStream:
    """One chat stream read by the worker process; used exactly like `ChatStream`."""

    def __init__(self, worker: StreamWorker, endpoint: str, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None) -> None:
        self.worker, self.endpoint, self.url, self.body, self.headers = worker, endpoint, url, body, headers
        self.last_byte_at = 0.0
        self.tokens = 0
        self.finish_reason = ""
        self.usage: tuple[int, int] | None = None
        self.cached_tokens: int | None = None
        self.timings: tuple[float | None, float | None] | None = None
        self.items: collections.deque[tuple[int, Any]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.process: asyncio.subprocess.Process | None = None  # the worker process reading it
        self.sid = 0  # its id with the worker, once open

    def abort(self) -> None:
        """Have the worker drop the connection now (a kill), as ChatStream.abort does in-process: the cancellation
        that follows reaches `events` only once it has handed on what is already buffered, and the worker's
        task only when it next waits; meanwhile the server went on generating."""
        if self.sid:
            self.worker.close_stream(self.sid, cancel=True)

    def feed(self, kind: int, payload: Any, now: float) -> None:
        self.last_byte_at = now
        if kind != BYTES:
            self.items.append((kind, payload))
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def events(self) -> AsyncGenerator[tuple[int, Any]]:
        worker = self.worker
        sid = self.sid = await worker.open(self)
        items = self.items
        ended = False
        try:
            while True:
                if not items:
                    self.waiter = asyncio.get_running_loop().create_future()
                    await self.waiter
                    continue
                kind, payload = items.popleft()
                if kind == DELTA:
                    self.tokens += payload[3]
                elif kind == END:
                    ended = True
                    return
                elif kind == ERROR:
                    ended = True
                    name, problem, status, retry_after_s, retryable = payload
                    raise _ERRORS.get(name, errors.EndpointError)(
                        self.endpoint, problem, status=status, retry_after_s=retry_after_s, retryable=retryable)
                elif kind == USAGE:
                    self.usage = (payload[0], payload[1])
                    if len(payload) > 2:  # (prompt, completion, cached)
                        self.cached_tokens = payload[2]
                elif kind == FINISH:
                    self.finish_reason = payload
                elif kind == TIMINGS:
                    self.timings = tuple(payload)
                yield (kind, payload)
        finally:
            worker.close_stream(sid, cancel=not ended)


class StreamWorker:
    """The worker process and the streams it reads for us. Use as an async context manager; a worker that
    dies fails its open streams (retryable, with its last words) and the next stream starts a new one."""

    def __init__(self) -> None:
        self.clients: dict[str, tuple[int, str]] = {}  # endpoint -> (concurrency, api_key_env)
        self.streams: dict[int, RemoteStream] = {}
        self.restarts = -1  # how many times a worker was started again after one died
        self._next_id = 0
        self._process: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)

    async def __aenter__(self) -> StreamWorker:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def add_client(self, endpoint: str, concurrency: int, api_key_env: str) -> None:
        """The child keeps one httpx client per endpoint, sized like the engine's own (`build_client`)."""
        self.clients[endpoint] = (concurrency, api_key_env)
        if self._process is not None:
            self._send(("client", endpoint, concurrency, api_key_env))

    def stream(self, endpoint: str, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> RemoteStream:
        return RemoteStream(self, endpoint, url, body, headers)

    async def open(self, stream: RemoteStream) -> int:
        if self._process is None or self._process.returncode is not None:
            await self._start()
        self._next_id += 1
        sid = self._next_id
        self.streams[sid] = stream
        stream.process = self._process
        self._send(("open", sid, stream.endpoint, stream.url, stream.body, stream.headers))
        return sid

    def close_stream(self, sid: int, *, cancel: bool) -> None:
        if self.streams.pop(sid, None) is not None and cancel and self._process is not None:
            self._send(("cancel", sid))  # the child closes the response: the server aborts the request

    async def aclose(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(Exception):
                process.stdin.close()  # type: ignore[union-attr]
            try:
                await asyncio.wait_for(process.wait(), _STOP_WAIT_S)
            except TimeoutError:  # stuck: it goes anyway, and closing the run does not fail
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            except asyncio.CancelledError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                raise
            finally:
                self._fail_all(process, "closed with its run")
        for task in list(self._tasks):
            task.cancel()

    # ---- internals ------------------------------------------------------------------------------
    async def _start(self) -> None:
        """Start a worker and wait for it to say it is ready (imports done), so that a request's first-byte
        clock never runs while the worker is still starting."""
        if self._starting is not None:
            await asyncio.shield(self._starting)
            return
        self._starting = asyncio.get_running_loop().create_future()
        try:
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "cerevisor_tui.endpoints.worker",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )
            except OSError as exc:
                raise errors.StreamBroken("(all)", f"the stream worker process did not start: {exc}") from None
            self._stderr.clear()
            self._spawn(self._read_stderr(process))
            assert process.stdout is not None
            try:
                ready = await asyncio.wait_for(process.stdout.readexactly(len(_READY)), _START_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError):
                ready = b""
            if ready != _READY:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                last = self._stderr[-1] if self._stderr else f"exit code {process.returncode}"
                raise errors.StreamBroken("(all)", f"the stream worker process did not start: {last}")
            self._process = process
            self.restarts += 1
            for endpoint, (concurrency, key_env) in self.clients.items():
                self._send(("client", endpoint, concurrency, key_env))
            self._spawn(self._read(process))
            self._starting.set_result(None)
        except BaseException as exc:
            self._starting.set_exception(exc)
            self._starting.exception()  # retrieved: only awaiting openers see it
            raise
        finally:
            self._starting = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, message: tuple[Any, ...]) -> None:
        process = self._process
        if process is None or process.stdin is None or process.stdin.is_closing():
            return
        process.stdin.write(_frame(message))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        reader = process.stdout
        assert reader is not None
        streams = self.streams
        monotonic = time.monotonic
        loads = marshal.loads
        unpack = _HEADER.unpack
        try:
            while True:
                (size,) = unpack(await reader.readexactly(4))
                batch = loads(await reader.readexactly(size))
                now = monotonic()
                for sid, kind, payload in batch:
                    stream = streams.get(sid)
                    if stream is not None:
                        stream.feed(kind, payload, now)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, EOFError):
            pass
        await process.wait()
        self._fail_all(process, f"exit code {process.returncode}")

    async def _read_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            text = line.decode("utf-8", "replace").rstrip()
            if text:
                self._stderr.append(text)

    def _fail_all(self, process: asyncio.subprocess.Process, how: str) -> None:
        """The worker is gone: every stream it was reading fails, retryable, saying why."""
        if self._process is process:
            self._process = None
        last = self._stderr[-1] if self._stderr else ""
        problem = f"the stream worker process ended ({how})" + (f": {last}" if last else "")
        for sid, stream in list(self.streams.items()):
            if stream.process is process:
                del self.streams[sid]
                stream.feed(ERROR, ("StreamBroken", problem, None, None, True), time.monotonic())


# ---- the child's side -------------------------------------------------------------------------------
class _Child:
    """Reads streams for the parent: one task per open stream, one batch written per loop iteration."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.clients: dict[str, Any] = {}
        self.keys: dict[str, str] = {}  # endpoint -> its key, for scrubbing what goes back to the parent
        self.scrub = Scrubber()
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.streams: dict[int, Any] = {}
        self.reported: dict[int, float] = {}  # the last_byte_at each stream's last record stood for
        self.out: list[tuple[int, int, Any]] = []
        self.loop = asyncio.get_running_loop()

    def push(self, record: tuple[int, int, Any]) -> None:
        if not self.out:
            self.loop.call_soon(self.flush)
        self.out.append(record)

    def flush(self) -> None:
        out, self.out = self.out, []
        if out and not self.writer.is_closing():
            self.writer.write(_frame(out))

    def client(self, endpoint: str, concurrency: int, api_key_env: str) -> None:
        old = self.clients.pop(endpoint, None)
        if old is not None:
            self.loop.create_task(old.aclose())
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            self.keys[endpoint] = key
            self.scrub = Scrubber(self.keys.values())
        self.clients[endpoint] = build_client(concurrency, key)

    def open(self, sid: int, endpoint: str, url: str, body: dict[str, Any], headers: dict[str, str] | None) -> None:
        task = self.loop.create_task(self._stream(sid, endpoint, url, body, headers))
        self.tasks[sid] = task
        task.add_done_callback(lambda _: self._forget(sid))

    def _forget(self, sid: int) -> None:
        self.tasks.pop(sid, None)
        self.streams.pop(sid, None)
        self.reported.pop(sid, None)

    def cancel(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None:
            stream.abort()  # the connection goes now, not when the task next waits (ChatStream.abort)
        task = self.tasks.get(sid)
        if task is not None:
            task.cancel()

    async def _stream(self, sid: int, endpoint: str, url: str, body: dict[str, Any],
                      headers: dict[str, str] | None) -> None:
        push = self.push
        transport = self.writer.transport
        try:
            client = self.clients.get(endpoint)
            if client is None:
                raise errors.EndpointError(endpoint, "the stream worker has no client for this endpoint")
            stream = ChatStream(client, endpoint, url, body, headers)
            self.streams[sid] = stream
            reported = self.reported
            async for kind, payload in stream.events():
                reported[sid] = stream.last_byte_at
                push((sid, kind, payload))
                if transport.get_write_buffer_size() > _WRITE_HIGH_BYTES:
                    await self.writer.drain()  # the parent is behind: stop reading until it catches up
            push((sid, END, None))
        except errors.EndpointError as exc:
            push((sid, ERROR, _error_payload(exc.scrub(self.scrub))))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must still end the stream with a reason, never hang it
            problem = self.scrub(f"stream worker: {type(exc).__name__}: {exc}")
            push((sid, ERROR, ("StreamBroken", problem, None, None, True)))

    async def sweep(self) -> None:
        """Bytes that made no item (a partial line) still count as life for liveness = "bytes"."""
        while True:
            await asyncio.sleep(_SWEEP_S)
            for sid, stream in list(self.streams.items()):
                if stream.last_byte_at > self.reported.get(sid, 0.0):
                    self.reported[sid] = stream.last_byte_at
                    self.push((sid, BYTES, None))

    async def serve(self, reader: asyncio.StreamReader) -> None:
        sweeper = self.loop.create_task(self.sweep())
        unpack = _HEADER.unpack
        try:
            while True:
                try:
                    (size,) = unpack(await reader.readexactly(4))
                    message = marshal.loads(await reader.readexactly(size))
                except asyncio.IncompleteReadError:
                    return  # the parent closed our stdin (or is gone): stop
                verb = message[0]
                if verb == "open":
                    self.open(*message[1:])
                elif verb == "cancel":
                    self.cancel(message[1])
                elif verb == "client":
                    self.client(*message[1:])
        finally:
            sweeper.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            for client in self.clients.values():
                with contextlib.suppress(Exception):
                    await client.aclose()
            self.flush()
            with contextlib.suppress(Exception):
                await self.writer.drain()


async def _child_main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout.buffer)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    child = _Child(writer)
    writer.write(_READY)
    await child.serve(reader)


if __name__ == "__main__":
    # Ctrl+C, a terminal hang-up or a TERM sent to the whole process group are the parent's to handle: it
    # stops its run cleanly and then closes our stdin. If it dies instead, the closed pipe still ends us.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(BrokenPipeError):
        asyncio.run(_child_main())
