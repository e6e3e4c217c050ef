"""An httpcore network backend on asyncio's own transports: the sockets our httpx clients read streams from.

Why: per read, httpcore's default backend (anyio's socket stream) enters a timeout scope and stops and
restarts the socket's reader, a large share of what reading hundreds of token streams costs; here a read
takes what has already arrived, without a trip through the event loop. endpoints/transport.py
puts it under our clients. asyncio only, as we run (anyio on asyncio); Unix sockets go to httpcore's own
backend."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import typing

import httpcore

_PAUSE_BYTES = 1 << 20  # stop reading the socket while this much is buffered and unread
_RESUME_BYTES = 256 << 10


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.eof = False
        self.error: BaseException | None = None
        self.paused = False
        self.reader: asyncio.Future[None] | None = None
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > _PAUSE_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake_reader()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def _wake_reader(self) -> None:
        reader = self.reader
        if reader is not None and not reader.done():
            reader.set_result(None)


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One TCP (or TLS) connection: reads return what has arrived, at most `max_bytes`."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def abort(self) -> None:
        """Drop the connection at once, from outside the task reading it (a kill: ChatStream.abort)."""
        self._transport.abort()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._protocol
        chunks = p.chunks
        while not chunks:
            if p.eof:
                if p.error is not None:
                    raise httpcore.ReadError(str(p.error) or type(p.error).__name__)
                return b""
            p.reader = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await p.reader
                else:
                    await asyncio.wait_for(p.reader, timeout)
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data in {timeout} s") from None
            finally:
                p.reader = None
        # everything that has arrived, in one piece: one pass through the HTTP parser and the SSE reader
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if len(data) > max_bytes:
            chunks.appendleft(data[max_bytes:])
            data = data[:max_bytes]
        p.size -= len(data)
        if p.paused and p.size < _RESUME_BYTES:
            p.paused = False
            self._transport.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        p = self._protocol
        if p.eof and p.error is not None or self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self._transport.write(buffer)
        writable = p.writable
        if writable is not None and not writable.done():
            try:
                await asyncio.wait_for(asyncio.shield(writable), timeout)
            except TimeoutError:
                raise httpcore.WriteTimeout(f"could not write in {timeout} s") from None

    async def aclose(self) -> None:
        # As anyio's socket stream (httpcore's default backend) closes: write_eof, close, then abort. With
        # close() alone, a request killed while the simulator (uvicorn) is still before its first token keeps
        # running there, and its server cannot shut down (tests/test_engine_details.py checks this).
        transport = self._transport
        if transport.is_closing():
            return
        if transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
        transport.close()
        await asyncio.sleep(0)
        transport.abort()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            transport = await loop.start_tls(self._transport, self._protocol, ssl_context,
                                             server_hostname=server_hostname, ssl_handshake_timeout=timeout)
        except (TimeoutError, OSError, ssl.SSLError, ConnectionError) as exc:
            self._transport.close()
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from exc
        if transport is None:
            raise httpcore.ConnectError("TLS was not started")
        return AsyncioStream(transport, self._protocol)

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable":  # an idle keep-alive connection the server closed or wrote to: not reusable
            return self._protocol.eof or bool(self._protocol.chunks)
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """TCP through asyncio transports; everything else through httpcore's own backend."""

    def __init__(self) -> None:
        self._fallback = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            connect = loop.create_connection(_Protocol, host, port,
                                              local_addr=(local_address, 0) if local_address else None)
            transport, protocol = await asyncio.wait_for(connect, timeout)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"could not connect to {host}:{port} in {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            for option in socket_options or ():
                sock.setsockopt(*option)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return AsyncioStream(transport, protocol)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.AsyncNetworkStream:
        return await self._fallback.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
