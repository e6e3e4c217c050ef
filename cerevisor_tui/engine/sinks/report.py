"""The run report: a subscriber that turns the event stream into `report.json` (schema_version 1)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import msgspec

from cerevisor_tui.config.paths import write_json_atomic  # noqa: F401 - the journal and the console write with it
from cerevisor_tui.contract import events as ev
from cerevisor_tui.kinds import FINAL_STATUSES, FORGOTTEN

SCHEMA_VERSION = 1
STATUSES = FINAL_STATUSES  # an agent's status in the report, and the totals counted by it, in this order


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Report:
    """Collects per-agent figures from events; `to_dict()` is the report at any moment."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now  # the run's clock: the events' times are on it, and a report mid-run ends at its now
        self.run_id = ""
        self.mode = ""
        self.started_at = ""
        self.finished_at: str | None = None
        self.endpoints: list[dict[str, Any]] = []
        self.agents: dict[str, dict[str, Any]] = {}
        self.sessions: dict[str, dict[str, Any]] = {}  # a gateway's sessions (SessionOpened), apart from the workflow
        # sessions the run forgot (idle for [gateway] forget_after_s): their name may open a new one, listed apart
        self.forgotten: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._t_end: float | None = None
        self._running: set[str] = set()
        self.max_running = 0
        self.cost_usd = 0.0  # the run's, on priced endpoints (AgentMeters)
        # each endpoint's cap over the run: [(t, cap, reason)], and its own max_concurrency
        self.caps: dict[str, list[tuple[float, int, str]]] = {}
        self._endpoint_max: dict[str, int] = {}
        self._handlers = ev.handlers(self, "_on_")  # TokenDelta and KeepAlive have none: not in the report

    def __call__(self, event: ev.Event) -> None:
        handler = self._handlers.get(event.kind)
        if handler is not None:
            handler(event)

    def _on_RunStarted(self, event: ev.RunStarted) -> None:
        self.run_id, self.mode = event.run_id, event.mode
        self.endpoints = [_endpoint_entry(ep) for ep in event.endpoints]
        self.started_at, self._t0 = _now_iso(), event.t
        self._endpoint_max = {ep.name: ep.max_concurrency for ep in event.endpoints}
        self.caps = {name: [] for name in self._endpoint_max}
        if event.mode != "auto":  # auto's controllers say their start caps themselves
            cap = 1 if event.mode == "sequential" else event.max_concurrency
            self._cap_all(event.t, cap, f"{event.mode}, cap {cap}")
        for wave, names in enumerate(event.waves):
            for name in names:
                self.agents[name] = {
                    "name": name, "wave": wave, "status": "pending", "attempts": 0, "turns": 0,
                    "prompt_tokens": 0, "completion_tokens": 0, "ttft_s": None, "duration_s": 0.0,
                    "output_tokens_per_s": None, "stall_warnings": 0, "error": "", "rerun_reason": "",
                    "_decode_s": 0.0, "_decoded": 0, "_t_start": None,
                }

    def _on_SessionOpened(self, event: ev.SessionOpened) -> None:
        earlier = self.sessions.get(event.agent)
        if earlier is not None:  # a resumed run's session, opened again: its figures go on
            earlier["status"] = "active"
            return
        self.sessions[event.agent] = {
            "name": event.agent, "source": event.source, "harness": event.harness, "api": event.api,
            "endpoint": event.endpoint, **({"key": event.key} if event.key else {}), "status": "active",
            "attempts": 0, "turns": 0, "unanswered": 0, "prompt_tokens": 0, "completion_tokens": 0, "ttft_s": None,
            "duration_s": 0.0, "output_tokens_per_s": None, "stall_warnings": 0, "kills": [], "error": "",
            "_decode_s": 0.0, "_decoded": 0, "_t_start": None,
        }

    def _of(self, agent: str) -> dict[str, Any]:
        """An agent's figures, or a gateway session's."""
        found = self.agents.get(agent)
        return found if found is not None else self.sessions[agent]

    def _on_AgentKilled(self, event: ev.AgentKilled) -> None:
        session = self.sessions.get(event.agent)
        if session is not None:  # a session goes on after a killed request: each kill is kept with its reason
            session["kills"].append({"request": event.attempt, "deadline": event.deadline, "reason": event.reason})
        elif event.agent in self.agents:  # an agent's kills, each with its reason (a retry may follow)
            self.agents[event.agent].setdefault("kills", []).append(
                {"attempt": event.attempt, "deadline": event.deadline, "reason": event.reason})

    def _on_ServerWedged(self, event: ev.ServerWedged) -> None:  # an endpoint's wedges, with what they killed
        entry = next((ep for ep in self.endpoints if ep.get("name") == event.endpoint), None)
        if entry is not None and not event.over:
            entry.setdefault("wedges", []).append({"t_s": round(event.t - self._t0, 3), "rule": event.rule,
                                                   "reason": event.reason, "agents": list(event.agents)})

    def _endpoint(self, name: str) -> dict[str, Any] | None:
        return next((entry for entry in self.endpoints if entry.get("name") == name), None)

    def _on_EndpointWarmed(self, event: ev.EndpointWarmed) -> None:  # its cold start: the warm-up's TTFT
        entry = self._endpoint(event.endpoint)
        if entry is not None:
            entry["cold_start_s"] = event.cold_start_s
            if event.error:
                entry["warmup_error"] = event.error

    def _on_LatencySample(self, event: ev.LatencySample) -> None:
        """The endpoint's latency figures: its last window in which anything was observed."""
        entry = self._endpoint(event.endpoint)
        if entry is None:
            return
        figures = {name: msgspec.to_builtins(q) if q is not None else None for name, q in (
            ("ttft", event.ttft), ("inter_token", event.inter_token), ("queue", event.queue),
            ("prefill", event.prefill))}
        if any(figures.values()) or "latency" not in entry:
            entry["latency"] = {"source": event.source, "window_s": event.window_s, **figures}
        if event.decode_stall_s:
            entry["decode_stall_max_s"] = max(entry.get("decode_stall_max_s", 0.0), event.decode_stall_s)

    def _on_ModeChanged(self, event: ev.ModeChanged) -> None:
        self.mode = event.mode
        if event.mode != "auto":
            self._cap_all(event.t, event.effective_cap, f"mode {event.mode}")

    def _on_ConcurrencyChanged(self, event: ev.ConcurrencyChanged) -> None:
        if event.endpoint:
            self._cap(event.endpoint, event.t, event.effective_cap, event.reason)
        elif self.mode == "parallel":  # (in auto mode a run-wide change moves the ceiling, not a cap)
            self._cap_all(event.t, event.max_concurrency, event.reason or f"cap {event.max_concurrency}")

    def _on_AgentStarted(self, event: ev.AgentStarted) -> None:
        a = self._of(event.agent)
        a["attempts"] += 1  # every request sent, over all turns: retries and restarts included
        if a["_t_start"] is None:
            a["_t_start"] = event.t
        self._running.add(event.agent)
        self.max_running = max(self.max_running, len(self._running))

    def _on_TurnFinished(self, event: ev.TurnFinished) -> None:
        a = self._of(event.agent)
        if not event.answered:  # a session's request that ended without its answer: a request, never a turn
            a["unanswered"] = a.get("unanswered", 0) + 1
            a["completion_tokens"] += event.completion_tokens
            return
        a["turns"] += 1
        a["prompt_tokens"] += event.prompt_tokens
        a["completion_tokens"] += event.completion_tokens
        if event.ttft_s is None:  # no first token seen (an answer that came in one piece): no decode rate to read
            return
        if a["ttft_s"] is None:
            a["ttft_s"] = round(event.ttft_s, 4)
        a["_decode_s"] += event.duration_s - event.ttft_s
        a["_decoded"] += event.completion_tokens
        if a["_decode_s"] > 0:
            a["output_tokens_per_s"] = round(a["_decoded"] / a["_decode_s"], 2)

    def _on_StallWarning(self, event: ev.StallWarning) -> None:
        self._of(event.agent)["stall_warnings"] += 1

    def _on_ToolCallFinished(self, event: ev.ToolCallFinished) -> None:  # an agent with tools: its calls by outcome (ok, error, ...)
        calls = self._of(event.agent).setdefault("tool_calls", {})
        calls[event.outcome] = calls.get(event.outcome, 0) + 1

    def _on_AgentPlaced(self, event: ev.AgentPlaced) -> None:  # a pool's agent: where it ran (its last member)
        a = self._of(event.agent)
        a["pool"], a["endpoint"] = event.pool, event.endpoint
        if event.moved_from:
            a["moves"] = a.get("moves", 0) + 1

    def _on_AgentMeters(self, event: ev.AgentMeters) -> None:
        a = self._of(event.agent)
        if event.cached_tokens is not None:  # only where the server says (vLLM --enable-prompt-tokens-details)
            a["cached_tokens"] = a.get("cached_tokens", 0) + event.cached_tokens
        if event.cost_usd or "cost_usd" in a:  # priced endpoints only
            a["cost_usd"] = event.cost_usd
        self.cost_usd = event.run_cost_usd

    def _on_AgentRerun(self, event: ev.AgentRerun) -> None:
        self._of(event.agent)["rerun_reason"] = event.reason

    def _on_AgentFinished(self, event: ev.AgentFinished) -> None:
        a = self._of(event.agent)
        a["status"], a["error"] = event.status, event.error
        if a["_t_start"] is not None:
            a["duration_s"] = round(event.t - a["_t_start"], 3)
        self._running.discard(event.agent)
        if event.agent in self.sessions and event.error.startswith(FORGOTTEN):
            self.forgotten.append(self.sessions.pop(event.agent))

    def _on_RunFinished(self, event: ev.RunFinished) -> None:
        self.finished_at, self._t_end = _now_iso(), event.t

    def _cap(self, endpoint: str, t: float, cap: int, reason: str) -> None:
        history = self.caps.setdefault(endpoint, [])
        if not history or history[-1][1] != cap:
            history.append((t, cap, reason))

    def _cap_all(self, t: float, cap: int, reason: str) -> None:
        for name, limit in self._endpoint_max.items():
            self._cap(name, t, min(cap, limit) if limit else cap, reason)

    def cap_summary(self) -> dict[str, Any]:
        """Each endpoint's cap history (seconds since the start) and its time-weighted mean cap over the run."""
        end = self._t_end if self._t_end is not None else self.now()
        out: dict[str, Any] = {}
        for name, history in self.caps.items():
            weighted = span = 0.0
            for i, (t, cap, _) in enumerate(history):
                until = history[i + 1][0] if i + 1 < len(history) else end
                weighted += cap * max(0.0, until - t)
                span += max(0.0, until - t)
            mean = weighted / span if span > 0 else (history[-1][1] if history else None)
            out[name] = {
                "history": [{"t_s": round(t - self._t0, 3), "cap": cap, "reason": reason} for t, cap, reason in history],
                "mean_cap": round(mean, 2) if mean is not None else None,
            }
        return out

    def finish(self, t: float) -> None:
        """Fix the end of the run's wall time (before RunFinished is emitted with the totals)."""
        self._t_end = t

    def replay(self, events: Iterable[ev.Event]) -> None:
        """Feed recorded events of an earlier run (a resumed run's completed agents) into the figures."""
        for event in events:
            match event:
                case ev.AgentFinished(agent=agent) if agent in self.sessions:
                    pass  # a session of the earlier run ended with it: it is reopened if it comes back
                case ev.RunStarted() | ev.RunFinished() | ev.ModeChanged() | ev.ConcurrencyChanged() | \
                        ev.AgentFinished() | ev.AgentRerun() | ev.EndpointWarmed() | ev.LatencySample():
                    continue  # the new run's own (it ends each agent itself); an agent's figures are what carries over
            try:
                self(event)
            except (TypeError, KeyError, ValueError, AttributeError):
                continue  # damaged (an agent's figures before its start): skip it rather than fail the resume

    def totals(self) -> ev.RunTotals:
        """The run's figures now, as report.json's `totals` and RunFinished have them."""
        agents = self.agents.values()
        end = self._t_end if self._t_end is not None else self.now()
        wall = max(0.0, end - self._t0) if self._t0 else 0.0
        sessions = (*self.forgotten, *self.sessions.values())
        output = sum(a["completion_tokens"] for a in (*agents, *sessions))
        # a gateway session's outcome counts as an agent's does (a killed session is a kill the operator must see)
        ended = (*agents, *sessions)
        counts = {s: sum(1 for a in ended if a["status"] == s) for s in STATUSES}
        return ev.RunTotals(
            agents=len(self.agents), **counts, output_tokens=output, wall_s=round(wall, 3),
            output_tokens_per_s=round(output / wall, 2) if wall > 0 else None, max_running=self.max_running,
            cost_usd=round(self.cost_usd, 6), sessions=len(sessions))

    def to_dict(self) -> dict[str, Any]:
        """The report as report.json holds it: JSON's own values only. A figure that is not a finite number (a
        cost past what a float holds) is null, never `Infinity` or `NaN`, which no strict JSON reader takes."""
        return msgspec.json.decode(msgspec.json.encode(self._figures()))  # (msgspec writes a non-finite float as null)

    def _figures(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "mode": self.mode,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "endpoints": self.endpoints,
            "agents": [{k: v for k, v in a.items() if not k.startswith("_")} for a in self.agents.values()],
            "totals": self.totals(),
            "caps": self.cap_summary(),
            **({"sessions": [_session_entry(a) for a in (*self.forgotten, *self.sessions.values())]}
               if self.sessions or self.forgotten else {}),
        }


def _session_entry(a: dict[str, Any]) -> dict[str, Any]:
    """A gateway session as report.json lists it: its requests (its attempts) and their figures."""
    out = {k: v for k, v in a.items() if not k.startswith("_") and k != "attempts"}
    out["requests"] = a["attempts"]
    if out["status"] == "completed":  # a session has no answer to complete: it ended with the run
        out["status"] = "ended"
    return out


def _endpoint_entry(ep: ev.EndpointSummary) -> dict[str, Any]:
    """An endpoint as report.json lists it: its prices only where it has them."""
    entry = msgspec.to_builtins(ep)
    if not ep.priced:
        del entry["price_in_per_mtok"], entry["price_out_per_mtok"]
    return entry
