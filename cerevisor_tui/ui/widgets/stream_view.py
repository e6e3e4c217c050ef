"""The stream pane's text view: an agent's transcript, wrapped, styled by kind, appended in place.

A line-API widget: new text re-wraps only the last row it touches, so a flush costs what it adds, not
what the transcript holds. Greedy wrapping places a row's break only where a word does not fit, and text
added at the end only lengthens the last word, so every row before the last stays as it was: the last
row's text and the new text are wrapped, and the rows before are kept (an answer with no newline is one
paragraph: re-wrapped whole, each flush would cost more than the last). It follows the end only while the
reader is at the bottom.

A whole transcript (switching agents, a new width) is wrapped from its end, a few screens' worth; the
older lines are wrapped as the reader scrolls up to them: wrapping all of a long transcript at once would
hold up the frame that answers the key press that selected the agent.
"""

from __future__ import annotations

import re

from rich.style import Style
from rich.text import Text
from textual.cache import LRUCache
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from cerevisor_tui.ui.model import ALERT, CONTENT, META, REASONING, TOOL, USER

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f]")
MAX_LINES = 20_000
WRAP_SCREENS = 4  # a whole transcript is wrapped from its end until this many screens of rows are ready
WRAP_MIN_ROWS = 200


def _clean(text: str) -> str:
    return _CONTROL.sub("", text.expandtabs(4))


class StreamView(ScrollView, can_focus=True):
    """Styled, wrapped, append-only text with follow-at-bottom scrolling."""

    DEFAULT_CSS = """
    StreamView {
        background: $surface;
        color: $foreground;
        overflow-x: hidden;
        overflow-y: auto;
        scrollbar-size-vertical: 1;
        /* Drawn only while the reader is scrolled up: following the end, the bar would move on every
           flush, and a scrollbar is drawn whole for each line of it that changes. The gutter stays, so
           showing it never re-wraps the text. */
        scrollbar-visibility: hidden;
        &.-reading {
            scrollbar-visibility: visible;
        }
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._lines: list[list[tuple[str, str]]] = [[]]
        self._head = 0  # lines before this one are not wrapped yet (the reader has not scrolled up to them)
        self._row_counts: list[int] = []  # rows of each wrapped line, from line `_head` on
        self._rows: list[Strip] = []
        # Where the last wrapped line's last row starts: (line, piece, offset in the piece, rows before it),
        # None when unknown (that line is then wrapped whole).
        self._tail: tuple[int, int, int, int] | None = None
        self._growing = False
        self._wrap_width = 0
        self._styles: dict[str, Style] = {}
        self._styled: LRUCache[int, Strip] = LRUCache(1024)
        self._base: Style | None = None  # self.rich_style (it walks the ancestors) until the styles change
        self._styles_of: dict[str, str] | None = None  # the theme variables `_styles` were made from
        self.following = True
        """Whether new text scrolls the view: true until the reader scrolls up, again once at the bottom."""

    # ---- content ----------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The plain text shown (for tests and copying)."""
        return "\n".join("".join(t for _, t in line) for line in self._lines)

    def clear(self) -> None:
        self._lines = [[]]
        self._head = 0
        self._row_counts = []
        self._rows = []
        self._tail = None
        self._styled.clear()
        self.virtual_size = Size(self.scrollable_content_region.width, 0)
        self.scroll_to(0, 0, animate=False, immediate=True)
        self.following = True
        self.refresh()

    def append(self, pieces: list[tuple[str, str]]) -> None:
        """Add text at the end; `pieces` are (kind, text) as the model keeps them."""
        if not pieces:
            return
        first_touched = len(self._lines) - 1
        for kind, text in pieces:
            parts = _clean(text).split("\n")
            if parts[0]:
                self._lines[-1].append((kind, parts[0]))
            for part in parts[1:]:
                self._lines.append([(kind, part)] if part else [])
        if len(self._lines) > MAX_LINES:
            drop = len(self._lines) - MAX_LINES
            unwrapped = min(drop, self._head)  # the oldest lines go first: unwrapped ones need no rows dropped
            self._head -= unwrapped
            wrapped = drop - unwrapped
            dropped_rows = sum(self._row_counts[:wrapped])
            del self._lines[:drop], self._row_counts[:wrapped], self._rows[:dropped_rows]
            self._styled.clear()  # row indices moved
            self._tail = None
            first_touched = max(0, first_touched - drop)
        self._rewrap_from(first_touched)

    # ---- layout -----------------------------------------------------------------------------------
    def _style_for(self, kind: str) -> Style:
        if not self._styles:
            colour = self.app.colour  # type: ignore[attr-defined]
            self._styles = {
                CONTENT: Style(),
                REASONING: Style.parse(f"italic {colour('stream-reasoning') or 'grey50'}"),
                TOOL: Style.parse(colour("secondary") or "magenta"),
                USER: Style.parse(f"bold {colour('primary') or 'cyan'}"),
                META: Style.parse(f"bold {colour('accent') or 'yellow'}"),
                ALERT: Style.parse(f"bold {colour('error') or 'red'}"),
            }
        return self._styles.get(kind, Style())

    def _wrap(self, line: list[tuple[str, str]], width: int) -> list[Strip]:
        return self._wrap_pieces(line, 0, 0, width)[0]

    def _wrap_pieces(self, line: list[tuple[str, str]], piece: int, offset: int,
                     width: int) -> tuple[list[Strip], int | None]:
        """Wrap `line` from its piece `piece`, char `offset`; also where its last row starts, in chars of what
        was wrapped, if wrapping may start there again: at a word's start. Not inside a word folded across
        rows (Rich folds a word with its trailing spaces, and wrapped afresh they would end the row instead),
        nor when the row is not its text exactly (trailing spaces past the width are cut): then None."""
        if piece >= len(line):
            return [Strip.blank(0)], None
        text = Text(no_wrap=False, overflow="fold", end="")
        kind, part = line[piece]
        text.append(part[offset:], self._style_for(kind))
        for kind, part in line[piece + 1:]:
            text.append(part, self._style_for(kind))
        console = self.app.console
        wrapped = text.wrap(console, width)
        plain, last = text.plain, wrapped[-1].plain
        start = len(plain) - len(last)
        restart = plain.endswith(last) and (start == 0 or (plain[start - 1].isspace() and not last[:1].isspace()))
        return [Strip(list(row.render(console)), row.cell_len) for row in wrapped], start if restart else None

    @staticmethod
    def _tail_at(index: int, line: list[tuple[str, str]], piece: int, offset: int, start: int,
                 above: int) -> tuple[int, int, int, int]:
        """The tail of line `index` as kept in `_tail`: `start` chars on from (piece, offset)."""
        for k in range(piece, len(line)):
            size = len(line[k][1]) - offset
            if start < size or k == len(line) - 1:
                return index, k, offset + start, above
            start -= size
            offset = 0
        return index, len(line), 0, above

    def _rewrap_from(self, first: int) -> None:
        """Wrap the lines from `first` on again (all of them when the width changed); follow the end if on."""
        width = self.scrollable_content_region.width
        if width <= 0:  # not laid out yet: wrapped at the first resize
            self._wrap_width = 0
            return
        if width != self._wrap_width:
            self._wrap_width = width
            first = 0
        if first < self._head or not self._row_counts or len(self._lines) - first > self._rows_wanted():
            # the whole transcript, lines not wrapped yet, or more new lines than the screens kept: from the end
            self._wrap_tail(width)
            return
        first = min(first - self._head, len(self._row_counts))  # as an index into _row_counts
        keep_rows = len(self._rows) - sum(self._row_counts[first:])
        rows_before = len(self._rows)
        tail = self._tail
        if tail is not None and first < len(self._row_counts) and tail[0] == self._head + first:
            _, piece, offset, above = tail  # that line's first `above` rows stay as they are
        else:
            piece = offset = above = 0
        keep_rows += above
        del self._rows[keep_rows:], self._row_counts[first:]
        self._tail = None
        last = len(self._lines) - 1
        for index in range(self._head + first, last + 1):
            line = self._lines[index]
            rows, start = self._wrap_pieces(line, piece, offset, width)
            self._rows.extend(rows)
            self._row_counts.append(above + len(rows))
            if index == last:
                if start is not None:
                    self._tail = self._tail_at(index, line, piece, offset, start, above + len(rows) - 1)
                elif tail is not None and tail[0] == index:
                    self._tail = tail  # its last row is no place to start again: the earlier one still is
            piece = offset = above = 0
        for index in range(keep_rows, max(rows_before, len(self._rows))):
            self._styled.discard(index)
        if len(self._rows) == rows_before:
            self.refresh_lines(keep_rows, len(self._rows) - keep_rows)  # the usual flush: the last row grew
            return
        self._grown()

    def _wrap_back(self, width: int, rows_wanted: int) -> tuple[list[Strip], list[int]]:
        """Wrap unwrapped lines backwards from `_head` until `rows_wanted` rows are ready; moves `_head`."""
        chunks: list[list[Strip]] = []
        total = 0
        while self._head > 0 and total < rows_wanted:
            self._head -= 1
            rows = self._wrap(self._lines[self._head], width)
            chunks.append(rows)
            total += len(rows)
        chunks.reverse()
        return [row for rows in chunks for row in rows], [len(rows) for rows in chunks]

    def _wrap_tail(self, width: int) -> None:
        self._head = len(self._lines)
        self._tail = None  # (the last line is wrapped whole at the next flush, and its tail known again)
        self._rows, self._row_counts = self._wrap_back(width, self._rows_wanted())
        self._styled.clear()
        self._grown()

    def _rows_wanted(self) -> int:
        return max(WRAP_MIN_ROWS, WRAP_SCREENS * self.size.height)

    def _grow_head(self) -> None:
        """The reader scrolled up near the oldest wrapped row: wrap more of what is above it, same view."""
        self._growing = False
        if not self._head or not self._wrap_width:
            return
        rows, counts = self._wrap_back(self._wrap_width, self._rows_wanted())
        self._rows[:0] = rows
        self._row_counts[:0] = counts
        self._styled.clear()
        self.virtual_size = Size(self._wrap_width, len(self._rows))
        self.scroll_to(y=self.scroll_y + len(rows), animate=False, immediate=True)  # the same text stays in view
        self.refresh()

    def _grown(self) -> None:
        """The rows changed in number: a new virtual size, and the end followed if the reader is there."""
        self.virtual_size = Size(self._wrap_width, len(self._rows))
        self.refresh()
        if self.following and not self.is_vertical_scrollbar_grabbed:
            # At once: a line-API view's virtual size is set above, not laid out, so the end is usually known
            # now (deferred until after the refresh, every flush would draw the view twice, once not yet
            # scrolled).
            # Not before the first layout: then after the refresh, when the view's height is known.
            self.scroll_end(animate=False, x_axis=False, immediate=True)
            if self.scroll_y < len(self._rows) - self.scrollable_content_region.height:
                self.scroll_end(animate=False, x_axis=False)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        # Any move, by the reader or by following, decides: at the bottom follows, above it reads.
        self.following = new_value >= self.max_scroll_y
        if self.has_class("-reading") == self.following:
            self.set_class(not self.following, "-reading")
        if self._head and not self._growing and new_value < self.size.height:
            self._growing = True
            self.call_after_refresh(self._grow_head)

    def on_resize(self) -> None:
        if self.scrollable_content_region.width != self._wrap_width:
            self._rewrap_from(0)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._base = None
        self._styled.clear()
        colours = self.app.theme_variables if self.is_mounted else None
        if colours is not self._styles_of:  # a new theme: the kinds' colours, so the wrapped rows, change
            self._styles_of = colours
            self._styles = {}
            if self.is_mounted and self._rows:
                self._rewrap_from(0)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.scrollable_content_region.width
        base = self._base
        if base is None:
            base = self._base = self.rich_style
        if index >= len(self._rows):
            return Strip.blank(width, base)
        strip = self._styled.get(index)  # overflow-x is hidden: scroll_x is 0, and a resize clears the cache
        if strip is None:
            strip = self._styled[index] = self._rows[index].apply_style(base).crop_extend(scroll_x, scroll_x + width,
                                                                                         base)
        return strip
