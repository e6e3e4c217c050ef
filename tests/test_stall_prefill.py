"""Prefill progress as a sign of life: llama-server's prompt_progress (the simulator's, over loopback HTTP)
extends the first-byte deadline as far as the prefill's projected end, and progress that stands still for the
idle window is a kill that says so. The rule itself (contract/deadlines.py: prefill_look) on explicit numbers."""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract.deadlines import PREFILL_GRACE_S, PREFILL_SLACK, estimate_look, prefill_look
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from tests.conftest import chunk, http_head, read_request, sse_chunk

PROMPT_TOKENS = 6_000  # the simulator counts 4 characters a token
EXTENDED = re.compile(r"^prefill \d+%, [\d,]+ tok/s, about [\d.]+ s left$")
NO_RATE_YET = re.compile(r"^prefill 0%, no rate yet \(stuck after [\d.]+ s\)$")  # a look before its first batch


def prompt(tokens: int = PROMPT_TOKENS) -> str:
    return " ".join(f"w{i:05d}" for i in range(tokens * 4 // 7))[: tokens * 4]


def engine_for(url: str, stream_process: bool, *, progress: str = "on", first_byte_s: float = 0.5,
               idle_s: float = 5.0, model: str = "") -> Engine:
    return Engine(validate({
        "run": {"mode": "parallel", "max_concurrency": 1, "metrics_interval_s": 0.2},
        # the wedge rules off: a simulator wedged mid-prefill is a hung kernel too, and these tests are the prefill rule's
        "stall": {"first_byte_timeout_s": first_byte_s, "idle_timeout_s": idle_s, "extend_s": 0.5,
                  "max_extensions": 0, "wedge_timeout_s": 0},
        "endpoints": [{"name": "box", "base_url": url, "prompt_progress": progress, "model": model}],
        "agents": [{"name": "a0", "prompt": prompt(), "max_tokens": 5, "retries": 0}],
    }), stream_process=stream_process)


def story(seen: list) -> str:
    """The run's events but its tokens, each at its second since the first: what a failure shows."""
    return "\n".join(f"{e.t - seen[0].t:7.3f} {e!r}"[:300] for e in seen if e.kind not in ("TokenDelta", "ServerSample"))


def of(seen: list, kind: str) -> list:
    return [e for e in seen if e.kind == kind]


# ---- on the simulator ---------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_prefill_progress_extends_past_the_first_byte_deadline_and_completes(stream_process):
    # 6,000 tokens at 4,000 tok/s: a second and a half of prefill against a half-second first-byte deadline
    settings = SimSettings(tokens_per_s=200.0, ttft_s=0.0, prefill_tokens_per_s=4000.0, progress_every_tokens=256)
    async with SimServer(settings) as srv:
        engine = engine_for(srv.base_url, stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        code = await engine.run()
    assert code == 0 and not of(seen, "AgentKilled"), story(seen)
    extended = of(seen, "StallExtended")
    assert all(EXTENDED.match(e.reason) or NO_RATE_YET.match(e.reason) for e in extended), [e.reason for e in extended]
    assert any(EXTENDED.match(e.reason) for e in extended)
    assert all(e.deadline == "first_byte" and not e.by_operator for e in extended)
    # each extension goes only as far as the projection: well short of the idle window, never the extend_s step
    for e in extended:
        assert e.deadline_at - e.t < 5.0
    (first,) = of(seen, "FirstToken")
    assert first.ttft_s > 0.5
    progress = of(seen, "PrefillProgress")
    assert progress and progress[-1].processed == progress[-1].total >= PROMPT_TOKENS * 0.9
    assert [p.processed for p in progress] == sorted(p.processed for p in progress)
    assert any(p.rate_tok_s and 2000 < p.rate_tok_s < 8000 for p in progress)
    # the projection is the deadline: no warnings on the way to it (before the progress came, there may be)
    assert not [w for w in of(seen, "StallWarning") if w.t > extended[0].t]


@pytest.mark.anyio
async def test_frozen_prefill_progress_is_killed_after_the_idle_window_saying_so(stream_process):
    # The engine wedges half a second into the second-and-a-half prefill: progress stops about a third of the way.
    settings = SimSettings(tokens_per_s=200.0, ttft_s=0.0, prefill_tokens_per_s=4000.0, progress_every_tokens=256,
                           max_num_batched_tokens=512, wedge_after_s=0.5, keepalive_s=0.1)
    async with SimServer(settings) as srv:
        engine = engine_for(srv.base_url, stream_process, idle_s=1.5)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    (killed,) = of(seen, "AgentKilled")
    assert killed.deadline == "first_byte"
    assert re.match(r"^no prefill progress for 1\.\d+ s \(prefill \d+% of [\d,]+ prompt tokens\)$", killed.reason), \
        killed.reason
    progress = of(seen, "PrefillProgress")
    assert progress and progress[-1].processed < progress[-1].total
    assert of(seen, "StallExtended")  # it was given the projection while progress moved
    assert killed.t - progress[-1].t >= 1.5  # never before a whole idle window without progress


@pytest.mark.anyio
async def test_a_request_that_does_not_ask_for_progress_is_held_to_its_first_byte_deadline():
    # "auto" against a server that is not llama.cpp (the simulator answers /props 404, its metrics are vLLM's):
    # no return_progress, no prefill progress, the plain deadline
    settings = SimSettings(tokens_per_s=200.0, ttft_s=0.0, prefill_tokens_per_s=4000.0)
    async with SimServer(settings) as srv:
        engine = engine_for(srv.base_url, False, progress="auto")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    assert not of(seen, "PrefillProgress")
    (killed,) = of(seen, "AgentKilled")
    assert killed.reason.startswith("no first token after")


# ---- the rule, on explicit numbers -------------------------------------------------------------------------

def look(now: float, **kw):
    args = {"total": 10_000, "processed": 6_300, "rate_tok_s": 1_230.0, "advanced_at": 100.0, "idle_s": 60.0}
    return prefill_look(now=now, **{**args, **kw})


def test_progress_just_inside_the_idle_window_extends_and_just_outside_kills():
    inside = look(100.0 + 60.0 - 1e-6)
    assert inside.action == "extend"
    assert inside.deadline_at == pytest.approx(160.0)  # the projection has passed: up to the idle window, no more
    outside = look(160.0)
    assert outside.action == "kill"
    assert outside.reason == "no prefill progress for 60 s (prefill 63% of 10,000 prompt tokens)"


def test_the_extension_goes_as_far_as_the_projected_end_and_its_slack():
    eta = 3_700 / 1_230.0
    got = look(101.0)
    assert got.action == "extend"
    assert got.deadline_at == pytest.approx(100.0 + eta + max(PREFILL_GRACE_S, PREFILL_SLACK * eta))
    assert got.reason == f"prefill 63%, 1,230 tok/s, about {eta - 1.0:.3g} s left"
    # a long prefill: the slack is a share of what is left; an idle window shorter than that caps it
    slow = look(101.0, rate_tok_s=37.0)  # 100 s left
    assert slow.deadline_at == pytest.approx(160.0)
    assert slow.reason == "prefill 63%, 37 tok/s, about 99 s left"
    wide = look(101.0, rate_tok_s=37.0, idle_s=600.0)
    assert wide.deadline_at == pytest.approx(100.0 + 100.0 * (1 + PREFILL_SLACK))


def test_past_its_projection_or_without_a_rate_the_deadline_moves_in_steps_up_to_the_idle_window():
    frozen = look(130.0)  # the projection (about 103 s) passed, progress still 30 s ago: a step of 6 s
    assert (frozen.action, frozen.deadline_at) == ("extend", pytest.approx(136.0))
    assert frozen.reason == "prefill 63%, no progress for 30 s (stuck after 60 s)"
    near = look(157.0)
    assert near.deadline_at == pytest.approx(160.0)  # never past the idle window from the last progress
    no_rate = look(100.5, rate_tok_s=None)
    assert no_rate.action == "extend" and no_rate.reason == "prefill 63%, no rate yet (stuck after 60 s)"


def test_a_prefill_done_or_unknown_leaves_the_deadline_to_the_other_rules():
    assert look(101.0, processed=10_000).action == "none"
    assert look(101.0, total=0, processed=0).action == "none"
    assert look(1000.0, estimated=True).action == "none"  # an estimate never kills


# ---- llama.cpp, told by its /props ------------------------------------------------------------------------

class LlamaLike:
    """A loopback server that answers /props as llama-server does (or 404, as others do), records each chat
    request's body, and streams prompt_progress (whether asked or not, to see the engine read it only when it
    asked) over a prefill of 3,000 tokens (2,500 tok/s by its clock, a little faster on the wall: 0.9 s, past a
    first-byte deadline of 0.5 s), then three tokens."""

    def __init__(self, *, llama: bool) -> None:
        self.llama = llama
        self.bodies: list[dict] = []
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> LlamaLike:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                path = request.split(b" ", 2)[1]
                if path == b"/props" and self.llama:
                    props = json.dumps({"default_generation_settings": {"n_ctx": 8192}, "total_slots": 1}).encode()
                    writer.write(http_head(200, "application/json", length=len(props)) + props)
                elif path == b"/health":
                    writer.write(http_head(200, "application/json", length=2) + b"{}")
                elif path.endswith(b"/chat/completions"):
                    self.bodies.append(json.loads(request.split(b"\r\n\r\n", 1)[1]))
                    await self.stream(writer)
                    return
                else:
                    writer.write(http_head(404, "text/plain", length=0))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(http_head(200, "text/event-stream"))
        role = {"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}
        for step in range(4):  # 0, 1,000, 2,000, 3,000 of 3,000
            progress = {"total": 3000, "cache": 0, "processed": 1000 * step, "time_ms": 400 * step}
            writer.write(chunk(b"data: " + json.dumps({"choices": [role], "prompt_progress": progress}).encode()
                               + b"\n\n"))
            await writer.drain()
            if step:  # the server's prefill, as it paces it (its first batch done at once, measured by its clock)
                await asyncio.sleep(0.3)
        for word in ("one ", "two ", "three"):
            writer.write(chunk(sse_chunk(word)))
        writer.write(chunk(sse_chunk("", finish="stop")) + chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()


@pytest.mark.anyio
async def test_a_llama_server_told_by_its_props_is_asked_for_progress_that_carries_its_prefill(stream_process):
    async with LlamaLike(llama=True) as srv:
        engine = engine_for(srv.base_url, stream_process, progress="auto", model="m")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert srv.bodies[0]["return_progress"] is True
    extended = of(seen, "StallExtended")
    assert all(EXTENDED.match(e.reason) for e in extended)
    assert any("2,500 tok/s" in e.reason for e in extended)
    assert [(p.processed, p.total) for p in of(seen, "PrefillProgress")][-1] == (3000, 3000)
    (done,) = of(seen, "TurnFinished")
    assert done.completion_tokens == 3 and done.ttft_s > 0.5  # progress is no token


@pytest.mark.anyio
async def test_a_server_whose_props_are_not_llamas_is_not_asked():
    async with LlamaLike(llama=False) as srv:
        engine = engine_for(srv.base_url, False, progress="auto", first_byte_s=30.0, model="m")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert "return_progress" not in srv.bodies[0]
    assert not of(seen, "StallExtended")


# ---- a server that tells no progress: the estimate -------------------------------------------------------

def estimate(now: float, alive: bool = True):
    # 9,000 tokens to prefill at 1,000 tok/s from 100: its projected end at 109, its slack to 111.25
    return estimate_look(now=now, sent_at=100.0, total=10_000, cached=1_000, rate_tok_s=1_000.0, alive=alive)


def test_an_estimated_prefill_is_extended_while_plausible_and_the_server_shows_life():
    inside = estimate(111.25 - 1e-6)
    assert (inside.action, inside.deadline_at) == ("extend", pytest.approx(111.25))
    assert inside.reason == "prefill ~99% (est.), 1,000 tok/s measured, about 0 s left, KV use climbing"
    early = estimate(104.0)
    assert early.reason == "prefill ~50% (est.), 1,000 tok/s measured, about 5 s left, KV use climbing"
    assert estimate(111.25).action == "none"  # past its plausible end: the other rules decide
    assert estimate(104.0, alive=False).action == "none"  # no life (KV use flat): nothing to go by
    assert estimate_look(now=104.0, sent_at=100.0, total=1_000, cached=1_000, rate_tok_s=1_000.0,
                         alive=True).action == "none"  # all of it cached: its first token is due


def test_kv_use_climbing_is_judged_against_the_sample_before_the_last_look():
    from cerevisor_tui.engine.connections import Connections
    from cerevisor_tui.engine.monitor import ServerMonitor

    config = validate({"endpoints": [{"name": "box", "base_url": "http://127.0.0.1:9/v1"}],
                       "agents": [{"name": "a", "prompt": "p"}]})
    monitor = ServerMonitor(config, Connections(config, lambda e: None), lambda e: None, lambda endpoint: None)
    assert not monitor.kv_climbed("box", 0.0)  # never sampled
    for at, usage in ((1.0, 0.20), (2.0, 0.20), (3.0, 0.25)):
        monitor.kv_seen.setdefault("box", deque()).append((at, usage))
    assert monitor.kv_climbed("box", 2.0)  # 0.20 by then, 0.25 since
    assert not monitor.kv_climbed("box", 3.0)  # nothing since
    monitor.kv_seen["box"].append((4.0, 0.25))
    assert not monitor.kv_climbed("box", 3.0)  # flat since the last look: a wedged engine's KV
    assert monitor.kv_climbed("box", 0.5)  # no sample by then: against the first since


def test_other_requests_decoding_or_prefill_tokens_moving_are_signs_of_life_too():
    from cerevisor_tui.contract.deadlines import estimate_look
    from cerevisor_tui.engine.connections import Connections
    from cerevisor_tui.engine.monitor import ServerMonitor

    config = validate({"endpoints": [{"name": "box", "base_url": "http://127.0.0.1:9/v1"}],
                       "agents": [{"name": "a", "prompt": "p"}]})
    monitor = ServerMonitor(config, Connections(config, lambda e: None), lambda e: None, lambda endpoint: None)
    assert monitor.shows_life("box", 0.0) == ""  # never sampled
    # KV use flat (a prompt's KV reserved at admission), tokens generated by the server's other requests
    for at, generated, prefill in ((1.0, 100.0, None), (2.0, 100.0, None), (3.0, 140.0, None)):
        monitor.kv_seen.setdefault("box", deque()).append((at, 0.5))
        monitor.counters_seen.setdefault("box", deque()).append((at, generated, prefill))
    assert monitor.shows_life("box", 2.0) == "other requests decoding"  # 100 by then, 140 since
    assert monitor.shows_life("box", 3.0) == ""  # nothing since: a frozen engine
    monitor.counters_seen["box"].append((4.0, 140.0, 2_000.0))
    monitor.counters_seen["box"].append((5.0, 140.0, 2_512.0))
    assert monitor.shows_life("box", 4.0) == "prefill tokens moving"  # SGLang's prefill_compute counter
    monitor.counters_seen["box"].append((6.0, 140.0, 2_512.0))
    assert monitor.shows_life("box", 5.0) == ""  # both flat since the last look
    look = estimate_look(now=104.0, sent_at=100.0, total=10_000, cached=0, rate_tok_s=1_000.0,
                         alive="other requests decoding")
    assert look.reason == "prefill ~40% (est.), 1,000 tok/s measured, about 6 s left, other requests decoding"


@pytest.mark.anyio
async def test_on_a_server_without_progress_the_measured_rate_gives_an_estimate():
    # a0's completed request measures the endpoint's prefill rate; a1's longer prompt, sent after it, is estimated
    # (when it is sent: 0.25 s and 0.5 s of prefill are as good as any)
    settings = SimSettings(tokens_per_s=200.0, ttft_s=0.0, prefill_tokens_per_s=16000.0)
    async with SimServer(settings) as srv:
        engine = Engine(validate({
            "run": {"mode": "sequential", "metrics_interval_s": 0.2},
            "stall": {"first_byte_timeout_s": 30.0},
            "endpoints": [{"name": "box", "base_url": srv.base_url}],
            "agents": [{"name": "a0", "prompt": prompt(4000), "max_tokens": 2},
                       {"name": "a1", "prompt": prompt(8000), "max_tokens": 2, "depends_on": ["a0"]}],
        }))
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert not [e for e in of(seen, "PrefillProgress") if e.agent == "a0"]  # nothing measured yet
    (est,) = [e for e in of(seen, "PrefillProgress") if e.agent == "a1"]
    assert est.estimated and est.total == pytest.approx(8000, rel=0.05)
    (a0,) = [e for e in of(seen, "TurnFinished") if e.agent == "a0"]
    assert est.rate_tok_s == pytest.approx(a0.prompt_tokens / a0.ttft_s, rel=0.01)
