"""`cerevisor-tui ls`: the runs in the runs directory, newest first."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from cerevisor_tui.text import printable


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


def describe(info: Any) -> str:
    """A run as `stop` and `attach` name it before they act: `20261202-… (gateway: 3 sessions; started 5 min ago
    by alice from 10.0.0.5)`."""
    from cerevisor_tui.supervisor.runs import age

    what = f"{info.done}/{info.total} agents done" if info.total or not info.sessions else ""
    if info.sessions:
        what += f"{', ' if what else 'gateway: '}{info.sessions} session{'s' * (info.sessions != 1)}"
    by = f" by {printable(info.by)}" if info.by else ""  # as supervisor.json says it: never a terminal's escape
    return f"{info.run_id} ({what}; started {age(info.started)}{by})"


def choose_live(args: Any, verb: str, *, yes: bool = False) -> Path:
    """The live run `stop` or `attach` acts on when none is named: only this user's, and named on stderr before
    anything is done. With several, the operator is asked which (on a terminal); `yes`: the newest. Raises
    LookupError (one message that says what there is) when there is none, or several and no one to ask."""
    from cerevisor_tui.supervisor.runs import find, list_runs

    runs_dir = runs_dir_of(args)
    mine = [info for info in list_runs(runs_dir) if info.state == "live" and info.mine]
    if not mine:
        return find(None, runs_dir, live=verb == "stop")  # raises, saying what there is instead
    listing = "\n".join(f"  {i}  {describe(info)}" for i, info in enumerate(mine, 1))
    if len(mine) > 1 and not yes:
        if not sys.stdin.isatty():
            more = ", or --yes for the newest" if verb == "stop" else ""
            raise LookupError(f"{len(mine)} live runs of yours under {runs_dir} (newest first); name the one to "
                              f"{verb} (cerevisor-tui {verb.split()[0]} RUN){more}:\n{listing}")
        print(f"{len(mine)} live runs of yours under {runs_dir}, newest first:\n{listing}", file=sys.stderr)
        try:
            answer = input(f"{verb.capitalize()} which? [1-{len(mine)}, Enter: none] ").strip()
        except EOFError:
            answer = ""
        if not answer.isdigit() or not 1 <= int(answer) <= len(mine):
            raise LookupError(f"nothing to {verb}: {'no' if not answer else repr(answer) + ' is not a'} run chosen")
        chosen = mine[int(answer) - 1]
    else:
        chosen = mine[0]
        others = f"; {len(mine) - 1} other live run(s) of yours go on" if len(mine) > 1 else ""
        doing = "stopping" if verb == "stop" else "attaching to"
        print(f"{doing} run {describe(chosen)}{others}", file=sys.stderr)
    return chosen.path


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
    print(f"{'RUN':<{width}}  {'STATE':<10}  {'AGENTS':>9}  {'STARTED':<12}  BY")
    for r in runs:
        agents = f"{r.done}/{r.total}" if r.total or not r.sessions else ""
        if r.sessions:  # a gateway's run: its sessions after its agents
            agents += f"{' + ' if agents else ''}{r.sessions} session{'s' * (r.sessions != 1)}"
        # who started it: on a shared account, what tells one person's runs from another's
        print(f"{r.run_id:<{width}}  {r.state:<10}  {agents:>9}  {age(r.started):<12}  {printable(r.by) or '-'}")
    for r in runs:
        if r.state == "unreadable":
            print(f"cerevisor-tui ls: {r.path}: {r.problem}", file=sys.stderr)
    return 0
