"""Textual's terminal driver, for a terminal that can go away (an SSH drop, `tmux kill-session`).

Why: with Textual's own driver a hang-up leaves the console alive forever. The kernel sends SIGHUP and
SIGCONT; Textual's SIGCONT handler "resumes" application mode and starts a second output thread; that
thread's first flush to the hung-up tty raises EIO and ends it; its queue (30 writes) fills; the next write
blocks the event loop in `Queue.put` for good, and with it the loop's own signal handlers, SIGTERM's included.

Here a failed write tells the app once (`CerevisorApp.terminal_lost`) and every later one is dropped, so the
output thread never dies and the loop never blocks on it; and application mode is never resumed on a
terminal that is gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Any

from textual.drivers.linux_driver import LinuxDriver


class TerminalOutput:
    """The file Textual's output thread writes to: a write or flush that fails is reported once, then every
    write is dropped (nothing written to a terminal that is gone can reach anyone)."""

    def __init__(self, file: IO[str], on_lost: Callable[[str], None]) -> None:
        self._file = file
        self._on_lost = on_lost
        self.lost = ""  # why, once a write failed

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._file.write(text)
            except (OSError, ValueError) as exc:  # EIO (hung up), EPIPE, EBADF; ValueError: the file was closed
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._file.flush()
            except (OSError, ValueError) as exc:
                self._lose(exc)

    def fileno(self) -> int:
        return self._file.fileno()

    def isatty(self) -> bool:
        return not self.lost and self._file.isatty()

    def _lose(self, exc: Exception) -> None:
        self.lost = f"cannot write to it: {getattr(exc, 'strerror', None) or exc}"
        try:
            self._on_lost(self.lost)
        except Exception:  # noqa: BLE001 - this runs on Textual's output thread, which must not end
            pass


class ConsoleDriver(LinuxDriver):
    """LinuxDriver whose output survives the terminal going away (see the module's docstring).

    It wraps LinuxDriver's private `_file` (Textual 1 to 8); `wraps_output` says whether that worked, and a
    test fails when it stops working. Without it the console's terminal watch still ends the process."""

    def __init__(self, app: Any, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        file = getattr(self, "_file", None)
        self.output: TerminalOutput | None = None
        if file is not None and hasattr(file, "write") and hasattr(file, "flush"):
            self.output = TerminalOutput(file, self._lost)
            self._file = self.output  # type: ignore[assignment]  # a stand-in: Textual only writes and flushes

    @property
    def wraps_output(self) -> bool:
        return self.output is not None

    def _lost(self, reason: str) -> None:
        report = getattr(self._app, "terminal_lost", None)
        if report is not None:
            report(reason)

    def resume_application_mode(self) -> None:
        """SIGCONT: after a Ctrl+Z, take the terminal back; after a hang-up (which sends SIGCONT too), there is
        none to take: starting application mode again would start an output thread that dies at once."""
        if (self.output is not None and self.output.lost) or (self.input_tty and not _is_terminal(self.fileno)):
            return
        super().resume_application_mode()


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
