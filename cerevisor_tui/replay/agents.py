"""A replay file's sessions as scripts for the run's own agents (`replay run --as-agents`; the engine's side is
engine/script.py, the run is put together in commands/replay.py).

A top-level session arrives its first turn's `delay_ms` after the replay began, a subagent `delay_ms` after the
answer to its parent's spawning turn (a parent that ends before that turn leaves it skipped); each later turn goes
`delay_ms` after the answer before; every gap is divided by the speed. A turn's prompt is built when it is sent, from
its block ids (replay/run.py's `prompt_text`), so the server's prefix cache sees the trace's sharing and an agent
holds only the prompt it is sending; the journal records its reference (length and block ids), ~2 KB where the
text of a 142K-token prompt is ~570 KB.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio

from cerevisor_tui.config.models import agent_name_problem
from cerevisor_tui.replay.run import Plan, prompt_text
from cerevisor_tui.replay.trace import TraceTurn


class SessionScript:
    """One session's turns, as a scripted agent asks for them (engine/script.py's TurnScript)."""

    def __init__(self, turns: list[tuple[TraceTurn, int]], sessions: ReplaySessions) -> None:
        self._turns = turns  # (the file's line, its whole prompt in tokens)
        self._sessions = sessions
        self._spawned = turns[0][0].parent is None
        self._skip = ""  # why it never runs: its parent ended before spawning it
        self._go: anyio.Event | None = None

    @property
    def turns(self) -> int:
        return len(self._turns)

    @property
    def session_id(self) -> str:
        return self._turns[0][0].session_id

    async def arrive(self) -> str:
        first = self._turns[0][0]
        gap_s = first.delay_ms / 1000 / self._sessions.speed
        if first.parent is None:
            await anyio.sleep_until(self._sessions.started_at() + gap_s)
            return ""
        if not self._spawned and not self._skip:
            self._go = anyio.Event()
            await self._go.wait()
        if self._skip:
            return self._skip
        await anyio.sleep(gap_s)
        return ""

    async def before(self, turn: int) -> None:
        if turn > 1:
            await anyio.sleep(self._turns[turn - 1][0].delay_ms / 1000 / self._sessions.speed)

    def messages(self, turn: int) -> list[dict[str, Any]]:
        line, whole = self._turns[turn - 1]
        return [{"role": "user", "content": prompt_text(line.hash_ids, whole, line.session_id)}]

    def max_tokens(self, turn: int) -> int:
        return max(1, self._turns[turn - 1][0].output_length)

    def context_tokens(self) -> int:
        line, whole = self._turns[-1]
        return whole + line.output_length

    def reference(self, turn: int) -> str:
        line, whole = self._turns[turn - 1]
        return (f"[replay {line.session_id} turn {line.turn}: a prompt of {whole:,} tokens, blocks "
                f"{json.dumps(line.hash_ids, separators=(',', ':'))}]")

    def spawn(self) -> None:
        self._spawned = True
        if self._go is not None:
            self._go.set()

    def skip(self, reason: str) -> None:
        if self._spawned:
            return
        self._skip = reason
        if self._go is not None:
            self._go.set()


class ReplaySessions:
    """A plan's sessions as scripts, by the agent name each runs under, and the spawns between them: the run tells
    `turn_done` and `ended` (commands/replay.py subscribes to its events)."""

    def __init__(self, plan: Plan, speed: float) -> None:
        self.plan = plan
        self.speed = speed
        self.names: dict[str, str] = {}  # session id -> agent name
        self.sessions: dict[str, str] = {}  # agent name -> session id
        self.scripts: dict[str, SessionScript] = {}  # by agent name
        for index, (session_id, turns) in enumerate(plan.turns.items()):
            name = session_id if agent_name_problem(session_id) is None else f"session-{index + 1}"
            while name in self.sessions:  # (a sanitized name that a file's own id already holds)
                name += "_"
            self.names[session_id], self.sessions[name] = name, session_id
            self.scripts[name] = SessionScript(turns, self)
        self._started_at: float | None = None

    def started_at(self) -> float:
        """When the replay began: the first arrival asked for it (every top-level agent asks as the run starts)."""
        if self._started_at is None:
            self._started_at = time.monotonic()
        return self._started_at

    def agent_configs(self) -> list[dict[str, Any]]:
        """The run's [[agents]], one a session: its prompt a line that names it (its turns are its script's)."""
        return [{"name": name, "prompt": f"replay session {script.session_id}: {script.turns} turns",
                 "max_tokens": max(script.max_tokens(turn) for turn in range(1, script.turns + 1))}
                for name, script in self.scripts.items()]

    def turn_done(self, agent: str, turn: int) -> None:
        """`agent` has its answer to `turn`: the subagents that turn spawns arrive."""
        session = self.sessions.get(agent)
        for child in self.plan.spawns.get((session, turn), ()) if session is not None else ():
            self.scripts[self.names[child]].spawn()

    def ended(self, agent: str, status: str) -> None:
        """`agent` ended: the subagents it had not spawned never will."""
        session = self.sessions.get(agent)
        if session is None:
            return
        for (parent, _), children in self.plan.spawns.items():
            if parent == session:
                for child in children:
                    self.scripts[self.names[child]].skip(f"its parent {agent} {status} before the turn that spawns it")
