"""A property of the control socket, on a detached run (a real process, its run.log): whatever a client sends
(any line, any command, any values), the run stays up, each line it reads gets one reply of one line (a hello
none), and no traceback reaches run.log."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract.wire import (
    PROTOCOL,
    CommandMessage,
    Hello,
    Reply,
    Welcome,
    WireError,
    encode,
    read_client,
    read_server,
)
from cerevisor_tui.supervisor.protocol import read_supervisor, socket_of
from tests.test_detach import cli, started, workflow

COMMANDS = [c for c in vars(cmd).values() if isinstance(c, type) and issubclass(c, cmd.Command) and c is not cmd.Command]
NAMES = sorted(c.__struct_config__.tag for c in COMMANDS if c is not cmd.Stop) + ["explode", "", "Stop"]
FIELDS = sorted({f.name for c in COMMANDS for f in msgspec.structs.fields(c)}) + ["name", "now"]

scalars = (st.none() | st.booleans() | st.integers() | st.just(10**4000) | st.floats() | st.sampled_from([
    "a0", "sim", "once", "run", "auto", "parallel", "sequential", ""]) | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


commands = st.builds(
    lambda ident, name, fields, extra: _dumps({"type": "command", "id": ident, "command": {"name": name, **fields},
                                               **extra}),
    st.integers(min_value=-(2**70), max_value=2**70) | values,
    st.sampled_from(NAMES),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=4),
    st.dictionaries(st.sampled_from(["later", "type", "id"]), values, max_size=1),
)
hellos = st.builds(lambda protocol, replay: _dumps({"type": "hello", "protocol": protocol, "replay": replay}),
                   st.sampled_from([PROTOCOL, 1, 3]) | values, st.booleans() | values)
raw = st.binary(max_size=300).map(lambda b: b.replace(b"\n", b" "))
deep = st.integers(min_value=1, max_value=20_000).map(lambda n: b'{"type":"command","id":1,"command":' + b"[" * n)
lines = st.lists(commands | hellos | raw | deep | values.map(_dumps), min_size=1, max_size=4)


def _answered(line: bytes) -> bool:
    """A line after the hello is answered unless it is a hello (taken as a no-op)."""
    try:
        return not isinstance(read_client(line + b"\n"), Hello)
    except WireError:
        return True


def test_whatever_a_client_sends_the_run_stays_up_and_answers_each_line_in_one(tmp_path: Path):
    wf = workflow(tmp_path, agents=4, tokens_per_s=5, max_tokens=4000)
    run_id, run_dir = started(cli("run", str(wf), "--detach"))
    pid = read_supervisor(run_dir)["pid"]
    path = str(socket_of(run_dir))

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(lines)
    def check(sent: list[bytes]) -> None:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)  # a bound for a hung run, never reached by one that answers
            sock.connect(path)
            fh = sock.makefile("rb")
            sock.sendall(encode(Hello(PROTOCOL, replay=False)))
            assert isinstance(read_server(fh.readline()), Welcome)
            sock.sendall(b"".join(line + b"\n" for line in sent))
            expected = [line for line in sent if _answered(line)]
            replies: list[Reply] = []
            while len(replies) < len(expected):
                got = fh.readline()
                assert got.endswith(b"\n"), got[-200:]
                message = read_server(got)  # every line the run sends is one whole message of the protocol
                assert message.__struct_config__.tag != "bye", (message, sent)  # no line here is over the limit
                if isinstance(message, Reply):
                    replies.append(message)
            for line, reply in zip(expected, replies, strict=True):
                try:
                    command = read_client(line + b"\n")
                except WireError:
                    assert not reply.ok and reply.error and "\n" not in reply.error, (line, reply)
                else:
                    assert isinstance(command, CommandMessage) and reply.id == command.id, (line, reply)
        os.kill(pid, 0)  # the run is up

    try:
        check()
        assert read_supervisor(run_dir)["pid"] == pid
        assert cli("ls", "--json", "--runs-dir", str(tmp_path / "runs")).stdout.count('"live"') == 1
    finally:
        stopped = cli("stop", run_id, "--runs-dir", str(tmp_path / "runs"))
    assert stopped.returncode == 0, stopped
    log = (run_dir / "run.log").read_text()
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]
