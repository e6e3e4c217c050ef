"""The console in a real terminal (tmux): a fresh start shows the simulator's agents streaming within
5 s, `m` changes the mode badge, `q` then "stop the run" exits (1: its agents were cancelled) and leaves the
terminal as it found it; the exit code is the run's; and a terminal that goes away (`tmux kill-session`,
what an SSH drop does) ends the console within 5 s while its run, in a process of its own, goes on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from cerevisor_tui.supervisor.runs import run_info
from tests.conftest import wait_until

TMUX = shutil.which("tmux")
SCRIPT = Path(sys.executable).with_name("cerevisor-tui")

pytestmark = [pytest.mark.skipif(TMUX is None or not SCRIPT.exists(),
                                 reason="needs tmux (apt-get install tmux) and the installed cerevisor-tui script"),
              pytest.mark.end_to_end]  # a real terminal and real processes, on the wall clock


class Terminal:
    """One tmux pane on a private tmux server, 100x30."""

    def __init__(self, tmp_path: Path) -> None:
        self.socket = f"cerevisor-test-{uuid.uuid4().hex[:8]}"
        self.tmp = tmp_path

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    def start(self, command: str, env: dict[str, str], *, then: str = "echo EXIT:$?; sleep 60") -> None:
        """`command` in the pane's shell, then `then` (with `then=""`, the command replaces the shell)."""
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        run = f"env -u CEREVISOR_TUI_CONFIG {exports} {command}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "100", "-y", "30",
                  f"cd {self.tmp} && {run}; {then}" if then else f"cd {self.tmp} && exec {run}")

    def pane_pid(self) -> int:
        return int(self.tmux("display", "-p", "-t", "t", "#{pane_pid}"))

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def wait(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        shown = [""]

        def screen_shows() -> str | None:
            shown[0] = self.screen()
            return shown[0] if predicate(shown[0]) else None

        return wait_until(screen_shows, lambda: f"{what}; the screen:\n{shown[0]}", timeout=timeout, interval=0.1)

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def test_fresh_console_streams_switches_mode_and_quits_cleanly(tmp_path):
    term = Terminal(tmp_path)
    env = {"XDG_CONFIG_HOME": tmp_path / "config", "XDG_STATE_HOME": tmp_path / "state", "TERM": "xterm-256color",
           "PATH": os.environ.get("PATH", "")}
    try:
        # how fast it starts is benchmarks/startup.py's to measure, not a wall-clock assert's on a shared machine
        term.start(str(SCRIPT), {k: str(v) for k, v in env.items()})
        screen = term.wait(lambda s: "streaming" in s and "SIMULATED" in s, 60.0, "agent streaming")
        assert "PARALLEL" in screen

        term.keys("p")  # hold the second wave, so agents are still waiting to run when we quit
        term.wait(lambda s: "PAUSED" in s, 20.0, "paused badge")
        term.keys("m")
        screen = term.wait(lambda s: "AUTO" in s.splitlines()[1], 20.0, "AUTO mode badge")
        assert "PARALLEL" not in screen.splitlines()[1]

        term.keys("q")  # the run lives in a process of its own: leave it running (d) or stop it (s)
        term.wait(lambda s: "have not finished" in s and "Detach (d)" in s, 20.0, "leave dialog")
        term.keys("s")
        screen = term.wait(lambda s: "EXIT:" in s, 30.0, "exit")
        assert "EXIT:1" in screen  # the run's code: its agents did not all complete (they were cancelled)
        # the terminal is restored: main screen, cursor shown, no mouse reporting, nothing of the app left
        flags = term.tmux("display", "-p", "-t", "t", "#{alternate_on} #{cursor_flag} #{mouse_any_flag}").split()
        assert flags == ["0", "1", "0"]
        # nothing of the app left, only what became of its run: stopped, and where its report is
        said = "".join(line for line in screen.splitlines() if line.strip())
        runs = list((tmp_path / "state" / "cerevisor-tui" / "runs").iterdir())
        assert said == (f"run {runs[0].name} stopped (stopped from an attached console), exit code 1; report: "
                        f"{runs[0] / 'report.json'}EXIT:1"), screen
    finally:
        term.close()

    assert len(runs) == 1
    assert (runs[0] / "events.jsonl").stat().st_size > 0 and (runs[0] / "report.json").is_file()
    assert json.loads((runs[0] / "events.jsonl").read_text().splitlines()[-1])["event"] == "RunFinished"
    assert list((runs[0] / "transcripts").glob("*.jsonl"))


def env_for(tmp_path: Path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "TERM": "xterm-256color", "PATH": os.environ.get("PATH", "")}


def workflow(tmp_path: Path, *, sim: str, agents: str) -> Path:
    """A config on the built-in simulator whose runs go to tmp_path/runs."""
    path = tmp_path / "team.toml"
    path.write_text(f'''
[run]
mode = "parallel"
max_concurrency = 4
run_dir = "{tmp_path / 'runs'}"
warmup = "off"

[[endpoints]]
name = "sim"
kind = "simulated"
[endpoints.sim]
seed = 3
ttft_s = 0.05
{sim}
{agents}''')
    return path


def run_dir(tmp_path: Path) -> Path:
    found = list((tmp_path / "runs").iterdir())
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("case, agents, exit_code", [
    pytest.param("one agent fails", '''
[[agents]]
name = "fails"
prompt = "hi"
max_tokens = 8
retries = 0
[[agents]]
name = "completes"
prompt = "hi"
max_tokens = 8
depends_on = ["fails"]
''', 1, id="failed-1"),
    pytest.param("every agent completes", '''
[[agents]]
name = "completes"
prompt = "hi"
max_tokens = 8
''', 0, id="completed-0"),
])
def test_the_console_exits_with_the_runs_code(tmp_path, case, agents, exit_code):
    # fail_first: the endpoint's first request answers HTTP 500; with retries = 0 that agent fails and its
    # dependent is skipped
    config = workflow(tmp_path, sim="tokens_per_s = 400.0\nfail_first = 1" if exit_code else "tokens_per_s = 400.0",
                      agents=agents)
    term = Terminal(tmp_path)
    try:
        term.start(f"{SCRIPT} --config {config}", env_for(tmp_path))
        term.wait(lambda s: "FINISHED" in s, 60.0, "the run's end")
        term.keys("q")  # the run is over: no question
        screen = term.wait(lambda s: "EXIT:" in s, 30.0, "exit")
    finally:
        term.close()
    assert f"EXIT:{exit_code}" in screen, case
    statuses = {a["name"]: a["status"] for a in json.loads((run_dir(tmp_path) / "report.json").read_text())["agents"]}
    assert statuses == ({"fails": "failed", "completes": "skipped"} if exit_code else {"completes": "completed"})


def process_state(pid: int) -> str:
    """The process's state letter ("Z": exited, not yet reaped by its new parent), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


SLOW_AGENTS = '''
[[agents]]
name = "a"
prompt = "go"
max_tokens = 4000
[[agents]]
name = "b"
prompt = "go"
max_tokens = 4000
'''


@pytest.mark.parametrize("shell", [
    "exec",  # the console is the session leader: the hang-up sends it SIGHUP (and SIGCONT)
    "child",  # a child of a shell that ignores SIGHUP: no signal at all, only a tty that stopped answering
])
def test_tmux_kill_session_ends_the_console_within_5_s_and_its_run_goes_on(tmp_path, shell):
    """An SSH drop: the console ends (a detach), its run, in a process of its own, does not; `stop` ends it."""
    config = workflow(tmp_path, sim="tokens_per_s = 5.0", agents=SLOW_AGENTS)
    term = Terminal(tmp_path)
    rc_file = tmp_path / "rc"
    try:
        if shell == "exec":
            term.start(f"{SCRIPT} --config {config}", env_for(tmp_path), then="")
        else:
            term.tmux("new-session", "-d", "-s", "t", "-x", "100", "-y", "30",
                      f"trap '' HUP; cd {tmp_path} && env -u CEREVISOR_TUI_CONFIG "
                      + " ".join(f"{k}={v}" for k, v in env_for(tmp_path).items())
                      + f" {SCRIPT} --config {config}; echo $? > {rc_file}")
        term.wait(lambda s: s.count("streaming") >= 2, 60.0, "both agents streaming")
        shell_pid = term.pane_pid()
        if shell == "exec":
            pid = shell_pid
        else:
            children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(shell_pid)], capture_output=True,
                                      text=True, check=True).stdout.split()
            pid = next(int(c) for c in children if "cerevisor" in Path(f"/proc/{c}/cmdline").read_text())
        assert process_state(pid) not in ("", "Z")
        term.tmux("kill-session", "-t", "t")
        killed = time.monotonic()
        while process_state(pid) not in ("", "Z") and time.monotonic() - killed < 10.0:
            time.sleep(0.05)
        gone_after_s = time.monotonic() - killed
    finally:
        term.close()
    assert gone_after_s < 5.0, f"the console was still there {gone_after_s:.1f} s after its terminal went"
    run = run_info(run_dir(tmp_path))
    assert run is not None and run.state == "live"
    assert not [line for line in (run.path / "events.jsonl").read_text().splitlines() if "cancelled" in line]
    stop = subprocess.run([sys.executable, "-m", "cerevisor_tui", "stop", str(run.path)], capture_output=True,
                          text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    report = json.loads((run.path / "report.json").read_text())
    assert report["finished_at"] and {a["status"] for a in report["agents"]} == {"cancelled"}
    if shell == "child":
        # the shell survives the hang-up and records the console's exit code: 129, as for SIGHUP
        wait_until(rc_file.exists, "the shell to record the console's exit code", timeout=5.0)
        assert rc_file.read_text().strip() == "129"
