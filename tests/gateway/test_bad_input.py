"""Bad input, each answered in the API's own shape (413, 400, 404 listing the served models), the models a
harness asks for mapped to served ones (`model_map`, `--model`), and a harness sending garbage never disturbing
another session's stream."""

from __future__ import annotations

import asyncio
import json

import anyio
import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import Answer, chat, post, served

pytestmark = pytest.mark.anyio

MESSAGES = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _openai_error(answer: Answer, status: int) -> str:
    assert answer.status == status, answer.raw
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return error["message"]


def _anthropic_error(answer: Answer, status: int, kind: str) -> str:
    assert answer.status == status, answer.raw
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


async def _chunked(data: bytes):
    for start in range(0, len(data), 4096):
        yield data[start:start + 4096]


async def test_a_body_over_max_body_mib_is_a_413():
    async with served(sim={}, gateway={"max_body_mib": 0.01}) as s, httpx.AsyncClient(timeout=30) as client:
        big = chat("x" * 20_000)
        # told by its Content-Length, before it is read
        message = _openai_error(await post(client, s.url + "/chat/completions", big), 413)
        assert "max_body_mib" in message
        # sent chunked, with no length: counted as it comes
        async with client.stream("POST", s.url + "/chat/completions", content=_chunked(json.dumps(big).encode()),
                                 headers={"content-type": "application/json"}) as r:
            raw = await r.aread()
        assert r.status_code == 413 and "max_body_mib" in json.loads(raw)["error"]["message"]
        assert "max_body_mib" in _anthropic_error(
            await post(client, s.url + "/messages", {**MESSAGES, "system": "y" * 20_000}), 413, "request_too_large")
        # a body under the limit goes through
        assert (await post(client, s.url + "/chat/completions", chat("small"))).status == 200
        assert s.sim.requests_total == 1


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe", b'{"model": "sim-model",'],
                         ids=["broken", "empty", "not-utf8", "cut"])
async def test_malformed_json_is_a_400(content):
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        message = _openai_error(await post(client, s.url + "/chat/completions", content=content), 400)
        assert "not JSON" in message
        _anthropic_error(await post(client, s.url + "/messages", content=content), 400, "invalid_request_error")
        assert s.sim.requests_total == 0 and not s.of(ev.SessionOpened)


@pytest.mark.parametrize("body", [[1, 2], "text", {"messages": []}, {"model": 7, "messages": []},
                                  {"model": "", "messages": []}], ids=["list", "string", "no-model", "model-7", "empty"])
async def test_a_body_that_is_not_a_request_is_a_400(body):
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        _openai_error(await post(client, s.url + "/chat/completions", body), 400)
        assert s.sim.requests_total == 0 and not s.of(ev.SessionOpened)


async def test_an_unknown_model_is_a_404_listing_the_served_ones():
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        message = _openai_error(await post(client, s.url + "/chat/completions", chat(model="gpt-9")), 404)
        assert "'gpt-9'" in message and "served: sim-model" in message and "model_map" in message
        message = _anthropic_error(await post(client, s.url + "/messages", {**MESSAGES, "model": "claude-x"}), 404,
                                   "not_found_error")
        assert "served: sim-model" in message
        assert s.sim.requests_total == 0 and not s.of(ev.SessionOpened)


async def test_model_map_globs_rewrite_the_model_sent_upstream():
    model_map = {"claude-*-haiku*": "sim-model", "claude-*": "sim-model", "gpt-5*": "sim-model"}
    async with served(sim={}, gateway={"model_map": model_map}) as s, httpx.AsyncClient(timeout=30) as client:
        for asked in ("claude-3-5-haiku-20241022", "gpt-5-codex"):
            answer = await post(client, s.url + "/chat/completions", chat(model=asked, stream=False),
                                headers={"X-Session-ID": asked})
            assert answer.status == 200
            assert s.sim.requests[-1]["model"] == "sim-model"
            [started] = s.of(ev.AgentStarted, asked)
            assert (started.model_asked, started.model_sent) == (asked, "sim-model")
        # the served name itself goes as it is, byte for byte
        await post(client, s.url + "/chat/completions", chat(stream=False), headers={"X-Session-ID": "plain"})
        [started] = s.of(ev.AgentStarted, "plain")
        assert (started.model_asked, started.model_sent) == ("sim-model", "sim-model")
        # a name no glob matches is still unknown
        _openai_error(await post(client, s.url + "/chat/completions", chat(model="llama-3")), 404)


async def test_the_model_override_sends_every_request_to_one_model():
    async with served(sim={}, model="sim-model") as s, httpx.AsyncClient(timeout=30) as client:
        for asked in ("claude-sonnet-4-5", "gpt-4o", "anything"):
            answer = await post(client, s.url + "/chat/completions", chat(model=asked), headers={"X-Session-ID": asked})
            assert answer.status == 200 and answer.text
            assert s.sim.requests[-1]["model"] == "sim-model"
            assert s.of(ev.AgentStarted, asked)[0].model_asked == asked
        # the rest of the body goes as the client sent it
        assert s.sim.requests[-1]["max_tokens"] == 6 and s.sim.requests[-1]["messages"] == chat()["messages"]


async def _raw_exchange(host: str, port: int, data: bytes, *, close_early: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        if close_early:
            return b""
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()


async def test_a_harness_sending_garbage_never_disturbs_another_sessions_stream():
    async with served(sim={"speed": 1.0, "tokens_per_s": 40}, gateway={"max_body_mib": 0.01}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: list[Answer] = []

        async def honest() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat("tell me", max_tokens=80),
                                      headers={"X-Session-ID": "honest"}))

        group.start_soon(honest)
        await until(lambda: s.of(ev.FirstToken, "honest"), "the honest session streaming")
        host, port = s.server.host, s.server.port
        not_http = await _raw_exchange(host, port, b"\x16\x03\x01\x02\x00 this is not HTTP at all\r\n\r\n")
        assert not_http.startswith(b"HTTP/1.1 400")
        outside = await _raw_exchange(host, port, b"GET /../../etc/passwd HTTP/1.1\r\nhost: x\r\n\r\n")
        assert outside.startswith(b"HTTP/1.1 400") and b"dot segment" in outside  # the one path rule (paths.py)
        # bodies cut short by clients that go away
        for path in (b"/v1/chat/completions", b"/v1/messages"):
            await _raw_exchange(host, port, b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n{",
                                close_early=True)
        for body, status in ((chat("x" * 20_000), 413), (chat(model="nope"), 404), ({"model": 1}, 400)):
            assert (await post(client, s.url + "/chat/completions", body)).status == status
        assert (await post(client, s.url + "/chat/completions", content=b"{]")).status == 400
        assert (await post(client, s.root + "/elsewhere", chat())).status == 404
        await until(lambda: answers, "the honest session's answer", timeout=30)
        [answer] = answers
        assert answer.status == 200 and answer.frames[-1] == b"data: [DONE]"
        assert len([d for d in answer.data if d["choices"] and d["choices"][0]["delta"].get("content")]) == 80
        assert not s.of(ev.AgentKilled)
        assert [o.agent for o in s.of(ev.SessionOpened)] == ["honest"]
        # and the gateway still serves
        assert (await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "later"})).status \
            == 200
