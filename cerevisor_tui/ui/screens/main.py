"""The main screen: header, agents, stream, load, footer; the operator's keys send the run its commands here.

Two timers redraw it from the run's mirror: the stream flush at `[ui].refresh_hz` (visible pane only) and
the status refresh (header, agents rows, load) at most 10 times a second. Events never touch a widget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Container, Vertical
from textual.screen import Screen
from textual.widgets import Static

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.ui.commands import ConsoleCommands
from cerevisor_tui.ui.format import fmt_clock, session_status, status_label, tool_countdown
from cerevisor_tui.ui.inbox import HINTS
from cerevisor_tui.ui.keys import MAIN_BINDINGS, TOUR, effective_keys
from cerevisor_tui.ui.mirror import FINAL, AgentView, RunMirror
from cerevisor_tui.ui.widgets.agent_filter import AgentFilter
from cerevisor_tui.ui.widgets.agent_table import SORT_LABELS, SORTS, AgentTable
from cerevisor_tui.ui.widgets.footer import Footer
from cerevisor_tui.ui.widgets.load_pane import LoadPane
from cerevisor_tui.ui.widgets.run_header import RunHeader
from cerevisor_tui.ui.widgets.stream_pane import StreamPane

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

STATUS_HZ_MAX = 4.0
RING_FRESH_S = 30.0
"""An inbox item rings the terminal only when it is this new: attaching to a run replays its journal, and
an agent killed an hour ago is in the inbox, not news."""


class AgentsPane(Vertical):
    ALLOW_MAXIMIZE = True


def session_subtitle(st: AgentView, now: float) -> str:
    """The stream pane's corner for a gateway session: its status and request, how long that request waited in
    the gateway's queue (not model silence: its stall clock starts when it is sent), and the model mapping."""
    number = st.attempt.turn if st.attempt is not None else st.turn  # the request its row describes (its oldest)
    parts = [session_status(st.status), f"request {number}" if number else "no request yet"]
    if st.status == "queued" and st.queued_at is not None:
        parts.append(f"next waiting for a slot {fmt_clock(now - st.queued_at)}")
    elif st.queued_s is not None:
        parts.append(f"queued {st.queued_s:.1f} s")
    if st.model_mapping:
        parts.append(st.model_mapping)
    if len(st.in_flight) > 1:
        parts.append(f"{len(st.in_flight)} requests in flight")
    return " · ".join(parts)


class MainScreen(Screen):
    """What the operator watches; see `ui/keys.py` for the keys."""

    app: CerevisorApp
    BINDINGS: ClassVar[list[BindingType]] = [*MAIN_BINDINGS]
    COMMANDS = {ConsoleCommands}
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (150, "-wide")]

    def __init__(self) -> None:
        super().__init__()
        self._cap_warning = ""  # the cap warning last notified
        self._jumped_seq = 0  # the inbox item `n` went to last
        self._cap_warned_at = 0  # the effective cap it was notified at
        self.untried: list[str] = []
        """The demo's suggested keys (binding ids) not yet pressed: the hint line names them."""
        self._hint = ""  # what the hint line says ("": hidden)

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Container(id="body"):
            with AgentsPane(id="agents-pane"):
                yield AgentTable(id="agents")
                yield AgentFilter(id="agents-filter")
            yield StreamPane(id="stream-pane")
            yield LoadPane(id="load-pane")
        yield Static(id="hint", markup=False)
        yield Footer(show_command_palette=False)

    # ---- parts ------------------------------------------------------------------------------------
    @property
    def table(self) -> AgentTable:
        return self.query_one(AgentTable)

    @property
    def stream_pane(self) -> StreamPane:
        return self.query_one(StreamPane)

    @property
    def selected(self) -> str | None:
        return self.table.selected_agent

    def on_mount(self) -> None:
        app = self.app
        self.query_one("#agents-pane").border_title = "1 agents"
        self.query_one("#load-pane").border_title = "3 load"
        self.table.build(app.mirror)
        self._update_agents_subtitle()
        self.untried = [binding_id for binding_id, _ in TOUR] if app.tour else []
        hz = app.config.ui.refresh_hz
        self.set_interval(1 / hz, self.flush_streams, name="stream-flush")
        self.set_interval(1 / min(hz, STATUS_HZ_MAX), self.refresh_status, name="status-refresh")
        self.stream_pane.show(self.selected, app.mirror)
        self.refresh_status()
        self.table.focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """`l` (release) is a key of a gateway session's row only."""
        if action == "release":
            tables = self.query(AgentTable)
            name = tables.first().selected_agent if tables else None
            st = self.app.mirror.agents.get(name) if name is not None else None
            return st is not None and st.session is not None
        return True

    def on_agent_table_highlighted(self, event: AgentTable.Highlighted) -> None:
        # (no refresh_bindings: `l`, the one key check_action moves, is not in the footer; a refresh would recompose
        # every footer key at each cursor move, a tenth of the console's CPU at 256 agents)
        self.stream_pane.show(event.agent, self.app.mirror)
        self._update_stream_title()
        self._update_agents_subtitle()

    def _update_agents_subtitle(self) -> None:
        table = self.table
        parts = []
        if table.sort != "wave":
            parts.append(f"by {SORT_LABELS[table.sort]}")
        if table.filter:
            parts.append(f"/{table.filter}: {table.row_count} of {len(table.all_names)}")
        if table.row_count:
            parts.append(f"{table.cursor_row + 1} of {table.row_count}")
        elif table.filter:
            parts.append("none match")
        subtitle = " · ".join(parts)
        pane = self.query_one("#agents-pane")
        if pane.border_subtitle != subtitle:
            pane.border_subtitle = subtitle

    def on_agent_table_selected(self, event: AgentTable.Selected) -> None:
        self.action_open_stream()

    # ---- redraws ----------------------------------------------------------------------------------
    def flush_streams(self) -> None:
        """Move new tokens of the visible stream into its view (the only per-token path to the screen)."""
        pane = self.stream_pane
        if pane.display and (self.maximized is None or self.maximized is pane):
            pane.flush(self.app.mirror)
            self._update_stream_title()

    def refresh_status(self) -> None:
        """Header, agents rows, load pane and notices, from the run's mirror."""
        app = self.app
        mirror = app.mirror
        if self.table.built_from != mirror.plan_version:
            self._show_plan()  # the run announced its agents (RunStarted) since the table was built
        now = app.clock()
        mirror.sample(now)
        table = self.table
        table.sync(mirror, now)  # first: the header counts the amber and red rows it found
        self.query_one(RunHeader).sync(mirror, now, error=app.engine_error,
                                       amber=table.amber, red=table.red)
        self._update_agents_subtitle()
        load = self.query_one(LoadPane)
        if self.maximized is None or self.maximized is load:
            load.sync(mirror, now, endpoint=mirror.endpoint_of(self.selected))
        self._update_stream_title()
        self._update_empty(mirror)
        for notice in mirror.take_notices():
            app.notice(notice.message, title=notice.title, severity=notice.severity,  # type: ignore[arg-type]
                       timeout=8 if notice.severity == "error" else 4)
        fresh = [item for item in mirror.inbox.take_new() if now - item.t <= RING_FRESH_S]
        app.ring(fresh)
        approvals = [item for item in fresh if item.kind == "approval"]
        if len(approvals) == 1:
            app.notice(f"{approvals[0].agent}: {approvals[0].text}  (y answers, n goes to it)",
                       title="Needs approval", severity="warning", timeout=8)
        elif approvals:
            app.notice(f"{len(approvals)} tool calls wait for you: n goes to each, i lists them.",
                       title="Needs approval", severity="warning", timeout=8)
        self._notify_cap_warning()
        self._update_hint(mirror)

    def _update_empty(self, mirror: RunMirror) -> None:
        """A run of gateway sessions alone calls its pane "sessions"; with none yet, the stream pane says where the
        gateway serves, in its own words."""
        pane = self.query_one("#agents-pane")
        title = "1 sessions" if mirror.serves_gateway and not mirror.workflow_agents else "1 agents"
        if pane.border_title != title:
            pane.border_title = title
        waiting = mirror.serves_gateway and not mirror.agents
        self.stream_pane.placeholder(
            f"{mirror.gateway or 'The gateway has not said where it serves yet.'}\n\nEach session a harness opens "
            "becomes a row here: its requests, their messages and streamed answers, its deadlines." if waiting else "")

    def _notify_cap_warning(self) -> None:
        """Once per change of the warning (a higher cap, parallel again, the server's own capacity arriving);
        lowering the cap while still past the fit adds no new notice. The header and load pane keep a marker."""
        mirror = self.app.mirror
        warning = mirror.cap_warning()
        cap = mirror.effective_cap
        if warning == self._cap_warning:
            return
        if warning and not (self._cap_warning and cap < self._cap_warned_at):
            self.app.notice(warning, title="Cap past the KV fit", severity="warning", timeout=8)
        self._cap_warning, self._cap_warned_at = warning, cap

    def _show_plan(self, *, keep: bool = True) -> None:
        """Build the agents pane from the mirror's agents and show the selected one's stream: with `keep`, the
        agent selected before stays selected (a gateway's new session adds a row under the operator's cursor),
        else (another run) the cursor goes to the first."""
        mirror = self.app.mirror
        before = self.selected if keep else None
        self.table.build(mirror)
        if before is not None and before in mirror.agents:
            self.table.show_agent(before, mirror, self.app.clock())
        self._update_agents_subtitle()
        if keep:
            self.stream_pane.show(self.selected, mirror)
        else:
            self.stream_pane.reset(self.selected, mirror)

    def show_run(self) -> None:
        """Draw the app's run afresh (the console switched to a resumed run, with a new mirror)."""
        self.table.refresh_colours()
        self._show_plan(keep=False)
        self.query_one(RunHeader).invalidate()
        self.query_one(LoadPane).invalidate()
        self._cap_warning, self._cap_warned_at = "", 0
        self.refresh_status()

    def _update_stream_title(self) -> None:
        pane = self.stream_pane
        name = pane.agent
        if name is None:
            title, subtitle = "2 stream", ""
        else:
            st = self.app.mirror.agents.get(name)
            title = f"2 stream · {st.label if st is not None else name}"
            subtitle = f"{status_label(st.status)} · turn {st.turn or '-'}/{st.turns}" if st else ""
            call = st.tool if st is not None and st.status == "tool" else None
            if st is not None and st.session is not None:
                if st.session.harness:
                    title += f" · {st.session.harness}"
                subtitle = session_subtitle(st, self.app.clock())
            elif call is not None:  # the call in flight: its name, how long it has run, its tool deadline
                now = self.app.clock()
                subtitle = f"tool {call.server}.{call.tool} · {now - call.t:.1f}s"
                clock = tool_countdown(call.deadline, call.warn_at, call.t, now)
                if clock is not None:
                    subtitle += f" · deadline in {fmt_clock(clock.remaining_s)}"
            elif st is not None and st.status == "approval":
                subtitle = "needs approval · y answers"
            if not pane.following:
                subtitle += " · scrolled up (End follows)"
        if (title, subtitle) != (pane.border_title, pane.border_subtitle):
            pane.border_title, pane.border_subtitle = title, subtitle

    def recolour(self) -> None:
        """Repaint everything coloured from the theme (after a theme change)."""
        self.table.refresh_colours()
        self.query_one(RunHeader).invalidate()
        self.query_one(LoadPane).invalidate()
        self.stream_pane.view.notify_style_update()
        self.refresh_status()

    # ---- actions ----------------------------------------------------------------------------------
    def action_toggle_mode(self) -> None:
        """The switch is immediate, never held by a dialog; the first landing on parallel/auto then offers a probe."""

        def switched(mode: cmd.AnswerValue) -> None:  # the mode the run switched to, told back by the run
            self.refresh_status()
            if mode == "sequential":
                self.app.notice("Sequential: one agent at a time; running agents finish first.", timeout=3)
            else:
                self._offer_probe()

        self.app.command(cmd.CycleMode(), switched)

    def _offer_probe(self) -> None:
        """Once per run: an endpoint not probed yet (and not hosted), with agents still to start, offered on the
        hint line above the footer (`P` opens it); a dialog over the table unasked would take the next key."""
        app = self.app
        mirror = app.mirror
        if app.probe_offered or not app.run_open:
            return
        if not any(a.status in ("pending", "queued") for a in mirror.agents.values()):
            return  # nothing left to start: a cap would change nothing
        used = {a.endpoint for a in mirror.agents.values()}
        probed = {name for name, probe in mirror.probes.items() if probe.state == "done"}
        candidates = [name for name, ep in mirror.endpoints.items()
                      if name in used and ep.kind != "hosted" and name not in probed]
        if not candidates:
            return
        app.probe_offered = True
        self.probe_offer = candidates[0]
        self._update_hint(mirror)

    probe_offer = ""
    """The endpoint the hint line offers to probe ("" none): until `P`, the run back in sequential mode, or
    nothing left to start."""

    def action_probe_offer(self) -> None:
        """`P`: the probe of the offered endpoint (else the first), asking first with what it will send."""
        app = self.app
        name = self.probe_offer or next(iter(app.mirror.endpoints), "")
        self.probe_offer = ""
        self._update_hint(app.mirror)
        if not app.run_open or name not in app.mirror.endpoints:
            self.app.notice("The run is not open: probe an endpoint with `cerevisor-tui probe URL`.",
                            severity="warning")
            return
        from cerevisor_tui.ui.screens.probe import ProbeScreen

        app.probe_offered = True
        app.push_screen(ProbeScreen(name, offer=True))

    def tried(self, binding_id: str) -> None:
        """A key of the demo's hint was pressed: the hint names the others."""
        if binding_id in self.untried or (binding_id == "cap_down" and "cap_up" in self.untried):
            self.untried = [b for b in self.untried if b not in (binding_id, "cap_up")]
            self._update_hint(self.app.mirror)

    def _update_hint(self, mirror: RunMirror) -> None:
        """The line above the footer: the probe on offer, else the demo's keys not tried yet; hidden when neither."""
        app = self.app
        offer = self.probe_offer
        if offer and (mirror.mode == "sequential" or not app.run_open
                      or not any(a.status in ("pending", "queued") for a in mirror.agents.values())):
            offer = self.probe_offer = ""
        if offer:
            text = (f"Probe {offer} before more agents run at once? P shows what it sends and measures the cap "
                    "it carries")
        elif self.untried:
            keymap = app.keymap
            bindings = {b.id: b for b in MAIN_BINDINGS}
            what = dict(TOUR)
            keys = [f"{effective_keys(bindings[b], keymap)}{'/-' if b == 'cap_up' else ''} {what[b]}"
                    for b in self.untried]
            text = "Try: " + " · ".join(keys) + " · q quit"
        else:
            text = ""
        if text != self._hint:
            self._hint = text
            hint = self.query_one("#hint", Static)
            hint.update(text)
            hint.display = bool(text)

    def action_probe(self, endpoint: str = "") -> None:
        """Sweep an endpoint now and offer its recommended cap (the palette's "Probe endpoint")."""
        app = self.app
        endpoints = app.mirror.endpoints
        name = endpoint or next(iter(endpoints), "")
        if name not in endpoints:
            self.app.notice(f"No endpoint named {name}.", severity="warning")
            return
        if not app.run_open:
            self.app.notice(f"The run is not open: probe {name} with `cerevisor-tui probe URL`.", severity="warning")
            return
        from cerevisor_tui.ui.screens.probe import ProbeScreen

        app.probe_offered = True
        app.push_screen(ProbeScreen(name))

    def action_cap(self, delta: int) -> None:
        """The parallel cap, or in auto mode the ceiling its controllers stay under (the engine decides which)."""
        mirror = self.app.mirror

        def nudged(value: cmd.AnswerValue) -> None:  # the cap (or ceiling) in force now, told back by the run
            self.refresh_status()
            if mirror.mode == "sequential":
                self.app.notice(f"Cap {value}: it applies in parallel mode (m to switch).", timeout=3)
            elif mirror.mode == "auto":
                self.app.notice(f"Auto ceiling {value}: no endpoint's cap goes above it.", timeout=3)

        self.app.command(cmd.NudgeCap(delta=delta), nudged)

    def action_cap_history(self) -> None:
        from cerevisor_tui.ui.screens.caps import CapHistoryScreen

        self.app.push_screen(CapHistoryScreen())

    def action_pause(self) -> None:
        app = self.app
        if app.mirror.paused:
            app.command(cmd.Resume())
            self.app.notice("Admissions resumed.", timeout=3)
        else:
            app.command(cmd.Pause())
            self.app.notice("Paused: queued agents wait; running agents go on.", timeout=3)
        self.refresh_status()

    def _catch_up(self) -> None:
        """A key acts on the agents the run has announced, even before the next status refresh shows them
        (an approval can come a few milliseconds after the run starts)."""
        if self.table.built_from != self.app.mirror.plan_version:
            self.refresh_status()

    def _selected_state(self, verb: str) -> AgentView | None:
        self._catch_up()
        name = self.selected
        agent = self.app.mirror.agents.get(name) if name is not None else None
        if agent is None:
            self.app.notice(f"No agent selected to {verb}.", severity="warning")
        return agent

    def action_kill(self) -> None:
        st = self._selected_state("kill")
        if st is None:
            return
        if st.session is not None:
            self._kill_request(st)
            return
        if st.status in FINAL or st.status == "pending":
            self.app.notice(f"{st.name} is {status_label(st.status)}: nothing to kill.",
                            severity="warning")
            return
        from cerevisor_tui.ui.screens.confirm import ConfirmScreen

        def killed(done: cmd.AnswerValue) -> None:
            if done is False:
                self.app.notice(f"{st.name} has already ended: nothing to kill.", severity="warning")

        def answer(yes: bool | None) -> None:
            if yes:
                self.app.command(cmd.Kill(agent=st.name), killed)

        if st.status == "tool" and st.tool is not None:
            title = "Kill tool call"
            question = (f"Cancel {st.name}'s call of {st.tool.server}.{st.tool.tool}? The model is told it was "
                        "killed, and the agent goes on.")
        else:
            title, question = "Kill agent", f"Kill {st.name}? Its request is closed now and no retry follows."
        self.app.push_screen(ConfirmScreen(title, question, yes="Kill", no="Keep"), answer)

    def _kill_request(self, st: AgentView) -> None:
        """`k` on a gateway session ends its requests in flight; the session goes on (its harness decides)."""
        if st.attempt is None:
            if st.status == "idle":
                self.app.notice(f"{st.label} is idle: no request in flight to kill. It keeps its slot until "
                            "[gateway] release_after_s passes; l gives it back now.", severity="warning")
                return
            waiting = " (its next request waits for a slot)" if st.status == "queued" else ""
            self.app.notice(f"{st.label} has no request in flight{waiting}: nothing to kill.", severity="warning")
            return
        from cerevisor_tui.ui.screens.confirm import ConfirmScreen

        def killed(done: cmd.AnswerValue) -> None:
            if done is False:
                self.app.notice(f"{st.name}'s request has already ended.", severity="warning")

        def answer(yes: bool | None) -> None:
            if yes:
                self.app.command(cmd.Kill(agent=st.name), killed)

        what = f"{len(st.in_flight)} requests in flight" if len(st.in_flight) > 1 else f"request {st.turn}"
        question = (f"End {st.name}'s {what}? Its harness gets an error and decides what follows; the session "
                    "goes on.")
        self.app.push_screen(ConfirmScreen("Kill request", question, yes="Kill", no="Keep"), answer)

    def action_release(self) -> None:
        """`l` on an idle gateway session: its slot is given back now (asked first), so the next one waiting runs."""
        st = self._selected_state("release")
        if st is None:
            return
        if st.session is None:
            self.app.notice(f"{st.name} is a workflow agent: only a gateway session keeps a slot between its requests.",
                        severity="warning")
            return
        if st.in_flight:
            self.app.notice(f"{st.label} has {len(st.in_flight)} request(s) in flight: it gives its slot back once idle "
                        "(k ends them).", severity="warning")
            return
        if st.status != "idle":
            self.app.notice(f"{st.label} is {session_status(st.status)}: it holds no slot.", severity="warning")
            return
        from cerevisor_tui.ui.screens.confirm import ConfirmScreen

        def released(done: cmd.AnswerValue) -> None:
            if done is False:
                self.app.notice(f"{st.label} holds no slot any more.", severity="warning")
            else:
                self.app.notice(f"{st.label} gave its slot back.", timeout=3)
            self.refresh_status()

        def answer(yes: bool | None) -> None:
            if yes:
                self.app.command(cmd.Release(agent=st.name), released)

        question = (f"Give {st.label}'s slot back now? The next session waiting runs; its own next request waits "
                    "for a slot again.")
        self.app.push_screen(ConfirmScreen("Release session", question, yes="Release", no="Keep"), answer)

    def action_extend(self) -> None:
        st = self._selected_state("extend")
        if st is None:
            return
        if st.session is not None and st.attempt is None:  # (an attached console gets no False back)
            self.app.notice(f"{st.name} has no request in flight to extend.", severity="warning")
            return

        def extended(done: cmd.AnswerValue) -> None:
            if done is False:
                what = "request in flight" if st.session is not None else "running attempt"
                self.app.notice(f"{st.name} has no {what} to extend.", severity="warning")
            self.refresh_status()

        self.app.command(cmd.Extend(agent=st.name), extended)

    def action_retry(self) -> None:
        st = self._selected_state("retry")
        if st is None:
            return

        def retried(outcome: cmd.AnswerValue) -> None:
            if outcome:
                self.app.notice(f"{st.name}: {outcome}", timeout=6 if st.session is not None else 4)

        self.app.command(cmd.Retry(agent=st.name), retried)

    def action_cycle_sort(self) -> None:
        ids = [sort for sort, _ in SORTS]
        table = self.table
        table.set_sort(ids[(ids.index(table.sort) + 1) % len(ids)], self.app.mirror, self.app.clock())
        self._update_agents_subtitle()
        self.app.notice(f"Agents sorted by {SORT_LABELS[table.sort]}.", timeout=2)

    def action_filter(self) -> None:
        if self.maximized is not None and self.maximized is not self.query_one("#agents-pane"):
            self.minimize()
        self.query_one(AgentFilter).open()

    def on_input_changed(self, event: AgentFilter.Changed) -> None:
        if isinstance(event.input, AgentFilter):
            self.table.set_filter(event.value, self.app.mirror, self.app.clock())
            self._update_agents_subtitle()

    def on_agent_filter_done(self, event: AgentFilter.Done) -> None:
        self.table.focus()
        self._update_agents_subtitle()

    def action_inbox(self) -> None:
        from cerevisor_tui.ui.screens.inbox import InboxScreen

        self.app.push_screen(InboxScreen(), lambda agent: self.go_to(agent) if agent else None)

    def action_next_attention(self) -> None:
        """The next inbox item, newest first, wrapping round: go to its agent and act on it."""
        items = self.app.mirror.inbox.newest_first()
        if not items:
            self.app.notice("Nothing needs you now.", timeout=2)
            return
        item = next((i for i in items if i.seq < self._jumped_seq), items[0])
        self._jumped_seq = item.seq
        self.go_to(item.agent)

    def go_to(self, agent: str) -> None:
        """Select `agent` (clearing a filter that hides it) and act on what it needs: an approval opens its
        prompt, anything else says what the keys can do."""
        app = self.app
        self._catch_up()
        if not self.table.show_agent(agent, app.mirror, app.clock()):
            return
        line = self.query_one(AgentFilter)
        if not self.table.filter and line.value:  # the filter hid the agent: it is gone, and so is its line
            line.value = ""
            line.remove_class("-open")
        if self.maximized is not None:
            self.minimize()
        self.table.focus()
        self._update_agents_subtitle()
        st = app.mirror.agents.get(agent)
        if st is not None and st.approval is not None:
            self.action_answer_approval()
            return
        item = app.mirror.inbox.items.get(agent)
        if item is not None:
            self.app.notice(f"{agent} {item.label}: {item.text}  ({HINTS[item.kind]})", timeout=5)

    def action_answer_approval(self) -> None:
        st = self._selected_state("answer")
        if st is None:
            return
        request = st.approval
        if request is None:
            self.app.notice(f"{st.name} has no tool call waiting for approval.", severity="warning")
            return
        from cerevisor_tui.ui.screens.approval import ApprovalScreen, Decision

        def decided(decision: Decision | None) -> None:
            if decision is None:
                return
            # decided meanwhile (another console, the call's end): the run's refusal says so
            if decision == "deny":
                self.app.command(cmd.Deny(agent=request.agent, call_id=request.call_id))
            else:
                self.app.command(cmd.Approve(agent=request.agent, call_id=request.call_id, scope=decision))
            self.refresh_status()

        self.app.push_screen(ApprovalScreen(request), decided)

    def action_settings(self) -> None:
        from cerevisor_tui.ui.screens.settings import SettingsScreen

        # start with the breakpoint class it will get, so mounting does not restyle the form twice
        self.app.push_screen(SettingsScreen(classes="-wide" if self.app.size.width >= 120 else "-narrow"))

    def action_help(self) -> None:
        from cerevisor_tui.ui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen())

    def action_open_stream(self) -> None:
        self.stream_pane.view.focus()

    def action_leave_stream(self) -> None:
        if self.maximized is not None:
            self.minimize()
        self.table.focus()

    def action_maximize_pane(self, pane_id: str) -> None:
        pane = self.query_one(f"#{pane_id}")
        if self.maximized is pane:
            self.minimize()
            return
        self.maximize(pane, container=False)
        if pane_id == "stream-pane":
            self.stream_pane.view.focus()
            self.flush_streams()
        elif pane_id == "agents-pane":
            self.table.focus()
        else:
            self.refresh_status()

    def action_quit(self) -> None:
        self.app.request_quit()
