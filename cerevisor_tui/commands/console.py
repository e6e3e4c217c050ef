"""`cerevisor-tui [--config FILE] [--theme NAME]`: the console.

The config is found as everywhere (--config, $CEREVISOR_TUI_CONFIG, ./cerevisor.toml, the user config
dir). With none, or one that configures no endpoint, the console runs the packaged demo workflow on
the built-in simulator (the header says SIMULATED). A config that cannot be used is one line on
stderr and exit 2. The run directory is kept as by the headless run (events, transcripts, report).
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from cerevisor_tui.config import Config, ConfigError, load_config, validate
from cerevisor_tui.config.checks import preflight
from cerevisor_tui.config.paths import default_runs_dir, find_config, user_config_file, user_themes_dir

DEMO = "built-in demo"


def demo_text() -> str:
    """The packaged demo workflow (config/example.toml): a simulated endpoint and five agents."""
    return resources.files("cerevisor_tui.config").joinpath("example.toml").read_text(encoding="utf-8")


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
        text = demo_text()
        return ConsoleSetup(validate(tomllib.loads(text), file=DEMO), None, user_config_file(), text, True)
    config = load_config(path)
    if not config.endpoints:
        # A config with no endpoint (only [ui] or [run], say) keeps its settings and runs the demo's workflow.
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        demo = tomllib.loads(demo_text())
        data["endpoints"], data["agents"] = demo["endpoints"], demo["agents"]
        return ConsoleSetup(validate(data, file=f"{path} (with the {DEMO})"), path, path, None, True)
    if not config.agents:
        raise ConfigError("no [[agents]] to run (see config.example.toml for a workflow)", file=str(path),
                          key="agents")
    return ConsoleSetup(config, path, path, None, False)


def main(args: Any) -> int:
    try:
        setup = resolve_config(getattr(args, "config", None))
        config = setup.config
        file = str(setup.config_path) if setup.config_path else DEMO
        preflight(config, file=file)
    except ConfigError as exc:  # before the engine and Textual are imported: a bad config fails fast
        print(f"cerevisor-tui: {exc}", file=sys.stderr)
        return 2

    from cerevisor_tui.engine.engine import Engine, new_run_id
    from cerevisor_tui.engine.journal import Journal, JournalError
    from cerevisor_tui.ui.keys import BINDING_IDS
    from cerevisor_tui.ui.theme_files import ThemeError, check_theme_name, load_themes

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
        run_id = new_run_id()
        runs_dir = Path(config.run.run_dir).expanduser() if config.run.run_dir else default_runs_dir()
        engine = Engine(config, run_id=run_id, run_dir=str(runs_dir / run_id))
        journal = Journal(runs_dir / run_id, engine.report)
        journal.open()
    except (ConfigError, JournalError, ThemeError) as exc:
        print(f"cerevisor-tui: {exc}", file=sys.stderr)
        return 2

    from cerevisor_tui.ui.app import CerevisorApp

    engine.subscribe(journal)
    app = CerevisorApp(
        engine, config, simulated=setup.simulated, config_path=setup.config_path, save_path=setup.save_path,
        save_template=setup.save_template, theme=theme, themes=themes,
    )
    try:
        app.run()
    finally:
        journal.write_report()
        journal.close()
    return app.return_code or 0
