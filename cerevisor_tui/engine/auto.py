"""Auto mode: a controller per endpoint that sets the endpoint's live cap from what the server reports and
what the engine measures. Pure: it owns no clock and does no I/O; the engine feeds it `Signals` and applies
the `Change`s it returns (a change only holds or opens admissions, it never stops a running agent).

Which controller, and why. The cap here counts agent *conversations*, not requests: an admitted agent keeps
its slot for all its turns, resending a growing conversation whose prefix the server keeps in its KV cache.
Lowering the cap only takes effect as whole conversations end, so an overshoot past the KV cliff is paid for
a whole conversation. That rules out controllers that find the limit by crossing it and backing off
(AIMD on loss, or a throughput-knee search like guidellm's over-saturation test): when their signal
shows, the damage is done and slow to undo. What we took:

1. **A KV fit ceiling, from the agents' own shape.** The server reports its KV capacity (vLLM's
   `cache_config_info`; else the endpoint's capacity estimate). The engine projects each agent's
   conversation to its full length (the tokens it has sent so far, by the server's own count, plus its turns
   still to come and their answers, at the measured tokens per character) and the controller never grows
   past `kv_target x capacity / projected length`. This is the leading signal: it is known before the cache
   is full.
2. **Slow start, judged by throughput per window** (TCP's slow start, with Vegas' test of "did the
   rate grow?"): 1, 2, 4, ... while aggregate output tokens/s grows by 5% per step and nothing queues
   (x4 per step while that stays within the KV fit: the fit, not the throughput test, is the safety there).
   A window is counted in output tokens (about half a turn per running agent), not wall seconds, so a slow
   box is judged as fairly as a fast one; it starts only once the cap is in effect.
3. **Backing off on what the server says**, at once and once per step (a decrease waits until it has taken
   effect before the next): preemptions (x0.75: vLLM is recomputing), requests waiting in the server's queue
   in two samples running (down to what it runs), 429/503 answers (x0.5, AIMD), llama.cpp's slot count as a
   hard ceiling, and, with no metrics at all (Ollama, hosted), TTFT rising past twice its best (Gradient2's
   latency ratio).
4. **Re-probing upward now and then** (Envoy's adaptive concurrency re-measures its baseline
   periodically): after `PROBE_EVERY` calm windows with headroom, +25%; kept if throughput rose, else back.
   The best cap moves as conversations grow: the fit ceiling moves with the projection.
5. **A floor on each user's interactivity** (an SLO's tokens/s per user, read on the server's clock where it has
   an inter-token histogram): throughput keeps rising past the knee of goodput, so with a floor a cap is judged
   by its users' stream too. Time per token grows about linearly with the cap; fitted on the caps measured, it
   says where the floor is reached, and the slow start and the probes go no further (the slow start by one doubling
   at most: the line fitted on small caps overshoots, as time per token grows faster once the batch is large).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GROWTH = 1.05  # a doubling must raise throughput by this much to go on doubling
PROBE_GAIN = 1.03  # an upward probe is kept when throughput rose by this much
COLLAPSE = 0.90  # throughput below this fraction of the smaller cap's: go back to it
PROBE_EVERY = 4  # calm windows at one cap before an upward probe
KV_FULL = 0.95  # KV use at which nothing grows
WINDOW_TURNS = 1.0  # a window: this many turns of output per running agent
COLD_LOOKS = 8  # looks a window waits for the agents just admitted to have their first token
KV_HEADROOM = 0.80  # KV use below which an upward probe may start
WAITING_SAMPLES = 3  # consecutive samples with a queue before it counts
WAITING_SHARE = 0.25  # a queue: at least this share of our running agents waiting (and at least two)
WAITING_MIN = 2.0
TTFT_QUEUE_RATIO = 2.0  # TTFT this many times its best (and 0.5 s more) means requests queue
HIT_DROP = 0.20  # prefix hit rate this far below its best, with the KV cache full: prefixes are evicted
FLOOR_WINDOWS = 2  # windows at one cap before the floor judges it under: one can be a burst of new sessions' prefills


@dataclass(frozen=True, slots=True)
class Signals:
    """One look at an endpoint: what the engine measured and what its server last reported (None: not reported)."""

    t: float  # monotonic seconds
    tokens: int  # output tokens streamed from this endpoint since the run started
    running: int  # our agents admitted on it
    queued: int  # our agents waiting for a slot on it
    cold: int = 0  # of the running ones, those that have not had a first token yet (a prefill burst)
    errors: int = 0  # 429/503 answers since the run started
    ttft_p50: float | None = None  # median TTFT of its last attempts
    sample: int = 0  # bumped by every new server sample
    server_ok: bool | None = None  # None: not watched; False: unreachable or loading
    waiting: float | None = None
    server_running: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None  # a counter
    prefix_hit_rate: float | None = None  # over the last sample interval
    kv_tokens: float | None = None  # the server's KV capacity in tokens
    slots: int | None = None  # llama.cpp's slot count
    context_tokens: float | None = None  # projected full length of this endpoint's conversations (mean)
    turn_tokens: float | None = None  # output tokens per turn (measured, else the agents' max_tokens)
    rates: tuple[tuple[float, float], ...] = ()  # recent answers' (when each ended, its output tokens/s per user)
    # the gaps between output tokens the server observed since the run began, (seconds, gaps): its inter-token
    # histogram's _sum and _count; None from a server without one
    decode_gaps: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class Change:
    cap: int
    reason: str


@dataclass(slots=True)
class _Window:
    t0: float
    tokens0: int
    sample0: int
    preemptions0: float | None
    gaps0: tuple[float, float] | None = None  # the server's decode gaps at its start
    waiting: float = 0.0  # summed over its samples
    samples: int = 0
    kv: float | None = None
    hits: float = 0.0
    hit_samples: int = 0
    last_sample: int = -1

    def see(self, s: Signals) -> None:
        if s.sample == self.last_sample:
            return
        self.last_sample = s.sample
        if s.waiting is not None:
            self.waiting += s.waiting
            self.samples += 1
        if s.kv_usage is not None:
            self.kv = max(self.kv or 0.0, s.kv_usage)
        if s.prefix_hit_rate is not None:
            self.hits += s.prefix_hit_rate
            self.hit_samples += 1

    def queue_text(self) -> str:
        mean = self.waiting / self.samples if self.samples else 0.0
        return "nothing waiting" if mean < 0.05 else f"{mean:.1f} waiting on average"

    def queued(self, running: int) -> bool:
        """Requests waited at the server through this window: on average a sizeable share of our agents."""
        return self.samples > 0 and self.waiting / self.samples >= max(WAITING_MIN, WAITING_SHARE * running)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.hit_samples if self.hit_samples else None


def _per_user(s: Signals, t0: float, gaps0: tuple[float, float] | None) -> tuple[float, str] | None:
    """Each user's output tokens/s since `t0` (the server's decode gaps then: `gaps0`), and whose figure it is:
    the server's (its decode gaps' count over their seconds) when it keeps an inter-token histogram, else the
    median of the run's answers that ended since, on the run's clock (which a sped-up simulator's host may lag);
    None with nothing decoded."""
    if s.decode_gaps is not None:
        before = gaps0 or (0.0, 0.0)
        seconds, gaps = s.decode_gaps[0] - before[0], s.decode_gaps[1] - before[1]
        return (gaps / seconds, "the server's tokens stream at") if gaps > 0 and seconds > 0 else None
    rates = sorted(rate for t, rate in s.rates if t >= t0)
    return (rates[len(rates) // 2], "answers stream at") if rates else None


def pct(x: float) -> str:
    return f"{x:.0%}"


class AutoController:
    """The live cap of one endpoint. `update()` at every look; apply what it returns."""

    def __init__(self, *, min_cap: int = 1, max_cap: int = 64, start_cap: int = 0, start_why: str = "",
                 kv_target: float = 0.95, min_interactivity: float = 0.0) -> None:
        self.min_cap = max(1, min_cap)
        self.max_cap = max(self.min_cap, max_cap)
        self.ceiling = self.max_cap  # moved by the operator (`+`/`-` in auto mode)
        self.kv_target = kv_target
        self.min_interactivity = min_interactivity  # tokens/s each user keeps (_per_user); 0: no floor
        self.interactivity: dict[int, float] = {}  # cap -> tokens/s per user over its windows (_per_user_at_cap)
        self.slow_start = not start_cap
        self.cap = self._clamp(start_cap or self.min_cap)
        self.start_reason = (f"auto: start at {self.cap} ({start_why})" if start_cap and start_why
                             else f"auto: start at {self.cap} (slow start: doubles while throughput grows and nothing queues)"
                             if not start_cap else f"auto: start at {self.cap}")
        self.measured: dict[int, float] = {}  # cap -> output tokens/s of its last full window
        self.hit_rates: dict[int, float] = {}  # cap -> prefix hit rate of its last full window
        self.prev_cap: int | None = None  # the cap before the last change
        self.ttft_best: float | None = None
        self._window: _Window | None = None
        self._settling = False  # a decrease not yet in effect: no further decrease until it is
        self._probe_from: int | None = None
        self._calm = 0
        self._flat = 0  # slow-start windows in a row that did not grow throughput
        self._queued_windows = 0  # slow-start windows in a row with a queue at the server
        self._cold_looks = 0
        self._warm = False
        self._errors = 0
        self._preemptions: float | None = None
        self._preempt_t: float | None = None
        self._waiting_streak = 0
        self._last_sample = -1
        # the floor's count at this cap: (cap, when its first window began, the server's decode gaps then, windows)
        self._floor_since: tuple[int, float, tuple[float, float] | None, int] | None = None

    # ---- the operator ---------------------------------------------------------------------------
    def set_ceiling(self, ceiling: int) -> Change | None:
        self.ceiling = max(self.min_cap, min(self.max_cap, ceiling))
        if self.cap > self.ceiling:
            return self._to(self.ceiling, f"ceiling {self.ceiling} set by the operator")
        return None

    def resume(self) -> Change:
        """Auto mode again, after the operator ran it by hand: back at the cap it had learned, measuring afresh."""
        self._window, self._probe_from, self._calm, self._settling = None, None, 0, False
        if self.prev_cap is None:
            return Change(self.cap, self.start_reason)
        return Change(self.cap, f"auto: back at {self.cap}, where it left off")

    def preempt_loop(self, why: str) -> Change | None:
        """A request of this endpoint was preempted again and again before its first token (engine/wedge.py):
        its prompt does not fit beside the others, so half as many share the KV cache from now on."""
        self.slow_start = False
        return self._to(max(self.min_cap, min(self.cap - 1, self.cap // 2)), f"preemption loop: {why}")

    # ---- the loop -------------------------------------------------------------------------------
    def update(self, s: Signals) -> Change | None:
        new_sample = s.sample != self._last_sample
        self._last_sample = s.sample
        if s.server_ok is False:  # down or loading: nothing it says now is about the cap
            self._window = None
            return None
        change = self._hazard(s, new_sample)
        if change is not None:
            return change
        if self._settling:
            if s.running > self.cap:
                return None
            self._settling = False
        w = self._window
        if s.running < self.cap:
            # admissions to a new cap still under way, or too few agents left to fill it (a wave's end, a
            # pause): what this window would measure is not the cap
            self._window = None
            return None
        if w is None:
            # The agents just admitted are still in their first prefill: not the cap's steady rate. Agents of a
            # turn or two keep arriving cold, so after a few looks the window opens anyway.
            if not self._warm and s.cold > max(1, self.cap // 10) and self._cold_looks < COLD_LOOKS:
                self._cold_looks += 1
                return None
            self._warm = True  # (until the next change: only a change admits a burst)
            # (the sample in hand was taken before the window: only later ones are about this cap)
            self._window = _Window(s.t, s.tokens, s.sample, s.preemptions, s.decode_gaps, last_sample=s.sample)
            return None
        w.see(s)
        turn = s.turn_tokens or 256.0
        need = max(8.0, WINDOW_TURNS * turn * max(1, min(self.cap, s.running or 1)))
        if s.tokens - w.tokens0 < need or s.t <= w.t0 or (s.server_ok is not None and s.sample == w.sample0):
            return None
        self._window = None
        return self._judge(s, w)

    # ---- at once: what the server says --------------------------------------------------------
    def _hazard(self, s: Signals, new_sample: bool) -> Change | None:
        errors, self._errors = s.errors - self._errors, s.errors
        if errors > 0 and self.cap > self.min_cap and not self._settling:
            self.slow_start = False
            return self._to(max(self.min_cap, self.cap // 2), f"{errors} answer{'s' * (errors > 1)} "
                            "HTTP 429/503 (the server sheds load)")
        if s.slots and self.cap > s.slots:
            self.slow_start = False
            return self._to(max(self.min_cap, s.slots), f"the server has {s.slots} slots; more would only queue")
        if not new_sample:
            return None
        preempted, dt = 0.0, 0.0  # preemptions since the last sample, and the seconds since it
        if s.preemptions is not None:
            if self._preemptions is not None and s.preemptions < self._preemptions:
                self._preemptions = None  # the counter went back: the server restarted
                self._window = None
            if self._preemptions is not None:
                preempted = s.preemptions - self._preemptions
            dt = s.t - self._preempt_t if self._preempt_t is not None else 0.0
            self._preemptions, self._preempt_t = s.preemptions, s.t
        # A request that arrives during a scheduler step waits for its end: a gauge above zero now and then is
        # not a queue; a sizeable share of our agents waiting, sample after sample, is.
        # A server that says nothing runs while our agents stream from it (vLLM does, now and then, when its
        # /metrics answer comes late) has told nothing about its queue: such a sample neither counts nor breaks it.
        stale = s.server_running == 0 and s.running > s.cold
        if not stale:
            queue = (s.waiting or 0) >= max(WAITING_MIN, WAITING_SHARE * s.running)
            self._waiting_streak = self._waiting_streak + 1 if queue else 0
        if self._settling or self.cap <= self.min_cap:
            return None
        if preempted > 0:
            self.slow_start = False
            base = min(self.cap, max(s.running, 1))
            new = max(self.min_cap, min(self.cap - 1, math.floor(base * 0.75)))
            return self._to(new, f"{preempted:.0f} preemption{'s' * (preempted > 1)} in {dt:.0f} s{self._kv(s)}")
        if self._waiting_streak >= WAITING_SAMPLES:
            waiting = math.ceil(s.waiting or 0)
            runs = int(s.server_running) if s.server_running is not None else max(1, s.running - waiting)
            new = max(self.min_cap, min(self.cap - 1, s.running - waiting, max(runs, 1)))
            self.slow_start = False
            self._waiting_streak = 0
            return self._to(new, f"{waiting} request{'s' * (waiting > 1)} waiting at the server, it runs {runs}"
                            f"{self._kv(s)}")
        return None

    # ---- at the end of a window: throughput --------------------------------------------------
    def _judge(self, s: Signals, w: _Window) -> Change | None:
        tp = (s.tokens - w.tokens0) / (s.t - w.t0)
        cap = self.cap
        self.measured[cap] = tp
        if w.hit_rate is not None:
            self.hit_rates[cap] = w.hit_rate
        if s.ttft_p50 is not None:
            self.ttft_best = s.ttft_p50 if self.ttft_best is None else min(self.ttft_best, s.ttft_p50)
        if s.queued == 0:
            return None  # nobody waits for a slot: a cap moved now would change nothing
        seen, floor_pending = self._per_user_at_cap(s, w) if self.min_interactivity else (None, False)
        slow = self._under_floor(seen)
        if slow is not None:
            return slow
        fit = self._fit(s)
        upper = min(self.ceiling, fit if fit is not None else self.max_cap, s.slots or self.max_cap)
        kv = f", KV {pct(w.kv)}" if w.kv is not None else ""
        # the projection grew (or the ceiling fell) past this cap: hold admissions down to what fits
        if fit is not None and cap > fit and cap - fit >= max(1, cap // 10):
            return self._to(max(self.min_cap, fit), self._fit_text(s, fit))
        # no metrics: requests queueing shows as TTFT
        if (s.waiting is None and s.ttft_p50 is not None and self.ttft_best is not None
                and s.ttft_p50 > TTFT_QUEUE_RATIO * self.ttft_best + 0.5 and cap > self.min_cap):
            self.slow_start = False
            return self._to(max(self.min_cap, cap * 3 // 4),
                                f"TTFT p50 {s.ttft_p50:.1f} s against {self.ttft_best:.1f} s at best: requests queue")
        # prefix hits falling while the cache is full: conversations lose their prefixes
        best_hits = max((h for c, h in self.hit_rates.items() if c < cap), default=None)
        hits = w.hit_rate
        if (best_hits is not None and hits is not None and w.kv is not None and w.kv >= 0.9
                and hits < best_hits - HIT_DROP and cap > self.min_cap):
            back = max(c for c, h in self.hit_rates.items() if c < cap and h >= best_hits - HIT_DROP / 2)
            self.slow_start = False
            return self._to(back, f"prefix hits {pct(hits)} against {pct(best_hits)} at {back}{kv}: "
                                "prefixes are evicted")
        headroom = not w.queued(s.running) and self._waiting_streak == 0 and (w.kv is None or w.kv < KV_FULL) and not self._preempted_in(w, s)
        prev = self.measured.get(self.prev_cap) if self.prev_cap is not None else None
        if self._probe_from is not None:  # judging an upward probe
            base_cap, self._probe_from = self._probe_from, None
            base = self.measured.get(base_cap)
            # its users kept the floor (else _under_floor sent it back): more of them streaming at the SLO is more
            # goodput, unless the total fell; without a floor, a probe must raise the total to be worth its risk
            gain = COLLAPSE if self.min_interactivity else PROBE_GAIN
            if base is not None and (tp < base * gain or not headroom):
                return self._to(base_cap, f"probe to {cap}: throughput {self._gain(tp, base)}, back to {base_cap}")
            self._calm = 0
            return None
        if self.slow_start:
            # with a floor its verdict is the test (throughput dips at any raise here, as the sessions it admits
            # prefill their first prompts, and goodput is what the floor keeps); without one, did the total grow?
            if (seen is None and prev is not None and self.prev_cap is not None and self.prev_cap < cap
                    and tp < prev * GROWTH):
                self._flat += 1
                if self._flat < 2:
                    return None  # measure this cap once more before judging it: one window can be noise
                self.slow_start = False
                if tp < prev * COLLAPSE:
                    return self._to(self.prev_cap, f"throughput {self._gain(tp, prev)} at {cap} against "
                                        f"{self.prev_cap}")
                return None
            self._flat = 0
            if floor_pending:
                return None
            # a queue in one window (a loaded host's late scheduler steps, a burst of turns arriving together) is
            # measured once more before it ends the slow start, as a flat window is; a full cache or a preemption is not
            queue_only = (not headroom and (w.kv is None or w.kv < KV_FULL) and not self._preempted_in(w, s))
            if queue_only and cap < upper and self._queued_windows < 1:
                self._queued_windows += 1
                return None
            self._queued_windows = 0
            if headroom and cap < upper:
                # x4 while that stays within what fits (the fit is the safety, not the throughput test), else x2
                new = min(cap * 4 if fit is not None and cap * 4 <= fit else cap * 2, upper)
                grew = f"throughput {self._gain(tp, prev)} at {cap}" if prev else f"{tp:,.0f} tok/s at {cap}"
                if seen is not None:
                    grew += f", users at {seen[0]:,.0f} tok/s each"
                    # with a floor, no further than the cap the caps measured so far say it is reached at: a cap
                    # admitted past the knee of goodput holds its sessions for all their turns
                    at_floor = self._floor_cap()
                    if at_floor is not None:
                        # and one doubling at most: time per token grows faster than linearly once the batch is
                        # large (on agentx-slice caps 1, 4 and 12 placed the floor at 30, where users streamed at
                        # 38 tok/s against 50), and the sessions a raise admits hold their slots for all their turns
                        new = min(new, cap * 2, max(cap + 1, at_floor))
                        grew += f" (the floor at about {at_floor})"
                return self._to(new, f"slow start: {grew}, {w.queue_text()}{kv}" + self._fit_note(s, fit, new))
            self.slow_start = False
            return None
        self._calm += 1
        if (self._calm >= PROBE_EVERY and headroom and cap < upper and (w.kv is None or w.kv < KV_HEADROOM)):
            self._calm = 0
            # not as far as a cap whose users were under the floor: the probe would only come back
            under = min((c for c, rate in self.interactivity.items() if c > cap and rate < self.min_interactivity),
                        default=upper + 1)
            step = cap + max(1, cap // 4)
            # with a floor, as far as the caps measured place it, when that is further: caps measured early, in
            # the first prompts' prefills, place it low, and +25% a probe would take the run to get there
            at_floor = self._floor_cap() if self.min_interactivity else None
            new = min(upper, under - 1, max(step, at_floor or 0))
            if new <= cap:
                return None
            self._probe_from = cap
            return self._to(new, f"probing upward: {tp:,.0f} tok/s at {cap}, {w.queue_text()}{kv}"
                                 + self._fit_note(s, fit, new))
        return None

    def _per_user_at_cap(self, s: Signals, w: _Window) -> tuple[tuple[float, str] | None, bool]:
        """Each user's tokens/s since this cap's first window (_per_user) once FLOOR_WINDOWS have ended at it, and
        whether the cap waits for that (nothing grows meanwhile): a cap's figure over its windows together, as
        goodput counts it, not one window's, which the first prefills of the sessions it admits can take."""
        if self._floor_since is None or self._floor_since[0] != self.cap:
            self._floor_since = (self.cap, w.t0, w.gaps0, 0)
        cap, t0, gaps0, windows = self._floor_since
        self._floor_since = (cap, t0, gaps0, windows + 1)
        seen = _per_user(s, t0, gaps0)
        # a first window under the floor can be the burst of the admitted sessions' first prefills, so it waits for
        # another; one that holds the floor with that burst in it holds it (the ramp then goes on a window sooner)
        if seen is not None and windows + 1 < FLOOR_WINDOWS and seen[0] < self.min_interactivity:
            return None, True
        return seen, False

    def _under_floor(self, seen: tuple[float, str] | None) -> Change | None:
        """With a floor on each user's interactivity (`seen`: this cap's figure, _per_user_at_cap) under it: back
        to the cap whose users would stream at the floor if each one's share of the decode steps fell as 1/cap (it
        falls slower, so this errs low and probes climb back), at least three quarters of this one (a figure is
        noisy), or to the largest cap measured above it when that is more.
        Throughput alone grows a cap for as long as the total rises, while each user's stream slows under the
        others' prefills: the knee of goodput at an SLO sits below the knee of throughput."""
        if seen is None:
            return None
        per_user, source = seen
        cap, floor = self.cap, self.min_interactivity
        self.interactivity[cap] = per_user
        if per_user >= floor or cap <= self.min_cap:
            return None
        self.slow_start, self._probe_from = False, None
        good = max((c for c, rate in self.interactivity.items() if c < cap and rate >= floor), default=self.min_cap)
        back = max(self.min_cap, min(cap - 1, max(good, cap * 3 // 4, math.floor(cap * per_user / floor))))
        return self._to(back, f"{source} {per_user:.0f} tok/s per user at {cap}, under the {floor:g} floor "
                              "([run.auto] min_interactivity_tokens_s)")

    def _floor_cap(self) -> int | None:
        """The cap at which each user's stream reaches the floor, from the caps measured: time per output token
        grows about linearly with the conversations that share the steps (each adds its decode and its turns'
        prefills), so 1/rate = a + b x cap, fitted by least squares; None with fewer than two caps measured or a
        time per token that does not grow."""
        points = [(c, 1.0 / rate) for c, rate in self.interactivity.items() if rate > 0]
        if len(points) < 2:
            return None
        n = len(points)
        mean_c = sum(c for c, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        spread = sum((c - mean_c) ** 2 for c, _ in points)
        slope = sum((c - mean_c) * (t - mean_t) for c, t in points) / spread if spread else 0.0
        if slope <= 0:
            return None
        return max(self.min_cap, math.floor(mean_c + (1.0 / self.min_interactivity - mean_t) / slope + 1e-9))

    # ---- helpers ----------------------------------------------------------------------------------
    def _fit(self, s: Signals) -> int | None:
        if not s.kv_tokens or not s.context_tokens:
            return None
        return max(self.min_cap, math.floor(self.kv_target * s.kv_tokens / s.context_tokens))

    def _fit_text(self, s: Signals, fit: int) -> str:
        return (f"conversations project to {s.context_tokens:,.0f} tokens: {fit} fit in "
                f"{pct(self.kv_target)} of the {s.kv_tokens:,.0f}-token KV cache")

    def _fit_note(self, s: Signals, fit: int | None, new: int) -> str:
        return f"; {fit} conversations of {s.context_tokens:,.0f} tokens fit" if fit is not None and new == fit else ""

    @staticmethod
    def _gain(tp: float, base: float | None) -> str:
        if not base:
            return f"{tp:,.0f} tok/s"
        return f"{(tp / base - 1):+.0%}"

    @staticmethod
    def _kv(s: Signals) -> str:
        return f", KV {pct(s.kv_usage)}" if s.kv_usage is not None else ""

    @staticmethod
    def _preempted_in(w: _Window, s: Signals) -> bool:
        return w.preemptions0 is not None and s.preemptions is not None and s.preemptions > w.preemptions0

    def _clamp(self, cap: int) -> int:
        return max(self.min_cap, min(self.ceiling, cap))

    def _to(self, cap: int, why: str) -> Change | None:
        cap = self._clamp(cap)
        if cap == self.cap:
            return None
        old, self.prev_cap, self.cap = self.cap, self.cap, cap
        self._window = None
        self._warm, self._cold_looks = False, 0
        self._settling = cap < old  # a decrease takes effect as conversations end: judge nothing until it has
        self._floor_since = None
        return Change(cap, f"auto: {old} -> {cap} ({why})")
