"""Pools of endpoints and the headers routers keep affinity by (issue 12): config checks, X-Session-ID and
X-Request-ID on every request, each attempt's request id in the journal."""

from __future__ import annotations

import contextlib
import json
import time

import anyio
import pytest

from cerevisor_tui.config import ConfigError, SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.journal import Journal
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.sim import SimServer
from tests.conftest import free_port

FAST = SimSettings(tokens_per_s=2000, ttft_s=0.0)


def pool_config(**extra) -> dict:
    return {"endpoints": [{"name": "a", "base_url": "http://127.0.0.1:1/v1"},
                          {"name": "b", "base_url": "http://127.0.0.1:2/v1"}],
            "pools": [{"name": "fleet", "endpoints": ["a", "b"]}],
            "agents": [{"name": "x", "endpoint": "fleet", "prompt": "p"}], **extra}


def test_an_agent_may_name_a_pool_and_the_pool_defaults_to_least_loaded():
    config = validate(pool_config())
    assert config.pools[0].policy == "least-loaded"
    assert config.agent_pool(config.agents[0]).name == "fleet"
    assert config.endpoints[0].session_header == "X-Session-ID"


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"pools": [{"name": "fleet", "endpoints": ["a", "c"]}]}, "pools[0] (fleet).endpoints[1]", "unknown endpoint 'c'"),
    ({"pools": [{"name": "a", "endpoints": ["a", "b"]}]}, "pools[0] (a).name", "already the name"),
    ({"pools": [{"name": "fleet", "endpoints": ["a", "a"]}]}, "pools[0] (fleet).endpoints[1]", "listed twice"),
    ({"pools": [{"name": "fleet", "endpoints": []}]}, "pools[0] (fleet).endpoints", "at least 1"),
    ({"pools": [{"name": "fleet", "endpoints": ["a"], "policy": "random"}]}, "pools[0] (fleet).policy", "least-loaded"),
    ({"agents": [{"name": "x", "endpoint": "flet", "prompt": "p"}]}, "agents[0] (x).endpoint", "pools: fleet"),
])
def test_a_bad_pool_is_a_config_error_naming_the_key(change, key, words):
    with pytest.raises(ConfigError) as info:
        validate(pool_config(**change), file="team.toml")
    assert info.value.key == key and words in str(info.value) and "team.toml" in str(info.value)


def test_a_session_header_must_be_a_header_name():
    bad = pool_config()
    bad["endpoints"][0]["session_header"] = "X Session"
    with pytest.raises(ConfigError) as info:
        validate(bad, file="team.toml")
    assert info.value.key == "endpoints[0] (a).session_header"


@pytest.mark.anyio
@pytest.mark.parametrize(("header", "expect"), [({}, "x-session-id"), ({"session_header": "X-Affinity"}, "x-affinity"),
                                                ({"session_header": ""}, None)])
async def test_every_request_carries_the_agents_session_id(header, expect, stream_process, tmp_path):
    """Every turn and retry of an agent carries the same session id, <run id>/<agent>, under the endpoint's
    header name (none when it is empty), and a per-attempt X-Request-Id that the journal records."""
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0, fail_first=1, fail_status=503)) as srv:
        engine = Engine(validate({"endpoints": [{"name": "e", "base_url": srv.base_url, **header}],
                                  "agents": [{"name": "a", "prompt": "p", "turns": ["q"], "max_tokens": 4},
                                             {"name": "ä b", "prompt": "p", "max_tokens": 4}]}),
                        run_dir=str(tmp_path), stream_process=stream_process)
        journal = Journal(tmp_path, engine.report)
        journal.open()
        engine.subscribe(journal)
        try:
            assert await engine.run() == 0
        finally:
            journal.close()
        seen = srv.state.requests
    assert len(seen) == 4  # three turns and one retry of the 503
    agent_b = "%C3%A4%20b"  # a header value is ASCII: the name percent-encoded, as X-Cerevisor-Agent has it
    sessions = {(r["agent"], r["headers"].get(expect) if expect else None) for r in seen}
    if expect:
        assert sessions == {("a", f"{engine.run_id}/a"), (agent_b, f"{engine.run_id}/{agent_b}")}
    assert all("x-session-id" not in r["headers"] for r in seen) == (expect != "x-session-id")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    journaled = [e["request_id"] for e in events if e["event"] == "AgentStarted"]
    assert sorted(journaled) == sorted(r["request_id"] for r in seen) and len(set(journaled)) == 4


# ---- placement ---------------------------------------------------------------------------------------------------
def fleet(urls: dict[str, str], agents: int, *, turns: int = 3, policy: str = "least-loaded", run: dict | None = None,
          member: dict | None = None) -> dict:
    return {"run": {"max_concurrency": 64, "metrics_interval_s": 60, **(run or {})},
            "endpoints": [{"name": n, "base_url": u, "model": "sim-model", **(member or {})} for n, u in urls.items()],
            "pools": [{"name": "fleet", "endpoints": list(urls), "policy": policy}],
            "agents": [{"name": f"a{i}", "endpoint": "fleet", "prompt": f"task {i} " * 40, "max_tokens": 4,
                        "retries": 0, "turns": [f"more {t}" for t in range(turns - 1)]} for i in range(agents)]}


def agents_by_server(servers: dict[str, SimServer]) -> dict[str, dict[str, int]]:
    """Each simulated replica's requests, counted by the agent that sent them."""
    return {name: dict(srv.state.requests_by_agent) for name, srv in servers.items()}


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
async def test_a_pool_spreads_its_agents_and_keeps_every_turn_on_one_member(policy):
    names = ["r0", "r1", "r2", "r3"]
    async with contextlib.AsyncExitStack() as stack:
        servers = {n: await stack.enter_async_context(SimServer(FAST)) for n in names}
        engine = Engine(validate(fleet({n: s.base_url for n, s in servers.items()}, 8, policy=policy)))
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
        counts = agents_by_server(servers)
    placed = {e.agent: e.endpoint for e in seen if e.kind == "AgentPlaced"}
    assert len(placed) == 8 and not any(e.moved_from for e in seen if e.kind == "AgentPlaced")
    for agent, member in placed.items():  # every turn of it on its member, none elsewhere
        assert counts[member].get(agent) == 3
        assert all(agent not in counts[other] for other in names if other != member)
    per_member = [sum(1 for m in placed.values() if m == n) for n in names]
    assert per_member == [2, 2, 2, 2]
    started = {(e.agent, e.endpoint) for e in seen if e.kind == "AgentStarted"}
    assert started == set(placed.items())  # the console is told where each attempt runs
    assert engine.started_event(0).agents["a0"].endpoint == "fleet"


@pytest.mark.anyio
async def test_least_loaded_counts_each_members_cap():
    """A member with room for 1 takes 1 agent of 5 when the other has room for 8, the rest wait for room."""
    async with SimServer(FAST) as small, SimServer(FAST) as big:
        config = fleet({"small": small.base_url, "big": big.base_url}, 5, turns=1)
        config["endpoints"][0]["max_concurrency"] = 1
        engine = Engine(validate(config))
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    placed = [e.endpoint for e in seen if e.kind == "AgentPlaced"]
    assert placed.count("small") == 1 and placed.count("big") == 4
    assert engine.scheduler.max_running == 5


@pytest.mark.anyio
async def test_an_agent_on_a_member_that_refuses_moves_at_once_and_says_its_prefix_is_lost(stream_process):
    """The first member refuses connections: the agent placed there moves to the other member in its next
    attempt, without spending a retry (retries = 0) or waiting; the member is down for the rest of the run."""
    async with SimServer(FAST) as live:
        dead = f"http://127.0.0.1:{free_port()}/v1"
        engine = Engine(validate(fleet({"dead": dead, "live": live.base_url}, 3, turns=2,
                                       run={"max_concurrency": 1})), stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
        counts = dict(live.state.requests_by_agent)
    placed = [e for e in seen if e.kind == "AgentPlaced"]
    assert [(e.agent, e.endpoint, e.moved_from) for e in placed] == [
        ("a0", "dead", ""), ("a0", "live", "dead"), ("a1", "live", ""), ("a2", "live", "")]
    assert "prefix" in placed[1].reason and "refused" in placed[1].reason
    assert counts == {"a0": 2, "a1": 2, "a2": 2}
    assert [e.title for e in seen if e.kind == "RunNotice"] == ["Pool member down"]
    assert not [e for e in seen if e.kind in ("AgentRetrying", "EndpointWaiting")]
    a0 = engine.report.to_dict()["agents"][0]
    assert (a0["pool"], a0["endpoint"], a0["moves"], a0["attempts"]) == ("fleet", "live", 1, 3)
    assert Printer.describe(placed[1]).startswith("a0: MOVED to live (pool fleet): moved from dead")


@pytest.mark.anyio
async def test_a_member_failing_its_health_check_gets_no_new_agent():
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0, cold_start_s=120)) as cold, SimServer(FAST) as warm:
        engine = Engine(validate(fleet({"cold": cold.base_url, "warm": warm.base_url}, 4, turns=1,
                                       run={"metrics_interval_s": 0.05})))
        seen: list = []
        engine.handle(cmd.Pause())  # admissions wait until the cold member's /health has put it down

        def watch(event) -> None:
            seen.append(event)
            if event.kind == "RunNotice" and event.title == "Pool member down":
                engine.handle(cmd.Resume())

        engine.subscribe(watch)
        assert await engine.run() == 0
    assert {e.endpoint for e in seen if e.kind == "AgentPlaced"} == {"warm"}
    down = [e for e in seen if e.kind == "RunNotice" and e.title == "Pool member down"]
    assert down and "health check" in down[0].message
    assert cold.state.requests_by_agent == {}


@pytest.mark.anyio
async def test_when_every_member_is_down_an_agent_waits_for_its_members_port_like_a_lone_local_endpoint():
    port = free_port()
    config = fleet({"a": f"http://127.0.0.1:{port}/v1", "b": f"http://127.0.0.1:{free_port()}/v1"}, 1, turns=1)
    engine = Engine(validate(config))
    seen: list = []
    started = anyio.Event()

    def watch(event) -> None:
        seen.append(event)
        if event.kind == "EndpointWaiting":
            started.set()

    engine.subscribe(watch)
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        await started.wait()  # both refused: it waits on the member it was moved to
        member = engine.agents["a0"].endpoint
        url = config["endpoints"][[e["name"] for e in config["endpoints"]].index(member)]["base_url"]
        async with SimServer(FAST, port=int(url.rsplit(":", 1)[1].split("/")[0])):
            with anyio.fail_after(30):
                while engine.agents["a0"].status != "completed":
                    await anyio.sleep(0.05)
    # it moved to b if its first refusal came before the health checks marked b down too, else it waited on a
    placed = [(e.endpoint, e.moved_from) for e in seen if e.kind == "AgentPlaced"]
    assert placed in ([("a", "")], [("a", ""), ("b", "a")]), placed


@pytest.mark.anyio
async def test_the_console_mirror_shows_where_each_agent_runs_and_its_meters(tmp_path):
    """The mirror learns placement and meters from the events alone, live and from the journal: the moved
    agent's row says where it runs and that its prefix was lost, with its cache share, context fill and cost."""
    from cerevisor_tui.ui.mirror import RunMirror

    async with SimServer(FAST) as live:
        config = fleet({"dead": f"http://127.0.0.1:{free_port()}/v1", "live": live.base_url}, 2, turns=2,
                       run={"max_concurrency": 1}, member={"price_in_per_mtok": 1.0, "price_out_per_mtok": 2.0})
        engine = Engine(validate(config), run_dir=str(tmp_path))
        journal = Journal(tmp_path, engine.report)
        journal.open()
        mirror = RunMirror()
        engine.subscribe(journal)
        engine.subscribe(mirror)
        try:
            assert await engine.run() == 0
        finally:
            journal.close()
    replayed = RunMirror()
    replayed.feed_records(json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines())
    for m in (mirror, replayed):
        a0, a1 = m.agents["a0"], m.agents["a1"]
        assert (a0.endpoint, a0.pool, a0.moved_from, a1.endpoint, a1.moved_from) == ("live", "fleet", "dead", "live", "")
        note = m.meter_note("a0")
        assert note.startswith("on live (moved from dead: prefix lost) · cache ") and "ctx " in note
        assert note.endswith(f"${engine.agents['a0'].cost_usd:.4f}") and engine.agents["a0"].cost_usd > 0
        assert m.run_cost_usd == pytest.approx(engine.budget.spent_usd)
        assert a0.cached_tokens == engine.agents["a0"].cached_tokens > 0
        shown = "".join("".join(parts) for _, parts in m.stream("a0").pieces)
        assert "↪ moved from dead" in shown  # the agent's stream says where it went on, and why
    assert any(n.title == "Agent moved" for n in mirror.notices)


@pytest.mark.anyio
async def test_auto_mode_sets_each_members_cap_and_placement_respects_it():
    """In auto mode each member has its own controller and live cap (a ConcurrencyChanged naming it); no
    member ever runs more of our agents than its live cap allows, and the pool's agents all complete."""
    async with SimServer(FAST) as a, SimServer(FAST) as b:
        config = fleet({"a": a.base_url, "b": b.base_url}, 12, turns=2,
                       run={"mode": "auto", "metrics_interval_s": 0.05, "auto": {"start_cap": 2, "max_cap": 4}})
        engine = Engine(validate(config))
        seen: list = []
        over: list[str] = []

        def watch(event) -> None:
            seen.append(event)
            if event.kind == "AgentStarted":
                for member in ("a", "b"):
                    if engine.scheduler.running_by_endpoint[member] > engine.scheduler.endpoint_cap(member):
                        over.append(member)

        engine.subscribe(watch)
        assert await engine.run() == 0
    caps = {e.endpoint for e in seen if e.kind == "ConcurrencyChanged" and e.endpoint}
    assert caps == {"a", "b"} and not over
    placed = [e.endpoint for e in seen if e.kind == "AgentPlaced"]
    assert sorted(set(placed)) == ["a", "b"] and len(placed) == 12


@pytest.mark.anyio
async def test_an_agent_whose_member_fails_its_health_check_moves_at_its_next_attempt():
    """The member answers, then its /health fails (the simulator goes back to loading): the agent running
    there is not moved mid-answer; its next attempt (here the operator's restart) goes to the other member."""
    stalls = SimSettings(tokens_per_s=2000, ttft_s=0.0, stall_after_tokens=1)
    async with SimServer(stalls) as a, SimServer(FAST) as b:
        config = fleet({"a": a.base_url, "b": b.base_url}, 1, turns=1, run={"metrics_interval_s": 0.05})
        config["stall"] = {"idle_timeout_s": 60}
        engine = Engine(validate(config))
        seen: list = []

        def watch(event) -> None:
            seen.append(event)
            if event.kind == "FirstToken" and engine.agents["a0"].endpoint == "a":
                a.state.settings.cold_start_s = 600.0  # /health answers 503 "loading" from now on
                a.state.started_at = time.monotonic()
            elif event.kind == "RunNotice" and event.title == "Pool member down":
                assert engine.handle(cmd.Retry(agent="a0")) == "restarting"

        engine.subscribe(watch)
        with anyio.fail_after(60):
            assert await engine.run() == 0
    moves = [(e.endpoint, e.moved_from) for e in seen if e.kind == "AgentPlaced"]
    assert moves == [("a", ""), ("b", "a")]
    moved = [e for e in seen if e.kind == "AgentPlaced"][1]
    assert "health check" in moved.reason and "prefix" in moved.reason
    assert b.state.requests_by_agent == {"a0": 1}
