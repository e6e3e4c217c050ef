"""Theme variables as concrete colours for Rich text (Textual keeps some as "auto 60%" or with alpha)."""

from __future__ import annotations

from textual.color import Color, ColorParseError


def resolve_colour(variables: dict[str, str], name: str) -> str:
    """The variable's colour as #RRGGBB over the theme's surface, or "" when it is not a colour."""
    value = variables.get(name, "")
    if not value:
        return ""
    try:
        ground = Color.parse(variables.get("surface") or variables.get("background") or "#000000")
        if value.startswith("auto"):
            parts = value.split()
            alpha = float(parts[1].rstrip("%")) / 100 if len(parts) > 1 else 1.0
            return (ground + ground.get_contrast_text(alpha)).hex
        colour = Color.parse(value)
        return (ground + colour).hex if colour.a < 1 else colour.hex
    except (ColorParseError, ValueError):
        return ""
