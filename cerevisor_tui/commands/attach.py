"""`cerevisor-tui attach [RUN]`: the console on a run, as a client of its control socket; a finished or
crashed run opens read-only from its journal. `--jsonl`: no console, the events as JSON lines."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any


async def _print_events(run_dir: Path) -> int:
    """Every event of a live run, the past ones first, until it ends; 0 when it finished, 1 when the
    connection was lost."""
    from cerevisor_tui.contract.events import encode_event
    from cerevisor_tui.supervisor.client import AttachError, ControlClient

    try:
        client = await ControlClient.connect(run_dir)
    except AttachError as exc:
        print(f"cerevisor-tui attach: {exc}", file=sys.stderr)
        return 1
    out = sys.stdout
    gone: list[OSError] = []

    def show(event: Any) -> None:
        try:
            out.write(encode_event(event).decode() + "\n")
        except OSError as exc:  # our reader has gone (`| head`): the reading stops here (client.run ends on it)
            gone.append(exc)
            raise

    why = await client.run(show)
    await client.close()
    if gone:
        raise BrokenPipeError(*gone[0].args)  # ends the command quietly (cli.py), the run goes on
    out.flush()
    if client.unreadable:
        print(f"cerevisor-tui attach: {client.unreadable} unreadable lines from the run skipped", file=sys.stderr)
    print(f"cerevisor-tui attach: {why}", file=sys.stderr)
    return 0 if client.bye.startswith("the run ended") else 1


def print_journal(run_dir: Path) -> int:
    """The events of a run that is not live, from its journal, each checked as this version's event (what a live
    run sends): a line that is not one (a cut last line, a hand edit) is skipped, and counted on stderr."""
    from cerevisor_tui.contract.events import EventError, decode_event, encode_event

    path = run_dir / "events.jsonl"
    skipped, first = 0, ""
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    event = decode_event(raw)
                except EventError as exc:
                    skipped += 1
                    first = first or f"line {number}: {exc}"
                    continue
                sys.stdout.write(encode_event(event).decode() + "\n")
    except BrokenPipeError:
        raise  # our reader has gone (`| head`), not the journal: ends the command quietly (cli.py)
    except OSError as exc:
        print(f"cerevisor-tui attach: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if skipped:
        print(f"cerevisor-tui attach: {skipped} unreadable line{'s' * (skipped != 1)} of {path} skipped "
              f"(first: {first})", file=sys.stderr)
    return 0


def main(args: Any) -> int:
    from cerevisor_tui.commands.ls import choose_live, runs_dir_of
    from cerevisor_tui.supervisor.runs import find, run_info

    try:
        run_dir = find(args.run, runs_dir_of(args)) if args.run else choose_live(args, "attach to")
    except LookupError as exc:
        print(f"cerevisor-tui attach: {exc}", file=sys.stderr)
        return 1
    info = run_info(run_dir)
    live = info is not None and info.state == "live"
    if args.jsonl:
        return asyncio.run(_print_events(run_dir)) if live else print_journal(run_dir)
    from cerevisor_tui.commands.console_client import no_terminal, open_console

    problem = no_terminal(" attach")
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2

    code = open_console(run_dir, live=live, args=args, state=info.state if info else "")
    if live:  # the run goes on, or this console stopped it (or saw it end): say which, and where its report is
        from cerevisor_tui.commands.console_client import after_console

        print(after_console(run_dir), file=sys.stderr)
    return code
