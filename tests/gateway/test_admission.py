"""Admission of sessions under the run's mode, cap and pause: a session holds a slot while active and gives it
back after release_after_s; a new session's first request waits for one; and the statuses that tell it."""

from __future__ import annotations

import asyncio
import functools
import re

import anyio
import httpx
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.printer import Printer

from ..conftest import RawServer, chunk, http_head, sse_chunk, until
from .conftest import Answer, chat, post, served, sim_endpoint

pytestmark = pytest.mark.anyio


def _index(s, kind, agent, where=lambda e: True) -> int:
    """Where in the run's events the first `kind` of `agent` that `where` accepts is."""
    return next(i for i, e in enumerate(s.events) if isinstance(e, kind) and e.agent == agent and where(e))


def _status_at(s, agent: str, status: str) -> int:
    return _index(s, ev.AgentStatus, agent, lambda e: e.status == status)


async def _request(client: httpx.AsyncClient, url: str, session: str, out: dict[str, Answer], *, key: str = "",
                   **body) -> None:
    out[key or session] = await post(client, url, chat(**body), headers={"X-Session-ID": session})


async def test_sequential_a_second_session_waits_until_the_first_releases_its_slot():
    async with served(run={"mode": "sequential"}, gateway={"release_after_s": 2.0}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        await _request(client, s.url + "/chat/completions", "first", answers, stream=False)
        assert answers["first"].status == 200
        await until(lambda: s.session("first").st.status == "idle", "the first request's end told")
        assert s.session("first").holding
        group.start_soon(_request, client, s.url + "/chat/completions", "second", answers)
        await until(lambda: s.session("second").queued == 1 if "second" in s.engine.sessions.by_name else False,
                    "the second session's request queued")
        assert s.session("first").holding, "release_after_s has not passed: the first session keeps its slot"
        assert not s.of(ev.AgentStarted, "second")
        await until(lambda: "second" in answers, "the second session's answer", timeout=30)
        assert answers["second"].status == 200 and answers["second"].text
        # it was admitted only once the first had given its slot back
        assert _status_at(s, "first", "released") < _index(s, ev.AgentStarted, "second")
        [started] = s.of(ev.AgentStarted, "second")
        assert started.queued_s > 0.1  # shown apart: time queued in the gateway is not model silence
        assert s.engine.scheduler.max_running == 1


async def test_a_session_holding_its_slot_goes_straight_through():
    async with served(run={"mode": "sequential"}, gateway={"release_after_s": 30}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for turn in range(3):
            answer = await post(client, s.url + "/chat/completions", chat(f"turn {turn}"),
                                headers={"X-Session-ID": "keeper"})
            assert answer.status == 200
        assert len(s.of(ev.AgentQueued, "keeper")) == 1  # its first request only
        assert [e.queued_s < 0.5 for e in s.of(ev.AgentStarted, "keeper")] == [True] * 3
        assert s.session("keeper").requests == 3 and s.session("keeper").holding


async def test_parallel_cap_queues_the_session_past_it():
    async with served(run={"mode": "parallel", "max_concurrency": 2}, gateway={"release_after_s": 2.0}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        for name in ("a", "b"):
            await _request(client, s.url + "/chat/completions", name, answers)
            await until(lambda name=name: not s.session(name).in_flight, f"{name}'s request ended")
        assert s.engine.scheduler.running == 2
        group.start_soon(_request, client, s.url + "/chat/completions", "c", answers)
        await until(lambda: "c" in s.engine.sessions.by_name and s.session("c").queued == 1
                    and s.session("c").st.status == "queued", "c queued")  # counted first, its status just after
        assert s.session("a").holding and s.session("b").holding
        # the operator is told why c waits, as it starts to: who holds the slots, and when an idle one is given back
        assert not s.of(ev.SessionWaits, "a")  # a slot was free
        await until(lambda: s.of(ev.SessionWaits, "c"), "c told why it waits")  # (its holder's task, just after)
        [queued] = s.of(ev.SessionWaits, "c")
        assert re.fullmatch(r"all 2 slots of the run are taken \(a idle \d+ s, b idle \d+ s\); an idle session gives "
                            r"its slot back 2 s after its last request \(\[gateway\] release_after_s; l on its row "
                            r"gives it back now\)", queued.why), queued.why
        assert Printer.describe(queued) == f"c: waits for a slot: {queued.why}"
        await until(lambda: "c" in answers, "c's answer", timeout=30)
        assert answers["c"].status == 200
        # c was admitted when a or b (the one that went first) gave its slot back
        released = _status_at(s, "a", "released")
        assert released < _index(s, ev.AgentStarted, "c")
        assert s.engine.scheduler.max_running == 2


async def test_parallel_cap_raised_live_admits_the_queued_session():
    async with served(run={"mode": "parallel", "max_concurrency": 1}, gateway={"release_after_s": 30}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        await _request(client, s.url + "/chat/completions", "a", answers)
        group.start_soon(_request, client, s.url + "/chat/completions", "b", answers)
        await until(lambda: "b" in s.engine.sessions.by_name and s.session("b").queued == 1, "b queued")
        s.engine.handle(cmd.SetConcurrency(cap=2))
        await until(lambda: "b" in answers, "b's answer once the cap is 2", timeout=10)
        assert answers["b"].status == 200 and s.session("a").holding


async def test_release_after_shortened_live_gives_an_idle_sessions_slot_to_the_waiting_one_at_once():
    # the settings screen's set_gateway: the idle session's hold reads the new release time now, not in 30 s
    async with served(run={"mode": "sequential"}, gateway={"release_after_s": 30}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        await _request(client, s.url + "/chat/completions", "idle", answers, stream=False)
        await until(lambda: s.session("idle").st.status == "idle", "the first session idle, holding its slot")
        group.start_soon(_request, client, s.url + "/chat/completions", "next", answers)
        await until(lambda: "next" in s.engine.sessions.by_name and s.session("next").queued == 1, "next queued")
        live = {"release_after_s": 0.0, "max_sessions_per_key": 1024, "keepalive_s": 0.2, "down_after_s": 30.0}
        assert s.engine.handle(cmd.SetGateway(**live)) == "release_after_s"
        assert s.engine.handle(cmd.SetGateway(**live)) == ""  # nothing changed the second time
        await until(lambda: "next" in answers, "the waiting session's answer", timeout=10)
        assert answers["next"].status == 200
        assert _status_at(s, "idle", "released") < _index(s, ev.AgentStarted, "next")
        [notice] = [e for e in s.of(ev.RunNotice) if "gateway settings applied" in e.message]
        assert notice.message == "gateway settings applied: release_after_s 0"


async def test_release_after_zero_admits_each_request_on_its_own():
    async with served(run={"mode": "sequential"}, gateway={"release_after_s": 0}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for turn in range(2):
            answer = await post(client, s.url + "/chat/completions", chat(f"turn {turn}"),
                                headers={"X-Session-ID": "each"})
            assert answer.status == 200
            await until(lambda: not s.session("each").holding, "the slot given back after the request")
        assert len(s.of(ev.AgentQueued, "each")) == 2  # every request waits for a slot of its own
        assert s.statuses("each").count("released") == 2


class HeldChat:
    """A chat upstream that sends each request's head and first token, then holds the rest until the test answers
    it (`answer(i)`, the i-th request it was sent): how long a session streams is the test's to say, not the
    machine's."""

    def __init__(self) -> None:
        self.arrived = 0
        self._answer: dict[int, asyncio.Event] = {}

    def _gate(self, index: int) -> asyncio.Event:
        return self._answer.setdefault(index, asyncio.Event())

    def answer(self, index: int) -> None:
        self._gate(index).set()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index, self.arrived = self.arrived, self.arrived + 1
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one")))
        await writer.drain()
        await self._gate(index).wait()
        writer.write(chunk(sse_chunk(" two", finish="stop") + b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()


async def test_release_after_zero_lets_another_session_in_between_two_requests():
    # sequential, per-request admission: while "a" streams, "b" queues; a's next request goes behind b's
    upstream = HeldChat()
    async with RawServer(upstream) as raw, \
            served(endpoints=[sim_endpoint(raw.base_url, name="held")], run={"mode": "sequential"},
                   gateway={"release_after_s": 0}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        group.start_soon(_request, client, s.url + "/chat/completions", "a", answers)
        await until(lambda: s.of(ev.FirstToken, "a"), "a streaming")
        group.start_soon(_request, client, s.url + "/chat/completions", "b", answers)
        await until(lambda: "b" in s.engine.sessions.by_name and s.session("b").queued == 1, "b queued")
        await until(lambda: s.of(ev.SessionWaits, "b"), "b told why it waits")
        [queued] = s.of(ev.SessionWaits, "b")
        assert queued.why == ("the one slot of the run is taken (a asking); each slot is given back as its request "
                              "ends ([gateway] release_after_s = 0)")
        upstream.answer(0)
        await until(lambda: "a" in answers, "a's first answer")
        # a's request ended and its slot went at once (release_after_s 0): b is admitted with no request of a's
        await until(lambda: s.of(ev.FirstToken, "b"), "b admitted after a's request, and streaming")
        group.start_soon(lambda: _request(client, s.url + "/chat/completions", "a", answers, key="a2", content="again"))
        await until(lambda: s.session("a").queued == 1, "a's next request queued behind b")
        upstream.answer(1)
        upstream.answer(2)
        await until(lambda: "a2" in answers and "b" in answers, "both answers")
        assert upstream.arrived == 3
        assert all(answers[k].status == 200 and answers[k].text == "one two" for k in ("a", "b", "a2"))
        b_done = _index(s, ev.TurnFinished, "b")
        a_second = _index(s, ev.AgentStarted, "a", lambda e: e.attempt == 2)
        assert b_done < a_second


async def test_pause_holds_new_sessions_and_resume_admits_them():
    async with served(gateway={"release_after_s": 30}) as s, httpx.AsyncClient(timeout=30) as client, \
            anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        await _request(client, s.url + "/chat/completions", "holder", answers)
        s.engine.handle(cmd.Pause())
        group.start_soon(_request, client, s.url + "/chat/completions", "newcomer", answers)
        await until(lambda: "newcomer" in s.engine.sessions.by_name and s.session("newcomer").queued == 1,
                    "the newcomer queued")
        await until(lambda: s.of(ev.SessionWaits, "newcomer"), "the newcomer told why it waits")
        assert [e.why for e in s.of(ev.SessionWaits, "newcomer")] == ["admissions are paused (p resumes them)"]
        # a session that holds its slot is not admitted again: its requests go on while paused
        await _request(client, s.url + "/chat/completions", "holder", answers, key="holder2", content="more")
        assert answers["holder2"].status == 200
        assert "newcomer" not in answers and not s.of(ev.AgentStarted, "newcomer")
        s.engine.handle(cmd.Resume())
        await until(lambda: "newcomer" in answers, "the newcomer's answer after resume", timeout=10)
        assert answers["newcomer"].status == 200


async def test_auto_mode_admits_sessions():
    async with served(run={"mode": "auto"}, gateway={"release_after_s": 0.2}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        for name in ("x", "y", "z"):
            group.start_soon(_request, client, s.url + "/chat/completions", name, answers)
        await until(lambda: len(answers) == 3, "every session's answer", timeout=30)
        assert all(a.status == 200 and a.text for a in answers.values())


async def test_statuses_of_a_session_queued_prefill_streaming_idle_released():
    async with served(gateway={"release_after_s": 0.3}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=8), headers={"X-Session-ID": "one"})
        assert answer.status == 200
        await until(lambda: s.session("one").st.status == "released", "the slot given back")
        assert s.statuses("one") == ["queued", "prefill", "streaming", "idle", "released"]
        # its next request waits for a slot again, and tells it the same way
        await post(client, s.url + "/chat/completions", chat("again"), headers={"X-Session-ID": "one"})
        await until(lambda: s.statuses("one")[-1] == "released", "released again")
        assert s.statuses("one")[5:] == ["queued", "prefill", "streaming", "idle", "released"]


async def test_sequential_releasing_an_idle_session_admits_the_next_one_at_once():
    """The operator's release (`l`): an idle session holding the one slot gives it back now, not release_after_s
    (here 600 s) after its last request, and the session waiting for it is admitted."""
    async with served(run={"mode": "sequential"}, gateway={"release_after_s": 600}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        await _request(client, s.url + "/chat/completions", "first", answers, stream=False)
        await until(lambda: s.session("first").st.status == "idle", "the first request's end told")
        with pytest.raises(ValueError, match="no agent named"):
            s.engine.handle(cmd.Release(agent="nobody"))
        group.start_soon(_request, client, s.url + "/chat/completions", "second", answers)
        await until(lambda: "second" in s.engine.sessions.by_name and s.session("second").queued == 1,
                    "the second session's request queued")
        with pytest.raises(ValueError, match="1 request in flight or queued"):  # its slot is its request's
            s.engine.handle(cmd.Release(agent="second"))
        assert s.session("first").holding and not s.of(ev.AgentStarted, "second")
        assert s.engine.handle(cmd.Release(agent="first")) is True
        await until(lambda: "second" in answers, "the second session's answer", timeout=30)
        assert answers["second"].status == 200 and answers["second"].text
        assert _status_at(s, "first", "released") < _index(s, ev.AgentStarted, "second")
        assert not s.session("first").holding and s.session("first").st.status == "released"
        assert s.engine.handle(cmd.Release(agent="first")) is False  # it holds none now
        # its harness comes back: its request waits for the slot again, as any new session's does
        group.start_soon(functools.partial(_request, client, s.url + "/chat/completions", "first", answers,
                                           key="first again"))
        await until(lambda: s.session("first").queued == 1, "the first session queued again")
        s.engine.handle(cmd.Release(agent="second"))
        await until(lambda: "first again" in answers, "the first session's next answer", timeout=30)
        assert answers["first again"].status == 200


async def test_a_side_request_beside_the_main_turn_leaves_the_row_on_the_main_turn():
    """Claude Code's small request while its turn streams: one row, whose status and clock stay the main turn's
    (the oldest request in flight) while the side request runs and after it ends."""
    async with served(sim={"speed": 1.0, "tokens_per_s": 20}, gateway={"release_after_s": 30}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}
        group.start_soon(functools.partial(_request, client, s.url + "/chat/completions", "cc", answers,
                                           key="main", max_tokens=60))
        await until(lambda: "cc" in s.engine.sessions.by_name and s.session("cc").st.status == "streaming",
                    "the main turn streaming")
        session = s.session("cc")
        [main] = session.in_flight.values()
        group.start_soon(functools.partial(_request, client, s.url + "/chat/completions", "cc", answers,
                                           key="side", max_tokens=2, stream=False))
        await until(lambda: len(session.in_flight) == 2, "the side request in flight")
        assert session.st.current is main and session.st.status == "streaming"
        await until(lambda: "side" in answers, "the side request's answer")
        assert answers["side"].status == 200 and "main" not in answers
        assert session.st.current is main and session.st.status == "streaming"
        side = _index(s, ev.AgentStarted, "cc", lambda e: e.attempt == 2)
        assert [e.status for e in s.events[side:] if isinstance(e, ev.AgentStatus)][-1] == "streaming"
        await until(lambda: "main" in answers, "the main turn's answer")
        await until(lambda: session.st.status == "idle", "the session idle")
        assert session.st.current is None
