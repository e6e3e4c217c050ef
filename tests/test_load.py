"""The load estimate: from an endpoint's capacity table, refined by the server's own KV capacity."""

from __future__ import annotations

import json

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.load import LoadEstimate, from_config
from cerevisor_tui.sim import SimServer


def endpoint(capacity: dict, url: str = "http://127.0.0.1:9/v1"):
    return validate({"endpoints": [{"name": "e", "base_url": url, "capacity": capacity}]}).endpoints[0]


def test_zones_of_a_running_count():
    est = LoadEstimate(conversations_fit=64, kv_capacity_tokens=64 * 1000, context_tokens=1000, cpu_conversations=64)
    assert [est.zone(n) for n in (1, 64, 65, 128, 129)] == ["fits", "fits", "cliff", "cliff", "overflow"]
    assert LoadEstimate(4, 4000, 1000).zone(1000) == "cliff"  # no CPU tier: past the fit is the cliff


def test_estimate_from_a_config_json_and_reported_kv_memory(tmp_path):
    # the peers' tiny model: 2 layers x 2 KV heads x head_dim 32 x 4 bytes x 2 = 1024 bytes per token
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "max_position_embeddings": 4096, "torch_dtype": "float32", "vocab_size": 570}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    est, why = from_config(endpoint({"model": str(path), "kv_memory_gib": 1.0, "context_tokens": 2048}))
    assert why == ""
    assert est.kv_capacity_tokens == 1024 * 1024  # 1 GiB / 1024 bytes
    assert est.conversations_fit == 512


def test_no_or_bad_capacity_config_is_a_note_not_a_crash():
    assert from_config(endpoint({}))[0] is None
    est, why = from_config(endpoint({"model": "no-such-model", "gpu": "h100"}))
    assert est is None and "no-such-model" in why
    est, why = from_config(endpoint({"model": "llama-3.1-8b"}))
    assert est is None and "gpu or kv_memory_gib" in why


@pytest.mark.anyio
async def test_the_server_reported_capacity_replaces_the_estimate_and_the_cap_warning_follows():
    async with SimServer(SimSettings(kv_cache_tokens=4096, tokens_per_s=200)) as srv:
        engine = Engine(validate({
            "run": {"max_concurrency": 8, "metrics_interval_s": 0.1},
            "endpoints": [{"name": "e", "base_url": srv.base_url, "capacity": {"context_tokens": 1024}}],
            "agents": [{"name": "a", "prompt": "p", "max_tokens": 40}],
        }))
        assert engine.monitor.load["e"] is None
        assert await engine.run() == 0
    est = engine.monitor.load["e"]
    assert est is not None and est.source == "server" and est.kv_capacity_tokens == 4096 and est.conversations_fit == 4
    warning = engine.load_teller.cap_warning()
    assert warning and "cap 8 on e" in warning and "4 conversations" in warning
    engine.handle(cmd.SetConcurrency(cap=4))
    assert engine.load_teller.cap_warning() is None
