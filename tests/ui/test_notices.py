"""Toasts: ours show their text verbatim (names and reasons are never markup) and once while shown, Textual's own
keep their markup; the palette's Screenshot saves in the run's directory, or the current one, and says where."""

from __future__ import annotations

import time

import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.theme_files import load_themes
from tests.conftest import until
from tests.ui.conftest import sim_config
from tests.ui.scenes import build


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


@pytest.mark.anyio
async def test_textuals_own_toast_keeps_its_markup_and_ours_show_brackets_verbatim():
    app = build("mid_run")
    async with app.run_test(size=(100, 30), notifications=True):
        await until(lambda: app.screen.table.row_count > 0)
        app.notify("Saved screenshot to [$text-success]'x.svg'")  # as Textual's own toasts call it
        await until(lambda: "Saved screenshot to 'x.svg'" in screen_text(app))
        app.notice("agent [b]x[/b] [$error]", title="Seen")
        await until(lambda: "agent [b]x[/b] [$error]" in screen_text(app))


@pytest.mark.anyio
async def test_a_notice_said_again_while_shown_makes_one_toast():
    app = build("mid_run")
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await until(lambda: app.screen.table.row_count > 0)
        app.screen.table.move_cursor(list(app.mirror.agents).index("planner"))  # completed: nothing to kill
        await pilot.press("k", "k", "k")
        await until(lambda: any("nothing to kill" in n.message for n in app._notifications))
        await pilot.pause()
        assert sum("nothing to kill" in n.message for n in app._notifications) == 1


async def screenshot(app, pilot) -> None:
    await pilot.press("ctrl+p")
    await pilot.press(*"screenshot")
    await pilot.pause()
    await pilot.press("enter")


@pytest.mark.anyio
async def test_a_screenshot_goes_to_the_current_directory_when_the_run_has_none_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = build("mid_run")  # its run directory (/runs/...) is not on this machine
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await until(lambda: app.screen.table.row_count > 0)
        await screenshot(app, pilot)
        saved = await until(lambda: list(tmp_path.glob("*.svg")))
        assert "planner" in saved[0].read_text()
        await until(lambda: f"Saved {saved[0]}" in " ".join(n.message for n in app._notifications))
        assert "[$" not in screen_text(app)


@pytest.mark.anyio
async def test_a_screenshot_goes_to_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi"}])
    run_dir = tmp_path / "runs" / "shot"
    run_dir.mkdir(parents=True)
    engine = Engine(config, run_id="shot", run_dir=str(run_dir))
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, themes=load_themes(None))
    engine.emit(engine.started_event(time.monotonic()))
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        assert app.mirror.run_dir == str(run_dir)
        await screenshot(app, pilot)
        saved = await until(lambda: list(run_dir.glob("*.svg")))
        assert not list(tmp_path.glob("*.svg"))
        await until(lambda: f"Saved {saved[0]}" in " ".join(n.message for n in app._notifications))
