"""`POST /v1/messages`, Anthropic's Messages API: messages of content blocks in, a message (or its events) out.

`max_tokens` is required, as Anthropic's is, and is a ceiling: the answer ends on its own (`end_turn`) at the
server's default length, or at `max_tokens` (`max_tokens`) when that is shorter. Usage is Anthropic's:
`input_tokens` are the prompt tokens not read from the prefix cache, `cache_read_input_tokens` those that were.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from starlette.responses import JSONResponse

from cerevisor_tui.sim.api import (
    Api,
    ApiError,
    Frames,
    Prompt,
    Reply,
    chat_call,
    content_text,
    function_tool,
    sse,
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesApi(Api):
    name = "messages"
    path = "/v1/messages"
    _ids = itertools.count(1)

    def read(self, body: dict[str, Any]) -> Prompt:
        if "max_tokens" not in body:
            raise ApiError(400, "max_tokens: Field required", "max_tokens")
        given = body.get("messages")
        if not isinstance(given, list) or not given or not all(isinstance(m, dict) for m in given):
            raise ApiError(400, "messages: must be a non-empty list of objects", "messages")
        messages: list[dict[str, Any]] = []
        system = body.get("system")
        if system is not None:
            if not isinstance(system, str | list):
                raise ApiError(400, "system: must be a string or a list of text blocks", "system")
            if text := content_text(system, ("text",)):
                messages.append({"role": "system", "content": text})
        for m in given:
            _add_message(messages, m)
        tools = [t for t in (_tool(x) for x in body.get("tools") or () if isinstance(x, dict)) if t]
        user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
        return Prompt(
            messages=messages, model=body.get("model"), max_tokens=body.get("max_tokens"),
            stream=bool(body.get("stream")), agent=user if isinstance(user, str) else "",
            tools={"tools": tools, "tool_choice": _tool_choice(body.get("tool_choice"))},
            max_tokens_is_cap=True, body={k: v for k, v in body.items() if k != "messages"},
        )

    def error(self, status: int, message: str, *, param: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message), status_code=status, headers=headers)

    def unknown_model(self, model: str) -> str:
        return f"model: {model}"

    def new_id(self) -> str:
        return f"msg_sim{next(self._ids):020d}"

    def whole(self, reply: Reply, text: str) -> dict[str, Any]:
        return _message(reply, [_block(reply, text, done=True)], _usage(reply))

    def frames(self, reply: Reply) -> Frames:
        return _MessagesFrames(reply)


def _add_message(messages: list[dict[str, Any]], m: dict[str, Any]) -> None:
    """One Anthropic message onto the chat-form conversation: tool_use blocks become the assistant's
    tool_calls, tool_result blocks tool messages (before the user's text, where Anthropic puts them)."""
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant", "system"):  # Claude Code 2.1 sends its reminders as system messages
        raise ApiError(400, f"messages: role must be 'user', 'assistant' or 'system', got {role!r}", "messages")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ApiError(400, "messages: content must be a string or a list of content blocks", "messages")
    text = content_text(content, ("text",))
    calls = [chat_call(b.get("id", ""), b.get("name", ""), json.dumps(b.get("input", {}), ensure_ascii=False))
             for b in content if b.get("type") == "tool_use"]
    for b in content:
        if b.get("type") == "tool_result":
            messages.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                             "content": content_text(b.get("content"), ("text",))})
    if role == "assistant":
        messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    elif role == "system":
        messages.append({"role": "system", "content": text})
    elif text or not any(b.get("type") == "tool_result" for b in content):
        messages.append({"role": "user", "content": text})


def _tool(tool: dict[str, Any]) -> dict[str, Any] | None:
    if tool.get("type") not in (None, "custom"):
        return None  # server tools (web_search, bash, ...) are not simulated
    return function_tool(tool.get("name"), tool.get("input_schema"))


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None


def _usage(reply: Reply, output_tokens: int | None = None) -> dict[str, Any]:
    seq = reply.seq
    return {"input_tokens": seq.prompt_tokens - seq.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": seq.cached_tokens,
            "output_tokens": seq.generated if output_tokens is None else output_tokens}


def _tool_use_id(reply: Reply) -> str:
    assert reply.call is not None
    return f"toolu_{reply.call.digest}"


def _block(reply: Reply, text: str, *, done: bool) -> dict[str, Any]:
    """The answer's content block: its text, or the tool call; as started or as done."""
    call = reply.call
    if call is None:
        return {"type": "text", "text": text if done else ""}
    return {"type": "tool_use", "id": _tool_use_id(reply), "name": call.name,
            "input": json.loads(call.arguments) if done else {}}


def _message(reply: Reply, content: list[dict[str, Any]], usage: dict[str, Any], *,
             done: bool = True) -> dict[str, Any]:
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": _STOP_REASONS[reply.finish] if done else None, "stop_sequence": None, "usage": usage}


class _MessagesFrames(Frames):
    """`event:` + `data:` pairs: message_start, one content block, message_delta, message_stop."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    def opening(self) -> str:
        reply = self.reply
        return (sse("message_start", {"type": "message_start",
                                      "message": _message(reply, [], _usage(reply, 0), done=False)})
                + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": _block(reply, "", done=False)})
                + sse("ping", {"type": "ping"}))

    def piece(self, text: str) -> str:
        if self.reply.call is None:
            delta = {"type": "text_delta", "text": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        return sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})

    def malformed(self) -> str:
        return 'event: content_block_delta\ndata: {"type": broken\n\n'

    def closing(self) -> str:
        reply = self.reply
        return (sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                + sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": _STOP_REASONS[reply.finish], "stop_sequence": None},
                                        "usage": _usage(reply)})
                + sse("message_stop", {"type": "message_stop"}))

    def failure(self, message: str) -> str:
        return sse("error", error_body(503, message))
