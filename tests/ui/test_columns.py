"""The agents pane fits its columns to the width: the note gets what the status column does not use, the wave
column is left out while every row is a gateway session, and long names are cut in the middle (a session id's two
ends tell it apart); at 80 columns the note still shows."""

from __future__ import annotations

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.widgets.agent_table import _fit
from tests.conftest import until
from tests.ui.scenes import NOW, build, build_gateway


def lines(app) -> list[str]:
    """The agents pane's lines as drawn (header first)."""
    table = app.screen.table
    return [strip.text for strip in (table.render_line(y) for y in range(table.size.height))]


def test_a_long_name_is_cut_in_its_middle():
    assert _fit("226c5305-4664-4f2a-9b1e-5d0c3a7bc9e1", 12, False, middle=True) == "226c53…bc9e1"
    assert _fit("日本語のエージェント", 9, False, middle=True) == "日本…ント"  # wide characters: 9 cells
    assert _fit("short", 8, False, middle=True) == "short   "


@pytest.mark.anyio
async def test_sessions_at_80_columns_show_their_notes_without_a_wave_column():
    app = build_gateway(long_names=True)
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.table
        await until(lambda: table.row_count == 4)
        await pilot.pause()
        shown = lines(app)
        header = shown[0]
        assert "wave" not in header and "gw" not in "".join(shown[1:])
        assert header.rstrip().endswith("note")
        claude = next(line for line in shown if line.startswith(" 226c53…"))
        assert claude.startswith(" 226c53…bc9e1 ")  # both ends of the id
        assert "claude-code" in claude  # its note, after the countdown (5 cells before the change)
        codex = next(line for line in shown if line.startswith(" 0199a6…"))
        assert "request 1 kil" in codex
        assert all(len(line) == table.size.width for line in shown)


@pytest.mark.anyio
async def test_the_status_column_gives_back_what_it_does_not_use():
    """A workflow's rows keep their wave column; the status column is as wide as the longest status now shown,
    and when that status ends the note gets the cells back."""
    app = build("killed")
    async with app.run_test(size=(100, 30)) as pilot:
        table = app.screen.table
        await until(lambda: table.row_count == 5)
        await pilot.pause()
        assert "wave" in lines(app)[0]
        note_at = lines(app)[0].index("note")
        app.mirror(ev.AgentStatus(NOW, "planner", "approval"))  # the longest a status gets but a tool call's
        app.screen.refresh_status()
        await until(lambda: lines(app)[0].index("note") == note_at + len("needs approval") - len("completed"))
        app.mirror(ev.AgentStatus(NOW, "planner", "completed"))
        app.screen.refresh_status()
        await until(lambda: lines(app)[0].index("note") == note_at)


@pytest.mark.anyio
async def test_a_maximized_load_pane_takes_the_screen_and_wraps_its_lines():
    app = build("auto")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(lambda: app.screen.table.row_count > 0)
        pane = app.screen.query_one("#load-pane")
        assert pane.region.height <= 8
        await pilot.press("3")
        await until(lambda: pane.region.height == 23)  # all but the footer's line
        shown = [strip.text for strip in app.screen._compositor.render_strips()]
        assert any("8.2k per" in line for line in shown)
        assert any(line.startswith("│ conversation ") for line in shown)  # the KV line's end, wrapped, not cut
        await pilot.press("escape")
        await until(lambda: pane.region.height <= 8)
