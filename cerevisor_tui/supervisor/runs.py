"""The runs under a runs directory, as `ls`, `attach` and `stop` see them: live (its control socket
answers), finished (every agent completed), resumable (it ended with agents not completed) or crashed (it
ended without its RunFinished: killed, or the machine went down; `run --resume` goes on with it).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cerevisor_tui.engine.sinks.journal import EVENTS_FILE
from cerevisor_tui.supervisor.protocol import read_supervisor, socket_of


@dataclass
class RunInfo:
    run_id: str
    path: Path
    state: str  # live | finished | resumable | crashed
    done: int  # agents completed
    total: int
    started: float  # wall-clock seconds
    pid: int | None = None
    exit_code: int | None = None
    sessions: int = 0  # a gateway's sessions (not among the agents)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        data["started"] = datetime.fromtimestamp(self.started).isoformat(timespec="seconds")
        return data


def answers(path: Path) -> bool:
    """Something listens on this Unix socket (a live run); it is not spoken to."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _started(run_dir: Path, run_id: str, supervisor: dict[str, Any]) -> float:
    if isinstance(supervisor.get("started_at"), int | float):
        return float(supervisor["started_at"])
    with contextlib.suppress(ValueError):
        return datetime.strptime(run_id[:15], "%Y%m%d-%H%M%S").timestamp()
    with contextlib.suppress(OSError):
        return (run_dir / EVENTS_FILE).stat().st_mtime
    return 0.0


def run_info(run_dir: Path) -> RunInfo | None:
    """What a run directory's journal and socket say; None when it is not a run directory."""
    path = run_dir / EVENTS_FILE
    try:
        fh = open(path, "rb")
    except OSError:
        return None
    run_id, agents, status, finished, sessions = run_dir.name, 0, {}, None, set()
    with fh:
        for raw in fh:
            # only the lines that matter here are parsed: a long run's journal is mostly other events
            if (b'"RunStarted"' not in raw and b'"AgentFinished"' not in raw and b'"RunFinished"' not in raw
                    and b'"SessionOpened"' not in raw):
                continue
            try:
                data = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(data, dict):
                continue
            kind = data.get("event")
            if kind == "RunStarted":
                run_id = str(data.get("run_id") or run_id)
                waves = data.get("waves") if isinstance(data.get("waves"), list) else []
                agents = sum(len(w) for w in waves if isinstance(w, list))
                finished = None
            elif kind == "SessionOpened" and isinstance(data.get("agent"), str):
                sessions.add(data["agent"])
            elif kind == "AgentFinished" and isinstance(data.get("agent"), str):
                status[data["agent"]] = data.get("status")
            elif kind == "RunFinished":
                finished = data.get("exit_code") if isinstance(data.get("exit_code"), int) else 1
    done = sum(1 for name, s in status.items() if s == "completed" and name not in sessions)
    supervisor = read_supervisor(run_dir)
    if answers(socket_of(run_dir)):
        state = "live"
    elif finished is None:
        state = "crashed"
    else:
        state = "finished" if done >= agents else "resumable"
    pid = supervisor.get("pid") if state == "live" and isinstance(supervisor.get("pid"), int) else None
    return RunInfo(run_id, run_dir, state, done, agents, _started(run_dir, run_id, supervisor), pid, finished,
                   len(sessions))


def list_runs(runs_dir: Path) -> list[RunInfo]:
    """Every run under `runs_dir`, newest first."""
    try:
        entries = [p for p in runs_dir.iterdir() if p.is_dir()]
    except OSError:
        return []
    runs = [info for p in entries if (info := run_info(p)) is not None]
    runs.sort(key=lambda r: (r.started, r.run_id), reverse=True)
    return runs


def find(run: str | None, runs_dir: Path, *, live: bool = False) -> Path:
    """The run directory RUN names (a directory, or a run id under `runs_dir`); without RUN the newest live
    run. Raises LookupError with one line that says what there is instead."""
    if run:
        path = Path(run)
        if not (path / EVENTS_FILE).is_file():
            path = runs_dir / run
        if not (path / EVENTS_FILE).is_file():
            raise LookupError(f"no run {run!r}: neither a run directory nor a run id under {runs_dir}")
        info = run_info(path) if live else None
        if info is not None and info.state != "live":  # stop: there is nothing to stop
            raise LookupError(f"run {info.run_id} is {info.state}: nothing to stop")
        return path
    runs = list_runs(runs_dir)
    for info in runs:
        if info.state == "live":
            return info.path
    if not runs:
        raise LookupError(f"no runs under {runs_dir}")
    newest = runs[0]
    if live:  # stop: there is nothing to stop
        raise LookupError(f"no live run to stop under {runs_dir} (the newest, {newest.run_id}, is {newest.state})")
    raise LookupError(f"no live run to attach to under {runs_dir}; the newest is {newest.run_id} ({newest.state}): "
                      "name it to open it")


def age(seconds: float) -> str:
    left = max(0.0, time.time() - seconds)
    if left < 90:
        return f"{left:.0f} s ago"
    if left < 5400:
        return f"{left / 60:.0f} min ago"
    if left < 48 * 3600:
        return f"{left / 3600:.0f} h ago"
    return f"{left / 86400:.0f} d ago"
