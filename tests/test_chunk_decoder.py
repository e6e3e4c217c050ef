"""The chunk decoder: what the typed msgspec decoding of `chat.completion.chunk` events yields for the shapes
servers send (null fields, extra fields, NaN), and that a chunk of the wrong shape is a clear per-agent error."""

from __future__ import annotations

import json
import types

import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.endpoints import chunks, client
from cerevisor_tui.endpoints.client import (
    DELTA,
    FINISH,
    KEEPALIVE,
    PROGRESS,
    TIMINGS,
    TOOL_CALLS,
    USAGE,
    ChatStream,
)
from cerevisor_tui.endpoints.errors import EndpointHTTPError, ProtocolError
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.gateway import apis
from tests.conftest import RawServer, chunk, http_head

VLLM_ID = {"id": "chatcmpl-b3c9", "object": "chat.completion.chunk", "created": 1767225600, "model": "m"}


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def vllm(delta: dict | None = None, finish: str | None = None, **extra: object) -> bytes:
    """A chunk with every field vLLM sends, logprobs and null finish_reason included."""
    return event({**VLLM_ID, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                  **extra})


class _Response:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def aiter_bytes(self):
        for read in self.reads:
            yield read


def stream() -> ChatStream:
    return ChatStream(types.SimpleNamespace(headers={"Authorization": "Bearer sk-secret-key"}), "e", "u", {})


async def read_all(*reads: bytes) -> tuple[list, ChatStream, Exception | None]:
    """What `_sse` yields for these network reads, the stream, and the error it ended with (if any)."""
    s, items = stream(), []
    try:
        async for item in s._sse(_Response(list(reads))):
            items.append(item)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return items, s, exc
    return items, s, None


@pytest.mark.anyio
async def test_a_vllm_stream_with_reasoning_tool_calls_finish_and_usage():
    items, s, error = await read_all(
        vllm({"role": "assistant", "content": ""})
        + vllm({"reasoning_content": "think"}) + vllm({"reasoning_content": " more"})
        + vllm({"content": "Hello"}) + vllm({"content": " world"})
        + vllm({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "search", "arguments": ""}}]})
        + vllm({"tool_calls": [{"index": 0, "function": {"arguments": '{"q": 1}'}}]})
        + vllm({"content": "!"}, "stop")
        + event({**VLLM_ID, "choices": [], "usage": {"prompt_tokens": 7, "total_tokens": 15, "completion_tokens": 8,
                                                     "prompt_tokens_details": None}})
        + b"data: [DONE]\n\n")
    assert error is None
    assert items == [
        (KEEPALIVE, None),
        (DELTA, ("", "think more", "", 2)),
        (DELTA, ("Hello world", "", "", 2)),
        (DELTA, ("", "", "search", 1)),
        (TOOL_CALLS, ((0, "call_1", "search", ""),)),  # the pieces the agent loop puts each call together from
        (DELTA, ("", "", '{"q": 1}', 1)),
        (TOOL_CALLS, ((0, None, None, '{"q": 1}'),)),
        (DELTA, ("!", "", "", 1)),
        (FINISH, "stop"),
        (USAGE, (7, 8)),
    ]
    assert (s.tokens, s.finish_reason, s.usage, s._done) == (7, "stop", (7, 8), True)


@pytest.mark.anyio
async def test_fields_servers_send_as_null_and_fields_we_do_not_read():
    items, s, error = await read_all(
        event({"choices": None, "usage": None}),
        event({"choices": [{"delta": None, "finish_reason": None}], "usage": None}),
        event({"choices": [{"delta": {"content": None, "reasoning_content": None, "reasoning": None,
                                      "tool_calls": None}}]}),
        event({"choices": [{"delta": {"tool_calls": [None, {"function": None}]}}]}),  # a sign of life all the same
        event({"choices": [{"delta": {"reasoning": "r", "content": None}}]}),  # Ollama's and OpenRouter's field
        # OpenAI sends "usage": null on every chunk; servers add fields of their own anywhere
        event({"choices": [{"delta": {"content": "a", "role": "assistant", "refusal": None, "annotations": [{}]},
                            "stop_reason": None, "matched_stop": [1, {"x": None}]}],
               "usage": None, "system_fingerprint": "fp", "service_tier": {"nested": [1.5, True]}}),
        event({"choices": [{"delta": {}, "finish_reason": "length"}]}),
        event({"choices": [], "usage": {}}),  # no counts: not a usage report
        event({"choices": [], "usage": {"prompt_tokens": 3.0, "completion_tokens": 4}}),
        b"data: [DONE]\n\n")
    assert error is None
    assert items == [(KEEPALIVE, None)] * 3 + [
        (DELTA, ("", "", " ", 1)), (DELTA, ("", "r", "", 1)), (DELTA, ("a", "", "", 1)),
        (FINISH, "length"), (KEEPALIVE, None), (USAGE, (3, 4))]
    assert s.usage == (3, 4)


@pytest.mark.anyio
async def test_nan_and_infinity_which_python_servers_write_are_read():
    """msgspec refuses NaN and Infinity; json.loads takes them, as the client always has."""
    chunk_with_inf = (b'data: {"choices": [{"delta": {"content": "x"}, "logprobs": {"content": '
                      b'[{"token": "x", "logprob": -Infinity}, {"logprob": NaN}]}}]}\n\n')
    items, _, error = await read_all(chunk_with_inf, vllm({}, "stop") + b"data: [DONE]\n\n")
    assert error is None
    assert items == [(DELTA, ("x", "", "", 1)), (FINISH, "stop")]


@pytest.mark.anyio
async def test_events_split_across_reads_and_multi_line_data():
    whole = vllm({"content": "ab"}) + b"data: {\"choices\": [{\"delta\":\ndata: {\"content\": \"c\"}}]}\n\n" + vllm({}, "stop")
    reads = [whole[i:i + 7] for i in range(0, len(whole), 7)] + [b"data: [DONE]\n\n"]
    items, s, error = await read_all(*reads)
    assert error is None
    assert [item for item in items if item[0] == DELTA] == [(DELTA, ("ab", "", "", 1)), (DELTA, ("c", "", "", 1))]
    assert s.finish_reason == "stop"


WRONG_SHAPES = {
    "content a number": ({"choices": [{"delta": {"content": 5}}]}, "$.choices[0].delta.content"),
    "reasoning an object": ({"choices": [{"delta": {"reasoning": {"text": "r"}}}]}, "$.choices[0].delta.reasoning"),
    "choices a string": ({"choices": "x"}, "$.choices"),
    "a null choice": ({"choices": [None]}, "$.choices[0]"),
    "tool arguments an object": (
        {"choices": [{"delta": {"tool_calls": [{"function": {"name": "f", "arguments": {"q": 1}}}]}}]},
        "$.choices[0].delta.tool_calls[0].function.arguments"),
    "usage as text": ({"choices": [], "usage": {"prompt_tokens": "3"}}, "$.usage.prompt_tokens"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("shape", list(WRONG_SHAPES))
async def test_a_chunk_of_the_wrong_shape_is_a_protocol_error_that_names_the_field(shape):
    obj, where = WRONG_SHAPES[shape]
    items, _, error = await read_all(vllm({"content": "one "}) + event({**obj, "key": "sk-secret-key"}))
    assert items == [(DELTA, ("one ", "", "", 1))]  # what came before it is the partial answer
    assert isinstance(error, ProtocolError), repr(error)
    assert "unexpected chunk in stream after 1 tokens" in error.problem and where in error.problem, error.problem
    assert "sk-secret-key" not in error.problem


@pytest.mark.anyio
async def test_error_events_are_server_errors_with_the_server_words():
    for raw in (b'data: {"error": {"message": "engine dead", "code": 500}}\n\n',
                b'data: {"object": "error", "message": "engine dead", "code": 400}\n\n',
                b'event: error\ndata: {"message": "engine dead"}\n\n'):
        items, _, error = await read_all(vllm({"content": "one "}) + raw)
        assert items == [(DELTA, ("one ", "", "", 1))]
        assert isinstance(error, EndpointHTTPError) and "engine dead" in error.problem, (raw, error)
    _, _, error = await read_all(b"data: [1, 2]\n\n")
    assert isinstance(error, ProtocolError) and "not a JSON object" in error.problem


def test_a_whole_chat_completion_reads_its_message():
    s = stream()
    whole = json.dumps({"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": "hm"},
         "finish_reason": "stop"}], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()
    assert s._items(s._read(whole, False)) == [(DELTA, ("hi", "hm", "", 1)), (FINISH, "stop"), (USAGE, (2, 3))]


def test_ordinary_chunks_take_the_typed_decoder_alone(monkeypatch):
    """The speed of the client rests on this: a chunk as vLLM, llama.cpp or OpenAI send it is decoded once by
    msgspec, never by the json.loads fallback (about 5 times slower)."""
    def no_json(*args, **kwargs):
        raise AssertionError("a common chunk went to json.loads")

    monkeypatch.setattr(client.json, "loads", no_json)
    s = stream()
    for raw in (vllm({"role": "assistant", "content": ""}), vllm({"content": " fox"}), vllm({"reasoning_content": "r"}),
                vllm({}, "stop"), event({**VLLM_ID, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}),
                event({**VLLM_ID, "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
                       "usage": None, "system_fingerprint": None})):
        chunk_read = s._read(client._data_value(raw.rstrip(b"\n")), False)
        assert isinstance(chunk_read, chunks.Chunk)


@pytest.mark.anyio
async def test_a_wrong_shape_fails_its_agent_and_the_run_goes_on(stream_process):
    """It used to end the whole run: the int reached the engine, and a TypeError escaped its task group."""
    async def wrong(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(vllm({"content": "one "}) + vllm({"content": 5}))
                     + chunk(b""))
        await writer.drain()

    async def good(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(vllm({"content": "fine"}) + vllm({}, "stop")
                     + b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    async with RawServer(wrong) as bad, RawServer(good) as ok:
        engine = Engine(validate({
            "run": {"mode": "parallel", "max_concurrency": 2},
            "endpoints": [{"name": "odd", "base_url": bad.base_url, "model": "m"},
                          {"name": "steady", "base_url": ok.base_url, "model": "m"}],
            "agents": [{"name": "victim", "endpoint": "odd", "prompt": "hi", "retries": 0},
                       {"name": "bystander", "endpoint": "steady", "prompt": "hi"}],
        }), stream_process=stream_process)
        assert await engine.run() == 1
    victim, bystander = engine.agents["victim"], engine.agents["bystander"]
    assert victim.status == "failed"
    assert victim.error.startswith("endpoint odd: unexpected chunk in stream after 1 tokens"), victim.error
    assert "$.choices[0].delta.content" in victim.error
    assert bystander.status == "completed" and bystander.output == "fine"


@pytest.mark.anyio
async def test_a_last_event_without_its_blank_line_still_counts():
    items, s, error = await read_all(vllm({"content": "a"}) + vllm({}, "stop").rstrip(b"\n"))
    assert error is None
    assert items == [(DELTA, ("a", "", "", 1)), (FINISH, "stop")] and s.finish_reason == "stop"


# ---- one decoder, two readers: the streaming client and the gateway's copy of a relayed chat stream ----------
# Chunk text as the servers send it (field order, nulls and extras as recorded from vLLM 0.11 and llama-server
# b6097): what a sign of life is, and what usage and timings say, must read the same on both paths.
VLLM_RECORDED = (
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":null}\n\n'
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"delta":{"reasoning_content":"The user"},"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"delta":{"reasoning_content":" wants"},"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"delta":{"tool_calls":[{"id":"chatcmpl-tool-4e2","type":"function","index":0,'
    b'"function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": \\"Oslo\\"}"}}]},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}]}'
    b'\n\n'
    b'data: {"id":"chatcmpl-9f1","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[],"usage":{"prompt_tokens":412,"total_tokens":440,"completion_tokens":28,'
    b'"prompt_tokens_details":{"cached_tokens":384}}}\n\n'
    b'data: [DONE]\n\n')

LLAMA_RECORDED = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
    b'"created":1754523863,"id":"chatcmpl-X6ur","model":"gpt-oss:20b","system_fingerprint":"b6097-9515c613",'
    b'"object":"chat.completion.chunk","prompt_progress":{"total":1085,"cache":64,"processed":1085,"time_ms":203}}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":"User wrote"}}],'
    b'"created":1754523863,"id":"chatcmpl-X6ur","model":"gpt-oss:20b","system_fingerprint":"b6097-9515c613",'
    b'"object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hello"}}],"created":1754523863,'
    b'"id":"chatcmpl-X6ur","model":"gpt-oss:20b","system_fingerprint":"b6097-9515c613",'
    b'"object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"! \\ud83d\\udc4b"}}],"created":1754523863,'
    b'"id":"chatcmpl-X6ur","model":"gpt-oss:20b","system_fingerprint":"b6097-9515c613",'
    b'"object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1754524122,"id":"chatcmpl-X6ur",'
    b'"model":"gpt-oss:20b","system_fingerprint":"b6097-9515c613","object":"chat.completion.chunk",'
    b'"usage":{"completion_tokens":247,"prompt_tokens":1085,"total_tokens":1332},'
    b'"timings":{"cache_n":64,"prompt_n":1021,"prompt_ms":203.378,"prompt_per_token_ms":0.18744516129032257,'
    b'"prompt_per_second":5334.893646313762,"predicted_n":247,"predicted_ms":933.63,'
    b'"predicted_per_token_ms":3.7798785425101213,"predicted_per_second":264.5587652496171}}\n\n'
    b'data: [DONE]\n\n')


async def both_readers(recorded: bytes) -> tuple[list, ChatStream, apis.Reading]:
    """What the client yields for a recorded stream (in reads of 97 bytes, cut anywhere) and what the gateway's
    Reading makes of the same frames (in two reads, cut at a frame end)."""
    reads = [recorded[i:i + 97] for i in range(0, len(recorded), 97)]
    items, s, error = await read_all(*reads)
    assert error is None
    reading = apis.Reading("chat")
    half = recorded.index(b"\n\n", len(recorded) // 2) + 2
    reading.frames(recorded[:half])
    reading.frames(recorded[half:])
    return items, s, reading


def joined(items: list, slot: int) -> str:
    return "".join(value[slot] for kind, value in items if kind == DELTA)


@pytest.mark.anyio
async def test_a_recorded_vllm_stream_reads_the_same_through_the_client_and_the_gateway():
    items, s, reading = await both_readers(VLLM_RECORDED)
    assert joined(items, 0) == reading.answer == ""
    assert joined(items, 1) == "".join(reading.reasoning) == "The user wants"
    assert joined(items, 2) == "".join(reading.tools) == 'get_weather{"city": "Oslo"}'
    assert s.tokens == reading.chunks == 4  # two reasoning pieces, two tool-call pieces: each a sign of life
    assert (TOOL_CALLS, ((0, "chatcmpl-tool-4e2", "get_weather", ""),)) in items
    assert s.finish_reason == reading.finish == "tool_calls"
    assert (USAGE, (412, 28, 384)) in items
    assert (reading.prompt_tokens, reading.completion_tokens, reading.cached_tokens) == (412, 28, 384)
    assert reading.unreadable == 0


@pytest.mark.anyio
async def test_a_recorded_llama_server_stream_reads_the_same_through_the_client_and_the_gateway():
    items, s, reading = await both_readers(LLAMA_RECORDED)
    assert items[0] == (PROGRESS, (1085, 64, 1085, 203))  # the role-only chunk's prefill progress
    assert joined(items, 0) == reading.answer == "Hello! \N{WAVING HAND SIGN}"
    assert joined(items, 1) == "".join(reading.reasoning) == "User wrote"
    assert s.tokens == reading.chunks == 3
    assert s.finish_reason == reading.finish == "stop"
    assert s.usage == (reading.prompt_tokens, reading.completion_tokens) == (1085, 247)
    # llama.cpp's timings: the latency panel's figures on both paths, and the prompt's tokens where usage is absent
    assert (TIMINGS, (203.378, 3.7798785425101213)) in items
    assert s.timings == reading.timings == (203.378, 3.7798785425101213)
    assert reading.timings_prompt_tokens == 1085


@pytest.mark.anyio
async def test_figures_that_cannot_be_true_are_believed_by_neither_reader():
    stream_text = (event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}],
                          "prompt_progress": {"total": 10, "cache": 0, "processed": 11, "time_ms": 1}})
                   + event({"choices": [{"index": 0, "delta": {"content": "a"}}]})
                   + event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                            "timings": {"prompt_ms": -5.0, "predicted_per_token_ms": 1e300, "prompt_n": -1}})
                   + b"data: [DONE]\n\n")
    items, s, reading = await both_readers(stream_text)
    assert [kind for kind, _ in items] == [KEEPALIVE, DELTA, FINISH]  # no progress past the prompt, no timings
    assert s.timings is None and reading.timings is None and reading.timings_prompt_tokens == 0
    assert s.tokens == reading.chunks == 1


@pytest.mark.anyio
async def test_a_tool_call_piece_that_carries_no_text_is_a_sign_of_life_on_both_paths():
    stream_text = (event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": None}]}}]})
                   + event({"choices": [{"index": 1, "delta": {"content": "another choice's"}}]})
                   + event({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
                   + b"data: [DONE]\n\n")
    items, s, reading = await both_readers(stream_text)
    assert s.tokens == reading.chunks == 1  # the other choice (n > 1) is no part of the answer on either path
    assert joined(items, 2) == "".join(reading.tools) == " " and reading.answer == ""
