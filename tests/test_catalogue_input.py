"""Model catalogue on odd and hostile config.json input: transformers' defaults for omitted
fields, head counts vLLM cannot load, bad `layer_types`, weight-estimate fields of the wrong
type, unreadable files. Every refusal is a one-line `CatalogueError` (or `PlanError`) naming
the field, never a traceback from deep inside the count."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hybrid_kv.catalogue import (
    CatalogueError,
    estimate_parameters,
    estimate_weight_bytes,
    layer_specs_from_config,
    load_config,
    load_model,
    max_model_len_from_config,
    weight_estimate_note,
)
from hybrid_kv.cli import main
from hybrid_kv.planner import (
    InsufficientMemoryError,
    PlanError,
    format_bytes,
    kv_cache_budget,
    plan_kv_cache,
)
from hybrid_kv.specs import KVSharingSpec, MambaSpec
from hypothesis import given
from hypothesis import strategies as st
from test_catalogue import FALCON_H1 as _FALCON_H1  # noqa: E402

GIB = 1 << 30

# google/gemma-3-12b-it and google/gemma-3-4b-it as published: their text_config leaves out
# head_dim (and the 4B also the heads and KV heads), relying on Gemma3TextConfig's defaults.
GEMMA3_12B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
}
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}
LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 4,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


def _write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


# ----------------------------------------------------------------------------- 1: defaults


@pytest.mark.parametrize(
    ("config", "kv_heads", "layers", "text_parameters"),
    [
        (GEMMA3_12B_IT, 8, 48, 11.77e9),
        (GEMMA3_4B_IT, 4, 34, 3.88e9),
        # A text_config without its own model_type is read as Gemma3TextConfig too.
        (
            {**GEMMA3_4B_IT, "text_config": {**GEMMA3_4B_IT["text_config"], "model_type": None}},
            4,
            34,
            3.88e9,
        ),
    ],
)
def test_gemma3_checkpoints_plan_with_gemma3textconfig_defaults(
    tmp_path: Path, config: dict[str, Any], kv_heads: int, layers: int, text_parameters: float
) -> None:
    if config["text_config"]["model_type"] is None:
        config = {**config, "text_config": dict(config["text_config"])}
        del config["text_config"]["model_type"]
    model = load_model(_write(tmp_path, config))
    assert len(model.layers) == layers
    for spec in model.layers.values():
        assert (spec.num_kv_heads, spec.head_size) == (kv_heads, 256)  # type: ignore[union-attr]
    assert model.layers["model.layers.0"].kind == "sliding_window"
    assert model.layers["model.layers.5"].kind == "full"
    assert model.max_model_len == 131072
    # The weight estimate takes Gemma3TextConfig's vocab_size (262208) too.
    dense, experts = estimate_parameters(config)
    assert abs(dense + experts - text_parameters) / text_parameters < 0.01


def test_gemma3_12b_it_plans_with_the_page_vllm_uses(tmp_path: Path) -> None:
    spec = load_model(_write(tmp_path, GEMMA3_12B_IT)).layers["model.layers.0"]
    # 2 (K and V) x 8 KV heads x 256 x 2 bytes: 8 KiB a token, not 7.5 KiB (head_size 240).
    assert spec.bytes_per_token == 2 * 8 * 256 * 2


@pytest.mark.parametrize(
    ("model_type", "kv_heads", "head_dim"),
    [
        # 32 heads, hidden 3072, no num_key_value_heads or head_dim: the class default, else
        # 3072 // 32 = 96 for head_dim and the head count for the KV heads.
        ("llama", 32, 96),
        ("granite", 32, 96),
        ("mistral", 8, 96),
        ("ministral", 8, 96),
        ("mixtral", 8, 96),
        ("qwen2", 32, 96),
        ("qwen2_moe", 16, 96),
        ("qwen3", 32, 128),
        ("qwen3_moe", 4, 96),
        ("phi3", 32, 96),
        ("gemma2", 4, 256),
        ("gemma3_text", 4, 256),
        ("cohere2", 32, 96),
        ("gpt_oss", 8, 64),
        ("llama4_text", 8, 128),
    ],
)
def test_omitted_head_fields_take_the_transformers_class_default(
    model_type: str, kv_heads: int, head_dim: int
) -> None:
    config = {
        "model_type": model_type,
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "num_hidden_layers": 4,
        "sliding_window": 512,
    }
    for spec in layer_specs_from_config(config).values():
        assert (spec.num_kv_heads, spec.head_size) == (kv_heads, head_dim)  # type: ignore[union-attr]


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gemma3n_text"])
def test_omitted_gemma_heads_take_eight_heads_and_head_dim_256(model_type: str) -> None:
    config = {"model_type": model_type, "hidden_size": 1024, "num_hidden_layers": 5}
    config["sliding_window"] = 512
    spec = layer_specs_from_config(config)["model.layers.0"]
    assert spec.head_size == 256  # type: ignore[union-attr]
    assert spec.num_kv_heads == {"gemma3n_text": 2}.get(model_type, 4)  # type: ignore[union-attr]


@pytest.mark.parametrize("head_dim", [128, 240, 64])
def test_a_head_dim_the_config_gives_wins_over_the_default(head_dim: int) -> None:
    text = {**GEMMA3_12B_IT["text_config"], "head_dim": head_dim}  # type: ignore[dict-item]
    spec = layer_specs_from_config({**GEMMA3_12B_IT, "text_config": text})["model.layers.0"]
    assert spec.head_size == head_dim  # type: ignore[union-attr]


def test_null_kv_heads_are_the_heads_as_transformers_reads_them() -> None:
    spec = layer_specs_from_config({**LLAMA, "num_key_value_heads": None})["model.layers.0"]
    assert spec.num_kv_heads == 32  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- 2: budgets


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize(
    "bits", [-16, -1, 0, 17, 1_000_000, 4.0, float("nan"), float("inf"), "4", [4], True]
)
def test_quantization_bits_outside_1_to_16_are_refused(method: str, bits: object) -> None:
    config = {**LLAMA, "quantization_config": {"quant_method": method, "bits": bits}}
    with pytest.raises(CatalogueError, match=r"llama config: quantization_config 'bits' must"):
        estimate_weight_bytes(config)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantization_bits_scale_the_layer_weights(bits: int) -> None:
    dense, _ = estimate_parameters(LLAMA)
    embeddings = 128256 * 4096 * 2
    config = {**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": bits}}
    expected = embeddings * 2 + (dense - embeddings) * bits / 8
    assert estimate_weight_bytes(config) == int(expected)


@pytest.mark.parametrize("tp", [0, -1, 1.5, "2", True])
def test_weight_estimate_refuses_a_bad_tensor_parallel_size(tp: object) -> None:
    with pytest.raises(CatalogueError, match="tensor_parallel_size"):
        estimate_weight_bytes(LLAMA, tp)  # type: ignore[arg-type]


BAD_BYTES = [float("nan"), float("inf"), -1, -(10 * GIB), 0, 1.5, "80GiB", None, True]


@pytest.mark.parametrize("weights", BAD_BYTES)
def test_kv_cache_budget_refuses_weights_that_are_not_a_positive_byte_count(
    weights: object,
) -> None:
    with pytest.raises(PlanError, match="weights must be"):
        kv_cache_budget(80 * GIB, 0.9, weights)  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu", BAD_BYTES)
def test_kv_cache_budget_refuses_gpu_memory_that_is_not_a_positive_byte_count(
    gpu: object,
) -> None:
    with pytest.raises(PlanError, match="gpu memory must be"):
        kv_cache_budget(gpu, 0.9, GIB)  # type: ignore[arg-type]


@given(
    gpu=st.integers(1, 1 << 80),
    utilization=st.floats(0, 1, exclude_min=True),
    weights=st.integers(1, 1 << 80),
)
def test_kv_cache_budget_never_exceeds_gpu_times_utilization(
    gpu: int, utilization: float, weights: int
) -> None:
    try:
        budget = kv_cache_budget(gpu, utilization, weights)
    except PlanError as error:
        assert "do not fit" in str(error)
        return
    assert 0 < budget < gpu * Fraction(str(utilization))
    assert budget < gpu


def test_negative_bits_in_the_config_never_raise_the_budget_over_the_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": -16}}
    argv = ["plan", _write(tmp_path, config), "--gpu-memory", "80GiB", "--strategy", "vllm"]
    assert main([*argv, "--max-model-len", "4096"]) == 2
    err = capsys.readouterr().err
    assert "cannot estimate the weights" in err and "'bits' must be" in err


@pytest.mark.parametrize(
    ("quantization", "note"),
    [
        (
            {"quant_method": "bitsandbytes", "bits": 4},
            "quantization method 'bitsandbytes' not known",
        ),
        ({"bits": 4}, "quantization method '(none)' not known"),
        ("int4", "quantization_config 'int4' is not a mapping"),
        ({"quant_method": "fp8"}, None),
        ({"quant_method": "GPTQ", "bits": 4}, None),
        ({}, None),
        (None, None),
    ],
)
def test_a_quantization_the_estimate_does_not_know_is_counted_at_16_bits_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quantization: object, note: str | None
) -> None:
    config = {**LLAMA, "quantization_config": quantization}
    assert weight_estimate_note(config) == note
    if note is not None:
        assert estimate_weight_bytes(config) == estimate_weight_bytes(LLAMA)
    argv = ["plan", _write(tmp_path, config), "--gpu-memory", "80GiB", "--strategy", "vllm"]
    assert main([*argv, "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    said = f"estimated from the config at 16 bits: {note}, pass --weights-memory for its size"
    assert (said in out) == (note is not None)
    assert "estimated from the config" in out


# ----------------------------------------------------------------------------- 4: KV heads


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (32, 64, 1, r"num_key_value_heads \(64\) is more than num_attention_heads \(32\)"),
        (8, 9, 1, r"num_key_value_heads \(9\) is more than num_attention_heads \(8\)"),
        (32, 5, 1, r"num_key_value_heads \(5\) must divide num_attention_heads \(32\)"),
        (32, 12, 1, r"num_key_value_heads \(12\) must divide num_attention_heads \(32\)"),
        (48, 8, 3, r"num_key_value_heads \(8\) must be divisible by tensor_parallel_size \(3\)"),
        (48, 8, 12, r"num_key_value_heads \(8\) must be divisible by tensor_parallel_size \(12\)"),
        (48, 16, 6, r"num_key_value_heads \(16\) must be divisible by tensor_parallel_size \(6\)"),
    ],
)
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "gemma3_text", "gpt_oss"])
def test_kv_heads_vllm_cannot_load_are_refused(
    model_type: str, heads: int, kv_heads: int, tp: int, message: str
) -> None:
    config = {
        "model_type": model_type,
        "hidden_size": 128 * heads,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "num_hidden_layers": 6,
        "sliding_window": 512,
    }
    named = {"qwen3": "qwen2", "gemma3_text": "gemma3"}.get(model_type, model_type)
    with pytest.raises(CatalogueError, match=rf"^{named} config: {message}"):
        layer_specs_from_config(config, tensor_parallel_size=tp)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "per_rank"),
    [
        (32, 8, 1, 8),
        (32, 8, 4, 2),
        (32, 8, 8, 1),
        # More ranks than KV heads: each rank holds a replica of one head.
        (32, 8, 16, 1),
        (32, 8, 32, 1),
        (48, 8, 16, 1),
        (48, 1, 3, 1),
        (48, 6, 3, 2),
    ],
)
def test_kv_heads_shard_or_replicate_over_ranks_as_vllm_does(
    heads: int, kv_heads: int, tp: int, per_rank: int
) -> None:
    config = {**LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    config["hidden_size"] = 128 * heads
    specs = layer_specs_from_config(config, tensor_parallel_size=tp)
    assert {spec.num_kv_heads for spec in specs.values()} == {per_rank}  # type: ignore[union-attr]


def test_tp3_on_eight_kv_heads_is_refused_through_load_model(tmp_path: Path) -> None:
    config = {**LLAMA, "hidden_size": 6144, "num_attention_heads": 48}
    with pytest.raises(CatalogueError, match=r"tensor_parallel_size \(3\)"):
        load_model(_write(tmp_path, config), tensor_parallel_size=3)


@pytest.mark.parametrize(("hidden", "heads"), [(16, 32), (1, 2), (4096, 10**20), (31, 32)])
def test_a_head_dim_derived_as_zero_says_the_config_has_no_head_dim(
    hidden: int, heads: int
) -> None:
    config = {**LLAMA, "hidden_size": hidden, "num_attention_heads": heads}
    config["num_key_value_heads"] = heads
    with pytest.raises(CatalogueError) as caught:
        layer_specs_from_config(config)
    message = str(caught.value)
    assert "has no 'head_dim'" in message and f"hidden_size ({hidden})" in message
    assert "got 0" not in message


# ----------------------------------------------------------------------------- 10: layer_types


def _with_layer_type(name: str, index: int, value: object) -> dict[str, Any]:
    config = load_config(name)
    text = config.get("text_config", config)
    if "layer_types" not in text:
        layers = len(load_model(name).layers)
        text["layer_types"] = ["full_attention"] * layers
    text["layer_types"][index] = value
    return config


@pytest.mark.parametrize(
    ("name", "model_type", "value"),
    [
        ("gpt-oss-20b", "gpt_oss", "mamba"),
        ("gpt-oss-20b", "gpt_oss", "chunked_attention"),
        ("gpt-oss-20b", "gpt_oss", "linear_attention"),
        ("gemma-3-27b", "gemma3", "linear_attention"),
        ("gemma-3-27b", "gemma3", "mamba"),
        ("gemma-2-9b", "gemma2", "chunked_attention"),
        ("command-r7b", "cohere2", "mamba"),
        ("ministral-8b", "mistral", "mamba"),
        ("qwen3-next-80b-a3b", "qwen3_next", "sliding_attention"),
        ("qwen3-next-80b-a3b", "qwen3_next", "chunked_attention"),
    ],
)
@pytest.mark.parametrize("index", [0, 3])
def test_a_layer_type_the_model_type_cannot_have_names_layer_value_and_type(
    name: str, model_type: str, value: str, index: int
) -> None:
    with pytest.raises(CatalogueError) as caught:
        layer_specs_from_config(_with_layer_type(name, index, value))
    message = str(caught.value)
    assert f"layer_types[{index}]" in message and repr(value) in message
    assert message.startswith(f"{model_type} config:") and f"{model_type} has no" in message


@pytest.mark.parametrize("value", [["full_attention"], {"a": 1}, None, 3, 1.5, True])
@pytest.mark.parametrize("name", ["gpt-oss-20b", "gemma-3-27b", "qwen3-next-80b-a3b"])
def test_a_layer_type_that_is_not_a_string_is_refused(name: str, value: object) -> None:
    with pytest.raises(CatalogueError, match=r"layer_types\[2\] must be a string, got"):
        layer_specs_from_config(_with_layer_type(name, 2, value))


def test_granite_hybrid_refuses_sliding_layers() -> None:
    config = {
        "model_type": "granitemoehybrid",
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "layer_types": ["mamba", "sliding_attention"],
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "sliding_window": 64,
    }
    with pytest.raises(CatalogueError, match=r"layer_types\[1\] is 'sliding_attention'"):
        layer_specs_from_config(config)


# ----------------------------------------------------------------------------- 11: MoE fields


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("deepseek-v3", "moe_layer_freq", 0),
        ("deepseek-v3", "moe_layer_freq", "1"),
        ("deepseek-v3", "moe_layer_freq", -2),
        ("deepseek-v3", "first_k_dense_replace", "3"),
        ("deepseek-v3", "first_k_dense_replace", -1),
        ("deepseek-v3", "first_k_dense_replace", 1.5),
        ("deepseek-v3", "n_shared_experts", "1"),
        ("deepseek-v3", "n_shared_experts", -1),
        ("deepseek-v3", "q_lora_rank", "2"),
        ("deepseek-v3", "q_lora_rank", [1536]),
        ("deepseek-v3", "n_routed_experts", "256"),
        ("deepseek-v3", "moe_intermediate_size", "x"),
        ("jamba-mini-1.5", "expert_layer_period", 0),
        ("jamba-mini-1.5", "expert_layer_period", "2"),
        ("jamba-mini-1.5", "expert_layer_offset", "1"),
        ("jamba-mini-1.5", "num_experts", "16"),
        ("jamba-mini-1.5", "num_experts", 2.5),
        ("qwen3-next-80b-a3b", "decoder_sparse_step", 0),
        ("qwen3-next-80b-a3b", "decoder_sparse_step", "1"),
        ("qwen3-next-80b-a3b", "mlp_only_layers", 5),
        ("qwen3-next-80b-a3b", "mlp_only_layers", ["0"]),
        ("qwen3-next-80b-a3b", "num_experts", "2"),
        ("qwen3-next-80b-a3b", "moe_intermediate_size", "x"),
        ("qwen3-next-80b-a3b", "shared_expert_intermediate_size", "x"),
        ("llama-4-scout", "interleave_moe_layer_step", 0),
        ("llama-4-scout", "interleave_moe_layer_step", "1"),
        ("llama-4-scout", "num_local_experts", "16"),
        ("gpt-oss-20b", "num_local_experts", "32"),
    ],
)
def test_weight_fields_of_the_wrong_type_name_the_field(name: str, key: str, value: object) -> None:
    config = load_config(name)
    text = config.get("text_config", config)
    text[key] = value
    with pytest.raises(CatalogueError, match=f"'{key}' must be"):
        estimate_weight_bytes(config)


def test_a_nemotron_h_moe_pattern_needs_an_expert_count() -> None:
    config = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "-E-E",
        "num_attention_heads": 8,
        "hidden_size": 512,
        "mamba_num_heads": 8,
        "mamba_head_dim": 64,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "vocab_size": 1000,
        "intermediate_size": 1024,
    }
    with pytest.raises(CatalogueError, match=r"MoE layers \(E\) but .* no expert count"):
        estimate_weight_bytes(config)
    assert estimate_weight_bytes({**config, "n_routed_experts": 8}) > 0


@pytest.mark.parametrize(
    ("name", "model_type", "key", "value"),
    [
        ("deepseek-v3", "deepseek_v2", "moe_layer_freq", 0),
        ("qwen3-next-80b-a3b", "qwen3_next", "num_experts", "2"),
        ("jamba-mini-1.5", "jamba", "expert_layer_period", 0),
    ],
)
def test_the_cli_asks_for_weights_memory_when_a_weight_field_is_bad(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    model_type: str,
    key: str,
    value: object,
) -> None:
    config = load_config(name)
    config[key] = value
    argv = ["plan", _write(tmp_path, config), "--gpu-memory", "640GiB", "--strategy", "vllm"]
    assert main([*argv, "--max-model-len", "4096"]) == 2
    err = capsys.readouterr().err
    assert f"cannot estimate the weights ({model_type} config: '{key}'" in err
    assert "pass --weights-memory" in err and "Traceback" not in err


def test_a_text_config_without_model_type_estimates_its_weights() -> None:
    config = {"model_type": "llama", "text_config": {k: v for k, v in LLAMA.items()}}
    del config["text_config"]["model_type"]  # type: ignore[attr-defined]
    assert estimate_weight_bytes(config) == estimate_weight_bytes(LLAMA)


# ----------------------------------------------------------------------------- 12: Mamba-2


BAMBA = load_config("bamba-9b")
# test_catalogue's Falcon-H1, with the fields the weight estimate reads.
FALCON_H1 = {**_FALCON_H1, "vocab_size": 1000, "intermediate_size": 2048}


@pytest.mark.parametrize("config", [BAMBA, FALCON_H1], ids=["bamba", "falcon_h1"])
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("mamba_d_ssm", "8192"),
        ("mamba_d_ssm", [8192]),
        ("mamba_d_ssm", -1),
        ("mamba_d_ssm", 1.5),
        ("mamba_d_ssm", True),
        ("mamba_d_head", "x"),
        ("mamba_d_head", 0),
        ("mamba_n_heads", "128"),
        ("mamba_expand", "2"),
    ],
)
def test_mamba2_fields_are_validated_before_they_are_used(
    config: dict[str, Any], key: str, value: object
) -> None:
    bad = {**config, key: value}
    if key == "mamba_expand":
        bad.pop("mamba_d_ssm", None)
    pattern = rf"^{config['model_type']} config: '{key}' must be a positive int, got "
    with pytest.raises(CatalogueError, match=pattern):
        layer_specs_from_config(bad)
    with pytest.raises(CatalogueError, match=pattern):
        estimate_weight_bytes(bad)


@pytest.mark.parametrize("head", ["auto", None])
def test_an_auto_mamba_head_dim_is_the_width_over_the_heads(head: object) -> None:
    spec = layer_specs_from_config({**FALCON_H1, "mamba_d_head": head})["model.layers.0.mamba"]
    assert isinstance(spec, MambaSpec)
    assert spec.shapes[1] == (24, 1536 // 24, 256)


# ----------------------------------------------------------------------------- 9, 14, 17: files


@pytest.mark.parametrize(
    "text",
    [
        "[" * 200_000 + "]" * 200_000,
        '{"a":' * 200_000 + "1" + "}" * 200_000,
        '{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    ],
    ids=["arrays", "objects", "nested-field"],
)
def test_deeply_nested_json_is_not_valid_json(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(CatalogueError, match=r"config.json is not valid JSON: nested too deeply"):
        load_config(str(path))
    with pytest.raises(CatalogueError, match="not valid JSON"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "model", ["~nonexistentuser-hkv/x", "~nonexistentuser-hkv", "~no_such_user_hkv/config.json"]
)
def test_an_unknown_home_directory_is_no_such_file(model: str) -> None:
    with pytest.raises(CatalogueError, match=f"no such file or directory: {re.escape(model)}$"):
        load_model(model)


@pytest.mark.parametrize("ref", [b"\xff\xfe", b"abc\x80def", b"\xc3"])
def test_an_unreadable_hub_ref_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ref: bytes
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--m"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps(LLAMA))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(ref)
    with pytest.raises(
        CatalogueError, match=rf"cannot read .*{re.escape(str(repo / 'refs' / 'main'))}"
    ):
        load_model("org/m")


@pytest.mark.parametrize(
    ("model_type", "heads", "message"),
    [
        # Bamba's class defaults to 8 KV heads, Gemma-3's to 4, Qwen2's to 32.
        ("bamba", 2, r"num_key_value_heads \(8, transformers' default\) is more than"),
        ("gemma3_text", 2, r"num_key_value_heads \(4, transformers' default\) is more than"),
        ("gemma3_text", 6, r"num_key_value_heads \(4, transformers' default\) must divide"),
        ("qwen2", 16, r"num_key_value_heads \(32, transformers' default\) is more than"),
    ],
)
def test_a_refused_default_kv_head_count_says_it_is_the_default(
    model_type: str, heads: int, message: str
) -> None:
    config = {
        "model_type": model_type,
        "hidden_size": 64 * heads,
        "num_attention_heads": heads,
        "num_hidden_layers": 6,
        "sliding_window": 8,
        "attn_layer_indices": [1],
    }
    with pytest.raises(CatalogueError, match=message):
        layer_specs_from_config(config)


@pytest.mark.parametrize("window", [0, None])
@pytest.mark.parametrize("name", ["gemma-3-27b", "gemma-2-9b", "gpt-oss-20b", "ministral-8b"])
def test_a_window_of_0_or_null_is_no_window_as_vllm_reads_it(name: str, window: int | None) -> None:
    # vLLM 0.33's ModelConfig reads `sliding_window: 0` as no window (null likewise), and its
    # attention then gives a sliding layer none: every layer attends to every token.
    config = load_config(name)
    config.get("text_config", config)["sliding_window"] = window
    layers = layer_specs_from_config(config)
    assert {spec.kind for spec in layers.values()} == {"full"}
    assert len(layers) == len(load_model(name).layers)


@pytest.mark.parametrize("window", [0, None])
def test_gemma3n_without_a_window_is_refused_as_vllm_cannot_load_it(window: int | None) -> None:
    # vLLM 0.33 writes null for a window of 0 into Gemma3nTextConfig, whose sliding_window
    # must be an int: it fails before building the model.
    config = load_config("gemma-3n-e4b")
    config["text_config"]["sliding_window"] = window
    with pytest.raises(CatalogueError, match="cannot load Gemma-3n without a window"):
        layer_specs_from_config(config)


def test_cohere2_without_a_window_is_refused_as_vllm_cannot_load_it() -> None:
    config = load_config("command-r7b")
    config["sliding_window"] = 0
    with pytest.raises(CatalogueError, match="'sliding_window' is 0, and vLLM 0.33 needs"):
        layer_specs_from_config(config)


@pytest.mark.parametrize(
    ("name", "served"),
    [("gemma-2-9b", "bf16"), ("gemma-3-27b", "bf16"), ("gemma-3n-e4b", "fp16"),
     ("mistral-7b-v0.1", "fp16")],
)  # fmt: skip
def test_a_float16_checkpoint_is_served_as_vllm_serves_it(name: str, served: str) -> None:
    # vLLM 0.33 runs Gemma-2 and Gemma-3 float16 checkpoints in bfloat16 (numerical
    # instability); other models, Gemma-3n among them, in float16.
    config = load_config(name)
    config["torch_dtype"] = "float16"
    layers = layer_specs_from_config(config)
    owners = [spec for spec in layers.values() if not isinstance(spec, KVSharingSpec)]
    assert {spec.dtype for spec in owners} == {served}  # type: ignore[union-attr]


def test_the_config_dtype_is_read_where_vllm_reads_it_first() -> None:
    # transformers' `dtype` ahead of the older `torch_dtype`, the root config ahead of the
    # text config.
    mistral = {**load_config("mistral-7b-v0.1"), "torch_dtype": "float16", "dtype": "bfloat16"}
    llama4 = load_config("llama-4-scout")
    llama4["text_config"]["torch_dtype"] = "float16"  # the root says bfloat16
    for config in (mistral, llama4):
        layers = layer_specs_from_config(config)
        assert {spec.dtype for spec in layers.values()} == {"bf16"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "key"),
    [("gemma-3-27b", "head_dim"), ("gpt-oss-20b", "head_dim"), ("qwen3-next-80b-a3b", "head_dim"),
     ("mistral-7b-v0.1", "num_key_value_heads"), ("gemma-2-9b", "num_key_value_heads")],
)  # fmt: skip
def test_a_null_that_transformers_refuses_is_refused(name: str, key: str) -> None:
    # transformers' class types these fields as a plain int: vLLM 0.33 fails reading the config.
    config = load_config(name)
    config.get("text_config", config)[key] = None
    with pytest.raises(CatalogueError, match=f"'{key}' is null, and transformers'"):
        layer_specs_from_config(config)


def test_a_null_head_dim_where_transformers_takes_one_is_derived() -> None:
    config = {**load_config("mistral-7b-v0.1"), "head_dim": None}
    assert {spec.head_size for spec in layer_specs_from_config(config).values()} == {128}  # type: ignore[union-attr]


_LLAMA_4K = {**load_config("llama-3.1-8b"), "max_position_embeddings": 4096, "rope_scaling": None}


@pytest.mark.parametrize(
    ("changes", "length"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 16384),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 8192),
        ({"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}}, 12288),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 4096),  # already scaled
        ({"seq_length": 1000}, 1000),  # the smallest length field
        ({"model_max_length": 9999}, 9999),  # wins when set
        (
            {
                "max_position_embeddings": 131072,
                "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
            },
            4096,
        ),
    ],
)
def test_max_model_len_is_the_length_vllm_serves_by_default(
    changes: dict[str, Any], length: int
) -> None:
    # vLLM 0.33's _get_and_verify_max_len, checked against vLLM for each case.
    assert max_model_len_from_config({**_LLAMA_4K, **changes}) == length


def test_a_rope_factor_that_is_no_number_is_refused() -> None:
    config = {**_LLAMA_4K, "rope_scaling": {"rope_type": "linear", "factor": "4"}}
    with pytest.raises(CatalogueError, match="RoPE 'factor' must be > 0"):
        max_model_len_from_config(config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # An int past a float's range, with or without a scaling factor to multiply.
        ({"max_position_embeddings": 10**400}, None),
        (
            {"max_position_embeddings": 10**400, "rope_scaling": {"type": "linear", "factor": 2.0}},
            "too large",
        ),
        ({"rope_scaling": {"rope_type": "linear", "factor": 1e308}}, "too large"),
        ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "finite"),
        ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "finite"),
    ],
)
def test_a_length_or_rope_factor_past_a_floats_range_is_a_catalogue_error(
    changes: dict[str, Any], message: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # They were an OverflowError traceback (an int too large for a float, a float infinity
    # made an int) or, for NaN, a ValueError from int() that did not name the field.
    config = {**_LLAMA_4K, **changes}
    if message is None:
        # Without RoPE scaling vLLM keeps the length an int, as given.
        assert max_model_len_from_config(config) == 10**400
        return
    with pytest.raises(CatalogueError, match=f"RoPE 'factor'.*{message}"):
        max_model_len_from_config(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--memory", "8GiB"]) == 2
    assert capsys.readouterr().err.startswith("hybrid-kv plan: error: llama config: RoPE")


@pytest.mark.parametrize(
    ("preset", "key", "argv"),
    [
        ("llama-3.1-8b", "hidden_size", ["--gpu-memory", "80GiB"]),
        ("gemma-2-9b", "head_dim", ["--gpu-memory", "80GiB"]),
        ("bamba-9b", "mamba_d_head", ["--memory", "40GiB"]),
    ],
)
def test_sizes_past_a_floats_range_are_counted_exactly_and_refused_in_one_line(
    preset: str,
    key: str,
    argv: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The weight estimate divided them as floats and `format_bytes` made them floats: an
    # OverflowError traceback, where a budget they cannot fit is an error like any other.
    config = {**load_config(preset), key: 10**400}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--max-model-len", "4096", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("hybrid-kv plan: error: ")
    assert "TiB" in captured.err


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_context_length_past_a_floats_range_plans_with_its_kv_cache_tokens(
    json_flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Mistral-7B slides on every layer, so a request of any length reserves a window's blocks:
    # the plan is made, and its token count (max concurrency times max_model_len, a float
    # product in vLLM) was an OverflowError traceback.
    config = {**load_config("mistral-7b-v0.1"), "max_position_embeddings": 10**400}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--memory", "40GiB", "--strategy", "vllm", *json_flag]) == 0
    out = capsys.readouterr().out
    if json_flag:
        tokens = json.loads(out)["plan"]["kv_cache_tokens"]
        assert 10**400 < tokens < 10**403
    else:
        assert "KV cache tokens" in out


def test_weights_and_sizes_past_a_floats_range_are_exact() -> None:
    config = {**load_config("llama-3.1-8b"), "hidden_size": 10**400}
    assert estimate_weight_bytes(config) > 10**800
    assert format_bytes(10**400).endswith(" TiB")
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 2**30 * 3 // 2)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 KiB",
        "1.50 GiB",
    ]
    bamba = {**load_config("bamba-9b"), "mamba_d_head": 10**400}
    with pytest.raises(InsufficientMemoryError):
        plan_kv_cache(layer_specs_from_config(bamba), 40 * GIB, 4096)


def test_mixtral_with_mixed_layer_types_runs_full_as_in_vllm() -> None:
    # vLLM 0.33's Mixtral attention has only the model-wide window, set when every layer
    # slides; Mistral's (Llama's) reads layer_types per layer.
    layer_types = ["sliding_attention", "full_attention"] * 16
    mistral = {**load_config("mistral-7b-v0.1"), "layer_types": layer_types}
    mixtral = {**mistral, "model_type": "mixtral"}
    assert {spec.kind for spec in layer_specs_from_config(mixtral).values()} == {"full"}
    kinds = {spec.kind for spec in layer_specs_from_config(mistral).values()}
    assert kinds == {"full", "sliding_window"}


def test_jamba_attention_offset_beyond_its_period_is_refused() -> None:
    config = {**load_config("jamba-mini-1.5"), "attn_layer_offset": 8}
    with pytest.raises(CatalogueError, match=r"attn_layer_offset \(8\) must be smaller"):
        layer_specs_from_config(config)


@pytest.mark.parametrize("model_type", ["llama", "granite"])
def test_llama_with_a_sliding_window_slides_as_vllm_reads_it(model_type: str) -> None:
    # vLLM 0.33's Llama and Granite attention: per layer from layer_types, else the model-wide
    # window on every layer.
    config = {**load_config("llama-3.1-8b"), "model_type": model_type, "sliding_window": 64}
    windows = {getattr(s, "sliding_window", None) for s in layer_specs_from_config(config).values()}
    assert windows == {64}
    config["layer_types"] = ["sliding_attention", "full_attention"] * 16
    kinds = [spec.kind for spec in layer_specs_from_config(config).values()]
    assert kinds[:2] == ["sliding_window", "full"]
