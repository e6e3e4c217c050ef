"""The run itself at agent scale (issue 31 item 7): 256 `agentx` sessions through a gateway with a consumer attached.

Three processes, as an operator runs them: the simulator (`cerevisor-tui sim --profile agentx-12xgb300`, sped up),
the gateway's run (`cerevisor-tui gateway --detach`, parallel, cap 256) and an attached consumer
(`cerevisor-tui attach RUN_DIR --jsonl`, what the console is fed: the same control socket and events). This
process replays the sessions into the gateway. Each session is an `agentx` session taken from its turn
`--from-turn` on (its whole prompt there sent as its first, about 140K tokens: a ~560 KB request body), for
`--turns` turns; sessions shorter than that are skipped.

Measured: the gateway run's resident memory (before, peak, after; its growth per session), its CPU per request
(user + system time of its process over the replay, over the requests it forwarded), the simulator's CPU per
request beside it, and the attached consumer's event delay (the time a line reached it minus the event's own
time: both are this host's CLOCK_MONOTONIC) and the bytes it was sent. The console's key latency under a
256-agent load is console_load.py's figure (the same control socket); here the consumer is headless.

    python benchmarks/seed_scale.py                   # 256 sessions x 2 turns at speed 20 (7 minutes at load 17)
    python benchmarks/seed_scale.py --sessions 64 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cerevisor_tui.endpoints.probe import percentile
from cerevisor_tui.replay.generate import generate
from cerevisor_tui.replay.run import ReplaySettings, replay
from cerevisor_tui.replay.trace import TraceTurn, whole_prompts

CLI = [sys.executable, "-m", "cerevisor_tui"]
TICKS_S = os.sysconf("SC_CLK_TCK")


def from_turn(turns: list[TraceTurn], first: int, count: int, sessions: int) -> list[TraceTurn]:
    """`sessions` top-level sessions from their turn `first` on, for `count` turns: that turn's whole prompt as
    the new first turn's input, the rest as they were (subagents left out)."""
    kept: dict[str, list[TraceTurn]] = {}
    for turn, whole in whole_prompts(turns):
        if turn.parent is not None or not first <= turn.turn < first + count:
            continue
        number = turn.turn - first + 1
        kept.setdefault(turn.session_id, []).append(TraceTurn(
            session_id=turn.session_id, turn=number, input_length=whole if number == 1 else turn.input_length,
            output_length=turn.output_length, hash_ids=turn.hash_ids, delay_ms=0.0 if number == 1 else turn.delay_ms,
            parent=None))
    whole_sessions = [rows for rows in kept.values() if len(rows) == count][:sessions]
    return [turn for rows in whole_sessions for turn in rows]


def _proc(pid: int) -> tuple[float, float, float]:
    """(RSS MiB, peak RSS MiB, CPU seconds) of a process."""
    rss = peak = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss, peak, (int(fields[11]) + int(fields[12])) / TICKS_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Consumer:
    """`attach RUN_DIR --jsonl`, its lines timed as they arrive."""

    def __init__(self, run_dir: Path) -> None:
        self.proc = subprocess.Popen([*CLI, "attach", str(run_dir), "--jsonl"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.delays_s: list[float] = []  # of the events the run emitted after `since` (not the journal's past)
        self.since = math.inf
        self.bytes = 0
        self.events = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            self.bytes += len(line)
            self.events += 1
            head = line[:200]  # every event starts with its type and time: no need to parse a 560 KB line
            at = head.find(b'"t":')
            if at >= 0:
                try:
                    t = float(head[at + 4:].split(b",", 1)[0].split(b"}", 1)[0])
                except ValueError:
                    continue
                if t >= self.since:
                    self.delays_s.append(now - t)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    turns = from_turn(generate("agentx", sessions=args.sessions * 2, seed=args.seed), args.from_turn, args.turns,
                      args.sessions)
    sessions = len({t.session_id for t in turns})
    body_kb = [whole * 4 / 1000 for _, whole in whole_prompts(turns)]
    sim = subprocess.Popen([*CLI, "sim", "--port", "0", "--profile", "agentx-12xgb300", "--speed", str(args.speed)],
                           stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert sim.stderr is not None
    sim_url = next((line.split(" on ", 1)[1].split(" ", 1)[0] for line in sim.stderr if " on http" in line), "")
    threading.Thread(target=sim.stderr.read, daemon=True).start()
    run_dir = Path(tempfile.mkdtemp(prefix="seed-scale-")) / "run"
    port = _free_port()
    started = subprocess.run([*CLI, "gateway", "--upstream", sim_url, "--mode", "parallel", "--concurrency",
                              str(sessions), "--listen", f"127.0.0.1:{port}", "--run-dir", str(run_dir), "--detach"],
                             capture_output=True, text=True, timeout=60)
    gateway_pid = int(started.stdout.split("(process ", 1)[1].split(",", 1)[0])
    try:
        consumer = Consumer(run_dir)
        rss_before, _, cpu_before = _proc(gateway_pid)
        _, _, sim_cpu_before = _proc(sim.pid)
        samples: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                samples.append(_proc(gateway_pid)[0])

        threading.Thread(target=sample, daemon=True).start()
        wall = consumer.since = time.monotonic()
        report = await replay(turns, f"http://127.0.0.1:{port}/v1",
                              ReplaySettings(concurrency=sessions, speed=args.speed, metrics_url=sim_url))
        wall_s = time.monotonic() - wall
        done.set()
        rss_after, rss_peak, cpu_after = _proc(gateway_pid)
        _, _, sim_cpu_after = _proc(sim.pid)
    finally:
        subprocess.run([*CLI, "stop", str(run_dir)], capture_output=True, timeout=60)
        sim.terminate()
        sim.wait(10)
    consumer.proc.wait(30)
    consumer.thread.join(10)
    requests = report.turns_completed + report.turns_failed
    return {
        "sessions": sessions, "turns": len(turns), "turns_completed": report.turns_completed,
        "body_kb_median": percentile(body_kb, 50), "body_kb_max": max(body_kb), "speed": args.speed,
        "wall_s": wall_s, "gateway_rss_before_mib": rss_before, "gateway_rss_peak_mib": rss_peak,
        "gateway_rss_after_mib": rss_after, "gateway_rss_sampled_max_mib": max(samples, default=rss_after),
        "gateway_rss_growth_per_session_mib": (rss_after - rss_before) / sessions,
        "gateway_cpu_ms_per_request": (cpu_after - cpu_before) * 1000 / max(1, requests),
        "sim_cpu_ms_per_request": (sim_cpu_after - sim_cpu_before) * 1000 / max(1, requests),
        "consumer_events": consumer.events, "consumer_mib": consumer.bytes / 2**20,
        "consumer_delay_p50_s": percentile(consumer.delays_s, 50),
        "consumer_delay_p95_s": percentile(consumer.delays_s, 95), "consumer_delay_max_s": max(consumer.delays_s,
                                                                                               default=None),
        "prefix_hit_rate": report.prefix_hit_rate, "first_error": report.first_error,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=2, help="turns of each session (default 2)")
    parser.add_argument("--from-turn", type=int, default=20, help="where each session is taken from (default 20)")
    parser.add_argument("--speed", type=float, default=20.0, help="simulator clock speed (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    figures = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(figures))
        return 0
    f = figures
    print(f"{f['sessions']} agentx sessions x {args.turns} turns through the gateway, bodies median "
          f"{f['body_kb_median']:.0f} KB (max {f['body_kb_max']:.0f}), {f['turns_completed']}/{f['turns']} turns "
          f"in {f['wall_s']:.0f} s wall at speed {f['speed']:g}")
    print(f"gateway run RSS: {f['gateway_rss_before_mib']:.0f} MiB before, peak {f['gateway_rss_peak_mib']:.0f}, "
          f"after {f['gateway_rss_after_mib']:.0f} ({f['gateway_rss_growth_per_session_mib'] * 1024:.0f} KiB a "
          "session kept)")
    print(f"CPU per request: gateway {f['gateway_cpu_ms_per_request']:.1f} ms, simulator "
          f"{f['sim_cpu_ms_per_request']:.1f} ms")
    print(f"attached consumer: {f['consumer_events']:,} events, {f['consumer_mib']:.0f} MiB; delay p50 "
          f"{f['consumer_delay_p50_s']:.3f} s, p95 {f['consumer_delay_p95_s']:.3f} s, max {f['consumer_delay_max_s']:.3f} s")
    if f["first_error"]:
        print(f"{f['turns'] - f['turns_completed']} turns failed; the first: {f['first_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
