"""The server monitor: each watched endpoint's /health and /metrics, read on the run's interval and told as a
ServerSample; the KV fit the server's own capacity implies; and, at a stall deadline, whether the server is busy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import anyio

from cerevisor_tui.config.models import Config
from cerevisor_tui.endpoints.metrics import MetricsSnapshot, ServerStatus, prefix_hit_rate, read_server
from cerevisor_tui.engine import events as ev
from cerevisor_tui.engine import load
from cerevisor_tui.engine.connections import Connections


class ServerMonitor:
    """What the run knows of its servers: their last status and sample, and each endpoint's KV load estimate
    (the configured one, replaced by the server's own capacity when it reports one)."""

    def __init__(self, config: Config, connections: Connections, emit: Callable[[ev.Event], None],
                 projected_context: Callable[[str], float | None]) -> None:
        self.config = config
        self.endpoints = {ep.name: ep for ep in config.endpoints}
        self.connections = connections
        self.emit = emit
        # the mean length the endpoint's conversations grow to, as the engine projects it (Engine.projected_context)
        self.projected_context = projected_context
        self.status: dict[str, ServerStatus] = {}
        self.status_at: dict[str, float] = {}
        self.last_sample: dict[str, ev.ServerSample] = {}
        self.samples: dict[str, int] = {ep.name: 0 for ep in config.endpoints}
        self.load: dict[str, load.LoadEstimate | None] = {}
        self.load_notes: dict[str, str] = {}
        for ep in config.endpoints:
            self.load[ep.name], self.load_notes[ep.name] = load.from_config(ep)

    async def read(self, endpoint: str) -> ServerStatus:
        """One look at the endpoint's /health and /metrics; a server that answers nonsense is 'unknown', never a crash."""
        base_url = self.connections.base_urls[endpoint]
        try:
            return await read_server(self.connections.clients[endpoint], base_url)
        except Exception as exc:  # noqa: BLE001 - a monitoring read must never end the run
            return ServerStatus(base_url=base_url, reachable=False, error=f"unreadable: {exc}"[:200])

    async def run(self, endpoint: str, on_sample: Callable[[str], None]) -> None:
        """Read the endpoint every `[run] metrics_interval_s` for as long as the run goes on; `on_sample` is
        called after each sample and the fit it implies."""
        previous: MetricsSnapshot | None = None
        while True:
            status = await self.read(endpoint)
            self.status[endpoint] = status
            self.status_at[endpoint] = time.monotonic()
            m = status.metrics
            detail = status.loading_message or ("loading" if status.loading else "") or (status.error or "")
            self.last_sample[endpoint] = sample = ev.ServerSample(
                time.monotonic(), endpoint, status.reachable and not status.loading and (status.health_status or 0) < 400,
                status.kind, _num(m.requests_running) if m else None, _num(m.requests_waiting) if m else None,
                m.kv_cache_usage if m else None,
                (prefix_hit_rate(previous, m) if m and previous else (m.prefix_cache_hit_rate if m else None)),
                _num(m.preemptions) if m else None, _num(m.kv_cache_size_tokens) if m else None, detail,
                slots_busy=status.slots.processing if status.slots else None,
                slots_total=status.slots.total if status.slots else None,
            )
            self.samples[endpoint] += 1
            self.emit(sample)
            previous = m or previous
            self.refresh_fit(endpoint, m.kv_cache_size_tokens if m is not None else None)
            on_sample(endpoint)
            await anyio.sleep(self.config.run.metrics_interval_s)

    def refresh_fit(self, endpoint: str, server_kv_tokens: float | None) -> None:
        """How many conversations fit: the server's own KV capacity when it reports one (else the configured
        estimate's), over the conversation length `[endpoints.capacity] context_tokens` gives, or else the
        one the agents' own conversations project to (their live context and their turns to come)."""
        current = self.load.get(endpoint)
        context = (self.endpoints[endpoint].capacity.context_tokens or int(self.projected_context(endpoint) or 0)
                   or (current.context_tokens if current else 0))
        if not context:
            return
        if server_kv_tokens:
            if (current is None or current.source != "server" or current.kv_capacity_tokens != server_kv_tokens
                    or current.context_tokens != context):
                self.load[endpoint] = load.from_server(server_kv_tokens, context, current)
        elif current is not None and current.context_tokens != context:
            self.load[endpoint] = dataclasses.replace(
                current, context_tokens=context, conversations_fit=current.kv_capacity_tokens // context)

    async def busy(self, endpoint: str) -> str | None:
        """Asked at a deadline: is the server loading its model, or are requests waiting in its queue?

        The monitor's recent sample answers at once when it can: a swamped server (the very case this check
        is for) can take seconds to answer a fresh /metrics read, and a late event loop adds its own. A
        sample that says busy stands for a while (a queue does not vanish in seconds); one that says not
        busy only while it is as fresh as the monitor makes them. Otherwise, or with no usable sample (no
        /metrics, an error), ask afresh.
        """
        if self.endpoints[endpoint].kind == "hosted":
            return None
        recent = self.status.get(endpoint)
        age = time.monotonic() - self.status_at.get(endpoint, -math.inf)
        interval = self.config.run.metrics_interval_s
        if recent is not None and recent.busy_reason and age <= max(10.0, 3 * interval):
            return recent.busy_reason
        if recent is not None and recent.reachable and recent.metrics is not None and age <= 1.5 * interval + 0.5:
            return None
        status = await self.read(endpoint)
        return status.busy_reason


def _num(value: float | int | None) -> float | None:
    return None if value is None else float(value)
