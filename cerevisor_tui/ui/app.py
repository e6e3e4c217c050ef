"""The Textual app: a client of one run. It holds the run's mirror (`ui/mirror.py`, built from its events)
and its control (`ui/control.py`, the operator's commands, contract/commands.py), plus themes and keymap; the screens
read the mirror and act through the control, never on an engine. In-process, commands/console.py also
hands it the run to await (a worker in the app's own event loop). When the last run of the same config
did not complete, it offers to resume it, and then follows that run in the first one's place.

The app never speaks HTTP: the engine does, and tells the app everything through its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import App
from textual.notifications import SeverityLevel
from textual.worker import Worker, WorkerState

from cerevisor_tui.config.models import Config
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.ui.colours import resolve_colour
from cerevisor_tui.ui.control import RunControl
from cerevisor_tui.ui.inbox import AttentionItem, terminal_alert
from cerevisor_tui.ui.keys import BINDING_IDS, MAIN_BINDINGS
from cerevisor_tui.ui.mirror import FINAL, RunMirror
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.theme_files import DEFAULT_THEME, ThemeSet

if TYPE_CHECKING:
    from textual.actions import ActionParseResult
    from textual.dom import DOMNode

STOP_WAIT_S = 5.0
"""How long quitting waits for the engine to cancel its agents and close its connections."""
SIGNAL_STOP_WAIT_S = 2.5
"""The same wait when a signal or a lost terminal ends the console: its terminal watch forces the exit 4 s
after (commands/terminal_watch.py), so the clean stop has to be done well before."""
LOST_TERMINAL_EXIT = 128 + signal.SIGHUP
GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections in the console (see _tune_gc)
_BINDING_OF_ACTION = {b.action: b.id for b in MAIN_BINDINGS if b.id}


Runner = Callable[[], Awaitable[int]]
"""Runs an in-process run to its end and returns its exit code (the engine's `run`); opaque to the app."""


@dataclass(frozen=True)
class RunHandle:
    """What the app follows a run through: its commands, its mirror (subscribed to its events), and, in-process,
    the run to await (None: the run goes on elsewhere)."""

    control: RunControl
    mirror: RunMirror
    run: Runner | None = None


@dataclass(frozen=True)
class ResumeOffer:
    """An earlier run of this config that did not complete, and how to reopen it (commands/console.py
    builds it: the run directory, its journal and the answers already given are its business)."""

    run_id: str
    completed: int  # agents it completed: never sent again
    total: int
    open: Callable[[Config], RunHandle]
    """The run that resumes it under the settings in force, its journal open and subscribed; raises when
    the run cannot be resumed."""


class CerevisorApp(App[int]):
    """The operator console over one run: reads its mirror, sends its control the operator's commands."""

    TITLE = "cerevisor-tui"
    CSS_PATH = "app.tcss"

    def __init__(
        self,
        control: RunControl,
        mirror: RunMirror,
        config: Config,
        *,
        run: Runner | None = None,
        config_path: Path | None = None,
        save_path: Path | None = None,
        save_template: str | None = None,
        theme: str | None = None,
        themes: ThemeSet | None = None,
        clock: Callable[[], float] = time.monotonic,
        resume_offer: ResumeOffer | None = None,
        tune_gc: bool = False,
        attached: bool = False,
        tour: bool = False,
    ) -> None:
        """`clock` is what countdowns and rates are computed against (tests freeze it); `save_path` is
        where the settings screen saves, `save_template` the TOML it starts from when that file does not
        exist yet (the demo); `run`: the in-process run, awaited in a worker (None: only show the mirror);
        `resume_offer`: the last run of this config did not complete (the palette offers to resume it);
        `tune_gc`: set the process's garbage collector for a console (see `_tune_gc`; the console sets it,
        tests that start many apps in one process do not); `attached`: the run lives in a process of its own
        (`run` follows it over its control socket): leaving, a lost terminal or a signal detach from it, and
        `q` asks whether to detach or stop it; `tour`: the built-in demo, whose first screen names the keys to
        try."""
        super().__init__(driver_class=_console_driver())
        self.control = control
        self.mirror = mirror
        self._run = run
        self.config = config
        self.config_path = config_path
        self.save_path = save_path or config_path
        self.save_template = save_template
        self.clock = clock
        self.keymap: dict[str, str] = dict(config.ui.keys)
        self.engine_error = ""
        self.run_exit_code: int | None = None
        self._theme_name = theme or config.ui.theme or DEFAULT_THEME
        self._themes = themes
        self._engine_worker: Worker[int] | None = None
        self._shutting_down = False
        self._colours: dict[str, str] = {}
        self._colours_of: dict[str, str] | None = None
        self.resume_offer = resume_offer
        self.probe_offered = False  # the probe is offered once per run, at the first switch to parallel/auto
        self._tune_gc_wanted = tune_gc
        self.attached = attached
        self.tour = tour
        self._gc_threshold: tuple[int, int, int] | None = None
        self.on_terminal_lost: Callable[[str], None] | None = None
        """Told (from Textual's output thread) when a write to the terminal failed; the console (commands/console.py,
        console_client.py) sets its terminal watch here. Unset, the app stops itself (`stop_from_thread`)."""
        self._console_loop: asyncio.AbstractEventLoop | None = None
        self._pending_stop: tuple[int, str] | None = None  # a stop asked for before the app was mounted
        self._notices_shown: dict[tuple[str, str, str], float] = {}  # (title, text, severity) -> shown until
        self.rung: deque[str] = deque(maxlen=100)
        """The terminal alerts this console sent, newest last (what `ring` wrote, or would have written to a
        headless terminal)."""

    # ---- setup ------------------------------------------------------------------------------------
    def get_default_screen(self) -> MainScreen:
        return MainScreen()

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """Our variables for themes that do not set them (Textual's own, for instance)."""
        theme = self.current_theme
        return {
            "stall-warn": theme.warning or "#FFA62B",
            "stall-critical": theme.error or "#BA3C5B",
            "stream-reasoning": "#8A8A8A" if theme.dark else "#6E6E6E",
        }

    def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        if self._themes is None:
            from cerevisor_tui.config.paths import user_themes_dir
            from cerevisor_tui.ui.theme_files import load_themes

            self._themes = load_themes(user_themes_dir())
        for theme in self._themes.themes.values():
            self.register_theme(theme)
        self.theme = self._theme_name if self.get_theme(self._theme_name) else DEFAULT_THEME
        for problem in self._themes.problems:
            self.notice(problem, title="Theme skipped", severity="warning", timeout=8)
        unknown = sorted(set(self.keymap) - BINDING_IDS)
        if unknown:
            self.notice(f"[ui.keys]: unknown binding id {', '.join(unknown)} (known: {', '.join(sorted(BINDING_IDS))})",
                        title="Key remap ignored", severity="warning", timeout=10)
        self.set_keymap({k: v for k, v in self.keymap.items() if k in BINDING_IDS})
        if self._run is not None:
            self._start_engine_worker()
        if self._tune_gc_wanted:
            self.call_after_refresh(self._tune_gc)
        if self.resume_offer is not None:
            offer = self.resume_offer
            self.notice(f"Last run {offer.run_id} did not complete ({offer.completed} of {offer.total} agents done): "
                        "ctrl+p → Resume last run", title="Resume?", severity="warning", timeout=20)
        self._console_loop = asyncio.get_running_loop()
        if self._pending_stop is not None:
            self._begin_shutdown(*self._pending_stop)

    def _tune_gc(self) -> None:
        """Collect young garbage rarely but early, and never scan what start-up built again.

        Every line Textual redraws is a Strip whose caches hold the strip itself: a reference cycle, which
        only the collector frees. At the default threshold (700) a frame's strips are still on screen when
        the young generations are collected, so they age into the oldest one, and at a full box's load a
        full collection then frees them by the ten thousand in one pause, with key presses waiting behind
        it. With 20,000 allocations between young collections a frame's strips are already garbage when
        they are looked at, and the objects start-up built are kept out of every scan (heap.py).
        """
        import gc

        from cerevisor_tui.heap import freeze_startup

        if self._gc_threshold is None:
            self._gc_threshold = gc.get_threshold()
            freeze_startup()
            gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)

    def _restore_gc(self) -> None:
        import gc

        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
            gc.unfreeze()
            self._gc_threshold = None

    # ---- from other threads: signals and the terminal ------------------------------------------------
    def stop_from_thread(self, exit_code: int, reason: str) -> None:
        """A signal or a lost terminal ends the console: stop the run cleanly (journal and report whole), then
        exit with `exit_code`. Safe from any thread; it only hands the work to the app's event loop."""
        self._pending_stop = (exit_code, reason)  # before the loop is known: on_mount takes it up
        loop = self._console_loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the app has ended already
                loop.call_soon_threadsafe(self._begin_shutdown, exit_code, reason)

    def terminal_lost(self, reason: str) -> None:
        """The console's driver could not write to the terminal (see ui/driver.py); from its output thread."""
        if self.on_terminal_lost is not None:
            self.on_terminal_lost(reason)
        else:
            self.stop_from_thread(LOST_TERMINAL_EXIT, f"console lost its terminal ({reason})")

    def ring(self, items: list[AttentionItem]) -> None:
        """New inbox items: the bell and one desktop notification, unless `[ui] notify = false`. Several at once
        (a local server that is down for every agent) ring once, naming them."""
        if not self.config.ui.notify or not items:
            return
        if len(items) == 1:
            alert = terminal_alert(f"cerevisor: {items[0].agent} {items[0].label}", items[0].text)
        else:
            alert = terminal_alert(f"cerevisor: {len(items)} agents need you",
                                   ", ".join(f"{item.agent} {item.label}" for item in items))
        self.rung.append(alert)
        if not self.is_headless and self._driver is not None:
            self._driver.write(alert)

    async def run_action(self, action: str | ActionParseResult, default_namespace: DOMNode | None = None,
                         namespaces: Mapping[str, DOMNode] | None = None) -> bool:
        """Every key's action comes here: one of the demo's suggested keys leaves its hint."""
        binding_id = _BINDING_OF_ACTION.get(action) if isinstance(action, str) else None
        if binding_id is not None and self.tour and isinstance(self.screen, MainScreen):
            self.screen.tried(binding_id)
        return await super().run_action(action, default_namespace, namespaces)

    def colour(self, name: str) -> str:
        """A theme variable as a concrete colour for Rich styles ("" when it is not one)."""
        if self._colours_of is not self.theme_variables:  # the theme's CSS was refreshed
            self._colours_of, self._colours = self.theme_variables, {}
        found = self._colours.get(name)
        if found is None:
            found = self._colours[name] = resolve_colour(self.theme_variables, name)
        return found

    def _theme_changed(self, theme: object) -> None:
        """Published once the new theme's variables are in force: repaint what we coloured ourselves."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen) and screen.is_mounted:
                screen.recolour()

    def notice(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None) -> None:
        """A toast of ours. Our messages carry agent names, paths and reasons verbatim: they are never read as
        markup (Textual's own toasts go through `notify` and keep theirs). The same notice again while the first
        is still shown is not shown twice: a key held down or a status said at every refresh makes one toast."""
        key = (title, message, severity)
        now = time.monotonic()
        if self._notices_shown.get(key, 0.0) > now:
            return
        shown_s = self.NOTIFICATION_TIMEOUT if timeout is None else timeout
        self._notices_shown = {k: until for k, until in self._notices_shown.items() if until > now}
        self._notices_shown[key] = now + shown_s
        self.notify(message, title=title, severity=severity, timeout=shown_s, markup=False)

    def clear_notifications(self) -> None:
        self._notices_shown.clear()
        super().clear_notifications()

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """The palette's Screenshot: an SVG of the screen, saved in the run's directory (the current directory
        when that is not on this machine), and the notice says where. Textual's own saves to ~/Downloads, which
        a GPU box seldom has, and then neither saves nor says anything."""
        directory = path or self._screenshot_dir()
        try:
            saved = self.save_screenshot(filename, directory, time_format)
        except OSError as exc:
            self.notice(f"Not saved in {directory}: {exc.strerror or exc}", title="Screenshot", severity="error",
                        timeout=8)
            return None
        self.notice(f"Saved {saved}", title="Screenshot", timeout=8)
        return None

    def _screenshot_dir(self) -> str:
        run_dir = self.mirror.run_dir
        if run_dir and os.path.isdir(run_dir) and os.access(run_dir, os.W_OK):
            return run_dir
        return os.getcwd()

    # ---- the run ----------------------------------------------------------------------------------
    def command(self, command: cmd.Command, then: Callable[[cmd.AnswerValue], None] | None = None) -> None:
        """Send `command` to the run: a refusal is said as a warning in the run's own words, and `then` gets what
        the run did (its answer's value), the same whether the run is in this process or over its socket."""

        def answered(answer: cmd.Answer) -> None:
            if answer.refused:
                self.notice(answer.error, title="Not done", severity="warning", timeout=6)
            elif then is not None:
                then(answer.value)

        self.control.send(command, answered)

    @property
    def model(self) -> RunMirror:
        """The mirror, as the UiModel it extends (its transcripts, throughput and trends)."""
        return self.mirror

    def _start_engine_worker(self) -> None:
        self._engine_worker = self.run_worker(self._run_engine(), name="engine", group="engine", exit_on_error=False)

    async def _run_engine(self) -> int:
        assert self._run is not None
        self.run_exit_code = await self._run()
        return self.run_exit_code

    @property
    def _run_going(self) -> bool:
        """The in-process run has not ended (without one, the run goes on elsewhere: the mirror says)."""
        worker = self._engine_worker
        if self._run is None:
            return True
        return worker is not None and not worker.is_finished

    @property
    def run_open(self) -> bool:
        """The run goes on and its endpoints are open (what a probe needs)."""
        mirror = self.mirror
        return self._run_going and bool(mirror.run_id) and mirror.finished is None and not mirror.stopping

    # ---- resuming the last run ----------------------------------------------------------------------
    def action_resume_last_run(self) -> None:
        """Stop this run and go on with the last run of this config, which did not complete (palette only)."""
        offer = self.resume_offer
        if offer is None:
            self.notice("No earlier run of this config is waiting to be resumed.", severity="warning")
            return
        if not self.run_active:
            self._begin_resume(offer)
            return
        from cerevisor_tui.ui.screens.confirm import ConfirmScreen

        running = sum(1 for a in self.mirror.agents.values() if a.status not in FINAL)
        question = (f"Stop this run ({running} agent(s) not finished are cancelled) and resume {offer.run_id}? "
                    f"Its {offer.total - offer.completed} unfinished agent(s) run again; the {offer.completed} it "
                    "completed are not sent again.")
        self.push_screen(ConfirmScreen("Resume last run", question, yes="Resume", no="Stay"),
                         lambda yes: self._begin_resume(offer) if yes else None)

    def _begin_resume(self, offer: ResumeOffer) -> None:
        if self._shutting_down or self.resume_offer is not offer:
            return
        try:
            handle = offer.open(self.config)
        except Exception as exc:  # noqa: BLE001 - an unusable run directory: say so, keep this run
            self.notice(str(exc) or type(exc).__name__, title="Cannot resume", severity="error", timeout=10)
            return
        self.resume_offer = None
        self.run_worker(self._swap_run(handle, offer.run_id, f"replaced by the resumed run {offer.run_id}"),
                        name="resume", group="resume")

    async def _swap_run(self, handle: RunHandle, run_id: str, reason: str) -> None:
        """Stop the current run cleanly (its journal gets its end), then follow `handle`'s run in its place."""
        worker = self._engine_worker
        if worker is not None and not worker.is_finished:
            self.command(cmd.Stop(reason=reason))
            try:
                await asyncio.wait_for(worker.wait(), STOP_WAIT_S)
            except TimeoutError:
                worker.cancel()
            except Exception:
                pass  # its error was shown already
        if self._shutting_down:
            return  # quit while the old run stopped: the resumed run stays as it was, to resume next time
        self.control, self.mirror, self._run = handle.control, handle.mirror, handle.run
        self.engine_error, self.run_exit_code = "", None
        self.probe_offered = False
        self._engine_worker = None
        main = self.screen_stack[0]
        if isinstance(main, MainScreen):
            main.show_run()
        if self._run is not None:
            self._start_engine_worker()
        self.notice(f"Resuming run {run_id}.", timeout=4)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker is self._engine_worker and event.state == WorkerState.ERROR:
            error = event.worker.error
            self.engine_error = str(error) or type(error).__name__
            self.notice(self.engine_error, title="Engine stopped", severity="error", timeout=15)

    @property
    def run_active(self) -> bool:
        """Agents are running or waiting to run (quitting would cancel them)."""
        worker = self._engine_worker
        if worker is None or worker.is_finished:
            return False
        return any(a.status not in FINAL for a in self.mirror.agents.values())

    @property
    def _gateway_serving(self) -> bool:
        """The run serves a gateway and goes on (a gateway waits for sessions until it is stopped)."""
        worker = self._engine_worker
        return (self.mirror.serves_gateway and self.mirror.finished is None and worker is not None
                and not worker.is_finished)

    async def on_unmount(self) -> None:
        """However the app ends, let the engine finish closing its streams (and the simulator) first; an
        attached console only closes its connection (the run goes on)."""
        self._restore_gc()
        worker = self._engine_worker
        if worker is None or worker.is_finished:
            return
        if self.attached:
            worker.cancel()
            return
        self.command(cmd.Stop(reason="console closed"))
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(worker.wait(), STOP_WAIT_S)

    # ---- quitting ---------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        """ctrl+q, and `q` on the main screen."""
        self.request_quit()

    def request_quit(self) -> None:
        if self._shutting_down:
            return
        if self.attached and (self.run_active or self._gateway_serving):
            from cerevisor_tui.ui.screens.confirm import DetachScreen

            mirror = self.mirror
            running = sum(1 for a in mirror.workflow_agents if a.status not in FINAL)
            sessions = sum(1 for a in mirror.sessions if a.status not in FINAL)
            self.push_screen(DetachScreen(running, gateway=mirror.gateway_url or mirror.serves_gateway,
                                          sessions=sessions), self._leave)
            return
        if not self.run_active:
            self._begin_shutdown()
            return
        from cerevisor_tui.ui.screens.confirm import ConfirmScreen

        running = sum(1 for a in self.mirror.agents.values() if a.status not in FINAL)
        self.push_screen(
            ConfirmScreen("Quit", f"{running} agent(s) have not finished. Quit and cancel them?", yes="Quit",
                          no="Stay"),
            lambda yes: self._begin_shutdown() if yes else None,
        )

    def _leave(self, choice: str | None) -> None:
        if choice == "detach":
            self._begin_shutdown(0, "console detached")
        elif choice == "stop":
            self.command(cmd.Stop(reason="stopped from an attached console"))
            self._begin_shutdown(None, "console quit", stop=False)

    def _begin_shutdown(self, exit_code: int | None = None, reason: str = "console quit", *, stop: bool = True) -> None:
        """`exit_code`: None when the operator quits (the run's own code is the console's); 128 + the signal's
        number when a signal ends the console, 129 when its terminal went away."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self.run_worker(self._stop_engine_and_exit(exit_code, reason, stop=stop and not self.attached),
                        name="shutdown", group="shutdown")

    async def _stop_engine_and_exit(self, exit_code: int | None, reason: str, *, stop: bool = True) -> None:
        """Stop the engine so every request is cancelled and its connection closed, then leave. Attached to
        a run in its own process (`stop` False): leave it as it is (the worker, its connection, ends here),
        unless the operator chose to stop it, which waits for its end as a quit does."""
        worker = self._engine_worker
        if worker is not None and not worker.is_finished and self.attached and exit_code is not None:
            worker.cancel()  # detach: close the connection, the run goes on
        elif worker is not None and not worker.is_finished:
            if stop:
                self.command(cmd.Stop(reason=reason))
            try:
                await asyncio.wait_for(worker.wait(), STOP_WAIT_S if exit_code is None else SIGNAL_STOP_WAIT_S)
            except TimeoutError:
                worker.cancel()  # cancelling the task still closes its connections on the way out
            except Exception:
                pass  # its error was shown already; leaving anyway
        code = self.run_code() if exit_code is None else exit_code
        self.exit(code, return_code=code)

    def run_code(self) -> int:
        """The console's exit code when the operator quits: the run's (0 every agent completed, 1 some failed,
        were killed or were cancelled by the quit); 1 when the engine failed or had to be cancelled."""
        if self.engine_error:
            return 1
        if self.run_exit_code is not None:
            return self.run_exit_code
        return 0 if self._engine_worker is None else 1


def _console_driver() -> type | None:
    """The driver for a real terminal (ui/driver.py); None (Textual's choice) on Windows. Tests run headless,
    where Textual uses its headless driver whatever this says."""
    if os.name == "nt":
        return None
    from cerevisor_tui.ui.driver import ConsoleDriver

    return ConsoleDriver
