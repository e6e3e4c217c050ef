"""Warm-up before the first wave (`[run] warmup`): one short request to each endpoint the run uses, its time to
first token told as the endpoint's cold start (EndpointWarmed). No agent is sent before it ends, so the agents'
first-byte windows start on a server that has loaded its model, compiled its kernels and answered once.

A warm-up that fails (an HTTP error, no first token within the endpoint's first-byte window) is a notice, not a
run failure: the agents' own watchdog then judges the endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from contextlib import aclosing
from urllib.parse import urlsplit

import anyio

from cerevisor_tui.config.models import Config, EndpointConfig, ResolvedStall, is_loopback
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.errors import EndpointError, EndpointUnreachable
from cerevisor_tui.engine.connections import Connections
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


async def warm_up(config: Config, connections: Connections, policies: Mapping[str, ResolvedStall],
                  emit: Callable[[ev.Event], None], stop_asked: anyio.Event, request_prefix: str,
                  reused: Collection[str] = ()) -> None:
    """Warm each endpoint `to_warm` names, all at once; returns when every one has answered or failed, or at
    once when the run is stopped meanwhile. `request_prefix`: what the run's X-Request-Ids start with (a resumed
    run's own: engine/resume.py request_prefix), so a resume never sends its warm-up's id again."""
    eps = to_warm(config, reused)
    if not eps:
        return
    emit(ev.WarmupStarted(time.monotonic(), [ep.name for ep in eps]))
    async with anyio.create_task_group() as group:

        async def on_stop() -> None:
            await stop_asked.wait()
            group.cancel_scope.cancel()

        async def each() -> None:
            async with anyio.create_task_group() as warming:
                for ep in eps:
                    warming.start_soon(_warm, ep, connections, policies[ep.name], emit, request_prefix)
            group.cancel_scope.cancel()

        group.start_soon(on_stop)
        group.start_soon(each)


async def _warm(ep: EndpointConfig, connections: Connections, policy: ResolvedStall, emit: Callable[[ev.Event], None],
                request_prefix: str) -> None:
    sent = time.monotonic()
    first: float | None = None
    error = waited_for = ""
    wait_s = 0.25
    # the first token within the endpoint's first-byte window; the rest (its one token, its usage) within the idle one
    with anyio.move_on_after(policy.first_byte_timeout_s) as scope:
        while True:
            try:
                body = {**ep.extra_body,  # the server's own parameters, as the agents' requests carry them
                        "model": await connections.model(ep), "messages": [{"role": "user", "content": PROMPT}],
                        "stream": True, "stream_options": {"include_usage": True}, "max_tokens": MAX_TOKENS,
                        "temperature": 0}
                headers = {"X-Cerevisor-Agent": "warmup", "X-Request-Id": f"{request_prefix}.warmup.{ep.name}"}
                stream = connections.stream(ep.name, connections.chat_url(ep.name), body, headers)
                async with aclosing(stream.events()) as items:
                    async for kind, _ in items:
                        if first is None and kind in (DELTA, FINISH, USAGE):
                            first = time.monotonic()
                            scope.deadline = first + policy.idle_timeout_s
                break
            except EndpointError as exc:
                loading = isinstance(exc, EndpointUnreachable) or exc.status == 503
                if first is not None or not loading or ep.kind == "hosted":
                    error = exc.problem
                    break
                waited_for = exc.problem
                await anyio.sleep(wait_s)
                wait_s = min(wait_s * 2, WAIT_BACKOFF_CAP_S)
    if first is None and not error:
        error = f"no first token within {policy.first_byte_timeout_s:g} s" + (f" ({waited_for})" if waited_for else "")
    cold = round(first - sent, 4) if first is not None else None
    emit(ev.EndpointWarmed(time.monotonic(), ep.name, cold, "" if cold is not None else error))
    if cold is None:
        emit(ev.RunNotice(time.monotonic(), f"Warm-up of {ep.name} failed: {error}. The agents are sent anyway; "
                          "their own stall watchdog judges the endpoint.", "warning", "Warm-up"))
