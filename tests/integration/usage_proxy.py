"""A recording HTTP proxy for loopback: forwards everything to a real server and keeps each stream's usage.

It lets a test compare what the product reports with what the server's own usage chunks said, read
off the wire independently of the product's parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from cerevisor_tui.sim.server import bind_socket

_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass(frozen=True)
class SeenUsage:
    agent: str
    prompt_tokens: int
    completion_tokens: int


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # a thread may not install signal handlers
        yield


class UsageProxy:
    """`with UsageProxy(upstream_root) as proxy:` serves on `proxy.base_url`; `proxy.usages` fills up."""

    def __init__(self, upstream_root: str) -> None:
        self.upstream = upstream_root.rstrip("/")
        self.usages: list[SeenUsage] = []
        self.chat_requests = 0
        self._sock = bind_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])])
        self._server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._run, name="usage-proxy", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    async def _handle(self, request: Request):
        client = httpx.AsyncClient(timeout=None)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        agent = request.headers.get("x-cerevisor-agent", "")
        if request.url.path.endswith("/chat/completions"):
            self.chat_requests += 1
        upstream = client.build_request(request.method, self.upstream + request.url.path, headers=headers,
                                        content=await request.body(), params=request.query_params)
        response = await client.send(upstream, stream=True)

        async def body():
            pending = b""
            try:
                async for chunk in response.aiter_bytes():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        self._look(line, agent)
                    yield chunk
            finally:
                await response.aclose()
                await client.aclose()

        ctype = response.headers.get("content-type", "application/octet-stream")
        return StreamingResponse(body(), status_code=response.status_code, media_type=ctype)

    def _look(self, line: bytes, agent: str) -> None:
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return
        try:
            usage = json.loads(line[5:]).get("usage")
        except ValueError:
            return
        if usage:
            self.usages.append(SeenUsage(agent, int(usage["prompt_tokens"]), int(usage["completion_tokens"])))

    def by_agent(self) -> dict[str, tuple[int, int, int]]:
        """agent -> (usage chunks, prompt tokens, completion tokens)."""
        out: dict[str, tuple[int, int, int]] = {}
        for u in self.usages:
            n, p, c = out.get(u.agent, (0, 0, 0))
            out[u.agent] = (n + 1, p + u.prompt_tokens, c + u.completion_tokens)
        return out

    def __enter__(self) -> UsageProxy:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("usage proxy did not start")
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
