"""The seed's two failures, measured on agent traffic (issue 31 item 4, with item 5's knee and admission figures).

The `agentx` replay (each session's first turns and the subagents they spawn: study_calibration.window) goes
through a gateway of a run of its own (`replay run --through-gateway`) to the simulated box `agentx-slice` (a
sixteenth of the AgentX box, whose knee a 2-core replay can reach; sim/presets.py), on a sped-up clock. Every
time is the simulator's own (BatchEngine.clock_s), so a host that cannot keep pace slows the run, not the figures:
the replay's turns and gaps, and the run's own timers (a session's release, Auto's windows, the monitor's interval),
which run on the simulator's clock over the speed (engine/clock.py PacedClock) rather than on the wall.

(a) Sequential (direct, one session at a time) against Auto and a sweep of fixed caps through the gateway: goodput
    (turns meeting the SLO, 50 tokens/s per user and a TTFT of 30 s past a session's first turn, per minute of the
    makespan) and makespan. The knee is the fixed cap of the best goodput; Auto's settled cap is its last. Auto
    runs with the SLO's interactivity as its floor (`replay --through-gateway --mode auto` sets it), which it reads
    from the simulator's inter-token histogram, on the simulator's clock. Admission: the prefix-hit rate through
    the gateway against the same file replayed directly one session at a time (each session alone on the server).
    Targets: Auto within 10% of the best fixed cap's goodput and at least 5x Sequential's; Auto's cap within one
    step of the knee; hits through the gateway at least 95% of those alone.

    Each session's first 8 turns, also with --quick (which takes fewer sessions and caps): AgentX's sessions run a
    median of 43 turns, one cold first prompt (50K-300K tokens, compute-bound, which no concurrency speeds up) to
    42 warm ones. A 4-turn window made a quarter of the turns cold first prompts, so every cap's goodput was
    mostly the first prompts' (the best fixed cap reached 4.0x Sequential at 4 turns, 7.3x at 8).
    8 is as far as a few minutes on 2 cores go; the real traffic's ratio of warm to cold turns is higher still.
(b) A fresh box: `--cold-start-s` of zero output (/health says loading, requests wait), then an empty prefix cache
    that every session's first prompt must fill (the warm-up). The same sessions under one generic 10-minute
    zero-output timer (first byte = idle = 600 s, no prefill progress, no busy extension: what harnesses do)
    and under the run's two deadlines (first byte 1800 s for a local server, idle 600 s) with prefill progress
    and the busy-server extension. Deadlines are the run's seconds: here divided by the speed, so that they mean
    simulated seconds. Targets: the generic timer's kills counted, the two deadlines' kills 0.

    python benchmarks/seed.py            # 48 sessions x 8 turns, caps 8 to 48: about 6 minutes on 2 cores, quiet
    python benchmarks/seed.py --quick    # 32 sessions x 8 turns, caps 8 to 32: 4 to 6 minutes on 2 cores
    python benchmarks/seed.py --json     # the figures as one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from study_calibration import window

from cerevisor_tui.commands.replay import through_gateway
from cerevisor_tui.config import SimSettings
from cerevisor_tui.engine.clock import PacedClock
from cerevisor_tui.replay.generate import generate
from cerevisor_tui.replay.run import ReplayReport, ReplaySettings, replay
from cerevisor_tui.replay.trace import TraceTurn
from cerevisor_tui.sim import SimServer

PROFILE = "agentx-slice"
AUTO_WITHIN = 0.10  # of the best fixed cap's goodput
AUTO_OVER_SEQUENTIAL = 5.0
HITS_KEPT = 0.95
GENERIC_TIMER_S = 600.0


@dataclass
class Row:
    label: str
    cap: int
    goodput_per_min: float
    goodput_share: float
    makespan_s: float
    turns_completed: int
    turns: int
    prefix_hit_rate: float | None
    kills: int
    sessions_killed: int
    settled_cap: int | None
    wall_s: float
    interactivity_p50: float | None  # output tokens/s per user, the median turn's
    first_error: str = ""
    caps: list[str] = field(default_factory=list)  # Auto's changes: "simulated s: cap (reason)"

    def line(self) -> str:
        hits = "-" if self.prefix_hit_rate is None else f"{self.prefix_hit_rate:.1%}"
        rate = "-" if self.interactivity_p50 is None else f"{self.interactivity_p50:.0f}"
        settled = "" if self.settled_cap is None else f"  settled at {self.settled_cap}"
        failed = f"\n    first failure: {self.first_error}" if self.first_error else ""
        failed += "".join(f"\n    {change}" for change in self.caps)
        return (f"  {self.label:12} {self.goodput_per_min:7.1f} good turns/min  {self.goodput_share:4.0%} met  "
                f"makespan {self.makespan_s:7.0f} s  {self.turns_completed:4}/{self.turns} turns  {rate:>4} tok/s p50  "
                f"hits {hits}  "
                f"kills {self.kills}{settled}  ({self.wall_s:.0f} s wall){failed}")


def _row(label: str, cap: int, report: ReplayReport, wall_s: float, speed: float = 1.0) -> Row:
    """A replay's figures; Auto's cap changes at the simulator's seconds (the run's clock times `speed`)."""
    caps = [c["cap"] for c in report.caps if c["cap"]]
    return Row(label, cap, report.goodput["turns_per_min"] or 0.0, report.goodput["share"] or 0.0,
               report.makespan_s, report.turns_completed, report.turns, report.prefix_hit_rate, len(report.kills),
               len({k["session"] for k in report.kills}), caps[-1] if label == "auto" and caps else None, wall_s,
               report.interactivity["p50_tokens_per_s"], report.first_error,
               [f"{c['t_s'] * speed:.0f} s: {c['cap']} ({c['reason']})" for c in report.caps] if label == "auto" else [])


def _scaled_stall(speed: float, **stall: float | bool) -> dict[str, Any]:
    """The run's deadlines in simulated seconds: each divided by the speed (the run's clock is the simulator's over
    the speed: gateway_run)."""
    return {key: value / speed if isinstance(value, float) else value for key, value in stall.items()}


async def gateway_run(turns: list[TraceTurn], mode: str, cap: int, speed: float, *, cold_start_s: float = 0.0,
                      stall: dict[str, Any] | None = None, endpoint: dict[str, Any] | None = None,
                      label: str = "") -> Row:
    """One replay through a run's gateway, against a fresh simulator."""
    sections: dict[str, Any] = {"run": {"metrics_interval_s": max(0.05, 2.0 / speed)},
                                "stall": stall or _scaled_stall(speed, wedge_timeout_s=45.0)}
    async with SimServer(SimSettings(profile=PROFILE, speed=speed, cold_start_s=cold_start_s)) as sim:
        started = time.monotonic()
        # the run's timers (a session's release, Auto's windows, the monitor's looks) on the simulator's clock, in
        # its seconds over the speed: the wall's while the host keeps pace, and as slow as the simulator when not
        clock = PacedClock(sim.state.engine.clock_s, speed)
        report = await through_gateway(turns, sim.base_url, ReplaySettings(speed=speed, clock=sim.state.engine.clock_s,
                                                                                 clock_sped_up=True),
                                       mode, cap, sections=sections, endpoint=endpoint or {},  # type: ignore[arg-type]
                                       clock=clock)
        return _row(label or f"{mode} {cap}", cap, report, time.monotonic() - started, speed)


async def sequential(turns: list[TraceTurn], speed: float) -> Row:
    """The file replayed directly, one session at a time (a subagent within its parent's): Sequential as the seed
    ran it, and each session alone on the server. Not through the gateway: there a session's slot is released
    only after a quiet spell (the gateway's release_after_s: it cannot know a harness is done), which one slot
    would pay after every session and make Sequential look worse than it is."""
    async with SimServer(SimSettings(profile=PROFILE, speed=speed)) as sim:
        started = time.monotonic()
        report = await replay(turns, sim.base_url, ReplaySettings(concurrency=1, speed=speed,
                                                                  clock=sim.state.engine.clock_s, clock_sped_up=True))
        return _row("sequential", 1, report, time.monotonic() - started)


def one_step(cap: int, knee: int, grid: list[int]) -> bool:
    """Whether `cap` lies within one step of the grid from `knee` (between its neighbours)."""
    at = grid.index(knee)
    return grid[max(0, at - 1)] <= cap <= grid[min(len(grid) - 1, at + 1)]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 sessions and fewer caps")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--sessions", type=int, default=0, help="agentx sessions (default 48; --quick 32)")
    parser.add_argument("--turns", type=int, default=8, help="turns of each session (default 8)")
    parser.add_argument("--speed", type=float, default=50.0, help="simulator clock speed (default 50)")
    parser.add_argument("--cold-start-s", type=float, default=590.0,
                        help="(b): simulated seconds of zero output before the box serves (default 590: the first prompts' prefills then end past the generic timer's 600 s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip", choices=("a", "b"), help="leave one part out")
    args = parser.parse_args()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    sessions = args.sessions or (32 if args.quick else 48)
    per_session = args.turns
    grid = [8, 16, 24, 32] if args.quick else [8, 16, 24, 32, 48]
    turns = window(generate("agentx", sessions=sessions, seed=args.seed), per_session)
    out: dict[str, Any] = {"profile": PROFILE, "sessions": sessions, "turns_per_session": per_session,
                           "turns": len(turns), "speed": args.speed}
    log(f"agentx: {sessions} sessions x their first {per_session} turns ({len(turns)} turns with subagents) "
        f"against --sim {PROFILE} at speed {args.speed:g}")
    if args.skip != "a":
        log("(a) goodput: Sequential, fixed caps, Auto")
        rows = [await sequential(turns, args.speed)]
        log(rows[0].line())
        for mode, cap in [*(("parallel", c) for c in grid), ("auto", sessions)]:
            row = await gateway_run(turns, mode, cap, args.speed, label="auto" if mode == "auto" else "")
            rows.append(row)
            log(row.line())
        one, fixed, auto = rows[0], rows[1:-1], rows[-1]
        best = max(fixed, key=lambda r: r.goodput_per_min)
        hits_alone = one.prefix_hit_rate
        through = [r.prefix_hit_rate for r in (auto, best) if r.prefix_hit_rate is not None]
        kept = min(through) / hits_alone if through and hits_alone else None
        out.update(goodput_sequential=one.goodput_per_min, goodput_auto=auto.goodput_per_min,
                   goodput_best_fixed=best.goodput_per_min, best_fixed_cap=best.cap, knee_cap=best.cap,
                   auto_settled_cap=auto.settled_cap, auto_within_one_step=(
                       auto.settled_cap is not None and one_step(auto.settled_cap, best.cap, grid)),
                   makespan_sequential_s=one.makespan_s, makespan_auto_s=auto.makespan_s,
                   makespan_best_fixed_s=best.makespan_s, prefix_hit_rate_alone=hits_alone,
                   prefix_hit_rate_kept=kept, runs=[vars(r) for r in rows])
    if args.skip != "b":
        first_turns = window(generate("agentx", sessions=sessions, seed=args.seed), 2)
        log(f"(b) a fresh box: {args.cold_start_s:g} s of cold start, then an empty prefix cache; each session's "
            f"first 2 turns ({len(first_turns)} turns), every session at once")
        generic = await gateway_run(
            first_turns, "parallel", sessions, args.speed, cold_start_s=args.cold_start_s, label="generic timer",
            stall=_scaled_stall(args.speed, first_byte_timeout_s=GENERIC_TIMER_S, idle_timeout_s=GENERIC_TIMER_S,
                                extend_when_server_busy=False, wedge_timeout_s=0.0, preempt_limit=0),
            endpoint={"prompt_progress": "off"})
        log(generic.line())
        two = await gateway_run(
            first_turns, "parallel", sessions, args.speed, cold_start_s=args.cold_start_s, label="two deadlines",
            stall=_scaled_stall(args.speed, first_byte_timeout_s=1800.0, idle_timeout_s=600.0, extend_s=300.0,
                                wedge_timeout_s=45.0), endpoint={"prompt_progress": "on"})
        log(two.line())
        out.update(kills_generic_timer=generic.kills, kills_two_deadlines=two.kills,
                   sessions_killed_generic_timer=generic.sessions_killed, cold_start_s=args.cold_start_s,
                   cold_runs=[vars(generic), vars(two)])
    if args.json:
        print(json.dumps(out))
        return 0
    _print_targets(out)
    return 0


def _print_targets(out: dict[str, Any]) -> None:
    print("\n| figure | measured | target | met |")
    print("|---|---|---|---|")
    if "goodput_auto" in out:
        auto, best, seq = out["goodput_auto"], out["goodput_best_fixed"], out["goodput_sequential"]
        print(f"| goodput, good turns per simulated minute: Sequential / Auto / best fixed (cap {out['best_fixed_cap']}) "
              f"| {seq:.1f} / {auto:.1f} / {best:.1f} | | |")
        print(f"| Auto against the best fixed cap | {auto / best:.0%} | ≥ {1 - AUTO_WITHIN:.0%} | "
              f"{'yes' if auto >= (1 - AUTO_WITHIN) * best else 'NO'} |")
        ratio = auto / seq if seq else float("inf")
        print(f"| Auto against Sequential | {ratio:.1f}x | ≥ {AUTO_OVER_SEQUENTIAL:g}x | "
              f"{'yes' if ratio >= AUTO_OVER_SEQUENTIAL else 'NO'} |")
        print(f"| makespan, simulated s: Sequential / Auto / best fixed | {out['makespan_sequential_s']:.0f} / "
              f"{out['makespan_auto_s']:.0f} / {out['makespan_best_fixed_s']:.0f} | | |")
        print(f"| Auto's settled cap against the knee of goodput | {out['auto_settled_cap']} / {out['knee_cap']} | "
              f"within one step | {'yes' if out['auto_within_one_step'] else 'NO'} |")
        kept = out["prefix_hit_rate_kept"]
        print(f"| prefix hits through the gateway over each session alone | {'-' if kept is None else f'{kept:.1%}'} "
              f"| ≥ {HITS_KEPT:.0%} | {'yes' if kept is not None and kept >= HITS_KEPT else 'NO'} |")
    if "kills_generic_timer" in out:
        print(f"| honest sessions killed, generic 10-minute timer | {out['sessions_killed_generic_timer']} "
              f"({out['kills_generic_timer']} kills) | counted | yes |")
        print(f"| kills, two deadlines with prefill progress and the busy extension | {out['kills_two_deadlines']} "
              f"| 0 | {'yes' if out['kills_two_deadlines'] == 0 else 'NO'} |")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
