"""The gateway's listener bounds: a deadline on reading each request's header and body, and a cap on open client
connections (per client address on a network listen), at the transport edge, under uvicorn's own HTTP protocol.

uvicorn bounds a header's size (h11's 16 KiB incomplete-event limit) and an idle keep-alive connection
(`timeout_keep_alive`), but a request that has begun to arrive has no deadline, and its `limit_concurrency` answers
503 only once a whole request has come: connections that send half a request line and stop are held for ever, and
enough of them take every descriptor until accept() fails for everyone, keyed clients included. So each connection
here is closed when its header or its body is late, and past the cap a new connection takes the place of the
oldest one still waiting for a request (which has sent nothing worth keeping); only when every open connection is
serving a request is the new one closed at once.
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Fitted to the process's descriptor limit: client connections take a quarter of it (each may hold one upstream
# too; the journal's transcripts, the run's sockets and pipes need the rest), and asyncio accepts up to `backlog`
# connections at once before any of them is counted here, so that burst is a sixteenth. Connections past the backlog
# wait in the kernel's queue, which costs the process no descriptor.
_CONNECTIONS_SHARE = 4
_BACKLOG_SHARE = 16
_BACKLOG_MAX = 2048  # uvicorn's own


class Listener:
    """The bounds one gateway's connections share, and what they did (`closed_late`, `evicted`, `refused`);
    `max_connections` and `backlog` fitted to the process's descriptor limit."""

    def __init__(self, *, header_timeout_s: float, body_timeout_s: float, max_connections: int,
                 max_connections_per_peer: int | None) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        self.max_connections = max(1, min(max_connections, soft // _CONNECTIONS_SHARE))
        self.backlog = max(1, min(_BACKLOG_MAX, soft // _BACKLOG_SHARE))  # uvicorn's `backlog`: see above
        self.max_connections_per_peer = max_connections_per_peer  # None: one global cap (a loopback listen)
        self.open: set[BoundedH11] = set()
        self.per_peer: Counter[str] = Counter()
        self.waiting: dict[BoundedH11, None] = {}  # those waiting for a request, oldest first
        self.closed_late = 0  # closed at their header or body deadline
        self.evicted = 0  # closed to make room for a new connection while waiting for a request
        self.refused = 0  # closed at once: every open connection was serving a request

    def admit(self, conn: BoundedH11) -> bool:
        """Count `conn` in, making room by closing the oldest waiting connection (of its peer, when that is what is
        full); False when there is no room to make."""
        per_peer = self.max_connections_per_peer
        if per_peer is not None and self.per_peer[conn.peer] >= per_peer:
            victim = next((c for c in self.waiting if c.peer == conn.peer), None)
        elif len(self.open) >= self.max_connections:
            victim = next(iter(self.waiting), None)
        else:
            victim = conn
        if victim is None:
            self.refused += 1
            return False
        if victim is not conn:
            self.evicted += 1
            victim.close()
        self.open.add(conn)
        self.per_peer[conn.peer] += 1
        return True

    def gone(self, conn: BoundedH11) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.per_peer[conn.peer] -= 1
            if not self.per_peer[conn.peer]:
                del self.per_peer[conn.peer]
        self.waiting.pop(conn, None)


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol under a `Listener`'s bounds (a subclass per gateway names its `listener`)."""

    listener: ClassVar[Listener]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading = ""  # "header" or "body" while a deadline runs
        self.peer = self.client[0] if self.client else ""
        if not self.listener.admit(self):
            self.close()
            return
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.listener.gone(self)
        super().connection_lost(exc)

    def close(self) -> None:
        self._disarm()
        self.listener.gone(self)
        if not self.transport.is_closing():
            self.transport.close()

    def _follow(self) -> None:
        """Arm or drop the read deadline for where the request stands in h11's reading of it."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        waiting = state is h11.IDLE
        if waiting:
            self.listener.waiting.setdefault(self, None)
        else:
            self.listener.waiting.pop(self, None)
        if waiting and self.timeout_keep_alive_task is None:  # a request begun, or none yet on a new connection
            self._arm("header", self.listener.header_timeout_s)
        elif state is h11.SEND_BODY:
            self._arm("body", self.listener.body_timeout_s)
        else:  # read whole (the app's turn), or idle between requests under uvicorn's keep-alive timer
            self._disarm()

    def _arm(self, reading: str, after_s: float) -> None:
        if self._reading == reading:
            return
        self._disarm()
        self._reading = reading
        self._deadline = self.loop.call_later(after_s, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._reading = None, ""

    def _late(self) -> None:
        self._deadline = None
        self.listener.closed_late += 1
        self.close()  # a body cut short is the app's disconnect: its request ends there


def bounded_protocol(listener: Listener) -> type[BoundedH11]:
    """The protocol class uvicorn builds each connection with, bound to `listener`."""
    return type("GatewayProtocol", (BoundedH11,), {"listener": listener})
