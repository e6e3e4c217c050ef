"""The httpx transport our clients send through: httpcore's connection pool on endpoints/network.py's backend.

httpx has no setting for the network backend under the pool it builds; a transport of our own is its public
seam for one. `AsyncioTransport` is httpx's `AsyncHTTPTransport` (httpx/_transports/default.py) without the
proxy branches: the request and the response mapped between httpx and httpcore as it maps them, and
httpcore's exceptions raised as httpx's, which is what the stream code catches (httpx.ConnectError,
ReadError, RemoteProtocolError...). A client given a transport of its own does not read proxies from
the environment, so `proxy_mounts` reads them as httpx would and gives each one httpx's own transport.
"""

from __future__ import annotations

import contextlib
import ipaddress
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


class _ResponseStream(httpx.AsyncByteStream):
    """A response body as httpcore streams it, its errors as httpx's."""

    def __init__(self, stream: typing.AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> typing.AsyncIterator[bytes]:
        with _as_httpx_exceptions():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        # closing a body that is not read to its end closes its connection (httpcore's HTTP/1.1 rule)
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()


class AsyncioTransport(httpx.AsyncBaseTransport):
    """httpcore's connection pool on `AsyncioBackend`, with httpx's TLS setup and `limits`, HTTP/1.1 only."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            # as an httpx client builds its default one: certifi's roots, or SSL_CERT_FILE / SSL_CERT_DIR
            ssl_context=httpx.create_ssl_context(trust_env=True),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            network_backend=AsyncioBackend(),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=typing.cast(typing.AsyncIterable[bytes], request.stream),
            extensions=request.extensions,
        )
        with _as_httpx_exceptions():
            response = await self._pool.handle_async_request(core_request)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(typing.cast(typing.AsyncIterable[bytes], response.stream)),
            extensions=response.extensions,  # network_stream among them: ChatStream.abort drops it
        )

    async def aclose(self) -> None:
        with _as_httpx_exceptions():
            await self._pool.aclose()


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
