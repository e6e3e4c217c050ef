"""`cerevisor-tui [--config FILE] [--theme NAME]`: the console.

The config is found as everywhere (--config, $CEREVISOR_TUI_CONFIG, ./cerevisor.toml, the user config
dir). With none, or one that configures no endpoint, the console runs the packaged demo workflow on
the built-in simulator (the header says SIMULATED). A config that cannot be used is one line on
stderr and exit 2. The run directory is kept as by the headless run (events, transcripts, report),
plus `run.json`, which names the config it ran: when the last run of the same config did not complete,
the console says so and its palette offers "Resume last run" (the headless `--resume`, from inside).

Exit codes: the run's when the operator quits (0 every agent completed, 1 otherwise); 128 + the signal's
number for SIGHUP, SIGTERM and SIGINT, and 129 when the terminal went away: within 5 s, the run stopped and
its report written, even when the event loop is stuck (commands/terminal_watch.py).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cerevisor_tui.commands.console_client import no_terminal
from cerevisor_tui.config import Config, ConfigError, load_config, validate
from cerevisor_tui.config.checks import preflight
from cerevisor_tui.config.paths import default_runs_dir, find_config, user_config_file, user_themes_dir

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine
    from cerevisor_tui.engine.resume import JournalState
    from cerevisor_tui.engine.sinks.journal import Journal
    from cerevisor_tui.ui.app import CerevisorApp, RunHandle

DEMO = "built-in demo"
RUN_FILE = "run.json"
"""In each console run directory: the run id, the config it ran and when it (last) started."""


def demo_text() -> str:
    """The packaged demo workflow (config/example.toml): a simulated endpoint and five agents."""
    return resources.files("cerevisor_tui.config").joinpath("example.toml").read_text(encoding="utf-8")


DEMO_TOKENS_PER_S = 8.0
DEMO_MAX_TOKENS_TIMES = 3
"""The demo's pace: each answer three times as long, streamed at 8 tokens/s a request, so its two waves take
about three and a half minutes, time to try every key on agents still running (at the example's 40 tokens/s it was over in
15 s)."""


def demo_workflow() -> dict[str, Any]:
    """The demo's endpoints and agents as the console runs them: the example's, at the demo's pace."""
    demo = tomllib.loads(demo_text())
    for endpoint in demo["endpoints"]:
        if endpoint.get("kind") == "simulated":
            endpoint.setdefault("sim", {})["tokens_per_s"] = DEMO_TOKENS_PER_S
    for agent in demo["agents"]:
        agent["max_tokens"] = agent.get("max_tokens", 256) * DEMO_MAX_TOKENS_TIMES
    return demo


@dataclass(frozen=True)
class ConsoleSetup:
    """What the console runs, where its config came from and where the settings screen saves."""

    config: Config
    config_path: Path | None  # the file read; None: no config was found
    save_path: Path
    save_template: str | None  # the TOML to start from when save_path does not exist yet
    demo: bool  # the packaged demo workflow on the built-in simulator

    @property
    def simulated(self) -> bool:
        return any(ep.kind == "simulated" for ep in self.config.endpoints)


def resolve_config(explicit: str | None) -> ConsoleSetup:
    """The config in force, or the demo; raises ConfigError naming the file and the key."""
    path = find_config(explicit)
    if path is None:
        return ConsoleSetup(validate(demo_workflow(), file=DEMO), None, user_config_file(), demo_text(), True)
    config = load_config(path)
    if not config.endpoints:
        # A config with no endpoint (only [ui] or [run], say) keeps its settings and runs the demo's workflow.
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        demo = demo_workflow()
        data["endpoints"], data["agents"] = demo["endpoints"], demo["agents"]
        return ConsoleSetup(validate(data, file=f"{path} (with the {DEMO})"), path, path, None, True)
    if not config.agents:
        raise ConfigError("no [[agents]] to run (see config.example.toml for a workflow)", file=str(path),
                          key="agents")
    return ConsoleSetup(config, path, path, None, False)


def config_key(setup: ConsoleSetup) -> str:
    """What `run.json` records as the config: the file's absolute path, or the demo's name."""
    return str(setup.config_path.resolve()) if setup.config_path else DEMO


def last_run_dir(runs_dir: Path, config: str) -> Path | None:
    """The run directory whose `run.json` names `config` and started last (a resumed run counts from its
    resumption); None when there is none."""
    found: list[tuple[str, str, Path]] = []
    try:
        children = list(runs_dir.iterdir())
    except OSError:
        return None
    for path in children:
        try:
            info = json.loads((path / RUN_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("config") == config:
            found.append((str(info.get("started_at", "")), path.name, path))
    return max(found)[2] if found else None


@dataclass(frozen=True)
class LastRun:
    """The last run of this config, which did not complete: what `--resume` would take up."""

    run_dir: Path
    state: JournalState  # what its journal says: its completed agents' answers and figures, what it spent, ...
    done: int  # agents of the workflow it completed
    total: int  # agents in the workflow

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def completed(self) -> dict[str, str]:
        """Agent -> its answer."""
        return self.state.completed


def incomplete_last_run(runs_dir: Path, config: str, setup_config: Config) -> LastRun | None:
    """The last run of `config` when it completed some of the workflow's agents but not all; else None.
    A last run that completed none is not offered: resuming it would be the fresh run the console starts."""
    from cerevisor_tui.commands.run import resume_state

    path = last_run_dir(runs_dir, config)
    if path is None:
        return None
    try:
        run_dir, state = resume_state(str(path), runs_dir)
    except ConfigError:
        return None  # it never got as far as its first event
    done = sum(1 for agent in setup_config.agents if agent.name in state.completed)
    if done in (0, len(setup_config.agents)):
        return None
    return LastRun(run_dir, state, done, len(setup_config.agents))


class ConsoleRuns:
    """The console's runs: the fresh one it starts with and the resumed one that may replace it. Each gets
    its journal and `run.json`; every journal opened is closed, its report written, when the console ends."""

    def __init__(self, config: Config, runs_dir: Path, config_key: str) -> None:
        self.config = config
        self.runs_dir = runs_dir
        self.config_key = config_key
        self.journals: list[Journal] = []
        self._closing = threading.Lock()  # the console's own close, or the terminal watch's forced one

    def open(self, run_id: str, run_dir: Path, *, resumed: JournalState | None = None,
             config: Config | None = None) -> Engine:
        """An engine for the run, its journal open and subscribed; raises JournalError on an unusable directory.
        `config`: the settings in force now (the settings screen may have saved new ones since start-up)."""
        from cerevisor_tui.engine.run_setup import open_run
        from cerevisor_tui.engine.sinks.journal import JournalError
        from cerevisor_tui.engine.sinks.report import write_json_atomic

        engine, journal = open_run(config or self.config, run_id, run_dir, console=True, resume=resumed is not None,
                                   resumed=resumed)
        try:
            write_json_atomic(run_dir / RUN_FILE, {"run_id": run_id, "config": self.config_key,
                                                   "started_at": datetime.now(UTC).isoformat()})
        except OSError as exc:
            journal.close()
            raise JournalError(f"run directory {run_dir} is not usable: {exc.strerror or exc}") from None
        self.journals.append(journal)
        return engine

    def open_fresh(self) -> Engine:
        from cerevisor_tui.engine.engine import new_run_id

        run_id = new_run_id()
        return self.open(run_id, self.runs_dir / run_id)

    def resume(self, last: LastRun, config: Config | None = None) -> Engine:
        """The last run taken up again: the same id and directory, its completed agents never sent again."""
        return self.open(last.run_id, last.run_dir, resumed=last.state, config=config)

    def close(self) -> bool:
        """Write each report and close each journal; returns whether everything was written."""
        with self._closing:
            whole = True
            for journal in self.journals:
                whole = journal.write_report() and whole
                journal.close()
                whole = whole and not journal.error
            self.journals.clear()
            return whole

    def abandon(self, reason: str) -> None:
        """The process exits now, without its event loop (the terminal watch's forced exit): each report as
        it stands, the agents that had not finished marked cancelled (they will not), and the locks released.
        The journals are left as written: a resume reruns what has no end in them."""
        from cerevisor_tui.contract import events as ev
        from cerevisor_tui.engine.sinks.report import STATUSES

        if not self._closing.acquire(timeout=1.0):
            return  # the console's own close is under way and stuck: exit without
        try:
            for journal in self.journals:
                report = journal.report
                for name, agent in list(report.agents.items()):
                    if agent["status"] not in STATUSES:
                        report(ev.AgentFinished(time.monotonic(), name, "cancelled", reason))
                journal.write_report()
                journal.close()
            self.journals.clear()
        finally:
            self._closing.release()


def main(args: Any) -> int:
    try:
        setup = resolve_config(getattr(args, "config", None))
        config = setup.config
        file = str(setup.config_path) if setup.config_path else DEMO
        preflight(config, file=file)
    except ConfigError as exc:  # before the engine and Textual are imported: a bad config fails fast
        print(f"cerevisor-tui: {exc}", file=sys.stderr)
        return 2

    from cerevisor_tui.engine.sinks.journal import JournalError
    from cerevisor_tui.ui.keys import BINDING_IDS
    from cerevisor_tui.ui.theme_files import ThemeError, check_theme_name, load_themes

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: the journal says EFBIG, not a core dump

    theme = getattr(args, "theme", None)
    try:
        for binding_id in config.ui.keys:
            if binding_id not in BINDING_IDS:
                raise ConfigError(f"unknown binding id (known: {', '.join(sorted(BINDING_IDS))})", file=file,
                                  key=f"ui.keys.{binding_id}")
        themes = load_themes(user_themes_dir())
        try:
            check_theme_name(theme or config.ui.theme, themes.themes)
        except ThemeError as exc:
            raise ConfigError(str(exc), file=None if theme else file, key="--theme" if theme else "ui.theme") from None
        runs_dir = Path(config.run.run_dir).expanduser() if config.run.run_dir else default_runs_dir()
        runs = ConsoleRuns(config, runs_dir, config_key(setup))
        last = incomplete_last_run(runs_dir, runs.config_key, config)  # before this run's own directory exists
        problem = no_terminal("")  # before a run is started for a console that cannot open
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        engine = runs.open_fresh() if getattr(args, "in_process", False) else None
    except (ConfigError, JournalError, ThemeError) as exc:
        print(f"cerevisor-tui: {exc}", file=sys.stderr)
        return 2

    from cerevisor_tui.commands.terminal_watch import TerminalWatch

    if engine is None:
        return detached_console(setup, runs, last, args, theme=theme, themes=themes, tour=setup.demo)
    app = build_app(setup, runs, engine, last, theme=theme, themes=themes, tune_gc=True, tour=setup.demo)
    watch = TerminalWatch(app.stop_from_thread, lambda code, reason: runs.abandon(f"{reason}; forced exit"))
    app.on_terminal_lost = watch.lost
    watch.start()
    try:
        try:
            app.run()
        finally:
            whole = runs.close()
    finally:
        watch.close()
    if watch.code is not None:  # a signal, or the terminal went away
        return watch.code
    code = app.return_code or 0
    return 1 if code == 0 and not whole else code


def run_handle(engine: Engine) -> RunHandle:
    """What the console follows an in-process run through: the engine's commands (LocalControl), a mirror
    subscribed to its events, and its `run` to await. The app gets these, never the engine."""
    from cerevisor_tui.engine.control import LocalControl
    from cerevisor_tui.ui.app import RunHandle
    from cerevisor_tui.ui.mirror import RunMirror

    mirror = RunMirror()
    engine.subscribe(mirror)
    return RunHandle(LocalControl(engine), mirror, engine.run)


def build_app(setup: ConsoleSetup, runs: ConsoleRuns, engine: Engine, last: LastRun | None,
              **kwargs: Any) -> CerevisorApp:
    """The console app over `engine`'s run, offering to resume `last` (Textual is imported only here)."""
    from cerevisor_tui.ui.app import CerevisorApp, ResumeOffer

    offer = None
    if last is not None:
        offer = ResumeOffer(last.run_id, last.done, last.total,
                            lambda config: run_handle(runs.resume(last, config)))
    handle = run_handle(engine)
    return CerevisorApp(handle.control, handle.mirror, setup.config, run=handle.run,
                        config_path=setup.config_path, save_path=setup.save_path, save_template=setup.save_template,
                        resume_offer=offer, **kwargs)


WORKFLOW_FILE = "workflow.toml"
"""In a console run's directory, when its config is not a file of the user's (the demo, or a config whose
endpoints and agents are the demo's): the workflow the run process reads."""


def workflow_file(setup: ConsoleSetup, run_dir: Path) -> Path:
    """The config file the run's own process reads: the user's file, or the demo's workflow written out."""
    if setup.config_path is not None and not setup.demo:
        return setup.config_path
    import tomli_w

    demo = demo_workflow()
    if setup.config_path is None:
        data = demo
    else:  # the user's settings with the demo's endpoints and agents (resolve_config)
        data = tomllib.loads(setup.config_path.read_text(encoding="utf-8"))
        data["endpoints"], data["agents"] = demo["endpoints"], demo["agents"]
    text = tomli_w.dumps(data)
    path = run_dir / WORKFLOW_FILE
    path.write_text(text, encoding="utf-8")
    return path


def detached_console(setup: ConsoleSetup, runs: ConsoleRuns, last: LastRun | None, args: Any, **app_options: Any) -> int:
    """The console's run in a process of its own, and the console attached to it: the run survives the
    terminal (an SSH drop is a detach; `cerevisor-tui attach` comes back to it)."""
    from cerevisor_tui.commands.console_client import attached_handle, open_console
    from cerevisor_tui.commands.run import DetachError, spawn_detached, start_detached
    from cerevisor_tui.engine.engine import new_run_id
    from cerevisor_tui.supervisor.runs import run_info
    from cerevisor_tui.ui.app import ResumeOffer

    run_id = new_run_id()
    run_dir = runs.runs_dir / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = workflow_file(setup, run_dir)
        write_run_file(run_dir, run_id, runs.config_key)
        # the console draws while the run process starts (the two start-ups overlap); it connects once it answers
        starting = start_detached(str(config_file), run_dir, run_id=run_id)
    except (OSError, DetachError) as exc:
        print(f"cerevisor-tui: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    apps: list[Any] = []

    def notify(message: str, severity: str) -> None:
        if apps:
            apps[0].notice(message, severity=severity, timeout=10)

    resumed: list[Path] = []

    def resume(config: Config) -> Any:
        """Go on with the last run in a process of its own, and follow it (the app stops this one first)."""
        assert last is not None
        resumed.append(last.run_dir)
        write_run_file(last.run_dir, last.run_id, runs.config_key)
        try:
            spawn_detached(str(config_file), last.run_dir, resume=True)
        except DetachError as exc:
            raise RuntimeError(str(exc)) from None
        return attached_handle(last.run_dir, notify)

    live_before = ""
    if last is not None:
        info = run_info(last.run_dir)
        if info is not None and info.state == "live":  # still running, in the background: not to resume
            live_before = (f"Run {last.run_id} of this config is still running in the background: "
                           f"`cerevisor-tui attach {last.run_dir}` shows it.")
            last = None
    offer = ResumeOffer(last.run_id, last.done, last.total, resume) if last is not None else None

    def on_app(app: Any) -> None:
        apps.append(app)
        if live_before:
            app.call_later(lambda: app.notice(live_before, title="Also running", severity="warning", timeout=20))

    code = open_console(run_dir, live=True, args=args, config=setup.config, config_path=setup.config_path,
                        save_path=setup.save_path, save_template=setup.save_template,
                        resume_offer=offer, on_app=on_app, starting=starting, **app_options)
    from cerevisor_tui.commands.console_client import after_console

    for followed in [run_dir, *resumed]:
        print(after_console(followed), file=sys.stderr)
    return code


def write_run_file(run_dir: Path, run_id: str, config: str) -> None:
    from cerevisor_tui.config.paths import write_json_atomic

    write_json_atomic(run_dir / RUN_FILE, {"run_id": run_id, "config": config,
                                           "started_at": datetime.now(UTC).isoformat()})
