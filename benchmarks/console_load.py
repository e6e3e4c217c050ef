"""The full console under a full box's load: 256 agents streaming at 20,000+ tokens/s, and stalls among them.

The console (CerevisorApp over a real Engine, journal on) runs headless under Textual's pilot; the
server is the paced SSE server of client_throughput.py in a process of its own: every stream sends
--rate tokens a second, --events-per-write at a time (a busy vLLM coalesces a stream's tokens the same
way when its clients fall behind). Agents named stall-N stop getting tokens after 6 + N/2 s and keep
their connection open, as a wedged model does; the idle deadline is --idle-timeout-s.

Measured, in one run:
- aggregate tokens/s the console took in (the UI model's own count), per second;
- event backlog: tokens the server has written that the console has not taken in yet, sampled every
  second; its slope over the run says whether it grows;
- event-loop lag: how late a 50 ms timer in the console's loop fires (what every keypress waits behind);
- frames per second: screen updates the compositor produced (each is also rendered to terminal bytes,
  as a real terminal would need, which headless Textual skips);
- key-press-to-screen latency through the pilot: from sending `down` to the first frame whose agent
  table shows the cursor on the next row;
- stall precision (issue point 4): for each agent the watchdog killed, kill time minus its deadline (the
  `deadline_at` its last StallWarning announced), and how many agents were killed that were streaming.

    python benchmarks/console_load.py                     # 256 agents, 30 s measured (about 1 minute)
    python benchmarks/console_load.py --agents 128 --rate 160 --seconds 20

Targets (issue 7): >= 20,000 tokens/s, no growing backlog, key latency p95 < 100 ms; stall kill time
minus deadline p95 < 0.5 s, no streaming agent killed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_throughput import MODEL, FastServer, proc_cpu_s  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y): units of y per second."""
    if len(points) < 2:
        return 0.0
    mt = statistics.fmean(t for t, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


class StallLog:
    """An engine subscriber for the stall figures: each agent's last announced deadline, and its kill."""

    def __init__(self) -> None:
        self.deadline: dict[str, float] = {}
        self.kills: list[tuple[str, float, float | None, str]] = []  # agent, kill time, deadline, reason

    def __call__(self, event: Any) -> None:
        kind = event.kind
        if kind == "TokenDelta":
            return
        if kind == "StallWarning":
            self.deadline[event.agent] = event.deadline_at
        elif kind == "AgentKilled":
            self.kills.append((event.agent, event.t, self.deadline.get(event.agent), event.reason))


class FrameCounter:
    """Wraps App._display: counts frames, renders them to terminal bytes, notes the agents cursor row."""

    def __init__(self, app: Any) -> None:
        from textual._compositor import CompositorUpdate

        self.app = app
        self.frames: list[tuple[float, int]] = []  # (time, cursor row shown)
        self.bytes = 0
        self.render_cpu = 0.0  # CPU seconds turning frames into terminal bytes
        self._update_type = CompositorUpdate
        self._display = app._display
        app._display = self

    def __call__(self, screen: Any, renderable: Any) -> None:
        self._display(screen, renderable)
        if renderable is None:
            return
        if isinstance(renderable, self._update_type):
            t = time.process_time()
            self.bytes += len(renderable.render_segments(self.app.console))
            self.render_cpu += time.process_time() - t
        table = getattr(self.app.screen, "table", None)
        row = table.cursor_row if table is not None and table.is_mounted else -1
        self.frames.append((time.perf_counter(), row))


class PartTimer:
    """CPU seconds spent in a few of the console's own methods (wrapped on their classes for this process)."""

    def __init__(self) -> None:
        from textual.screen import Screen

        from cerevisor_tui.ui.model import UiModel
        from cerevisor_tui.ui.screens.main import MainScreen

        self.cpu: dict[str, float] = {}
        self._wrap(MainScreen, "refresh_status", "status refresh (header, agents table, load; <= 4 Hz)")
        self._wrap(MainScreen, "flush_streams", "stream flush (visible pane; refresh_hz)")
        self._wrap(Screen, "_compositor_refresh", "compositor (frames)")
        self._wrap(UiModel, "__call__", "UI model (every event, inline; 1 call in 64 timed, x64)", every=64)

    def _wrap(self, cls: type, name: str, label: str, every: int = 1) -> None:
        """Time `cls.name`; with `every` > 1, only one call in `every`, counted `every` times: reading the
        process clock twice per call would cost more than a per-token method it measures."""
        original = getattr(cls, name)
        cpu = self.cpu
        cpu[label] = 0.0
        clock = time.process_time
        calls = [0]

        def timed(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] % every:
                return original(*args, **kwargs)
            t = clock()
            try:
                return original(*args, **kwargs)
            finally:
                cpu[label] += (clock() - t) * every

        setattr(cls, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.cpu)


def build_config(base_url: str, agents: int, stalls: int, tokens: int, idle_s: float, run_dir: str,
                 busy_check: bool = True, stream_process: str = "auto") -> Any:
    from cerevisor_tui.config import validate

    names = [f"stall-{i}" for i in range(stalls)] + [f"agent-{i:03d}" for i in range(agents - stalls)]
    return validate({
        "run": {"mode": "parallel", "max_concurrency": agents, "run_dir": run_dir, "metrics_interval_s": 2.0,
                "stream_process": stream_process},
        "stall": {"idle_timeout_s": idle_s, "first_byte_timeout_s": 60.0, "extend_when_server_busy": busy_check},
        "endpoints": [{"name": "box", "kind": "local", "base_url": base_url, "model": MODEL,
                       "max_concurrency": agents}],
        "agents": [{"name": name, "prompt": f"{name}: write at length.", "max_tokens": tokens, "retries": 0}
                   for name in names],
    })


async def measure(args: argparse.Namespace, server: FastServer, run_dir: Path) -> dict[str, Any]:
    from cerevisor_tui.engine.engine import Engine, wants_stream_process
    from cerevisor_tui.engine.journal import Journal
    from cerevisor_tui.ui.app import CerevisorApp
    from cerevisor_tui.ui.theme_files import load_themes

    tokens = int(args.rate * (args.seconds + args.warmup_s + 20))  # streams outlast the measurement
    config = build_config(server.base_url, args.agents, args.stalls, tokens, args.idle_timeout_s, str(run_dir),
                          args.busy_check, args.stream_process)
    engine = Engine(config, run_dir=str(run_dir), stream_process=wants_stream_process(config, console=True))
    journal = Journal(run_dir, engine.report)
    journal.open()
    engine.subscribe(journal)
    stalls = StallLog()
    engine.subscribe(stalls)
    parts = PartTimer()
    app = CerevisorApp(engine, config, themes=load_themes(None), tune_gc=True)  # as `cerevisor-tui` runs it
    out: dict[str, Any] = {}
    loop_lag: list[float] = []
    async with app.run_test(size=(args.width, args.height)) as pilot:
        frames = FrameCounter(app)
        model = app.model

        async def lag_probe() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.05)
                loop_lag.append(time.perf_counter() - t - 0.05)

        prober = asyncio.create_task(lag_probe())
        # warm up: every agent admitted and streaming
        deadline = time.perf_counter() + 30
        while sum(1 for st in engine.agents.values() if st.status == "streaming") < args.agents - args.stalls:
            if time.perf_counter() > deadline:
                raise SystemExit("the agents did not all start streaming within 30 s")
            await asyncio.sleep(0.2)
        await asyncio.sleep(args.warmup_s)
        loop_lag.clear()
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        server_cpu0 = server.cpu_s()
        worker_pid = engine.stream_worker.pid if engine.stream_worker is not None else None
        worker_cpu0 = proc_cpu_s(worker_pid)
        first_frame = len(frames.frames)
        parts0 = parts.snapshot()
        bytes0 = frames.bytes
        render0 = frames.render_cpu
        samples: list[tuple[float, int, int]] = []  # (t, tokens taken in, tokens sent)
        presses: list[tuple[float, int]] = []  # (time the key was sent, row it should show)
        press_tasks: list[asyncio.Task[None]] = []
        next_press = t0 + 1.0
        next_sample = t0
        while (now := time.perf_counter()) < t0 + args.seconds:
            if now >= next_sample:
                sent = (await server.stats())["tokens"]
                samples.append((time.perf_counter() - t0, model.tokens_total, sent))
                next_sample += 1.0
            if now >= next_press:
                table = app.screen.table
                presses.append((time.perf_counter(), table.cursor_row + 1))
                press_tasks.append(asyncio.create_task(pilot.press("down")))
                next_press += args.press_every_s
            await asyncio.sleep(0.01)
        cpu = time.process_time() - cpu0
        parts_cpu = {k: v - parts0[k] for k, v in parts.snapshot().items()}
        server_cpu = server.cpu_s() - server_cpu0
        worker_cpu = proc_cpu_s(worker_pid) - worker_cpu0
        window_frames = frames.frames[first_frame:]
        frame_bytes = frames.bytes - bytes0
        render_cpu = frames.render_cpu - render0
        for task in press_tasks:
            await task
        prober.cancel()
        engine.stop("benchmark over")
        for _ in range(100):
            if all(st.status in ("completed", "failed", "killed", "skipped", "cancelled") for st in engine.agents.values()):
                break
            await asyncio.sleep(0.1)
        await pilot.pause()
    journal.write_report()
    journal.close()

    latencies = []
    for sent_at, row in presses:
        shown = next((t for t, r in frames.frames if t >= sent_at and r >= row), None)
        if shown is not None:
            latencies.append(shown - sent_at)
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(samples, samples[1:], strict=False)]
    backlog = [(t, sent - taken) for t, taken, sent in samples]
    fps = [sum(1 for t, _ in window_frames if t0 + s <= t < t0 + s + 1) for s in range(int(args.seconds))]
    stall_names = {f"stall-{i}" for i in range(args.stalls)}
    late = [t - d for agent, t, d, _ in stalls.kills if agent in stall_names and d is not None]
    false_kills = [(agent, reason) for agent, _, _, reason in stalls.kills if agent not in stall_names]
    out.update(
        tokens_per_s=statistics.median(rates) if rates else 0.0, tokens_per_s_min=min(rates, default=0.0),
        backlog_start=backlog[0][1] if backlog else 0, backlog_end=backlog[-1][1] if backlog else 0,
        backlog_max=max((b for _, b in backlog), default=0), backlog_slope=slope(backlog),
        fps=statistics.median(fps) if fps else 0.0, fps_min=min(fps, default=0),
        frame_kib_per_s=frame_bytes / 1024 / args.seconds,
        key_p50_ms=percentile(latencies, 0.5) * 1000, key_p95_ms=percentile(latencies, 0.95) * 1000,
        key_max_ms=max(latencies, default=float("nan")) * 1000, presses=len(presses), shown=len(latencies),
        lag_p50_ms=percentile(loop_lag, 0.5) * 1000, lag_p95_ms=percentile(loop_lag, 0.95) * 1000,
        cpu_share=cpu / args.seconds, server_cpu_share=server_cpu / args.seconds,
        worker_cpu_share=worker_cpu / args.seconds if worker_pid else None,
        stall_killed=len(late), stall_expected=sum(1 for i in range(args.stalls) if 6 + i * 0.5 < args.seconds +
                                                    args.warmup_s - args.idle_timeout_s),
        stall_p50_s=percentile(late, 0.5), stall_p95_s=percentile(late, 0.95), stall_max_s=max(late, default=0.0),
        false_kills=false_kills, samples=samples, parts={k: v / args.seconds for k, v in parts_cpu.items()},
        render_share=render_cpu / args.seconds,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=256, help="agents streaming at once (default 256)")
    parser.add_argument("--rate", type=float, default=84.0,
                        help="tokens/s of each stream (default 84: 21,500 tokens/s for 256 agents)")
    parser.add_argument("--events-per-write", type=int, default=8, help="tokens in one server write (default 8)")
    parser.add_argument("--stalls", type=int, default=16, help="agents whose stream stalls (default 16)")
    parser.add_argument("--idle-timeout-s", type=float, default=3.0, help="idle deadline (default 3 s)")
    parser.add_argument("--no-busy-check", dest="busy_check", action="store_false",
                        help="kill at the deadline without first asking the server whether it is busy "
                        "(extend_when_server_busy = false): the watchdog's own precision")
    parser.add_argument("--stream-process", choices=("auto", "on", "off"), default="auto",
                        help="[run] stream_process, as the console takes it (default auto: on with 2+ CPUs)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds measured (default 30)")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds of streaming before measuring")
    parser.add_argument("--press-every-s", type=float, default=0.6, help="a `down` key press this often")
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=48)
    args = parser.parse_args(argv)

    print(f"console load: {args.agents} agents x {args.rate:g} tokens/s = {args.agents * args.rate:,.0f} tokens/s "
          f"offered ({args.events_per_write} per write), {args.stalls} of them stall, idle deadline "
          f"{args.idle_timeout_s:g} s (server-busy check {'on' if args.busy_check else 'off'}); stream_process "
          f"{args.stream_process}; {args.seconds:g} s "
          f"measured at {args.width}x{args.height}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cerevisor-console-load-") as tmp, \
            FastServer(args.events_per_write, rate=args.rate, stall_base_s=6.0, stall_step_s=0.5) as server:
        r = asyncio.run(measure(args, server, Path(tmp) / "run"))
    print("\n  t s   taken in   backlog")
    for t, taken, sent in r["samples"][:: max(1, len(r["samples"]) // 10)]:
        print(f"  {t:4.0f} {taken:10,} {sent - taken:9,}")
    held_rate = r["tokens_per_s"] >= 20_000
    held_backlog = r["backlog_slope"] < 0.02 * r["tokens_per_s"]  # under 2% of the rate a second
    held_keys = r["key_p95_ms"] < 100
    held_stall = r["stall_p95_s"] < 0.5 and not r["false_kills"] and r["stall_killed"] >= r["stall_expected"]
    print()
    print("| figure | measured | target |")
    print("|---|---:|---|")
    print(f"| aggregate tokens/s taken in (median of 1 s; min) | {r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f})"
          f" | >= 20,000 {'hold' if held_rate else 'MISSED'} |")
    print(f"| event backlog, tokens (start / end / max; slope per s) | {r['backlog_start']:,} / {r['backlog_end']:,} / "
          f"{r['backlog_max']:,}; {r['backlog_slope']:+,.0f}/s | not growing {'hold' if held_backlog else 'MISSED'} |")
    print(f"| frames per second (median; min) | {r['fps']:.0f} ({r['fps_min']}) | |")
    print(f"| terminal output | {r['frame_kib_per_s']:,.0f} KiB/s | |")
    print(f"| key to screen, ms (p50 / p95 / max; {r['shown']} of {r['presses']} presses) | {r['key_p50_ms']:.0f} / "
          f"{r['key_p95_ms']:.0f} / {r['key_max_ms']:.0f} | p95 < 100 {'hold' if held_keys else 'MISSED'} |")
    print(f"| event-loop lag, ms (p50 / p95) | {r['lag_p50_ms']:.0f} / {r['lag_p95_ms']:.0f} | |")
    print(f"| stall kill time - deadline, s (p50 / p95 / max; {r['stall_killed']} kills) | {r['stall_p50_s']:.3f} / "
          f"{r['stall_p95_s']:.3f} / {r['stall_max_s']:.3f} | p95 < 0.5 {'hold' if held_stall else 'MISSED'} |")
    print(f"| streaming agents killed | {len(r['false_kills'])} | 0 |")
    worker = "off" if r["worker_cpu_share"] is None else f"{r['worker_cpu_share']:.0%}"
    print(f"| CPU: console process / stream worker process / server process | {r['cpu_share']:.0%} / {worker} / "
          f"{r['server_cpu_share']:.0%} of a core | |")
    print("\nwhere the console process's CPU went (share of a core):")
    ui = sum(r["parts"].values())
    for label, share in r["parts"].items():
        print(f"  {share:6.1%}  {label}")
        if label.startswith("compositor"):
            print(f"  {'':6s}  of which {r['render_share']:.1%} turning frames into terminal bytes (what a real "
                  f"terminal costs; headless Textual skips it)")
    print(f"  {r['cpu_share'] - ui:6.1%}  the rest: engine, HTTP reads, watchdog, journal, Textual's own message pumps")
    if r["lag_p50_ms"] > 50:
        if r["cpu_share"] < 0.9:
            print(f"  the loop was late while the process used only {r['cpu_share']:.0%} of a core: the machine did not "
                  f"give it one (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        else:
            print("  the loop was late while the process used a whole core: the console is CPU-bound at this rate")
    for agent, reason in r["false_kills"][:5]:
        print(f"  killed while streaming: {agent}: {reason}")
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0 if held_rate and held_backlog and held_keys and held_stall else 1


if __name__ == "__main__":
    sys.exit(main())
