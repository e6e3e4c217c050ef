"""The run directory: `events.jsonl` (append-only), `transcripts/<agent>.jsonl`, and `report.json`.

Every event but token deltas and keep-alives is appended and flushed as it happens (the transcripts
hold the text); the file is fsynced when an agent ends, so a crash loses at most the last partial
line. The report is rewritten atomically at every wave end and at the end of the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from cerevisor_tui.engine import events as ev
from cerevisor_tui.engine.report import Report, write_json_atomic

SKIPPED = frozenset({"TokenDelta", "KeepAlive"})


class JournalError(Exception):
    """The run directory cannot be used (unwritable, full): found before any request is sent."""


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)


class Journal:
    """A subscriber that keeps the run directory; `open()` checks it is writable first."""

    def __init__(self, run_dir: str | os.PathLike[str], report: Report, extra_report: str | None = None) -> None:
        self.dir = Path(run_dir)
        self.report = report
        self.extra_report = Path(extra_report) if extra_report else None
        self._events: IO[str] | None = None
        self._transcripts: dict[str, IO[str]] = {}

    def open(self) -> None:
        try:
            (self.dir / "transcripts").mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-test"
            probe.write_text("ok")
            probe.unlink()
            self._events = open(self.dir / "events.jsonl", "a", encoding="utf-8")
        except OSError as exc:
            raise JournalError(f"run directory {self.dir} is not usable: {exc.strerror or exc}") from None

    def close(self) -> None:
        for fh in (self._events, *self._transcripts.values()):
            if fh is not None and not fh.closed:
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()
        self._transcripts.clear()

    def __call__(self, event: ev.Event) -> None:
        kind = event.kind
        if kind in SKIPPED or self._events is None:
            return
        self._events.write(_dumps(event.to_dict()) + "\n")
        self._events.flush()
        if isinstance(event, ev.MessageRecorded):
            fh = self._transcripts.get(event.agent)
            if fh is None:
                fh = self._transcripts[event.agent] = open(
                    self.dir / "transcripts" / f"{event.agent}.jsonl", "a", encoding="utf-8"
                )
            record = {"turn": event.turn, "attempt": event.attempt, "role": event.role, "content": event.content}
            if event.reasoning:
                record["reasoning"] = event.reasoning
            if event.partial:
                record["partial"] = True
            fh.write(_dumps(record) + "\n")
            fh.flush()
        elif isinstance(event, ev.AgentFinished):
            os.fsync(self._events.fileno())
            fh = self._transcripts.get(event.agent)
            if fh is not None:
                os.fsync(fh.fileno())
        elif isinstance(event, ev.WaveFinished | ev.RunFinished):
            self.write_report()

    def write_report(self) -> None:
        data = self.report.to_dict()
        write_json_atomic(self.dir / "report.json", data)
        if self.extra_report is not None:
            write_json_atomic(self.extra_report, data)
