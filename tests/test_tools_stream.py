"""Tool calls as servers really stream them, from a raw socket server: two parallel calls whose pieces
interleave, a server that repeats a call's name in every piece, and one that ignores `stream: true` and sends
a whole chat.completion with tool_calls. Each call is put together, run through MCP, and answered in order."""

from __future__ import annotations

import json
import sys

import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.engine.engine import Engine
from tests.conftest import RawServer, chunk, http_head
from tests.test_tools import FAKE, kinds


def data(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def delta(finish=None, **fields) -> bytes:
    return data({"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]})


def call_piece(index: int, *, id: str | None = None, name: str | None = None, arguments: str = "") -> dict:
    piece: dict = {"index": index, "function": {"arguments": arguments}}
    if id:
        piece |= {"id": id, "type": "function"}
    if name:
        piece["function"]["name"] = name
    return piece


class Scripted:
    """Answers the first chat request with `first` (a list of SSE events, or a whole JSON body), the rest in text."""

    def __init__(self, first) -> None:
        self.first = first
        self.requests = 0

    async def __call__(self, reader, writer) -> None:
        self.requests += 1
        if self.requests == 1 and isinstance(self.first, dict):
            body = json.dumps(self.first).encode()
            writer.write(http_head(200, "application/json", length=len(body)) + body)
            await writer.drain()
            return
        writer.write(http_head(200, "text/event-stream"))
        events = self.first if self.requests == 1 else [delta(content="done"), delta("stop")]
        for event in [*events, b"data: [DONE]\n\n"]:
            writer.write(chunk(event))
            await writer.drain()
        writer.write(chunk(b""))
        await writer.drain()


async def run_scripted(first) -> tuple[Engine, list]:
    async with RawServer(Scripted(first)) as srv:
        engine = Engine(validate({
            "endpoints": [{"name": "e", "base_url": srv.base_url, "model": "m"}],
            "mcp_servers": [{"name": "fake", "command": sys.executable, "args": [FAKE], "allow": ["*"]}],
            "agents": [{"name": "a", "prompt": "p", "tools": ["fake"], "retries": 0}]}), ask="deny")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0, kinds(seen, "AgentFinished")
    return engine, seen


@pytest.mark.anyio
async def test_two_parallel_calls_whose_pieces_interleave_are_each_put_together_and_run_in_order():
    first = [
        delta(role="assistant", tool_calls=[call_piece(0, id="c0", name="fake__add", arguments='{"a": ')]),
        delta(tool_calls=[call_piece(1, id="c1", name="fake__echo", arguments='{"te')]),
        delta(tool_calls=[call_piece(0, arguments='4, "b": 5}')]),
        delta(tool_calls=[call_piece(1, arguments='xt": "hi"}')]),
        delta("tool_calls"),
    ]
    engine, seen = await run_scripted(first)
    messages = engine.agents["a"].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    calls = messages[1]["tool_calls"]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("c0", "fake__add", {"a": 4, "b": 5}), ("c1", "fake__echo", {"text": "hi"})]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:4]] == [("c0", "9"), ("c1", "echo: hi")]
    assert messages[4]["content"] == "done"


@pytest.mark.anyio
async def test_a_name_repeated_in_every_piece_is_taken_once():
    first = [delta(tool_calls=[call_piece(0, id="c0", name="fake__echo", arguments=part)])
             for part in ('{"text"', ': "x"}')] + [delta("tool_calls")]
    engine, _ = await run_scripted(first)
    call = engine.agents["a"].messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "fake__echo", "arguments": '{"text": "x"}'}


@pytest.mark.anyio
async def test_a_whole_chat_completion_with_tool_calls_is_taken_too():
    first = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
             "tool_calls": [{"id": "w0", "type": "function",
                             "function": {"name": "fake__add", "arguments": '{"a": 1, "b": 1}'}}]}}]}
    engine, seen = await run_scripted(first)
    assert [(e.call_id, e.outcome, e.result) for e in kinds(seen, "ToolCallFinished")] == [("w0", "ok", "2")]
