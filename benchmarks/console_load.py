"""The full console under a full box's load: 256 agents streaming at 20,000+ tokens/s, and stalls among them.

Two consoles, measured the same way and side by side in one invocation (`--console`, both by default):
- inprocess: the run's engine in the console's own process (`cerevisor-tui --in-process`), its streams
  read by the stream worker, the app following it through a mirror subscribed to the engine;
- attached: the run in a process of its own, started with `cerevisor-tui run FILE --detach`, and the
  console attached to its control socket as `cerevisor-tui attach` and the console's own runs open it
  (commands/console_client.py): a RunMirror fed from the socket by a ControlClient, commands sent through
  a RemoteControl.
Each case runs in a fresh process, the cases interleaved over `--rounds`. `--burn` runs a process that burns
a core meanwhile (`--burn both`: every console with and without it).

The console (CerevisorApp, journal on) runs headless under Textual's pilot; the server is the paced SSE
server of client_throughput.py in a process of its own: every stream sends --rate tokens a second,
--events-per-write at a time (a busy vLLM coalesces a stream's tokens the same way when its clients fall
behind). Agents named stall-N stop getting tokens after 6 + N/2 s and keep their connection open, as a
wedged model does; the idle deadline is --idle-timeout-s.

Measured, in each case:
- aggregate tokens/s the console took in (its mirror's own count), per second;
- event backlog: tokens the server has written that the console has not taken in yet, sampled every
  second; its slope over the run says whether it grows;
- event-loop lag: how late a 50 ms timer in the console's loop fires (what every keypress waits behind);
- frames per second: screen updates the compositor produced (each is also rendered to terminal bytes,
  as a real terminal would need, which headless Textual skips);
- key-press-to-screen latency through the pilot: from sending `down` to the first frame whose agent
  table shows the cursor on the next row;
- stall precision (issue point 4): for each agent the watchdog killed, kill time minus its deadline (the
  `deadline_at` its last StallWarning announced), and how many agents were killed that were streaming;
- CPU of the console, of the run side (the stream worker, or the run's own process) and of the server;
  how busy the machine was, and how long the console's main thread waited for a CPU (/proc schedstat).

    python benchmarks/console_load.py                     # both consoles, 30 s measured each (about 2 minutes)
    python benchmarks/console_load.py --burn both --rounds 3
    python benchmarks/console_load.py --console attached --agents 128 --rate 160 --seconds 20

Targets (issues 7 and 14): >= 20,000 tokens/s, no growing backlog, key latency p95 < 100 ms (the attached
console: even while a second process burns a core); stall kill time minus deadline p95 < 0.5 s, no
streaming agent killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
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

    def __init__(self, attached: bool = False) -> None:
        from textual.screen import Screen

        from cerevisor_tui.ui.mirror import RunMirror
        from cerevisor_tui.ui.screens.main import MainScreen

        self.cpu: dict[str, float] = {}
        self._wrap(MainScreen, "refresh_status", "status refresh (header, agents table, load; <= 4 Hz)")
        self._wrap(MainScreen, "flush_streams", "stream flush (visible pane; refresh_hz)")
        self._wrap(Screen, "_compositor_refresh", "compositor (frames)")
        self._wrap(RunMirror, "__call__", "run mirror (every event, inline; 1 call in 64 timed, x64)", every=64)
        if attached:
            from cerevisor_tui.supervisor import client

            # looked up at each call by the client's read loop: wrapping the module's name times it
            self._wrap(client, "read_server", "socket: line to typed message (1 call in 64 timed, x64)", every=64)

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


def config_data(base_url: str, agents: int, stalls: int, tokens: int, idle_s: float, run_dir: str,
                busy_check: bool = True, stream_process: str = "auto") -> dict[str, Any]:
    names = [f"stall-{i}" for i in range(stalls)] + [f"agent-{i:03d}" for i in range(agents - stalls)]
    return {
        "run": {"mode": "parallel", "max_concurrency": agents, "run_dir": run_dir, "metrics_interval_s": 2.0,
                "stream_process": stream_process},
        "stall": {"idle_timeout_s": idle_s, "first_byte_timeout_s": 60.0, "extend_when_server_busy": busy_check},
        "endpoints": [{"name": "box", "kind": "local", "base_url": base_url, "model": MODEL,
                       "max_concurrency": agents}],
        "agents": [{"name": name, "prompt": f"{name}: write at length.", "max_tokens": tokens, "retries": 0}
                   for name in names],
    }


def build_config(*args: Any, **kwargs: Any) -> Any:
    from cerevisor_tui.config import validate

    return validate(config_data(*args, **kwargs))


def child_pids(pid: int | None) -> list[int]:
    """A process's children (its stream worker, say), from /proc."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError, TypeError):
        return []


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy (all CPUs, everything but idle and iowait), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def run_queue_wait_s(pid: int | str = "self") -> float:
    """Seconds the process's main thread has spent runnable but waiting for a CPU (/proc/PID/schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def wakeups(pid: int | str = "self") -> int:
    """Times the process's main thread gave up its CPU to wait (voluntary context switches): its wake-ups."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def alive(pid: int) -> bool:
    """The process exists and has not ended (a zombie has ended: a detached run is not our child to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class InProcessRun:
    """The run's engine in the console's process, followed through a mirror subscribed to it (as
    `commands/console.py` builds it), its streams read by the stream worker."""

    label = "in-process"

    def __init__(self, args: argparse.Namespace, server: FastServer, tmp: Path, stalls: StallLog) -> None:
        from cerevisor_tui.commands.console import run_handle
        from cerevisor_tui.engine.engine import Engine, wants_stream_process
        from cerevisor_tui.engine.sinks.journal import Journal

        run_dir = tmp / "run"
        self.config = build_config(server.base_url, args.agents, args.stalls, run_tokens(args), args.idle_timeout_s,
                                   str(run_dir), args.busy_check, args.stream_process)
        self.engine = Engine(self.config, run_dir=str(run_dir),
                             stream_process=wants_stream_process(self.config, console=True))
        self.journal = Journal(run_dir, self.engine.report)
        self.journal.open()
        self.engine.subscribe(self.journal)
        self.engine.subscribe(stalls)
        self.handle = run_handle(self.engine)

    def app(self) -> Any:
        from cerevisor_tui.ui.app import CerevisorApp
        from cerevisor_tui.ui.theme_files import load_themes

        return CerevisorApp(self.handle.control, self.handle.mirror, self.config, run=self.handle.run,
                            themes=load_themes(None), tune_gc=True)  # as `cerevisor-tui` runs it

    events = 0  # not counted: the mirror is called by the engine

    def other_pids(self) -> list[int]:
        worker = self.engine.connections.worker
        return [worker.pid] if worker is not None else []

    async def stop(self, mirror: Any) -> None:
        self.engine.stop("benchmark over")
        for _ in range(100):
            if all(a.status in FINAL for a in mirror.agents.values()):
                break
            await asyncio.sleep(0.1)

    def close(self) -> None:
        self.journal.write_report()
        self.journal.close()


class AttachedRun:
    """The run in a process of its own, started with `cerevisor-tui run FILE --detach`, and the console
    attached to its control socket as `cerevisor-tui attach` opens it (commands/console_client.py): a
    RunMirror fed by a ControlClient, the operator's commands sent through a RemoteControl."""

    label = "attached"

    def __init__(self, args: argparse.Namespace, server: FastServer, tmp: Path, stalls: StallLog) -> None:
        import subprocess

        import tomli_w

        from cerevisor_tui.config import validate
        from cerevisor_tui.supervisor.protocol import read_supervisor

        self.run_dir = tmp / "run"
        data = config_data(server.base_url, args.agents, args.stalls, run_tokens(args), args.idle_timeout_s,
                           str(self.run_dir), args.busy_check, args.stream_process)
        self.config = validate(data)
        config_file = tmp / "workflow.toml"
        config_file.write_text(tomli_w.dumps(data), encoding="utf-8")
        started = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(config_file), "--detach",
                                  "--run-dir", str(self.run_dir)], capture_output=True, text=True, timeout=90)
        if started.returncode != 0:
            raise SystemExit(f"run --detach failed ({started.returncode}): {started.stderr.strip()}")
        self.pid = int(read_supervisor(self.run_dir)["pid"])
        self.stalls = stalls
        self.client: Any = None
        self.events = 0  # events the console took in from the socket

    def app(self) -> Any:
        from cerevisor_tui.supervisor.client import ControlClient, RemoteControl
        from cerevisor_tui.ui.app import CerevisorApp
        from cerevisor_tui.ui.mirror import RunMirror
        from cerevisor_tui.ui.theme_files import load_themes

        mirror = RunMirror()
        control = RemoteControl(lambda message: print(f"  refused: {message}", file=sys.stderr))
        stalls = self.stalls

        def feed(event: Any) -> None:
            self.events += 1
            mirror(event)
            stalls(event)

        async def follow() -> int:  # as console_client.attached_handle's, with the stall log beside the mirror
            client = self.client = await ControlClient.connect(self.run_dir)
            control.bind(client)
            try:
                await client.run(feed)
            finally:
                control.bind(None, "the connection to the run has ended")
                await client.close()
            return mirror.finished.exit_code if mirror.finished is not None else 1

        return CerevisorApp(control, mirror, self.config, run=follow, attached=True, themes=load_themes(None),
                            tune_gc=True)

    def other_pids(self) -> list[int]:
        return [self.pid, *child_pids(self.pid)]

    async def stop(self, mirror: Any) -> None:
        from cerevisor_tui.contract.commands import Stop

        if self.client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.command(Stop(reason="benchmark over")), 10)
        for _ in range(150):
            if mirror.finished is not None or not alive(self.pid):
                break
            await asyncio.sleep(0.1)

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(self.pid):
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGTERM)


CONSOLES = {"inprocess": InProcessRun, "attached": AttachedRun}
FINAL = frozenset({"completed", "failed", "killed", "skipped", "cancelled"})


def run_tokens(args: argparse.Namespace) -> int:
    return int(args.rate * (args.seconds + args.warmup_s + 30))  # streams outlast the measurement


async def measure(args: argparse.Namespace, server: FastServer, tmp: Path) -> dict[str, Any]:
    stalls = StallLog()
    run = CONSOLES[args.one](args, server, tmp, stalls)
    parts = PartTimer(attached=args.one == "attached")
    app = run.app()
    out: dict[str, Any] = {}
    loop_lag: list[float] = []
    try:
        async with app.run_test(size=(args.width, args.height)) as pilot:
            frames = FrameCounter(app)
            mirror = app.mirror

            async def lag_probe() -> None:
                while True:
                    t = time.perf_counter()
                    await asyncio.sleep(0.05)
                    loop_lag.append(time.perf_counter() - t - 0.05)

            prober = asyncio.create_task(lag_probe())
            # warm up: every agent admitted and streaming
            deadline = time.perf_counter() + 40
            while sum(1 for a in mirror.agents.values() if a.status == "streaming") < args.agents - args.stalls:
                if time.perf_counter() > deadline:
                    raise SystemExit("the agents did not all start streaming within 40 s")
                await asyncio.sleep(0.2)
            await asyncio.sleep(args.warmup_s)
            loop_lag.clear()
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            server_cpu0 = server.cpu_s()
            others = run.other_pids()
            others_cpu0 = [proc_cpu_s(pid) for pid in others]
            burner_cpu0 = proc_cpu_s(args.burner_pid)
            events0 = run.events
            wait0 = run_queue_wait_s()
            busy0 = machine_busy_s()
            wakeups0 = wakeups()
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
                    samples.append((time.perf_counter() - t0, mirror.tokens_total, sent))
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
            others_cpu = sum(proc_cpu_s(pid) - c0 for pid, c0 in zip(others, others_cpu0, strict=True))
            burner_cpu = proc_cpu_s(args.burner_pid) - burner_cpu0
            events = run.events - events0
            waited = run_queue_wait_s() - wait0
            busy = machine_busy_s() - busy0
            woke = wakeups() - wakeups0
            load = os.getloadavg()[0]
            window_frames = frames.frames[first_frame:]
            frame_bytes = frames.bytes - bytes0
            render_cpu = frames.render_cpu - render0
            for task in press_tasks:
                await task
            prober.cancel()
            await run.stop(mirror)
            await pilot.pause()
    finally:
        run.close()

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
        console=args.one, burn=args.burner_pid is not None, load=load, events_per_s=events / args.seconds,
        tokens_per_s=statistics.median(rates) if rates else 0.0, tokens_per_s_min=min(rates, default=0.0),
        backlog_start=backlog[0][1] if backlog else 0, backlog_end=backlog[-1][1] if backlog else 0,
        backlog_max=max((b for _, b in backlog), default=0), backlog_slope=slope(backlog),
        fps=statistics.median(fps) if fps else 0.0, fps_min=min(fps, default=0),
        frame_kib_per_s=frame_bytes / 1024 / args.seconds,
        key_p50_ms=percentile(latencies, 0.5) * 1000, key_p95_ms=percentile(latencies, 0.95) * 1000,
        key_max_ms=max(latencies, default=float("nan")) * 1000, presses=len(presses), shown=len(latencies),
        lag_p50_ms=percentile(loop_lag, 0.5) * 1000, lag_p95_ms=percentile(loop_lag, 0.95) * 1000,
        cpu_share=cpu / args.seconds, server_cpu_share=server_cpu / args.seconds,
        other_cpu_share=others_cpu / args.seconds if others else None,
        burner_cpu_share=burner_cpu / args.seconds if args.burner_pid else None,
        stall_killed=len(late), stall_expected=sum(1 for i in range(args.stalls) if 6 + i * 0.5 < args.seconds +
                                                    args.warmup_s - args.idle_timeout_s),
        stall_p50_s=percentile(late, 0.5), stall_p95_s=percentile(late, 0.95), stall_max_s=max(late, default=0.0),
        false_kills=false_kills, samples=samples, parts={k: v / args.seconds for k, v in parts_cpu.items()},
        render_share=render_cpu / args.seconds, run_queue_share=waited / args.seconds,
        machine_busy_share=busy / args.seconds, wakeups_per_s=woke / args.seconds,
        others_share=(busy - cpu - others_cpu - server_cpu - (burner_cpu if args.burner_pid else 0.0)) / args.seconds,
    )
    return out


def run_one(args: argparse.Namespace) -> int:
    """One case in this process (the parent started it): its figures as one JSON line on stdout."""
    with tempfile.TemporaryDirectory(prefix="cerevisor-console-load-") as tmp, \
            FastServer(args.events_per_write, rate=args.rate, stall_base_s=6.0, stall_step_s=0.5) as server:
        r = asyncio.run(measure(args, server, Path(tmp)))
    print(RESULT + json.dumps(r), flush=True)
    return 0


RESULT = "RESULT "


def spawn_case(args: argparse.Namespace, argv: list[str], console: str, burn: bool) -> dict[str, Any]:
    """One case in a fresh process, with a core burnt meanwhile when `burn`."""
    import subprocess

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if burn else None
    try:
        extra = ["--burner-pid", str(burner.pid)] if burner is not None else []
        done = subprocess.run([sys.executable, __file__, *argv, "--one", console, *extra],
                              stdout=subprocess.PIPE, text=True, timeout=args.seconds + 240)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise SystemExit(f"the {console} case ended without figures (exit code {done.returncode})")


def ms_pair(rs: list[dict[str, Any]], a: str, b: str) -> str:
    return f"{med(rs, a):.0f} / {med(rs, b):.0f}"


def med(rs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rs if r[key] is not None]
    return statistics.median(values) if values else float("nan")


def spread(rs: list[dict[str, Any]], key: str, fmt: str = "{:.0f}") -> str:
    """The median, and the range when there is more than one run."""
    values = sorted(r[key] for r in rs)
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(values[0])}-{fmt.format(values[-1])})"


def report(args: argparse.Namespace, cases: dict[tuple[str, bool], list[dict[str, Any]]]) -> bool:
    """The side-by-side table (medians over the rounds); returns whether every key-latency target held."""
    names = {"inprocess": "in-process", "attached": "attached"}
    keys = list(cases)
    heads = [names[c] + (" + burn" if b else "") for c, b in keys]
    print("\n| figure | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(keys))

    def row(label: str, cell: Any) -> None:
        print(f"| {label} | " + " | ".join(cell(cases[k]) for k in keys) + " |")

    row("tokens/s taken in (median of 1 s)", lambda rs: f"{med(rs, 'tokens_per_s'):,.0f}")
    row("event backlog, tokens (end; slope per s)",
        lambda rs: f"{med(rs, 'backlog_end'):,.0f}; {med(rs, 'backlog_slope'):+,.0f}/s")
    row("events/s over the socket", lambda rs: f"{med(rs, 'events_per_s'):,.0f}" if rs[0]["events_per_s"] else "-")
    row("frames per second (median)", lambda rs: f"{med(rs, 'fps'):.0f}")
    row("key to screen p50, ms", lambda rs: spread(rs, "key_p50_ms"))
    row("key to screen p95, ms", lambda rs: spread(rs, "key_p95_ms"))
    row("event-loop lag p50 / p95, ms", lambda rs: ms_pair(rs, "lag_p50_ms", "lag_p95_ms"))
    row("stall kill - deadline p50 / p95, s",
        lambda rs: f"{med(rs, 'stall_p50_s'):.3f} / {med(rs, 'stall_p95_s'):.3f}")
    row("stall kills / streaming agents killed",
        lambda rs: f"{med(rs, 'stall_killed'):.0f} / {max(len(r['false_kills']) for r in rs)}")

    def cpu(rs: list[dict[str, Any]]) -> str:
        other = med(rs, "other_cpu_share")
        burner = med(rs, "burner_cpu_share")
        text = (f"{med(rs, 'cpu_share'):.0%} / {'-' if math.isnan(other) else f'{other:.0%}'} / "
                f"{med(rs, 'server_cpu_share'):.0%}")
        return text + ("" if math.isnan(burner) else f" / {burner:.0%}")

    row("CPU: console / run side / server (/ burner), of a core", cpu)
    row(f"machine busy, cores of {os.cpu_count()} (of which not this benchmark's processes)",
        lambda rs: f"{med(rs, 'machine_busy_share'):.2f} ({med(rs, 'others_share'):.2f})")
    row("console wake-ups per second", lambda rs: f"{med(rs, 'wakeups_per_s'):,.0f}")
    row("console waiting for a CPU (run queue), share of the time", lambda rs: f"{med(rs, 'run_queue_share'):.0%}")
    row("1-minute load average at the end", lambda rs: spread(rs, "load", "{:.1f}"))
    print("\n(run side: the stream worker in-process, the run's own process attached; "
          f"{len(next(iter(cases.values())))} run(s) of each, medians)")
    print("\nwhere the console process's CPU went (share of a core, medians):")
    labels: list[str] = []
    for rs in cases.values():
        for label in rs[0]["parts"]:
            if label not in labels:
                labels.append(label)
    print("| part | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(keys))
    for label in labels:
        row(label, lambda rs, label=label: (f"{statistics.median(r['parts'][label] for r in rs):.1%}"
                                            if label in rs[0]["parts"] else "-"))
    row("the rest (engine or client, Textual's message pumps)",
        lambda rs: f"{statistics.median(r['cpu_share'] - sum(r['parts'].values()) for r in rs):.1%}")
    held = True
    for (console, burn), rs in cases.items():
        p95 = med(rs, "key_p95_ms")
        ok = p95 < 100
        held = held and ok
        print(f"  {names[console]}{' + burn' if burn else ''}: key p95 {p95:.0f} ms: "
              f"target < 100 {'holds' if ok else 'MISSED'}")
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--console", default="inprocess,attached",
                        help="the consoles measured, side by side: inprocess, attached (default both)")
    parser.add_argument("--burn", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                        help="run a process that burns a core meanwhile: on (`--burn` alone), off (default), "
                        "or both: each console with and without it")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every case, interleaved (default 1)")
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
                        help="[run] stream_process (default auto: on in the in-process console with 2+ CPUs, "
                        "off in a run of its own, as `run` takes it)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds measured (default 30)")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds of streaming before measuring")
    parser.add_argument("--press-every-s", type=float, default=0.6, help="a `down` key press this often")
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=48)
    parser.add_argument("--one", choices=tuple(CONSOLES), help=argparse.SUPPRESS)  # a case, in a child process
    parser.add_argument("--burner-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return run_one(args)

    consoles = [c.strip() for c in args.console.split(",") if c.strip()]
    unknown = [c for c in consoles if c not in CONSOLES]
    if unknown or not consoles:
        parser.error(f"--console: {', '.join(unknown) or 'none given'} (known: {', '.join(CONSOLES)})")
    burns = {"off": [False], "on": [True], "both": [False, True]}[args.burn]
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    passed = strip_options(passed, ("--console", "--burn", "--rounds"))
    print(f"console load: {args.agents} agents x {args.rate:g} tokens/s = {args.agents * args.rate:,.0f} tokens/s "
          f"offered ({args.events_per_write} per write), {args.stalls} of them stall, idle deadline "
          f"{args.idle_timeout_s:g} s (server-busy check {'on' if args.busy_check else 'off'}); stream_process "
          f"{args.stream_process}; {args.seconds:g} s measured at {args.width}x{args.height}; consoles "
          f"{', '.join(consoles)}; burn {args.burn}; {args.rounds} round(s); "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    started = time.perf_counter()
    cases: dict[tuple[str, bool], list[dict[str, Any]]] = {(c, b): [] for b in burns for c in consoles}
    for n in range(args.rounds):
        for burn in burns:
            for console in consoles:
                r = spawn_case(args, passed, console, burn)
                cases[(console, burn)].append(r)
                print(f"  round {n + 1}: {console}{' + burn' if burn else ''}: key p50/p95 {r['key_p50_ms']:.0f} / "
                      f"{r['key_p95_ms']:.0f} ms, {r['tokens_per_s']:,.0f} tokens/s, {r['fps']:.0f} frames/s, "
                      f"lag p50 {r['lag_p50_ms']:.0f} ms, CPU console {r['cpu_share']:.0%}, load {r['load']:.1f}",
                      flush=True)
    held_keys = report(args, cases)
    held_rest = all(
        r["tokens_per_s"] >= 20_000 and r["backlog_slope"] < 0.02 * r["tokens_per_s"] and r["stall_p95_s"] < 0.5
        and not r["false_kills"] and r["stall_killed"] >= r["stall_expected"]
        for rs in cases.values() for r in rs)
    print(f"  every case: >= 20,000 tokens/s, no growing backlog, stall p95 < 0.5 s, no streaming agent killed: "
          f"{'holds' if held_rest else 'MISSED'}")
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0 if held_keys and held_rest else 1


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv less the options that pick the cases (each child is told its own)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            takes_value = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            skip = takes_value and (name != "--burn" or argv[i + 1] in ("off", "on", "both"))
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
