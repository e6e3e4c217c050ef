"""The latency panel's figures (what vllm-top shows): p50 and p95 of time to first token, inter-token latency,
queue time and prefill time per endpoint over the last window, and whether decoding has stalled server-wide.

Where they come from:
- vLLM: its histograms (`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (older:
  `vllm:time_per_output_token_seconds`), `vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`).
  The window's figures are quantiles of the difference between two scrapes' buckets, interpolated within a
  bucket as Prometheus' `histogram_quantile` does; one in the first bucket or the +Inf one is only a bound
  (`< 300 ms`, `> 60 s`), and is told as one.
- SGLang: its TTFT histogram (`sglang:time_to_first_token_seconds`; its inter-token one where it has it).
- llama.cpp: no latency histograms; each of our requests' `timings` (`prompt_ms`, `predicted_per_token_ms`, in
  its last stream chunk) with the TTFT we measured ourselves, kept for the window (`TimingsWindow`).
- Decode stall: the server's generated-token counter (llama.cpp: its decode calls) flat while it says requests run.

Pure: parsing, differences and quantiles take text and numbers; the monitor keeps the scrapes and the times.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cerevisor_tui.contract.events import LatencySample, Quantiles
from cerevisor_tui.endpoints import bounds

WINDOW_S = 60.0
"""How far back the panel's figures reach: the scrape nearest this age is the window's start."""

QUANTILES = (0.5, 0.95)
Bound = Literal["", "below", "above"]

# Each figure's histogram, by server kind; the first name found wins (vLLM renamed its inter-token histogram).
HISTOGRAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "ttft": ("vllm:time_to_first_token_seconds",),
        "inter_token": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "queue": ("vllm:request_queue_time_seconds",),
        "prefill": ("vllm:request_prefill_time_seconds",),
    },
    "sglang": {
        "ttft": ("sglang:time_to_first_token_seconds",),
        "inter_token": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    },
}
# What moves while a server decodes, and how many requests it says it runs, by server kind.
PROGRESS_COUNTERS = {"vllm": "vllm:generation_tokens", "sglang": "sglang:generation_tokens",
                     "llamacpp": "llamacpp:n_decode"}
RUNNING_GAUGES = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs",
                  "llamacpp": "llamacpp:requests_processing"}
FIGURES = ("ttft", "inter_token", "queue", "prefill")

_FAMILIES = frozenset(
    name for kinds in HISTOGRAMS.values() for names in kinds.values() for name in names
) | frozenset(PROGRESS_COUNTERS.values()) | frozenset(RUNNING_GAUGES.values())


@dataclass(frozen=True)
class Buckets:
    """A histogram as Prometheus exposes it: cumulative counts per upper bound (`le`), the last +Inf."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Buckets | None) -> Buckets:
        """The observations since `earlier`; a server that restarted (a count went down, or other buckets)
        counts from zero, so then these are its own."""
        if earlier is None or earlier.bounds != self.bounds:
            return self
        diff = tuple(now - then for now, then in zip(self.counts, earlier.counts, strict=True))
        return self if any(d < 0 for d in diff) else Buckets(self.bounds, diff)


def _rank_bucket(q: float, buckets: Buckets) -> tuple[int, list[float], float] | None:
    """The bucket the q-quantile's rank falls in, the counts (a dip between two bucket updates evened out, as
    Prometheus does) and the rank; None for an empty histogram or one without +Inf."""
    bounds, counts = buckets.bounds, list(buckets.counts)
    if len(bounds) < 2 or not math.isinf(bounds[-1]) or not counts or counts[-1] <= 0 or not 0 <= q <= 1:
        return None
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    rank = q * counts[-1]
    return bisect.bisect_left(counts, rank), counts, rank


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0..1) of a histogram, as Prometheus' histogram_quantile computes it: the bucket the rank
    falls in, and linear interpolation between its lower and upper bounds (the first bucket's lower bound 0).
    A rank in the +Inf bucket is the highest finite bound. None for an empty histogram or one without +Inf."""
    found = _rank_bucket(q, buckets)
    if found is None:
        return None
    b, counts, rank = found
    bounds = buckets.bounds
    if b >= len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else counts[b - 1]
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return bounds[b]
    return start + (bounds[b] - start) * (rank - below) / in_bucket


def bounded_quantile(q: float, buckets: Buckets) -> tuple[float | None, Bound]:
    """The q-quantile as the panel shows it: `histogram_quantile`, unless the histogram can only bound it. A rank
    in the first bucket is somewhere under that bucket's upper bound ("below": vLLM's queue time, whose first
    bucket is `le="0.3"`, would interpolate to 150 ms where nothing queued at all); one in the +Inf bucket is
    somewhere over the highest finite bound ("above"). The value is then that bound."""
    found = _rank_bucket(q, buckets)
    if found is None:
        return None, ""
    b, bounds = found[0], buckets.bounds
    if b >= len(bounds) - 1:
        return bounds[-2], "above"
    if b == 0 and bounds[0] > 0:
        return bounds[0], "below"
    return histogram_quantile(q, buckets), ""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile of plain values, interpolated between the two nearest (numpy's default); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _quantiles(p50: float | None, p95: float | None, count: float, bounds: tuple[Bound, Bound] = ("", "")
               ) -> Quantiles | None:
    """One figure over the window as the panel's event carries it (milliseconds matter: rounded to 0.1 ms)."""
    return None if p50 is None or p95 is None else Quantiles(round(p50, 4), round(p95, 4), count, *bounds)


def quantiles_of(buckets: Buckets | None) -> Quantiles | None:
    if buckets is None or buckets.total <= 0:
        return None
    (p50, p50_bound), (p95, p95_bound) = (bounded_quantile(q, buckets) for q in QUANTILES)
    return _quantiles(p50, p95, buckets.total, (p50_bound, p95_bound))


def quantiles_of_values(values: Sequence[float]) -> Quantiles | None:
    p50, p95 = (percentile(values, q) for q in QUANTILES)
    return _quantiles(p50, p95, float(len(values)))


@dataclass(frozen=True)
class LatencyScrape:
    """What one /metrics text says for the panel: each figure's histogram (label sets summed), the progress
    counter and the requests the server runs (None where it does not say)."""

    kind: str
    histograms: dict[str, Buckets] = field(default_factory=dict)
    progress: float | None = None
    running: float | None = None
    # the inter-token histogram's _sum (seconds) and _count (gaps): their differences between two scrapes give the
    # mean time per token a user saw, exactly, where its quantiles are only bounds (at a sped-up simulator every
    # gap falls under vLLM's first bucket, 10 ms)
    inter_token_sum_s: float | None = None
    inter_token_count: float | None = None


_LE = re.compile(r'[{,]\s*le="([^"]*)"')
# each family's sample names, so that a line is kept or dropped by one set lookup
_SAMPLE_NAMES = frozenset(f + suffix for f in _FAMILIES for suffix in ("", "_bucket", "_count", "_sum", "_total"))


def samples_of(text: str) -> Iterator[tuple[str, str | None, float]]:
    """(sample name, its `le` label or None, value) of each sample line of the families the panel reads; a line
    that does not read is skipped.

    Read by hand rather than with prometheus-client's parser, which costs the event loop the stall watchdog runs
    on 16 to 29 ms a scrape for the panel's ~200 lines of vLLM-shaped text, against 0.8 ms by hand
    (benchmarks/latency_parse.py, on a loaded 2-core box); tests/test_latency.py checks that both read the same
    numbers. Label sets are not kept: the panel sums them."""
    for line in text.splitlines():
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.partition(" ")[0]
        if name not in _SAMPLE_NAMES:
            continue
        if brace >= 0:
            labels, _, rest = line.rpartition("}")  # a value is a number: the last brace closes the labels
        else:
            labels, rest = "", line[len(name):]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = bounds.metric(float(fields[0]))
        except ValueError:
            continue
        if value is None:  # a value no server keeps (1e308, NaN, negative): absent
            continue
        le = _LE.search(labels) if labels else None
        yield name, le[1] if le else None, value


def parse_latency(text: str, kind: str) -> LatencyScrape:
    """The panel's part of a /metrics text of a server of `kind` (vllm, sglang, llamacpp), label sets (models,
    engines) summed; a text that does not parse gives what could be read, never an exception."""
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    totals: dict[str, float] = {}  # each histogram's _sum and _count, label sets summed
    for name, le, value in samples_of(text):
        if name.endswith("_bucket"):
            if le is None:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            per = buckets.setdefault(name[: -len("_bucket")], {})
            per[bound] = per.get(bound, 0.0) + value
        elif name.endswith(("_sum", "_count")):
            totals[name] = totals.get(name, 0.0) + value
        elif not name.endswith("_created"):
            base = name[: -len("_total")] if name.endswith("_total") else name
            sums[base] = sums.get(base, 0.0) + value
    histograms = {}
    for figure, names in HISTOGRAMS.get(kind, {}).items():
        found = next((n for n in names if n in buckets), None)
        if found is not None:
            bounds = tuple(sorted(buckets[found]))
            histograms[figure] = Buckets(bounds, tuple(buckets[found][b] for b in bounds))
    gaps = next((n for n in HISTOGRAMS.get(kind, {}).get("inter_token", ()) if f"{n}_count" in totals), "")
    return LatencyScrape(kind, histograms, sums.get(PROGRESS_COUNTERS.get(kind, "")),
                         sums.get(RUNNING_GAUGES.get(kind, "")), totals.get(f"{gaps}_sum"), totals.get(f"{gaps}_count"))


@dataclass(frozen=True)
class Timings:
    """llama.cpp's `timings` of one of our requests, with the time to first token we measured."""

    ttft_s: float | None
    prompt_ms: float | None
    predicted_per_token_ms: float | None


class LatencyWindow:
    """One endpoint's scrapes over the last `window_s` and its requests' timings (llama.cpp), turned into the
    panel's figures (its LatencySample) at each sample. Times are the caller's clock (monotonic seconds)."""

    def __init__(self, endpoint: str = "", window_s: float = WINDOW_S) -> None:
        self.endpoint = endpoint
        self.window_s = window_s
        self.scrapes: deque[tuple[float, LatencyScrape]] = deque()
        self.timings: deque[tuple[float, Timings]] = deque()
        self._progress: tuple[float, float] | None = None  # (counter value, when it last moved or was first seen)

    def add_timings(self, t: float, timings: Timings) -> None:
        self.timings.append((t, timings))

    def sample(self, t: float, scrape: LatencyScrape) -> LatencySample:
        """Take a scrape taken at `t`: the figures of the window that ends with it. None where the server does not
        tell or nothing was observed; `decode_stall_s`: how long generated tokens have been flat while requests
        run."""
        self.scrapes.append((t, scrape))
        # keep the newest scrape at least window_s old: it is the window's start
        while len(self.scrapes) > 2 and self.scrapes[1][0] <= t - self.window_s:
            self.scrapes.popleft()
        while self.timings and self.timings[0][0] < t - self.window_s:
            self.timings.popleft()
        start_t, start = self.scrapes[0]
        stall = self._stall(t, scrape)
        if scrape.histograms:
            earlier = start.histograms if len(self.scrapes) > 1 else {}  # a first scrape: all it has seen
            figures = {name: quantiles_of(b.minus(earlier.get(name))) for name, b in scrape.histograms.items()}
            return LatencySample(t, self.endpoint, "histograms", round(t - start_t, 3), decode_stall_s=stall,
                                 running=scrape.running, **{name: figures.get(name) for name in FIGURES})
        taken = [timing for _, timing in self.timings]
        return LatencySample(
            t, self.endpoint, "timings", self.window_s if taken else 0.0,
            ttft=quantiles_of_values(_present(x.ttft_s for x in taken)),
            inter_token=quantiles_of_values([ms / 1000 for ms in _present(x.predicted_per_token_ms for x in taken)]),
            prefill=quantiles_of_values([ms / 1000 for ms in _present(x.prompt_ms for x in taken)]),
            decode_stall_s=stall, running=scrape.running)

    def _stall(self, t: float, scrape: LatencyScrape) -> float | None:
        """Seconds the progress counter has been flat while the server runs requests; None when it is moving,
        nothing runs, or the server does not say."""
        if scrape.progress is None:
            self._progress = None
            return None
        if self._progress is None or scrape.progress != self._progress[0] or not scrape.running:
            self._progress = (scrape.progress, t)
            return None
        return round(t - self._progress[1], 3)


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]
