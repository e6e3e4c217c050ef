"""A loopback server that echoes the request's Authorization header back through every path a server's
text can take into a run: an error body, an HTML page, a reason phrase, a stream delta split across two
reads, reasoning, a malformed chunk, a stream error, a non-stream body, a stream cut in the middle of the
key, /v1/models and /health. The request's `model` picks the path (`BEHAVIOURS`).

It runs in a thread of its own, so a `cerevisor-tui` subprocess (or an in-process CLI call) can use it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

BEHAVIOURS = ("http400", "html401", "reason", "split", "split3", "reasoning", "malformed", "sse_error",
              "nonstream", "cut", "clean", "models")
# what the agent on each ends as (with retries = 0)
OUTCOMES = {"http400": "failed", "html401": "failed", "reason": "failed", "split": "completed",
            "split3": "completed", "reasoning": "completed", "malformed": "failed", "sse_error": "failed",
            "nonstream": "failed", "cut": "failed", "clean": "completed", "models": "failed"}


def _sse(delta: dict | None = None, finish: str | None = None) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "model": "m",
           "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class EchoServer:
    """`with EchoServer() as srv:` serves on `srv.base_url` until the block ends; `srv.seen` holds the
    Authorization values it received."""

    def __init__(self, *, loading: bool = True, list_models: bool = False) -> None:
        self.loading = loading  # /health answers 503 "Loading model for <key>"; else 200
        self.list_models = list_models  # /v1/models lists the behaviours; else 401 "no models for <key>"
        self.port = 0
        self.seen: list[str] = []
        self.health_reads = 0
        self._health_read: asyncio.Condition | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> EchoServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self._health_read = asyncio.Condition()
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self.loop.run_until_complete(start())
        self._ready.set()
        self.loop.run_forever()
        self._server.close()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: several requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                auth = headers.get("authorization", "")
                self.seen.append(auth)
                if method == "GET":
                    await self._get(writer, path, auth)
                    continue
                try:
                    model = json.loads(body).get("model", "")
                except ValueError:
                    model = ""
                if not await self._post(writer, model, auth):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _fixed(status: int, ctype: str, body: bytes, reason: str = "X") -> bytes:
        return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
                .encode("latin-1") + body)

    async def _get(self, writer: asyncio.StreamWriter, path: str, auth: str) -> None:
        if path.endswith("/models") and self.list_models:
            body = json.dumps({"object": "list", "data": [{"id": b, "object": "model"} for b in BEHAVIOURS]}).encode()
            writer.write(self._fixed(200, "application/json", body))
        elif path.endswith("/models"):
            body = json.dumps({"error": {"message": f"no models for {auth}"}}).encode()
            writer.write(self._fixed(401, "application/json", body))
        elif path.endswith("/health"):  # llama.cpp's "still loading" shape, with the key in its message
            body = json.dumps({"error": {"code": 503, "message": f"Loading model for {auth}"}}).encode()
            writer.write(self._fixed(503, "application/json", body) if self.loading else self._fixed(200, "text/plain", b""))
            async with self._health_read:
                self.health_reads += 1
                self._health_read.notify_all()
        else:
            writer.write(self._fixed(404, "text/plain", b""))
        await writer.drain()

    async def _post(self, writer: asyncio.StreamWriter, model: str, auth: str) -> bool:
        """Answer one chat request; False when the connection must close after it."""
        key = auth.partition(" ")[2]
        if model == "http400":
            body = json.dumps({"error": {"message": f"invalid header Authorization: {auth}"}}).encode()
            writer.write(self._fixed(400, "application/json", body))
        elif model == "html401":
            body = f"<html><head><title>Denied: {auth}</title></head><body>{auth}</body></html>".encode()
            writer.write(self._fixed(401, "text/html", body))
        elif model == "reason":
            writer.write(self._fixed(418, "text/plain", b"", reason=f"Teapot {auth}"))
        elif model == "nonstream":
            writer.write(self._fixed(200, "text/plain", f"you sent {auth} and we do not stream".encode()))
        elif model == "clean-after-health":
            # answers once /health was read twice: the run's monitor has recorded a sample of it by then
            async with self._health_read:
                await asyncio.wait_for(self._health_read.wait_for(lambda: self.health_reads >= 2), 20)
            return await self._post(writer, "clean", auth)
        elif model in ("split", "split3", "reasoning", "cut", "clean"):
            field = "reasoning_content" if model == "reasoning" else "content"
            text = "clean answer" if model == "clean" else f"the header was {auth}, so there"
            if model == "cut":
                text = f"the header was Bearer {key[:len(key) * 2 // 3]}"
            at = len("the header was Bearer ") + len(key) // 2
            pieces = [text[:at], text[at:]]
            if model == "split3":
                pieces = [text[:at - 4], text[at - 4:at + 3], text[at + 3:]]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in pieces:  # each piece in a read of its own: the client cannot merge them
                writer.write(_chunk(_sse({field: piece})))
                await writer.drain()
                await asyncio.sleep(0.03)
            if model == "cut":  # the stream ends in the middle of the key, without a finish reason
                writer.write(_chunk(b""))
                await writer.drain()
                return False
            writer.write(_chunk(_sse({}, finish="stop") + b"data: [DONE]\n\n") + _chunk(b""))
        elif model == "malformed":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            bad = f'data: {{"id": "x", "note": "{auth}" broken\n\n'.encode()
            writer.write(_chunk(_sse({"content": "one "}) + bad) + _chunk(b""))
        elif model == "sse_error":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            err = b"data: " + json.dumps({"error": {"message": f"engine saw {auth}", "code": 400}}).encode() + b"\n\n"
            writer.write(_chunk(_sse({"content": "one "}) + err) + _chunk(b""))
        else:
            writer.write(self._fixed(404, "application/json", b'{"error": {"message": "unknown model"}}'))
        await writer.drain()
        return True


def leaks(text: str, key: str, window: int = 10) -> list[str]:
    """Every piece of `key` at least `window` characters long that occurs in `text` (the whole key, or a
    part of it long enough to be worth something)."""
    found = []
    for i in range(0, max(1, len(key) - window + 1)):
        piece = key[i:i + window]
        if piece and piece in text:
            found.append(piece)
    return found


def outputs(*paths: Path, texts: tuple[str, ...] = ()) -> str:
    """All the text a run left: the given strings and every file under the given paths."""
    parts = list(texts)
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for path in files:
            parts.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts)


def workflow(path: Path, url: str, *, behaviours=BEHAVIOURS, key_env: str = "CEREVISOR_CANARY",
             stream_process: str = "off", local: tuple[str, ...] = ()) -> Path:
    """One endpoint (and one agent) per behaviour, all with the same key; `local` names the behaviours
    whose endpoint is local (its /health, echoing the key, is read while the run goes)."""
    lines = [f'[run]\nmax_concurrency = 16\nmetrics_interval_s = 0.1\nstream_process = "{stream_process}"\n']
    for b in behaviours:
        kind = "local" if b in local else "hosted"
        model = "" if b == "models" else f'model = "{b}-after-health"\n' if b in local else f'model = "{b}"\n'
        lines.append(f'[[endpoints]]\nname = "ep-{b}"\nbase_url = "{url}"\nkind = "{kind}"\n{model}'
                     f'api_key_env = "{key_env}"\nextend_when_server_busy = false\n')
    for b in behaviours:
        lines.append(f'[[agents]]\nname = "ag-{b}"\nendpoint = "ep-{b}"\nprompt = "go"\nretries = 0\nmax_tokens = 20\n')
    path.write_text("\n".join(lines))
    return path
