"""The help screen: every key (as remapped), what each pane shows, what the stall colours mean."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from cerevisor_tui.ui.keys import MAIN_BINDINGS, effective_keys
from cerevisor_tui.ui.widgets.footer import Footer

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

PANES = (
    ("header", "Endpoints and their health (● up, ● down, ○ not reported yet), the mode badge, the cap "
               "(amber `> fit N` when it lets more conversations run than fit in KV memory), agents running / "
               "queued / done / failed, output tokens per second, the wave, the run time. In auto mode the "
               "badge carries the live cap (AUTO 32: the sum of the endpoints' caps), then, where the line has "
               "room, auto's ceiling and the reason for its last change. What needs you: inbox N (open items of the "
               "attention inbox, i) and the agents in amber and red."),
    ("1 agents", "One row per agent: wave, status, turn k/n, time to first token, tokens/s, tokens, and the "
                 "countdown to its nearest stall deadline (first token, or idle once streaming; in a tool call, "
                 "its tool deadline). A running MCP call shows as tool: NAME 3.2s, a call waiting for you as "
                 "needs approval (y answers). o sorts (wave order, nearest deadline, status, tokens/s), / "
                 "filters by name or status; the pane's corner says which. A gateway's sessions come after the "
                 "workflow's agents, gw in their wave column: req N is the request they are on, idle between "
                 "requests (holding a slot), released once it is given back. A path label (/a/NAME/v1) names its "
                 "row; a harness's generated id reads as the harness and a short id. The note says what it is about "
                 "(its first words, its working directory), the harness and the model mapping. A session with "
                 "several requests in flight (a side request beside its main turn) shows streaming ×2: the row "
                 "follows the oldest, the stream shows each. k ends a session's requests in flight; the session goes "
                 "on, and its harness, not the gateway, decides whether to retry. l gives an idle session's slot "
                 "back now (the next one waiting runs) instead of after [gateway] release_after_s."),
    ("2 stream", "The selected agent's conversation: your prompts, its answer as it streams (reasoning "
                 "dimmed), each tool call with its arguments and its result on a line (the corner: the call in "
                 "flight, its time and deadline). A session's: each request's new messages, then its answer; the "
                 "corner says how long the request queued in the gateway (not model silence: its stall clock "
                 "starts when it is sent). It follows new text while you are at the bottom; scroll up to read, "
                 "End to follow."),
    ("3 load", "What the server reports in /metrics: requests running and waiting, KV-cache use, prefix "
               "hits (- until it reports them); the trend over the whole run of one endpoint (the selected "
               "agent's): its cap, output tokens/s, requests waiting and KV use, one bar a server sample (wide "
               "screens, auto mode, or maximized with 3); the throughput sparkline; and per endpoint the KV estimate: "
               "how many conversations fit (from [endpoints.capacity], or the server's own capacity once it "
               "reports one) and the zone of those in flight: FITS, CLIFF (evicted prefixes are recomputed), "
               "OVERFLOW (the CPU tier is full too)."),
)

MODES = (
    ("sequential", "One agent at a time."),
    ("parallel", "Up to the cap (+/-), each endpoint's max_concurrency capping it further."),
    ("auto", "Each endpoint's cap follows what its server sustains (queue, KV use, preemptions, prefix hits, "
             "throughput); +/- move its ceiling, and a lists every change with its reason."),
)
"""What `m` cycles through. Lowering a cap, in any mode, never stops a running agent."""

ATTENTION = (
    ("inbox (i)", "Every agent that needs you, newest first: a tool call to approve, killed (by its watchdog, "
                  "not by you), failed, its endpoint down, past its last stall warning. enter goes to it, d dismisses it; n on the main screen goes "
                  "to the next one and acts (an approval opens its prompt)."),
    ("approval (y)", "o approves the call once, a approves the tool for the rest of the run, d denies it (the "
                     "model is told you denied it), esc leaves it waiting."),
    ("bell", "A new item rings the terminal once per agent per change of its state: the bell and a desktop "
             "notification (OSC 9, OSC 777). [ui] notify = false turns it off."),
)


class HelpScreen(Screen):
    """Read-only; esc, q or ? goes back."""

    app: CerevisorApp
    BINDINGS = [
        Binding("escape,q,question_mark", "app.pop_screen", "Back", key_display="esc", id="help_close",
                tooltip="Back to the console"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help") as scroll:
            scroll.border_title = "help"
            yield Static(self._body(), id="help-body")
        yield Footer()

    def _body(self) -> Table:
        app = self.app
        v = {name: app.colour(name) for name in ("accent", "primary", "text-muted", "stall-warn", "stall-critical")}
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style=f"bold {v.get('accent', '')}", no_wrap=True)
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column(ratio=1)
        for binding in MAIN_BINDINGS:
            keys.add_row(Text(effective_keys(binding, app.keymap)), Text(binding.description), Text(binding.tooltip))
        keys.add_row(Text("ctrl+p"), Text("Palette"),
                     Text("Every action by name, and themes; also Probe endpoint (sweep it and apply the "
                          "recommended cap) and Resume last run (when the last run of this config did not complete)."))
        keys.add_row(Text("tab"), Text("Focus"), Text("Move between the agents and the stream."))

        panes = Table.grid(padding=(0, 2))
        panes.add_column(style="bold", no_wrap=True)
        panes.add_column(ratio=1)
        for name, text in PANES:
            panes.add_row(Text(name), Text(text))

        modes = Table.grid(padding=(0, 2))
        modes.add_column(style="bold", no_wrap=True)
        modes.add_column(ratio=1)
        for name, text in MODES:
            modes.add_row(Text(name), Text(text))

        stall = Text()
        warn_at = app.config.stall.warn_at or []
        stall.append("■ amber", style=f"bold {v.get('stall-warn', 'yellow')}")
        stall.append(f"  the agent has used {warn_at[0]:.0%} of a deadline without a sign of life\n"
                     if warn_at else "  past the first warning\n")
        stall.append("■ red", style=f"bold {v.get('stall-critical', 'red')}")
        stall.append(f"    past {warn_at[-1]:.0%}: it will be killed at 0:00 unless the server is busy "
                     "or you extend it (e)" if warn_at else "  past the last warning")

        files = Text()
        files.append("config   ", style="bold")
        files.append(str(app.config_path) if app.config_path else "none found: the built-in demo")
        files.append("\nsaves to ", style="bold")
        files.append(str(app.save_path) if app.save_path else "-")
        files.append("\nrun dir  ", style="bold")
        files.append(app.mirror.run_dir or "-")
        files.append("  (events.jsonl, transcripts/, report.json)", style=v.get("text-muted", ""))

        page = Table.grid(padding=(0, 0))
        page.add_column(ratio=1)
        heading = f"bold {v.get('primary', '')}"
        page.add_row(Text("Keys", style=heading))
        page.add_row(keys)
        page.add_row(Text("Remap any key under [ui.keys] in the config by its id, e.g. toggle_mode = \"M\".",
                          style=v.get("text-muted", "")))
        page.add_row(Text("\nModes", style=heading))
        page.add_row(modes)
        page.add_row(Text("Switching is live; lowering a cap never stops a running agent, it only holds new ones.",
                          style=v.get("text-muted", "")))
        page.add_row(Text("\nPanes", style=heading))
        page.add_row(panes)
        attention = Table.grid(padding=(0, 2))
        attention.add_column(style="bold", no_wrap=True)
        attention.add_column(ratio=1)
        for name, text in ATTENTION:
            attention.add_row(Text(name), Text(text))
        page.add_row(Text("\nWhen an agent needs you", style=heading))
        page.add_row(attention)
        page.add_row(Text("\nStall colours", style=heading))
        page.add_row(stall)
        page.add_row(Text("\nFiles", style=heading))
        page.add_row(files)
        return page
