"""`cerevisor-tui run FILE`: the headless run, with a run directory, a report and exit codes 0/1/2."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from cerevisor_tui.config import Config, ConfigError, load_config, validate
from cerevisor_tui.config.checks import preflight
from cerevisor_tui.config.paths import default_runs_dir

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


def apply_overrides(config: Config, args: Any, *, file: str) -> Config:
    """--mode, --concurrency, --endpoint and --model on top of the file, validated like the file."""
    data = config.model_dump(exclude_unset=False)
    if args.mode:
        data["run"]["mode"] = args.mode
    if args.concurrency is not None:
        data["run"]["max_concurrency"] = args.concurrency
        if data["run"]["mode"] == "auto":  # in auto mode the cap is found live: N is its ceiling
            data["run"]["auto"]["max_cap"] = args.concurrency
            data["run"]["auto"]["min_cap"] = min(data["run"]["auto"]["min_cap"], args.concurrency)
    for ep in data["endpoints"]:
        if args.endpoint:
            ep["base_url"] = args.endpoint
            if ep["kind"] == "simulated":
                ep["kind"] = "local"
        if args.model:
            ep["model"] = args.model
    try:
        return validate(data, file=f"{file} (with command-line overrides)")
    except ConfigError:
        raise


def resume_state(run: str, runs_dir: Path) -> tuple[Path, str, dict[str, str], list[dict[str, Any]]]:
    """A run to resume: its directory, its id, the answers of the agents it completed, and their events."""
    path = Path(run)
    if not path.is_dir():
        path = runs_dir / run
    events = path / "events.jsonl"
    if not events.is_file():
        raise ConfigError(f"no run to resume at {path} (it has no events.jsonl)", key="--resume")
    run_id, completed, recorded = path.name, {}, []
    with events.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a crash may leave one partial last line
            if not isinstance(e, dict):
                continue
            recorded.append(e)
            if e.get("event") == "RunStarted":
                run_id = e.get("run_id", run_id)
            elif e.get("event") == "AgentFinished" and e.get("status") == "completed":
                completed[e["agent"]] = e.get("output", "")
    # the figures of completed agents carry over into the resumed run's report: the events since
    # each one's last AgentQueued (an earlier failed run of the same agent does not count twice)
    last_run: dict[str, list[dict[str, Any]]] = {}
    for e in recorded:
        agent = e.get("agent")
        if agent in completed:
            if e.get("event") == "AgentQueued":
                last_run[agent] = []
            elif e.get("event") != "AgentFinished":
                last_run.setdefault(agent, []).append(e)
    history = [e for events_ in last_run.values() for e in events_]
    return path, run_id, completed, history


def main(args: Any) -> int:
    from cerevisor_tui.engine.engine import Engine, new_run_id, wants_stream_process
    from cerevisor_tui.engine.journal import Journal, JournalError
    from cerevisor_tui.engine.printer import Printer

    try:
        config = apply_overrides(load_config(args.file), args, file=args.file)
        if not config.agents:
            raise ConfigError("no [[agents]] to run", file=args.file, key="agents")
        preflight(config, file=args.file)
        runs_dir = Path(config.run.run_dir).expanduser() if config.run.run_dir else default_runs_dir()
        completed: dict[str, str] = {}
        history: list[dict[str, Any]] = []
        if args.resume:
            run_dir, run_id, completed, history = resume_state(args.resume, runs_dir)
        else:
            run_id = new_run_id()
            run_dir = Path(args.run_dir) if args.run_dir else runs_dir / run_id
        engine = Engine(config, run_id=run_id, run_dir=str(run_dir), completed=completed, history=history,
                        stream_process=wants_stream_process(config, console=False))
        journal = Journal(run_dir, engine.report, extra_report=args.report)
        journal.open()
    except (ConfigError, JournalError) as exc:
        print(f"cerevisor-tui run: {exc}", file=sys.stderr)
        return 2

    engine.subscribe(journal)
    engine.subscribe(Printer(jsonl=args.jsonl))
    received: list[int] = []

    async def watch_signals(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                if received:
                    print("cerevisor-tui run: second signal, stopping now", file=sys.stderr)
                    scope.cancel()
                    return
                received.append(signum)
                print(f"\ncerevisor-tui run: {signal.Signals(signum).name}: stopping; running agents are cancelled "
                      "(again to force)", file=sys.stderr)
                engine.stop(f"run stopped by {signal.Signals(signum).name}")

    async def body() -> int:
        code = 1
        async with anyio.create_task_group() as group:
            group.start_soon(watch_signals, group.cancel_scope)
            try:
                code = await engine.run()
            finally:
                group.cancel_scope.cancel()
        return code

    try:
        code = anyio.run(body)
    finally:
        journal.write_report()
        journal.close()
    if received:
        return SIGNAL_EXIT.get(signal.Signals(received[0]), 130)
    return code
