"""Real MCP servers from the package index, over stdio: mcp-server-time and mcp-server-git (on a throwaway
repository), installed by .ci/integration.sh into $PEERS_DIR/mcp. The simulator's tool calls drive them
through the product's own `run`, and each transcript holds the call and the server's real result.

Nothing here skips: a server that is not installed fails the test with the command that installs it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import cerevisor, jsonl, write_config
from tests.integration.servers import PEERS_DIR

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
MCP_BIN = PEERS_DIR / "mcp" / "bin"


def server_command(name: str) -> str:
    path = MCP_BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed under {MCP_BIN}: run .ci/integration.sh (or "
                    f"python3 -m venv {MCP_BIN.parent} && {MCP_BIN}/pip install mcp-server-time mcp-server-git)",
                    pytrace=False)
    return str(path)


def sim_workflow(tool_args: dict[str, Any], servers: list[dict[str, Any]],
                 agents: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "endpoints": [{"name": "sim", "kind": "simulated", "sim": {"speed": 20, "tool_args": tool_args}}],
        "mcp_servers": servers,
        "agents": [{"max_tokens": 12, "retries": 0, **agent} for agent in agents],
    }


def transcript(run_dir: Path, agent: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "transcripts" / f"{agent}.jsonl").read_text().splitlines()]


def call_and_result(lines: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The first tool call of a transcript and the tool message that answers it."""
    call = next(m for m in lines if m.get("tool_calls"))["tool_calls"][0]
    answer = next(m for m in lines if m["role"] == "tool" and m["tool_call_id"] == call["id"])
    return call, answer["content"]


def test_mcp_server_time_answers_the_simulators_call(tmp_path: Path):
    config = sim_workflow(
        {"get_current_time": {"timezone": "UTC"}},
        [{"name": "time", "command": server_command("mcp-server-time"), "allow": ["get_*"]}],
        [{"name": "clock", "prompt": "What time is it in UTC?", "tools": ["time"]}])
    run_dir = tmp_path / "run"
    proc = cerevisor("run", str(write_config(tmp_path / "time.toml", config)), "--run-dir", str(run_dir), "--jsonl")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    call, result = call_and_result(transcript(run_dir, "clock"))
    assert call["function"]["name"] == "time__get_current_time"
    assert json.loads(call["function"]["arguments"]) == {"timezone": "UTC"}
    answer = json.loads(result)  # the server's own answer, whole
    assert answer["timezone"] == "UTC" and answer["datetime"].endswith("+00:00") and "day_of_week" in answer
    events = jsonl(proc.stdout)
    finished = [e for e in events if e["event"] == "ToolCallFinished"]
    assert [(e["server"], e["tool"], e["outcome"]) for e in finished] == [("time", "get_current_time", "ok")]


def test_mcp_server_git_on_a_throwaway_repository_with_its_permission_rules(tmp_path: Path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=ci@example.com", "-c", "user.name=ci"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "notes.txt").write_text("hello\n")
    subprocess.run([*git, "add", "notes.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a commit only this test makes"], check=True)
    (repo / "notes.txt").write_text("hello again\n")  # an unstaged change for git_status to see
    config = sim_workflow(
        {"git_log": {"repo_path": str(repo), "max_count": 5}, "git_status": {"repo_path": str(repo)},
         "git_commit": {"repo_path": str(repo), "message": "the model's commit"}},
        [{"name": "git", "command": server_command("mcp-server-git"), "args": ["--repository", str(repo)],
          "allow": ["git_log", "git_status"], "ask": ["git_commit"], "deny": ["git_reset", "git_checkout"]}],
        [{"name": "historian", "prompt": "What happened in this repository?", "tools": ["git.git_log"]},
         {"name": "inspector", "prompt": "Is the tree clean?", "tools": ["git.git_status"]},
         {"name": "committer", "prompt": "Commit the change.", "tools": ["git.git_commit"]}])
    run_dir = tmp_path / "run"
    proc = cerevisor("run", str(write_config(tmp_path / "git.toml", config)), "--run-dir", str(run_dir), "--jsonl")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    call, result = call_and_result(transcript(run_dir, "historian"))
    assert call["function"]["name"] == "git__git_log"
    assert "a commit only this test makes" in result
    call, result = call_and_result(transcript(run_dir, "inspector"))
    assert call["function"]["name"] == "git__git_status" and "notes.txt" in result
    # git_commit is `ask`: headless without --approve-all it is denied, the model told, and nothing committed
    call, result = call_and_result(transcript(run_dir, "committer"))
    assert result.startswith("error: denied:") and "--approve-all" in result
    log = subprocess.run([*git, "log", "--oneline"], capture_output=True, text=True, check=True).stdout
    assert "the model's commit" not in log
    decided = [e for e in jsonl(proc.stdout) if e["event"] == "ApprovalDecided"]
    assert [(e["tool"], e["decision"], e["by"]) for e in decided] == [("git_commit", "deny", "headless")]
    # with --approve-all the same call runs, and the repository has the model's commit
    subprocess.run([*git, "add", "notes.txt"], check=True)
    config["agents"] = [config["agents"][2]]
    proc = cerevisor("run", str(write_config(tmp_path / "git2.toml", config)), "--run-dir", str(tmp_path / "run2"),
                     "--approve-all")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    log = subprocess.run([*git, "log", "--oneline"], capture_output=True, text=True, check=True).stdout
    assert "the model's commit" in log


FAKE = Path(__file__).resolve().parents[1] / "fixtures" / "mcp_fake.py"


def test_real_vllm_forced_tool_call_reaches_an_mcp_server_and_the_agent_completes(vllm_server, tmp_path: Path):
    """tool_choice naming the function (vLLM satisfies it with structured output), then "none" so the model answers.

    The tool is a no-argument one of our fake server, on the SDK's server side (tests/fixtures/mcp_fake.py
    --sdk), not one of the package index's: the tiny model has random weights, and structured output makes any free-text argument (a timezone,
    a repo_path) a random string that does not close within max_tokens, so the call's JSON never ends.
    An object with no properties is "{}" at once: what vLLM's structured output does is tested, not the model."""
    import sys

    from tests.integration.servers import MODEL

    config = {
        "stall": {"first_byte_timeout_s": 120.0, "idle_timeout_s": 60.0},
        "endpoints": [{"name": "box", "base_url": vllm_server.base_url, "kind": "local", "model": MODEL}],
        "mcp_servers": [{"name": "fake", "command": sys.executable, "args": [str(FAKE), "--sdk"], "allow": ["*"]}],
        "agents": [{"name": "forced", "prompt": "List the environment.", "tools": ["fake.environment_names"],
                    "tool_choice": "fake.environment_names", "max_tokens": 48, "temperature": 0.0, "retries": 0}],
    }
    run_dir = tmp_path / "run"
    proc = cerevisor("run", str(write_config(tmp_path / "vllm.toml", config)), "--run-dir", str(run_dir), "--jsonl")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    lines = transcript(run_dir, "forced")
    call, result = call_and_result(lines)
    assert call["function"]["name"] == "fake__environment_names" and call["id"].startswith("chatcmpl-tool-")
    assert json.loads(call["function"]["arguments"]) == {}
    assert "PATH" in result.split("\n")  # the server's own answer
    assert [m["role"] for m in lines] == ["user", "assistant", "tool", "assistant"]
    assert lines[-1]["content"] and "tool_calls" not in lines[-1]  # the second request (tool_choice none): text
