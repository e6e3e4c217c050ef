"""Consoles attached to a detached run, in real terminals (tmux): an SSH drop (the tmux session killed) is a
detach, and a console attached again shows the run whole; two consoles on one run see each other's commands;
stopping from one console, or with `cerevisor-tui stop`, ends the run for all of them with its report written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    run_dir = detached_run(tmp_path, tokens_per_s=40.0)  # two waves of 5 s: still streaming when the second attaches
    first = attach(tmp_path, run_dir)
    second = None
    try:
        first.wait(lambda s: "streaming" in s, 15.0, "agents streaming in the first console")
        first.close()  # the terminal is gone, as with an SSH drop: the console detaches, the run goes on
        second = attach(tmp_path, run_dir)
        # the new console shows the run from its start: the first agents' answers and the ones still streaming
        second.wait(lambda s: "streaming" in s and "agent0" in s and "agent3" in s, 15.0, "the run in a new console")
        screen = second.wait(lambda s: "FINISHED" in s, 60.0, "the run to finish")
        assert "4 done" in screen
        assert "SIMULATED" in screen.splitlines()[0]  # the run's own endpoints say so: attach has no config
        finished = {e["agent"]: e["status"] for e in journal(run_dir) if e["event"] == "AgentFinished"}
        assert finished == {f"agent{i}": "completed" for i in range(4)}  # nothing was cancelled by the drop
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
        two.wait(lambda s: "EXIT:1" in s, 15.0, "the second console to exit with the run's code")
        one.wait(lambda s: "FINISHED" in s, 15.0, "the first console to see the run end")
        report = json.loads((run_dir / "report.json").read_text())
        assert report["totals"]["cancelled"] >= 1
        assert journal(run_dir)[-1]["event"] == "RunFinished"
    finally:
        one.close()
        if two is not None:
            two.close()


def test_stop_from_the_command_line_ends_the_run_for_an_attached_console(tmp_path: Path):
    run_dir = detached_run(tmp_path, agents=4, tokens_per_s=10)
    term = attach(tmp_path, run_dir)
    try:
        term.wait(lambda s: "streaming" in s, 15.0, "agents streaming")
        stop = subprocess.run([sys.executable, "-m", "cerevisor_tui", "stop", str(run_dir)], capture_output=True,
                              text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        term.wait(lambda s: "FINISHED" in s, 15.0, "the console to see the run end")
        term.keys("q")  # nothing runs any more: q leaves at once, with the run's code
        term.wait(lambda s: "EXIT:1" in s, 10.0, "the console to exit")
    finally:
        term.close()
