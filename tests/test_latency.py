"""The latency panel's figures (endpoints/latency.py): Prometheus' histogram_quantile on explicit buckets worked
by hand, the window's difference between two scrapes, the decode-stall line, llama.cpp's per-request timings;
then end to end: the simulator's histograms read over loopback HTTP, and a llama-shaped server's `timings` and
decode counter carried by a run to its LatencySample events and its report."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.endpoints.latency import (
    Buckets,
    LatencyScrape,
    LatencyWindow,
    Timings,
    bounded_quantile,
    histogram_quantile,
    parse_latency,
    percentile,
    quantiles_of,
)
from cerevisor_tui.endpoints.metrics import read_server
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from tests.conftest import chunk, http_head, read_request

INF = math.inf
# le 0.1, 0.5, 1, +Inf holding 2, 4, 3 and 1 observations
B = Buckets((0.1, 0.5, 1.0, INF), (2.0, 6.0, 9.0, 10.0))


def test_quantiles_interpolate_within_the_bucket_the_rank_falls_in_as_prometheus_does():
    # rank 5 of 10 falls in (0.1, 0.5], 3 of its 4 observations in: 0.1 + 0.4 * 3/4
    assert histogram_quantile(0.5, B) == pytest.approx(0.4)
    # rank 1 falls in the first bucket, whose lower bound is 0: 0.1 * 1/2
    assert histogram_quantile(0.1, B) == pytest.approx(0.05)
    # rank 8.5 in (0.5, 1]: 0.5 + 0.5 * 2.5/3
    assert histogram_quantile(0.85, B) == pytest.approx(0.5 + 0.5 * 2.5 / 3)
    # rank 9.5 is in the +Inf bucket: the highest finite bound
    assert histogram_quantile(0.95, B) == 1.0
    # a rank exactly at a bucket's count is that bucket's upper bound
    assert histogram_quantile(0.6, B) == pytest.approx(0.5)


def test_a_quantile_in_the_first_or_the_inf_bucket_is_told_as_the_bound_it_is_under_or_over():
    # rank 1 of 10 is in le=0.1: all the histogram says is "under 100 ms", not the 50 ms Prometheus interpolates
    assert bounded_quantile(0.1, B) == (0.1, "below")
    assert bounded_quantile(0.95, B) == (1.0, "above")
    assert bounded_quantile(0.5, B) == (pytest.approx(0.4), "")
    # vLLM's queue time where nothing queued: every observation 0, all in its first bucket, le="0.3"
    idle = Buckets((0.3, 0.5, 0.8, INF), (30.0, 30.0, 30.0, 30.0))
    assert histogram_quantile(0.5, idle) == pytest.approx(0.15)  # the interpolation the panel used to show
    q = quantiles_of(idle)
    assert q is not None and (q.p50_s, q.p50_bound, q.p95_s, q.p95_bound) == (0.3, "below", 0.3, "below")
    assert bounded_quantile(0.5, Buckets((0.0, 1.0, INF), (5.0, 5.0, 5.0))) == (0.0, "")  # le="0": exact


def test_an_empty_histogram_or_one_without_inf_has_no_quantile():
    assert histogram_quantile(0.5, Buckets((0.1, INF), (0.0, 0.0))) is None
    assert histogram_quantile(0.5, Buckets((0.1, 0.5), (1.0, 2.0))) is None
    assert histogram_quantile(0.5, Buckets((INF,), (3.0,))) is None


def test_a_dip_between_two_bucket_updates_is_evened_out():
    # a scrape that caught le=0.5 before le=0.1 was updated: counts taken as [3, 3, 4, 4]
    dipped = Buckets((0.1, 0.5, 1.0, INF), (3.0, 2.0, 4.0, 4.0))
    assert histogram_quantile(0.5, dipped) == pytest.approx(0.1 * 2 / 3)


def test_the_window_is_the_difference_of_two_scrapes_and_a_reset_counts_from_zero():
    earlier = Buckets(B.bounds, (2.0, 2.0, 2.0, 2.0))  # two fast requests before the window
    window = B.minus(earlier)
    assert window.counts == (0.0, 4.0, 7.0, 8.0)
    # rank 4 of 8: all of (0.1, 0.5] -> its upper bound; rank 7.6: in the +Inf bucket
    assert histogram_quantile(0.5, window) == pytest.approx(0.5)
    assert histogram_quantile(0.95, window) == 1.0
    restarted = Buckets(B.bounds, (1.0, 1.0, 1.0, 1.0))
    assert restarted.minus(B) == restarted  # a count went down: the server restarted


def test_plain_percentiles_interpolate_between_the_two_nearest_values():
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8)
    assert percentile([], 0.5) is None


def vllm_text(engines: list[dict[str, list[float]]], generated: float, running: float,
              itl_name: str = "vllm:inter_token_latency_seconds") -> str:
    """vLLM-shaped /metrics: per engine, each histogram's cumulative bucket counts over le 0.1, 0.5, 1, +Inf."""
    les = ("0.1", "0.5", "1.0", "+Inf")
    lines = []
    names = {"ttft": "vllm:time_to_first_token_seconds", "itl": itl_name, "queue": "vllm:request_queue_time_seconds",
             "prefill": "vllm:request_prefill_time_seconds", "other": "vllm:e2e_request_latency_seconds"}
    for key, name in names.items():
        lines += [f"# HELP {name} x", f"# TYPE {name} histogram"]
        for i, counts in enumerate(engines):
            labels = f'engine="{i}",model_name="m"'
            for le, n in zip(les, counts.get(key, [0, 0, 0, 0]), strict=True):
                lines.append(f'{name}_bucket{{{labels},le="{le}"}} {n}')
            lines.append(f"{name}_count{{{labels}}} {counts.get(key, [0, 0, 0, 0])[-1]}")
            lines.append(f"{name}_sum{{{labels}}} 1.0")
    lines += ["# TYPE vllm:generation_tokens counter", f'vllm:generation_tokens_total{{model_name="m"}} {generated}',
              "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="m"}} {running}',
              "# TYPE vllm:num_requests_waiting gauge", 'vllm:num_requests_waiting{model_name="m"} 0']
    return "\n".join(lines) + "\n"


def test_vllm_histograms_are_read_with_their_engines_summed_and_the_old_itl_name_taken():
    text = vllm_text([{"ttft": [1, 3, 4, 4], "other": [9, 9, 9, 9]}, {"ttft": [1, 3, 5, 6]}], 120.0, 2.0,
                     itl_name="vllm:time_per_output_token_seconds")
    scrape = parse_latency(text, "vllm")
    assert scrape.histograms["ttft"] == Buckets((0.1, 0.5, 1.0, INF), (2.0, 6.0, 9.0, 10.0))
    assert "inter_token" in scrape.histograms  # the older name, as vLLM before 0.10 has it
    assert (scrape.progress, scrape.running) == (120.0, 2.0)
    assert parse_latency("not { metrics", "vllm") == LatencyScrape("vllm")


def library_reading(text: str, kind: str) -> LatencyScrape:
    """The panel's figures read with prometheus-client's parser: what the hand-written reader must agree with."""
    from prometheus_client.parser import text_string_to_metric_families

    from cerevisor_tui.endpoints.latency import HISTOGRAMS, PROGRESS_COUNTERS, RUNNING_GAUGES

    buckets: dict[str, dict[float, float]] = {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                per = buckets.setdefault(sample.name[: -len("_bucket")], {})
                per[float(sample.labels["le"])] = per.get(float(sample.labels["le"]), 0.0) + sample.value
            else:
                name = sample.name.removesuffix("_total")
                values[name] = values.get(name, 0.0) + sample.value
    histograms = {}
    for figure, names in HISTOGRAMS[kind].items():
        name = next((n for n in names if n in buckets), None)
        if name is not None:
            bounds = tuple(sorted(buckets[name]))
            histograms[figure] = Buckets(bounds, tuple(buckets[name][b] for b in bounds))
    gaps = next((n for n in HISTOGRAMS[kind].get("inter_token", ()) if f"{n}_count" in values), "")
    return LatencyScrape(kind, histograms, values.get(PROGRESS_COUNTERS[kind]), values.get(RUNNING_GAUGES[kind]),
                         values.get(f"{gaps}_sum"), values.get(f"{gaps}_count"))


def test_the_hand_reader_reads_what_prometheus_clients_parser_reads():
    text = vllm_text([{"ttft": [1, 3, 4, 4], "itl": [5, 50, 70, 71], "queue": [2, 2, 3, 3]}, {"ttft": [0, 1, 1, 2]}],
                     7.0, 1.0)
    # a label value with a brace, a space and an escaped quote; a sample with a timestamp
    text += ('vllm:request_prefill_time_seconds_bucket{model_name="a} \\"b",le="0.5"} 4 1700000000000\n'
             'vllm:request_prefill_time_seconds_bucket{model_name="a} \\"b",le="+Inf"} 6 1700000000000\n')
    assert parse_latency(text, "vllm") == library_reading(text, "vllm")
    assert parse_latency(text, "vllm").histograms["prefill"].counts[-1] == 6.0


def test_the_window_reaches_back_to_the_scrape_nearest_its_age():
    window = LatencyWindow(window_s=60.0)
    first = parse_latency(vllm_text([{"ttft": [2, 2, 2, 2]}], 0.0, 0.0), "vllm")
    # 30 s later, 8 more requests: 4 in (0.1, 0.5], 3 in (0.5, 1], 1 past 1 s
    second = parse_latency(vllm_text([{"ttft": [2, 6, 9, 10], "queue": [8, 8, 8, 8]}], 50.0, 1.0), "vllm")
    window.sample(0.0, first)
    figures = window.sample(30.0, second)
    assert figures.source == "histograms" and figures.window_s == 30.0
    assert figures.ttft is not None and figures.ttft.count == 8.0
    assert (figures.ttft.p50_s, figures.ttft.p95_s) == (pytest.approx(0.5), 1.0)
    assert figures.ttft.p95_bound == "above"  # the last is past every finite bucket: over 1 s
    # all 8 queued under 0.1 s: bounded by the first bucket, not interpolated in it (0.1 * 7.6/8)
    assert figures.queue is not None and (figures.queue.p95_s, figures.queue.p95_bound) == (0.1, "below")
    assert figures.prefill is None  # nothing observed in the window
    # at 95 s the 0 s scrape is more than the window behind: the 30 s one is the start, and nothing came since
    figures = window.sample(95.0, second)
    assert figures.window_s == 65.0 and figures.ttft is None


def test_a_decode_stall_is_tokens_flat_while_requests_run():
    window = LatencyWindow()
    flat = parse_latency(vllm_text([{}], 500.0, 3.0), "vllm")
    idle = parse_latency(vllm_text([{}], 500.0, 0.0), "vllm")
    moving = parse_latency(vllm_text([{}], 510.0, 3.0), "vllm")
    assert window.sample(0.0, flat).decode_stall_s is None  # first seen
    assert window.sample(2.0, flat).decode_stall_s == 2.0
    assert window.sample(7.0, flat).decode_stall_s == 7.0
    assert window.sample(9.0, moving).decode_stall_s is None  # tokens came
    assert window.sample(11.0, idle).decode_stall_s is None  # flat, but nothing runs
    assert window.sample(13.0, moving).decode_stall_s is None


def test_llama_timings_give_the_figures_over_our_own_requests_in_the_window():
    window = LatencyWindow(window_s=60.0)
    for t, ttft, prompt_ms, per_token_ms in [(0.0, 9.0, 8000.0, 90.0), (50.0, 0.2, 100.0, 20.0),
                                             (55.0, 0.4, 300.0, 30.0), (58.0, 0.6, 500.0, 40.0)]:
        window.add_timings(t, Timings(ttft, prompt_ms, per_token_ms))
    figures = window.sample(70.0, LatencyScrape("llamacpp", progress=10.0, running=1.0))
    assert figures.source == "timings"
    assert figures.queue is None  # llama.cpp's timings say nothing of its queue
    # the request at 0 s is out of the window; the others' p50 is their middle, p95 interpolated
    assert figures.ttft is not None and figures.ttft.count == 3.0
    assert (figures.ttft.p50_s, figures.ttft.p95_s) == (pytest.approx(0.4), pytest.approx(0.58))
    assert figures.prefill is not None and figures.prefill.p50_s == pytest.approx(0.3)
    assert figures.inter_token is not None and figures.inter_token.p95_s == pytest.approx(0.039)


def bucket_counts(text: str, name: str) -> list[tuple[float, float]]:
    """(le, count) of one histogram in a scrape, read with a regex, not with the code under test."""
    found = [(float(le), float(v)) for le, v in re.findall(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$',
                                                          text, re.M)]
    assert found, name
    return sorted(found)


def by_hand(q: float, counts: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile, worked again from its definition for the end-to-end check."""
    total = counts[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (cumulative - below)
        lower, below = le, cumulative
    raise AssertionError("no +Inf bucket")


@pytest.mark.anyio
async def test_the_simulators_histograms_over_http_give_the_figures_worked_by_hand():
    async with SimServer(SimSettings(speed=50.0, max_num_seqs=2)) as srv, httpx.AsyncClient() as client:
        window = LatencyWindow()
        before = await read_server(client, srv.base_url)
        text_before = (await client.get(srv.root_url + "/metrics")).text
        assert before.metrics is not None and before.metrics.latency is not None
        window.sample(0.0, before.metrics.latency)

        async def ask(i: int) -> None:
            body = {"model": "sim-model", "messages": [{"role": "user", "content": f"q{i} " * (50 * i + 10)}],
                    "max_tokens": 8}
            assert (await client.post(srv.base_url + "/chat/completions", json=body)).status_code == 200

        await asyncio.gather(*(ask(i) for i in range(6)))  # 6 requests, 2 at a time: some wait in the queue
        after = await read_server(client, srv.base_url)
        text_after = (await client.get(srv.root_url + "/metrics")).text
        assert after.metrics is not None and after.metrics.latency is not None
        figures = window.sample(10.0, after.metrics.latency)
        assert parse_latency(text_after, "vllm") == library_reading(text_after, "vllm")
    for figure, name in (("ttft", "vllm:time_to_first_token_seconds"), ("queue", "vllm:request_queue_time_seconds"),
                         ("prefill", "vllm:request_prefill_time_seconds")):
        then, now = bucket_counts(text_before, name), bucket_counts(text_after, name)
        diff = [(le, n - m) for (le, n), (_, m) in zip(now, then, strict=True)]
        q = getattr(figures, figure)
        assert q is not None and q.count == 6.0, figure
        # (as the panel's event carries them: to 0.1 ms)
        for quantile, value, bound in ((0.5, q.p50_s, q.p50_bound), (0.95, q.p95_s, q.p95_bound)):
            # a rank in the first bucket is that bucket's bound, said as one; elsewhere Prometheus' interpolation
            first = diff[0][1] >= quantile * diff[-1][1] and diff[0][0] > 0
            assert bound == ("below" if first else "" if not math.isinf(next(
                le for le, n in diff if n >= quantile * diff[-1][1])) else "above"), figure
            assert value == pytest.approx(diff[0][0] if first else by_hand(quantile, diff), abs=5e-5), figure


# ---- llama.cpp, end to end ---------------------------------------------------------------------------------
LLAMA_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 100
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total {decodes}
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


class LlamaShaped:
    """A loopback server shaped as llama-server: /health, /slots, /metrics (its decode counter frozen with a
    request processing: a decode stall) and streamed chat answers whose last chunk carries `timings`."""

    def __init__(self, timings: list[dict], *, metrics: bool = True) -> None:
        self.timings = list(timings)
        self.metrics = metrics  # llama-server serves /metrics only when started with --metrics
        self.chats = 0
        self.server: asyncio.base_events.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader)
            path = request.split(b" ", 2)[1].decode()
            if path == "/metrics" and not self.metrics:
                body = b"metrics are disabled"
                writer.write(http_head(501, "text/plain", length=len(body)) + body)
            elif path == "/metrics":
                body = LLAMA_METRICS.format(decodes=42, running=1).encode()
                writer.write(http_head(200, "text/plain", length=len(body)) + body)
            elif path in ("/health", "/slots"):
                body = b'{"status": "ok"}' if path == "/health" else b"[]"
                writer.write(http_head(200, "application/json", length=len(body)) + body)
            else:
                timings = self.timings[self.chats % len(self.timings)]
                self.chats += 1
                first = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}
                last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "timings": timings,
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
                writer.write(http_head(200, "text/event-stream"))
                for obj in (first, last):
                    writer.write(chunk(b"data: " + json.dumps(obj).encode() + b"\n\n"))
                writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.mark.anyio
@pytest.mark.parametrize("metrics", [True, False], ids=["with-metrics", "without-metrics"])
async def test_a_llama_servers_timings_reach_the_runs_latency_panel_and_report(stream_process, metrics):
    timings = [{"prompt_n": 3, "prompt_ms": ms, "prompt_per_token_ms": 1.0, "predicted_n": 1,
                "predicted_ms": per, "predicted_per_token_ms": per} for ms, per in [(100.0, 20.0), (300.0, 40.0)]]
    async with LlamaShaped(timings, metrics=metrics) as url:
        engine = Engine(validate({
            "run": {"metrics_interval_s": 0.05, "warmup": "off"},
            "endpoints": [{"name": "llama", "base_url": url, "kind": "local", "model": "m"}],
            "agents": [{"name": f"a{i}", "prompt": "hi", "max_tokens": 1} for i in range(4)],
        }), stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        engine.hold_open = True  # stays up until the panel has every request, then is stopped

        def complete() -> bool:
            got = [e for e in seen if e.kind == "LatencySample" and e.prefill is not None and e.prefill.count == 4]
            if got and (got[-1].decode_stall_s or not metrics):
                engine.stop("seen")
                return True
            return False

        engine.subscribe(lambda e: complete() if e.kind == "LatencySample" else None)
        await engine.run()
    panel = [e for e in seen if e.kind == "LatencySample" and e.prefill is not None and e.prefill.count == 4][-1]
    assert panel.source == "timings" and panel.queue is None
    # prompt_ms 100, 300, 100, 300 ms: p50 200 ms, p95 300 ms; predicted_per_token_ms 20 and 40 ms likewise
    assert (panel.prefill.p50_s, panel.prefill.p95_s) == (pytest.approx(0.2), pytest.approx(0.3))
    assert panel.inter_token is not None and panel.inter_token.p50_s == pytest.approx(0.03)
    assert panel.ttft is not None and panel.ttft.count == 4
    endpoint = engine.report.to_dict()["endpoints"][0]
    assert endpoint["latency"]["source"] == "timings"
    assert endpoint["latency"]["prefill"] == {"p50_s": pytest.approx(0.2), "p95_s": pytest.approx(0.3), "count": 4.0}
    if metrics:  # llama's decode counter stands at 42 while it says a request runs: the decode-stall line
        assert panel.decode_stall_s and panel.decode_stall_s > 0 and panel.running == 1.0
        assert endpoint["decode_stall_max_s"] > 0
    else:  # without /metrics: its requests' timings alone, and nothing said of decoding
        assert panel.decode_stall_s is None and "decode_stall_max_s" not in endpoint


@pytest.mark.anyio
async def test_a_run_on_the_simulator_tells_its_latency_panel_from_vllms_histograms():
    async with SimServer(SimSettings(speed=20.0)) as srv:
        engine = Engine(validate({
            "run": {"metrics_interval_s": 0.05, "warmup": "off"},
            "endpoints": [{"name": "sim", "base_url": srv.base_url, "kind": "local", "model": "sim-model"}],
            "agents": [{"name": f"a{i}", "prompt": "hello " * 40, "max_tokens": 6} for i in range(3)],
        }))
        seen: list = []
        engine.subscribe(seen.append)
        engine.hold_open = True
        engine.scheduler.set_paused(True)  # admitted once the monitor has scraped the server before them

        def told(e) -> None:
            if e.kind == "LatencySample" and engine.scheduler.paused:
                engine.handle(cmd.Resume())
            # stopped once the panel has every answer whole: the third first token comes before its last tokens
            # (a loaded host once stopped it there, with 9 of the 15 gaps counted)
            if (e.kind == "LatencySample" and e.ttft is not None and e.ttft.count >= 3 and e.queue is not None
                    and e.inter_token is not None and e.inter_token.count >= 15):
                engine.stop("seen")

        engine.subscribe(told)
        await engine.run()
    panel = [e for e in seen if e.kind == "LatencySample" and e.ttft is not None][-1]
    assert panel.source == "histograms" and panel.ttft.count == 3
    assert panel.queue is not None and panel.prefill is not None
    # 3 answers of 6 tokens: 15 gaps, each under vLLM's first bucket (10 ms) at speed 20, so only bounded
    assert panel.inter_token is not None and panel.inter_token.count == 15 and panel.inter_token.p50_bound == "below"
    latency = engine.report.to_dict()["endpoints"][0]["latency"]
    assert latency["ttft"]["count"] == 3 and latency["ttft"]["p50_s"] == panel.ttft.p50_s
