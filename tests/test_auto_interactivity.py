"""Auto's floor on each user's interactivity, on the server's own clock: vLLM's inter-token histogram (_sum over
_count between scrapes), read from recorded vLLM text, from the simulator over loopback HTTP, and preferred by the
controller to the run's own measure of its answers, which a sped-up simulator's host lags."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.endpoints.latency import LatencyScrape, parse_latency
from cerevisor_tui.endpoints.metrics import parse_metrics
from cerevisor_tui.engine.auto import AutoController
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.monitor import decode_gaps
from cerevisor_tui.sim import SimServer
from tests.test_auto import Box, caps
from tests.test_latency import vllm_text

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def test_vllms_recorded_inter_token_histogram_gives_each_users_tokens_per_s_between_two_scrapes():
    running = parse_metrics((FIXTURES / "vllm-0.32-running.txt").read_text()).latency
    pressure = parse_metrics((FIXTURES / "vllm-0.32-pressure.txt").read_text()).latency
    assert running is not None and pressure is not None
    assert (running.inter_token_sum_s, running.inter_token_count) == (pytest.approx(13.439130757), 1989.0)
    seconds, gaps = decode_gaps(running, pressure)
    assert (seconds, gaps) == (pytest.approx(115.454041817 - 13.439130757), 14489.0 - 1989.0)
    assert gaps / seconds == pytest.approx(122.53, abs=0.01)  # tokens/s each user saw between the two scrapes


def test_the_older_name_is_read_and_engines_are_summed():
    text = vllm_text([{"itl": [1, 3, 4, 4]}, {"itl": [0, 2, 2, 6]}], 10.0, 1.0, itl_name="vllm:time_per_output_token_seconds")
    scrape = parse_latency(text, "vllm")
    assert (scrape.inter_token_sum_s, scrape.inter_token_count) == (2.0, 10.0)  # 1.0 s and 4 + 6 gaps
    assert (parse_latency(text, "llamacpp").inter_token_count, parse_latency("garbage {", "vllm").inter_token_sum_s) \
        == (None, None)


def test_decode_gaps_count_from_the_first_scrape_and_afresh_after_a_restart():
    early, later, restarted = (LatencyScrape("vllm", inter_token_sum_s=s, inter_token_count=n)
                               for s, n in ((50.0, 1000.0), (60.0, 1500.0), (2.0, 100.0)))
    assert decode_gaps(None, early) == (0.0, 0.0)  # what the server did before the run is not the run's
    assert decode_gaps(early, later) == (10.0, 500.0)
    assert decode_gaps(later, restarted) == (2.0, 100.0)
    assert decode_gaps(early, LatencyScrape("vllm")) is None  # a server without the histogram


def drive_with_server_gaps(ctl: AutoController, box: Box, seconds: int, lag: float) -> list[tuple[float, int, str]]:
    """Each look carries the server's decode gaps (every token of the second, at each user's rate) and the run's
    own measure of the answers, `lag` times slower, as a host that cannot keep pace with the server sees them."""
    changes, spent_s, gaps = [], 0.0, 0.0
    for _ in range(seconds):
        s = box.look(ctl.cap)
        tokens = box.rate(box.running)
        per_user = tokens / max(1, box.running)
        spent_s, gaps = spent_s + tokens / per_user, gaps + tokens
        change = ctl.update(replace(s, decode_gaps=(spent_s, gaps), rates=((s.t, per_user / lag),)))
        if change is not None:
            changes.append((box.t, change.cap, change.reason))
    return changes


def test_the_servers_figure_decides_over_the_runs_own_lagging_one():
    # as tests/test_auto.py's floor test: 180 tok/s each holds up to 14 agents; the run sees its answers 4x slower
    def rising(n: int) -> float:
        return 400.0 * n ** 0.7

    held = AutoController(max_cap=64, min_interactivity=180.0)
    changes = drive_with_server_gaps(held, Box(rising), 200, lag=4.0)
    assert 12 <= held.cap <= 14, changes
    assert any("the server's tokens stream at" in why for _, _, why in changes)
    assert max(caps(changes)) <= 16


@pytest.mark.anyio
async def test_on_the_simulator_auto_backs_off_on_the_servers_inter_token_latency():
    # 50 tokens/s each alone, sped up 50x: 2,500 a second of the run's clock, however far the host lags; two or
    # more in a batch step slower (2% each) and prefill each other's turns between their tokens, under the floor
    speed, alone = 50, 2500.0
    floor = 0.985 * alone
    sim = SimSettings(speed=speed, tokens_per_s=50, ttft_s=0.05, max_num_seqs=64, kv_cache_tokens=64_000,
                      block_size=16)
    async with SimServer(sim) as srv:
        engine = Engine(validate({
            "run": {"mode": "auto", "metrics_interval_s": 0.05, "max_concurrency": 8, "warmup": "off",
                    "auto": {"min_interactivity_tokens_s": floor}},
            "endpoints": [{"name": "e", "base_url": srv.base_url, "model": "sim-model", "max_concurrency": 8}],
            "agents": [{"name": f"a{i}", "system": f"agent {i} " + "x" * 800, "prompt": "y" * 400,
                        "turns": ["z" * 400], "max_tokens": 64} for i in range(16)],
        }))
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
        server = srv.state.engine.inter_token_s
    changes = [e for e in seen if e.kind == "ConcurrencyChanged" and e.endpoint == "e"]
    reasons = "; ".join(c.reason for c in changes)
    backs = [c for c in changes if "the server's tokens stream at" in c.reason and f"under the {floor:g} floor" in c.reason]
    assert backs, reasons
    # x4 from 1 (one cap measured: no fit yet), under the floor at 4: back, in proportion to the shortfall
    assert max(c.effective_cap for c in changes) == 4 and all(c.effective_cap < 4 for c in backs), reasons
    ctl = engine.caps.auto["e"]
    assert ctl.interactivity[1] == pytest.approx(alone, rel=0.01)  # 1 / (0.02 s a token / 50)
    seconds, gaps = engine.monitor.decode_gaps["e"]
    assert 0 < gaps <= server.count and seconds <= server.sum  # counted from the monitor's first scrape


def test_the_cap_at_the_floor_comes_from_time_per_token_growing_linearly_with_the_cap():
    ctl = AutoController(max_cap=64, min_interactivity=50.0)
    assert ctl._floor_cap() is None  # nothing measured
    ctl.interactivity = {1: 100.0}
    assert ctl._floor_cap() is None  # one cap: no slope
    ctl.interactivity = {1: 100.0, 4: 80.0}  # 10 ms a token alone, +0.83 ms for each more conversation
    assert ctl._floor_cap() == 13  # 20 ms a token at 13
    ctl.interactivity = {1: 100.0, 4: 100.0}
    assert ctl._floor_cap() is None  # the time per token does not grow: no limit from the floor
