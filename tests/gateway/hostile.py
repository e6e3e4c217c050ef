"""An upstream that is no friend: a loopback HTTP server that repeats the credentials it is sent (in an error body, an
error event mid-stream, a whole answer, a pass-through's echo), answers in shapes no API has (a message that is a
string, an error nested 900 deep), lies in its /metrics, and records every request as it came on the wire (raw
target, headers, body), so a test can say what reached it and what did not."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from ..conftest import chunk, http_head

KEY = "sk-upstream-0123456789abcdef"
"""The run's upstream key (the endpoint's api_key_env): what must never reach a client."""
KEY_ENV = "HOSTILE_UPSTREAM_KEY"
LYING_METRICS = ("# TYPE vllm:num_requests_running gauge\n"
                 'vllm:num_requests_running{engine="0"} 1e308\nvllm:num_requests_running{engine="1"} 1e308\n'
                 "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting NaN\n"
                 "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc -4\n"
                 "# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total +Inf\n"
                 "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 1e308\n"
                 'vllm:cache_config_info{num_gpu_blocks="1e308",block_size="inf"} 1.0\n')


def deep(n: int = 900) -> Any:
    value: Any = "bottom"
    for _ in range(n):
        value = {"error": value}
    return value


def deep_bytes(n: int = 900) -> bytes:
    """An error object nested `n` deep, as JSON (written out, as encoders refuse such depth)."""
    return b'{"error": ' * n + b'"bottom"' + b"}" * n


@dataclass
class Seen:
    method: str
    target: str  # the request line's target, as sent: percent-escapes and dots as they were
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def _sse(obj: Any, event: str = "") -> bytes:
    return (f"event: {event}\n" if event else "").encode() + b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chat_chunk(content: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "up-model",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


@dataclass
class Hostile:
    """`async with Hostile() as up:` serves on `up.base_url` (…/v1). The mode of a POST is its last message's text
    (`echo-error`, `echo-frame`, `echo-whole`, `echo-stream`, `string-message`, `deep-frame`; anything else: a
    plain answer); every other request is answered with an echo of what it carried, Authorization included."""

    metrics: str = LYING_METRICS
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _server: asyncio.base_events.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def posts(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]

    async def __aenter__(self) -> Hostile:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:]
                                                                          if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append(Seen(method, target, headers, body))
                await self._answer(writer, method, target, headers, body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, method: str, target: str, headers: dict[str, str],
                      body: bytes) -> None:
        auth = headers.get("authorization", "") + " " + headers.get("x-api-key", "")
        if target.endswith("/metrics"):
            data = self.metrics.encode()
            writer.write(http_head(200, "text/plain", length=len(data)) + data)
            return
        if method == "HEAD":
            writer.write(http_head(200, "application/json", length=0))
            return
        if method != "POST" or not target.endswith(("/chat/completions", "/messages")):
            data = json.dumps({"object": "echo", "method": method, "target": target, "headers": headers}).encode()
            writer.write(http_head(200, "application/json", length=len(data)) + data)
            return
        try:
            request = json.loads(body)
            messages = request.get("messages") or [{}]
            mode = messages[-1].get("content", "") if isinstance(messages[-1], dict) else ""
        except (ValueError, AttributeError, TypeError, IndexError, KeyError):  # a 400, as a real server says
            data = b'{"error": {"message": "not a request", "type": "invalid_request_error"}}'
            writer.write(http_head(400, "application/json", length=len(data)) + data)
            return
        anthropic = target.endswith("/messages")
        if mode == "echo-error":
            error = {"type": "error", "error": {"type": "authentication_error", "message": f"bad key: {auth}"}} \
                if anthropic else {"error": {"message": f"invalid key {auth}", "type": "invalid_request_error"}}
            data = json.dumps(error).encode()
            writer.write(http_head(401, "application/json", length=len(data)) + data)
        elif mode == "echo-whole":
            answer = {"id": "c1", "object": "chat.completion", "model": "up-model",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": f"your key: {auth}"},
                                   "finish_reason": "stop"}]}
            data = json.dumps(answer).encode()
            writer.write(http_head(200, "application/json", length=len(data)) + data)
        elif mode == "string-message":
            data = json.dumps({"choices": [{"message": "not an object", "finish_reason": 7}], "usage": "x"}).encode()
            writer.write(http_head(200, "application/json", length=len(data)) + data)
        elif mode in ("huge-progress", "wobble"):
            writer.write(http_head(200, "text/event-stream"))
            await self._progress(writer, mode)
        else:
            writer.write(http_head(200, "text/event-stream"))
            if anthropic:
                frames = [_sse({"type": "message_start", "message": {"usage": {"input_tokens": 3}}}, "message_start"),
                          _sse({"type": "content_block_delta", "index": 0,
                                "delta": {"type": "text_delta", "text": "hello"}}, "content_block_delta")]
            else:
                frames = [_sse(_chat_chunk("hello"))]
            if mode == "echo-frame":
                frames.append(_sse({"type": "error", "error": {"type": "api_error", "message": f"key {auth}"}},
                                   "error") if anthropic else _sse({"error": {"message": f"upstream saw {auth}"}}))
            elif mode == "echo-stream":
                frames.append(_sse(_chat_chunk(f"the key is {auth}")))
            elif mode.startswith("deep-frame"):  # deep-frame-N: nested N deep (900 by default)
                depth = int(mode.rpartition("-")[2]) if mode[-1].isdigit() else 900
                frames.append((b"event: error\n" if anthropic else b"") + b"data: " + deep_bytes(depth) + b"\n\n")
            if anthropic:
                frames.append(_sse({"type": "message_stop"}, "message_stop"))
            else:
                frames += [_sse(_chat_chunk("", "stop")), b"data: [DONE]\n\n"]
            for frame in frames:
                writer.write(chunk(frame))
                await writer.drain()
            writer.write(chunk(b""))


    @staticmethod
    async def _progress(writer: asyncio.StreamWriter, mode: str) -> None:
        """`huge-progress`: a prompt_progress of 1e308 tokens, then a short answer. `wobble`: progress that goes
        10, 11, 10, 11 ... of 1,000 for ever (until the client goes away), never a token."""
        role = b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]'
        if mode == "huge-progress":
            writer.write(chunk(b'data: {' + role + b',"prompt_progress":{"total":1e308,"cache":0,'
                               b'"processed":1e300,"time_ms":5}}\n\n'))
            for frame in (_sse(_chat_chunk("hello")), _sse(_chat_chunk("", "stop")), b"data: [DONE]\n\n"):
                writer.write(chunk(frame))
            writer.write(chunk(b""))
            return
        processed = 10
        while True:
            writer.write(chunk(b'data: {' + role + b',"prompt_progress":{"total":1000,"cache":0,"processed":'
                               + str(processed).encode() + b',"time_ms":100}}\n\n'))
            await writer.drain()
            processed = 21 - processed  # 10, 11, 10, 11 ...
            await asyncio.sleep(0.1)


async def raw_request(host: str, port: int, request: bytes, *, timeout_s: float = 30.0) -> bytes:
    """Send `request` as it is (no client normalises its path) and read the answer until the server closes."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), timeout_s)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def body_of(answer: bytes) -> bytes:
    """The body of a raw answer, chunked or not."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return rest
    out = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out
