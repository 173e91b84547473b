"""Model catalogue: layer specs built from the shipped config.json presets and from files."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hybrid_kv.catalogue import (
    CatalogueError,
    estimate_parameters,
    estimate_weight_bytes,
    layer_specs_from_config,
    list_presets,
    load_config,
    load_model,
    max_model_len_from_config,
)
from hybrid_kv.specs import KVSharingSpec, MambaSpec, MLAAttentionSpec, validate_layers


def _kinds(name: str) -> Counter[str]:
    return Counter(spec.kind for spec in load_model(name).layers.values())


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_builds_valid_layers(name: str) -> None:
    model = load_model(name)
    validate_layers(model.layers)
    assert model.max_model_len > 0
    assert list(model.layers) == [f"model.layers.{i}" for i in range(len(model.layers))]


def test_presets_cover_the_issue_catalogue() -> None:
    assert {
        "gemma-2-9b",
        "gemma-3-27b",
        "gemma-3n-e4b",
        "gpt-oss-20b",
        "llama-4-scout",
        "ministral-8b",
        "command-r7b",
        "jamba-mini-1.5",
        "bamba-9b",
        "llama-3.1-8b",
    } <= set(list_presets())


def test_gemma2_alternates_sliding_and_full_starting_with_sliding() -> None:
    layers = load_model("gemma-2-9b").layers
    assert layers["model.layers.0"].kind == "sliding_window"
    assert layers["model.layers.1"].kind == "full"
    assert layers["model.layers.0"].sliding_window == 4096  # type: ignore[union-attr]
    assert layers["model.layers.0"].bytes_per_token == 2 * 8 * 256 * 2  # fp32 ckpt -> bf16


def test_gemma3_27b_has_52_sliding_and_10_full_layers_every_sixth() -> None:
    model = load_model("gemma-3-27b")
    assert _kinds("gemma-3-27b") == {"sliding_window": 52, "full": 10}
    full = [name for name, spec in model.layers.items() if spec.kind == "full"]
    assert full == [f"model.layers.{i}" for i in range(5, 62, 6)]
    assert model.max_model_len == 131072  # transformers' default for gemma3_text


def test_gemma3n_shares_kv_of_the_last_non_shared_layer_of_each_type() -> None:
    layers = load_model("gemma-3n-e4b").layers
    shared = {n: s.target for n, s in layers.items() if isinstance(s, KVSharingSpec)}
    assert len(shared) == 15
    assert shared["model.layers.20"] == "model.layers.18"  # sliding
    assert shared["model.layers.24"] == "model.layers.19"  # full
    assert set(shared.values()) == {"model.layers.18", "model.layers.19"}


def test_gpt_oss_alternates_window_128_and_full() -> None:
    assert _kinds("gpt-oss-20b") == {"sliding_window": 12, "full": 12}
    assert _kinds("gpt-oss-120b") == {"sliding_window": 18, "full": 18}


def test_llama4_scout_uses_chunked_local_attention_with_every_fourth_layer_global() -> None:
    layers = load_model("llama-4-scout").layers
    assert _kinds("llama-4-scout") == {"chunked_local": 36, "full": 12}
    assert layers["model.layers.3"].kind == "full"
    assert layers["model.layers.0"].attention_chunk_size == 8192  # type: ignore[union-attr]


def test_cohere2_has_three_sliding_layers_per_full_layer() -> None:
    assert _kinds("command-r7b") == {"sliding_window": 24, "full": 8}


def test_cohere2_windows_hold_one_token_more_than_the_config_as_vllm_gives_them() -> None:
    # vLLM 0.33's Cohere2 attention passes `sliding_window + 1` (its layer sees the window and
    # the current token), and its KV cache spec carries that window.
    layers = load_model("command-r7b").layers
    assert load_config("command-r7b")["sliding_window"] == 4096
    assert {s.sliding_window for s in layers.values() if s.kind == "sliding_window"} == {4097}


def test_gpt_oss_slides_on_even_layers_whatever_its_layer_types_say() -> None:
    # vLLM 0.33's gpt-oss attention picks the window by the layer's index, not `layer_types`.
    config = load_config("gpt-oss-20b")
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    layers = layer_specs_from_config(config)
    assert [layers[f"model.layers.{i}"].kind for i in range(4)] == [
        "sliding_window",
        "full",
        "sliding_window",
        "full",
    ]


def test_mistral_family_slides_on_every_layer() -> None:
    assert _kinds("ministral-8b") == {"sliding_window": 36}
    assert _kinds("mistral-7b-v0.1") == {"sliding_window": 32}


def test_mistral_params_style_window_pattern_repeats() -> None:
    config = {
        "model_type": "mistral",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "sliding_window": [None, 32],
    }
    kinds = [s.kind for s in layer_specs_from_config(config).values()]
    assert kinds == ["full", "sliding_window", "full", "sliding_window"]


def test_jamba_puts_attention_at_offset_4_of_every_8_and_mamba1_elsewhere() -> None:
    layers = load_model("jamba-mini-1.5").layers
    attention = [n for n, s in layers.items() if s.kind == "full"]
    assert attention == [f"model.layers.{i}" for i in (4, 12, 20, 28)]
    mamba = layers["model.layers.0"]
    assert isinstance(mamba, MambaSpec) and mamba.shapes == ((3, 8192), (8192, 16))


def test_bamba_puts_attention_at_the_listed_indices_and_mamba2_elsewhere() -> None:
    layers = load_model("bamba-9b").layers
    assert [n for n, s in layers.items() if s.kind == "full"] == [
        f"model.layers.{i}" for i in (9, 18, 27)
    ]
    mamba = layers["model.layers.0"]
    assert isinstance(mamba, MambaSpec) and mamba.shapes == ((3, 8448), (128, 64, 128))


def test_plain_llama_is_full_attention_only() -> None:
    assert _kinds("llama-3.1-8b") == {"full": 32}


def test_dtype_override_changes_attention_but_not_mamba_states() -> None:
    layers = load_model("jamba-mini-1.5", dtype="fp8").layers
    assert layers["model.layers.4"].dtype == "fp8_e4m3"  # type: ignore[union-attr]
    assert layers["model.layers.0"].dtypes == ("bf16", "bf16")  # type: ignore[union-attr]


def test_config_path_and_directory_load(tmp_path: Path) -> None:
    config = load_config("gpt-oss-20b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model(str(tmp_path / "config.json")).layers == load_model("gpt-oss-20b").layers
    assert load_model(str(tmp_path)).max_model_len == 131072


def test_unknown_model_lists_the_presets() -> None:
    with pytest.raises(CatalogueError, match=r"unknown model 'gemma-9'.*gemma-3-27b"):
        load_model("gemma-9")


def test_preset_names_are_case_insensitive() -> None:
    assert load_model("Gemma-3-27B").layers == load_model("gemma-3-27b").layers
    assert load_model("Gemma-3-27B").name == "gemma-3-27b"


def test_a_near_miss_suggests_the_preset() -> None:
    with pytest.raises(CatalogueError, match="did you mean gemma-3-27b"):
        load_model("gema-3-27b")


@pytest.mark.parametrize("path", ["./nope/config.json", "missing.json", "/tmp/no/such/dir"])
def test_a_missing_path_says_no_such_file(path: str) -> None:
    with pytest.raises(CatalogueError, match="no such file or directory"):
        load_model(path)


def test_a_path_that_is_neither_a_file_nor_a_directory_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    # A FIFO nobody writes to would block a read forever: refused before any read.
    for path in (str(fifo), os.devnull):
        with pytest.raises(CatalogueError, match="neither a config.json file nor a directory"):
            load_model(path)


def test_a_directory_without_a_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(CatalogueError, match="no config.json in directory"):
        load_model(str(tmp_path))


def test_a_config_json_that_is_a_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    # Given its parent, the config is there but not a file; given itself, it is a directory.
    with pytest.raises(CatalogueError, match=r"config\.json is not a file"):
        load_model(str(tmp_path))
    with pytest.raises(CatalogueError, match="is a directory, not a config.json file"):
        load_model(str(tmp_path / "config.json"))


def _cache_model(hub: Path, model_id: str, config: dict[str, object], ref: bool = True) -> Path:
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_hub_ids_resolve_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HOME", raising=False)
    _cache_model(tmp_path / "hub", "google/gemma-2-9b", load_config("gemma-2-9b"))
    model = load_model("google/gemma-2-9b")
    assert model.name == "google/gemma-2-9b"
    assert model.layers == load_model("gemma-2-9b").layers


def test_hf_home_holds_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    # No refs/main: the snapshot holding a config is used.
    _cache_model(tmp_path / "hub", "org/tiny", load_config("llama-3.1-8b"), ref=False)
    assert load_model("org/tiny").model_type == "llama"


def test_an_uncached_hub_id_says_where_it_looked_and_never_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CatalogueError, match=r"not in the local Hugging Face cache.*download"):
        load_model("someone/never-seen")
    # huggingface_hub 1.0 removed `huggingface-cli`; its command line is `hf`.
    with pytest.raises(CatalogueError, match="`hf download someone/never-seen config.json`"):
        load_model("someone/never-seen")


def test_bad_json_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(CatalogueError, match="not valid JSON"):
        load_config(str(path))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers"),
        (
            {
                "model_type": "bamba",
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "hidden_size": 8,
            },
            "attn_layer_indices",
        ),
        ({"model_type": "rwkv"}, "unsupported model_type 'rwkv'"),
        ({"num_hidden_layers": 2}, "model_type"),
    ],
)
def test_configs_missing_fields_raise(config: dict[str, object], message: str) -> None:
    with pytest.raises(CatalogueError, match=message):
        layer_specs_from_config(config)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "jamba", "qwen3_next"])
def test_a_corrupt_layer_count_is_refused_before_anything_is_built(model_type: str) -> None:
    config = {
        "model_type": model_type,
        "num_hidden_layers": 10**9,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "hidden_size": 16,
        "sliding_window": 8,
    }
    with pytest.raises(CatalogueError, match="'num_hidden_layers' is 1,000,000,000, more than"):
        layer_specs_from_config(config)


def test_max_model_len_requires_max_position_embeddings() -> None:
    with pytest.raises(CatalogueError, match="max_position_embeddings"):
        max_model_len_from_config({"model_type": "llama"})


# ----------------------------------------------------------------------------- architectures


def test_an_unknown_model_type_names_the_layer_kinds_its_config_mentions() -> None:
    config = {
        "model_type": "zamba9",
        "num_attention_heads": 8,
        "sliding_window": 4096,
        "mamba_d_state": 64,
        "layer_types": ["hybrid", "attention"],
    }
    with pytest.raises(CatalogueError) as caught:
        layer_specs_from_config(config)
    message = str(caught.value)
    for fragment in ("zamba9", "sliding-window", "Mamba", "hybrid", "supported model types"):
        assert fragment in message


def _kinds_of(layers: dict[str, object]) -> list[str]:
    return [spec.kind for spec in layers.values()]  # type: ignore[attr-defined]


QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 36,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    **QWEN3_8B,
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
PHI3_MINI = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "intermediate_size": 8192,
    "vocab_size": 32064,
    "sliding_window": 2047,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
PHI4 = {
    **PHI3_MINI,
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_key_value_heads": 10,
    "num_hidden_layers": 40,
    "intermediate_size": 17920,
    "vocab_size": 100352,
    "sliding_window": None,
    "max_position_embeddings": 16384,
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1408,
    "intermediate_size": 10944,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
}
KIMI_K2 = {**load_config("deepseek-v3"), "model_type": "kimi_k2", "n_routed_experts": 384}
GRANITE_4_H = {
    "model_type": "granitemoehybrid",
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "mamba", "attention", "mamba"],
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 131072,
}
FALCON_H1 = {
    "model_type": "falcon_h1",
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "mamba_d_ssm": 1536,
    "mamba_n_heads": 24,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 131072,
}
NEMOTRON_H = {
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hybrid_override_pattern": "M-M*-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "max_position_embeddings": 8192,
}
GEMMA3N_E2B = {
    "model_type": "gemma3n_text",
    "head_dim": 256,
    "hidden_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 30,
    "num_kv_shared_layers": 10,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 6,
    "max_position_embeddings": 32768,
}
LLAMA4_MAVERICK = {
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "attention_chunk_size": 8192,
        "head_dim": 128,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "num_hidden_layers": 48,
        "no_rope_layers": [],
        "interleave_moe_layer_step": 2,
        "max_position_embeddings": 1048576,
    },
}


def test_qwen2_and_qwen3_are_full_attention() -> None:
    for config in (QWEN25_7B, QWEN3_8B, QWEN3_30B_A3B):
        layers = layer_specs_from_config(config)
        assert set(_kinds_of(layers)) == {"full"}
    assert layer_specs_from_config(QWEN3_8B)["model.layers.0"].bytes_per_token == 8 * 256 * 2


# vLLM 0.33's Qwen2/Qwen3 (dense and MoE) attention takes no per-layer window: all layers slide
# by the model-wide window vLLM sets when transformers' `layer_types` are absent or all sliding,
# and Qwen2Model asserts that mixed `layer_types` cover every layer (`max_window_layers`).
def _qwen(config: dict[str, object], layers: int = 4, **fields: object) -> dict[str, object]:
    return {**config, "num_hidden_layers": layers, "sliding_window": 64, **fields}


def test_qwen2_slides_everywhere_when_every_layer_is_past_max_window_layers() -> None:
    config = _qwen(QWEN25_7B, use_sliding_window=True, max_window_layers=0)
    layers = layer_specs_from_config(config)
    assert _kinds_of(layers) == ["sliding_window"] * 4
    assert layers["model.layers.3"].sliding_window == 64  # type: ignore[attr-defined]


def test_qwen2_with_max_window_layers_at_the_layer_count_is_full() -> None:
    config = _qwen(QWEN25_7B, use_sliding_window=True, max_window_layers=4)
    assert _kinds_of(layer_specs_from_config(config)) == ["full"] * 4


@pytest.mark.parametrize("config", [QWEN25_7B, QWEN3_8B])
def test_qwen2_and_qwen3_sliding_on_some_layers_is_refused_as_vllm_refuses_it(
    config: dict[str, object],
) -> None:
    mixed = _qwen(config, use_sliding_window=True, max_window_layers=2)
    with pytest.raises(CatalogueError, match=r"max_window_layers 2 < num_hidden_layers 4"):
        layer_specs_from_config(mixed)


def test_qwen3_moe_has_no_layer_types_so_every_layer_slides_when_enabled() -> None:
    config = _qwen(QWEN3_30B_A3B, use_sliding_window=True, max_window_layers=2)
    assert _kinds_of(layer_specs_from_config(config)) == ["sliding_window"] * 4
    config["use_sliding_window"] = False
    assert _kinds_of(layer_specs_from_config(config)) == ["full"] * 4


def test_qwen_without_sliding_window_reads_no_max_window_layers() -> None:
    config = _qwen(QWEN25_7B, use_sliding_window=False, max_window_layers=None)
    assert _kinds_of(layer_specs_from_config(config)) == ["full"] * 4


def test_qwen2_moe_layer_types_are_mixed_so_it_runs_full() -> None:
    config = _qwen(QWEN3_30B_A3B, model_type="qwen2_moe", use_sliding_window=True)
    assert _kinds_of(layer_specs_from_config(config)) == ["full"] * 4


def test_qwen3_next_alternates_gated_deltanet_and_full_attention() -> None:
    layers = load_model("qwen3-next-80b-a3b").layers
    assert _kinds_of(layers)[:4] == ["mamba", "mamba", "mamba", "full"]
    gdn = layers["model.layers.0"]
    assert isinstance(gdn, MambaSpec) and gdn.shapes == ((3, 8192), (32, 128, 128))


def test_phi3_slides_on_every_layer_and_phi4_attends_fully() -> None:
    phi3 = layer_specs_from_config(PHI3_MINI)
    assert set(_kinds_of(phi3)) == {"sliding_window"}
    assert phi3["model.layers.0"].sliding_window == 2047  # type: ignore[union-attr]
    assert set(_kinds_of(layer_specs_from_config(PHI4))) == {"full"}


@pytest.mark.parametrize("config", [DEEPSEEK_V2_LITE, load_config("deepseek-v3"), KIMI_K2])
def test_deepseek_and_kimi_use_mla_with_one_latent_vector(config: dict[str, object]) -> None:
    layers = layer_specs_from_config(config)
    assert {type(s) for s in layers.values()} == {MLAAttentionSpec}
    assert layers["model.layers.0"].head_size == 512 + 64  # type: ignore[union-attr]


def test_granite_4_hybrid_follows_its_layer_types() -> None:
    layers = layer_specs_from_config(GRANITE_4_H)
    assert _kinds_of(layers) == ["mamba", "mamba", "full", "mamba"]
    assert layers["model.layers.0"].shapes == ((3, 3072 + 2 * 128), (48, 64, 128))  # type: ignore[union-attr]


def test_falcon_h1_layers_hold_attention_and_mamba_side_by_side() -> None:
    layers = layer_specs_from_config(FALCON_H1)
    assert list(layers) == [
        "model.layers.0.self_attn",
        "model.layers.0.mamba",
        "model.layers.1.self_attn",
        "model.layers.1.mamba",
    ]
    assert layers["model.layers.0.mamba"].shapes == ((3, 1536 + 512), (24, 64, 256))  # type: ignore[union-attr]


def test_nemotron_h_reads_its_hybrid_pattern() -> None:
    layers = layer_specs_from_config(NEMOTRON_H)
    # M-M*-M- : MLP layers ("-") have no cache.
    assert list(layers) == [f"model.layers.{i}" for i in (0, 2, 3, 5)]
    assert _kinds_of(layers) == ["mamba", "mamba", "full", "mamba"]
    assert layers["model.layers.0"].shapes == ((3, 8192 + 2 * 8 * 128), (128, 64, 128))  # type: ignore[union-attr]


def test_gemma3n_e2b_shares_the_last_ten_layers() -> None:
    layers = layer_specs_from_config(GEMMA3N_E2B)
    shared = {n: s.target for n, s in layers.items() if isinstance(s, KVSharingSpec)}
    assert len(shared) == 10
    assert set(shared.values()) == {"model.layers.18", "model.layers.19"}


@pytest.mark.parametrize(
    ("written", "expected"),
    [(None, "fp32"), ("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"),
     ("auto", "fp16"), ("fp8", "fp8_e4m3")],
)  # fmt: skip
def test_nemotron_h_keeps_its_ssm_state_in_float32_unless_the_config_says(
    written: str | None, expected: str
) -> None:
    # vLLM 0.33's NemotronH config hook: the SSM state takes the config's
    # mamba_ssm_cache_dtype, float32 without one ("auto": the conv state's, the model dtype).
    config = {**NEMOTRON_H, "torch_dtype": "float16"}
    if written is not None:
        config["mamba_ssm_cache_dtype"] = written
    state = layer_specs_from_config(config)["model.layers.0"]
    assert state.dtypes == ("fp16", expected)  # type: ignore[union-attr]


@pytest.mark.parametrize("written", ["int3", 32, None])
def test_nemotron_h_refuses_an_ssm_state_dtype_it_cannot_read(written: object) -> None:
    with pytest.raises(CatalogueError, match="'mamba_ssm_cache_dtype' must be one of auto"):
        layer_specs_from_config({**NEMOTRON_H, "mamba_ssm_cache_dtype": written})


@pytest.mark.parametrize(
    ("name", "window"),
    [("gemma-2-9b", 4096), ("gemma-3-27b", 4096), ("gemma-3n-e4b", 512), ("command-r7b", 4097),
     ("gpt-oss-20b", 128), ("mistral-7b-v0.1", 4096), ("ministral-8b", 4096)],
)  # fmt: skip
def test_a_config_without_a_window_slides_by_transformers_default(name: str, window: int) -> None:
    # vLLM 0.33 reads config.json through transformers' class, whose default window a config
    # that leaves sliding_window out takes (Cohere2's attention adds one).
    config = load_config(name)
    del config.get("text_config", config)["sliding_window"]
    windows = {
        getattr(spec, "sliding_window", None) for spec in layer_specs_from_config(config).values()
    }
    assert window in windows


def test_qwen2_with_use_sliding_window_and_no_window_slides_by_4096() -> None:
    config = {**QWEN25_7B, "use_sliding_window": True, "max_window_layers": 0}
    del config["sliding_window"]
    windows = {
        getattr(spec, "sliding_window", None) for spec in layer_specs_from_config(config).values()
    }
    assert windows == {4096}


@pytest.mark.parametrize(
    ("chunk", "kinds"), [(None, {"full"}), (0, {"full"}), ("absent", {"full", "chunked_local"})]
)
def test_llama4_chunks_as_vllm_reads_attention_chunk_size(chunk: object, kinds: set[str]) -> None:
    # Left out: transformers' default, 8192; null or 0: no chunked attention in vLLM 0.33.
    config = load_config("llama-4-scout")
    if chunk == "absent":
        del config["text_config"]["attention_chunk_size"]
    else:
        config["text_config"]["attention_chunk_size"] = chunk
    layers = layer_specs_from_config(config)
    assert {spec.kind for spec in layers.values()} == kinds
    if chunk == "absent":
        chunks = {getattr(spec, "attention_chunk_size", None) for spec in layers.values()}
        assert chunks == {None, 8192}


def test_gemma2_alternates_whatever_sliding_window_pattern_says() -> None:
    # transformers' Gemma2Config has no sliding_window_pattern: vLLM 0.33 alternates.
    config = {**load_config("gemma-2-9b"), "sliding_window_pattern": 3}
    kinds = [spec.kind for spec in layer_specs_from_config(config).values()]
    assert kinds[:4] == ["sliding_window", "full", "sliding_window", "full"]


def test_gemma3n_without_num_kv_shared_layers_shares_transformers_default_15() -> None:
    config = dict(GEMMA3N_E2B)
    del config["num_kv_shared_layers"]
    layers = layer_specs_from_config(config)
    shared = {n: s.target for n, s in layers.items() if isinstance(s, KVSharingSpec)}
    assert len(shared) == 15
    assert set(shared.values()) == {"model.layers.13", "model.layers.14"}
    with pytest.raises(CatalogueError, match="'num_kv_shared_layers' is null"):
        layer_specs_from_config({**GEMMA3N_E2B, "num_kv_shared_layers": None})


def test_nemotron_h_without_n_groups_takes_transformers_default_8() -> None:
    # vLLM 0.33 reads config.json through NemotronHConfig: n_groups left out is 8, and the
    # conv state holds 2 * n_groups * ssm_state_size channels beside the intermediate size.
    config = dict(NEMOTRON_H)
    del config["n_groups"]
    state = layer_specs_from_config(config)["model.layers.0"]
    assert state.shapes[0] == (3, 8192 + 2 * 8 * 128)  # type: ignore[union-attr]
    assert layer_specs_from_config({**config, "n_groups": 1})["model.layers.0"].shapes[0] == (
        3,
        8192 + 2 * 128,
    )  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "dropped"),
    [("jamba-mini-1.5", ("attn_layer_period", "attn_layer_offset", "mamba_d_state")),
     ("qwen3-next-80b-a3b", ("linear_num_key_heads", "linear_conv_kernel_dim")),
     ("deepseek-v3", ("kv_lora_rank", "qk_rope_head_dim"))],
)  # fmt: skip
def test_fields_left_out_take_transformers_defaults(name: str, dropped: tuple[str, ...]) -> None:
    # The presets write transformers' defaults for these: leaving them out changes nothing.
    config = load_config(name)
    for key in dropped:
        del config[key]
    assert layer_specs_from_config(config) == load_model(name).layers


def _gemma3n_small(num_shared: int) -> dict[str, object]:
    layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 2
    return {**GEMMA3N_E2B, "num_hidden_layers": 10, "layer_types": layer_types,
            "num_kv_shared_layers": num_shared}  # fmt: skip


def test_gemma3n_shared_layers_take_the_cache_vllm_picks_by_position() -> None:
    # vLLM 0.33's Gemma-3n: a sliding shared layer takes layer first_shared - 2, a full one
    # first_shared - 1, whatever their kinds: here layer 4 (full) and layer 5 (sliding).
    layers = layer_specs_from_config(_gemma3n_small(4))
    shared = {n: s.target for n, s in layers.items() if isinstance(s, KVSharingSpec)}
    assert shared == {
        "model.layers.6": "model.layers.4",
        "model.layers.7": "model.layers.4",
        "model.layers.8": "model.layers.4",
        "model.layers.9": "model.layers.5",
    }


@pytest.mark.parametrize(
    ("num_shared", "expected"),
    [(9, {"model.layers.4": "model.layers.0", "model.layers.9": "model.layers.0"}), (10, {})],
)
def test_gemma3n_shared_layers_with_no_target_keep_their_own_cache(
    num_shared: int, expected: dict[str, str]
) -> None:
    # A target before layer 0 is none in vLLM 0.33: the layer allocates its own cache.
    layers = layer_specs_from_config(_gemma3n_small(num_shared))
    shared = {n: s.target for n, s in layers.items() if isinstance(s, KVSharingSpec)}
    assert shared == expected
    assert len(layers) == 10
    assert layers["model.layers.1"].kind == "sliding_window"  # type: ignore[union-attr]


def test_llama4_maverick_uses_chunked_attention_with_every_fourth_layer_global() -> None:
    layers = layer_specs_from_config(LLAMA4_MAVERICK)
    assert Counter(_kinds_of(layers)) == {"chunked_local": 36, "full": 12}


@pytest.mark.parametrize(
    ("config", "published"),
    [
        (load_config("llama-3.1-8b"), 8.03e9),
        (load_config("mistral-7b-v0.1"), 7.24e9),
        (load_config("gemma-2-9b"), 9.24e9),
        (load_config("gpt-oss-20b"), 20.91e9),
        (load_config("gpt-oss-120b"), 116.83e9),
        (load_config("jamba-mini-1.5"), 51.57e9),
        (load_config("bamba-9b"), 9.78e9),
        (load_config("deepseek-v3"), 671e9),
        (QWEN25_7B, 7.62e9),
        (QWEN3_8B, 8.19e9),
        (QWEN3_30B_A3B, 30.53e9),
        (PHI3_MINI, 3.82e9),
        (PHI4, 14.66e9),
        (DEEPSEEK_V2_LITE, 15.71e9),
    ],
)
def test_parameter_estimates_are_within_one_percent_of_published_counts(
    config: dict[str, object], published: float
) -> None:
    dense, experts = estimate_parameters(config)
    assert abs(dense + experts - published) / published < 0.01


def test_weight_bytes_follow_the_checkpoint_precision_and_split_over_ranks() -> None:
    llama = load_config("llama-3.1-8b")
    dense, experts = estimate_parameters(llama)
    assert estimate_weight_bytes(llama) == 2 * (dense + experts)
    assert estimate_weight_bytes(llama, 4) == -(-2 * (dense + experts) // 4)
    # gpt-oss stores its experts in MXFP4 (4.25 bits), the rest in bf16.
    gpt = load_config("gpt-oss-20b")
    dense, experts = estimate_parameters(gpt)
    assert estimate_weight_bytes(gpt) == int(2 * dense + experts * 4.25 / 8)


def test_weights_that_cannot_be_estimated_name_the_missing_field() -> None:
    with pytest.raises(CatalogueError, match="intermediate_size"):
        estimate_weight_bytes(load_config("gemma-3n-e4b"))


# ----------------------------------------------------------------------------- tensor parallel


def test_tensor_parallel_ranks_hold_a_share_of_the_kv_heads() -> None:
    one = load_model("gpt-oss-20b").layers["model.layers.0"]
    two = load_model("gpt-oss-20b", tensor_parallel_size=2).layers["model.layers.0"]
    sixteen = load_model("gpt-oss-20b", tensor_parallel_size=16).layers["model.layers.0"]
    assert (one.num_kv_heads, two.num_kv_heads, sixteen.num_kv_heads) == (8, 4, 1)  # type: ignore[union-attr]


def test_tensor_parallel_splits_mamba_but_not_mla() -> None:
    jamba = load_model("jamba-mini-1.5", tensor_parallel_size=2).layers["model.layers.0"]
    assert jamba.shapes == ((3, 4096), (4096, 16))  # type: ignore[union-attr]
    mla = load_model("deepseek-v3", tensor_parallel_size=8).layers["model.layers.0"]
    assert mla.head_size == 576  # type: ignore[union-attr]
    with pytest.raises(CatalogueError, match="tensor_parallel_size must be >= 1"):
        load_model("gpt-oss-20b", tensor_parallel_size=0)
    # vLLM refuses a head count the ranks do not divide before it looks at Mamba shapes.
    with pytest.raises(
        CatalogueError, match=r"\(32\) must be divisible by tensor_parallel_size \(3\)"
    ):
        load_model("jamba-mini-1.5", tensor_parallel_size=3)
    with pytest.raises(
        CatalogueError, match=r"\(32\) must be divisible by tensor_parallel_size \(64\)"
    ):
        load_model("llama-3.1-8b", tensor_parallel_size=64)
