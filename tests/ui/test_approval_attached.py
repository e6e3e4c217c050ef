"""A console attached to a detached run answers a tool call's approval over the run's control socket, in a
real terminal (tmux): the run waits for a console (a detached run asks), the attached console shows
`needs approval`, `y` opens the prompt, `a` approves the tool for the run, and the run completes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ui.test_attach_tmux import env, journal
from tests.ui.test_tmux import SCRIPT, TMUX, Terminal

pytestmark = [pytest.mark.skipif(TMUX is None or not SCRIPT.exists(),
                                 reason="needs tmux (apt-get install tmux) and the installed cerevisor-tui script"),
              pytest.mark.end_to_end]  # a real terminal and real processes, on the wall clock

FAKE_MCP = Path(__file__).parents[1] / "fixtures" / "mcp_fake.py"


def detached_run(tmp_path: Path) -> Path:
    workflow = tmp_path / "tools.toml"
    workflow.write_text(f'''
[run]
run_dir = "{tmp_path / 'runs'}"

[[endpoints]]
name = "sim"
kind = "simulated"
[endpoints.sim]
seed = 7
tokens_per_s = 200.0
ttft_s = 0.02
tool_steps = 2
tool_args = {{ echo = {{ text = "hello" }} }}

[[mcp_servers]]
name = "fake"
command = "{sys.executable}"
args = ["{FAKE_MCP}"]
ask = ["echo"]

[[agents]]
name = "toolsmith"
prompt = "use the tool"
tools = ["fake"]
max_tokens = 8
retries = 0
''')
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(workflow), "--detach"],
                          capture_output=True, text=True, timeout=60, env={**env(tmp_path), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.split(" started in ")[1].split(" (process")[0])


def test_an_attached_console_approves_a_tool_call_for_the_run(tmp_path: Path):
    run_dir = detached_run(tmp_path)
    term = Terminal(tmp_path)
    try:
        term.start(f"{SCRIPT} attach {run_dir}", env(tmp_path))
        term.wait(lambda s: "needs approval" in s and "inbox 1" in s, 30.0, "the tool call waiting for approval")
        term.keys("y")
        term.wait(lambda s: "toolsmith asks to run fake.echo" in s and '"text": "hello"' in s, 10.0, "the prompt")
        term.keys("a")
        term.wait(lambda s: "FINISHED" in s, 30.0, "the run to finish")
    finally:
        term.close()
        subprocess.run([sys.executable, "-m", "cerevisor_tui", "stop", str(run_dir)], capture_output=True,
                       timeout=30, env={**env(tmp_path), "HOME": str(tmp_path)})
    events = journal(run_dir)
    decided = [(e["decision"], e["by"]) for e in events if e["event"] == "ApprovalDecided"]
    assert decided == [("run", "operator")]  # the second call of the tool was not asked about
    assert [e["outcome"] for e in events if e["event"] == "ToolCallFinished"] == ["ok", "ok"]
    assert [e["status"] for e in events if e["event"] == "AgentFinished"] == ["completed"]
