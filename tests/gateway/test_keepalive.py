"""Keep-alives: a streamed request that waits gets an SSE comment every keepalive_s, the first only after
keepalive_s, so that a quick error keeps its HTTP status and a later one becomes the API's own error event; and
the real SDKs (openai-python, anthropic) read through them."""

from __future__ import annotations

import asyncio
import time

import anyio
import httpx
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev

from ..conftest import SDK, LazyModule, until
from .conftest import Answer, chat, post, served
from .upstreams import WORDS, FakeApi

anthropic, openai = LazyModule("anthropic"), LazyModule("openai")
pytestmark = pytest.mark.anyio

KEEPALIVE_S = 0.2


def _sequential(**kwargs):
    """A sequential run where a session that has been served keeps the only slot (`_hold_the_slot`) until the
    test lets the others in (`_let_in`): a request waits exactly as long as a test needs, however loaded the
    machine."""
    return served(run={"mode": "sequential"}, gateway={"release_after_s": 60, "keepalive_s": KEEPALIVE_S}, **kwargs)


async def _hold_the_slot(s, client: httpx.AsyncClient, session: str = "holder") -> None:
    answer = await post(client, s.url + "/chat/completions", chat(stream=False), headers={"X-Session-ID": session})
    assert answer.status in (200, 500), answer.raw  # served or failed, it holds the slot all the same
    assert s.session(session).holding


def _let_in(s) -> None:
    s.engine.handle(cmd.SetMode(mode="parallel"))


def _queued(s, session: str) -> bool:
    return session in s.engine.sessions.by_name and s.session(session).queued == 1


async def test_a_queued_stream_gets_comments_the_first_only_after_keepalive_s():
    async with _sequential() as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        arrivals: list[tuple[float, bytes]] = []
        let_in = False
        start = time.monotonic()
        async with client.stream("POST", s.url + "/chat/completions", json=chat(max_tokens=5),
                                 headers={"X-Session-ID": "waiter"}) as r:
            assert r.status_code == 200  # its headers went out with the first comment, while it waits
            assert _queued(s, "waiter")
            async for piece in r.aiter_raw():
                arrivals.append((time.monotonic() - start, piece))
                if not let_in and sum(p.count(b": keep-alive") for _, p in arrivals) >= 3:
                    _let_in(s)
                    let_in = True
        raw = b"".join(piece for _, piece in arrivals)
        answer = Answer(200, r.headers, raw)
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        first_comment = next(t for t, piece in arrivals if piece.startswith(b": keep-alive"))
        assert first_comment >= KEEPALIVE_S * 0.99
        assert set(answer.comments) == {b": keep-alive"} and len(answer.comments) >= 3
        # the comments come before the answer, which is whole
        data_at = raw.index(b"data:")
        assert raw.rindex(b": keep-alive") < data_at
        assert answer.frames[-1] == b"data: [DONE]"
        assert len(answer.text.split()) >= 1 and [d for d in answer.data if d["choices"]]
        [started] = s.of(ev.AgentStarted, "waiter")
        assert started.queued_s >= 3 * KEEPALIVE_S * 0.99


async def test_a_stream_that_starts_at_once_gets_no_comment():
    async with served(gateway={"keepalive_s": 2.0}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=20), headers={"X-Session-ID": "q"})
        assert answer.status == 200 and not answer.comments, answer.raw


async def test_a_request_not_streamed_simply_waits():
    async with _sequential() as s, httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        await _hold_the_slot(s, client)
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat(stream=False),
                                      headers={"X-Session-ID": "w"}))

        group.start_soon(ask)
        await until(lambda: _queued(s, "w"), "the request queued")
        await anyio.sleep(3 * KEEPALIVE_S)  # queued past a few keep-alive periods: what it is sent meanwhile
        assert not answers
        _let_in(s)
        await until(lambda: answers, "its answer")
        [answer] = answers
        assert answer.status == 200 and answer.raw.startswith(b"{")
        assert answer.json()["choices"][0]["message"]["content"]


async def test_a_quick_refusal_keeps_its_http_status():
    # the first comment goes only after keepalive_s, so an answer quicker than that keeps its status: a long
    # keepalive_s here, as a loaded machine's upstream may take longer than this file's 0.2 s to refuse
    async with served(run={"mode": "sequential"}, gateway={"release_after_s": 60, "keepalive_s": 30},
                      sim={"fail_first": 1, "fail_status": 429}) as s, httpx.AsyncClient(timeout=30) as client:
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
        async with client.stream("POST", s.url + "/chat/completions", json=chat(),
                                 headers={"X-Session-ID": "late"}) as r:
            assert r.status_code == 200  # the headers went out with the first comment
            _let_in(s)
            raw = await r.aread()
        answer = Answer(r.status_code, r.headers, raw)
        assert answer.comments
        [error] = [d for d in answer.data if "error" in d]
        assert "500" in error["error"]["message"] and "Simulated failure" in error["error"]["message"]
        assert answer.frames[-1].startswith(b"data: {\"error\"")


def _sdk(s, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0, default_headers={"X-Session-ID": session})


@SDK
async def test_openai_sdk_reads_through_keepalives():
    async with _sequential() as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        sdk = _sdk(s, "sdk")
        stream = await sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=7, stream=True)
        assert _queued(s, "sdk")  # create() came back on the first comment, its request still waiting
        _let_in(s)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) == 7
        await sdk.close()


@SDK
async def test_openai_sdk_raises_an_error_event_after_keepalives():
    async with _sequential(sim={"fail_first": 2, "fail_status": 500}) as s, httpx.AsyncClient(timeout=30) as client:
        await _hold_the_slot(s, client)
        sdk = _sdk(s, "sdk")
        stream = await sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=7, stream=True)
        assert _queued(s, "sdk")
        _let_in(s)
        with pytest.raises(openai.APIError, match="Simulated failure"):
            async for _ in stream:
                pass
        await sdk.close()


@SDK
async def test_openai_sdk_quick_refusal_is_its_status_error():
    async with _sequential() as s:
        sdk = openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="served: sim-model"):
            await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], stream=True)
        await sdk.close()


@SDK
async def test_anthropic_sdk_reads_through_keepalives():
    # the slot is held by a session on an Anthropic-shaped upstream; another waits for it, kept alive
    async with FakeApi() as api, served(
            run={"mode": "sequential"}, gateway={"release_after_s": 60, "keepalive_s": KEEPALIVE_S},
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
            assert _queued(s, "claude")  # the stream opened on the first comment, its request still waiting
            _let_in(s)
            text = "".join([t async for t in stream.text_stream])
        assert text == "".join(WORDS)
        await sdk.close()


@SDK
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
