"""The agents pane: one line per agent, drawn through Textual's line API from a cached strip per row; sorted
(wave order, nearest deadline, status, tokens/s) and filtered (by name or status) at its status refresh.

Not a `DataTable`: there every cell update invalidates its row caches, so with hundreds of busy rows each
frame renders every visible cell through Rich again. Here a row is turned into one `Strip` of plain
segments only when what it shows changes, and only the lines of changed visible rows are refreshed.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass
from typing import Literal

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from cerevisor_tui.ui.format import (
    CRITICAL,
    NORMAL,
    STATUS_LOOK,
    WARN,
    Countdown,
    countdown,
    fmt_clock,
    fmt_count,
    fmt_rate,
    fmt_seconds,
    live_rate,
    prefill_status,
    session_status,
    status_label,
    tool_countdown,
    tool_status,
)
from cerevisor_tui.ui.mirror import ACTIVE, FINAL, AgentView, RunMirror

TURN_WIDTH, TURN_WIDTH_SESSIONS = 4, 7
"""The turn column, and its width once a gateway session shows: a session's cell says which request it is on
(`req 12`)."""

COLUMNS: tuple[tuple[str, str, int | None], ...] = (
    ("agent", "agent", None),
    ("wave", "wave", 4),
    ("status", "status", 9),
    ("turn", "turn", TURN_WIDTH),
    ("ttft", "ttft", 6),
    ("rate", "tok/s", 5),
    ("tokens", "tokens", 6),
    ("stall", "stall in", 11),
    ("note", "note", None),
)
"""(key, label, width): fixed widths, so a changing number never makes the columns jump. The agent
column fits the longest name (up to 24 cells); the note takes what is left of the pane's width."""

STATUS_WIDTH, STATUS_WIDTH_MAX = 9, 20
"""The status column is 9 cells, or as wide as the longest status a row shows now (`needs approval`,
`tool: NAME 3.2s`), up to 20 where the pane has room: what it does not use goes to the note."""
STATUS_WANTED = {"approval": len("needs approval"), "tool": STATUS_WIDTH_MAX}

SESSION_WAVE = "gw"
"""A gateway session's wave cell: it belongs to no wave, and its row comes after the workflow's agents."""

STATUS_COLUMN = [key for key, _, _ in COLUMNS].index("status")
RIGHT = frozenset({"wave", "turn", "ttft", "rate", "tokens", "stall"})
NAME_MIN = 12
"""In a narrow pane the agent column gives up cells down to this (names are cut in the middle, where a session
id's two ends tell it apart: `226c53…4c9e1`) so that the note keeps NOTE_WANTED; below that the note gets what
is left, and then the pane's edge cuts."""
NOTE_WANTED = 20

Sort = Literal["wave", "deadline", "status", "rate"]
SORTS: tuple[tuple[Sort, str], ...] = (
    ("wave", "wave order"),
    ("deadline", "nearest deadline"),
    ("status", "status"),
    ("rate", "tokens/s"),
)
"""What the sort key cycles through: (id, what the pane's subtitle calls it)."""
SORT_LABELS = dict(SORTS)



@dataclass(frozen=True, slots=True)
class AgentRow:
    """What one row shows, as plain text plus the colour roles; compared to skip unchanged rows."""

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
    tool: tuple[str, float] | None = None  # a running tool call (name, elapsed): its status fits the column
    note_role: str = ""  # a theme colour name for the note cell ("": plain)

    def texts(self, status_cells: int = STATUS_WIDTH_MAX) -> list[str]:
        """The cells' text in column order; a running tool call's status fitted in `status_cells` (the column as
        it is when drawn: a row may predate the pane's size)."""
        texts = [getattr(self, key) for key, _, _ in COLUMNS]
        if self.tool is not None:
            texts[STATUS_COLUMN] = tool_status(*self.tool, status_cells)
        return texts


def agent_clock(st: AgentView, warn_at: tuple[float, ...], now: float) -> Countdown | None:
    """The countdown the row shows: its running tool call's tool deadline, or its attempt's stall deadline;
    none while a tool call waits for the operator (that time is not the model's)."""
    if st.status == "tool" and st.tool is not None:
        call = st.tool
        return tool_countdown(call.deadline, call.warn_at, call.t, now)
    if st.status == "approval":
        return None
    return countdown(st, warn_at, now)


def agent_row(st: AgentView, warn_at: tuple[float, ...], note: str, now: float,
              keepalive_at: float | None = None, queue_position: int | None = None) -> AgentRow:
    """`keepalive_at`: when the agent's stream last carried a keep-alive (bytes without a token). A running tool
    call's `tool: NAME 3.2s` is fitted to the status column when drawn (its name is cut, never its time). An
    attempt in its prefill reads as its progress (`prefill 63% · 40 s`); a queued agent as its place in our
    queue for its endpoint (`queue_position`, `queued #3`)."""
    call = st.tool if st.status == "tool" else None
    clock = agent_clock(st, warn_at, now)
    level = clock.level if clock else NORMAL
    status = st.status
    look = STATUS_LOOK.get(status)  # type: ignore[call-overload]
    role = look.role if look is not None else "foreground"
    if level == CRITICAL:
        role = "stall-critical"
    elif level == WARN:
        role = "stall-warn"
    note_role = "error" if status in ("killed", "failed") else ""
    quiet = ""
    if st.attempt is not None and keepalive_at is not None and keepalive_at > st.attempt.last_alive + 1.0:
        # alive but silent: the server (or a proxy) keeps the stream open while no token comes
        quiet = f"keep-alives, no token for {fmt_clock(now - st.attempt.last_alive)}"
    if st.session is not None:
        note, note_role = session_note(st, note, now)
    elif status in ("failed", "killed", "skipped", "cancelled") and st.error:
        note, quiet = st.error, ""
    elif call is not None:
        note, quiet = f"{call.server}.{call.tool} {call.arguments}", ""
    elif status == "approval" and st.approval is not None:
        note, quiet = f"{st.approval.server}.{st.approval.tool} {st.approval.arguments} (y answers)", ""
    if quiet:
        note = f"{note} · {quiet}" if note else quiet
    if st.turns:
        turn = f"{st.turn}/{st.turns}" if st.turn else f"-/{st.turns}"
    else:  # a gateway session: no number of turns, the request it is on (with several in flight, its oldest)
        number = st.attempt.turn if st.attempt is not None else st.turn
        turn = f"req {number}" if number else "req -"
    rate = live_rate(st, now) if status in ACTIVE or status == "completed" else st.output_tokens_per_s
    label = "tool" if call is not None else session_status(status) if st.session is not None else status_label(status)
    att = st.attempt
    if status in ("prefill", "stalling") and att is not None and att.prefill is not None and att.first_token_at is None:
        label = prefill_status(att.prefill, now)
    elif status == "queued" and queue_position is not None:
        label = f"queued #{queue_position}"
    if len(st.in_flight) > 1:  # a session's side requests beside the one its row describes (its oldest)
        label += f" ×{len(st.in_flight)}"
    return AgentRow(
        agent=st.label, wave=SESSION_WAVE if st.session is not None else str(st.wave + 1), status=label, turn=turn,
        ttft=fmt_seconds(st.ttft_s), rate=fmt_rate(rate), tokens=fmt_count(st.tokens) if st.tokens else "-",
        stall=clock.label if clock else "", note=note, status_role=role, level=level,
        tool=(call.tool, now - call.t) if call is not None else None, note_role=note_role,
    )


def session_note(st: AgentView, note: str, now: float) -> tuple[str, str]:
    """A session's note and its colour role: how long its next request has waited for a slot, then its last
    request's kill (the session goes on) or what the run notes of it (a stall, keep-alives), else who it is: its
    harness, the model mapping, its meters (`note`'s tail after the run's notes)."""
    parts: list[str] = []
    role = ""
    if st.status == "queued" and st.queued_at is not None:
        parts.append(f"waiting for a slot {fmt_clock(now - st.queued_at)}")
    if st.killed_request is not None:
        number, reason = st.killed_request
        parts.append(f"request {number} killed: {reason}")
        role = "error"
    elif note:
        parts.append(note)
    return " · ".join(parts), role


def session_identity(st: AgentView, note: str, meters: str) -> str:
    """What a session's row notes while nothing else is noted: the run's note of it, else what it is about, the
    harness's own session id where a path label named the row, its harness and the model mapping with its meters
    ('"fix the login bug" · in …/shop/api · claude-code 2.0.14 · claude-sonnet-4 → qwen3-coder · cache 82%')."""
    if note:
        return note
    session = st.session
    if session is None:
        return meters
    parts = [session.topic, f"session {session.own_id}" if session.own_id else "", session.harness,
             st.model_mapping, meters]
    return " · ".join(p for p in parts if p)


def empty_hint(mirror: RunMirror) -> str:
    """What the agents pane says while the run has no agent: a gateway waiting for its first session says where
    harnesses point (the stream pane has the gateway's own words in full); a run with nothing at all says that."""
    if mirror.serves_gateway:
        where = f" at {mirror.gateway_url}" if mirror.gateway_url else ""
        return f"Waiting for sessions: point a harness's base URL{where}"
    if mirror.run_id and mirror.started_at is not None:
        return "This run has no agents."
    return ""


def deadline_at(st: AgentView) -> float:
    """When the deadline the row counts down to fires (monotonic; inf: none), by the rules of `agent_clock`
    without building its label: the deadline sort asks it of every agent at every refresh."""
    if st.status == "tool":
        deadline = st.tool.deadline if st.tool is not None else None
        return deadline if deadline is not None else math.inf
    att = st.attempt
    if att is None or st.status == "approval" or st.status == "retrying" or st.status in FINAL:
        return math.inf
    deadline = att.deadline_at
    return deadline if math.isfinite(deadline) else math.inf  # (a NaN would leave the sort's order undefined)


def sort_key(sort: Sort, st: AgentView, warn_at: tuple[float, ...], now: float, order: int) -> tuple:
    """Where the agent goes under `sort`; `order` (its place in wave order) breaks ties, so rows that are equal
    keep still."""
    if sort == "deadline":  # to the second the row shows: deadlines a token's arrival apart are equal
        deadline = deadline_at(st)
        return (math.floor(deadline) if math.isfinite(deadline) else deadline, order)
    if sort == "status":
        look = STATUS_LOOK.get(st.status)  # type: ignore[call-overload]
        return (look.rank if look is not None else len(STATUS_LOOK), order)
    if sort == "rate":
        rate = live_rate(st, now) if st.status in ACTIVE or st.status == "completed" else st.output_tokens_per_s
        return (-round(rate) if rate is not None else math.inf, order)  # whole tokens/s: near rates tie
    return (order,)


def matches(text: str, st: AgentView) -> bool:
    """The filter: `text` (lower case) is part of the agent's name (a session's title or topic too), or of its
    status as shown or as the engine names it ("fail", "stall", "approval")."""
    session = st.session
    return (text in st.name.lower() or text in status_label(st.status).lower() or text in st.status
            or (session is not None and (text in session.title.lower() or text in session.topic.lower())))


_CONTROL = re.compile("[\x00-\x1f\x7f]+")


def _fit(text: str, width: int, right: bool, middle: bool = False) -> str:
    """`text` in exactly `width` cells on one line: control characters (a server's error may carry a
    newline) become a space, too long is cut with an ellipsis (at its end, or with `middle` in its middle,
    keeping both ends), short is padded on the side it is not aligned to."""
    if not text.isprintable():
        text = _CONTROL.sub(" ", text)
    length = cell_len(text)
    if length > width:
        if middle and width > 2:
            head = width // 2
            return set_cell_size(text, head) + "…" + _tail(text, width - head - 1)
        return set_cell_size(text, width - 1) + "…" if width > 1 else set_cell_size(text, width)
    pad = " " * (width - length)
    return pad + text if right else text + pad


def _tail(text: str, cells: int) -> str:
    """The end of `text` in exactly `cells` cells (a wide character cut in two is padded)."""
    taken = 0
    for i in range(len(text) - 1, -1, -1):
        taken += cell_len(text[i])
        if taken >= cells:
            return set_cell_size(text[i:], cells) if taken == cells else " " + text[i + 1:]
    return text.rjust(cells)


class AgentTable(ScrollView, can_focus=True):
    """One line per agent under a fixed header, in wave order or sorted, all or those the filter matches; the
    cursor row is the selected agent.

    `sync` recomputes each row's `AgentRow` and redraws only the visible lines whose row changed; under a sort
    or a filter it then puts the rows in order (a few hundred comparisons at the status refresh, never per
    token), and the cursor stays on its agent as rows move.
    """

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "cursor_to(0)", "First", show=False),
        Binding("end", "cursor_to(-1)", "Last", show=False),
    ]

    COMPONENT_CLASSES = {"agent-table--header", "agent-table--cursor"}

    DEFAULT_CSS = """
    AgentTable {
        height: 1fr;
        background: $surface;
        color: $foreground;
        & > .agent-table--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        & > .agent-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
        &:focus {
            background-tint: $foreground 5%;
            & > .agent-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
        }
    }
    """

    class Highlighted(Message):
        """The cursor moved to another agent."""

        def __init__(self, table: AgentTable, agent: str) -> None:
            super().__init__()
            self.table = table
            self.agent = agent

    class Selected(Message):
        """The agent under the cursor was clicked again: open its stream."""

        def __init__(self, table: AgentTable, agent: str) -> None:
            super().__init__()
            self.table = table
            self.agent = agent

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.names: list[str] = []  # the rows shown, in order
        self.all_names: list[str] = []  # every agent, in wave order
        self.sort: Sort = "wave"
        self.filter = ""  # lower case; "" shows every agent
        self.amber = 0  # agents whose countdown is amber, and red, at the last sync (the header counts them)
        self.red = 0
        self.built_from = -1  # the mirror's plan_version the rows were built from
        self.cursor_row = 0
        self._index: dict[str, int] = {}
        self._rows: dict[str, AgentRow] = {}
        self._strips: dict[str, tuple[object, Strip]] = {}  # name -> (what it was drawn from, strip)
        self._widths: list[int] = []
        self._name_width = 5
        self._status_width = STATUS_WIDTH  # the longest status a row shows (up to STATUS_WIDTH_MAX)
        self._turn_width = TURN_WIDTH  # wider once a session shows
        self._hidden: frozenset[str] = frozenset()  # columns not drawn: the wave while every row is a session
        self.empty_hint = ""  # what the pane says while it has no rows (a gateway waiting for sessions)
        self._hint_lines: list[str] = []  # that, wrapped to the pane
        self._status_cells = STATUS_WIDTH  # what the pane's width leaves it of that
        self._styles: dict[str, Style] = {}

    # ---- content ----------------------------------------------------------------------------------
    def build(self, mirror: RunMirror) -> None:
        """One row per agent, in wave order (sorted and filtered at the next sync), the cursor on the first."""
        self.built_from = mirror.plan_version
        self.all_names = list(mirror.agents)
        self.names = [name for name in self.all_names
                      if not self.filter or matches(self.filter, mirror.agents[name])]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._rows = {}
        self._strips = {}
        self._name_width = min(max([5, *(cell_len(mirror.agents[name].label) for name in self.names)]), 24)
        self.cursor_row = 0
        self._layout()
        self.scroll_to(0, 0, animate=False, immediate=True)
        self.refresh()

    def refresh_colours(self) -> None:
        """Forget drawn rows so they are drawn again in the current theme's colours."""
        self._styles = {}
        self._redraw()

    def sync(self, mirror: RunMirror, now: float) -> int:
        """Bring every row up to date, then their order; returns how many rows changed."""
        changed = amber = red = 0
        status_width, sessions = STATUS_WIDTH, 0
        top = self.scroll_offset.y
        visible = range(top, top + max(0, self.size.height - 1))
        endpoints = mirror.endpoints
        positions = mirror.queue_positions()
        for name, st in mirror.agents.items():
            note = mirror.notes.get(name, "")
            if not note and st.reused and st.status == "completed":
                note = "answer reused from the earlier run"  # never sent again: its figures are in the report
            if st.session is not None:
                note = session_identity(st, note, mirror.meter_note(name))
            else:  # a pool's member and the meters, when there is something to show
                note = note or mirror.meter_note(name)
            ep = endpoints.get(st.endpoint)
            row = agent_row(st, ep.warn_at if ep is not None else (), note, now, mirror.keepalive_at.get(name),
                            positions.get(name))
            wanted = min(STATUS_WIDTH_MAX, max(STATUS_WANTED.get(st.status, 0), cell_len(row.status)))
            status_width = max(status_width, wanted)
            if st.session is not None:
                sessions += 1
            if row.level == WARN:
                amber += 1
            elif row.level == CRITICAL:
                red += 1
            if self._rows.get(name) == row:
                continue
            self._rows[name] = row
            changed += 1
            index = self._index.get(name)
            if index is not None and index in visible:
                self.refresh_line(index + 1)
        self.amber, self.red = amber, red
        hint = empty_hint(mirror) if not mirror.agents else ""
        # a session's cell says which request it is on (`req 12`); every row a session: no wave to show
        turn_width = TURN_WIDTH_SESSIONS if sessions else TURN_WIDTH
        hidden = frozenset({"wave"}) if sessions and sessions == len(mirror.agents) else frozenset()
        if (hint, status_width, turn_width, hidden) != (self.empty_hint, self._status_width, self._turn_width,
                                                        self._hidden):
            self.empty_hint, self._status_width, self._turn_width, self._hidden = hint, status_width, turn_width, hidden
            self._layout()
            self.refresh()
        if self.sort != "wave" or self.filter or len(self.names) != len(self.all_names):
            self._order_rows(mirror, now)
        return changed

    def _order_rows(self, mirror: RunMirror, now: float) -> None:
        """Put the rows in the sort's order, those the filter matches only; the cursor stays on its agent (on
        the first row when its agent is filtered out)."""
        agents, endpoints = mirror.agents, mirror.endpoints
        names = [name for name in self.all_names
                 if name in agents and (not self.filter or matches(self.filter, agents[name]))]
        if self.sort != "wave":
            order = {name: i for i, name in enumerate(self.all_names)}

            def key(name: str) -> tuple:
                st = agents[name]
                ep = endpoints.get(st.endpoint)
                return sort_key(self.sort, st, ep.warn_at if ep is not None else (), now, order[name])

            names.sort(key=key)
        if names == self.names:
            return
        selected = self.selected_agent
        self.names = names
        self._index = {name: i for i, name in enumerate(names)}
        self.virtual_size = Size(self.virtual_size.width, len(names) + 1)
        index = self._index.get(selected) if selected is not None else None
        self.cursor_row = index if index is not None else 0
        if index is None and names:
            self.scroll_to(0, 0, animate=False, immediate=True)
            self.post_message(self.Highlighted(self, names[0]))
        else:
            self._scroll_to_cursor()
        self.refresh()

    def set_sort(self, sort: Sort, mirror: RunMirror, now: float) -> None:
        """Sort by `sort` (an id of SORTS) now; the cursor stays on its agent, and the pane shows the top of the
        new order (what the sort puts first) unless that would scroll the cursor's row out of view."""
        self.sort = sort
        self._order_rows(mirror, now)
        if self.cursor_row < max(1, self.size.height - 1):
            self.scroll_to(0, 0, animate=False, immediate=True)

    def set_filter(self, text: str, mirror: RunMirror, now: float) -> None:
        """Show only the agents whose name or status contains `text` (any case); "" shows them all."""
        self.filter = text.strip().lower()
        self._order_rows(mirror, now)

    def show_agent(self, agent: str, mirror: RunMirror, now: float) -> bool:
        """Put the cursor on `agent`, clearing a filter that hides it; False: no such agent."""
        if agent not in self._index and agent in self.all_names:
            self.set_filter("", mirror, now)
        index = self._index.get(agent)
        if index is None:
            return False
        self.move_cursor(index)
        return True

    def row(self, agent: str) -> AgentRow | None:
        """What the agent's row shows now (None before the first sync)."""
        return self._rows.get(agent)

    def row_texts(self, agent: str) -> list[str]:
        """The agent's cells as shown, in column order (empty before the first sync)."""
        row = self._rows.get(agent)
        return row.texts(self._status_cells) if row else []

    @property
    def row_count(self) -> int:
        return len(self.names)

    @property
    def selected_agent(self) -> str | None:
        return self.names[self.cursor_row] if self.names else None

    # ---- cursor -----------------------------------------------------------------------------------
    def move_cursor(self, row: int) -> None:
        """Put the cursor on row `row` (clamped), scroll it into view, and say so."""
        if not self.names:
            return
        row = max(0, min(row, len(self.names) - 1))
        if row == self.cursor_row:
            return
        old, self.cursor_row = self.cursor_row, row
        self.refresh_line(old + 1)
        self.refresh_line(row + 1)
        self._scroll_to_cursor()
        self.post_message(self.Highlighted(self, self.names[row]))

    def _scroll_to_cursor(self) -> None:
        rows_shown = max(1, self.size.height - 1)
        top = self.scroll_offset.y
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False, immediate=True)
        elif self.cursor_row >= top + rows_shown:
            self.scroll_to(y=self.cursor_row - rows_shown + 1, animate=False, immediate=True)

    def action_cursor(self, step: int) -> None:
        self.move_cursor(self.cursor_row + step)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * max(1, self.size.height - 2))

    def action_cursor_to(self, row: int) -> None:
        self.move_cursor(row if row >= 0 else len(self.names) - 1)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        row = self.scroll_offset.y + offset.y - 1
        if not 0 <= row < len(self.names):
            return
        if row == self.cursor_row:
            self.post_message(self.Selected(self, self.names[row]))
        else:
            self.move_cursor(row)

    def on_focus(self) -> None:
        self._redraw()  # the cursor row's colours follow focus

    def on_blur(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        self._strips = {}
        self.refresh()

    # ---- drawing ----------------------------------------------------------------------------------
    def on_resize(self) -> None:
        self._layout()

    def _layout(self) -> None:
        """Column widths for the pane's width: every column but the note as wide as it needs, the note the
        rest; a narrow pane cuts long names first (to NAME_MIN), then the note."""
        hidden = self._hidden
        others = sum(width or 0 for key, _, width in COLUMNS
                     if key not in ("agent", "note", "status", "turn") and key not in hidden)
        others += self._turn_width
        others += len(COLUMNS) - len(hidden)  # a space before each cell
        # a wide status gives way before the countdown does: the name keeps its minimum, the note goes first
        room = self.size.width - others - min(self._name_width, NAME_MIN)
        self._status_cells = max(STATUS_WIDTH, min(self._status_width, room))
        others += self._status_cells
        name = max(min(self._name_width, NAME_MIN), min(self._name_width, self.size.width - others - NOTE_WANTED))
        widths = [name if key == "agent" else self._status_cells if key == "status"
                  else self._turn_width if key == "turn" else 0 if key in hidden else (width or 0)
                  for key, _, width in COLUMNS]
        widths[-1] = max(0, self.size.width - others - name)
        if widths != self._widths:
            self._widths = widths
            self._strips = {}
        self._hint_lines = textwrap.wrap(self.empty_hint, max(10, self.size.width - 2)) if self.empty_hint else []
        self.virtual_size = Size(others + sum(widths), max(len(self.names), len(self._hint_lines)) + 1)

    def _style(self, role: str, bold: bool = False) -> Style:
        key = f"{role}/{bold}"
        style = self._styles.get(key)
        if style is None:
            colour = self.app.colour(role) if role else ""  # type: ignore[attr-defined]
            style = self._styles[key] = Style(color=colour or None, bold=bold or None)
        return style

    def _segments(self, texts: list[str], styles: list[Style], base: Style) -> Strip:
        segments = []
        hidden = self._hidden
        for (key, _, _), width, text, style in zip(COLUMNS, self._widths, texts, styles, strict=True):
            if key not in hidden:
                segments.append(Segment(" " + _fit(text, width, key in RIGHT, key == "agent"),
                                        base + style if style else base))
        return Strip(segments, sum(self._widths) + len(COLUMNS) - len(hidden))

    def _row_strip(self, name: str, row: AgentRow | None, cursor: bool) -> Strip:
        drawn_from = (row, cursor)
        cached = self._strips.get(name)
        if cached is not None and cached[0] == drawn_from:
            return cached[1]
        # every cell on the pane's own background: a segment without one shows the terminal's default
        base = self.get_component_rich_style("agent-table--cursor") if cursor else self.rich_style
        if row is None:
            texts, styles = [name, *[""] * (len(COLUMNS) - 1)], [Style()] * len(COLUMNS)
        else:
            texts = row.texts(self._status_cells)
            level = ""
            if row.level == WARN:
                level = "stall-warn"
            elif row.level == CRITICAL:
                level = "stall-critical"
            status = self._style(row.status_role)
            level_style = self._style(level, bold=True) if level else Style()
            styles = [level_style, Style(), status, Style(), Style(), Style(), Style(),
                      level_style if level else self._style("text-muted"),
                      self._style(row.note_role) if row.note_role else Style()]
        strip = self._segments(texts, styles, base)
        self._strips[name] = (drawn_from, strip)
        return strip

    def _hint_line(self, line: int, width: int) -> Strip:
        """Line `line` of the empty pane's hint, wrapped to the pane."""
        if not 0 <= line < len(self._hint_lines):
            return Strip.blank(width, self.rich_style)
        style = self.rich_style + self._style("text-muted")
        return Strip([Segment(" " + self._hint_lines[line], style)]).crop_extend(0, width, self.rich_style)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        if y == 0:
            header = self.get_component_rich_style("agent-table--header")
            strip = self._segments([label for _, label, _ in COLUMNS], [Style()] * len(COLUMNS), header)
            return strip.crop_extend(scroll_x, scroll_x + width, header)
        index = scroll_y + y - 1
        if index >= len(self.names):
            if not self.names and not self.filter:
                return self._hint_line(index, width)
            return Strip.blank(width, self.rich_style)
        name = self.names[index]
        cursor = index == self.cursor_row
        strip = self._row_strip(name, self._rows.get(name), cursor)
        return strip.crop_extend(scroll_x, scroll_x + width,
                                 self.get_component_rich_style("agent-table--cursor") if cursor else self.rich_style)
