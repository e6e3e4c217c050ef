"""A run is never stopped by its own output: stdout closed under it (`| head`, a dead `tee`, a closed terminal)
or a subscriber that raises. The run finishes, its journal ends with RunFinished and its report is written; the
commands that only print (`ls`, `attach --jsonl`) end quietly when their reader goes away."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from cerevisor_tui.cli import PIPE_CLOSED
from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from tests.conftest import cli_here, wait_until

CLI = [sys.executable, "-m", "cerevisor_tui"]


def workflow(path: Path, *, agents: int = 2, max_tokens: int = 40, extra: str = "", endless: bool = False,
             tokens_per_s: float = 40.0) -> Path:
    """A workflow on the built-in simulator; `endless`: its answers take far longer than any test (it is stopped):
    200 tokens at 2 a second, the first in half a second."""
    if endless:
        tokens_per_s, max_tokens = 2.0, 200
    sim = f"[endpoints.sim]\ntokens_per_s = {tokens_per_s}\n"
    lines = [f'[run]\nmode = "parallel"\nmax_concurrency = {agents}\n{extra}'
             f'[[endpoints]]\nname = "box"\nkind = "simulated"\n{sim}']
    lines += [f'[[agents]]\nname = "a{i}"\nprompt = "task {i}"\nmax_tokens = {max_tokens}\n' for i in range(agents)]
    path.write_text("\n".join(lines))
    return path


def closed_pipe() -> int:
    """The write end of a pipe whose reader has gone already: every write to it is EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return w


def journal(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def assert_finished(run_dir: Path, *, completed: int | None = None, cancelled: int | None = None) -> dict:
    """The run ended as a run ends: RunFinished last in its journal, its report written, and `ls` (its list of
    runs, asked in this process) does not call it crashed (finished; resumable when it was stopped with agents
    left)."""
    from cerevisor_tui.supervisor.runs import list_runs

    records = journal(run_dir)
    assert records[-1]["event"] == "RunFinished", records[-1]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["finished_at"] is not None
    if completed is not None:
        assert report["totals"]["completed"] == completed
    if cancelled is not None:
        assert report["totals"]["cancelled"] == cancelled
    assert {r.run_id: r.state for r in list_runs(run_dir.parent)}[records[-1]["run_id"]] == (
        "resumable" if cancelled else "finished")
    return report


def test_a_run_piped_into_head_finishes_with_its_report_and_its_lines_go_on_in_run_log(tmp_path):
    # a second of lines after the first: head has long gone
    cfg = workflow(tmp_path / "w.toml", tokens_per_s=20, max_tokens=20)
    run_dir = tmp_path / "runs" / "r1"
    proc = subprocess.run(["bash", "-c", '"$@" | head -1; exit "${PIPESTATUS[0]}"', "run", *CLI, "run", str(cfg),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr
    assert proc.stdout.count("\n") == 1 and "run " in proc.stdout  # head's one line
    assert_finished(run_dir, completed=2)
    log = (run_dir / "run.log").read_text()
    assert "its output was lost (Broken pipe); the run goes on" in log
    assert "finished: 2/2 completed" in log  # the final line, where its output would have been


@pytest.mark.parametrize("jsonl", [False, True], ids=["lines", "jsonl"])
def test_a_run_whose_stdout_is_closed_from_the_start_completes_without_a_traceback(tmp_path, jsonl):
    cfg = workflow(tmp_path / "w.toml", tokens_per_s=400)  # every line it writes fails, however soon
    run_dir = tmp_path / "runs" / "r1"
    w = closed_pipe()
    try:
        proc = subprocess.run([*CLI, "run", str(cfg), "--run-dir", str(run_dir), *(["--jsonl"] if jsonl else [])],
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a word: the closed output is no error of the run's
    assert_finished(run_dir, completed=2)
    # --jsonl is for a program, which stopped reading: its events are in the journal, not spilled into run.log
    assert (run_dir / "run.log").exists() is not jsonl


def test_a_foreground_run_whose_terminal_closes_stops_and_writes_its_report(tmp_path):
    """An SSH drop in the foreground: the pty closes under the run (SIGHUP, then EIO on every write)."""
    cfg = workflow(tmp_path / "w.toml", endless=True)
    run_dir = tmp_path / "runs" / "r1"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the run, its terminal the pty
        os.execv(sys.executable, [*CLI, "run", str(cfg), "--run-dir", str(run_dir)])
    seen = b""
    try:
        while seen.count(b"first token") < 2:  # both agents streaming
            seen += os.read(fd, 4096)
    finally:
        os.close(fd)  # the terminal goes away
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 129  # stopped by SIGHUP, as README says
    report = assert_finished(run_dir, cancelled=2)
    assert {a["status"] for a in report["agents"]} == {"cancelled"}
    log = (run_dir / "run.log").read_text()
    assert "its output was lost" in log and "2 cancelled" in log


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--json"], ["attach", "--jsonl"]], ids=" ".join)
def test_ls_and_attach_jsonl_into_a_closed_pipe_end_quietly(tmp_path, capsys, argv):
    cfg = workflow(tmp_path / "w.toml", agents=1, max_tokens=4, tokens_per_s=400)
    run_dir = tmp_path / "runs" / "r1"
    assert cli_here(capsys, "run", str(cfg), "--run-dir", str(run_dir)).returncode == 0  # a run to list: here
    where = ["--runs-dir", str(run_dir.parent)] if argv[0] == "ls" else [str(run_dir)]
    w = closed_pipe()
    try:
        proc = subprocess.run([*CLI, *argv, *where], stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert (proc.returncode, proc.stderr) == (PIPE_CLOSED, "")


def test_attach_jsonl_of_a_live_run_into_a_closed_pipe_ends_quietly_and_the_run_goes_on(tmp_path, capsys):
    cfg = workflow(tmp_path / "w.toml", agents=1, endless=True)
    run_dir = tmp_path / "runs" / "r1"
    run = subprocess.Popen([*CLI, "run", str(cfg), "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (run_dir / "supervisor.json").exists() and b"FirstToken" in
                   (run_dir / "events.jsonl").read_bytes(), "the run's first token")
        w = closed_pipe()
        try:
            proc = subprocess.run([*CLI, "attach", str(run_dir), "--jsonl"], stdout=w, stderr=subprocess.PIPE,
                                  text=True, timeout=60)
        finally:
            os.close(w)
        assert (proc.returncode, proc.stderr) == (PIPE_CLOSED, "")
        assert run.poll() is None  # the run is not the attach's to end
        cli_here(capsys, "stop", str(run_dir))  # a client of the run's socket: here
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert "Traceback" not in err
    assert_finished(run_dir, cancelled=1)


@pytest.mark.anyio
async def test_a_subscriber_that_raises_never_ends_the_run_it_is_said_once_and_kept_or_dropped_by_its_failure():
    """One raising a value error on every token delta (the hot path) and every AgentStarted is kept for what it can
    take; one whose output is gone (an OSError) is dropped. The run completes and tells each once."""
    config = validate({"run": {"max_concurrency": 2},
                       "endpoints": [{"name": "box", "kind": "simulated"}],
                       "agents": [{"name": f"a{i}", "prompt": "p", "max_tokens": 20} for i in range(2)]})
    engine = Engine(config)
    heard: list[ev.Event] = []
    kept: list[str] = []
    gone: list[str] = []

    def fussy(event: ev.Event) -> None:
        kept.append(event.kind)
        if event.kind in ("TokenDelta", "AgentStarted"):
            raise KeyError(event.kind)

    def dead_pipe(event: ev.Event) -> None:
        gone.append(event.kind)
        if event.kind == "AgentQueued":
            raise BrokenPipeError(32, "Broken pipe")

    for subscriber in (fussy, dead_pipe, heard.append):
        engine.subscribe(subscriber)
    with anyio.fail_after(120):
        code = await engine.run()
    assert code == 0
    assert [e.status for e in heard if isinstance(e, ev.AgentFinished)] == ["completed", "completed"]
    notices = [e.message for e in heard if isinstance(e, ev.RunNotice) and e.title == "A subscriber failed"]
    assert len(notices) == 2, notices
    assert any("fussy failed on" in n and "it keeps the events it can take" in n for n in notices)
    assert any("dead_pipe failed on AgentQueued (BrokenPipeError" in n and "dropped" in n for n in notices)
    assert kept.count("TokenDelta") > 2 and kept[-1] == "RunFinished"  # kept: it heard the run to its end
    assert gone.count("AgentQueued") == 1 and "RunFinished" not in gone  # dropped at its first failure
    assert engine.bus.failures[id(fussy)] > 3  # counted, said once
