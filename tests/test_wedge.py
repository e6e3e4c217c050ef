"""Wedged servers (engine/wedge.py): each rule just inside and just outside its threshold on explicit sequences
of /metrics readings, the readings as real scraped metrics give them, and end to end on the simulator over
loopback: a wedged engine caught long before the first-byte deadline, an honest long prefill left alone, a
preemption loop ended with Auto's cap lowered, and a wedged pool member marked down and left."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.metrics import ServerStatus, combine, parse_metrics
from cerevisor_tui.engine.auto import AutoController
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.engine.wedge import (
    Progress,
    decode_stalled,
    engine_frozen,
    preempt_loop,
    prefill_end,
    progress_of,
    still_for,
)
from cerevisor_tui.sim import SimServer

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def readings(until_t: float, *, moving_until: float, every: float = 2.0, **fields: float) -> list[Progress]:
    """A reading every `every` s from 0 to `until_t`: the token counters climb until `moving_until`, then stand."""
    out = []
    t = 0.0
    while t <= until_t + 1e-9:
        n = min(t, moving_until)
        out.append(
            Progress(
                t, True, generated=10 * n, prompt_tokens=100 * n, kv_usage=0.5, preemptions=0.0, **fields
            )
        )
        t += every
    return out


# ---- engine frozen ---------------------------------------------------------------------------------------


def test_a_frozen_engine_is_wedged_once_nothing_moved_for_the_threshold_while_our_request_was_open():
    # moving until 10 s, then still: at 54 s it stood still 44 s, at 56 s 46 s
    assert engine_frozen(readings(54, moving_until=10), since=0.0, threshold_s=45) is None
    assert (
        engine_frozen(readings(56, moving_until=10), since=0.0, threshold_s=45)
        == "server wedged: no progress on any request for 46 s"
    )
    # counted from our request's sending: an idle server's stillness before it is no wedge
    assert engine_frozen(readings(56, moving_until=10), since=12.0, threshold_s=45) is None
    assert (
        engine_frozen(readings(58, moving_until=10), since=12.0, threshold_s=45)
        == "server wedged: no progress on any request for 46 s"
    )
    assert still_for(readings(58, moving_until=10), since=12.0) == 46


def test_a_still_engine_is_no_wedge_while_an_open_prefill_may_honestly_still_run():
    # the case: 1,400 tokens at 20 tok/s, one unchunked step of 70 s sent at 10 s: nothing moves after it
    end = prefill_end(10.0, 1400, 0, 20.0)
    assert end == 10.0 + 2 * 70.0
    assert engine_frozen(readings(56, moving_until=10), since=10.0, threshold_s=45) is not None  # killed at 45 s
    assert engine_frozen(readings(56, moving_until=10), since=10.0, threshold_s=45, step_until=end) is None
    assert engine_frozen(readings(148, moving_until=10), since=10.0, threshold_s=45, step_until=end) is None
    assert engine_frozen(readings(150, moving_until=10), since=10.0, threshold_s=45, step_until=end) == (
        "server wedged: no progress on any request for 140 s")  # past twice its projection: frozen after all
    # what the prefix cache holds is not computed; with nothing measured or nothing to compute, no allowance
    assert prefill_end(10.0, 1400, 1000, 20.0) == 10.0 + 2 * 20.0
    assert prefill_end(10.0, 1400, 1400, 20.0) == -math.inf
    assert prefill_end(10.0, 1400, 0, None) == prefill_end(10.0, 1400, 0, 0.0) == -math.inf


def test_any_motion_is_progress_kv_use_preemptions_or_prefill_chunks():
    frozen = readings(60, moving_until=0)
    assert engine_frozen(frozen, 0.0, 45) is not None
    for field in ("kv_usage", "preemptions", "prefill_tokens"):
        moved = [
            Progress(
                s.t, True, generated=0.0, prompt_tokens=0.0, kv_usage=0.5, preemptions=0.0, prefill_tokens=0.0
            )
            for s in frozen
        ]
        last = moved[-2]
        moved[-2] = Progress(**{**{k: getattr(last, k) for k in last.__slots__}, field: 1.0})
        assert engine_frozen(moved, 0.0, 45) is None, field  # it moved 2 s before the end


def test_a_frozen_engine_needs_a_healthy_server_with_counters_and_a_threshold():
    frozen = readings(60, moving_until=0)
    down = [*frozen[:-1], Progress(60.0, False, generated=0.0, prompt_tokens=0.0, kv_usage=0.5)]
    assert engine_frozen(down, 0.0, 45) is None  # a server that says it is down is the health check's to tell
    silent = [Progress(s.t, True, kv_usage=0.5) for s in frozen]
    assert engine_frozen(silent, 0.0, 45) is None  # no token counters: nothing to judge by
    assert engine_frozen(frozen, 0.0, 0) is None  # off
    assert engine_frozen([], 0.0, 45) is None


# ---- a hung kernel -----------------------------------------------------------------------------------------


def test_requests_running_and_nothing_generated_for_the_idle_deadline_is_a_hung_kernel():
    def hung(until_t: float, **over: float) -> list[Progress]:
        out = []
        for i in range(int(until_t // 2) + 1):
            fields = {
                "running": 3.0,
                "generated": 500.0,
                "prompt_tokens": 900.0,
                "kv_usage": 0.4,
                "preemptions": float(i),
            } | over  # preemptions move: the frozen rule says nothing
            out.append(Progress(2.0 * i, True, **fields))
        return out

    assert engine_frozen(hung(70), 0.0, 45) is None
    assert decode_stalled(hung(58), 0.0, 60) is None
    assert (
        decode_stalled(hung(60), 0.0, 60)
        == "server wedged: 3 requests running, no token generated server-wide for 60 s (a hung kernel?)"
    )
    assert decode_stalled(hung(70), 20.0, 60) is None  # from our request's sending
    assert decode_stalled(hung(70, running=0.0), 0.0, 60) is None  # nothing running: an idle server


def test_a_long_honest_prefill_is_no_hung_kernel_while_kv_use_climbs():
    climbing = [
        Progress(2.0 * i, True, running=1.0, generated=0.0, prompt_tokens=0.0, kv_usage=0.01 * i)
        for i in range(40)
    ]
    assert decode_stalled(climbing, 0.0, 60) is None
    # KV use stops climbing at 20 s: the window starts there
    level = [
        Progress(s.t, True, running=1.0, generated=0.0, prompt_tokens=0.0, kv_usage=min(s.kv_usage, 0.1))
        for s in climbing
    ]
    assert decode_stalled(level, 0.0, 60) is None  # 58 s since 20 s
    assert (
        decode_stalled(
            [*level, Progress(80.0, True, running=1.0, generated=0.0, prompt_tokens=0.0, kv_usage=0.1)],
            0.0,
            60,
        )
        is not None
    )


# ---- a preemption loop --------------------------------------------------------------------------------------


def loop(count: int, *, waiting: float = 1.0) -> list[Progress]:
    """Preempted twice between readings before our request was sent at 10 s, then once per reading."""
    out = [
        Progress(float(t), True, waiting_capacity=0.0, generated=0.0, preemptions=t * 0.4) for t in (0, 5, 10)
    ]
    before = 4.0
    for i in range(1, count + 1):
        out.append(
            Progress(10.0 + 3 * i, True, waiting_capacity=waiting, generated=0.0, preemptions=before + i)
        )
    return out


def test_a_request_preempted_limit_times_before_its_first_token_is_a_preemption_loop():
    assert preempt_loop(loop(5), 10.0, 6, 41_200) is None
    assert (
        preempt_loop(loop(6), 10.0, 6, 41_200)
        == "KV cache too small for this prompt (41,200 tokens): preempted 6 times"
    )
    assert preempt_loop(loop(6), 10.0, 6, 0) == "KV cache too small for this prompt: preempted 6 times"
    # counted from the last reading before it was sent: sent at 3 s, from the reading at 0 s
    assert preempt_loop(loop(4), 10.0, 6, 1) is None
    assert (
        preempt_loop(loop(4), 3.0, 6, 1) == "KV cache too small for this prompt (1 tokens): preempted 8 times"
    )
    assert preempt_loop(loop(9, waiting=0.0), 10.0, 6, 1) is None  # nothing waits for KV room: not this
    assert preempt_loop(loop(9), 10.0, 0, 1) is None  # off
    restarted = [*loop(6), Progress(40.0, True, waiting_capacity=1.0, generated=0.0, preemptions=1.0)]
    assert preempt_loop(restarted, 10.0, 6, 1) is None  # the counter went back: the server restarted


# ---- readings from real scraped metrics ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "generated", "prompt", "waiting", "preemptions"),
    [
        ("vllm-0.32-pressure", 14501.0, 180.0, 4.0, 4.0),
        ("vllm-0.32-running", 1998.0, 3371.0, 0.0, 0.0),
        ("llamacpp-busy", 232.0, 136.0, 2.0, None),  # its decode calls; its deferred requests
        ("sglang-docs-llama-3.1-8b", 7557572.0, 8128902.0, None, None),
    ],
)
def test_a_reading_takes_the_counters_each_server_kind_moves(
    fixture, generated, prompt, waiting, preemptions
):
    metrics = parse_metrics((FIXTURES / f"{fixture}.txt").read_text())
    reading = progress_of(ServerStatus("http://box/v1", True, 200, metrics=metrics), 5.0)
    assert reading is not None and reading.healthy
    assert (reading.generated, reading.prompt_tokens, reading.preemptions) == (generated, prompt, preemptions)
    if waiting is not None:
        assert reading.waiting_capacity == waiting
    assert progress_of(ServerStatus("http://box/v1", True, 200), 5.0) is None  # no metrics: nothing to judge
    assert (
        progress_of(ServerStatus("http://box/v1", True, 503, loading=True, metrics=metrics), 5.0).healthy
        is False
    )


# ---- end to end on the simulator --------------------------------------------------------------------------


def engine_for(
    url: str | list[str], *, agents: list[dict], first_byte_s: float = 600.0, **stall: float
) -> Engine:
    urls = [url] if isinstance(url, str) else url
    names = ["box"] if len(urls) == 1 else [f"box{i}" for i in range(len(urls))]
    return Engine(
        validate(
            {
                "run": {
                    "mode": "parallel",
                    "max_concurrency": 4,
                    "metrics_interval_s": 0.2,
                    **stall.pop("run", {}),
                },
                "stall": {
                    "first_byte_timeout_s": first_byte_s,
                    "idle_timeout_s": 600.0,
                    "warn_at": [0.9],
                    **stall,
                },
                "endpoints": [{"name": n, "base_url": u} for n, u in zip(names, urls, strict=True)],
                **({"pools": [{"name": "fleet", "endpoints": names}]} if len(urls) > 1 else {}),
                "agents": agents,
            }
        )
    )


def prompt_of(tokens: int) -> str:
    return " ".join(f"w{i}" for i in range(tokens))[: tokens * 4]  # the simulator counts 4 characters a token


def of(seen: list[ev.Event], kind: type[ev.Event]) -> list:
    return [e for e in seen if isinstance(e, kind)]


@pytest.mark.anyio
async def test_a_wedged_engine_is_caught_long_before_the_first_byte_deadline_and_told_everywhere(tmp_path):
    settings = SimSettings(wedge_after_s=0.0, tokens_per_s=50, ttft_s=0.05)
    async with SimServer(settings) as srv:
        engine = engine_for(
            srv.base_url,
            agents=[{"name": f"a{i}", "prompt": "hi", "retries": 0} for i in range(2)],
            wedge_timeout_s=1.0,
        )
        seen: list[ev.Event] = []
        out = io.StringIO()
        engine.subscribe(seen.append)
        engine.subscribe(Printer(out))
        assert await engine.run() == 1
    wedged = of(seen, ev.ServerWedged)
    assert len(wedged) == 1 and wedged[0].rule == "frozen" and sorted(wedged[0].agents) == ["a0", "a1"]
    assert wedged[0].reason.startswith("server wedged: no progress on any request for ")
    killed = of(seen, ev.AgentKilled)
    assert sorted(k.agent for k in killed) == ["a0", "a1"]
    assert all(k.deadline == "wedge" and k.reason == wedged[0].reason for k in killed)
    assert not of(seen, ev.StallWarning)  # the 600 s first-byte window never came near
    # the agents were shown wedged, and end with the wedge's reason, not a deadline's
    assert {e.agent for e in of(seen, ev.AgentStatus) if e.status == "wedged"} == {"a0", "a1"}
    assert {e.error for e in of(seen, ev.AgentFinished)} == {wedged[0].reason}
    report = engine.report.to_dict()
    assert [w["rule"] for w in report["endpoints"][0]["wedges"]] == ["frozen"]
    assert all(
        a["kills"] == [{"attempt": 1, "deadline": "wedge", "reason": wedged[0].reason}]
        for a in report["agents"]
    )
    assert f"box: WEDGED (frozen): {wedged[0].reason}; killed " in out.getvalue()
    assert f"a0: KILLED: {wedged[0].reason}" in out.getvalue()
    assert ev.decode_event(ev.encode_event(wedged[0])) == wedged[0]  # as the journal and --jsonl carry it


@pytest.mark.anyio
async def test_an_honest_prefill_longer_than_the_threshold_is_left_alone():
    # 5,000 tokens at 2,000 tokens/s in 512-token chunks: 2.5 s of prefill against a 1 s threshold
    settings = SimSettings(tokens_per_s=50, ttft_s=0.0, prefill_tokens_per_s=2000, max_num_batched_tokens=512)
    async with SimServer(settings) as srv:
        engine = engine_for(
            srv.base_url,
            agents=[{"name": "a", "prompt": prompt_of(5000), "max_tokens": 4, "retries": 0}],
            wedge_timeout_s=1.0,
        )
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert not of(seen, ev.ServerWedged) and not of(seen, ev.AgentKilled)
    first = of(seen, ev.FirstToken)[0]
    assert first.ttft_s > 2 * 1.0  # it really outlived the threshold


@pytest.mark.anyio
async def test_an_unchunked_prefill_longer_than_the_threshold_is_left_alone_at_the_endpoints_measured_rate():
    # 50 tok/s at 10x speed: the short prompt's turn measures the rate; the long one is a single step of 1,400
    # tokens (unchunked: under max_num_batched_tokens), 2.8 s in which nothing moves, against a 1 s threshold
    settings = SimSettings(speed=10, tokens_per_s=50, ttft_s=0.0, prefill_tokens_per_s=50)
    async with SimServer(settings) as srv:
        engine = engine_for(
            srv.base_url,
            agents=[{"name": "short", "prompt": prompt_of(100), "max_tokens": 2, "retries": 0},
                    {"name": "long", "prompt": prompt_of(1400), "max_tokens": 2, "retries": 0,
                     "depends_on": ["short"]}],
            wedge_timeout_s=1.0,
        )
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert not of(seen, ev.ServerWedged) and not of(seen, ev.AgentKilled)
    [first] = [e for e in of(seen, ev.FirstToken) if e.agent == "long"]
    assert first.ttft_s > 2 * 1.0  # it really outlived the threshold, with nothing moving


@pytest.mark.anyio
async def test_a_preemption_loop_is_ended_with_its_prompt_named_and_auto_lowers_the_cap():
    settings = SimSettings(tokens_per_s=50, ttft_s=0.0, prefill_tokens_per_s=20_000, preempt_loop_tokens=2000)
    async with SimServer(settings) as srv:
        agents = [
            {"name": "big", "prompt": prompt_of(3000), "max_tokens": 4, "retries": 0},
            *({"name": f"s{i}", "prompt": prompt_of(200), "max_tokens": 4, "retries": 0} for i in range(3)),
        ]
        engine = engine_for(
            srv.base_url, agents=agents, preempt_limit=3, run={"mode": "auto", "auto": {"start_cap": 4}}
        )
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    wedged = of(seen, ev.ServerWedged)
    assert [(w.rule, w.agents) for w in wedged] == [("preempt_loop", ["big"])]
    # its size at the endpoint's tokens per character (measured on the others' turns, else 4 characters a token)
    size = re.fullmatch(
        r"KV cache too small for this prompt \(([\d,]+) tokens\): preempted 3 times", wedged[0].reason
    )
    assert size and 2900 <= int(size[1].replace(",", "")) <= 3300, wedged[0].reason
    assert {e.agent: e.status for e in of(seen, ev.AgentFinished)} == {
        "big": "killed",
        "s0": "completed",
        "s1": "completed",
        "s2": "completed",
    }
    # Auto backs off from the preemptions themselves; the loop's end halves what is left (the test below)
    caps = [c.effective_cap for c in of(seen, ev.ConcurrencyChanged) if c.endpoint == "box"]
    assert caps[0] == 4 and min(caps) < 4


def test_auto_halves_the_cap_of_an_endpoint_in_a_preemption_loop_down_to_its_minimum():
    ctl = AutoController(min_cap=2, max_cap=16, start_cap=9)
    change = ctl.preempt_loop("KV cache too small for this prompt (41,200 tokens): preempted 6 times")
    assert change is not None and change.cap == 4 and ctl.cap == 4
    assert (
        change.reason == "auto: 9 -> 4 (preemption loop: KV cache too small for this prompt (41,200 tokens): "
        "preempted 6 times)"
    )
    assert ctl.preempt_loop("again").cap == 2
    assert ctl.preempt_loop("again") is None  # at its minimum: nothing to change


@pytest.mark.anyio
async def test_a_wedged_pool_member_is_marked_down_and_its_agents_move_to_one_that_moves():
    async with (
        SimServer(SimSettings(wedge_after_s=0.0, tokens_per_s=50, ttft_s=0.05)) as stuck,
        SimServer(SimSettings(tokens_per_s=50, ttft_s=0.05)) as fine,
    ):
        agents = [
            {"name": f"a{i}", "prompt": "hi", "max_tokens": 4, "retries": 1, "endpoint": "fleet"}
            for i in range(4)
        ]
        engine = engine_for(
            [stuck.base_url, fine.base_url], agents=agents, wedge_timeout_s=1.0, run={"max_concurrency": 4}
        )
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    wedged = of(seen, ev.ServerWedged)
    assert wedged and {w.endpoint for w in wedged} == {"box0"} and not any(w.over for w in wedged)
    downs = [n for n in of(seen, ev.RunNotice) if n.title == "Pool member down"]
    assert downs and "box0 is wedged (server wedged: no progress" in downs[0].message
    moved = [p for p in of(seen, ev.AgentPlaced) if p.moved_from == "box0"]
    assert {p.agent for p in moved} == set(wedged[0].agents) and all(p.endpoint == "box1" for p in moved)
    # box0 answers /health with 200 all along, yet it was never brought back up
    assert not [n for n in of(seen, ev.RunNotice) if n.title == "Pool member up"]
    assert json.dumps(engine.report.to_dict())  # the report stays writable


@pytest.mark.anyio
async def test_requests_running_and_nothing_generated_for_the_idle_deadline_is_caught_as_a_hung_kernel():
    # the engine stops half a second into a 2 s prefill: a request stays running and nothing is generated;
    # the frozen rule waits 30 s, the hung-kernel rule the 1 s idle deadline
    settings = SimSettings(
        wedge_after_s=0.5, tokens_per_s=50, ttft_s=0.0, prefill_tokens_per_s=2000, max_num_batched_tokens=256
    )
    async with SimServer(settings) as srv:
        engine = engine_for(
            srv.base_url,
            agents=[{"name": "a", "prompt": prompt_of(4000), "retries": 0}],
            wedge_timeout_s=30.0,
            idle_timeout_s=1.0,
        )
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    wedged = of(seen, ev.ServerWedged)
    assert [(w.rule, w.agents) for w in wedged] == [("hung", ["a"])]
    assert re.fullmatch(
        r"server wedged: 1 request running, no token generated server-wide for [\d.]+ s "
        r"\(a hung kernel\?\)",
        wedged[0].reason,
    ), wedged[0].reason
    assert [(k.deadline, k.reason) for k in of(seen, ev.AgentKilled)] == [("wedge", wedged[0].reason)]


class _StoppedServer:
    """A vLLM-shaped server on a raw socket: /health 200 throughout; while `stopped`, its /metrics counters and
    KV use stand still and a request gets its headers and nothing more; once started, the counters move at
    every read and a request is answered once `answer` is set."""

    def __init__(self) -> None:
        import asyncio

        self.stopped = True
        self.reads = 0
        self.moving = 0
        self.answer = asyncio.Event()

    def metrics(self) -> bytes:
        self.reads += 1
        if not self.stopped:
            self.moving += 1
        return (
            f'vllm:num_requests_running{{model_name="m"}} 1.0\nvllm:num_requests_waiting{{model_name="m"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} 0.25\nvllm:num_preemptions_total{{model_name="m"}} 0.0\n'
            f'vllm:generation_tokens_total{{model_name="m"}} {100 + self.moving}.0\n'
            f'vllm:prompt_tokens_total{{model_name="m"}} 500.0\n'
        ).encode()

    async def serve(self, reader, writer) -> None:
        import asyncio

        from tests.conftest import chunk, http_head, read_request, sse_chunk

        try:
            request = await read_request(reader)
            if request.startswith(b"GET /metrics"):
                body = self.metrics()
                writer.write(http_head(200, "text/plain", length=len(body)) + body)
            elif request.startswith(b"GET"):
                writer.write(http_head(200, "application/json", length=2) + b"{}")
            else:
                writer.write(http_head(200, "text/event-stream"))
                await writer.drain()
                if self.stopped:
                    await reader.read()  # nothing, until the client gives up
                    return
                await self.answer.wait()
                writer.write(
                    chunk(sse_chunk("hello"))
                    + chunk(sse_chunk(" again", finish="stop"))
                    + chunk(b"data: [DONE]\n\n")
                    + b"0\r\n\r\n"
                )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.mark.anyio
async def test_a_wedge_is_over_when_the_counters_move_again_and_the_retried_agent_completes():
    import asyncio

    server = _StoppedServer()
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        engine = Engine(
            validate(
                {
                    "run": {"metrics_interval_s": 0.2},
                    "stall": {"first_byte_timeout_s": 600.0, "wedge_timeout_s": 1.0},
                    "endpoints": [
                        {
                            "name": "box",
                            "kind": "local",
                            "base_url": f"http://127.0.0.1:{port}/v1",
                            "model": "m",
                        }
                    ],
                    "agents": [{"name": "a", "prompt": "p", "retries": 1}],
                }
            )
        )
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)

        def start_on_the_kill(event: ev.Event) -> None:  # the engine core goes on, as after a SIGCONT
            if isinstance(event, ev.AgentKilled):
                server.stopped = False
            if isinstance(event, ev.ServerWedged) and event.over:  # the retry is answered after, not before, the
                server.answer.set()  # monitor's next look (however short its backoff)

        engine.subscribe(start_on_the_kill)
        assert await engine.run() == 0
    finally:
        listener.close()
    wedged = of(seen, ev.ServerWedged)
    assert [(w.rule, w.over) for w in wedged] == [("frozen", False), ("frozen", True)]
    assert wedged[1].reason == "box moves again" and wedged[1].agents == []
    statuses = [e.status for e in of(seen, ev.AgentStatus)]
    assert "wedged" in statuses and statuses[-1] == "completed"
    assert [k.deadline for k in of(seen, ev.AgentKilled)] == ["wedge"]


def test_prefill_chunks_are_read_where_the_server_counts_them_and_a_router_adds_its_workers_up():
    sglang = parse_metrics(
        'sglang:num_running_reqs{model_name="m"} 1\n'
        'sglang:realtime_tokens_total{model_name="m",mode="prefill_compute"} 4096\n'
        'sglang:realtime_tokens_total{model_name="m",mode="decode"} 77\n'
        'sglang:generation_tokens_total{model_name="m"} 77\n'
    )
    assert (sglang.prefill_tokens, sglang.generated) == (4096.0, 77.0)
    sim = parse_metrics(
        'vllm:num_requests_running{model_name="m"} 1.0\n'
        'cerevisor_sim:computed_prompt_tokens_total{model_name="m"} 512.0\n'
    )
    assert sim.prefill_tokens == 512.0 and sim.generated is None
    both = combine(
        [
            parse_metrics((FIXTURES / "vllm-0.32-pressure.txt").read_text()),
            parse_metrics((FIXTURES / "vllm-0.32-running.txt").read_text()),
        ]
    )
    assert (both.generated, both.prompt_tokens, both.waiting_capacity) == (
        14501.0 + 1998.0,
        180.0 + 3371.0,
        4,
    )


def test_the_headless_log_says_a_wedge_and_its_end_in_a_line_each():
    many = [f"a{i}" for i in range(12)]
    assert (
        Printer.describe(ev.ServerWedged(1.0, "box", "hung", "server wedged: x", many))
        == "box: WEDGED (hung): server wedged: x; killed 12 agents"
    )
    assert (
        Printer.describe(ev.ServerWedged(1.0, "box", "frozen", "server wedged: y", ["a", "b"]))
        == "box: WEDGED (frozen): server wedged: y; killed a, b"
    )
    assert (
        Printer.describe(ev.ServerWedged(2.0, "box", "frozen", "box moves again", over=True))
        == "box: no longer wedged: box moves again"
    )
