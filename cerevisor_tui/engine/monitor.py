"""The server monitor: each watched endpoint's /health and /metrics (a router's: each of its workers'), read on
the run's interval and told as a ServerSample; the box's GPUs, told as a GpuSample at the same pace; the KV fit
the server's own capacity implies; and, at a stall deadline, whether the server is busy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import httpx
import msgspec

from cerevisor_tui.config.models import Config
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.client import build_client
from cerevisor_tui.endpoints.latency import LatencyScrape, LatencyWindow, Timings
from cerevisor_tui.endpoints.metrics import (
    MetricsSnapshot,
    ServerStatus,
    prefix_counts,
    prefix_hit_rate,
    read_routed,
    read_server,
)
from cerevisor_tui.endpoints.tiers import TierSnapshot, idle_tier_warning
from cerevisor_tui.engine import load
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.endpoint_state import EndpointStates
from cerevisor_tui.engine.gpus import watch_gpus

KV_SEEN = 64  # samples of KV use kept per endpoint (at the default interval, about a minute)


class ServerMonitor:
    """What the run knows of its servers: their last status and sample, and each endpoint's KV load estimate
    (the configured one, replaced by the server's own capacity when it reports one)."""

    def __init__(self, config: Config, connections: Connections, emit: Callable[[ev.Event], None],
                 projected_context: Callable[[str], float | None], *, states: EndpointStates | None = None,
                 clock: Clock = MONOTONIC) -> None:
        self.config = config
        self.clock = clock  # what the interval between looks is slept on (the run's clock)
        self.states = states  # the endpoints' states, told each look (engine/endpoint_state.py)
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
        # the KV use each recent sample saw, (when it answered, usage): whether it climbs (kv_climbed)
        self.kv_seen: dict[str, deque[tuple[float, float]]] = {}
        # its token counters at each recent sample, (when, generated, prefill tokens): whether they move (shows_life)
        self.counters_seen: dict[str, deque[tuple[float, float | None, float | None]]] = {}
        # a router's workers are read with a client of their own, without the endpoint's API key
        self._worker_clients: dict[str, httpx.AsyncClient] = {}
        # the latency panel of each endpoint: its scrapes over the window, and llama.cpp's timings of our requests
        self.latency: dict[str, LatencyWindow] = {ep.name: LatencyWindow(ep.name) for ep in config.endpoints}
        self._latency_sent: dict[str, ev.LatencySample] = {}
        # each endpoint's KV tiers at its first sample, where the hits per tier count from
        self._tiers_first: dict[str, TierSnapshot] = {}
        # the gaps between output tokens its server observed since the monitor's first scrape, (seconds, gaps),
        # summed over the differences between scrapes: the time per token its users see, on the server's own
        # clock, which a sped-up simulator keeps where the host cannot (Auto's interactivity floor)
        self.decode_gaps: dict[str, tuple[float, float]] = {}

    def add_timings(self, endpoint: str, timings: Timings) -> None:
        """A request of ours on `endpoint` ended with llama.cpp's `timings`: the panel's figures for that server."""
        self.latency[endpoint].add_timings(self.clock.now(), timings)

    def _tell_latency(self, endpoint: str, metrics: MetricsSnapshot | None) -> None:
        """The endpoint's latency panel after a sample, told when its figures changed. A llama-server without
        /metrics (it needs --metrics) still has its requests' timings."""
        window = self.latency[endpoint]
        scrape = metrics.latency if metrics is not None else None
        if scrape is None:
            if not window.timings:
                return
            scrape = LatencyScrape(metrics.kind if metrics is not None else "unknown")
        event = window.sample(self.clock.now(), scrape)
        sent = self._latency_sent.get(endpoint)
        if sent is None or msgspec.structs.replace(sent, t=event.t, window_s=event.window_s) != event:
            self._latency_sent[endpoint] = event
            self.emit(event)

    async def read(self, endpoint: str) -> ServerStatus:
        """One look at the endpoint's /health and /metrics; a server that answers nonsense is 'unknown', never a crash.
        A router (`metrics_urls`): its health and its workers' metrics together."""
        return (await self.look(endpoint))[0]

    async def look(self, endpoint: str) -> tuple[ServerStatus, tuple[ServerStatus, ...]]:
        """The endpoint's status, and each of its workers' when it is a router (else none)."""
        base_url = self.connections.base_urls[endpoint]
        workers = self.endpoints[endpoint].metrics_urls
        try:
            if not workers:
                return await read_server(self.connections.clients[endpoint], base_url), ()
            client = self._worker_clients.get(endpoint)
            # a look outside the monitor's loop (a deadline before its first sample) brings a client of its own
            async with nullcontext(client) if client is not None else build_client(len(workers)) as client:
                routed = await read_routed(self.connections.clients[endpoint], base_url, client, workers)
            return routed.fleet, routed.workers
        except Exception as exc:  # noqa: BLE001 - a monitoring read must never end the run
            return ServerStatus(base_url=base_url, reachable=False, error=f"unreadable: {exc}"[:200]), ()

    async def run(self, endpoint: str, on_sample: Callable[[str], None]) -> None:
        """Read the endpoint every `[run] metrics_interval_s` for as long as the run goes on; `on_sample` is
        called after each sample and the fit it implies."""
        workers = self.endpoints[endpoint].metrics_urls
        if workers:
            async with build_client(len(workers)) as client:
                self._worker_clients[endpoint] = client
                try:
                    await self._run(endpoint, on_sample)
                finally:
                    del self._worker_clients[endpoint]
        else:
            await self._run(endpoint, on_sample)

    async def _run(self, endpoint: str, on_sample: Callable[[str], None]) -> None:
        previous: dict[str, MetricsSnapshot] = {}  # by worker URL; "" for the endpoint itself
        while True:
            status, workers = await self.look(endpoint)
            self.status[endpoint] = status
            if self.states is not None:
                self.states.looked(endpoint, status)
            if status.kind != "unknown":  # what serves it: its requests ask for prefill progress on llama.cpp
                self.connections.server_kinds[endpoint] = status.kind
            # when it answered: a swamped vLLM answers /metrics seconds after it was asked, with its state then; on
            # the run's clock, which the attempts' times it is judged against (the watchdog, the wedge rules) are on
            self.status_at[endpoint] = self.clock.now()
            m = status.metrics
            if m is not None:
                if m.kv_cache_usage is not None:
                    self.kv_seen.setdefault(endpoint, deque(maxlen=KV_SEEN)).append(
                        (self.status_at[endpoint], m.kv_cache_usage))
                self.counters_seen.setdefault(endpoint, deque(maxlen=KV_SEEN)).append(
                    (self.status_at[endpoint], m.generated, m.prefill_tokens))
            rows = [_sample_fields(w, previous.get(w.base_url)) for w in workers]
            fields = _sample_fields(status, previous.get(""))
            if workers:  # the fleet's prefix hits: the workers' own, since each one's last sample, together
                counted = [r for r in rows if r["prefix_queries"] is not None]
                queries = sum(r["prefix_queries"] for r in counted)
                hits = sum(r["prefix_hit_rate"] * r["prefix_queries"] for r in counted if r["prefix_hit_rate"] is not None)
                fields["prefix_queries"] = queries if counted else None
                fields["prefix_hit_rate"] = hits / queries if queries > 0 else None
            m = status.metrics
            tiers = m.tiers if m is not None else None
            if tiers is not None:
                self._tiers_first.setdefault(endpoint, tiers)
            self.last_sample[endpoint] = sample = ev.ServerSample(
                self.clock.now(), endpoint, fields["healthy"], status.kind, fields["running"], fields["waiting"],
                fields["kv_cache_usage"], fields["prefix_hit_rate"], _num(m.preemptions) if m else None,
                fields["kv_cache_tokens"], fields["detail"],
                slots_busy=status.slots.processing if status.slots else None,
                slots_total=status.slots.total if status.slots else None,
                prefix_queries=fields["prefix_queries"],
                workers=[ev.WorkerSample(w.base_url, **row) for w, row in zip(workers, rows, strict=True)],
                tiers=tier_sample(self._tiers_first.get(endpoint), previous[""].tiers if "" in previous else None,
                                  tiers),
            )
            self.samples[endpoint] += 1
            self.emit(sample)
            if not workers:  # a router's workers' histograms: not summed yet
                self._tell_latency(endpoint, m)
                if m is not None and (gaps := decode_gaps(previous[""].latency if "" in previous else None,
                                                          m.latency)) is not None:
                    seconds, count = self.decode_gaps.get(endpoint, (0.0, 0.0))
                    self.decode_gaps[endpoint] = (seconds + gaps[0], count + gaps[1])
            if m is not None:
                previous[""] = m
            for w in workers:
                if w.metrics is not None:
                    previous[w.base_url] = w.metrics
            self.refresh_fit(endpoint, m.kv_cache_size_tokens if m is not None else None,
                             tiers.cpu_capacity_tokens if tiers is not None else None)
            on_sample(endpoint)
            await self.clock.sleep(self.config.run.metrics_interval_s)

    async def run_gpus(self) -> None:
        """Read the box's GPUs at the pace of the server samples, for as long as the run goes on."""
        await watch_gpus(self.emit, self.config.run.metrics_interval_s, self.clock)

    def refresh_fit(self, endpoint: str, server_kv_tokens: float | None, server_cpu_tokens: float | None = None) -> None:
        """How many conversations fit: the server's own KV capacity when it reports one (else the configured
        estimate's), over the conversation length `[endpoints.capacity] context_tokens` gives, or else the
        one the agents' own conversations project to (their live context and their turns to come). A CPU tier
        the server reports (`server_cpu_tokens`) is how many more it holds there."""
        current = self.load.get(endpoint)
        context = (self.endpoints[endpoint].capacity.context_tokens or int(self.projected_context(endpoint) or 0)
                   or (current.context_tokens if current else 0))
        if not context:
            return
        if server_kv_tokens:
            cpu = int(server_cpu_tokens // context) if server_cpu_tokens else None
            if (current is None or current.source != "server" or current.kv_capacity_tokens != server_kv_tokens
                    or current.context_tokens != context or (cpu is not None and current.cpu_conversations != cpu)):
                self.load[endpoint] = load.from_server(server_kv_tokens, context, current, cpu_conversations=cpu)
        elif current is not None and current.context_tokens != context:
            self.load[endpoint] = msgspec.structs.replace(
                current, context_tokens=context, conversations_fit=current.kv_capacity_tokens // context)

    def shows_life(self, endpoint: str, since: float) -> str:
        """What the server did after `since`, in words ("" for nothing): its KV use climbed (a prompt prefilled in
        chunks), its prefill counter moved (SGLang's prefill_compute tokens), or it generated tokens (other
        requests decoding: its engine steps). An estimated prefill is extended while one of these holds."""
        if self.kv_climbed(endpoint, since):
            return "KV use climbing"
        for index, words in ((2, "prefill tokens moving"), (1, "other requests decoding")):
            if _moved([(row[0], row[index]) for row in self.counters_seen.get(endpoint, ())], since):
                return words
        return ""

    def kv_climbed(self, endpoint: str, since: float) -> bool:
        """The server's KV use rose after `since`: its latest sample above the last one taken by then (or, with
        none taken by then, above the first since), as while a prompt is prefilled in chunks."""
        seen = self.kv_seen.get(endpoint)
        if not seen or seen[-1][0] <= since:
            return False
        before = [usage for at, usage in seen if at <= since]
        after = [usage for at, usage in seen if at > since]
        reference = before[-1] if before else after[0]
        return after[-1] > reference

    async def busy(self, endpoint: str, since: float = -math.inf) -> str | None:
        """Asked at a deadline: is the server loading its model, or are requests waiting in its queue?

        The monitor's recent sample answers at once when it can: a swamped server (the very case this check
        is for) can take seconds to answer a fresh /metrics read, and a late event loop adds its own. A
        sample that says busy stands for a while (a queue does not vanish in seconds); one that says not
        busy only while it is as fresh as the monitor makes them. Otherwise, or with no usable sample (no
        /metrics, an error), ask afresh. A sample taken before `since` (when the silence being judged began)
        does not answer: a request of ours still waiting at its start says nothing of a silence after its tokens.
        A sample's time is when its answer came.
        """
        if self.endpoints[endpoint].kind == "hosted":
            return None
        recent = self.status.get(endpoint)
        taken = self.status_at.get(endpoint, -math.inf)
        age = self.clock.now() - taken
        interval = self.config.run.metrics_interval_s
        if recent is not None and recent.busy_reason and age <= max(10.0, 3 * interval) and taken >= since:
            return recent.busy_reason
        if (recent is not None and not recent.busy_reason and recent.reachable and recent.metrics is not None
                and age <= 1.5 * interval + 0.5):
            return None
        status = await self.read(endpoint)
        return status.busy_reason


def decode_gaps(before: LatencyScrape | None, after: LatencyScrape | None) -> tuple[float, float] | None:
    """(seconds, gaps) the server's inter-token histogram grew by between two scrapes: (0, 0) from a first
    scrape (what came before the run is not its own), its whole count after a restart (a total went down); None
    from a server without the histogram."""
    if after is None or after.inter_token_sum_s is None or after.inter_token_count is None:
        return None
    if before is None or before.inter_token_sum_s is None or before.inter_token_count is None:
        return 0.0, 0.0
    seconds = after.inter_token_sum_s - before.inter_token_sum_s
    count = after.inter_token_count - before.inter_token_count
    if seconds < 0 or count < 0:
        return after.inter_token_sum_s, after.inter_token_count
    return seconds, count


def _moved(seen: list[tuple[float, float | None]], since: float) -> bool:
    """A counter's latest sample after `since` is above the last one taken by then (or the first since)."""
    known = [(at, value) for at, value in seen if value is not None]
    if not known or known[-1][0] <= since:
        return False
    before = [value for at, value in known if at <= since]
    after = [value for at, value in known if at > since]
    return after[-1] > (before[-1] if before else after[0])


def _num(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def tier_sample(first: TierSnapshot | None, prev: TierSnapshot | None, cur: TierSnapshot | None) -> ev.TierSample | None:
    """A server's KV tiers as the console shows them: the hits each served since `first` (the endpoint's first
    sample), and the warning of a tier that stores without loading; None for a server with no tier beyond GPU."""
    if cur is None:
        return None
    readings = []
    for t in cur.tiers:
        at_first = first.tier(t.tier) if first is not None else None
        hits = t.hits
        if hits is not None and at_first is not None and at_first.hits is not None and hits >= at_first.hits:
            hits -= at_first.hits  # a counter that went back is a restart: it counts from zero
        readings.append(ev.TierReading(t.tier, hits, t.unit, t.used_tokens, t.capacity_tokens, t.usage))
    return ev.TierSample(cur.source, readings, idle_tier_warning(prev, cur))


def _sample_fields(status: ServerStatus, previous: MetricsSnapshot | None) -> dict[str, Any]:
    """What a ServerSample (or one worker of it) says of one server's status; `previous` is its last metrics."""
    m = status.metrics
    # the prefix hits since the last sample; a first sample has only what the server says itself (SGLang's rate)
    counts = prefix_counts(previous, m) if m is not None and previous is not None else None
    return {
        "healthy": status.reachable and not status.loading and (status.health_status or 0) < 400,
        "running": _num(m.requests_running) if m else None,
        "waiting": _num(m.requests_waiting) if m else None,
        "kv_cache_usage": m.kv_cache_usage if m else None,
        "prefix_hit_rate": (prefix_hit_rate(previous, m) if previous is not None else m.prefix_cache_hit_rate)
        if m else None,
        "prefix_queries": counts[1] if counts is not None else None,
        "kv_cache_tokens": _num(m.kv_cache_size_tokens) if m else None,
        "detail": status.loading_message or ("loading" if status.loading else "") or (status.error or ""),
    }
