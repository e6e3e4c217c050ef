"""Runs that outlive the terminal, through the CLI: `run --detach`, `ls`, `attach --jsonl`, `stop`, and a
killed supervisor resumed with `--resume`. Each run embeds its simulator (endpoint kind "simulated")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cerevisor_tui.supervisor.protocol import read_supervisor
from tests.conftest import wait_until


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], capture_output=True, text=True,
                          timeout=timeout)


def workflow(tmp_path: Path, agents: int = 4, tokens_per_s: float = 20.0, max_tokens: int = 40,
             name: str = "a") -> Path:
    """A workflow on the built-in simulator: `agents` agents named NAME0, NAME1, ... in one wave, 2 at a time."""
    lines = ["[run]", 'mode = "parallel"', "max_concurrency = 2", f'run_dir = "{tmp_path / "runs"}"', "",
             "[[endpoints]]", 'name = "sim"', 'kind = "simulated"', "",
             "[endpoints.sim]", f"tokens_per_s = {tokens_per_s}", "ttft_s = 0.05", ""]
    for i in range(agents):
        lines += ["[[agents]]", f'name = "{name}{i}"', f'prompt = "task {i}"', f"max_tokens = {max_tokens}", ""]
    path = tmp_path / "wf.toml"
    path.write_text("\n".join(lines))
    return path


def ls(tmp_path: Path) -> dict[str, dict]:
    proc = cli("ls", "--json", "--runs-dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    return {r["run_id"]: r for r in json.loads(proc.stdout)}


def started(proc: subprocess.CompletedProcess) -> tuple[str, Path]:
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("run ") and " started in " in first, proc.stdout
    run_id = first.split()[1]
    run_dir = Path(first.split(" started in ")[1].split(" (process")[0])
    return run_id, run_dir


def test_a_detached_run_goes_on_alone_and_stop_ends_it_with_its_report(tmp_path: Path):
    wf = workflow(tmp_path, agents=6, tokens_per_s=10, max_tokens=200)
    t0 = time.monotonic()
    run_id, run_dir = started(cli("run", str(wf), "--detach"))
    assert time.monotonic() - t0 < 30  # returned at once, not at the run's end (6 x 20 s of tokens)
    pid = read_supervisor(run_dir)["pid"]
    assert os.getsid(pid) == pid  # a session of its own: no terminal's SIGHUP reaches it
    assert ls(tmp_path)[run_id]["state"] == "live"
    os.kill(pid, signal.SIGHUP)  # what an SSH drop sends a process still tied to the terminal: ignored
    events = wait_until(lambda: [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
                               if '"TokenDelta"' not in x and '"FirstToken"' in x], "tokens to flow")
    assert events and ls(tmp_path)[run_id]["state"] == "live"
    # a client that attaches now gets the past first: from RunStarted on
    watcher = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "attach", run_id, "--jsonl", "--runs-dir",
                                str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = watcher.stdout.readline()  # attached: the replay has begun
    stopped = cli("stop", run_id, "--runs-dir", str(tmp_path / "runs"))
    assert stopped.returncode == 0, stopped.stderr
    assert f"run {run_id} stopped" in stopped.stdout and "report.json" in stopped.stdout
    out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    kinds = [json.loads(line)["event"] for line in (first + out).splitlines()]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["run_id"] == run_id and report["totals"]["cancelled"] >= 1
    wait_until(lambda: subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0,
             "the run's process to end")
    assert ls(tmp_path)[run_id]["state"] == "resumable"
    gone = cli("stop", run_id, "--runs-dir", str(tmp_path / "runs"))
    assert gone.returncode == 1 and f"run {run_id} is resumable: nothing to stop" in gone.stderr
    newest = cli("stop", "--runs-dir", str(tmp_path / "runs"))
    assert newest.returncode == 1 and f"no live run to stop under {tmp_path / 'runs'}" in newest.stderr


def test_a_killed_supervisor_is_a_crashed_run_that_resumes(tmp_path: Path):
    wf = workflow(tmp_path, agents=3, tokens_per_s=40, max_tokens=40)
    run_id, run_dir = started(cli("run", str(wf), "--detach", "--mode", "sequential"))
    wait_until(lambda: '"status": "completed"' in (run_dir / "events.jsonl").read_text()
             or '"status":"completed"' in (run_dir / "events.jsonl").read_text(), "a first agent to complete")
    os.kill(read_supervisor(run_dir)["pid"], signal.SIGKILL)
    wait_until(lambda: ls(tmp_path)[run_id]["state"] == "crashed", "the run to show as crashed")
    resumed = cli("run", str(wf), "--resume", run_id, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    info = ls(tmp_path)[run_id]
    assert info["state"] == "finished" and info["done"] == info["total"] == 3
    # a console opening it read-only sees the resumed run as it ended, not the crashed one's leftovers
    from cerevisor_tui.engine.sinks.journal import read_records
    from cerevisor_tui.ui.mirror import RunMirror

    mirror = RunMirror()
    mirror.feed_records(read_records(run_dir)[0])
    assert {a.name: a.status for a in mirror.agents.values()} == {"a0": "completed", "a1": "completed",
                                                                   "a2": "completed"}
    assert mirror.finished is not None and mirror.finished.exit_code == 0
    assert not [note for note in mirror.notes.values() if "cancel" in note]


def test_detach_says_what_is_wrong_before_it_starts_anything(tmp_path: Path):
    wf = workflow(tmp_path)
    wf.write_text(wf.read_text().replace("max_concurrency = 2", "max_concurrency = -2"))
    proc = cli("run", str(wf), "--detach")
    assert proc.returncode == 2 and "max_concurrency" in proc.stderr and str(wf) in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    none = cli("attach", "--jsonl", "--runs-dir", str(tmp_path / "runs"))
    assert none.returncode == 1 and "no runs under" in none.stderr
