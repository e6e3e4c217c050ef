"""A run that serves a gateway, on loopback, in the test's own event loop: the engine over a simulated endpoint
(or any URL), the gateway's real HTTP server in front of it, and httpx clients speaking to it.

`served(sim={...})` runs a simulator of the test's own (a SimServer, reached as `Served.sim`, its SimState) and
points an endpoint of kind "local" at it, so a test can count what the server saw (requests, aborts). Without
`sim`, the endpoint is the run's in-process simulator (kind "simulated"), which a test cannot reach.
"""

from __future__ import annotations

import json
import re
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from cerevisor_tui.config import validate
from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sessions import Session
from cerevisor_tui.gateway import GatewayServer, serve_gateway
from cerevisor_tui.sim import SimServer
from tests.conftest import wait_until
from tests.forkserver import Limits

FAST_SIM = {"speed": 50.0, "seed": 3}
NO_EXTENSIONS = {"extend_when_server_busy": False}


@dataclass
class Served:
    engine: Engine
    server: GatewayServer
    events: list[ev.Event] = field(default_factory=list)
    sim_server: SimServer | None = None
    exit_code: int | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def root(self) -> str:
        """The gateway's root (no /v1): for path labels, /a/NAME/v1."""
        return self.server.url.removesuffix("/v1")

    def of(self, kind: type[ev.Event], agent: str | None = None) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and (agent is None or getattr(e, "agent", None) == agent)]

    def statuses(self, agent: str) -> list[str]:
        return [e.status for e in self.of(ev.AgentStatus, agent)]

    def session(self, name: str) -> Session:
        return self.engine.sessions.by_name[name]

    def opened(self) -> list[tuple[str, str]]:
        """Each session opened, as (name, what named it)."""
        return [(o.agent, o.source) for o in self.of(ev.SessionOpened)]

    @property
    def sim(self) -> Any:
        """The test's own simulator's SimState (`served(sim=...)`)."""
        assert self.sim_server is not None, "served(sim={...}) runs a simulator a test can reach"
        return self.sim_server.state


def sim_endpoint(base_url: str, *, name: str = "sim", kind: str = "local", **rest: Any) -> dict[str, Any]:
    """An endpoint at `base_url` serving the simulator's model."""
    return {"name": name, "kind": kind, "base_url": base_url, "model": "sim-model", **rest}


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
async def served(config=None, *, model: str = "", sim: dict[str, Any] | None = None, run_dir: Path | None = None,
                 resume: bool = False, **kwargs: Any) -> AsyncIterator[Served]:
    """The run and its gateway, serving until the block ends (then the run is stopped, as `stop` does, and its
    exit code kept). `sim`: settings of a simulator of the test's own, the run's endpoint "sim" (kind local).
    `run_dir`: the run keeps a run directory there (journal, transcripts, report.json), as `gateway` does;
    `resume`: the run takes up the one there, as `--resume` does."""
    async with AsyncExitStack() as stack:
        sim_server = None
        if sim is not None:
            sim_server = await stack.enter_async_context(SimServer(SimSettings(**{**FAST_SIM, **sim})))
            kwargs.setdefault("endpoints", [sim_endpoint(sim_server.base_url)])
        config = config or gateway_config(**kwargs)
        journal = None
        if run_dir is not None:
            from cerevisor_tui.engine.resume import read_journal
            from cerevisor_tui.engine.run_setup import open_run

            engine, journal = open_run(config, "gw-test", run_dir, console=False, resume=resume,
                                       resumed=read_journal(run_dir) if resume else None)
            stack.callback(journal.close)
        else:
            engine = Engine(config)
        out = Served(engine, None, sim_server=sim_server)  # type: ignore[arg-type]
        engine.subscribe(out.events.append)
        async with anyio.create_task_group() as group:

            async def run() -> None:
                out.exit_code = await engine.run()

            group.start_soon(run)
            out.server = await serve_gateway(engine, config.gateway, model=model)
            await engine.sessions.ready.wait()
            try:
                yield out
            finally:
                engine.stop("test over")
                await out.server.close()


def chat(content: str = "hi", *, stream: bool = True, max_tokens: int = 6, system: str = "",
         history: list[dict[str, Any]] | None = None, model: str = "sim-model", **extra: Any) -> dict[str, Any]:
    """A chat completions request body."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    messages.append({"role": "user", "content": content})
    return {"model": model, "messages": messages, "stream": stream, "max_tokens": max_tokens, **extra}


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    raw: bytes

    @property
    def frames(self) -> list[bytes]:
        return [f for f in self.raw.replace(b"\r\n", b"\n").split(b"\n\n") if f]

    @property
    def comments(self) -> list[bytes]:
        return [f for f in self.frames if f.startswith(b":")]

    @property
    def data(self) -> list[Any]:
        """Each data frame's JSON ([DONE] left out)."""
        out = []
        for frame in self.frames:
            for line in frame.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    out.append(json.loads(line[5:]))
        return out

    @property
    def text(self) -> str:
        """A streamed chat answer's content."""
        return "".join((d["choices"][0]["delta"].get("content") or "") for d in self.data
                       if isinstance(d, dict) and d.get("choices"))

    def json(self) -> Any:
        return json.loads(self.raw)


async def post(client: httpx.AsyncClient, url: str, body: Any = None, *, headers: dict[str, str] | None = None,
               content: bytes | None = None) -> Answer:
    """POST `body` (or raw `content`) and read the whole answer, streamed or not."""
    kwargs: dict[str, Any] = {"content": content} if content is not None else {"json": body}
    async with client.stream("POST", url, headers=headers, **kwargs) as r:
        raw = b"".join([piece async for piece in r.aiter_raw()])
    return Answer(r.status_code, r.headers, raw)


class Headless:
    """`gateway --headless` in the foreground, its stdout read line by line as it comes."""

    def __init__(self, *args: str, descriptors: int | None = None) -> None:
        """`descriptors`: the process's descriptor limit, soft and hard (so the run cannot raise it)."""
        limit = Limits(((resource.RLIMIT_NOFILE, descriptors, descriptors),)) if descriptors else None
        self.proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "gateway", "--headless", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
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
