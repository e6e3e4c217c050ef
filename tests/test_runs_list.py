"""`ls` on a run whose socket does not answer us: its lock says whether a process still runs it."""

from __future__ import annotations

from pathlib import Path

from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.events import encode_event
from cerevisor_tui.engine.sinks.journal import EVENTS_FILE, RunLock
from cerevisor_tui.supervisor.runs import run_info


def _started_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    started = ev.RunStarted(t=0.0, run_id=run_dir.name, mode="parallel", max_concurrency=4, waves=[["a", "b"]],
                            endpoints=[])
    (run_dir / EVENTS_FILE).write_bytes(encode_event(started) + b"\n")


def test_a_run_whose_lock_is_held_is_live_though_its_socket_is_not_ours(tmp_path: Path):
    """Another user's run in a shared runs dir: its socket refuses us, its process holds the lock. It runs: it is
    not `crashed` (what `run --resume` would be told to take over)."""
    run_dir = tmp_path / "20261202-100000-other"
    _started_run(run_dir)
    assert run_info(run_dir).state == "crashed"  # no process: what a killed run leaves
    lock = RunLock(run_dir).acquire()  # (a flock of another open file: refused to run_info as to another process)
    try:
        info = run_info(run_dir)
        assert info.state == "live" and info.pid is None, info
    finally:
        lock.release()
    assert run_info(run_dir).state == "crashed"
