"""Agents with MCP tools, end to end on loopback: the simulator answers with tool calls, a small MCP server
(tests/fixtures/mcp_fake.py, answering as the SDK's own server side does) answers them over stdio, and the engine runs the loop,
asks for permission, keeps the tool deadline and records the conversation in OpenAI's message form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.resume import read_journal
from cerevisor_tui.engine.sinks.journal import Journal

FAKE = str(Path(__file__).parent / "fixtures" / "mcp_fake.py")


def test_the_fake_server_answers_as_the_sdks_own_server_side_does():
    """The fake's plain stdio (what the suite runs: it starts in ~0.06 s of CPU, the SDK in ~0.75 s) against the
    same tools on the SDK's server side (`--sdk`): the same initialize, listing, results and errors, line for line."""
    calls = [("echo", {"text": "hi"}), ("add", {"a": 2, "b": 3}), ("fail", {"reason": "x"}), ("nope", {}),
             ("environment", {"name": "MCP_FAKE_UNSET"}), ("add", {"a": "two", "b": 3})]
    lines = [{"jsonrpc": "2.0", "id": 0, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
             {"jsonrpc": "2.0", "method": "notifications/initialized"},
             {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
             *({"jsonrpc": "2.0", "id": 2 + i, "method": "tools/call", "params": {"name": name, "arguments": args}}
               for i, (name, args) in enumerate(calls))]
    answers = {}
    for mode in ("plain", "sdk"):
        proc = subprocess.Popen([sys.executable, FAKE, *(["--sdk"] if mode == "sdk" else [])], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        proc.stdin.flush()
        got = {}
        while len(got) < len(lines) - 1:  # every request answered (the stream stays open until then)
            message = json.loads(proc.stdout.readline())
            got[message["id"]] = message
        proc.stdin.close()
        proc.wait(10)
        answers[mode] = got
    plain, sdk = answers["plain"], answers["sdk"]
    bad_args = len(lines) - 2  # a validation error: the SDK quotes pydantic's whole message; the fake names the field
    assert plain[bad_args]["result"]["isError"] and sdk[bad_args]["result"]["isError"]
    assert "addArguments\na\n" in plain[bad_args]["result"]["content"][0]["text"]
    assert "addArguments\na\n" in sdk[bad_args]["result"]["content"][0]["text"]
    assert {k: v for k, v in plain.items() if k != bad_args} == {k: v for k, v in sdk.items() if k != bad_args}


def workflow(tool_args: dict[str, Any], *, server: dict[str, Any] | None = None, agents: int = 1,
             tool_steps: int = 1, **agent: Any) -> dict[str, Any]:
    return {
        "stall": {"idle_timeout_s": 30},
        "endpoints": [{"name": "sim", "kind": "simulated",
                       "sim": {"speed": 50, "seed": 3, "tool_steps": tool_steps, "tool_args": tool_args}}],
        "mcp_servers": [{"name": "fake", "command": sys.executable, "args": [FAKE], "allow": ["*"],
                         **(server or {})}],
        "agents": [{"name": f"a{i}", "prompt": "use the tool", "tools": ["fake"], "max_tokens": 8, "retries": 0,
                    **agent} for i in range(agents)],
    }


async def run(data: dict[str, Any], run_dir: Path | None = None, *, ask: str = "deny",
              during: Any = None) -> tuple[Engine, list, int]:
    resuming = run_dir is not None and (run_dir / "events.jsonl").exists()
    engine = Engine(validate(data), run_dir=str(run_dir or ""), ask=ask,  # type: ignore[arg-type]
                    resumed=read_journal(run_dir) if resuming else None)
    seen: list = []
    engine.subscribe(seen.append)
    journal = None
    if run_dir is not None:
        journal = Journal(run_dir, engine.report)
        journal.open(resume=resuming)
        engine.subscribe(journal)
    async with anyio.create_task_group() as group:
        if during is not None:
            group.start_soon(during, engine, seen)
        code = await engine.run()
        group.cancel_scope.cancel()
    if journal is not None:
        journal.close()
    return engine, seen, code


def kinds(seen: list, kind: str) -> list:
    return [e for e in seen if e.kind == kind]


def transcript(run_dir: Path, agent: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "transcripts" / f"{agent}.jsonl").read_text().splitlines()]


@pytest.mark.anyio
async def test_a_tool_call_runs_through_mcp_and_the_transcript_replays_as_an_openai_conversation(tmp_path):
    engine, seen, code = await run(workflow({"add": {"a": 2, "b": 40}}), tmp_path)
    assert code == 0, [e for e in seen if e.kind == "AgentFinished"]
    started, finished = kinds(seen, "ToolCallStarted"), kinds(seen, "ToolCallFinished")
    assert [(e.server, e.tool, json.loads(e.arguments)) for e in started] == [("fake", "add", {"a": 2, "b": 40})]
    assert started[0].deadline is not None and started[0].warn_at == (0.5, 0.8, 0.95)
    assert [(e.outcome, e.result) for e in finished] == [("ok", "42")]
    lines = transcript(tmp_path, "a0")
    assert [m["role"] for m in lines] == ["user", "assistant", "tool", "assistant"]
    call = lines[1]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "fake__add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 40}  # put together from streamed pieces
    assert lines[2] == {"turn": 1, "attempt": 1, "role": "tool", "content": "42", "tool_call_id": call["id"]}
    assert lines[3]["content"] and "tool_calls" not in lines[3]
    assert engine.agents["a0"].status == "completed"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["agents"][0]["tool_calls"] == {"ok": 1}


@pytest.mark.anyio
async def test_the_model_is_offered_the_tools_schemas_and_gets_each_result_before_it_answers():
    engine, seen, code = await run(workflow({"echo": {"text": "hello"}}, tool_steps=2))
    assert code == 0
    msgs = engine.agents["a0"].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert msgs[2]["content"] == "echo: hello" and msgs[2]["tool_call_id"] == msgs[1]["tool_calls"][0]["id"]
    offered = engine.agents["a0"].toolset.tools
    names = {t["function"]["name"] for t in offered}
    assert {"fake__echo", "fake__add", "fake__hang"} <= names
    add = next(t for t in offered if t["function"]["name"] == "fake__add")["function"]
    assert add["parameters"]["required"] == ["a", "b"] and add["description"] == "Add two whole numbers."


@pytest.mark.anyio
async def test_max_steps_ends_a_tool_loop_that_never_answers_with_a_clear_failure():
    engine, seen, code = await run(workflow({"echo": {"text": "again"}}, tool_steps=50, max_steps=3))
    assert code == 1
    end = kinds(seen, "AgentFinished")[-1]
    assert end.status == "failed" and "max_steps (3) reached" in end.error and "fake__echo" in end.error
    assert len(kinds(seen, "ToolCallFinished")) == 2  # the third answer's call is not run


@pytest.mark.anyio
async def test_a_tool_listed_by_name_is_the_only_one_offered_and_deny_rules_hide_a_tool():
    data = workflow({"echo": {"text": "x"}}, server={"allow": ["*"], "deny": ["hang", "crash"]})
    data["agents"][0]["tools"] = ["fake.echo"]
    engine, _, code = await run(data)
    assert code == 0
    assert [t["function"]["name"] for t in engine.agents["a0"].toolset.tools] == ["fake__echo"]
    data["agents"][0]["tools"] = ["fake"]
    engine, _, _ = await run(data)
    names = {t["function"]["name"] for t in engine.agents["a0"].toolset.tools}
    assert "fake__hang" not in names and "fake__crash" not in names and "fake__echo" in names


@pytest.mark.anyio
async def test_tool_calls_come_through_the_stream_worker_process_too(tmp_path):
    data = workflow({"add": {"a": 1, "b": 2}})
    engine = Engine(validate(data), stream_process=True, ask="deny")
    seen: list = []
    engine.subscribe(seen.append)
    assert await engine.run() == 0
    assert engine.connections.stream_process and not engine.connections.stream_process_problem  # its streams were read by the worker
    assert [(e.outcome, e.result) for e in kinds(seen, "ToolCallFinished")] == [("ok", "3")]
    assert json.loads(engine.agents["a0"].messages[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_the_headless_run_prints_a_line_for_each_call_and_decision(tmp_path):
    import subprocess

    import tomli_w

    data = workflow({"echo": {"text": "hi"}}, server={"allow": [], "ask": ["echo"]})
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(data))
    done = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(path), "--run-dir", str(tmp_path / "r"),
                           "--approve-all"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a0: fake.echo approved once (headless)" in done.stdout
    assert 'a0: tool fake.echo {"text": "hi"}' in done.stdout
    assert "a0: tool fake.echo OK in" in done.stdout and ": echo: hi" in done.stdout
    assert "a0: turn 1/1, step 2 sent to sim" in done.stdout  # a tool loop's second request is its step, not a retry


@pytest.mark.anyio
async def test_a_server_spoken_to_over_streamable_http_by_url():
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, FAKE, "--http", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while True:  # until it listens (it ends the test if it dies)
            assert server.poll() is None, "the HTTP MCP server did not start"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                await anyio.sleep(0.05)
        data = workflow({"add": {"a": 20, "b": 22}})
        data["mcp_servers"] = [{"name": "fake", "url": f"http://127.0.0.1:{port}/mcp", "allow": ["*"]}]
        engine, seen, code = await run(data)
        assert code == 0, kinds(seen, "AgentFinished")
        assert [(e.outcome, e.result) for e in kinds(seen, "ToolCallFinished")] == [("ok", "42")]
    finally:
        server.terminate()
        server.wait()


@pytest.mark.parametrize(("change", "key", "problem"), [
    ({"agents": [{"name": "a", "prompt": "p", "tools": ["nope"]}]}, "agents[0] (a).tools[0]",
     "unknown MCP server 'nope' in 'nope' (known: fake)"),
    ({"mcp_servers": [{"name": "fake", "command": "x"}, {"name": "fake", "command": "y"}]},
     "mcp_servers[1] (fake).name",
     "duplicate MCP server name 'fake'"),
    ({"mcp_servers": [{"name": "fake"}]}, "mcp_servers[0]", "give either command (stdio) or url"),
    ({"mcp_servers": [{"name": "fake", "command": "x", "url": "http://h/mcp"}]}, "mcp_servers[0]", "give either"),
    ({"mcp_servers": [{"name": "my server", "command": "x"}]}, "mcp_servers[0] (my server).name",
     "letters, digits, _ or -"),
    ({"agents": [{"name": "a", "prompt": "p", "tools": ["fake"], "tool_choice": "other.tool"}]},
     "agents[0] (a).tool_choice", "not auto, required, none or a server.tool of this agent's tools"),
])
def test_a_bad_tools_config_names_the_key_and_the_problem(change, key, problem):
    from cerevisor_tui.config.errors import ConfigError

    data = workflow({})
    data.update(change)
    with pytest.raises(ConfigError) as info:
        validate(data, file="tools.toml")
    text = str(info.value)
    assert text.startswith("tools.toml: ") and key in text and problem in text, text
