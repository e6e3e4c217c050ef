"""The console's lifeline: it ends the process when its terminal goes away or a signal asks, on a thread of its
own, so that it works while the event loop cannot run (blocked writing to a terminal that is gone).

What reports a loss, whichever comes first: SIGHUP; the terminal's file descriptor no longer being a terminal
(a hung-up tty answers EIO, a closed descriptor EBADF; looked at every POLL_S); a write that fails (`lost()`,
which the console's Textual driver calls). SIGTERM and SIGINT ask for a stop too. The first report calls
`stop(code, reason)` (the console stops its run cleanly, in its event loop); a terminal found gone is replaced
by /dev/null on descriptors 0-2, so nothing can block or fail writing to it again. If the process is still
there GRACE_S later, or FORCE_EXIT_S after a second signal, `force(code)` writes what it can (the report) on
this thread and the process exits with `code`: 128 + the signal's number, 129 (as SIGHUP) for a lost terminal.

A console attached to a run in its own process (commands/console_client.py) gives a `stop` that detaches
(the run goes on) and a `force` with nothing to write; the watch is the same either way.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

LOST_TERMINAL_EXIT = 128 + signal.SIGHUP
"""A terminal lost without a signal ends the console as SIGHUP would: 129."""
SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
POLL_S = 0.25
GRACE_S = 4.0
"""From the first report to the forced exit: the console's own stop (engine stopped, report written, Textual's
teardown) takes well under it; a lost terminal ends the process within POLL_S + GRACE_S < 5 s."""
FORCE_EXIT_S = 1.5
"""After a second signal: as the headless run (commands/run.py)."""


def is_terminal(fd: int) -> bool:
    """`fd` is a terminal that still answers (isatty: a TCGETS that fails with EIO once the tty is hung up)."""
    try:
        return os.isatty(fd)
    except OSError:
        return False


class TerminalWatch:
    """Installs handlers for SIGHUP, SIGTERM and SIGINT and watches the terminal on `fds` (those that are
    terminals at `start()`). `stop` is called once, from this watch's thread: it must only hand the work to
    the event loop (`call_soon_threadsafe`). `force` is called from the same thread when the grace is over."""

    def __init__(self, stop: Callable[[int, str], None], force: Callable[[int, str], None], *,
                 fds: tuple[int, ...] = (0, 1, 2), grace_s: float = GRACE_S, poll_s: float = POLL_S,
                 exit_process: Callable[[int], Any] = os._exit) -> None:
        self._stop, self._force, self._exit = stop, force, exit_process
        self._fds = fds
        self._watched: tuple[int, ...] = ()
        self.grace_s, self.poll_s = grace_s, poll_s
        self.code: int | None = None  # set at the first report: what the process exits with
        self.reason = ""
        self._signals: list[int] = []  # appended by the handlers (atomic), read by the thread
        self._losses: list[str] = []
        self._released = False
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._previous: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._run, name="terminal-watch", daemon=True)

    # ---- from any thread, or a signal handler -----------------------------------------------------
    def lost(self, reason: str) -> None:
        """The terminal is gone (a write to it failed): safe from any thread."""
        self._losses.append(reason)
        self._wake()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A plain handler, not the event loop's: it runs even while the main thread is blocked in a lock or
        # a write, and does nothing that could block itself.
        self._signals.append(signum)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # ---- owner ------------------------------------------------------------------------------------
    def start(self) -> TerminalWatch:
        """Install the signal handlers (main thread only) and start watching."""
        self._watched = tuple(fd for fd in self._fds if is_terminal(fd))
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching and put the previous handlers back (the process is about to return normally)."""
        self._closed = True
        self._wake()
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._previous.clear()
        self._thread.join(timeout=1.0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- the watch's thread -------------------------------------------------------------------------
    def _terminal_gone(self) -> bool:
        return any(not is_terminal(fd) for fd in self._watched)

    def _run(self) -> None:
        deadline: float | None = None
        handled = 0  # signals seen so far
        while not self._closed:
            timeout = self.poll_s if deadline is None else max(0.0, min(self.poll_s, deadline - time.monotonic()))
            try:
                ready, _, _ = select.select([self._wake_r], [], [], timeout)
                if ready:
                    os.read(self._wake_r, 4096)
            except OSError:
                return  # closed under us
            if self._closed:
                return
            gone = bool(self._losses) or self._terminal_gone()
            if gone and not self._released:
                self._release_terminal()
            signals = list(self._signals)
            now = time.monotonic()
            if self.code is None and (signals or gone):
                if signals:
                    name = signal.Signals(signals[0]).name
                    self.code, self.reason = 128 + signals[0], f"console stopped by {name}"
                else:
                    self.code = LOST_TERMINAL_EXIT
                    self.reason = f"console lost its terminal ({self._losses[0] if self._losses else 'no longer a tty'})"
                handled = len(signals)
                deadline = now + self.grace_s
                with contextlib.suppress(Exception):
                    self._stop(self.code, self.reason)
            elif self.code is not None and len(signals) > handled:
                handled = len(signals)
                deadline = min(deadline or now, now + FORCE_EXIT_S)
            if deadline is not None and now >= deadline:
                code = self.code if self.code is not None else LOST_TERMINAL_EXIT
                with contextlib.suppress(Exception):
                    self._force(code, self.reason)
                self._exit(code)
                return

    def _release_terminal(self) -> None:
        """/dev/null in place of a terminal that is gone: Textual's writes, its teardown and Python's own flush at
        exit then succeed instead of failing (exit status 120) or blocking."""
        self._released = True
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
        os.close(null)
