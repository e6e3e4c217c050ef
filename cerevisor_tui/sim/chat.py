"""`POST /v1/chat/completions` as vLLM serves it: chat messages in, chat.completion (chunks) out."""

from __future__ import annotations

import itertools
import json
from typing import Any

from starlette.responses import JSONResponse

from cerevisor_tui.sim.api import Api, ApiError, Frames, Prompt, Reply

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error object (its type is a Python exception name, its code the HTTP status)."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


class ChatApi(Api):
    name = "chat"
    path = "/v1/chat/completions"
    prompt_progress = True
    _ids = itertools.count(1)

    def read(self, body: dict[str, Any]) -> Prompt:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of objects", "messages")
        return Prompt(
            messages=messages, model=body.get("model"),
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
            stream=bool(body.get("stream")), agent=body.get("user") or "",
            tools={"tools": body.get("tools"), "tool_choice": body.get("tool_choice")},
            body={k: v for k, v in body.items() if k != "messages"},
        )

    def error(self, status: int, message: str, *, param: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    def new_id(self) -> str:
        return f"chatcmpl-sim-{next(self._ids)}"

    def whole(self, reply: Reply, text: str) -> dict[str, Any]:
        call = reply.call
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
        return {
            "id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None, "finish_reason": reply.finish, "stop_reason": None}],
            "usage": _usage(reply),
        }

    def frames(self, reply: Reply) -> Frames:
        return _ChatFrames(reply)


def _usage(reply: Reply) -> dict[str, Any]:
    seq = reply.seq
    return {"prompt_tokens": seq.prompt_tokens, "completion_tokens": seq.generated,
            "total_tokens": seq.prompt_tokens + seq.generated,
            # as vLLM with --enable-prompt-tokens-details: the prompt's prefix-cache hits
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}


class _ChatFrames(Frames):
    """chat.completion.chunk events, `data:` lines only, ending in `data: [DONE]`."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.base = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
                     "model": reply.model}
        # Content chunks are the hot path: a prebuilt prefix and suffix around the JSON of each word.
        self.head = "data: " + json.dumps(self.base, separators=(",", ":"))[:-1] + ',"choices":[{"index":0,'
        self.tail = '},"logprobs":null,"finish_reason":null}]}\n\n'

    def _event(self, obj: dict[str, Any]) -> str:
        return "data: " + json.dumps({**self.base, **obj}, separators=(",", ":")) + "\n\n"

    def opening(self) -> str:
        call = self.reply.call
        if call is None:
            return self.head + '"delta":{"role":"assistant","content":""' + self.tail
        # OpenAI's form: the call's id and name first, then its arguments in pieces
        first = {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}
        return self.head + '"delta":' + json.dumps(first) + self.tail[1:]

    def piece(self, text: str) -> str:
        if self.reply.call is None:
            return self.head + '"delta":{"content":' + json.dumps(text) + self.tail
        piece = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        return self.head + '"delta":' + json.dumps(piece) + self.tail[1:]

    def malformed(self) -> str:
        return 'data: {"id": broken\n\n'

    def progress(self, total: int, cache: int, processed: int, time_ms: int) -> str:
        # llama-server's form (server-task.cpp, to_json_oaicompat_chat): a chunk whose delta holds only the
        # role, with `prompt_progress` beside `choices`; `processed` counts the cached tokens too.
        choice = {"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}
        return self._event({"choices": [choice], "prompt_progress": {
            "total": total, "cache": cache, "processed": processed, "time_ms": time_ms}})

    def closing(self) -> str:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.reply.finish, "stop_reason": None}
        out = [self._event({"choices": [choice]})]
        if (self.reply.prompt.body.get("stream_options") or {}).get("include_usage"):
            out.append(self._event({"choices": [], "usage": _usage(self.reply)}))
        out.append("data: [DONE]\n\n")
        return "".join(out)

    def failure(self, message: str) -> str | None:
        return None  # cut, as a vLLM process that goes away mid-answer leaves its chat clients
