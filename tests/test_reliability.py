"""Reliability: signals, crash and resume, an unusable run directory, secrets, and more faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import start_in_thread
from tests.conftest import RawServer, chunk, cli_here, http_head, sse_chunk, wait_until


def workflow(path: Path, url: str, *, agents: int = 6, max_tokens: int = 30, extra_ep: str = "", deps: bool = True,
             extra_run: str = "") -> Path:
    # warmup off: these tests count the server's requests (its first ones fail, by fault)
    lines = [f'[run]\nmode = "parallel"\nmax_concurrency = 2\nwarmup = "off"\n{extra_run}[[endpoints]]\nname = "box"\nbase_url = "{url}"\n{extra_ep}']
    for i in range(agents):
        dep = f'depends_on = ["a{i - 1}"]\n' if deps and i >= max(1, agents // 2) else ""
        lines.append(f'[[agents]]\nname = "a{i}"\nprompt = "task {i}"\nturns = ["more {i}"]\nmax_tokens = {max_tokens}\n{dep}')
    path.write_text("\n".join(lines))
    return path


def start_run(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_cancels_running_agents_closes_connections_and_writes_the_report(tmp_path, signum, code):
    with start_in_thread(SimSettings(tokens_per_s=20)) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, max_tokens=200)
        proc = start_run(str(cfg), "--run-dir", str(tmp_path / "run"))
        wait_until(lambda: sim.state.running == 2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == code, err
        wait_until(lambda: sim.state.running == 0, timeout=2)
        assert sim.state.aborted_total >= 2
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    statuses = {a["name"]: a["status"] for a in report["agents"]}
    assert list(statuses.values()).count("cancelled") == 6
    assert "stopping" in err and "Traceback" not in err


def test_a_signal_just_after_the_first_request_to_the_built_in_simulator_ends_the_run(tmp_path):
    """3.11's asyncio.wait_for lost the cancel that closed the in-process simulator when it came as an abort
    woke its loop: the run cancelled its agents, then waited on the simulator for ever."""
    cfg = tmp_path / "w.toml"
    cfg.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n'
                   'sim = { tokens_per_s = 0.5 }\n[[agents]]\nname = "a0"\nprompt = "p"\n'
                   '[[agents]]\nname = "a1"\nprompt = "p"\ndepends_on = ["a0"]\n')
    run_dir = tmp_path / "run"
    proc = start_run(str(cfg), "--run-dir", str(run_dir))
    events = run_dir / "events.jsonl"
    try:
        wait_until(lambda: events.exists() and '"AgentStarted"' in events.read_text(), interval=0.005)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)  # a hang guard: it ends at once
    finally:
        proc.kill()  # one that hung goes, whatever this test says of it
        proc.wait()
    assert proc.returncode == 143, err
    assert "0/2 completed" in out and "2 cancelled" in out


def test_sigkill_mid_run_then_resume_completes_without_asking_twice(tmp_path, capsys):
    # an agent's two turns take about 0.35 s: after two complete, four (three of them in a chain) are left
    with start_in_thread(SimSettings(tokens_per_s=160, ttft_s=0.05)) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=6, max_tokens=20)
        run_dir = tmp_path / "run"
        proc = start_run(str(cfg), "--run-dir", str(run_dir))
        events = run_dir / "events.jsonl"
        wait_until(lambda: events.exists() and events.read_text().count('"status":"completed"') >= 2)
        proc.kill()
        proc.wait(10)
        lines = events.read_text().splitlines()
        for line in lines[:-1]:
            json.loads(line)  # every line but possibly the last parses
        done_before = {json.loads(line)["agent"] for line in lines[:-1]
                       if '"AgentFinished"' in line and '"status":"completed"' in line}
        asked_before = dict(sim.state.requests_by_agent)
        resumed = cli_here(capsys, "run", str(cfg), "--resume", str(run_dir))  # nothing kills it: in this process
        assert resumed.returncode == 0, resumed.stderr
        asked_after = dict(sim.state.requests_by_agent)
    for name in done_before:  # a completed agent is never sent again
        assert asked_after[name] == asked_before[name]
    report = json.loads((run_dir / "report.json").read_text())
    assert {a["name"] for a in report["agents"] if a["status"] == "completed"} == {f"a{i}" for i in range(6)}
    # agents completed before the crash keep their figures in the resumed report
    assert all(a["turns"] == 2 and a["completion_tokens"] > 0 for a in report["agents"])
    # the same journal goes on: one RunStarted per run, appended
    kinds = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines() if line.startswith("{")]
    assert kinds.count("RunStarted") == 2


def test_a_resumed_agent_goes_on_after_the_turns_it_had_answered_and_never_sends_one_again(tmp_path, capsys):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[run]\nmode = "parallel"\n[[endpoints]]\nname = "box"\nbase_url = "{url}"\n'
                   '[[agents]]\nname = "long"\nprompt = "first"\nturns = ["second", "third", "fourth"]\n'
                   'max_tokens = 12\n')
    with start_in_thread(SimSettings(tokens_per_s=40, ttft_s=0.05)) as sim:
        cfg.write_text(cfg.read_text().replace("{url}", sim.base_url))
        run_dir = tmp_path / "run"
        proc = start_run(str(cfg), "--run-dir", str(run_dir))
        events = run_dir / "events.jsonl"
        wait_until(lambda: events.exists() and any('"TurnFinished"' in line and '"turn":2,' in line
                                                   for line in events.read_text().splitlines()), timeout=60)
        proc.kill()
        proc.wait(10)
        answered = {json.loads(line)["turn"]: json.loads(line)["content"] for line in events.read_text().splitlines()
                    if '"MessageRecorded"' in line and '"role":"assistant"' in line and '"partial":true' not in line}
        assert {1, 2} <= set(answered)
        before = len(list(sim.state.requests))
        resumed = cli_here(capsys, "run", str(cfg), "--resume", str(run_dir))  # nothing kills it: in this process
        out = resumed.stdout
        assert resumed.returncode == 0, resumed.stderr
        resent = [r for r in list(sim.state.requests)[before:] if r["agent"] == "long"]  # not the warm-up
    turns_sent = [int(r["request_id"].split(".t")[-1].split(".")[0]) for r in resent]
    done = max(answered)
    assert turns_sent and min(turns_sent) == done + 1, turns_sent  # no answered turn is sent again
    # the turns taken from the journal are the conversation the next turn is sent with, as they were answered
    first = resent[0]["messages"]
    assert [m["content"] for m in first if m["role"] == "assistant"] == [answered[t] for t in range(1, done + 1)]
    assert [m["content"] for m in first if m["role"] == "user"][:done + 1] == ["first", "second", "third", "fourth"][:done + 1]
    assert f"long: turns 1-{done} answered before, taken from the journal; it goes on at turn {done + 1}" in out
    report = json.loads((run_dir / "report.json").read_text())
    assert [a["status"] for a in report["agents"]] == ["completed"]
    assert report["agents"][0]["turns"] == 4  # the turns taken from the journal count in its figures


def test_recorded_turns_are_the_latest_unbroken_chain_of_answered_turns():
    from cerevisor_tui.contract import events as ev
    from cerevisor_tui.engine.resume import TurnChains

    def msg(turn, role, content, **more):
        return ev.MessageRecorded(0.0, "a", 1, turn, role, content, **more)

    def done(turn):
        return ev.TurnFinished(0.0, "a", 1, turn, 2, 5, 3, "stop", 0.1, 0.2)

    def recorded_turns(events):
        chains = TurnChains()
        for event in events:
            chains.feed(event)
        return chains.turns()

    call = [{"id": "call_1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]
    events = [
        msg(1, "user", "u1"), msg(1, "assistant", "old answer"), msg(2, "user", "u2"), msg(2, "assistant", "x2"),
        msg(1, "user", "u1", inputs={"temperature": "0.5"}),  # run again from turn 1: turn 2 belongs to before
        msg(1, "assistant", "half", partial=True),  # its attempt died
        done(1), msg(1, "assistant", "", tool_calls=call), msg(1, "tool", "result", tool_call_id="call_1"),
        done(1), msg(1, "assistant", "new answer"),
        msg(2, "user", "u2"), done(2),  # its figures, but killed before its answer was recorded
    ]
    [turn] = recorded_turns(events)["a"]
    assert (turn.user, turn.answer, turn.inputs) == ("u1", "new answer", {"temperature": "0.5"})
    assert [m["role"] for m in turn.messages] == ["assistant", "tool", "assistant"]
    assert turn.messages[0] == {"role": "assistant", "content": None, "tool_calls": call}
    assert [e.kind for e in turn.figures] == ["TurnFinished", "TurnFinished"]
    assert recorded_turns([msg(2, "user", "u2"), done(2), msg(2, "assistant", "x")]) == {}  # no turn 1: nothing


def test_an_unusable_run_directory_is_an_error_before_any_request(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with start_in_thread(SimSettings()) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=1)
        proc = cli_here(capsys, "run", str(cfg), "--run-dir", str(blocker / "run"))
        err = proc.stderr
        assert proc.returncode == 2
        assert "run directory" in err and "not usable" in err and "Traceback" not in err
        assert sim.state.requests_total == 0


def test_a_canary_key_reaches_the_server_and_nowhere_else(tmp_path, stream_process):
    """Read by the stream worker process too: it takes the key from the environment it inherits."""
    canary = "sk-canary-" + os.urandom(8).hex()
    with start_in_thread(SimSettings(tokens_per_s=2000, ttft_s=0.02)) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=2, extra_ep='api_key_env = "CEREVISOR_CANARY"\n',
                       extra_run=f'stream_process = "{"on" if stream_process else "off"}"\n')
        proc = start_run(str(cfg), "--run-dir", str(tmp_path / "run"), "--report", str(tmp_path / "r.json"),
                         env={"CEREVISOR_CANARY": canary})
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert {r["authorization"] for r in sim.state.requests} == {f"Bearer {canary}"}
        proc = start_run(str(cfg), "--jsonl", "--run-dir", str(tmp_path / "run2"), env={"CEREVISOR_CANARY": canary})
        out2, err2 = proc.communicate(timeout=60)
    for text in (out, err, out2, err2):
        assert canary not in text
    for path in [*tmp_path.rglob("*")]:
        if path.is_file():
            assert canary not in path.read_text(errors="replace"), path
    assert "CEREVISOR_CANARY" in (tmp_path / "r.json").read_text()  # the variable's name is shown, not its value


def test_a_key_is_not_sent_over_plain_http_to_another_host(tmp_path):
    cfg = workflow(tmp_path / "w.toml", "http://192.0.2.10:8000/v1", agents=1, extra_ep='api_key_env = "CEREVISOR_CANARY"\n')
    proc = start_run(str(cfg), env={"CEREVISOR_CANARY": "x"})
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "allow_insecure_http" in err and "clear text" in err


@pytest.mark.anyio
async def test_bytes_trickling_one_at_a_time_still_make_a_stream():
    body = sse_chunk("slow ") + sse_chunk("drip") + sse_chunk("", finish="stop") + b"data: [DONE]\n\n"

    async def trickle(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        for i in range(len(body)):
            writer.write(chunk(body[i:i + 1]))
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.write(chunk(b""))
        await writer.drain()

    async with RawServer(trickle) as srv:
        engine = Engine(validate({"stall": {"idle_timeout_s": 2, "liveness": "bytes"},
                                  "endpoints": [{"name": "e", "base_url": srv.base_url, "model": "m"}],
                                  "agents": [{"name": "a", "prompt": "p"}]}))
        assert await engine.run() == 0
    assert engine.agents["a"].output == "slow drip"


def test_a_server_killed_mid_stream_fails_the_agent_clearly_and_the_run_goes_on(tmp_path):
    from tests.conftest import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "sim", "--port", str(port), "--tokens-per-s", "10"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with start_in_thread(SimSettings(tokens_per_s=100)) as good:
            cfg = tmp_path / "w.toml"
            cfg.write_text(f'''[[endpoints]]
name = "doomed"
base_url = "http://127.0.0.1:{port}/v1"
kind = "hosted"
[[endpoints]]
name = "good"
base_url = "{good.base_url}"
[[agents]]
name = "victim"
endpoint = "doomed"
prompt = "p"
max_tokens = 100
retries = 0
[[agents]]
name = "other"
endpoint = "good"
prompt = "p"
max_tokens = 60
''')
            # a hosted endpoint fails at once on a refused port: the simulator process must be listening first
            wait_until(lambda: _listening(port))
            proc = start_run(str(cfg), "--run-dir", str(tmp_path / "run"))
            events = tmp_path / "run" / "events.jsonl"
            wait_until(lambda: events.exists() and '"event":"FirstToken","t"' in events.read_text()
                     and any('"FirstToken"' in line and '"victim"' in line for line in events.read_text().splitlines()))
            server.kill()
            out, err = proc.communicate(timeout=60)
    finally:
        server.kill()
    assert proc.returncode == 1
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    by_name = {a["name"]: a for a in report["agents"]}
    assert by_name["victim"]["status"] == "failed" and by_name["victim"]["error"].startswith("endpoint doomed: ")
    assert by_name["other"]["status"] == "completed"
    transcript = (tmp_path / "run" / "transcripts" / "victim.jsonl").read_text()
    assert '"partial":true' in transcript  # what arrived before the crash is kept, marked partial


@pytest.mark.anyio
async def test_operator_retry_restarts_a_running_attempt():
    async def endless(reader, writer):
        writer.write(http_head(200, "text/event-stream") + chunk(sse_chunk("x ")))
        await writer.drain()
        await reader.read()

    async with RawServer(endless) as srv:
        engine = Engine(validate({"stall": {"idle_timeout_s": 0.5},
                                  "endpoints": [{"name": "e", "base_url": srv.base_url, "model": "m"}],
                                  "agents": [{"name": "a", "prompt": "p", "retries": 0}]}))
        restarted = []

        def on_event(e):
            if e.kind == "FirstToken" and not restarted:
                restarted.append(engine.handle(cmd.Retry(agent="a")))
        engine.subscribe(on_event)
        with anyio.fail_after(10):
            assert await engine.run() == 1
    assert restarted == ["restarting"] and srv.requests == 2
