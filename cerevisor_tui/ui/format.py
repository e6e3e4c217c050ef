"""How numbers, statuses and deadlines read in the console: pure functions, no Textual."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cerevisor_tui.contract import events as ev
from cerevisor_tui.kinds import Status
from cerevisor_tui.ui.mirror import FINAL, AgentView


@dataclass(frozen=True, slots=True)
class StatusLook:
    """How the console shows one agent status."""

    label: str  # what the agents pane and the stream's title say
    rank: int  # the status sort: what needs the operator first, then what runs, then what waits, then what ended
    role: str  # the theme colour of its cell (a stall countdown's level overrides it)


STATUS_LOOK: dict[Status, StatusLook] = {
    "approval": StatusLook("needs approval", 0, "warning"),
    "stalling": StatusLook("stalling", 1, "stall-warn"),
    "wedged": StatusLook("wedged", 2, "error"),  # its server is wedged (engine/wedge.py)
    "failed": StatusLook("failed", 3, "error"),
    "killed": StatusLook("killed", 4, "error"),
    "waiting": StatusLook("loading", 5, "warning"),  # its local endpoint still loading (its port refused)
    "retrying": StatusLook("retrying", 6, "warning"),
    "tool": StatusLook("tool", 7, "accent"),  # a running call shows as `tool: NAME 3.2s` (`tool_status`)
    "prefill": StatusLook("prefill", 8, "primary"),
    "streaming": StatusLook("streaming", 9, "success"),
    "idle": StatusLook("idle", 10, "text-muted"),  # a gateway session between requests, holding its slot
    "queued": StatusLook("queued", 11, "text-muted"),
    "released": StatusLook("released", 12, "text-muted"),  # a gateway session without a slot
    "pending": StatusLook("pending", 13, "text-muted"),
    "completed": StatusLook("done", 14, "success"),
    "skipped": StatusLook("skipped", 15, "text-muted"),
    "cancelled": StatusLook("cancelled", 16, "text-muted"),
}
"""Each status the engine tells (kinds.Status), once: its label, its place in the sort, its colour."""


def status_label(status: str) -> str:
    look = STATUS_LOOK.get(status)  # type: ignore[call-overload]
    return look.label if look is not None else status


def session_status(status: str) -> str:
    """A gateway session's status as the console says it: "ended" (with the run) where an agent is "done"."""
    return "ended" if status == "completed" else status_label(status)


NORMAL, WARN, CRITICAL = "", "warn", "critical"


def fmt_clock(seconds: float) -> str:
    """A countdown or an elapsed time: 9:58, 1:02:03."""
    seconds = max(0, math.ceil(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def fmt_for(seconds: int) -> str:
    """How long a state has held: 42 s, 3:05 past two minutes, 1:02:03 past an hour."""
    return f"{seconds} s" if seconds < 120 else fmt_clock(seconds)


ENDPOINT_STATE_ROLES = {"up": "success", "loading": "warning", "down": "error", "wedged": "error"}
"""The theme colour of each endpoint state (contract/events.py EndpointState), in the header and the load pane."""


def endpoint_state_text(state: str, seconds: int | None) -> str:
    """An endpoint's state as shown beside its name: "down 42 s"; "up" alone (how long it is up is no news), and
    any state alone where how long is not known."""
    return state if state == "up" or seconds is None else f"{state} {fmt_for(seconds)}"


def fmt_count(n: float) -> str:
    """Token counts: 812, 12.4k, 3.1M."""
    if n < 1000:
        return f"{n:.0f}"
    if n < 1_000_000:
        return f"{n / 1000:.1f}k"
    return f"{n / 1_000_000:.1f}M"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}"


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.0f}s"


def fmt_percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def fmt_number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


@dataclass(frozen=True, slots=True)
class Countdown:
    """The nearest deadline of an agent's running attempt, as the operator sees it."""

    label: str  # "first 29:42" / "idle 0:12"
    remaining_s: float
    fraction: float  # of the deadline window already used
    level: str  # NORMAL | WARN | CRITICAL


def countdown(agent: AgentView, warn_at: tuple[float, ...], now: float) -> Countdown | None:
    """Amber (WARN) past the first warn_at fraction, red (CRITICAL) past the last; None when nothing runs."""
    att = agent.attempt
    if att is None or agent.status in FINAL or agent.status == "retrying":
        return None
    deadline_at = att.deadline_at
    if not math.isfinite(deadline_at):
        return None
    return _countdown("first" if att.phase == "first_byte" else "idle", att.base, deadline_at, warn_at, now)


def _countdown(label: str, base: float, deadline: float, warn_at: tuple[float, ...], now: float) -> Countdown:
    """A window from `base` to `deadline`: amber past its first warn_at fraction, red past its last."""
    window = deadline - base
    remaining = deadline - now
    fraction = (now - base) / window if window > 0 else 1.0
    level = NORMAL
    if warn_at and fraction >= warn_at[-1]:
        level = CRITICAL
    elif warn_at and fraction >= warn_at[0]:
        level = WARN
    return Countdown(f"{label} {fmt_clock(remaining)}", remaining, fraction, level)


def prefill_status(progress: ev.PrefillProgress, now: float) -> str:
    """An attempt's prefill as its status: `prefill 63% · 40 s` (the server's progress, the time left at its
    rate counting down), `prefill 63%` before a rate, `prefill ~40% (est.)` where the share is an estimate."""
    share = progress.processed / progress.total if progress.total > 0 else 0.0
    if progress.estimated:  # the share goes on at the measured rate, short of the whole prompt
        if progress.rate_tok_s and progress.total > 0:
            share = min(0.99, (progress.processed + progress.rate_tok_s * max(0.0, now - progress.t)) / progress.total)
        return f"prefill ~{share:.0%} (est.)"
    if progress.eta_s is None:
        return f"prefill {share:.0%}"
    left = max(0.0, progress.eta_s - (now - progress.t))
    return f"prefill {share:.0%} · {left:.0f} s" if left < 59.5 else f"prefill {share:.0%} · {fmt_clock(left)}"


def tool_status(tool: str, elapsed_s: float, width: int = 20) -> str:
    """`tool: NAME 3.2s` in at most `width` cells: a long tool name is cut, the time always shows."""
    elapsed = f"{elapsed_s:.1f}s" if elapsed_s < 100 else fmt_clock(elapsed_s)
    room = width - len("tool:  ") - len(elapsed)
    name = tool if len(tool) <= room else tool[:max(1, room - 1)] + "…"
    return f"tool: {name} {elapsed}"


def tool_countdown(deadline: float | None, warn_at: tuple[float, ...], started: float, now: float) -> Countdown | None:
    """The running tool call's countdown to its tool deadline (None: it has none); coloured as a stall's."""
    if deadline is None or not math.isfinite(deadline):
        return None
    return _countdown("tool", started, deadline, warn_at, now)


def live_rate(agent: AgentView, now: float) -> float | None:
    """Output tokens/s of the running attempt while it streams, else the agent's average so far."""
    att = agent.attempt
    if att is not None and att.first_token_at is not None and att.tokens > 1:
        elapsed = now - att.first_token_at
        if elapsed > 0.2:
            return att.tokens / elapsed
    return agent.output_tokens_per_s
