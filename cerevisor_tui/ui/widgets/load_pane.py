"""The load pane: what each server reports (with several endpoints or a router's workers, the fleet: a row
each and their totals), an endpoint's trend over the run (cap, tokens/s, queue, KV), the aggregate
throughput sparkline, each endpoint's KV estimate, and the GPUs of the run's box."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Container, Vertical
from textual.widgets import Static

from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.format import (
    ENDPOINT_STATE_ROLES,
    endpoint_state_text,
    fmt_count,
    fmt_number,
    fmt_percent,
    fmt_rate,
    fmt_seconds,
)
from cerevisor_tui.ui.mirror import ACTIVE, RunMirror
from cerevisor_tui.ui.model import UiModel
from cerevisor_tui.ui.widgets.throughput_bars import ThroughputBars
from cerevisor_tui.ui.widgets.trend_chart import TrendChart, TrendRow

ZONE_ROLES = {"fits": "success", "cliff": "warning", "overflow": "error"}
"""Theme colour of each KV zone: all in GPU memory, past it (evictions recomputed or reloaded), CPU tier full too."""


@dataclass(frozen=True)
class KvRow:
    """One endpoint's KV estimate line, as shown; compared to skip a redraw when nothing changed. The zone,
    the fit and whether the cap is past it are the engine's judgement (engine/load.py), from its LoadChanged."""

    endpoint: str
    conversations: int  # in flight on the endpoint now
    cap: int  # how many the cap lets run on it now
    zone: str
    estimate: ev.LoadEstimate | None
    note: str  # why there is no estimate
    cap_past_fit: bool
    server_kv_tokens: int | None


def kv_rows(mirror: RunMirror, *, finished: bool = False) -> tuple[KvRow, ...]:
    """`finished`: the run has ended, nothing is in flight: each endpoint's estimate without a zone or a cap."""
    rows = []
    for name, ep in mirror.endpoints.items():
        sv = mirror.servers.get(name)
        kv_tokens = int(sv.kv_cache_tokens) if sv and sv.kv_cache_tokens else None
        load = ep.load
        if load is not None and finished:
            rows.append(KvRow(name, 0, 0, "", load.estimate, load.note, False, kv_tokens))
        elif load is None:
            rows.append(KvRow(name, 0, 0, "", None, "", False, kv_tokens))
        else:
            rows.append(KvRow(name, load.conversations, load.cap, load.zone, load.estimate, load.note,
                              bool(load.warning), kv_tokens))
    return tuple(rows)


@dataclass(frozen=True)
class TierLine:
    """One server's KV tiers, as shown: where the conversations now open fall against what GPU memory holds and
    what GPU + CPU hold (`zone` the engine's, from its LoadChanged), the prefix hits each tier served since the
    run began, and the warning of a tier that stores without loading."""

    endpoint: str
    zone: str
    placement: str  # "open 80 · GPU 64 · GPU+CPU 128 conversations"
    served: str  # "prefix hits GPU 1.2M · CPU 340k · 1:fs 120 chunks  CPU 61% full" (tokens unless said)
    warning: str


def _capacity(est: ev.LoadEstimate | None, sample: ev.TierSample) -> str:
    if est is not None:
        both = f" · GPU+CPU {est.conversations_fit + est.cpu_conversations}" if est.cpu_conversations else ""
        return f"GPU {est.conversations_fit}{both} conversations"
    parts = [f"{t.tier.upper() if t.tier in ('gpu', 'cpu') else t.tier} {fmt_count(t.capacity_tokens)}"
             for t in sample.tiers if t.capacity_tokens]
    return (" · ".join(parts) + " tokens") if parts else "capacity not reported"


def tier_lines(mirror: RunMirror) -> tuple[TierLine, ...]:
    """A line per endpoint whose server reports KV tiers beyond GPU memory (vLLM offload, LMCache, SGLang
    HiCache); none for the others."""
    lines = []
    for name in mirror.endpoints:
        sample = mirror.samples.get(name)
        tiers = sample.tiers if sample is not None else None
        if tiers is None:
            continue
        load = mirror.endpoints[name].load
        est = load.estimate if load is not None else None
        placement = (f"open {load.conversations} · " if load is not None else "") + _capacity(est, tiers)
        served = []
        for t in tiers.tiers:
            label = t.tier.upper() if t.tier in ("gpu", "cpu") else t.tier
            served.append(f"{label} {'-' if t.hits is None else fmt_count(t.hits)}"
                          + (f" {t.unit}" if t.unit != "tokens" else ""))
        fill = next((t for t in tiers.tiers if t.tier == "cpu" and t.usage is not None), None)
        text = "prefix hits " + " · ".join(served)
        if fill is not None:
            text += f"  CPU {fmt_percent(fill.usage)} full"
        lines.append(TierLine(name, load.zone if load is not None else "", placement, text, tiers.warning))
    return tuple(lines)


@dataclass(frozen=True)
class FleetRow:
    """One line of the fleet table: an endpoint, a worker behind a router (`worker`), or the totals."""

    name: str
    health: str  # up | loading | down | wedged | "" (no state said yet)
    running: float | None
    waiting: float | None
    kv: float | None
    prefix: float | None
    agents: int | None  # ours running there; None for a worker (the router places them, not we)
    detail: str = ""
    worker: bool = False
    total: bool = False


def _health(healthy: bool | None, detail: str) -> str:
    if healthy is None:
        return ""
    if healthy:
        return "up"
    return "loading" if "load" in detail.lower() else "down"


def _worker_name(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def fleet_rows(mirror: RunMirror, now: float | None = None) -> tuple[FleetRow, ...]:
    """A row per endpoint and, under a router, per worker; then the totals (running and waiting summed, KV the
    fullest server's, prefix hits weighed by the lookups each made). Empty when there is one endpoint and no
    workers: the pane then keeps its one-line form."""
    samples = mirror.samples
    if len(mirror.endpoints) < 2 and not any(s.workers for s in samples.values()):
        return ()
    running_on: dict[str, int] = {}
    for a in mirror.agents.values():
        if a.status in ACTIVE:
            running_on[a.endpoint] = running_on.get(a.endpoint, 0) + 1
    rows: list[FleetRow] = []
    for name in mirror.endpoints:
        s = samples.get(name)
        agents = running_on.get(name, 0)
        # the run's word on its state where it said one (engine/endpoint_state.py), with how long and why
        told = mirror.state_of(name, now if now is not None else (mirror.finished.t if mirror.finished else 0.0))
        health = told[0] if told is not None else ""
        detail = ""
        if told is not None and told[0] != "up" and told[1]:
            detail = told[1] if told[2] is None else f"{endpoint_state_text(told[0], told[2])}: {told[1]}"
        if s is None:
            rows.append(FleetRow(name, health, None, None, None, None, agents, detail))
            continue
        rows.append(FleetRow(name, health, s.running, s.waiting, s.kv_cache_usage,
                             s.prefix_hit_rate, agents, detail or s.detail))
        for w in s.workers:
            rows.append(FleetRow(_worker_name(w.url), _health(w.healthy, w.detail), w.running, w.waiting,
                                 w.kv_cache_usage, w.prefix_hit_rate, None, w.detail, worker=True))
    tops = [r for r in rows if not r.worker]
    weighed = [(s.prefix_hit_rate, s.prefix_queries) for s in samples.values()
               if s.endpoint in mirror.endpoints and s.prefix_hit_rate is not None and s.prefix_queries]
    queries = sum(q for _, q in weighed)

    def total(values: list[float | None]) -> float | None:
        found = [v for v in values if v is not None]
        return sum(found) if found else None

    kvs = [r.kv for r in tops if r.kv is not None]
    rows.append(FleetRow("total", "", total([r.running for r in tops]), total([r.waiting for r in tops]),
                         max(kvs) if kvs else None, sum(r * q for r, q in weighed) / queries if queries else None,
                         sum(r.agents or 0 for r in tops), total=True))
    return tuple(rows)


def gpu_lines(sample: ev.GpuSample | None) -> tuple[str, ...]:
    """The GPU rows: `GPU 0 H100  util 87%  mem 71.2/80.0 GiB  power 512/700 W  63°C`, or why there are none.
    Nothing before the first GpuSample (a run that has not read them yet, a journal from an older version)."""
    if sample is None:
        return ()
    if not sample.gpus:
        return (f"GPUs  not read: {sample.error or 'none found'}",)
    lines = []
    for g in sample.gpus:
        used, total = g.memory_used_bytes, g.memory_total_bytes
        memory = "-" if used is None or total is None else f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB"
        power, limit = g.power_w, g.power_limit_w
        watts = "-" if power is None else f"{power:.0f}" + (f"/{limit:.0f}" if limit else "") + " W"
        temp = g.temperature_c
        lines.append(f"GPU {g.index} {g.name}  util {fmt_percent(g.utilization)}  "
                     f"mem {memory}  power {watts}  " + ("-" if temp is None else f"{temp:.0f}°C"))
    return tuple(lines)


BOUND_SIGNS = {"": "", "below": "<", "above": ">"}


def fmt_pair(q: ev.Quantiles | None) -> str:
    """A figure's p50/p95: `120/410 ms`, `1.2/3.4 s`; `-` when nothing was observed. A quantile the server's
    histogram only bounds shows as the bound: both in its first bucket `< 300 ms`, one of them `<300/410 ms`,
    past its last finite bucket `> 60 s`."""
    if q is None:
        return "-"
    in_ms = q.p95_s < 1
    unit = "ms" if in_ms else "s"

    def one(value_s: float) -> str:
        return f"{value_s * 1000:.0f}" if in_ms else f"{value_s:.1f}"

    if q.p50_bound and q.p50_bound == q.p95_bound and q.p50_s == q.p95_s:
        return f"{BOUND_SIGNS[q.p50_bound]} {one(q.p50_s)} {unit}"
    return f"{BOUND_SIGNS[q.p50_bound]}{one(q.p50_s)}/{BOUND_SIGNS[q.p95_bound]}{one(q.p95_s)} {unit}"


def latency_lines(mirror: RunMirror) -> tuple[str, ...]:
    """Each endpoint's latency panel, once it has one or is warmed up:
    `sim latency p50/p95  TTFT 120/410 ms  ITL 21/35 ms  queue 0/12 ms  prefill 95/300 ms  cold start 2.31 s`;
    a decode stall under it: `sim decode stalled 12 s: 3 running, no token generated`. llama.cpp tells no queue
    time; SGLang only its TTFT (and ITL where it has it)."""
    lines = []
    for name, ep in mirror.endpoints.items():
        lat = ep.latency
        warm = {"warming": "warming up", "failed": "warm-up failed"}.get(ep.warmup, "")
        if ep.cold_start_s is not None:
            warm = f"cold start {fmt_seconds(ep.cold_start_s)}"
        if lat is None and not warm:
            continue
        parts = [f"{name} latency p50/p95"]
        if lat is not None:
            parts.append(f"TTFT {fmt_pair(lat.ttft)}")
            parts.append(f"ITL {fmt_pair(lat.inter_token)}")
            if lat.source == "histograms":
                parts.append(f"queue {fmt_pair(lat.queue)}")
            parts.append(f"prefill {fmt_pair(lat.prefill)}")
        if warm:
            parts.append(warm)
        lines.append("  ".join(parts))
        if lat is not None and lat.decode_stall_s and mirror.finished is None:
            running = f"{lat.running:g} running" if lat.running else "requests running"
            lines.append(f"{name} decode stalled {fmt_seconds(lat.decode_stall_s)}: {running}, no token generated")
    return tuple(lines)


def trend_rows(model: UiModel, endpoint: str, colour: Callable[[str], str]) -> tuple[TrendRow, ...]:
    """`endpoint`'s trend as the chart draws it: cap, output tokens/s, requests waiting, KV-cache use.
    `colour` turns a theme variable into a Rich colour."""
    track = model.tracks.get(endpoint)
    if track is None or not len(track.trend):
        return ()
    points = track.trend.points
    last = track.trend.last
    cap = model.cap_of(endpoint)
    return (
        TrendRow("cap", tuple(p.cap for p in points), "-" if cap is None else str(cap), colour("accent")),
        TrendRow("tok/s", tuple(p.tokens_per_s for p in points), fmt_rate(last.tokens_per_s if last else None),
                 colour("primary")),
        TrendRow("waiting", tuple(p.waiting for p in points), fmt_number(last.waiting if last else None),
                 colour("warning")),
        TrendRow("KV", tuple(p.kv_cache_usage for p in points), fmt_percent(last.kv_cache_usage if last else None),
                 colour("secondary"), top=1.0),
    )


class LoadPane(Vertical):
    """Server numbers from ServerSample events (`-` until a server reports one), one endpoint's trend over
    the run (shown in the wide layout, in auto mode, and maximized), throughput over time, and per
    endpoint the KV estimate: the zone of the conversations in flight, how many fit, and whether the cap
    lets more run than fit; then a row per GPU of the run's box, once the run has read them (GpuSample). Once the
    run has finished, each endpoint says `finished` and nothing live is shown (no server, GPU or rate figure)."""

    ALLOW_MAXIMIZE = True
    DEFAULT_CSS = """
    LoadPane {
        height: auto;
        #servers { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
        #gpus { height: auto; text-wrap: nowrap; text-overflow: ellipsis; display: none; }
        #gpus.-shown { display: block; }
        #trend { height: auto; }
        #throughput-row { height: 1; layout: horizontal; }
        #throughput-label { height: 1; width: auto; color: $text-muted; padding-right: 2; }
        #throughput { height: 1; width: 1fr; }
        #kv-estimate { height: auto; color: $text-muted; text-wrap: nowrap; text-overflow: ellipsis; }
        #latency { height: auto; text-wrap: nowrap; text-overflow: ellipsis; display: none; }
        #latency.-shown { display: block; }
        #tiers { height: auto; text-wrap: nowrap; text-overflow: ellipsis; display: none; }
        #tiers.-shown { display: block; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._servers_shown: object = None
        self._gpus_shown: object = None
        self._latency_shown: object = None
        self._tiers_shown: object = None
        self._samples_shown = -1
        self._label_shown = ""
        self._kv_shown: object = None
        self._trend_shown: object = None

    def compose(self) -> ComposeResult:
        yield Static(id="servers")
        yield TrendChart(id="trend")
        with Container(id="throughput-row"):
            yield Static(id="throughput-label")
            yield ThroughputBars(id="throughput")
        yield Static(Text("KV estimate  -"), id="kv-estimate")
        yield Static(id="tiers")  # shown once a server reports KV tiers beyond GPU memory
        yield Static(id="latency")  # shown once an endpoint has a latency panel or a warm-up
        # last: a box of 8 GPUs is 8 lines, and the lines above keep their places in a pane of 6
        yield Static(id="gpus")

    def invalidate(self) -> None:
        """Redraw everything at the next sync (the theme or the engine changed)."""
        self._servers_shown = None
        self._gpus_shown = None
        self._latency_shown = None
        self._tiers_shown = None
        self._label_shown = ""
        self._kv_shown = None
        self._trend_shown = None
        self._samples_shown = -1

    def set_kv_estimate(self, text: str | Text) -> None:
        """Fill the KV estimate slot by hand (`sync` fills it from the engine)."""
        self.query_one("#kv-estimate", Static).update(text)

    def sync(self, mirror: RunMirror, now: float, *, endpoint: str | None = None) -> None:
        """`endpoint`: whose trend to draw (the selected agent's); None: the first endpoint's."""
        model = mirror
        finished = mirror.finished is not None
        self._sync_gpus(mirror)
        self._sync_latency(mirror)
        if finished:  # no server is read any more: its last sample is not the present
            ended = tuple(mirror.endpoints)
            if ended != self._servers_shown:
                self._servers_shown = ended
                self.query_one("#servers", Static).update(self._finished_text(ended))
        else:
            fleet = fleet_rows(mirror, now)
            lines = () if fleet else self._server_lines(mirror, now)
            if (fleet or lines) != self._servers_shown:
                self._servers_shown = fleet or lines
                self.query_one("#servers", Static).update(self._fleet_text(fleet) if fleet else
                                                          self._lines_text(lines))
        if model.samples_taken != self._samples_shown:
            self._samples_shown = model.samples_taken
            # a fixed time window, oldest on the left, so the line does not stretch while it fills
            window = model.throughput.maxlen or len(model.throughput)
            self.query_one("#throughput", ThroughputBars).values = [0.0] * (window - len(model.throughput)) + list(
                model.throughput)
        peak = max(model.throughput, default=0.0)
        rate = "finished" if finished else f"{fmt_rate(model.tokens_per_s(now))} tok/s"
        label = f"{rate}  peak {fmt_rate(peak)}  total {fmt_count(model.tokens_total)}"
        if label.rstrip() != self._label_shown.rstrip():
            # Width auto, the sparkline takes the rest. The label only ever widens: a width that changed with
            # every figure would lay the row out again and redraw the whole sparkline 4 times a second.
            grows = len(label) > len(self._label_shown)
            self._label_shown = label.ljust(len(self._label_shown))
            self.query_one("#throughput-label", Static).update(self._label_shown, layout=grows)
        self._sync_trend(model, endpoint if endpoint in model.tracks else next(iter(model.tracks), None))
        kv = kv_rows(mirror, finished=finished)
        if kv != self._kv_shown:
            self._kv_shown = kv
            self.set_kv_estimate(self._kv_text(kv))
        self._sync_tiers(mirror)

    def _sync_tiers(self, mirror: RunMirror) -> None:
        """`sim tiers CLIFF open 80 · GPU 64 · GPU+CPU 128 conversations  prefix hits GPU 1.2M · CPU 340k`, and
        under it the warning of a tier that stores without loading."""
        lines = tier_lines(mirror)
        if lines == self._tiers_shown:
            return
        self._tiers_shown = lines
        pane = self.query_one("#tiers", Static)
        pane.set_class(bool(lines), "-shown")
        colour = self.app.colour  # type: ignore[attr-defined]
        muted = colour("text-muted")
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, line in enumerate(lines):
            if i:
                text.append("\n")
            text.append(f"{line.endpoint} tiers ", style="bold")
            if line.zone:
                text.append(f"{line.zone.upper()} ", style=f"bold {colour(ZONE_ROLES.get(line.zone, 'warning'))}")
            text.append(line.placement)
            text.append(f"  {line.served}", style=muted)
            if line.warning:
                text.append(f"\n{line.endpoint} ", style="bold")
                text.append(f"⚠ {line.warning}", style=f"bold {colour('warning')}")
        pane.update(text)

    @staticmethod
    def _server_lines(mirror: RunMirror, now: float) -> tuple[tuple[Any, ...], ...]:
        rows = []
        for name in mirror.endpoints:
            sv = mirror.servers.get(name)
            slots = f"{sv.slots_busy}/{sv.slots_total}" if sv and sv.slots_total else ""
            told = mirror.state_of(name, now)
            state = (told[0], endpoint_state_text(told[0], told[2]), told[1]) if told and told[0] != "up" else None
            rows.append((name, state, *((sv.running, sv.waiting, sv.kv_cache_usage, sv.prefix_hit_rate, slots,
                                         "" if state and state[2] else sv.detail)
                                        if sv else (None, None, None, None, "", ""))))
        return tuple(rows)

    def _finished_text(self, endpoints: tuple[str, ...]) -> Text:
        """`sim finished`: the run has ended and its servers are no longer read."""
        text = Text(no_wrap=True, overflow="ellipsis")
        muted = self.app.colour("text-muted")  # type: ignore[attr-defined]
        for i, name in enumerate(endpoints):
            if i:
                text.append("\n")
            text.append(f"{name} ", style="bold")
            text.append("finished", style=muted)
        return text

    def _lines_text(self, rows: tuple[tuple[Any, ...], ...]) -> Text:
        """One endpoint's line: `sim running 2  waiting 0  KV 41%  prefix hit 93%`; an endpoint not up says so
        first: `vllm0 down 42 s: connection refused at 127.0.0.1:8399  running -  ...`."""
        text = Text(no_wrap=True, overflow="ellipsis")
        colour = self.app.colour  # type: ignore[attr-defined]
        muted = colour("text-muted")
        for i, (name, state, running, waiting, kv, prefix, slots, detail) in enumerate(rows):
            if i:
                text.append("\n")
            text.append(f"{name} ", style="bold")
            if state is not None:
                role = ENDPOINT_STATE_ROLES.get(state[0], "warning")
                text.append(state[1], style=f"bold {colour(role)}")
                text.append(f": {state[2]}  " if state[2] else "  ", style=muted)
            text.append("running ", style=muted)
            text.append(f"{fmt_number(running)}  ")
            text.append("waiting ", style=muted)
            text.append(f"{fmt_number(waiting)}  ")
            text.append("KV ", style=muted)
            text.append(f"{fmt_percent(kv)}  ")
            text.append("prefix hit ", style=muted)
            text.append(fmt_percent(prefix))
            if slots:
                text.append("  slots ", style=muted)
                text.append(slots)
            if detail:
                text.append(f"  {detail}", style=muted)
        return text

    def _sync_latency(self, mirror: RunMirror) -> None:
        lines = latency_lines(mirror)
        if lines == self._latency_shown:
            return
        self._latency_shown = lines
        pane = self.query_one("#latency", Static)
        pane.set_class(bool(lines), "-shown")
        colour = self.app.colour  # type: ignore[attr-defined]
        muted = colour("text-muted")
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, line in enumerate(lines):
            if i:
                text.append("\n")
            name, _, rest = line.partition(" ")
            text.append(f"{name} ", style="bold")
            stalled = rest.startswith("decode stalled")
            text.append(rest, style=f"bold {colour('warning')}" if stalled else muted)
        pane.update(text)

    def _sync_gpus(self, mirror: RunMirror) -> None:
        lines = gpu_lines(mirror.gpus) if mirror.finished is None else ()  # no longer read once the run ended
        if lines == self._gpus_shown:
            return
        self._gpus_shown = lines
        gpus = self.query_one("#gpus", Static)
        gpus.set_class(bool(lines), "-shown")
        muted = self.app.colour("text-muted")  # type: ignore[attr-defined]
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, line in enumerate(lines):
            if i:
                text.append("\n")
            head, _, rest = line.partition("  ")
            text.append(head, style="bold")
            text.append(f"  {rest}", style=muted if mirror.gpus is not None and not mirror.gpus.gpus else "")
        gpus.update(text)

    def _fleet_text(self, rows: tuple[FleetRow, ...]) -> Text:
        """The fleet as a table: a header, a row per endpoint (its workers indented under it), the totals."""
        colour = self.app.colour  # type: ignore[attr-defined]
        muted = colour("text-muted")
        health_style = {state: f"bold {colour(role)}" if role == "error" else colour(role)
                        for state, role in ENDPOINT_STATE_ROLES.items()}
        width = min(28, max(len("endpoint"), *(len(r.name) + (2 if r.worker else 0) for r in rows)))
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{'endpoint':<{width}}  health   running  waiting    KV  prefix  agents", style=muted)
        for r in rows:
            text.append("\n")
            name = ("  " + r.name if r.worker else r.name)[:width]
            text.append(f"{name:<{width}}", style="bold" if not r.worker else "")
            text.append(f"  {r.health or ('' if r.total else '-'):<7}", style=health_style.get(r.health, muted))
            text.append(f"  {fmt_number(r.running):>7}  {fmt_number(r.waiting):>7}  {fmt_percent(r.kv):>4}  "
                        f"{fmt_percent(r.prefix):>6}  {'' if r.agents is None else r.agents:>6}",
                        style="bold" if r.total else "")
            if r.detail:
                text.append(f"  {r.detail}", style=muted)
        return text

    def _sync_trend(self, model: UiModel, endpoint: str | None) -> None:
        """Rebuild the chart's rows only when a sample came, the cap moved or another endpoint is shown."""
        self.set_class(model.mode == "auto", "-auto")
        track = model.tracks.get(endpoint) if endpoint is not None else None
        key = (endpoint, track.trend.version if track else -1, model.mode, model.cap_of(endpoint) if endpoint else None)
        if key == self._trend_shown:
            return
        self._trend_shown = key
        self.query_one(TrendChart).rows = trend_rows(model, endpoint, self.app.colour) if endpoint else ()  # type: ignore[attr-defined]
        self.border_subtitle = f"trend: {endpoint}" if endpoint and len(model.tracks) > 1 else ""

    def _kv_text(self, rows: tuple[KvRow, ...]) -> Text:
        """`sim FITS 2 of 6 conversations fit (server)  24.6k KV tokens, 4.1k per conversation`."""
        colour = self.app.colour  # type: ignore[attr-defined]
        muted = colour("text-muted")
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, row in enumerate(rows):
            if i:
                text.append("\n")
            text.append(f"{row.endpoint} ", style="bold")
            est = row.estimate
            if est is None:
                text.append("KV estimate -", style=muted)
                if row.server_kv_tokens:
                    text.append(f"  server holds {fmt_count(row.server_kv_tokens)} KV tokens: set "
                                "capacity.context_tokens to see how many conversations fit", style=muted)
                elif row.note:
                    text.append(f"  {row.note}", style=muted)
                continue
            if not row.zone:  # the run has ended: what fits, with nothing in flight to place against it
                text.append(f"{est.conversations_fit} conversations fit ({est.source})")
            else:
                text.append(f"{row.zone.upper()} ", style=f"bold {colour(ZONE_ROLES.get(row.zone, 'warning'))}")
                text.append(f"{row.conversations} of {est.conversations_fit} conversations fit ({est.source})")
            if row.cap_past_fit:
                text.append(f"  cap {row.cap} > fit", style=f"bold {colour('warning')}")
            more = f"  {fmt_count(est.kv_capacity_tokens)} KV tokens, {fmt_count(est.context_tokens)} per conversation"
            if est.cpu_conversations:
                more += f", CPU tier {est.cpu_conversations} more"
            if est.source == "estimate" and est.detail:
                more += f" · {est.detail}"
            text.append(more, style=muted)
        return text
