"""The load pane: what each server reports, the aggregate throughput sparkline, and the KV estimate slot."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Container, Vertical
from textual.widgets import Sparkline, Static

from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.ui.format import fmt_count, fmt_number, fmt_percent, fmt_rate
from cerevisor_tui.ui.model import UiModel


class LoadPane(Vertical):
    """Server numbers from ServerSample events (`-` until a server reports one), throughput over time.

    `#kv-estimate` is the slot for the capacity estimate (conversations that fit, zone); it shows `-`
    until something calls `set_kv_estimate`.
    """

    ALLOW_MAXIMIZE = True
    DEFAULT_CSS = """
    LoadPane {
        height: auto;
        #servers { height: auto; }
        #throughput-row { height: 1; layout: horizontal; }
        #throughput-label { height: 1; width: auto; color: $text-muted; padding-right: 2; }
        #throughput { height: 1; width: 1fr; }
        #kv-estimate { height: auto; color: $text-muted; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._servers_shown: object = None
        self._samples_shown = -1
        self._label_shown = ""

    def compose(self) -> ComposeResult:
        yield Static(id="servers")
        with Container(id="throughput-row"):
            yield Static(id="throughput-label")
            yield Sparkline([], id="throughput", summary_function=max)
        yield Static(Text("KV estimate  -"), id="kv-estimate")

    def invalidate(self) -> None:
        """Redraw at the next sync (the theme changed)."""
        self._servers_shown = None
        self._label_shown = ""

    def set_kv_estimate(self, text: str | Text) -> None:
        """Fill the KV estimate slot (the capacity estimate: conversations that fit, zone)."""
        self.query_one("#kv-estimate", Static).update(text)

    def sync(self, engine: Engine, model: UiModel, now: float) -> None:
        rows = []
        for name in engine.endpoints:
            sv = model.servers.get(name)
            slots = f"{sv.slots_busy}/{sv.slots_total}" if sv and sv.slots_total else ""
            rows.append((name, *((sv.running, sv.waiting, sv.kv_cache_usage, sv.prefix_hit_rate, slots, sv.detail)
                                  if sv else (None, None, None, None, "", ""))))
        rows_key = tuple(rows)
        if rows_key != self._servers_shown:
            self._servers_shown = rows_key
            text = Text(no_wrap=True, overflow="ellipsis")
            muted = self.app.colour("text-muted")  # type: ignore[attr-defined]
            for i, (name, running, waiting, kv, prefix, slots, detail) in enumerate(rows):
                if i:
                    text.append("\n")
                text.append(f"{name} ", style="bold")
                text.append("running ", style=muted)
                text.append(f"{fmt_number(running)}  ")
                text.append("waiting ", style=muted)
                text.append(f"{fmt_number(waiting)}  ")
                text.append("KV ", style=muted)
                text.append(f"{fmt_percent(kv)}  ")
                text.append("prefix hit ", style=muted)
                text.append(fmt_percent(prefix))
                if slots:
                    text.append("  slots ", style=muted)
                    text.append(slots)
                if detail:
                    text.append(f"  {detail}", style=muted)
            self.query_one("#servers", Static).update(text)
        if model.samples_taken != self._samples_shown:
            self._samples_shown = model.samples_taken
            # a fixed time window, oldest on the left, so the line does not stretch while it fills
            window = model.throughput.maxlen or len(model.throughput)
            self.query_one("#throughput", Sparkline).data = [0.0] * (window - len(model.throughput)) + list(
                model.throughput)
        peak = max(model.throughput, default=0.0)
        label = f"{fmt_rate(model.tokens_per_s(now))} tok/s  peak {fmt_rate(peak)}  total {fmt_count(model.tokens_total)}"
        if label != self._label_shown:
            self._label_shown = label
            self.query_one("#throughput-label", Static).update(label)  # width auto: the sparkline takes the rest
