"""Where a probe's sweep is past the knee, and what cap to recommend with which reason: pure functions of
the levels measured so far (no I/O, no clock), which the sweep in endpoints/probe.py asks after each level.

The sweep stops past the knee (`judge_single_turn`, `judge_conversations`):

- the server queued requests for most of the level (vLLM `num_requests_waiting`, llama.cpp
  `requests_deferred`, SGLang `num_queue_reqs`) and never ran as many as were sent: the cap is
  what it ran at once;
- `patience` levels in a row beat the best throughput so far by less than `min_gain` (only for a
  server without a queue gauge; one with it is swept on until it queues): the cap is the smallest
  level within `min_gain` of the best;
- TTFT p50 blew up against level 1's (again only without a queue gauge): requests wait rather
  than run;
- requests failed (HTTP 429/5xx, broken streams): the server refuses more;
- conversation mode: the prefix-cache hit rate fell out of the best level's band and throughput did
  not pay for it. The cap is the highest level whose hit rate stays within `hit_tolerance` of the
  best level's and whose throughput is within `throughput_tolerance` of the best throughput
  (`recommend_conversations`): below the cache's cliff, where each agent's prefix survives until
  its next turn. A server that reports no prefix-cache counters is judged on throughput and TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cerevisor_tui.contract.events import ProbeLevelSummary, RecommendedMode

StopReason = Literal["knee", "queue", "ttft", "errors", "prefix", "max_concurrency", "max_requests",
                     "max_seconds"]


@dataclass(frozen=True)
class KneeSettings:
    """The thresholds the knee is judged by, and the sweep's bounds that a reason names when the sweep ran
    out of them; ProbeSettings adds the rest of the sweep's bounds."""

    max_concurrency: int = 64
    max_requests: int = 1000
    max_seconds: float = 180.0
    min_gain: float = 0.15  # a level that beats the best so far by less than this is flat
    patience: int = 2  # flat levels in a row that end the sweep
    ttft_blowup: float = 4.0  # TTFT p50 above this multiple of level 1's ...
    ttft_floor_s: float = 0.5  # ... and above this many seconds is past the knee
    waiting_share: float = 0.25  # share of server samples with requests waiting that counts as queueing
    hit_tolerance: float = 0.15  # a prefix hit rate this far (absolute) below the best level's still holds
    throughput_tolerance: float = 0.10  # ... and throughput this far (a fraction) below the best still holds


ProbeLevel = ProbeLevelSummary
"""What one concurrency level measured: the contract's record (a console's probe carries it as it is)."""


@dataclass(frozen=True)
class Recommendation:
    """What a judge concludes from the levels measured: the cap, why, and why the sweep ends."""

    concurrency: int
    reason: str
    stopped_because: StopReason

    @property
    def mode(self) -> RecommendedMode:
        return "sequential" if self.concurrency <= 1 else "parallel"


def judge_single_turn(levels: list[ProbeLevel], settings: KneeSettings, *,
                      ended: StopReason | None = None) -> Recommendation | None:
    """After each level of a single-turn sweep: a Recommendation when the sweep is past the knee, else
    None; with `ended` (max_concurrency, max_requests or max_seconds) the sweep ran out, and the
    recommendation is made from what it measured."""
    if ended is None and levels:
        level = levels[-1]
        previous = levels[-2] if len(levels) > 1 else None
        verdict = _past_knee(level, previous, levels[0], settings)
        if verdict is not None:
            stopped, cap, why = verdict
            if stopped in ("ttft", "errors") and len(levels) > 1:
                # below the level that failed or queued, throughput may have flattened earlier
                pick, below = _knee(levels[:-1], settings)
                if pick < cap:
                    cap, why = pick, f"{why}; and below that, {below}"
            return Recommendation(cap, why, stopped)
        if not level.complete:
            ended = "max_seconds"
        else:
            # A server that reports its queue tells where its capacity ends; flat throughput before that
            # is as likely noise on the host as a knee, so only a server without that signal stops on it.
            if _flat_levels(levels, settings) >= settings.patience and level.server_waiting_share is None:
                return Recommendation(*_knee(levels, settings), "knee")
            return None
    ended = ended or "max_concurrency"
    usable = [lv for lv in levels if lv.complete and not lv.failed]
    if not usable:
        return Recommendation(1, _no_level(ended, settings), ended)
    pick, why = _knee(usable, settings)
    if pick < max(lv.concurrency for lv in usable):
        return Recommendation(pick, why, ended)
    return Recommendation(pick, f"throughput still grew up to {pick} at once when the sweep reached "
                                f"{_limit(ended, settings)}; the server may carry more", ended)


def judge_conversations(levels: list[ProbeLevel], settings: KneeSettings, *,
                        ended: StopReason | None = None) -> Recommendation | None:
    """After each level of a conversation sweep: a Recommendation when the sweep should stop, else None;
    with `ended` the sweep ran out. The cap itself is `recommend_conversations`'."""
    if ended is None and levels:
        stop = _conversation_stop(levels, settings)
        if stop is None and not levels[-1].complete:
            stop = "max_seconds"
        if stop is None:
            return None
        ended = stop
    ended = ended or "max_concurrency"
    if not levels:
        return Recommendation(1, _no_level(ended, settings), ended)
    cap, why = recommend_conversations(levels, settings)
    top = max(lv.concurrency for lv in levels)
    if cap == top and ended in ("max_concurrency", "max_requests", "max_seconds"):
        why += f"; the sweep stopped at {_limit(ended, settings)}, so the server may carry more"
    return Recommendation(cap, why, ended)


def recommend_conversations(levels: list[ProbeLevel], settings: KneeSettings) -> tuple[int, str]:
    """The cap for agents shaped like the probe's conversations, and why: the highest level whose prefix
    hit rate stays within `hit_tolerance` of the best level's and whose throughput is within
    `throughput_tolerance` of the best throughput.

    Levels that failed, queued (the server ran fewer than were sent) or were cut short are measured but
    not candidates. When no candidate has both, prefixes win: the highest level that keeps them, with
    the throughput it gives up said. A server that reports no prefix-cache counters is judged on
    throughput and TTFT alone, as the single-turn probe judges it.
    """
    usable = [lv for lv in levels if lv.requests and not lv.failed and lv.complete and not _queued(lv, settings)]
    if not usable:
        first = levels[0] if levels else None
        if first is not None and first.failed:
            return 1, (f"at 1 at once {first.failed} of {first.requests} requests failed ({first.first_error}), "
                       "so one at a time")
        return 1, "no level ran cleanly (each failed, queued or was cut short), so one at a time"
    best = max(usable, key=lambda lv: lv.output_tokens_per_s)
    with_hits = [lv for lv in usable if lv.prefix_hit_rate is not None]
    if not with_hits:
        base = usable[0].ttft_p50_s
        calm = [lv for lv in usable if not _ttft_blown(lv.ttft_p50_s, base, settings)] or usable[:1]
        cap, why = _knee(calm, settings)
        return cap, f"{why}; the server reports no prefix-cache hits, so this judges throughput and TTFT alone"
    best_hits = max(lv.prefix_hit_rate or 0.0 for lv in with_hits)
    floor_hits = best_hits - settings.hit_tolerance
    keeps = [lv for lv in with_hits if (lv.prefix_hit_rate or 0.0) >= floor_hits]
    floor_tps = best.output_tokens_per_s * (1 - settings.throughput_tolerance)
    holds = [lv for lv in keeps if lv.output_tokens_per_s >= floor_tps]
    pick = max(holds or keeps, key=lambda lv: lv.concurrency)
    why = f"cap {pick.concurrency}: prefix hits {pick.prefix_hit_rate or 0.0:.0%}"
    above = [lv for lv in levels if lv.concurrency > pick.concurrency]
    hits_above = [lv for lv in above if lv.prefix_hit_rate is not None]
    if hits_above:
        why += " (" + ", ".join(f"{lv.prefix_hit_rate:.0%} at {lv.concurrency}" for lv in hits_above[:2]) + ")"
    elif best_hits < 0.05:
        why += " (these conversations have little to reuse)"
    if pick is best:
        why += f", {best.output_tokens_per_s:,.0f} tokens/s"
    else:
        share = pick.output_tokens_per_s / best.output_tokens_per_s if best.output_tokens_per_s else 1.0
        why += (f", throughput {share:.0%} of the best ({best.output_tokens_per_s:,.0f} tokens/s at "
                f"{best.concurrency})")
    if not holds:
        why += ("; more at once gives more throughput, but each agent's prefix is evicted before its next turn "
                "and recomputed, a cost that grows with every turn")
    elif above:
        why += _beyond(above[0], floor_hits, settings)
    return pick.concurrency, why


def _beyond(level: ProbeLevel, floor_hits: float, settings: KneeSettings) -> str:
    """What went wrong at the level above the recommended one, as the end of its reason."""
    c = level.concurrency
    if level.failed:
        return f"; at {c} at once {level.failed} of {level.requests} requests failed ({level.first_error})"
    if level.prefix_hit_rate is not None and level.prefix_hit_rate < floor_hits:
        return f"; at {c} each agent's prefix is evicted before its next turn"
    if _queued(level, settings):
        return f"; at {c} the server queued requests, running at most {level.server_running_max} at once"
    if not level.complete:
        return f"; {c} was cut short by the time budget"
    return f"; {c} at once gave {level.output_tokens_per_s:,.0f} tokens/s"


def _conversation_stop(levels: list[ProbeLevel], settings: KneeSettings) -> StopReason | None:
    """Why a conversation sweep ends after its last level (errors, queue, prefix, ttft, knee), or None."""
    level = levels[-1]
    previous = levels[-2] if len(levels) > 1 else None
    if level.failed:
        return "errors"
    if previous is not None and _queued(level, settings):
        return "queue"
    if level.prefix_hit_rate is not None:
        best_hits = max(lv.prefix_hit_rate for lv in levels if lv.prefix_hit_rate is not None)
        lost = 0
        for lv in reversed(levels):
            if lv.prefix_hit_rate is None or lv.prefix_hit_rate >= best_hits - settings.hit_tolerance:
                break
            lost += 1
        if lost:
            before = max((lv.output_tokens_per_s for lv in levels[:-1]), default=0.0)
            # prefixes are lost from here on; go on only while that buys real throughput
            if lost >= settings.patience or level.output_tokens_per_s < before * (1 + settings.min_gain):
                return "prefix"
        return None
    if previous is None or level.server_waiting_share is not None:
        return None
    verdict = _past_knee(level, previous, levels[0], settings)
    if verdict is not None:
        return verdict[0]
    return "knee" if _flat_levels(levels, settings) >= settings.patience else None


def _queued(level: ProbeLevel, settings: KneeSettings) -> bool:
    """The server queued requests for most of the level while running fewer than were sent."""
    share, ran = level.server_waiting_share, level.server_running_max
    return (level.concurrency > 1 and share is not None and share >= settings.waiting_share and ran is not None
            and ran < level.concurrency)


def _ttft_blown(p50: float | None, base: float | None, settings: KneeSettings) -> bool:
    """TTFT p50 past both the floor and `ttft_blowup` times the base level's: requests wait rather than run."""
    return bool(base and p50 and p50 > settings.ttft_floor_s and p50 > settings.ttft_blowup * base)


def _flat_levels(levels: list[ProbeLevel], settings: KneeSettings) -> int:
    """How many levels in a row, up to the last, beat the best throughput before them by less than min_gain."""
    flat = 0
    for i in range(1, len(levels)):
        best = max(lv.output_tokens_per_s for lv in levels[:i])
        flat = flat + 1 if levels[i].output_tokens_per_s < best * (1 + settings.min_gain) else 0
    return flat


def _limit(ended: str, settings: KneeSettings) -> str:
    return {"max_concurrency": f"the highest level tried ({settings.max_concurrency})",
            "max_requests": f"the request budget ({settings.max_requests} requests)",
            "max_seconds": f"the time budget ({settings.max_seconds:g} s)"}.get(ended, ended)


def _no_level(ended: str, settings: KneeSettings) -> str:
    return f"no level completed within {_limit(ended, settings)}, so one at a time"


def _knee(levels: list[ProbeLevel], settings: KneeSettings) -> tuple[int, str]:
    """The smallest level within min_gain of the best throughput, and why."""
    best = max(levels, key=lambda lv: lv.output_tokens_per_s)
    floor = best.output_tokens_per_s / (1 + settings.min_gain)
    pick = min((lv for lv in levels if lv.output_tokens_per_s >= floor), key=lambda lv: lv.concurrency)
    beyond = [lv.concurrency for lv in levels if lv.concurrency > pick.concurrency]
    return pick.concurrency, (
        f"{pick.concurrency} at once gives {pick.output_tokens_per_s:,.0f} tokens/s, within "
        f"{settings.min_gain:.0%} of the best measured ({best.output_tokens_per_s:,.0f} at {best.concurrency}); "
        f"{', '.join(map(str, beyond)) or 'more'} at once added no more than that"
    )


def _past_knee(level: ProbeLevel, previous: ProbeLevel | None, first: ProbeLevel,
               settings: KneeSettings) -> tuple[StopReason, int, str] | None:
    """(stopped_because, recommended concurrency, why) when this level is past the knee, else None."""
    c = level.concurrency
    prev_c = previous.concurrency if previous else 1
    if level.failed:
        return ("errors", prev_c,
                f"at {c} at once {level.failed} of {level.requests} requests failed ({level.first_error}), "
                f"so {prev_c} is the most it carried cleanly")
    share = level.server_waiting_share
    ran = level.server_running_max
    # Requests wait a moment on arrival even below the cap; it is queueing only when the server also
    # ran fewer than were sent, for most of the level.
    if share is not None and share >= settings.waiting_share and ran is not None and ran < c and previous is not None:
        cap = max(1, ran)
        return ("queue", cap,
                f"at {c} at once the server queued requests (up to {level.server_waiting_max} waiting) "
                f"while running at most {ran}, so more than {cap} only adds waiting")
    if previous is None:
        return None
    if share is not None:
        return None  # a server with a queue gauge says when it queues; slow first tokens alone are load
    # p50, not p95: a few slow first tokens are noise; most of them slow is a queue
    base = first.ttft_p50_s
    p50 = level.ttft_p50_s
    if base is not None and p50 is not None and _ttft_blown(p50, base, settings):
        return ("ttft", prev_c,
                f"at {c} at once TTFT p50 rose to {p50:.2f} s from {base:.2f} s at 1, so requests wait "
                f"rather than run beyond {prev_c}")
    return None
