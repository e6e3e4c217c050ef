"""A run that serves a gateway, on loopback, in the test's own event loop: the engine over a simulated endpoint
(or any URL), the gateway's real HTTP server in front of it, and httpx clients speaking to it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.gateway import GatewayServer, serve_gateway
from tests.conftest import wait_until

FAST_SIM = {"speed": 50.0, "seed": 3}


@dataclass
class Served:
    engine: Engine
    server: GatewayServer
    events: list[ev.Event] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def of(self, kind: type[ev.Event], agent: str | None = None) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and (agent is None or getattr(e, "agent", None) == agent)]

    @property
    def sim(self) -> Any:
        return None


def gateway_config(*, endpoints: list[dict[str, Any]] | None = None, gateway: dict[str, Any] | None = None,
                   run: dict[str, Any] | None = None, stall: dict[str, Any] | None = None, **rest: Any):
    data: dict[str, Any] = {
        "run": {"mode": "parallel", "max_concurrency": 4, **(run or {})},
        "endpoints": endpoints or [{"name": "sim", "kind": "simulated", "model": "sim-model",
                                    "sim": {**FAST_SIM}}],
        "gateway": {"listen": "127.0.0.1:0", "keepalive_s": 0.2, **(gateway or {})},
        **rest,
    }
    if stall:
        data["stall"] = stall
    return validate(data)


@asynccontextmanager
async def served(config=None, *, model: str = "", **kwargs: Any) -> AsyncIterator[Served]:
    """The run and its gateway, serving until the block ends (then the run is stopped, as `stop` does)."""
    config = config or gateway_config(**kwargs)
    engine = Engine(config)
    out = Served(engine, None)  # type: ignore[arg-type]
    engine.subscribe(out.events.append)
    async with anyio.create_task_group() as group:
        result: list[int] = []

        async def run() -> None:
            result.append(await engine.run())

        group.start_soon(run)
        out.server = await serve_gateway(engine, config.gateway, model=model)
        await engine.sessions.ready.wait()
        try:
            yield out
        finally:
            engine.stop("test over")
            await out.server.close()


class Headless:
    """`gateway --headless` in the foreground, its stdout read line by line as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "gateway", "--headless", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def url(self) -> str:
        def served() -> str | None:
            for line in self.lines:
                found = re.search(r"Gateway serving on (http://\S+/v1)", line)
                if found:
                    return found.group(1)
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            return None

        return wait_until(served, "the gateway to say where it serves", timeout=60)

    def end(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=60)
        self._reader.join(10)
        return self.proc.returncode, err
