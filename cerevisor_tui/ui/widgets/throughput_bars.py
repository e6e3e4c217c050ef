"""A one-line bar chart of recent values: the load pane's aggregate throughput over time.

Textual's Sparkline looks the same but buckets with Fractions and blends a colour per cell, twice a
second, in the same loop as every key press. This one resamples
with integers, has eight colour steps made once per theme, and draws one Strip of runs, cached until the
values or the width change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.strip import Strip
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


class ThroughputBars(Widget):
    """`values` drawn as bars, newest on the right, each column the max of the values it stands for."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"throughput-bars--max-color", "throughput-bars--min-color"}
    DEFAULT_CSS = """
    ThroughputBars {
        height: 1;
    }
    ThroughputBars > .throughput-bars--max-color {
        color: $primary;
    }
    ThroughputBars > .throughput-bars--min-color {
        color: $primary 30%;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._values: list[float] = []
        self._rows: list[Strip] | None = None  # top row first
        self._steps: list[Style] | None = None

    @property
    def values(self) -> list[float]:
        return self._values

    @values.setter
    def values(self, values: Sequence[float]) -> None:
        self._values = list(values)
        self._rows = None
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._steps = None
        self._rows = None

    def on_resize(self) -> None:
        self._rows = None

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        if self._rows is None or len(self._rows) != height or (self._rows and self._rows[0].cell_length != width):
            self._rows = self._draw(width, height)
        return self._rows[y] if 0 <= y < len(self._rows) else Strip.blank(width, self.rich_style)

    def _colour(self, component: str) -> Color:
        colour = self.get_component_rich_style(component).color
        return Color.from_rich_color(colour) if colour is not None else Color.parse("white")

    def _draw(self, width: int, height: int) -> list[Strip]:
        base = self.rich_style
        values = self._values
        if not values or width <= 0 or height <= 0:
            return [Strip.blank(width, base) for _ in range(height)]
        if self._steps is None:
            low, high = (self._colour(f"throughput-bars--{end}-color") for end in ("min", "max"))
            self._steps = [base + Style(color=low.blend(high, i / (len(BARS) - 1)).rich_color)
                           for i in range(len(BARS))]
        steps = self._steps
        n = len(values)
        # column c stands for values[c*n//width : (c+1)*n//width] (at least one)
        columns = [max(values[c * n // width:max(c * n // width + 1, (c + 1) * n // width)]) for c in range(width)]
        bottom, span = min(columns), max(columns) - min(columns)
        ratios = [(value - bottom) / span if span > 0 else 0.0 for value in columns]
        eighths = height * 8
        fills = [max(1, round(ratio * eighths)) for ratio in ratios]  # the lowest still shows as a baseline
        colour = [steps[round(ratio * (len(BARS) - 1))] for ratio in ratios]
        rows = []
        for row in range(height - 1, -1, -1):  # from the top
            segments: list[Segment] = []
            run: list[str] = []
            run_style: Style | None = None
            for fill, style in zip(fills, colour, strict=True):
                cell = min(8, fill - row * 8)
                char, style = (BARS[cell - 1], style) if cell > 0 else (" ", base)
                if style is not run_style and run:
                    segments.append(Segment("".join(run), run_style))
                    run = []
                run_style = style
                run.append(char)
            segments.append(Segment("".join(run), run_style))
            rows.append(Strip(segments, width))
        return rows
