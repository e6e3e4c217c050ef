"""The run directory: `events.jsonl` (append-only), `transcripts/<agent>.jsonl`, `report.json`, and the
`lock` that keeps it to one process.

Every event but token deltas and keep-alives is appended (the transcripts hold the text): the lines told in
one turn of the event loop are gathered and written at its end in one `os.write` per file (a gateway request
tells about ten events over three or four turns; a write per line was most of the journal's cost), or at once
when no loop runs. A crash (the process killed) loses the lines of the turn it cut short, never a line
already written, and the next run that appends starts on a new line after a write it cut part-way; the file
is fsynced when an agent that ran ends, after what was gathered is written. The report is rewritten atomically
at every wave end and at the end of the run. A write that fails (a full disk, a file-size limit, a
read-only remount) does not raise into the run: the journal stops writing, keeps what it wrote, and
tells its owner once (`on_error`), who stops the run.

`iter_events` reads a run directory back, each line decoded once to its event (for `--resume`:
engine/resume.py `read_journal`; for a console shown an ended run: `read_events`): whatever it cannot read (a
truncated line, invalid UTF-8, a line of the wrong shape) is skipped and counted, never an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.report import Report, write_json_atomic

SKIPPED = frozenset({"TokenDelta", "KeepAlive"})
TRANSCRIPTS_OPEN = 64
"""Transcripts held open at once, the most recently written: another is opened when written to, and closed at its
agent's end, so a run of thousands of agents or gateway sessions holds 64 descriptors for them, not thousands."""
EVENTS_FILE = "events.jsonl"
LOCK_FILE = "lock"
"""In each run directory: holds the id of the process running it, locked (flock) while it runs."""


class JournalError(Exception):
    """The run directory cannot be used (unwritable, full, in use by another run): found before any request is sent."""


def _dumps(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str) + "\n").encode(
        "utf-8", "surrogatepass")


def _journalled(event: ev.MessageRecorded) -> tuple[ev.MessageRecorded, dict[str, Any]]:
    """A gateway session's message as events.jsonl and its transcript keep it: its text once in each (the event's
    client form only in the transcript; the event keeps its role as the mark of a session's message). The gateway
    has cut both already (gateway/apis.py `recorded`)."""
    return msgspec.structs.replace(event, raw={"role": event.role}), event.raw


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _ends_mid_line(path: Path) -> bool:
    """The file is not empty and its last byte is not a newline (a crash or a full disk cut a line short)."""
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except OSError:
        return False


class _Lines:
    """A JSON-lines file appended to whole lines at a time: `add` gathers them, `flush` writes what was gathered
    in one `os.write` (more only if the kernel takes part of it), and a write that fails part-way (a full disk, a
    file-size limit) is taken back, so the file never holds a cut line of ours."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.lseek(self._fd, 0, os.SEEK_END)
        self._pending: list[bytes] = []

    def add(self, line: bytes) -> None:
        self._pending.append(line)

    def write(self, line: bytes) -> None:
        """`line` in the file when it returns (after what was gathered before it). Raises OSError."""
        self._pending.append(line)
        self.flush()

    def flush(self) -> None:
        """What was gathered, written. Raises OSError (with what was gathered dropped)."""
        if not self._pending:
            return
        encoded = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        data = memoryview(encoded)
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(encoded)

    def fileno(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Closed without writing what was gathered (`flush` first to keep it)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self._pending.clear()
            os.close(fd)


def _append(path: Path) -> _Lines:
    """Open a JSON-lines file to append to, on a line of its own even when its last line was cut short (by
    a crash: a write that fails is taken back)."""
    fh = _Lines(path)
    if _ends_mid_line(path):
        fh.write(b"\n")
    return fh


class RunLock:
    """One process per run directory: an exclusive flock on `<run dir>/lock` for the life of the run.

    The OS releases it when the process ends, however it ends, so a run killed with SIGKILL can be
    resumed at once; a second process asking for it is refused with the holder's process id.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(run_dir)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        path = self.dir / LOCK_FILE
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise JournalError(f"run directory {self.dir} is not usable: {_why(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = f" (process {int(path.read_text().split()[0])})"
            raise JournalError(f"run directory {self.dir} is in use by another run{holder}: wait for it to end "
                               "or stop it; one process per run directory") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            os.close(fd)
            raise JournalError(f"run directory {self.dir} is not usable: {_why(exc)}") from None
        self._fd = fd
        return self

    @classmethod
    def handed_down(cls, run_dir: str | os.PathLike[str], fd: int) -> RunLock:
        """The lock a parent process took and handed to this one as `fd` (`run --detach`: no second process can
        take the directory between the parent's check and the run's start). Raises JournalError."""
        lock = cls(run_dir)
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(lock.dir / LOCK_FILE)):
                raise OSError(f"fd {fd} is not {lock.dir / LOCK_FILE}")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held already, through the parent's open file
            os.set_inheritable(fd, False)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise JournalError(f"run directory {lock.dir}: the lock handed down is not usable: {_why(exc)}") from None
        lock._fd = fd
        return lock

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("the run directory's lock is not held")
        return self._fd

    def release(self) -> None:
        # The file stays: unlinking a lock file lets two processes hold "the" lock on two different files.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def holds_run(run_dir: str | os.PathLike[str]) -> bool:
    """The directory already has a run's journal in it (a fresh run must not be merged into it)."""
    try:
        return (Path(run_dir) / EVENTS_FILE).stat().st_size > 0
    except OSError:
        return False


def check_report_path(path: str | os.PathLike[str]) -> None:
    """`--report PATH` can be written: its directory exists or can be made and takes a file. Raises JournalError."""
    target = Path(path)
    if target.is_dir():
        raise JournalError(f"report path {target} is a directory; name a file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = target.parent / f".{target.name}.write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise JournalError(f"report path {target} is not writable: {_why(exc)}") from None


class Journal:
    """A subscriber that keeps the run directory; `open()` takes its lock and checks it is writable first.

    `on_error` is told once, with one line naming the path and the reason, when a write fails mid-run.
    """

    def __init__(self, run_dir: str | os.PathLike[str], report: Report, extra_report: str | None = None,
                 *, on_error: Callable[[str], None] | None = None) -> None:
        self.dir = Path(run_dir)
        self.report = report
        self.extra_report = Path(extra_report) if extra_report else None
        self.on_error = on_error
        self.error = ""  # the first write error, in one line: from then on nothing more is written
        self.report_error = ""  # the last report write that failed ("" once one succeeds)
        self._events: _Lines | None = None
        self._transcripts: OrderedDict[str, _Lines] = OrderedDict()  # the open ones, least recently written first
        self._evicted: set[str] = set()  # transcripts closed to make room, before their agent ended
        self._ran: set[str] = set()  # agents queued in this run: their end is fsynced
        self._lock: RunLock | None = None
        self._gathered: dict[str, _Lines] = {}  # transcripts with lines gathered, not yet written
        self._flush_due = False  # a flush is called at the end of this turn of the event loop

    def open(self, *, resume: bool = False, lock: RunLock | None = None) -> None:
        """Lock the directory (or take `lock`, already held), refuse one that holds a run unless `resume`,
        and check it takes writes. Raises JournalError, with the lock released again."""
        self._lock = lock or RunLock(self.dir)
        try:
            if self.extra_report is not None:
                check_report_path(self.extra_report)
            self._lock.acquire()
            if not resume and holds_run(self.dir):
                raise JournalError(f"run directory {self.dir} already holds a run: resume it with --resume {self.dir}, "
                                   "or choose another directory")
            try:
                (self.dir / "transcripts").mkdir(parents=True, exist_ok=True)
                probe = self.dir / ".write-test"
                probe.write_text("ok")
                probe.unlink()
                self._events = _append(self.dir / EVENTS_FILE)
                self._events.flush()
            except OSError as exc:
                raise JournalError(f"run directory {self.dir} is not usable: {_why(exc)}") from None
        except JournalError:
            self._close_files()
            self._lock.release()
            raise

    def close(self) -> None:
        """Flush and fsync what is open, then release the lock; never raises (a failure is kept in `error`)."""
        self._close_files()
        if self._lock is not None:
            self._lock.release()

    def _close_files(self) -> None:
        for name, fh in (("events.jsonl", self._events), *((f"transcripts/{a}.jsonl", f)
                                                         for a, f in self._transcripts.items())):
            if fh is None or fh.closed:
                continue
            try:
                fh.flush()
                os.fsync(fh.fileno())
            except OSError as exc:
                self._failed(self.dir / name, exc)
            finally:
                with contextlib.suppress(OSError):
                    fh.close()  # closes the file even when its last flush fails
        self._transcripts.clear()
        self._gathered.clear()
        for agent in sorted(self._evicted):  # closed to make room, and their agents never ended
            path = self.dir / "transcripts" / f"{agent}.jsonl"
            try:
                self._end_transcript(agent, path)
            except OSError as exc:
                self._failed(path, exc)

    def _transcript_path(self, agent: str) -> Path:
        return self.dir / "transcripts" / f"{agent}.jsonl"

    def _transcript(self, agent: str) -> _Lines:
        """The agent's transcript, open to append to: the least recently written one is closed first when
        TRANSCRIPTS_OPEN are (written whole lines, unbuffered, it loses nothing; it is fsynced at its agent's end)."""
        fh = self._transcripts.get(agent)
        if fh is not None:
            self._transcripts.move_to_end(agent)
            return fh
        while len(self._transcripts) >= TRANSCRIPTS_OPEN:
            oldest, old = self._transcripts.popitem(last=False)
            self._evicted.add(oldest)
            try:
                old.flush()
            finally:
                self._gathered.pop(oldest, None)
                old.close()
        fh = self._transcripts[agent] = _append(self._transcript_path(agent))
        return fh

    def _end_transcript(self, agent: str, path: Path) -> None:
        """The agent ended: its transcript fsynced, and closed. Raises OSError."""
        fh = self._transcripts.pop(agent, None)
        if fh is not None:
            try:
                self._gathered.pop(agent, None)
                fh.flush()
                os.fsync(fh.fileno())
            finally:
                fh.close()
        elif agent in self._evicted:  # closed to make room: what it wrote is synced through a descriptor of its own
            self._evicted.discard(agent)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _failed(self, path: Path, exc: OSError) -> None:
        if self.error:
            return
        self.error = f"cannot write {path}: {_why(exc)}"
        if self.on_error is not None:
            self.on_error(self.error)

    def __call__(self, event: ev.Event) -> None:
        kind = event.kind
        if kind in SKIPPED or self._events is None or self.error:
            return
        transcript = ""  # the agent whose transcript is written, for a failure's path
        try:
            raw: dict[str, Any] = {}
            if isinstance(event, ev.MessageRecorded) and event.raw:
                line, raw = _journalled(event)
                self._events.add(ev.encode_event(line) + b"\n")
            else:
                self._events.add(ev.encode_event(event) + b"\n")
            if isinstance(event, ev.MessageRecorded):
                transcript = event.agent
                fh = self._transcript(event.agent)
                record: dict[str, Any] = {"turn": event.turn, "attempt": event.attempt, "role": event.role,
                                          "content": event.content}
                if raw:  # a gateway session's message, in its client's own format
                    record = {"turn": event.turn, "attempt": event.attempt, **raw}
                if event.reasoning:
                    record["reasoning"] = event.reasoning
                if event.partial:
                    record["partial"] = True
                if event.tool_calls:
                    record["tool_calls"] = event.tool_calls
                if event.tool_call_id:
                    record["tool_call_id"] = event.tool_call_id
                fh.add(_dumps(record))
                self._gathered[event.agent] = fh
            elif isinstance(event, ev.AgentQueued):
                self._ran.add(event.agent)
            elif isinstance(event, ev.AgentFinished):
                # Only an agent that ran here: a stop that cancels thousands never sent is one write, not
                # thousands of fsyncs, and a resumed run does not fsync each answer it reuses.
                if event.agent in self._ran:
                    self._events.flush()
                    os.fsync(self._events.fileno())
                    transcript = event.agent
                    self._end_transcript(event.agent, self._transcript_path(event.agent))
        except OSError as exc:
            self._failed(self._transcript_path(transcript) if transcript else self.dir / EVENTS_FILE, exc)
            return
        if isinstance(event, ev.WaveFinished | ev.RunFinished):
            # at a wave's end a report that cannot be written stops the run; at its end there is nothing to stop
            self.flush()
            self.write_report(stop_on_error=isinstance(event, ev.WaveFinished))
        elif not self._flush_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # told outside the event loop: written at once
                self.flush()
            else:
                self._flush_due = True
                loop.call_soon(self.flush)

    def flush(self) -> None:
        """The lines gathered, written (at the end of the loop's turn that told them, and before anyone reads the
        file: a console's replay, an fsync, the close); a failure is told as any write's (`on_error`)."""
        self._flush_due = False
        if self._events is None:
            return
        agent = ""
        try:
            self._events.flush()
            while self._gathered:
                agent, fh = self._gathered.popitem()
                fh.flush()
        except OSError as exc:
            self._failed(self._transcript_path(agent) if agent else self.dir / EVENTS_FILE, exc)

    def write_report(self, *, stop_on_error: bool = False) -> bool:
        """Rewrite report.json (and --report's copy) atomically; a reader never sees half a file. Returns
        whether both were written; a failure is kept in `report_error` (and with `stop_on_error`, stops the run)."""
        data = self.report.to_dict()
        for path in (self.dir / "report.json", self.extra_report):
            if path is None:
                continue
            try:
                write_json_atomic(path, data)
            except OSError as exc:
                self.report_error = f"cannot write {path}: {_why(exc)}"
                if stop_on_error:
                    self._failed(path, exc)
                return False
        self.report_error = ""
        return True


def _problem(raw: bytes, last: bool, exc: ev.EventError) -> str:
    """Why a line of events.jsonl that does not decode as an event cannot be one (read again only to say why)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid UTF-8"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return "truncated last line" if last and not raw.endswith(b"\n") else "not JSON"
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        return "not an event"
    return f"{data['event']}: {exc}"


def iter_events(run_dir: str | os.PathLike[str]) -> Iterator[tuple[int, ev.Event | None, str]]:
    """Each non-blank line of a run directory's events.jsonl, in order, read one at a time (a journal may be
    far larger than what a resume keeps of it) and decoded once, its fields checked as this version's event:
    its number, and its event or None and why it cannot be one. Raises JournalError when the file itself cannot
    be read."""
    path = Path(run_dir) / EVENTS_FILE
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, after the last line is handed out
    except OSError as exc:
        raise JournalError(f"cannot read {path}: {_why(exc)}") from None
    with fh:
        try:
            lines = iter(fh)
            raw = next(lines, None)
            number = 1
            while raw is not None:
                following = next(lines, None)  # one line ahead: only the last line may be a cut one
                if raw.strip():
                    try:
                        yield number, ev.decode_event(raw), ""
                    except ev.EventError as exc:
                        yield number, None, _problem(raw, following is None, exc)
                raw, number = following, number + 1
        except OSError as exc:
            raise JournalError(f"cannot read {path}: {_why(exc)}") from None


def read_events(run_dir: str | os.PathLike[str]) -> tuple[list[ev.Event], int]:
    """Every readable event of a run directory's events.jsonl, in order (what a console shown a run that is not
    running is fed), and how many lines could not be read. Raises JournalError only when the file itself cannot
    be read."""
    events: list[ev.Event] = []
    skipped = 0
    for _, event, _ in iter_events(run_dir):
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return events, skipped
