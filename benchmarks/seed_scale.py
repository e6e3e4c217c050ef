"""The run itself at agent scale (issue 31 item 7): 256 `agentx` sessions through a gateway with a consumer attached.

Four processes, as an operator runs them: the simulator (`cerevisor-tui sim --profile agentx-12xgb300`, sped up),
the gateway's run (`cerevisor-tui gateway --detach`, parallel, cap 256), an attached consumer
(`cerevisor-tui attach RUN_DIR --jsonl`, what the console is fed: the same control socket and events) and the
console itself (the Textual app, headless under its pilot, attached to the run's control socket as
`cerevisor-tui attach RUN_DIR` opens it, in a process of its own). This process replays the sessions into the
gateway; with --as-agents the run is `replay run --as-agents` instead, which sends them as its own agents. Each
session is an `agentx` session taken from its turn `--from-turn` on (its whole prompt there sent as its first,
about 140K tokens: a ~560 KB request body), for `--turns` turns; sessions shorter than that are skipped.

Measured: the run's resident memory (before, peak, after; its growth per session), its CPU per request
(user + system time of its process over the replay, over the requests it forwarded), the simulator's CPU per
request beside it, the attached consumer's event delay (the time a line reached it minus the event's own
time: both are this host's CLOCK_MONOTONIC) and the bytes it was sent, and the console's key-press-to-screen
latency while the sessions run: a `down` (or `up` at the table's last row) every --press-every-s, from the
press to the first frame whose session table shows the cursor on the row it moved to (console_load.py's
measure, here with the sessions as the rows), and what the console said meanwhile (a run that let it go).

    python benchmarks/seed_scale.py                   # 256 sessions x 2 turns at speed 20 (7 minutes at load 17)
    python benchmarks/seed_scale.py --sessions 64 --json
    python benchmarks/seed_scale.py --as-agents       # the same load as `replay run --as-agents` (about 2 minutes)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from console_load import FrameCounter  # noqa: E402

from cerevisor_tui.endpoints.probe import percentile  # noqa: E402
from cerevisor_tui.replay.generate import generate  # noqa: E402
from cerevisor_tui.replay.run import ReplaySettings, replay  # noqa: E402
from cerevisor_tui.replay.trace import TraceTurn, whole_prompts, write_trace  # noqa: E402

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


RESULT = "RESULT "
READY = "READY"
ROWS_WAIT_S = 120.0  # the console says READY without its rows past this: the parent must not wait forever


async def console_keys(run_dir: Path, press_every_s: float, size: tuple[int, int]) -> dict[str, Any]:
    """The console attached to the run in `run_dir`, headless: once its session table has two rows it says READY on
    stdout and presses a key every `press_every_s` until its stdin ends; the key-press-to-screen latencies."""
    from cerevisor_tui.commands.console_client import attached_handle, ui_config
    from cerevisor_tui.ui.app import CerevisorApp

    config, config_path = ui_config(run_dir, None)
    # what the console would say on screen (a connection the run let go, a refusal), with when: seconds after READY
    notices: list[str] = []
    ready_at = [time.monotonic()]
    handle = attached_handle(run_dir, lambda message, severity="warning": notices.append(
        f"at {time.monotonic() - ready_at[0]:.1f} s: {message}"))
    app = CerevisorApp(handle.control, handle.mirror, config, run=handle.run, attached=True, config_path=config_path,
                       tune_gc=True)
    ended = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), ended.set()), daemon=True).start()
    presses: list[tuple[float, int, int]] = []  # (time the key was sent, row it should show, +1 down / -1 up)
    async with app.run_test(size=size) as pilot:
        frames = FrameCounter(app)
        waited_until = time.monotonic() + ROWS_WAIT_S
        while getattr(app.screen, "table", None) is None or app.screen.table.row_count < 2:
            if ended.is_set() or time.monotonic() > waited_until:
                break
            await asyncio.sleep(0.1)
        print(READY, flush=True)
        ready_at[0] = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        while not ended.is_set():
            table = app.screen.table
            step = 1 if table.cursor_row + 1 < table.row_count else -1
            presses.append((time.perf_counter(), table.cursor_row + step, step))
            tasks.append(asyncio.create_task(pilot.press("down" if step > 0 else "up")))
            await asyncio.sleep(press_every_s)
        for task in tasks:
            await task
        await pilot.pause()
        rows = app.screen.table.row_count if getattr(app.screen, "table", None) is not None else 0
    latencies = []
    for sent_at, row, step in presses:
        shown = next((t for t, r in frames.frames if t >= sent_at and (r - row) * step >= 0), None)
        if shown is not None:
            latencies.append(shown - sent_at)
    return {"presses": len(presses), "shown": len(latencies), "frames": len(frames.frames), "notices": notices,
            "rows": rows,
            "key_p50_ms": _ms(percentile(latencies, 50)), "key_p95_ms": _ms(percentile(latencies, 95)),
            "key_max_ms": _ms(max(latencies, default=None))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


class Console:
    """`console_keys` in a process of its own (the replay client's work must not share its event loop)."""

    def __init__(self, run_dir: Path, press_every_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--console-of", str(run_dir), "--press-every-s",
                                      str(press_every_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.ready = next((line for line in self.proc.stdout if line.strip() == READY), "") != ""

    def figures(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        self.proc.wait(60)
        line = next((line for line in out.splitlines() if line.startswith(RESULT)), "")
        return json.loads(line[len(RESULT):]) if line else {"error": f"the console exited {self.proc.returncode}"}


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
    if args.as_agents:  # the run is `replay run --as-agents`: it sends the sessions itself
        trace = run_dir.parent / "trace.jsonl"
        write_trace(turns, trace)
        agents = subprocess.Popen([*CLI, "replay", "run", str(trace), "--endpoint", sim_url, "--as-agents", "--mode",
                                   "parallel", "--concurrency", str(sessions), "--speed", str(args.speed),
                                   "--run-dir", str(run_dir), "--json"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        while not (run_dir / "supervisor.json").is_file() and agents.poll() is None:
            time.sleep(0.1)  # (a benchmark's wait for another process's file)
        run_pid = agents.pid
    else:
        port = _free_port()
        started = subprocess.run([*CLI, "gateway", "--upstream", sim_url, "--mode", "parallel", "--concurrency",
                                  str(sessions), "--listen", f"127.0.0.1:{port}", "--run-dir", str(run_dir),
                                  "--detach"], capture_output=True, text=True, timeout=60)
        run_pid = int(started.stdout.split("(process ", 1)[1].split(",", 1)[0])
    try:
        consumer = Consumer(run_dir)
        rss_before, _, cpu_before = _proc(run_pid)
        _, _, sim_cpu_before = _proc(sim.pid)
        samples: list[float] = []
        last = [(rss_before, cpu_before)]  # the run's last (RSS, CPU): an agents' run has exited when it is read
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                try:
                    rss, _, cpu = _proc(run_pid)
                except (OSError, IndexError, ValueError):  # it has exited (or is exiting)
                    continue
                samples.append(rss)
                last[0] = (rss, cpu)

        threading.Thread(target=sample, daemon=True).start()
        wall = consumer.since = time.monotonic()
        if args.as_agents:
            sending = asyncio.create_task(_figures_of(agents))
        else:
            sending = asyncio.create_task(_report_figures(replay(turns, f"http://127.0.0.1:{port}/v1", ReplaySettings(
                concurrency=sessions, speed=args.speed, metrics_url=sim_url))))
        # the console attaches once the replay is under way (it presses keys only while there are rows to move on)
        console = await asyncio.to_thread(Console, run_dir, args.press_every_s) if args.console else None
        report = await sending
        wall_s = time.monotonic() - wall
        done.set()
        keys = await asyncio.to_thread(console.figures) if console is not None else {}
        rss_after, rss_peak, cpu_after = (last[0][0], max(samples, default=rss_before), last[0][1]) \
            if args.as_agents else _proc(run_pid)  # (the agents' run has ended by now: as last sampled)
        _, _, sim_cpu_after = _proc(sim.pid)
    finally:
        if not args.as_agents:
            subprocess.run([*CLI, "stop", str(run_dir)], capture_output=True, timeout=60)
        sim.terminate()
        sim.wait(10)
    consumer.proc.wait(30)
    consumer.thread.join(10)
    journal = [run_dir / "events.jsonl", *(run_dir / "transcripts").glob("*.jsonl")]
    requests = report["turns_completed"] + report["turns_failed"]
    return {
        "sessions": sessions, "turns": len(turns), "turns_completed": report["turns_completed"],
        "run": "agents" if args.as_agents else "gateway",
        "body_kb_median": percentile(body_kb, 50), "body_kb_max": max(body_kb), "speed": args.speed,
        "wall_s": wall_s, "gateway_rss_before_mib": rss_before, "gateway_rss_peak_mib": rss_peak,
        "gateway_rss_after_mib": rss_after, "gateway_rss_sampled_max_mib": max(samples, default=rss_after),
        "gateway_rss_growth_per_session_mib": (rss_after - rss_before) / sessions,
        "gateway_cpu_ms_per_request": (cpu_after - cpu_before) * 1000 / max(1, requests),
        "sim_cpu_ms_per_request": (sim_cpu_after - sim_cpu_before) * 1000 / max(1, requests),
        "journal_kb_per_request": sum(path.stat().st_size for path in journal if path.is_file()) / 1000 / max(1, requests),
        "consumer_events": consumer.events, "consumer_mib": consumer.bytes / 2**20,
        "consumer_delay_p50_s": percentile(consumer.delays_s, 50),
        "consumer_delay_p95_s": percentile(consumer.delays_s, 95), "consumer_delay_max_s": max(consumer.delays_s,
                                                                                               default=None),
        "prefix_hit_rate": report["prefix_hit_rate"], "first_error": report["first_error"],
        **{f"console_{name}": value for name, value in keys.items()},
    }


async def _report_figures(replaying: Any) -> dict[str, Any]:
    return (await replaying).to_dict()


async def _figures_of(agents: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = await asyncio.to_thread(agents.communicate)
    return json.loads(out) if out.strip() else {"turns_completed": 0, "turns_failed": 0, "prefix_hit_rate": None,
                                                 "first_error": f"replay run exited {agents.returncode}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=2, help="turns of each session (default 2)")
    parser.add_argument("--from-turn", type=int, default=20, help="where each session is taken from (default 20)")
    parser.add_argument("--speed", type=float, default=20.0, help="simulator clock speed (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--as-agents", action="store_true",
                        help="the run is `replay run --as-agents` (the sessions as its own agents) instead of a gateway")
    parser.add_argument("--no-console", dest="console", action="store_false",
                        help="leave the console out (only the --jsonl consumer attaches)")
    parser.add_argument("--press-every-s", type=float, default=0.6, help="the console's key presses (default 0.6)")
    parser.add_argument("--console-of", help=argparse.SUPPRESS)  # the console's own process: its run directory
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    if args.console_of:
        figures = asyncio.run(console_keys(Path(args.console_of), args.press_every_s, (160, 50)))
        print(RESULT + json.dumps(figures), flush=True)
        return 0
    figures = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(figures))
        return 0
    f = figures
    how = "as the run's own agents" if f["run"] == "agents" else "through the gateway"
    print(f"{f['sessions']} agentx sessions x {args.turns} turns {how}, bodies median "
          f"{f['body_kb_median']:.0f} KB (max {f['body_kb_max']:.0f}), {f['turns_completed']}/{f['turns']} turns "
          f"in {f['wall_s']:.0f} s wall at speed {f['speed']:g}")
    print(f"{f['run']} run RSS: {f['gateway_rss_before_mib']:.0f} MiB before, peak {f['gateway_rss_peak_mib']:.0f}, "
          f"after {f['gateway_rss_after_mib']:.0f} ({f['gateway_rss_growth_per_session_mib'] * 1024:.0f} KiB a "
          "session kept)")
    print(f"CPU per request: {f['run']} run {f['gateway_cpu_ms_per_request']:.1f} ms, simulator "
          f"{f['sim_cpu_ms_per_request']:.1f} ms")
    print(f"attached consumer: {f['consumer_events']:,} events, {f['consumer_mib']:.0f} MiB; delay p50 "
          f"{f['consumer_delay_p50_s']:.3f} s, p95 {f['consumer_delay_p95_s']:.3f} s, max {f['consumer_delay_max_s']:.3f} s")
    print(f"journal (events and transcripts): {f['journal_kb_per_request']:.0f} KB a request")
    if "console_key_p50_ms" in f:
        print(f"console attached: key press to screen p50 {_shown_ms(f['console_key_p50_ms'])}, p95 "
              f"{_shown_ms(f['console_key_p95_ms'])}, max {_shown_ms(f['console_key_max_ms'])} "
              f"({f['console_shown']} of {f['console_presses']} presses shown, {f['console_rows']} rows)"
              + "".join(f"; it said: {notice}" for notice in f["console_notices"]))
    elif "console_error" in f:
        print(f"console: {f['console_error']}")
    if f["first_error"]:
        print(f"{f['turns'] - f['turns_completed']} turns failed; the first: {f['first_error']}")
    return 0


def _shown_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


if __name__ == "__main__":
    sys.exit(main())
