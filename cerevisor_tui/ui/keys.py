"""The console's key bindings: one list that the main screen, the footer, the help screen and the
command palette all read. Every binding has an id, so `[ui.keys]` can remap it (`App.set_keymap`)."""

from __future__ import annotations

from textual.binding import Binding

CAP = Binding.Group("Cap", compact=True)

MAIN_BINDINGS: list[Binding] = [
    Binding("m", "toggle_mode", "Mode", id="toggle_mode",
            tooltip="Cycle the mode live: sequential → parallel → auto. Running agents are never stopped."),
    Binding("plus,equals_sign", "cap(1)", "Cap+", key_display="+", id="cap_up", group=CAP,
            tooltip="Raise the parallel cap (in auto mode, the ceiling) by one: more agents may run at once."),
    Binding("minus", "cap(-1)", "Cap-", key_display="-", id="cap_down", group=CAP,
            tooltip="Lower the parallel cap (in auto mode, the ceiling) by one; running agents go on."),
    # not in the footer, which has no room left at 80 columns; the help, the palette and the switch to auto name it
    Binding("a", "cap_history", "Caps", id="cap_history", show=False,
            tooltip="Every cap change of the run, who made it (you or auto) and why, newest first."),
    Binding("p", "pause", "Pause", id="pause",
            tooltip="Pause or resume admissions: queued agents wait, running ones go on."),
    Binding("k", "kill", "Kill", id="kill",
            tooltip="Kill the selected agent (asks first): its request is closed, no retry follows."),
    # a gateway session's row only (MainScreen.check_action): only a session holds a slot when idle. Not in the
    # footer, which has no room left at 80 columns (it pushed out `? Help` and `q Quit`); the help, the palette and
    # `k` on an idle session name it
    Binding("l", "release", "Release", id="release", show=False,
            tooltip="Give the selected idle gateway session's slot back now (asks first): the next session waiting "
                    "runs, and its own next request waits for a slot again."),
    Binding("e", "extend", "Extend", id="extend",
            tooltip="Move the selected agent's stall deadline later by stall.extend_s (default 300 s)."),
    Binding("r", "retry", "Retry", id="retry",
            tooltip="Restart the selected agent's attempt, or run a failed or killed agent again."),
    Binding("i", "inbox", "Inbox", id="inbox", show=False,
            tooltip="The attention inbox: every agent that needs you (approval, killed, failed, endpoint down, "
                    "about to be killed), newest first; enter goes to one, d dismisses it."),
    Binding("n", "next_attention", "Next", id="next_attention", show=False,
            tooltip="Go to the next agent in the inbox (newest first) and act on it: a tool call waiting for "
                    "approval opens its prompt."),
    Binding("y", "answer_approval", "Approve", id="answer_approval", show=False,
            tooltip="Answer the selected agent's tool call that needs approval: approve once, for the run, "
                    "or deny."),
    Binding("o", "cycle_sort", "Sort", id="cycle_sort", show=False,
            tooltip="Sort the agents: wave order → nearest deadline first → status → tokens/s. The cursor stays "
                    "on its agent as rows move."),
    Binding("slash", "filter", "Filter", key_display="/", id="filter", show=False,
            tooltip="Filter the agents by name or status as you type (e.g. fail, stall, approval); enter keeps "
                    "the filter, esc in the filter line clears it."),
    Binding("P", "probe_offer", "Probe", id="probe", show=False,
            tooltip="Probe an endpoint (the one offered on the line above the footer, else the first): what it "
                    "sends, then the sweep and the cap it recommends."),
    Binding("s", "settings", "Settings", id="settings",
            tooltip="Edit run, stall and endpoint settings, and save them to the config file."),
    Binding("enter", "open_stream", "Stream", id="open_stream", show=False,
            tooltip="Go into the stream pane of the selected agent (scroll with arrows, PgUp/PgDn)."),
    Binding("escape", "leave_stream", "Back", id="leave_stream", show=False,
            tooltip="Back from the stream pane to the agents; restores a maximized pane."),
    Binding("1", "maximize_pane('agents-pane')", "Agents", id="maximize_agents", show=False,
            tooltip="Maximize the agents pane (esc restores)."),
    Binding("2", "maximize_pane('stream-pane')", "Stream", id="maximize_stream", show=False,
            tooltip="Maximize the stream pane (esc restores)."),
    Binding("3", "maximize_pane('load-pane')", "Load", id="maximize_load", show=False,
            tooltip="Maximize the load pane (esc restores)."),
    Binding("question_mark", "help", "Help", key_display="?", id="help",
            tooltip="Keys, panes and what the colours mean."),
    Binding("q", "quit", "Quit", id="quit",
            tooltip="Quit; asks first while agents are running or queued. The run is stopped cleanly."),
]

PALETTE_NAMES: dict[str, str] = {
    "toggle_mode": "Cycle mode (sequential / parallel / auto)",
    "cap_up": "Raise concurrency cap",
    "cap_down": "Lower concurrency cap",
    "cap_history": "Cap changes and their reasons (auto)",
    "pause": "Pause / resume admissions",
    "kill": "Kill selected agent",
    "release": "Release selected session's slot",
    "extend": "Extend selected agent's deadline",
    "retry": "Retry selected agent",
    "inbox": "Attention inbox",
    "next_attention": "Next agent that needs you",
    "answer_approval": "Answer the selected agent's approval",
    "cycle_sort": "Sort agents (wave / deadline / status / tokens/s)",
    "filter": "Filter agents by name or status",
    "probe": "Probe the offered endpoint (asks first)",
    "settings": "Settings",
    "open_stream": "Open stream of selected agent",
    "leave_stream": "Back to agents",
    "maximize_agents": "Maximize agents pane",
    "maximize_stream": "Maximize stream pane",
    "maximize_load": "Maximize load pane",
    "help": "Help",
    "quit": "Quit",
}
"""What the command palette calls each action."""

TOUR: tuple[tuple[str, str], ...] = (
    ("toggle_mode", "mode"), ("cap_up", "cap"), ("extend", "extend"), ("kill", "kill"), ("cycle_sort", "sort"),
    ("maximize_load", "load"), ("help", "help"),
)
"""The keys the demo's first screen suggests, by binding id, with what each does; a key tried leaves the hint."""

BINDING_IDS = frozenset(b.id for b in MAIN_BINDINGS if b.id)


def effective_keys(binding: Binding, keymap: dict[str, str]) -> str:
    """The keys a binding answers to now, after `[ui.keys]` remaps, as the operator types them."""
    if binding.id and binding.id in keymap:
        return keymap[binding.id]
    if binding.key_display:
        return binding.key_display
    names = {"question_mark": "?", "slash": "/", "plus": "+", "minus": "-", "equals_sign": "=", "escape": "esc"}
    return ",".join(names.get(k, k) for k in binding.key.split(","))
