"""Modes, caps and waves, counted on the server side (the simulator over loopback HTTP)."""

from __future__ import annotations

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from tests.conftest import until

FAST = SimSettings(tokens_per_s=60, ttft_s=0.05, max_num_seqs=64)


def make(url: str, n: int, *, mode: str, cap: int = 4, max_tokens: int = 20, ep_cap: int = 64, deps=None, **stall):
    agents = [{"name": f"a{i}", "prompt": f"task {i}", "max_tokens": max_tokens, "retries": 0} for i in range(n)]
    for name, dep in (deps or {}).items():
        agents[int(name[1:])]["depends_on"] = dep
    return Engine(validate({
        "run": {"mode": mode, "max_concurrency": cap},
        "stall": {"idle_timeout_s": 5, "first_byte_timeout_s": 5, **stall},
        "endpoints": [{"name": "sim", "base_url": url, "kind": "local", "max_concurrency": ep_cap}],
        "agents": agents,
    }))


@pytest.mark.anyio
async def test_sequential_never_streams_two_at_once():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 4, mode="sequential", max_tokens=8)
        assert await engine.run() == 0
        assert srv.state.max_running_seen == 1
        assert srv.state.requests_total == 4


@pytest.mark.anyio
async def test_parallel_reaches_its_cap_and_never_more():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 9, mode="parallel", cap=3)
        assert await engine.run() == 0
        assert srv.state.max_running_seen == 3
        assert engine.report.totals().max_running == 3


@pytest.mark.anyio
async def test_endpoint_max_concurrency_caps_parallel():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 6, mode="parallel", cap=8, ep_cap=2)
        assert await engine.run() == 0
        assert srv.state.max_running_seen == 2


@pytest.mark.anyio
async def test_switching_to_parallel_admits_the_waiting_agents_at_once():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 6, mode="sequential", cap=4, max_tokens=40)  # 0.7 s each: four seen at once

        async def switch():
            await until(lambda: srv.state.running == 1, "the first agent to run")
            engine.handle(cmd.SetMode(mode="parallel"))
            await until(lambda: srv.state.running == 4, "the waiting agents to be admitted")

        async with anyio.create_task_group() as tg:
            tg.start_soon(switch)
            assert await engine.run() == 0
        assert srv.state.max_running_seen == 4


@pytest.mark.anyio
async def test_switching_to_sequential_kills_nothing_and_admits_one_at_a_time():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 7, mode="parallel", cap=3, max_tokens=15)
        switched = []
        admitted_while_busy = []

        def on_event(e):
            if e.kind == "FirstToken" and not switched and srv.state.running == 3:
                engine.handle(cmd.SetMode(mode="sequential"))
                switched.append(e.t)
            elif e.kind == "AgentStarted" and switched and e.turn == 1 and e.attempt == 1:
                # the new agent holds the only slot: nobody else may be running
                admitted_while_busy.append(engine.scheduler.running - 1)

        engine.subscribe(on_event)
        assert await engine.run() == 0
        assert switched
        assert all(st.status == "completed" for st in engine.agents.values())
        assert admitted_while_busy and set(admitted_while_busy) == {0}


@pytest.mark.anyio
async def test_a_wave_starts_only_after_the_previous_one_ended():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 5, mode="parallel", cap=4, deps={"a3": ["a0", "a1"], "a4": ["a3"]})
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert [[a for a in w] for w in ([a.name for a in lvl] for lvl in engine.waves)] == [["a0", "a1", "a2"], ["a3"], ["a4"]]
    finished = {e.agent: e.t for e in seen if e.kind == "AgentFinished"}
    started = {e.agent: e.t for e in seen if e.kind == "AgentStarted" and e.attempt == 1}
    assert started["a3"] >= max(finished["a0"], finished["a1"], finished["a2"])
    assert started["a4"] >= finished["a3"]


@pytest.mark.anyio
async def test_dependency_output_is_inserted_and_failures_skip_dependents():
    async with SimServer(FAST) as srv:
        engine = Engine(validate({
            "endpoints": [{"name": "sim", "base_url": srv.base_url}],
            "agents": [
                {"name": "first", "prompt": "go", "max_tokens": 5},
                {"name": "second", "prompt": "use: {{ first.output }}", "depends_on": ["first"], "max_tokens": 5},
                {"name": "bad", "prompt": "go", "endpoint": "sim", "max_tokens": 99999, "retries": 0},
                {"name": "after_bad", "prompt": "x", "depends_on": ["bad"]},
            ],
        }))
        assert await engine.run() == 1
        sent = [r for r in srv.state.requests if "use: " in str(r)]
    first = engine.agents["first"].output
    assert first and any(first in str(r) for r in sent)
    assert engine.agents["bad"].status == "failed"
    assert engine.agents["after_bad"].status == "skipped"
    assert engine.agents["after_bad"].error == "dependency bad failed"


@pytest.mark.anyio
async def test_time_in_our_admission_queue_never_counts_against_a_deadline():
    async with SimServer(FAST) as srv:
        # each agent needs ~0.5 s; the third waits ~1 s in our queue with a 0.6 s first-byte deadline
        engine = make(srv.base_url, 3, mode="sequential", max_tokens=25, first_byte_timeout_s=0.6)
        seen = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert not [e for e in seen if e.kind in ("AgentKilled", "StallWarning")]


@pytest.mark.anyio
async def test_pause_holds_admissions_and_resume_releases_them():
    async with SimServer(FAST) as srv:
        engine = make(srv.base_url, 3, mode="parallel", cap=3, max_tokens=5)
        engine.handle(cmd.Pause())
        seen = []
        engine.subscribe(seen.append)

        async def later():
            await anyio.sleep(0.5)
            assert srv.state.requests_total == 0
            engine.handle(cmd.Resume())

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            assert await engine.run() == 0
    first_start = min(e.t for e in seen if e.kind == "AgentStarted")
    run_start = next(e.t for e in seen if e.kind == "RunStarted")
    assert first_start - run_start >= 0.45
