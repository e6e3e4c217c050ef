"""Start-up: `cerevisor-tui --help`, the headless path's imports, and the console's first frame in a terminal.

Each figure is the median of --repeats fresh processes, run one after the other:
- `cerevisor-tui --help` and `cerevisor-tui run --help`, wall time of the installed script;
- importing what `cerevisor-tui run` needs (engine, journal, printer), and whether Textual came with it;
- the console's first frame: `cerevisor-tui` with no config (the demo on the built-in simulator) in a
  pseudo-terminal of 120x40, from starting the process to the first screen bytes, and to the frame that
  shows the run header (its SIMULATED badge); then SIGTERM, which the console answers by stopping cleanly.

    python benchmarks/startup.py
    python benchmarks/startup.py --repeats 9

Targets (issue 7): --help < 0.3 s, the headless path never imports Textual, first console frame < 1.5 s.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

SCRIPT = Path(sys.executable).with_name("cerevisor-tui")


def command() -> list[str]:
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cerevisor_tui"]


def wall(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=60)
    return time.perf_counter() - started


def headless_imports() -> tuple[float, bool, int]:
    """Seconds to import what `run` uses, whether Textual came along, and how many modules were loaded."""
    code = ("import sys, time, json; t = time.perf_counter(); "
            "import cerevisor_tui.cli, cerevisor_tui.commands.run, cerevisor_tui.engine.engine, "
            "cerevisor_tui.engine.sinks.journal, cerevisor_tui.engine.sinks.printer; "
            "print(json.dumps([time.perf_counter() - t, 'textual' in sys.modules, len(sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    seconds, textual, modules = json.loads(out.stdout)
    return seconds, textual, modules


def first_frame(tmp: Path, marker: bytes = b"SIMULATED", timeout_s: float = 20.0) -> tuple[float, float]:
    """Seconds from exec to the first bytes on the terminal, and to the first frame showing `marker`."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "XDG_CONFIG_HOME": str(tmp / "config"),
           "XDG_STATE_HOME": str(tmp / "state"), "COLUMNS": "120", "LINES": "40"}
    env.pop("CEREVISOR_TUI_CONFIG", None)
    tmp.mkdir(parents=True, exist_ok=True)

    def controlling_terminal() -> None:  # in the child: a session of its own, with the pty as its terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    started = time.perf_counter()
    proc = subprocess.Popen(command(), stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp,
                            preexec_fn=controlling_terminal)
    os.close(slave)
    first_byte = shown = float("nan")
    seen = b""
    try:
        while time.perf_counter() - started < timeout_s:
            ready, _, _ = select.select([master], [], [], 0.05)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:
                break
            if not data:
                break
            now = time.perf_counter()
            if first_byte != first_byte:  # nan: nothing yet
                first_byte = now - started
            seen += data
            if marker in seen:
                shown = now - started
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        end = time.perf_counter() + 10
        while proc.poll() is None and time.perf_counter() < end:
            if select.select([master], [], [], 0.05)[0]:
                try:
                    os.read(master, 1 << 16)  # keep the terminal drained while it shuts down
                except OSError:
                    break
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    return first_byte, shown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="fresh processes per figure (default 7)")
    args = parser.parse_args(argv)
    print(f"start-up: {' '.join(command())}, median of {args.repeats}; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    help_s, run_help_s, frames, bytes_s, imports = [], [], [], [], []
    textual = False
    modules = 0
    with tempfile.TemporaryDirectory(prefix="cerevisor-startup-") as tmp:
        for i in range(args.repeats):  # interleaved: each round measures every figure once
            help_s.append(wall([*command(), "--help"]))
            run_help_s.append(wall([*command(), "run", "--help"]))
            seconds, loaded, modules = headless_imports()
            imports.append(seconds)
            textual |= loaded
            first, shown = first_frame(Path(tmp) / f"r{i}")
            bytes_s.append(first)
            frames.append(shown)
    med = statistics.median
    frame = med(f for f in frames if f == f) if any(f == f for f in frames) else float("nan")
    print()
    print("| figure | median | range | target |")
    print("|---|---:|---:|---|")
    print(f"| `cerevisor-tui --help` | {med(help_s):.3f} s | {min(help_s):.3f}-{max(help_s):.3f} | < 0.3 s "
          f"{'hold' if med(help_s) < 0.3 else 'MISSED'} |")
    print(f"| `cerevisor-tui run --help` | {med(run_help_s):.3f} s | {min(run_help_s):.3f}-{max(run_help_s):.3f} | |")
    print(f"| import the headless path ({modules} modules) | {med(imports):.3f} s | "
          f"{min(imports):.3f}-{max(imports):.3f} | Textual not imported: {'hold' if not textual else 'MISSED'} |")
    print(f"| console: first bytes on the terminal | {med(bytes_s):.3f} s | {min(bytes_s):.3f}-{max(bytes_s):.3f} | |")
    print(f"| console: first frame with the run header | {frame:.3f} s | {min(frames):.3f}-{max(frames):.3f} | "
          f"< 1.5 s {'hold' if frame < 1.5 else 'MISSED'} |")
    missing = sum(1 for f in frames if f != f)
    if missing:
        print(f"\n{missing} of {len(frames)} starts showed no header within 20 s")
    return 0 if med(help_s) < 0.3 and not textual and frame < 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
