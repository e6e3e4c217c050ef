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

from ..conftest import RawServer, chunk, free_port, http_head, until
from .conftest import chat, gateway_config, post, served, sim_endpoint

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


async def test_models_and_other_pass_through_go_to_a_pool_member_that_is_up_not_the_first():
    async def unhealthy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass  # (its GET /health, /metrics and /v1/models are all answered 404 by RawServer)

    async with RawServer(unhealthy) as sick, served(sim={}) as probe:  # a simulator of the test's own
        sim_url = probe.sim_server.base_url
        config = gateway_config(endpoints=[{"name": "sick", "kind": "local", "base_url": sick.base_url,
                                            "model": "sim-model"}, sim_endpoint(sim_url, name="fine")],
                                pools=[{"name": "fleet", "endpoints": ["sick", "fine"]}],
                                gateway={"upstream": "fleet"}, run={"metrics_interval_s": 0.2})
        async with served(config) as s, httpx.AsyncClient(timeout=30) as client:
            await until(lambda: s.engine.placement.down.get("sick"), "the first member's failed health check")
            r = await client.get(s.url + "/models")
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["sim-model"]
            assert s.server.gateway.passed == 1 and sick.requests == 0


async def test_a_pass_through_refused_by_the_first_member_goes_to_the_next():
    closed = f"http://127.0.0.1:{free_port()}/v1"  # a hosted member: no health check says it is down
    async with served(sim={}) as probe:
        config = gateway_config(endpoints=[{"name": "gone", "kind": "hosted", "base_url": closed, "model": "sim-model"},
                                           sim_endpoint(probe.sim_server.base_url, name="fine")],
                                pools=[{"name": "fleet", "endpoints": ["gone", "fine"]}], gateway={"upstream": "fleet"})
        async with served(config) as s, httpx.AsyncClient(timeout=30) as client:
            r = await client.get(s.url + "/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "sim-model"


async def test_an_upstream_that_never_ends_its_frame_is_ended_over_the_limit_with_an_error_in_the_apis_shape():
    from cerevisor_tui.gateway.sse import FRAME_LIMIT_BYTES

    closed = asyncio.Event()
    sent = 0

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(http_head(200, "text/event-stream"))
        writer.write(chunk(b'data: {"choices": [{"index": 0, "delta": {"content": "'))
        piece = chunk(b"x" * 65536)
        try:
            while not reader.at_eof() and sent < 4 * FRAME_LIMIT_BYTES:
                writer.write(piece)
                sent += 65536
                await writer.drain()
        except ConnectionError:
            pass
        if sent < 4 * FRAME_LIMIT_BYTES:
            closed.set()

    # a long keepalive_s: the first comment goes only after it, and reading 8 MiB on a loaded machine may take longer
    # than this suite's 0.2 s, which would send the headers (200) before the error
    async with RawServer(endless) as raw, served(endpoints=[_raw(raw.base_url)], gateway={"keepalive_s": 60}) as s, \
            httpx.AsyncClient(timeout=60) as client:
        for path, body, shape in (("/chat/completions", chat(model="m"), "error"),):
            answer = await post(client, s.url + path, body, headers={"X-Session-ID": "long"})
            assert answer.status == 502
            error = answer.json()[shape]
            assert "over 8 MiB without ending it" in error["message"] and error["type"]
        await until(closed.is_set, "the upstream connection closed by the gateway")
        assert FRAME_LIMIT_BYTES <= sent < 2 * FRAME_LIMIT_BYTES  # read up to the limit, then dropped


def test_frames_are_cut_at_their_ends_wherever_the_reads_split_them():
    from cerevisor_tui.gateway.sse import Frames as _Frames
    from cerevisor_tui.gateway.sse import FrameTooLong

    stream = b"data: 1\n\ndata: 2\r\n\r\n: note\n\ndata: 3\n\n"
    for size in range(1, len(stream) + 1):
        frames = _Frames()
        out = [frames.feed(stream[i:i + size]) for i in range(0, len(stream), size)]
        assert b"".join(out) == stream and frames.rest() == b""
        assert all(not piece or piece.endswith((b"\n\n", b"\r\n\r\n")) for piece in out)
    small = _Frames(limit_bytes=10)
    assert small.feed(b"data: 12") == b""
    with pytest.raises(FrameTooLong):
        small.feed(b"345")
