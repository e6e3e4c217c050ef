"""Helpers for console tests: a config on the built-in simulator, and waiting on engine events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.config import Config, validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.state import AgentState
from cerevisor_tui.engine.status import Happening, move
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.theme_files import load_themes

FAST_SIM = {"seed": 7, "tokens_per_s": 200.0, "ttft_s": 0.02}


def sim_config(tmp_path: Path, *, agents: list[dict[str, Any]], sim: dict[str, Any] | None = None,
               stall: dict[str, Any] | None = None, run: dict[str, Any] | None = None,
               ui: dict[str, Any] | None = None) -> Config:
    """One simulated endpoint (started in-process by the engine) and the given agents."""
    return validate({
        "run": {"mode": "parallel", "max_concurrency": 2, "run_dir": str(tmp_path / "runs"),
                "metrics_interval_s": 0.2, **(run or {})},
        "stall": {"idle_timeout_s": 30.0, **(stall or {})},
        "ui": ui or {},
        "endpoints": [{"name": "sim", "kind": "simulated", "sim": {**FAST_SIM, **(sim or {})}}],
        "agents": agents,
    })


def console(config: Config, *, stream_process: bool = False, start_engine: bool = True,
            **kwargs: Any) -> CerevisorApp:
    """The console over an in-process engine, as the console command builds it (control, mirror, run).
    `start_engine=False`: shown, not run; the mirror gets the RunStarted the run would announce."""
    engine = Engine(config, stream_process=stream_process)
    handle = run_handle(engine)
    if not start_engine:
        engine.emit(engine.started_event(time.monotonic()))
    return CerevisorApp(handle.control, handle.mirror, config, run=handle.run if start_engine else None,
                        themes=load_themes(None), **kwargs)


def engine_of(app: CerevisorApp) -> Engine:
    """The in-process engine behind the app's control: tests compare its own state with what the console shows
    (the app itself holds only the control and the mirror)."""
    engine = app.control.engine  # type: ignore[attr-defined]
    assert isinstance(engine, Engine)
    return engine


class EventLog:
    """Every engine event, and a way to wait for one (no sleeping in tests)."""

    def __init__(self, engine: Engine) -> None:
        self.seen: list[ev.Event] = []
        self._waiters: list[tuple[Callable[[ev.Event], bool], asyncio.Future[ev.Event]]] = []
        engine.subscribe(self)

    def __call__(self, event: ev.Event) -> None:
        self.seen.append(event)
        for predicate, future in self._waiters:
            if not future.done() and predicate(event):
                future.set_result(event)

    async def wait(self, predicate: Callable[[ev.Event], bool], timeout: float = 60.0) -> ev.Event:
        for event in self.seen:
            if predicate(event):
                return event
        future: asyncio.Future[ev.Event] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiters.remove((predicate, future))

    def of(self, kind: str, agent: str | None = None) -> list[ev.Event]:
        return [e for e in self.seen if e.kind == kind and (agent is None or getattr(e, "agent", None) == agent)]


def kind(name: str, agent: str | None = None, **fields: Any) -> Callable[[ev.Event], bool]:
    """A predicate: an event of this kind (for this agent, with these field values)."""

    def match(e: ev.Event) -> bool:
        if e.kind != name or (agent is not None and getattr(e, "agent", None) != agent):
            return False
        return all(getattr(e, k) == v for k, v in fields.items())

    return match


def palette_offers(app: CerevisorApp, name: str) -> bool:
    """The command palette (the screen on top) has searched what was typed, and lists the command called `name`
    first and highlighted: enter now runs it."""
    from textual.command import CommandList

    commands = app.screen.query_one(CommandList)
    if not commands.has_class("--visible") or not commands.option_count or commands.highlighted != 0:
        return False
    top = commands.get_option_at_index(0)
    return getattr(getattr(top, "hit", None), "text", None) == name


@pytest.fixture(autouse=True)
def _no_user_dirs(tmp_path, monkeypatch):
    """Keep tests away from the real user config, state and themes."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.delenv("CEREVISOR_TUI_CONFIG", raising=False)


STATUS_WITH = {"AgentQueued": "queued", "AgentStarted": "prefill", "EndpointWaiting": "waiting",
               "FirstToken": "streaming", "StallWarning": "stalling", "AgentRetrying": "retrying",
               "ToolCallStarted": "tool", "ToolCallFinished": "prefill", "ApprovalRequested": "approval"}
"""The status the engine gives an agent as it emits each of these (a scene made by hand says it as the engine would)."""


def emit_as_engine(engine: Engine, event: ev.Event) -> None:
    """A hand-made event emitted with the status change the engine makes with it: the agent's status is set on the
    engine's own record, which tells it (AgentStatus) before the event, as in a run."""
    status = STATUS_WITH.get(event.kind)
    if status is not None:
        set_status(engine.agents[event.agent], status)
    engine.emit(event)


# the happening that takes an agent to each status (engine/status.py), for scenes made by hand
_TO: dict[str, Happening] = {"pending": "reset", "queued": "queued", "prefill": "sent", "waiting": "refused",
                             "streaming": "token", "stalling": "warned", "retrying": "retrying", "tool": "tool",
                             "approval": "approval", "idle": "idle", "wedged": "wedged", "released": "released",
                             "completed": "completed", "failed": "failed", "killed": "killed", "skipped": "skipped",
                             "cancelled": "cancelled"}


def set_status(st: AgentState, status: str) -> None:
    """A hand-made scene's agent moved to `status` through the engine's own table, as a run would move it."""
    move(st, _TO[status])
    assert st.status == status, f"the table does not take {st.name} from {st.status} to {status}"
