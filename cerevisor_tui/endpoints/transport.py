"""The httpx transport our clients send through: a connection pool of our own on endpoints/network.py's backend.

httpx has no setting for the network backend under the pool it builds; a transport of our own is its public
seam for one. `AsyncioTransport` maps the request and the response between httpx and httpcore as httpx's
`AsyncHTTPTransport` does (httpx/_transports/default.py), without the proxy branches, and raises httpcore's
exceptions as httpx's, which is what the stream code catches (httpx.ConnectError, ReadError,
RemoteProtocolError, PoolTimeout...). A client given a transport of its own does not read proxies from
the environment, so `proxy_mounts` reads them as httpx would and gives each one httpx's own transport.

Why not httpcore's `AsyncConnectionPool`: 1.0.9 walks all its connections and all its requests at every
request's start and end (`_assign_requests_to_connections`), so with n streams open each costs O(n) and the
gateway's 256 streams cost O(n^2); it collapsed there (docs/performance.md: the gateway). `_Pool` keeps, per
origin, its idle connections most recent last and, over all origins, the order they went idle in: taking,
returning, expiring and evicting one is O(1). Each connection is httpcore's own `AsyncHTTPConnection`
(connect, TLS, HTTP/1.1 with h11), so the wire behaviour is httpcore's, but for one thing httpcore's pool does
not do: a request whose kept-alive connection the server closed as it went out, with nothing answered, goes again
once on a new connection (seen: llama-server closing one between a streamed answer and the next request, which a
gateway client got as a 503).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import ssl
import typing
import urllib.request

import httpcore
import httpx

from cerevisor_tui.endpoints.network import AsyncioBackend

# httpcore's exceptions and the httpx exceptions httpx's own transport raises for them
_HTTPX_EXCEPTION: dict[type[Exception], type[httpx.TransportError]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}


@contextlib.contextmanager
def _as_httpx_exceptions() -> typing.Iterator[None]:
    """Raise an httpcore exception as the most specific httpx one, chained to it; anything else as it is."""
    try:
        yield
    except Exception as exc:
        for cls in type(exc).__mro__:  # the most specific class first, as httpx's own mapping picks
            mapped = _HTTPX_EXCEPTION.get(cls)
            if mapped is not None:
                raise mapped(str(exc)) from exc
        raise


_Origin = tuple[bytes, bytes, int]  # scheme, host, port


class _Pool:
    """HTTP/1.1 connections by origin, held to httpx's `limits`, with O(1) work per request.

    `max_connections` caps the requests in flight (each holds a connection of its own); a request that finds
    no idle connection to its origin opens one, first closing the longest-idle connection to another origin
    when open connections would pass the cap, as httpcore's pool does. A request that waits for the cap
    longer than its pool timeout gets PoolTimeout. At most `max_keepalive_connections` stay open idle (the
    longest idle closed first), none past `keepalive_expiry`; an idle connection the server closed or wrote
    to is not reused (httpcore's `has_expired`)."""

    def __init__(self, limits: httpx.Limits) -> None:
        # httpx's default (certifi, SSL_CERT_*), made at the first https origin: loading the CAs takes ~30 ms of
        # CPU, each client a run or a probe builds paid it, and loopback servers speak plain http
        self._ssl_context: ssl.SSLContext | None = None
        self._backend = AsyncioBackend()
        self._keepalive_expiry = limits.keepalive_expiry
        self._max_connections = limits.max_connections
        self._max_keepalive = limits.max_keepalive_connections
        if self._max_connections is not None and self._max_keepalive is not None:
            self._max_keepalive = min(self._max_keepalive, self._max_connections)
        self._slots = asyncio.Semaphore(self._max_connections) if self._max_connections is not None else None
        self._idle: dict[_Origin, collections.OrderedDict[httpcore.AsyncHTTPConnection, None]] = {}
        self._idle_order: collections.OrderedDict[httpcore.AsyncHTTPConnection, _Origin] = (
            collections.OrderedDict()
        )
        self._active: set[httpcore.AsyncHTTPConnection] = set()

    def _ssl_for(self, origin: _Origin) -> ssl.SSLContext | None:
        if origin[0] != b"https":
            return None
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context(trust_env=True)
        return self._ssl_context

    async def acquire(self, origin: _Origin, timeout: float | None, *,
                      new: bool = False) -> tuple[httpcore.AsyncHTTPConnection, bool]:
        """A connection for one request to `origin`, held by it until `release`, and whether it served a request
        before (an idle one, kept alive); `new`: not an idle one."""
        if self._slots is not None:
            if self._slots.locked() and timeout is not None:
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for may lose a cancel that comes as it ends
                    async with asyncio.timeout(timeout):
                        await self._slots.acquire()
                except TimeoutError:
                    raise httpcore.PoolTimeout(f"no connection free in {timeout} s") from None
            else:
                await self._slots.acquire()
        try:
            await self._close_expired()
            connection = None if new else await self._idle_connection(origin)
            reused = connection is not None
            if connection is None:
                open_connections = len(self._active) + len(self._idle_order)
                if self._max_connections is not None and open_connections >= self._max_connections:
                    # at the cap, with no idle connection to this origin: one to another makes room
                    await self._close(*self._idle_order.popitem(last=False))
                connection = httpcore.AsyncHTTPConnection(
                    origin=httpcore.Origin(*origin),
                    ssl_context=self._ssl_for(origin),
                    keepalive_expiry=self._keepalive_expiry,
                    http1=True,
                    http2=False,
                    network_backend=self._backend,
                )
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        self._active.add(connection)
        return connection, reused

    async def release(self, connection: httpcore.AsyncHTTPConnection, origin: _Origin) -> None:
        """The request on `connection` is over: keep it for the next one if it can take one, else close it."""
        if connection not in self._active:
            return
        self._active.discard(connection)
        if self._slots is not None:
            self._slots.release()
        # a body not read to its end, an error, the server's close: not reusable
        if not connection.is_idle() or connection.has_expired():
            if not connection.is_closed():
                await connection.aclose()
            return
        self._idle.setdefault(origin, collections.OrderedDict())[connection] = None
        self._idle_order[connection] = origin
        if self._max_keepalive is not None and len(self._idle_order) > self._max_keepalive:
            await self._close(*self._idle_order.popitem(last=False))

    async def _idle_connection(self, origin: _Origin) -> httpcore.AsyncHTTPConnection | None:
        idle = self._idle.get(origin)
        while idle:
            connection, _ = idle.popitem(last=True)  # the most recent: the oldest are the ones left to expire
            del self._idle_order[connection]
            if not connection.has_expired():
                return connection
            await connection.aclose()
        return None

    async def _close_expired(self) -> None:
        # idle connections expire in the order they went idle: the oldest one tells whether any has
        while self._idle_order:
            connection, origin = next(iter(self._idle_order.items()))
            if not connection.has_expired():
                return
            await self._close(connection, origin)

    async def _close(self, connection: httpcore.AsyncHTTPConnection, origin: _Origin) -> None:
        self._idle_order.pop(connection, None)
        self._idle[origin].pop(connection, None)
        await connection.aclose()

    async def aclose(self) -> None:
        connections = [*self._idle_order, *self._active]
        self._idle.clear()
        self._idle_order.clear()
        self._active.clear()
        for connection in connections:
            await connection.aclose()


class _ResponseStream(httpx.AsyncByteStream):
    """A response body as httpcore streams it, its errors as httpx's; its close gives the connection back."""

    def __init__(
        self,
        stream: typing.AsyncIterable[bytes],
        pool: _Pool,
        connection: httpcore.AsyncHTTPConnection,
        origin: _Origin,
    ) -> None:
        self._stream = stream
        self._pool = pool
        self._connection = connection
        self._origin = origin
        self._closed = False

    async def __aiter__(self) -> typing.AsyncIterator[bytes]:
        try:
            with _as_httpx_exceptions():
                async for part in self._stream:
                    yield part
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        # once only: given back, the connection may already carry another request
        if self._closed:
            return
        self._closed = True
        # closing a body that is not read to its end closes its connection (httpcore's HTTP/1.1 rule)
        try:
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                with _as_httpx_exceptions():
                    await aclose()
        finally:
            await self._pool.release(self._connection, self._origin)


class AsyncioTransport(httpx.AsyncBaseTransport):
    """`_Pool` on `AsyncioBackend`, with httpx's TLS setup and `limits`, HTTP/1.1 only."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._pool = _Pool(limits)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.raw_scheme
        if scheme not in (b"http", b"https"):
            raise httpx.UnsupportedProtocol(f"Request URL has an unsupported protocol '{url.scheme}://'.")
        origin: _Origin = (scheme, url.raw_host, url.port or (443 if scheme == b"https" else 80))
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=typing.cast(typing.AsyncIterable[bytes], request.stream),
            extensions=request.extensions,
        )
        timeout = request.extensions.get("timeout", {}).get("pool")
        with _as_httpx_exceptions():
            for resend in (False, True):
                connection, reused = await self._pool.acquire(origin, timeout, new=resend)
                try:
                    response = await connection.handle_async_request(core_request)
                    break
                except BaseException as exc:
                    await self._pool.release(connection, origin)  # httpcore closed it: the request did not finish
                    # a kept-alive connection the server closed as the request went out (its keep-alive ran out, or
                    # it closes after each streamed answer): nothing came back, so the request goes again, once, on
                    # a new connection, as Go's transport does (its errServerClosedIdle); a body that cannot be sent
                    # twice is not
                    if resend or not (reused and _unanswered(exc) and isinstance(request.stream, httpx.ByteStream)):
                        raise
            else:  # (the resend either answered or raised)
                raise AssertionError("unreachable")
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(
                typing.cast(typing.AsyncIterable[bytes], response.stream), self._pool, connection, origin
            ),
            extensions=response.extensions,  # network_stream among them: ChatStream.abort drops it
        )

    async def aclose(self) -> None:
        with _as_httpx_exceptions():
            await self._pool.aclose()


# what a request meets on a connection the server closed before answering it: the end of the stream with no
# response (h11's "Server disconnected without sending a response."), or a reset read or write
_CLOSED_UNANSWERED = (httpcore.RemoteProtocolError, httpcore.ReadError, httpcore.WriteError)


def _unanswered(exc: BaseException) -> bool:
    if isinstance(exc, httpcore.RemoteProtocolError):
        return "without sending a response" in str(exc)
    return isinstance(exc, _CLOSED_UNANSWERED)


def proxy_mounts(limits: httpx.Limits) -> dict[str, httpx.AsyncBaseTransport | None]:
    """The environment's proxies as an httpx client's `mounts`, read as httpx reads them for a client built
    without a transport (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY; httpx/_utils.py, get_environment_proxies).
    A proxy gets httpx's own transport; a NO_PROXY pattern None, which is the client's own transport."""
    found = urllib.request.getproxies()
    mounts: dict[str, httpx.AsyncBaseTransport | None] = {}
    for scheme in ("http", "https", "all"):
        if found.get(scheme):
            proxy = found[scheme] if "://" in found[scheme] else f"http://{found[scheme]}"
            mounts[f"{scheme}://"] = httpx.AsyncHTTPTransport(proxy=proxy, limits=limits)
    if not mounts:  # nothing to route around: no patterns to match each request against
        return mounts
    for host in (host.strip() for host in found.get("no", "").split(",")):
        if host == "*":  # no proxy for anything
            return {}
        if not host:
            continue
        if "://" in host:
            mounts[host] = None
        elif _is_ip(host, ipaddress.IPv4Address):
            mounts[f"all://{host}"] = None
        elif _is_ip(host, ipaddress.IPv6Address):
            mounts[f"all://[{host}]"] = None
        elif host.lower() == "localhost":
            mounts[f"all://{host}"] = None
        else:  # "example.com" is it and its subdomains, ".example.com" its subdomains only
            mounts[f"all://*{host}"] = None
    return mounts


def _is_ip(host: str, kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]) -> bool:
    try:
        kind(host.split("/")[0])
    except ValueError:
        return False
    return True
