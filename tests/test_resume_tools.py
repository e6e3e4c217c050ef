"""Resuming a run whose agents call tools, through the real paths: `cerevisor-tui run` as a subprocess against a
loopback model server that numbers every tool call `call_1` (as several local tool-call parsers do), a real
MCP server over stdio, SIGKILL, then `--resume`. A finished call is never run again, a call the crash cut off is
run again only with an approval ("may already have taken effect"), a damaged call record resumes with a
notice, and a changed `tools`, `tool_choice` or `max_steps` reruns a completed agent. Only what is SIGKILLed is a
process of its own: a run nothing kills (a resume, the reruns) runs in this process, as the command opens it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest
import tomli_w

from cerevisor_tui.engine.toolcalls import AskPolicy
from tests.conftest import wait_until
from tests.test_tools import FAKE

Script = Callable[[dict[str, Any]], "dict[str, Any] | str | None"]
"""What the scripted server answers a chat request (its JSON body) with: a tool call {"name", "arguments"},
text, or None (it holds the request open until the test ends)."""


class ScriptedServer:
    """An OpenAI-compatible streaming server on loopback whose answers a test scripts, every tool call under the
    id `call_1`; it keeps each request's body and X-Request-Id."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[str] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # /health, /metrics, /v1/models: not what these tests script
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.bodies.append(body)
                outer.request_ids.append(self.headers.get("x-request-id", ""))
                answer = outer.script(body)
                if answer is None:
                    outer.release.wait()
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                if isinstance(answer, str):
                    deltas = [{"role": "assistant", "content": answer}]
                    finish = "stop"
                else:
                    deltas = [{"role": "assistant", "content": None, "tool_calls": [
                        {"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": answer["name"], "arguments": json.dumps(answer["arguments"])}}]}]
                    finish = "tool_calls"
                for delta in deltas:
                    self._event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                self._event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _event(self, obj: dict[str, Any]) -> None:
                self.wfile.write(b"data: " + json.dumps({"object": "chat.completion.chunk", **obj}).encode() + b"\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@contextmanager
def scripted(script: Script) -> Iterator[ScriptedServer]:
    server = ScriptedServer(script)
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.server.shutdown()
        server.server.server_close()


def tool_results(body: dict[str, Any]) -> list[str]:
    """The tool messages of the request's current turn (since its last user message)."""
    messages = body["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m["content"] for m in messages[last_user:] if m["role"] == "tool"]


def config(tmp_path: Path, url: str, *, server: dict[str, Any] | None = None, **agent: Any) -> Path:
    data = {
        "run": {"warmup": "off"},  # these tests count the server's requests
        "stall": {"idle_timeout_s": 60, "first_byte_timeout_s": 600},
        "endpoints": [{"name": "box", "base_url": url, "model": "m"}],
        "mcp_servers": [{"name": "fake", "command": sys.executable, "args": [FAKE], "allow": ["*"], **(server or {})}],
        "agents": [{"name": "a0", "prompt": "use the tools", "tools": ["fake"], "max_tokens": 8, "retries": 0,
                    **agent}],
    }
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def cerevisor(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def killed_after(proc: subprocess.Popen, run_dir: Path, condition: Callable[[list[dict[str, Any]]], bool]) -> None:
    """SIGKILL the run once its journal meets `condition`."""
    try:
        wait_until(lambda: (run_dir / "events.jsonl").exists() and condition(records(run_dir)),
                   "the run to reach the point it is killed at")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)


@pytest.mark.end_to_end  # a real run SIGKILLed, then resumed
def test_calls_that_share_an_id_are_each_paired_with_their_own_result_and_never_run_again(tmp_path):
    notes, run_dir = tmp_path / "notes.txt", tmp_path / "run"
    crashed = threading.Event()

    def script(body: dict[str, Any]) -> dict[str, Any] | str | None:
        done = tool_results(body)
        if len(done) < 2:  # two calls, both `call_1`, with different arguments: a, then b
            return {"name": "fake__note", "arguments": {"path": str(notes), "text": "ab"[len(done)]}}
        return None if not crashed.is_set() else "done"  # the run is killed while it waits for this answer

    with scripted(script) as server:
        cfg = config(tmp_path, server.base_url)
        killed_after(cerevisor(str(cfg), "--run-dir", str(run_dir)), run_dir,
                     lambda rs: sum(r["event"] == "MessageRecorded" and r["role"] == "tool" for r in rs) == 2)
        assert notes.read_text() == "a\nb\n"
        crashed.set()
        code, seen = anyio.run(run_here, cfg, run_dir, True)
        assert code == 0
    assert notes.read_text() == "a\nb\n"  # neither call ran again (keyed by id, `a` would have: it shares b's id)
    resumed = records(run_dir)[[r["event"] for r in records(run_dir)].index("RunStarted", 1):]
    reused = [r["result"] for r in resumed if r["event"] == "ToolCallFinished"]
    assert reused == ["(from the journal, not run again) noted a", "(from the journal, not run again) noted b"]
    assert not [e for e in seen if e.kind == "RunNotice" and "may already have taken effect" in e.message]


def interrupted_run(tmp_path: Path, server: ScriptedServer, notes: Path) -> tuple[Path, Path]:
    """A run killed while its one tool call runs (a slow `note`, which has already written its line)."""
    run_dir = tmp_path / "run"
    cfg = config(tmp_path, server.base_url, server={"allow": ["*"], "tool_timeout_s": 600})
    killed_after(cerevisor(str(cfg), "--run-dir", str(run_dir)), run_dir,
                 lambda rs: any(r["event"] == "ToolCallStarted" for r in rs) and notes.exists())
    return cfg, run_dir


async def resumed_with_an_operator(cfg: Path, run_dir: Path) -> Any:
    """Resume `run_dir` in this process with an operator to ask; returns the approval request it waits on,
    which the operator denies."""
    from cerevisor_tui.commands.run import resume_state
    from cerevisor_tui.config import load_config
    from cerevisor_tui.contract.commands import Deny
    from cerevisor_tui.engine.run_setup import open_run
    from tests.test_tools_permissions import waiter

    _, state = resume_state(str(run_dir), run_dir.parent)
    # as the detached run a console starts opens it (commands/run.py: console=False, ask="operator")
    engine, journal = open_run(load_config(str(cfg)), state.run_id, run_dir, console=False, resume=True,
                               resumed=state, ask="operator")
    seen: list = []
    engine.subscribe(seen.append)
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        await waiter(engine, seen, lambda e: e.kind == "ApprovalRequested").wait()
        asked = next(e for e in seen if e.kind == "ApprovalRequested")
        engine.handle(Deny(agent=asked.agent, call_id=asked.call_id))
    journal.close()
    notices = [e.message for e in seen if e.kind == "RunNotice" and "may already have taken effect" in e.message]
    assert len(notices) == 1
    return asked


@pytest.mark.end_to_end  # a real run SIGKILLed, then resumed
def test_a_call_cut_off_by_a_crash_is_not_run_again_headless_without_approve_all(tmp_path):
    notes = tmp_path / "notes.txt"

    def script(body: dict[str, Any]) -> dict[str, Any] | str:
        if not tool_results(body):
            return {"name": "fake__slow_note", "arguments": {"path": str(notes), "text": "once", "seconds": 600}}
        return "done: " + tool_results(body)[0]

    with scripted(script) as server:
        cfg, run_dir = interrupted_run(tmp_path, server, notes)
        copy, console = tmp_path / "copy", tmp_path / "console"
        shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("*.sock"))
        shutil.copytree(run_dir, console, ignore=shutil.ignore_patterns("*.sock"))
        # where an operator may answer (a console, a detached run), it waits for one, though the rules allow it
        asked = anyio.run(resumed_with_an_operator, cfg, console)
        assert (asked.server, asked.tool) == ("fake", "slow_note")
        assert notes.read_text() == "once\n"
        # headless, no --approve-all: the call may already have taken effect, so it is denied, and said so
        code, resumed = anyio.run(run_here, cfg, run_dir, True)
        assert code == 0
        assert notes.read_text() == "once\n"
        notice = [e.message for e in resumed if e.kind == "RunNotice" and "may already" in e.message]
        assert len(notice) == 1 and "fake.slow_note" in notice[0], notice
        finished = [e for e in resumed if e.kind == "ToolCallFinished"]
        assert [e.outcome for e in finished] == ["denied"]
        assert "may already have taken effect" in finished[0].result
        assert [(e.decision, e.by) for e in resumed if e.kind == "ApprovalDecided"] == [("deny", "headless")]
        # with --approve-all it runs again (a short tool deadline ends its sleep, after its line is written)
        cfg = config(tmp_path, server.base_url, server={"allow": ["*"], "tool_timeout_s": 1})
        code, resumed = anyio.run(run_here, cfg, copy, True, "approve")
    assert code == 0
    assert [(e.decision, e.by) for e in resumed if e.kind == "ApprovalDecided"] == [("once", "headless")]
    assert [e.outcome for e in resumed if e.kind == "ToolCallFinished"] == ["timeout"]
    assert notes.read_text() == "once\nonce\n"


@pytest.mark.end_to_end  # a real run SIGKILLed, then resumed
def test_a_damaged_tool_call_record_resumes_with_a_notice_not_a_traceback(tmp_path):
    notes = tmp_path / "notes.txt"
    crashed = threading.Event()

    def script(body: dict[str, Any]) -> dict[str, Any] | str | None:
        if not tool_results(body):
            return {"name": "fake__note", "arguments": {"path": str(notes), "text": "n"}}
        return "done" if crashed.is_set() else None

    with scripted(script) as server:
        run_dir = tmp_path / "run"
        cfg = config(tmp_path, server.base_url)
        killed_after(cerevisor(str(cfg), "--run-dir", str(run_dir)), run_dir,
                     lambda rs: any(r["event"] == "MessageRecorded" and r["role"] == "tool" for r in rs))
        crashed.set()
        events = run_dir / "events.jsonl"
        lines = events.read_text().splitlines()
        for i, line in enumerate(lines):  # one field of the recorded call damaged, the line still JSON
            record = json.loads(line)
            if record["event"] == "MessageRecorded" and record.get("tool_calls"):
                record["tool_calls"][0]["function"] = "garbled"
                lines[i] = json.dumps(record)
        events.write_text("\n".join(lines) + "\n")
        code, resumed = anyio.run(run_here, cfg, run_dir, True)  # a traceback would end the test here
    assert code == 0
    notice = [e.message for e in resumed if e.kind == "RunNotice" and "may already" in e.message]
    assert notice and "damaged" in notice[0]
    # what the call did cannot be known from the journal: headless, it is not run again
    assert notes.read_text() == "n\n"
    assert [e.outcome for e in resumed if e.kind == "ToolCallFinished"] == ["denied"]


async def run_here(cfg: Path, run_dir: Path, resume: bool, ask: AskPolicy = "deny") -> tuple[int, list[Any]]:
    """`cerevisor-tui run CFG --run-dir RUN_DIR` (or `--resume RUN_DIR`) in this process, as the command opens
    it (headless: a call its rules ask about is denied, or approved: `ask="approve"` is `--approve-all`): for a
    run nothing kills, without an interpreter's start and imports. Returns what the run returns and the events
    it told (what `--jsonl` prints)."""
    from cerevisor_tui.commands.run import resume_state
    from cerevisor_tui.config import load_config
    from cerevisor_tui.engine.engine import new_run_id
    from cerevisor_tui.engine.run_setup import open_run

    state = resume_state(str(run_dir), run_dir.parent)[1] if resume else None
    engine, journal = open_run(load_config(str(cfg)), state.run_id if state else new_run_id(), run_dir,
                               console=False, resume=resume, resumed=state, ask=ask)
    seen: list[Any] = []
    engine.subscribe(seen.append)
    try:
        return await engine.run(), seen
    finally:
        journal.close()


def test_a_completed_agent_is_run_again_when_its_tools_tool_choice_or_max_steps_change(tmp_path):
    def script(body: dict[str, Any]) -> str:
        return "answer"

    with scripted(script) as server:
        run_dir = tmp_path / "run"
        cfg = config(tmp_path, server.base_url)
        assert anyio.run(run_here, cfg, run_dir, False)[0] == 0
        sent = len(server.bodies)
        for change, why in [({}, None), ({"max_steps": 4}, "max_steps 10 -> 4"),
                            ({"max_steps": 4, "tool_choice": "required"}, "tool_choice (none) -> required"),
                            ({"max_steps": 4, "tool_choice": "required", "tools": ["fake.echo"]},
                             "tools [fake] -> [fake.echo]")]:
            cfg = config(tmp_path, server.base_url, **change)
            assert anyio.run(run_here, cfg, run_dir, True)[0] == 0
            reruns = [r["reason"] for r in records(run_dir)[-40:] if r["event"] == "AgentRerun"]
            if why is None:  # nothing changed: reused, never sent again
                assert len(server.bodies) == sent
            else:
                assert len(server.bodies) == sent + 1 and reruns[-1] == why, (reruns, change)
                sent += 1


@pytest.mark.end_to_end  # a real run SIGKILLed, then resumed
def test_a_resumed_run_never_sends_an_x_request_id_an_earlier_run_sent(tmp_path):
    answers = iter([None, "one", "two"])  # the first request is held open until the run is killed
    first_sent = threading.Event()

    def script(body: dict[str, Any]) -> str | None:
        answer = next(answers)
        first_sent.set()
        return answer

    with scripted(script) as server:
        run_dir = tmp_path / "run"
        cfg = tmp_path / "plain.toml"
        cfg.write_text(tomli_w.dumps({
            "run": {"warmup": "off"},  # the server's script answers our agent's requests only
            "endpoints": [{"name": "box", "base_url": server.base_url, "model": "m"}],
            "agents": [{"name": "a0", "prompt": "p", "turns": ["q"], "max_tokens": 8}]}))
        proc = cerevisor(str(cfg), "--run-dir", str(run_dir))
        wait_until(first_sent.is_set, "the first request")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert anyio.run(run_here, cfg, run_dir, True)[0] == 0
    assert len(server.request_ids) == 3
    assert len(set(server.request_ids)) == 3, server.request_ids  # the resume's t1.a1 is not the first run's
    # the held request and the resume's first one are the same turn and attempt, under different ids
    assert server.request_ids[0].endswith(".a0.t1.a1") and server.request_ids[1].endswith(".a0.t1.a1")


@pytest.mark.end_to_end  # a real run SIGKILLed, then resumed
def test_a_cut_off_call_run_to_its_end_by_a_resume_is_reused_by_the_next_resume(tmp_path):
    notes, run_dir, ends = tmp_path / "notes.txt", tmp_path / "run", tmp_path / "slow_note_may_end"
    hold = threading.Event()
    hold.set()

    def script(body: dict[str, Any]) -> dict[str, Any] | str | None:
        done = tool_results(body)
        if not done:
            return {"name": "fake__note", "arguments": {"path": str(notes), "text": "a"}}
        if len(done) == 1:  # it sleeps until `ends` exists: through the crash, then not in the resume
            return {"name": "fake__slow_note", "arguments": {"path": str(notes), "text": "b", "seconds": 600,
                                                             "until": str(ends)}}
        return None if hold.is_set() else "done"

    with scripted(script) as server:
        cfg = config(tmp_path, server.base_url)
        # killed while slow_note sleeps, its line written
        killed_after(cerevisor(str(cfg), "--run-dir", str(run_dir)), run_dir,
                     lambda rs: any(r["event"] == "ToolCallStarted" and r["tool"] == "slow_note" for r in rs)
                     and notes.read_text().count("b") == 1)
        # resumed with --approve-all: `a` is reused, `b` runs again to its end; killed waiting for the answer
        ends.touch()
        killed_after(cerevisor(str(cfg), "--resume", str(run_dir), "--approve-all"), run_dir,
                     lambda rs: sum(r["event"] == "ToolCallFinished" and r["tool"] == "slow_note"
                                    and r["outcome"] == "ok" for r in rs) == 1)
        assert notes.read_text() == "a\nb\nb\n"
        hold.clear()
        code, resumed = anyio.run(run_here, cfg, run_dir, True)  # headless, no --approve-all
    assert code == 0
    assert notes.read_text() == "a\nb\nb\n"  # the second resume ran neither call, nor asked about b
    assert [(e.tool, e.outcome) for e in resumed if e.kind == "ToolCallFinished"] == [("note", "ok"), ("slow_note", "ok")]
    assert not [e for e in resumed if e.kind == "ApprovalDecided"]
    assert not [e for e in resumed if e.kind == "RunNotice" and "may already" in e.message]
