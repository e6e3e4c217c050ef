"""The console's model and formatting, without Textual: buffers, cursors, countdown levels, throughput."""

from __future__ import annotations

from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.format import CRITICAL, NORMAL, WARN, countdown, fmt_clock, fmt_count
from cerevisor_tui.ui.mirror import AgentView, AttemptView
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
    a = AgentView("a", "s", 0, 1, status="streaming", turn=1)
    # streaming since 90, last token at 100: the 10 s idle deadline fires at 110
    a.attempt = AttemptView(1, 1, sent_at=90.0, first_byte_s=60.0, idle_s=10.0, last_alive=100.0, first_token_at=95.0)
    warn_at = (0.5, 0.8, 0.95)
    assert countdown(a, warn_at, 104.0).level == NORMAL
    amber = countdown(a, warn_at, 105.5)
    assert amber.level == WARN and amber.label == "idle 0:05"
    assert countdown(a, warn_at, 109.6).level == CRITICAL
    a.status = "completed"
    assert countdown(a, warn_at, 105.0) is None
    a.status, a.attempt = "prefill", None
    assert countdown(a, warn_at, 105.0) is None


def test_formats():
    assert fmt_clock(0.2) == "0:01" and fmt_clock(598.0) == "9:58" and fmt_clock(3723) == "1:02:03"
    assert fmt_count(812) == "812" and fmt_count(12_400) == "12.4k" and fmt_count(3_100_000) == "3.1M"


def test_a_row_says_when_keep_alives_arrive_without_tokens():
    from cerevisor_tui.ui.widgets.agent_table import agent_row

    a = AgentView("a", "s", 0, 1, status="stalling", turn=1)
    a.attempt = AttemptView(1, 1, sent_at=0.0, first_byte_s=60.0, idle_s=10.0, last_alive=100.0, first_token_at=1.0)
    row = agent_row(a, (0.5, 0.8), "no output for 50% of its deadline", 106.0, keepalive_at=105.5)
    assert row.note == "no output for 50% of its deadline · keep-alives, no token for 0:06"
    assert row.level == WARN and row.stall == "idle 0:04" and row.status == "stalling"
    assert agent_row(a, (0.5, 0.8), "", 106.0, keepalive_at=100.2).note == ""


# ---- auto mode: cap history and trends --------------------------------------------------------------
def run_started(t: float = 100.0, mode: str = "auto", endpoints=(("box", "local", 64),)) -> ev.RunStarted:
    return ev.RunStarted(t, "r1", mode, 4, [["a", "b"]],
                         [ev.EndpointSummary(n, k, max_concurrency=m) for n, k, m in endpoints])


def test_model_records_each_endpoints_cap_changes_and_their_reasons_newest_last():
    m = UiModel()
    m(run_started(endpoints=(("box", "local", 64), ("big", "local", 64))))
    m(ev.ConcurrencyChanged(100.1, 4, 1, endpoint="box", reason="auto: start at 1 (slow start)", ceiling=64))
    m(ev.ConcurrencyChanged(104.0, 4, 2, endpoint="box", reason="auto: 1 -> 2 (slow start: 40 tok/s at 1)", ceiling=64))
    m(ev.ConcurrencyChanged(105.0, 4, 3))  # a run-wide change without a reason (+ in parallel, pause): not listed
    m(ev.ConcurrencyChanged(106.0, 4, 3, reason="auto ceiling 12 (operator)", ceiling=12))
    m(ev.ConcurrencyChanged(107.0, 4, 8, endpoint="big", reason="auto: 12 -> 8 (3 preemptions in 10 s, KV 100%)",
                            ceiling=12))
    assert [(c.endpoint, c.cap, c.reason[:14]) for c in m.cap_changes] == [
        ("box", 1, "auto: start at"), ("box", 2, "auto: 1 -> 2 ("), ("", 3, "auto ceiling 1"), ("big", 8, "auto: 12 -> 8 ")]
    assert m.run_cap == 4  # the ceiling is not the parallel cap
    assert m.last_cap_change is m.cap_changes[-1] and m.cap_changes_total == 4
    assert m.tracks["box"].last_change.reason.startswith("auto: 1 -> 2")
    assert m.tracks["box"].auto_cap == 2 and m.tracks["big"].auto_cap == 8 and m.auto_ceiling == 12
    assert m.cap_of("box") == 2 and m.cap_of("big") == 8
    assert m.take_notices() == []  # too chatty for notifications: the header and `a` show them


def test_cap_of_follows_the_mode_the_run_cap_and_the_endpoints_own_cap():
    m = UiModel()
    m(run_started(mode="parallel", endpoints=(("box", "local", 3), ("big", "local", 64))))
    assert m.cap_of("box") == 3 and m.cap_of("big") == 4  # run cap 4, box carries at most 3
    m(ev.ConcurrencyChanged(101.0, 6, 6))  # + twice
    assert m.cap_of("big") == 6
    m(ev.ModeChanged(102.0, "sequential", 1))
    assert m.cap_of("big") == 1
    m(ev.ModeChanged(103.0, "auto", 2, "each endpoint's cap follows what its server sustains"))
    assert m.cap_of("big") is None  # until its controller says
    m(ev.ConcurrencyChanged(103.0, 64, 5, endpoint="big", reason="auto: start at 5"))
    assert m.cap_of("big") == 5
    assert "a: every cap change" in m.take_notices()[-1].message  # the switch names the key that shows them


def test_trend_takes_a_point_per_server_sample_with_that_endpoints_own_tokens_per_s():
    m = UiModel()
    m(run_started(endpoints=(("box", "local", 64), ("big", "local", 64))))
    m(ev.ConcurrencyChanged(100.0, 64, 2, endpoint="box", reason="auto: start at 2"))
    m(ev.AgentStarted(100.0, "a", 1, 1, 1, "box", 60, 60))
    m(ev.AgentStarted(100.0, "b", 1, 1, 1, "big", 60, 60))
    for i in range(20):  # box: 8 tokens every 0.1 s for 2 s; big: 1
        m(ev.TokenDelta(100.0 + i * 0.1, "a", 1, "x" * 8, tokens=8))
        m(ev.TokenDelta(100.0 + i * 0.1, "b", 1, "y"))
    m(ev.ServerSample(102.0, "box", True, "vllm", running=2.0, waiting=1.0, kv_cache_usage=0.5))
    m(ev.ServerSample(102.0, "big", True, "vllm", running=1.0, waiting=0.0, kv_cache_usage=0.1))
    m(ev.ConcurrencyChanged(102.5, 64, 4, endpoint="box", reason="auto: 2 -> 4"))
    m(ev.ServerSample(104.0, "box", True, "vllm", running=4.0, waiting=0.0, kv_cache_usage=None))
    box = m.tracks["box"].trend.points
    assert [(p.cap, p.tokens_per_s, p.waiting, p.kv_cache_usage) for p in box] == [
        (2.0, 80.0, 1.0, 0.5), (4.0, 0.0, 0.0, None)]
    assert [p.tokens_per_s for p in m.tracks["big"].trend.points] == [10.0]
    assert m.tracks["box"].trend.last == box[-1]


def test_trend_stays_bounded_and_keeps_the_whole_run_coarser():
    from cerevisor_tui.ui.model import Trend, TrendPoint

    trend = Trend(max_points=8)
    for i in range(100):
        trend.add(TrendPoint(float(i), float(i % 4), 10.0, None, 0.5))
    points = trend.points
    assert len(points) <= 8 and trend.stride == 16 and trend.version == 100
    assert points[0].t < 16 and points[-1].t == 99.0  # from the start of the run to its newest sample
    assert all(p.tokens_per_s == 10.0 and p.waiting is None and p.kv_cache_usage == 0.5 for p in points)
    assert points[0].cap == 1.5  # a merged point is the mean of the samples it stands for
    assert trend.last == TrendPoint(99.0, 3.0, 10.0, None, 0.5)


def test_cap_history_is_bounded_and_counts_every_change():
    from cerevisor_tui.ui.model import CAP_HISTORY_MAX

    m = UiModel()
    m(run_started())
    for i in range(CAP_HISTORY_MAX + 50):
        m(ev.ConcurrencyChanged(100.0 + i, 64, 1 + i % 3, endpoint="box", reason=f"auto: change {i}"))
    assert len(m.cap_changes) == CAP_HISTORY_MAX and m.cap_changes_total == CAP_HISTORY_MAX + 50
    assert m.cap_changes[0].reason == "auto: change 50"


def test_an_endpoint_without_server_samples_gets_trend_points_from_the_redraw_clock():
    m = UiModel()
    m(run_started(endpoints=(("api", "hosted", 64),)))
    m(ev.ConcurrencyChanged(100.0, 64, 3, endpoint="api", reason="auto: start at 3"))
    m(ev.AgentStarted(100.0, "a", 1, 1, 1, "api", 60, 60))
    m(ev.TokenDelta(100.5, "a", 1, "x", tokens=30))
    m.sample(101.0)  # too soon
    m.sample(103.0)
    (point,) = m.tracks["api"].trend.points
    assert (point.cap, point.tokens_per_s, point.waiting, point.kv_cache_usage) == (3.0, 10.0, None, None)


def test_every_status_the_engine_tells_has_one_look_and_its_own_place_in_the_sort():
    from cerevisor_tui.kinds import STATUSES
    from cerevisor_tui.ui.format import STATUS_LOOK

    assert set(STATUS_LOOK) == set(STATUSES)
    ranks = [look.rank for look in STATUS_LOOK.values()]
    assert sorted(ranks) == list(range(len(STATUSES)))
    assert all(look.label and look.role for look in STATUS_LOOK.values())
