"""The run directory under misuse and misfortune, through `cerevisor-tui run`: one process per run directory,
damaged journals, a changed config on resume, disk errors, and stopping a long chain. A run that holds a directory
against another, meets a limit of its process, or is signalled is a process of its own; a run nothing kills and a
refusal run in this process (`cli_here`: the command's own entry, its output read as a process's)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cerevisor_tui.config import SimSettings
from cerevisor_tui.sim import start_in_thread
from tests.conftest import cli_here, wait_until
from tests.forkserver import Limits
from tests.test_reliability import start_run, workflow

FAST = SimSettings(tokens_per_s=400, ttft_s=0.01)


def run_here(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`cerevisor-tui run ARGS` in this process (a traceback would fail the test where it is raised)."""
    return cli_here(capsys, "run", *args)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert "Traceback" not in err, err
    return out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def journal(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def statuses(run_dir: Path) -> dict[str, str]:
    return {a["name"]: a["status"] for a in json.loads((run_dir / "report.json").read_text())["agents"]}


# ---- one process per run directory ----------------------------------------------------------------------
def test_a_run_directory_in_use_or_holding_a_run_is_refused_and_a_killed_run_resumes(tmp_path, capsys):
    with start_in_thread(SimSettings(tokens_per_s=20)) as sim:
        slow = workflow(tmp_path / "slow.toml", sim.base_url, agents=2, max_tokens=400, deps=False)
        run_dir = tmp_path / "run"
        first = start_run(str(slow), "--run-dir", str(run_dir))
        try:
            wait_until(lambda: sim.state.running == 2)
            for args in (("--resume", str(run_dir)), ("--run-dir", str(run_dir))):
                second = run_here(capsys, str(slow), *args)
                line = one_line(second.stderr)
                assert second.returncode == 2
                assert f"run directory {run_dir} is in use by another run (process {first.pid})" in line
            assert sim.state.requests_total == 2  # the refused ones sent nothing
        finally:
            first.kill()  # the OS releases its lock
            first.wait(10)
        quick = workflow(tmp_path / "quick.toml", sim.base_url, agents=2, max_tokens=5, deps=False)
        fresh = run_here(capsys, str(quick), "--run-dir", str(run_dir))
        line = one_line(fresh.stderr)
        assert fresh.returncode == 2 and "already holds a run" in line and f"--resume {run_dir}" in line
        assert run_here(capsys, str(quick), "--resume", str(run_dir)).returncode == 0
    assert set(statuses(run_dir).values()) == {"completed"}
    assert len({e["run_id"] for e in journal(run_dir) if e["event"] == "RunStarted"}) == 1  # one run in it


def test_resume_names_a_run_or_is_an_error(tmp_path, capsys):
    cfg = workflow(tmp_path / "w.toml", "http://127.0.0.1:9/v1", agents=1)
    for value in ("", "  ", str(tmp_path / "nothing-here")):
        proc = cli_here(capsys, "run", str(cfg), "--resume", value)
        line = one_line(proc.stderr)
        assert proc.returncode == 2 and line.startswith("cerevisor-tui run: --resume: ")


# ---- damaged journals ------------------------------------------------------------------------------------
def test_a_damaged_journal_resumes_skipping_what_it_cannot_read(tmp_path, capsys):
    with start_in_thread(FAST) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=3, max_tokens=5, deps=False)
        run_dir = tmp_path / "run"
        assert run_here(capsys, str(cfg), "--run-dir", str(run_dir)).returncode == 0
        events = run_dir / "events.jsonl"
        raw = events.read_bytes()
        # the journal ends halfway through the last agent's end (a crash), with bad lines before it
        at = raw.rindex(b'{"event":"AgentFinished"')
        victim = json.loads(raw[at:raw.index(b"\n", at)])["agent"]
        damaged = (raw[:at] + b"\xff\xfe not UTF-8 \xc3\x28\n" + b"[1, 2]\n"
                   + b'{"event":"AgentFinished","status":"completed","output":"no agent"}\n'
                   + b'{"event":"AgentFinished","agent":["a0"],"status":"completed"}\n'
                   + b'{"event":"AgentStarted","t":"soon","agent":"a0","attempt":1,"turn":1}\n'
                   + raw[at:at + 40])
        events.write_bytes(damaged)
        asked = dict(sim.state.requests_by_agent)
        proc = run_here(capsys, str(cfg), "--resume", str(run_dir))
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 0, err
        after = dict(sim.state.requests_by_agent)
    first_bad = raw[:at].count(b"\n") + 1
    assert one_line(err) == (f"cerevisor-tui run: resume: 6 unreadable lines of {events} skipped "
                             f"(first: line {first_bad}: invalid UTF-8)")
    # its end was lost, not its answers: it completes from them, and nothing is sent again
    assert f"{victim}: turns 1-2 answered before, taken from the journal; none is left to send" in out
    assert after == asked
    # the resumed run's first line starts on a line of its own, after the cut one; all it wrote reads
    text = events.read_bytes()
    assert text.startswith(damaged + b"\n")
    for line in text[len(damaged) + 1:].splitlines():
        json.loads(line)
    assert set(statuses(run_dir).values()) == {"completed"}


# ---- a changed config on resume ---------------------------------------------------------------------------
def chain(path: Path, url: str, *, a1: str = "refine: {{ a0.output }}", a2: str = "check: {{ a1.output }}",
          a2_deps: str = '["a1"]', b_tokens: int = 5) -> Path:
    path.write_text(f'''[run]
mode = "parallel"
max_concurrency = 4
[[endpoints]]
name = "box"
base_url = "{url}"
[[agents]]
name = "a0"
prompt = "start"
max_tokens = 5
[[agents]]
name = "a1"
prompt = "{a1}"
depends_on = ["a0"]
max_tokens = 5
[[agents]]
name = "a2"
prompt = "{a2}"
depends_on = {a2_deps}
max_tokens = 5
[[agents]]
name = "b"
prompt = "alone"
max_tokens = {b_tokens}
''')
    return path


@pytest.mark.warmup_auto  # each run warms its endpoint as a user's does (`[run] warmup = "auto"`, loopback)
def test_resume_reruns_what_changed_and_everything_downstream_and_says_why(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with start_in_thread(FAST) as sim:
        def run(cfg: Path, *args: str) -> tuple[str, dict[str, int]]:
            before = dict(sim.state.requests_by_agent)
            proc = run_here(capsys, str(cfg), *args)
            out, err = proc.stdout, proc.stderr
            assert proc.returncode == 0, err
            return out, {a: n - before.get(a, 0) for a, n in sim.state.requests_by_agent.items()
                         if n - before.get(a, 0)}

        out, sent = run(chain(tmp_path / "w.toml", sim.base_url), "--run-dir", str(run_dir))
        assert sent == {"warmup": 1, "a0": 1, "a1": 1, "a2": 1, "b": 1}  # the warm-up first ([run] warmup)

        out, sent = run(chain(tmp_path / "w.toml", sim.base_url, a1="refine better: {{ a0.output }}"),
                        "--resume", str(run_dir))
        assert sent == {"warmup": 1, "a1": 1, "a2": 1}
        assert "a1: completed before, runs again: prompt changed" in out
        assert "a2: completed before, runs again: its dependency a1 runs again" in out
        report = {a["name"]: a for a in json.loads((run_dir / "report.json").read_text())["agents"]}
        assert report["a1"]["rerun_reason"] == "prompt changed" and report["a0"]["rerun_reason"] == ""
        assert {e["agent"] for e in journal(run_dir) if e["event"] == "AgentRerun"} == {"a1", "a2"}

        out, sent = run(tmp_path / "w.toml", "--resume", str(run_dir))  # the same config again: nothing to do
        assert sent == {} and "runs again" not in out  # no warm-up either: no agent is sent

        # a removed dependency (and the answer it inserted), and a changed setting
        out, sent = run(chain(tmp_path / "w.toml", sim.base_url, a1="refine better: {{ a0.output }}", a2="check",
                              a2_deps="[]", b_tokens=6), "--resume", str(run_dir))
        assert sent == {"warmup": 1, "a2": 1, "b": 1}
        assert "a2: completed before, runs again: prompt changed, depends_on [a1] -> []" in out
        assert "b: completed before, runs again: max_tokens 5 -> 6" in out
    assert set(statuses(run_dir).values()) == {"completed"}


# ---- disk errors -------------------------------------------------------------------------------------------
def test_an_unwritable_report_path_is_an_error_before_any_request(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with start_in_thread(FAST) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=1)
        for i, report in enumerate((blocker / "r.json", tmp_path)):
            proc = cli_here(capsys, "run", str(cfg), "--run-dir", str(tmp_path / f"run{i}"), "--report", str(report))
            line = one_line(proc.stderr)
            assert proc.returncode == 2 and f"report path {report} " in line
        assert sim.state.requests_total == 0


def test_a_file_size_limit_mid_run_stops_it_in_one_line_and_what_was_written_resumes(tmp_path, capsys):
    """`ulimit -f`: a write past it fails with EFBIG (the run ignores SIGXFSZ, which would kill it unsaid)."""
    limit = 16_000

    with start_in_thread(FAST) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=8, max_tokens=40)
        run_dir = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "run", str(cfg), "--run-dir", str(run_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=Limits(((resource.RLIMIT_FSIZE, limit, limit),)),
                                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})  # no .pyc write before main
        out, err = finish(proc)
        assert proc.returncode == 1, err
        line = one_line(err)
        assert line.startswith(f"cerevisor-tui run: cannot write {run_dir}/") and "File too large" in line
        assert "the run stopped" in line
        assert "CANCELLED: run stopped: cannot write" in out and "COMPLETED" in out  # it stopped mid-run
        events = run_dir / "events.jsonl"
        assert events.stat().st_size <= limit
        for raw in events.read_bytes().splitlines():
            json.loads(raw)  # every line reads: the write that failed part-way was taken back
        if (run_dir / "report.json").exists():
            json.loads((run_dir / "report.json").read_text())  # a report is whole or the one before
        assert run_here(capsys, str(cfg), "--resume", str(run_dir)).returncode == 0
    assert set(statuses(run_dir).values()) == {"completed"}


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_mid_run_stops_it_in_one_line_and_a_read_only_one_is_refused_before_sending(tmp_path, capsys):
    with start_in_thread(FAST) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=8, max_tokens=40)
        with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
            proc = run_here(capsys, str(cfg), "--run-dir", str(ro / "run"))
            line = one_line(proc.stderr)
            assert proc.returncode == 2 and "not usable: Read-only file system" in line
            assert sim.state.requests_total == 0
        with tmpfs(tmp_path / "disk", "size=40k") as disk:
            run_dir = disk / "run"
            proc = start_run(str(cfg), "--run-dir", str(run_dir))
            out, err = finish(proc)
            assert proc.returncode == 1, err
            line = one_line(err)
            assert f"cannot write {run_dir}/" in line and "No space left on device" in line
            assert "CANCELLED: run stopped: cannot write" in out and sim.state.requests_total > 0
            for raw in (run_dir / "events.jsonl").read_bytes().splitlines():
                json.loads(raw)  # no cut line: the write that found the disk full was taken back
            for transcript in (run_dir / "transcripts").iterdir():
                for raw in transcript.read_bytes().splitlines():
                    json.loads(raw)
            subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
            assert run_here(capsys, str(cfg), "--resume", str(run_dir)).returncode == 0
            assert set(statuses(run_dir).values()) == {"completed"}


# ---- stopping ----------------------------------------------------------------------------------------------
def test_sigterm_on_a_long_chain_cancels_the_rest_in_one_step(tmp_path):
    agents = 1000
    with start_in_thread(SimSettings(tokens_per_s=20)) as sim:
        cfg = tmp_path / "chain.toml"
        lines = [f'[run]\nmetrics_interval_s = 5\n[[endpoints]]\nname = "box"\nbase_url = "{sim.base_url}"\n']
        for i in range(agents):
            dep = f'depends_on = ["a{i - 1}"]\n' if i else ""
            lines.append(f'[[agents]]\nname = "a{i}"\nprompt = "step {i}"\nmax_tokens = 400\n{dep}')
        cfg.write_text("\n".join(lines))
        run_dir = tmp_path / "run"
        proc = start_run(str(cfg), "--run-dir", str(run_dir))
        wait_until(lambda: sim.state.running == 1 and sim.state.requests_by_agent.get("a0"))  # after the warm-up
        proc.send_signal(signal.SIGTERM)
        out, err = finish(proc, timeout=30)
        assert proc.returncode == 143, err
    kinds = [e["event"] for e in journal(run_dir)]
    assert kinds.count("WaveStarted") == 1 and kinds.count("WaveFinished") == 1  # no wave-by-wave cancelling
    assert list(statuses(run_dir).values()) == ["cancelled"] * agents


HANG = """
import sys, threading, anyio
from pathlib import Path
marker, where = Path(sys.argv[1]), sys.argv[2]
if where == "shutdown":  # the run's endpoints never finish closing, even when cancelled
    from cerevisor_tui.sim import SimServer
    async def never(self, *exc):
        marker.write_text("hanging")
        with anyio.CancelScope(shield=True):
            await anyio.sleep_forever()
    SimServer.__aexit__ = never
else:  # the last report write never returns
    from cerevisor_tui.engine.sinks.journal import Journal
    def never(self, **kwargs):
        marker.write_text("hanging")
        threading.Event().wait()
    Journal.write_report = never
from cerevisor_tui.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("where", ["shutdown", "report"])
def test_a_second_signal_ends_a_stop_that_hangs(tmp_path, where):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n[endpoints.sim]\ntokens_per_s = 5\n'
                   '[[agents]]\nname = "a"\nprompt = "p"\nmax_tokens = 400\n')
    marker, run_dir = tmp_path / "hanging", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HANG, str(marker), where, "run", str(cfg), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = run_dir / "events.jsonl"
    wait_until(lambda: events.exists() and '"FirstToken"' in events.read_text())
    proc.send_signal(signal.SIGTERM)
    wait_until(marker.exists)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc, timeout=20)
    assert proc.returncode == 143, err
    assert "SIGTERM: stopping" in err
    if where == "shutdown":  # the event loop still runs: it hears the second signal too, and says so
        assert "second signal, stopping now" in err


def test_the_console_holds_its_run_directory_as_a_headless_run_does(tmp_path):
    from cerevisor_tui.commands import console
    from cerevisor_tui.engine.resume import JournalState
    from cerevisor_tui.engine.sinks.journal import JournalError

    path = tmp_path / "team.toml"
    path.write_text(console.demo_text())
    setup = console.resolve_config(str(path))
    runs = console.ConsoleRuns(setup.config, tmp_path / "runs", console.config_key(setup))
    engine = runs.open_fresh()
    run_dir = Path(engine.run_dir)
    last = console.LastRun(run_dir, JournalState(engine.run_id), 0, len(setup.config.agents))
    try:
        headless = start_run(str(path), "--resume", str(run_dir))
        line = one_line(finish(headless)[1])
        assert headless.returncode == 2 and f"in use by another run (process {os.getpid()})" in line
        with pytest.raises(JournalError, match="in use by another run"):
            runs.resume(last)  # nor a second run of this console
    finally:
        runs.close()
    runs.resume(last)  # released with the journal
    runs.close()
