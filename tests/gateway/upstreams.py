"""Upstreams the simulator cannot play yet: a loopback HTTP server that answers `/v1/messages` as Anthropic's API
does and `/v1/responses` as OpenAI's does (a fixed answer, streamed or not, in their real event shapes), and
records what it was sent and whether its client went away before the end."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from ..conftest import chunk, http_head

WORDS = ("Hello", " from", " the", " upstream", ".")


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def messages_frames(words: tuple[str, ...] = WORDS, *, input_tokens: int = 11, cache: tuple[int, int] = (0, 0)
                    ) -> list[bytes]:
    """A streamed Anthropic Messages answer, frame by frame (message_start ... message_stop). `cache`: the prompt
    tokens read from the prompt cache and written to it, which Anthropic counts apart from input_tokens."""
    frames = [
        _event("message_start", {"type": "message_start", "message": {
            "id": "msg_01", "type": "message", "role": "assistant", "content": [], "model": "up-model",
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1, "cache_read_input_tokens": cache[0],
                      "cache_creation_input_tokens": cache[1]}}}),
        _event("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}),
        b": ping from the upstream\n\n",
        _event("ping", {"type": "ping"}),
    ]
    frames += [_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": w}}) for w in words]
    frames += [
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": len(words)}}),
        _event("message_stop", {"type": "message_stop"}),
    ]
    return frames


def messages_whole(words: tuple[str, ...] = WORDS, *, input_tokens: int = 11, cache: tuple[int, int] = (0, 0)
                   ) -> dict[str, Any]:
    return {"id": "msg_01", "type": "message", "role": "assistant", "model": "up-model",
            "content": [{"type": "text", "text": "".join(words)}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": len(words), "cache_read_input_tokens": cache[0],
                      "cache_creation_input_tokens": cache[1]}}


REASONING = {"type": "reasoning", "id": "rs_01", "summary": [{"type": "summary_text", "text": "Thinking it over."}],
             "encrypted_content": "opaque"}
"""A reasoning item, as Codex gets one before its answer and sends back in its next request's input."""


def _response(status: str, words: tuple[str, ...], input_tokens: int, reasoning: bool = False) -> dict[str, Any]:
    done = status == "completed"
    message = {"type": "message", "id": "msg_01", "status": status, "role": "assistant",
               "content": [{"type": "output_text", "text": "".join(words), "annotations": []}]}
    return {"id": "resp_01", "object": "response", "created_at": 1, "status": status, "model": "up-model",
            "output": ([REASONING] if reasoning else []) + [message] if done else [],
            "usage": {"input_tokens": input_tokens, "output_tokens": len(words), "total_tokens": input_tokens +
                      len(words), "input_tokens_details": {"cached_tokens": 3},
                      "output_tokens_details": {"reasoning_tokens": 0}} if done else None}


def responses_frames(words: tuple[str, ...] = WORDS, *, input_tokens: int = 9, reasoning: bool = False) -> list[bytes]:
    """A streamed OpenAI Responses answer, event by event (response.created ... response.completed)."""
    n = iter(range(1000))
    frames = [_event("response.created", {"type": "response.created", "sequence_number": next(n),
                                          "response": _response("in_progress", words, input_tokens)})]
    if reasoning:
        frames.append(_event("response.reasoning_summary_text.delta", {
            "type": "response.reasoning_summary_text.delta", "item_id": "rs_01", "output_index": 0,
            "summary_index": 0, "delta": "Thinking it over.", "sequence_number": next(n)}))
    frames += [_event("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_01",
                                                     "output_index": 0, "content_index": 0, "delta": w,
                                                     "sequence_number": next(n)}) for w in words]
    frames.append(_event("response.completed", {"type": "response.completed", "sequence_number": next(n),
                                                "response": _response("completed", words, input_tokens, reasoning)}))
    return frames


def responses_whole(words: tuple[str, ...] = WORDS, *, input_tokens: int = 9, reasoning: bool = False) -> dict[str, Any]:
    return _response("completed", words, input_tokens, reasoning)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes = b""  # the body's bytes as they came


@dataclass
class FakeApi:
    """`async with FakeApi() as api:` serves on `api.base_url` (…/v1). `gap_s` between frames; `hold` keeps the
    answer back (its head and all) until set; `reasoning`: a responses answer has a reasoning item before its
    message; `seen` and `gone` (clients that went away before the end) count."""

    gap_s: float = 0.0
    reasoning: bool = False
    silent_gets: bool = False  # GET /v1/models (and /health, /metrics) never answered, as on a wedged server
    error_status: int = 0  # every POST answered with this status and an error body, as an overloaded server does
    set_cookie: str = ""  # every answer sets this cookie, as a load balancer in front of a hosted API does
    cache: tuple[int, int] = (0, 0)  # a messages answer's prompt tokens read from and written to the prompt cache
    hold: asyncio.Event | None = None
    seen: list[Seen] = field(default_factory=list)
    gone: int = 0
    finished: int = 0
    port: int = 0
    _server: asyncio.base_events.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> FakeApi:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            length = int(headers.get("content-length", "0"))
            raw = await reader.readexactly(length) if length else b""
            body = json.loads(raw) if length else {}
            if method != "POST" and self.silent_gets:
                await reader.read(1)  # until the client gives up
                return
            if method != "POST":
                writer.write(http_head(404, "application/json", "connection: close\r\n", length=2) + b"{}")
                await writer.drain()
                return
            self.seen.append(Seen(path, headers, body, raw))
            close = "connection: close\r\n" + (f"set-cookie: {self.set_cookie}\r\n" if self.set_cookie else "")
            if self.error_status:
                data = json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
                writer.write(http_head(self.error_status, "application/json", close,
                                       length=len(data)) + data.encode())
                await writer.drain()
                return
            if self.hold is not None:
                waiting = asyncio.ensure_future(self.hold.wait())
                closed = asyncio.ensure_future(reader.read(1))  # b"": the client went away
                done, _ = await asyncio.wait({waiting, closed}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if closed in done:
                    self.gone += 1
                    return
                closed.cancel()
            messages = path.endswith("/messages")
            if body.get("stream"):
                writer.write(http_head(200, "text/event-stream", close))
                frames = messages_frames(cache=self.cache) if messages else responses_frames(reasoning=self.reasoning)
                for frame in frames:
                    writer.write(chunk(frame))
                    await writer.drain()
                    if self.gap_s:
                        await asyncio.sleep(self.gap_s)
                writer.write(chunk(b""))
            else:
                whole = messages_whole(cache=self.cache) if messages else responses_whole(reasoning=self.reasoning)
                data = json.dumps(whole).encode()
                writer.write(http_head(200, "application/json", close, length=len(data)) + data)
            await writer.drain()
            self.finished += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            self.gone += 1
        finally:
            writer.close()
