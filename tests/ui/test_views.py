"""Panes, focus, help, palette, key remaps, themes and the stream pane's buffering, with fixed scenes."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from textual.command import CommandPalette

from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.keys import MAIN_BINDINGS, PALETTE_NAMES
from cerevisor_tui.ui.screens.help import HelpScreen
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.widgets.stream_view import StreamView
from tests.conftest import until
from tests.ui.conftest import console, engine_of, palette_offers, sim_config
from tests.ui.scenes import NOW, build


@pytest.mark.anyio
async def test_number_keys_maximize_a_pane_esc_restores_and_enter_goes_into_the_stream():
    app = build("mid_run")
    async with app.run_test() as pilot:
        screen = app.screen
        for key, pane in (("1", "#agents-pane"), ("2", "#stream-pane"), ("3", "#load-pane")):
            await pilot.press(key)
            assert screen.maximized is screen.query_one(pane)
            await pilot.press("escape")
            assert screen.maximized is None
        assert app.focused is screen.table
        await pilot.press("enter")
        assert isinstance(app.focused, StreamView)
        await pilot.press("escape")
        assert app.focused is screen.table


@pytest.mark.anyio
async def test_selecting_an_agent_shows_its_whole_transcript_so_far():
    app = build("mid_run")
    async with app.run_test() as pilot:
        view = app.screen.stream_pane.view
        assert "List three risks" in view.text and "Which of them is the hardest" in view.text
        await pilot.press("down")
        assert app.screen.stream_pane.agent == "skeptic"
        assert "What usually goes wrong" in view.text
        assert "List three risks" not in view.text


@pytest.mark.anyio
async def test_stream_follows_only_while_the_reader_is_at_the_bottom():
    app = build("mid_run")
    async with app.run_test(size=(80, 24)):
        screen, view = app.screen, app.screen.stream_pane.view
        await until(lambda: view.following and view.scroll_y == view.max_scroll_y > 0)
        assert view.styles.scrollbar_visibility == "hidden"  # following: no scrollbar to redraw per flush

        def more(n: int) -> None:
            for i in range(n):
                engine_of(app).emit(ev.TokenDelta(NOW, "researcher", 2, f"word{i} " * 8))

        more(5)
        height = view.max_scroll_y
        screen.flush_streams()
        await until(lambda: view.max_scroll_y > height)  # the new text is laid out
        await until(lambda: view.scroll_y == view.max_scroll_y)  # followed the new text

        view.scroll_to(y=0, animate=False, immediate=True)
        await until(lambda: not view.following)
        more(5)
        height = view.max_scroll_y
        screen.flush_streams()
        await until(lambda: view.max_scroll_y > height)
        assert view.scroll_y == 0  # the reader stays where they are
        assert "scrolled up" in screen.stream_pane.border_subtitle
        assert view.styles.scrollbar_visibility == "visible"  # reading back: where am I

        view.scroll_end(animate=False, immediate=True)
        await until(lambda: view.following)
        assert view.styles.scrollbar_visibility == "hidden"


@pytest.mark.anyio
async def test_tokens_are_buffered_not_written_per_token(monkeypatch):
    """5000 token events between two flushes reach the stream view as one append."""
    writes: list[int] = []
    original = StreamView.append
    monkeypatch.setattr(StreamView, "append", lambda self, pieces: (writes.append(len(pieces)), original(self, pieces)))
    app = build("mid_run")
    async with app.run_test() as pilot:
        await pilot.pause()
        writes.clear()
        for i in range(5000):
            engine_of(app).emit(ev.TokenDelta(NOW, "researcher", 2, f"t{i} "))
        assert writes == []  # the subscriber touched no widget
        app.screen.flush_streams()
        assert writes == [1]  # one run of content text, in one write
        assert app.screen.stream_pane.view.text.endswith("t4999 ")


@pytest.mark.anyio
async def test_help_lists_every_binding_with_its_remapped_key(tmp_path):
    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi"}], ui={"keys": {"toggle_mode": "M"}})
    app = console(config, start_engine=False)
    async with app.run_test(size=(120, 50)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        out = Console(width=120, file=io.StringIO(), record=True)
        out.print(app.screen.query_one("#help-body").content)
        text = out.export_text()
        for binding in MAIN_BINDINGS:
            assert " ".join(binding.tooltip.split()[:3]) in text  # every key is explained
        assert "M " in text and "toggle_mode" in text
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


@pytest.mark.anyio
async def test_ui_keys_remap_a_binding_by_its_id(tmp_path):
    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi"}], ui={"keys": {"toggle_mode": "M"}})
    app = console(config, start_engine=False)
    async with app.run_test() as pilot:
        await pilot.press("m")
        assert engine_of(app).scheduler.mode == "parallel"  # m no longer cycles
        await pilot.press("M")
        assert engine_of(app).scheduler.mode == "auto"


@pytest.mark.anyio
async def test_command_palette_offers_every_action_by_name_and_runs_it(tmp_path):
    app = console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi"}]), start_engine=False)
    async with app.run_test() as pilot:
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        assert set(PALETTE_NAMES) == {b.id for b in MAIN_BINDINGS}
        await pilot.press(*"raise")
        await until(lambda: palette_offers(app, PALETTE_NAMES["cap_up"]))
        await pilot.press("enter")
        await until(lambda: isinstance(app.screen, MainScreen))
        assert engine_of(app).scheduler.max_concurrency == 3


@pytest.mark.anyio
async def test_theme_flag_picks_a_packaged_theme_and_stall_colours_come_from_it(tmp_path):
    app = console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi"}]), start_engine=False,
                  theme="cerevisor-contrast")
    async with app.run_test():
        assert app.theme == "cerevisor-contrast"
        assert app.colour("stall-warn") == "#FFD700"
        assert app.colour("stall-critical") == "#FF3030"
        app.theme = "textual-dark"  # a theme without our variables: derived from its warning/error
        await until(lambda: app.colour("stall-warn") != "#FFD700")
        assert app.colour("stall-warn") == app.get_theme("textual-dark").warning.upper()


@pytest.mark.anyio
async def test_the_agents_cursor_moves_by_key_and_mouse_scrolls_into_view_and_shows_its_stream(tmp_path):
    names = [f"agent-{i:02d}" for i in range(40)]
    config = sim_config(tmp_path, agents=[{"name": name, "prompt": "hi"} for name in names])
    app = console(config, start_engine=False)
    async with app.run_test(size=(100, 30)) as pilot:
        screen, table = app.screen, app.screen.table
        pane = screen.query_one("#agents-pane")
        await until(lambda: table.selected_agent == "agent-00" and pane.border_subtitle == "1 of 40")
        await pilot.press("down", "down")
        assert table.selected_agent == "agent-02" and screen.stream_pane.agent == "agent-02"
        assert pane.border_subtitle == "3 of 40"
        await pilot.press("end")
        rows_shown = table.size.height - 1  # under the header
        await until(lambda: table.selected_agent == "agent-39" and pane.border_subtitle == "40 of 40"
                    and table.scroll_offset.y == 40 - rows_shown)  # the last row is the bottom line
        assert table.render_line(table.size.height - 1).text.split()[0] == "agent-39"
        await pilot.press("pageup")
        assert table.cursor_row == 39 - (table.size.height - 2)
        await pilot.press("home")
        await until(lambda: table.selected_agent == "agent-00" and table.scroll_offset.y == 0)
        assert table.render_line(0).text.split()[:2] == ["agent", "wave"]  # the header stays on top
        await pilot.click(table, offset=(2, 3))  # the third row under the header
        assert table.selected_agent == "agent-02"
        await pilot.click(table, offset=(2, 3))  # clicked again: into its stream
        assert app.focused is screen.stream_pane.view


@pytest.mark.anyio
async def test_long_names_and_notes_are_cut_with_an_ellipsis_and_columns_stay_put(tmp_path):
    long_name = "an-agent-with-a-very-long-descriptive-name"
    config = sim_config(tmp_path, agents=[{"name": long_name, "prompt": "hi"}, {"name": "b", "prompt": "hi"}])
    app = console(config, start_engine=False)
    async with app.run_test(size=(80, 24)):
        table = app.screen.table
        app.model.notes["b"] = "a note\nfar\tlonger than the narrow pane has room for, " * 3  # one line all the same
        app.screen.refresh_status()
        width = table.size.width
        await until(lambda: "a note " in table.render_line(2).text)
        lines = [table.render_line(y).text for y in range(3)]  # header, then the two rows
        assert all(len(line) == width for line in lines)
        # a narrow pane cuts long names to 12 cells, in their middle, before it gives up the note
        assert lines[1].startswith(" " + long_name[:6] + "…" + long_name[-5:] + " ")
        assert lines[0].split()[-1] == "note" and lines[2].rstrip().endswith("…")  # the note shows, cut at the edge
        assert "a note " in lines[2] and not any(c in lines[2] for c in "\n\t")
        status_at = lines[0].index("status")
        assert lines[1][status_at:].startswith("pending") and lines[2][status_at:].startswith("pending")


@pytest.mark.anyio
async def test_throughput_bars_scale_to_their_height_and_resample_to_their_width():
    from textual.app import App

    from cerevisor_tui.ui.widgets.throughput_bars import ThroughputBars

    class Bars(App):
        CSS = "ThroughputBars { height: 3; width: 8; }"

        def compose(self):
            yield ThroughputBars()

    app = Bars()
    async with app.run_test(size=(20, 5)):
        bars = app.query_one(ThroughputBars)
        bars.values = [0, 0, 10, 10, 20, 20, 40, 40, 0, 0, 0, 0, 5, 5, 80, 80]  # 16 values, 2 per column
        await until(lambda: bars.render_line(0).text.strip())  # drawn: the peak reaches the top row
        rows = [bars.render_line(y).text for y in range(3)]
        assert all(len(row) == 8 for row in rows)
        # the peak fills all 3 rows; the minimum is a baseline; 40 of 80 reaches halfway
        assert [row[7] for row in rows] == ["█", "█", "█"]
        assert [row[4] for row in rows] == [" ", " ", "▁"]
        assert rows[2][3] == "█" and rows[1][3] == "▄" and rows[0][3] == " "
        bars.values = [5.0] * 16  # all equal: a flat baseline, not a division by zero
        await until(lambda: bars.render_line(2).text == "▁" * 8 and bars.render_line(0).text == " " * 8)


@pytest.mark.anyio
async def test_a_long_transcript_is_wrapped_from_its_end_and_older_lines_as_the_reader_scrolls_up():
    from textual.app import App

    class One(App):
        def colour(self, name):
            return None

        def compose(self):
            yield StreamView()

    app = One()
    async with app.run_test(size=(40, 12)):
        view = app.query_one(StreamView)
        view.append([("content", "\n".join(f"line {i:04d}" for i in range(3000)))])
        shown = lambda: [view.render_line(y).text.strip() for y in range(view.size.height)]  # noqa: E731
        await until(lambda: shown()[-1] == "line 2999" and view.following)
        wrapped = view.virtual_size.height
        assert wrapped < 3000  # only the end is wrapped so far (a line is a row at this width)
        assert view.text.count("\n") == 2999  # all of it is there

        top_seen = []
        for _ in range(40):  # each time the reader reaches the top, older lines appear above it
            rows = view.virtual_size.height
            view.scroll_home(animate=False, immediate=True)
            # (not one pause: on a loaded machine the next scroll then came before the lines were added)
            await until(lambda rows=rows: view.virtual_size.height > rows or shown()[0] == "line 0000")
            top_seen.append(shown()[0])
            if shown()[0] == "line 0000":
                break
        assert shown()[0] == "line 0000" and view.virtual_size.height == 3000
        assert not view.following
        # each time, the line the reader had reached stayed at the top while older lines were added above it,
        # so every visit to the top shows an older line than the one before
        numbers = [int(text.split()[1]) for text in top_seen]
        assert numbers[0] == 3000 - wrapped  # the oldest line wrapped at first, still at the top after growing
        assert len(numbers) > 2 and numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
        view.scroll_end(animate=False, immediate=True)
        await until(lambda: shown()[-1] == "line 2999" and view.following)


def test_the_shipped_themes_are_the_top_level_themes_folder():
    """themes/ beside config.example.toml is what the package loads (its ui/themes links there)."""
    from pathlib import Path

    from cerevisor_tui.ui.theme_files import packaged_themes

    root = Path(__file__).resolve().parents[2] / "themes"
    shipped = sorted(p.stem for p in root.glob("*.toml"))
    assert shipped == ["cerevisor-contrast", "cerevisor-dark", "cerevisor-light"]
    assert sorted(packaged_themes()) == shipped


@pytest.mark.anyio
@pytest.mark.parametrize("width", [13, 41, 80])
async def test_text_added_to_a_long_paragraph_wraps_exactly_as_the_whole_paragraph_would(width):
    """Flushes re-wrap only the last row; the rows must equal a wrap of each whole line, styles included."""
    import random

    from textual.app import App

    class One(App):
        def colour(self, name):
            return None

        def compose(self):
            yield StreamView()

    def cells(strip):  # each cell's character and style: the same rows however their segments are cut
        return [(ch, seg.style) for seg in strip for ch in seg.text]

    rng = random.Random(width)
    words = ["a", "bb", "word", "longerword", "x" * 55, "tab\there", "wide\u4e2d\u6587", "\u4e2d" * 9, "  ", "end."]
    app = One()
    async with app.run_test(size=(width + 1, 30)) as pilot:
        view = app.query_one(StreamView)
        await pilot.pause()
        incremental = 0
        for flush in range(200):
            batch = []
            for _ in range(rng.randint(1, 4)):
                kind = rng.choice(["content", "content", "reasoning", "tool"])
                text = "".join(rng.choice(words) + rng.choice(["", " ", " ", "  "]) for _ in range(rng.randint(1, 3)))
                batch.append((kind, text + ("\n" if rng.random() < 0.03 else "")))
            incremental += view._tail is not None and view._tail[0] == len(view._lines) - 1
            view.append(batch)
            if flush % 10:
                continue
            want = [cells(row) for line in view._lines[view._head:] for row in view._wrap(line, view._wrap_width)]
            got = [cells(row) for row in view._rows]
            assert got == want, [("".join(c for c, _ in g), "".join(c for c, _ in w))
                                 for g, w in zip(got, want, strict=False) if g != w][:3]
        assert incremental > 100  # most flushes took the last-row path
