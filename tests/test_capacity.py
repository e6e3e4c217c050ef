"""KV-cache math, presets and config.json parsing (pure; no server, no files beyond packaged data)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cerevisor_tui.capacity import (
    CapacityError,
    ModelConfigError,
    UnknownPresetError,
    bytes_per_token,
    estimate,
    get_gpu,
    get_model,
    kv_layout,
    list_gpus,
    list_models,
    model_from_hf_config,
)
from cerevisor_tui.capacity.presets import check_presets
from cerevisor_tui.capacity.specs import GIB, dtype_bytes

# The local test model (/work/shared/peers/make_tiny_model.py): 2 layers, 2 KV heads, head_dim 32, float32.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "vocab_size": 567,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


# --- bytes per token -------------------------------------------------------------------------------


def test_tiny_model_costs_1024_bytes_per_token():
    model = model_from_hf_config(TINY_CONFIG)
    assert model.dtype == "float32"
    assert bytes_per_token(model) == 2 * 2 * 2 * 32 * 4 == 1024


def test_gqa_bytes_per_token_and_kv_dtypes():
    llama = get_model("llama-3.1-8b")
    assert bytes_per_token(llama) == 2 * 32 * 8 * 128 * 2 == 131072
    assert bytes_per_token(llama, "fp8") == 65536
    assert bytes_per_token(llama, "fp16") == bytes_per_token(llama, "bf16") == 131072
    assert bytes_per_token(llama, "float32") == 262144
    with pytest.raises(CapacityError, match="give auto, fp16, bf16, fp8"):
        bytes_per_token(llama, "fp7")
    with pytest.raises(CapacityError, match="give auto"):
        bytes_per_token(llama, "mxfp4")


def test_tensor_parallel_splits_kv_heads_until_one_per_gpu():
    llama70 = get_model("llama-3.1-70b")  # 80 layers, 8 KV heads x 128
    assert kv_layout(llama70, "auto", 4).bytes_per_token_per_gpu == 2 * 80 * 2 * 128 * 2 == 81920
    assert not kv_layout(llama70, "auto", 8).replicated
    sixteen = kv_layout(llama70, "auto", 16)  # more GPUs than KV heads: one (replicated) head each
    assert sixteen.bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2
    assert sixteen.replicated
    assert sixteen.bytes_per_token == bytes_per_token(llama70) == 327680


def test_mla_latent_is_replicated_on_every_gpu():
    deepseek = get_model("deepseek-v3")
    assert deepseek.attention == "mla"
    assert bytes_per_token(deepseek) == (512 + 64) * 61 * 2 == 70272
    layout = kv_layout(deepseek, "auto", 8)
    assert layout.bytes_per_token_per_gpu == 70272  # not divided by 8
    assert layout.bytes_per_token_all_gpus == 8 * 70272
    assert layout.replicated
    assert kv_layout(deepseek, "fp8", 8).bytes_per_token_per_gpu == 35136


def test_sliding_window_layers_hold_at_most_their_window():
    gpt_oss = get_model("gpt-oss-20b")  # 24 layers, every other one a 128-token window, 8 KV heads x 64
    layout = kv_layout(gpt_oss)
    per_layer = 2 * 8 * 64 * 2
    assert layout.full_bytes_per_token_per_gpu == 12 * per_layer
    assert layout.window_bytes_per_token_per_gpu == 12 * per_layer
    assert bytes_per_token(gpt_oss) == 24 * per_layer  # the textbook figure counts every layer
    # Short conversations pay for every layer; long ones only for the full layers past the window.
    assert layout.conversation_bytes_per_gpu(96) == 96 * 24 * per_layer
    assert layout.conversation_bytes_per_gpu(131072) == 131072 * 12 * per_layer + 128 * 12 * per_layer
    # Partial blocks are paid in full (block of 16 tokens).
    assert layout.conversation_bytes_per_gpu(17) == 32 * 24 * per_layer


def test_sliding_window_capacity_depends_on_context():
    gemma = get_model("gemma-3-27b")
    short = estimate(gemma, kv_memory_gib=20, context_tokens=1024)
    long = estimate(gemma, kv_memory_gib=20, context_tokens=65536)
    # At 64K only 10 of 62 layers grow with the context, so far more tokens fit than at 1K.
    assert long.kv_capacity_tokens > 4 * short.kv_capacity_tokens
    assert any("52 of 62 layers" in note for note in long.notes)


def test_dtype_sizes_include_mxfp4():
    assert dtype_bytes("mxfp4") == pytest.approx(4.25 / 8)
    assert dtype_bytes("bf16") == 2
    assert dtype_bytes("fp8_e4m3") == 1


# --- config.json ------------------------------------------------------------------------------------


def test_head_dim_derived_from_hidden_size_when_absent():
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
    model = model_from_hf_config(config)
    assert model.head_dim == 128
    assert bytes_per_token(model) == 131072
    assert model.max_context_tokens == 32768


def test_kv_heads_default_to_attention_heads():
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float16"}
    assert model_from_hf_config(config).num_kv_heads == 4


def test_gemma3_text_config_nesting_and_local_global_pattern():
    # Shape of google/gemma-3-27b-it config.json: the language model sits under text_config.
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
            "sliding_window_pattern": 6, "max_position_embeddings": 131072,
        },
        "vision_config": {"num_hidden_layers": 27},
    }
    model = model_from_hf_config(config)
    assert (model.num_layers, model.sliding_layers, model.sliding_window_tokens) == (62, 52, 1024)
    assert model.dtype == "bfloat16"
    preset = get_model("gemma-3-27b")
    assert kv_layout(model) == kv_layout(preset)


def test_layer_types_count_sliding_layers():
    # Shape of openai/gpt-oss-20b config.json.
    config = {"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
              "hidden_size": 2880, "sliding_window": 128, "torch_dtype": "bfloat16",
              "layer_types": ["sliding_attention", "full_attention"] * 12,
              "quantization_config": {"quant_method": "mxfp4"}}
    model = model_from_hf_config(config)
    assert model.sliding_layers == 12
    assert model.weight_dtype == "mxfp4"
    assert kv_layout(model) == kv_layout(get_model("gpt-oss-20b"))


def test_sliding_window_switched_off_or_on_for_all_layers():
    base = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
            "torch_dtype": "bfloat16"}
    qwen25 = model_from_hf_config({**base, "sliding_window": 131072, "use_sliding_window": False})
    assert qwen25.sliding_layers == 0
    mistral01 = model_from_hf_config({**base, "sliding_window": 4096})  # Mistral-7B-v0.1: every layer
    assert (mistral01.sliding_layers, mistral01.sliding_window_tokens) == (28, 4096)


def test_mla_from_config():
    config = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 7168, "torch_dtype": "bfloat16",
              "max_position_embeddings": 163840, "quantization_config": {"quant_method": "fp8"}}
    model = model_from_hf_config(config)
    assert model.attention == "mla"
    assert bytes_per_token(model) == 70272
    assert model.weight_dtype == "fp8"
    assert model.weights_bytes is None  # config.json does not give an MLA model's size


def test_params_estimated_from_config_shapes():
    # Llama-3.1-8B's config.json: the estimate lands within 1% of the published 8.03B.
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16"}
    model = model_from_hf_config(config)
    assert model.params == pytest.approx(8.03e9, rel=0.01)
    # Mixtral-8x7B: all experts count for memory, two per token for compute.
    mixtral = model_from_hf_config({**config, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.params == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.01)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([], "JSON object"),
        ({"num_attention_heads": 4}, "num_hidden_layers"),
        ({"num_hidden_layers": 2}, "num_attention_heads"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4}, "head_dim or hidden_size"),
        ({"num_hidden_layers": "two", "num_attention_heads": 4}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "torch_dtype": "int3"}, "torch_dtype"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "layer_types": ["sliding_attention"] * 2},
         "sliding_window"),
    ],
)
def test_bad_config_names_the_problem(config, message):
    with pytest.raises(ModelConfigError, match=message):
        model_from_hf_config(config)


# --- presets ----------------------------------------------------------------------------------------

REQUIRED_GPUS = ["l4", "a10g", "a100-40gb", "a100-80gb", "h100", "h200", "b200", "gb200", "gb300",
                 "rtx-3090", "rtx-4090", "mi300x"]
REQUIRED_MODELS = ["llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b",
                   "qwen2.5-72b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-235b-a22b", "qwen3-30b-a3b",
                   "mistral-7b", "mixtral-8x7b", "deepseek-v3", "deepseek-r1", "gpt-oss-20b", "gpt-oss-120b",
                   "gemma-3-27b",
                   "qwen3.6-35b-a3b"]  # the simulator's profiles and the README name it


def test_presets_cover_the_required_models_and_gpus_with_sources():
    check_presets()
    assert set(REQUIRED_GPUS) <= {g.name for g in list_gpus()}
    assert set(REQUIRED_MODELS) <= {m.name for m in list_models()}
    for model in list_models():
        assert model.source.startswith("https://huggingface.co/"), model.name
    for gpu in list_gpus():
        assert gpu.source, gpu.name


@pytest.mark.parametrize(
    ("name", "preset"),
    [("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"), ("Llama-3.1-8B", "llama-3.1-8b"),
     ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b"), ("google/gemma-3-27b-it", "gemma-3-27b"),
     ("mistral-7b-instruct", "mistral-7b")],
)
def test_models_found_by_repo_id_and_alias(name, preset):
    assert get_model(name).name == preset


def test_a_hybrids_linear_layers_hold_no_kv_in_its_config_and_its_preset_alike():
    # Qwen3.6-35B-A3B: 40 layers, every 4th full attention (2 KV heads x 256), the rest Gated DeltaNet
    config = {"num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10}
    from_config = model_from_hf_config({"text_config": config, "architectures": ["Qwen3_5MoeForConditionalGeneration"]})
    preset = get_model("Qwen/Qwen3.6-35B-A3B")
    assert from_config.num_layers == preset.num_layers == 10
    assert kv_layout(from_config).bytes_per_token_all_gpus == kv_layout(preset).bytes_per_token_all_gpus == 20_480
    with pytest.raises(ModelConfigError, match="every layer linear"):
        model_from_hf_config({**config, "layer_types": ["linear_attention"] * 40})


def test_gpu_memory_is_what_the_driver_reports():
    assert get_gpu("h100").memory_gib == pytest.approx(81559 / 1024)
    assert get_gpu("H200").memory_gib == pytest.approx(143771 / 1024)
    assert get_gpu("4090").name == "rtx-4090"


def test_unknown_preset_lists_close_names():
    with pytest.raises(UnknownPresetError) as info:
        get_model("lama-3.1-70")
    assert "llama-3.1-70b" in str(info.value)
    with pytest.raises(UnknownPresetError, match="h100"):
        get_gpu("h1OO")


def test_weights_from_params_or_published_size():
    assert get_model("llama-3.1-8b").weights_bytes == pytest.approx(8.03e9 * 2)
    assert get_model("gpt-oss-120b").weights_bytes == pytest.approx(60.8 * GIB)  # MXFP4 checkpoint
    assert get_model("deepseek-r1").weights_bytes == pytest.approx(671e9)  # FP8: one byte per parameter


# --- estimate: memory, capacity, zones ------------------------------------------------------------


def test_kv_memory_is_gpus_times_memory_times_utilization_minus_weights_and_reserve():
    llama70 = get_model("llama-3.1-70b")
    h100 = get_gpu("h100")
    e = estimate(llama70, gpu=h100, gpus=4, gpu_memory_utilization=0.9, runtime_reserve_gib=4.0,
                 context_tokens=32768)
    weights_per_gpu = 70.6e9 * 2 / GIB / 4
    assert e.kv_memory_gib_per_gpu == pytest.approx(h100.memory_gib * 0.9 - weights_per_gpu - 4.0)
    blocks = int(e.kv_memory_gib_per_gpu * GIB // (16 * 81920))
    assert e.kv_capacity_tokens == blocks * 16
    assert e.conversations_fit == blocks // (32768 // 16)
    assert e.max_concurrency == e.conversations_fit
    # A bigger reserve leaves less room.
    smaller = estimate(llama70, gpu=h100, gpus=4, runtime_reserve_gib=8.0, context_tokens=32768)
    assert smaller.kv_capacity_tokens < e.kv_capacity_tokens


def test_capacity_rounds_down_to_whole_blocks():
    tiny = model_from_hf_config(TINY_CONFIG)
    e = estimate(tiny, kv_memory_gib=(100 * 1024 + 5) / GIB, context_tokens=10)  # 100 tokens and a bit
    assert e.kv_capacity_tokens == 96  # 6 blocks of 16
    assert e.conversations_fit == 6  # a 10-token conversation takes one block


def test_zones_without_cpu_tier():
    e = estimate(get_model("llama-3.1-8b"), kv_memory_gib=16, context_tokens=16384)
    assert e.kv_capacity_tokens == 16 * GIB // 131072 == 131072
    assert e.conversations_fit == 8
    fits, cliff = e.zones
    assert (fits.name, fits.min_concurrency, fits.max_concurrency) == ("fits", 1, 8)
    assert (cliff.name, cliff.min_concurrency, cliff.max_concurrency) == ("cliff", 9, None)
    assert e.zone("overflow") is None
    assert e.zone_for(8).name == "fits"
    assert e.zone_for(500).name == "cliff"
    assert "recomputed" in cliff.meaning


def test_zones_with_cpu_tier_reload_and_overflow():
    # 64 conversations of 16K fit in GPU; a 128 GiB CPU tier holds 64 more (2 GiB each).
    e = estimate(get_model("llama-3.1-8b"), gpu=get_gpu("h100"), kv_memory_gib=128, context_tokens=16384,
                 cpu_offload_gib=128)
    assert e.conversations_fit == 64
    assert e.cpu_conversations == 64
    assert [(z.name, z.min_concurrency, z.max_concurrency) for z in e.zones] == [
        ("fits", 1, 64), ("cliff", 65, 128), ("overflow", 129, None)]
    # Reloading 2 GiB over a ~50 GB/s link beats recomputing 16K tokens of prefill.
    assert e.cliff.reload_s == pytest.approx(2 * GIB / 50e9)
    assert e.cliff.recompute_s is not None and e.cliff.recompute_s > e.cliff.reload_s
    assert "CPU tier" in e.zones[1].meaning


def test_cpu_tier_counts_every_gpu_share():
    # With tensor parallelism each GPU offloads its own share: a conversation costs its share x gpus.
    e = estimate(get_model("llama-3.1-70b"), kv_memory_gib=30, gpus=4, context_tokens=8192, cpu_offload_gib=100)
    per_conversation = 8192 * 81920 * 4
    assert e.cpu_conversations == int(100 * GIB // per_conversation)


def test_recompute_time_needs_a_throughput():
    e = estimate(get_model("qwen3-8b"), kv_memory_gib=10, context_tokens=8000)
    assert e.cliff.recompute_s is None
    given_rate = estimate(get_model("qwen3-8b"), kv_memory_gib=10, context_tokens=8000, prefill_tokens_per_s=4000)
    assert given_rate.cliff.recompute_s == pytest.approx(2.0)


def test_context_defaults_to_model_max_and_longer_is_noted():
    e = estimate(get_model("qwen3-8b"), kv_memory_gib=10)
    assert e.context_tokens == 40960
    longer = estimate(get_model("qwen3-8b"), kv_memory_gib=10, context_tokens=100_000)
    assert any("longer than the model's max context" in note for note in longer.notes)


def test_nothing_fits_is_said_plainly():
    e = estimate(get_model("llama-3.1-8b"), kv_memory_gib=1, context_tokens=131072)
    assert e.conversations_fit == 0
    assert e.zones[0].name == "cliff" and e.zones[0].min_concurrency == 1
    assert any("not even one conversation" in note for note in e.notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "--gpu NAME"),
        ({"gpu": "rtx-4090", "model": "llama-3.1-70b"}, "does not fit on 1 x rtx-4090"),
        ({"kv_memory_gib": 0}, "must be positive"),
        ({"kv_memory_gib": 10, "gpus": 0}, "at least 1"),
        ({"kv_memory_gib": 10, "gpu_memory_utilization": 1.5}, "utilization"),
        ({"kv_memory_gib": 10, "context_tokens": 0}, "at least 1 token"),
        ({"kv_memory_gib": 10, "cpu_offload_gib": -1}, "negative"),
    ],
)
def test_bad_inputs_raise_capacity_errors(kwargs, message):
    model = get_model(kwargs.pop("model", "llama-3.1-8b"))
    if "gpu" in kwargs:
        kwargs["gpu"] = get_gpu(kwargs["gpu"])
    with pytest.raises(CapacityError, match=message):
        estimate(model, **kwargs)


def test_unknown_weights_need_kv_memory_or_weights_flag():
    model = model_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32})
    with pytest.raises(CapacityError, match="--weights-gib"):
        estimate(model, gpu=get_gpu("l4"), context_tokens=100)
    assert estimate(model, gpu=get_gpu("l4"), context_tokens=100, weights_gib=1.0).kv_capacity_tokens > 0


def test_json_summary_has_the_documented_keys():
    d = estimate(get_model("qwen3-32b"), gpu=get_gpu("h100"), gpus=2, context_tokens=16384, cpu_offload_gib=64).to_dict()
    for key in ("bytes_per_token", "kv_capacity_tokens", "conversations_fit", "zones", "max_concurrency"):
        assert key in d
    assert set(d["zones"]) == {"fits", "cliff", "overflow"}
    assert d["zones"]["fits"]["max_concurrency"] == d["conversations_fit"]


@given(memory=st.floats(min_value=0.5, max_value=200), context=st.integers(min_value=1, max_value=200_000),
       name=st.sampled_from(["llama-3.1-8b", "gpt-oss-20b", "deepseek-v3", "gemma-3-27b"]))
def test_more_memory_never_fits_fewer(memory, context, name):
    model = get_model(name)
    small = estimate(model, kv_memory_gib=memory, context_tokens=context)
    large = estimate(model, kv_memory_gib=memory * 1.5, context_tokens=context)
    assert large.kv_capacity_tokens >= small.kv_capacity_tokens
    assert large.conversations_fit >= small.conversations_fit
    assert small.conversations_fit * context <= small.kv_capacity_tokens + context
