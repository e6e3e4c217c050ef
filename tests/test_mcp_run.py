"""A run's MCP servers as processes and as holders of secrets: a server gets only the environment variables
its config names, whatever a tool's arguments or results carry of a key is scrubbed from events and
transcripts, a resumed run never repeats a call whose result it recorded (nor asks again about a tool approved
for the run), and a run killed with SIGKILL leaves no server behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from cerevisor_tui.contract.commands import Approve
from tests.conftest import wait_until
from tests.test_tools import kinds, run, workflow
from tests.test_tools_permissions import waiter

KEY_ENV = "CEREVISOR_CANARY"


def all_text(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())


@pytest.mark.anyio
async def test_a_server_gets_only_the_variables_its_config_names_and_their_values_stay_secret(tmp_path, monkeypatch):
    key = "sk-canary-" + os.urandom(8).hex()
    given = "given-" + os.urandom(8).hex()
    monkeypatch.setenv(KEY_ENV, key)
    monkeypatch.setenv("MCP_GIVEN", given)
    monkeypatch.setenv("MCP_HIDDEN", "hidden")
    data = workflow({}, server={"env": ["MCP_GIVEN"]})
    data["endpoints"] = [
        {"name": "names", "kind": "simulated", "api_key_env": KEY_ENV,
         "sim": {"speed": 50, "tool_args": {"environment_names": {}}}},
        {"name": "value", "kind": "simulated", "api_key_env": KEY_ENV,
         "sim": {"speed": 50, "tool_args": {"environment": {"name": "MCP_GIVEN"}}}},
        {"name": "echo", "kind": "simulated", "api_key_env": KEY_ENV,
         "sim": {"speed": 50, "tool_args": {"echo": {"text": f"the key is {key}"}}}},
    ]
    data["agents"] = [{"name": ep, "endpoint": ep, "prompt": "go", "tools": ["fake"], "max_tokens": 8}
                      for ep in ("names", "value", "echo")]
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    names = next(m["content"] for m in engine.agents["names"].messages if m["role"] == "tool").split("\n")
    assert "MCP_GIVEN" in names and "PATH" in names
    assert "MCP_HIDDEN" not in names and KEY_ENV not in names
    # the model's arguments held the key, and the echo gave it back: neither reaches an event or a file
    echoed = kinds(seen, "ToolCallStarted")
    assert any("the key is" in e.arguments for e in echoed)
    for event in seen:
        text = json.dumps(event.to_dict(), default=str)
        assert key not in text and given not in text, event.kind
    files = all_text(tmp_path)
    assert "the key is" in files and key not in files and given not in files
    assert given not in json.dumps(engine.agents["value"].messages)  # nor what the model is sent


@pytest.mark.anyio
async def test_a_resumed_run_never_repeats_a_recorded_call_and_keeps_for_the_run_approvals(tmp_path):
    notes = tmp_path / "notes.txt"
    run_dir = tmp_path / "run"
    data = workflow({"note": {"path": str(notes), "text": "n"}}, tool_steps=2, max_steps=2,
                    server={"allow": [], "ask": ["note"]})

    async def approve_for_run(engine, seen):
        from cerevisor_tui.contract.commands import command_of

        await waiter(engine, seen, lambda e: e.kind == "ApprovalRequested").wait()
        e = kinds(seen, "ApprovalRequested")[0]
        engine.handle(command_of({"name": "approve", "agent": e.agent, "call_id": e.call_id, "scope": "run"}))

    engine, seen, code = await run(data, run_dir, ask="operator", during=approve_for_run)
    assert code == 1 and "max_steps (2) reached" in kinds(seen, "AgentFinished")[0].error
    assert notes.read_text() == "n\n"  # its one call ran
    data["agents"][0]["max_steps"] = 3
    # resumed headless: an ask call would be denied, unless the earlier approval for the run still holds
    engine, seen, code = await run(data, run_dir, ask="deny")
    assert code == 0, kinds(seen, "AgentFinished")
    finished = kinds(seen, "ToolCallFinished")
    assert [e.outcome for e in finished] == ["ok", "ok"]
    assert finished[0].result.startswith("(from the journal, not run again) noted n") and finished[0].elapsed_s == 0
    assert not kinds(seen, "ApprovalRequested") and not kinds(seen, "ApprovalDecided")
    assert notes.read_text() == "n\nn\n"  # the recorded call was not run again; the new one was


def test_a_run_killed_with_sigkill_leaves_no_mcp_server_behind(tmp_path):
    pid_file = tmp_path / "mcp.pid"
    config = workflow({"hang": {"seconds": 600}}, server={"env": ["MCP_FAKE_PID_FILE"]})
    config["run"] = {"run_dir": str(tmp_path / "runs")}
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(config))
    env = dict(os.environ, MCP_FAKE_PID_FILE=str(pid_file))
    proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", str(path), "--jsonl"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:  # the tool call is running: the server is up and busy
            if '"ToolCallStarted"' in line:
                break
        server_pid = int(pid_file.read_text().split()[0])
        assert alive(server_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: not alive(server_pid), "the MCP server to end with its run (it outlived it)", timeout=30)
    finally:
        proc.kill()
        proc.wait()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for a parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.anyio
async def test_a_detached_run_waits_for_a_console_to_approve_over_its_control_socket(tmp_path):
    import asyncio

    from cerevisor_tui.supervisor.client import ControlClient
    from tests.test_detach import cli, started

    config = workflow({"echo": {"text": "over the socket"}}, server={"allow": [], "ask": ["echo"]})
    config["run"] = {"run_dir": str(tmp_path / "runs")}
    path = tmp_path / "detached.toml"
    path.write_text(tomli_w.dumps(config))
    _, run_dir = started(cli("run", str(path), "--detach"))
    client = await ControlClient.connect(run_dir)
    asked: asyncio.Future = asyncio.get_running_loop().create_future()
    ended = asyncio.Event()

    def on_event(event) -> None:
        if event.kind == "ApprovalRequested" and not asked.done():
            asked.set_result(event)
        elif event.kind == "RunFinished":
            ended.set()

    reading = asyncio.ensure_future(client.run(on_event))
    try:
        request = await asyncio.wait_for(asked, 60)  # it waits: a detached run has a console to ask
        assert await client.command(Approve(agent=request.agent, call_id=request.call_id, scope="once")) == "once"
        await asyncio.wait_for(ended.wait(), 60)
    finally:
        await client.close()
        await reading
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    decided = [(r["decision"], r["by"]) for r in records if r["event"] == "ApprovalDecided"]
    assert decided == [("once", "operator")]
    assert [(r["outcome"], r["result"]) for r in records if r["event"] == "ToolCallFinished"] == [
        ("ok", "echo: over the socket")]
