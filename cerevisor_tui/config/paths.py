"""Where config, run directories and user themes live (platformdirs)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON to a temp file beside `path`, fsync it, then rename over: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
