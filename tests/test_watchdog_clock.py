"""The stall watchdog and the attempt owner on a virtual clock (engine/clock.py): the deadlines, warnings,
extensions and kills of DESIGN section 5, each at the very time the rules say, in microseconds of real time and
whatever the machine's load. Wall-clock end-to-end runs of the same rules stay in test_stall.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.config.models import ResolvedStall, resolve_stall
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.attempt import Attempts, Budget, TurnFigures
from cerevisor_tui.engine.clock import VirtualClock
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.watchdog import Watchdog

pytestmark = pytest.mark.anyio

STALL = {"first_byte_timeout_s": 10.0, "idle_timeout_s": 4.0, "warn_at": [0.5, 0.8], "extend_s": 3.0,
         "max_extensions": 2, "extend_when_server_busy": False}


@dataclass
class Rig:
    clock: VirtualClock
    attempts: Attempts
    watchdog: Watchdog
    policies: dict[str, ResolvedStall]
    st: AgentState
    events: list[ev.Event] = field(default_factory=list)

    def of(self, kind: type[ev.Event]) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def at(self, kind: type[ev.Event]) -> list[float]:
        """When each event of `kind` was told, in seconds of the attempt."""
        return [round(e.t - self.start, 6) for e in self.of(kind)]

    start: float = 0.0


@asynccontextmanager
async def watched(**stall: object) -> AsyncIterator[tuple[Rig, Attempt]]:
    """One attempt begun at the clock's start, under the watchdog, until the block ends."""
    config = validate({"stall": {**STALL, **stall}, "endpoints": [{"name": "ep", "base_url": "http://127.0.0.1:9/v1"}],
                       "agents": [{"name": "a", "prompt": "p"}]})
    clock = VirtualClock()
    events: list[ev.Event] = []
    policies = {"ep": resolve_stall(config.stall, config.endpoints[0])}

    async def no_limit(_ep: object) -> int:
        return 0

    attempts = Attempts(endpoints={"ep": config.endpoints[0]}, policies=policies, figures={"ep": TurnFigures()},
                        emit=events.append, subscribers=[events.append], subscriber_failed=lambda *a: None,
                        scrub=Scrubber([]), budget=Budget(), context_limit=no_limit, clock=clock)
    watchdog = Watchdog(policies, events.append, clock)
    st = AgentState(config.agents[0], "ep", 0)
    rig = Rig(clock, attempts, watchdog, policies, st, events, start=clock.now())
    att = attempts.begin(st, 1, "r.a.t1.a1", turns=1)
    async with anyio.create_task_group() as group:
        group.start_soon(watchdog.watch, st, att, policies["ep"])
        yield rig, att
        group.cancel_scope.cancel()


async def test_no_first_token_warns_at_each_fraction_and_kills_at_the_first_byte_deadline():
    async with watched() as (rig, att):
        await rig.clock.advance(9.999)
        assert rig.at(ev.StallWarning) == pytest.approx([5.0, 8.0], abs=0.002) and not att.kill_reason
        assert rig.st.status == "stalling"
        await rig.clock.advance(0.002)
    assert att.kill_deadline == "first_byte" and att.kill_reason == "no first token after 10 s"


async def test_after_the_first_token_the_idle_window_runs_from_the_last_sign_of_life():
    async with watched() as (rig, att):
        await rig.clock.advance(3.0)
        rig.attempts.feeder(rig.st, att)("hello", "", "", 1)
        assert rig.st.status == "streaming" and rig.of(ev.FirstToken)[0].ttft_s == pytest.approx(3.0)
        await rig.clock.advance(3.9)
        rig.attempts.feeder(rig.st, att)(" there", "", "", 1)  # a sign of life: the idle window starts again
        await rig.clock.advance(3.9)
        assert not att.kill_reason
        assert rig.at(ev.StallWarning) == pytest.approx([5.0, 6.2, 8.9, 10.1], abs=0.002)
        await rig.clock.advance(0.2)
    assert att.kill_deadline == "idle" and att.kill_reason == "no output for 4 s after 2 tokens"


async def test_keepalives_are_not_signs_of_life_unless_liveness_is_bytes():
    async with watched() as (rig, att):
        await rig.clock.advance(6.0)
        rig.attempts.keepalive(rig.st, att, by_bytes=False)
        await rig.clock.advance(4.1)
    assert att.kill_reason == "no first token after 10 s"
    async with watched(liveness="bytes") as (rig, att):
        await rig.clock.advance(6.0)
        rig.attempts.keepalive(rig.st, att, by_bytes=True)
        await rig.clock.advance(3.9)
        assert not att.kill_reason  # its byte at 6 s moved the window: idle now, to 10 s
        await rig.clock.advance(0.2)
    assert att.kill_deadline == "idle"


async def test_the_operators_extension_moves_the_deadline_and_rearms_only_the_warnings_ahead():
    async with watched() as (rig, att):
        await rig.clock.advance(8.5)
        rig.watchdog.extend(rig.st, att, 5.0)
        assert rig.st.status == "prefill"  # no longer stalling: its deadline is 15 s away from the start
        await rig.clock.advance(6.0)
        assert not att.kill_reason
        [extended] = rig.of(ev.StallExtended)
        assert extended.by_operator and extended.deadline_at - rig.start == pytest.approx(15.0)
        await rig.clock.advance(0.6)
    assert att.kill_reason == "no first token after 15 s"


async def test_a_busy_server_extends_the_deadline_at_most_max_extensions_times():
    async with watched(extend_when_server_busy=True) as (rig, att):
        asked: list[float] = []

        async def busy(endpoint: str, since: float) -> str:
            asked.append(rig.clock.now() - rig.start)
            return "3 requests waiting in the server's queue"

        rig.watchdog.busy_check = busy
        await rig.clock.advance(100.0)
    assert asked == pytest.approx([10.0, 13.0], abs=0.002)  # at the deadline and the first extended one; no more
    assert [e.reason for e in rig.of(ev.StallExtended)] == ["3 requests waiting in the server's queue"] * 2
    assert att.kill_reason == "no first token after 16 s"


async def test_prefill_progress_extends_to_its_projected_end_and_a_stuck_prefill_is_killed_saying_so():
    async with watched() as (rig, att):
        for second in range(1, 13):  # 1,000 of 20,000 prompt tokens a second, by the server's own clock
            await rig.clock.advance(1.0)
            rig.attempts.progress(rig.st, att, 20_000, 0, second * 1000, second * 1000, by_bytes=False)
        assert not att.kill_reason and not rig.of(ev.StallWarning)  # moving: warned of by no one
        extended = rig.of(ev.StallExtended)
        assert extended and extended[0].reason.startswith("prefill 50%")
        await rig.clock.advance(4.0 + 0.1)  # then nothing for the idle window
    assert att.kill_deadline == "first_byte"
    assert att.kill_reason.startswith("no prefill progress for 4") and "60% of 20,000 prompt tokens" in att.kill_reason


async def test_an_extension_given_before_the_watchdogs_first_look_stands():
    # the operator's `e` in the instant a request is sent, before its watchdog task has run once (it reset the
    # extension at its first look, so the request was killed at its plain deadline)
    async with watched() as (rig, att):
        rig.watchdog.extend(rig.st, att, 5.0)
        await rig.clock.advance(14.9)
        assert not att.kill_reason
        await rig.clock.advance(0.2)
    assert att.kill_reason == "no first token after 15 s"


async def test_a_tool_calls_deadline_warns_extends_and_cancels_on_the_runs_clock():
    """The tool watchdog (engine/watchdog.py `watch_tool`) on the run's clock: warnings at 5 and 8 s of a 10 s
    deadline, the operator's +5 s at 9 s re-arming only the warning still ahead (0.8 of 15 s, at 12 s), and the
    call cancelled at 15 s, each event timed on that clock (its looks come 1 ms after their time, as the
    attempts' do). On the host's clock it took 15 s of wall."""
    from cerevisor_tui.engine.state import ToolCall
    from cerevisor_tui.engine.watchdog import extend_tool, watch_tool

    clock = VirtualClock()
    events: list[ev.Event] = []
    start = clock.now()
    st = AgentState(validate({"endpoints": [{"name": "ep", "base_url": "http://127.0.0.1:9/v1"}],
                              "agents": [{"name": "a", "prompt": "p"}]}).agents[0], "ep", 0)
    call = ToolCall("call_1", "fake", "hang", start, start + 10.0, (0.5, 0.8))

    def told() -> list[tuple[float, float]]:
        return [(e.t - start, e.fraction) for e in events if isinstance(e, ev.ToolCallWarning)]

    with anyio.CancelScope() as call.scope:
        async with anyio.create_task_group() as group:
            group.start_soon(watch_tool, st, call, events.append, clock)
            await clock.advance(4.999)
            assert not events
            await clock.advance(3.003)
            assert told() == [(pytest.approx(5.0, abs=0.002), 0.5), (pytest.approx(8.0, abs=0.002), 0.8)]
            await clock.advance(0.998)  # 9 s
            extend_tool(st, call, 5.0, events.append, 1, clock)
            extended = events[-1]
            assert isinstance(extended, ev.StallExtended) and extended.t - start == pytest.approx(9.0)
            assert extended.deadline == "tool" and extended.deadline_at == start + 15.0
            await clock.advance(2.99)
            assert len(told()) == 2  # the 0.8 warning of the new deadline is due at 12 s, not before
            await clock.advance(0.02)
            assert told()[2:] == [(pytest.approx(12.0, abs=0.002), 0.8)]
            await clock.advance(2.98)  # 14.99 s
            assert not call.outcome
            await clock.advance(0.02)
    assert call.outcome == "timeout" and call.reason == "no result after 15 s (tool_timeout_s)"
