"""The control socket on a real run against the simulator: a client that attaches mid-run gets the past
from the journal and then every event live, nothing missed or doubled; commands and their replies; what
the socket refuses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.wire import PROTOCOL, Hello, encode, event_line
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.journal import Journal
from cerevisor_tui.sim import SimServer
from cerevisor_tui.supervisor import server as supervisor_server
from cerevisor_tui.supervisor.client import AttachError, CommandFailed, ControlClient
from cerevisor_tui.supervisor.protocol import socket_of
from cerevisor_tui.supervisor.server import ControlServer
from tests.conftest import until

pytestmark = pytest.mark.anyio


AS_NOBODY = ("import socket, sys, os; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX)\n"
             "try: s.connect(sys.argv[1])\nexcept PermissionError: print('denied'); sys.exit()\n"
             "print(s.makefile().readline())")
"""A client of uid 65534 (nobody): prints 'denied' when it cannot connect, else the server's first line."""




def journal_events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


class Run:
    """An engine with its journal and control socket, on the simulator."""

    def __init__(self, url: str, run_dir: Path, agents: int = 6, **run: Any) -> None:
        self.engine = Engine(validate({
            "run": {"mode": "parallel", "max_concurrency": 3, **run},
            "endpoints": [{"name": "sim", "base_url": url}],
            "agents": [{"name": f"a{i}", "prompt": f"task {i}", "max_tokens": 60} for i in range(agents)],
        }), run_id="r1", run_dir=str(run_dir))
        self.journal = Journal(run_dir, self.engine.report)
        self.journal.open()
        self.engine.subscribe(self.journal)
        self.server = ControlServer(run_dir, "r1", self.engine.handle, in_flight=self.engine.in_flight,
                                    journal_flush=self.journal.flush)  # as commands/run.py wires it
        self.run_dir = run_dir

    async def __aenter__(self) -> Run:
        await self.server.start()
        self.engine.subscribe(self.server)
        self.task = asyncio.ensure_future(self.engine.run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.engine.handle(cmd.Stop(reason="test over"))
        await asyncio.wait_for(asyncio.shield(self.task), 30)
        await self.server.close("the run ended")
        self.journal.close()


async def test_a_client_attached_mid_run_gets_the_past_then_every_event_once(tmp_path: Path):
    async with SimServer(SimSettings(tokens_per_s=150, ttft_s=0.05)) as sim:
        async with Run(sim.base_url, tmp_path / "run") as run:
            tokens: list[Any] = []
            run.engine.subscribe(lambda e: tokens.append(e) if e.kind == "TokenDelta" else None)
            await until(lambda: len(tokens) > 20, "tokens to flow")
            client = await ControlClient.connect(run.run_dir)
            assert client.hello.protocol == PROTOCOL and client.hello.run_id == "r1"
            seen: list[Any] = []
            reader = asyncio.ensure_future(client.run(seen.append))
            await asyncio.wait_for(asyncio.shield(run.task), 60)
            await run.server.close("the run ended")
            assert await asyncio.wait_for(reader, 10) == "the run ended"
    journaled = [json.dumps(e, sort_keys=True) for e in journal_events(tmp_path / "run")]
    received = [json.dumps(e.to_dict(), sort_keys=True) for e in seen
                if e.kind not in ("TokenDelta", "KeepAlive", "RunTally")]
    assert received == journaled  # the replay and the live events meet exactly: nothing missed, nothing twice
    # once, after the past: the run's own count of the tokens it streamed until then (the journal has none)
    tallies = [i for i, e in enumerate(seen) if e.kind == "RunTally"]
    assert len(tallies) == 1 and seen[tallies[0]].output_tokens > 20
    # the answers as the client saw them: the replayed partial text of the attempts in flight plus live deltas
    answers: dict[str, str] = {}
    for e in seen:
        if e.kind == "TokenDelta":
            answers[e.agent] = answers.get(e.agent, "") + e.text
        elif e.kind == "AgentStarted":
            answers[e.agent] = ""
    recorded = {e.agent: e.content for e in seen if e.kind == "MessageRecorded" and e.role == "assistant"}
    streamed = {a: answers[a] for a in recorded if a in answers}
    assert streamed and all(streamed[a] == recorded[a] for a in streamed), (streamed, recorded)


async def test_commands_reply_and_every_client_sees_their_events(tmp_path: Path):
    async with SimServer(SimSettings(tokens_per_s=20, ttft_s=0.05)) as sim:
        async with Run(sim.base_url, tmp_path / "run", agents=4) as run:
            one, two = await ControlClient.connect(run.run_dir), await ControlClient.connect(run.run_dir, replay=False)
            seen_one: list[Any] = []
            seen_two: list[Any] = []
            readers = [asyncio.ensure_future(one.run(seen_one.append)), asyncio.ensure_future(two.run(seen_two.append))]
            assert await one.command(cmd.SetMode(mode="sequential")) == "sequential"
            await until(lambda: any(e.kind == "ModeChanged" and e.mode == "sequential" for e in seen_two),
                        "the other client to see the mode change")
            with pytest.raises(CommandFailed, match="no agent named 'nobody'"):
                await two.command(cmd.Kill(agent="nobody"))
            with pytest.raises(CommandFailed, match="Invalid enum value 'warp' - at `mode`"):
                await two.command(cmd.SetMode(mode="warp"))  # type: ignore[arg-type]
            assert not any(e.kind == "RunStarted" for e in seen_two)  # replay: false
            assert any(e.kind == "RunStarted" for e in seen_one)
            await one.command(cmd.Stop(reason="stopped from a client"))
            await asyncio.wait_for(asyncio.shield(run.task), 30)
        for reader in readers:
            assert await asyncio.wait_for(reader, 10) == "the run ended"
        assert any(e.kind == "RunFinished" for e in seen_two)


async def test_a_command_gets_the_same_answer_in_process_and_over_the_socket(tmp_path: Path):
    """The console's two controls, on one run: the in-process one (engine/control.py) and the detached one
    over the real socket (supervisor/client.py) give the same typed Answer, so `k` on an agent that has ended
    says "nothing to kill" either way, and a refusal is the run's own line either way."""
    from cerevisor_tui.engine.control import LocalControl
    from cerevisor_tui.supervisor.client import RemoteControl

    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0)) as sim:
        async with Run(sim.base_url, tmp_path / "run", agents=2, mode="sequential") as run:
            done: list[Any] = []
            run.engine.subscribe(lambda e: done.append(e) if e.kind == "AgentFinished" else None)
            await until(lambda: done, "an agent to finish")
            ended = done[0].agent
            client = await ControlClient.connect(run.run_dir)
            reader = asyncio.ensure_future(client.run(lambda e: None))
            local, errors = LocalControl(run.engine), []
            remote = RemoteControl(errors.append)
            remote.bind(client)

            async def both(command: cmd.Command) -> tuple[cmd.Answer, cmd.Answer]:
                here: list[cmd.Answer] = []
                there: list[cmd.Answer] = []
                local.send(command, here.append)
                remote.send(command, there.append)
                await until(lambda: there, "the socket's answer")  # noqa: B023
                return here[0], there[0]

            here, there = await both(cmd.Kill(agent=ended))
            assert here == there == cmd.Answer(False)  # nothing to kill: it has ended
            here, there = await both(cmd.Extend(agent=ended))
            assert here == there == cmd.Answer(False)
            here, there = await both(cmd.Kill(agent="nobody"))
            assert here == there == cmd.Answer(error="no agent named 'nobody' in this run")
            here, there = await both(cmd.NudgeCap(delta=1))
            assert here == cmd.Answer(4) and there == cmd.Answer(5)  # each moved it once: the cap in force
            assert not errors  # every answer went to the one who asked for it
            remote.bind(None, "run r1 has ended")
            remote.send(cmd.Pause())  # no one asks for the answer: a refusal is said all the same
            assert errors == ["run r1 has ended"]
            await client.close()
            reader.cancel()


async def test_the_socket_is_the_owners_alone_and_speaks_one_protocol(tmp_path: Path):
    async with SimServer(SimSettings(tokens_per_s=5)) as sim:
        async with Run(sim.base_url, tmp_path / "run", agents=1) as run:
            path = socket_of(run.run_dir)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(b'{"type":"hello","protocol":1,"replay":true}\n')  # version 1's hello
            answer = json.loads(await reader.readline())
            assert answer["type"] == "bye" and answer["reason"] == f"this run speaks protocol {PROTOCOL}, not protocol 1"
            assert await reader.readline() == b""
            writer.close()
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(b'{"type":"command","id":1,"command":{"name":"pause"}}\n')  # no hello first
            answer = json.loads(await reader.readline())
            assert answer == {"type": "bye", "reason": f"this run speaks protocol {PROTOCOL}, not a command before its hello"}
            writer.close()
            if os.getuid() == 0:  # another uid: the file's mode keeps it out, and the server refuses it anyway
                denied = subprocess.run([sys.executable, "-c", AS_NOBODY, str(path)], capture_output=True, text=True,
                                        timeout=30)
                assert denied.stdout.strip() == "denied", denied
    if os.getuid() != 0:
        return
    # and were the socket reachable (a run dir others may enter, a socket made writable), the server says no
    open_dir = Path(tempfile.mkdtemp(prefix="cv-open-"))
    try:
        open_dir.chmod(0o755)
        async with SimServer(SimSettings(tokens_per_s=5)) as sim:
            async with Run(sim.base_url, open_dir / "run", agents=1) as run:
                (open_dir / "run").chmod(0o755)
                path = socket_of(run.run_dir)
                path.chmod(0o666)
                # the client blocks in a plain socket call: run it off the loop that serves the socket
                refused = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", AS_NOBODY, str(path)],
                                                  capture_output=True, text=True, timeout=30)
                assert json.loads(refused.stdout)["type"] == "bye", refused
                assert "refused: uid 65534" in refused.stdout, refused
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


async def test_a_run_dir_too_long_for_a_socket_path_puts_it_in_a_private_dir(tmp_path: Path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    async with SimServer(SimSettings(tokens_per_s=5)) as sim:
        async with Run(sim.base_url, deep, agents=1) as run:
            path = socket_of(run.run_dir)
            assert path.parent != deep and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            client = await ControlClient.connect(deep)
            assert client.hello.run_dir == str(deep)
            await client.close()
    assert not path.exists()  # removed at the end
    with pytest.raises(AttachError, match="not live"):
        await ControlClient.connect(deep)


def _message(i: int, size: int = 2000) -> Any:
    return ev.MessageRecorded(t=float(i), agent=f"a{i % 7}", attempt=1, turn=i, role="assistant",
                              content=f"answer {i} " + "x" * size)


async def test_a_journal_larger_than_a_clients_buffer_is_replayed_whole_while_live_events_wait(tmp_path: Path):
    """A long run's journal (tens of MB) is streamed to an attaching console as it reads, not written at once
    into a buffer it would overflow (the client was dropped as 'too far behind' before reading a byte); the
    events emitted meanwhile follow the replay, each once."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    past = [_message(i) for i in range(2000)]  # 4 MB, 64 times the buffer below
    with open(run_dir / "events.jsonl", "w", encoding="utf-8") as fh:
        for event in past:
            fh.write(json.dumps(event.to_dict()) + "\n")
    server = ControlServer(run_dir, "r1", lambda command: None, buffer_max=64 * 1024)
    await server.start()
    try:
        client = await ControlClient.connect(run_dir)
        seen: list[Any] = []
        live = [_message(100_000 + i, 100) for i in range(50)]  # held meanwhile: under the buffer
        sent = 0

        def on_event(event: Any) -> None:
            nonlocal sent
            if event.kind == "RunTally":  # the run's count after its past: not one of these
                return
            seen.append(event)
            if sent < len(live) and len(seen) % 40 == 0:  # the run goes on while the past is read
                server(live[sent])
                sent += 1

        reader = asyncio.ensure_future(client.run(on_event))
        await until(lambda: client.live or client.closed.is_set(), "the replay to end")
        assert client.live, f"dropped during its replay: {client.bye}"
        for event in live[sent:]:
            server(event)
        await until(lambda: len(seen) == len(past) + len(live), "every event")
        assert [e.turn for e in seen] == [e.turn for e in past + live]  # in order, each once
        assert server.clients == 1 and not client.bye
        await client.close()
        await asyncio.wait_for(reader, 10)
    finally:
        await server.close()


async def test_a_client_that_stops_reading_during_its_replay_is_dropped_and_the_run_goes_on(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "events.jsonl", "w", encoding="utf-8") as fh:
        for i in range(2000):
            fh.write(json.dumps(_message(i).to_dict()) + "\n")
    server = ControlServer(run_dir, "r1", lambda command: None, buffer_max=64 * 1024)
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(socket_of(run_dir)))
        writer.write(encode(Hello(PROTOCOL)))
        assert json.loads(await reader.readline())["type"] == "hello"  # then it reads nothing more
        await until(lambda: server.clients == 1, "the client to be taken in")
        i = held = 0
        while server.clients:  # the events it is not reading pile up past its buffer: it is let go
            server(_message(10_000 + i))
            held += len(event_line(_message(10_000 + i)))  # what its buffer holds, envelope and all
            i += 1
            await asyncio.sleep(0.001)
        assert held > 64 * 1024
        writer.close()
    finally:
        await server.close()


async def test_a_client_that_sends_no_hello_is_told_so_when_the_wait_for_it_ends(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(supervisor_server, "HELLO_WAIT_S", 0.2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = ControlServer(run_dir, "r1", lambda command: None)
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(socket_of(run_dir)))
        # the wait's TimeoutError says nothing itself: the reason must not end in an empty "expected a hello: "
        assert json.loads(await reader.readline()) == {"type": "bye", "reason": "expected a hello: none came"}
        writer.close()
    finally:
        await server.close()


async def test_a_command_line_that_does_not_check_is_refused_in_one_line_that_answers_it(tmp_path: Path):
    """What a client sends is read as the contract's types: an unknown command, a value out of its bounds, a
    field this version does not know or a line that is not JSON each get a one-line refusal (with the command's
    id where it has one), and the run goes on."""
    async with SimServer(SimSettings(tokens_per_s=5)) as sim:
        async with Run(sim.base_url, tmp_path / "run", agents=1) as run:
            reader, writer = await asyncio.open_unix_connection(str(socket_of(run.run_dir)), limit=1 << 26)
            writer.write(b'{"type":"hello","protocol":%d,"replay":false}\n' % PROTOCOL)
            assert json.loads(await reader.readline())["type"] == "hello"
            assert json.loads(await reader.readline()) == {"type": "live"}
            lines = {
                b'{"type":"command","id":1,"command":{"name":"explode"}}': "Invalid value 'explode' - at `name`",
                b'{"type":"command","id":2,"command":{"name":"set_stall","endpoint":"x"}}': "missing required field `policy`",
                b'{"type":"command","id":3,"command":{"name":"set_concurrency","cap":1e4000}}': "at `cap`",
                b'{"type":"command","id":4,"command":{"name":"extend","agent":"a0","seconds":-100000}}': "at `seconds`",
                b'{"type":"command","id":5,"command":{"name":"pause","now":true}}': "unknown field `now`",
                b'{"type":"command","id":6,"command":{"name":"pause"},"later":1}': "unknown field `later`",
                b'{"type":"command","id":7,' + b'[' * 5000: "",
                b'{"type":"command","id":8,"command":' + b'[' * 20000: "",  # deep inside a field: RecursionError
                b'not json': "",
            }
            for line, problem in lines.items():
                writer.write(line + b"\n")
                while (reply := json.loads(await reader.readline()))["type"] != "reply":
                    pass  # an event of the run
                assert reply["ok"] is False and problem in reply["error"], (line[:60], reply)
                assert reply["id"] == (json.loads(line)["id"] if problem else None)
            writer.write(b'{"type":"command","id":9,"command":{"name":"pause"}}\n')
            while (reply := json.loads(await reader.readline()))["type"] != "reply":
                pass
            assert reply == {"type": "reply", "id": 9, "ok": True, "value": None, "error": ""}
            assert run.engine.scheduler.paused
            writer.write(b'{"type":"command","id":10,"command":{"name":"kill","agent":"' + b"x" * (2 << 20) + b'"}}\n')
            while (answer := json.loads(await reader.readline()))["type"] != "bye":
                pass
            assert answer["reason"] == "a line over 1024 KiB: not a command of this run"
            writer.close()
            assert run.engine.scheduler.paused and not run.task.done()  # the run goes on


def _socket_fds() -> int:
    """Sockets this process holds open (the server's side of each connection among them)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


async def _say_hello(run_dir: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict]:
    reader, writer = await asyncio.open_unix_connection(str(socket_of(run_dir)))
    writer.write(encode(Hello(PROTOCOL, replay=False)))
    return reader, writer, json.loads(await reader.readline())


async def test_a_client_dropped_for_not_reading_lets_go_of_its_connection(tmp_path: Path):
    """`close()` waits for a flush that a client that reads nothing never allows: its socket and buffer stayed
    until the run ended. It is aborted."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = ControlServer(run_dir, "r1", lambda command: None, buffer_max=64 * 1024)
    await server.start()
    try:
        before = _socket_fds()
        reader, writer, hello = await _say_hello(run_dir)
        assert hello["type"] == "hello"
        await until(lambda: server.clients == 1, "the client to be taken in")
        assert _socket_fds() == before + 2  # its end and the server's
        i = 0
        while server.clients:  # it reads nothing more: dropped once its buffer is full
            server(_message(i))
            i += 1
            await asyncio.sleep(0.001)
        await until(lambda: _socket_fds() == before + 1, "the server's end of the connection to be closed")
        writer.close()
    finally:
        await server.close()


async def test_the_clients_are_capped_in_number_and_in_bytes_held_for_them_together(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = ControlServer(run_dir, "r1", lambda command: None, clients_max=2, buffer_max=64 << 20,
                           buffered_max=512 * 1024)
    await server.start()
    try:
        one, two = await _say_hello(run_dir), await _say_hello(run_dir)
        assert one[2]["type"] == two[2]["type"] == "hello"
        reader, writer, third = await _say_hello(run_dir)
        assert third == {"type": "bye", "reason": "refused: this run has 2 clients connected already, the most it "
                                                  "takes; detach one and try again"}
        with contextlib.suppress(ConnectionResetError):  # its hello unread: Linux may reset rather than end it
            assert await reader.readline() == b""
        writer.close()
        await until(lambda: server.clients == 2, "both clients to be taken in")
        sent = 0
        while server.clients == 2:  # neither reads: together they pass the total long before either its own cap
            server(_message(sent))
            sent += len(event_line(_message(sent)))
            await asyncio.sleep(0.001)
        assert server.clients == 1 and sent < 16 << 20
        for _, w, _ in (one, two):
            w.close()
        await until(lambda: server.clients == 0, "the other client to leave")
        four = await _say_hello(run_dir)  # a place is free again
        assert four[2]["type"] == "hello"
        four[1].close()
    finally:
        await server.close()
