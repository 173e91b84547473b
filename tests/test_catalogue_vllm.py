"""The catalogue against vLLM 0.33's own model code, where vLLM is installed.

For every preset vLLM 0.33 can build, and for the configs where the catalogue's rules were
found to differ from vLLM's, vLLM builds the model (no weights) and each layer's KV cache spec
is read as its model runner reads it (`tests/vllm_catalogue.py`, in one subprocess). Per layer:
the kind, window or chunk, KV heads, head size, dtype and bytes per token, the MLA latent, the
Mamba state shapes and dtypes, and the layer whose KV cache a layer shares must be the
catalogue's. A case vLLM cannot build here for want of a package is skipped, naming it.

Bamba is not among them: vLLM 0.33 no longer has a Bamba model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hybrid_kv
import pytest
import vllm_catalogue as probe
from hybrid_kv.catalogue import layer_specs_from_config, load_config, max_model_len_from_config

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if os.environ.get("HYBRID_KV_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise RuntimeError("HYBRID_KV_REQUIRE_VLLM=1 but vLLM is not installed")  # CI's vLLM step
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM 0.33 is not installed")


def _cases() -> dict[str, dict[str, Any]]:
    preset = {
        name: probe.text_only(load_config(name))
        for name in (
            "llama-3.1-8b",
            "mistral-7b-v0.1",
            "ministral-8b",
            "gemma-2-9b",
            "gemma-3-27b",
            "gemma-3n-e4b",
            "command-r7b",
            "llama-4-scout",
            "gpt-oss-20b",
            "jamba-mini-1.5",
            "qwen3-next-80b-a3b",
            "deepseek-v3",
        )
    }
    gemma3n_types = (["sliding_attention"] * 4 + ["full_attention"]) * 2
    gemma3n = {
        f"gemma-3n-10-layers-{shared}-shared": probe.text_only(
            load_config("gemma-3n-e4b"),
            num_hidden_layers=10,
            layer_types=gemma3n_types,
            num_kv_shared_layers=shared,
            activation_sparsity_pattern=[0.0] * 10,
        )
        for shared in (4, 9)
    }
    small = {
        "hidden_size": 256,
        "intermediate_size": 64,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **small}
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **small}
    nemotron_h = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "num_hidden_layers": 6,
        "hybrid_override_pattern": "M-M*-M",
        "head_dim": 32,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        **small,
    }
    return {
        **preset,
        **gemma3n,
        "gemma-2-float16": probe.text_only(load_config("gemma-2-9b"), torch_dtype="float16"),
        "gemma-3n-default-sharing": probe.text_only(
            load_config("gemma-3n-e4b"),
            num_hidden_layers=30,
            layer_types=gemma3n_types * 3,
            num_kv_shared_layers=None,
            activation_sparsity_pattern=[0.0] * 30,
        ),
        "gemma-2-pattern-3": probe.text_only(load_config("gemma-2-9b"), sliding_window_pattern=3),
        # Fields left out take transformers' defaults (None drops the key).
        "gemma-3-no-window": probe.text_only(load_config("gemma-3-27b"), sliding_window=None),
        "mistral-no-window": probe.text_only(load_config("mistral-7b-v0.1"), sliding_window=None),
        "llama-4-no-chunk-size": probe.text_only(
            load_config("llama-4-scout"), attention_chunk_size=None
        ),
        "qwen2-sliding": {
            **qwen2,
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 0,
        },
        "mixtral-mixed-layer-types": probe.text_only(
            load_config("mistral-7b-v0.1"),
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_hidden_layers=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "llama-sliding": probe.text_only(
            load_config("llama-3.1-8b"),
            num_hidden_layers=4,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "qwen3": {**qwen3, "num_hidden_layers": 2},
        "qwen3-linear-rope": {
            **qwen3,
            "num_hidden_layers": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
        "nemotron-h": nemotron_h,
        "nemotron-h-default-groups": {k: v for k, v in nemotron_h.items() if k != "n_groups"},
        "jamba-default-layout": probe.text_only(
            load_config("jamba-mini-1.5"),
            num_hidden_layers=9,
            attn_layer_period=None,
            attn_layer_offset=None,
            mamba_d_state=None,
        ),
    }


CASES = _cases()


@pytest.fixture(scope="module")
def vllm_layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("vllm") / "layers.json"
    here = Path(__file__).parent
    env = {
        **os.environ,
        # The hybrid_kv this process imported (a source tree or an installed wheel).
        "PYTHONPATH": os.pathsep.join(
            [str(here), str(Path(hybrid_kv.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
        "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
    }
    done = subprocess.run(
        [sys.executable, str(here / "vllm_catalogue.py"), str(out)],
        input=json.dumps(CASES),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a measurement
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_catalogue_layers_are_the_ones_vllm_builds(case: str, vllm_layers: dict[str, Any]) -> None:
    result = vllm_layers[case]
    if "error" in result and result["error"].startswith("ModuleNotFoundError"):
        pytest.skip(f"vLLM cannot build {case} here: {result['error']}")
    assert "error" not in result, result.get("error")
    assert probe.ours(layer_specs_from_config(CASES[case])) == result["layers"]
    assert max_model_len_from_config(CASES[case]) == result["max_model_len"]
