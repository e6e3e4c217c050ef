"""Where config, run directories and user themes live (platformdirs)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_config_path, user_state_path

APP = "cerevisor-tui"
CONFIG_ENV = "CEREVISOR_TUI_CONFIG"


def user_config_file() -> Path:
    return user_config_path(APP) / "config.toml"


def user_themes_dir() -> Path:
    return user_config_path(APP) / "themes"


def default_runs_dir() -> Path:
    return user_state_path(APP) / "runs"


def probe_store_file() -> Path:
    """The saved probe recommendations, by endpoint and model (endpoints/probe_store.py)."""
    return user_state_path(APP) / "probes.json"


def find_config(explicit: str | None) -> Path | None:
    """The config file in force: --config, $CEREVISOR_TUI_CONFIG, ./cerevisor.toml, the user config dir."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    for candidate in (Path.cwd() / "cerevisor.toml", user_config_file()):
        if candidate.is_file():
            return candidate
    return None
