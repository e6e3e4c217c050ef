"""Warm-up at the start of a run (`[run] warmup`), over real loopback HTTP: one short request to each endpoint
the run uses, its time to first token the endpoint's cold start (the event, the report), each endpoint's agents
sent only after its own warm-up (never held by another endpoint's), a failure a notice and not the run's, a
dead or silent or wedged endpoint's warm-up ended in seconds, and `off` sends nothing."""

from __future__ import annotations

import time

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.clock import VirtualClock
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.engine.warmup import to_warm, used_endpoints
from cerevisor_tui.sim import SimServer
from tests.conftest import RawServer, free_port, until

pytestmark = pytest.mark.anyio

QUICK = {"ttft_s": 0.0, "tokens_per_s": 400.0}
"""The simulator's answers at once: what these tests time is the warm-up, not the agents' 4 tokens (0.4 s each at
the simulator's default pace)."""


def engine_on(url: str, warmup: str, *, agents: int = 2, kind: str = "local", stream_process: bool = False,
              retries: int = 2, **stall) -> Engine:
    return Engine(validate({
        "run": {"warmup": warmup},
        "stall": stall,
        "endpoints": [{"name": "box", "base_url": url, "kind": kind, "model": "sim-model"}],
        "agents": [{"name": f"a{i}", "prompt": "hello", "max_tokens": 4, "retries": retries} for i in range(agents)],
    }), stream_process=stream_process)


def kinds(seen: list, *names: str) -> list:
    return [e for e in seen if e.kind in names]


async def test_the_warm_up_goes_before_its_endpoints_agents_and_its_ttft_is_the_cold_start(stream_process):
    # the simulator holds requests for its cold start (1 s from the run's start), as a server loading its weights does
    async with SimServer(SimSettings(cold_start_s=1.0, **QUICK)) as srv:
        engine = engine_on(srv.base_url, "on", stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        cold_left: list[float] = []  # what was left of the server's cold start as the warm-up went out

        def watch(e) -> None:
            if e.kind == "RunStarted":  # its connections open (a stream worker started on a loaded machine may take
                srv.state.started_at = time.monotonic()  # longer than the cold start): the cold start counts from here
            elif e.kind == "WarmupStarted":
                cold_left.append(srv.state.cold_start_left_s)

        engine.subscribe(watch)
        assert await engine.run() == 0
        assert srv.state.requests_total == 3  # the warm-up, then the two agents
    started, warmed = kinds(seen, "WarmupStarted")[0], kinds(seen, "EndpointWarmed")[0]
    wave, first_sent = kinds(seen, "WaveStarted")[0], kinds(seen, "AgentStarted")[0]
    assert started.endpoints == ["box"]
    assert started.t <= wave.t and started.t <= warmed.t <= first_sent.t  # the agents' windows start after it
    assert warmed.error == "" and warmed.cold_start_s is not None
    # it waited out what was left of the server's cold start (~1 s), less the moment between the warm-up's start
    # and its request's sending (a few ms on a loaded host: 0.995 against 0.9995 once)
    assert warmed.cold_start_s >= cold_left[0] - 0.05 and cold_left[0] > 0.5
    endpoint = engine.report.to_dict()["endpoints"][0]
    assert endpoint["cold_start_s"] == warmed.cold_start_s and "warmup_error" not in endpoint


async def test_warmup_off_sends_nothing_before_the_agents():
    async with SimServer(SimSettings(**QUICK)) as srv:
        engine = engine_on(srv.base_url, "off")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
        assert srv.state.requests_total == 2
    assert not kinds(seen, "WarmupStarted", "EndpointWarmed")
    assert "cold_start_s" not in engine.report.to_dict()["endpoints"][0]


@pytest.mark.warmup_auto
async def test_auto_warms_a_loopback_endpoint_even_when_it_is_called_hosted():
    async with SimServer(SimSettings(**QUICK)) as srv:
        engine = engine_on(srv.base_url, "auto", kind="hosted")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
        assert srv.state.requests_total == 3
    assert kinds(seen, "EndpointWarmed")[0].cold_start_s is not None


@pytest.mark.warmup_auto
def test_auto_warms_local_endpoints_and_the_endpoints_the_run_uses_only():
    config = validate({
        "endpoints": [{"name": "api", "kind": "hosted", "base_url": "https://api.example.com/v1", "model": "m"},
                      {"name": "box", "kind": "local", "base_url": "http://10.0.0.5:8000/v1", "model": "m"},
                      {"name": "w1", "kind": "local", "base_url": "http://10.0.0.6:8000/v1", "model": "m"},
                      {"name": "w2", "kind": "local", "base_url": "http://10.0.0.7:8000/v1", "model": "m"},
                      {"name": "spare", "kind": "local", "base_url": "http://10.0.0.8:8000/v1", "model": "m"}],
        "pools": [{"name": "pool", "endpoints": ["w1", "w2"]}],
        "agents": [{"name": "a", "prompt": "p", "endpoint": "api"}, {"name": "b", "prompt": "p", "endpoint": "box"},
                   {"name": "c", "prompt": "p", "endpoint": "pool"}],
    })
    assert used_endpoints(config) == ["api", "box", "w1", "w2"]  # not "spare": no agent uses it
    assert [ep.name for ep in to_warm(config)] == ["box", "w1", "w2"]  # auto: not the hosted API
    on = config.model_copy(update={"run": config.run.model_copy(update={"warmup": "on"})})
    assert [ep.name for ep in to_warm(on)] == ["api", "box", "w1", "w2"]


def test_the_warmup_key_is_checked_like_the_others():
    from cerevisor_tui.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        validate({"run": {"warmup": "sometimes"}})
    assert "run.warmup" in str(caught.value) and "auto" in str(caught.value)


async def test_a_failed_warm_up_is_a_notice_and_the_run_goes_on(stream_process):
    async with SimServer(SimSettings(fail_first=1, fail_status=500, **QUICK)) as srv:
        engine = engine_on(srv.base_url, "on", stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0  # the agents were sent anyway, and completed
    warmed = kinds(seen, "EndpointWarmed")[0]
    assert warmed.cold_start_s is None and "500" in warmed.error
    notice = [e for e in kinds(seen, "RunNotice") if e.title == "Warm-up"][0]
    assert notice.severity == "warning" and "Warm-up of box failed" in notice.message
    assert Printer.describe(notice).startswith("WARNING: Warm-up of box failed")
    assert engine.report.to_dict()["endpoints"][0]["warmup_error"] == warmed.error


async def test_a_warm_up_without_a_first_token_ends_at_the_first_byte_deadline():
    async def silent(reader, writer):
        await reader.read()  # never answers

    async with RawServer(silent) as srv:
        # its agent is not retried: each retry only waited out the same deadline again
        engine = engine_on(srv.base_url, "on", agents=1, retries=0, first_byte_timeout_s=0.5, idle_timeout_s=0.5)
        seen: list = []
        engine.subscribe(seen.append)
        with anyio.fail_after(30):
            assert await engine.run() == 1  # its agent is killed at its own deadline
        assert srv.requests == 1 + len(kinds(seen, "AgentStarted"))  # the warm-up was sent once, not retried
    warmed = kinds(seen, "EndpointWarmed")[0]
    assert warmed.cold_start_s is None and warmed.error == "no first token within 0.5 s"
    killed = kinds(seen, "AgentKilled")
    assert killed and all(k.deadline == "first_byte" for k in killed)
    assert warmed.t <= kinds(seen, "AgentStarted")[0].t


async def test_a_run_stopped_while_warming_sends_no_agent():
    async def silent(reader, writer):
        await reader.read()

    async with RawServer(silent) as srv:
        engine = engine_on(srv.base_url, "on", agents=2)
        seen: list = []
        engine.subscribe(seen.append)
        engine.subscribe(lambda e: engine.stop("stopped while warming") if e.kind == "WarmupStarted" else None)
        with anyio.fail_after(30):
            assert await engine.run() == 1
    assert not kinds(seen, "AgentStarted")
    assert {e.status for e in kinds(seen, "AgentFinished")} == {"cancelled"}


async def test_the_headless_printer_says_warming_up_and_the_cold_start():
    async with SimServer(SimSettings(**QUICK)) as srv:
        engine = engine_on(srv.base_url, "on", agents=1)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    lines = [Printer.describe(e) for e in kinds(seen, "WarmupStarted", "EndpointWarmed")]
    assert lines[0] == "warming up: box (one short request each, before its agents)"
    assert lines[1].startswith("box: warmed up, cold start ") and lines[1].endswith(" s")


def two_endpoints(sick_url: str, fine_url: str, *, warmup_timeout_s: float, **stall) -> Engine:
    """A run whose agents are split between a sick endpoint and a fine one, each warmed at the start."""
    return Engine(validate({
        "run": {"warmup": "on", "warmup_timeout_s": warmup_timeout_s, "metrics_interval_s": 0.2,
                "mode": "parallel", "max_concurrency": 4},
        "stall": {"first_byte_timeout_s": 600.0, **stall},
        "endpoints": [{"name": "sick", "base_url": sick_url, "model": "sim-model"},
                      {"name": "fine", "base_url": fine_url, "model": "sim-model"}],
        "agents": [{"name": f"{ep}{i}", "endpoint": ep, "prompt": "hello", "max_tokens": 4, "retries": 0}
                   for ep in ("sick", "fine") for i in range(2)],
    }))


async def test_a_dead_port_fails_its_warm_up_in_seconds_and_never_holds_the_other_endpoints_agents():
    dead = f"http://127.0.0.1:{free_port()}/v1"  # a port that never opens (a local server: waited for)
    async with SimServer(SimSettings(speed=10.0)) as fine:
        engine = two_endpoints(dead, fine.base_url, warmup_timeout_s=1.0, first_byte_timeout_s=1.0)
        seen: list = []
        engine.subscribe(seen.append)
        with anyio.fail_after(60):
            assert await engine.run() == 1  # the dead endpoint's agents end at their own deadline
    warmed = {e.endpoint: e for e in kinds(seen, "EndpointWarmed")}
    assert warmed["fine"].cold_start_s is not None
    assert warmed["sick"].cold_start_s is None and warmed["sick"].error.startswith("no first token within 1 s")
    started = {e.agent: e for e in kinds(seen, "AgentStarted")}
    # the fine endpoint's agents went as its warm-up ended, long before the dead one's gave up
    assert max(started["fine0"].t, started["fine1"].t) < warmed["sick"].t
    assert {e.agent for e in kinds(seen, "AgentFinished") if e.status == "completed"} == {"fine0", "fine1"}
    # the dead one's were held until its warm-up gave up, with a notice
    assert warmed["sick"].t <= min(started["sick0"].t, started["sick1"].t)
    assert [n for n in kinds(seen, "RunNotice") if n.title == "Warm-up" and "Warm-up of sick failed" in n.message]


@pytest.mark.parametrize("warmup_timeout_s, wedge_timeout_s", [(30.0, 1.5), (1.0, 2.0)],
                         ids=["wedge-within-warm-up", "warm-up-gives-up-first"])
async def test_a_wedged_endpoint_at_start_holds_no_other_agent_and_its_own_are_told_why_within_the_wedge_window(
        warmup_timeout_s, wedge_timeout_s):
    async with SimServer(SimSettings(wedge_after_s=0.0, tokens_per_s=50, ttft_s=0.05)) as sick, \
            SimServer(SimSettings(speed=10.0)) as fine:
        engine = two_endpoints(sick.base_url, fine.base_url, warmup_timeout_s=warmup_timeout_s,
                               wedge_timeout_s=wedge_timeout_s)
        seen: list = []
        engine.subscribe(seen.append)
        with anyio.fail_after(60):
            assert await engine.run() == 1
    warmed = {e.endpoint: e for e in kinds(seen, "EndpointWarmed")}
    started = {e.agent: e for e in kinds(seen, "AgentStarted")}
    assert warmed["fine"].cold_start_s is not None and warmed["sick"].cold_start_s is None
    assert max(started["fine0"].t, started["fine1"].t) < warmed["sick"].t  # not held by the wedged one
    assert {e.agent for e in kinds(seen, "AgentFinished") if e.status == "completed"} == {"fine0", "fine1"}
    if warmup_timeout_s > wedge_timeout_s:  # judged while it was out: it fails with the wedge's reason
        assert warmed["sick"].error.startswith("server wedged: no progress on any request for ")
    # the wedged endpoint's agents are told why as soon as they are sent: the server was still all along, since
    # the warm-up went out, so they do not each wait a wedge window of their own
    killed = {e.agent: e for e in kinds(seen, "AgentKilled")}
    assert set(killed) == {"sick0", "sick1"}
    for name in ("sick0", "sick1"):
        assert killed[name].deadline == "wedge" and killed[name].reason.startswith("server wedged")
        assert killed[name].t - started[name].t < wedge_timeout_s
    wedged = kinds(seen, "ServerWedged")
    assert wedged and {w.endpoint for w in wedged} == {"sick"}


async def test_a_pools_agents_go_to_the_member_that_has_warmed_while_another_still_warms():
    async def silent(reader, writer):
        await reader.read()  # takes the warm-up, never answers

    async with RawServer(silent) as slow, SimServer(SimSettings(speed=10.0)) as fine:
        engine = Engine(validate({
            "run": {"warmup": "on", "warmup_timeout_s": 3.0, "mode": "parallel", "max_concurrency": 4},
            "endpoints": [{"name": "slow", "base_url": slow.base_url, "model": "sim-model"},
                          {"name": "fine", "base_url": fine.base_url, "model": "sim-model"}],
            "pools": [{"name": "fleet", "endpoints": ["slow", "fine"]}],
            "agents": [{"name": f"a{i}", "endpoint": "fleet", "prompt": "hello", "max_tokens": 4} for i in range(3)],
        }))
        seen: list = []
        engine.subscribe(seen.append)
        with anyio.fail_after(60):
            assert await engine.run() == 0
        assert slow.requests == 1  # the warm-up alone
    placed = kinds(seen, "AgentPlaced")
    assert len(placed) == 3 and {p.endpoint for p in placed} == {"fine"}
    # all placed, and done, while the slow member's warm-up was still out (the run's end ended it)
    assert not [e for e in kinds(seen, "EndpointWarmed") if e.endpoint == "slow" and e.t < placed[-1].t]


async def test_a_resumed_runs_warm_up_carries_its_own_request_id(tmp_path):
    """A resumed run sends its warm-up again: under the resumed run's prefix (engine/resume.py request_prefix),
    never the id the first run's warm-up was sent with."""
    from cerevisor_tui.contract import commands as cmd
    from cerevisor_tui.engine.resume import read_journal
    from cerevisor_tui.engine.sinks.journal import Journal

    run_dir = tmp_path / "run"
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0)) as srv:
        config = engine_on(srv.base_url, "on").config.model_copy(
            update={"run": validate({"run": {"warmup": "on", "mode": "sequential"}}).run})
        for resumed in (None, "resumed"):
            engine = Engine(config, run_id="r1", run_dir=str(run_dir),
                            resumed=read_journal(run_dir) if resumed else None)
            journal = Journal(run_dir, engine.report)
            journal.open(resume=resumed is not None)
            engine.subscribe(journal)
            # stopped once a0 has ended and the endpoint has warmed (a resumed run's a0 ends at once, reused,
            # while its warm-up may still be out: agents no longer wait for it)
            ended: set[str] = set()

            def stop_when_done(e, engine=engine, ended=ended) -> None:
                if e.kind == "EndpointWarmed" or (e.kind == "AgentFinished" and e.agent == "a0"):
                    ended.add(e.kind)
                if ended == {"EndpointWarmed", "AgentFinished"}:
                    engine.handle(cmd.Stop(reason="test"))

            engine.subscribe(stop_when_done)
            await engine.run()
            journal.close()
        ids = [r["request_id"] for r in srv.state.requests]
    warmups = [i for i in ids if ".warmup." in i]
    assert len(warmups) == 2 and warmups[0] == "r1.warmup.box"
    assert warmups[1].startswith("r1.r") and warmups[1].endswith(".warmup.box")
    assert len(ids) == len(set(ids))


async def test_a_warm_up_is_timed_and_ended_on_the_runs_clock():
    """The warm-up's deadline and its events are on the run's clock (engine/clock.py), as the attempts' are, so the
    wedge rules weigh its send time against theirs on one clock: a silent server's warm-up ends at 30 s of that
    clock, told at that time, whatever the wall took."""
    async def silent(reader, writer):
        await reader.read()  # never answers

    clock = VirtualClock()
    start = clock.now()
    async with RawServer(silent) as srv:
        engine = Engine(validate({
            # (the server's looks, which it never answers either, only every 100 s)
            "run": {"warmup": "on", "metrics_interval_s": 100},
            "stall": {"first_byte_timeout_s": 30.0, "idle_timeout_s": 30.0},
            "endpoints": [{"name": "box", "base_url": srv.base_url, "kind": "local", "model": "m"}],
            "agents": [{"name": "a0", "prompt": "hello", "max_tokens": 4, "retries": 0}]}), clock=clock)
        seen: list = []
        engine.subscribe(seen.append)
        codes: list[int] = []

        async def run() -> None:
            codes.append(await engine.run())

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await until(lambda: srv.requests == 1, "the warm-up request")
            await clock.advance(29.9)
            assert not kinds(seen, "EndpointWarmed") and srv.requests == 1
            await clock.advance(0.2)
            warmed = (await until(lambda: kinds(seen, "EndpointWarmed"), "the warm-up's end"))[0]
            await until(lambda: srv.requests == 2, "the agent's request, after the warm-up")
            await clock.advance(30.1)  # the agent's own first-byte deadline ends the run
            await until(lambda: codes, "the run's end")
    assert codes == [1]
    assert kinds(seen, "WarmupStarted")[0].t == start
    assert warmed.error == "no first token within 30 s" and warmed.t - start == pytest.approx(30.0, abs=0.2)
