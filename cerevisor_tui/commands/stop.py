"""`cerevisor-tui stop [RUN] [--yes]`: stop a live run through its control socket and wait until it has ended.
Without RUN: this user's live run, named before it is stopped; with several, the operator is asked which
(`--yes`: the newest), and without a terminal to ask on, nothing is stopped and the runs are listed."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

STOP_WAIT_S = 30.0


async def _stop(run_dir: Any) -> tuple[int, str]:
    from cerevisor_tui.contract.commands import Stop
    from cerevisor_tui.supervisor.client import AttachError, CommandFailed, ControlClient

    try:
        client = await ControlClient.connect(run_dir, replay=False)
    except AttachError as exc:
        return 1, str(exc)
    finished: list[Any] = []
    reader = asyncio.ensure_future(client.run(lambda e: finished.append(e) if e.kind == "RunFinished" else None))
    try:
        await client.command(Stop(reason="stopped by `cerevisor-tui stop`"))
    except CommandFailed as exc:
        reader.cancel()
        await client.close()
        return 1, f"run {run_dir.name} refused to stop: {exc}"
    try:
        await asyncio.wait_for(asyncio.shield(reader), STOP_WAIT_S)
    except TimeoutError:
        reader.cancel()
        await client.close()
        return 1, f"run {run_dir.name} was asked to stop but has not ended within {STOP_WAIT_S:.0f} s"
    await client.close()
    report = run_dir / "report.json"
    end = finished[0] if finished else None
    if end is not None:
        return 0, (f"run {run_dir.name} stopped (exit code {end.exit_code}; {end.totals.completed} agents completed); "
                   f"report: {report}")
    return 0, f"run {run_dir.name} ended; report: {report}"


def main(args: Any) -> int:
    from cerevisor_tui.commands.ls import choose_live, runs_dir_of
    from cerevisor_tui.supervisor.runs import find

    try:
        run_dir = (find(args.run, runs_dir_of(args), live=True) if args.run else
                   choose_live(args, "stop", yes=getattr(args, "yes", False)))
    except LookupError as exc:
        print(f"cerevisor-tui stop: {exc}", file=sys.stderr)
        return 1
    code, line = asyncio.run(_stop(run_dir))
    print(line if code == 0 else f"cerevisor-tui stop: {line}", file=sys.stdout if code == 0 else sys.stderr)
    return code
