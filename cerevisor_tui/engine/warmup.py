"""Warm-up at the start of a run (`[run] warmup`): one short request to each endpoint the run uses, its time to
first token told as the endpoint's cold start (EndpointWarmed). An endpoint's agents are admitted when its own
warm-up ends (the scheduler holds that endpoint until then), so their first-byte windows start on a server that
has loaded its model, compiled its kernels and answered once, and no endpoint's warm-up holds another's agents.

A warm-up is judged as any request: the wedge rules see it while it is open (engine/wedge.py), and it has a short
deadline of its own (`[run] warmup_timeout_s`, within the endpoint's first-byte window), so a dead port or a
server that never answers fails it in seconds. A warm-up that fails is a notice, not a run failure: its agents
are sent, and their own watchdog judges the endpoint.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio

from cerevisor_tui.config.models import Config, EndpointConfig, ResolvedStall, is_loopback
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.errors import EndpointError, EndpointUnreachable
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.endpoint_state import EndpointStates
from cerevisor_tui.kinds import DELTA, FINISH, USAGE

PROMPT = "Reply with one word: ready."
MAX_TOKENS = 1
WAIT_BACKOFF_CAP_S = 5.0  # a server still loading refuses its port (vLLM) or answers 503 (llama.cpp): ask again


def is_local(ep: EndpointConfig) -> bool:
    """A local or simulated endpoint, or a hosted one on this machine: where `warmup = "auto"` warms."""
    if ep.kind != "hosted":
        return True
    return is_loopback(urlsplit(ep.base_url).hostname or "")


def used_endpoints(config: Config, reused: Collection[str] = ()) -> list[str]:
    """The endpoints the run sends to, in config order: its agents' (a pool's: every member), but for the agents
    a resumed run reuses, and the gateway's upstream."""
    wanted: set[str] = set()

    def add(name: str) -> None:
        pool = config.pool(name)
        wanted.update(pool.endpoints if pool is not None else (name,))

    for agent in config.agents:
        if agent.name not in reused:
            add(agent.endpoint or config.endpoints[0].name)
    if config.gateway is not None and config.endpoints:
        add(config.gateway.upstream or config.endpoints[0].name)
    return [ep.name for ep in config.endpoints if ep.name in wanted]


def to_warm(config: Config, reused: Collection[str] = ()) -> list[EndpointConfig]:
    """The endpoints `[run] warmup` warms: none (off), every one the run uses (on), or its local ones (auto);
    `reused`: the agents a resumed run does not send again."""
    if config.run.warmup == "off":
        return []
    eps = [config.endpoint(name) for name in used_endpoints(config, reused)]
    return eps if config.run.warmup == "on" else [ep for ep in eps if is_local(ep)]


@dataclass(eq=False)
class Warming:
    """One endpoint's warm-up request while it is out, as the wedge rules see it."""

    endpoint: str
    sent_at: float
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    answered: bool = False  # its first token came
    kill_reason: str = ""

    def kill(self, reason: str) -> None:
        """The wedge rules judged its server wedged: the warm-up fails with `reason`."""
        self.kill_reason = reason
        self.scope.cancel()


class Admission(Protocol):
    """The scheduler's side: an endpoint held takes no agent until it is admitted again."""

    def hold(self, endpoint: str) -> None: ...

    def admit(self, endpoint: str) -> None: ...


class Judge(Protocol):
    """The wedge rules' side: each warm-up request while it is out."""

    def warming(self, request: Warming) -> None: ...

    def warmed(self, request: Warming) -> None: ...


async def warm_up(config: Config, connections: Connections, policies: Mapping[str, ResolvedStall],
                  emit: Callable[[ev.Event], None], request_prefix: str, admission: Admission, judge: Judge,
                  reused: Collection[str] = (), *, states: EndpointStates | None = None, clock: Clock,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Warm each endpoint `to_warm` names, all at once, each held for admission until its own warm-up ends,
    answered or failed. Started with `TaskGroup.start`: the endpoints are held, and WarmupStarted told, when that
    returns; cancelled, it admits what it held. `states`: the endpoints' states, told each refusal; a port that
    never answered and is down by their rule ends its warm-up there (its requests are told so, not held)."""
    eps = to_warm(config, reused)
    if not eps:
        task_status.started()
        return
    for ep in eps:
        admission.hold(ep.name)
    emit(ev.WarmupStarted(clock.now(), [ep.name for ep in eps]))
    task_status.started()
    try:
        async with anyio.create_task_group() as warming:
            for ep in eps:
                warming.start_soon(_warm, ep, connections, policies[ep.name], emit, request_prefix, admission, judge,
                                   config.run.warmup_timeout_s, states, clock)
    finally:
        for ep in eps:
            admission.admit(ep.name)


async def _warm(ep: EndpointConfig, connections: Connections, policy: ResolvedStall, emit: Callable[[ev.Event], None],
                request_prefix: str, admission: Admission, judge: Judge, timeout_s: float,
                states: EndpointStates | None, clock: Clock) -> None:
    try:
        await _request(ep, connections, policy, emit, request_prefix, judge, timeout_s, states, clock)
    finally:
        admission.admit(ep.name)  # its agents go now, whatever came of it


async def _request(ep: EndpointConfig, connections: Connections, policy: ResolvedStall,
                   emit: Callable[[ev.Event], None], request_prefix: str, judge: Judge, timeout_s: float,
                   states: EndpointStates | None, clock: Clock) -> None:
    sent = clock.now()
    first: float | None = None
    error = waited_for = ""
    wait_s = 0.25
    first_byte_s = min(timeout_s, policy.first_byte_timeout_s)
    request = Warming(ep.name, sent)
    judge.warming(request)
    items: AsyncGenerator[tuple[int, Any], None] | None = None
    try:
        with request.scope:
            # the first token within its deadline (a server still loading is asked again meanwhile) ...
            with clock.move_on_after(first_byte_s):
                while True:
                    try:
                        body = {**ep.extra_body,  # the server's own parameters, as the agents' requests carry them
                                "model": await connections.model(ep), "messages": [{"role": "user", "content": PROMPT}],
                                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": MAX_TOKENS,
                                "temperature": 0}
                        headers = {"X-Cerevisor-Agent": "warmup", "X-Request-Id": f"{request_prefix}.warmup.{ep.name}"}
                        request.sent_at = clock.now()  # (again after a refusal: open from here)
                        items = reading = connections.stream(ep.name, connections.chat_url(ep.name), body,
                                                             headers).events()
                        async for kind, _ in reading:
                            if kind in (DELTA, FINISH, USAGE):
                                first = clock.now()
                                request.answered = True
                                break
                        break
                    except EndpointError as exc:
                        loading = isinstance(exc, EndpointUnreachable) or exc.status == 503
                        if not loading or ep.kind == "hosted":
                            error = exc.problem
                            break
                        waited_for = exc.problem
                        down_at = None
                        if states is not None and isinstance(exc, EndpointUnreachable):
                            down_s = states.refused(ep.name)
                            if down_s is not None:
                                error = f"it has refused connections for {down_s:.0f} s and has never answered"
                                break
                            down_at = states.down_at(ep.name)
                        # asked again when its grace ends, not a backoff later: what it holds is let go at once
                        await clock.sleep(max(0.0, min(wait_s, down_at - clock.now())) if down_at is not None
                                          else wait_s)
                        wait_s = min(wait_s * 2, WAIT_BACKOFF_CAP_S)
            # ... and the rest (its one token, its usage) within as long again
            if first is not None and items is not None:
                with clock.move_on_after(min(timeout_s, policy.idle_timeout_s)):
                    try:
                        async for _ in items:
                            pass
                    except EndpointError as exc:
                        error = exc.problem
    finally:
        if items is not None:
            with anyio.CancelScope(shield=True):
                await items.aclose()
        judge.warmed(request)
    if request.kill_reason:
        error = request.kill_reason
    elif first is None and not error:
        error = f"no first token within {first_byte_s:g} s" + (f" ({waited_for})" if waited_for else "")
    cold = round(first - sent, 4) if first is not None else None
    emit(ev.EndpointWarmed(clock.now(), ep.name, cold, "" if cold is not None else error))
    if cold is None:
        emit(ev.RunNotice(clock.now(), f"Warm-up of {ep.name} failed: {error}. Its agents are sent anyway; "
                          "their own stall watchdog judges the endpoint.", "warning", "Warm-up"))
