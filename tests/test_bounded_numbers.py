"""Numbers a server says are believed only when they can be true (endpoints/bounds.py): a run whose endpoint's
/metrics says 1e308, NaN or -4, or whose stream says a prompt of 1e308 tokens, goes on as with a server that says
nothing; prefill progress counts only past its high-water mark (a wobbling 10, 11, 10, 11 is no progress), and
holds a first byte back at most PREFILL_MAX_TIMES its projected prefill. Each end-to-end test runs a real run
against the hostile upstream of tests/gateway/hostile.py over loopback HTTP."""

from __future__ import annotations

import math
import re
from typing import Any

import anyio
import httpx
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.deadlines import PREFILL_MAX_TIMES, prefill_look
from cerevisor_tui.endpoints import bounds
from cerevisor_tui.endpoints.latency import parse_latency
from cerevisor_tui.endpoints.metrics import parse_metrics
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.prefill import Prefill
from tests.conftest import until
from tests.gateway.conftest import post, served
from tests.gateway.hostile import LYING_METRICS, Hostile


def _config(url: str, *prompts: str, **stall: Any) -> Any:
    return validate({
        "run": {"mode": "parallel", "max_concurrency": 4, "metrics_interval_s": 0.05},
        "stall": {"wedge_timeout_s": 0, "max_extensions": 0, **stall},
        "endpoints": [{"name": "box", "kind": "local", "base_url": url, "model": "up-model",
                       "prompt_progress": "on"}],
        "agents": [{"name": f"a{i}", "prompt": prompt, "max_tokens": 4, "retries": 0}
                   for i, prompt in enumerate(prompts)],
    })


async def _run(config: Any, timeout_s: float = 60.0) -> tuple[int, list[ev.Event]]:
    engine = Engine(config)
    seen: list[ev.Event] = []
    engine.subscribe(seen.append)
    with anyio.fail_after(timeout_s):
        code = await engine.run()
    return code, seen


def _of(seen: list[ev.Event], kind: type) -> list[Any]:
    return [e for e in seen if isinstance(e, kind)]


@pytest.mark.anyio
async def test_a_run_whose_server_lies_in_its_metrics_and_its_progress_finishes():
    async with Hostile() as up:
        code, seen = await _run(_config(up.base_url, "hi", "huge-progress", "hi"))
    assert code == 0 and _of(seen, ev.RunFinished)
    assert sorted(f.status for f in _of(seen, ev.AgentFinished)) == ["completed"] * 3
    assert any(r.target.endswith("/metrics") for r in up.seen)  # the lies were read
    for sample in _of(seen, ev.ServerSample):  # and read as absent
        assert sample.running is None and sample.kv_cache_usage is None


@pytest.mark.anyio
async def test_a_gateway_request_whose_progress_says_1e308_tokens_is_answered_and_the_lie_not_believed():
    async with Hostile() as up:
        endpoint = {"name": "box", "kind": "local", "base_url": up.base_url, "model": "up-model",
                    "prompt_progress": "on"}
        async with served(endpoints=[endpoint]) as s, httpx.AsyncClient(timeout=30) as client:
            body = {"model": "up-model", "stream": True, "messages": [{"role": "user", "content": "huge-progress"}]}
            answer = await post(client, s.url + "/chat/completions", body)
            assert answer.status == 200 and answer.text == "hello"
            await until(lambda: s.of(ev.TurnFinished), "the turn finished")
            assert not s.of(ev.PrefillProgress)


@pytest.mark.anyio
async def test_progress_that_wobbles_is_no_progress_and_is_killed_at_the_idle_window():
    async with Hostile() as up:
        code, seen = await _run(_config(up.base_url, "wobble", first_byte_timeout_s=1.0, idle_timeout_s=2.0),
                                timeout_s=30.0)
    [killed] = _of(seen, ev.AgentKilled)
    # no progress since its first reading: killed once the idle window (2 s) has passed, not before; a loaded host
    # may look later than that, so the figure is at least 2, not exactly 2.x
    quiet_s = re.fullmatch(r"no prefill progress for ([0-9.]+) s \(prefill .*\)", killed.reason)
    assert quiet_s is not None and float(quiet_s.group(1)) >= 2.0, killed.reason
    assert code == 1


# ---- the rules, on explicit numbers ----------------------------------------------------------------------------
def test_a_wobbling_or_falling_processed_count_never_moves_the_high_water_mark():
    p = Prefill()
    p.see(1000, 0, 10, 100, now=1.0)
    assert p.advanced_at == 1.0
    p.see(1000, 0, 11, 110, now=2.0)
    assert (p.processed, p.advanced_at) == (11, 2.0)
    for i, processed in enumerate((10, 11, 10, 11, 5, 0)):
        p.see(1000, 0, processed, 120, now=3.0 + i)
    assert (p.processed, p.advanced_at) == (11, 2.0)
    p.see(1000, 0, 12, 130, now=20.0)
    assert (p.processed, p.advanced_at) == (12, 20.0)


def test_a_prefill_holds_the_first_byte_back_at_most_a_multiple_of_its_projection():
    # 10,000 tokens at 100 tok/s: 100 s projected, so never past 300 s from the request's start
    args = {"total": 10_000, "processed": 9_000, "rate_tok_s": 100.0, "idle_s": 600.0, "started_at": 0.0}
    inside = prefill_look(now=250.0, advanced_at=249.0, **args)
    assert inside.action == "extend" and inside.deadline_at <= PREFILL_MAX_TIMES * 100.0
    past = prefill_look(now=300.0, advanced_at=299.0, **args)
    assert past.action == "kill" and "3x its projected 100 s" in past.reason
    # without a rate, the projection is the idle window
    no_rate = prefill_look(now=30.0, advanced_at=29.0, **{**args, "rate_tok_s": None, "idle_s": 10.0})
    assert no_rate.action == "kill"
    # with no start given (a caller of old), the rule is as it was
    assert prefill_look(now=300.0, advanced_at=299.0, **{**args, "started_at": None}).action == "extend"


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0, 1e308, bounds.MAX_METRIC * 2])
def test_a_metric_value_that_cannot_be_true_is_absent(value):
    assert bounds.metric(value) is None


def test_metrics_and_latency_text_that_lies_parse_as_absent():
    snapshot = parse_metrics(LYING_METRICS)
    assert snapshot.kind == "vllm"
    assert (snapshot.requests_running, snapshot.requests_waiting, snapshot.kv_cache_usage, snapshot.preemptions,
            snapshot.generated, snapshot.num_gpu_blocks, snapshot.block_size) == (None,) * 7
    honest = parse_metrics("vllm:num_requests_running 3\nvllm:num_requests_running 1e308\n")
    assert honest.requests_running == 3
    latency = parse_latency('vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1e308\n'
                            'vllm:time_to_first_token_seconds_bucket{le="1.0"} NaN\n'
                            "vllm:generation_tokens_total inf\n", "vllm")
    assert latency.progress is None and not latency.histograms


@pytest.mark.parametrize("told", [(1e999, 0, 0, 0), (1000, 0, 1e999, 5), (1000, -1, 5, 5), (1000, 0, 5, -1),
                                  (1000, 2000, 5, 5), (1000, 0, 2000, 5), (math.nan, 0, 0, 0), ("10", 0, 0, 0),
                                  (True, 0, 0, 0), (bounds.MAX_PROMPT_TOKENS + 1, 0, 0, 0)])
def test_a_prompt_progress_that_cannot_be_true_is_absent(told):
    assert bounds.prompt_progress(*told) is None


def test_a_true_prompt_progress_reads_as_integers():
    assert bounds.prompt_progress(1000.0, 100, 500, 12.5) == (1000, 100, 500, 12)
