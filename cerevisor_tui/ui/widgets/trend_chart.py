"""A strip chart of a few series over the run, one row each: label, eight-level bars, current value.

The load pane draws an endpoint's cap, output tokens/s, queue and KV-cache use with it, so the
operator sees auto mode at work (the cap stepping up while throughput grows, down when requests
wait). It is a line-API widget like ThroughputBars: each row is one Strip of three segments, made
when the rows or the width change (once per server sample) and cached in between: it is redrawn in the
event loop every key press waits on, where a plot widget (textual-plotext) costs many times as much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

BARS = " ▁▂▃▄▅▆▇█"
"""Index 0 (nothing) to 8 (full cell)."""


@dataclass(frozen=True)
class TrendRow:
    """One series as drawn: oldest value first, None where it is not known."""

    label: str
    values: tuple[float | None, ...]
    value: str  # the current value, as the operator reads it
    colour: str  # a Rich colour for the bars ("" for the widget's own)
    top: float | None = None  # the top of the scale; None: the row's own maximum


def levels(values: Sequence[float | None], top: float) -> list[int]:
    """Each value in eighths of a cell, 0 to 8, scaled to `top`: zero and unknown are 0 (blank), anything above
    zero at least 1 (▁)."""
    if top <= 0:
        return [0] * len(values)
    scale = 8 / top
    return [0 if v is None or v <= 0 else (8 if v >= top else max(1, round(v * scale))) for v in values]


def spans(n: int, width: int) -> list[tuple[int, int]]:
    """Which of `n` values each of `width` columns stands for, when there are more values than columns."""
    return [(c * n // width, max(c * n // width + 1, (c + 1) * n // width)) for c in range(width)]


def bar_text(eighths: list[int], width: int, spans_: list[tuple[int, int]] | None = None) -> str:
    """`eighths` on `width` columns, newest on the right: one a column while they fit (right-aligned, so the
    chart grows from the right as the run goes on), else each column the highest of those it stands for (a
    spike is never averaged away)."""
    n = len(eighths)
    if width <= 0:
        return ""
    if n <= width:
        return " " * (width - n) + "".join([BARS[e] for e in eighths])
    return "".join([BARS[max(eighths[a:b])] for a, b in spans_ or spans(n, width)])


class TrendChart(Widget):
    """`rows`, one series a row; the label column and the value column size to their widest text."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"trend-chart--label", "trend-chart--value"}
    DEFAULT_CSS = """
    TrendChart {
        height: auto;
    }
    TrendChart > .trend-chart--label {
        color: $text-muted;
    }
    TrendChart > .trend-chart--value {
        text-style: bold;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._rows: tuple[TrendRow, ...] = ()
        self._strips: list[Strip] | None = None
        self._width = -1
        self._styles: tuple[Style, Style, Style] | None = None  # base, label, value: made once per theme

    @property
    def rows(self) -> tuple[TrendRow, ...]:
        return self._rows

    @rows.setter
    def rows(self, rows: Sequence[TrendRow]) -> None:
        rows = tuple(rows)
        if rows == self._rows:
            return
        relayout = len(rows) != len(self._rows)
        self._rows = rows
        self._strips = None
        self.refresh(layout=relayout)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._rows)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._strips = None
        self._styles = None

    def on_resize(self) -> None:
        self._strips = None

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._strips is None or self._width != width:
            self._strips, self._width = self._draw(width), width
        return self._strips[y] if 0 <= y < len(self._strips) else Strip.blank(width, self.rich_style)

    def _draw(self, width: int) -> list[Strip]:
        if self._styles is None:
            base = self.rich_style
            self._styles = (base, base + self.get_component_rich_style("trend-chart--label", partial=True),
                            base + self.get_component_rich_style("trend-chart--value", partial=True))
        base, label_style, value_style = self._styles
        label_w = max((len(r.label) for r in self._rows), default=0) + 1
        value_w = max((len(r.value) for r in self._rows), default=0) + 1
        chart_w = max(0, width - label_w - value_w)
        cuts: dict[int, list[tuple[int, int]]] = {}  # the rows of one trend have as many points each
        strips = []
        for row in self._rows:
            n = len(row.values)
            if n > chart_w and n not in cuts:
                cuts[n] = spans(n, chart_w)
            known = [v for v in row.values if v is not None]
            top = row.top if row.top is not None else max(known, default=0.0)
            segments = [Segment(row.label.ljust(label_w)[:width], label_style),
                        Segment(bar_text(levels(row.values, top), chart_w, cuts.get(n)),
                                base + Style(color=row.colour) if row.colour else base),
                        Segment(row.value.rjust(value_w), value_style)]
            strips.append(Strip(segments).crop_extend(0, width, base))
        return strips
