"""What the gateway knows of the three APIs it passes through: OpenAI's chat completions and responses, and
Anthropic's messages. Nothing is translated between them: this module reads a copy of what goes by (the
request's conversation, each streamed frame's signs of life, tokens and usage) and writes the few things the
gateway says itself, each in the API's own shape (an error body, a mid-stream error event).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import msgspec

from cerevisor_tui.contract.events import Role
from cerevisor_tui.endpoints import chunks
from cerevisor_tui.endpoints.chunks import Chunk, Timings

Api = Literal["chat", "responses", "messages"]
PATHS: dict[str, Api] = {"/chat/completions": "chat", "/responses": "responses", "/messages": "messages"}
"""The governed paths, under /v1, and the API each speaks."""

KEEPALIVE = b": keep-alive\n\n"
"""An SSE comment: every SSE client skips it (the openai and anthropic SDKs included), and it keeps the
connection, and the harness's own read timer, alive while a request waits."""

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_api_key", 404: "model_not_found",
                 413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable",
                 504: "timeout"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
_json = msgspec.json.Encoder()
MAX_DEPTH = 64
"""The deepest nesting of lists and objects a request body may have: a real one (tool schemas included) nests a
dozen deep; a deeper one is a 400, never a recursion through the run's scrubber, journal and transcript."""


def error_body(api: Api | None, status: int, message: str) -> bytes:
    """An error the gateway answers itself, as the API's own error body (what the client's SDK parses); `api`
    None: a path the gateway does not serve, in OpenAI's shape, as OpenAI answers an unknown URL."""
    if api is None:
        return _json.encode({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}})
    if api == "messages":
        return _json.encode({"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                                        "message": message}})
    return _json.encode({"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                                   "param": None, "code": _OPENAI_TYPES.get(status, "server_error")}})


def error_frame(api: Api, status: int, message: str) -> bytes:
    """An error after the response's headers went out (keep-alives, or part of the answer): the API's own
    error event, which its SDKs raise as an error."""
    if api == "messages":
        return b"event: error\ndata: " + error_body(api, status, message) + b"\n\n"
    if api == "responses":
        return b"event: error\ndata: " + _json.encode(
            {"type": "error", "code": _OPENAI_TYPES.get(status, "server_error"), "message": message, "param": None,
             "sequence_number": 0}) + b"\n\n"
    return b"data: " + error_body(api, status, message) + b"\n\n"


# ---- the request: its conversation -------------------------------------------------------------------------
def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text of its blocks (text, input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text", ""), str))
    return ""


def depth_over(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` (decoded JSON) nests lists and objects deeper than `limit`; walked without recursion."""
    # plain loops and a tuple for isinstance: a comprehension testing `dict | list` took 86 us on a 560 KB body, these 19
    containers = (dict, list)
    level: list[Any] = [value] if isinstance(value, containers) else []
    for _ in range(limit + 1):
        below: list[Any] = []
        for item in level:
            for child in item.values() if isinstance(item, dict) else item:
                if isinstance(child, containers):
                    below.append(child)
        level = below
        if not level:
            return False
    return True


def request_problem(api: Api, body: dict[str, Any]) -> str | None:
    """What makes `body` no request of `api`'s shape, in a line for the client (a 400), or None. Only what the
    gateway itself reads is checked: the upstream judges the rest."""
    if depth_over(body):
        return f"the request body nests deeper than {MAX_DEPTH} levels"
    field = "input" if api == "responses" else "messages"
    items = body.get(field)
    if api == "responses" and isinstance(items, str):
        return None
    if items is not None and not isinstance(items, list):
        return f"`{field}` must be a list"
    for i, item in enumerate(items or ()):
        if not isinstance(item, dict):
            return f"`{field}[{i}]` must be an object"
    return None


def conversation(api: Api, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The request's system prompt and its messages (as the client sent them), whatever the API."""
    if api == "messages":
        system = body.get("system")
        messages = body.get("messages")
        return text_of(system), [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    if api == "responses":
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        items = [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
        system = body.get("instructions")
        return system if isinstance(system, str) else "", items
    messages = body.get("messages")
    messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    system = "".join(text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    return system, [m for m in messages if m.get("role") not in ("system", "developer")]


def prompt_chars(api: Api, body: dict[str, Any]) -> int:
    """The characters of the request's prompt (system prompt and messages' text), as the run counts a prompt's
    size: tokens per character, and a prefill's estimate."""
    system, messages = conversation(api, body)
    return len(system) + sum(len(text_of(m.get("content", m.get("output", "")))) for m in messages)


def history(api: Api, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as the client sent it, system prompt first, for its transcript: chat's messages as they
    are; Anthropic's `system` and Responses' `instructions` (fields, not messages there) as a first message."""
    if api == "chat":
        messages = body.get("messages")
        return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    system, messages = conversation(api, body)
    field = "instructions" if api == "responses" else "system"
    raw = body.get(field)
    return ([{"role": "system", "content": raw}] if raw else []) + messages


FINGERPRINT_CHARS = 4096
"""A first user message longer than this is fingerprinted by its first this many characters and its length: it is
the same every turn of a conversation, and hashing it whole cost each request of a harness that pastes a file into
it the whole file; a shorter one is hashed whole (a session's name stays as earlier runs of it named it)."""


def fingerprint(model: str, system: str, messages: list[dict[str, Any]]) -> str:
    """What every turn of one conversation shares: its model, system prompt and first user message."""
    first = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    if len(first) > FINGERPRINT_CHARS:
        first = f"{first[:FINGERPRINT_CHARS]}\0{len(first)}"
    return hashlib.sha256(f"{model}\0{system}\0{first}".encode()).hexdigest()[:10]


MAX_RECORDED_CHARS = 64 * 1024
"""A session's message is recorded (told to the run: its journal, transcript and every console) up to this many
characters, a note saying how many more it had: a client may send 32 MiB in one request (an agent's turn 43 sends
~560 KB), and neither the run's disk nor a console's socket is its to fill (256 sessions' turns at once told whole
would pass what a console may fall behind, supervisor/server.py CLIENT_BUFFER_MAX)."""


def recorded(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A message a session's client sent, as the run records it: its text and its client form, each at most
    MAX_RECORDED_CHARS (a form cut short is its role, its cut text and `cut`)."""
    text = text_of(message.get("content", message.get("output", "")))
    if len(text) > MAX_RECORDED_CHARS:
        text = f"{text[:MAX_RECORDED_CHARS]}\n[cerevisor: {len(text) - MAX_RECORDED_CHARS:,} more characters not recorded]"
    elif len(msgspec.json.encode(message)) <= 2 * MAX_RECORDED_CHARS:
        return text, message
    return text, {"role": role_of(message), "content": text, "cut": True}


def role_of(message: dict[str, Any]) -> Role:
    """Who said a message, in the journal's words (its transcript keeps the message as the client sent it)."""
    role = message.get("role")
    if isinstance(role, str) and role in ROLES:
        return cast(Role, role)
    if role == "function":  # the chat API's older name for a tool's result
        return "tool"
    kind = message.get("type")  # responses' items without a role: function_call, function_call_output, ...
    if isinstance(kind, str) and kind.endswith("_output"):
        return "tool"
    if kind in ("function_call", "custom_tool_call", "reasoning"):
        return "assistant"
    return "user"


ROLES: frozenset[str] = frozenset(get_args(Role))


def answered(messages: list[dict[str, Any]]) -> int:
    """How many of a conversation's messages come before what is new in it: up to its last answer (what a
    transcript of an earlier run of the session already holds)."""
    return next((i + 1 for i in range(len(messages) - 1, -1, -1) if role_of(messages[i]) == "assistant"), 0)


# ---- what comes back: a decoded copy ---------------------------------------------------------------------
class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    # chat's names, responses' names, messages' names: whichever the frame has
    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens_details: _Details | None = None
    input_tokens_details: _Details | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class _Delta(msgspec.Struct):
    """messages' content_block_delta and message_delta (chat's deltas are endpoints/chunks.py's)."""

    type: str = ""
    text: str | None = None
    thinking: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None


class _Message(msgspec.Struct):
    usage: _Usage | None = None
    stop_reason: str | None = None


class _Response(msgspec.Struct):
    usage: _Usage | None = None
    status: str | None = None
    output: list[Any] = []
    error: Any = None


class _Frame(msgspec.Struct):
    """The fields of a responses or messages event that the gateway reads, for both at once (the rest is skipped);
    a chat chunk is read as the streaming client reads it (endpoints/chunks.py)."""

    type: str = ""
    usage: _Usage | None = None
    error: Any = None
    delta: _Delta | str | None = None  # a _Delta in chat/messages, a string in responses' *.delta events
    message: _Message | str | None = None  # messages' message_start; responses' flat error event's text
    response: _Response | None = None  # responses' response.completed / response.failed
    timings: Timings | None = None  # llama.cpp's, in its last chunk


_frame = msgspec.json.Decoder(_Frame)


@dataclass
class Reading:
    """What the gateway reads of one request's answer as it goes by."""

    api: Api
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    chunks: int = 0  # frames that carried content, reasoning or a tool call: one token each as servers stream
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    finish: str = ""
    items: int = 0  # responses: the answer's output items, each of which the client sends back in its next input
    error: str = ""  # an error the upstream said in its stream
    unreadable: int = 0  # frames that were not JSON of the API's shape
    timings: tuple[float | None, float | None] | None = None  # llama.cpp's (prompt_ms, predicted_per_token_ms)
    timings_prompt_tokens: int = 0  # llama.cpp's prompt tokens (computed + cached), from its timings

    def usage(self, usage: _Usage | None) -> None:
        if usage is None:
            return
        self.prompt_tokens = usage.prompt_tokens or usage.input_tokens or self.prompt_tokens
        self.completion_tokens = usage.completion_tokens or usage.output_tokens or self.completion_tokens
        details = usage.prompt_tokens_details or usage.input_tokens_details
        cached = details.cached_tokens if details is not None else usage.cache_read_input_tokens
        if cached is not None:
            self.cached_tokens = cached
        if self.api == "messages":  # Anthropic counts the prompt's cache reads and writes apart from input_tokens
            whole = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
            if whole:  # (message_delta may say its output alone)
                self.prompt_tokens = whole

    def frames(self, data: bytes) -> tuple[str, str, str, int]:
        """Read the complete SSE frames in `data`; returns what they added (content, reasoning, tool-call text,
        chunks that carried any)."""
        text, reasoning, tools, signs = [], [], [], 0
        chat = self.api == "chat"
        decode: Callable[[bytes], Any] = chunks.decode_chunk if chat else _frame.decode  # (read takes its type)
        read = self._chunk if chat else self._frame
        for line in data.split(b"\n"):  # (a \r left at a line's end is JSON's whitespace)
            if line[:5] != b"data:":
                continue
            try:
                frame = decode(line[5:])
            except (msgspec.DecodeError, RecursionError):  # (ValidationError is a DecodeError)
                payload = line[5:].strip()
                if payload and payload != b"[DONE]":
                    self.unreadable += 1  # (nested past msgspec's depth: not a frame of any API)
                continue
            t, r, k = read(frame)
            if t or r or k:
                signs += 1
                if t:
                    text.append(t)
                if r:
                    reasoning.append(r)
                if k:
                    tools.append(k)
        got = "".join(text), "".join(reasoning), "".join(tools)
        if got[0]:
            self.text.append(got[0])
        if got[1]:
            self.reasoning.append(got[1])
        if got[2]:
            self.tools.append(got[2])
        self.chunks += signs
        return (*got, signs)

    def _chunk(self, c: Chunk) -> tuple[str, str, str]:
        """A chat chunk: its signs of life, by the streaming client's rules (endpoints/chunks.py)."""
        if c.timings is not None:
            self._timings(c.timings)
        if c.error is not chunks.UNSET and c.error is not None:
            self.error = _error_text(c.error)
        if c.usage is not None and (usage := chunks.usage_of(c.usage)) is not None:
            self.prompt_tokens = usage[0] or self.prompt_tokens
            self.completion_tokens = usage[1] or self.completion_tokens
            if usage[2] is not None:
                self.cached_tokens = usage[2]
        # choice 0 only: the others (n > 1) go to the client as they came, and are not the session's answer
        choice = chunks.answer_choice(c.choices) if c.choices else None
        if choice is None:
            return "", "", ""
        if choice.finish_reason:
            self.finish = choice.finish_reason
        return chunks.signs(choice.delta) if choice.delta is not None else ("", "", "")

    def _frame(self, f: _Frame) -> tuple[str, str, str]:
        if f.timings is not None:
            self._timings(f.timings)
        if f.error is not None:
            self.error = _error_text(f.error)
        elif f.type == "error" and isinstance(f.message, str):  # responses' flat error event
            self.error = f.message[:500]
        if self.api == "messages":
            if f.type == "message_start" and isinstance(f.message, _Message):
                self.usage(f.message.usage)
            elif f.type == "message_delta":
                self.usage(f.usage)
                if isinstance(f.delta, _Delta) and f.delta.stop_reason:
                    self.finish = f.delta.stop_reason
            elif f.type == "content_block_delta" and isinstance(f.delta, _Delta):
                d = f.delta
                return d.text or "", d.thinking or "", d.partial_json or ""
            return "", "", ""
        # responses: typed events
        kind = f.type
        if kind.endswith(".delta") and isinstance(f.delta, str):
            if kind == "response.output_text.delta":
                return f.delta, "", ""
            if kind.startswith("response.reasoning"):
                return "", f.delta, ""
            if kind.startswith("response.function_call_arguments") or kind.startswith("response.custom_tool_call"):
                return "", "", f.delta
            return "", "", ""
        if f.response is not None and kind in ("response.completed", "response.incomplete", "response.failed"):
            self.usage(f.response.usage)
            self.items = len(f.response.output)
            self.finish = f.response.status or kind.rpartition(".")[2]
            if f.response.error:
                self.error = _error_text(f.response.error)
        return "", "", ""

    def _timings(self, t: Timings) -> None:
        self.timings = chunks.timings_of(t) or self.timings
        prompt_tokens = chunks.timings_prompt_tokens(t)
        if prompt_tokens is not None:
            self.timings_prompt_tokens = prompt_tokens

    def whole(self, data: bytes) -> None:
        """Read a response that was not streamed: its text and usage. What is not of the API's shape is left
        unread (the client gets it as it came)."""
        try:
            body = msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError):
            self.unreadable += 1
            return
        if not isinstance(body, dict) or depth_over(body):
            self.unreadable += 1
            return
        # (to each Struct type, None aside: msgspec learns a union anew at every call, ~20 times the cost)
        usage, timings = body.get("usage"), body.get("timings")
        try:
            self.usage(None if usage is None else msgspec.convert(usage, _Usage))
            timings = None if timings is None else msgspec.convert(timings, Timings)
        except msgspec.ValidationError:
            timings = None
        if timings is not None:
            self._timings(timings)
        if self.api == "chat":
            choices = body.get("choices")
            choice = next((c for c in choices if isinstance(c, dict) and not c.get("index")), {}) \
                if isinstance(choices, list) else {}
            message = choice.get("message")
            message = message if isinstance(message, dict) else {}
            self.text.append(text_of(message.get("content")))
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            self.reasoning.append(reasoning if isinstance(reasoning, str) else "")
            finish = choice.get("finish_reason")
            self.finish = finish if isinstance(finish, str) else ""
        elif self.api == "messages":
            content = body.get("content")
            for block in content if isinstance(content, list) else ():
                if isinstance(block, dict):
                    if block.get("type") == "text":
                        self.text.append(str(block.get("text", "")))
                    elif block.get("type") == "thinking":
                        self.reasoning.append(str(block.get("thinking", "")))
                    elif block.get("type") == "tool_use":
                        self.tools.append(f"{block.get('name', '')}{_json.encode(block.get('input', {})).decode()}")
            self.finish = str(body.get("stop_reason") or "")
        else:
            output = body.get("output")
            output = output if isinstance(output, list) else []
            self.items = len(output)
            for item in output:
                if not isinstance(item, dict):
                    continue
                if item.get("type") == "message":
                    self.text.append(text_of(item.get("content")))
                elif item.get("type") == "reasoning":
                    self.reasoning.append(text_of(item.get("summary")) or text_of(item.get("content")))
                elif item.get("type") == "function_call":
                    self.tools.append(f"{item.get('name', '')}{item.get('arguments', '')}")
            self.finish = str(body.get("status") or "")
        self.chunks = self.completion_tokens or sum(map(len, self.text)) // 4

    @property
    def answer(self) -> str:
        return "".join(self.text)


def _error_text(error: Any) -> str:
    """An upstream error's message, as a line (a deeply nested error is said to be one, not walked)."""
    if depth_over(error, 8):
        return "(an error nested too deep to read)"
    if isinstance(error, dict):
        nested = error.get("error")
        inner = nested if isinstance(nested, dict) else error
        return str(inner.get("message") or inner.get("type") or error)[:500]
    return str(error)[:500]


def sent_body(raw: bytes, body: dict[str, Any], changes: dict[str, Any]) -> bytes:
    """The request's bytes as sent upstream: as the client sent them, with `changes` made (the model mapped,
    usage or progress asked for the gateway's meters). A field the body lacks is added after its last one, the rest
    of its bytes untouched (a late turn's ~560 KB is not encoded again for it); changing a field it has encodes the
    whole body anew."""
    if not changes:
        return raw
    end = raw.rstrip(b" \t\r\n")
    if any(name in body for name in changes) or not end.endswith(b"}"):
        return _json.encode({**body, **changes})
    return b"".join((memoryview(end)[:-1], b"," if body else b"", _json.encode(changes)[1:]))  # one copy
