"""Auto mode against sequential and fixed caps, on a queue of agents well past the simulated KV cliff.

Our engine (in-process, headless, built from a Config as `cerevisor-tui run` builds it) runs one queue of
multi-turn agents against the simulator (in-process, a fresh one per run, so that its clock and counters
are that run's): sequentially, in parallel at fixed caps across the range (the largest is the naive
"cap = every agent"), and in auto mode, where a controller per endpoint sets the live cap from the
server's /metrics and the engine's own measurements. Per run it prints the makespan and the output
tokens per second on the simulator's clock (`engine.now`: it stands still while the server is idle and
slows down rather than jumps ahead when the host is busy, so host noise does not move the figures), the
prefix-cache hit rate, preemptions and the requests waiting at the server; for auto, its cap history
and time-weighted mean cap; then the targets of issue 11 (item 5), each MET or MISSED with its numbers.
Progress goes to stderr, the markdown tables to stdout.

    .venv/bin/python benchmarks/auto_mode.py            # both scenarios (about 3.5 minutes on 2 cores)
    .venv/bin/python benchmarks/auto_mode.py --quick    # the first scenario, smaller (about 25 s)
    .venv/bin/python benchmarks/auto_mode.py --profile qwen3.6-35b-a3b@2xh100 --cpu-offload-gib 64
    .venv/bin/python benchmarks/auto_mode.py --profile qwen3.6-35b-a3b@2xh100 --agents 64 --caps 32,64 --scale 1

The agents have the shape of the agentic-coding conversations of vLLM's tiered-offloading write-up,
which docs/performance.md's KV-cliff table (benchmarks/sim_kv_curve.py) reproduces: a 12,288-token first prompt, 8
follow-up turns of 4,096 tokens, 256 output tokens per turn, the whole conversation resent each turn
(the engine does that from an agent's `prompt` and `turns`). Every prompt is unique (a header, then
random hex; the simulator counts 4 characters per token and hashes prompt blocks in a chain), so the
prefix cache only ever serves a conversation its own earlier turns.

Scenarios (both by default; `--profile` or `--cpu-offload-gib` runs one of your choosing instead):
- `qwen3.6-35b-a3b@2xh100`, no CPU tier, docs/performance.md's table: about 77 conversations fit, throughput peaks
  at 64 and collapses by 96. 192 agents; caps 16, 32, 64, 96, 192.
- `qwen3.6-35b-a3b@4xa100-40gb`, the same model on smaller GPUs with 45% of the KV cache: about 34 fit,
  the knee sits at 32. 96 agents; caps 16, 32, 48, 96.
Another profile or a CPU tier gets a queue of 2.5x the conversations that fit (GPU and CPU tier
together) and caps at 1/12, 1/6, 1/3, 1/2 and all of it. `--quick` runs the first scenario only,
with 128 agents, caps 32, 64 and 128, at 1/8 scale.

Scale. The host's work is per request and per streamed token (the simulator sends every token as an
SSE event of its own): at full size, the 13 runs of up to 192 agents would take far longer than the 5
minutes this benchmark may take. So every token count is divided by `--scale` (4): the KV cache, the CPU tier,
the prompts and the answers. The model's per-token times (a decode step, prefill, a reload) are not,
so each turn takes a quarter of the time while the conversations that fit, the batch sizes, the hit
rates and the output tokens per second stay those of full size: 64 agents at caps 32 and 64 give
2,599 and 3,246 tok/s at 1/4 scale against 2,735 and 3,291 at full size, and the first scenario is
within 4% of docs/performance.md's table where the two measure the same thing. What scaling does change: requests
arrive 4x as often, and one that arrives during a scheduler step waits for the step's end (vLLM's
scheduler also admits at step boundaries), so below the cliff the waiting gauge reads about 3x its
full-size value (a mean of 1.5-2.1 requests against 0.5-0.6 at caps 32 and 64).

Speed and clocks. Every run is at `--speed` 4 (4x real time), at which the host keeps 80-99% of the
pace. As fast as the host goes (speed 1000) the large caps give the same figures (within 0.3%), but
small ones read up to 11% low: the engine's turnaround between an agent's turns then costs simulated
time that a real server would not lose. The engine itself runs on the simulator's clock: for each
run, the `time` that the engine's modules (engine, conversation, watchdog, monitor, connections) read
`monotonic()` through (every timestamp, Auto's throughput windows included) is replaced by one that reads the simulated clock. A real server and its
client share one clock; here the simulated server slows down when the host is busy and the wall clock
does not, so on the wall clock the controller would take the host's hiccups for the server's
throughput (on a busy 2-core box, slow starts ended at 8 by noise). `--engine-clock wall` shows that,
with the pace the simulator kept. The swap is checked before the runs and after each (the run's length
by the engine's clock must be the simulator's); if the engine no longer reads its clock that way, the
script says so and uses the wall clock.

Metrics interval. `[run] metrics_interval_s` = 2 s (the engine's default) / scale / speed = 0.125 s:
the engine samples /metrics about every 0.5 simulated seconds, which is to a quarter-size turn what
the default 2 s is to a full-size one. The default itself would be a sample every 8 simulated seconds
here (200 at speed 100), several turns: Auto needs two samples per window, and would react a
conversation late. The `[stall]` deadlines are a day, so that nothing is killed.

Also: Auto starts as on a fresh install (the state dir is a temporary folder, so no probe saved for some
earlier loopback port gives it a start cap). Sequential runs the first `--sequential-agents` (4) of the
queue and its makespan is multiplied by the queue over them: the agents are alike and independent, so
one at a time is exactly linear (its throughput needs no scaling). An auto run that has not finished
after 15 s + 3x the best fixed cap's wall time is stopped and judged on what it did (its makespan
shows a "+"); a controller that never leaves cap 1 would otherwise take minutes.

Read from each run: `engine.report.to_dict()` (report.json): the totals, and `caps[endpoint]` (its
`history` of {t_s, cap, reason} and `mean_cap`); the engine's `ConcurrencyChanged` events that name
this endpoint (effective_cap, reason), recorded with the simulated time at which each came, on which
the settle target is judged; its `ServerSample`s (requests waiting); and the simulator's own counters.

Targets (issue 11, item 5): auto's throughput within 10% of the best fixed cap's; at least 1.5x the
naive "cap = every agent" and 10x sequential; auto settles (no cap change over 25% of the cap it
leaves) within the first 20% of its run; auto's preemptions at most 2x the best fixed cap's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine import connections, conversation, monitor, watchdog
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import ProfileError, SimServer, resolve

ENDPOINT = "sim"
PROFILE = "qwen3.6-35b-a3b@2xh100"
SMALL_PROFILE = "qwen3.6-35b-a3b@4xa100-40gb"
# (profile, full-size CPU tier GiB, agents, caps): the default scenarios, and --quick's
DEFAULT_SCENARIOS = ((PROFILE, 0.0, 192, (16, 32, 64, 96, 192)),
                     (SMALL_PROFILE, 0.0, 96, (16, 32, 48, 96)))
QUICK_SCENARIOS = ((PROFILE, 0.0, 128, (32, 64, 128)),)
CAP_SHARES = (1 / 12, 1 / 6, 1 / 3, 1 / 2, 1)  # of the queue, for another profile or a CPU tier
SPEED = 4.0
DEFAULT_METRICS_INTERVAL_S = 2.0  # the engine's default [run] metrics_interval_s, at full size and speed 1

THROUGHPUT_OF_BEST = 0.9  # auto's throughput at least this share of the best fixed cap's
OVER_NAIVE = 1.5  # ... and this many times the naive cap's
OVER_SEQUENTIAL = 10.0  # ... and sequential's
SETTLE_CHANGE = 0.25  # a cap change larger than this share of the cap it leaves is not settled
SETTLE_BY = 0.20  # ... and none may come after this share of the run
PREEMPTIONS_OF_BEST = 2.0


@dataclass(frozen=True)
class Shape:
    """One agent's conversation at full size, and the scale the runs divide every token count by."""

    first_tokens: int = 12288
    turn_tokens: int = 4096
    turns: int = 8
    output_tokens: int = 256
    scale: float = 4.0

    def tokens(self, full: int) -> int:
        return max(1, round(full / self.scale))

    @property
    def conversation_tokens(self) -> int:
        """The length one conversation grows to, scaled."""
        return (self.tokens(self.first_tokens) + self.turns * self.tokens(self.turn_tokens)
                + (self.turns + 1) * self.tokens(self.output_tokens))


@dataclass(frozen=True)
class Scenario:
    profile: str
    cpu_offload_gib: float  # at full size; the run's CPU tier is scaled like the KV cache
    agents: int
    caps: tuple[int, ...]  # the last is the naive cap = every agent

    @property
    def title(self) -> str:
        tier = f"a {self.cpu_offload_gib:g} GiB CPU tier" if self.cpu_offload_gib else "no CPU tier"
        return f"{self.profile}, {tier}"


@dataclass
class Run:
    """One run's figures; times on the simulator's clock unless named wall."""

    label: str
    mode: str
    cap: int
    agents: int
    completed: int
    output_tokens: int
    sim_s: float
    wall_s: float
    speed: float
    hit_rate: float  # of the prompt tokens, served from GPU memory
    cpu_hit_rate: float  # of the rest, reloaded from the CPU tier
    preemptions: int
    max_waiting: int  # the most requests waiting at the server in one of the engine's /metrics samples
    mean_waiting: float  # requests waiting at the server, looked at every 10 ms, weighted by simulated time
    samples: int  # /metrics samples the engine took
    scale_up: float = 1.0  # sequential on a subset: the makespan is multiplied by the queue over the subset
    changes: list[tuple[float, int, str]] = field(default_factory=list)  # (simulated s, cap, reason)
    report_caps: dict[str, Any] = field(default_factory=dict)  # report.json's caps[endpoint]
    stopped: str = ""  # why the run was cut short, if it was

    @property
    def makespan_s(self) -> float:
        return self.sim_s * self.scale_up

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.sim_s if self.sim_s > 0 else 0.0

    @property
    def pace(self) -> float:
        """Simulated seconds per wall second over the speed asked: 1 when the host kept up."""
        return self.sim_s / (self.wall_s * self.speed) if self.wall_s > 0 else 0.0

    def mean_cap(self) -> float | None:
        """The cap's time-weighted mean over the run, on the simulated clock; else report.json's."""
        if not self.changes or self.sim_s <= 0:
            mean = self.report_caps.get("mean_cap")
            return float(mean) if isinstance(mean, int | float) else None
        total = 0.0
        for i, (t, cap, _) in enumerate(self.changes):
            until = self.changes[i + 1][0] if i + 1 < len(self.changes) else self.sim_s
            total += cap * max(0.0, until - t)
        return total / self.sim_s

    def settle(self) -> tuple[float | None, int]:
        """When the last cap change over SETTLE_CHANGE came (simulated s; None: none), and how many changes."""
        last = None
        for (_, before, _), (t, cap, _) in itertools.pairwise(self.changes):
            if abs(cap - before) > SETTLE_CHANGE * before:
                last = t
        return last, max(0, len(self.changes) - 1)


# ---- the workload ----------------------------------------------------------------------------------
def _filler(rng: random.Random, tokens: int) -> str:
    """Text the simulator counts as `tokens` tokens (4 characters each), unique to its seed."""
    return rng.randbytes(tokens * 2).hex()


def _agents(shape: Shape, count: int) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        rng = random.Random(i)
        header = f"Agent {i}: fix issue #{1000 + i}; the repository follows.\n"
        out.append({
            "name": f"agent-{i:03d}",
            "prompt": header + _filler(rng, max(1, shape.tokens(shape.first_tokens) - len(header) // 4)),
            "turns": [_filler(rng, shape.tokens(shape.turn_tokens)) for _ in range(shape.turns)],
            "max_tokens": shape.tokens(shape.output_tokens),
            "retries": 0,
        })
    return out


def _settings(sc: Scenario, shape: Shape, speed: float) -> SimSettings:
    kv_tokens = resolve(SimSettings(profile=sc.profile)).kv_cache_tokens
    return SimSettings(profile=sc.profile, speed=speed, ttft_s=0.0, kv_cache_tokens=shape.tokens(kv_tokens),
                       cpu_offload_gib=sc.cpu_offload_gib / shape.scale)


def fits(sc: Scenario, shape: Shape) -> tuple[int, int, int]:
    """(GPU KV tokens, CPU tier tokens, conversations that fit in both), scaled."""
    spec = resolve(_settings(sc, shape, 1.0))
    cpu = spec.num_cpu_blocks * spec.block_size
    return spec.kv_cache_tokens, cpu, (spec.kv_cache_tokens + cpu) // shape.conversation_tokens


# ---- the engine on the simulator's clock -------------------------------------------------------------
class _ServerClock:
    """The engine's clock (`Engine(clock=...)`) on the simulator's: `now()` reads it, waits stay anyio's; and the
    `time` module inside the parts that still read it directly: `monotonic()` reads the same."""

    def __init__(self, sim: Any) -> None:
        self._sim = sim
        self._base = time.monotonic()  # a plausible value: the report reads a start time of 0 as "not started"

    def monotonic(self) -> float:
        return self._base + self._sim.now

    now = monotonic
    move_on_after = staticmethod(anyio.move_on_after)
    sleep = staticmethod(anyio.sleep)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


# the engine's parts that read the clock through their own module's `time` (the rest take the engine's clock)
_CLOCKED_MODULES = (connections, conversation, monitor, watchdog)


def server_clock_works() -> bool:
    """Whether the engine reads its clock through its modules' `time`, which `_engine_clock` swaps."""
    return all(getattr(module, "time", None) is time for module in _CLOCKED_MODULES)


@contextlib.contextmanager
def _engine_clock(clock: Clock) -> Iterator[None]:
    if not isinstance(clock, _ServerClock):
        yield
        return
    for module in _CLOCKED_MODULES:
        module.time = clock
    try:
        yield
    finally:
        for module in _CLOCKED_MODULES:
            module.time = time


# ---- one run -------------------------------------------------------------------------------------------
async def run_once(sc: Scenario, shape: Shape, agents: list[dict[str, Any]], *, mode: str, cap: int,
                   label: str, speed: float, metrics_interval_s: float, server_clock: bool,
                   wall_limit_s: float = math.inf) -> Run:
    """One run of `agents` in `mode` against a fresh simulator."""
    async with SimServer(_settings(sc, shape, speed)) as srv:
        sim, kv = srv.state.engine, srv.state.kv
        config = validate({
            "run": {"mode": mode, "max_concurrency": cap, "metrics_interval_s": metrics_interval_s,
                    "stream_process": "off"},
            "stall": {"first_byte_timeout_s": 86400, "idle_timeout_s": 86400},
            "endpoints": [{"name": ENDPOINT, "kind": "local", "base_url": srv.base_url, "model": srv.model,
                           "max_concurrency": max(cap, len(agents))}],
            "agents": agents,
        })
        clock = _ServerClock(sim) if server_clock else MONOTONIC
        engine = Engine(config, run_dir="", clock=clock)
        changes: list[tuple[float, int, str]] = []
        sampled = [0, 0.0]  # /metrics samples the engine took, the most requests waiting in one

        def record(event: ev.Event) -> None:
            if isinstance(event, ev.ConcurrencyChanged) and event.endpoint == ENDPOINT:
                if not changes or changes[-1][1] != event.effective_cap:
                    changes.append((sim.now, event.effective_cap, event.reason))
            elif isinstance(event, ev.ServerSample) and event.endpoint == ENDPOINT:
                sampled[0] += 1
                sampled[1] = max(sampled[1], event.waiting or 0.0)

        engine.subscribe(record)
        waiting = [0.0, 0.0, 0]  # simulated request-seconds waited, the clock at the last look, the count then
        stopped = [""]

        async def watch() -> None:
            started = time.monotonic()
            while True:
                now, count = sim.now, srv.state.waiting
                waiting[0] += waiting[2] * (now - waiting[1])
                waiting[1], waiting[2] = now, count
                if time.monotonic() - started > wall_limit_s and not stopped[0]:
                    stopped[0] = f"stopped after {wall_limit_s:.0f} s wall"
                    engine.stop(f"benchmark: {stopped[0]}")
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        started = time.monotonic()
        try:
            with _engine_clock(clock):
                await engine.run()
        finally:
            watcher.cancel()
        wall = time.monotonic() - started
        report = engine.report.to_dict()
        totals = report["totals"]
        if server_clock and abs(totals["wall_s"] - sim.now) > 0.05 * sim.now + 1.0:
            print(f"auto_mode: the run took {totals['wall_s']:.1f} s by the engine's clock and {sim.now:.1f} s "
                  "by the simulator's: the engine no longer reads only `time.monotonic` through its module, "
                  "so it was not on the simulator's clock", file=sys.stderr)
        return Run(
            label=label, mode=mode, cap=cap, agents=len(agents), completed=totals["completed"],
            output_tokens=totals["output_tokens"], sim_s=sim.now, wall_s=wall, speed=speed,
            hit_rate=kv.hits_tokens / kv.queries_tokens if kv.queries_tokens else 0.0,
            cpu_hit_rate=kv.cpu_hits_tokens / kv.cpu_queries_tokens if kv.cpu_queries_tokens else 0.0,
            preemptions=sim.preemptions_total, max_waiting=int(sampled[1]),
            mean_waiting=waiting[0] / sim.now if sim.now > 0 else 0.0, samples=sampled[0],
            changes=changes, report_caps=(report.get("caps") or {}).get(ENDPOINT) or {}, stopped=stopped[0],
        )


def _progress(r: Run) -> None:
    done = f"{r.completed}/{r.agents} done" + (f", {r.stopped}" if r.stopped else "")
    print(f"    {r.label:<22} {r.tokens_per_s:6,.0f} output tok/s, makespan {r.makespan_s:6.1f} s "
          f"({r.sim_s:.1f} s simulated in {r.wall_s:.1f} s wall, pace {r.pace:.0%}); hits {r.hit_rate:.0%}"
          + (f" + {r.cpu_hit_rate:.0%} CPU" if r.cpu_hit_rate else "") + ", "
          f"preemptions {r.preemptions}, waiting {r.mean_waiting:.1f} mean {r.max_waiting} max; {done}",
          file=sys.stderr, flush=True)


@dataclass
class Outcome:
    """A scenario's runs."""

    scenario: Scenario
    fit: int
    kv_tokens: int
    cpu_tokens: int
    sequential: Run
    fixed: list[Run]
    auto: Run
    server_clock: bool

    @property
    def best(self) -> Run:
        return max(self.fixed, key=lambda r: r.tokens_per_s)

    @property
    def naive(self) -> Run:
        return self.fixed[-1]


async def run_scenario(sc: Scenario, shape: Shape, args: argparse.Namespace) -> Outcome:
    kv_tokens, cpu_tokens, fit = fits(sc, shape)
    if fit < 1:
        raise ProfileError(f"{sc.profile}: not one conversation of {shape.conversation_tokens * shape.scale:,.0f} "
                           f"tokens fits in its KV cache of {kv_tokens * shape.scale:,.0f}")
    print(f"  {sc.title}: {sc.agents} agents, about {fit} conversations fit", file=sys.stderr, flush=True)
    agents = _agents(shape, sc.agents)
    common = {"speed": args.speed, "metrics_interval_s": args.metrics_interval_s,
              "server_clock": args.engine_clock == "server"}
    subset = min(sc.agents, args.sequential_agents)
    seq = await run_once(sc, shape, agents[:subset], mode="sequential", cap=1,
                         label=f"sequential ({subset} agents)", **common)
    seq.scale_up = sc.agents / subset
    _progress(seq)
    fixed = []
    for cap in sc.caps:
        fixed.append(await run_once(sc, shape, agents, mode="parallel", cap=cap, label=f"cap {cap}",
                                    **common))
        _progress(fixed[-1])
    best = max(fixed, key=lambda r: r.tokens_per_s)
    # a controller that never leaves a low cap would take minutes: stop it at a few times what the best
    # fixed cap needs, and judge what it did until then
    limit = args.auto_wall_limit_s or 15.0 + 3.0 * best.wall_s
    auto = await run_once(sc, shape, agents, mode="auto", cap=sc.agents, label="auto", wall_limit_s=limit,
                          **common)
    _progress(auto)
    return Outcome(sc, fit, kv_tokens, cpu_tokens, seq, fixed, auto, common["server_clock"])


# ---- the report --------------------------------------------------------------------------------------
def _table(o: Outcome) -> str:
    head = ["run", "cap", "makespan (sim s)", "output tok/s", "prefix hits", "preemptions", "waiting: mean",
            "max", "agents done"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in [o.sequential, *o.fixed, o.auto]:
        if r.mode == "sequential":
            name, cap = f"sequential ({r.agents} agents, makespan x{r.scale_up:g})", "1"
        elif r.mode == "auto":
            mean = r.mean_cap()
            name = "auto" + (f" ({r.stopped})" if r.stopped else "")
            cap = f"mean {mean:.1f}" if mean is not None else "?"
        else:
            name, cap = "parallel" + (" (cap = every agent)" if r is o.naive else ""), str(r.cap)
        hits = f"{r.hit_rate:.0%}" + (f" + {r.cpu_hit_rate:.0%} CPU" if o.cpu_tokens else "")
        rows.append("| " + " | ".join([
            name, cap, f"{r.makespan_s:,.1f}" + ("+" if r.stopped else ""), f"{r.tokens_per_s:,.0f}",
            hits, str(r.preemptions), f"{r.mean_waiting:.1f}", str(r.max_waiting),
            f"{r.completed}/{r.agents}"]) + " |")
    return "\n".join(rows)


def _cap_history(r: Run, limit: int = 24) -> str:
    if len(r.changes) <= 1:
        return "no cap changes" + (f" (it stayed at {r.changes[0][1]})" if r.changes else "")
    shown: list[tuple[float, int, str] | None] = list(r.changes)
    if len(shown) > limit:
        shown = shown[:limit - 6] + [None] + shown[-5:]
    lines = []
    for change in shown:
        if change is None:
            lines.append(f"- ... {len(r.changes) - limit + 1} more")
        else:
            t, cap, reason = change
            lines.append(f"- {t:6.1f} s ({t / r.sim_s if r.sim_s else 0:4.0%}): {cap:>4}  {reason}")
    return "\n".join(lines)


def _targets(o: Outcome) -> list[tuple[bool, str]]:
    auto, seq, best, naive = o.auto, o.sequential, o.best, o.naive
    a = auto.tokens_per_s

    def over(base: Run) -> float:
        return a / base.tokens_per_s if base.tokens_per_s else 0.0

    def out_of_reach(factor: float, base: Run) -> str:
        best_over = best.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
        return f"; no fixed cap meets it: the best is {best_over:.1f}x" if best_over < factor else ""

    out = [
        (over(best) >= THROUGHPUT_OF_BEST,
         f"auto's throughput within {1 - THROUGHPUT_OF_BEST:.0%} of the best fixed cap's ({best.cap}): "
         f"{a:,.0f} against {best.tokens_per_s:,.0f} output tok/s ({over(best) - 1:+.0%})"),
        (over(naive) >= OVER_NAIVE,
         f"auto at least {OVER_NAIVE:g}x the naive cap = every agent ({naive.cap}): {a:,.0f} against "
         f"{naive.tokens_per_s:,.0f} output tok/s ({over(naive):.2f}x{out_of_reach(OVER_NAIVE, naive)})"),
        (over(seq) >= OVER_SEQUENTIAL,
         f"auto at least {OVER_SEQUENTIAL:g}x sequential: {a:,.0f} against {seq.tokens_per_s:,.0f} output "
         f"tok/s ({over(seq):.1f}x{out_of_reach(OVER_SEQUENTIAL, seq)})"),
    ]
    last, count = auto.settle()
    settle = (f"auto settles (no cap change over {SETTLE_CHANGE:.0%}) within the first {SETTLE_BY:.0%} "
              "of its run: ")
    if count == 0:
        stayed = f" (it stayed at {auto.changes[0][1]})" if auto.changes else ""
        out.append((True, settle + f"vacuously, no cap changes{stayed}"))
    elif last is None:
        out.append((True, settle + f"{count} cap changes, none over {SETTLE_CHANGE:.0%}"))
    else:
        share = last / auto.sim_s if auto.sim_s else 1.0
        out.append((share <= SETTLE_BY, settle + f"the last came at {last:,.1f} of {auto.sim_s:,.1f} "
                                                 f"simulated s ({share:.0%}; {count} changes in all)"))
    most = PREEMPTIONS_OF_BEST * best.preemptions
    out.append((auto.preemptions <= most,
                f"auto's preemptions at most {PREEMPTIONS_OF_BEST:g}x the best fixed cap's: "
                f"{auto.preemptions} against {best.preemptions} (at most {most:g})"))
    return out


def _print_outcome(o: Outcome, shape: Shape) -> list[bool]:
    sc, auto = o.scenario, o.auto
    cpu = f" and a {o.cpu_tokens:,}-token CPU tier" if o.cpu_tokens else ""
    print(f"\n### {sc.title}: {sc.agents} agents\n")
    print(f"KV cache {o.kv_tokens:,} tokens{cpu} (1/{shape.scale:g} scale): about {o.fit} conversations of "
          f"{shape.conversation_tokens:,} tokens fit. Best fixed cap: {o.best.cap}.\n")
    print(_table(o))
    clock = ("on the simulator's clock" if o.server_clock else
             f"on the wall clock, the simulator at {auto.pace:.0%} of its speed"
             + (" (under 90%: the host fell behind, which Auto took for the server)"
                if auto.pace < 0.9 else ""))
    sample_s = auto.sim_s / auto.samples if auto.samples else 0.0
    history = auto.report_caps.get("history")
    from_report = (f"; report.json: {len(history)} caps, mean {auto.report_caps.get('mean_cap')}"
                   if isinstance(history, list) else "; report.json has no caps")
    print(f"\nAuto: the engine {clock}; a /metrics sample every {sample_s:.2f} simulated s{from_report}. "
          "Its caps (simulated s, share of its run, cap, reason):\n")
    print(_cap_history(auto))
    print()
    met = []
    for ok, text in _targets(o):
        met.append(ok)
        print(f"- {'MET' if ok else 'MISSED'}: {text}")
    return met


# ---- the command ---------------------------------------------------------------------------------------
def _scenarios(args: argparse.Namespace, shape: Shape) -> list[Scenario]:
    if args.profile or args.cpu_offload_gib:
        chosen: tuple[tuple[str, float, int, tuple[int, ...]], ...] = (
            (args.profile or PROFILE, args.cpu_offload_gib, 0, ()),)
    else:
        chosen = QUICK_SCENARIOS if args.quick else DEFAULT_SCENARIOS
    out = []
    for profile, gib, agents, caps in chosen:
        if args.agents:
            agents, caps = args.agents, ()
        if not agents:  # 2.5x the conversations that fit, in steps of 12
            fit = fits(Scenario(profile, gib, 1, (1,)), shape)[2]
            agents = max(12, 12 * round(2.5 * fit / 12))
        if args.caps:
            caps = tuple(int(c) for c in args.caps.split(","))
        elif not caps:
            caps = tuple(max(1, round(agents * share)) for share in CAP_SHARES)
        chosen_caps = {min(c, agents) for c in caps} | {agents}  # the naive cap = every agent comes last
        out.append(Scenario(profile, gib, agents, tuple(sorted(chosen_caps))))
    return out


async def main_async(args: argparse.Namespace) -> int:
    shape = Shape(scale=args.scale)
    started = time.monotonic()
    outcomes = [await run_scenario(sc, shape, args) for sc in _scenarios(args, shape)]
    took = time.monotonic() - started
    print(f"## Auto mode against sequential and fixed caps (simulated clock; took {took:.0f} s)\n")
    print(f"Agents of a {shape.first_tokens:,}-token first prompt, {shape.turns} follow-up turns of "
          f"{shape.turn_tokens:,} tokens and {shape.output_tokens} output tokens per turn, the conversation "
          f"resent each turn, at 1/{shape.scale:g} scale (KV cache, CPU tier, prompts and answers divided by "
          f"{shape.scale:g}; the tokens per second are those of full size). Simulator speed {args.speed:g}, "
          f"[run] metrics_interval_s {args.metrics_interval_s:g}.")
    met = []
    for o in outcomes:
        met += _print_outcome(o, shape)
    print(f"\n{sum(met)} of {len(met)} targets met.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the first scenario only, 128 agents, caps 32, 64, 128, at 1/8 scale")
    parser.add_argument("--profile", default="",
                        help=f"run one scenario on this simulator profile (default {PROFILE})")
    parser.add_argument("--cpu-offload-gib", type=float, default=0.0,
                        help="that scenario's CPU KV tier at full size, GiB (scaled like the KV cache)")
    parser.add_argument("--agents", type=int, default=0, help="agents in the queue (default: per scenario)")
    parser.add_argument("--caps", default="", help="fixed caps, comma separated (default: per scenario)")
    parser.add_argument("--scale", type=float, default=0.0,
                        help="divide every token count by this (default 4; 8 with --quick)")
    parser.add_argument("--speed", type=float, default=SPEED,
                        help=f"simulator speed of every run (default {SPEED:g})")
    parser.add_argument("--metrics-interval-s", type=float, default=0.0,
                        help="[run] metrics_interval_s of every run (default: 2 s / scale / speed)")
    parser.add_argument("--engine-clock", choices=("server", "wall"), default="server",
                        help="the clock the engine (and so Auto) reads: the simulator's (default) or the wall")
    parser.add_argument("--sequential-agents", type=int, default=4,
                        help="agents the sequential run takes from the queue (default 4)")
    parser.add_argument("--auto-wall-limit-s", type=float, default=0.0,
                        help="stop the auto run after this long (default: 15 s + 3x the best fixed cap's)")
    args = parser.parse_args(argv)
    if not args.scale:
        args.scale = 8.0 if args.quick else 4.0
    if not args.metrics_interval_s:
        args.metrics_interval_s = round(DEFAULT_METRICS_INTERVAL_S / args.scale / args.speed, 4)
    if args.engine_clock == "server" and not server_clock_works():
        print("auto_mode: the engine's modules no longer read their clock through their module's `time`: "
              "the engine runs on the wall clock (update _engine_clock)", file=sys.stderr)
        args.engine_clock = "wall"
    # auto starts as on a fresh install: no probe recommendation saved for some earlier loopback port
    with tempfile.TemporaryDirectory(prefix="cerevisor-bench-state-") as state_dir:
        os.environ["XDG_STATE_HOME"] = state_dir
        try:
            return asyncio.run(main_async(args))
        except ProfileError as exc:
            print(f"auto_mode: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
