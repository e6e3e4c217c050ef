"""Auto mode against real servers: vLLM under KV pressure (4,096 KV tokens, 4 sequences) and llama-server
(4 slots). It starts low, grows, and settles where the server says: at the number of conversations that
fit in vLLM's KV cache, below its sequence limit when requests queue there, and never past llama-server's slots."""

from __future__ import annotations

from typing import Any

import pytest

from cerevisor_tui.engine.auto import WAITING_MIN, WAITING_SAMPLES, WAITING_SHARE
from tests.integration.checks import engine_for, run_engine
from tests.integration.servers import MODEL, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def auto_config(base_url: str, name: str, agents: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "run": {"warmup": "off", "mode": "auto", "metrics_interval_s": 0.25},
        "stall": {"first_byte_timeout_s": 300.0, "idle_timeout_s": 120.0},
        "endpoints": [{"name": name, "base_url": base_url, "model": MODEL, "max_concurrency": 16}],
        "agents": agents,
    }


def cap_changes(seen: list[Any], endpoint: str) -> list[Any]:
    return [e for e in seen if e.kind == "ConcurrencyChanged" and e.endpoint == endpoint]


def longest_queue(samples: list[tuple[float, float | None, float | None]]) -> int:
    """The most server samples (t, running, waiting) in a row that had a queue as auto counts one (engine/auto.py:
    at least WAITING_MIN waiting, and WAITING_SHARE of the requests under way)."""
    longest = streak = 0
    for _, running, waiting in samples:
        running, waiting = running or 0, waiting or 0  # (a sample without the figure has no queue to show)
        streak = streak + 1 if waiting >= max(WAITING_MIN, WAITING_SHARE * (running + waiting)) else 0
        longest = max(longest, streak)
    return longest


def story(changes: list[Any]) -> str:
    return "\n".join(f"{c.effective_cap}: {c.reason}" for c in changes)


@pytest.mark.anyio
async def test_vllm_auto_settles_where_the_conversations_fit_and_keeps_their_prefixes(vllm_pressure: ServerProcess):
    """12 agents of three ~550-token turns: about 2 of their conversations fit in 4,096 KV tokens. The probe
    of short single-turn requests says 4 (the sequence limit), where each agent's prefix is evicted before
    its next turn; auto stops at the fit, from the server's reported capacity and the agents' own shape."""
    words = "the" + " the" * 519  # 520 tokens of the tiny model's vocabulary
    agents = [{"name": f"a{i}", "system": f"You are agent {i}.", "prompt": f"{i} first: {words}",
               "turns": [f"{i} second: {words}", f"{i} third: {words}"], "max_tokens": 24, "retries": 0}
              for i in range(12)]
    engine = engine_for(auto_config(vllm_pressure.base_url, "vllm", agents))
    hits_before = vllm_pressure.metric("vllm:prefix_cache_hits_total")
    queries_before = vllm_pressure.metric("vllm:prefix_cache_queries_total")

    code, seen = await run_engine(engine, timeout_s=500)
    assert code == 0, [f"{e.agent}: {e.error}" for e in seen if e.kind == "AgentFinished" and e.status != "completed"]
    changes = cap_changes(seen, "vllm")
    assert changes[0].effective_cap == 1, story(changes)
    caps = [c.effective_cap for c in changes]
    # the conversations' length as vLLM counted it: the last turn's prompt plus its answer
    last_turns = [e for e in seen if e.kind == "TurnFinished" and e.turn == 3]
    context = max(e.prompt_tokens + e.completion_tokens for e in last_turns)
    fit = int(0.95 * 4096 // context)
    assert 1 <= fit < 4, f"the workload does not have the shape this test is about: {context} tokens a conversation"
    assert max(caps) <= fit and caps[-1] == fit, story(changes)
    assert any("fit" in c.reason for c in changes), story(changes)
    # the journal's reasons are the events' reasons
    report = engine.report.to_dict()["caps"]["vllm"]
    assert [h["reason"] for h in report["history"]] == [c.reason for c in changes]
    hits = vllm_pressure.metric("vllm:prefix_cache_hits_total") - hits_before
    queries = vllm_pressure.metric("vllm:prefix_cache_queries_total") - queries_before
    assert queries > 0 and hits / queries > 0.3, f"prefix hits {hits:.0f} of {queries:.0f} prompt tokens"


@pytest.mark.anyio
async def test_vllm_auto_backs_off_to_what_runs_when_requests_wait(vllm_pressure: ServerProcess):
    """Eight conversations fit, but vLLM runs 4 sequences at once: past 4 the rest wait in its queue,
    and auto comes back down to what the server runs. It starts at 8 ([run.auto] start_cap, as from a saved
    probe): from 1, slow start may rightly stop below 4, as CPU vLLM's throughput barely grows with its batch."""
    # Answers long enough that vLLM's 4 sequences stay busy and the rest wait in its queue sample after sample
    # (with ~230 tokens a busy client, this 2-core box running other work, could not keep the server fed, and
    # under one request waited on average), yet short enough that 8 conversations fit in the KV cache (at ~700
    # tokens auto rightly stops at the 5 that fit, with one waiting). Mixed lengths: the tiny model always runs
    # to max_tokens, and equal answers would end, and free their slots, in lockstep.
    agents = [{"name": f"s{i}", "prompt": f"Count from {i} onwards, slowly.", "max_tokens": 400 + 11 * (i % 7),
               "retries": 0} for i in range(40)]
    config = auto_config(vllm_pressure.base_url, "vllm", agents)
    config["run"]["auto"] = {"start_cap": 8}
    engine = engine_for(config)
    queued_before = vllm_pressure.metric("vllm:request_queue_time_seconds_sum")
    code, seen = await run_engine(engine, timeout_s=500)
    assert code == 0
    changes = cap_changes(seen, "vllm")
    caps = [c.effective_cap for c in changes]
    assert caps[0] == 8, story(changes)
    waited = [c for c in changes if "waiting at the server" in c.reason]
    samples = [(round(e.t - seen[0].t, 1), e.running, e.waiting) for e in seen if e.kind == "ServerSample"]
    # Little's law on vLLM's own counter: the time requests spent in its queue over the run's length is how
    # many waited on average (however rarely /metrics was read)
    wall = seen[-1].t - seen[0].t
    mean_waiting = (vllm_pressure.metric("vllm:request_queue_time_seconds_sum") - queued_before) / wall
    if not waited and mean_waiting < 1.0:
        # The condition under test never arose: this 2-core box, busy with other work, could not feed vLLM
        # faster than it answers (vLLM's API process then holds the requests, and its engine logs "Running: 1").
        # The back-off rule itself is tested on recorded signals (tests/test_auto.py).
        pytest.skip(f"vLLM's queue-time counter says {mean_waiting:.1f} requests waited on average: no queue "
                    f"formed to back off from\n{story(changes)}\nserver samples: {samples}")
    if not waited and longest_queue(samples) < WAITING_SAMPLES:
        # Nor did it arise where auto looks: a queue in WAITING_SAMPLES samples in a row. On a busy box vLLM's
        # /metrics answers late (once, 6 samples in 18 s, asked every 0.25 s): a queue between two of them is not
        # one auto saw.
        pytest.skip(f"no {WAITING_SAMPLES} server samples in a row had a queue: none that auto could back off "
                    f"from\n{story(changes)}\nserver samples (s, running, waiting): {samples}")
    assert waited, (f"{story(changes)}\nserver samples (s, running, waiting): {samples}\n"
                    f"requests waiting at vLLM on average over the run: {mean_waiting:.1f}")
    assert waited[0].effective_cap <= 4, story(changes)
    # and it does not go back to where requests queued: probes stop within one step of the sequence limit
    assert all(cap <= 6 for cap in caps[changes.index(waited[0]):]), story(changes)
    assert not [e for e in seen if e.kind == "AgentKilled"]


@pytest.mark.anyio
async def test_llama_auto_grows_from_one_and_never_past_its_slots(llama: ServerProcess):
    """From 1, slow start doubles; the server's 4 slots bound every raise. Where between 2 and 4 it settles is the
    server's throughput's to say, and on this 2-core box llama-server's barely grows past one sequence (measured
    side by side: 1,700-2,300 tokens/s at 1, 2,300 at 2, 3,000-4,100 at 4), within what a busy host moves it: the
    test does not ask for 4 (tests/test_auto.py judges the growth and the back-off on recorded signals)."""
    # 400-token answers: the tiny model streams 3,000-4,500 tokens/s alone on this VM, and with 48 the whole run
    # ended in about a second, at cap 2, before slow start had the samples to go on
    agents = [{"name": f"l{i}", "prompt": f"Tell story {i}.", "turns": ["Go on."], "max_tokens": 400, "retries": 0}
              for i in range(24)]
    engine = engine_for(auto_config(llama.base_url, "llama", agents))
    code, seen = await run_engine(engine, timeout_s=500)
    assert code == 0
    changes = cap_changes(seen, "llama")
    caps = [c.effective_cap for c in changes]
    assert caps[0] == 1 and caps[1] == 2 and max(caps) <= 4, story(changes)
    assert "slow start" in changes[1].reason, story(changes)


@pytest.mark.anyio
async def test_llama_auto_started_above_its_slots_comes_down_to_them_at_once(llama: ServerProcess):
    """Started at 8 (as from a saved probe), auto reads llama-server's 4 slots in its first sample and comes down
    to them, naming them, before any throughput is judged; it never goes above them after."""
    agents = [{"name": f"l{i}", "prompt": f"Tell story {i}.", "max_tokens": 200, "retries": 0} for i in range(12)]
    config = auto_config(llama.base_url, "llama", agents)
    config["run"]["auto"] = {"start_cap": 8}
    engine = engine_for(config)
    code, seen = await run_engine(engine, timeout_s=500)
    assert code == 0
    changes = cap_changes(seen, "llama")
    caps = [c.effective_cap for c in changes]
    assert caps[:2] == [8, 4] and "4 slots" in changes[1].reason, story(changes)
    assert max(caps[1:]) <= 4, story(changes)
