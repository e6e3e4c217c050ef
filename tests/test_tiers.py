"""KV tiers beyond GPU memory, read live: vLLM's offload and tiering metrics, LMCache's and SGLang's HiCache from
recorded exposition text (tests/fixtures/metrics/, each naming its source), and the simulator's CPU tier end to
end: a run against it, its ServerSample events, the mirror's tier lines and the load pane.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from cerevisor_tui.commands.console import run_handle
from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.metrics import parse_metrics, read_server
from cerevisor_tui.endpoints.tiers import TierSnapshot, idle_tier_warning, parse_tiers
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.monitor import tier_sample
from cerevisor_tui.sim import SimServer
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.theme_files import load_themes
from cerevisor_tui.ui.widgets.load_pane import LoadPane, tier_lines

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def tiers_of(name: str) -> TierSnapshot:
    found = parse_tiers((FIXTURES / name).read_text())
    assert found is not None, name
    return found


def test_vllm_offload_and_tiering_read_per_tier():
    t = tiers_of("vllm-offload-tiering.txt")
    assert t.source == "vllm" and [x.tier for x in t.tiers] == ["gpu", "cpu", "1:fs"]
    gpu, cpu, fs = t.tiers
    assert (gpu.hits, gpu.queries, gpu.capacity_tokens) == (1.5e6, 2.4e6, 65536)
    # the connector's external counters are the CPU tier's hits, in tokens; its size is kv_offloading_size (16 GiB)
    # over one GPU's bytes per token (kv_cache_memory_bytes / kv_cache_size_tokens = 128 KiB)
    assert (cpu.hits, cpu.queries, cpu.unit) == (6e5, 9e5, "tokens")
    assert cpu.capacity_tokens == 16 * 1024**3 / (8589934592 / 65536) == 131072
    assert (cpu.stored, cpu.loaded, cpu.usage, cpu.used_tokens) == (1.2e11, 7.8e10, 0.5, 65536)
    # a tier under the CPU one counts chunks, under the tier label vLLM gives it
    assert (fs.hits, fs.queries, fs.unit, fs.stored, fs.loaded) == (120, 300, "chunks", 4e10, 9e9)


def test_lmcache_is_the_cpu_tier_beside_vllms_gpu_counters():
    t = tiers_of("lmcache.txt")
    assert t.source == "lmcache"
    gpu, cpu = t.tiers
    assert (gpu.tier, gpu.hits, gpu.queries) == ("gpu", 3e5, 8e5)
    assert (cpu.tier, cpu.hits, cpu.queries, cpu.stored, cpu.loaded) == ("cpu", 4.2e5, 5e5, 6.4e5, 4.2e5)


def test_sglang_hicache_counts_each_data_parallel_rank_once():
    t = tiers_of("sglang-hicache.txt")
    assert t.source == "sglang" and [x.tier for x in t.tiers] == ["gpu", "cpu", "storage"]
    gpu, cpu, storage = t.tiers
    assert (gpu.hits, gpu.queries, gpu.capacity_tokens) == (5.11430304e9, 7.5e9, 600000)  # tp_rank 1 repeats 0's pool
    assert (cpu.hits, cpu.used_tokens, cpu.capacity_tokens, cpu.usage) == (1.729396096e9, 5e6, 8e6, 0.625)
    assert storage.hits == 2e7


def test_servers_without_a_tier_beyond_gpu_report_none():
    # vLLM 0.32 exports the external prefix counters with no connector at all; SGLang without HiCache; llama.cpp
    for name in ("vllm-0.32-running.txt", "sglang-docs-llama-3.1-8b.txt", "llamacpp-busy.txt"):
        assert parse_tiers((FIXTURES / name).read_text()) is None, name
    assert parse_metrics((FIXTURES / "vllm-0.32-running.txt").read_text()).tiers is None
    assert parse_metrics((FIXTURES / "vllm-offload-tiering.txt").read_text()).tiers == tiers_of(
        "vllm-offload-tiering.txt")


def test_nonsense_values_read_as_absent_and_never_raise():
    text = (FIXTURES / "vllm-offload-tiering.txt").read_text()
    broken = (text.replace("1.2e+11", "NaN").replace('kv_offloading_size="16.0"', 'kv_offloading_size="1e30"')
              .replace("} 7.8e+10", "} +Inf").replace("0:primary\"} 2048.0", "0:primary\"} 2048.0 garbage"))
    t = parse_tiers(broken)
    assert t is not None
    cpu = t.tier("cpu")
    assert cpu is not None and (cpu.stored, cpu.loaded, cpu.capacity_tokens) == (None, None, None)
    assert all(v is None or math.isfinite(v) for x in t.tiers for v in (x.hits, x.queries, x.stored, x.loaded))
    for junk in ("", "vllm:kv_offload_cpu_cache_usage_perc{", "\x00\xff", "lmcache:num_hit_tokens_total x\n"):
        parse_tiers(junk)


def test_hits_count_from_the_runs_first_sample_and_from_zero_after_a_restart():
    first, later = tiers_of("vllm-offload-store-only-before.txt"), tiers_of("vllm-offload-store-only.txt")
    sample = tier_sample(first, first, later)
    assert sample is not None and [(t.tier, t.hits) for t in sample.tiers] == [("gpu", 5e4), ("cpu", 0.0)]
    restarted = tier_sample(later, later, first)  # the counters went back: the server restarted
    assert restarted is not None and restarted.tiers[0].hits == 5e4
    assert tier_sample(None, None, None) is None


def test_a_tier_that_stores_and_never_loads_is_warned_of():
    before = tiers_of("vllm-offload-store-only-before.txt")
    after = tiers_of("vllm-offload-store-only.txt")
    warning = idle_tier_warning(before, after)  # it held data, lookups came, not one was ever served
    assert "cpu tier stores but never loads" in warning
    assert idle_tier_warning(after, after) == ""  # nothing asked since: no verdict yet
    assert idle_tier_warning(None, after) == ""  # one scrape: no verdict yet
    # SGLang: its host pool holds tokens, prompts came, none served from the host
    text = (FIXTURES / "sglang-hicache.txt").read_text().replace("} 1.729396096e+09", "} 0.0")
    sg_before, sg_after = parse_tiers(text), parse_tiers(text.replace("} 7.5e+09", "} 7.6e+09"))
    assert sg_before is not None and sg_after is not None
    assert idle_tier_warning(sg_before, sg_after).startswith("cpu tier stores but never loads")
    assert idle_tier_warning(tiers_of("sglang-hicache.txt"), tiers_of("sglang-hicache.txt")) == ""
    healthy = tiers_of("vllm-offload-tiering.txt")
    assert idle_tier_warning(healthy, healthy) == ""


def mirror_of(*samples: ev.Event) -> RunMirror:
    mirror = RunMirror()
    config = validate({"endpoints": [{"name": "box", "base_url": "http://10.0.0.9:8000/v1"}],
                       "agents": [{"name": "a", "prompt": "p"}]})
    engine = Engine(config)
    engine.subscribe(mirror)
    engine.emit(engine.started_event(0.0))  # names the endpoints
    for e in samples:
        engine.emit(e)
    return mirror


@pytest.mark.parametrize(("fixture", "served"), [
    ("vllm-offload-tiering.txt", "prefix hits GPU 1.5M · CPU 600.0k · 1:fs 120 chunks  CPU 50% full"),
    ("lmcache.txt", "prefix hits GPU 300.0k · CPU 420.0k"),
    ("sglang-hicache.txt", "prefix hits GPU 5114.3M · CPU 1729.4M · storage 20.0M  CPU 62% full"),
])
def test_recorded_expositions_reach_the_tier_line(fixture, served):
    tiers = tiers_of(fixture)
    sample = ev.ServerSample(1.0, "box", True, tiers=tier_sample(None, None, tiers))
    assert ev.decode_event(ev.encode_event(sample)) == sample  # the journal keeps it as the console got it
    (line,) = tier_lines(mirror_of(sample))
    assert line.served == served and line.warning == ""


def test_the_store_only_warning_reaches_the_tier_line_and_an_old_journal_line_still_reads():
    before, after = tiers_of("vllm-offload-store-only-before.txt"), tiers_of("vllm-offload-store-only.txt")
    (line,) = tier_lines(mirror_of(ev.ServerSample(2.0, "box", True, tiers=tier_sample(before, before, after))))
    assert line.warning.startswith("cpu tier stores but never loads")
    old = b'{"event":"ServerSample","t":1.0,"endpoint":"box","healthy":true}'
    assert ev.decode_event(old).tiers is None
    assert tier_lines(mirror_of(ev.decode_event(old))) == ()


# --- the simulator, end to end ---------------------------------------------------------------------


def _text(words: int, seed: str) -> str:
    return " ".join(f"{seed}{i}" for i in range(words))


def tiered_config(url: str) -> dict:
    """Three waves on a server whose GPU holds one long prompt: `a` fills it, `b` evicts a's blocks to the CPU
    tier, `c` asks a's prompt again and is served from the CPU tier."""
    long_a, long_b = _text(500, "alpha"), _text(500, "beta")
    return {
        "run": {"mode": "sequential", "metrics_interval_s": 0.05},
        "endpoints": [{"name": "sim", "base_url": url, "capacity": {"context_tokens": 1024}}],
        "agents": [
            {"name": "a", "prompt": long_a, "max_tokens": 20},
            {"name": "b", "prompt": long_b, "max_tokens": 20, "depends_on": ["a"]},
            {"name": "c", "prompt": long_a, "max_tokens": 60, "depends_on": ["b"]},
        ],
    }


@pytest.mark.anyio
async def test_the_simulators_cpu_tier_reaches_the_load_pane():
    settings = SimSettings(kv_cache_tokens=2048, cpu_offload_gib=0.25, tokens_per_s=100, block_size=16)
    async with SimServer(settings) as srv:
        engine = Engine(validate(tiered_config(srv.base_url)))
        handle = run_handle(engine)
        assert await engine.run() == 0
        async with httpx.AsyncClient() as client:
            status = await read_server(client, srv.base_url)
    tiers = status.metrics.tiers if status.metrics else None
    assert tiers is not None and tiers.source == "vllm"
    cpu = tiers.tier("cpu")
    assert cpu is not None and cpu.capacity_tokens == 2048  # 0.25 GiB at 128 KiB a token
    assert cpu.hits and cpu.stored and cpu.loaded  # c's prefix came back from the CPU tier

    # c decodes for 0.6 s, samples come every 0.05 s: the run's last ones saw its CPU hits
    mirror = handle.mirror
    seen = mirror.samples["sim"].tiers
    assert seen is not None and [t.tier for t in seen.tiers] == ["gpu", "cpu"] and seen.warning == ""
    assert seen.tiers[1].hits == cpu.hits and seen.tiers[1].capacity_tokens == 2048
    load = mirror.endpoints["sim"].load
    assert load is not None and load.estimate is not None
    # GPU 2048 tokens and a CPU tier of 2048 tokens, at 1024 tokens a conversation: the live 2 and 2 + 2
    assert (load.estimate.conversations_fit, load.estimate.cpu_conversations) == (2, 2)
    (line,) = tier_lines(mirror)
    assert line.placement.endswith("GPU 2 · GPU+CPU 4 conversations")
    assert line.served.startswith("prefix hits GPU ") and " · CPU " in line.served and line.warning == ""

    app = CerevisorApp(handle.control, mirror, engine.config, themes=load_themes(None))
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        pane = app.screen.query_one(LoadPane)
        pane.sync(mirror, 0.0)
        shown = str(pane.query_one("#tiers").content)
        assert pane.query_one("#tiers").display
        assert shown.startswith("sim tiers ") and "GPU+CPU 4 conversations" in shown and "CPU " in shown
