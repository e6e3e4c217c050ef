"""The contract between a run and its consoles (cerevisor_tui/contract/): every event and command is one typed
value that reads back as itself from its line, a record this version does not know is an error (never read in
part), and the control socket's lines are the events' journal lines, wrapped."""

from __future__ import annotations

import json
import os

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract import wire

SAMPLES = [
    ev.TokenDelta(1234.5678, "agent-001", 2, " the quick brown fox", "", "", 8),
    ev.TokenDelta(0.25, "ägent \"quoted\"", 1, "é \u2028 line\nnext\ttab 🦊", "thinking…", '{"a": 1}', 3),
    ev.StallWarning(5.0, "a", 1, "idle", 0.5, 1.0, 9.5),
    ev.RunStarted(1.0, "run-1", "parallel", 4, [["a", "b"]],
                  [ev.EndpointSummary("box", "local", stall=ev.StallPolicy(60.0, 5.0, (0.5,), "tokens", 30.0, 1, True))],
                  agents={"a": ev.AgentPlan("box", 0, 2), "b": ev.AgentPlan("pool", 0, pool="pool")}),
    ev.AgentFinished(3.0, "a", "completed", output="done", inputs={"prompt": "x"}),
    ev.ToolCallStarted(2.0, "a", 1, 1, "c1", "fs", "read", "{}", deadline=None, warn_at=(0.5, 0.8)),
    ev.ServerSample(4.0, "box", True, "vllm", running=2.0, workers=[ev.WorkerSample("http://w1", True)]),
    ev.GpuSample(4.0, gpus=[ev.GpuReading(0, "H100", 0.5, 1, 2)]),
    ev.LoadChanged(4.0, "box", 3, 4, "fits", ev.LoadEstimate(6, 24_000, 4_000)),
    ev.WarmupStarted(0.5, ["box"]),
    ev.EndpointWarmed(0.9, "box", None, "HTTP 500"),
    ev.LatencySample(4.0, "box", "histograms", 60.0, ttft=ev.Quantiles(0.12, 0.41, 30.0), decode_stall_s=4.0),
    ev.EndpointState(4.0, "box", "down", "connection refused at 127.0.0.1:8399; it has never answered", 1.5),
]


def test_every_event_kind_is_registered_once_under_its_class_name() -> None:
    names = [cls.kind for cls in ev.EVENT_TYPES]
    assert len(names) == len(set(names)) >= 37
    assert all(cls.kind == cls.__name__ == cls.__struct_config__.tag for cls in ev.EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_an_event_reads_back_from_its_line_and_its_socket_line(event: ev.Event) -> None:
    line = ev.encode_event(event)
    assert json.loads(line)["event"] == event.kind
    assert ev.decode_event(line) == event
    assert ev.event_of(json.loads(line)) == event
    message = wire.read_server(wire.event_line(event))
    assert isinstance(message, wire.EventMessage) and message.event == event
    assert wire.event_line(event) == wire.encode(wire.EventMessage(event))  # a journal line, wrapped, is the same


def test_a_record_this_version_does_not_know_is_an_error_never_read_in_part() -> None:
    good = json.loads(ev.encode_event(SAMPLES[0]))
    assert ev.event_of(good) == SAMPLES[0]
    later = good | {"a_field_of_a_later_version": 1}
    with pytest.raises(ev.EventError, match="unknown field `a_field_of_a_later_version`"):
        ev.event_of(later)
    with pytest.raises(ev.EventError, match="Invalid value 'SomethingNew'"):
        ev.event_of({"event": "SomethingNew", "t": 1.0})
    with pytest.raises(ev.EventError, match="Expected `int`, got `str`"):
        ev.event_of(good | {"tokens": "2"})
    with pytest.raises(ev.EventError, match="missing required field `agent`"):
        ev.event_of({"event": "TokenDelta", "t": 1.5})
    with pytest.raises(ev.EventError, match="Invalid enum value 'exploded'"):
        ev.event_of({"event": "AgentFinished", "t": 1.0, "agent": "a", "status": "exploded"})
    with pytest.raises(ev.EventError):
        ev.decode_event(b'{"event":"TokenDelta",')
    # over the socket the same line is not an event either: the client counts it and reads on
    with pytest.raises(wire.WireError, match="unknown field"):
        wire.read_server(wire.EVENT_PREFIX + json.dumps(later).encode() + b"}\n")


def test_a_field_a_record_lacks_takes_its_default() -> None:
    assert ev.event_of({"event": "TokenDelta", "t": 1.5, "agent": "a", "attempt": 1, "text": "x"}) == \
        ev.TokenDelta(1.5, "a", 1, "x")


def test_a_value_with_no_json_number_is_written_as_null_and_reads_back_as_not_reported() -> None:
    sample = ev.ServerSample(1.0, "box", True, kv_cache_usage=float("nan"), waiting=float("inf"))
    assert ev.decode_event(ev.encode_event(sample)) == ev.ServerSample(1.0, "box", True)


def test_every_command_reads_back_from_its_line_under_its_snake_case_name() -> None:
    samples = [cmd.SetMode(mode="auto"), cmd.CycleMode(), cmd.SetConcurrency(cap=8), cmd.NudgeCap(delta=-1),
               cmd.Pause(), cmd.Resume(), cmd.Kill(agent="a"), cmd.Release(agent="a"), cmd.Extend(agent="a", seconds=30.0),
               cmd.Retry(agent="a"), cmd.Approve(agent="a", call_id="c", scope="run"), cmd.Deny(agent="a", call_id="c"),
               cmd.SetStall(endpoint="box", policy=ev.StallPolicy(**POLICY)), cmd.Stop(), cmd.Probe(endpoint="box"),
               cmd.CancelProbe(endpoint="box"),
               cmd.SetGateway(release_after_s=0.0, max_sessions_per_key=3, keepalive_s=10.0, down_after_s=30.0)]
    assert {type(c) for c in samples} == set(cmd.COMMAND_TYPES)
    for command in samples:
        message = wire.read_client(wire.command_line(7, command))
        assert isinstance(message, wire.CommandMessage) and message.id == 7 and message.command == command
        assert json.loads(wire.command_line(7, command))["command"]["name"] == command.name
    assert cmd.Kill(agent="a").reason == "killed by operator" and cmd.Stop().reason == "run stopped"


POLICY = {"first_byte_timeout_s": 60.0, "idle_timeout_s": 5.0, "warn_at": [0.8, 0.5, 0.8], "liveness": "tokens",
          "extend_s": 30.0, "max_extensions": 1, "extend_when_server_busy": True}


def test_a_stall_policy_is_one_record_its_warnings_in_order_each_once() -> None:
    """What `set_stall` carries, RunStarted's endpoints tell and the engine runs by is one contract record."""
    policy = cmd.command_of({"name": "set_stall", "endpoint": "box", "policy": POLICY}).policy  # type: ignore[attr-defined]
    assert policy == ev.StallPolicy(**POLICY) and policy.warn_at == (0.5, 0.8)
    from cerevisor_tui.config import ResolvedStall
    assert ResolvedStall is ev.StallPolicy


@pytest.mark.parametrize(("data", "problem"), [
    ({"name": "set_stall", "endpoint": "box", "extra": 1}, "unknown field `extra`"),
    ({"name": "set_stall", "endpoint": "box", "policy": {}}, "missing required field `first_byte_timeout_s` - at `policy`"),
    ({"name": "set_stall", "endpoint": "box", "policy": {**POLICY, "idle_timeout_s": float("inf")}},
     "at `policy.idle_timeout_s`"),
    ({"name": "set_stall", "endpoint": "box", "policy": {**POLICY, "warn_at": [0.5, 0]}}, "at `policy.warn_at[1]`"),
    ({"name": "set_stall", "endpoint": "box", "policy": {**POLICY, "max_extensions": -1}},
     "at `policy.max_extensions`"),
    ({"name": "extend", "agent": "a", "seconds": float("nan")}, "at `seconds`"),
    ({"name": "extend", "agent": "a", "seconds": 1e12}, "at `seconds`"),
    ({"name": "set_concurrency", "cap": 10**4000}, "at `cap`"),
    ({"name": "set_concurrency", "cap": 4097}, "at `cap`"),
    ({"name": "kill", "agent": ""}, "at `agent`"),
    ({"name": "kill", "agent": "a", "reason": "x" * 5000}, "at `reason`"),
])
def test_a_command_out_of_its_bounds_is_refused_in_one_line(data: dict, problem: str) -> None:
    with pytest.raises(cmd.CommandError) as caught:
        cmd.command_of(data)
    assert problem in str(caught.value) and "\n" not in str(caught.value)


def test_a_command_line_that_does_not_check_still_names_its_id() -> None:
    with pytest.raises(wire.WireError) as caught:
        wire.read_client(b'{"type":"command","id":12,"command":{"name":"explode"}}')
    assert caught.value.ident == 12 and "Invalid value 'explode' - at `name`" in str(caught.value)
    with pytest.raises(wire.WireError) as caught:
        wire.read_client(b"[" * 100_000)
    assert caught.value.ident is None


@given(text=st.text(st.characters(exclude_categories=["Cs"])), reasoning=st.text(max_size=20),
       tokens=st.integers(0, 10_000), t=st.floats(0, 1e7, allow_nan=False))
def test_any_token_delta_round_trips(text: str, reasoning: str, tokens: int, t: float) -> None:
    event = ev.TokenDelta(t, "agent", 1, text, reasoning, "", tokens)
    assert ev.decode_event(ev.encode_event(event)) == event
    assert wire.read_server(wire.event_line(event)).event == event  # type: ignore[union-attr]


def test_the_wire_messages_are_tagged_by_type() -> None:
    assert msgspec.json.decode(wire.encode(wire.Live())) == {"type": "live"}
    assert msgspec.json.decode(wire.encode(wire.Bye("x"))) == {"type": "bye", "reason": "x"}
    assert isinstance(wire.read_server(b'{"type":"hello","protocol":2,"run_id":"r","run_dir":"/d","pid":1}'),
                      wire.Welcome)


async def _read_from_a_run(tmp_path, lines: list[bytes]) -> tuple[str, list[ev.Event], list[str], int]:
    """A run's socket that says hello, writes `lines` and closes, read by the console's client: why it ended, the
    events handed on, what it told `on_unreadable`, and the lines it counted unreadable."""
    import asyncio

    from cerevisor_tui.supervisor.client import ControlClient

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()  # the client's hello
        writer.write(wire.encode(wire.Welcome(wire.PROTOCOL, "r1", str(tmp_path), os.getpid())))
        writer.write(b"".join(lines))
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(tmp_path / "control.sock"))
    # the client trusts only the process supervisor.json names (supervisor/protocol.py check_server)
    (tmp_path / "supervisor.json").write_text(json.dumps({"pid": os.getpid(), "socket": str(tmp_path / "control.sock")}))
    async with server:
        client = await ControlClient.connect(tmp_path)
        seen: list[ev.Event] = []
        told: list[str] = []
        ended = await client.run(seen.append, on_unreadable=told.append)
        await client.close()
    return ended, seen, told, client.unreadable


@pytest.mark.anyio
async def test_a_console_counts_an_event_its_version_does_not_know_and_never_hands_it_on(tmp_path) -> None:
    """The console's side of the socket: an event line with a field this version does not know is not read in
    part; the client counts it (`unreadable`) and reads on, the events around it arriving whole."""
    good = ev.AgentQueued(1.0, "a", 0)
    later = json.loads(ev.encode_event(ev.AgentQueued(2.0, "b", 0))) | {"priority": 3}
    ended, seen, told, unreadable = await _read_from_a_run(tmp_path, [
        wire.EVENT_PREFIX + json.dumps(later).encode() + b"}\n", wire.event_line(good),
        wire.encode(wire.Bye("the run ended"))])
    assert ended == "the run ended"
    assert seen == [good] and unreadable == 1
    assert len(told) == 1 and "unknown field `priority`" in told[0]


@pytest.mark.anyio
async def test_a_connection_cut_mid_line_is_lost_not_a_line_of_another_version(tmp_path) -> None:
    """A run aborts a client that fell behind while it still takes in its last lines: the cut line is the
    connection's end, said so, and not an event "this console cannot read" (an older version's, it would say)."""
    good = ev.AgentQueued(1.0, "a", 0)
    cut = wire.event_line(ev.AgentQueued(2.0, "b", 0))[:20]  # aborted here
    ended, seen, told, unreadable = await _read_from_a_run(tmp_path, [wire.event_line(good), cut])
    assert ended.startswith("connection lost mid-event") and seen == [good]
    assert told == [] and unreadable == 0
