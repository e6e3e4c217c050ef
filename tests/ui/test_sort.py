"""The agents table at scale: the sort key (wave order, nearest deadline, status, tokens/s) and the `/` filter,
at 256 agents on an 80x24 terminal. The run's events go through the engine's own emit into the console's
mirror (the path a real run takes), at fixed monotonic times against a frozen clock."""

from __future__ import annotations

import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.theme_files import load_themes
from tests.conftest import until
from tests.ui.conftest import emit_as_engine, sim_config

T0 = 1000.0
NOW = 1100.0
AGENTS = [f"a{i:03d}" for i in range(256)]
URGENT = "a200"  # row 200 in wave order: far below what 80x24 shows


def crowd(tmp_path) -> tuple[CerevisorApp, Engine]:
    """256 agents all waiting for their first token (600 s window), each sent a little later than the one
    before; URGENT was sent 500 s before the others, so its deadline is the nearest, and it is past 80% of it."""
    config = sim_config(tmp_path, agents=[{"name": name, "prompt": "hi"} for name in AGENTS],
                        run={"max_concurrency": 256}, stall={"first_byte_timeout_s": 600.0})
    engine = Engine(config, run_id="sort", run_dir=str(tmp_path / "runs" / "sort"))
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None))
    engine.emit(engine.started_event(T0))
    engine.emit(ev.WaveStarted(T0, 0, AGENTS))
    for i, name in enumerate(AGENTS):
        sent = T0 - 410.0 if name == URGENT else T0 + i * 0.1
        emit_as_engine(engine, ev.AgentStarted(sent, name, 1, 1, 1, "sim", 600.0, 60.0))
    emit_as_engine(engine, ev.StallWarning(T0 - 110, URGENT, 1, "first_byte", 0.5, 300.0, T0 + 190))
    emit_as_engine(engine, ev.StallWarning(T0 + 70, URGENT, 1, "first_byte", 0.8, 120.0, T0 + 190))
    return app, engine


def on_screen(app: CerevisorApp, agent: str) -> bool:
    """Whether the agent's row is drawn in the agents pane now (the table's visible rows, by what it draws)."""
    table = app.screen.table
    top = table.scroll_offset.y
    shown = table.names[top:top + table.size.height - 1]
    return agent in shown and agent in app.export_screenshot()


@pytest.mark.anyio
async def test_nearest_deadline_sort_puts_the_agent_nearest_its_deadline_on_screen_at_80x24(tmp_path):
    app, _ = crowd(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.table
        await until(lambda: table.names.index(URGENT) == 200)
        assert not on_screen(app, URGENT)
        await pilot.press("o")
        await until(lambda: table.sort == "deadline" and table.names[0] == URGENT and on_screen(app, URGENT))
        assert table.selected_agent == "a000" and table.cursor_row == 1  # the cursor kept its agent
        assert table.row_texts(URGENT)[-2].startswith("first 1:30")  # 90 s left, amber
        assert table.amber == 1 and "by nearest deadline" in str(app.screen.query_one("#agents-pane").border_subtitle)
        # the next agents are the ones sent first, in order
        assert table.names[1:4] == ["a000", "a001", "a002"]


@pytest.mark.anyio
async def test_the_cursor_stays_on_its_agent_as_the_rows_move(tmp_path):
    app, engine = crowd(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("o")
        await pilot.pause()
        table = app.screen.table
        await pilot.press("down", "down", "down", "down")  # from a000, which the sort put on row 1
        chosen = table.names[5]
        assert table.selected_agent == chosen == "a004"
        # a later agent's first token comes: its idle window (60 s) ends before every first-byte deadline
        emit_as_engine(engine, ev.FirstToken(NOW - 1, "a100", 1, 1, 5.0))
        emit_as_engine(engine, ev.FirstToken(NOW - 1, "a002", 1, 1, 5.0))
        app.screen.refresh_status()
        await until(lambda: table.names[:2] == ["a002", "a100"])  # idle 0:59 each; the tie keeps wave order
        assert table.selected_agent == chosen and table.cursor_row == table.names.index(chosen) == 6
        assert app.screen.stream_pane.agent == chosen  # the stream shown did not change either


@pytest.mark.anyio
async def test_the_sort_key_cycles_status_and_rate_and_back_to_wave_order(tmp_path):
    app, engine = crowd(tmp_path)
    for name, tokens in (("a010", 5), ("a020", 50)):
        emit_as_engine(engine, ev.FirstToken(NOW - 5, name, 1, 1, 1.0))
        for i in range(tokens):
            engine.emit(ev.TokenDelta(NOW - 5 + i * 4 / tokens, name, 1, "x "))
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.table
        await pilot.press("o", "o")
        await until(lambda: table.sort == "status")
        assert table.names[0] == URGENT  # stalling comes first
        assert table.names[-2:] == ["a010", "a020"]  # streaming after prefill
        await pilot.press("o")
        await until(lambda: table.sort == "rate")
        assert table.names[:2] == ["a020", "a010"]
        await pilot.press("o")
        await until(lambda: table.sort == "wave")
        assert table.names == AGENTS


@pytest.mark.anyio
async def test_slash_filters_by_name_or_status_and_esc_clears(tmp_path):
    app, _ = crowd(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.table
        await pilot.press("slash", "a", "2", "0")
        await until(lambda: table.names == [f"a20{i}" for i in range(10)])
        await pilot.press("backspace", "backspace", "backspace", "s", "t", "a", "l", "l", "enter")
        await until(lambda: table.names == [URGENT] and table.has_focus)
        assert table.selected_agent == URGENT and table.filter == "stall"
        subtitle = str(app.screen.query_one("#agents-pane").border_subtitle)
        assert "/stall: 1 of 256" in subtitle
        await pilot.press("slash", "escape")
        await until(lambda: table.names == AGENTS and table.has_focus)
        assert table.filter == ""
        assert table.selected_agent == URGENT  # the cursor kept its agent while the rows came back


@pytest.mark.anyio
async def test_sorting_keeps_the_cursor_on_its_agent(tmp_path):
    app, _ = crowd(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.table
        await pilot.press("down", "down", "down")
        await until(lambda: table.selected_agent == "a003")
        await pilot.press("o")  # nearest deadline: URGENT goes first, a003 one row down
        await until(lambda: table.sort == "deadline" and table.names[0] == URGENT)
        assert table.selected_agent == "a003" and table.cursor_row == 4
        assert app.screen.stream_pane.agent == "a003"
        await pilot.press("o", "o", "o")  # status, rate, and back to wave order
        await until(lambda: table.sort == "wave" and table.names == AGENTS)
        assert table.selected_agent == "a003" and table.cursor_row == 3


@pytest.mark.anyio
async def test_deadlines_a_token_apart_keep_their_rows_still(tmp_path):
    """Two streaming agents whose idle deadlines fall in the same second keep wave order whichever got the later
    token, however often the pane is redrawn: the rows do not swap as each token moves its deadline."""
    app, engine = crowd(tmp_path)
    emit_as_engine(engine, ev.FirstToken(NOW - 1.2, "a002", 1, 1, 5.0))  # idle deadline NOW + 58.8
    emit_as_engine(engine, ev.FirstToken(NOW - 1.6, "a100", 1, 1, 5.0))  # NOW + 58.4: nearer, in the same second
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.table
        await pilot.press("o")
        await until(lambda: table.sort == "deadline" and table.names[:2] == ["a002", "a100"])
        for t in (NOW - 1.1, NOW - 1.3, NOW - 1.15):  # a100's deadline passes a002's and back, within the second
            engine.emit(ev.TokenDelta(t, "a100", 1, "x "))
            app.screen.refresh_status()
            await pilot.pause()
            assert table.names[:2] == ["a002", "a100"]
        engine.emit(ev.TokenDelta(NOW - 0.1, "a002", 1, "x "))  # a whole second later: a002's deadline is farther
        app.screen.refresh_status()
        await until(lambda: table.names[:2] == ["a100", "a002"])
