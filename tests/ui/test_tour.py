"""Learning the console on the built-in demo: its answers last long enough to try every key, its first screen names
the keys to try (each tried leaves the hint), and going parallel or auto offers the probe on that line instead of
opening a dialog over the table."""

from __future__ import annotations

import pytest

from cerevisor_tui.commands.console import demo_workflow
from cerevisor_tui.config import validate
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.screens.probe import ProbeScreen
from tests.conftest import until
from tests.ui.conftest import console


def hint(app) -> str:
    line = app.screen.query_one("#hint")
    return str(line.render()) if line.display else ""


def test_the_demo_streams_for_minutes():
    """Its two waves stream for over three minutes at the simulator's pace (the example's pace: 15 s)."""
    demo = demo_workflow()
    rate = demo["endpoints"][0]["sim"]["tokens_per_s"]
    longest = {0: 0.0, 1: 0.0}
    for agent in demo["agents"]:
        wave = 1 if agent.get("depends_on") else 0
        longest[wave] = max(longest[wave], (1 + len(agent.get("turns", []))) * agent["max_tokens"] / rate)
    assert longest[0] + longest[1] >= 180


@pytest.mark.anyio
async def test_the_demo_names_the_keys_to_try_and_offers_the_probe_without_a_dialog(tmp_path):
    data = demo_workflow()
    data["run"]["run_dir"] = str(tmp_path / "runs")
    app = console(validate(data, file="demo"), start_engine=False, tour=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(lambda: hint(app).startswith("Try: m mode · +/- cap · e extend · k kill · o sort"))
        assert hint(app).endswith("? help · q quit") and len(hint(app)) <= 78  # whole at 80 columns
        assert "q quit" in "\n".join(strip.text for strip in app.screen._compositor.render_strips())
        await pilot.press("o", "plus")
        await until(lambda: hint(app) == "Try: m mode · e extend · k kill · 3 load · ? help · q quit")
        await pilot.press("m")  # parallel -> auto: the probe is offered on the hint line
        await until(lambda: hint(app).startswith("Probe sim before more agents run at once? P "))
        assert isinstance(app.screen, MainScreen) and app.mirror.mode == "auto"
        await pilot.press("P")
        await until(lambda: isinstance(app.screen, ProbeScreen))
        assert app.screen.state == "offer"  # it asks first, saying what it sends
        await pilot.press("escape")
        await until(lambda: isinstance(app.screen, MainScreen))
        await until(lambda: hint(app) == "Try: e extend · k kill · 3 load · ? help · q quit")


@pytest.mark.anyio
async def test_a_run_of_ones_own_shows_no_hint(tmp_path):
    data = demo_workflow()
    data["run"]["run_dir"] = str(tmp_path / "runs")
    app = console(validate(data, file="team.toml"), start_engine=False)
    async with app.run_test(size=(80, 24)):
        await until(lambda: app.screen.table.row_count == 5)
        assert hint(app) == ""
