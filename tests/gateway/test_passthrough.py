"""Passed through, never translated: the three APIs streamed and not (their bytes as the upstream sent them, cut
only at frame ends, a copy read for tokens and usage), the request and session ids upstream, routing by model,
GET /v1/models from the upstream, and any other /v1/* path passed through, counted but not governed."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.sim import SimServer

from ..conftest import RawServer, chunk, free_port, http_head, sse_chunk, until
from .conftest import FAST_SIM, chat, post, served, sim_endpoint
from .upstreams import WORDS, FakeApi, messages_frames, messages_whole, responses_frames, responses_whole

pytestmark = pytest.mark.anyio


def _hosted(api: FakeApi) -> list[dict]:
    return [{"name": "up", "kind": "hosted", "base_url": api.base_url, "model": "up-model"}]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_chat_through_the_simulator(stream):
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions",
                            chat(max_tokens=7, stream=stream, stream_options={"include_usage": True}),
                            headers={"X-Session-ID": "c"})
        assert answer.status == 200
        [started] = s.of(ev.AgentStarted, "c")
        assert answer.headers["x-request-id"] == started.request_id
        if stream:
            assert answer.frames[-1] == b"data: [DONE]"
            assert answer.data[-1]["usage"]["completion_tokens"] == 7
        else:
            assert answer.json()["usage"]["completion_tokens"] == 7
        [turn] = await until(lambda: s.of(ev.TurnFinished, "c"), "the turn's end told")
        assert turn.completion_tokens == 7 and turn.prompt_tokens > 0 and turn.finish_reason == "length"
        [seen] = s.sim.requests
        assert seen["request_id"] == started.request_id  # the server logs an abort under this id
        assert seen["headers"]["x-session-id"] == "c"  # routers keep the session's turns on one worker
        assert seen["body"]["stream"] is stream
        [meters] = await until(lambda: s.of(ev.AgentMeters, "c"), "the session's meters")
        assert meters.prompt_tokens == turn.prompt_tokens


@pytest.mark.parametrize("path, frames, whole", [
    ("/messages", messages_frames(), messages_whole()),
    ("/responses", responses_frames(), responses_whole()),
], ids=["messages", "responses"])
async def test_messages_and_responses_pass_through_byte_for_byte(path, frames, whole):
    async with FakeApi() as api, served(endpoints=_hosted(api)) as s, httpx.AsyncClient(timeout=30) as client:
        body = {"model": "up-model", "max_tokens": 16, "stream": True, "input": "hi",
                "messages": [{"role": "user", "content": "hi"}]}
        streamed = await post(client, s.url + path, body, headers={"X-Session-ID": "sse"})
        assert streamed.status == 200 and streamed.headers["x-accel-buffering"] == "no"
        assert streamed.raw == b"".join(frames)  # the upstream's SSE bytes, never re-encoded
        plain = await post(client, s.url + path, {**body, "stream": False}, headers={"X-Session-ID": "sse"})
        assert plain.status == 200 and plain.json() == whole
        turns = await until(lambda: len(s.of(ev.TurnFinished, "sse")) == 2 and s.of(ev.TurnFinished, "sse"),
                            "both turns' ends told")
        assert [t.completion_tokens for t in turns] == [len(WORDS)] * 2
        assert all(t.prompt_tokens in (9, 11) for t in turns)
        assert [seen.path for seen in api.seen] == ["/v1" + path] * 2
        assert [seen.body for seen in api.seen] == [body, {**body, "stream": False}]
        answers = [m.content for m in s.of(ev.MessageRecorded, "sse") if m.role == "assistant"]
        assert answers == ["".join(WORDS)] * 2
        [opened] = s.of(ev.SessionOpened)
        assert opened.api == path.strip("/")


async def test_frames_reach_the_client_whole_however_the_upstream_cuts_them():
    frames = [sse_chunk(w) for w in ("alpha", " beta", " gamma")] + [sse_chunk(finish="stop"), b"data: [DONE]\n\n"]

    async def cutting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(http_head(200, "text/event-stream"))
        data = b"".join(frames)
        for start in range(0, len(data), 7):  # seven bytes at a time, a frame's end anywhere among them
            writer.write(chunk(data[start:start + 7]))
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(chunk(b""))
        await writer.drain()

    async with RawServer(cutting) as raw, served(endpoints=[
            {"name": "raw", "kind": "hosted", "base_url": raw.base_url, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        pieces = []
        async with client.stream("POST", s.url + "/chat/completions", json=chat(model="m")) as r:
            async for piece in r.aiter_raw():
                pieces.append(piece)
        assert b"".join(pieces) == b"".join(frames)
        assert all(piece.endswith(b"\n\n") for piece in pieces)
        [turn] = await until(lambda: s.of(ev.TurnFinished), "the turn's end told")
        assert turn.completion_tokens == 3 and turn.finish_reason == "stop"


async def test_a_request_goes_to_the_endpoint_that_serves_its_model():
    async with SimServer(SimSettings(**FAST_SIM), model="alpha-model") as a, \
            SimServer(SimSettings(**FAST_SIM), model="beta-model") as b:
        endpoints = [sim_endpoint(a.base_url, name="a", model="alpha-model"),
                     sim_endpoint(b.base_url, name="b", model="beta-model")]
        async with served(endpoints=endpoints, gateway={"model_map": {"beta-*": "beta-model"}}) as s, \
                httpx.AsyncClient(timeout=30) as client:
            for model, session in (("beta-model", "one"), ("alpha-model", "two"), ("beta-large", "three")):
                answer = await post(client, s.url + "/chat/completions", chat(model=model),
                                    headers={"X-Session-ID": session})
                assert answer.status == 200
            assert a.state.requests_total == 1 and b.state.requests_total == 2
            assert [(o.agent, o.endpoint) for o in s.of(ev.SessionOpened)] == [("one", "b"), ("two", "a"),
                                                                               ("three", "b")]
            message = (await post(client, s.url + "/chat/completions", chat(model="gamma"))).json()["error"]["message"]
            assert "alpha-model" in message and "beta-model" in message


async def test_models_are_the_upstreams():
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        r = await client.get(s.url + "/models")
        assert r.status_code == 200
        listed = r.json()
        assert [m["id"] for m in listed["data"]] == ["sim-model"]
        direct = (await client.get(s.sim_server.base_url + "/models")).json()
        assert listed["data"][0].keys() == direct["data"][0].keys()
        labelled = await client.get(s.root + "/a/someone/v1/models")
        assert labelled.status_code == 200 and labelled.json()["data"][0]["id"] == "sim-model"
        assert s.server.gateway.passed == 2
        assert not s.of(ev.SessionOpened)  # counted, not governed: no session, no attempt


async def test_other_v1_paths_are_passed_through_with_their_status_and_query():
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        r = await client.get(s.url + "/no/such/thing", params={"limit": "3"})
        direct = await client.get(s.sim_server.base_url + "/no/such/thing", params={"limit": "3"})
        assert r.status_code == direct.status_code == 404
        embeddings = await client.post(s.url + "/embeddings", json={"model": "sim-model", "input": "hi"})
        direct = await client.post(s.sim_server.base_url + "/embeddings", json={"model": "sim-model", "input": "hi"})
        assert embeddings.status_code == direct.status_code and embeddings.content == direct.content
        assert s.server.gateway.passed == 2 and s.sim.requests_total == 0
        assert not s.of(ev.SessionOpened) and not s.of(ev.AgentStarted)
        # outside /v1 nothing is served
        outside = await client.get(s.root + "/metrics")
        assert outside.status_code == 404 and "/v1/*" in outside.json()["error"]["message"]


async def test_a_passed_through_request_to_an_upstream_that_is_down_is_a_503():
    closed = f"http://127.0.0.1:{free_port()}/v1"
    async with served(endpoints=[{"name": "far", "kind": "hosted", "base_url": closed, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        r = await client.get(s.url + "/models")
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "far is not answering" in r.json()["error"]["message"]


async def test_a_passed_through_stream_streams():
    # /v1/completions (legacy completions, as IDE plugins stream fill-in-the-middle): not governed, but not
    # held back either: each frame reaches the client as it comes
    more = asyncio.Event()

    async def completions(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(http_head(200, "text/event-stream"))
        writer.write(chunk(b'data: {"choices": [{"text": "def "}]}\n\n'))
        await writer.drain()
        await more.wait()
        writer.write(chunk(b'data: {"choices": [{"text": "f():"}]}\n\n') + chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    async with RawServer(completions) as raw, served(endpoints=[
            {"name": "raw", "kind": "hosted", "base_url": raw.base_url, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        pieces: list[bytes] = []
        body = {"model": "m", "prompt": "def", "stream": True}
        with anyio.fail_after(10):  # held back, the first frame would never come: the upstream waits for it
            async with client.stream("POST", s.url + "/completions", json=body) as r:
                assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
                async for piece in r.aiter_raw():
                    pieces.append(piece)
                    more.set()  # the first frame came while the upstream held back the rest
        assert b"".join(pieces).endswith(b"data: [DONE]\n\n")
        assert s.server.gateway.passed == 1 and not s.of(ev.SessionOpened)


async def test_a_client_gone_from_a_passed_through_stream_ends_it_upstream():
    closed = asyncio.Event()

    async def completions(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(http_head(200, "text/event-stream") + chunk(b'data: {"choices": [{"text": "x"}]}\n\n'))
        await writer.drain()
        if not await reader.read(1):  # end of file: the gateway closed the connection
            closed.set()

    async with RawServer(completions) as raw, served(endpoints=[
            {"name": "raw", "kind": "hosted", "base_url": raw.base_url, "model": "m"}]) as s:
        async with httpx.AsyncClient(timeout=30) as client, \
                client.stream("POST", s.url + "/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
            async for _ in r.aiter_raw():
                break  # gone after the first frame
        await until(closed.is_set, "the upstream connection closed")
