"""The knee decision on hand-made levels: each rule that ends a sweep or picks the cap, with a level just
inside and one just outside its threshold, so a changed threshold or rule fails here."""

from __future__ import annotations

from cerevisor_tui.endpoints.knee import (
    KneeSettings,
    ProbeLevel,
    judge_conversations,
    judge_single_turn,
    recommend_conversations,
)

S = KneeSettings()  # the thresholds `cerevisor-tui probe` uses (ProbeSettings inherits them)


def _level(c: int, tps: float, *, hits: float | None = None, ttft: float = 0.05, failed: int = 0,
           share: float | None = None, running: int | None = None, complete: bool = True) -> ProbeLevel:
    """A level of `c` at once giving `tps` tokens/s; `share` None: a server without a queue gauge."""
    return ProbeLevel(concurrency=c, requests=4 * c, failed=failed, output_tokens=int(tps), wall_s=1.0,
                      output_tokens_per_s=tps, ttft_p50_s=ttft, ttft_p95_s=ttft, stream_tokens_per_s=None,
                      server_running_max=running, server_waiting_max=3 if share else 0,
                      server_waiting_share=share, complete=complete, prefix_hit_rate=hits,
                      first_error="HTTP 503 overloaded" if failed else "")


def _gauged(c: int, tps: float, **kw) -> ProbeLevel:
    """A level on a server that reports its queue, which ran all `c` and kept none waiting unless told."""
    return _level(c, tps, **{"share": 0.0, "running": c, **kw})


def test_the_thresholds_are_the_documented_ones():
    assert (S.min_gain, S.patience, S.ttft_blowup, S.ttft_floor_s, S.waiting_share, S.hit_tolerance,
            S.throughput_tolerance) == (0.15, 2, 4.0, 0.5, 0.25, 0.15, 0.10)


# ---- single-turn ------------------------------------------------------------------------------------

def test_a_queue_at_the_server_ends_the_sweep_at_what_it_ran():
    below = [_gauged(1, 100), _gauged(2, 190), _gauged(4, 360)]
    verdict = judge_single_turn([*below, _gauged(8, 380, share=0.25, running=7)], S)
    assert verdict is not None and verdict.stopped_because == "queue" and verdict.concurrency == 7
    assert "up to 3 waiting" in verdict.reason and "at most 7" in verdict.reason
    # waiting in under a quarter of the samples is arrival, not a queue
    assert judge_single_turn([*below, _gauged(8, 380, share=0.24, running=7)], S) is None
    # waiting while it runs everything sent is not queueing either
    assert judge_single_turn([*below, _gauged(8, 380, share=0.9, running=8)], S) is None
    # level 1 has nothing below it to fall back to
    assert judge_single_turn([_gauged(1, 100, share=0.9, running=0)], S) is None


def test_two_levels_in_a_row_under_15_percent_gain_end_the_sweep_without_a_queue_gauge():
    verdict = judge_single_turn([_level(1, 100), _level(2, 114.9), _level(4, 114.9)], S)
    assert verdict is not None and verdict.stopped_because == "knee"
    assert verdict.concurrency == 1 and verdict.mode == "sequential"
    # level 2 gained just over 15 %: only one flat level so far
    assert judge_single_turn([_level(1, 100), _level(2, 115.1), _level(4, 115.1)], S) is None
    # each level is weighed against the best before it (114.9 here): 132.2 is over 15 % more
    assert judge_single_turn([_level(1, 100), _level(2, 114.9), _level(4, 132.2)], S) is None
    verdict = judge_single_turn([_level(1, 100), _level(2, 114.9), _level(4, 132.0)], S)
    assert verdict is not None and verdict.stopped_because == "knee"
    # a dip does not lower the bar: 210 is over 15 % more than the 180 before it, not than the best, 200
    verdict = judge_single_turn([_level(1, 100), _level(2, 200), _level(4, 180), _level(8, 210)], S)
    assert verdict is not None and verdict.stopped_because == "knee" and verdict.concurrency == 2
    # one flat level is not yet a knee
    assert judge_single_turn([_level(1, 100), _level(2, 114.9)], S) is None
    # a server with a queue gauge is swept on until it queues
    assert judge_single_turn([_gauged(1, 100), _gauged(2, 114.9), _gauged(4, 114.9)], S) is None


def test_the_cap_is_the_smallest_level_within_15_percent_of_the_best():
    # the best is 230: within 15 % means at least 200
    verdict = judge_single_turn([_level(1, 100), _level(2, 201), _level(4, 230)], S, ended="max_concurrency")
    assert verdict is not None and verdict.concurrency == 2 and verdict.stopped_because == "max_concurrency"
    assert "2 at once gives 201 tokens/s, within 15% of the best measured (230 at 4)" in verdict.reason
    verdict = judge_single_turn([_level(1, 100), _level(2, 199), _level(4, 230)], S, ended="max_concurrency")
    assert verdict is not None and verdict.concurrency == 4
    assert "throughput still grew up to 4 at once" in verdict.reason and "may carry more" in verdict.reason


def test_ttft_p50_over_4x_level_1s_ends_the_sweep_without_a_queue_gauge():
    one = _level(1, 100, ttft=0.25)
    verdict = judge_single_turn([one, _level(2, 190, ttft=1.01)], S)
    assert verdict is not None and verdict.stopped_because == "ttft" and verdict.concurrency == 1
    assert "TTFT p50 rose to 1.01 s from 0.25 s" in verdict.reason
    assert judge_single_turn([one, _level(2, 190, ttft=1.0)], S) is None  # exactly 4x is not over it
    # ... and over the 0.5 s floor: 4x of a fast first token is still fast
    fast = _level(1, 100, ttft=0.1)
    verdict = judge_single_turn([fast, _level(2, 190, ttft=0.501)], S)
    assert verdict is not None and verdict.stopped_because == "ttft"
    assert judge_single_turn([fast, _level(2, 190, ttft=0.5)], S) is None
    # a server with a queue gauge says when it queues; slow first tokens alone are load
    assert judge_single_turn([_gauged(1, 100, ttft=0.25), _gauged(2, 190, ttft=5.0)], S) is None


def test_failures_end_the_sweep_at_the_level_before():
    assert judge_single_turn([_level(1, 100), _level(2, 190, failed=0)], S) is None
    verdict = judge_single_turn([_level(1, 100), _level(2, 190), _level(4, 300, failed=1)], S)
    assert verdict is not None and verdict.stopped_because == "errors" and verdict.concurrency == 2
    assert "at 4 at once 1 of 16 requests failed (HTTP 503 overloaded)" in verdict.reason
    verdict = judge_single_turn([_level(1, 100, failed=1)], S)
    assert verdict is not None and verdict.stopped_because == "errors" and verdict.concurrency == 1


def test_after_failures_or_ttft_a_flat_stretch_below_lowers_the_cap():
    below = [_level(1, 100), _level(2, 190), _level(4, 200)]  # 4 gave little over 2
    verdict = judge_single_turn([*below, _level(8, 210, failed=1)], S)
    assert verdict is not None and verdict.stopped_because == "errors" and verdict.concurrency == 2
    assert "; and below that, 2 at once gives 190 tokens/s" in verdict.reason


def test_a_level_cut_short_ends_the_sweep_on_the_time_budget():
    verdict = judge_single_turn([_level(1, 100), _level(2, 190, complete=False)], S)
    assert verdict is not None and verdict.stopped_because == "max_seconds" and verdict.concurrency == 1
    verdict = judge_single_turn([], S, ended="max_requests")
    assert verdict is not None and verdict.concurrency == 1
    assert verdict.reason == "no level completed within the request budget (1000 requests), so one at a time"


# ---- conversation mode --------------------------------------------------------------------------------

def test_prefix_hits_within_15_points_of_the_best_level_hold():
    below = [_gauged(1, 100, hits=0.6), _gauged(2, 190, hits=0.6)]
    # 0.451 is within 0.15 of 0.6: the sweep goes on and 4 is the cap
    assert judge_conversations([*below, _gauged(4, 200, hits=0.451)], S) is None
    cap, why = recommend_conversations([*below, _gauged(4, 200, hits=0.451)], S)
    assert cap == 4 and why.startswith("cap 4: prefix hits 45%, 200 tokens/s")
    # 0.449 is not: prefixes are lost at 4, and 200 tokens/s does not pay for it
    verdict = judge_conversations([*below, _gauged(4, 200, hits=0.449)], S)
    assert verdict is not None and verdict.stopped_because == "prefix" and verdict.concurrency == 2
    assert "at 4 each agent's prefix is evicted before its next turn" in verdict.reason


def test_lost_prefixes_end_the_sweep_unless_throughput_gains_15_percent_once():
    below = [_gauged(1, 100, hits=0.6), _gauged(2, 190, hits=0.6)]
    # the best before is 190: 15 % more is 218.5
    verdict = judge_conversations([*below, _gauged(4, 218.4, hits=0.1)], S)
    assert verdict is not None and verdict.stopped_because == "prefix"
    assert judge_conversations([*below, _gauged(4, 218.6, hits=0.1)], S) is None
    # two levels in a row without the prefixes end it, whatever they gain
    verdict = judge_conversations([*below, _gauged(4, 300, hits=0.1), _gauged(8, 1000, hits=0.1)], S)
    assert verdict is not None and verdict.stopped_because == "prefix" and verdict.concurrency == 2


def test_of_the_levels_that_keep_prefixes_the_highest_within_10_percent_of_the_best_throughput():
    # the best throughput, 400 at 8, lost its prefixes; 90 % of it is 360
    levels = [_gauged(1, 100, hits=0.6), _gauged(2, 380, hits=0.6), _gauged(4, 360.5, hits=0.6),
              _gauged(8, 400, hits=0.3)]
    cap, why = recommend_conversations(levels, S)
    assert cap == 4 and "throughput 90% of the best (400 tokens/s at 8)" in why
    levels[2] = _gauged(4, 359.5, hits=0.6)
    cap, why = recommend_conversations(levels, S)
    assert cap == 2 and why.endswith("; 4 at once gave 360 tokens/s")


def test_when_no_level_keeps_both_prefixes_win_and_the_reason_says_the_cost():
    lost = "more at once gives more throughput, but each agent's prefix is evicted"
    levels = [_gauged(1, 100, hits=0.6), _gauged(2, 360.5, hits=0.6), _gauged(4, 400, hits=0.3)]
    cap, why = recommend_conversations(levels, S)
    assert cap == 2 and lost not in why
    levels[1] = _gauged(2, 359.5, hits=0.6)
    cap, why = recommend_conversations(levels, S)
    assert cap == 2 and lost in why


def test_conversation_queue_and_failures_end_the_sweep_and_are_not_candidates():
    below = [_gauged(1, 100, hits=0.6), _gauged(2, 190, hits=0.6)]
    verdict = judge_conversations([*below, _gauged(4, 300, hits=0.6, share=0.25, running=3)], S)
    assert verdict is not None and verdict.stopped_because == "queue" and verdict.concurrency == 2
    assert "at 4 the server queued requests, running at most 3 at once" in verdict.reason
    assert judge_conversations([*below, _gauged(4, 300, hits=0.6, share=0.24, running=3)], S) is None
    assert judge_conversations([*below, _gauged(4, 300, hits=0.6, share=0.9, running=4)], S) is None
    verdict = judge_conversations([*below, _gauged(4, 300, hits=0.6, failed=1)], S)
    assert verdict is not None and verdict.stopped_because == "errors" and verdict.concurrency == 2


def test_a_server_without_prefix_metrics_is_judged_on_throughput_and_ttft():
    verdict = judge_conversations([_level(1, 100), _level(2, 114.9), _level(4, 114.9)], S)
    assert verdict is not None and verdict.stopped_because == "knee" and verdict.concurrency == 1
    assert verdict.reason.endswith("the server reports no prefix-cache hits, so this judges throughput and TTFT alone")
    assert judge_conversations([_level(1, 100), _level(2, 115.1), _level(4, 115.1)], S) is None
    # TTFT p50 over 4x level 1's ends the sweep, and that level is no candidate
    blown = [_level(1, 100, ttft=0.25), _level(2, 190, ttft=0.25), _level(4, 400, ttft=1.01)]
    verdict = judge_conversations(blown, S)
    assert verdict is not None and verdict.stopped_because == "ttft" and verdict.concurrency == 2
    calm = [*blown[:2], _level(4, 400, ttft=1.0)]
    assert judge_conversations(calm, S) is None
    assert recommend_conversations(calm, S)[0] == 4
    # with a queue gauge it is swept on until it queues
    assert judge_conversations([_gauged(1, 100), _gauged(2, 114.9), _gauged(4, 114.9)], S) is None
