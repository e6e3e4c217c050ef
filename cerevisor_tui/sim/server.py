"""Run the simulator app under uvicorn: inside the caller's event loop, or in a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim.app import SimState, create_app


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the embedding program owns Ctrl-C."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one. Raises OSError when the port is taken.

    Made with proto IPPROTO_TCP, not 0: the connections it accepts inherit it, and asyncio sets TCP_NODELAY only
    on sockets whose proto says TCP. Without it, uvicorn's headers and first body chunk (two writes) met Nagle
    and the client's delayed ACK: every streamed answer's first token came 40 ms late."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class SimServer:
    """`async with SimServer(settings) as srv:` serves a simulated vLLM on `srv.base_url` until the block ends."""

    def __init__(self, settings: SimSettings | None = None, *, port: int = 0, host: str = "127.0.0.1",
                 model: str = "sim-model", sock: socket.socket | None = None) -> None:
        self.settings = settings or SimSettings()
        self.host = host
        self.model = model
        self._requested_port = port
        self._sock = sock
        self.app: Any = None
        self.port = 0
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def state(self) -> SimState:
        return self.app.state.sim

    async def start(self) -> SimServer:
        sock = self._sock or bind_socket(self.host, self._requested_port)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self.app = create_app(self.settings, model=self.model)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, ws="none", http="h11")
        self._server = _Uvicorn(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]),
                                                            name="cerevisor-sim-uvicorn")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raise what stopped it
                raise RuntimeError("the simulator stopped while starting")
            await asyncio.sleep(0.002)
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        await self.state.engine.close()  # ends open streams, so shutdown need not wait for them
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = None
        self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def serve_forever(self) -> None:
        """Wait until the server stops (used by the CLI)."""
        if self._task is not None:
            await self._task

    async def __aenter__(self) -> SimServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class ThreadedSim:
    """A SimServer running in a background thread with its own event loop, for synchronous code."""

    def __init__(self, settings: SimSettings | None, port: int, host: str, model: str) -> None:
        self._server = SimServer(settings, port=port, host=host, model=model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="cerevisor-sim", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self._server.start()
            except BaseException as exc:  # handed to the starting thread
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            await self._stop.wait()
            await self._server.stop()

        asyncio.run(main())

    def start(self) -> ThreadedSim:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    @property
    def base_url(self) -> str:
        return self._server.base_url

    @property
    def root_url(self) -> str:
        return self._server.root_url

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def state(self) -> SimState:
        return self._server.state

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def __enter__(self) -> ThreadedSim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(settings: SimSettings | None = None, port: int = 0, *, host: str = "127.0.0.1",
                    model: str = "sim-model") -> ThreadedSim:
    """Start a simulator in a background thread; `.base_url`, `.state`, `.stop()` (also a context manager)."""
    return ThreadedSim(settings, port, host, model).start()
