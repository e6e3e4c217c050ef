"""Our httpx clients (build_client) over real loopback sockets: bodies stream through our asyncio backend,
errors are the httpx ones httpx's own transport raises, a body closed early closes its connection, the
client's pool limits hold (reuse, queueing, PoolTimeout, expiry, the keep-alive cap, drops, aborts), and
proxies from the environment are still used."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import httpcore
import httpx
import pytest

from cerevisor_tui.endpoints.client import build_client, is_refused, list_models
from cerevisor_tui.endpoints.network import AsyncioStream
from cerevisor_tui.endpoints.transport import AsyncioTransport
from tests.conftest import RawServer, chunk, free_port, http_head, read_body, read_request, until

WORDS = (b"alpha ", b"beta ", b"gamma")


@asynccontextmanager
async def serving(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> AsyncIterator[int]:
    """A loopback server that hands each connection, unread, to `handler`; yields its port."""
    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    # a backlog past the pool test's 120 connections at once: with the default 100, the rest wait out a SYN retry
    server = await asyncio.start_server(guarded, "127.0.0.1", 0, backlog=1024)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@pytest.mark.anyio
async def test_a_body_streams_through_our_backend_as_it_arrives():
    """Each word is sent only once the client has read the one before: nothing waits for the whole body."""
    received = [asyncio.Event() for _ in WORDS]

    async def one_word_at_a_time(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        for word, got in zip(WORDS, received, strict=True):
            writer.write(chunk(word))
            await writer.drain()
            await got.wait()
        writer.write(chunk(b""))
        await writer.drain()

    async with RawServer(one_word_at_a_time) as srv, build_client(4) as client:
        with anyio.fail_after(10):
            async with client.stream("POST", srv.base_url + "/chat/completions", json={}) as response:
                assert isinstance(response.extensions["network_stream"], AsyncioStream)
                parts = response.aiter_raw()
                for word, got in zip(WORDS, received, strict=True):
                    piece = b""
                    while len(piece) < len(word):  # a word may come in more than one read
                        piece += await parts.__anext__()
                    assert piece == word
                    got.set()
                assert [part async for part in parts] == []  # only the body's end was left


def clients() -> list[tuple[str, httpx.AsyncClient]]:
    """Ours and httpx's own default transport, to hold side by side."""
    return [("ours", build_client(2)), ("httpx", httpx.AsyncClient(timeout=None))]


@pytest.mark.anyio
async def test_a_refused_connection_is_httpx_connect_error():
    url = f"http://127.0.0.1:{free_port()}/v1/models"
    for name, client in clients():
        async with client:
            with pytest.raises(httpx.ConnectError) as caught:
                await client.get(url)
        assert is_refused(caught.value), name
        assert isinstance(caught.value.__cause__, Exception), name  # chained to what httpcore said


def drop(writer: asyncio.StreamWriter, how: str) -> None:
    if how == "reset":  # linger 0: the close sends an RST, as a crashed server's kernel does
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


async def raised_by_a_drop(client: httpx.AsyncClient, how: str) -> type[BaseException]:
    """What reading a streamed answer raises when the server drops it in the middle of a chunk."""
    first_read = asyncio.Event()

    async def half_an_answer(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(WORDS[0]) + b"40\r\nonly part of it")
        await writer.drain()
        await first_read.wait()
        drop(writer, how)

    async with RawServer(half_an_answer) as srv, client:
        with anyio.fail_after(10), pytest.raises(httpx.TransportError) as caught:
            async with client.stream("POST", srv.base_url + "/chat/completions", json={}) as response:
                async for _ in response.aiter_raw():
                    first_read.set()
    return type(caught.value)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["closed", "reset"])
async def test_a_server_that_drops_mid_stream_raises_what_httpx_raises(how):
    """The stream code turns httpx.RemoteProtocolError and httpx.ReadError into StreamBroken: our transport
    must raise, for each way of dropping, the same type as httpx's default one."""
    raised = {name: await raised_by_a_drop(client, how) for name, client in clients()}
    assert raised["ours"] is raised["httpx"], raised
    assert issubclass(raised["ours"], (httpx.RemoteProtocolError, httpx.ReadError)), raised


@pytest.mark.anyio
async def test_closing_a_response_mid_stream_closes_its_connection():
    """A kill leaves the body unread: the server must see the connection end, not keep generating."""
    server_saw_eof = asyncio.Event()

    async def endless(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(WORDS[0]))
        await writer.drain()
        assert await reader.read() == b""  # no more requests on it: only the end of the connection
        server_saw_eof.set()

    async with RawServer(endless) as srv, build_client(4) as client:
        with anyio.fail_after(10):
            async with client.stream("POST", srv.base_url + "/chat/completions", json={}) as response:
                parts = response.aiter_raw()  # held: the response's own close must end it, not the collector
                assert await parts.__anext__() == WORDS[0]
            await server_saw_eof.wait()
    del parts


@pytest.mark.anyio
async def test_the_pool_holds_the_whole_concurrency_open_and_keeps_it_alive():
    """More streams at once than httpx's default pool allows (100): every one is open at the same time, and
    afterwards all stay alive in the pool (its keep-alive limit is the client's), so a second such round
    opens no connection."""
    concurrency = 120
    connections = 0
    arrived = 0
    rounds = [asyncio.Event(), asyncio.Event()]  # set when all of that round's requests are in
    body = b'{"data": [{"id": "m"}]}'

    async def keep_alive(reader, writer):
        nonlocal connections, arrived
        connections += 1
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:  # the client closed it
                return
            arrived += 1
            everyone = rounds[(arrived - 1) // concurrency]
            if arrived % concurrency == 0:
                everyone.set()
            await everyone.wait()  # nobody is answered until the whole round is in flight
            writer.write(http_head(200, "application/json", length=len(body)) + body)
            await writer.drain()

    async with serving(keep_alive) as port, build_client(concurrency) as client:
        url = f"http://127.0.0.1:{port}/v1"
        for _ in rounds:
            with anyio.fail_after(20):
                answers = await asyncio.gather(*(list_models(client, "box", url) for _ in range(concurrency)))
            assert all(models == [{"id": "m"}] for models in answers)
    assert connections == concurrency and arrived == 2 * concurrency


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for scheme in ("http", "https", "all", "no"):
        for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY"):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.anyio
async def test_a_proxy_from_the_environment_is_used(no_proxies):
    """As httpx does for a client without a transport of its own: HTTP_PROXY gets the request, absolute-form."""
    request_lines: list[bytes] = []
    body = b'{"data": [{"id": "via-proxy"}]}'

    async def proxy(reader, writer):
        request_lines.append((await read_request(reader)).split(b"\r\n", 1)[0])
        writer.write(http_head(200, "application/json", length=len(body)) + body)
        await writer.drain()

    target = free_port()  # nothing listens there: only the proxy can answer
    async with serving(proxy) as port:
        no_proxies.setenv("HTTP_PROXY", f"127.0.0.1:{port}")
        async with build_client(2) as client:
            assert await list_models(client, "box", f"http://127.0.0.1:{target}/v1") == [{"id": "via-proxy"}]
    assert request_lines == [f"GET http://127.0.0.1:{target}/v1/models HTTP/1.1".encode()]


@pytest.mark.anyio
async def test_a_no_proxy_host_goes_direct_through_our_backend(no_proxies):
    no_proxies.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # refused, were it used
    no_proxies.setenv("NO_PROXY", "example.com, 127.0.0.1")
    body = b'{"data": [{"id": "m"}]}'

    async def direct(reader, writer):
        await read_request(reader)
        writer.write(http_head(200, "application/json", length=len(body)) + body)
        await writer.drain()

    async with serving(direct) as port, build_client(2) as client:
        response = await client.get(f"http://127.0.0.1:{port}/v1/models")
    assert response.json() == {"data": [{"id": "m"}]}
    assert isinstance(response.extensions["network_stream"], AsyncioStream)


# The pool under our transport (endpoints/transport.py, `_Pool`): what httpcore's pool does, held to httpx's limits.

BODY = b'{"data": [{"id": "m"}]}'


class KeepAlive:
    """A loopback server that answers every request on a connection, keeping it open; a request to `/hold`
    is answered only once `release` is set. Counts connections opened and seen closed by the client."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.open_now = 0
        self.most_open = 0
        self.requests = 0
        self.held = 0
        self.release = asyncio.Event()
        self.close_after_answer = False  # the server ends each connection once it has answered
        # "read": the next request on a connection that has answered one is read and the connection closed
        # unanswered (a keep-alive that ran out as the request came); "unread": closed with its body unread (a reset);
        # "all": every request, new connections too
        self.drop_kept: str | None = None
        self.dropped = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        answered = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    if answered and self.drop_kept == "unread":  # its body left unread: the close is a reset
                        self.dropped += 1
                        writer.transport.abort()
                        return
                    request = head + await read_body(reader, head)
                except asyncio.IncompleteReadError:  # the client closed it
                    return
                self.requests += 1
                if self.drop_kept == "all" or (answered and self.drop_kept == "read"):
                    self.dropped += 1
                    return
                answered += 1
                if request.startswith(b"GET /hold"):
                    self.held += 1
                    await self.release.wait()
                writer.write(http_head(200, "application/json", length=len(BODY)) + BODY)
                await writer.drain()
                if self.close_after_answer:
                    return
        finally:
            self.open_now -= 1
            self.closed += 1


def pooled(max_connections: int | None = None, max_keepalive: int | None = 10, keepalive_expiry: float = 60.0,
           pool_timeout: float | None = None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive,
                          keepalive_expiry=keepalive_expiry)
    return httpx.AsyncClient(transport=AsyncioTransport(limits), timeout=httpx.Timeout(None, pool=pool_timeout))


@pytest.mark.anyio
async def test_a_kept_alive_connection_is_reused():
    server = KeepAlive()
    async with serving(server) as port, pooled() as client:
        with anyio.fail_after(10):
            streams = []
            for _ in range(3):
                response = await client.get(f"http://127.0.0.1:{port}/v1/models")
                assert response.json() == {"data": [{"id": "m"}]}
                streams.append(response.extensions["network_stream"])
    assert server.opened == 1 and server.requests == 3
    assert len({id(stream) for stream in streams}) == 1


@pytest.mark.anyio
async def test_max_connections_queues_the_rest_until_one_is_free():
    """Like httpx's own pool: past max_connections a request waits (no pool timeout) and goes out on a
    connection another has finished with; no more than the cap are ever open."""
    server = KeepAlive()
    async with serving(server) as port, pooled(max_connections=2) as client:
        url = f"http://127.0.0.1:{port}"
        with anyio.fail_after(20):
            held = [asyncio.ensure_future(client.get(url + "/hold")) for _ in range(2)]
            await until(lambda: server.held == 2, "both held requests at the server")
            queued = [asyncio.ensure_future(client.get(url + "/v1/models")) for _ in range(3)]
            await until(lambda: all(not task.done() for task in queued) and server.requests == 2, "")
            server.release.set()
            answers = await asyncio.gather(*held, *queued)
    assert all(answer.status_code == 200 for answer in answers)
    assert server.requests == 5 and server.opened == 2 and server.most_open == 2


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["ours", "httpx"])
async def test_a_full_pool_past_its_pool_timeout_is_httpx_pool_timeout(name):
    server = KeepAlive()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    transport = AsyncioTransport(limits) if name == "ours" else httpx.AsyncHTTPTransport(limits=limits)
    async with serving(server) as port, httpx.AsyncClient(transport=transport, timeout=None) as client:
        url = f"http://127.0.0.1:{port}"
        with anyio.fail_after(20):
            held = asyncio.ensure_future(client.get(url + "/hold"))
            await until(lambda: server.held == 1, "the held request at the server")
            with pytest.raises(httpx.PoolTimeout):
                await client.get(url + "/v1/models", timeout=httpx.Timeout(None, pool=0.05))
            server.release.set()
            assert (await held).status_code == 200
            # the request that timed out took nothing with it: the one connection serves the next
            assert (await client.get(url + "/v1/models")).status_code == 200
    assert server.opened == 1


@pytest.mark.anyio
async def test_at_max_connections_an_idle_connection_to_another_origin_makes_room():
    """As httpcore's pool does: with the one place taken by an idle connection to A, a request to B closes it
    rather than waiting for a place that would never free."""
    a, b = KeepAlive(), KeepAlive()
    async with serving(a) as port_a, serving(b) as port_b, pooled(max_connections=1, pool_timeout=5) as client:
        with anyio.fail_after(10):
            assert (await client.get(f"http://127.0.0.1:{port_a}/v1/models")).status_code == 200
            assert (await client.get(f"http://127.0.0.1:{port_b}/v1/models")).status_code == 200
            await until(lambda: a.closed == 1, "A's idle connection closed")
    assert a.opened == 1 and b.opened == 1


@pytest.mark.anyio
async def test_a_connection_the_server_closed_is_not_reused():
    server = KeepAlive()
    server.close_after_answer = True
    async with serving(server) as port, pooled() as client:
        url = f"http://127.0.0.1:{port}/v1/models"
        with anyio.fail_after(10):
            first = await client.get(url)
            stream = first.extensions["network_stream"]
            await until(lambda: stream.get_extra_info("is_readable"), "the server's close, seen by the client")
            second = await client.get(url)
    assert second.status_code == 200 and second.extensions["network_stream"] is not stream
    assert server.opened == 2


@pytest.mark.anyio
@pytest.mark.parametrize("drop", ["read", "unread"])
async def test_a_request_on_a_kept_connection_the_server_closed_unanswered_goes_again_once_on_a_new_one(drop):
    """The race `has_expired` cannot see: the server closes a kept-alive connection as a request goes out on it
    (llama-server between a streamed answer and the next request). Nothing came back, so the request is sent
    again, once, on a new connection, and the caller gets its answer."""
    server = KeepAlive()
    async with serving(server) as port, pooled() as client:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with anyio.fail_after(10):
            first = await client.post(url, content=b'{"n": 1}')
            server.drop_kept = drop
            second = await client.post(url, content=b'{"n": 2}')
    assert first.status_code == 200 and second.status_code == 200
    assert second.extensions["network_stream"] is not first.extensions["network_stream"]
    assert server.dropped == 1 and server.opened == 2


@pytest.mark.anyio
async def test_a_new_connection_closed_unanswered_or_a_second_drop_is_the_callers_error():
    """Sent again only when the connection had been kept alive, and once: a new connection the server closes
    unanswered, or a request whose second connection is closed too, is httpx's error to the caller."""
    server = KeepAlive()
    async with serving(server) as port, pooled() as client:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with anyio.fail_after(10):
            server.drop_kept = "all"
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await client.post(url, content=b"{}")
            assert server.opened == 1 and server.dropped == 1
            server.drop_kept = None
            assert (await client.post(url, content=b"{}")).status_code == 200
            server.drop_kept = "all"  # the kept connection closed unanswered, then the new one too
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await client.post(url, content=b"{}")
    assert server.opened == 3 and server.dropped == 3


@pytest.mark.anyio
async def test_a_body_that_cannot_be_sent_twice_is_not_sent_again():
    server = KeepAlive()

    async def body():
        yield b"{}"

    async with serving(server) as port, pooled() as client:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with anyio.fail_after(10):
            assert (await client.post(url, content=b"{}")).status_code == 200
            server.drop_kept = "read"  # (its chunked body left unread: the close may come as a reset)
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await client.post(url, content=body())
    assert server.opened == 1 and server.dropped == 1


@pytest.mark.anyio
async def test_an_expired_keep_alive_connection_is_closed_not_reused():
    server = KeepAlive()
    async with serving(server) as port, pooled(keepalive_expiry=0.0) as client:
        url = f"http://127.0.0.1:{port}/v1/models"
        with anyio.fail_after(10):
            await client.get(url)
            await until(lambda: server.closed == 1, "the expired connection closed")
            await client.get(url)
    assert server.opened == 2


@pytest.mark.anyio
async def test_idle_connections_past_max_keepalive_are_closed():
    server = KeepAlive()
    async with serving(server) as port, pooled(max_keepalive=1) as client:
        url = f"http://127.0.0.1:{port}"
        with anyio.fail_after(20):
            held = [asyncio.ensure_future(client.get(url + "/hold")) for _ in range(3)]
            await until(lambda: server.held == 3, "three held requests at the server")
            server.release.set()
            answers = await asyncio.gather(*held)
            await until(lambda: server.closed == 2, "two of the three connections closed")
            again = await client.get(url + "/v1/models")
    assert server.opened == 3  # the one kept open was reused
    assert again.extensions["network_stream"] in [answer.extensions["network_stream"] for answer in answers]


@pytest.mark.anyio
async def test_an_aborted_stream_drops_its_connection_and_frees_its_place():
    """ChatStream.abort's way: the response's network_stream dropped from outside the task reading it. The
    reader gets httpx's error, the server sees the connection end, and the pool's one place is free again."""
    ended = asyncio.Event()
    opened = 0
    streaming: list[AsyncioStream] = []

    async def endless_then_models(reader, writer):
        nonlocal opened
        opened += 1
        request = await read_request(reader)
        if request.startswith(b"GET"):
            writer.write(http_head(200, "application/json", length=len(BODY)) + BODY)
            await writer.drain()
            return
        writer.write(http_head(200, "text/event-stream") + chunk(WORDS[0]))
        await writer.drain()
        assert await reader.read() == b""
        ended.set()

    async def read_until_dropped(client: httpx.AsyncClient, url: str) -> None:
        async with client.stream("POST", url, json={}) as response:
            async for _ in response.aiter_raw():
                streaming.append(response.extensions["network_stream"])

    async with serving(endless_then_models) as port, pooled(max_connections=1, pool_timeout=5) as client:
        url = f"http://127.0.0.1:{port}/v1"
        with anyio.fail_after(10):
            task = asyncio.ensure_future(read_until_dropped(client, url + "/chat/completions"))
            await until(lambda: streaming, "the first part read")
            streaming[0].abort()
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await task
            await ended.wait()
            assert (await client.get(url + "/models")).status_code == 200  # on a new connection, in the one place
    assert opened == 2


@pytest.mark.anyio
async def test_a_cancelled_request_gives_its_place_back():
    """Cancelled while it waits for a place, or while it waits for its answer: either way the pool's one
    place serves the next request."""
    server = KeepAlive()
    async with serving(server) as port, pooled(max_connections=1) as client:
        url = f"http://127.0.0.1:{port}"
        with anyio.fail_after(20):
            held = asyncio.ensure_future(client.get(url + "/hold"))
            await until(lambda: server.held == 1, "the held request at the server")
            waiting = asyncio.ensure_future(client.get(url + "/v1/models"))
            await until(lambda: not waiting.done() and server.requests == 1, "")
            waiting.cancel()
            held.cancel()  # its connection is mid-request: closed
            await asyncio.gather(waiting, held, return_exceptions=True)
            server.release.set()  # the server reads again, and finds the connection closed
            await until(lambda: server.closed == 1, "the cancelled request's connection closed")
            answer = await client.get(url + "/v1/models")
    assert answer.status_code == 200 and server.opened == 2 and server.requests == 2


@pytest.mark.anyio
async def test_a_request_asks_a_few_idle_connections_not_all_of_them(monkeypatch):
    """The pool's work per request does not grow with its connections: with 100 idle ones, a request checks
    at most 3 for expiry (the oldest, the one it takes, and itself when it goes back). httpcore 1.0.9's pool
    checks every one at each request's start and end, over 200 here, which made 256 streams O(n^2)."""
    checks = 0
    has_expired = httpcore.AsyncHTTPConnection.has_expired

    def counted(self: httpcore.AsyncHTTPConnection) -> bool:
        nonlocal checks
        checks += 1
        return has_expired(self)

    monkeypatch.setattr(httpcore.AsyncHTTPConnection, "has_expired", counted)
    server = KeepAlive()
    async with serving(server) as port, pooled(max_keepalive=200) as client:
        url = f"http://127.0.0.1:{port}"
        with anyio.fail_after(30):
            held = [asyncio.ensure_future(client.get(url + "/hold")) for _ in range(100)]
            await until(lambda: server.held == 100, "100 held requests at the server")
            server.release.set()
            await asyncio.gather(*held)
            checks = 0
            for _ in range(10):
                await client.get(url + "/v1/models")
    assert server.opened == 100
    assert checks <= 10 * 3, checks
