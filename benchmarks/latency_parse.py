"""What the latency panel adds to each /metrics read: `parse_metrics` on a vLLM-sized text (~60 KB: 30 histogram
families of 2 engines, as vLLM 0.10+ exposes) with the panel's histograms read (`parse_latency`, as the monitor
does now) against the same parse without them, side by side; and the whole text through prometheus-client's
parser, which is what filtering first saves. Prints medians and ratios.

    .venv/bin/python benchmarks/latency_parse.py
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from cerevisor_tui.endpoints import metrics
from cerevisor_tui.endpoints.latency import _FAMILIES, _SAMPLE_NAMES, parse_latency

LES = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5", "5.0",
       "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf")
PANEL = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
         "vllm:request_prefill_time_seconds")


def vllm_text() -> str:
    names = [*PANEL, *(f"vllm:other_histogram_{i}_seconds" for i in range(26))]
    lines = []
    for name in names:
        lines += [f"# HELP {name} Histogram of something.", f"# TYPE {name} histogram"]
        for engine in ("0", "1"):
            labels = f'engine="{engine}",model_name="meta-llama/Llama-3.1-8B-Instruct"'
            for i, le in enumerate(LES):
                lines.append(f'{name}_bucket{{{labels},le="{le}"}} {i * 7}.0')
            lines += [f"{name}_count{{{labels}}} 154.0", f"{name}_sum{{{labels}}} 12.5"]
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        lines += [f"# TYPE {gauge} gauge", f'{gauge}{{engine="0",model_name="m"}} 3.0']
    lines += ["# TYPE vllm:generation_tokens counter", 'vllm:generation_tokens_total{engine="0",model_name="m"} 9000.0']
    return "\n".join(lines) + "\n"


def medians_ms(fns, text: str, rounds: int = 200) -> list[float]:
    """Each function's median time, the rounds interleaved so that a loaded machine weighs on all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn(text)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1000 for t in times]


def panel_lines(text: str) -> str:
    """The panel's lines, their HELP and TYPE lines kept: what the library would be handed instead."""
    kept = []
    for line in text.splitlines():
        parts = line.split(" ", 3) if line.startswith("#") else []
        name = parts[2] if len(parts) > 2 else line.split("{", 1)[0].split(" ", 1)[0]
        if name in _FAMILIES or name in _SAMPLE_NAMES:
            kept.append(line)
    return "\n".join(kept) + "\n"


def without_panel(text: str) -> metrics.MetricsSnapshot:
    samples = metrics._Samples(metrics._families(metrics._relevant(text)))
    return metrics._vllm(samples)


def with_panel(text: str) -> metrics.MetricsSnapshot:
    return replace(without_panel(text), latency=parse_latency(text, "vllm"))


def main() -> None:
    text = vllm_text()
    assert metrics.parse_metrics(text).latency is not None
    base, now, panel_alone = medians_ms([without_panel, with_panel, lambda t: parse_latency(t, "vllm")], text)
    library = medians_ms([lambda t: list(text_string_to_metric_families(panel_lines(t)))], text,
                         rounds=50)[0]
    print(f"/metrics text: {len(text) / 1024:.0f} KiB, {text.count(chr(10))} lines")
    print(f"parse, without the panel:                 {base:7.2f} ms median")
    print(f"parse, with the panel:                    {now:7.2f} ms median  ({now / base:.2f}x)")
    print(f"  the panel's part alone (by hand):       {panel_alone:7.2f} ms median")
    print(f"  the panel's lines through the library:  {library:7.2f} ms median  ({library / panel_alone:.1f}x by hand)")


if __name__ == "__main__":
    main()
