"""Runs that outlive the terminal, through the CLI: `run --detach`, `ls`, `attach --jsonl`, `stop`, and a
killed supervisor resumed with `--resume`. Each run embeds its simulator (endpoint kind "simulated"). The runs
and `attach` of a live run are processes; `ls`, a refused command and `stop` (a client of the run's socket) run
in this process (`cli_here`), without an interpreter's start and imports each."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from cerevisor_tui.supervisor.protocol import read_supervisor
from tests.conftest import cli_here, wait_until


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


def ls(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> dict[str, dict]:
    proc = cli_here(capsys, "ls", "--json", "--runs-dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    return {r["run_id"]: r for r in json.loads(proc.stdout)}


def started(proc: subprocess.CompletedProcess) -> tuple[str, Path]:
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("run ") and " started in " in first, proc.stdout
    run_id = first.split()[1]
    run_dir = Path(first.split(" started in ")[1].split(" (process")[0])
    return run_id, run_dir


@pytest.mark.end_to_end  # a real detached run, attached, stopped or killed and resumed
def test_a_detached_run_goes_on_alone_and_stop_ends_it_with_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    wf = workflow(tmp_path, agents=6, tokens_per_s=10, max_tokens=200)
    t0 = time.monotonic()
    run_id, run_dir = started(cli("run", str(wf), "--detach"))
    assert time.monotonic() - t0 < 30  # returned at once, not at the run's end (6 x 20 s of tokens)
    pid = read_supervisor(run_dir)["pid"]
    assert os.getsid(pid) == pid  # a session of its own: no terminal's SIGHUP reaches it
    assert ls(capsys, tmp_path)[run_id]["state"] == "live"
    os.kill(pid, signal.SIGHUP)  # what an SSH drop sends a process still tied to the terminal: ignored
    events = wait_until(lambda: [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
                               if '"TokenDelta"' not in x and '"FirstToken"' in x], "tokens to flow")
    assert events and ls(capsys, tmp_path)[run_id]["state"] == "live"
    # a client that attaches now gets the past first: from RunStarted on
    watcher = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "attach", run_id, "--jsonl", "--runs-dir",
                                str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = watcher.stdout.readline()  # attached: the replay has begun
    stopped = cli_here(capsys, "stop", run_id, "--runs-dir", str(tmp_path / "runs"))
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
    assert ls(capsys, tmp_path)[run_id]["state"] == "resumable"
    gone = cli_here(capsys, "stop", run_id, "--runs-dir", str(tmp_path / "runs"))
    assert gone.returncode == 1 and f"run {run_id} is resumable: nothing to stop" in gone.stderr
    newest = cli_here(capsys, "stop", "--runs-dir", str(tmp_path / "runs"))
    assert newest.returncode == 1 and f"no live run to stop under {tmp_path / 'runs'}" in newest.stderr


@pytest.mark.end_to_end  # a real detached run, attached, stopped or killed and resumed
def test_a_killed_supervisor_is_a_crashed_run_that_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    wf = workflow(tmp_path, agents=3, tokens_per_s=40, max_tokens=40)
    run_id, run_dir = started(cli("run", str(wf), "--detach", "--mode", "sequential"))
    wait_until(lambda: '"status": "completed"' in (run_dir / "events.jsonl").read_text()
             or '"status":"completed"' in (run_dir / "events.jsonl").read_text(), "a first agent to complete")
    first = read_supervisor(run_dir)
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: ls(capsys, tmp_path)[run_id]["state"] == "crashed", "the run to show as crashed")
    resumed = cli("run", str(wf), "--resume", run_id, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    info = ls(capsys, tmp_path)[run_id]
    assert info["state"] == "finished" and info["done"] == info["total"] == 3
    # ls shows when the run began, not when it was resumed
    again = read_supervisor(run_dir)
    assert again["started_at"] == first["started_at"] and again["resumed_at"] > first["started_at"], (first, again)
    assert info["started"] == datetime.fromtimestamp(first["started_at"]).isoformat(timespec="seconds")
    assert info["resumed"] == datetime.fromtimestamp(again["resumed_at"]).isoformat(timespec="seconds")
    # a console opening it read-only sees the resumed run as it ended, not the crashed one's leftovers
    from cerevisor_tui.engine.sinks.journal import read_events
    from cerevisor_tui.ui.mirror import RunMirror

    mirror = RunMirror()
    for event in read_events(run_dir)[0]:
        mirror(event)
    assert {a.name: a.status for a in mirror.agents.values()} == {"a0": "completed", "a1": "completed",
                                                                   "a2": "completed"}
    assert mirror.finished is not None and mirror.finished.exit_code == 0
    assert not [note for note in mirror.notes.values() if "cancel" in note]


def test_detach_says_what_is_wrong_before_it_starts_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    wf = workflow(tmp_path)
    wf.write_text(wf.read_text().replace("max_concurrency = 2", "max_concurrency = -2"))
    proc = cli_here(capsys, "run", str(wf), "--detach")
    assert proc.returncode == 2 and "max_concurrency" in proc.stderr and str(wf) in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    none = cli_here(capsys, "attach", "--jsonl", "--runs-dir", str(tmp_path / "runs"))
    assert none.returncode == 1 and "no runs under" in none.stderr


def listed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> dict[str, dict]:
    """`ls --json`, by run directory (a copy of a run has the run's id)."""
    proc = cli_here(capsys, "ls", "--json", "--runs-dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    return {Path(r["path"]).name: r for r in json.loads(proc.stdout)}


def test_a_copy_of_a_live_run_directory_is_not_the_live_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A copy (a backup, `cp -r`) names the original's socket in its supervisor.json: it is not live, and `stop
    COPY` does not stop the original."""
    wf = workflow(tmp_path, agents=2, tokens_per_s=10, max_tokens=400)
    run_id, run_dir = started(cli("run", str(wf), "--detach"))
    # its socket answers before its journal says RunStarted: a copy names the run by its journal's run id
    wait_until(lambda: '"RunStarted"' in (run_dir / "events.jsonl").read_text(), "the run's RunStarted")
    copy = run_dir.parent / "copy"
    subprocess.run(["cp", "-r", str(run_dir), str(copy)], check=True)
    runs = listed(capsys, tmp_path)
    assert runs[run_dir.name]["state"] == "live" and runs[run_dir.name]["problem"] == ""
    assert runs["copy"]["state"] == "crashed" and runs["copy"]["pid"] is None, runs["copy"]
    assert f"the socket of the run in {run_dir} (is this directory a copy of it?)" in runs["copy"]["problem"]
    refused = cli_here(capsys, "stop", str(copy))
    assert refused.returncode == 1, refused
    assert f"run {run_id} is crashed: nothing to stop; its socket is the socket of the run in {run_dir}" in \
        refused.stderr
    assert listed(capsys, tmp_path)[run_dir.name]["state"] == "live"
    assert not any(json.loads(line).get("event") == "RunStopping"
                   for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip())
    stopped = cli_here(capsys, "stop", str(run_dir))
    assert stopped.returncode == 0 and f"run {run_id} stopped" in stopped.stdout, stopped


def _journal(run_dir: Path, *, supervisor: str | None = None, run_started: str | None = None) -> None:
    run_dir.mkdir(parents=True)
    started = run_started or json.dumps({"event": "RunStarted", "t": 1.0, "run_id": run_dir.name,
                                         "mode": "parallel", "max_concurrency": 1, "waves": [["a"]],
                                         "endpoints": []})
    (run_dir / "events.jsonl").write_text(started + "\n" + json.dumps(
        {"event": "RunFinished", "t": 2.0, "run_id": run_dir.name, "exit_code": 1,
         "totals": {"agents": 1, "completed": 0, "failed": 1, "killed": 0, "skipped": 0, "cancelled": 0,
                    "output_tokens": 0, "wall_s": 1.0, "output_tokens_per_s": None, "max_running": 1}}) + "\n")
    if supervisor is not None:
        (run_dir / "supervisor.json").write_text(supervisor)


def test_ls_lists_a_run_whose_supervisor_file_does_not_check_as_unreadable_and_the_others_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    runs = tmp_path / "runs"
    good = {"pid": 4242, "socket": str(tmp_path / "gone.sock"), "run_id": "x", "started_at": 1.7e9}
    _journal(runs / "fine", supervisor=json.dumps(good))
    _journal(runs / "none")
    hostile = {
        "inf": '{"pid": 4242, "socket": "s", "started_at": 1e400}',
        "nan": '{"pid": 4242, "socket": "s", "started_at": NaN}',
        "negative": '{"pid": 4242, "socket": "s", "started_at": -1e300}',
        "pid": '{"pid": "4242", "socket": "s"}',
        "nul": '{"pid": 4242, "socket": "a\\u0000b"}',
        "list": "[1, 2]",
        "nested": "[" * 100_000,
    }
    for name, text in hostile.items():
        _journal(runs / name, supervisor=text)
    _journal(runs / "deep", run_started='{"event": "RunStarted", "waves": ' + "[" * 100_000)
    found = listed(capsys, tmp_path)
    assert set(found) == {"fine", "none", "deep", *hostile}
    assert found["fine"]["state"] == found["none"]["state"] == "resumable"
    assert found["fine"]["started"] == datetime.fromtimestamp(1.7e9).isoformat(timespec="seconds")
    assert found["deep"]["total"] == 0  # its RunStarted does not read: no agents known
    for name in hostile:
        assert found[name]["state"] == "unreadable" and found[name]["problem"].startswith("supervisor.json: "), \
            found[name]
    assert "`started_at`" in found["inf"]["problem"] and "`pid`" in found["pid"]["problem"]
    plain = cli_here(capsys, "ls", "--runs-dir", str(runs))
    assert plain.returncode == 0 and "Traceback" not in plain.stderr, plain
    assert len(plain.stdout.splitlines()) == 1 + len(found)
    assert f"cerevisor-tui ls: {runs / 'inf'}: supervisor.json: " in plain.stderr


def test_attach_jsonl_of_a_run_not_live_prints_checked_events_and_counts_what_it_skips(tmp_path: Path):
    wf = workflow(tmp_path, agents=2, tokens_per_s=400, max_tokens=10)
    done = cli("run", str(wf), "--jsonl")
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    journal = run_dir / "events.jsonl"
    good = [line for line in journal.read_text().splitlines() if line.strip()]
    with open(journal, "a") as fh:
        fh.write('{"event": "AgentFinished", "t": "soon", "agent": "a0"}\n')  # a hand edit: a field of the wrong type
        fh.write('{"event": "RunNotice", "t": 9.0, "mess')  # a cut last line
    shown = cli("attach", str(run_dir), "--jsonl")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert [json.loads(line)["event"] for line in lines] == [json.loads(line)["event"] for line in good]
    assert f"2 unreadable lines of {journal} skipped (first: line {len(good) + 1}: " in shown.stderr, shown.stderr


IN_USE = re.compile(r"cerevisor-tui run: run directory (\S+) is in use by another run \(process (\d+)\): wait for it "
                    r"to end or stop it; one process per run directory\n")


def test_a_detach_that_loses_the_run_directory_says_so_as_the_foreground_does(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]):
    """Two `run --detach` on one directory at once: one starts, the other is refused at once, in the foreground's
    words and exit code (2), not with a line of the winner's run.log as its own error."""
    wf = workflow(tmp_path, agents=2, tokens_per_s=10, max_tokens=400)
    run_dir = tmp_path / "runs" / "shared"
    both = [subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", str(wf), "--detach", "--run-dir",
                              str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    ends = sorted(((p.wait(timeout=90), *p.communicate()) for p in both), key=lambda end: end[0])
    (won, won_out, _), (lost, lost_out, lost_err) = ends
    assert (won, lost) == (0, 2), ends
    pid = read_supervisor(run_dir)["pid"]
    assert IN_USE.fullmatch(lost_err) and lost_out == "", lost_err
    foreground = cli("run", str(wf), "--run-dir", str(run_dir))
    assert foreground.returncode == 2 and foreground.stderr == f"cerevisor-tui run: run directory {run_dir} is in use " \
        f"by another run (process {pid}): wait for it to end or stop it; one process per run directory\n", foreground
    again = cli("run", str(wf), "--detach", "--run-dir", str(run_dir))  # and so does a detach after it
    assert (again.returncode, again.stderr) == (2, foreground.stderr), again
    assert (run_dir / "lock").read_text() == f"{pid}\n"  # the run's own process holds the lock it was handed
    stopped = cli_here(capsys, "stop", str(run_dir))
    assert stopped.returncode == 0, stopped


@pytest.mark.end_to_end  # two real detached runs, stopped
def test_stop_without_a_run_names_the_one_it_stops_and_with_several_refuses_to_guess_unless_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """On a shared account `stop` picked the newest live run, a colleague's maybe, and said nothing first."""
    wf = workflow(tmp_path, agents=4, tokens_per_s=5, max_tokens=400)
    older, _ = started(cli("run", str(wf), "--detach"))
    newer, _ = started(cli("run", str(wf), "--detach"))
    runs = str(tmp_path / "runs")
    asked = subprocess.run([sys.executable, "-m", "cerevisor_tui", "stop", "--runs-dir", runs],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert asked.returncode == 1 and "2 live runs of yours" in asked.stderr and "--yes" in asked.stderr, asked.stderr
    listed = [line.split()[1] for line in asked.stderr.splitlines() if line.startswith("  ")]
    assert listed == [newer, older]  # newest first, each named
    assert "started " in asked.stderr and " by " in asked.stderr  # who started it: what tells people apart
    assert {ls(capsys, tmp_path)[r]["state"] for r in (older, newer)} == {"live"}  # nothing was stopped
    newest = cli_here(capsys, "stop", "--yes", "--runs-dir", runs)
    assert newest.returncode == 0, newest.stderr
    assert f"stopping run {newer} (" in newest.stderr and "1 other live run(s) of yours go on" in newest.stderr
    assert f"run {newer} stopped" in newest.stdout
    last = cli_here(capsys, "stop", "--runs-dir", runs)  # one left: named, then stopped, no question
    assert last.returncode == 0 and f"stopping run {older} (" in last.stderr and f"run {older} stopped" in last.stdout


def test_a_run_is_its_owners_by_the_uid_of_its_files_and_says_who_started_it(tmp_path: Path):
    import pytest

    from cerevisor_tui.supervisor.runs import run_info

    wf = workflow(tmp_path, agents=1, max_tokens=5)
    proc = cli("run", str(wf), "--run-dir", str(tmp_path / "runs" / "r"))
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "r"
    info = run_info(run_dir)
    assert info is not None and info.mine and info.uid == os.getuid() and info.by  # `root`, `alice from 10.0.0.5`
    if os.getuid() != 0:
        pytest.skip("giving the files to another user needs root")
    for name in ("supervisor.json", "events.jsonl"):
        os.chown(run_dir / name, 65534, 65534)
    other = run_info(run_dir)
    assert other is not None and not other.mine and other.uid == 65534
