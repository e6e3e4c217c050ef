"""A pool member that is up (its health check says 200) but fails every request with a 500 or a 429: the agent
placed there moves to a member with room without spending a retry, saying so, and the failing member is
degraded for placement, so the agents admitted after it go elsewhere."""

from __future__ import annotations

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from tests.conftest import free_port
from tests.test_fleet import FAST, fleet


@pytest.mark.anyio
@pytest.mark.parametrize("status", [500, 429])
async def test_an_agent_whose_member_fails_its_requests_moves_to_one_with_room(status, stream_process):
    failing = SimSettings(tokens_per_s=2000, ttft_s=0.0, fail_first=10_000, fail_status=status)
    async with SimServer(failing) as bad, SimServer(FAST) as good:
        engine = Engine(validate(fleet({"bad": bad.base_url, "good": good.base_url}, 3, turns=2,
                                       run={"max_concurrency": 1})), stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0  # retries = 0: a failure that did not move its agent would fail it
        assert bad.state.requests_total == 1  # degraded after its first failure: nothing more is sent there
        counts = dict(good.state.requests_by_agent)
    placed = [(e.agent, e.endpoint, e.moved_from) for e in seen if e.kind == "AgentPlaced"]
    assert placed == [("a0", "bad", ""), ("a0", "good", "bad"), ("a1", "good", ""), ("a2", "good", "")]
    moved = next(e for e in seen if e.kind == "AgentPlaced" and e.moved_from)
    assert f"failed its request (HTTP {status}" in moved.reason
    assert counts == {"a0": 2, "a1": 2, "a2": 2}
    notices = [e for e in seen if e.kind == "RunNotice"]
    assert [e.title for e in notices] == ["Pool member degraded"] and "bad failed a request" in notices[0].message
    assert not [e for e in seen if e.kind == "AgentRetrying"]


@pytest.mark.anyio
async def test_with_no_other_member_to_go_to_the_agent_retries_where_it_is():
    failing = SimSettings(tokens_per_s=2000, ttft_s=0.0, fail_first=1, fail_status=500)
    async with SimServer(failing) as flaky:
        config = fleet({"flaky": flaky.base_url, "down": f"http://127.0.0.1:{free_port()}/v1"}, 1, turns=1)
        config["agents"][0]["retries"] = 1
        engine = Engine(validate(config))
        engine.placement.mark_down("down", "refused a connection (nothing listens on its port)")
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
        assert flaky.state.requests_total == 2
    assert not [e for e in seen if e.kind == "AgentPlaced" and e.moved_from]
    assert [e.attempt for e in seen if e.kind == "AgentRetrying"] == [2]
    assert [e.title for e in seen if e.kind == "RunNotice"] == ["Pool member degraded"]


def test_a_degraded_member_takes_new_agents_only_when_no_other_has_room_and_recovers_after_its_time():
    from cerevisor_tui.config.models import PoolConfig
    from cerevisor_tui.engine.placement import DEGRADED_S, MemberLoad, Placement

    placement = Placement([PoolConfig(name="fleet", endpoints=["a", "b"])])
    loads = [MemberLoad("a", 0, 2), MemberLoad("b", 1, 2)]
    assert placement.choose("fleet", loads, 0.0).name == "a"  # emptier
    assert placement.mark_degraded("a", "HTTP 500", 10.0) and not placement.mark_degraded("a", "HTTP 500", 11.0)
    assert placement.choose("fleet", loads, 12.0).name == "b"
    assert placement.escape_target("fleet", loads, "a", 12.0).name == "b"
    full = [MemberLoad("a", 0, 2), MemberLoad("b", 2, 2)]
    assert placement.choose("fleet", full, 12.0).name == "a"  # degraded, but the only one with room
    assert placement.escape_target("fleet", full, "a", 12.0) is None  # nowhere with room: it stays
    assert placement.choose("fleet", loads, 11.0 + DEGRADED_S).name == "a"  # its last failure is long past
    assert "a" not in placement.degraded
