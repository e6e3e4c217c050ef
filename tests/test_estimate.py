"""`cerevisor-tui estimate`, tied to KV-cache sizes that vLLM itself printed, each with its source.

vLLM logs, per GPU worker, `Available KV cache memory: X GiB` and then `GPU KV cache size: N tokens`
(older versions: `kv_cache_size=X GiB` and `# GPU blocks: B`, i.e. N = B x 16). Feeding X to
`--kv-memory-gib` must give N within 1%. vLLM prints X rounded to 0.01 GiB, which alone accounts for
up to ~0.1% on the smaller figures below.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cerevisor_tui.cli import main as cli_main
from cerevisor_tui.endpoints.metrics import parse_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def run_json(capsys, *argv: str) -> dict:
    assert cli_main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def assert_within_1_percent(ours: int, vllm: int) -> None:
    assert abs(ours - vllm) / vllm < 0.01, f"ours {ours:,} vs vLLM {vllm:,} ({100 * (ours - vllm) / vllm:+.2f}%)"


# --- published vLLM figures ------------------------------------------------------------------------


def test_llama_3_1_8b_rtx_3090_vllm_v0(capsys):
    """meta-llama/Llama-3.1-8B-Instruct on an RTX 3090, vLLM V0, two runs:
    `kv_cache_size=3.81GiB ... GPU blocks: 1952` and `kv_cache_size=2.89GiB ... # GPU blocks: 1478`.
    Source: https://github.com/vllm-project/vllm/issues/10517 (comment of 2024-12-02)."""
    for kv_gib, blocks in ((3.81, 1952), (2.89, 1478)):
        d = run_json(capsys, "--model", "llama-3.1-8b", "--kv-memory-gib", str(kv_gib), "--context", "20000")
        assert d["bytes_per_token"] == 131072
        assert_within_1_percent(d["kv_capacity_tokens"], blocks * 16)  # -0.10% and +0.07%


def test_qwen3_14b_vllm_v1(capsys):
    """Qwen3-14B, vLLM V1 (0.11): `Available KV cache memory: 6.51 GiB`, `GPU KV cache size: 42,656 tokens`,
    `Maximum concurrency for 32,768 tokens per request: 1.30x`.
    Source: https://github.com/LMCache/LMCache/issues/1739"""
    d = run_json(capsys, "--model", "qwen3-14b", "--kv-memory-gib", "6.51", "--context", "32768")
    assert d["bytes_per_token"] == 163840
    assert_within_1_percent(d["kv_capacity_tokens"], 42656)  # exact
    assert d["max_concurrency_ratio"] == pytest.approx(1.30, abs=0.005)
    assert d["conversations_fit"] == 1


def test_qwen3_1_7b_from_its_config_json(tmp_path, capsys):
    """Qwen/Qwen3-1.7B through --model-config, vLLM V1 on a 24 GB GPU: `Available KV cache memory: 18.78 GiB`,
    `GPU KV cache size: 175,856 tokens`. Source: https://github.com/vllm-project/vllm/issues/33263
    The config values are those of https://huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json."""
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
              "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
              "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    d = run_json(capsys, "--model-config", str(path), "--kv-memory-gib", "18.78", "--context", "1024")
    assert d["bytes_per_token"] == 114688
    assert_within_1_percent(d["kv_capacity_tokens"], 175856)  # -0.02%


@pytest.mark.parametrize(
    ("model", "gpus", "kv_gib", "vllm_tokens", "context", "concurrency"),
    [
        ("qwen3-8b", 1, 50.32, 366_400, 40960, 8.95),
        ("qwen3-32b", 2, 33.66, 275_760, 40960, 6.73),
        ("llama-3.1-70b", 4, 32.06, 420_208, 131072, 3.21),
    ],
)
def test_lmcache_table_of_vllm_kv_sizes(capsys, model, gpus, kv_gib, vllm_tokens, context, concurrency):
    """KV memory and tokens as vLLM reported them on H100s (70B: tp=4, a GQA model split across GPUs;
    Qwen3-32B: tp=2), collected in LMCache's FAQ table "KV Cache Sizes for Popular Models".
    Source: https://github.com/LMCache/LMCache/pull/1769 (docs/source/getting_started/faq.rst)."""
    d = run_json(capsys, "--model", model, "--gpus", str(gpus), "--kv-memory-gib", str(kv_gib),
                 "--context", str(context))
    assert_within_1_percent(d["kv_capacity_tokens"], vllm_tokens)  # 0.00%, -0.01%, 0.00%
    assert d["max_concurrency_ratio"] == pytest.approx(concurrency, abs=0.01)


def test_tiny_model_matches_our_own_vllm_cpu_scrape(tmp_path, capsys):
    """The local tiny model (2 layers, 2 KV heads, head_dim 32, float32: 1024 bytes per token) under vLLM
    0.32 CPU with VLLM_CPU_KVCACHE_SPACE=1 GiB. vLLM's cache_config_info in our scrape
    (tests/fixtures/metrics/vllm-0.32-idle.txt) says kv_cache_memory_bytes=1073741824, block_size=128,
    kv_cache_size_tokens=1048576; its log said `CPU KV cache size: 1,048,576 tokens`."""
    server = parse_metrics((FIXTURES / "vllm-0.32-idle.txt").read_text())
    config = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "max_position_embeddings": 4096, "vocab_size": 567, "dtype": "float32"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    d = run_json(capsys, "--model-config", str(path), "--kv-memory-gib", "1", "--block-size",
                 str(server.block_size), "--context", "2048")
    assert d["bytes_per_token"] == 1024
    assert server.kv_cache_size_tokens == 1048576
    assert d["kv_capacity_tokens"] == server.kv_cache_size_tokens  # exact
    assert d["max_concurrency_ratio"] == 512.0  # vLLM: "Maximum concurrency for 2,048 tokens per request: 512.00x"


# --- the command itself -----------------------------------------------------------------------------


def test_text_output_names_every_figure(capsys):
    assert cli_main(["estimate", "--model", "llama-3.1-70b", "--gpu", "h100", "--gpus", "4", "--context", "32768",
                     "--cpu-offload-gib", "256"]) == 0
    out = capsys.readouterr().out
    for label in ("bytes/token", "KV capacity", "fit", "zones", "fits 1-", "cliff", "overflow", "configure",
                  "max_concurrency = ", "reload", "recompute"):
        assert label in out, label
    assert "81,920 per GPU" in out


def test_kv_memory_mode_points_at_the_vllm_log_line(capsys):
    assert cli_main(["estimate", "--model", "qwen3-14b", "--kv-memory-gib", "6.51"]) == 0
    out = capsys.readouterr().out
    assert "42,656 tokens" in out
    assert "GPU KV cache size" in out


def test_list_shows_presets(capsys):
    assert cli_main(["estimate", "--list"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-405b" in out and "mi300x" in out and "gb300" in out
    assert cli_main(["estimate", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"models", "gpus"} <= set(listed)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "lama-3.1-8b", "--gpu", "h100"], "did you mean llama-3.1-8b"),
        (["--model", "llama-3.1-8b", "--gpu", "h1000"], "did you mean h100"),
        (["--model", "llama-3.1-8b"], "--gpu NAME"),
        (["--model", "llama-3.1-405b", "--gpu", "l4"], "does not fit"),
        (["--model-config", "/nonexistent/config.json", "--kv-memory-gib", "1"], "cannot read"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert cli_main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_bad_config_json_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "estimate", "--model-config", str(bad),
                           "--kv-memory-gib", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_the_simulators_model_is_explained_not_guessed_at(capsys):
    # the README's examples serve sim-model; estimate says what it is instead of "did you mean qwen3-8b?"
    assert cli_main(["estimate", "--model", "sim-model", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert "the simulator's own model" in err and "--profile MODEL@GPU" in err and "did you mean" not in err
    assert cli_main(["estimate", "--model", "qwen3.6-35b-a3b", "--gpu", "h100", "--gpus", "2"]) == 0
