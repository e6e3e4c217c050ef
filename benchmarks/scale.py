"""1024 concurrent agents against the simulator, headless, with the peak memory of the process that runs them.

The simulator runs in a process of its own (`cerevisor-tui sim`, sized to run every sequence at once) and
`cerevisor-tui run` runs the workflow in another, exactly as a user would: run directory, transcripts and
report on disk. The figure is that process's peak resident memory (from wait4), against a one-agent run
of the same command as the baseline, so the per-agent cost shows. While it runs, the resident memory is
sampled every 0.2 s: a flat curve after the ramp means nothing grows with the tokens streamed.

    python benchmarks/scale.py                          # 1024 agents, 2 turns of 64 tokens (1-2 minutes on 2 busy cores)
    python benchmarks/scale.py --agents 2048 --turns 3

Target (issue 7): every agent completes, peak RSS < 400 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET_MB = 400


class Simulator:
    """`cerevisor-tui sim` in a child process; `with Simulator(...) as sim:` gives `sim.base_url`."""

    def __init__(self, seqs: int, tokens_per_s: float, speed: float) -> None:
        self.args = [
            sys.executable, "-m", "cerevisor_tui", "sim", "--port", "0", "--max-num-seqs", str(seqs),
            "--tokens-per-s", str(tokens_per_s), "--speed", str(speed), "--ttft-s", "0.2",
            "--batch-slowdown", "0", "--max-model-len", "8192", "--kv-cache-tokens", str(seqs * 2048),
            "--max-num-batched-tokens", "65536",
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.base_url = ""

    def __enter__(self) -> Simulator:
        self.proc = subprocess.Popen(self.args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if " on http" in line:
                self.base_url = line.split(" on ", 1)[1].split(" ", 1)[0]
                break
        if not self.base_url:
            raise SystemExit(f"the simulator did not start: {self.proc.stderr.read()[-2000:]}")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep its pipe drained
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def workflow(base_url: str, agents: int, tokens: int, turns: int) -> str:
    lines = [
        "[run]", 'mode = "parallel"', f"max_concurrency = {agents}", "metrics_interval_s = 2.0", "",
        "[[endpoints]]", 'name = "sim"', 'kind = "local"', f'base_url = "{base_url}"', 'model = "sim-model"',
        f"max_concurrency = {agents}", "",
    ]
    follow_ups = ", ".join(f'"Go on with part {t + 2}."' for t in range(turns - 1))
    for i in range(agents):
        lines += ["[[agents]]", f'name = "agent-{i:04d}"', 'system = "You are one of many agents."',
                  f'prompt = "Agent {i}: write a report on topic {i}."', f"turns = [{follow_ups}]",
                  f"max_tokens = {tokens}", "retries = 0", ""]
    return "\n".join(lines)


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_headless(base_url: str, agents: int, tokens: int, turns: int, workdir: Path) -> dict[str, Any]:
    """`cerevisor-tui run` on a fresh run directory; its peak RSS, an RSS timeline and its report."""
    workdir.mkdir(parents=True, exist_ok=True)
    wf = workdir / "workflow.toml"
    wf.write_text(workflow(base_url, agents, tokens, turns))
    run_dir = workdir / "run"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", str(wf), "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    timeline: list[tuple[float, float]] = []
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss = _rss_mib(proc.pid)
        if rss is not None:
            timeline.append((time.perf_counter() - started, rss))
        time.sleep(0.2)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    report = json.loads((run_dir / "report.json").read_text())
    transcripts = list((run_dir / "transcripts").glob("*.jsonl"))
    return {
        "exit_code": proc.returncode, "stderr": stderr[-2000:], "wall_s": wall, "timeline": timeline,
        "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
        "totals": report["totals"], "transcripts": len(transcripts),
        "disk_mib": sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file()) / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1024, help="agents, all running at once (default 1024)")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per turn (default 64)")
    parser.add_argument("--turns", type=int, default=2, help="turns per agent, the first prompt included (default 2)")
    parser.add_argument("--tokens-per-s", type=float, default=20.0,
                        help="simulated decode speed of each sequence, before --speed (default 20)")
    parser.add_argument("--speed", type=float, default=10.0, help="simulator time scale (default 10)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories here instead of a temp dir")
    args = parser.parse_args(argv)

    print(f"scale: {args.agents} agents at once, {args.turns} turns of {args.tokens} tokens each, simulator in its "
          f"own process ({args.tokens_per_s:g} tokens/s a sequence x{args.speed:g}); {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="cerevisor-scale-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        with Simulator(max(args.agents, 16), args.tokens_per_s, args.speed) as sim:
            base = run_headless(sim.base_url, 1, args.tokens, args.turns, root / "one")
            big = run_headless(sim.base_url, args.agents, args.tokens, args.turns, root / "many")
    for name, res in (("1 agent", base), (f"{args.agents} agents", big)):
        if res["exit_code"] != 0:
            print(f"{name}: exit code {res['exit_code']}\n{res['stderr']}", file=sys.stderr)
    t = big["totals"]
    print("\nresident memory over the run (MiB, sampled):")
    step = max(1, len(big["timeline"]) // 12)
    print("  " + "  ".join(f"{s:.0f}s:{m:.0f}" for s, m in big["timeline"][::step]))
    peak_mb = big["peak_rss_mib"] * 2**20 / 1e6
    per_agent_kib = (big["peak_rss_mib"] - base["peak_rss_mib"]) * 1024 / max(1, args.agents - 1)
    print()
    print("| agents | completed | max running | output tokens | wall s | tokens/s | peak RSS | per agent | "
          "transcripts on disk | target < 400 MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    b = base["totals"]
    print(f"| 1 | {b['completed']} | {b['max_running']} | {b['output_tokens']} | {base['wall_s']:.1f} | "
          f"{b['output_tokens_per_s'] or 0:,.0f} | {base['peak_rss_mib']:.0f} MiB | | {base['transcripts']} files | |")
    held = t["completed"] == args.agents and peak_mb < TARGET_MB
    print(f"| {args.agents} | {t['completed']} | {t['max_running']} | {t['output_tokens']:,} | {big['wall_s']:.1f} | "
          f"{t['output_tokens_per_s'] or 0:,.0f} | {big['peak_rss_mib']:.0f} MiB ({peak_mb:.0f} MB) | "
          f"{per_agent_kib:.0f} KiB | {big['transcripts']} files, {big['disk_mib']:.1f} MiB | "
          f"{'hold' if held else 'MISSED'} |")
    print(f"\nthe run process used {big['cpu_s']:.1f} s of CPU; the simulator shares the same cores.")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
