"""Resume planning: what a resumed run reuses of an earlier run in the same directory, and what it sends again.

An agent's AgentFinished records what it ran with (`agent_inputs`: its texts as digests, the rest as values).
A resumed run reuses a completed agent's answer unless what it would run with now differs, or a dependency of
its runs again (a changed answer upstream makes every answer downstream stale); each rerun says why.

An agent that had not completed keeps the turns it had answered (`recorded_turns`): a resumed run goes on at
the first turn without an answer, so no answered turn is sent twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cerevisor_tui.config.graph import OUTPUT_REF
from cerevisor_tui.config.models import AgentConfig, Config
from cerevisor_tui.engine.toolcalls import ToolMemory


def agent_inputs(config: Config, cfg: AgentConfig, render: Callable[[str], str]) -> dict[str, str]:
    """What an agent runs with, as its AgentFinished records it: its texts as sent (`render` inserts its
    dependencies' answers) as digests, the rest as values. A resumed run compares the keys both have, so a key
    added later does not rerun everything."""
    ep = config.agent_endpoint(cfg)
    return {
        "system": _digest(cfg.system),
        "prompt": _digest(render(cfg.prompt)),
        "turns": _digest(json.dumps([render(text) for text in cfg.turns], ensure_ascii=False)),
        "depends_on": ", ".join(sorted(cfg.depends_on)),
        "endpoint": cfg.endpoint if config.agent_pool(cfg) else ep.name,  # a pool: any member will do
        "model": ep.model,  # as configured: "" is the first /v1/models lists
        "max_tokens": str(cfg.max_tokens),
        "temperature": str(cfg.temperature),
        "extra_body": json.dumps({**ep.extra_body, **cfg.extra_body}, sort_keys=True),
        # what an agent with tools is offered and may do with them (without tools, neither matters)
        "tools": ", ".join(cfg.tools),
        "tool_choice": cfg.tool_choice if cfg.tools else "",
        "max_steps": str(cfg.max_steps) if cfg.tools else "",
    }


def rendered_with(outputs: Mapping[str, str]) -> Callable[[str], str]:
    """{{ name.output }} filled in from `outputs` (the answers an earlier run gave)."""
    return lambda text: OUTPUT_REF.sub(lambda m: outputs.get(m.group(1), ""), text)


def recorded_inputs(history: Iterable[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """What each agent an earlier run completed ran with, from its recorded AgentFinished."""
    return {e["agent"]: e["inputs"] for e in history if e.get("event") == "AgentFinished"
            and isinstance(e.get("agent"), str) and isinstance(e.get("inputs"), dict)}


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
            now = agent_inputs(config, cfg, render)
            changes = [_input_change(key, str(before[key]), value) for key, value in now.items()
                       if key in before and str(before[key]) != value]
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


def tool_memory(run_dir: str) -> ToolMemory | None:
    """What an earlier run in this run directory got from its tools (a resumed run); None: nothing."""
    if not run_dir or not (Path(run_dir) / "events.jsonl").is_file():
        return None
    return ToolMemory.from_records(journal_records(run_dir))  # line by line: a journal may be far larger than it


@dataclass(frozen=True)
class RecordedTurn:
    """A turn an earlier run answered: its user message, then the conversation's messages after it (the tool
    calls and their results of a turn with tools), its answer last."""

    user: str
    messages: tuple[dict[str, Any], ...]
    answer: str
    figures: tuple[dict[str, Any], ...] = ()  # its recorded events (attempts, meters): the report's figures


_NOT_A_TURNS = {"AgentQueued", "AgentFinished", "AgentRerun", "AgentStatus"}  # an agent's events, not a turn's


def recorded_turns(records: Iterable[dict[str, Any]], skip: Container[str] = ()) -> dict[str, list[RecordedTurn]]:
    """Each agent's answered turns, from turn 1 on with none missing, as the journal's MessageRecorded tell
    them. A turn's user message starts it again and drops every later turn recorded before (an agent run
    again from an earlier turn: what it said after is not its conversation any more); a partial answer (its
    attempt died) is not an answer; a turn whose answer is not recorded ends what can be reused. The agents in `skip` (completed, or run again from the start) are not kept."""
    chains: dict[str, dict[int, dict[str, Any]]] = {}
    current: dict[str, dict[str, Any]] = {}  # each agent's turn in progress in the journal
    for e in records:
        if e.get("event") != "MessageRecorded":
            agent = e.get("agent")
            if isinstance(agent, str) and agent in current and e.get("event") not in _NOT_A_TURNS:
                current[agent]["figures"].append(e)
            continue
        if e.get("partial") or e.get("raw"):  # raw: a gateway session's
            continue
        agent, turn, role, content = e.get("agent"), e.get("turn"), e.get("role"), e.get("content")
        if not isinstance(agent, str) or type(turn) is not int or not isinstance(content, str) or agent in skip:
            continue
        chain = chains.setdefault(agent, {})
        if role == "user":
            for later in [t for t in chain if t >= turn]:
                del chain[later]
            chain[turn] = current[agent] = {"user": content, "messages": [], "answer": None, "figures": []}
            continue
        entry = chain.get(turn)
        if entry is None or entry["answer"] is not None:
            continue
        calls = e.get("tool_calls")
        if role == "tool" and isinstance(e.get("tool_call_id"), str):
            entry["messages"].append({"role": "tool", "tool_call_id": e["tool_call_id"], "content": content})
        elif role == "assistant" and calls and isinstance(calls, list):
            entry["messages"].append({"role": "assistant", "content": content or None, "tool_calls": calls})
        elif role == "assistant":  # its answer, recorded after its figures (its TurnFinished)
            entry["messages"].append({"role": "assistant", "content": content})
            entry["answer"] = content
    out: dict[str, list[RecordedTurn]] = {}
    for agent, chain in chains.items():
        turns: list[RecordedTurn] = []
        for number in sorted(chain):
            entry = chain[number]
            if number != len(turns) + 1 or entry["answer"] is None:
                break
            turns.append(RecordedTurn(entry["user"], tuple(entry["messages"]), entry["answer"],
                                      tuple(entry["figures"])))
        if turns:
            out[agent] = turns
    return out


def journal_records(run_dir: str) -> Iterator[dict[str, Any]]:
    """The records of an earlier run in this run directory (a resumed run), read line by line; none for a
    new run, or when it cannot be read (the journal's own reader says so)."""
    if not run_dir or not (Path(run_dir) / "events.jsonl").is_file():
        return
    from cerevisor_tui.engine.sinks.journal import JournalError, iter_lines

    with contextlib.suppress(JournalError):
        for _, data, _ in iter_lines(run_dir):
            if data is not None:
                yield data


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
