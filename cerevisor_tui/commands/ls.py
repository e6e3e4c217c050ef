"""`cerevisor-tui ls`: the runs in the runs directory, newest first."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def runs_dir_of(args: Any) -> Path:
    """--runs-dir, else the config's [run] run_dir (when a config is found and sets it), else the user state dir."""
    from cerevisor_tui.config.paths import default_runs_dir, find_config

    if getattr(args, "runs_dir", None):
        return Path(args.runs_dir).expanduser()
    found = find_config(getattr(args, "config", None))
    if found is not None:
        from cerevisor_tui.config import ConfigError, load_config

        try:
            configured = load_config(found).run.run_dir
        except ConfigError:
            configured = ""
        if configured:
            return Path(configured).expanduser()
    return default_runs_dir()


def main(args: Any) -> int:
    from cerevisor_tui.supervisor.runs import age, list_runs

    runs_dir = runs_dir_of(args)
    runs = list_runs(runs_dir)
    if args.json:
        print(json.dumps([r.to_dict() for r in runs], indent=1))
        return 0
    if not runs:
        print(f"no runs under {runs_dir}", file=sys.stderr)
        return 0
    width = max(len(r.run_id) for r in runs)
    print(f"{'RUN':<{width}}  {'STATE':<10}  {'AGENTS':>9}  STARTED")
    for r in runs:
        agents = f"{r.done}/{r.total}" if r.total or not r.sessions else ""
        if r.sessions:  # a gateway's run: its sessions after its agents
            agents += f"{' + ' if agents else ''}{r.sessions} session{'s' * (r.sessions != 1)}"
        print(f"{r.run_id:<{width}}  {r.state:<10}  {agents:>9}  {age(r.started)}")
    for r in runs:
        if r.state == "unreadable":
            print(f"cerevisor-tui ls: {r.path}: {r.problem}", file=sys.stderr)
    return 0
