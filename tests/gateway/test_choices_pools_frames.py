"""The gateway's relay with what an upstream or a client may send beyond one plain answer, over real loopback
sockets: several choices (`n=2`: the client gets them all, the session's answer is choice 0's), a pool whose first
member is down (pass-through requests, GET /v1/models among them, go to a member that is up), and an upstream
whose stream never ends a frame (searched linearly, and ended over the frame-size limit with an error in the API's
shape)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import RawServer, chunk, http_head, until
from .conftest import chat, post, served

pytestmark = pytest.mark.anyio


def _frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _raw(url: str, name: str = "raw") -> dict:
    return {"name": name, "kind": "hosted", "base_url": url, "model": "m"}


async def test_with_n_2_the_client_gets_both_choices_and_the_session_records_choice_0():
    async def two(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(http_head(200, "text/event-stream"))
        for word in ("one ", "two ", "three"):
            for index in (0, 1):
                writer.write(chunk(_frame({"choices": [{"index": index, "delta": {"content": f"{index}:{word}"},
                                                        "finish_reason": None}]})))
        writer.write(chunk(_frame({"choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]})))
        writer.write(chunk(_frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})))
        writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    async with RawServer(two) as raw, served(endpoints=[_raw(raw.base_url)]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(model="m", n=2), headers={"X-Session-ID": "c"})
        assert answer.status == 200
        assert sorted({d["choices"][0]["index"] for d in answer.data if d.get("choices")}) == [0, 1]
        [turn] = await until(lambda: s.of(ev.TurnFinished, "c"), "the turn's end told")
        assert turn.finish_reason == "stop"  # choice 0's, not the last frame's
        answers = [m for m in s.of(ev.MessageRecorded, "c") if m.role == "assistant"]
        assert [m.content for m in answers] == ["0:one 0:two 0:three"]


async def test_a_whole_answer_with_two_choices_records_choice_0_whatever_their_order():
    body = json.dumps({"choices": [{"index": 1, "message": {"role": "assistant", "content": "second"},
                                    "finish_reason": "length"},
                                   {"index": 0, "message": {"role": "assistant", "content": "first"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()

    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(http_head(200, "application/json", length=len(body)) + body)
        await writer.drain()

    async with RawServer(whole) as raw, served(endpoints=[_raw(raw.base_url)]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(model="m", n=2, stream=False),
                            headers={"X-Session-ID": "w"})
        assert answer.status == 200 and answer.raw == body
        [turn] = await until(lambda: s.of(ev.TurnFinished, "w"), "the turn's end told")
        assert turn.finish_reason == "stop"
        assert [m.content for m in s.of(ev.MessageRecorded, "w") if m.role == "assistant"] == ["first"]
