"""Prefill progress through the gateway: toward a llama-shaped upstream the gateway asks for prompt_progress,
which its watchdog reads as the prefill's sign of life; a client that did not ask for it never sees a
prompt_progress frame, and a client that asked sees them all."""

from __future__ import annotations

import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.sim import SimServer

from .conftest import chat, post, served, sim_endpoint

pytestmark = pytest.mark.anyio

# 4,000 prompt tokens at 4,000 tok/s: a second of prefill, against a first-byte deadline of half that
PREFILL = SimSettings(speed=1.0, prefill_tokens_per_s=4000.0, progress_every_tokens=256, ttft_s=0.0,
                      tokens_per_s=200.0)
LONG = " ".join(f"w{i:05d}" for i in range(2300))[:16_000]
STALL = {"first_byte_timeout_s": 0.5, "idle_timeout_s": 5.0, "extend_when_server_busy": False}


def progress_frames(answer) -> list[dict]:
    return [d["prompt_progress"] for d in answer.data if isinstance(d, dict) and "prompt_progress" in d]


async def test_a_client_that_did_not_ask_never_sees_prompt_progress_and_its_prefill_outlives_the_deadline():
    async with SimServer(PREFILL) as srv, \
            served(endpoints=[sim_endpoint(srv.base_url, prompt_progress="on")], stall=STALL) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(LONG, max_tokens=4),
                            headers={"X-Session-ID": "quiet"})
        assert answer.status == 200
        assert b"prompt_progress" not in answer.raw
        assert answer.data[0]["choices"][0]["delta"]["role"] == "assistant"  # the role-only chunk it also was
        assert len(answer.text) > 0 and answer.raw.rstrip().endswith(b"data: [DONE]")
        assert not s.of(ev.AgentKilled, "quiet")
        progress = s.of(ev.PrefillProgress, "quiet")
        assert progress and progress[-1].processed == progress[-1].total > 3500
        extended = s.of(ev.StallExtended, "quiet")
        assert extended and all(e.reason.startswith("prefill ") for e in extended)


async def test_a_client_that_asked_sees_every_prompt_progress_frame():
    async with SimServer(PREFILL) as srv, \
            served(endpoints=[sim_endpoint(srv.base_url, prompt_progress="on")], stall=STALL) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(LONG, max_tokens=4, return_progress=True),
                            headers={"X-Session-ID": "asks"})
        assert answer.status == 200
        frames = progress_frames(answer)
        total = frames[-1]["total"]
        assert [f["processed"] for f in frames] == [*range(0, total, 256), total]
        assert s.of(ev.PrefillProgress, "asks")


async def test_without_prompt_progress_on_the_endpoint_the_request_goes_as_the_client_sent_it():
    async with SimServer(PREFILL) as srv, \
            served(endpoints=[sim_endpoint(srv.base_url, prompt_progress="off")], stall=STALL) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(LONG, max_tokens=4),
                            headers={"X-Session-ID": "plain"})
        # held to its plain first-byte deadline: the stream (begun with keep-alives) ends with an error event
        assert b"first_byte deadline (no first token after" in answer.raw and b"prompt_progress" not in answer.raw
        assert not s.of(ev.PrefillProgress, "plain")
        [killed] = s.of(ev.AgentKilled, "plain")
        assert killed.reason.startswith("no first token after")
