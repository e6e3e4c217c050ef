"""The console in a real terminal (tmux): a fresh start shows the simulator's agents streaming within
5 s, `m` changes the mode badge, `q` then confirm exits 0 and leaves the terminal as it found it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

TMUX = shutil.which("tmux")
SCRIPT = Path(sys.executable).with_name("cerevisor-tui")

pytestmark = pytest.mark.skipif(TMUX is None or not SCRIPT.exists(),
                                reason="needs tmux (apt-get install tmux) and the installed cerevisor-tui script")


class Terminal:
    """One tmux pane on a private tmux server, 100x30."""

    def __init__(self, tmp_path: Path) -> None:
        self.socket = f"cerevisor-test-{uuid.uuid4().hex[:8]}"
        self.tmp = tmp_path

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    def start(self, command: str, env: dict[str, str]) -> None:
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        self.tmux("new-session", "-d", "-s", "t", "-x", "100", "-y", "30",
                  f"cd {self.tmp} && env -u CEREVISOR_TUI_CONFIG {exports} {command}; echo EXIT:$?; sleep 60")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def wait(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        end = time.monotonic() + timeout
        while True:
            text = self.screen()
            if predicate(text):
                return text
            if time.monotonic() > end:
                raise AssertionError(f"no {what} within {timeout} s; the screen:\n{text}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def test_fresh_console_streams_switches_mode_and_quits_cleanly(tmp_path):
    term = Terminal(tmp_path)
    env = {"XDG_CONFIG_HOME": tmp_path / "config", "XDG_STATE_HOME": tmp_path / "state", "TERM": "xterm-256color",
           "PATH": os.environ.get("PATH", "")}
    try:
        started = time.monotonic()
        term.start(str(SCRIPT), {k: str(v) for k, v in env.items()})
        screen = term.wait(lambda s: "streaming" in s and "SIMULATED" in s, 5.0, "agent streaming")
        assert time.monotonic() - started < 5.0
        assert "PARALLEL" in screen

        term.keys("p")  # hold the second wave, so agents are still waiting to run when we quit
        term.wait(lambda s: "PAUSED" in s, 3.0, "paused badge")
        term.keys("m")
        screen = term.wait(lambda s: "AUTO" in s.splitlines()[1], 3.0, "AUTO mode badge")
        assert "PARALLEL" not in screen.splitlines()[1]

        term.keys("q")
        term.wait(lambda s: "have not finished" in s, 3.0, "quit confirmation")
        term.keys("y")
        screen = term.wait(lambda s: "EXIT:" in s, 10.0, "exit")
        assert "EXIT:0" in screen
        # the terminal is restored: main screen, cursor shown, no mouse reporting, nothing of the app left
        flags = term.tmux("display", "-p", "-t", "t", "#{alternate_on} #{cursor_flag} #{mouse_any_flag}").split()
        assert flags == ["0", "1", "0"]
        assert [line for line in screen.splitlines() if line.strip()] == ["EXIT:0"]
    finally:
        term.close()

    runs = list((tmp_path / "state" / "cerevisor-tui" / "runs").iterdir())
    assert len(runs) == 1
    assert (runs[0] / "events.jsonl").stat().st_size > 0 and (runs[0] / "report.json").is_file()
    assert list((runs[0] / "transcripts").glob("*.jsonl"))
