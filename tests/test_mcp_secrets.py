"""What an MCP server gives the run, held to the run's rules on secrets and size: a key in a tool result is
scrubbed before the result is cut, a server's stderr reaches `mcp-<name>.log` scrubbed and bounded, and a
message over the bound is one call's clear error, not a run that stops."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cerevisor_tui.tools import stdio
from cerevisor_tui.tools.stdio import LOG_MAX_BYTES
from tests.test_tools import FAKE, kinds, run, workflow

KEY_ENV = "CEREVISOR_CANARY"


def canary() -> str:
    return "sk" + os.urandom(12).hex()  # no fixed start: any 8 characters of it are its own


def all_text(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())


@pytest.mark.anyio
async def test_a_key_that_the_result_cut_splits_is_scrubbed_whole_before_the_cut(tmp_path, monkeypatch):
    key = canary()
    monkeypatch.setenv(KEY_ENV, key)
    # "echo: " + 84 characters, then the key: the cut at 100 falls 10 characters into it
    data = workflow({"echo": {"text": "a" * 84 + key + " and more"}}, server={"max_result_chars": 100})
    data["endpoints"][0]["api_key_env"] = KEY_ENV
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    tool = next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")
    assert tool.startswith("echo: " + "a" * 84 + "[redac") and "[result cut:" in tool
    start = key[:8]  # the shortest start of a key the scrubber takes out
    assert start not in tool  # what the model is sent
    for event in seen:
        assert start not in json.dumps(event.to_dict(), default=str), event.kind
    files = all_text(tmp_path)
    assert "[result cut:" in files and start not in files  # transcripts and the journal


@pytest.mark.anyio
async def test_a_key_a_server_writes_to_its_stderr_reaches_its_log_scrubbed(tmp_path, monkeypatch):
    key = canary()
    monkeypatch.setenv("MCP_TOKEN", key)
    data = workflow(
        {"echo": {"text": "x"}}, server={"args": [FAKE, "--log-env", "MCP_TOKEN"], "env": ["MCP_TOKEN"]}
    )
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    log = (tmp_path / "mcp-fake.log").read_text()
    assert "mcp_fake settings: token=[redacted] (end of settings)" in log, log  # written in two pieces
    assert key[:8] not in all_text(tmp_path)


@pytest.mark.anyio
async def test_a_server_log_is_bounded_and_keeps_its_latest_part(tmp_path):
    data = workflow({"shout": {"megabytes": 20, "last": "the very last line"}})
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    log, earlier = tmp_path / "mcp-fake.log", tmp_path / "mcp-fake.log.1"
    assert log.stat().st_size <= LOG_MAX_BYTES and earlier.stat().st_size <= LOG_MAX_BYTES
    assert sorted(p.name for p in tmp_path.glob("mcp-fake.log*")) == ["mcp-fake.log", "mcp-fake.log.1"]
    text = log.read_text()
    assert text.startswith("[cerevisor-tui: this log reached 8 MiB; its earlier part is in mcp-fake.log.1")
    assert text.endswith("the very last line\n")


@pytest.mark.anyio
async def test_a_message_over_the_bound_is_one_calls_error_and_the_server_goes_on_serving(tmp_path):
    data = workflow({})
    data["endpoints"] = [  # 40 MB of text: an 80 MB message (text and structured content), over 64 MiB
        {"name": "big", "kind": "simulated", "sim": {"speed": 50, "tool_args": {"flood": {"megabytes": 40}}}},
        {
            "name": "small",
            "kind": "simulated",
            "sim": {"speed": 50, "tool_args": {"echo": {"text": "still here"}}},
        },
    ]
    data["agents"] = [
        {"name": "big", "endpoint": "big", "prompt": "go", "tools": ["fake"], "max_tokens": 8, "retries": 0},
        {
            "name": "small",
            "endpoint": "small",
            "prompt": "go",
            "tools": ["fake"],
            "max_tokens": 8,
            "retries": 0,
            "depends_on": ["big"],
        },
    ]
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    finished = {e.agent: e for e in kinds(seen, "ToolCallFinished")}
    assert finished["big"].outcome == "error"
    told = next(m["content"] for m in engine.agents["big"].messages if m["role"] == "tool")
    assert (
        told.startswith("error: MCP server fake: the server's answer was 80,000,")
        and "over the 64 MiB" in told
    )
    assert finished["small"].outcome == "ok" and finished["small"].result == "echo: still here"


@pytest.mark.anyio
async def test_a_server_that_exits_at_once_is_told_with_its_exit_code_and_its_log(tmp_path):
    data = workflow({"echo": {"text": "x"}}, server={"args": [FAKE, "--fail-start"]})
    engine, seen, code = await run(data, tmp_path)
    error = kinds(seen, "AgentFinished")[0].error
    assert error == (
        'MCP server fake did not start: it exited with code 3 (its stderr ends: "mcp_fake: refusing '
        f'to start (as asked)"; its log: {tmp_path / "mcp-fake.log"})'
    )


@pytest.mark.anyio
async def test_a_server_that_exits_mid_call_is_told_with_its_exit_code(tmp_path):
    engine, seen, code = await run(workflow({"crash": {"code": 7}}), tmp_path)
    result = kinds(seen, "ToolCallFinished")[0].result
    assert result.startswith("error: MCP server fake: it exited with code 7 ("), result
    assert str(tmp_path / "mcp-fake.log") in result


SLOW_TO_GO = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], "a").write("SIGTERM\\n"))
time.sleep(120)
"""


@pytest.mark.anyio
async def test_a_start_timeout_is_told_at_the_deadline_not_once_the_server_is_wound_down(tmp_path, monkeypatch):
    """A server that never answers, and ignores its stdin closing and SIGTERM: winding it down takes the grace
    before SIGTERM and the one before SIGKILL. Its agent hears of the timeout before any of that."""
    # the graces at test scale (2 s each); SIGTERM still goes 2 s after the start, once the server is surely
    # listening for it
    monkeypatch.setattr(stdio, "GRACE_S", 1.0)
    monkeypatch.setattr(stdio, "KILL_AFTER_S", 0.2)
    term = tmp_path / "term.txt"
    slow = {"command": sys.executable, "args": ["-c", SLOW_TO_GO, str(term)], "start_timeout_s": 1.0}
    data = workflow({"echo": {"text": "x"}}, server=slow)
    at_failure: list[bool] = []

    async def watch(engine, seen):
        engine.subscribe(lambda e: at_failure.append(term.exists()) if e.kind == "AgentFinished" else None)

    engine, seen, code = await run(data, tmp_path / "run", during=watch)
    assert (
        kinds(seen, "AgentFinished")[0].error == "MCP server fake did not start within 1 s (start_timeout_s)"
    )
    assert at_failure == [False]  # told before the wind-down sent SIGTERM
    assert term.read_text() == "SIGTERM\n"  # which it then did, before the run ended


RAW = str(Path(__file__).parent / "fixtures" / "mcp_raw.py")


@pytest.mark.anyio
async def test_an_over_long_answer_whose_id_comes_last_and_an_over_long_notification(tmp_path):
    """A hand-written server: an answer over the bound is told to its own call though its id is its last
    member, and a notification over the bound is dropped (said in the server's log), the call's answer kept."""
    data = workflow({}, server={"command": sys.executable, "args": [RAW]})
    data["endpoints"] = [
        {
            "name": "last",
            "kind": "simulated",
            "sim": {"speed": 50, "tool_args": {"id_last": {"megabytes": 70}}},
        },
        {"name": "loud", "kind": "simulated", "sim": {"speed": 50, "tool_args": {"loud_then_fine": {}}}},
    ]
    data["agents"] = [
        {
            "name": "last",
            "endpoint": "last",
            "prompt": "go",
            "tools": ["fake"],
            "max_tokens": 8,
            "retries": 0,
        },
        {
            "name": "loud",
            "endpoint": "loud",
            "prompt": "go",
            "tools": ["fake"],
            "max_tokens": 8,
            "retries": 0,
            "depends_on": ["last"],
        },
    ]
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    finished = {e.agent: e for e in kinds(seen, "ToolCallFinished")}
    assert finished["last"].outcome == "error"
    assert (
        "the server's answer was 70,000,0" in finished["last"].result
        and "over the 64 MiB" in finished["last"].result
    )
    assert finished["loud"].outcome == "ok" and finished["loud"].result == "fine"
    log = (tmp_path / "mcp-fake.log").read_text()
    assert "[cerevisor-tui: a message of 70,000,0" in log and "dropped, over the 64 MiB bound]" in log
