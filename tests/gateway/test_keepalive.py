"""Keep-alives: a streamed request that waits gets an SSE comment every keepalive_s, the first only after
keepalive_s, so that a quick error keeps its HTTP status and a later one becomes the API's own error event; and
the real SDKs (openai-python, anthropic) read through them."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import Answer, chat, post, served
from .upstreams import WORDS, FakeApi

pytestmark = pytest.mark.anyio

KEEPALIVE_S = 0.2
HOLD_S = 1.2  # how long the first session keeps its slot: a second one waits that long, kept alive


def _sequential(**kwargs):
    """A run where a session that has been served holds the only slot for HOLD_S."""
    return served(run={"mode": "sequential"}, gateway={"release_after_s": HOLD_S, "keepalive_s": KEEPALIVE_S},
                  **kwargs)


async def _hold_the_slot(s, client: httpx.AsyncClient, session: str = "holder") -> None:
    answer = await post(client, s.url + "/chat/completions", chat(stream=False), headers={"X-Session-ID": session})
    assert answer.status in (200, 500), answer.raw  # served or failed, it holds the slot all the same
    assert s.session(session).holding


async def test_a_queued_stream_gets_comments_the_first_only_after_keepalive_s():
    async with _sequential() as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        arrivals: list[tuple[float, bytes]] = []
        start = time.monotonic()
        async with client.stream("POST", s.url + "/chat/completions", json=chat(max_tokens=5),
                                 headers={"X-Session-ID": "waiter"}) as r:
            assert r.status_code == 200
            async for piece in r.aiter_raw():
                arrivals.append((time.monotonic() - start, piece))
        raw = b"".join(piece for _, piece in arrivals)
        answer = Answer(200, r.headers, raw)
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        first_comment = next(t for t, piece in arrivals if piece.startswith(b": keep-alive"))
        assert first_comment >= KEEPALIVE_S * 0.99
        assert len(answer.comments) >= 2  # it waited HOLD_S: several comments
        assert set(answer.comments) == {b": keep-alive"}
        # the comments come before the answer, which is whole
        data_at = raw.index(b"data:")
        assert raw.rindex(b": keep-alive") < data_at
        assert answer.frames[-1] == b"data: [DONE]"
        assert len(answer.text.split()) >= 1 and [d for d in answer.data if d["choices"]]
        [started] = s.of(ev.AgentStarted, "waiter")
        assert started.queued_s >= KEEPALIVE_S


async def test_a_stream_that_starts_at_once_gets_no_comment():
    async with served(gateway={"keepalive_s": 2.0}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=20), headers={"X-Session-ID": "q"})
        assert answer.status == 200 and not answer.comments, answer.raw


async def test_a_request_not_streamed_simply_waits():
    async with _sequential() as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        answer = await post(client, s.url + "/chat/completions", chat(stream=False), headers={"X-Session-ID": "w"})
        assert answer.status == 200
        assert answer.json()["choices"][0]["message"]["content"]
        assert s.of(ev.AgentStarted, "w")[0].queued_s > KEEPALIVE_S


async def test_a_quick_refusal_keeps_its_http_status():
    async with _sequential(sim={"fail_first": 1, "fail_status": 429}) as s, httpx.AsyncClient(timeout=30) as client:
        unknown = await post(client, s.url + "/chat/completions", chat(model="no-such-model"))
        assert unknown.status == 404 and not unknown.comments
        assert "sim-model" in unknown.json()["error"]["message"]
        # the upstream's own quick error: its status and Retry-After, passed as they came
        limited = await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "r"})
        assert limited.status == 429 and not limited.comments
        assert limited.headers["retry-after"] == "1"
        assert "Simulated failure" in limited.json()["error"]["message"]


async def test_after_a_comment_an_upstream_error_is_the_apis_error_event():
    # the holder's request takes the first failure; the waiter's, sent after its comments, takes the second
    async with _sequential(sim={"fail_first": 2, "fail_status": 500}) as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        answer = await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "late"})
        assert answer.status == 200  # the headers went out with the first comment
        assert answer.comments
        [error] = [d for d in answer.data if "error" in d]
        assert "500" in error["error"]["message"] and "Simulated failure" in error["error"]["message"]
        assert answer.frames[-1].startswith(b"data: {\"error\"")


async def test_openai_sdk_reads_through_keepalives():
    async with _sequential() as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        sdk = openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0,
                                 default_headers={"X-Session-ID": "sdk"})
        stream = await sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=7, stream=True)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) == 7
        assert s.of(ev.AgentStarted, "sdk")[0].queued_s > 2 * KEEPALIVE_S  # it did wait past several comments
        await sdk.close()


async def test_openai_sdk_raises_an_error_event_after_keepalives():
    async with _sequential(sim={"fail_first": 2, "fail_status": 500}) as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        sdk = openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0,
                                 default_headers={"X-Session-ID": "sdk"})
        stream = await sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=7, stream=True)
        with pytest.raises(openai.APIError, match="Simulated failure"):
            async for _ in stream:
                pass
        await sdk.close()


async def test_openai_sdk_quick_refusal_is_its_status_error():
    async with _sequential() as s:
        sdk = openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="served: sim-model"):
            await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], stream=True)
        await sdk.close()


async def test_anthropic_sdk_reads_through_keepalives():
    # the slot is held by a session on the simulator; the messages request goes to an Anthropic-shaped upstream
    async with FakeApi() as api, served(
            run={"mode": "sequential"}, gateway={"release_after_s": HOLD_S, "keepalive_s": KEEPALIVE_S},
            endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url, "model": "up-model"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        body = {"model": "up-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
                "stream": True}
        first = await post(client, s.url + "/messages", body, headers={"X-Session-ID": "holder"})
        assert first.status == 200 and s.session("holder").holding
        sdk = anthropic.AsyncAnthropic(base_url=s.root, api_key="unused", max_retries=0,
                                       default_headers={"X-Session-ID": "claude"})
        async with sdk.messages.stream(model="up-model", max_tokens=16,
                                       messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
        assert text == "".join(WORDS)
        assert s.of(ev.AgentStarted, "claude")[0].queued_s > 2 * KEEPALIVE_S
        await sdk.close()


async def test_anthropic_sdk_raises_the_error_event_after_keepalives():
    # held back upstream past its first-byte deadline, after the gateway's comments: an `event: error`
    hold = asyncio.Event()
    async with FakeApi(hold=hold) as api, served(
            gateway={"keepalive_s": KEEPALIVE_S},
            stall={"first_byte_timeout_s": 1.0, "extend_when_server_busy": False},
            endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url, "model": "up-model"}]) as s:
        sdk = anthropic.AsyncAnthropic(base_url=s.root, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.APIStatusError, match="first_byte deadline"):
            async with sdk.messages.stream(model="up-model", max_tokens=16,
                                           messages=[{"role": "user", "content": "hi"}]) as stream:
                async for _ in stream.text_stream:
                    pass
        await until(lambda: api.gone == 1, "the upstream request closed")
        await sdk.close()
