"""Agents' MCP tool calls for one run: each call's permission (the server's rules, the operator's answer, or
headless policy), its execution under its own deadline, and what the model is told; the operator's kill,
extend, approve and deny act here. A resumed run reuses a call's result from the journal instead of running
it again, asks before running again a call the earlier run was cut off in, and keeps the tools approved "for
the run"."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.state import AgentState, ToolCall
from cerevisor_tui.engine.status import move
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
    hands back instead of calling again, keyed by function name and arguments (in order, for repeats), and
    the calls it started and never saw end (a crash mid-call), which may already have taken effect.

    A call is paired with its result by position in the journal, never by its id: local tool-call parsers
    number every call `call_1`, turn after turn."""

    def __init__(self) -> None:
        # (agent, function, arguments) -> what each earlier call of it left, in order: its result, or
        # INTERRUPTED (it started and has no end in the journal), or NOT_RUN (denied, timed out, killed)
        self.results: dict[tuple[str, str, str], list[str]] = defaultdict(list)
        self.approved: set[tuple[str, str]] = set()
        self.damaged: dict[str, int] = {}  # agent -> its calls that ran and whose records cannot be read
        # while a journal is read (`feed`): agent -> the calls of its last answer, in order; how many of them have
        # their tool message; what its current call has shown ("started", "ok", "error", ...); and what each call
        # (function, arguments) of its current run left, in order (a run is from its AgentQueued on, and a later
        # run, a resume, walks the same calls again: see _fold)
        self._calls: dict[str, list[tuple[str, str] | None]] = {}
        self._done: dict[str, int] = {}
        self._state: dict[str, str] = {}
        self._runs: dict[str, dict[tuple[str, str], list[str]]] = {}

    def feed(self, event: ev.Event) -> None:
        """The journal's next event (read once, for every part of a resume: engine/resume.py `read_journal`)."""
        calls = self._calls
        match event:
            case ev.MessageRecorded(agent=agent, role="assistant", partial=False, tool_calls=recorded):
                self._answer_over(agent)
                calls[agent] = [_recorded_call(c) for c in recorded]
                self._done[agent] = 0
            case ev.MessageRecorded(agent=agent, role="tool", content=content) if agent in calls:
                self._call_over(agent, self._state.pop(agent, ""), content)
            case ev.ToolCallStarted(agent=agent) if agent in calls:
                self._state[agent] = "started"
            case ev.ToolCallFinished(agent=agent, outcome=outcome) if agent in calls:
                self._state[agent] = outcome
            case ev.AgentQueued(agent=agent) | ev.AgentFinished(agent=agent):
                self._answer_over(agent)
                calls.pop(agent, None)
                if isinstance(event, ev.AgentQueued):
                    self._fold(agent, self._runs.pop(agent, {}))
            case ev.ApprovalDecided(server=server, tool=tool, decision="run"):
                self.approved.add((server, tool))

    def read(self) -> ToolMemory:
        """The journal is read to its end: a call cut off by it is over, and each agent's last run is known."""
        for agent in list(self._calls):
            self._answer_over(agent)
        for agent, run in self._runs.items():
            self._fold(agent, run)
        self._calls, self._done, self._state, self._runs = {}, {}, {}, {}
        return self

    def _call_over(self, agent: str, outcome: str, content: str | None) -> None:
        """The agent's next call (by position) has its tool message (`content`), or its answer is over without
        one (None). A call that ran (or began to) and has no result to hand back may have taken effect."""
        position = self._done[agent]
        if position >= len(self._calls[agent]):
            return
        self._done[agent] = position + 1
        call = self._calls[agent][position]
        finished = outcome in ("ok", "error") and content is not None
        ran = outcome == "started" or (outcome in ("ok", "error") and content is None)
        if call is None:
            if ran or finished:
                self.damaged[agent] = self.damaged.get(agent, 0) + 1
            return
        left = self._runs.setdefault(agent, {}).setdefault(call, [])
        left.append(content if finished and content is not None else INTERRUPTED if ran else NOT_RUN)

    def _answer_over(self, agent: str) -> None:
        """The agent's answer is over (another one, its end, the journal's end): a call that started and has
        no tool message was cut off mid-call."""
        outcome = self._state.pop(agent, "")
        if outcome and agent in self._calls:
            self._call_over(agent, outcome, None)

    def _fold(self, agent: str, run: dict[tuple[str, str], list[str]]) -> None:
        """One run of the agent into what is known: its n-th call of a function and arguments replaces the
        n-th known one when it ran (a result, or cut off); one it did not run (denied, timed out, killed)
        leaves what an earlier run left. So a result reused by a resume is not counted twice, and a call cut
        off once and then run to its end has that result."""
        for (function, arguments), entries in run.items():
            known = self.results[(agent, function, arguments)]
            for n, entry in enumerate(entries):
                if n >= len(known):
                    known.append(entry)
                elif entry is not NOT_RUN:
                    known[n] = entry
            while known and known[-1] is NOT_RUN:
                known.pop()

    def uncertain(self, agent: str) -> bool:
        """Whether the agent's next call without a recorded result may be one whose record is damaged (it ran,
        and what it was cannot be read): as many of its calls are asked about as it has damaged records."""
        left = self.damaged.get(agent, 0)
        if left:
            self.damaged[agent] = left - 1
        return bool(left)

    def take(self, agent: str, function: str, arguments: str) -> str | None:
        """What the earlier run left of this call, the next of it in order: its result, INTERRUPTED, or None
        (no earlier run of it, or one that did not run it)."""
        found = self.results.get((agent, function, _canonical(arguments)))
        if not found:
            return None
        entry = found.pop(0)
        return None if entry is NOT_RUN else entry


INTERRUPTED = "\x00interrupted"
"""ToolMemory.take's answer for a call an earlier run started and never finished (it may have taken effect)."""
NOT_RUN = "\x00not run"
"""A call an earlier run did not run (denied, or timed out or killed: its result is not one to hand back)."""


def _recorded_call(call: Any) -> tuple[str, str] | None:
    """A recorded call's function name and arguments (canonical); None for an entry that is not a call."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None
    return fn["name"], _canonical(fn.get("arguments"))


def _canonical(arguments: Any) -> str:
    """Arguments text in one form, so the same call compares equal however its JSON was spaced."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


class ToolCalls:
    """The run's tool calls: `run` executes one call of an agent and returns what the model is told."""

    def __init__(self, servers: McpServers, *, emit: Callable[[ev.Event], None], scrub: Scrubber,
                 ask: AskPolicy = "operator", memory: ToolMemory | None = None, clock: Clock) -> None:
        self.servers = servers
        self.emit = emit
        self.clock = clock  # the run's: each call's times and its deadline
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
        self.emit(ev.ApprovalDecided(self.clock.now(), agent, call_id, pending.server, pending.tool,
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
        extend_tool(st, running[0], seconds, self.emit, running[1], self.clock)
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
            emit(ev.ToolCallFinished(self.clock.now(), name, call_id, "", function, "error", text, 0.0))
            return text
        server, tool = target
        cfg = self.servers.servers[server].config
        reused = self.memory.take(name, function, arguments)
        if reused is not None and reused is not INTERRUPTED:  # a resumed run: its result is in the journal
            now = self.clock.now()
            emit(ev.ToolCallStarted(now, name, attempt, st.turn, call_id, server, tool, shown, None, ()))
            emit(ev.ToolCallFinished(now, name, call_id, server, tool, "ok",
                                     preview("(from the journal, not run again) " + reused), 0.0))
            return reused
        # A call the earlier run started and never finished (or cannot tell, its record damaged) may already have
        # taken effect: it runs again only with an approval, whatever the server's rules say.
        uncertain = ("was started by the earlier run, which ended before it finished" if reused is INTERRUPTED
                     else "cannot be paired with what the earlier run recorded (a tool call it ran is damaged in "
                          "the journal)" if reused is None and self.memory.uncertain(name) else "")
        if uncertain:
            brief = shown if len(shown) <= 120 else shown[:119] + "…"
            emit(ev.RunNotice(self.clock.now(), f"{name}: the tool call {server}.{tool}({brief}) {uncertain}: it "
                              f"may already have taken effect, so it runs again only if approved", "warning",
                              "Tool call may have run"))
        denied = await self._permission(st, call_id, server, tool, shown, cfg, uncertain=bool(uncertain))
        if denied:
            emit(ev.ToolCallFinished(self.clock.now(), name, call_id, server, tool, "denied", denied, 0.0))
            return f"error: {denied}"
        try:
            args = parse_arguments(arguments)
        except ValueError as exc:
            text = f"error: {exc}"
            emit(ev.ToolCallFinished(self.clock.now(), name, call_id, server, tool, "error", preview(text), 0.0))
            return text
        return await self._execute(st, attempt, call_id, server, tool, args, shown, cfg)

    async def _permission(self, st: AgentState, call_id: str, server: str, tool: str, shown: str, cfg: Any, *,
                          uncertain: bool = False) -> str:
        """"" when the call may run; else why not, as the model is told. `uncertain`: the call may already have
        taken effect (an earlier run was cut off in it): asked about as an `ask` rule would, unless denied."""
        rule = rule_for(cfg, tool)
        emit, name = self.emit, st.name
        if rule == "deny":
            emit(ev.ApprovalDecided(self.clock.now(), name, call_id, server, tool, "deny", "rule"))
            return f"denied: the rules of MCP server {server} deny {tool}"
        if not uncertain and (rule == "allow" or self.approvals.approved(server, tool)):
            return ""
        if self.ask == "approve":
            emit(ev.ApprovalDecided(self.clock.now(), name, call_id, server, tool, "once", "headless"))
            return ""
        if self.ask == "deny":
            emit(ev.ApprovalDecided(self.clock.now(), name, call_id, server, tool, "deny", "headless"))
            if uncertain:
                return f"denied: this {tool} call may already have taken effect (an earlier run was cut off in " \
                       "it), so it needs the operator's approval, and this headless run does not give it " \
                       "(run --approve-all would)"
            return f"denied: {tool} needs the operator's approval, and this headless run does not give it " \
                   "(run --approve-all would)"
        pending = self.pending[(name, call_id)] = _Pending(server, tool)
        move(st, "approval")
        try:
            emit(ev.ApprovalRequested(self.clock.now(), name, call_id, server, tool, shown))
            await pending.decided.wait()
        finally:
            del self.pending[(name, call_id)]
            move(st, "sent")  # denied: the model is told so next; approved: the call runs (`tool`)
        if pending.decision == "deny":
            return f"denied by the operator: {tool} was not run"
        return ""

    async def _execute(self, st: AgentState, attempt: int, call_id: str, server: str, tool: str, args: dict[str, Any],
                       shown: str, cfg: Any) -> str:
        name = st.name
        now = self.clock.now()
        tc = ToolCall(call_id, server, tool, now, now + cfg.tool_timeout_s, tuple(cfg.warn_at))
        self.running[name] = (tc, attempt)
        move(st, "tool")
        self.emit(ev.ToolCallStarted(now, name, attempt, st.turn, call_id, server, tool, shown, tc.deadline_at,
                                     tc.warn_at))
        text, outcome = "", "ok"
        try:
            with anyio.CancelScope() as tc.scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(watch_tool, st, tc, self.emit, self.clock)
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
        elapsed = self.clock.now() - now
        move(st, "sent")  # the model is given the result next
        self.emit(ev.ToolCallFinished(self.clock.now(), name, call_id, server, tool, outcome,  # type: ignore[arg-type]
                                      preview(text), elapsed))
        return text

