"""What a chat-completion chunk is, and what in it is a sign of life, defined once for both of its readers: the
streaming client (endpoints/client.py) and the gateway's copy of a relayed chat stream (gateway/apis.py).

A chunk is decoded by one reused `msgspec.json.Decoder` into `Chunk`, a Struct of only the fields read; msgspec
skips the rest (id, model, logprobs...) without building them. A field of another type is refused by the decoder
(the reader decides what that means: an error that names the field, or a frame left unread). Every Struct is
`gc=False`: a chunk never takes part in a reference cycle, and untracked chunks do not push the collector into
running. The helpers below turn a decoded chunk into what both readers count: its answer's choice, the delta's
content, reasoning and tool-call text (a sign of life when any is there), its usage, llama.cpp's `timings` and
llama-server's `prompt_progress`, each believed only within endpoints/bounds.py.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cerevisor_tui.endpoints import bounds


class ToolFunction(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class ToolCall(msgspec.Struct, gc=False):
    index: int | None = None
    id: str | None = None
    function: ToolFunction | None = None


class Delta(msgspec.Struct, gc=False):
    """A choice's `delta` (in a whole `chat.completion`, its `message`)."""

    content: str | None = None
    reasoning_content: str | None = None  # vLLM's, llama.cpp's and SGLang's name
    reasoning: str | None = None  # Ollama's and OpenRouter's
    tool_calls: list[ToolCall | None] | None = None


class Choice(msgspec.Struct, gc=False):
    index: int | None = None  # 0 is the answer; a server asked for several (n, best_of) streams others beside it
    delta: Delta | None = None
    message: Delta | None = None
    finish_reason: str | None = None


class PromptDetails(msgspec.Struct, gc=False):
    cached_tokens: int | float | None = None  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int | float | None = None
    completion_tokens: int | float | None = None
    prompt_tokens_details: PromptDetails | None = None  # vLLM with --enable-prompt-tokens-details, OpenAI


class Timings(msgspec.Struct, gc=False):
    """llama.cpp's per-request `timings`, in its last chunk: the latency panel's figures for that server, and the
    prompt's tokens (computed and from its cache) where no usage is said."""

    prompt_n: int | float | None = None
    cache_n: int | float | None = None
    prompt_ms: float | None = None
    predicted_per_token_ms: float | None = None


class PromptProgress(msgspec.Struct, gc=False):
    """llama-server's `prompt_progress` (asked with `"return_progress": true`): prompt tokens in all, from its
    cache, processed so far (the cached ones included), and the milliseconds its prefill has taken."""

    total: int | float = 0
    cache: int | float = 0
    processed: int | float = 0
    time_ms: int | float = 0


class Chunk(msgspec.Struct, gc=False):
    """What is read of one `chat.completion.chunk` (or of a whole `chat.completion`); other fields are skipped.
    Every field may be absent or null."""

    choices: list[Choice] | None = None
    usage: Usage | None = None
    timings: Timings | None = None  # llama.cpp
    prompt_progress: PromptProgress | None = None  # llama-server's, beside a role-only delta
    error: Any = msgspec.UNSET  # there at all, even null: the server says the stream failed
    # Not read: "object". vLLM's older mid-stream error is {"object": "error", "message": ...} without choices:
    # `says_error` looks for it; decoding "chat.completion.chunk" into a string for every chunk would cost the hot
    # path for nothing.


decode_chunk = msgspec.json.Decoder(Chunk).decode
"""One event's data as a `Chunk`; raises msgspec.DecodeError (ValidationError among them) or RecursionError."""

UNSET = msgspec.UNSET


def says_error(chunk: Chunk, payload: bytes) -> bool:
    """Whether the chunk is a server's error rather than part of an answer: an `error` field (even null), or no
    choices and "error" in its text (vLLM's older `{"object": "error", ...}`)."""
    return chunk.error is not UNSET or (not chunk.choices and b'"error"' in payload)


def answer_choice(choices: list[Choice]) -> Choice | None:
    """The chunk's choice of index 0 (or of none given): the answer. Another choice's pieces are never joined into
    it, whatever the request asked for."""
    for choice in choices:
        if not choice.index:
            return choice
    return None


def signs(delta: Delta) -> tuple[str, str, str]:
    """A delta's content, reasoning and tool-call text: a sign of life when any is not empty. A tool call is one
    even when its piece carries no text (its text is then a space)."""
    return (delta.content or "", delta.reasoning_content or delta.reasoning or "",
            tool_text(delta.tool_calls) if delta.tool_calls else "")


def has_text(delta: Delta) -> bool:
    return bool(delta.content or delta.reasoning_content or delta.reasoning or delta.tool_calls)


def tool_text(tool_calls: list[ToolCall | None]) -> str:
    """The text of a delta's tool calls (names and argument pieces); a space when they carry none, as a tool call
    is a sign of life all the same."""
    parts = []
    for call in tool_calls:
        fn = call.function if call is not None else None
        if fn is not None:
            parts.append((fn.name or "") + (fn.arguments or ""))
    return "".join(parts) or " "


def tool_pieces(tool_calls: list[ToolCall | None]) -> tuple[tuple[int, str | None, str | None, str | None], ...]:
    """A delta's tool calls as (index, id, name, arguments piece): a call's later pieces carry only its index
    (OpenAI's streaming form); a whole message's calls carry no index and are numbered in order."""
    pieces = []
    for i, call in enumerate(tool_calls):
        fn = call.function if call is not None else None
        if call is None or not (call.id or (fn and (fn.name or fn.arguments))):
            continue  # a piece that carries nothing opens no call
        pieces.append((call.index if call.index is not None else i, call.id, fn.name if fn else None,
                       fn.arguments if fn else None))
    return tuple(pieces)


def usage_of(usage: Usage) -> tuple[int, int, int | None] | None:
    """(prompt tokens, completion tokens, cached prompt tokens or None where not said); None when the usage
    carries no counts (an empty object is no usage report)."""
    if usage.prompt_tokens is None and usage.completion_tokens is None:
        return None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    return int(usage.prompt_tokens or 0), int(usage.completion_tokens or 0), None if cached is None else int(cached)


def timings_of(timings: Timings) -> tuple[float | None, float | None] | None:
    """llama.cpp's (prompt_ms, predicted_per_token_ms), each None where absent or not believable; None when
    neither is there."""
    prompt_ms = bounds.metric(timings.prompt_ms) if timings.prompt_ms is not None else None
    per_token_ms = (bounds.metric(timings.predicted_per_token_ms)
                    if timings.predicted_per_token_ms is not None else None)
    return None if prompt_ms is None and per_token_ms is None else (prompt_ms, per_token_ms)


def timings_prompt_tokens(timings: Timings) -> int | None:
    """The prompt's tokens as llama.cpp's timings count them (computed and from the cache); None where not said
    or not believable."""
    computed = bounds.metric(timings.prompt_n) if timings.prompt_n is not None else None
    cached = bounds.metric(timings.cache_n) if timings.cache_n is not None else 0.0
    if computed is None or cached is None or computed + cached > bounds.MAX_PROMPT_TOKENS:
        return None
    return int(computed + cached)


def progress_of(progress: PromptProgress) -> tuple[int, int, int, int] | None:
    """llama-server's prompt_progress as (total, cache, processed, time_ms): a sign of life of the prefill, not a
    token; None when its numbers cannot be true."""
    return bounds.prompt_progress(progress.total, progress.cache, progress.processed, progress.time_ms)
