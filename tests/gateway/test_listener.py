"""The gateway's listener bounds, through raw sockets: a connection that sends half a request and stops is closed at
its header deadline, a body that stops coming at its body deadline, and past the connection cap a new connection
takes the place of the oldest one waiting for a request, so a flood of idle connections never keeps a client out."""

from __future__ import annotations

import anyio
import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import chat, post, served

pytestmark = pytest.mark.anyio


async def _closed(stream: anyio.abc.SocketStream) -> bytes:
    """What the gateway sends before it closes `stream` (read until the end)."""
    got = b""
    while True:
        try:
            got += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return got


async def test_half_a_request_line_is_closed_at_the_header_deadline():
    async with served(gateway={"header_timeout_s": 0.3}) as s:
        half = await anyio.connect_tcp(s.server.host, s.server.port)
        await half.send(b"POST /v1/chat/compl")
        silent = await anyio.connect_tcp(s.server.host, s.server.port)  # never says a word
        assert await _closed(half) == b"" and await _closed(silent) == b""
        assert s.server.listener.closed_late == 2
        await until(lambda: not s.server.listener.open, "both connections let go")
        async with httpx.AsyncClient(timeout=30) as client:  # and the gateway serves on
            assert (await post(client, s.url + "/chat/completions", chat())).status == 200


async def test_a_body_that_stops_coming_is_closed_at_the_body_deadline():
    async with served(gateway={"header_timeout_s": 30, "body_timeout_s": 0.3}) as s:
        stream = await anyio.connect_tcp(s.server.host, s.server.port)
        await stream.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 500\r\n\r\n{\"model\": \"sim-")
        assert await _closed(stream) == b""
        assert s.server.listener.closed_late == 1
        assert not s.of(ev.SessionOpened)  # nothing of it reached the run


async def test_a_header_past_16_kib_is_refused_and_its_connection_closed():
    async with served() as s:
        stream = await anyio.connect_tcp(s.server.host, s.server.port)
        await stream.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + b"x-long: " + b"a" * (20 << 10))
        assert (await _closed(stream)).startswith(b"HTTP/1.1 400 ")
        assert not s.of(ev.SessionOpened)
        async with httpx.AsyncClient(timeout=30) as client:  # and the gateway serves on
            assert (await post(client, s.url + "/chat/completions", chat())).status == 200


async def test_a_keep_alive_connection_gets_a_fresh_header_deadline_for_each_request():
    async with served(gateway={"header_timeout_s": 0.5}) as s, httpx.AsyncClient(timeout=30) as client:
        for _ in range(3):  # one connection, requests one after another: none is cut
            assert (await post(client, s.url + "/chat/completions", chat())).status == 200
        assert s.server.listener.closed_late == 0


async def test_past_the_cap_idle_connections_make_room_for_a_client():
    async with served(gateway={"max_connections": 4, "header_timeout_s": 600}) as s:
        idle = [await anyio.connect_tcp(s.server.host, s.server.port) for _ in range(10)]
        await until(lambda: s.server.listener.evicted >= 6, "the oldest idle connections closed to make room")
        assert len(s.server.listener.open) <= 4
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await post(client, s.url + "/chat/completions", chat())).status == 200
        for stream in idle[:6]:  # the first ones went first
            assert await _closed(stream) == b""
        for stream in idle:
            await stream.aclose()


async def test_on_a_network_listen_one_peer_has_its_own_cap(monkeypatch):
    monkeypatch.setenv("GW_KEY", "sk-client-key")
    async with served(gateway={"listen": "0.0.0.0:0", "keys_env": ["GW_KEY"], "max_connections_per_peer": 2,
                               "header_timeout_s": 600}) as s:
        listener = s.server.listener
        assert listener.max_connections_per_peer == 2
        idle = [await anyio.connect_tcp("127.0.0.1", s.server.port) for _ in range(5)]
        await until(lambda: listener.evicted >= 3, "the peer's oldest idle connections closed")
        assert listener.per_peer["127.0.0.1"] <= 2
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await post(client, f"http://127.0.0.1:{s.server.port}/v1/chat/completions", chat(),
                                headers={"authorization": "Bearer sk-client-key"})
            assert answer.status == 200
        for stream in idle:
            await stream.aclose()
