"""What `--resume` keeps of a journal it reads line by line: the answers of completed agents and the events the
report counts, never their messages (the bulk of a journal); what cannot be read is counted as before. And what
a resumed run sends: never an X-Request-Id an earlier run of the directory sent."""

from __future__ import annotations

import json
import subprocess
import sys

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.resume import REPLAYED, read_journal


def test_a_resume_keeps_the_reported_events_of_completed_agents_and_not_their_messages(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n[endpoints.sim]\nspeed = 50\n'
                   + "".join(f'[[agents]]\nname = "a{i}"\nprompt = "task {i}"\nturns = ["more"]\nmax_tokens = 8\n'
                             for i in range(3)))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(cfg), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = run_dir / "events.jsonl"
    with open(events, "a") as fh:  # a damaged line in the middle, and a cut one at the end
        fh.write("not json\n" + events.read_text().splitlines()[-1][:30])
    state = read_journal(run_dir)
    assert set(state.completed) == {"a0", "a1", "a2"}
    kinds = {e.kind for e in state.history}
    assert "MessageRecorded" not in kinds and "TurnFinished" in kinds and "AgentFinished" in kinds
    assert kinds <= REPLAYED | {"AgentFinished"}
    turns = [e for e in state.history if isinstance(e, ev.TurnFinished)]
    assert sorted((e.agent, e.turn) for e in turns) == [(f"a{i}", t) for i in range(3) for t in (1, 2)]
    assert state.turns == {}  # completed agents' turns are not kept
    assert state.skipped == 2
    lines = len(events.read_text().splitlines())
    assert state.first_problem == f"line {lines - 1}: not JSON"
    assert "truncated last line" not in state.first_problem
    # the resumed run's report carries the figures over: each agent's two turns
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(cfg), "--resume", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert [(a["status"], a["turns"]) for a in report["agents"]] == [("completed", 2)] * 3


def test_no_x_request_id_is_sent_twice_across_a_sigkill_and_two_resumes(tmp_path):
    import signal

    from cerevisor_tui.config import SimSettings
    from cerevisor_tui.sim import start_in_thread
    from tests.conftest import wait_until
    from tests.test_reliability import start_run, workflow

    with start_in_thread(SimSettings(tokens_per_s=200, ttft_s=0.02)) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=12, max_tokens=20, deps=False)
        run_dir = tmp_path / "run"
        events = run_dir / "events.jsonl"
        for args in (("--run-dir", str(run_dir)), ("--resume", str(run_dir))):
            proc = start_run(str(cfg), *args)
            before = len(sim.state.requests)
            wait_until(lambda: len(sim.state.requests) >= before + 4, "requests in flight")  # noqa: B023
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        assert events.read_text().count('"RunStarted"') == 2
        proc = start_run(str(cfg), "--resume", str(run_dir))
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        ids = [r["request_id"] for r in sim.state.requests]
    assert len(ids) > 12 * 2  # the killed runs' requests are sent again
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1][:5]


def test_a_journal_of_the_dataclass_version_resumes(tmp_path):
    """tests/fixtures/journals/events.jsonl, written by the version before the typed contract (its AgentFinished
    inputs without the keys added since, its messages without what a turn ran with), read once and taken up by
    a resumed run: its completed agents are reused with their figures, a new agent runs."""
    import shutil
    from pathlib import Path

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "journals" / "events.jsonl", run_dir / "events.jsonl")
    state = read_journal(run_dir)
    assert state.skipped == 0 and state.run_id == "20261201-201450-3a33"
    assert set(state.completed) == {"a0", "stuck", "a1"} and state.turns == {}
    cfg = tmp_path / "w.toml"
    cfg.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n[endpoints.sim]\nspeed = 50\n'
                   '[[endpoints]]\nname = "stalls"\nkind = "simulated"\n[endpoints.sim]\nspeed = 50\n'
                   '[[agents]]\nname = "a0"\nprompt = "use the tool"\nmax_tokens = 8\n'
                   '[[agents]]\nname = "stuck"\nendpoint = "stalls"\nprompt = "hello"\nmax_tokens = 20\n'
                   '[[agents]]\nname = "a1"\nprompt = "go on from {{ a0.output }}"\nturns = ["and again"]\n'
                   'depends_on = ["a0"]\nmax_tokens = 13\n'
                   '[[agents]]\nname = "a2"\nprompt = "new"\nmax_tokens = 4\n')
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(cfg), "--resume", str(run_dir), "--jsonl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sent = [json.loads(line) for line in proc.stdout.splitlines() if '"AgentStarted"' in line]
    assert {e["agent"] for e in sent} == {"a2"}  # nothing the old journal completed is sent again
    report = json.loads((run_dir / "report.json").read_text())
    assert {a["name"]: (a["status"], a["turns"]) for a in report["agents"]} == {
        "a0": ("completed", 2), "stuck": ("completed", 1), "a1": ("completed", 2), "a2": ("completed", 1)}


def test_each_journal_line_is_decoded_once_to_its_event_and_a_bad_one_is_counted_with_why(tmp_path):
    from cerevisor_tui.engine.sinks.journal import iter_events

    good = ev.encode_event(ev.AgentQueued(1.0, "a", 0))
    (tmp_path / "events.jsonl").write_bytes(b"\n".join([
        good, b"\xff\xfe not text", b"[1, 2]", b'{"event": "NoSuchEvent", "t": 1.0}',
        b'{"event": "AgentQueued", "t": 1.0, "agent": 7, "wave": 0}', b'{"event": "AgentQueued", "t": 1e400, '
        b'"agent": "a", "wave": 0}', b"", good, b'{"event": "AgentQu']))  # the last line cut short
    read = list(iter_events(tmp_path))
    assert [(n, type(e).__name__ if e else None) for n, e, _ in read] == [
        (1, "AgentQueued"), (2, None), (3, None), (4, None), (5, None), (6, None), (8, "AgentQueued"), (9, None)]
    problems = [why for _, e, why in read if e is None]
    assert problems[:3] == ["invalid UTF-8", "not an event", "NoSuchEvent: Invalid value 'NoSuchEvent' - at `$.event`"]
    assert problems[3].startswith("AgentQueued: Expected `str`, got `int`")
    assert problems[4].startswith("AgentQueued: ") and problems[5] == "truncated last line"
    state = read_journal(tmp_path)  # the resume's one pass over the same lines: counted, never a traceback
    assert state.skipped == 6 and state.first_problem == "line 2: invalid UTF-8"
