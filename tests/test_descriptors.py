"""File descriptors are bounded: a run holds at most TRANSCRIPTS_OPEN transcripts open (each opened when written
and closed at its agent's end), raises its soft descriptor limit to the hard one at start, and a connection it
cannot open for want of descriptors (EMFILE) is an error of its own, never "the server is loading". Through real
processes, under real limits."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.report import Report
from tests.conftest import free_port
from tests.forkserver import Limits


def _workflow(path: Path, agents: int, concurrency: int) -> Path:
    lines = ['[run]', 'mode = "parallel"', f"max_concurrency = {concurrency}", 'warmup = "off"', "",
             "[[endpoints]]", 'name = "sim"', 'kind = "simulated"', "[endpoints.sim]", "speed = 100.0", ""]
    for i in range(agents):
        lines += ["[[agents]]", f'name = "a{i}"', 'prompt = "hi"', "max_tokens = 2", ""]
    path.write_text("\n".join(lines))
    return path


def _run_under(limit: tuple[int, int], workflow: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(workflow), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=Limits(((resource.RLIMIT_NOFILE, *limit),)))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_a_journal_holds_a_bounded_number_of_transcripts_open_and_loses_no_line(tmp_path):
    from cerevisor_tui.engine.sinks.journal import TRANSCRIPTS_OPEN, Journal

    journal = Journal(tmp_path / "run", Report())
    journal.open()
    before = _open_fds()
    names = [f"a{i}" for i in range(3 * TRANSCRIPTS_OPEN)]
    for name in names:
        journal(ev.AgentQueued(0.0, name, 0))
    for turn in (1, 2):  # each agent written, the others after it, then again: every file reopened once
        for name in names:
            journal(ev.MessageRecorded(0.0, name, 1, turn, "user", f"{name} turn {turn}"))
            assert _open_fds() - before <= TRANSCRIPTS_OPEN
    for name in names[:10]:
        journal(ev.AgentFinished(0.0, name, "completed", "", "", {}))
    assert _open_fds() - before <= TRANSCRIPTS_OPEN - 10 + 10  # the ended ones are closed, not kept
    journal.close()
    assert _open_fds() < before  # the events file and the lock too
    assert not journal.error
    for name in names:
        lines = (tmp_path / "run" / "transcripts" / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line)["content"] for line in lines] == [f"{name} turn 1", f"{name} turn 2"]


def test_a_run_of_more_agents_than_its_descriptor_limit_completes(tmp_path):
    # soft and hard limit 160: nothing to raise, and 200 transcripts could never be open at once
    proc = _run_under((160, 160), _workflow(tmp_path / "wf.toml", 200, 8), tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["totals"]["completed"] == 200
    assert len(list((tmp_path / "run" / "transcripts").glob("*.jsonl"))) == 200


def test_a_run_raises_its_soft_descriptor_limit_to_the_hard_one(tmp_path):
    # 48 agents at once, each a connection at both ends of the in-process simulator's loopback: past a soft 64
    soft, hard = 64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard descriptor limit here is {hard}")
    proc = _run_under((soft, hard), _workflow(tmp_path / "wf.toml", 48, 48), tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "report.json").read_text())["totals"]["completed"] == 48


def test_out_of_descriptors_on_connect_is_an_error_and_never_waited_on_as_a_loading_server(tmp_path):
    # the run's process has every descriptor it may have open: its agent's connection cannot be made
    script = textwrap.dedent(f"""
        import json, os, anyio
        from cerevisor_tui.config import validate
        from cerevisor_tui.engine.engine import Engine

        async def main():
            engine = Engine(validate({{
                "run": {{"warmup": "off"}},
                "stall": {{"first_byte_timeout_s": 20}},
                "endpoints": [{{"name": "box", "kind": "local", "base_url": "http://127.0.0.1:{free_port()}/v1",
                               "model": "m"}}],
                "agents": [{{"name": "a", "prompt": "p", "retries": 1}}]}}))
            seen = []
            engine.subscribe(seen.append)
            hog = []

            def take_every_descriptor(event):  # once the run's clients are made, before its agent connects
                if event.kind == "RunStarted":
                    try:
                        while True:
                            hog.append(os.open(os.devnull, os.O_RDONLY))
                    except OSError:
                        pass

            engine.subscribe(take_every_descriptor)
            code = await engine.run()
            for fd in hog:
                os.close(fd)
            print(json.dumps({{"code": code, "kinds": [e.kind for e in seen],
                              "error": engine.agents["a"].error}}))

        anyio.run(main)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["code"] == 1
    assert "EndpointWaiting" not in out["kinds"]  # not "waiting for endpoint" for its first-byte window
    assert out["kinds"].count("AgentRetrying") == 1  # an error of ours: retried as the agent's retries say
    assert "out of file descriptors" in out["error"] and "Traceback" not in proc.stderr
