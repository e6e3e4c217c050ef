"""The stream worker process (`[run] stream_process`): the same answers, errors and kills as reading in-process,
and a worker that dies or is closed never takes a run (or a stray process) with it.

The stall, fault and secret tests run both ways through the `stream_process` fixture; these cover what only
the worker has: its own life cycle."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from cerevisor_tui.config import ConfigError, SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine, wants_stream_process
from cerevisor_tui.sim import SimServer
from tests.conftest import RawServer, chunk, http_head, sse_chunk, until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) is not alive either
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _workflow(url: str, *, stream_process: bool, retries: int = 0, agents: int = 3, **stall) -> Engine:
    return Engine(validate({
        "run": {"mode": "parallel", "max_concurrency": 4},
        "stall": {"idle_timeout_s": 5, "first_byte_timeout_s": 10, **stall},
        "endpoints": [{"name": "box", "base_url": url, "model": "sim-model"}],
        "agents": [{"name": f"a{i}", "prompt": f"task {i}", "turns": [f"more {i}"], "max_tokens": 40,
                    "retries": retries} for i in range(agents)],
    }), stream_process=stream_process)


@pytest.mark.anyio
async def test_the_worker_gives_the_same_answers_and_figures_as_in_process():
    results = []
    for stream_process in (False, True):
        async with SimServer(SimSettings(tokens_per_s=400, ttft_s=0.05, seed=7)) as srv:
            engine = _workflow(srv.base_url, stream_process=stream_process)
            assert await engine.run() == 0
            assert (engine.connections.worker is not None) == stream_process
        results.append({name: (st.output, st.completion_tokens, st.tokens, st.turn, len(st.messages))
                        for name, st in engine.agents.items()})
    assert results[0] == results[1]
    assert all(output for output, *_ in results[1].values())


@pytest.mark.anyio
async def test_a_worker_that_dies_mid_stream_fails_its_attempts_retryably_and_a_new_one_takes_over():
    """SIGKILL the worker while an agent streams: the attempt fails saying so, the retry starts a new worker,
    and the run completes."""
    async def slow(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        for i in range(8):
            writer.write(chunk(sse_chunk(f"t{i} ")))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(chunk(sse_chunk("", finish="stop") + b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    async with RawServer(slow) as srv:
        engine = _workflow(srv.base_url, stream_process=True, retries=1, agents=1)
        seen: list = []
        killed: list[int] = []

        def on_event(event) -> None:
            seen.append(event)
            if event.kind == "FirstToken" and not killed:
                pid = engine.connections.worker.pid
                killed.append(pid)
                os.kill(pid, signal.SIGKILL)

        engine.subscribe(on_event)
        assert await engine.run() == 0
    retrying = [e for e in seen if e.kind == "AgentRetrying"]
    assert len(retrying) == 1 and "stream worker process ended" in retrying[0].cause, retrying
    assert engine.agents["a0"].output == "".join(f"t{i} " for i in range(8))
    assert engine.connections.worker.restarts == 1 and engine.connections.worker.pid != killed[0]
    assert srv.requests == 3  # the killed attempt, then both turns


@pytest.mark.anyio
async def test_the_worker_ends_with_the_run_and_a_kill_reaches_the_server():
    closed: list[float] = []

    async def endless(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("one ")))
        await writer.drain()
        try:
            await reader.read()  # returns when the client side closes the connection
        finally:
            closed.append(time.monotonic())

    async with RawServer(endless) as srv:
        engine = _workflow(srv.base_url, stream_process=True, agents=2)
        pids: list[int] = []

        def on_event(event) -> None:
            if event.kind == "FirstToken":
                pids.append(engine.connections.worker.pid)
                engine.handle(cmd.Kill(agent=event.agent))

        engine.subscribe(on_event)
        assert await engine.run() == 1
        await until(lambda: len(closed) == 2 and srv.open_connections == 0, "the server to see both connections closed")
    assert {st.status for st in engine.agents.values()} == {"killed"}
    assert len(set(pids)) == 1 and not _alive(pids[0])


@pytest.mark.anyio
async def test_a_worker_that_will_not_exit_is_killed_and_the_run_still_ends_cleanly():
    """SIGSTOP the worker once the last agent is done: closing the run waits its grace, kills it, and
    returns the run's own exit code (no error out of the engine)."""
    async with SimServer(SimSettings(tokens_per_s=400, ttft_s=0.05)) as srv:
        engine = _workflow(srv.base_url, stream_process=True, agents=1)
        stopped: list[int] = []

        def on_event(event) -> None:
            if event.kind == "AgentFinished":
                stopped.append(engine.connections.worker.pid)
                os.kill(stopped[0], signal.SIGSTOP)

        engine.subscribe(on_event)
        t0 = time.monotonic()
        assert await engine.run() == 0
        assert time.monotonic() - t0 < 15
    assert stopped and not _alive(stopped[0])


@pytest.mark.anyio
async def test_a_worker_that_cannot_start_leaves_the_run_reading_in_process(monkeypatch):
    async with SimServer(SimSettings(tokens_per_s=400, ttft_s=0.05)) as srv:
        engine = _workflow(srv.base_url, stream_process=True, agents=1)
        monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
        assert await engine.run() == 0
    assert engine.connections.worker is None and engine.agents["a0"].output
    assert "stream worker process did not start" in engine.connections.stream_process_problem


def test_auto_means_the_console_on_a_machine_with_a_second_cpu(monkeypatch):
    workflow = {"endpoints": [{"name": "box", "kind": "simulated"}], "agents": [{"name": "a", "prompt": "p"}]}
    config = validate(workflow)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert wants_stream_process(config, console=True) and not wants_stream_process(config, console=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert not wants_stream_process(config, console=True)
    on = validate({"run": {"stream_process": "on"}, **workflow})
    off = validate({"run": {"stream_process": "off"}, **workflow})
    assert wants_stream_process(on, console=False) and not wants_stream_process(off, console=True)
    with pytest.raises(ConfigError, match="stream_process"):
        validate({"run": {"stream_process": "sometimes"}, **workflow})
