"""The inbox's alert reaches a real terminal: the console in a pseudo-terminal writes the bell and the OSC 9 and
OSC 777 notifications for an agent that failed, once, however many times the screen is redrawn after."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).with_name("cerevisor-tui")

pytestmark = pytest.mark.skipif(not SCRIPT.exists() or os.name != "posix",
                                reason="needs the installed cerevisor-tui script and a POSIX pty")

CONFIG = """
[run]
mode = "sequential"
run_dir = "{runs}"
warmup = "off"  # the simulator's first request is the broken agent's

[[endpoints]]
name = "sim"
kind = "simulated"
[endpoints.sim]
seed = 7
tokens_per_s = 100.0
ttft_s = 0.02
fail_first = 1
fail_status = 400

[[agents]]
name = "broken"
prompt = "the first request: answered with HTTP 400, never retried"
retries = 0

[[agents]]
name = "steady"
prompt = "then this one streams for a second or so"
max_tokens = 100
"""

ALERT = "\x07\x1b]9;cerevisor: broken failed: "


class Pty:
    """The console on a pseudo-terminal of 100x30; everything it writes is kept."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        os.set_blocking(master, False)
        subprocess.run(["stty", "rows", "30", "cols", "100"], stdin=slave, check=False)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.master = master
        self.output = ""

    def read_until(self, predicate, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not predicate(self.output):
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout} s; the last output: {self.output[-2000:]!r}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.output += os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:  # the console ended and the pty closed
                    if self.proc.poll() is not None:
                        raise AssertionError(f"the console ended before {what}: {self.output[-2000:]!r}") from None

    def write(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def test_a_failed_agent_rings_the_terminal_once(tmp_path):
    config = tmp_path / "cerevisor.toml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs"))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "TERM": "xterm-256color",
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state")}
    console = Pty([str(SCRIPT), "--config", str(config), "--in-process"], env)
    try:
        console.read_until(lambda out: ALERT in out, 20.0, "alert for the failed agent")
        console.read_until(lambda out: "FINISHED" in out, 20.0, "end of the run")  # steady streamed meanwhile
        assert console.output.count(ALERT) == 1
        assert console.output.count("\x1b]777;notify;cerevisor: broken failed;") == 1
        assert console.output.count("\x1b]9;") == 1  # steady's completion is no news
        console.write("q")
        assert console.proc.wait(15) == 1  # the run's code: an agent failed
    finally:
        console.close()
