"""The control socket's event lines: the server's msgspec way for TokenDelta writes what json.dumps of
to_dict() wrote, the client's reads it back to the same event without from_dict, and either side reads
the other's general lines (an older server, a hand-written line)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cerevisor_tui.engine import events as ev
from cerevisor_tui.supervisor import client
from cerevisor_tui.supervisor.client import read_event
from cerevisor_tui.supervisor.protocol import ProtocolError, encode
from cerevisor_tui.supervisor.server import event_line


def general_line(event: ev.Event) -> bytes:
    return encode({"type": "event", "event": event.to_dict()})


SAMPLES = [
    ev.TokenDelta(1234.5678, "agent-001", 2, " the quick brown fox", "", "", 8),
    ev.TokenDelta(0.25, "ägent \"quoted\"", 1, "é \u2028 line\nnext\ttab 🦊", "thinking…", '{"a": 1}', 3),
    ev.TokenDelta(7.0, "a", 1, ""),
    ev.StallWarning(5.0, "a", 1, "idle", float("nan"), 1.0, 9.5),
    ev.RunStarted(1.0, "run-1", "parallel", 4, [["a", "b"]], [{"name": "box", "stall": {"warn_at": [0.5]}}]),
    ev.AgentFinished(3.0, "a", "completed", output="done"),
]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_a_line_says_what_to_dict_said_and_reads_back(event: ev.Event) -> None:
    line = event_line(event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == json.loads(general_line(event))  # NaN == NaN fails: compare the text
    if event.kind == "TokenDelta":
        assert line == general_line(event)  # byte for byte, for these values
    got = read_event(line)
    assert type(got) is type(event)
    assert repr(got) == repr(event)
    assert repr(read_event(general_line(event))) == repr(event)  # an older server's line


def test_a_token_delta_line_is_read_without_from_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast way must stay taken: it is where the client's CPU per event went from 24.4 to 9.7 us."""
    def no(data: object) -> None:
        raise AssertionError("from_dict was called for a TokenDelta line")

    monkeypatch.setattr(client.ev, "from_dict", no)
    event = SAMPLES[0]
    assert read_event(event_line(event)) == event


def test_a_token_delta_line_that_does_not_fit_takes_the_general_way() -> None:
    # a field this version does not know is skipped, one it lacks takes its default (as from_dict does)
    line = b'{"type":"event","event":{"event":"TokenDelta","t":1.5,"agent":"a","attempt":1,"text":"x","new":[1]}}\n'
    assert read_event(line) == ev.TokenDelta(1.5, "a", 1, "x")
    # a value of another type: the general way reads it as from_dict does
    odd = b'{"type":"event","event":{"event":"TokenDelta","t":1.5,"agent":"a","attempt":1,"text":"x","tokens":"2"}}\n'
    got = read_event(odd)
    assert isinstance(got, ev.TokenDelta) and got.tokens == "2"
    # a required field missing: not an event (from_dict's None)
    assert read_event(b'{"type":"event","event":{"event":"TokenDelta","t":1.5}}\n') is None
    with pytest.raises(ProtocolError):
        read_event(b'{"type":"event","event":{"event":"TokenDelta",\n')


@given(text=st.text(st.characters(exclude_categories=["Cs"])), reasoning=st.text(max_size=20),
       tokens=st.integers(0, 10_000), t=st.floats(0, 1e7, allow_nan=False))
def test_any_token_delta_round_trips(text: str, reasoning: str, tokens: int, t: float) -> None:
    event = ev.TokenDelta(t, "agent", 1, text, reasoning, "", tokens)
    line = event_line(event)
    assert json.loads(line) == json.loads(general_line(event))
    assert read_event(line) == event
