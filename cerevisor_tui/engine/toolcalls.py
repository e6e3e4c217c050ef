"""Agents' MCP tool calls for one run: each call's permission (the server's rules, the operator's answer, or
headless policy), its execution under its own deadline, and what the model is told; the operator's kill,
extend, approve and deny act here. A resumed run reuses a call's result from the journal instead of running
it again, and keeps the tools approved "for the run"."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.state import AgentState, ToolCall
from cerevisor_tui.engine.watchdog import extend_tool, watch_tool
from cerevisor_tui.tools.manager import McpServers, ToolCallError, Toolset
from cerevisor_tui.tools.permissions import Approvals, rule_for
from cerevisor_tui.tools.schemas import capped, parse_arguments, preview, result_text, shown_arguments

AskPolicy = Literal["operator", "deny", "approve"]
"""What `ask` means in this run: wait for the operator (a console may answer), or, headless, deny
(the default of `run`) or approve (`run --approve-all`)."""


@dataclass(eq=False)
class _Pending:
    server: str
    tool: str
    decided: anyio.Event = field(default_factory=anyio.Event)
    decision: str = ""


class ToolMemory:
    """What an earlier run of this run directory got from its tools, per agent: the results a resumed run
    hands back instead of calling again, keyed by function name and arguments (in order, for repeats)."""

    def __init__(self) -> None:
        self.results: dict[tuple[str, str, str], list[str]] = defaultdict(list)
        self.approved: set[tuple[str, str]] = set()

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]]) -> ToolMemory:
        memory = cls()
        calls: dict[tuple[str, str], tuple[str, str]] = {}
        answered: dict[tuple[str, str], str] = {}
        good: set[tuple[str, str]] = set()
        for r in records:
            kind, agent = r.get("event"), r.get("agent")
            if kind == "MessageRecorded" and isinstance(agent, str):
                if r.get("role") == "assistant" and not r.get("partial"):
                    for c in r.get("tool_calls") or ():
                        fn = c.get("function") or {}
                        calls[(agent, str(c.get("id")))] = (str(fn.get("name")), _canonical(fn.get("arguments")))
                elif r.get("role") == "tool" and r.get("tool_call_id"):
                    answered[(agent, str(r["tool_call_id"]))] = str(r.get("content", ""))
            elif kind == "ToolCallFinished" and r.get("outcome") in ("ok", "error") and isinstance(agent, str):
                good.add((agent, str(r.get("call_id"))))
            elif kind == "ApprovalDecided" and r.get("decision") == "run":
                memory.approved.add((str(r.get("server")), str(r.get("tool"))))
        for key, content in answered.items():
            if key in good and key in calls:
                memory.results[(key[0], *calls[key])].append(content)
        return memory

    def take(self, agent: str, function: str, arguments: str) -> str | None:
        found = self.results.get((agent, function, _canonical(arguments)))
        return found.pop(0) if found else None


def _canonical(arguments: Any) -> str:
    """Arguments text in one form, so the same call compares equal however its JSON was spaced."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


class ToolCalls:
    """The run's tool calls: `run` executes one call of an agent and returns what the model is told."""

    def __init__(self, servers: McpServers, *, emit: Callable[[ev.Event], None], scrub: Scrubber,
                 ask: AskPolicy = "operator", memory: ToolMemory | None = None) -> None:
        self.servers = servers
        self.emit = emit
        self.scrub = scrub
        self.ask = ask
        self.memory = memory or ToolMemory()
        self.approvals = Approvals(self.memory.approved)
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.running: dict[str, tuple[ToolCall, int]] = {}  # agent -> its running call, and the attempt it answers

    async def toolset(self, agent: Any) -> Toolset | None:
        """The tools an agent is offered, once their servers have started; None without `tools`. Raises
        ToolSetupError."""
        return await self.servers.toolset(agent) if agent.tools else None

    # ---- the operator ---------------------------------------------------------------------------------
    def approve(self, agent: str, call_id: str, scope: str) -> None:
        pending = self._pending(agent, call_id)
        if scope == "run":
            self.approvals.approve_for_run(pending.server, pending.tool)
        self._decide(agent, call_id, pending, "run" if scope == "run" else "once")

    def deny(self, agent: str, call_id: str) -> None:
        self._decide(agent, call_id, self._pending(agent, call_id), "deny")

    def _pending(self, agent: str, call_id: str) -> _Pending:
        pending = self.pending.get((agent, call_id))
        if pending is None or pending.decision:
            raise ValueError(f"no such tool call {call_id!r} waiting for approval on {agent}")
        return pending

    def _decide(self, agent: str, call_id: str, pending: _Pending, decision: str) -> None:
        pending.decision = decision
        self.emit(ev.ApprovalDecided(time.monotonic(), agent, call_id, pending.server, pending.tool,
                                     decision, "operator"))  # type: ignore[arg-type]
        pending.decided.set()

    def kill(self, agent: str, reason: str) -> bool:
        """Cancel the agent's running tool call (the model is told); False: none runs."""
        running = self.running.get(agent)
        if running is None:
            return False
        running[0].kill("killed", reason)
        return True

    def extend(self, st: AgentState, seconds: float) -> bool:
        """Move the agent's running tool call's deadline later; False: none runs."""
        running = self.running.get(st.name)
        if running is None:
            return False
        extend_tool(st, running[0], seconds, self.emit, running[1])
        return True

    # ---- one call -------------------------------------------------------------------------------------
    async def run(self, st: AgentState, attempt: int, toolset: Toolset, call: dict[str, Any]) -> str:
        """Execute one of the model's calls for agent `st` (the AgentState); returns the tool message's content."""
        call_id = str(call.get("id") or "")
        fn = call.get("function") or {}
        function, arguments = str(fn.get("name") or ""), str(fn.get("arguments") or "")
        shown = shown_arguments(self.scrub(arguments) if self.scrub else arguments)
        emit, name = self.emit, st.name
        target = toolset.names.get(function)
        if target is None:
            text = f"error: no tool named {function!r} is available to you"
            emit(ev.ToolCallFinished(time.monotonic(), name, call_id, "", function, "error", text, 0.0))
            return text
        server, tool = target
        cfg = self.servers.servers[server].config
        reused = self.memory.take(name, function, arguments)
        if reused is not None:  # a resumed run: this call's result is in the journal already
            now = time.monotonic()
            emit(ev.ToolCallStarted(now, name, attempt, st.turn, call_id, server, tool, shown, None, ()))
            emit(ev.ToolCallFinished(now, name, call_id, server, tool, "ok",
                                     preview("(from the journal, not run again) " + reused), 0.0))
            return reused
        denied = await self._permission(st, call_id, server, tool, shown, cfg)
        if denied:
            emit(ev.ToolCallFinished(time.monotonic(), name, call_id, server, tool, "denied", denied, 0.0))
            return f"error: {denied}"
        try:
            args = parse_arguments(arguments)
        except ValueError as exc:
            text = f"error: {exc}"
            emit(ev.ToolCallFinished(time.monotonic(), name, call_id, server, tool, "error", preview(text), 0.0))
            return text
        return await self._execute(st, attempt, call_id, server, tool, args, shown, cfg)

    async def _permission(self, st: AgentState, call_id: str, server: str, tool: str, shown: str, cfg: Any) -> str:
        """"" when the call may run; else why not, as the model is told."""
        rule = rule_for(cfg, tool)
        emit, name = self.emit, st.name
        if rule == "deny":
            emit(ev.ApprovalDecided(time.monotonic(), name, call_id, server, tool, "deny", "rule"))
            return f"denied: the rules of MCP server {server} deny {tool}"
        if rule == "allow" or self.approvals.approved(server, tool):
            return ""
        if self.ask == "approve":
            emit(ev.ApprovalDecided(time.monotonic(), name, call_id, server, tool, "once", "headless"))
            return ""
        if self.ask == "deny":
            emit(ev.ApprovalDecided(time.monotonic(), name, call_id, server, tool, "deny", "headless"))
            return f"denied: {tool} needs the operator's approval, and this headless run does not give it " \
                   "(run --approve-all would)"
        pending = self.pending[(name, call_id)] = _Pending(server, tool)
        before = st.status
        st.status = "approval"
        try:
            emit(ev.ApprovalRequested(time.monotonic(), name, call_id, server, tool, shown))
            await pending.decided.wait()
        finally:
            del self.pending[(name, call_id)]
            st.status = before
        if pending.decision == "deny":
            return f"denied by the operator: {tool} was not run"
        return ""

    async def _execute(self, st: AgentState, attempt: int, call_id: str, server: str, tool: str, args: dict[str, Any],
                       shown: str, cfg: Any) -> str:
        name = st.name
        now = time.monotonic()
        tc = ToolCall(call_id, server, tool, now, now + cfg.tool_timeout_s, tuple(cfg.warn_at))
        self.running[name] = (tc, attempt)
        st.status = "tool"
        self.emit(ev.ToolCallStarted(now, name, attempt, st.turn, call_id, server, tool, shown, tc.deadline_at,
                                     tc.warn_at))
        text, outcome = "", "ok"
        try:
            with anyio.CancelScope() as tc.scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(watch_tool, st, tc, self.emit)
                    try:
                        result, is_error = await self.servers.call(server, tool, args)
                        text = result_text(result)
                        if is_error:
                            outcome = "error"
                            text = f"error: {text or 'the tool failed without a message'}"
                    except ToolCallError as exc:
                        outcome, text = "error", f"error: {exc}"
                    group.cancel_scope.cancel()
        finally:
            self.running.pop(name, None)
        if tc.outcome == "timeout":
            outcome, text = "timeout", f"error: the tool call was cancelled: {tc.reason}"
        elif tc.outcome == "killed":
            outcome, text = "killed", f"error: the tool call was cancelled by the operator ({tc.reason})"
        if self.scrub:  # before the cut: a key the cut splits would keep its start
            text = self.scrub(text)
        text = capped(text, cfg.max_result_chars)
        elapsed = time.monotonic() - now
        st.status = "prefill"  # the model is given the result next
        self.emit(ev.ToolCallFinished(time.monotonic(), name, call_id, server, tool, outcome,  # type: ignore[arg-type]
                                      preview(text), elapsed))
        return text

