"""The console's model and formatting, without Textual: buffers, cursors, countdown levels, throughput."""

from __future__ import annotations

import math

from cerevisor_tui.config import validate
from cerevisor_tui.engine import events as ev
from cerevisor_tui.engine.engine import Attempt, Engine
from cerevisor_tui.ui.format import CRITICAL, NORMAL, WARN, countdown, fmt_clock, fmt_count
from cerevisor_tui.ui.model import CONTENT, REASONING, USER, AgentStream, StreamCursor, UiModel


def test_stream_reads_only_what_came_after_the_cursor():
    s = AgentStream()
    s.append(CONTENT, "a")
    s.append(CONTENT, "b")
    cursor, out, reset = s.read(StreamCursor())
    assert reset and out == [(CONTENT, "ab")]
    s.append(CONTENT, "c")
    s.append(REASONING, "think")
    cursor, out, reset = s.read(cursor)
    assert not reset and out == [(CONTENT, "c"), (REASONING, "think")]
    cursor, out, reset = s.read(cursor)
    assert out == [] and not reset


def test_stream_is_bounded_and_a_trim_tells_the_reader_to_start_over():
    s = AgentStream(max_chars=100)
    cursor = StreamCursor()
    for i in range(50):
        s.append(USER if i % 2 else CONTENT, "x" * 9)
        cursor, _, _ = s.read(cursor)
    assert s.chars <= 100
    s.append(CONTENT, "y" * 60)  # past the bound: trimmed to three quarters
    assert s.chars <= 75
    _, out, reset = s.read(cursor)
    assert reset and "".join(t for _, t in out) == s.text() and s.text().endswith("y" * 60)


def test_one_huge_run_keeps_its_tail():
    s = AgentStream(max_chars=100)
    for i in range(300):
        s.append(CONTENT, str(i % 10))
    assert s.chars <= 100 and s.text().endswith("789")


def test_model_keeps_transcripts_notes_and_notices_from_events():
    m = UiModel()
    m(ev.MessageRecorded(1.0, "a", 1, 1, "user", "hello"))
    m(ev.AgentStarted(1.0, "a", 1, 1, 2, "sim", 60, 60))
    m(ev.TokenDelta(1.1, "a", 1, "", "hmm "))
    m(ev.TokenDelta(1.2, "a", 1, "hi "))
    m(ev.MessageRecorded(1.3, "a", 1, 1, "assistant", "hi "))  # already streamed: not written twice
    m(ev.AgentKilled(2.0, "a", 1, "idle", "no output for 600 s after 2 tokens", 2))
    m(ev.AgentStarted(3.0, "a", 2, 1, 2, "sim", 60, 60))  # the same turn again: a retry
    text = m.streams["a"].text()
    assert "hello" in text and "hmm hi " in text and text.count("hi ") == 1
    assert "killed: no output for 600 s after 2 tokens" in text
    assert "turn 1/2 · attempt 2" in text
    notices = m.take_notices()
    assert [n.severity for n in notices] == ["error"] and "a killed" in notices[0].message
    assert m.take_notices() == []


def test_throughput_counts_tokens_over_the_last_complete_window():
    m = UiModel()
    for i in range(40):  # 40 tokens over 2 s
        m(ev.TokenDelta(100.0 + i * 0.05, "a", 1, "x"))
    assert m.tokens_per_s(102.0) == 20.0
    assert m.tokens_per_s(110.0) == 0.0
    m.sample(102.0)
    m.sample(102.1)  # same bucket: no second point
    assert list(m.throughput) == [20.0] and m.samples_taken == 1


def test_countdown_turns_amber_past_the_first_warning_and_red_past_the_last():
    engine = Engine(validate({"endpoints": [{"name": "s", "kind": "simulated"}],
                              "agents": [{"name": "a", "prompt": "p"}]}))
    st = engine.agents["a"]
    st.status = "streaming"
    st.current = Attempt(1, 1, sent_at=0.0, base=100.0, deadline_at=110.0, phase="idle")
    warn_at = (0.5, 0.8, 0.95)
    assert countdown(st, warn_at, 104.0).level == NORMAL
    amber = countdown(st, warn_at, 105.5)
    assert amber.level == WARN and amber.label == "idle 0:05"
    assert countdown(st, warn_at, 109.6).level == CRITICAL
    st.status = "completed"
    assert countdown(st, warn_at, 105.0) is None
    st.status, st.current.deadline_at = "prefill", math.inf
    assert countdown(st, warn_at, 105.0) is None


def test_formats():
    assert fmt_clock(0.2) == "0:01" and fmt_clock(598.0) == "9:58" and fmt_clock(3723) == "1:02:03"
    assert fmt_count(812) == "812" and fmt_count(12_400) == "12.4k" and fmt_count(3_100_000) == "3.1M"


def test_a_row_says_when_keep_alives_arrive_without_tokens():
    from cerevisor_tui.ui.widgets.agent_table import agent_row

    engine = Engine(validate({"endpoints": [{"name": "s", "kind": "simulated"}],
                              "agents": [{"name": "a", "prompt": "p"}]}))
    st = engine.agents["a"]
    st.status, st.turn = "stalling", 1
    st.current = Attempt(1, 1, sent_at=0.0, last_alive=100.0, base=100.0, deadline_at=110.0, phase="idle")
    row = agent_row(st, (0.5, 0.8), "no output for 50% of its deadline", 106.0, keepalive_at=105.5)
    assert row.note == "no output for 50% of its deadline · keep-alives, no token for 0:06"
    assert row.level == WARN and row.stall == "idle 0:04" and row.status == "stalling"
    assert agent_row(st, (0.5, 0.8), "", 106.0, keepalive_at=100.2).note == ""
