"""Meters per agent (issue 12): prompt tokens served from the prefix cache (usage.prompt_tokens_details), the
context's fill against the model's max_model_len with the agent flagged before a turn that will not fit, and
cost on priced endpoints with a [run] budget that pauses admissions."""

from __future__ import annotations

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.printer import Printer
from cerevisor_tui.sim import SimServer

FAST = SimSettings(tokens_per_s=2000, ttft_s=0.0)


def meters(seen: list, agent: str) -> list:
    return [e for e in seen if e.kind == "AgentMeters" and e.agent == agent]


@pytest.mark.anyio
async def test_cached_prompt_tokens_come_from_the_servers_usage(stream_process):
    """The simulator reports prompt_tokens_details.cached_tokens as vLLM does; from the second turn on, the
    conversation so far is served from its prefix cache."""
    async with SimServer(FAST) as srv:
        engine = Engine(validate({
            "endpoints": [{"name": "e", "base_url": srv.base_url}],
            "agents": [{"name": "a", "prompt": "long context " * 200, "turns": ["go on", "and more"],
                        "max_tokens": 8}]}), stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    m = meters(seen, "a")
    assert [x.turn for x in m] == [1, 2, 3]
    assert m[0].cached_tokens == 0
    for before, after in zip(m, m[1:], strict=False):  # all of the earlier prompt, in whole blocks of 16
        assert before.prompt_tokens - 16 < after.cached_tokens <= after.prompt_tokens
    assert engine.agents["a"].cached_tokens == sum(x.cached_tokens for x in m)
    agent = engine.report.to_dict()["agents"][0]
    assert agent["cached_tokens"] == engine.agents["a"].cached_tokens and "cost_usd" not in agent
    assert m[-1].context_tokens == m[-1].prompt_tokens + 8 and m[-1].cost_usd == 0.0


@pytest.mark.anyio
async def test_an_agent_is_flagged_before_the_turn_that_will_not_fit_its_context():
    """max_model_len comes from /v1/models; the meters after turn 1 say the next turn will not fit, and the
    server then refuses it with a 400, as it would."""
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0, max_model_len=700)) as srv:
        engine = Engine(validate({
            "endpoints": [{"name": "e", "base_url": srv.base_url}],
            "agents": [{"name": "a", "prompt": "word " * 300, "turns": ["more " * 300], "max_tokens": 100,
                        "retries": 0}]}))
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 1
    first = meters(seen, "a")[0]
    assert first.max_model_len == 700 and "will refuse" in first.warning
    refused = next(e for e in seen if e.kind == "AgentFinished")
    assert refused.status == "failed" and "400" in refused.error
    assert seen.index(first) < next(i for i, e in enumerate(seen) if e.kind == "AgentStarted" and e.turn == 2)


@pytest.mark.anyio
async def test_cost_per_agent_and_run_and_a_budget_that_pauses_admissions():
    """At $1 a prompt token and $2 a completion token, the budget is spent by the first agent's first turn:
    admissions pause, that agent still finishes its turns, the next one waits."""
    async with SimServer(FAST) as srv:
        engine = Engine(validate({
            "run": {"max_concurrency": 1, "budget_usd": 1.0},
            "endpoints": [{"name": "e", "base_url": srv.base_url, "kind": "local",
                           "price_in_per_mtok": 1e6, "price_out_per_mtok": 2e6}],
            "agents": [{"name": f"a{i}", "prompt": "p", "turns": ["q"], "max_tokens": 4} for i in range(2)]}))
        seen: list = []
        first_done = anyio.Event()

        def watch(event) -> None:
            seen.append(event)
            if event.kind == "AgentFinished" and event.agent == "a0":
                first_done.set()

        engine.subscribe(watch)
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run)
            await first_done.wait()
            assert engine.agents["a1"].status == "queued" and engine.scheduler.paused
            engine.stop("test over")
    m = meters(seen, "a0")
    assert m[0].cost_usd == m[0].prompt_tokens + 2 * 4
    assert m[-1].cost_usd == sum(x.prompt_tokens + 8 for x in m) == m[-1].run_cost_usd == engine.run_cost_usd
    notices = [e for e in seen if e.kind == "RunNotice" and e.title == "Budget reached"]
    assert len(notices) == 1 and "running agents finish" in notices[0].message
    assert engine.agents["a0"].status == "completed" and engine.agents["a1"].status == "cancelled"
    report = engine.report.to_dict()
    assert report["totals"]["cost_usd"] == pytest.approx(engine.run_cost_usd)
    assert report["agents"][0]["cost_usd"] == pytest.approx(engine.agents["a0"].cost_usd)
    assert Printer.describe(notices[0]).startswith("WARNING: Budget reached: $")  # a headless run says so too
