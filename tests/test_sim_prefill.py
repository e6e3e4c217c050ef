"""The simulator's prefill over real loopback HTTP: its rate, llama-server's prompt_progress, and two faults
(a wedged engine behind a live /health, a prompt preempted before its first token forever)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import SimServer
from tests.conftest import until

pytestmark = pytest.mark.anyio

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa ".split()


def prompt_of(tokens: int, salt: str = "") -> str:
    """A prompt of about `tokens` simulated tokens (4 characters each), unlike any other salt's."""
    text = salt + " " + " ".join(WORDS[i % len(WORDS)] + str(i) for i in range(tokens))
    return text[: tokens * 4]


def body(content: str, *, max_tokens: int = 4, stream: bool = True, **extra) -> dict:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], "stream": stream,
            "max_tokens": max_tokens, **extra}


def metric(text: str, name: str, **labels: str) -> float:
    want = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    found = re.search(rf"^{re.escape(name)}\{{{want}[^}}]*\}} (\S+)$", text, re.M)
    assert found, f"{name} {labels} not in metrics"
    return float(found[1])


def vllm_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("vllm:")]


async def scrape(client: httpx.AsyncClient, srv: SimServer) -> str:
    return (await client.get(srv.root_url + "/metrics")).text


async def stream_events(client: httpx.AsyncClient, url: str, payload: dict) -> list[str]:
    async with client.stream("POST", url, json=payload) as r:
        assert r.status_code == 200, await r.aread()
        return [line async for line in r.aiter_lines() if line]


def progress_of(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:])["prompt_progress"] for line in lines
            if line.startswith("data: {") and "prompt_progress" in line]


def contents(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("delta", {}).get("content"):
                    out.append(choice["delta"]["content"])
    return out


# ---- the prefill rate -----------------------------------------------------------------------------------

async def test_time_to_first_token_grows_with_uncached_prompt_tokens_at_the_rate():
    rate, speed = 20_000.0, 4.0
    settings = SimSettings(tokens_per_s=1000.0, ttft_s=0.0, prefill_tokens_per_s=rate, speed=speed)
    async with SimServer(settings) as srv, httpx.AsyncClient(timeout=30) as c:
        prefill_sums = []
        for tokens, salt in ((1000, "a"), (8000, "b"), (8000, "b")):  # the third: all of it cached
            r = await c.post(srv.base_url + "/chat/completions",
                             json=body(prompt_of(tokens, salt), max_tokens=1, stream=False))
            assert r.status_code == 200
            prefill_sums.append(metric(await scrape(c, srv), "vllm:request_prefill_time_seconds_sum"))
        short, long_, cached = (prefill_sums[0], prefill_sums[1] - prefill_sums[0],
                                prefill_sums[2] - prefill_sums[1])
        step = 1 / 1000.0 / speed  # the decode step that makes the first token
        # The sim reports real seconds: engine seconds over speed.
        assert (long_ - step) / (short - step) == pytest.approx(8.0, rel=0.02)
        assert long_ - step == pytest.approx(8000 / rate / speed, rel=0.02)
        assert cached < short  # a cached prefix is free: one token computed
        m = await scrape(c, srv)
        assert metric(m, "vllm:request_prefill_time_seconds_count") == 3
        assert metric(m, "vllm:time_to_first_token_seconds_count") == 3
        assert metric(m, "vllm:request_queue_time_seconds_count") == 3
        assert metric(m, "vllm:prompt_tokens_total") == pytest.approx(17_000, rel=0.01)


async def test_prefill_takes_real_time_at_the_rate():
    """The engine really waits: a long prompt's first byte is no earlier than its prefill allows."""
    settings = SimSettings(tokens_per_s=1000.0, ttft_s=0.0, prefill_tokens_per_s=10_000.0)
    async with SimServer(settings) as srv, httpx.AsyncClient(timeout=30) as c:
        loop = asyncio.get_running_loop()
        start = loop.time()
        r = await c.post(srv.base_url + "/chat/completions", json=body(prompt_of(4000), max_tokens=1, stream=False))
        assert r.status_code == 200
        assert loop.time() - start >= 0.9 * 4000 / 10_000.0


# ---- prompt_progress --------------------------------------------------------------------------------------

async def test_prompt_progress_rises_to_total_in_llama_server_chunks_only_when_asked():
    settings = SimSettings(tokens_per_s=1000.0, ttft_s=0.0, prefill_tokens_per_s=20_000.0,
                           progress_every_tokens=256)
    async with SimServer(settings) as srv, httpx.AsyncClient(timeout=30) as c:
        url = srv.base_url + "/chat/completions"
        text = prompt_of(3000, "p")
        lines = await stream_events(c, url, body(text, return_progress=True))
        events = progress_of(lines)
        total = events[0]["total"]
        assert total >= 2900
        assert [e["processed"] for e in events] == [*range(0, total, 256), total]
        assert {e["total"] for e in events} == {total} and {e["cache"] for e in events} == {0}
        times = [e["time_ms"] for e in events]
        assert times == sorted(times) and times[-1] >= 0.9 * 1000 * total / 20_000.0
        # llama-server's chunk: a chat.completion.chunk whose delta holds only the role, before any token
        first = json.loads(lines[0][6:])
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"] == [{"finish_reason": None, "index": 0,
                                     "delta": {"role": "assistant", "content": None}}]
        last_progress = max(i for i, line in enumerate(lines) if "prompt_progress" in line)
        assert not contents(lines[:last_progress]) and len(contents(lines)) == 4

        # The next turn extends the prompt: its cached prefix is reported, and processed starts there.
        longer = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"},
                  {"role": "user", "content": prompt_of(1000, "q")}]
        lines = await stream_events(c, url, {**body("", return_progress=True), "messages": longer})
        events = progress_of(lines)
        cache = events[0]["cache"]
        assert cache >= 2900 and events[0]["processed"] == cache
        assert events[-1]["processed"] == events[-1]["total"] > cache

        # Not asked, not streamed, or another API: never a progress chunk.
        assert progress_of(await stream_events(c, url, body(prompt_of(3000, "r")))) == []
        assert progress_of(await stream_events(c, url, body(prompt_of(3000, "s"), return_progress=False))) == []
        r = await c.post(url, json=body(prompt_of(3000, "t"), stream=False, return_progress=True))
        assert "prompt_progress" not in r.text
        responses = {"model": "sim-model", "input": prompt_of(3000, "u"), "stream": True, "return_progress": True}
        assert "prompt_progress" not in "".join(await stream_events(c, srv.base_url + "/responses", responses))


# ---- wedge_after_s -----------------------------------------------------------------------------------------

async def test_a_wedge_freezes_tokens_counters_and_kv_while_health_says_200():
    # 40 tokens/s: the wedge strikes after about 20 tokens of engine time; keep-alives (the HTTP side is
    # alive) are what the test waits on to know time went by.
    settings = SimSettings(tokens_per_s=40.0, ttft_s=0.0, speed=10.0, wedge_after_s=0.5, keepalive_s=0.2)
    async with SimServer(settings) as srv, httpx.AsyncClient(timeout=30) as c:
        url = srv.base_url + "/chat/completions"
        seen: list[str] = []

        async def read(payload: dict, into: list[str]) -> None:
            async with c.stream("POST", url, json=payload) as r:
                async for line in r.aiter_lines():
                    if line:
                        into.append(line)

        first = asyncio.create_task(read(body("wedge me", max_tokens=500), seen))
        await until(lambda: srv.state.wedged, "the engine wedged")
        frozen_tokens = srv.state.engine.generation_tokens_total
        assert 0 < frozen_tokens < 500
        frozen_metrics = vllm_lines(await scrape(c, srv))
        frozen_kv = srv.state.kv.usage
        assert frozen_kv > 0

        late: list[str] = []
        second = asyncio.create_task(read(body("and me", max_tokens=5), late))
        await until(lambda: seen[-3:] == [": keep-alive"] * 3 and late.count(": keep-alive") >= 3,
                    "keep-alives on both streams")
        assert len(contents(seen)) == frozen_tokens
        assert all(line == ": keep-alive" for line in late)  # accepted, and never answered
        assert srv.state.engine.generation_tokens_total == frozen_tokens
        assert srv.state.kv.usage == frozen_kv
        assert vllm_lines(await scrape(c, srv)) == frozen_metrics
        assert (await c.get(srv.root_url + "/health")).status_code == 200
        for task in (first, second):  # a client giving up changes nothing either
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        assert vllm_lines(await scrape(c, srv)) == frozen_metrics
        assert srv.state.kv.usage == frozen_kv


# ---- preempt_loop -------------------------------------------------------------------------------------------

async def test_a_preempt_loop_climbs_the_preemption_counter_and_never_makes_a_token():
    settings = SimSettings(tokens_per_s=1000.0, ttft_s=0.0, prefill_tokens_per_s=10_000.0,
                           preempt_loop_tokens=1000, keepalive_s=0.05)
    async with SimServer(settings) as srv, httpx.AsyncClient(timeout=30) as c:
        url = srv.base_url + "/chat/completions"
        seen: list[str] = []

        async def read() -> None:
            async with c.stream("POST", url, json=body(prompt_of(2000, "loop"), return_progress=True)) as r:
                async for line in r.aiter_lines():
                    if line:
                        seen.append(line)

        task = asyncio.create_task(read())
        waiting_seen: list[float] = []

        async def climbed() -> bool:
            m = await scrape(c, srv)
            waiting_seen.append(metric(m, "vllm:num_requests_waiting_by_reason", reason="capacity"))
            return metric(m, "vllm:num_preemptions_total") >= 4 and max(waiting_seen) == 1

        async def poll() -> None:
            while not await climbed():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), 30)
        m = await scrape(c, srv)
        # Each round prefills again: the prompt is computed once per preemption, never served from cache.
        assert metric(m, "cerevisor_sim:computed_prompt_tokens_total") >= 4 * 1900
        assert metric(m, "vllm:generation_tokens_total") == 0
        assert metric(m, "vllm:request_prefill_time_seconds_count") == 0
        assert not contents(seen)
        events = progress_of(seen)  # each round's progress starts again from nothing
        assert [e["processed"] for e in events].count(0) >= 4

        # A short prompt is not caught in it.
        r = await c.post(url, json=body("short one", max_tokens=3, stream=False))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ---- off by default -----------------------------------------------------------------------------------------

def test_faults_are_off_and_progress_is_llama_sized_by_default():
    s = SimSettings()
    assert (s.wedge_after_s, s.preempt_loop_tokens, s.progress_every_tokens) == (-1.0, -1, 256)
