"""The two-deadline stall watchdog, at test scale over real loopback HTTP."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.clock import MONOTONIC, Clock, VirtualClock
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from tests.conftest import RawServer, chunk, free_port, http_head, sse_chunk, until

DONE = sse_chunk("", finish="stop") + sse_chunk(usage={"prompt_tokens": 1, "completion_tokens": 2}) + b"data: [DONE]\n\n"


def engine_for(url: str, stream_process: bool, *, kind: str = "local", retries: int = 0, clock: Clock = MONOTONIC,
               **stall) -> Engine:
    stall = {"idle_timeout_s": 1.0, "first_byte_timeout_s": 5.0, "warn_at": [0.5, 0.8, 0.95], **stall}
    return Engine(validate({
        "stall": stall,
        "endpoints": [{"name": "box", "base_url": url, "kind": kind, "model": "m"}],
        "agents": [{"name": "a1", "prompt": "hi", "retries": retries}],
    }), stream_process=stream_process, clock=clock)


def recorder(engine: Engine) -> list:
    seen: list = []
    engine.subscribe(seen.append)
    return seen


@asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[list[int]]:
    """The engine's run in a task beside the body, which drives its clock; yields the list its exit code lands in."""
    codes: list[int] = []

    async def run() -> None:
        codes.append(await engine.run())

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        yield codes


def keepalives_after_tokens(seconds: float):
    async def handler(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + sse_chunk("two ")))
        await writer.drain()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            writer.write(chunk(b": keep-alive\n\n"))
            await writer.drain()
        writer.write(chunk(DONE) + chunk(b""))
        await writer.drain()
    return handler


async def keepalives_run(stream_process: bool, seconds: float, **stall) -> tuple[Engine, list, int]:
    """A run whose server sends two tokens, then a keep-alive every 0.1 s for `seconds`, then the end: through the
    stream worker on the wall clock (its keep-alives and bytes are the child's to pass on), in this process on the
    run's clock moved by the test, keep-alive by keep-alive, each read before the clock moves on (the same rules
    to the watchdog's look, in microseconds). Returns the engine, what it told, and its exit code."""
    if stream_process:
        async with RawServer(keepalives_after_tokens(seconds)) as srv:
            engine = engine_for(srv.base_url, True, **stall)
            seen = recorder(engine)
            return engine, seen, await engine.run()
    clock = VirtualClock()
    ticks = [asyncio.Event() for _ in range(round(seconds / 0.1))]

    async def handler(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + sse_chunk("two ")))
        await writer.drain()
        for tick in ticks:
            await tick.wait()
            writer.write(chunk(b": keep-alive\n\n"))
            await writer.drain()
        writer.write(chunk(DONE) + chunk(b""))
        await writer.drain()

    async with RawServer(handler) as srv:
        engine = engine_for(srv.base_url, False, clock=clock, **stall)
        seen = recorder(engine)
        try:
            async with running(engine) as codes:
                await until(lambda: codes or "".join(e.text for e in seen if e.kind == "TokenDelta") == "one two ",
                            "the two tokens")
                for i, tick in enumerate(ticks):
                    await clock.advance(0.1)
                    if codes:
                        break
                    tick.set()
                    await until(lambda: codes or len([e for e in seen if e.kind == "KeepAlive"]) == i + 1,  # noqa: B023
                                f"keep-alive {i + 1}, or the run's end")
        finally:
            for tick in ticks:  # a killed stream's server ends too
                tick.set()
    return engine, seen, codes[0]


@pytest.mark.anyio
async def test_keepalives_without_tokens_are_killed_at_the_idle_deadline_after_each_warning(stream_process):
    engine, seen, code = await keepalives_run(stream_process, 3.0)
    assert code == 1
    last_token = max(e.t for e in seen if e.kind == "TokenDelta")
    warnings = [e for e in seen if e.kind == "StallWarning"]
    killed = [e for e in seen if e.kind == "AgentKilled"]
    assert [w.fraction for w in warnings] == [0.5, 0.8, 0.95]
    assert all(w.deadline == "idle" for w in warnings)
    assert len(killed) == 1 and killed[0].deadline == "idle"
    assert killed[0].reason.startswith("no output for 1") and killed[0].reason.endswith("after 2 tokens")
    assert abs((killed[0].t - last_token) - 1.0) < (0.5 if stream_process else 0.002)
    assert max(w.t for w in warnings) < killed[0].t
    assert any(e.kind == "KeepAlive" for e in seen)  # shown either way
    assert engine.agents["a1"].status == "killed"
    report = engine.report.to_dict()["agents"][0]
    assert report["status"] == "killed" and report["stall_warnings"] == 3 and report["error"].startswith("idle deadline: no output")


@pytest.mark.anyio
async def test_with_byte_liveness_keepalives_keep_the_stream_alive(stream_process):
    engine, seen, code = await keepalives_run(stream_process, 2.0, liveness="bytes")  # twice the idle deadline
    assert code == 0
    assert len([e for e in seen if e.kind == "KeepAlive"]) >= 10
    assert not [e for e in seen if e.kind in ("AgentKilled", "StallWarning")]


@pytest.mark.anyio
async def test_a_slow_but_alive_stream_is_never_killed():
    # On the run's clock, moved by the test (engine/clock.py VirtualClock), over real loopback HTTP: each token is
    # sent once a second of that clock has passed, 3 s in all, past either 2 s deadline; only each token's sign
    # of life keeps it. In this process only: the deadlines are the engine's, whichever process reads the
    # stream, and the stream worker's tokens reach it as signs of life in every stream-process test here.
    clock = VirtualClock()
    send = [asyncio.Event() for _ in range(4)]  # each token, then the end, when the test says

    async def slow(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        for i in range(3):
            await send[i].wait()
            writer.write(chunk(sse_chunk(f"t{i} ")))
            await writer.drain()
        await send[3].wait()
        writer.write(chunk(DONE) + chunk(b""))
        await writer.drain()

    async with RawServer(slow) as srv:
        engine = engine_for(srv.base_url, False, first_byte_timeout_s=2.0, idle_timeout_s=2.0, clock=clock)
        seen = recorder(engine)
        async with running(engine) as codes:
            await until(lambda: [e for e in seen if e.kind == "AgentStarted"], "the request sent")
            for i in range(3):
                await clock.advance(1.0)  # half the idle (and first-byte) deadline
                send[i].set()
                await until(lambda: codes or len([e for e in seen if e.kind == "TokenDelta"]) == i + 1,  # noqa: B023
                            f"token {i}, or the run's end")
            send[3].set()
    assert codes == [0]
    assert not [e for e in seen if e.kind == "AgentKilled"]
    assert engine.agents["a1"].output == "t0 t1 t2 "
    sent = next(e.t for e in seen if e.kind == "AgentStarted")
    assert [e.t - sent for e in seen if e.kind == "TokenDelta"] == pytest.approx([1.0, 2.0, 3.0])
    # only the first warning fraction (0.5) can pass between tokens half the deadline apart
    assert {e.fraction for e in seen if e.kind == "StallWarning"} <= {0.5}


@pytest.mark.anyio
async def test_first_byte_deadline_kills_with_its_own_reason(stream_process):
    async def silent(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        await writer.drain()
        await asyncio.sleep(10)

    async with RawServer(silent) as srv:
        engine = engine_for(srv.base_url, stream_process, first_byte_timeout_s=0.8, idle_timeout_s=0.2)
        seen = recorder(engine)
        assert await engine.run() == 1
    killed = next(e for e in seen if e.kind == "AgentKilled")
    # the silence as measured at the kill (a loaded machine's loop may look a few tenths late), and the 0.8 s
    # deadline named beside it once it ran visibly past
    assert killed.deadline == "first_byte", killed
    found = re.fullmatch(r"no first token after ([\d.]+) s( \(deadline 0\.8 s\))?", killed.reason)
    assert found and float(found[1]) >= 0.8, killed.reason
    assert bool(found[2]) == (float(found[1]) - 0.8 > 0.5), killed.reason
    assert [w.deadline for w in seen if w.kind == "StallWarning"] == ["first_byte"] * 3


async def _late_server(port: int, refused: anyio.Event, started: list) -> None:
    await refused.wait()

    async def ok(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + sse_chunk("two ") + DONE) + chunk(b""))
        await writer.drain()

    async with RawServer(ok, port=port) as srv:
        started.append(srv)
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_a_local_endpoint_that_opens_its_port_late_is_waited_for(stream_process):
    port = free_port()
    engine = engine_for(f"http://127.0.0.1:{port}/v1", stream_process, kind="local", first_byte_timeout_s=5.0)
    seen = recorder(engine)
    started: list = []
    # the port opens once the agent has found it shut twice (and waited twice), however long its start took
    refused = anyio.Event()
    engine.subscribe(lambda e: refused.set() if len([w for w in seen if w.kind == "EndpointWaiting"]) >= 2 else None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_late_server, port, refused, started)
        code = await engine.run()
        tg.cancel_scope.cancel()
    assert code == 0 and engine.agents["a1"].output == "one two "
    waits = [e for e in seen if e.kind == "EndpointWaiting"]
    assert len(waits) >= 2 and all("cannot connect" in w.reason for w in waits)
    assert not [e for e in seen if e.kind == "AgentKilled"]


@pytest.mark.anyio
async def test_a_hosted_endpoint_that_refuses_fails_at_once(stream_process):
    port = free_port()
    engine = engine_for(f"http://127.0.0.1:{port}/v1", stream_process, kind="hosted", first_byte_timeout_s=5.0)
    seen = recorder(engine)
    assert await engine.run() == 1
    # from the run's start (its stream worker up, when it has one: a loaded machine takes seconds to start it)
    started = next(e for e in seen if e.kind == "RunStarted")
    failed = next(e for e in seen if e.kind == "AgentFinished")
    assert failed.t - started.t < 1.0
    assert not [e for e in seen if e.kind == "EndpointWaiting"]
    st = engine.agents["a1"]
    assert st.status == "failed" and st.error.startswith("endpoint box: cannot connect")


@pytest.mark.anyio
async def test_a_kill_closes_the_connection_on_the_server_side(stream_process):
    closed_at: list[float] = []

    async def endless(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ")))
        await writer.drain()
        try:
            await reader.read()  # returns when the client closes the connection
        finally:
            closed_at.append(time.monotonic())

    async with RawServer(endless) as srv:
        engine = engine_for(srv.base_url, stream_process, idle_timeout_s=0.6)
        seen = recorder(engine)
        assert await engine.run() == 1
        await until(lambda: closed_at and srv.open_connections == 0, "the server to see the connection closed")
        killed = next(e for e in seen if e.kind == "AgentKilled")
        assert closed_at and closed_at[0] - killed.t < 1.0
        assert srv.open_connections == 0


@pytest.mark.anyio
async def test_operator_extend_moves_the_deadline_and_the_stall_kill_after_it_is_retried():
    # On the run's clock, moved by the test, over real loopback HTTP: each attempt gets two tokens, then silence.
    # In this process only: an extension, a stall kill and its retry are the engine's, whichever process reads
    # the stream (a kill through the stream worker: test_a_kill_closes_the_connection_on_the_server_side).
    clock = VirtualClock()

    async def two_tokens_then_silence(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + sse_chunk("two ")))
        await writer.drain()
        await reader.read()  # until the kill closes the connection

    async with RawServer(two_tokens_then_silence) as srv:
        engine = engine_for(srv.base_url, False, retries=1, idle_timeout_s=1.0, clock=clock)
        seen = recorder(engine)
        extended: list[float] = []

        def on_event(e):
            if e.kind == "StallWarning" and e.fraction == 0.8 and not extended:
                before = engine.agents["a1"].current.deadline_at
                assert engine.handle(cmd.Extend(agent="a1", seconds=1.0))
                extended.append(engine.agents["a1"].current.deadline_at - before)
        engine.subscribe(on_event)
        async with running(engine) as codes:
            for attempt in (1, 2):  # its tokens, then five seconds of silence on the run's clock
                def answered(attempt: int = attempt) -> bool:
                    return bool(codes) or "".join(e.text for e in seen if e.kind == "TokenDelta"
                                                  and e.attempt == attempt) == "one two "
                await until(answered, f"attempt {attempt}'s tokens")
                await clock.advance(5.0)
    assert codes == [1]
    killed = [e for e in seen if e.kind == "AgentKilled"]
    last_token = max(e.t for e in seen if e.kind == "TokenDelta" and e.t < killed[0].t)
    assert extended == [pytest.approx(1.0)]
    assert killed[0].t - last_token == pytest.approx(2.0, abs=0.002)  # 1 s idle + 1 s extension, to the look
    assert any(e.kind == "StallExtended" and e.reason == "extended by operator" for e in seen)
    assert sum(1 for e in seen if e.kind == "AgentRetrying") == 1  # stall kills are retried
    retried = max(e.t for e in seen if e.kind == "TokenDelta")
    assert len(killed) == 2 and killed[1].t - retried == pytest.approx(1.0, abs=0.002)  # the retry: not extended


@pytest.mark.anyio
async def test_operator_kill_ends_without_retry(stream_process):
    async with RawServer(keepalives_after_tokens(5.0)) as srv:
        engine = engine_for(srv.base_url, stream_process, retries=3)
        seen = recorder(engine)
        engine.subscribe(lambda e: engine.handle(cmd.Kill(agent="a1")) if e.kind == "FirstToken" else None)
        assert await engine.run() == 1
    assert engine.agents["a1"].status == "killed" and engine.agents["a1"].error == "killed by operator"
    assert not [e for e in seen if e.kind == "AgentRetrying"]


def _waiting_engine(url: str, first_byte_s: float, stream_process: bool, clock: Clock = MONOTONIC,
                    model: str = "") -> Engine:
    return Engine(validate({
        "stall": {"first_byte_timeout_s": first_byte_s, "extend_when_server_busy": False},
        "endpoints": [{"name": "box", "base_url": url, "model": model}],
        "agents": [{"name": "a", "prompt": "p", "max_tokens": 5, "retries": 0}],
    }), stream_process=stream_process, clock=clock)


@pytest.mark.anyio
async def test_a_first_byte_timeout_raised_live_saves_an_agent_already_waiting():
    """The model answers after 1.5 s; the 1 s first-byte deadline would kill the agent, but the operator
    raises it to 30 s from settings while it waits. On the run's clock, moved by the test, over real loopback
    HTTP (the server answers when the test says); in this process only: the policy and its deadlines are the
    engine's, whichever process reads the stream."""
    clock = VirtualClock()
    answer = asyncio.Event()

    async def later(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        await writer.drain()
        await answer.wait()
        writer.write(chunk(sse_chunk("one ") + sse_chunk("two ") + DONE) + chunk(b""))
        await writer.drain()

    async with RawServer(later) as srv:
        engine = _waiting_engine(srv.base_url, 1.0, False, clock=clock, model="m")
        seen = []

        def on_event(event) -> None:
            seen.append(event)
            if event.kind == "AgentStarted":
                config = engine.config.model_copy(update={"stall": engine.config.stall.model_copy(
                    update={"first_byte_timeout_s": 30.0})})
                assert engine.set_stall(config) == ["box"]

        engine.subscribe(on_event)
        try:
            async with running(engine) as codes:
                await until(lambda: [e for e in seen if e.kind == "AgentStarted"], "the request sent")
                await clock.advance(1.5)  # past the old deadline
                answer.set()
        finally:
            answer.set()
    assert codes == [0]
    assert not any(e.kind == "AgentKilled" for e in seen)
    assert [e.ttft_s for e in seen if e.kind == "FirstToken"] == [pytest.approx(1.5)]
    assert engine.policies["box"].first_byte_timeout_s == 30.0


@pytest.mark.anyio
async def test_a_first_byte_timeout_lowered_live_ends_a_waiting_agent_at_once(stream_process):
    async with SimServer(SimSettings(ttft_s=20.0, tokens_per_s=200)) as srv:
        engine = _waiting_engine(srv.base_url, 60.0, stream_process)
        seen = []
        lowered: list[float] = []

        def lower_once_waiting(event) -> None:  # the request is out: the agent waits for its first byte
            if event.kind == "AgentStarted" and not lowered:
                config = engine.config.model_copy(update={"stall": engine.config.stall.model_copy(
                    update={"first_byte_timeout_s": 0.2})})
                lowered.append(time.monotonic())
                engine.set_stall(config)

        engine.subscribe(seen.append)
        engine.subscribe(lower_once_waiting)
        assert await engine.run() == 1
    killed = [e for e in seen if e.kind == "AgentKilled"]
    assert len(killed) == 1 and killed[0].deadline == "first_byte"
    assert killed[0].t - lowered[0] < 5.0  # at once, not at the old 60 s deadline (or the 20 s answer)


@pytest.mark.anyio
async def test_a_retry_waits_on_the_runs_clock_and_its_events_carry_the_runs_time():
    """A server's Retry-After of 30 s is waited out on the run's clock (no wall second passes: the test moves it),
    and the events of the conversation (its messages, the retry) are stamped with that clock, as its attempts are."""
    clock = VirtualClock()
    answered: list[int] = []

    async def busy_then_answer(reader, writer):
        answered.append(1)
        if len(answered) == 1:
            body = b'{"error": {"message": "busy"}}'
            writer.write(http_head(503, "application/json", "retry-after: 30\r\n", length=len(body)) + body)
        else:
            writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ") + DONE) + chunk(b""))
        await writer.drain()

    async with RawServer(busy_then_answer) as srv:
        engine = engine_for(srv.base_url, False, retries=1, clock=clock)
        seen = recorder(engine)
        async with running(engine) as codes:
            await until(lambda: any(e.kind == "AgentRetrying" for e in seen),
                        lambda: f"the retry told: {[e.kind for e in seen]}", timeout=5)
            await clock.advance(29.0)
            assert len(answered) == 1  # still waiting: its 30 s are the run's
            await clock.advance(1.0)
            await until(lambda: codes, "the run's end")
    assert codes == [0]
    retrying = next(e for e in seen if e.kind == "AgentRetrying")
    second = [e for e in seen if e.kind == "AgentStarted"][1]
    assert retrying.delay_s == 30.0 and second.t - retrying.t == pytest.approx(30.0, abs=0.002)
    recorded = [e.t for e in seen if e.kind == "MessageRecorded"]
    assert recorded and all(1000.0 <= t <= clock.now() for t in recorded)
