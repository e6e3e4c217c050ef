"""One run put together: the engine over a config and its run directory's journal, open and subscribed. The
console, `run` and (next) `gateway` each open their run here, so a run is assembled one way."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

from cerevisor_tui.config.models import Config
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.connections import wants_stream_process
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.resume import JournalState
from cerevisor_tui.engine.sinks.journal import Journal, RunLock
from cerevisor_tui.engine.toolcalls import AskPolicy


def open_run(config: Config, run_id: str, run_dir: Path, *, console: bool, resume: bool = False,
             resumed: JournalState | None = None, ask: AskPolicy = "operator", extra_report: str | None = None,
             lock: RunLock | None = None, clock: Clock = MONOTONIC) -> tuple[Engine, Journal]:
    """The run's engine and its journal (the run directory locked, `events.jsonl` open, appended to when the
    run is resumed, with what its journal said: `resumed`). A write that fails mid-run stops the run, saying why. Raises JournalError on a directory
    that cannot be used, before any request is sent."""
    raise_descriptor_limit()
    engine = Engine(config, run_id=run_id, run_dir=str(run_dir), resumed=resumed,
                    stream_process=wants_stream_process(config, console=console), ask=ask, clock=clock)
    journal = Journal(run_dir, engine.report, extra_report=extra_report,
                      on_error=lambda line: engine.stop(f"run stopped: {line}"))
    journal.open(resume=resume, lock=lock)
    engine.subscribe(journal)
    return engine, journal


def raise_descriptor_limit() -> int:
    """The process's soft limit of open files raised to its hard one (often 1,024 of 524,288): a run holds a
    connection per agent or session at each end of a loopback, a transcript per recent writer, its clients' and
    MCP servers' pipes. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(OSError, ValueError):  # (macOS refuses an unlimited soft limit: kept as it is)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
