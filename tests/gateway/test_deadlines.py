"""The watchdog on a session's requests: the first-byte deadline (504 before the headers, an error event
after), the idle deadline mid-stream, the operator's kill and extension; each kill aborts the upstream request,
is recorded with its reason, and the session goes on."""

from __future__ import annotations

import anyio
import httpx
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import NO_EXTENSIONS, Answer, chat, post, served

pytestmark = pytest.mark.anyio

# The simulator computes a prompt in chunks of 32 tokens at 200 tokens/s: a long prompt (LONG, 2,000 tokens)
# takes ten seconds to its first token, and a short one ("hi") starts at once, even right after a long one
# was aborted mid-prefill.
SLOW_PREFILL = {"speed": 1.0, "prefill_tokens_per_s": 200, "max_num_batched_tokens": 32, "ttft_s": 0.0,
                "tokens_per_s": 100}
LONG = "many words " * 730


def _killed(s, agent: str) -> list[ev.AgentKilled]:
    return s.of(ev.AgentKilled, agent)


async def test_first_byte_deadline_before_the_headers_is_a_504_naming_it():
    async with served(sim=SLOW_PREFILL, stall={"first_byte_timeout_s": 1.0, **NO_EXTENSIONS}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(LONG, stream=False),
                            headers={"X-Session-ID": "slow"})
        assert answer.status == 504
        error = answer.json()["error"]
        assert error["type"] == "timeout"
        assert "first_byte deadline" in error["message"] and "no first token after 1" in error["message"]
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        [killed] = _killed(s, "slow")
        assert killed.deadline == "first_byte" and killed.reason.startswith("no first token after 1")
        [entry] = s.engine.report.to_dict()["sessions"]
        assert entry["kills"] == [{"request": 1, "deadline": "first_byte", "reason": killed.reason}]
        # the session goes on: its next request is served
        again = await post(client, s.url + "/chat/completions", chat("hi", stream=False),
                           headers={"X-Session-ID": "slow"})
        assert again.status == 200 and again.json()["choices"][0]["message"]["content"]
        session = s.session("slow")
        await until(lambda: not session.in_flight and session.st.status == "idle", "the second request's end told")
        assert session.requests == 2 and session.kills == [killed.reason]


async def test_first_byte_deadline_of_a_stream_before_any_comment_is_a_504_too():
    async with served(sim=SLOW_PREFILL, gateway={"keepalive_s": 30},
                      stall={"first_byte_timeout_s": 1.0, **NO_EXTENSIONS}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(LONG), headers={"X-Session-ID": "slow"})
        assert answer.status == 504 and "first_byte deadline" in answer.json()["error"]["message"]
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")


async def test_first_byte_deadline_after_keepalives_is_an_error_event():
    async with served(sim=SLOW_PREFILL, gateway={"keepalive_s": 0.2},
                      stall={"first_byte_timeout_s": 1.0, **NO_EXTENSIONS}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(LONG), headers={"X-Session-ID": "slow"})
        assert answer.status == 200 and answer.comments
        [error] = answer.data
        assert error["error"]["type"] == "timeout" and "first_byte deadline" in error["error"]["message"]
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")


async def test_idle_deadline_mid_stream_is_an_error_event_and_the_session_goes_on():
    async with served(sim={"stall_after_tokens": 3}, stall={"idle_timeout_s": 1.0, **NO_EXTENSIONS}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=20), headers={"X-Session-ID": "st"})
        assert answer.status == 200
        assert answer.text  # the tokens before the stall reached the client
        error = answer.data[-1]["error"]
        assert "idle deadline" in error["message"] and "no output for 1" in error["message"]
        assert "after 3 tokens" in error["message"]
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        [killed] = _killed(s, "st")
        assert killed.deadline == "idle" and killed.tokens == 3
        assert s.engine.report.to_dict()["sessions"][0]["kills"][0]["deadline"] == "idle"
        # the killed answer is in the transcript's events as partial
        partial = [m for m in s.of(ev.MessageRecorded, "st") if m.role == "assistant"]
        assert partial and partial[0].partial
        again = await post(client, s.url + "/chat/completions", chat("again", max_tokens=2),
                           headers={"X-Session-ID": "st"})
        assert again.status == 200 and again.frames[-1] == b"data: [DONE]"
        await until(lambda: not s.session("st").in_flight, "the second request's end told")
        assert s.session("st").requests == 2


async def test_operator_kill_ends_the_request_and_aborts_it_upstream():
    async with served(sim={"speed": 1.0, "tokens_per_s": 20}) as s, httpx.AsyncClient(timeout=30) as client, \
            anyio.create_task_group() as group:
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat(max_tokens=400),
                                      headers={"X-Session-ID": "victim"}))

        group.start_soon(ask)
        await until(lambda: s.of(ev.FirstToken, "victim"), "the stream started")
        assert s.engine.handle(cmd.Kill(agent="victim")) is True
        await until(lambda: answers, "the answer ended")
        [answer] = answers
        assert answer.status == 200
        assert "killed by operator" in answer.data[-1]["error"]["message"]
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        [killed] = _killed(s, "victim")
        assert killed.deadline == "operator" and killed.reason == "killed by operator"
        assert s.engine.report.to_dict()["sessions"][0]["kills"][0]["reason"] == "killed by operator"
        assert s.engine.handle(cmd.Kill(agent="victim")) is False  # nothing in flight now
        again = await post(client, s.url + "/chat/completions", chat("again", max_tokens=2),
                           headers={"X-Session-ID": "victim"})
        assert again.status == 200


async def test_operator_kill_before_the_first_byte_is_a_503():
    async with served(sim=SLOW_PREFILL) as s, httpx.AsyncClient(timeout=30) as client, \
            anyio.create_task_group() as group:
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat(LONG, stream=False),
                                      headers={"X-Session-ID": "victim"}))

        group.start_soon(ask)
        await until(lambda: s.sim.requests_total == 1, "the request at the server")
        s.engine.handle(cmd.Kill(agent="victim", reason="not now"))
        await until(lambda: answers, "the answer ended")
        assert answers[0].status == 503 and "not now" in answers[0].json()["error"]["message"]
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")


async def test_operator_extend_saves_a_request_from_its_first_byte_deadline():
    # 1,600 characters of LONG (400 tokens) take two seconds to their first token; the deadline is 1.5 s,
    # extended by 30 s at once
    async with served(sim=SLOW_PREFILL, stall={"first_byte_timeout_s": 1.5, **NO_EXTENSIONS}) as s, \
            httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat(LONG[:1600], stream=False),
                                      headers={"X-Session-ID": "patient"}))

        group.start_soon(ask)
        await until(lambda: s.of(ev.AgentStarted, "patient"), "the request sent")
        assert s.engine.handle(cmd.Extend(agent="patient", seconds=30)) is True
        [extended] = s.of(ev.StallExtended, "patient")
        assert extended.by_operator and extended.extend_s == 30
        await until(lambda: answers, "the answer", timeout=30)
        assert answers[0].status == 200
        assert not _killed(s, "patient") and s.sim.aborted_total == 0
        # the request ends a moment after its last byte (its meters): then there is nothing left to extend
        await until(lambda: not s.engine.sessions.by_name["patient"].in_flight, "the request's end")
        assert s.engine.handle(cmd.Extend(agent="patient")) is False


async def test_stop_ends_each_request_in_flight_and_in_the_queue_with_a_clear_error():
    async with served(sim={"speed": 1.0, "tokens_per_s": 20}, run={"mode": "sequential"}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        answers: dict[str, Answer] = {}

        async def ask(session: str, stream: bool) -> None:
            answers[session] = await post(client, s.url + "/chat/completions", chat(max_tokens=400, stream=stream),
                                          headers={"X-Session-ID": session})

        group.start_soon(ask, "running", True)
        await until(lambda: s.of(ev.FirstToken, "running"), "the first session streaming")
        group.start_soon(ask, "waiting", False)
        await until(lambda: "waiting" in s.engine.sessions.by_name and s.session("waiting").queued == 1,
                    "the second session queued")
        s.engine.handle(cmd.Stop(reason="maintenance"))
        await until(lambda: len(answers) == 2, "both answers ended")
        assert "maintenance" in answers["running"].data[-1]["error"]["message"]
        assert answers["waiting"].status == 503 and answers["waiting"].headers["retry-after"]
        assert "the run is stopping (maintenance)" in answers["waiting"].json()["error"]["message"]
        await until(lambda: s.sim.aborted_total == 1, "the running request aborted upstream")
        assert s.sim.requests_total == 1  # the queued one was never sent
    assert s.exit_code == 0


async def test_operator_kill_of_a_queued_request_drops_it_from_the_queue():
    async with served(sim={}, run={"mode": "sequential"}, gateway={"release_after_s": 60}) as s, \
            httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as group:
        assert (await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "holder"})).status \
            == 200
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat(stream=False),
                                      headers={"X-Session-ID": "waiting"}))

        group.start_soon(ask)
        await until(lambda: "waiting" in s.engine.sessions.by_name and s.session("waiting").queued == 1, "queued")
        assert s.engine.handle(cmd.Kill(agent="waiting", reason="not this one")) is True
        await until(lambda: answers, "the dropped request's answer")
        assert answers[0].status == 503 and "not this one" in answers[0].json()["error"]["message"]
        session = s.session("waiting")
        assert session.queued == 0 and not session.holding and session.holder is None
        assert s.engine.scheduler.queued == 0 and s.sim.requests_total == 1
        assert session.st.status not in ("queued", "prefill")
        assert s.engine.handle(cmd.Kill(agent="waiting")) is False  # nothing left to kill


@pytest.mark.parametrize("path, body, frame", [
    ("/messages", {"model": "sim-model", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]},
     b"event: error\ndata: "),
    ("/responses", {"model": "sim-model", "max_output_tokens": 20, "input": "hi"}, b"event: error\ndata: "),
], ids=["messages", "responses"])
async def test_idle_deadline_of_messages_and_responses_is_their_own_error_event(path, body, frame):
    async with served(sim={"stall_after_tokens": 3}, stall={"idle_timeout_s": 1.0, **NO_EXTENSIONS}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + path, {**body, "stream": True}, headers={"X-Session-ID": "st"})
        assert answer.status == 200
        assert answer.frames[-1].startswith(frame)
        error = answer.data[-1]
        assert error["type"] == "error"
        message = error["error"]["message"] if path == "/messages" else error["message"]
        assert "idle deadline" in message and "after 3 tokens" in message
        if path == "/messages":
            assert error["error"]["type"] == "timeout_error"
        await until(lambda: s.sim.aborted_total == 1, "the upstream request aborted")
        [killed] = await until(lambda: s.of(ev.AgentKilled, "st"), "the kill told")
        assert killed.deadline == "idle" and killed.tokens == 3
