"""The console's lifeline (commands/terminal_watch.py) and its driver (ui/driver.py), piece by piece: a signal
or a terminal that goes away stops the console, and the process ends even when its main thread is stuck;
a write to a hung-up terminal is reported once and never raises. (tests/ui/test_tmux.py does it for real.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from cerevisor_tui.commands import terminal_watch
from cerevisor_tui.commands.terminal_watch import FORCE_EXIT_S, TerminalWatch


class Outcome:
    """What the watch did: its stop call, its forced call and the exit code; `exited` is set at the exit."""

    def __init__(self) -> None:
        self.stops: list[tuple[int, str]] = []
        self.forced: list[tuple[int, str]] = []
        self.codes: list[int] = []
        self.stopped = threading.Event()
        self.exited = threading.Event()

    def stop(self, code: int, reason: str) -> None:
        self.stops.append((code, reason))
        self.stopped.set()

    def force(self, code: int, reason: str) -> None:
        self.forced.append((code, reason))

    def exit(self, code: int) -> None:
        self.codes.append(code)
        self.exited.set()


def watch(outcome: Outcome, **kwargs) -> TerminalWatch:
    return TerminalWatch(outcome.stop, outcome.force, exit_process=outcome.exit, **kwargs)


def test_a_signal_stops_the_console_and_ends_the_process_after_the_grace_while_the_main_thread_is_blocked():
    out = Outcome()
    stuck = threading.Lock()
    stuck.acquire()

    def exit_process(code: int) -> None:
        out.exit(code)
        stuck.release()  # what os._exit would end: the blocked main thread

    w = TerminalWatch(out.stop, out.force, exit_process=exit_process, fds=(), grace_s=0.5).start()
    try:
        sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
        started = time.monotonic()
        sender.start()
        # the main thread blocks as the console's did on Textual's full output queue; the handler still runs
        assert stuck.acquire(timeout=10)
        elapsed = time.monotonic() - started
    finally:
        w.close()
    assert out.stops == [(143, "console stopped by SIGTERM")]
    assert out.forced == [(143, "console stopped by SIGTERM")] and out.codes == [143]
    assert 0.5 <= elapsed < 3.0


def test_a_second_signal_forces_the_exit_within_force_exit_s():
    out = Outcome()
    w = watch(out, fds=(), grace_s=60.0).start()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert out.stopped.wait(10)
        assert out.stops == [(129, "console stopped by SIGHUP")]
        second = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        assert out.exited.wait(10)
        assert time.monotonic() - second < FORCE_EXIT_S + 1.0
    finally:
        w.close()
    assert out.codes == [129]  # the first signal's


def test_a_hung_up_terminal_is_a_loss_without_any_signal_and_is_replaced_by_dev_null():
    master, slave = os.openpty()
    out = Outcome()
    w = watch(out, fds=(slave,), grace_s=0.3, poll_s=0.05).start()
    try:
        os.close(master)  # what `tmux kill-session` or an SSH drop does to the console's tty
        assert out.stopped.wait(10)
        assert out.exited.wait(10)
        assert os.write(slave, b"late frame") == 10  # /dev/null now: a write neither fails nor blocks
    finally:
        w.close()
        os.close(slave)
    assert out.stops == [(129, "console lost its terminal (no longer a tty)")] and out.codes == [129]


def test_a_failed_write_reported_from_another_thread_is_a_loss():
    out = Outcome()
    w = watch(out, fds=(), grace_s=0.2).start()
    try:
        threading.Thread(target=w.lost, args=("cannot write to it: Input/output error",)).start()
        assert out.exited.wait(10)
    finally:
        w.close()
    assert out.stops == [(129, "console lost its terminal (cannot write to it: Input/output error)")]


def test_close_restores_the_handlers_and_nothing_fires_later():
    before = {s: signal.getsignal(s) for s in terminal_watch.SIGNALS}
    out = Outcome()
    w = watch(out, fds=(), grace_s=0.1).start()
    assert signal.getsignal(signal.SIGTERM) == w._on_signal
    w.close()
    assert {s: signal.getsignal(s) for s in terminal_watch.SIGNALS} == before
    assert not out.stops and not out.codes


# ---- the driver ---------------------------------------------------------------------------------------
@pytest.fixture
def textual_signals():
    """LinuxDriver installs SIGTSTP and SIGCONT handlers when built: put the test process's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTSTP, signal.SIGCONT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.anyio
async def test_the_console_driver_wraps_textuals_output_and_a_write_to_a_hung_up_terminal_is_reported_once(
        textual_signals):
    from textual.app import App

    from cerevisor_tui.ui.driver import ConsoleDriver, TerminalOutput

    losses: list[str] = []

    class Probe(App):
        def terminal_lost(self, reason: str) -> None:
            losses.append(reason)

    driver = ConsoleDriver(Probe())
    # a Textual upgrade that renames LinuxDriver._file fails here rather than in an operator's SSH drop
    assert driver.wraps_output and isinstance(driver._file, TerminalOutput)

    master, slave = os.openpty()
    tty = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        output = TerminalOutput(tty, driver._lost)
        output.write("frame 1")
        output.flush()
        os.close(master)
        output.write("\x1b[?1049h" * 1000)  # what Textual's output thread does at the next frame
        output.flush()
        output.write("frame 3")
        output.flush()
    finally:
        try:
            tty.close()
        except OSError:
            pass
    assert len(losses) == 1 and "Input/output error" in losses[0]
    assert output.lost

    driver.output.lost = losses[0]  # a SIGCONT after the hang-up: nothing to resume, no new output thread
    driver.resume_application_mode()
    assert driver._writer_thread is None
