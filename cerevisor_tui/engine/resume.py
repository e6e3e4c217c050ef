"""Resume planning: what a resumed run reuses of an earlier run in the same directory, and what it sends again.

An agent's AgentFinished records what it ran with (`agent_inputs`: its texts as digests, the rest as values).
A resumed run reuses a completed agent's answer unless what it would run with now differs, or a dependency of
its runs again (a changed answer upstream makes every answer downstream stale); each rerun says why.

An agent that had not completed keeps the turns it had answered (`TurnChains`), each with what it ran with
(`turn_inputs`, on the turn's user message): a resumed run goes on at the first turn without an answer, so no
answered turn is sent twice, unless what the agent runs with now differs (then it starts again at turn 1).

`read_journal` reads the journal once, each line decoded to its event, and feeds every part of a resume from
that one pass: the completed agents and their figures, what the run spent, the tools' results, the turns.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cerevisor_tui.config.graph import OUTPUT_REF
from cerevisor_tui.config.models import AgentConfig, Config, EndpointConfig
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.journal import EVENTS_FILE, iter_events
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.engine.toolcalls import ToolMemory


def agent_inputs(config: Config, cfg: AgentConfig, render: Callable[[str], str]) -> dict[str, str]:
    """What an agent runs with, as its AgentFinished records it: its texts as sent (`render` inserts its
    dependencies' answers) as digests, the rest as values. A resumed run compares the keys both have, so a key
    added later does not rerun everything."""
    ep = config.agent_endpoint(cfg)
    inputs = {
        "prompt": _digest(render(cfg.prompt)),
        "turns": _digest(json.dumps([render(text) for text in cfg.turns], ensure_ascii=False)),
        "depends_on": ", ".join(sorted(cfg.depends_on)),
        "endpoint": cfg.endpoint if config.agent_pool(cfg) else ep.name,  # a pool: any member will do
    }
    return {**inputs, **turn_inputs(ep, cfg)}


def turn_inputs(ep: EndpointConfig, cfg: AgentConfig) -> dict[str, str]:
    """What each of an agent's turns is answered under, besides its user text, as the turn's user message records
    it: an answered turn is reused by a resumed run only while all of it is the same."""
    return {
        "system": _digest(cfg.system),
        "model": ep.model,  # as configured: "" is the first /v1/models lists
        "max_tokens": str(cfg.max_tokens),
        "temperature": str(cfg.temperature),
        "extra_body": json.dumps({**ep.extra_body, **cfg.extra_body}, sort_keys=True),
        # what an agent with tools is offered and may do with them (without tools, neither matters)
        "tools": ", ".join(cfg.tools),
        "tool_choice": cfg.tool_choice if cfg.tools else "",
        "max_steps": str(cfg.max_steps) if cfg.tools else "",
    }


def input_changes(before: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """What differs between what was recorded and what is run with now, in the operator's words: the keys both
    have (a key added later changes nothing)."""
    return [_input_change(key, str(before[key]), value) for key, value in now.items()
            if key in before and str(before[key]) != value]


def rendered_with(outputs: Mapping[str, str]) -> Callable[[str], str]:
    """{{ name.output }} filled in from `outputs` (the answers an earlier run gave)."""
    return lambda text: OUTPUT_REF.sub(lambda m: outputs.get(m.group(1), ""), text)


def plan_resume(config: Config, waves: list[list[AgentConfig]], reused: Mapping[str, str],
                recorded: Mapping[str, dict[str, str]]) -> dict[str, str]:
    """The completed agents a resumed run sends again, each with why: what it would run with changed, or a
    dependency of it runs (again, or for the first time)."""
    rerun: dict[str, str] = {}
    render = rendered_with(reused)
    for level in waves:
        for cfg in level:
            if cfg.name not in reused:
                continue
            dep = next((d for d in cfg.depends_on if d not in reused or d in rerun), None)
            if dep is not None:
                rerun[cfg.name] = (f"its dependency {dep} runs again" if dep in rerun
                                   else f"its dependency {dep} had not completed")
                continue
            before = recorded.get(cfg.name)
            if not before:
                continue  # recorded before inputs were: reused as it is
            changes = input_changes(before, agent_inputs(config, cfg, render))
            if changes:
                rerun[cfg.name] = ", ".join(changes)
    return rerun


def request_prefix(run_id: str, run_dir: str) -> str:
    """What a run's X-Request-Ids start with: its run id, and in a resumed run also the length its journal had
    when it began. Every request is journalled (its AgentStarted) before it is sent, so the journal grows
    between two resumes that send anything, and no resume sends an id an earlier run of the directory sent
    (attempt numbers start again at 1 in each)."""
    try:
        size = (Path(run_dir) / "events.jsonl").stat().st_size if run_dir else 0
    except OSError:
        size = 0
    return f"{run_id}.r{size}" if size else run_id


@dataclass(frozen=True)
class RecordedTurn:
    """A turn an earlier run answered: its user message, then the conversation's messages after it (the tool
    calls and their results of a turn with tools), its answer last."""

    user: str
    messages: tuple[dict[str, Any], ...]
    answer: str
    figures: tuple[ev.Event, ...] = ()  # its recorded events (attempts, meters): the report's figures
    inputs: Mapping[str, str] = field(default_factory=dict)  # what it ran with (turn_inputs); {}: not recorded


@dataclass
class _Turn:
    """A turn being read back: what RecordedTurn holds, its answer None until recorded."""

    user: str
    inputs: dict[str, str]
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: str | None = None
    figures: list[ev.Event] = field(default_factory=list)


class TurnChains:
    """Each agent's answered turns, from turn 1 on with none missing, as the journal's MessageRecorded tell them,
    fed event by event (`feed`), read at the journal's end (`turns`).

    A turn's user message starts it again and drops every later turn recorded before (an agent run again from
    an earlier turn: what it said after is not its conversation any more); a partial answer (its attempt died)
    is not an answer; a turn whose answer is not recorded ends what can be reused. An agent `forget` names
    (completed: a resumed run reuses its answer, or runs it again from the start) is not kept."""

    def __init__(self) -> None:
        self._chains: dict[str, dict[int, _Turn]] = {}
        self._current: dict[str, _Turn] = {}  # each agent's turn in progress in the journal
        self._forgotten: set[str] = set()

    def forget(self, agent: str) -> None:
        self._forgotten.add(agent)
        self._chains.pop(agent, None)
        self._current.pop(agent, None)

    def feed(self, event: ev.Event) -> None:
        match event:
            case ev.MessageRecorded() if event.partial or event.raw or event.agent in self._forgotten:
                pass  # a dead attempt's part of an answer, a gateway session's message, or a completed agent's
            case ev.MessageRecorded(agent=agent, turn=number, role="user", content=content, inputs=inputs):
                chain = self._chains.setdefault(agent, {})
                for later in [t for t in chain if t >= number]:
                    del chain[later]
                chain[number] = self._current[agent] = _Turn(content, inputs)
            case ev.MessageRecorded(agent=agent, turn=number, role=role, content=content, tool_calls=calls,
                                    tool_call_id=call_id):
                turn = self._chains.get(agent, {}).get(number)
                if turn is None or turn.answer is not None:
                    return
                if role == "tool" and call_id:
                    turn.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
                elif role == "assistant" and calls:
                    turn.messages.append({"role": "assistant", "content": content or None, "tool_calls": calls})
                elif role == "assistant":  # its answer, recorded after its figures (its TurnFinished)
                    turn.messages.append({"role": "assistant", "content": content})
                    turn.answer = content
            case ev.AgentQueued() | ev.AgentFinished() | ev.AgentRerun() | ev.AgentStatus():
                pass  # an agent's, not a turn's
            case _:
                who = getattr(event, "agent", None)
                if who in self._current:
                    self._current[who].figures.append(event)

    def turns(self) -> dict[str, list[RecordedTurn]]:
        out: dict[str, list[RecordedTurn]] = {}
        for agent, chain in self._chains.items():
            turns: list[RecordedTurn] = []
            for number in sorted(chain):
                turn = chain[number]
                if number != len(turns) + 1 or turn.answer is None:
                    break
                turns.append(RecordedTurn(turn.user, tuple(turn.messages), turn.answer, tuple(turn.figures),
                                          turn.inputs))
            if turns:
                out[agent] = turns
        return out


REPLAYED = frozenset(cls.kind for cls in ev.EVENT_TYPES if hasattr(Report, f"_on_{cls.kind}"))
"""The kinds of event the report counts: what a resumed run keeps of its completed agents' earlier events
(their messages, the bulk of a journal, are in their transcripts and not needed again)."""


@dataclass
class SessionBefore:
    """What a gateway session had done in an earlier run of the directory: a resumed run's session of the same
    name goes on from it (its requests numbered on, its cost counted on, its transcript appended to)."""

    requests: int = 0
    cost_usd: float = 0.0


@dataclass
class JournalState:
    """What a run directory's journal says, for `--resume`: its run id, the answers of the agents it completed,
    what each ran with and their recorded events, what the run has spent on priced endpoints, what its tools
    returned, the turns of agents that had not completed, and how many lines could not be read."""

    run_id: str
    completed: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, dict[str, str]] = field(default_factory=dict)  # a completed agent's AgentFinished inputs
    history: list[ev.Event] = field(default_factory=list)
    spent_usd: float = 0.0  # the last AgentMeters' run_cost_usd: a resumed run counts on from it
    tools: ToolMemory = field(default_factory=ToolMemory)
    turns: dict[str, list[RecordedTurn]] = field(default_factory=dict)
    sessions: dict[str, SessionBefore] = field(default_factory=dict)  # a gateway's, by name
    skipped: int = 0
    first_problem: str = ""  # e.g. "line 12: invalid UTF-8"

    def notice(self, path: Path) -> str:
        """One line on what was skipped, or "" when every line was read."""
        if not self.skipped:
            return ""
        lines = "line" if self.skipped == 1 else "lines"
        return f"{self.skipped} unreadable {lines} of {path / EVENTS_FILE} skipped (first: {self.first_problem})"


def read_journal(run_dir: str | os.PathLike[str]) -> JournalState:
    """Read a run directory's events.jsonl back once, line by line, skipping (and counting) what cannot be read.
    Raises JournalError only when the file itself cannot be read."""
    path = Path(run_dir)
    state = JournalState(run_id=path.name)
    turns = TurnChains()
    finished: dict[str, ev.AgentFinished] = {}
    # The figures of completed agents carry over into the resumed run's report: the events the report counts
    # since each one's last AgentQueued (an earlier failed run of the same agent does not count twice), then
    # its last completed AgentFinished, which says what it ran with (the engine compares that with the config).
    # Only those are kept: a journal's bulk (its messages) is never held. A gateway session's figures are all
    # kept: it has no answer to reuse, and it goes on in the resumed run under its name (its AgentQueued is
    # a request waiting for its slot, not a new run of it).
    last_run: dict[str, list[ev.Event]] = {}
    sessions = state.sessions
    for number, event, problem in iter_events(path):
        if event is None:
            state.skipped += 1
            state.first_problem = state.first_problem or f"line {number}: {problem}"
            continue
        state.tools.feed(event)
        turns.feed(event)
        match event:
            case ev.RunStarted(run_id=run_id) if run_id:
                state.run_id = run_id
            case ev.SessionOpened(agent=agent):
                sessions.setdefault(agent, SessionBefore())
            case ev.AgentStarted(agent=agent, attempt=number) if agent in sessions:
                sessions[agent].requests = max(sessions[agent].requests, number)
            case ev.AgentFinished(agent=agent) if agent in sessions:
                pass
            case ev.AgentFinished(agent=agent, status="completed"):
                state.completed[agent] = event.output
                finished[agent] = event
                turns.forget(agent)
            case ev.AgentMeters(agent=agent, cost_usd=cost, run_cost_usd=spent):
                if math.isfinite(spent):
                    state.spent_usd = spent
                if agent in sessions:
                    sessions[agent].cost_usd = cost
        match event:  # a completed agent's figures, a session's (its end too: it may not come back)
            case ev.AgentQueued(agent=agent) if agent not in sessions:
                last_run[agent] = []
            case ev.AgentFinished(agent=agent) if agent in sessions:
                last_run.setdefault(agent, []).append(event)
            case ev.AgentFinished():
                pass
            case _ if event.kind in REPLAYED and isinstance(who := getattr(event, "agent", None), str):
                last_run.setdefault(who, []).append(event)
    state.tools.read()
    state.turns = turns.turns()
    state.inputs = {agent: dict(e.inputs) for agent, e in finished.items() if e.inputs}
    state.history = [e for agent, events_ in last_run.items() if agent in state.completed or agent in sessions
                     for e in events_]
    state.history += finished.values()
    return state


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _input_change(key: str, before: str, now: str) -> str:
    """One changed input in the operator's words: texts by name, values from before to now."""
    if key in ("system", "prompt", "turns"):
        return f"{key} changed"
    if key in ("depends_on", "tools"):
        return f"{key} [{before}] -> [{now}]"
    if key in ("tool_choice", "max_steps"):
        return f"{key} {before or '(none)'} -> {now or '(none)'}"
    if key == "model":
        return f"model {before or '(the first listed)'} -> {now or '(the first listed)'}"
    return f"{key} {before} -> {now}"
