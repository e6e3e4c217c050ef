"""A client that goes away aborts its upstream request in every window: while queued (nothing is sent), before
the first byte, mid-stream, and for a request not streamed; each time the session's counts return to zero and
its slot is given back or used again, never leaked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import chat, post, served
from .upstreams import FakeApi

pytestmark = pytest.mark.anyio

SLOW_PREFILL = {"speed": 1.0, "prefill_tokens_per_s": 200, "max_num_batched_tokens": 32, "ttft_s": 0.0,
                "tokens_per_s": 100}
LONG = "many words " * 730  # about ten seconds to its first token under SLOW_PREFILL
SLOW_DECODE = {"speed": 1.0, "tokens_per_s": 20}


async def _go_away(url: str, body: dict[str, Any], session: str, when: Callable[[], Any], what: str) -> None:
    """Send `body` as `session` on a client of its own, and close that client's connection once `when()`."""
    async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
        async def ask() -> None:
            await post(client, url, body, headers={"X-Session-ID": session})
            raise AssertionError("the request ended before its client went away")

        group.start_soon(ask)
        await until(when, what)
        group.cancel_scope.cancel()


def _settled(s, name: str) -> bool:
    session = s.session(name)
    assert not session.in_flight and session.queued == 0
    return True


async def test_gone_while_queued_sends_nothing_and_leaves_the_queue():
    async with served(sim={}, run={"mode": "sequential"}, gateway={"release_after_s": 1.0}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        assert (await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "holder"})).status \
            == 200
        await _go_away(s.url + "/chat/completions", chat(), "leaver",
                       lambda: "leaver" in s.engine.sessions.by_name and s.session("leaver").queued == 1,
                       "the leaver queued")
        await until(lambda: _settled(s, "leaver"), "the leaver's request gone from the session")
        await until(lambda: s.engine.scheduler.queued == 0, "its place in the scheduler's queue gone too")
        assert s.session("leaver").holder is None and not s.session("leaver").holding
        assert not s.of(ev.AgentStarted, "leaver")
        assert s.sim.requests_total == 1  # the holder's only
        # the slot is the next session's once the holder gives it back, and the leaver may come back
        again = await post(client, s.url + "/chat/completions", chat("back"), headers={"X-Session-ID": "leaver"})
        assert again.status == 200
        assert s.session("leaver").requests == 1


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_gone_before_the_first_byte_aborts_the_upstream_request(stream):
    async with served(sim=SLOW_PREFILL, run={"mode": "sequential"}, gateway={"release_after_s": 0}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        await _go_away(s.url + "/chat/completions", chat(LONG, stream=stream), "leaver",
                       lambda: s.sim.requests_total == 1, "the request at the server")
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        assert not s.of(ev.FirstToken, "leaver")
        await until(lambda: _settled(s, "leaver"), "the leaver's request ended")
        await until(lambda: s.engine.scheduler.running == 0, "its slot given back")
        [turn] = await until(lambda: s.of(ev.TurnFinished, "leaver"), "the request's end told")
        assert turn.finish_reason == "client gone"
        assert s.sim.running == 0 and s.sim.waiting == 0  # nothing left computing on the server
        # the one slot (sequential) is free: another session is served
        answer = await post(client, s.url + "/chat/completions", chat(stream=stream), headers={"X-Session-ID": "next"})
        assert answer.status == 200


async def test_gone_mid_stream_aborts_the_upstream_request_and_keeps_the_partial_answer():
    async with served(sim=SLOW_DECODE, run={"mode": "sequential"}, gateway={"release_after_s": 0}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        await _go_away(s.url + "/chat/completions", chat(max_tokens=400), "leaver",
                       lambda: s.session("leaver").st.tokens >= 3 if "leaver" in s.engine.sessions.by_name else False,
                       "a few tokens streamed")
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        await until(lambda: _settled(s, "leaver"), "the leaver's request ended")
        await until(lambda: s.engine.scheduler.running == 0, "its slot given back")
        assert s.sim.running == 0
        [turn] = await until(lambda: s.of(ev.TurnFinished, "leaver"), "the request's end told")
        assert turn.finish_reason == "client gone" and 3 <= turn.completion_tokens < 400
        [partial] = [m for m in s.of(ev.MessageRecorded, "leaver") if m.role == "assistant"]
        assert partial.partial and partial.content
        assert not s.of(ev.AgentKilled, "leaver")  # the client ended it: no kill
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=3), headers={"X-Session-ID": "next"})
        assert answer.status == 200


async def test_gone_while_a_whole_answer_is_computed_aborts_it():
    async with served(sim=SLOW_DECODE, run={"mode": "sequential"}, gateway={"release_after_s": 0}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        await _go_away(s.url + "/chat/completions", chat(max_tokens=400, stream=False), "leaver",
                       lambda: s.sim.requests_total == 1 and s.sim.running == 1, "the answer being computed")
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        await until(lambda: _settled(s, "leaver"), "the leaver's request ended")
        await until(lambda: s.engine.scheduler.running == 0, "its slot given back")
        assert s.sim.completed_total == 0 and s.sim.running == 0
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=3, stream=False),
                            headers={"X-Session-ID": "next"})
        assert answer.status == 200


async def test_gone_keeps_the_session_holding_its_slot_until_release_after_s():
    # one request of two gone: the session's other request, and its slot, go on
    async with served(sim=SLOW_DECODE, gateway={"release_after_s": 30}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers = []

        async def stay() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat("stay", max_tokens=60),
                                      headers={"X-Session-ID": "two"}))

        group.start_soon(stay)
        await until(lambda: "two" in s.engine.sessions.by_name and s.session("two").in_flight, "the first request")
        await _go_away(s.url + "/chat/completions", chat("leave", max_tokens=400), "two",
                       lambda: len(s.session("two").in_flight) == 2 and s.sim.running == 2, "both requests running")
        await until(lambda: s.sim.aborted_total == 1, "the gone request aborted upstream")
        await until(lambda: answers, "the other request's answer", timeout=30)
        assert answers[0].status == 200 and answers[0].frames[-1] == b"data: [DONE]"
        await until(lambda: _settled(s, "two"), "both requests ended")
        assert s.session("two").holding and s.engine.scheduler.running == 1


@pytest.mark.parametrize("path, body", [
    ("/messages", {"model": "sim-model", "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]}),
    ("/responses", {"model": "sim-model", "max_output_tokens": 400, "input": "hi"}),
], ids=["messages", "responses"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_gone_from_messages_and_responses_aborts_them_too(path, body, stream):
    async with served(sim=SLOW_DECODE, gateway={"release_after_s": 0}) as s, httpx.AsyncClient(timeout=30):
        await _go_away(s.url + path, {**body, "stream": stream}, "leaver",
                       lambda: s.sim.requests_total == 1 and s.sim.running == 1, "the answer being computed")
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        await until(lambda: _settled(s, "leaver"), "the leaver's request ended")
        await until(lambda: s.engine.scheduler.running == 0, "its slot given back")


async def test_a_passed_through_request_ends_upstream_when_its_client_leaves_before_the_answer():
    import asyncio

    from ..conftest import RawServer

    asked, ended = anyio.Event(), anyio.Event()

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.set()
        if not await reader.read(1):  # the gateway's side of the connection closed: the request is over
            ended.set()

    async with RawServer(never_answers) as raw, served(endpoints=[
            {"name": "raw", "kind": "hosted", "base_url": raw.base_url, "model": "m"}]) as s:
        stream = await anyio.connect_tcp(s.server.host, s.server.port)
        await stream.send(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 2\r\n\r\n{}")
        await asked.wait()
        await stream.aclose()  # gone before any answer
        await ended.wait()
        assert s.server.gateway.passed == 1


async def test_a_client_that_hangs_up_once_the_answers_end_went_out_has_its_answer_counted():
    """Codex CLI closes its connection at `response.completed`, before the upstream ends its stream: the answer
    went out whole, so it is an answered request (its TurnFinished, its meters), not a client gone."""
    async with FakeApi(gap_s=0.3) as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                            "model": "up-model"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        body = {"model": "up-model", "input": "hi", "stream": True}
        async with client.stream("POST", s.root + "/a/codex/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("event: response.completed"):
                    break  # hangs up here, the upstream's end still 0.3 s away
        await until(lambda: s.of(ev.TurnFinished, "codex"), "the request's end told")
        await until(lambda: s.of(ev.AgentMeters, "codex"), "its meters")
        assert [e.finish_reason for e in s.of(ev.TurnFinished, "codex")] == ["completed"]
        assert not s.of(ev.AgentKilled, "codex") and api.gone == 0
