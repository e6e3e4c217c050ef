"""Every faulty answer a server can give becomes a per-agent error naming the endpoint and the problem,
and the rest of the run goes on (raw socket servers on loopback, through the whole engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.engine.engine import Engine
from tests.conftest import RawServer, chunk, http_head, sse_chunk

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def good(reader, writer):
    writer.write(http_head(200, "text/event-stream"))
    for word in ("alpha ", "beta ", "gamma"):
        writer.write(chunk(sse_chunk(word)))
    writer.write(chunk(sse_chunk("", finish="stop") + sse_chunk(usage=USAGE) + b"data: [DONE]\n\n") + chunk(b""))
    await writer.drain()


def respond(status: int, ctype: str, body: bytes, extra: str = ""):
    async def handler(reader, writer):
        writer.write(http_head(status, ctype, extra, len(body)) + body)
        await writer.drain()
    return handler


def stream_then(raw: bytes, *, close: bool = True):
    async def handler(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + raw) + (chunk(b"") if close else b""))
        await writer.drain()
        if not close:
            await asyncio.sleep(30)
    return handler


async def reset_mid_stream(reader, writer):
    writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + sse_chunk("two ")))
    await writer.drain()
    writer.transport.abort()


VLLM_ERR = json.dumps({"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens",
                                 "type": "BadRequestError", "param": None, "code": 400}}).encode()
FAULTS = {
    "400 context too long": (respond(400, "application/json", VLLM_ERR), "HTTP 400", "maximum context length is 2048"),
    "401": (respond(401, "application/json", b'{"error": {"message": "Incorrect API key provided"}}'), "HTTP 401", "Incorrect API key"),
    "404 model": (respond(404, "application/json", b'{"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "code": 404}}'), "HTTP 404", "does not exist"),
    "429 retry-after": (respond(429, "application/json", b'{"error": {"message": "Too many requests"}}', "retry-after: 0\r\n"), "HTTP 429", "Retry-After 0 s"),
    "500": (respond(500, "text/plain", b"Internal Server Error"), "HTTP 500", "Internal Server Error"),
    "503": (respond(503, "application/json", b'{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}'), "HTTP 503", "Loading model"),
    "html body": (respond(200, "text/html", b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"), "instead of an event stream", "502 Bad Gateway"),
    "html error page": (respond(502, "text/html", b"<html><head><title>502 Bad Gateway</title></head></html>"), "HTTP 502", "502 Bad Gateway"),
    "malformed json": (stream_then(b'data: {"id": broken\n\n'), "malformed JSON", "broken"),
    "mid-stream error (vLLM new shape)": (stream_then(b'data: {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}\n\n'), "server error in stream", "engine dead"),
    "mid-stream error (vLLM old shape)": (stream_then(b'data: {"object": "error", "message": "boom old", "type": "BadRequestError", "code": 400}\n\n'), "server error in stream", "boom old"),
    "end without DONE": (stream_then(b""), "ended without [DONE]", "after 1 tokens"),
    "reset mid-stream": (reset_mid_stream, "connection lost", "after 2 tokens"),
    "invalid utf-8": (stream_then(b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n'), "not valid UTF-8", ""),
    "one endless line": (stream_then(b"data: " + b"x" * (1 << 20) + b"yyyy", close=False), "exceeds 1 MiB", ""),
}


def config_for(bad_url: str, good_url: str, retries: int = 0):
    return validate({
        "run": {"mode": "parallel", "max_concurrency": 4},
        "stall": {"idle_timeout_s": 5, "first_byte_timeout_s": 5},
        "endpoints": [
            {"name": "flaky", "base_url": bad_url, "kind": "hosted", "model": "m"},
            {"name": "steady", "base_url": good_url, "kind": "hosted", "model": "m"},
        ],
        "agents": [
            {"name": "victim", "endpoint": "flaky", "prompt": "hi", "retries": retries},
            {"name": "bystander", "endpoint": "steady", "prompt": "hi", "turns": ["more"]},
        ],
    })


@pytest.mark.anyio
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_fault_is_a_clear_per_agent_error(fault, stream_process):
    handler, phrase, detail = FAULTS[fault]
    async with RawServer(handler) as bad, RawServer(good) as ok:
        engine = Engine(config_for(bad.base_url, ok.base_url), stream_process=stream_process)
        code = await engine.run()
    victim, bystander = engine.agents["victim"], engine.agents["bystander"]
    assert code == 1
    assert victim.status == "failed"
    assert victim.error.startswith("endpoint flaky: "), victim.error
    assert phrase in victim.error and detail in victim.error, victim.error
    assert "Traceback" not in victim.error
    assert bystander.status == "completed" and bystander.output == "alpha beta gamma"


@pytest.mark.anyio
async def test_retryable_faults_are_retried_and_others_are_not(stream_process):
    async with RawServer(respond(500, "text/plain", b"oops")) as s500, RawServer(respond(401, "text/plain", b"no")) as s401:
        engine = Engine(config_for(s500.base_url, s401.base_url, retries=2), stream_process=stream_process)
        engine.config.agents[1].retries = 2
        retrying = []
        engine.subscribe(lambda e: retrying.append(e.agent) if e.kind == "AgentRetrying" else None)
        await engine.run()
    assert s500.requests == 3 and retrying.count("victim") == 2
    assert s401.requests == 1 and "bystander" not in retrying


@pytest.mark.anyio
async def test_usage_chunk_counts_and_text_are_reported(stream_process):
    async with RawServer(good) as ok:
        engine = Engine(config_for(ok.base_url, ok.base_url), stream_process=stream_process)
        assert await engine.run() == 0
    report = engine.report.to_dict()
    victim = next(a for a in report["agents"] if a["name"] == "victim")
    assert victim["completion_tokens"] == 3 and victim["prompt_tokens"] == 5 and victim["turns"] == 1
    bystander = next(a for a in report["agents"] if a["name"] == "bystander")
    assert bystander["completion_tokens"] == 6 and bystander["turns"] == 2
