"""`cerevisor-tui run FILE`: the headless run, with a run directory, a report and exit codes 0/1/2.

One process per run directory (its lock); what it cannot write stops the run cleanly, in one line; a
first signal stops the run (report written), a second ends the process within FORCE_EXIT_S.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from cerevisor_tui.config import Config, ConfigError, load_config, validate
from cerevisor_tui.config.checks import preflight
from cerevisor_tui.config.paths import default_runs_dir

if TYPE_CHECKING:
    from collections.abc import Callable

    from cerevisor_tui.engine.resume import JournalState
    from cerevisor_tui.engine.toolcalls import AskPolicy

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
FORCE_EXIT_S = 1.5
"""After a second signal, what is left (closing connections, the last report) gets this long, then the
process exits: the report of the last wave end and every journal line written stay as they are."""


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


def handed_down(run_dir: Path, args: Any) -> Any:
    """The run directory's lock that `run --detach` took and handed to this process (--lock-fd), else None."""
    from cerevisor_tui.engine.sinks.journal import RunLock

    fd = getattr(args, "lock_fd", None)
    return RunLock.handed_down(run_dir, fd) if fd is not None else None


def find_run(run: str, runs_dir: Path) -> Path:
    """The directory of the run `--resume RUN` names: a directory, or a run id under the runs directory."""
    from cerevisor_tui.supervisor.runs import find

    if not run.strip():
        raise ConfigError("names no run: give the run id printed at its start, or its directory", key="--resume")
    try:
        return find(run, runs_dir)
    except LookupError as exc:
        raise ConfigError(f"nothing to resume: {exc}", key="--resume") from None


def resume_state(run: str, runs_dir: Path) -> tuple[Path, JournalState]:
    """A run to resume: its directory and what its journal says (the answers of the agents it completed,
    their events, what it spent; what cannot be read is skipped: engine/resume.py `read_journal`)."""
    from cerevisor_tui.engine.resume import read_journal
    from cerevisor_tui.engine.sinks.journal import JournalError

    path = find_run(run, runs_dir)
    try:
        return path, read_journal(path)
    except JournalError as exc:
        raise ConfigError(str(exc), key="--resume") from None


class ForcedExit:
    """Armed at the first signal: another one ends the process FORCE_EXIT_S later, whatever it is doing.

    Its handlers are plain signal handlers and its clock a thread, so they work while the event loop is
    stuck (a write that blocks, a connection that will not close); the loop, when it is not, still hears
    the signal too and cancels what is left cleanly in the meantime.
    """

    def __init__(self, code: int) -> None:
        self.code = code
        self._forced = threading.Event()
        threading.Thread(target=self._exit_after, name="forced-exit", daemon=True).start()
        self.install()

    def install(self) -> None:
        for signum in SIGNAL_EXIT:
            signal.signal(signum, self._on_signal)

    def force(self) -> None:
        self._forced.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._forced.set()

    def _exit_after(self) -> None:
        self._forced.wait()
        time.sleep(FORCE_EXIT_S)
        os._exit(self.code)


def say(line: str) -> None:
    """A line on stderr, if stderr is still there: a closed terminal or pipe never ends the run or loses its report."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def main(args: Any) -> int:
    from cerevisor_tui.engine.engine import new_run_id
    from cerevisor_tui.engine.resume import read_journal
    from cerevisor_tui.engine.run_setup import open_run
    from cerevisor_tui.engine.sinks.journal import JournalError, RunLock
    from cerevisor_tui.engine.sinks.printer import Printer
    from cerevisor_tui.heap import freeze_startup

    # A file-size limit (ulimit -f) makes a write fail with EFBIG, which the journal reports, rather than
    # SIGXFSZ killing the process with nothing said.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    lock: RunLock | None = None
    try:
        config = apply_overrides(load_config(args.file), args, file=args.file)
        if not config.agents and config.gateway is None:
            raise ConfigError("no [[agents]] to run (nor a [gateway] to serve)", file=args.file, key="agents")
        preflight(config, file=args.file)
        runs_dir = Path(config.run.run_dir).expanduser() if config.run.run_dir else default_runs_dir()
        state: JournalState | None = None
        resuming = args.resume is not None
        if resuming:
            run_dir = find_run(args.resume, runs_dir)
            # before reading: another process may still be writing it
            lock = handed_down(run_dir, args) or RunLock(run_dir).acquire()
            state = read_journal(run_dir)
            run_id = state.run_id
            if state.skipped:
                print(f"cerevisor-tui run: resume: {state.notice(run_dir)}", file=sys.stderr)
        else:
            run_id = getattr(args, "run_id", None) or new_run_id()
            run_dir = Path(args.run_dir) if args.run_dir else runs_dir / run_id
            lock = handed_down(run_dir, args)
        if getattr(args, "detach", False):
            return detach(args, run_dir, run_id, lock or RunLock(run_dir).acquire())  # the run's process takes it
        # a tool call its server's rules `ask` about: --approve-all approves it; a detached run (a console's, or
        # --detach) waits for a console to answer; a run in the foreground has no one to ask and denies it
        ask: AskPolicy = "approve" if getattr(args, "approve_all", False) else "operator" if getattr(args, "detached", False) \
            else "deny"
        engine, journal = open_run(config, run_id, run_dir, console=False, resume=resuming, resumed=state,
                                   ask=ask, extra_report=args.report, lock=lock)
    except (ConfigError, JournalError) as exc:
        if lock is not None:
            lock.release()
        print(f"cerevisor-tui run: {exc}", file=sys.stderr)
        return 2

    detached = bool(getattr(args, "detached", False))
    # A foreground run's lines go on in run.log if its output goes away (a closed terminal, `| head`); a
    # detached run's output is run.log already, and --jsonl's is for a program, which has stopped reading.
    printer = Printer(jsonl=args.jsonl, spill=None if detached or args.jsonl else run_dir / "run.log")
    engine.subscribe(printer)
    received: list[int] = []
    forced: list[ForcedExit] = []
    if detached:  # a detached run has no terminal to lose: only `stop`, SIGINT or SIGTERM end it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stop_signals = (signal.SIGINT, signal.SIGTERM) if detached else (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    async def watch_signals(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(*stop_signals) as signals:
            async for signum in signals:
                if received:
                    say("cerevisor-tui run: second signal, stopping now")
                    forced[0].force()
                    scope.cancel()
                    return
                received.append(signum)
                forced.append(ForcedExit(SIGNAL_EXIT.get(signal.Signals(signum), 130)))
                say(f"\ncerevisor-tui run: {signal.Signals(signum).name}: stopping; running agents are cancelled "
                    "(again to force)")
                engine.stop(f"run stopped by {signal.Signals(signum).name}")

    async def body() -> int:
        code = 1
        server = await serve_control(engine, run_dir, run_id, args.file, required=detached,
                                     journal_flush=journal.flush)
        if server is None and detached:
            return 1
        if not detached:  # no one may press `p` past a spent budget but a console attached to the socket
            engine.spending.consoles_attached = (lambda: server.clients) if server is not None else (lambda: 0)
            if server is not None:  # one that leaves without resuming it leaves no one: the run may end then
                server.on_client_gone = engine.spending.end_if_spent
        gateway = None
        if config.gateway is not None:
            from cerevisor_tui.gateway import GatewayError, serve_gateway

            try:
                gateway = await serve_gateway(engine, config.gateway)
            except GatewayError as exc:
                say(f"cerevisor-tui run: {exc}")
                if server is not None:
                    await server.close(f"the run could not start: {exc}")
                return 2
        if getattr(args, "own_process", False):  # started: from here a full collection skips what start-up made
            freeze_startup()
        async with anyio.create_task_group() as group:
            group.start_soon(watch_signals, group.cancel_scope)
            if gateway is not None:
                group.start_soon(announce_gateway, engine, gateway)
            try:
                code = await engine.run()
            finally:
                group.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    if gateway is not None:
                        await gateway.close()
                    if server is not None:
                        await server.close(f"the run ended (exit code {code})")
        return code

    try:
        code = anyio.run(body)
    finally:
        if forced:  # stopping already: another signal while the last report is written ends the process
            forced[0].install()
        report_written = journal.write_report()
        journal.close()
        printer.flush()
    if journal.error or not report_written:
        say(f"cerevisor-tui run: {write_problem(journal, report_written, run_dir)}")
    if received and not (config.gateway is not None and not config.agents):  # a gateway alone ends by a signal
        return SIGNAL_EXIT.get(signal.Signals(received[0]), 130)
    return 1 if journal.error or not report_written else code


async def announce_gateway(engine: Any, gateway: Any) -> None:
    """Once the run has begun: where its gateway serves, and which models it routes (GatewayServing, for consoles;
    and a RunNotice that says it to people)."""
    from cerevisor_tui.contract import events as ev

    await engine.sessions.ready.wait()
    await gateway.gateway.resolve_models()
    models = sorted(gateway.gateway.served_models())
    engine.emit(ev.GatewayServing(time.monotonic(), gateway.url, models, dict(engine.config.gateway.model_map)))
    served = ", ".join(models) or "not known yet (the upstream is not answering)"
    mapped = "; ".join(f"{glob} -> {model}" for glob, model in engine.config.gateway.model_map.items())
    engine.emit(ev.RunNotice(time.monotonic(), f"Gateway serving on {gateway.url} (models: {served}"
                             + (f"; mapped: {mapped}" if mapped else "") + "). Point a harness's base URL at it; "
                             f"a path label names its session: {gateway.url.removesuffix('/v1')}/a/NAME/v1",
                             "information", "Gateway"))
    problem = gateway.gateway.model_problem()
    if problem:
        engine.emit(ev.RunNotice(time.monotonic(), f"Gateway: {problem}.", "warning", "Gateway model"))


async def serve_control(engine: Any, run_dir: Path, run_id: str, config_file: str, *, required: bool,
                        journal_flush: Callable[[], None] = lambda: None) -> Any:
    """The run's control socket (supervisor/server.py), subscribed to the engine; None, with a line on
    stderr, when it cannot be made (a run in the foreground goes on without it, a detached one cannot)."""
    from cerevisor_tui.supervisor.server import ControlServer

    server = ControlServer(run_dir, run_id, engine.handle, in_flight=engine.in_flight, journal_flush=journal_flush,
                           config_path=str(Path(config_file).resolve()))
    try:
        await server.start()
    except OSError as exc:
        what = "cannot run detached" if required else "consoles cannot attach to this run"
        say(f"cerevisor-tui run: {what}: no control socket ({exc.strerror or exc})")
        return None
    engine.subscribe(server)
    return server


DETACH_WAIT_S = 60.0


class DetachError(Exception):
    """A detached run could not be started: one line says why; `code`, the exit code that says it (2: the run
    refused to start, as it would have in the foreground)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def start_detached(config_file: str, run_dir: Path, *, run_id: str = "", resume: bool = False,
                   flags: list[str] | None = None, lock: Any = None) -> Any:
    """Start `run CONFIG --detached` in a process of its own (own session, no terminal, SIGHUP ignored), its
    output in RUN_DIR/run.log; returns the Popen at once (`served` says when its socket answers). `lock`: the
    run directory's RunLock, held: handed to the process (and released here), so that no other can come between."""
    import subprocess

    argv = [sys.executable, "-m", "cerevisor_tui", "run", str(Path(config_file).resolve()), "--detached"]
    argv += (["--resume", str(run_dir.resolve())] if resume else
             ["--run-dir", str(run_dir.resolve()), "--run-id", run_id])
    argv += flags or []
    kept = (lock.fileno(),) if lock is not None else ()
    argv += [f"--lock-fd={fd}" for fd in kept]
    try:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "run.log", "ab")
        except OSError as exc:
            raise DetachError(f"run directory {run_dir} is not usable: {exc.strerror or exc}") from None
        with log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                    close_fds=True, pass_fds=kept)
    finally:
        if lock is not None:
            lock.release()  # the process holds it now (or, when it could not start, nobody)


def served(proc: Any, run_dir: Path) -> bool:
    """The run process started by `start_detached` answers on its control socket (False: not yet). Raises
    DetachError when it has ended (the last line of its log says why)."""
    from cerevisor_tui.supervisor.protocol import read_supervisor, socket_of
    from cerevisor_tui.supervisor.runs import answers

    if read_supervisor(run_dir).get("pid") == proc.pid and answers(socket_of(run_dir)):
        return True
    code = proc.poll()
    if code is not None:
        tail = ""
        with contextlib.suppress(OSError, IndexError):
            tail = (run_dir / "run.log").read_text(errors="replace").strip().splitlines()[-1]
        if code == 2 and tail.startswith("cerevisor-tui run: "):  # it refused, as the run in the foreground would
            raise DetachError(tail.removeprefix("cerevisor-tui run: "), code=2)
        raise DetachError(f"the run process ended at once (exit code {code}): {tail}")
    return False


def spawn_detached(config_file: str, run_dir: Path, *, run_id: str = "", resume: bool = False,
                   flags: list[str] | None = None, lock: Any = None) -> int:
    """`start_detached`, then wait until its control socket answers; returns its process id. Raises
    DetachError when it ends at once or does not answer in DETACH_WAIT_S."""
    proc = start_detached(config_file, run_dir, run_id=run_id, resume=resume, flags=flags, lock=lock)
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        if served(proc, run_dir):
            return proc.pid
        time.sleep(0.05)
    raise DetachError(f"the run process ({proc.pid}) did not open its control socket within {DETACH_WAIT_S:.0f} s; "
                      f"see {run_dir / 'run.log'}")


def how_to_reach(run_dir: Path, run_id: str) -> str:
    """The command lines (attach, ls, stop) that reach a detached run: by id in the default runs directory, else by its directory."""
    from cerevisor_tui.config.paths import default_runs_dir

    name = run_id if run_dir.resolve().parent == default_runs_dir().resolve() else str(run_dir)
    where = "" if name == run_id else f" --runs-dir {run_dir.parent}"
    return f"attach: cerevisor-tui attach {name}    list: cerevisor-tui ls{where}    stop: cerevisor-tui stop {name}"


def detach(args: Any, run_dir: Path, run_id: str, lock: Any) -> int:
    """`run --detach`: start the run in a process of its own, handing it the run directory's `lock` (held), say
    where it is, return 0. The config was checked here already: what is wrong with it is said before anything
    starts, and a directory in use is refused here, as in the foreground."""
    flags: list[str] = []
    for flag, value in (("--mode", args.mode), ("--concurrency", args.concurrency), ("--endpoint", args.endpoint),
                        ("--model", args.model), ("--report", args.report and str(Path(args.report).resolve()))):
        if value is not None:
            flags += [flag, str(value)]
    if args.jsonl:
        flags.append("--jsonl")
    if getattr(args, "approve_all", False):
        flags.append("--approve-all")
    try:
        pid = spawn_detached(args.file, run_dir, run_id=run_id, resume=args.resume is not None, flags=flags,
                             lock=lock)
    except DetachError as exc:
        print(f"cerevisor-tui run: {exc}", file=sys.stderr)
        return exc.code
    print(f"run {run_id} started in {run_dir} (process {pid}); it goes on without this terminal")
    print(f"  {how_to_reach(run_dir, run_id)}")
    return 0


def write_problem(journal: Any, report_written: bool, run_dir: Path) -> str:
    """What could not be written, and what stands, in one line."""
    if not journal.error:
        return f"{journal.report_error}; the run itself ended; the report of its last wave stands in {run_dir}"
    kept = ("the report is written" if report_written
            else f"the report could not be rewritten ({journal.report_error}); the last one written stands")
    return (f"{journal.error}; the run stopped, agents not finished were cancelled; what was written is kept "
            f"in {run_dir}, {kept}")
