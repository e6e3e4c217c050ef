"""Every shipped theme paints every cell of the console: no widget leaves a cell on the terminal's default
background (`ESC[49m`), which on a light theme in a dark terminal is a black band across the pane."""

from __future__ import annotations

import pytest

from cerevisor_tui.ui.theme_files import load_themes
from tests.conftest import until
from tests.ui.scenes import build, build_gateway, select

THEMES = sorted(load_themes(None).themes)


def unpainted(app) -> list[str]:
    """The screen as the terminal is sent it (the compositor's lines): where a cell has no background of its own,
    the line and the text found there."""
    found = []
    for y, strip in enumerate(app.screen._compositor.render_strips()):
        for segment in strip:
            style = segment.style
            if segment.control or not segment.text:
                continue
            if style is None or style.bgcolor is None or style.bgcolor.is_default:
                found.append(f"line {y}: {segment.text!r}")
    return found


def test_the_shipped_themes_are_the_ones_tested():
    assert {"cerevisor-dark", "cerevisor-light", "cerevisor-contrast"} <= set(THEMES)


@pytest.mark.anyio
@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_every_theme_paints_every_cell_of_the_main_screen(theme, size):
    app = build("mid_run")
    app._theme_name = theme
    async with app.run_test(size=size) as pilot:
        await select("skeptic")(pilot)
        await until(lambda: app.theme == theme and app.screen.table.row_count == len(app.mirror.agents) > 0)
        await pilot.pause()
        assert unpainted(app) == []


@pytest.mark.anyio
@pytest.mark.parametrize("theme", THEMES)
async def test_every_theme_paints_the_gateway_rows_and_the_maximized_load_pane(theme):
    app = build_gateway()
    app._theme_name = theme
    async with app.run_test(size=(120, 30)) as pilot:
        await until(lambda: app.theme == theme and app.screen.table.row_count == 4)
        await pilot.pause()
        assert unpainted(app) == []
        await pilot.press("3")
        await pilot.pause()
        assert unpainted(app) == []
