"""MCP servers that misbehave: one that does not start, is not there, crashes mid-call, answers with an error,
or answers 10 MB. Each is a clear outcome for the agents that use it, and the run goes on."""

from __future__ import annotations

import sys

import pytest

from tests.test_tools import FAKE, kinds, run, workflow


def with_bystander(data: dict) -> dict:
    """The workflow plus an agent without tools, which must complete whatever the tool server does."""
    data["agents"].append({"name": "bystander", "prompt": "no tools here", "max_tokens": 8})
    return data


@pytest.mark.anyio
async def test_a_server_that_fails_to_start_fails_only_its_agents_saying_why():
    data = with_bystander(workflow({"echo": {"text": "x"}}, server={"args": [FAKE, "--fail-start"]}))
    engine, seen, code = await run(data)
    assert code == 1
    ends = {e.agent: e for e in kinds(seen, "AgentFinished")}
    assert ends["bystander"].status == "completed"
    assert ends["a0"].status == "failed"
    assert ends["a0"].error.startswith("MCP server fake did not start:"), ends["a0"].error


@pytest.mark.anyio
async def test_a_server_command_that_does_not_exist_is_named():
    data = with_bystander(workflow({"echo": {"text": "x"}}, server={"command": "/nonexistent/mcp-server-nothing",
                                                                   "args": []}))
    engine, seen, code = await run(data)
    ends = {e.agent: e for e in kinds(seen, "AgentFinished")}
    assert ends["bystander"].status == "completed"
    assert ends["a0"].status == "failed" and "MCP server fake did not start" in ends["a0"].error
    assert "nonexistent" in ends["a0"].error or "not found" in ends["a0"].error


@pytest.mark.anyio
async def test_a_server_that_crashes_mid_call_is_an_error_result_and_the_run_goes_on():
    data = with_bystander(workflow({"crash": {"code": 7}}, agents=2))
    engine, seen, code = await run(data)
    finished = kinds(seen, "ToolCallFinished")
    assert finished and all(e.outcome == "error" for e in finished)
    assert "MCP server fake" in finished[0].result
    ends = {e.agent: e.status for e in kinds(seen, "AgentFinished")}
    assert ends == {"a0": "completed", "a1": "completed", "bystander": "completed"}  # each model was told, and answered
    assert code == 0


@pytest.mark.anyio
async def test_a_tool_that_answers_with_an_error_gives_the_model_that_error():
    engine, seen, code = await run(workflow({"fail": {"reason": "disk on fire"}}))
    assert code == 0
    finished = kinds(seen, "ToolCallFinished")[0]
    assert finished.outcome == "error"
    tool = next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")
    assert tool.startswith("error: ") and "failing as asked: disk on fire" in tool


@pytest.mark.anyio
async def test_a_10_mb_result_is_cut_to_max_result_chars_and_the_cut_is_said():
    data = workflow({"flood": {"megabytes": 10}}, server={"max_result_chars": 5000})
    engine, seen, code = await run(data)
    assert code == 0
    tool = next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")
    assert tool.startswith("x" * 5000)
    assert tool.endswith("[result cut: 10,000,000 characters, the first 5,000 kept]")
    assert len(tool) < 5100
    finished = kinds(seen, "ToolCallFinished")[0]
    assert finished.outcome == "ok" and len(finished.result) <= 200


def test_the_fake_server_fixture_is_runnable_alone():
    """The fixture fails to start on request, as the first test relies on (a cheap check of the fixture)."""
    import subprocess

    done = subprocess.run([sys.executable, FAKE, "--fail-start"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and "refusing to start" in done.stderr


@pytest.mark.anyio
async def test_a_server_that_never_answers_at_start_fails_its_agents_at_start_timeout_s():
    silent = {"command": sys.executable, "args": ["-c", "import time; time.sleep(120)"], "start_timeout_s": 1.0}
    data = with_bystander(workflow({"echo": {"text": "x"}}, server=silent))
    engine, seen, code = await run(data)
    ends = {e.agent: e for e in kinds(seen, "AgentFinished")}
    assert ends["bystander"].status == "completed"
    assert ends["a0"].status == "failed"
    assert ends["a0"].error == "MCP server fake did not start within 1 s (start_timeout_s)"
    # the run does not wait for its tool servers to start: the agent without tools ran meanwhile
    assert [e.agent for e in kinds(seen, "AgentFinished")] == ["bystander", "a0"]
