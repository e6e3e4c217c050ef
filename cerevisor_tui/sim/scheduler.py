"""The simulated engine: a step loop like vLLM's scheduler, on a clock that `speed` scales.

Each step admits waiting requests while there are free sequence slots and KV blocks, computes one
decode token for every running sequence plus chunks of prompts (prefill), and takes simulated time:
a decode step costs (1 + batch_slowdown x (batch - 1)) / tokens_per_s, prefill costs its uncached
tokens / prefill_tokens_per_s, a reload from the CPU tier costs tokens / reload rate. When a running
sequence needs a block and none is free, the most recently admitted one is preempted (its blocks are
freed; it waits at the head of the queue and recomputes later), as vLLM does.

Two faults live here because they are the engine's: `wedge_after_s` stops the loop for good at the first step
boundary past that engine time (nothing is computed, freed or counted again, new requests are taken in and
never looked at), and `preempt_loop_tokens` preempts a long prompt each time its prefill completes, so that it
waits, prefills again and never makes its first token.

Time is cheap: the loop sleeps until each step's end in real time and runs several tiny steps per
wake-up when `speed` makes them shorter than a millisecond. The engine clock (`now`) counts only time
spent serving: it stands still while the server is idle, and when the host is too busy to keep pace
the simulation slows down instead of jumping ahead. So a benchmark that reads `now` measures the
modelled server, not the machine running it (or its clients' think time).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from cerevisor_tui.sim.kv import KvCache, KvHold

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"

# vLLM's buckets (v1/metrics/loggers.py): request_latency_buckets, and those of time_to_first_token_seconds.
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's inter_token_latency_seconds buckets (older vLLM: time_per_output_token_seconds, the same gaps)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)


DECODE_RATES_KEPT = 100_000


@dataclass
class Histogram:
    """A Prometheus histogram kept as counts per bucket (upper bounds `bounds`, then +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count of observations <= le) pairs ending in +Inf, as HistogramMetricFamily takes them."""
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out


@dataclass
class EngineParams:
    """Numbers the step loop runs on (resolved from SimSettings and the profile)."""

    speed: float = 1.0
    tokens_per_s: float = 40.0
    ttft_s: float = 0.3
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    batch_slowdown: float = 0.02
    prefill_tokens_per_s: float = 20000.0
    reload_tokens_per_s: float = 1_000_000.0
    stall_after_tokens: int = -1
    wedge_after_s: float = -1.0
    preempt_loop_tokens: int = -1


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    prompt_tokens: int
    hashes: list[int]
    max_tokens: int
    notify_each_token: bool = True
    generated: int = 0
    phase: str = WAITING
    hold: KvHold = field(default_factory=KvHold)
    not_before: float = 0.0  # engine time before which its prefill may not start (ttft)
    prefill_left: int = 0
    reload_left: int = 0
    admitted_once: bool = False
    blocked_at: int = -1  # kv.releases when admission last failed
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (usage's cached_tokens)
    aborted: bool = False
    closed: bool = False  # the server is shutting down
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    notify_progress: bool = False  # wake `changed` as its prefill moves too (llama's return_progress)
    arrived_at: float = 0.0  # engine times: submitted, first admitted (-1: not yet), latest admission
    scheduled_at: float = -1.0
    admitted_at: float = 0.0
    admissions: int = 0
    progress_base: int = 0  # prompt tokens the latest admission did not compute (cache hits, reloads)
    prefill_computed: int = 0  # prompt tokens computed since the latest admission, in finished steps
    step_chunk: int = 0  # prompt tokens it computes in the step under way
    wait_until: float = 0.0  # engine time before which it may not be admitted again (preempt_loop)
    first_token_at: float = 0.0  # engine time of its first output token
    last_token_at: float = 0.0  # engine time of its latest output token

    @property
    def finished(self) -> bool:
        return self.phase == DONE


class BatchEngine:
    """Runs sequences against a KvCache; one per simulated server, living in one event loop."""

    def __init__(self, params: EngineParams, kv: KvCache) -> None:
        self.p = params
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.now = 0.0  # engine (simulated) seconds
        self._sim_high = 0.0  # the latest sim_time() told
        self.max_running_seen = 0
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_prompt_tokens_total = 0
        self.steps_total = 0
        # Durations as a client's clock sees them (engine seconds / speed), in vLLM's histograms.
        self.ttft_s = Histogram(TTFT_BUCKETS_S)
        self.queue_time_s = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.prefill_time_s = Histogram(REQUEST_LATENCY_BUCKETS_S)
        # each gap between two output tokens of a request, as vLLM observes it per token: its _sum over its
        # _count is the time per token a user sees, slowed by the batch and the prefills stepped with it
        self.inter_token_s = Histogram(INTER_TOKEN_BUCKETS_S)
        # each finished request's interactivity, output tokens per engine second after its first, the latest
        # DECODE_RATES_KEPT: what a benchmark reads to measure on the server's clock, not a busy client's
        self.decode_rates: deque[float] = deque(maxlen=DECODE_RATES_KEPT)
        self.wedged = False
        self.step_start = 0.0  # engine times the step under way began and ends
        self.step_end = 0.0
        self._limbo: list[Sequence] = []  # taken in while wedged: never scheduled
        self._chunked: list[Sequence] = []
        self._loop_victims: list[Sequence] = []
        self._wake = asyncio.Event()
        self._anchor_real = time.monotonic()
        self._anchor_sim = 0.0
        self._idle_since: float | None = self._anchor_real  # real time the engine went idle; None: serving
        self._idle_s = 0.0  # engine seconds spent idle before that, at `speed`
        self._clock_high = 0.0  # the latest clock_s() read: it never runs backwards
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if self._closed:
            seq.closed = True
            seq.changed.set()
            return
        if self.wedged:
            self._limbo.append(seq)
            return
        seq.arrived_at = self.now
        self.waiting.append(seq)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="cerevisor-sim-engine")

    def abort(self, seq: Sequence) -> bool:
        """Drop a request (client gone); True when it was still waiting or running."""
        if seq.phase == DONE:
            return False
        if self.wedged:  # the engine never hears of it: its blocks and the counters stay as they are
            seq.aborted = True
            seq.changed.set()
            return False
        if seq.phase == WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        else:
            self.running.remove(seq)
            self.kv.release(seq.hold)
        seq.phase = DONE
        seq.aborted = True
        seq.changed.set()
        self._wake.set()
        return True

    async def close(self) -> None:
        """Stop the loop and wake every open request so that its handler ends."""
        self._closed = True
        for seq in [*self.waiting, *self.running, *self._limbo]:
            seq.closed = True
            seq.changed.set()
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    # ---- the loop -----------------------------------------------------------------------------
    def _clock(self) -> float:
        return self._anchor_sim + (time.monotonic() - self._anchor_real) * self.p.speed

    def _reanchor(self) -> None:
        self._anchor_real = time.monotonic()
        self._anchor_sim = self.now

    def sim_time(self) -> float:
        """The engine clock now, between steps too (it stands still while idle or wedged). It never runs backwards:
        on a busy host a step may end later than planned, the clock read meanwhile having run past the step's
        end, and the loop then takes up from that end (prompt_progress's `time_ms` fell back by ~10 ms so)."""
        if self._task is None or self.wedged or not (self.waiting or self.running):
            at = self.now
        else:
            at = self._clock()
        self._sim_high = max(self._sim_high, at)
        return self._sim_high

    def clock_s(self) -> float:
        """Engine seconds since the server started, idle time counted at `speed` too: what a client of the
        modelled server would measure. While the host keeps pace it runs at `speed` times the wall; while the
        host falls behind it slows with the engine (see module doc), so a replay timed on it measures the server,
        not the machine. It never runs backwards (a step that ended late moves it forward no further)."""
        if self._idle_since is not None:  # until the loop takes up its work, the engine clock is `now`
            at = self.now + self._idle_s + (time.monotonic() - self._idle_since) * self.p.speed
        else:
            at = self.sim_time() + self._idle_s
        self._clock_high = max(self._clock_high, at)
        return self._clock_high

    def prompt_progress(self, seq: Sequence) -> int | None:
        """Prompt tokens of `seq` processed so far, cache included (llama's `processed`), while it prefills.

        Within a step the tokens are spread over its time, so a reader sees the prefill move at the modelled
        rate however coarse the steps; None once it has its first token, or while it is not admitted."""
        if seq.phase != PREFILL or seq.generated:
            return None
        done = seq.progress_base + seq.prefill_computed
        if seq.step_chunk:
            span = self.step_end - self.step_start
            frac = 1.0 if span <= 0 else (self.sim_time() - self.step_start) / span
            done += int(seq.step_chunk * min(1.0, max(0.0, frac)))
        return min(done, seq.prompt_tokens)

    def seconds_until_processed(self, seq: Sequence, tokens: int) -> float | None:
        """Real seconds until `seq` has `tokens` prompt tokens processed, if the step under way gets it there."""
        if seq.phase != PREFILL or not seq.step_chunk:
            return None
        before = seq.progress_base + seq.prefill_computed
        if tokens > before + seq.step_chunk:
            return None
        at = self.step_start + (tokens - before) / seq.step_chunk * (self.step_end - self.step_start)
        return max(0.0, (at - self.sim_time()) / self.p.speed)

    def _served(self) -> None:
        """The idle time that just ended, into clock_s's count."""
        if self._idle_since is not None:
            self._idle_s += (time.monotonic() - self._idle_since) * self.p.speed
            self._idle_since = None

    def _wedge_due(self) -> bool:
        return self.p.wedge_after_s >= 0 and self.now >= self.p.wedge_after_s

    async def _loop(self) -> None:
        self._served()
        self._reanchor()
        while not self._closed:  # closed: it ends even if a cancel was lost on the way
            if not self.waiting and not self.running:
                # Idle: the clock stands still, so engine time is time spent serving (see module doc).
                self._wake.clear()
                self._idle_since = time.monotonic()
                await self._wake.wait()
                self._served()
                self._reanchor()
                continue
            if self._wedge_due():
                # As an engine core that died behind a live HTTP server: nothing moves again.
                self.wedged = True
                await asyncio.Event().wait()
            self._wake.clear()
            self._admit()
            dt, produced = self._plan()
            if dt <= 0.0:
                # Nothing can compute yet: sleep until the earliest TTFT ends or something arrives.
                pending = [s.not_before for s in self.running if s.phase == PREFILL]
                if self.waiting and self.waiting[0].wait_until > self.now:
                    pending.append(self.waiting[0].wait_until)
                if not pending:
                    await self._wake.wait()
                    self.now = max(self.now, self._clock())
                    continue
                until = min(pending)
                delay = (until - self._clock()) / self.p.speed
                if delay > 0:
                    # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that comes as the wait ends
                    # (the wake of an abort and close()'s cancel at once), and the loop then never ended
                    try:
                        async with asyncio.timeout(delay):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                self.now = max(self.now, min(until, self._clock()))
                if self.now < until and not self._wake.is_set():
                    self.now = until
                continue
            self.step_start = self.now
            self.now += dt
            self.step_end = self.now
            delay = (self.now - self._clock()) / self.p.speed
            if delay > 0.001:
                await asyncio.sleep(delay)
            else:
                if delay < -0.001:  # behind real time (a busy host): slow down rather than catch up
                    self._reanchor()
                await asyncio.sleep(0)
            self._apply(produced)

    def _admit(self) -> None:
        p = self.p
        while self.waiting and len(self.running) < p.max_num_seqs:
            seq = self.waiting[0]
            if seq.blocked_at == self.kv.releases:
                break  # no block came back since it last did not fit
            if seq.wait_until > self.now:
                break  # preempt_loop: it waits for room, and holds the queue as vLLM's FCFS head does
            tokens = seq.prompt_tokens + seq.generated  # a preempted sequence recomputes its output too
            got = self.kv.try_admit(seq.hashes, tokens, seq.hold, count=not seq.admitted_once)
            if got is None:
                seq.blocked_at = self.kv.releases
                break
            self.waiting.popleft()
            seq.phase = PREFILL
            seq.prefill_left = max(1, got.compute_tokens)
            seq.reload_left = got.cpu_hit_tokens
            seq.progress_base = tokens - seq.prefill_left
            seq.prefill_computed = seq.step_chunk = 0
            seq.admitted_at = self.now
            seq.admissions += 1
            if not seq.admitted_once:
                seq.cached_tokens = got.gpu_hit_tokens + got.cpu_hit_tokens
                seq.not_before = self.now + p.ttft_s
                self.prompt_tokens_total += seq.prompt_tokens
                seq.admitted_once = True
                seq.scheduled_at = self.now
                self.queue_time_s.observe((self.now - seq.arrived_at) / p.speed)
            else:
                seq.not_before = self.now
            self.running.append(seq)
            if seq.notify_progress:
                seq.changed.set()
        if len(self.running) > self.max_running_seen:
            self.max_running_seen = len(self.running)

    def _preempt_for(self, seq: Sequence) -> bool:
        """Free blocks for `seq` by preempting the latest admitted others; False if `seq` itself went."""
        while True:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
            if self.kv.grow(seq.hold, seq.prompt_tokens + seq.generated + 1):
                return True

    def _preempt(self, seq: Sequence, *, keep_cached: bool = True) -> None:
        self.running.remove(seq)
        self.kv.release(seq.hold, keep_cached=keep_cached)
        seq.phase = WAITING
        seq.step_chunk = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(seq)
        if seq.notify_progress:
            seq.changed.set()

    def _loops(self, seq: Sequence) -> bool:
        """The preempt_loop fault: this prompt is preempted instead of making its first token."""
        return 0 <= self.p.preempt_loop_tokens <= seq.prompt_tokens and seq.generated == 0

    def _plan(self) -> tuple[float, list[Sequence]]:
        """Decide one step: which sequences make a token, and how long it takes (0: nothing to do)."""
        p = self.p
        produced: list[Sequence] = []
        stall = p.stall_after_tokens
        # Decode slots first: each decoding sequence needs room for one more token.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.phase == DECODE and (stall < 0 or seq.generated < stall):
                if not self.kv.grow(seq.hold, seq.prompt_tokens + seq.generated + 1):
                    if not self._preempt_for(seq):
                        continue  # seq itself was preempted; running[i] is the next one now
                produced.append(seq)
            i += 1
        budget = p.max_num_batched_tokens - len(produced)
        prefill_tokens = 0
        reload_tokens = 0
        in_batch = len(produced)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.phase != PREFILL or seq.not_before > self.now:
                continue
            if seq.reload_left:
                reload_tokens += seq.reload_left
                seq.reload_left = 0
            chunk = min(seq.prefill_left, budget)
            seq.prefill_left -= chunk
            seq.step_chunk = chunk
            self._chunked.append(seq)
            budget -= chunk
            prefill_tokens += chunk
            in_batch += 1
            if seq.prefill_left == 0:
                (self._loop_victims if self._loops(seq) else produced).append(seq)
        if in_batch == 0:
            return 0.0, produced
        self.computed_prompt_tokens_total += prefill_tokens
        dt = (1.0 + p.batch_slowdown * (in_batch - 1)) / p.tokens_per_s
        dt += prefill_tokens / p.prefill_tokens_per_s + reload_tokens / p.reload_tokens_per_s
        return dt, produced

    def _apply(self, produced: list[Sequence]) -> None:
        self.steps_total += 1
        for seq in self._chunked:
            seq.prefill_computed += seq.step_chunk
            seq.step_chunk = 0
            if seq.notify_progress and seq.phase == PREFILL:
                seq.changed.set()
        self._chunked.clear()
        for seq in self._loop_victims:
            if seq.phase == PREFILL:
                # Its blocks go back uncached, as under the pressure that preempts it, so each round prefills
                # again; it then waits as long as a prefill takes before it is admitted again.
                self._preempt(seq, keep_cached=False)
                seq.wait_until = self.now + seq.prompt_tokens / self.p.prefill_tokens_per_s
        self._loop_victims.clear()
        for seq in produced:
            if seq.phase == DONE or seq.phase == WAITING:  # aborted or preempted meanwhile
                continue
            seq.phase = DECODE
            seq.generated += 1
            self.generation_tokens_total += 1
            if seq.generated == 1 and seq.scheduled_at >= 0:
                seq.first_token_at = self.now
                self.ttft_s.observe((self.now - seq.arrived_at) / self.p.speed)
                self.prefill_time_s.observe((self.now - seq.scheduled_at) / self.p.speed)
            elif seq.generated > 1:
                self.inter_token_s.observe((self.now - seq.last_token_at) / self.p.speed)
            seq.last_token_at = self.now
            if seq.generated >= seq.max_tokens:
                if seq.generated > 1 and self.now > seq.first_token_at:
                    self.decode_rates.append((seq.generated - 1) / (self.now - seq.first_token_at))
                seq.phase = DONE
                self.running.remove(seq)
                self.kv.release(seq.hold)
                seq.changed.set()
            elif seq.notify_each_token:
                seq.changed.set()
