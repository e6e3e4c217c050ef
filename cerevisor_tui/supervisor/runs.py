"""The runs under a runs directory, as `ls`, `attach` and `stop` see them: live (its control socket
answers, as this very run, or a process holds its lock: another user's run), finished (every agent completed), resumable (it ended with agents not completed),
crashed (it ended without its RunFinished: killed, or the machine went down; `run --resume` goes on with it)
or unreadable (its supervisor.json does not check: `problem` says why).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.events import EventError, decode_event
from cerevisor_tui.contract.wire import PROTOCOL, Hello, Welcome, WireError, encode, read_server
from cerevisor_tui.engine.sinks.journal import EVENTS_FILE, LOCK_FILE
from cerevisor_tui.supervisor.protocol import (
    SOCKET_NAME,
    SUPERVISOR_FILE,
    SupervisorFile,
    check_server,
    check_user,
    supervisor_file,
)

ANSWER_WAIT_S = 2.0
"""How long `ls` waits for a run's socket to take its hello and answer it."""
HELLO_LINE_MAX = 64 * 1024


@dataclass
class RunInfo:
    run_id: str
    path: Path
    state: str  # live | finished | resumable | crashed | unreadable
    done: int  # agents completed
    total: int
    started: float  # wall-clock seconds: the run's first start, also once it was resumed
    pid: int | None = None
    exit_code: int | None = None
    sessions: int = 0  # a gateway's sessions (not among the agents)
    resumed: float = 0.0  # when it was last taken up again (0: never)
    problem: str = ""  # why it is unreadable, or why its socket is not its own
    stopped: str = ""  # why it was stopped (its last RunStopping), "" when it was not
    uid: int | None = None  # whose it is: the owner of its supervisor.json (its journal's, before it has one)
    by: str = ""  # who started it, as supervisor.json says (`alice from 10.0.0.5`)

    @property
    def mine(self) -> bool:
        """Started by this user (the same uid; on a shared account `by` is what tells people apart)."""
        return self.uid == os.getuid()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        data["started"] = _iso(self.started)
        data["resumed"] = _iso(self.resumed) if self.resumed else None
        return data


def _iso(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds).isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        return ""


def answers(path: Path) -> bool:
    """Something listens on this Unix socket (a live run); it is not spoken to."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def identify(run_dir: Path, path: Path) -> str | None:
    """Says hello on the socket at `path` and checks who answers (supervisor/protocol.py `check_server`): ""
    when it is the run in `run_dir`, why not when it is not, None when nothing there answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(ANSWER_WAIT_S)
        try:
            sock.connect(str(path))
        except (OSError, ValueError):
            return None
        problem = check_user(sock)
        if problem:
            return problem
        try:
            sock.sendall(encode(Hello(PROTOCOL, replay=False)))
            with sock.makefile("rb") as fh:
                hello = read_server(fh.readline(HELLO_LINE_MAX))
        except (OSError, WireError) as exc:
            return f"what answers at {path} is not a run of this version: {exc}"
        if not isinstance(hello, Welcome):
            return f"the run at {path} refused: {getattr(hello, 'reason', type(hello).__name__)}"
        return check_server(run_dir, sock, hello)


def _started(run_dir: Path, run_id: str, supervisor: SupervisorFile | None) -> float:
    if supervisor is not None and supervisor.started_at > 0:
        return supervisor.started_at
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
    run_id, agents, finished, stopped = run_dir.name, 0, None, ""
    status: dict[str, str] = {}
    sessions: set[str] = set()
    with fh:
        for raw in fh:
            # only the lines that matter here are parsed: a long run's journal is mostly other events
            if (b'"RunStarted"' not in raw and b'"AgentFinished"' not in raw and b'"RunFinished"' not in raw
                    and b'"SessionOpened"' not in raw and b'"RunStopping"' not in raw):
                continue
            try:
                event = decode_event(raw)  # checked as this version's event: a line that is not one is passed over
            except (EventError, RecursionError):
                continue
            if isinstance(event, ev.RunStarted):  # (again, when it was resumed)
                run_id, agents, finished, stopped = event.run_id or run_id, sum(map(len, event.waves)), None, ""
            elif isinstance(event, ev.RunStopping):
                stopped = event.reason
            elif isinstance(event, ev.SessionOpened):
                sessions.add(event.agent)
            elif isinstance(event, ev.AgentFinished):
                status[event.agent] = event.status
            elif isinstance(event, ev.RunFinished):
                finished = event.exit_code
    done = sum(1 for name, s in status.items() if s == "completed" and name not in sessions)
    try:
        supervisor = supervisor_file(run_dir)
    except ValueError as exc:
        return RunInfo(run_id, run_dir, "unreadable", done, agents, _started(run_dir, run_id, None), None, finished,
                       len(sessions), problem=str(exc), stopped=stopped, uid=_owner(run_dir))
    problem = identify(run_dir, Path(supervisor.socket) if supervisor else run_dir / SOCKET_NAME)
    if problem == "" or (finished is None and _running(run_dir)):
        state = "live"  # (its socket may not be ours to speak to: another user's run in a shared runs dir)
    elif finished is None:
        state = "crashed"
    else:
        state = "finished" if done >= agents else "resumable"
    pid = supervisor.pid if state == "live" and supervisor is not None else None
    return RunInfo(run_id, run_dir, state, done, agents, _started(run_dir, run_id, supervisor), pid, finished,
                   len(sessions), supervisor.resumed_at if supervisor else 0.0, problem or "", stopped,
                   _owner(run_dir), supervisor.by if supervisor else "")


def _running(run_dir: Path) -> bool:
    """A process holds the run's lock (journal.py RunLock): it runs, though its socket did not answer us (another
    user's run, whose socket is not ours to connect to, or one still starting)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (releases a lock it took)
    return False


def _owner(run_dir: Path) -> int | None:
    """The uid that owns a run: of the supervisor.json its process wrote, else of its journal."""
    for name in (SUPERVISOR_FILE, EVENTS_FILE):
        with contextlib.suppress(OSError):
            return (run_dir / name).stat().st_uid
    return None


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
            raise LookupError(f"run {info.run_id} is {info.state}: nothing to stop"
                              + (f"; {info.problem}" if info.problem else ""))
        return path
    runs = list_runs(runs_dir)
    for info in runs:
        if info.state == "live" and info.mine:
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
