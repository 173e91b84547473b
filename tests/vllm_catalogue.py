"""The layer specs vLLM 0.33's own model code gives for a config, beside the catalogue's (used
by tests/test_catalogue_vllm.py where vLLM is installed).

Run as a script under vLLM's Python, it reads `{case: config.json contents}` as JSON on stdin,
builds each model the way a vLLM worker does (EngineArgs -> VllmConfig, `initialize_model` on
the `meta` device, on the CPU if the model cannot be built there, with no weights), reads
every attention and Mamba layer's `get_kv_cache_spec` as the model runner does, and writes
`{case: {"layers": {index: summary}, "max_model_len": n} or {"error": "Type: message"}}`
(`n`: the context length vLLM serves by default) as JSON to the file
named by its argument (vLLM logs to stdout).

    PYTHONPATH=python VLLM_TARGET_DEVICE=cpu VENV/bin/python tests/vllm_catalogue.py OUT < IN

Layers are keyed by index (`model.layers.{i}` in both); a summary holds the kind, window or
chunk, KV heads, head size, dtype and bytes per token of an attention layer, the latent width
of an MLA layer, the state shapes and dtypes of a Mamba layer, or the index a layer shares
its KV cache with.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import sys
import tempfile
from typing import Any

from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

Summary = dict[str, Any]

_TEXT_ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "gemma3n": "Gemma3nForCausalLM",
    "llama4": "Llama4ForCausalLM",
}
_SMALL = {
    "vocab_size": 512,
    "vocab_size_per_layer_input": 512,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
}


def text_only(config: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """`config` as vLLM's text-only model reads it, smaller where the KV cache does not look:
    a multimodal config's `text_config` with the root's dtype and the text architecture (the
    multimodal classes need torchvision), a small vocabulary, MLP and expert count, no
    quantization (its kernels need a GPU); then `changes` (a value of None drops the key)."""
    config = copy.deepcopy(config)
    if "text_config" in config:
        text = config["text_config"]
        text.setdefault("model_type", f"{config['model_type']}_text")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                text.setdefault(key, config[key])
        text["architectures"] = [_TEXT_ARCHITECTURES[config["model_type"]]]
        config = text
    config.pop("quantization_config", None)
    for key, value in _SMALL.items():
        if key in config:
            config[key] = [value] * len(config[key]) if isinstance(config[key], list) else value
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "fp8"}.get(
        name, name
    )


def ours(layers: dict[str, LayerSpec]) -> dict[str, Summary]:
    """The catalogue's `layers` as summaries keyed by layer index."""
    summaries: dict[str, Summary] = {}
    for name, spec in layers.items():
        index = name.removeprefix("model.layers.")
        if isinstance(spec, KVSharingSpec):
            summaries[index] = {"shares": int(spec.target.removeprefix("model.layers."))}
        elif isinstance(spec, MambaSpec):
            summaries[index] = {
                "kind": "mamba",
                "shapes": [list(shape) for shape in spec.shapes],
                "dtypes": list(spec.dtypes),
            }
        elif isinstance(spec, MLAAttentionSpec):
            summaries[index] = {
                "kind": "mla",
                "head_size": spec.head_size,
                "dtype": spec.dtype,
                "bytes_per_token": spec.bytes_per_token,
            }
        else:
            summary = {
                "kind": spec.kind,
                "kv_heads": spec.num_kv_heads,
                "head_size": spec.head_size,
                "dtype": spec.dtype,
                "bytes_per_token": spec.bytes_per_token,
            }
            if isinstance(spec, SlidingWindowSpec):
                summary["window"] = spec.sliding_window
            if isinstance(spec, ChunkedLocalAttentionSpec):
                summary["chunk"] = spec.attention_chunk_size
            summaries[index] = summary
    return summaries


def _theirs(spec: Any) -> Summary:
    kind = type(spec).__name__
    if hasattr(spec, "shapes"):
        return {
            "kind": "mamba",
            "shapes": [list(shape) for shape in spec.shapes],
            "dtypes": [_dtype_name(dtype) for dtype in spec.dtypes],
        }
    per_token = spec.page_size_bytes // spec.block_size
    if "MLA" in kind:
        return {
            "kind": "mla",
            "head_size": spec.head_size,
            "dtype": _dtype_name(spec.dtype),
            "bytes_per_token": per_token,
        }
    summary = {
        "kind": {
            "FullAttentionSpec": "full",
            "SlidingWindowSpec": "sliding_window",
            "ChunkedLocalAttentionSpec": "chunked_local",
        }.get(kind, kind),
        "kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": _dtype_name(spec.dtype),
        "bytes_per_token": per_token,
    }
    if summary["kind"] == "sliding_window":
        summary["window"] = spec.sliding_window
    if summary["kind"] == "chunked_local":
        summary["chunk"] = spec.attention_chunk_size
    return summary


def _index(layer_name: str) -> str:
    match = re.search(r"layers\.(\d+)\.", layer_name)
    if match is None:
        raise ValueError(f"no layer index in {layer_name!r}")
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _vllm_specs(config: dict[str, Any]) -> tuple[dict[str, Summary], int]:
    import torch
    from vllm.config import VllmConfig, get_layers_from_vllm_config, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.registry import ModelRegistry

    for architecture in config.get("architectures", []):
        registered = ModelRegistry.models.get(architecture)
        if registered is not None:
            registered.load_model_cls()  # a package the model needs is missing: say which
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "config.json"), "w") as file:
            json.dump(config, file)
        engine_args = EngineArgs(
            model=directory,
            skip_tokenizer_init=True,
            load_format="dummy",
            max_model_len=2048,
            enforce_eager=True,
        )
        vllm_config = engine_args.create_engine_config()
        default_length = EngineArgs(
            model=directory, skip_tokenizer_init=True, enforce_eager=True
        ).create_model_config()
        if not model_parallel_is_initialized():
            with set_current_vllm_config(VllmConfig()):  # no model: the expert group too
                address = f"tcp://127.0.0.1:{_free_port()}"
                init_distributed_environment(1, 0, address, 0, backend="gloo")
                ensure_model_parallel_initialized(1, 1)
        try:
            with set_current_vllm_config(vllm_config), torch.device("meta"):
                initialize_model(vllm_config)
        except (RuntimeError, NotImplementedError) as error:
            if "meta" not in str(error):
                raise
            # Built anew (the layers of the first try are registered in its config).
            vllm_config = engine_args.create_engine_config()
            with set_current_vllm_config(vllm_config), torch.device("cpu"):
                initialize_model(vllm_config)
        with set_current_vllm_config(vllm_config):
            layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
            summaries: dict[str, Summary] = {}
            for name, layer in layers.items():
                target = getattr(layer, "kv_sharing_target_layer_name", None)
                if target:
                    summaries[_index(name)] = {"shares": int(_index(target))}
                elif (spec := layer.get_kv_cache_spec(vllm_config)) is not None:
                    summaries[_index(name)] = _theirs(spec)
    return summaries, default_length.max_model_len


def main() -> None:
    import torch

    # vLLM's CPU platform keeps Mamba SSM states in float32 for its CPU kernels (when the CPU
    # has AVX-512 BF16); GPUs keep vLLM's default, the one the catalogue plans for.
    torch.cpu._is_avx512_bf16_supported = lambda: False
    cases = json.load(sys.stdin)
    results: dict[str, Any] = {}
    for name, config in cases.items():
        try:
            layers, max_model_len = _vllm_specs(config)
            results[name] = {"layers": layers, "max_model_len": max_model_len}
        except Exception as error:  # reported to the test, which names it
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
    with open(sys.argv[1], "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
