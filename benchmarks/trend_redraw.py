"""What one redraw of the load pane's trend costs: our line-API strip chart against a textual-plotext plot.

The trend (cap, output tokens/s, requests waiting, KV use of one endpoint, 240 points each) is redrawn
once per server sample, in the event loop every key press waits on (docs/performance.md: key to screen p95 < 100 ms
at 256 agents). Each widget runs in a headless app at --width columns; a redraw is a new point set as
the load pane sets it, then the widget's lines rendered as the compositor asks for them. Median and p95
of --rounds redraws, interleaved. ThroughputBars (the throughput sparkline, 1 row) is there for scale.

textual-plotext is not a dependency; install it beside the venv to compare:

    pip install --target /tmp/plotext textual-plotext plotext
    PYTHONPATH=/tmp/plotext python benchmarks/trend_redraw.py
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections.abc import Callable

from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widget import Widget

from cerevisor_tui.ui.widgets.throughput_bars import ThroughputBars
from cerevisor_tui.ui.widgets.trend_chart import TrendChart, TrendRow

try:
    from textual_plotext import PlotextPlot
except ImportError:  # not a dependency: measured only where installed
    PlotextPlot = None  # type: ignore[assignment,misc]

SERIES = ("cap", "tok/s", "waiting", "KV")


def series(points: int, shift: int) -> dict[str, list[float]]:
    """An auto run's shape: the cap doubling then settling, throughput following it, a queue burst, KV filling."""
    xs = range(shift, shift + points)
    return {
        "cap": [float(min(32, 2 ** (i // 20))) for i in xs],
        "tok/s": [20_000 * (1 - math.exp(-i / 60)) + 300 * math.sin(i / 3) for i in xs],
        "waiting": [max(0.0, 12 * math.sin(i / 15)) for i in xs],
        "KV": [min(1.0, i / 200) for i in xs],
    }


class Bench(App[None]):
    def __init__(self, height: int) -> None:
        super().__init__()
        self.chart_height = height

    def compose(self) -> ComposeResult:
        yield TrendChart(id="trend")
        yield ThroughputBars(id="bars")
        if PlotextPlot is not None:
            yield PlotextPlot(id="plot")

    def on_mount(self) -> None:
        self.query_one("#bars").styles.height = 1
        if PlotextPlot is not None:
            self.query_one("#plot").styles.height = self.chart_height


def redraw_trend(chart: TrendChart, data: dict[str, list[float]]) -> None:
    chart.rows = [TrendRow(name, tuple(values), f"{values[-1]:.0f}", "#4EBF71", top=1.0 if name == "KV" else None)
                  for name, values in data.items()]


def redraw_bars(bars: ThroughputBars, data: dict[str, list[float]]) -> None:
    bars.values = data["tok/s"]


def redraw_plot(plot: Widget, data: dict[str, list[float]]) -> None:
    plt = plot.plt  # type: ignore[attr-defined]
    plt.clear_data()
    for name, values in data.items():
        plt.plot(values, label=name)
    plot.refresh()


def timed(widget: Widget, update: Callable[[Widget, dict[str, list[float]]], None], data: dict[str, list[float]]) -> float:
    """Seconds for one redraw: the new data set, then every line rendered as the compositor asks for them."""
    start = time.perf_counter()
    update(widget, data)
    widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return time.perf_counter() - start


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    app = Bench(args.plot_height)
    times: dict[str, list[float]] = {}
    async with app.run_test(size=(args.width, 4 + 1 + args.plot_height)) as pilot:
        await pilot.pause()
        cases: list[tuple[str, Widget, Callable]] = [
            ("TrendChart, 4 rows (line API)", app.query_one("#trend"), redraw_trend),
            ("ThroughputBars, 1 row (line API)", app.query_one("#bars"), redraw_bars),
        ]
        if PlotextPlot is not None:
            cases.append((f"PlotextPlot, {args.plot_height} rows (textual-plotext)", app.query_one("#plot"),
                          redraw_plot))
        for _name, widget, update in cases:  # warm caches, fonts of the theme, plotext's first build
            update(widget, series(args.points, 0))
            await pilot.pause()
        for i in range(args.rounds):
            data = series(args.points, i + 1)
            for name, widget, update in cases:
                times.setdefault(name, []).append(timed(widget, update, data))
            await pilot.pause()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=160, help="columns (default 160)")
    parser.add_argument("--points", type=int, default=240, help="points per series (default 240)")
    parser.add_argument("--plot-height", type=int, default=12,
                        help="rows of the plotext plot: fewer leave its 4 lines unreadable (default 12)")
    parser.add_argument("--rounds", type=int, default=60, help="redraws of each, interleaved (default 60)")
    args = parser.parse_args()
    times = asyncio.run(measure(args))
    print(f"one redraw at {args.width} columns, {args.points} points a series, {args.rounds} rounds")
    print(f"{'widget':44} {'median ms':>10} {'p95 ms':>8}")
    for name, values in times.items():
        values.sort()
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        print(f"{name:44} {statistics.median(values) * 1000:10.2f} {p95 * 1000:8.2f}")
    if PlotextPlot is None:
        print("textual-plotext is not installed: see this script's docstring to compare against it")


if __name__ == "__main__":
    main()
