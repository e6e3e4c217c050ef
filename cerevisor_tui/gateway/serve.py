"""The gateway under uvicorn, inside the run's event loop: started before the run's first request, stopped
after its last."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from cerevisor_tui.config.models import GatewayConfig, is_loopback, split_listen
from cerevisor_tui.gateway.listener import Listener, bounded_protocol
from cerevisor_tui.gateway.server import Gateway, GatewayError
from cerevisor_tui.sim.server import bind_socket

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the run owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """The gateway serving on its socket; `url` is its base (…/v1)."""

    def __init__(self, gateway: Gateway, listener: Listener, server: _Uvicorn, task: asyncio.Task[None], host: str,
                 port: int) -> None:
        self.gateway = gateway
        self.listener = listener
        self._server = server
        self._task = task
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def close(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def serve_gateway(engine: Engine, settings: GatewayConfig, *, model: str = "") -> GatewayServer:
    """Bind `settings.listen` and serve the run's gateway. Raises GatewayError (one line) when it cannot."""
    gateway = Gateway(engine, settings, model=model)
    host, port = split_listen(settings.listen)
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        raise GatewayError(f"cannot listen on {settings.listen}: {exc.strerror or exc}") from None
    listener = Listener(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                        max_connections=settings.max_connections,
                        max_connections_per_peer=None if is_loopback(host) else settings.max_connections_per_peer)
    # uvicorn's own bounds kept: an idle keep-alive connection closed after 75 s, a header over h11's 16 KiB refused
    config = uvicorn.Config(gateway, http=bounded_protocol(listener), log_level="warning", access_log=False,
                            lifespan="off", ws="none", timeout_graceful_shutdown=2, timeout_keep_alive=75,
                            backlog=listener.backlog)
    server = _Uvicorn(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="cerevisor-gateway")
    while not server.started:
        if task.done():
            sock.close()
            raise GatewayError(f"the gateway on {settings.listen} stopped while starting: {task.exception()}")
        await asyncio.sleep(0.005)
    return GatewayServer(gateway, listener, server, task, host, sock.getsockname()[1])
