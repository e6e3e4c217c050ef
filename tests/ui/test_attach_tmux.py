"""Consoles attached to a detached run, in real terminals (tmux): an SSH drop (the tmux session killed) is a
detach, and a console attached again shows the run whole; two consoles on one run see each other's commands;
stopping from one console, or with `cerevisor-tui stop`, ends the run for all of them with its report written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_here
from tests.test_detach import workflow
from tests.ui.test_tmux import SCRIPT, TMUX, Terminal

pytestmark = [pytest.mark.skipif(TMUX is None or not SCRIPT.exists(),
                                 reason="needs tmux (apt-get install tmux) and the installed cerevisor-tui script"),
              pytest.mark.end_to_end]  # a real terminal and real processes, on the wall clock


def env(tmp_path: Path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "TERM": "xterm-256color", "PATH": os.environ.get("PATH", "")}


def detached_run(tmp_path: Path, agents: int = 4, tokens_per_s: float = 25.0, max_tokens: int = 200) -> Path:
    workflow(tmp_path, agents, tokens_per_s, max_tokens, name="agent")
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(tmp_path / "wf.toml"), "--detach"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.split(" started in ")[1].split(" (process")[0])


def journal(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def attach(tmp_path: Path, run_dir: Path) -> Terminal:
    term = Terminal(tmp_path)
    term.start(f"{SCRIPT} attach {run_dir}", env(tmp_path))
    return term


def test_an_ssh_drop_is_a_detach_and_a_new_console_shows_the_whole_run(tmp_path: Path):
    # 6 agents, 2 at a time, 5 s each. The first console pauses admissions before it drops, so however slow the
    # host, agents are still queued when the second console attaches, and the run goes on only when it resumes.
    run_dir = detached_run(tmp_path, agents=6, tokens_per_s=40.0)
    first = attach(tmp_path, run_dir)
    second = None
    try:
        first.wait(lambda s: "streaming" in s, 15.0, "agents streaming in the first console")
        first.keys("p")
        first.wait(lambda s: "PAUSED" in s, 10.0, "the pause in the first console")
        first.close()  # the terminal is gone, as with an SSH drop: the console detaches, the run goes on
        second = attach(tmp_path, run_dir)
        # the new console shows the run from its start, paused as the first console left it, agents still queued
        second.wait(lambda s: "PAUSED" in s and "agent0" in s and re.search(r"\b[1-9] queued", s) is not None, 15.0,
                    "the run in a new console")
        second.keys("p")  # resumed from the new console: the queued agents run
        screen = second.wait(lambda s: "FINISHED" in s, 60.0, "the run to finish")
        assert "6 done" in screen
        assert "SIMULATED" in screen.splitlines()[0]  # the run's own endpoints say so: attach has no config
        finished = {e["agent"]: e["status"] for e in journal(run_dir) if e["event"] == "AgentFinished"}
        assert finished == {f"agent{i}": "completed" for i in range(6)}  # nothing was cancelled by the drop
    finally:
        first.close()
        if second is not None:
            second.close()


def test_two_consoles_share_one_run_and_either_may_stop_it(tmp_path: Path):
    run_dir = detached_run(tmp_path, agents=6, tokens_per_s=10)
    one, two = attach(tmp_path, run_dir), None
    try:
        one.wait(lambda s: "streaming" in s and "PARALLEL" in s, 15.0, "the first console")
        two = attach(tmp_path, run_dir)
        two.wait(lambda s: "streaming" in s and "PARALLEL" in s, 15.0, "the second console")
        one.keys("m")  # parallel -> auto, in the first console
        two.wait(lambda s: "AUTO" in s, 10.0, "the mode change in the second console")
        two.keys("q")
        two.wait(lambda s: "Detach (d)" in s and "Stop run (s)" in s, 5.0, "the leave dialog")
        two.keys("s")  # stop the run, for every console
        left = two.wait(lambda s: "EXIT:1" in s, 15.0, "the second console to exit with the run's code")
        # it says what happened and where the report is
        said = left.replace("\n", "")
        assert f"stopped (stopped from an attached console), exit code 1; report: {run_dir / 'report.json'}" in said, left
        one.wait(lambda s: "FINISHED" in s, 15.0, "the first console to see the run end")
        report = json.loads((run_dir / "report.json").read_text())
        assert report["totals"]["cancelled"] >= 1
        assert journal(run_dir)[-1]["event"] == "RunFinished"
    finally:
        one.close()
        if two is not None:
            two.close()


def test_stop_from_the_command_line_ends_the_run_for_an_attached_console(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]):
    run_dir = detached_run(tmp_path, agents=4, tokens_per_s=10)
    term = attach(tmp_path, run_dir)
    try:
        term.wait(lambda s: "streaming" in s, 15.0, "agents streaming")
        stop = cli_here(capsys, "stop", str(run_dir))  # the command's own entry, in this process: a socket client
        assert stop.returncode == 0, stop.stderr
        term.wait(lambda s: "FINISHED" in s, 15.0, "the console to see the run end")
        term.keys("q")  # nothing runs any more: q leaves at once, with the run's code
        term.wait(lambda s: "EXIT:1" in s, 10.0, "the console to exit")
    finally:
        term.close()


def test_stopping_a_gateway_from_its_console_says_it_stopped_and_where_its_report_is(tmp_path: Path):
    """It used to leave `... it goes on without this terminal` on the screen, though it had stopped, and no report."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_dir = tmp_path / "gw"
    term = Terminal(tmp_path)
    try:
        term.start(f"{SCRIPT} gateway --listen 127.0.0.1:{port} --run-dir {run_dir}", env(tmp_path))
        term.wait(lambda s: f"127.0.0.1:{port}" in s and "GATEWAY" in s.upper() and "sessions" in s, 30.0,
                  "the gateway's console")
        term.keys("q")
        term.wait(lambda s: "Stop run (s)" in s, 10.0, "the leave dialog")
        term.keys("s")
        left = term.wait(lambda s: "EXIT:" in s, 30.0, "the console to exit")
    finally:
        term.close()
    said = left.replace("\n", "")
    assert "goes on without this" not in said, left
    assert "gateway run " in said and "stopped (stopped from an attached console)" in said, left
    assert f"report: {run_dir / 'report.json'}" in said, left


def test_stop_and_attach_without_a_run_ask_which_when_several_of_yours_are_live(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]):
    older = detached_run(tmp_path, agents=4, tokens_per_s=5.0, max_tokens=400)
    newer = detached_run(tmp_path, agents=4, tokens_per_s=5.0, max_tokens=400)
    runs = tmp_path / "runs"
    term = Terminal(tmp_path)
    try:
        term.start(f"{SCRIPT} stop --runs-dir {runs}", env(tmp_path))
        screen = term.wait(lambda s: "Stop which? [1-2, Enter: none]" in s, 30.0, "the question")
        assert f"1  {newer.name} (" in screen and f"2  {older.name} (" in screen
        term.keys("2", "Enter")
        screen = term.wait(lambda s: "EXIT:" in s, 60.0, "stop to end")
        assert "EXIT:0" in screen and f"run {older.name} stopped" in screen.replace("\n", "")
    finally:
        term.close()
    attach_term = Terminal(tmp_path)
    try:  # one left: attach names it and opens it, no question
        attach_term.start(f"{SCRIPT} attach --runs-dir {runs}", env(tmp_path))
        attach_term.wait(lambda s: "streaming" in s, 30.0, "the console on the run left")
        attach_term.keys("q")
        attach_term.wait(lambda s: "Detach (d)" in s, 10.0, "the leave dialog")
        attach_term.keys("d")
        left = attach_term.wait(lambda s: "EXIT:" in s, 30.0, "the console to leave").replace("\n", "")
        assert f"attaching to run {newer.name} (" in left and f"run {newer.name} goes on without this console" in left
    finally:
        attach_term.close()
        cli_here(capsys, "stop", str(newer))


def test_a_finished_run_opened_read_only_shows_its_total_from_its_report(tmp_path: Path):
    """Its journal has no token deltas: the load pane's total is the one the run's end told (0 before)."""
    wf = workflow(tmp_path, agents=2, tokens_per_s=200.0, max_tokens=20, name="agent")
    run_dir = tmp_path / "runs" / "done"
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(wf), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    output = json.loads((run_dir / "report.json").read_text())["totals"]["output_tokens"]
    term = attach(tmp_path, run_dir)
    try:
        term.wait(lambda s: f"finished  peak 0.0  total {output}" in s and "sim finished" in s, 20.0,
                  "the read-only console's load pane")
    finally:
        term.close()
