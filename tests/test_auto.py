"""Auto mode's controller on recorded signal sequences: a toy server whose throughput, queue, KV and
counters follow the cap it is given, looked at once a second, as the engine does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cerevisor_tui.engine.auto import AutoController, Signals


@dataclass
class Box:
    """A server under a queue of agents: `rate(running)` output tokens/s; more fields as a test scripts them."""

    rate: Callable[[int], float]
    queue: int = 1000  # agents still waiting for a slot
    metrics: bool = True
    kv_tokens: float | None = None
    context: float | None = None
    t: float = 0.0
    tokens: float = 0.0
    running: int = 0
    sample: int = 0
    extra: dict = field(default_factory=dict)  # signal fields a test sets directly (waiting, preemptions, ...)

    def look(self, cap: int) -> Signals:
        # admissions are at once; a lower cap only takes effect as conversations end, one per second
        if self.running < cap:
            admit = min(cap - self.running, self.queue)
            self.running += admit
            self.queue -= admit
        elif self.running > cap:
            self.running -= 1
        self.t += 1.0
        self.tokens += self.rate(self.running)
        self.sample += 1
        server = dict(server_ok=True, waiting=0.0, kv_usage=min(1.0, self.running / 40),
                      preemptions=0.0, prefix_hit_rate=0.8) if self.metrics else {}
        server.update(self.extra)
        return Signals(t=self.t, tokens=int(self.tokens), running=self.running, queued=self.queue,
                       sample=self.sample if self.metrics else 0, kv_tokens=self.kv_tokens,
                       context_tokens=self.context, turn_tokens=4.0, **server)


def drive(ctl: AutoController, box: Box, seconds: int) -> list[tuple[float, int, str]]:
    changes = []
    for _ in range(seconds):
        change = ctl.update(box.look(ctl.cap))
        if change is not None:
            assert change.cap == ctl.cap and change.reason.startswith("auto: ")
            changes.append((box.t, change.cap, change.reason))
    return changes


def caps(changes) -> list[int]:
    return [cap for _, cap, _ in changes]


def linear_then_flat(knee: int, per_agent: float = 100.0) -> Callable[[int], float]:
    return lambda n: per_agent * min(n, knee)


def test_slow_start_doubles_while_throughput_grows_then_holds():
    ctl = AutoController(max_cap=256)
    changes = drive(ctl, Box(linear_then_flat(16)), 120)
    # 32 was tried, gave no more than 16: slow start ends there without collapse, and nothing moves for long
    assert caps(changes)[:5] == [2, 4, 8, 16, 32]
    assert "slow start" in changes[0][2] and "+100%" in changes[1][2]
    assert not ctl.slow_start
    assert all(cap <= 40 for cap in caps(changes))


def test_throughput_that_falls_past_the_knee_sends_it_back():
    # past 8 the box recomputes evicted prefixes: throughput falls, not just flattens
    ctl = AutoController(max_cap=256)
    changes = drive(ctl, Box(lambda n: 100.0 * n if n <= 8 else 800.0 * 8 / n), 80)
    assert caps(changes)[:4] == [2, 4, 8, 16]
    assert caps(changes)[4] == 8 and "against 8" in changes[4][2]


def test_kv_fit_is_the_ceiling_and_follows_the_projection():
    box = Box(linear_then_flat(1000), kv_tokens=100_000, context=10_000)
    ctl = AutoController(max_cap=256, kv_target=0.9)
    changes = drive(ctl, box, 60)
    assert caps(changes) == [4, 8, 9]  # x4 while it stays within the fit, then x2, then the fit
    assert "9 conversations of 10,000 tokens fit" in changes[-1][2]
    box.context = 15_000  # the conversations turned out longer: 6 fit now
    later = drive(ctl, box, 30)
    assert caps(later) == [6]
    assert "conversations project to 15,000 tokens: 6 fit" in later[0][2]


def test_preemptions_back_off_once_per_step_until_it_takes_effect():
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=16, start_cap=16)
    drive(ctl, box, 3)
    box.extra = {"preemptions": 5.0}
    changes = drive(ctl, box, 1)
    assert caps(changes) == [12]
    assert "5 preemptions in 1 s, KV 40%" in changes[0][2]
    # the server preempts on while our 16 conversations drain to 12: no further cut until they have
    for n in range(4):
        box.extra = {"preemptions": 6.0 + n}
        assert drive(ctl, box, 1) == []
    assert box.running == 12
    box.extra = {"preemptions": 20.0}
    assert caps(drive(ctl, box, 1)) == [9]


def test_a_quarter_of_the_agents_waiting_three_samples_running_cuts_to_what_the_server_runs():
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=32, start_cap=16)
    drive(ctl, box, 2)
    box.extra = {"waiting": 4.0, "server_running": 12.0}
    assert drive(ctl, box, 2) == []
    changes = drive(ctl, box, 1)
    assert caps(changes) == [12]
    assert "4 requests waiting at the server, it runs 12" in changes[0][2]


def test_a_sample_that_says_nothing_runs_while_our_agents_stream_neither_counts_nor_breaks_a_queue():
    # vLLM, answering /metrics late, now and then reports 0 running and 0 waiting under a steady queue
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=32, start_cap=16)
    drive(ctl, box, 2)
    queue, stale = {"waiting": 4.0, "server_running": 12.0}, {"waiting": 0.0, "server_running": 0.0}
    for extra in (queue, stale, queue, stale):
        box.extra = extra
        assert drive(ctl, box, 1) == []
    box.extra = queue
    assert caps(drive(ctl, box, 1)) == [12]
    # a sample that says nothing waits, with requests running, does end the streak
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=32, start_cap=16)
    drive(ctl, box, 2)
    for extra in (queue, queue, {"waiting": 0.0, "server_running": 12.0}, queue, queue):
        box.extra = extra
        assert drive(ctl, box, 1) == []


def test_requests_that_wait_a_scheduler_step_are_not_a_queue():
    # at every sample a few requests have just arrived mid-step: below a quarter of the agents, never a queue
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=32, start_cap=16)
    box.extra = {"waiting": 3.0}
    assert all(cap >= 16 for cap in caps(drive(ctl, box, 30)))
    box.extra = {"waiting": 6.0}  # and one sample of a real queue is not enough either
    assert drive(ctl, box, 1) == []


def test_slow_start_measures_a_flat_window_twice_before_it_ends():
    # a doubling whose first window is flat (the new agents' prefill) but whose second grows goes on doubling
    seen = {"n": 0, "ticks": 0}

    def warming(n: int) -> float:  # half the rate for the first three looks at each new level
        if n != seen["n"]:
            seen.update(n=n, ticks=0)
        seen["ticks"] += 1
        return 100.0 * n if seen["ticks"] > 3 else 50.0 * n

    ctl = AutoController(max_cap=256)
    changes = drive(ctl, Box(warming), 60)
    assert caps(changes)[:5] == [2, 4, 8, 16, 32]


def test_slow_start_measures_a_window_with_a_passing_queue_twice_before_it_ends():
    # at 4, a window's samples show two requests waiting (a loaded host's scheduler steps late), then none: the slow
    # start goes on rather than leaving the rest of the way to the probes (CI: it ended at 4 with 9 fitting)
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=256)
    changes: list = []
    while ctl.cap < 4:
        changes += drive(ctl, box, 1)
    box.extra = {"waiting": 2.0}  # a quarter of 4 and more, two samples: a queue in the window, not yet a streak
    changes += drive(ctl, box, 2)
    box.extra = {}
    changes += drive(ctl, box, 20)
    assert caps(changes)[:4] == [2, 4, 8, 16], changes
    assert all("slow start" in why for _, _, why in changes[:4]), changes


def test_no_window_opens_while_the_agents_just_admitted_have_no_first_token():
    ctl = AutoController(max_cap=64)
    box = Box(linear_then_flat(1000))
    ctl.cap = 8
    box.extra = {"cold": 4}
    assert drive(ctl, box, 8) == []  # half the agents still in their first prefill: nothing measured
    box.extra = {}
    assert caps(drive(ctl, box, 10))[:1] == [16]


def test_agents_that_keep_arriving_cold_do_not_hold_the_window_shut():
    # single-turn agents: some are always in their first prefill; after a few looks the window opens anyway
    ctl = AutoController(max_cap=64, start_cap=8)
    box = Box(linear_then_flat(1000))
    box.extra = {"cold": 3}
    assert caps(drive(ctl, box, 30))[:1] == [10]


def test_429s_halve_the_cap_and_it_grows_back_only_by_probing():
    box = Box(linear_then_flat(1000), metrics=False)
    ctl = AutoController(max_cap=64, start_cap=32)
    drive(ctl, box, 3)
    box.extra = {"errors": 3}
    changes = drive(ctl, box, 1)
    assert caps(changes) == [16] and "3 answers HTTP 429/503" in changes[0][2]
    # more rejections while 32 conversations drain to 16 do not cut again
    box.extra = {"errors": 5}
    assert drive(ctl, box, 5) == []
    later = drive(ctl, box, 200)
    assert later and all("probing upward" in r or "probe to" in r for _, _, r in later)
    assert caps(later)[0] == 20


def test_without_metrics_a_rising_ttft_means_requests_queue():
    box = Box(linear_then_flat(1000), metrics=False)
    ctl = AutoController(max_cap=64, start_cap=16)
    box.extra = {"ttft_p50": 0.5}
    drive(ctl, box, 10)
    assert ctl.ttft_best == 0.5
    before = ctl.cap
    box.extra = {"ttft_p50": 3.0}
    changes = drive(ctl, box, 10)
    assert caps(changes)[0] == before * 3 // 4 and "TTFT p50 3.0 s against 0.5 s" in changes[0][2]


def test_a_server_restart_is_not_a_burst_of_preemptions_and_a_down_server_freezes_the_cap():
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=64, start_cap=16)
    box.extra = {"preemptions": 50.0}
    drive(ctl, box, 3)
    box.extra = {"server_ok": False, "waiting": None, "preemptions": None}
    assert drive(ctl, box, 10) == []  # down: nothing it says is about the cap
    box.extra = {"preemptions": 0.0}  # back, its counters from zero
    assert drive(ctl, box, 3) == []
    box.extra = {"preemptions": 2.0}  # counted from the restart
    changes = drive(ctl, box, 1)
    assert caps(changes) == [12] and "2 preemptions" in changes[0][2]


def test_llama_slots_are_a_ceiling():
    box = Box(linear_then_flat(1000))
    box.extra = {"slots": 4}
    ctl = AutoController(max_cap=64, start_cap=8)
    changes = drive(ctl, box, 30)
    assert caps(changes)[0] == 4 and "4 slots" in changes[0][2]
    assert ctl.cap == 4


def test_an_upward_probe_that_gains_nothing_goes_back():
    box = Box(linear_then_flat(16))
    ctl = AutoController(max_cap=64, start_cap=16)
    changes = drive(ctl, box, 60)
    assert caps(changes)[:2] == [20, 16]
    assert "probing upward" in changes[0][2] and "probe to 20: throughput +0%, back to 16" in changes[1][2]


def test_an_upward_probe_that_gains_stays():
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=64, start_cap=16)
    changes = drive(ctl, box, 40)
    assert caps(changes)[:2] == [20, 25]


def test_nothing_grows_without_a_queue():
    box = Box(linear_then_flat(1000), queue=3)
    ctl = AutoController(max_cap=64)
    changes = drive(ctl, box, 60)
    assert max(caps(changes)) <= 4


def test_the_operator_ceiling_caps_it_and_resume_keeps_what_it_learned():
    box = Box(linear_then_flat(1000))
    ctl = AutoController(max_cap=64)
    drive(ctl, box, 20)
    assert ctl.cap > 4
    change = ctl.set_ceiling(3)
    assert change is not None and change.cap == 3 and "ceiling 3" in change.reason
    assert all(cap <= 3 for cap in caps(drive(ctl, box, 30)))
    again = ctl.resume()
    assert again.cap == 3 and "where it left off" in again.reason


def test_signals_are_immutable_snapshots():
    s = Signals(t=1.0, tokens=0, running=0, queued=0)
    assert replace(s, running=2).running == 2 and s.running == 0


def test_an_idle_gap_between_waves_is_not_measured_as_a_slow_cap():
    box = Box(linear_then_flat(1000), queue=16)
    ctl = AutoController(max_cap=64)
    grown = drive(ctl, box, 30)
    assert caps(grown)[:3] == [2, 4, 8]
    cap = ctl.cap
    box.running = 0  # the wave ended: nothing runs, nothing is queued, no tokens for a while
    assert drive(ctl, box, 20) == []
    box.queue = 200  # the next wave
    later = drive(ctl, box, 30)
    assert all(c >= cap for c in caps(later)), later


def drive_with_rates(ctl: AutoController, box: Box, seconds: int) -> list[tuple[float, int, str]]:
    """`drive`, each look carrying the answers that ended that second and how fast each user's streamed: the
    box's throughput shared by the agents running."""
    changes = []
    for _ in range(seconds):
        s = box.look(ctl.cap)
        s = replace(s, rates=((s.t, box.rate(box.running) / max(1, box.running)),))
        change = ctl.update(s)
        if change is not None:
            changes.append((box.t, change.cap, change.reason))
    return changes


def test_a_floor_on_each_users_interactivity_stops_auto_at_the_knee_of_goodput_not_of_throughput():
    # total throughput keeps rising (x1.6 a doubling) while each user's stream slows: 264 tok/s each at 4 agents,
    # 214 at 8, 190 at 12, 174 at 16, 141 at 32; 180 each holds up to 14 agents
    def rising(n: int) -> float:
        return 400.0 * n ** 0.7

    free = AutoController(max_cap=64)
    drive_with_rates(free, Box(rising), 200)
    assert free.cap >= 32  # throughput alone grows past where users get 180 tok/s

    held = AutoController(max_cap=64, min_interactivity=180.0)
    changes = drive_with_rates(held, Box(rising), 200)
    assert 12 <= held.cap <= 14  # the most agents whose answers still stream at 180 tok/s each, within a probe's step
    assert any("under the 180 floor" in why for _, _, why in changes)
    assert max(caps(changes)) <= 16  # it tried 16, saw users slow under the floor, came back and probed up to it


def test_without_answers_in_a_window_the_floor_decides_nothing():
    ctl = AutoController(max_cap=256, min_interactivity=1e6)
    changes = drive(ctl, Box(linear_then_flat(16)), 120)  # no rates carried: throughput alone, as before
    assert caps(changes)[:5] == [2, 4, 8, 16, 32]
