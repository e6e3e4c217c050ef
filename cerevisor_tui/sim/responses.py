"""`POST /v1/responses`, OpenAI's Responses API: `input` items in, a `response` object (or its events) out.

Stateless: the whole conversation comes in `input` (`previous_response_id` is refused). An answer that reaches
`max_output_tokens` ends `incomplete` (reason max_output_tokens, the stream's last event
`response.incomplete`), as OpenAI's does; one that ends on its own, or calls a tool, ends `completed`.
"""

from __future__ import annotations

import itertools
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

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "assistant", "system", "developer")


def _error_type(status: int) -> tuple[str, str | None]:
    """OpenAI's error `type` and `code` for a status."""
    if status == 429:
        return "requests", "rate_limit_exceeded"
    if status >= 500:
        return "server_error", None
    return "invalid_request_error", "model_not_found" if status == 404 else None


class ResponsesApi(Api):
    name = "responses"
    path = "/v1/responses"
    _ids = itertools.count(1)

    def read(self, body: dict[str, Any]) -> Prompt:
        if body.get("previous_response_id") is not None:
            raise ApiError(400, "previous_response_id is not supported: the simulator stores no responses, "
                           "send the whole conversation in input", "previous_response_id")
        messages: list[dict[str, Any]] = []
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
        given = body.get("input")
        if isinstance(given, str):
            messages.append({"role": "user", "content": given})
        elif isinstance(given, list) and given:
            for item in given:
                _add_item(messages, item)
        else:
            raise ApiError(400, "input must be a string or a non-empty list of items", "input")
        tools = [t for t in (_tool(x) for x in body.get("tools") or () if isinstance(x, dict)) if t]
        user = body.get("user") or body.get("safety_identifier")
        return Prompt(
            messages=messages, model=body.get("model"), max_tokens=body.get("max_output_tokens"),
            stream=bool(body.get("stream")), agent=user if isinstance(user, str) else "",
            tools={"tools": tools, "tool_choice": _tool_choice(body.get("tool_choice"))},
            body={k: v for k, v in body.items() if k != "input"},
        )

    def error(self, status: int, message: str, *, param: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        kind, code = _error_type(status)
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                            status_code=status, headers=headers)

    def new_id(self) -> str:
        return f"resp_sim{next(self._ids):020d}"

    def whole(self, reply: Reply, text: str) -> dict[str, Any]:
        return _response(reply, _status(reply), [_item(reply, text, done=True)], _usage(reply))

    def frames(self, reply: Reply) -> Frames:
        return _ResponsesFrames(reply)


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """One input item onto the chat-form conversation (a function call joins its assistant message)."""
    if not isinstance(item, dict):
        raise ApiError(400, "input items must be objects", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise ApiError(400, f"input message role must be one of {', '.join(_ROLES)}, got {role!r}", "input")
        messages.append({"role": role, "content": content_text(item.get("content"), _TEXT_PARTS)})
    elif kind == "function_call":
        call = chat_call(item.get("call_id", ""), item.get("name", ""), item.get("arguments", ""))
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                         "content": content_text(output, _TEXT_PARTS)})
    elif kind != "reasoning":  # a reasoning item carries nothing the simulated model reads
        raise ApiError(400, f"input item type {kind!r} is not supported by the simulator", "input")


def _tool(tool: dict[str, Any]) -> dict[str, Any] | None:
    if tool.get("type") != "function":
        return None  # built-in tools (web_search, file_search, ...) are not simulated
    return function_tool(tool.get("name"), tool.get("parameters"))


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        return None
    return choice


def _status(reply: Reply) -> str:
    return "incomplete" if reply.finish == "length" else "completed"


def _usage(reply: Reply) -> dict[str, Any]:
    seq = reply.seq
    return {"input_tokens": seq.prompt_tokens, "input_tokens_details": {"cached_tokens": seq.cached_tokens},
            "output_tokens": seq.generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": seq.prompt_tokens + seq.generated}


def _item_id(reply: Reply) -> str:
    if reply.call is not None:
        return f"fc_{reply.call.digest}"
    return "msg_" + reply.id.removeprefix("resp_")


def _item(reply: Reply, text: str, *, done: bool) -> dict[str, Any]:
    """The answer's output item: a message with its text, or a function call; as added or as done."""
    call = reply.call
    status = _status(reply) if done else "in_progress"
    if call is not None:
        return {"id": _item_id(reply), "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments if done else ""}
    return {"id": _item_id(reply), "type": "message", "status": status, "role": "assistant",
            "content": [_part(text)] if done else []}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _response(reply: Reply, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
    asked = reply.prompt.body
    return {
        "id": reply.id, "object": "response", "created_at": reply.created, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": asked.get("instructions"), "max_output_tokens": asked.get("max_output_tokens"),
        "max_tool_calls": None, "model": reply.model, "output": output,
        "parallel_tool_calls": asked.get("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
        "temperature": asked.get("temperature", 1.0), "text": {"format": {"type": "text"}},
        "tool_choice": asked.get("tool_choice", "auto"), "tools": asked.get("tools") or [],
        "top_p": asked.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
        "user": asked.get("user"), "metadata": asked.get("metadata") or {},
    }


class _ResponsesFrames(Frames):
    """`event:` + `data:` pairs, each data with its type and sequence number; no `[DONE]`."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.item_id = _item_id(reply)
        self.sequence_number = 0
        self.pieces: list[str] = []

    def _event(self, kind: str, **fields: Any) -> str:
        out = sse(kind, {"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return out

    def opening(self) -> str:
        reply = self.reply
        out = [self._event("response.created", response=_response(reply, "in_progress", [], None)),
               self._event("response.in_progress", response=_response(reply, "in_progress", [], None)),
               self._event("response.output_item.added", output_index=0, item=_item(reply, "", done=False))]
        if reply.call is None:
            out.append(self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                                   content_index=0, part=_part("")))
        return "".join(out)

    def piece(self, text: str) -> str:
        self.pieces.append(text)
        if self.reply.call is not None:
            return self._event("response.function_call_arguments.delta", item_id=self.item_id, output_index=0,
                               delta=text)
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def malformed(self) -> str:
        return 'event: response.output_text.delta\ndata: {"type": broken\n\n'

    def closing(self) -> str:
        reply, text = self.reply, "".join(self.pieces)
        if reply.call is not None:
            out = [self._event("response.function_call_arguments.done", item_id=self.item_id, output_index=0,
                               arguments=reply.call.arguments)]
        else:
            out = [self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                               text=text, logprobs=[]),
                   self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                               content_index=0, part=_part(text))]
        item = _item(reply, text, done=True)
        out.append(self._event("response.output_item.done", output_index=0, item=item))
        status = _status(reply)
        out.append(self._event(f"response.{status}", response=_response(reply, status, [item], _usage(reply))))
        return "".join(out)

    def failure(self, message: str) -> str:
        return self._event("error", code="server_error", message=message, param=None)
