"""Meters per agent (issue 12): prompt tokens served from the prefix cache (usage.prompt_tokens_details), the
context's fill against the model's max_model_len with the agent flagged before a turn that will not fit, and
cost on priced endpoints with a [run] budget that pauses admissions."""

from __future__ import annotations

import asyncio
import json

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine import connections
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.sim import SimServer
from tests.conftest import chunk, http_head, read_request, sse_chunk

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
async def test_a_server_silent_on_its_model_list_after_an_answer_holds_no_agent(monkeypatch):
    """The server answers a turn, then leaves /v1/models unanswered (as a vLLM frozen right after an answer
    does): the agent's meters wait MODELS_TIMEOUT_S for the context length, not for ever, and the run goes on;
    the next answer asks again, and has it."""
    monkeypatch.setattr(connections, "MODELS_TIMEOUT_S", 0.2)
    models_answer = asyncio.Event()
    asked: list[bool] = []  # per /v1/models: whether it was answered

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader)
            if request.startswith(b"GET /v1/models"):
                asked.append(models_answer.is_set())
                await models_answer.wait()
                body = json.dumps({"data": [{"id": "m", "max_model_len": 5000}]}).encode()
                writer.write(http_head(200, "application/json", length=len(body)) + body)
            elif request.startswith(b"POST"):
                writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("Hello.", finish="stop"))
                             + chunk(sse_chunk(usage={"prompt_tokens": 10, "completion_tokens": 2}))
                             + chunk(b"data: [DONE]\n\n") + chunk(b""))
            else:  # /health, /metrics
                writer.write(http_head(404, "text/plain", length=0))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = Engine(validate({
        "run": {"warmup": "off"},
        "endpoints": [{"name": "e", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}],
        "agents": [{"name": "a", "prompt": "p", "turns": ["q"], "max_tokens": 4, "retries": 0}]}))
    seen: list = []

    def watch(event) -> None:
        seen.append(event)
        if event.kind == "AgentMeters":
            models_answer.set()  # the first meters are told: from here the server answers its model list

    engine.subscribe(watch)
    with anyio.move_on_after(60) as bound:
        code = await engine.run()
    server.close()
    models_answer.set()
    assert not bound.cancelled_caught, "the run waited on /v1/models after the answer"
    assert code == 0
    assert [(m.turn, m.max_model_len) for m in meters(seen, "a")] == [(1, 0), (2, 5000)]
    assert asked[0] is False and True in asked


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
            engine.handle(cmd.Stop(reason="test over"))
    m = meters(seen, "a0")
    assert m[0].cost_usd == m[0].prompt_tokens + 2 * 4
    assert m[-1].cost_usd == sum(x.prompt_tokens + 8 for x in m) == m[-1].run_cost_usd == engine.budget.spent_usd
    notices = [e for e in seen if e.kind == "RunNotice" and e.title == "Budget reached"]
    assert len(notices) == 1 and "running agents finish" in notices[0].message
    assert engine.agents["a0"].status == "completed" and engine.agents["a1"].status == "cancelled"
    report = engine.report.to_dict()
    assert report["totals"]["cost_usd"] == pytest.approx(engine.budget.spent_usd)
    assert report["agents"][0]["cost_usd"] == pytest.approx(engine.agents["a0"].cost_usd)
    assert Printer.describe(notices[0]).startswith("WARNING: Budget reached: $")  # a headless run says so too


@pytest.mark.anyio
async def test_an_attempt_killed_after_its_first_tokens_costs_its_prompt_and_what_it_streamed():
    """A hosted API bills a request it had begun to answer, however it ended: the operator's kill after a few
    tokens counts the prompt (its characters at the endpoint's tokens per character, 0.25 before any usage was
    measured) and the tokens streamed, for the agent, the run and the budget; a request killed before its first
    token counts nothing (the server may not have begun it)."""
    prompt = "p" * 400
    async with SimServer(SimSettings(tokens_per_s=50, ttft_s=0.0)) as srv, \
            SimServer(SimSettings(tokens_per_s=50, ttft_s=30.0)) as silent:
        engine = Engine(validate({
            "run": {"budget_usd": 10_000.0, "mode": "parallel", "max_concurrency": 2},
            "endpoints": [{"name": "e", "base_url": srv.base_url, "kind": "local",
                           "price_in_per_mtok": 1e6, "price_out_per_mtok": 2e6},
                          {"name": "quiet", "base_url": silent.base_url, "kind": "local",
                           "price_in_per_mtok": 1e6, "price_out_per_mtok": 2e6}],
            "agents": [{"name": "a", "endpoint": "e", "prompt": prompt, "max_tokens": 500, "retries": 0},
                       {"name": "b", "endpoint": "quiet", "prompt": prompt, "max_tokens": 500, "retries": 0}]}))
        seen: list = []
        deltas = {"a": 0}

        def watch(event) -> None:
            seen.append(event)
            if event.kind == "TokenDelta" and event.agent == "a":
                deltas["a"] += 1
                if deltas["a"] == 3:  # b has waited for its first token since it started beside a
                    engine.handle(cmd.Kill(agent="a", reason="enough"))
                    engine.handle(cmd.Kill(agent="b", reason="enough"))

        engine.subscribe(watch)
        assert await engine.run() == 1
    killed = {e.agent: e for e in seen if e.kind == "AgentKilled"}
    assert killed["a"].tokens >= 3 and killed["b"].tokens == 0
    [m] = meters(seen, "a")
    assert m.cost_usd == round(400 * 0.25) * 1 + killed["a"].tokens * 2 == m.run_cost_usd
    assert m.prompt_tokens == 0  # no usage came: the estimate prices it and counts as no server's figure
    assert meters(seen, "b") == [] and engine.agents["b"].cost_usd == 0
    assert engine.budget.spent_usd == m.cost_usd == engine.agents["a"].cost_usd
    report = engine.report.to_dict()
    assert report["totals"]["cost_usd"] == pytest.approx(m.cost_usd)
    assert next(a for a in report["agents"] if a["name"] == "a")["cost_usd"] == pytest.approx(m.cost_usd)


@pytest.mark.anyio
async def test_a_resumed_run_counts_what_it_spent_before_toward_its_budget(tmp_path):
    """The budget is the run's, across --resume: the journal's last run_cost_usd is where the resumed run
    counts on from (it used to start again at 0 and spend the budget a second time)."""
    from cerevisor_tui.engine.resume import read_journal
    from cerevisor_tui.engine.sinks.journal import Journal

    def config(budget: float):
        return validate({
            "run": {"max_concurrency": 1, "budget_usd": budget},
            "endpoints": [{"name": "e", "base_url": srv.base_url, "kind": "local",
                           "price_in_per_mtok": 1e6, "price_out_per_mtok": 2e6}],
            "agents": [{"name": f"a{i}", "prompt": "same prompt", "max_tokens": 4} for i in range(3)]})

    async def run(engine: Engine, stop_after: str = "") -> list:
        journal = Journal(tmp_path / "run", engine.report)
        journal.open(resume=engine.completed_before != {})
        engine.subscribe(journal)
        seen: list = []

        def watch(event) -> None:
            seen.append(event)
            if event.kind == "AgentFinished" and event.agent == stop_after:
                engine.handle(cmd.Stop(reason="stopped by the test"))
            elif event.kind == "RunNotice" and event.title == "Budget reached":
                engine.handle(cmd.Stop(reason="budget reached"))

        engine.subscribe(watch)
        await engine.run()
        journal.close()
        return seen

    async with SimServer(FAST) as srv:
        first = Engine(config(1e9), run_id="r1", run_dir=str(tmp_path / "run"))
        await run(first, stop_after="a0")
        one = first.budget.spent_usd  # what one agent costs (same prompt, same answer length)
        assert one > 0 and first.agents["a0"].status == "completed"
        state = read_journal(tmp_path / "run")
        assert state.spent_usd == pytest.approx(one) and set(state.completed) == {"a0"}

        # budget 1.5 agents: a1 runs (1 spent before, < 1.5), then 2 > 1.5: a2 is never admitted
        second = Engine(config(1.5 * one), run_id="r1", run_dir=str(tmp_path / "run"), resumed=state)
        seen = await run(second)
        assert second.agents["a1"].status == "completed" and second.agents["a2"].status == "cancelled"
        assert second.budget.spent_usd == pytest.approx(2 * one)
        assert second.report.to_dict()["totals"]["cost_usd"] == pytest.approx(2 * one)
        assert [e for e in seen if e.kind == "AgentMeters"][-1].run_cost_usd == pytest.approx(2 * one)

        # a budget already spent: nothing is admitted, and the run says why at once
        state = read_journal(tmp_path / "run")
        assert state.spent_usd == pytest.approx(2 * one)
        third = Engine(config(1.5 * one), run_id="r1", run_dir=str(tmp_path / "run"), resumed=state)
        seen = await run(third)
        assert third.agents["a2"].status == "cancelled" and not any(e.kind == "AgentStarted" for e in seen)
        assert any(e.kind == "RunNotice" and e.title == "Budget reached" for e in seen)
