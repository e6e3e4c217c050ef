"""What `--resume` keeps of a journal it reads line by line: the answers of completed agents and the events the
report counts, never their messages (the bulk of a journal); what cannot be read is counted as before. And what
a resumed run sends: never an X-Request-Id an earlier run of the directory sent."""

from __future__ import annotations

import json
import subprocess
import sys

from cerevisor_tui.engine.sinks.journal import REPLAYED, read_journal


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
    kinds = {e["event"] for e in state.history}
    assert "MessageRecorded" not in kinds and "TurnFinished" in kinds and "AgentFinished" in kinds
    assert kinds <= REPLAYED | {"AgentFinished"}
    turns = [e for e in state.history if e["event"] == "TurnFinished"]
    assert sorted((e["agent"], e["turn"]) for e in turns) == [(f"a{i}", t) for i in range(3) for t in (1, 2)]
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
