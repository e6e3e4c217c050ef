"""The agents pane: one DataTable row per agent, keyed by its name, updated cell by cell when it changes."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widgets import DataTable

from cerevisor_tui.engine.engine import AgentState, Engine
from cerevisor_tui.ui.format import (
    ACTIVE,
    CRITICAL,
    NORMAL,
    STATUS_LABELS,
    WARN,
    countdown,
    fmt_clock,
    fmt_count,
    fmt_rate,
    fmt_seconds,
    live_rate,
)
from cerevisor_tui.ui.model import UiModel

COLUMNS: tuple[tuple[str, str, int | None], ...] = (
    ("agent", "agent", None),
    ("wave", "wave", 4),
    ("status", "status", 9),
    ("turn", "turn", 4),
    ("ttft", "ttft", 6),
    ("rate", "tok/s", 5),
    ("tokens", "tokens", 6),
    ("stall", "stall in", 11),
    ("note", "note", 48),
)
"""(key, label, width): fixed widths, so a changing number never makes the columns jump."""


@dataclass(frozen=True, slots=True)
class AgentRow:
    """What one row shows, as plain text plus the colour roles; compared to skip unchanged cells."""

    agent: str
    wave: str
    status: str
    turn: str
    ttft: str
    rate: str
    tokens: str
    stall: str
    note: str
    status_role: str  # a theme colour name for the status cell
    level: str  # stall level of the row: NORMAL | WARN | CRITICAL


def agent_row(st: AgentState, warn_at: tuple[float, ...], note: str, now: float,
              keepalive_at: float | None = None) -> AgentRow:
    """`keepalive_at`: when the agent's stream last carried a keep-alive (bytes without a token)."""
    clock = countdown(st, warn_at, now)
    level = clock.level if clock else NORMAL
    status = st.status
    role = {
        "streaming": "success", "prefill": "primary", "waiting": "warning", "stalling": "stall-warn",
        "retrying": "warning", "completed": "success", "failed": "error", "killed": "error",
        "skipped": "text-muted", "cancelled": "text-muted", "queued": "text-muted", "pending": "text-muted",
    }.get(status, "foreground")
    if level == CRITICAL:
        role = "stall-critical"
    elif level == WARN:
        role = "stall-warn"
    if status in ("failed", "killed", "skipped", "cancelled") and st.error:
        note = st.error
    elif st.current is not None and keepalive_at is not None and keepalive_at > st.current.last_alive + 1.0:
        # alive but silent: the server (or a proxy) keeps the stream open while no token comes
        quiet = f"keep-alives, no token for {fmt_clock(now - st.current.last_alive)}"
        note = f"{note} · {quiet}" if note else quiet
    turn = f"{st.turn}/{st.turns}" if st.turn else f"-/{st.turns}"
    rate = live_rate(st, now) if status in ACTIVE or status == "completed" else st.output_tokens_per_s
    return AgentRow(
        agent=st.name, wave=str(st.wave + 1), status=STATUS_LABELS.get(status, status), turn=turn,
        ttft=fmt_seconds(st.ttft_s), rate=fmt_rate(rate), tokens=fmt_count(st.tokens) if st.tokens else "-",
        stall=clock.label if clock else "", note=note, status_role=role, level=level,
    )


class AgentTable(DataTable):
    """Rows keyed by agent name; `sync` writes only the cells whose text or colour changed."""

    DEFAULT_CSS = """
    AgentTable {
        height: 1fr;
        background: $surface;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False, cursor_foreground_priority="renderable")
        self._rows_shown: dict[str, AgentRow] = {}
        self._cells_shown: dict[str, dict[str, tuple[str, str]]] = {}
        self._colours: dict[str, str] = {}

    def build(self, engine: Engine) -> None:
        """Columns and one row per agent, in wave order."""
        name_width = max([5, *(len(name) for name in engine.agents)])
        for key, label, width in COLUMNS:
            self.add_column(label, key=key, width=min(name_width, 24) if width is None else width)
        for name in engine.agents:
            self.add_row(*([""] * len(COLUMNS)), key=name)

    def refresh_colours(self) -> None:
        """Forget drawn cells so the next sync repaints them in the current theme's colours."""
        self._colours = {}
        self._rows_shown = {}
        self._cells_shown = {}

    def _colour(self, role: str) -> str:
        if role not in self._colours:
            self._colours[role] = self.app.colour(role)  # type: ignore[attr-defined]
        return self._colours[role]

    def sync(self, engine: Engine, model: UiModel, now: float) -> int:
        """Bring every row up to date; returns how many cells were written."""
        written = 0
        for name, st in engine.agents.items():
            note = model.notes.get(name, "")
            if not note and name in engine.completed_before and st.status == "completed":
                note = "answer reused from the earlier run"  # never sent again: its figures are in the report
            row = agent_row(st, engine.policies[st.endpoint].warn_at, note, now, model.keepalive_at.get(name))
            if self._rows_shown.get(name) == row:
                continue
            self._rows_shown[name] = row
            shown = self._cells_shown.setdefault(name, {})
            for key, (text, style, justify) in self._cells(row).items():
                if shown.get(key) != (text, style):
                    shown[key] = (text, style)
                    self.update_cell(name, key, Text(text, style=style, justify=justify))
                    written += 1
        return written

    def _cells(self, row: AgentRow) -> dict[str, tuple[str, str, str]]:
        """Each cell as (text, style, justify)."""
        level_style = ""
        if row.level == WARN:
            level_style = f"bold {self._colour('stall-warn')}"
        elif row.level == CRITICAL:
            level_style = f"bold {self._colour('stall-critical')}"
        status_style = self._colour(row.status_role)
        return {
            "agent": (row.agent, level_style, "left"),
            "wave": (row.wave, "", "right"),
            "status": (row.status, status_style, "left"),
            "turn": (row.turn, "", "right"),
            "ttft": (row.ttft, "", "right"),
            "rate": (row.rate, "", "right"),
            "tokens": (row.tokens, "", "right"),
            "stall": (row.stall, level_style or self._colour("text-muted"), "right"),
            "note": (row.note, status_style if row.status in ("killed", "failed") else "", "left"),
        }

    @property
    def selected_agent(self) -> str | None:
        if not self.row_count:
            return None
        try:
            key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        except Exception:
            return None
        return key.value
