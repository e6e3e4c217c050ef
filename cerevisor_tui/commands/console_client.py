"""The console attached to a run in a process of its own (`attach`, and the console's own runs): the app
gets a RunMirror fed from the run's control socket and a RemoteControl that sends the operator's commands
there. Leaving, a lost terminal or a signal detach: the run goes on. A run that is not live (finished,
crashed) opens read-only from its events.jsonl, every command refused with a line that says why."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cerevisor_tui.config import Config, ConfigError, load_config, validate


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


def open_console(run_dir: Path, *, live: bool, args: Any, state: str = "") -> int:
    from cerevisor_tui.commands.terminal_watch import TerminalWatch
    from cerevisor_tui.supervisor.client import AttachError, ControlClient, RemoteControl
    from cerevisor_tui.ui.app import CerevisorApp
    from cerevisor_tui.ui.mirror import RunMirror

    config, config_path = ui_config(run_dir, getattr(args, "config", None))
    mirror = RunMirror()
    apps: list[CerevisorApp] = []

    def refused(message: str) -> None:
        if apps:
            apps[0].notify(message, title="Not done", severity="warning", timeout=6)

    control = RemoteControl(refused)
    follow = None
    if live:
        async def follow() -> int:
            """Follow the run until it ends (its exit code) or the connection is lost (1, said on screen)."""
            try:
                client = await ControlClient.connect(run_dir)
            except AttachError as exc:
                refused(str(exc))
                return 1
            control.bind(client)
            try:
                why = await client.run(mirror)
            finally:
                control.bind(None, f"the connection to run {run_dir.name} has ended")
                await client.close()
            if mirror.finished is not None:
                return mirror.finished.exit_code
            if apps:
                apps[0].notify(f"{why}; `cerevisor-tui attach {run_dir.name}` tries again", title="Detached",
                               severity="error", timeout=30)
            return 1
    else:
        from cerevisor_tui.engine.journal import JournalError, read_records

        try:
            records, _ = read_records(run_dir)
        except JournalError as exc:
            print(f"cerevisor-tui attach: {exc}", file=sys.stderr)
            return 1
        mirror.feed_records(records)
        goes_on = "" if state == "finished" else f" (`cerevisor-tui run FILE --resume {run_dir.name}` goes on with it)"
        control.bind(None, f"run {run_dir.name} is {state or 'not running'}: this console shows it read-only{goes_on}")
    app = CerevisorApp(control, mirror, config, run=follow, attached=True, config_path=config_path,
                       theme=getattr(args, "theme", None), tune_gc=True)
    apps.append(app)
    if not live:
        app.call_later(lambda: refused(control.refusal))
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
