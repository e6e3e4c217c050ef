"""Colour themes as TOML data files, turned into `textual.theme.Theme` objects.

The shipped themes live in the repository's top-level `themes/` (`cerevisor_tui/ui/themes` links to it, so the
wheel packages them as `cerevisor_tui/ui/themes/*.toml`); the user themes folder
(`paths.user_themes_dir()`) is read after them, so a user file may replace a packaged theme by name.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from textual.theme import Theme

DEFAULT_THEME = "cerevisor-dark"
THEME_VARIABLES = ("stall-warn", "stall-critical", "stream-reasoning")
"""Our own theme variables; a theme may leave them out, the console then derives them."""

_COLOURS = ("primary", "secondary", "warning", "error", "success", "accent", "foreground", "background",
            "surface", "panel", "boost")
_KEYS = {"name", "dark", "luminosity_spread", "text_alpha", "variables", *_COLOURS}


class ThemeError(Exception):
    """A theme file that cannot be used, or a theme name that does not exist."""


@dataclass
class ThemeSet:
    """The themes found, and the problems of files that could not be read (shown, never fatal)."""

    themes: dict[str, Theme] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def theme_from_toml(data: dict[str, Any], *, source: str) -> Theme:
    """One theme from a parsed TOML table; raises ThemeError naming the file and the key."""
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ThemeError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    for key in ("name", "primary"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ThemeError(f"{source}: {key}: required text is missing")
    colours = {key: data[key] for key in _COLOURS if key in data}
    for key, value in colours.items():
        if not isinstance(value, str):
            raise ThemeError(f"{source}: {key}: must be a colour such as \"#4FB0C6\"")
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ThemeError(f"{source}: variables: must be a table of colour strings")
    try:
        theme = Theme(
            name=data["name"],
            dark=bool(data.get("dark", True)),
            luminosity_spread=float(data.get("luminosity_spread", 0.15)),
            text_alpha=float(data.get("text_alpha", 0.95)),
            variables=dict(variables),
            **colours,
        )
        theme.to_color_system()  # parses every colour now, so a typo is reported with its file
    except Exception as exc:  # Color.parse raises its own error types
        raise ThemeError(f"{source}: {exc}") from None
    return theme


def _read(text: str, source: str) -> Theme:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ThemeError(f"{source}: invalid TOML: {exc}") from None
    return theme_from_toml(data, source=source)


def packaged_themes() -> dict[str, Theme]:
    """The themes shipped with the package."""
    themes: dict[str, Theme] = {}
    folder = resources.files("cerevisor_tui.ui").joinpath("themes")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            theme = _read(entry.read_text(encoding="utf-8"), f"themes/{entry.name}")
            themes[theme.name] = theme
    return themes


def load_themes(user_dir: Path | None = None) -> ThemeSet:
    """Packaged themes, then every `*.toml` of the user themes folder (a broken file is reported, not fatal)."""
    found = ThemeSet(packaged_themes())
    if user_dir is not None and user_dir.is_dir():
        for path in sorted(user_dir.glob("*.toml")):
            try:
                theme = _read(path.read_text(encoding="utf-8"), str(path))
            except (OSError, UnicodeDecodeError) as exc:
                found.problems.append(f"{path}: cannot read: {exc}")
                continue
            except ThemeError as exc:
                found.problems.append(str(exc))
                continue
            found.themes[theme.name] = theme
    return found


def check_theme_name(name: str, themes: dict[str, Theme]) -> str:
    """The name if it is one of ours or Textual's built-in themes, else a ThemeError that lists the choices."""
    from textual.theme import BUILTIN_THEMES

    if name in themes or name in BUILTIN_THEMES:
        return name
    raise ThemeError(f"unknown theme {name!r} (choose from {', '.join(sorted(themes))}, or a Textual theme "
                     "such as textual-dark; user themes go in the user themes folder)")
