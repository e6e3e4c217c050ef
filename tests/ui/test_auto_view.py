"""Auto mode on the console: the `AUTO n` badge, the cap history (`a`), the load pane's trend, +/- on the ceiling."""

from __future__ import annotations

import pytest

from cerevisor_tui.ui.model import UiModel
from cerevisor_tui.ui.screens.caps import CapHistoryScreen
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.widgets.load_pane import trend_rows
from cerevisor_tui.ui.widgets.run_header import RunHeader
from cerevisor_tui.ui.widgets.trend_chart import TrendChart, TrendRow, bar_text, levels
from tests.conftest import until
from tests.ui.conftest import EventLog, console, engine_of, kind, sim_config
from tests.ui.scenes import AUTO_CHANGES, build

SLOW = {"tokens_per_s": 8.0}


def header_lines(app) -> list[str]:
    return str(app.screen.query_one(RunHeader).render()).split("\n")


def history_text(app) -> str:
    screen = app.screen
    assert isinstance(screen, CapHistoryScreen)
    return "\n".join(strip.text for strip in screen._compositor.render_strips())


# ---- the real engine --------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_an_auto_run_shows_AUTO_and_its_live_cap_and_a_lists_the_controllers_reasons(tmp_path):
    agents = [{"name": f"a{i}", "prompt": "hi", "max_tokens": 400} for i in range(3)]
    app = console(sim_config(tmp_path, agents=agents, sim=SLOW, run={"mode": "auto"}))
    log = EventLog(engine_of(app))
    async with app.run_test(size=(120, 30)) as pilot:
        start = await log.wait(kind("ConcurrencyChanged", endpoint="sim"))
        assert start.reason.startswith("auto: start at 1")
        app.screen.refresh_status()
        cap = engine_of(app).scheduler.effective_cap
        assert header_lines(app)[1].startswith(f" AUTO {cap} ") and " cap " not in header_lines(app)[1]
        await pilot.press("a")
        assert isinstance(app.screen, CapHistoryScreen)
        assert "auto: start at 1 (slow start" in history_text(app) and "sim" in history_text(app)
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


@pytest.mark.anyio
async def test_m_to_auto_shows_the_sum_of_live_caps_and_plus_minus_move_the_ceiling_not_the_parallel_cap(tmp_path):
    app = console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 400}], sim=SLOW))
    log = EventLog(engine_of(app))
    async with app.run_test() as pilot:  # 80x24
        await log.wait(kind("FirstToken", "a"))
        await pilot.press("m")
        assert engine_of(app).scheduler.mode == "auto"
        await log.wait(kind("ConcurrencyChanged", endpoint="sim"))
        app.screen.refresh_status()
        line = header_lines(app)[1]
        assert line.startswith(f" AUTO {engine_of(app).scheduler.effective_cap} ")
        assert "1 running" in line and "0 failed" in line and "tok/s" in line  # counters keep their place at 80
        ceiling = engine_of(app).caps.ceiling
        await pilot.press("plus", "plus", "minus")
        assert engine_of(app).caps.ceiling == ceiling + 1
        assert engine_of(app).scheduler.max_concurrency == 2  # the parallel cap did not move
        assert f"ceiling {ceiling + 1}" in header_lines(app)[1]
        await pilot.press("a")
        text = history_text(app)
        assert text.index(f"auto ceiling {ceiling + 1} (operator)") < text.index("auto: start at 1")  # newest first
        await pilot.press("a")  # a closes it too
        assert isinstance(app.screen, MainScreen)
        await pilot.press("m")  # sequential: the badge loses the cap, the history stays
        assert header_lines(app)[1].startswith(" SEQUENTIAL ")
        assert app.model.cap_changes_total >= 3


@pytest.mark.anyio
async def test_a_lists_the_operators_mode_and_cap_changes_beside_autos_each_with_who_made_it(tmp_path):
    """The report holds every cap change, manual ones included; so does `a`, each saying who made it."""
    app = console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 400}], sim=SLOW))
    log = EventLog(engine_of(app))
    async with app.run_test(size=(140, 30)) as pilot:
        await log.wait(kind("FirstToken", "a"))
        await pilot.press("plus")  # parallel: the cap, 2 -> 3
        await log.wait(kind("ConcurrencyChanged", reason="cap 2 -> 3"))
        await pilot.press("m")  # auto: the controller starts
        await log.wait(kind("ConcurrencyChanged", endpoint="sim"))
        await pilot.press("a")
        rows = [line for line in history_text(app).split("\n") if " -> " in line or "mode " in line or "auto:" in line]
        by_reason = {reason: line for line in rows for reason in ("cap 2 -> 3", "mode auto", "auto: start at")
                     if reason in line}
        assert " operator " in by_reason["cap 2 -> 3"] and " all " in by_reason["cap 2 -> 3"], rows
        assert " operator " in by_reason["mode auto"], rows
        assert " auto " in by_reason["auto: start at"] and " sim " in by_reason["auto: start at"], rows
        assert rows.index(by_reason["auto: start at"]) < rows.index(by_reason["mode auto"]) < rows.index(
            by_reason["cap 2 -> 3"])  # newest first
    reasons = [h["reason"] for h in engine_of(app).report.to_dict()["caps"]["sim"]["history"]]
    assert "cap 2 -> 3" in reasons and "auto: start at 1" in " ".join(reasons)  # the report names the same changes


# ---- fixed scenes -------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_header_keeps_mode_cap_and_counters_at_80_columns_and_adds_the_last_reason_where_it_fits():
    app = build("auto")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(lambda: header_lines(app)[1].startswith(" AUTO 3  ceiling 64  wave 1/2  3 running 0 queued 0 done"))
        line = header_lines(app)[1]
        assert line.startswith(" AUTO 3  ceiling 64  wave 1/2  3 running 0 queued 0 done 0 failed ")
        assert line.rstrip().endswith("tok/s") and "->" not in line
        await pilot.resize_terminal(160, 48)
        await until(lambda: "sim: 4 -> 3" in header_lines(app)[1])  # the wider header has room for the reason
        line = header_lines(app)[1]
        assert line.startswith(" AUTO 3  ceiling 64  wave 1/2")
        assert line.rstrip().endswith("sim: 4 -> 3 (2 requests waiting in the server's queue, KV 97%)")


@pytest.mark.anyio
async def test_history_screen_lists_every_change_newest_first_with_run_time_endpoint_cap_and_reason():
    app = build("auto")
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("a")
        lines = [line for line in history_text(app).split("\n") if "auto:" in line]  # a row's first line
        assert len(lines) == len(AUTO_CHANGES)
        assert "0:08" in lines[0] and " 3 " in lines[0] and "auto: 4 -> 3 (2 requests waiting" in lines[0]
        assert "0:00" in lines[-1] and "auto: start at 1" in lines[-1]
        assert f"Cap changes ({len(AUTO_CHANGES)})" in history_text(app)


@pytest.mark.anyio
async def test_narrow_auto_load_pane_shows_the_trend_in_place_of_the_throughput_line():
    for scene, trend, throughput in (("auto", True, False), ("mid_run", False, True)):
        app = build(scene)
        async with app.run_test(size=(80, 24)) as pilot:
            chart = app.screen.query_one(TrendChart)
            await until(lambda app=app, chart=chart, trend=trend, throughput=throughput: chart.display is trend
                        and app.screen.query_one("#throughput-row").display is throughput)
            if trend:
                rows = [chart.render_line(y).text for y in range(4)]
                assert [row.split()[0] for row in rows] == ["cap", "tok/s", "waiting", "KV"]
                assert rows[0].rstrip().endswith(" 3") and rows[3].rstrip().endswith(" 88%")
            await pilot.press("3")  # maximized: both
            assert chart.display and app.screen.query_one("#throughput-row").display
        wide = build(scene)
        async with wide.run_test(size=(160, 48)):
            # the wide layout has room for it in every mode
            await until(lambda wide=wide: wide.screen.query_one(TrendChart).display)


# ---- the chart ----------------------------------------------------------------------------------------
def test_trend_rows_come_from_the_model_only():
    app = build("auto")
    rows = trend_rows(app.model, "sim", lambda name: name)
    assert [(r.label, r.value, r.colour) for r in rows] == [
        ("cap", "3", "accent"), ("tok/s", "29.5", "primary"), ("waiting", "1", "warning"), ("KV", "88%", "secondary")]
    assert rows[0].values == (1.0, 2.0, 4.0, 4.0, 3.0) and rows[3].top == 1.0
    assert trend_rows(UiModel(), "sim", lambda name: name) == ()


def test_levels_and_bars():
    assert levels([None, 0.0, 0.01, 0.5, 1.0, 2.0], 1.0) == [0, 0, 1, 4, 8, 8]
    assert levels([1.0, 2.0], 0.0) == [0, 0]
    assert bar_text([1, 8], 4) == "  ▁█"  # fewer values than columns: right-aligned, newest on the right
    assert bar_text([1, 8, 2, 3, 0, 4], 3) == "█▃▄"  # more: each column the highest of its values


@pytest.mark.anyio
async def test_trend_chart_sizes_its_columns_and_redraws_only_when_its_rows_change():
    from textual.app import App

    class Chart(App):
        CSS = "TrendChart { width: 24; }"

        def compose(self):
            yield TrendChart()

    app = Chart()
    async with app.run_test(size=(30, 6)):
        chart = app.query_one(TrendChart)
        chart.rows = [TrendRow("cap", (1.0, 2.0, 4.0), "4", ""), TrendRow("KV", (0.5, None, 1.0), "100%", "", top=1.0)]
        await until(lambda: chart.size.height == 2)  # one row a series
        cap, kv = (chart.render_line(y).text for y in range(2))
        assert len(cap) == len(kv) == 24
        # label column 4 (the widest label and a space), value column 5, the chart the 15 cells between
        assert cap == "cap " + " " * 12 + "▂▄█" + "    4" and kv == "KV  " + " " * 12 + "▄ █" + " 100%"
        drawn = chart._strips
        chart.rows = list(chart.rows)  # the same rows: nothing to draw again
        assert chart._strips is drawn
