"""The header: endpoints and their states (up, or loading, down or wedged with how long and why), the mode badge, the cap, agent counts, throughput, wave; in auto
mode the badge carries the live cap (`AUTO 32`) and, where the line has room, auto's ceiling and its last
reason (`a` lists them all).

Two lines, each cut to the width, never wrapped: a first line that wrapped would push the second (mode,
cap, counters) out of the header. Where the endpoints do not fit, each loses its URL and model, then the line
shows only their health dots; the run clock and the run's state keep their place, and so do the counts of
what needs the operator (inbox N, agents in amber and red), shown only when there are any.

A run that serves a gateway says where on the first line (`gateway http://127.0.0.1:8100/v1`, the URL the
first to give way) and counts its sessions on the second (`3 sessions: 1 busy 1 idle 1 queued`),
apart from the workflow's agents; a run of sessions alone shows no waves and no agent counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from rich.text import Text
from textual.widgets import Static

from cerevisor_tui.ui.format import ENDPOINT_STATE_ROLES, endpoint_state_text, fmt_clock, fmt_rate
from cerevisor_tui.ui.mirror import ACTIVE, FINAL, RunMirror

MODE_ROLES = {"sequential": "secondary", "parallel": "primary", "auto": "accent"}


@dataclass(frozen=True)
class HeaderState:
    """Everything the header shows; compared to skip a redraw when nothing changed."""

    mode: str
    cap: int
    effective_cap: int
    paused: bool
    fit: int | None  # set when the cap is past what fits in an endpoint's KV memory
    running: int
    queued: int
    done: int
    failed: int
    killed: int
    tokens_per_s: float
    wave: int
    waves: int
    elapsed_s: int
    health: tuple[tuple[str, tuple[str, str, int | None] | None], ...]  # each endpoint's state, why, seconds in it
    models: tuple[str, ...]
    wheres: tuple[str, ...]  # each endpoint's URL, or its kind where that says more ("simulated")
    simulated: bool
    finished: bool
    stopping: str
    error: str
    ceiling: int | None = None  # auto's ceiling
    last_reason: str = ""  # auto's last change, as shown: "sim: 24 -> 32 (throughput +18% at 24, ...)"
    width: int = 0
    inbox: int = 0  # agents that need the operator (the attention inbox, i)
    amber: int = 0  # agents whose countdown is amber, and red
    red: int = 0
    gateway: bool = False  # the run serves a gateway
    gateway_url: str = ""
    sessions: tuple[tuple[str, int], ...] = ()  # ("sessions", N), then each state with any: ("busy", 1), ...
    workflow: bool = True  # the run has agents of its own (or waves): its counters show
    warming: bool = False  # at the start: the warm-up's requests are out (`[run] warmup`)


def reason_text(endpoint: str, reason: str) -> str:
    """A cap change as the header shows it: `sim: 24 -> 32 (why)`."""
    text = reason.removeprefix("auto: ")
    return f"{endpoint}: {text}" if endpoint else text


SESSION_STATES = (("busy", ACTIVE - {"idle"}), ("idle", {"idle"}), ("queued", {"queued"}),
                  ("released", {"released"}), ("ended", FINAL))
"""How the header counts a gateway's sessions: a request in flight, holding a slot between requests, a request
waiting for a slot, the slot given back, ended (with the run)."""


def session_counts(statuses: list[str]) -> tuple[tuple[str, int], ...]:
    """("sessions", N) then each of SESSION_STATES that any session is in, with how many."""
    counts = [("sessions", len(statuses))]
    for label, states in SESSION_STATES:
        n = sum(1 for s in statuses if s in states)
        if n:
            counts.append((label, n))
    return tuple(counts)


REASON_MIN_CELLS = 24
"""The header shows auto's last reason only where at least this much of it fits."""


class RunHeader(Static):
    """Two lines, redrawn from the engine's state only when what they show changed."""

    DEFAULT_CSS = """
    RunHeader {
        height: 2;
        background: $panel;
        color: $foreground;
        padding: 0 1;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: HeaderState | None = None

    def invalidate(self) -> None:
        """Redraw at the next sync (the theme changed)."""
        self._shown = None

    def on_resize(self) -> None:
        """What fits changed: redraw now rather than at the next status refresh."""
        shown = self._shown
        if shown is not None and shown.width != self.content_size.width:
            self._draw(replace(shown, width=self.content_size.width))

    def sync(self, mirror: RunMirror, now: float, *, error: str = "", amber: int = 0,
             red: int = 0) -> bool:
        """Redraw if anything shown changed; returns whether it did. `amber`, `red`: agents whose countdown is
        that colour (the agents table counts them as it draws their rows)."""
        agents = mirror.workflow_agents
        counts = Counter(a.status for a in agents)
        sessions = [a.status for a in mirror.sessions]
        started = mirror.started_at
        elapsed = (now - started) if started is not None else 0.0
        if mirror.finished is not None and started is not None:
            elapsed = mirror.finished.t - started
        auto = mirror.mode == "auto"
        last = mirror.last_cap_change if auto else None
        endpoints = mirror.endpoints.values()
        state = HeaderState(
            mode=mirror.mode, cap=mirror.run_cap, effective_cap=mirror.effective_cap, paused=mirror.paused,
            fit=mirror.fit_below_cap(),
            running=sum(counts[s] for s in ACTIVE), queued=counts["queued"], done=counts["completed"],
            failed=counts["failed"], killed=counts["killed"], tokens_per_s=round(mirror.tokens_per_s(now), 1),
            wave=mirror.wave, waves=len(mirror.waves), elapsed_s=int(elapsed),
            health=tuple((ep.name, mirror.state_of(ep.name, mirror.finished.t if mirror.finished else now))
                         for ep in endpoints),
            models=tuple(ep.model for ep in endpoints),
            wheres=tuple(ep.kind if ep.kind == "simulated" else ep.base_url for ep in endpoints),
            simulated=any(ep.kind == "simulated" for ep in endpoints),  # the run's own endpoints, config or not
            finished=mirror.finished is not None, stopping=mirror.stopping, error=error,
            ceiling=mirror.auto_ceiling if auto else None,
            last_reason=reason_text(last.endpoint, last.reason) if last is not None else "",
            width=self.content_size.width, inbox=len(mirror.inbox), amber=amber, red=red,
            gateway=mirror.serves_gateway, gateway_url=mirror.gateway_url,
            sessions=session_counts(sessions) if mirror.serves_gateway else (),
            workflow=bool(agents or mirror.waves) or not mirror.serves_gateway,
            warming=any(ep.warmup == "warming" for ep in endpoints),
        )
        if state == self._shown:
            return False
        self._draw(state)
        return True

    def _draw(self, state: HeaderState) -> None:
        self._shown = state
        # two lines, always: no layout pass needed
        self.update(self._text(state), layout=False)

    def _c(self, name: str) -> str:
        return self.app.colour(name)  # type: ignore[attr-defined]

    def _endpoints(self, s: HeaderState, detail: str) -> Text:
        """Each endpoint's state dot, with `detail` "full" its name and URL (or kind) and model, or, when it is not
        up, its state, since when and why (`vllm0 down 42 s: connection refused at 127.0.0.1:8399`); "names" its
        name and a state other than up."""
        text = Text()
        if detail == "dots":
            text.append(" ")
        for (name, told), model_id, where in zip(s.health, s.models, s.wheres, strict=True):
            role = ENDPOINT_STATE_ROLES.get(told[0], "text-muted") if told is not None else "text-muted"
            dot = "●" if told is not None else "○"
            if detail == "dots":
                text.append(dot, style=self._c(role))
                continue
            text.append("  ")
            text.append(dot, style=self._c(role))
            text.append(f" {name}", style="bold")
            if told is not None and told[0] != "up":
                state, why, seconds = told
                text.append(f" {endpoint_state_text(state, seconds)}", style=f"bold {self._c(role)}")
                if detail == "full" and why:
                    text.append(f": {why}", style=self._c("text-muted"))
            elif detail == "full":
                text.append(f" {where}" + (f" · {model_id}" if model_id else ""), style=self._c("text-muted"))
        if detail == "dots":
            text.append(f" {len(s.health)} endpoints", style=self._c("text-muted"))
        return text

    def _text(self, s: HeaderState) -> Text:
        bg = self._c("background") or "black"
        line1 = Text(no_wrap=True, overflow="ellipsis")
        line1.append("cerevisor", style=f"bold {self._c('primary')}")
        if s.simulated:
            line1.append(" ")
            line1.append(" SIMULATED ", style=f"bold {bg} on {self._c('warning')}")
        tail = Text()
        if s.inbox:
            tail.append(f"  inbox {s.inbox}", style=f"bold {bg} on {self._c('error')}")
        if s.amber:
            tail.append(f"  {s.amber} amber", style=f"bold {self._c('stall-warn')}")
        if s.red:
            tail.append(f"  {s.red} red", style=f"bold {self._c('stall-critical')}")
        tail.append(f"  run {fmt_clock(s.elapsed_s)}", style=self._c("text-muted"))
        bad = s.failed + s.killed
        if s.error:
            tail.append(f"  engine stopped: {s.error}", style=f"bold {self._c('error')}")
        elif s.finished:
            tail.append("  FINISHED", style=f"bold {self._c('warning') if bad else self._c('success')}")
        elif s.stopping:
            tail.append("  STOPPING", style=f"bold {self._c('warning')}")
        gateway = Text()
        if s.gateway:
            gateway.append("  gateway", style="bold")
            if s.gateway_url:
                gateway.append(f" {s.gateway_url}", style=self._c("text-muted"))
        room = s.width - line1.cell_len - tail.cell_len - gateway.cell_len
        endpoints = self._endpoints(s, "full")
        for detail in ("names", "dots"):  # fewer words until they fit
            if not s.width or endpoints.cell_len <= room:
                break
            endpoints = self._endpoints(s, detail)
        if s.width and s.gateway_url and endpoints.cell_len > room:  # its URL gives way after the endpoints'
            gateway = Text("  gateway", style="bold")
        line1.append_text(endpoints)
        line1.append_text(gateway)
        line1.append_text(tail)

        line2 = Text(no_wrap=True, overflow="ellipsis")
        badge = f" {s.mode.upper()} {s.effective_cap} " if s.mode == "auto" else f" {s.mode.upper()} "
        line2.append(badge, style=f"bold {bg} on {self._c(MODE_ROLES.get(s.mode, 'primary'))}")
        if s.mode != "auto":
            line2.append(f" cap {s.effective_cap if s.mode == 'sequential' else s.cap}", style="bold")
        if s.fit is not None:
            line2.append(f" > fit {s.fit}", style=f"bold {self._c('warning')}")
        if s.paused and not s.stopping:
            line2.append(" ")
            line2.append(" PAUSED ", style=f"bold {bg} on {self._c('stall-warn')}")
        if s.workflow:
            if s.wave < 0 and s.warming:
                line2.append("  warming up", style=f"bold {self._c('warning')}")
            else:
                line2.append(f"  wave {s.wave + 1}/{s.waves}" if s.wave >= 0 else f"  wave -/{s.waves}")
            line2.append("  ")
            line2.append(f"{s.running} running", style=f"bold {self._c('success')}" if s.running else "")
            line2.append(f" {s.queued} queued {s.done} done ")
            line2.append(f"{s.failed} failed" + (f" {s.killed} killed" if s.killed else ""),
                         style=f"bold {self._c('error')}" if bad else "")
        if s.sessions:
            self._sessions(line2, s)
        line2.append(f"  {fmt_rate(s.tokens_per_s)} tok/s", style="bold")
        if s.mode == "auto":
            self._auto_extras(line2, s, len(badge))
        return Text("\n", no_wrap=True, overflow="ellipsis").join([line1, line2])

    def _sessions(self, line: Text, s: HeaderState) -> None:
        """`3 sessions: 1 busy 1 idle 1 queued` (the first line names the gateway and where it serves)."""
        (_, total), *states = s.sessions
        line.append("  ")
        line.append(f"{total} session" + ("s" if total != 1 else ""), style="bold" if total else "")
        if states:
            line.append(": ")
            for i, (label, n) in enumerate(states):
                style = f"bold {self._c('success')}" if label == "busy" else ""
                line.append(("" if i == 0 else " ") + f"{n} {label}", style=style)

    def _auto_extras(self, line: Text, s: HeaderState, after: int) -> None:
        """Auto's ceiling after the badge, then its last reason at the end, each only where it fits: the mode,
        the cap and the counters always keep their place at 80 columns."""
        muted = self._c("text-muted")
        if s.ceiling is not None:
            ceiling = f" ceiling {s.ceiling}"
            if line.cell_len + len(ceiling) <= s.width:
                tail = line[after:]
                line.right_crop(line.cell_len - after)
                line.append(ceiling, style=muted)
                line.append_text(tail)
        if s.last_reason and s.width - line.cell_len - 2 >= REASON_MIN_CELLS:
            line.append(f"  {s.last_reason}", style=muted)
