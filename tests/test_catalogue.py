"""Model catalogue: layer specs built from the shipped config.json presets and from files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hybrid_kv.catalogue import (
    CatalogueError,
    layer_specs_from_config,
    list_presets,
    load_config,
    load_model,
    max_model_len_from_config,
)
from hybrid_kv.specs import KVSharingSpec, MambaSpec, validate_layers


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
    assert isinstance(mamba, MambaSpec) and mamba.shapes == ((8192, 3), (8192, 16))


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
                "hidden_size": 8,
            },
            "attn_layer_indices",
        ),
        (
            {
                "model_type": "gemma3_text",
                "num_hidden_layers": 6,
                "num_attention_heads": 2,
                "head_dim": 8,
            },
            "sliding_window",
        ),
        ({"model_type": "rwkv"}, "unsupported model_type"),
        ({"num_hidden_layers": 2}, "model_type"),
    ],
)
def test_configs_missing_fields_raise(config: dict[str, object], message: str) -> None:
    with pytest.raises(CatalogueError, match=message):
        layer_specs_from_config(config)


def test_max_model_len_requires_max_position_embeddings() -> None:
    with pytest.raises(CatalogueError, match="max_position_embeddings"):
        max_model_len_from_config({"model_type": "llama"})
