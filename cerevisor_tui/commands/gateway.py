"""`cerevisor-tui gateway`: serve the OpenAI- and Anthropic-compatible front door that governs harnesses the
console did not write. Like the console, it starts its run detached (an SSH drop never drops a harness's
connection) and attaches to it; `--headless` serves in the foreground for a service manager.

The run it starts is an ordinary run whose config has a `[gateway]` table: this command writes that config
(the user's file with the command line's overrides, or one made from `--upstream URL` alone) into the run's
directory as `gateway.toml`, and `run` serves it (commands/run.py).
"""

from __future__ import annotations

import sys
import tomllib
from argparse import Namespace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cerevisor_tui.config import ConfigError, validate
from cerevisor_tui.config.models import is_loopback

GATEWAY_FILE = "gateway.toml"
SIMULATED = {"name": "sim", "kind": "simulated", "model": "sim-model"}


def gateway_data(args: Any) -> dict[str, Any]:
    """The run's config as data: the config file (if any), the [gateway] table, the command line on top."""
    data: dict[str, Any] = {}
    config_file = args.gateway_config or getattr(args, "config", None)
    if config_file:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("file not found", file=str(path)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read: {getattr(exc, 'strerror', None) or exc}", file=str(path)) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"invalid TOML: {exc}", file=str(path)) from None
    gateway = dict(data.get("gateway") or {})
    endpoints = list(data.get("endpoints") or [])
    if args.upstream:
        if "://" in args.upstream:
            problem = _url_problem(args.upstream)
            if problem:
                raise ConfigError(problem, key="--upstream")
            local = is_loopback(urlsplit(args.upstream).hostname or "")
            name = _free_name("upstream", endpoints)
            endpoints.append({"name": name, "base_url": args.upstream.rstrip("/"),
                              "kind": "local" if local else "hosted"})
            gateway["upstream"] = name
        else:
            known = [ep.get("name") for ep in endpoints] + [p.get("name") for p in data.get("pools") or ()]
            if args.upstream not in known:
                names = ", ".join(str(n) for n in known if n) or "none: give a URL"
                raise ConfigError(f"{args.upstream!r} is neither a URL (http://HOST:PORT/v1) nor an endpoint or pool "
                                  f"of the config (known: {names})", key="--upstream")
            gateway["upstream"] = args.upstream
    if not endpoints:  # nothing to govern: the built-in simulator, as the console does
        endpoints = [dict(SIMULATED)]
    if args.model:
        gateway["model_map"] = {"*": args.model}  # every request goes to ID
    if args.listen:
        gateway["listen"] = args.listen
    data["endpoints"] = endpoints
    data["gateway"] = gateway
    run = dict(data.get("run") or {})
    if args.mode:
        run["mode"] = args.mode
    if args.concurrency is not None:
        run["max_concurrency"] = args.concurrency
    if args.run_dir:
        run.pop("run_dir", None)
    data["run"] = run
    return data


def _url_problem(url: str) -> str | None:
    from cerevisor_tui.config.models import url_problem

    problem = url_problem(url)
    if problem:
        return problem
    if not urlsplit(url).path.rstrip("/").endswith("/v1"):
        return f"{url!r} should be the server's OpenAI base URL, ending in /v1 (e.g. http://127.0.0.1:8000/v1)"
    return None


def _free_name(base: str, endpoints: list[dict[str, Any]]) -> str:
    names = {ep.get("name") for ep in endpoints}
    name, n = base, 1
    while name in names:
        n += 1
        name = f"{base}{n}"
    return name


def main(args: Any) -> int:
    import tomli_w

    from cerevisor_tui.commands import run as run_command
    from cerevisor_tui.config.paths import default_runs_dir
    from cerevisor_tui.engine.engine import new_run_id

    shown = args.gateway_config or getattr(args, "config", None) or "the command line"
    try:
        data = gateway_data(args)
        config = validate(data, file=f"{shown} (with the gateway's options)")
    except ConfigError as exc:
        print(f"cerevisor-tui gateway: {exc}", file=sys.stderr)
        return 2
    from cerevisor_tui.commands.console_client import no_terminal

    problem = None if args.headless or args.detach else \
        no_terminal(" gateway", "use --headless (a line per event) or --detach")
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    runs_dir = Path(config.run.run_dir).expanduser() if config.run.run_dir else default_runs_dir()
    run_id = new_run_id()
    run_dir = Path(args.run_dir) if args.run_dir else runs_dir / run_id
    # the directory is ours before its gateway.toml is written: a run in it (live or ended) keeps its own
    from cerevisor_tui.engine.sinks.journal import JournalError, RunLock, holds_run

    lock = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire()
        if holds_run(run_dir):
            raise JournalError(f"run directory {run_dir} already holds a run: choose another directory (or "
                               f"resume that run with `cerevisor-tui run {run_dir / GATEWAY_FILE} --resume {run_dir}`)")
        config_file = run_dir / GATEWAY_FILE
        config_file.write_text(tomli_w.dumps(config.model_dump(exclude_defaults=True, exclude_none=True)),
                               encoding="utf-8")
    except (OSError, JournalError) as exc:
        if lock is not None:
            lock.release()
        why = exc if isinstance(exc, JournalError) else f"run directory {run_dir} is not usable: {exc.strerror or exc}"
        print(f"cerevisor-tui gateway: {why}", file=sys.stderr)
        return 2
    run_args = Namespace(file=str(config_file), mode=None, concurrency=None, endpoint=None, model=None,
                         report=args.report, jsonl=args.jsonl, run_dir=str(run_dir), resume=None, detach=False,
                         approve_all=False, detached=False, run_id=run_id,
                         own_process=getattr(args, "own_process", False))
    listen = config.gateway.listen if config.gateway else ""
    if args.headless:
        lock.release()  # the run takes it again at once
        return run_command.main(run_args)
    from cerevisor_tui.commands.run import DetachError, how_to_reach, spawn_detached, start_detached

    flags = ["--report", str(Path(args.report).resolve())] if args.report else []
    try:
        if args.detach:  # started, answering, and left to run: its log says the rest
            pid = spawn_detached(str(config_file), run_dir, run_id=run_id, flags=flags, lock=lock)
            print(f"gateway run {run_id} serving on {listen} (process {pid}, run dir {run_dir}); it goes on "
                  "without this terminal")
            print(f"  {how_to_reach(run_dir, run_id)}")
            return 0
        starting = start_detached(str(config_file), run_dir, run_id=run_id, flags=flags, lock=lock)
    except DetachError as exc:
        print(f"cerevisor-tui gateway: {exc}", file=sys.stderr)
        return 1
    from cerevisor_tui.commands.console_client import after_console, open_console

    # said before the console and left on the terminal after it: no claim on what happens meanwhile
    print(f"gateway run {run_id} serving on {listen} (run dir {run_dir})", file=sys.stderr)
    code = open_console(run_dir, live=True, args=args, starting=starting)
    print(after_console(run_dir, "gateway run", args.report), file=sys.stderr)
    return code
