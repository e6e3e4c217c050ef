"""The console attached to a run in a process of its own (`attach`, and the console's own runs): the app
gets a RunMirror fed from the run's control socket and a RemoteControl that sends the operator's commands
there. Leaving, a lost terminal or a signal detach: the run goes on. A run that is not live (finished,
crashed) opens read-only from its events.jsonl, every command refused with a line that says why."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cerevisor_tui.config import Config, ConfigError, load_config, validate

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel

    from cerevisor_tui.ui.app import RunHandle


def no_terminal(command: str, hint: str = "use --jsonl to read the run's events as JSON lines") -> str | None:
    """The line that says the console cannot open here (its input or output is not a terminal: a pipe, a file, a
    job without one), or None when it can. Full-screen into a pipe would write escape codes and never end."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        return None
    which = "output" if not sys.stdout.isatty() else "input"
    return f"cerevisor-tui{command}: the console needs a terminal, and its {which} is not one; {hint}"


def ui_config(run_dir: Path, explicit: str | None) -> tuple[Config, Path | None]:
    """The config whose [ui] the console uses: the run's own (supervisor.json names it), else the one in force,
    else the defaults. Only [ui] matters here (the run's settings come with its events)."""
    from cerevisor_tui.config.paths import find_config
    from cerevisor_tui.supervisor.protocol import read_supervisor

    named = read_supervisor(run_dir).get("config")
    for candidate in (Path(named) if isinstance(named, str) and named else None, find_config(explicit)):
        if candidate is not None and candidate.is_file():
            try:
                return load_config(candidate), candidate
            except ConfigError:
                continue
    return validate({}), None


async def until_served(proc: Any, run_dir: Path) -> None:
    """Wait for a run process just started (commands/run.py `start_detached`) to answer on its socket; raises
    DetachError if it ends first or takes longer than DETACH_WAIT_S."""
    import asyncio
    import time

    from cerevisor_tui.commands.run import DETACH_WAIT_S, DetachError, served

    deadline = time.monotonic() + DETACH_WAIT_S
    while not served(proc, run_dir):
        if time.monotonic() > deadline:
            raise DetachError(f"the run process ({proc.pid}) did not open its control socket within "
                              f"{DETACH_WAIT_S:.0f} s; see {run_dir / 'run.log'}")
        await asyncio.sleep(0.02)


def attached_handle(run_dir: Path, notify: Callable[[str, SeverityLevel], None], starting: Any = None) -> RunHandle:
    """A RunHandle that follows the live run in `run_dir` over its control socket: commands through a
    RemoteControl, a mirror fed from the socket, and `run` (what the app awaits) reading until the run ends
    (its exit code) or the connection is lost (1, said on screen). `notify(message, severity)`. `starting`:
    the run's process, just started (the console draws while it starts, and connects once it answers)."""
    from cerevisor_tui.supervisor.client import AttachError, ControlClient, RemoteControl
    from cerevisor_tui.ui.app import RunHandle
    from cerevisor_tui.ui.mirror import RunMirror

    mirror = RunMirror(replaying=True)  # the run's past comes first, then `live`
    control = RemoteControl(lambda message: notify(message, "warning"))

    async def follow() -> int:
        from cerevisor_tui.commands.run import DetachError

        try:
            if starting is not None:
                await until_served(starting, run_dir)
            client = await ControlClient.connect(run_dir)
        except (AttachError, DetachError) as exc:
            notify(str(exc), "error")
            return 1
        control.bind(client)
        try:
            why = await client.run(mirror, on_live=mirror.replayed, on_unreadable=lambda problem: notify(
                f"the run sent an event this console cannot read ({problem}); it is left out. Is this "
                "console an older version than the run's?", "warning"))
        finally:
            control.bind(None, f"the connection to run {run_dir.name} has ended")
            await client.close()
            if mirror.replaying:  # let go before its past was all sent: what it had is shown as it stands
                mirror.replayed()
        if mirror.finished is not None:
            return mirror.finished.exit_code
        notify(f"{why}; `cerevisor-tui attach {run_dir}` tries again", "error")
        return 1

    return RunHandle(control, mirror, follow)


GONE_WAIT_S = 10.0
"""How long `after_console` waits for an ended run's process to exit (it writes the last report on its way out)."""


def _gone(pid: object, timeout_s: float = GONE_WAIT_S) -> None:
    """Wait until process `pid` has exited (or `timeout_s` has passed)."""
    import os
    import time

    if not isinstance(pid, int) or pid <= 0:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:  # our own child (the console started it): exited, and reaped
                return
        except ChildProcessError:  # not ours (`attach`): there until it has exited
            try:
                os.kill(pid, 0)
            except OSError:
                return
        time.sleep(0.05)


def after_console(run_dir: Path, what: str = "run", report: str | None = None) -> str:
    """What the terminal says once a console on a run in a process of its own has closed: the run goes on (and
    how to reach it), or how it ended and where its report is. `report`: a `--report` path besides its own."""
    from cerevisor_tui.commands.run import how_to_reach
    from cerevisor_tui.supervisor.protocol import read_supervisor
    from cerevisor_tui.supervisor.runs import run_info

    info = run_info(run_dir)
    if info is None:
        return f"{what} in {run_dir} left no journal"
    if info.state == "live":
        return f"{what} {info.run_id} goes on without this console; {how_to_reach(run_dir, info.run_id)}"
    # its socket closed at its end, and its last report is written after that: read it once its process is gone
    _gone(read_supervisor(run_dir).get("pid"))
    info = run_info(run_dir) or info
    how = f"stopped ({info.stopped})" if info.stopped else "finished"
    if info.state == "crashed":
        how = f"ended without its last event (crashed; `cerevisor-tui run FILE --resume {run_dir}` goes on with it)"
    elif info.exit_code is not None:
        how += f", exit code {info.exit_code}"
    reports = [str(path) for path in (run_dir / "report.json", Path(report) if report else None)
               if path is not None and path.is_file()]
    return f"{what} {info.run_id} {how}; " + (f"report: {' and '.join(reports)}" if reports else
                                              f"no report was written (see {run_dir / 'run.log'})")


def open_console(run_dir: Path, *, live: bool, args: Any, state: str = "", **app_options: Any) -> int:
    """The console on the run in `run_dir` (live: attached; else read-only from its journal) until the operator
    leaves or the terminal goes away; returns the console's exit code. `app_options` go to the app (the
    console's own runs pass their config's paths and the resume offer)."""
    from cerevisor_tui.commands.terminal_watch import TerminalWatch
    from cerevisor_tui.supervisor.client import RemoteControl
    from cerevisor_tui.ui.app import CerevisorApp, RunHandle
    from cerevisor_tui.ui.mirror import RunMirror

    on_app = app_options.pop("on_app", None)
    config = app_options.pop("config", None)
    config_path = app_options.pop("config_path", None)
    if config is None:
        config, config_path = ui_config(run_dir, getattr(args, "config", None))
    apps: list[CerevisorApp] = []

    def notify(message: str, severity: SeverityLevel = "warning") -> None:
        if apps:
            apps[0].notice(message, title="Not done" if severity == "warning" else "Detached", severity=severity,
                           timeout=6 if severity == "warning" else 30)

    starting = app_options.pop("starting", None)
    refusal = ""  # a read-only console's: why it takes no command
    if live:
        handle = attached_handle(run_dir, notify, starting)
    else:
        from cerevisor_tui.engine.sinks.journal import JournalError, read_events
        from cerevisor_tui.ui.model import Notice

        try:
            events, unreadable = read_events(run_dir)
        except JournalError as exc:
            print(f"cerevisor-tui attach: {exc}", file=sys.stderr)
            return 1
        mirror = RunMirror(replaying=True)
        for event in events:
            mirror(event)
        mirror.replayed()
        if unreadable:
            lines = "line" if unreadable == 1 else "lines"
            mirror.notices.append(Notice(f"{unreadable} {lines} of {run_dir / 'events.jsonl'} could not be read "
                                         "(damaged, or from another version) and are left out", "warning", "Journal"))
        goes_on = "" if state == "finished" else f" (`cerevisor-tui run FILE --resume {run_dir.name}` goes on with it)"
        refusal = f"run {run_dir.name} is {state or 'not running'}: this console shows it read-only{goes_on}"
        handle = RunHandle(RemoteControl(lambda message: notify(message, "warning"), refusal), mirror, None)
    app_options.setdefault("theme", getattr(args, "theme", None))
    app = CerevisorApp(handle.control, handle.mirror, config, run=handle.run, attached=True, config_path=config_path,
                       tune_gc=True, **app_options)
    apps.append(app)
    if on_app is not None:
        on_app(app)
    if refusal:
        app.call_later(lambda: notify(refusal))
    watch = TerminalWatch(app.stop_from_thread, lambda code, reason: None)
    app.on_terminal_lost = watch.lost
    watch.start()
    try:
        app.run()
    finally:
        watch.close()
    if watch.code is not None:  # a signal, or the terminal went away: detached
        return watch.code
    return app.return_code or 0
