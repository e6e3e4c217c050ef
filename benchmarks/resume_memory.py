"""Peak memory of `cerevisor-tui run --resume` over a large journal: this tree against another (a baseline).

A real one-agent run on the simulator gives the records; they are copied for N agents, each answer inflated,
into a journal of about --mb megabytes that did not finish (no RunFinished). Each measurement resumes a fresh
copy of it in a child process (every agent is reused: nothing is sent) and reads the child's peak RSS
(wait4's ru_maxrss). Prints both trees' medians side by side and their ratio.

    .venv/bin/python benchmarks/resume_memory.py --baseline /work/main --mb 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def config(path: Path, agents: int) -> Path:
    lines = ['[[endpoints]]\nname = "sim"\nkind = "simulated"\n[endpoints.sim]\nspeed = 50\n']
    lines += [f'[[agents]]\nname = "a{i}"\nprompt = "task"\nmax_tokens = 16\n' for i in range(agents)]
    path.write_text("\n".join(lines))
    return path


def journal(work: Path, mb: int, answer_kb: int) -> tuple[Path, int]:
    """A run directory whose journal holds about `mb` MB: one real agent's records, copied for each agent."""
    one = work / "one"
    subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(config(work / "one.toml", 1)), "--run-dir",
                    str(one)], check=True, capture_output=True, cwd=HERE)
    records = [json.loads(line) for line in (one / "events.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "RunStarted")
    agent = [r for r in records if r.get("agent") == "a0"]
    filler = ("lorem ipsum " * (answer_kb * 1024 // 12 + 1))[: answer_kb * 1024]
    per_agent = len(json.dumps(agent)) + answer_kb * 1024
    agents = max(1, mb * 1024 * 1024 // per_agent)
    run = work / "run"
    run.mkdir()
    (run / "transcripts").mkdir()
    with open(run / "events.jsonl", "w") as out:
        out.write(json.dumps({**start, "waves": [[f"a{i}" for i in range(agents)]]}) + "\n")
        for i in range(agents):
            for r in agent:
                r = {**r, "agent": f"a{i}"}
                if r["event"] == "MessageRecorded" and r["role"] == "assistant":
                    r["content"] = filler
                out.write(json.dumps(r, separators=(",", ":")) + "\n")
    config(work / "w.toml", agents)
    return run, agents


def peak_rss_mib(tree: Path, work: Path, run: Path, n: int) -> float:
    copy = work / f"copy-{n}"
    shutil.copytree(run, copy)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", str(work / "w.toml"), "--resume",
                             str(copy)], env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"resume under {tree} exited {proc.returncode}: {err[-2000:]}")
    shutil.rmtree(copy)
    return usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another source tree to compare with (e.g. /work/main)")
    parser.add_argument("--mb", type=int, default=100, help="journal size in MB (default 100)")
    parser.add_argument("--answer-kb", type=int, default=40, help="each agent's answer in KB (default 40)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per tree (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resume-mem-") as tmp:
        work = Path(tmp)
        run, agents = journal(work, args.mb, args.answer_kb)
        size = (run / "events.jsonl").stat().st_size / 1024 / 1024
        print(f"journal: {size:.0f} MB, {agents} completed agents, answers of {args.answer_kb} KB; "
              f"{args.repeat} resumes per tree")
        trees = {"this tree": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
        medians = {}
        n = 0
        for name, tree in trees.items():
            peaks = []
            for _ in range(args.repeat):
                peaks.append(peak_rss_mib(tree, work, run, n))
                n += 1
            medians[name] = statistics.median(peaks)
            print(f"{name:>10}: peak RSS median {medians[name]:7.1f} MiB  ({', '.join(f'{p:.1f}' for p in peaks)})"
                  f"  [{tree}]")
        if "baseline" in medians:
            print(f"     ratio: this tree / baseline = {medians['this tree'] / medians['baseline']:.2f}")


if __name__ == "__main__":
    main()
