"""The seam between the simulator's one server and its three HTTP APIs (chat, responses, Anthropic messages).

An API reads a request body into a `Prompt` (the conversation as chat-form messages, whatever shape it came
in), answers errors in its own shape, and frames a `Reply` as its own SSE events or whole JSON body. Everything
else (the engine sequence, faults, counters, disconnects) is the server's, in app.py, the same for all three.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from starlette.responses import JSONResponse

from cerevisor_tui.sim.scheduler import Sequence

Finish = Literal["stop", "length", "tool_calls"]
"""Why an answer ended, in chat's words; each API says it its own way (end_turn, max_tokens, incomplete...)."""


class ApiError(Exception):
    """A request the server refuses: its HTTP status, a message for the client, and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """The function call an answer makes (sim/tools.py chose it): chat's id `call_<digest>`, name, arguments."""

    id: str
    name: str
    arguments: str

    @property
    def digest(self) -> str:
        """The id without its prefix, for the ids other APIs give the same call (fc_..., toolu_...)."""
        return self.id.removeprefix("call_")


@dataclass
class Prompt:
    """A request read into the server's one form: what the engine and the text generator need."""

    messages: list[dict[str, Any]]
    """The conversation as chat messages (system first, tool calls as `tool_calls`, results as role "tool"),
    so that a turn's rendered prompt extends the previous turn's in every API and prefix reuse works."""
    model: str | None
    max_tokens: Any
    """As the request gave it (None: not given); the server checks its value."""
    stream: bool
    agent: str
    """Who asks, from the body (user, metadata.user_id); the X-Cerevisor-Agent header wins."""
    tools: dict[str, Any] = field(default_factory=dict)
    """The offered tools and tool_choice in chat's form, for tools.choose_call."""
    max_tokens_is_cap: bool = False
    """True where max_tokens is mandatory (messages): the answer ends on its own at the server's default
    length unless max_tokens cuts it shorter, rather than always running to max_tokens."""
    body: dict[str, Any] = field(default_factory=dict)
    """The request's other fields (without the conversation), for the request log and the framing."""


@dataclass
class Reply:
    """One answer under way: the engine sequence its frames and body are made from."""

    id: str
    model: str
    created: int
    seq: Sequence
    finish: Finish
    call: ToolCall | None
    prompt: Prompt


class Frames(ABC):
    """One streamed answer's SSE events, in the order the server asks for them."""

    @abstractmethod
    def opening(self) -> str:
        """The events before the first piece (sent with it: first byte and first token arrive together)."""

    @abstractmethod
    def piece(self, text: str) -> str:
        """The event of one token: a word of text, or a piece of the tool call's arguments."""

    @abstractmethod
    def malformed(self) -> str:
        """The malformed-chunk fault: an event whose JSON is broken."""

    @abstractmethod
    def closing(self) -> str:
        """The events after the last piece, with the usage."""

    @abstractmethod
    def failure(self, message: str) -> str | None:
        """The error event of an answer the server gave up mid-stream; None: cut the connection instead."""

    def progress(self, total: int, cache: int, processed: int, time_ms: int) -> str:
        """A prompt_progress event (only APIs with `Api.prompt_progress` are asked for one)."""
        raise NotImplementedError


class Api(ABC):
    """One HTTP API of the simulator: how it reads a request and writes its answers and errors."""

    name: ClassVar[str]
    path: ClassVar[str]
    prompt_progress: ClassVar[bool] = False
    """Whether a streamed request may ask for llama-server's prompt_progress (`"return_progress": true`)."""

    @abstractmethod
    def read(self, body: dict[str, Any]) -> Prompt:
        """The request as a Prompt; raises ApiError (400) when its shape is wrong."""

    @abstractmethod
    def error(self, status: int, message: str, *, param: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        """An HTTP error in this API's shape."""

    def unknown_model(self, model: str) -> str:
        return f"The model `{model}` does not exist."

    @abstractmethod
    def new_id(self) -> str:
        """The id of a new answer (chatcmpl-..., resp_..., msg_...)."""

    @abstractmethod
    def whole(self, reply: Reply, text: str) -> dict[str, Any]:
        """The body of a non-streamed answer; `text` is the answer's text (unused for a tool call)."""

    @abstractmethod
    def frames(self, reply: Reply) -> Frames:
        """The SSE events of a streamed answer."""


def sse(event: str, data: dict[str, Any]) -> str:
    """One SSE event with its name, as the responses and messages APIs send them."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def content_text(content: Any, kinds: tuple[str, ...]) -> str:
    """The text of a content field: a string, or the `text` of its parts of the given types."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") in kinds and isinstance(p.get("text"), str))
    raise ApiError(400, "content must be a string or a list of content parts")


def chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call in chat's form, as a Prompt's messages carry them."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def function_tool(name: Any, parameters: Any) -> dict[str, Any] | None:
    """An offered function in chat's form (None when it has no name)."""
    if not isinstance(name, str):
        return None
    return {"type": "function", "function": {"name": name,
                                             "parameters": parameters if isinstance(parameters, dict) else {}}}
