"""Layer specs from Hugging Face `config.json` contents (no network), and shipped presets.

A model is named by a preset (case-insensitive; `list_presets()`), a path to a `config.json`
or to a directory holding one, or a Hugging Face hub id (`org/name`) already in the local
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`); nothing is ever
downloaded. Multimodal configs are read through their `text_config`.

Supported `model_type`s (`SUPPORTED_MODEL_TYPES`): Llama, Mistral/Ministral, Qwen2/2.5/3 (and
their MoE variants; sliding window where the config enables it), Phi-3/Phi-4 (sliding
window), Gemma-2/3 (sliding + full), Gemma-3n (KV sharing), Cohere2, gpt-oss, Llama-4 (chunked
local + full), DeepSeek-V2/V3 and Kimi-K2 (MLA), Jamba (Mamba-1), Bamba, Granite-4.0-H,
Falcon-H1 and Nemotron-H (Mamba-2), Qwen3-Next (gated DeltaNet + full). Layers are named
`model.layers.{i}`; Falcon-H1, whose layers hold both attention and Mamba, names them
`model.layers.{i}.self_attn` and `model.layers.{i}.mamba`.

Fields a config leaves out take the defaults of transformers' config class for its
`model_type` (head_dim 256 and 8 heads / 4 KV heads for Gemma-3, ...), as vLLM reads them.

With `tensor_parallel_size`, specs are those of one rank, as vLLM shards them: KV heads
`max(1, heads // tp)`, MLA's latent vector whole, Mamba widths and heads split. Head counts
vLLM cannot load are refused: heads the ranks do not divide, KV heads that do not divide the
heads, and KV heads neither divisible by the ranks nor dividing them.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecError,
    canonical_dtype,
    layer_context,
)

__all__ = [
    "PRESETS_DIR",
    "SUPPORTED_MODEL_TYPES",
    "CatalogueError",
    "ModelSpec",
    "estimate_parameters",
    "estimate_stage_weight_bytes",
    "estimate_weight_bytes",
    "hub_cache_dir",
    "layer_specs_from_config",
    "list_presets",
    "load_config",
    "load_model",
    "max_model_len_from_config",
    "resolve_model",
    "weight_estimate_note",
]

PRESETS_DIR = Path(__file__).with_name("presets")

Config = Mapping[str, Any]


class CatalogueError(ValueError):
    """Unknown model, unreadable config, or a config missing fields."""


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers (in model order, for one tensor-parallel rank), its longest
    supported context, and the config they were read from."""

    name: str
    layers: Mapping[str, LayerSpec]
    max_model_len: int
    model_type: str
    config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    tensor_parallel_size: int = 1

    @property
    def num_hidden_layers(self) -> int | None:
        """The config's decoder layer count (`num_hidden_layers`, else Nemotron-H's pattern
        length), which vLLM's pipeline stages split; None when the config gives none."""
        if not self.config:
            return None
        text = _text_config(self.config)[0]
        value = text.get("num_hidden_layers")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # Nemotron-H's layers are its pattern's characters, MLP-only ones (no cache) included.
        pattern = text.get("hybrid_override_pattern")
        return len(pattern) if isinstance(pattern, str) else None


def list_presets() -> list[str]:
    """Names of the shipped presets (`hybrid-kv plan NAME`)."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


# --------------------------------------------------------------------------- resolving names

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
    `~/.cache/huggingface/hub` (as `huggingface_hub` resolves it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _from_hub_cache(model_id: str) -> Path | None:
    """`config.json` of `model_id` in the local hub cache: the snapshot `refs/main` points
    at, else the most recent snapshot holding one."""
    repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        try:
            revision = ref.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise CatalogueError(f"cannot read the hub cache ref {ref}: {error}") from None
        candidate = snapshots / revision / "config.json"
        if candidate.is_file():
            return candidate
    found = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _looks_like_path(model: str) -> bool:
    return (
        os.sep in model or "/" in model or model.startswith((".", "~")) or model.endswith(".json")
    )


def resolve_model(model: str) -> Path:
    """The `config.json` a model name refers to (see the module docstring)."""
    if not isinstance(model, str) or not model.strip():
        raise CatalogueError(f"a model name must be a non-empty string, got {model!r}")
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # `~user` with no such user, or no home directory
        raise CatalogueError(f"no such file or directory: {model}") from None
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            return config
        if config.exists():
            raise CatalogueError(f"{config} is not a file")
        if path.name == "config.json":
            raise CatalogueError(f"{path} is a directory, not a config.json file")
        raise CatalogueError(f"no config.json in directory {path}")
    if path.is_file():
        return path
    if path.exists():
        # A device, FIFO or socket: reading one can block forever or never end.
        raise CatalogueError(f"{model} is neither a config.json file nor a directory")
    if _HUB_ID.match(model) and not model.endswith(".json"):
        cached = _from_hub_cache(model)
        if cached is not None:
            return cached
        raise CatalogueError(
            f"no such file {model!r}, and {model} is not in the local Hugging Face cache "
            f"({hub_cache_dir()}); hybrid-kv does not download: fetch it with "
            f"`hf download {model} config.json` or give a path to its config.json"
        )
    if _looks_like_path(model):
        raise CatalogueError(f"no such file or directory: {model}")
    presets = {name.lower(): name for name in list_presets()}
    key = model.strip().lower()
    if key in presets:
        return PRESETS_DIR / f"{presets[key]}.json"
    close = difflib.get_close_matches(key, list(presets), n=3, cutoff=0.6)
    suggestion = f"did you mean {' or '.join(presets[c] for c in close)}? " if close else ""
    raise CatalogueError(
        f"unknown model {model!r}: {suggestion}not a preset ({', '.join(list_presets())}), "
        "a config.json path, or a Hugging Face id in the local cache"
    )


def load_config(model: str) -> dict[str, Any]:
    """The config a model name refers to (preset, path or cached hub id)."""
    path = resolve_model(model)
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise CatalogueError(f"cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise CatalogueError(f"{path} is not valid JSON: {error}") from None
    except RecursionError:
        raise CatalogueError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(config, dict):
        raise CatalogueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _display_name(model: str, path: Path) -> str:
    if path.parent == PRESETS_DIR:
        return path.stem
    if _HUB_ID.match(model) and not Path(model).exists():
        return model
    if path.name == "config.json":
        return path.parent.name
    return path.stem


def load_model(model: str, *, dtype: str | None = None, tensor_parallel_size: int = 1) -> ModelSpec:
    """Load a preset, config file or cached hub model and build its layer specs (of one rank
    of `tensor_parallel_size`)."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise CatalogueError(f"tensor_parallel_size must be an int, got {tensor_parallel_size!r}")
    if tensor_parallel_size < 1:
        raise CatalogueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    path = resolve_model(model)
    config = load_config(str(path))
    layers = layer_specs_from_config(config, dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    return ModelSpec(
        name=_display_name(model, path),
        layers=layers,
        max_model_len=max_model_len_from_config(config),
        model_type=_text_config(config)[1],
        config=config,
        tensor_parallel_size=tensor_parallel_size,
    )


# The text config's length fields vLLM 0.33 takes the smallest of (`model_max_length`, where
# set, wins), and the RoPE types whose `factor` max_position_embeddings already includes.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_PRESCALED_ROPE = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)


def _rope_parameters(config: Config) -> list[Mapping[str, Any]]:
    """The config's RoPE parameters (`rope_parameters`, or the older `rope_scaling`), one
    mapping per layer type where they are given per layer type."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(params, Mapping) or not params:
        return []
    if all(isinstance(value, Mapping) for value in params.values()):
        return [value for value in params.values() if value]
    return [params]


def max_model_len_from_config(config: Config) -> int:
    """The context length vLLM 0.33 serves by default: the smallest length field of the text
    model (`max_position_embeddings`, ...; `model_max_length` where set; transformers'
    default when all are omitted), times a linear or dynamic RoPE scaling factor (not for
    Gemma-3, nor the types whose length includes it); with LongRoPE,
    `original_max_position_embeddings`."""
    text, model_type = _text_config(config)
    lengths = {key: text[key] for key in _MAX_LEN_KEYS if text.get(key) is not None}
    if text.get("model_max_length"):
        lengths = {"model_max_length": text["model_max_length"]}
    if not lengths:
        default = _DEFAULT_MAX_POSITIONS.get(model_type)
        if default is None:
            raise CatalogueError(f"{model_type} config is missing 'max_position_embeddings'")
        lengths = {"max_position_embeddings": default}
    key, length = min(
        ((key, _int(text, key, model_type, value)) for key, value in lengths.items()),
        key=lambda item: item[1],
    )
    rope = _rope_parameters(config)
    rope_types = [str(p.get("rope_type", p.get("type", "default"))) for p in rope]
    if "longrope" in rope_types and config.get("original_max_position_embeddings") is not None:
        key = "original_max_position_embeddings"
        return _int(config, key, model_type, config[key])
    if not rope or "gemma3" in str(config.get("model_type")):
        # vLLM scales nothing: the length stays the int given.
        return max(1, length)
    factor: Any = 1.0
    for params, rope_type in zip(rope, rope_types, strict=True):
        if rope_type not in _PRESCALED_ROPE:
            factor = params.get("factor", factor)
    if factor is None:
        factor = 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise CatalogueError(f"{model_type} config: RoPE 'factor' must be > 0, got {factor!r}")
    if not math.isfinite(factor):
        raise CatalogueError(f"{model_type} config: RoPE 'factor' must be finite, got {factor!r}")
    try:
        # vLLM's float product, truncated.
        return max(1, int(length * factor))
    except OverflowError:
        raise CatalogueError(
            f"{model_type} config: RoPE 'factor' ({factor!r}) times {key} is too large for the "
            "float vLLM scales the length in"
        ) from None


def layer_specs_from_config(
    config: Config, *, dtype: str | None = None, tensor_parallel_size: int = 1
) -> dict[str, LayerSpec]:
    """`{layer_name: spec}` for a Hugging Face config.

    `dtype` is the attention KV-cache dtype; by default the checkpoint's dtype when it is 16-bit,
    else bf16 (fp32 checkpoints are served in bf16). Mamba states use the checkpoint dtype
    rule too, independently of `dtype` (like vLLM's separate Mamba cache dtype), except
    Nemotron-H's SSM state: the config's `mamba_ssm_cache_dtype`, else float32, as in vLLM.
    """
    if not isinstance(config, Mapping):
        raise CatalogueError(f"a config must be a JSON object, got {type(config).__name__}")
    text, model_type, source_type = _config_types(config)
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise CatalogueError(_unsupported(text, model_type))
    model_dtype = _model_dtype(config, text)
    kv_dtype = model_dtype if dtype is None else dtype
    try:
        canonical_dtype(kv_dtype)
    except SpecError as error:
        raise CatalogueError(str(error)) from None
    context = _Context(
        text,
        model_type,
        kv_dtype,
        model_dtype,
        tensor_parallel_size,
        _TRANSFORMERS_DEFAULTS.get(source_type, {}),
        source_type,
    )
    heads = context.lookup("num_attention_heads")
    if isinstance(heads, int) and heads > 0 and heads % tensor_parallel_size:
        # vLLM's ModelConfig.verify_with_parallel_config refuses the same.
        raise CatalogueError(
            f"{model_type} config: num_attention_heads ({heads}) must be divisible by "
            f"tensor_parallel_size ({tensor_parallel_size}), as vLLM requires"
        )
    try:
        return builder(context)
    except SpecError as error:
        raise CatalogueError(f"{model_type} config: {error}") from None


# --------------------------------------------------------------------------- helpers

_DEFAULT_MAX_POSITIONS = {"gemma3": 131072, "gemma3_text": 131072}
_MODEL_TYPE_ALIASES = {
    "gemma3_text": "gemma3",
    "gemma3n_text": "gemma3n",
    "llama4_text": "llama4",
    "ministral": "mistral",
    "qwen2_moe": "qwen2",
    "qwen3": "qwen2",
    "qwen3_moe": "qwen2",
    "phi4": "phi3",
    "deepseek_v3": "deepseek_v2",
    "kimi_k2": "deepseek_v2",
    "granite": "llama",
    "mixtral": "mistral",
}


# transformers' config-class defaults, by `model_type` as the config writes it, for the fields
# real checkpoints leave out (multimodal Gemma-3 omits heads, KV heads, head_dim and vocab).
# vLLM reads config.json through these classes, so an omitted field takes this value. Checked
# against transformers 5.20 (the version vLLM 0.33 runs with). Where a class has no head_dim
# default, head_dim is hidden_size // num_attention_heads; with no KV-head default, the KV
# heads are the heads (also when the config writes null). `phi4` and `kimi_k2` have no class.
# `sliding_window` (and Llama-4's `attention_chunk_size`) are the classes' defaults for a config
# that leaves the key out; one that writes null has none.
_MLA_DEFAULTS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
_MAMBA2_DEFAULTS = {
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}
_TRANSFORMERS_DEFAULTS: dict[str, dict[str, int]] = {
    "llama": {"num_attention_heads": 32},
    "granite": {"num_attention_heads": 32},
    "mistral": {"num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "ministral": {"num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "mixtral": {"num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen2": {"num_attention_heads": 32, "num_key_value_heads": 32, "sliding_window": 4096},
    "qwen2_moe": {"num_attention_heads": 16, "num_key_value_heads": 16, "sliding_window": 4096},
    "qwen3": {
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "sliding_window": 4096,
    },
    "qwen3_moe": {"num_attention_heads": 32, "num_key_value_heads": 4, "sliding_window": 4096},
    "phi3": {"num_attention_heads": 32},
    "gemma2": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
        "sliding_window": 4096,
    },
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262208,
        "sliding_window": 4096,
    },
    "gemma3n_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "vocab_size": 262400,
        "sliding_window": 512,
        "num_kv_shared_layers": 15,
    },
    "cohere2": {"num_attention_heads": 64, "sliding_window": 4096},
    "gpt_oss": {
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
    },
    "llama4_text": {
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_chunk_size": 8192,
    },
    "deepseek_v2": {"num_attention_heads": 32, **_MLA_DEFAULTS},
    "deepseek_v3": {"num_attention_heads": 128, "num_key_value_heads": 128, **_MLA_DEFAULTS},
    "jamba": {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_expand": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
    },
    "bamba": {"num_attention_heads": 32, "num_key_value_heads": 8},
    "granitemoehybrid": {"num_attention_heads": 32, **_MAMBA2_DEFAULTS},
    "falcon_h1": {"num_attention_heads": 32, "num_key_value_heads": 8, **_MAMBA2_DEFAULTS},
    "nemotron_h": {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
    },
    "qwen3_next": {
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
}
# A multimodal config's text_config without a model_type is read as its text model's class.
_TRANSFORMERS_DEFAULTS.update(
    {
        outer: _TRANSFORMERS_DEFAULTS[inner]
        for outer, inner in (
            ("gemma3", "gemma3_text"),
            ("gemma3n", "gemma3n_text"),
            ("llama4", "llama4_text"),
        )
    }
)


# Fields transformers' class types as a plain int for a `model_type` (as the config writes it):
# a config that writes null there fails its validation, so vLLM 0.33 cannot load it. (Left out,
# they take the class default.) Checked against transformers 5.20.
_GEMMA_LIKE = {"gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gpt_oss"}
_LLAMA4 = {"llama4", "llama4_text"}
_NOT_NULL: dict[str, frozenset[str]] = {
    "head_dim": frozenset({*_GEMMA_LIKE, *_LLAMA4, "qwen3", "nemotron_h", "qwen3_next"}),
    "num_key_value_heads": frozenset(
        {*_GEMMA_LIKE, *_LLAMA4, "mistral", "ministral", "mixtral", "qwen3_moe", "jamba"}
        | {"nemotron_h", "qwen3_next"}
    ),
    "num_kv_shared_layers": frozenset({"gemma3n", "gemma3n_text"}),
}


@dataclass(frozen=True)
class _Context:
    text: Config
    model_type: str
    dtype: str
    model_dtype: str
    tp: int
    defaults: Mapping[str, int] = field(default_factory=dict)
    source_type: str = ""
    """The model type as the config writes it (`model_type` is the builder's)."""

    def lookup(self, key: str) -> Any:
        """`key` of the text config; transformers' default when the config leaves it out."""
        return self.text[key] if key in self.text else self.defaults.get(key)

    def kv_heads(self, heads: int) -> int:
        """KV heads on one rank (vLLM replicates heads when there are fewer than ranks)."""
        return max(1, heads // self.tp)


def _config_types(config: Config) -> tuple[Config, str, str]:
    """The text config, its model type as the builders know it, and as the config writes it."""
    text = config.get("text_config", config)
    if not isinstance(text, Mapping):
        raise CatalogueError("text_config must be a JSON object")
    model_type = text.get("model_type", config.get("model_type"))
    if not isinstance(model_type, str):
        raise CatalogueError("config is missing 'model_type'")
    return text, _MODEL_TYPE_ALIASES.get(model_type, model_type), model_type


def _text_config(config: Config) -> tuple[Config, str]:
    text, model_type, _ = _config_types(config)
    return text, model_type


_KIND_HINTS = (
    ("layer_types", "the layer types listed in 'layer_types'"),
    ("sliding_window", "sliding-window attention ('sliding_window')"),
    ("attention_chunk_size", "chunked local attention ('attention_chunk_size')"),
    ("kv_lora_rank", "MLA ('kv_lora_rank')"),
    ("mamba_d_state", "Mamba ('mamba_d_state')"),
    ("ssm_state_size", "Mamba ('ssm_state_size')"),
    ("state_size", "a recurrent state ('state_size')"),
    ("linear_num_value_heads", "linear attention ('linear_num_value_heads')"),
    ("num_kv_shared_layers", "KV sharing ('num_kv_shared_layers')"),
    ("num_attention_heads", "attention ('num_attention_heads')"),
)


def _unsupported(text: Config, model_type: str) -> str:
    """Say which layer kinds an unknown model would need, from what its config mentions."""
    mentioned = []
    for key, description in _KIND_HINTS:
        if text.get(key) is None:
            continue
        if key == "layer_types" and isinstance(text[key], list):
            kinds = sorted({str(v) for v in text[key]})
            description = f"layer types {', '.join(kinds)} ('layer_types')"
        mentioned.append(description)
    needs = (
        f"its config mentions {'; '.join(mentioned)}"
        if mentioned
        else "its config names no attention or state layers hybrid-kv recognises"
    )
    return (
        f"unsupported model_type {model_type!r}: {needs}. A builder must map each layer to "
        "full, sliding-window, chunked-local, MLA, Mamba or KV-sharing specs "
        f"(supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}); or build the "
        "{layer: spec} mapping yourself and call plan_kv_cache"
    )


# vLLM 0.33 serves these model types (the config's own `model_type`) in bfloat16 when their
# checkpoint is float16, for numerical stability (its _FLOAT16_NOT_SUPPORTED_MODELS).
_NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text"})


def _model_dtype(config: Config, text: Config) -> str:
    """The dtype vLLM 0.33 serves the checkpoint in (`--dtype auto`): the config's `dtype`
    (transformers' name, ahead of the older `torch_dtype`), else its text config's; 16-bit
    as written, anything else bf16; float16 is bf16 for the model types in `_NO_FLOAT16`."""
    raw = next(
        (
            scope[key]
            for scope in (config, text)
            for key in ("dtype", "torch_dtype")
            if scope.get(key) is not None
        ),
        "bfloat16",
    )
    try:
        dtype = canonical_dtype(str(raw))
    except SpecError:
        return "bf16"
    if dtype == "fp16" and config.get("model_type") in _NO_FLOAT16:
        return "bf16"
    return dtype if dtype in ("bf16", "fp16") else "bf16"


def _require(text: Config, key: str, model_type: str) -> Any:
    if key not in text or text[key] is None:
        raise CatalogueError(f"{model_type} config is missing {key!r}")
    return text[key]


# Upper bounds on config fields that set how much is built per layer (the largest released
# models have a few hundred layers), so a corrupt config is refused rather than planned for hours.
_MAXIMA = {"num_hidden_layers": 10_000}


def _int(text: Config, key: str, model_type: str, value: Any = None) -> int:
    value = _require(text, key, model_type) if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CatalogueError(f"{model_type} config: {key!r} must be a positive int, got {value!r}")
    maximum = _MAXIMA.get(key)
    if maximum is not None and value > maximum:
        raise CatalogueError(f"{model_type} config: {key!r} is {value:,}, more than {maximum:,}")
    return value


def _get_int(ctx: _Context, key: str, default: int | None = None) -> int:
    """`key` of the text config; left out, transformers' default for the class, else
    `default`."""
    value = ctx.text.get(key, ctx.defaults.get(key, default))
    if value is None:
        raise CatalogueError(f"{ctx.model_type} config is missing {key!r}")
    return _int(ctx.text, key, ctx.model_type, value)


def _attention_dims(ctx: _Context) -> tuple[int, int, int]:
    """`(num_attention_heads, num_key_value_heads, head_dim)` of the whole model, as vLLM reads
    them (transformers' defaults for omitted fields). Refuses KV heads vLLM cannot load: GQA
    needs the KV heads to divide the heads, and tensor parallelism shards the KV heads
    (`kv % tp == 0`) or replicates them (`tp % kv == 0`)."""
    text, model_type, tp = ctx.text, ctx.model_type, ctx.tp
    for key, model_types in _NOT_NULL.items():
        if key in text and text[key] is None and ctx.source_type in model_types:
            raise CatalogueError(
                f"{model_type} config: {key!r} is null, and transformers' {ctx.source_type} "
                "config (through which vLLM 0.33 reads it) needs an int: vLLM cannot load it"
            )
    heads = _int(text, "num_attention_heads", model_type, ctx.lookup("num_attention_heads"))
    kv_value = ctx.lookup("num_key_value_heads")
    kv_heads = (
        heads if kv_value is None else _int(text, "num_key_value_heads", model_type, kv_value)
    )
    head_dim = ctx.lookup("head_dim")
    if head_dim is None:
        hidden = _get_int(ctx, "hidden_size")
        if hidden < heads:
            raise CatalogueError(
                f"{model_type} config has no 'head_dim', and the head_dim derived in its "
                f"place, hidden_size ({hidden}) // num_attention_heads ({heads}), is 0: "
                "give 'head_dim'"
            )
        head_dim = hidden // heads
    head_dim = _int(text, "head_dim", model_type, head_dim)

    def shown(key: str, value: int) -> str:
        return f"{value}, transformers' default" if key not in text else str(value)

    kv_shown = shown("num_key_value_heads", kv_heads) if kv_value is not None else str(kv_heads)
    heads_shown = shown("num_attention_heads", heads)
    if kv_heads > heads:
        raise CatalogueError(
            f"{model_type} config: num_key_value_heads ({kv_shown}) is more than "
            f"num_attention_heads ({heads_shown}); vLLM cannot load it"
        )
    if heads % kv_heads:
        raise CatalogueError(
            f"{model_type} config: num_key_value_heads ({kv_shown}) must divide "
            f"num_attention_heads ({heads_shown}) (grouped-query attention), as vLLM requires"
        )
    if kv_heads % tp and tp % kv_heads:
        raise CatalogueError(
            f"{model_type} config: num_key_value_heads ({kv_shown}) must be divisible by "
            f"tensor_parallel_size ({tp}), or divide it (each rank then holds a replica), "
            "as vLLM requires"
        )
    return heads, kv_heads, head_dim


def _attention_shape(ctx: _Context) -> tuple[int, int, int]:
    """`(layers, KV heads of one rank, head_dim)`."""
    layers = _int(ctx.text, "num_hidden_layers", ctx.model_type)
    _, kv_heads, head_dim = _attention_dims(ctx)
    return layers, ctx.kv_heads(kv_heads), head_dim


def _name(index: int) -> str:
    return f"model.layers.{index}"


def _attention(
    ctx: _Context, kind: str, kv_heads: int, head_dim: int, window: int | None, chunk: int | None
) -> LayerSpec:
    if kind == "full":
        return FullAttentionSpec(num_kv_heads=kv_heads, head_size=head_dim, dtype=ctx.dtype)
    if kind == "sliding_window" and window is not None:
        return SlidingWindowSpec(
            num_kv_heads=kv_heads, head_size=head_dim, dtype=ctx.dtype, sliding_window=window
        )
    if kind != "chunked_local" or chunk is None:
        raise CatalogueError(f"{ctx.model_type} config: no {kind} attention in {ctx.model_type}")
    return ChunkedLocalAttentionSpec(
        num_kv_heads=kv_heads, head_size=head_dim, dtype=ctx.dtype, attention_chunk_size=chunk
    )


def _build(
    ctx: _Context,
    kinds: list[str],
    kv_heads: int,
    head_dim: int,
    *,
    window: int | None = None,
    chunk: int | None = None,
    mamba: MambaSpec | None = None,
) -> dict[str, LayerSpec]:
    layers: dict[str, LayerSpec] = {}
    for index, kind in enumerate(kinds):
        name = _name(index)
        with layer_context(name):
            if kind == "mamba":
                if mamba is None:
                    raise CatalogueError(
                        f"{ctx.model_type} config: {ctx.model_type} has no Mamba layers"
                    )
                layers[name] = mamba
            elif kind != "none":
                layers[name] = _attention(ctx, kind, kv_heads, head_dim, window, chunk)
    return layers


_LAYER_TYPES = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding_window",
    "chunked_attention": "chunked_local",
    "linear_attention": "mamba",
    "mamba": "mamba",
}


_ATTENTION_KINDS = frozenset({"full", "sliding_window"})
_LINEAR_KINDS = frozenset({"full", "mamba"})


def _kinds_from_layer_types(
    ctx: _Context, num_layers: int, allowed: frozenset[str]
) -> list[str] | None:
    """Layer kinds from `layer_types`, each one of the `allowed` kinds of the model type."""
    layer_types = ctx.text.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise CatalogueError(
            f"{ctx.model_type} config: 'layer_types' must list {num_layers} entries"
        )
    names = [name for name, kind in _LAYER_TYPES.items() if kind in allowed]
    kinds = []
    for index, value in enumerate(layer_types):
        if not isinstance(value, str):
            raise CatalogueError(
                f"{ctx.model_type} config: layer_types[{index}] must be a string, got {value!r}"
            )
        kind = _LAYER_TYPES.get(value)
        if kind is None:
            raise CatalogueError(
                f"{ctx.model_type} config: unknown layer type {value!r} at layer_types[{index}]"
                f" (a {ctx.model_type} layer is one of {', '.join(names)})"
            )
        if kind not in allowed:
            raise CatalogueError(
                f"{ctx.model_type} config: layer_types[{index}] is {value!r}, but "
                f"{ctx.model_type} has no such layers (a {ctx.model_type} layer is one of "
                f"{', '.join(names)})"
            )
        kinds.append(kind)
    return kinds


def _window(ctx: _Context, kinds: list[str]) -> int | None:
    if "sliding_window" not in kinds or _window_disabled(ctx):
        return None
    return _int(ctx.text, "sliding_window", ctx.model_type, ctx.lookup("sliding_window"))


def _window_disabled(ctx: _Context) -> bool:
    """Whether the config writes `sliding_window` as null or 0 (or leaves it out where
    transformers' class has no window by default): vLLM 0.33 reads 0 as no window (its
    ModelConfig: "some checkpoints set sliding_window to 0 to indicate that sliding window is
    disabled"), and a layer with no window attends to every token."""
    value = ctx.lookup("sliding_window")
    return value is None or (type(value) is int and value == 0)


def _require_window(ctx: _Context, kinds: list[str], why: str) -> None:
    """Refuses a config with sliding layers whose window is disabled (`_window_disabled`) for a
    model vLLM 0.33 cannot load so; `why` ends the message ("vLLM 0.33 {why}")."""
    if "sliding_window" in kinds and _window_disabled(ctx):
        raise CatalogueError(
            f"{ctx.model_type} config: 'sliding_window' is {ctx.lookup('sliding_window')!r}, "
            f"and vLLM 0.33 {why}"
        )


def _windowed(ctx: _Context, kinds: list[str]) -> tuple[list[str], int | None]:
    """`kinds` and the window of their sliding layers; with the window disabled (`_window`),
    sliding layers are full, as vLLM 0.33 runs them."""
    window = _window(ctx, kinds)
    if window is None:
        kinds = ["full" if kind == "sliding_window" else kind for kind in kinds]
    return kinds, window


# --------------------------------------------------------------------------- builders


def _sliding_pattern(
    pattern_default: int, window_extra: int = 0, *, pattern_key: str | None = None
) -> Callable[[_Context], dict[str, LayerSpec]]:
    """Gemma-2/3, Cohere2: `layer_types`, else every `pattern`-th layer is full: the config's
    `pattern_key` where transformers' class reads one (Gemma-3, Cohere2), else
    `pattern_default` (Gemma-2 alternates whatever the config says). A sliding layer's window
    is the config's plus `window_extra` (Cohere2: vLLM 0.33's attention sees
    `sliding_window + 1` tokens, and its KV cache spec says so)."""

    def build(ctx: _Context) -> dict[str, LayerSpec]:
        num_layers, kv_heads, head_dim = _attention_shape(ctx)
        kinds = _kinds_from_layer_types(ctx, num_layers, _ATTENTION_KINDS)
        if kinds is None:
            pattern = pattern_default
            if pattern_key is not None:
                pattern = _get_int(ctx, pattern_key, pattern_default)
            kinds = [
                "full" if (i + 1) % pattern == 0 else "sliding_window" for i in range(num_layers)
            ]
        if window_extra:
            # vLLM 0.33's Cohere2 attention adds to the window: it cannot load a config without.
            _require_window(ctx, kinds, "needs a window for its sliding layers")
        kinds, window = _windowed(ctx, kinds)
        if window is not None:
            window += window_extra
        return _build(ctx, kinds, kv_heads, head_dim, window=window)

    return build


def _gpt_oss(ctx: _Context) -> dict[str, LayerSpec]:
    """gpt-oss: even layers slide, odd layers are full, as vLLM 0.33's attention decides by
    the layer's index. Its checkpoints' `layer_types` say the same; vLLM does not read them, so
    a config whose `layer_types` say otherwise is planned as vLLM runs it (they are still
    checked: a layer kind gpt-oss has not is refused)."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    _kinds_from_layer_types(ctx, num_layers, _ATTENTION_KINDS)
    kinds = ["sliding_window" if i % 2 == 0 else "full" for i in range(num_layers)]
    kinds, window = _windowed(ctx, kinds)
    return _build(ctx, kinds, kv_heads, head_dim, window=window)


def _gemma3n(ctx: _Context) -> dict[str, LayerSpec]:
    """Gemma-3n: the last `num_kv_shared_layers` layers share the KV cache of a layer before
    them, chosen by position as vLLM 0.33's Gemma-3n attention does: a sliding shared layer
    takes layer `first_shared - 2`, a full one `first_shared - 1`, whatever kind that layer is
    (in released checkpoints the last sliding and the last full layer before the shared ones).
    A shared layer whose target would be before layer 0 keeps a cache of its own. A config
    that leaves `num_kv_shared_layers` out shares 15 layers (transformers' default)."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    kinds = _kinds_from_layer_types(ctx, num_layers, _ATTENTION_KINDS)
    if kinds is None:
        kinds = ["full" if (i + 1) % 5 == 0 else "sliding_window" for i in range(num_layers)]
    # vLLM 0.33 reads a window of 0 as none and writes null into transformers'
    # Gemma3nTextConfig, whose sliding_window must be an int: the model does not load.
    _require_window(ctx, kinds, "cannot load Gemma-3n without a window for its sliding layers")
    window = _window(ctx, kinds)
    layers = _build(ctx, kinds, kv_heads, head_dim, window=window)
    num_shared = ctx.lookup("num_kv_shared_layers")  # transformers' default: 15
    if num_shared != 0:
        num_shared = _int(ctx.text, "num_kv_shared_layers", ctx.model_type, num_shared)
        first_shared = num_layers - num_shared
        for index in range(max(first_shared, 0), num_layers):
            target = first_shared - (2 if kinds[index] == "sliding_window" else 1)
            if target >= 0:
                layers[_name(index)] = KVSharingSpec(_name(target))
    return layers


def _mistral(ctx: _Context) -> dict[str, LayerSpec]:
    """Mistral, Ministral, Mixtral, Phi-3/4: `layer_types`, a per-layer window pattern, or
    one window on every layer (none: full attention)."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    kinds = _kinds_from_layer_types(ctx, num_layers, _ATTENTION_KINDS)
    window = ctx.lookup("sliding_window")
    if kinds is not None and ctx.source_type == "mixtral" and len(set(kinds)) > 1:
        # vLLM 0.33's Mixtral attention takes no per-layer window, only the model-wide one,
        # which vLLM sets only when every layer slides: mixed layer_types run full.
        kinds = ["full"] * num_layers
    if kinds is not None:
        kinds, size = _windowed(ctx, kinds)
        return _build(ctx, kinds, kv_heads, head_dim, window=size)
    if isinstance(window, list):  # params.json-style per-layer pattern, repeated
        if not window:
            raise CatalogueError(f"{ctx.model_type} config: empty 'sliding_window' pattern")
        layers: dict[str, LayerSpec] = {}
        for index in range(num_layers):
            size = window[index % len(window)]
            with layer_context(_name(index)):
                if size is None:
                    layers[_name(index)] = _attention(ctx, "full", kv_heads, head_dim, None, None)
                else:
                    size = _int(ctx.text, "sliding_window", ctx.model_type, size)
                    layers[_name(index)] = _attention(
                        ctx, "sliding_window", kv_heads, head_dim, size, None
                    )
        return layers
    kind = "full" if window is None or _window_disabled(ctx) else "sliding_window"
    size = None if kind == "full" else _int(ctx.text, "sliding_window", ctx.model_type, window)
    return _build(ctx, [kind] * num_layers, kv_heads, head_dim, window=size)


def _qwen2(ctx: _Context) -> dict[str, LayerSpec]:
    """Qwen2/2.5/3 (dense and MoE), as vLLM 0.33 runs them. Their attention takes no per-layer
    window: every layer slides by the model-wide window, which vLLM sets only when the
    transformers config's `layer_types` are absent or all sliding, and only with
    `use_sliding_window` (transformers drops the window otherwise). `layer_types` are the
    config's, or transformers' for the class: Qwen2/Qwen3 slide from `max_window_layers` on,
    Qwen2-MoE every other layer below it, Qwen3-MoE has none. Mixed `layer_types` run full,
    except that vLLM's Qwen2/Qwen3 model refuses them unless `max_window_layers` is
    `num_hidden_layers`."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    given = _kinds_from_layer_types(ctx, num_layers, _ATTENTION_KINDS)
    window = ctx.lookup("sliding_window") if ctx.text.get("use_sliding_window") else None
    if window is not None and not _window_disabled(ctx):
        window = _int(ctx.text, "sliding_window", ctx.model_type, window)
    else:
        window = None
    if window is None and given is None:
        # No window, so transformers' layer_types are all full: max_window_layers is not read.
        return _build(ctx, ["full"] * num_layers, kv_heads, head_dim)
    first = ctx.text.get("max_window_layers", 28)  # transformers' default
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise CatalogueError(
            f"{ctx.model_type} config: 'max_window_layers' must be an int >= 0, got {first!r}"
        )
    kinds: list[str] | None = given
    if kinds is None and ctx.source_type == "qwen2_moe":
        sliding = bool(ctx.text.get("use_sliding_window"))
        kinds = [
            "sliding_window" if (i + 1) % 2 and i < first and sliding else "full"
            for i in range(num_layers)
        ]
    elif kinds is None and ctx.source_type != "qwen3_moe":
        kinds = [
            "sliding_window" if window is not None and i >= first else "full"
            for i in range(num_layers)
        ]
    mixed = kinds is not None and len(set(kinds)) > 1
    if mixed and ctx.source_type in ("qwen2", "qwen3") and first != num_layers:
        raise CatalogueError(
            f"{ctx.source_type} config: sliding window on some layers but not all "
            f"(max_window_layers {first} < num_hidden_layers {num_layers}), which vLLM 0.33's "
            f"{ctx.source_type} model refuses"
        )
    if window is None or (kinds is not None and set(kinds) != {"sliding_window"}):
        return _build(ctx, ["full"] * num_layers, kv_heads, head_dim)
    return _build(ctx, ["sliding_window"] * num_layers, kv_heads, head_dim, window=window)


def _llama(ctx: _Context) -> dict[str, LayerSpec]:
    """Llama, Granite: full attention, unless the config adds a `sliding_window` (and
    `layer_types`), which vLLM 0.33's Llama and Granite models read as Mistral's are read."""
    return _mistral(ctx)


def _llama4(ctx: _Context) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    chunk = ctx.lookup("attention_chunk_size")
    no_rope = ctx.text.get("no_rope_layers") or None
    if no_rope is None:
        interval = _get_int(ctx, "no_rope_layer_interval", 4)
        no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(no_rope, list) or len(no_rope) != num_layers:
        raise CatalogueError(
            f"{ctx.model_type} config: 'no_rope_layers' must list {num_layers} flags"
        )
    if chunk is None or (type(chunk) is int and chunk == 0):
        # vLLM 0.33 chunks only with a chunk size (0 is none): every layer attends globally.
        return _build(ctx, ["full"] * num_layers, kv_heads, head_dim)
    chunk = _int(ctx.text, "attention_chunk_size", ctx.model_type, chunk)
    # RoPE layers (flag 1) use chunked local attention; NoPE layers attend globally.
    kinds = ["chunked_local" if flag else "full" for flag in no_rope]
    return _build(ctx, kinds, kv_heads, head_dim, chunk=chunk)


def _deepseek(ctx: _Context) -> dict[str, LayerSpec]:
    """DeepSeek-V2/V3, Kimi-K2: MLA, one latent vector of `kv_lora_rank + qk_rope_head_dim`
    per token (not split over TP ranks)."""
    num_layers = _get_int(ctx, "num_hidden_layers")
    latent = _get_int(ctx, "kv_lora_rank") + _get_int(ctx, "qk_rope_head_dim")
    layers: dict[str, LayerSpec] = {}
    for index in range(num_layers):
        with layer_context(_name(index)):
            layers[_name(index)] = MLAAttentionSpec(head_size=latent, dtype=ctx.dtype)
    return layers


def _jamba(ctx: _Context) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    period = _get_int(ctx, "attn_layer_period")
    offset = ctx.lookup("attn_layer_offset")
    if not isinstance(offset, int) or offset < 0:
        raise CatalogueError(f"{ctx.model_type} config is missing 'attn_layer_offset'")
    if offset >= period:
        # transformers' JambaConfig refuses it, so vLLM 0.33 cannot load it.
        raise CatalogueError(
            f"{ctx.model_type} config: attn_layer_offset ({offset}) must be smaller than "
            f"attn_layer_period ({period}), as transformers' JambaConfig requires"
        )
    hidden = _get_int(ctx, "hidden_size")
    mamba = MambaSpec.mamba1(
        intermediate_size=_get_int(ctx, "mamba_expand") * hidden,
        state_size=_get_int(ctx, "mamba_d_state"),
        conv_kernel=_get_int(ctx, "mamba_d_conv"),
        dtype=ctx.model_dtype,
        tensor_parallel_size=ctx.tp,
    )
    kinds = ["full" if i % period == offset else "mamba" for i in range(num_layers)]
    return _build(ctx, kinds, kv_heads, head_dim, mamba=mamba)


def _mamba2_widths(ctx: _Context, prefix: str = "mamba_") -> tuple[int, int, int]:
    """`(intermediate size, heads, head dim)` of a Mamba-2 mixer from `mamba_*` fields: the
    intermediate size is `d_ssm`, else `expand * hidden_size`; the head dim is `d_head`, else
    the intermediate size over the heads (transformers' "auto")."""
    num_heads = _get_int(ctx, f"{prefix}n_heads")
    if ctx.text.get(f"{prefix}d_ssm") is not None:
        intermediate = _get_int(ctx, f"{prefix}d_ssm")
    else:
        intermediate = _get_int(ctx, f"{prefix}expand") * _get_int(ctx, "hidden_size")
    head = ctx.text.get(f"{prefix}d_head")
    if head is None or head == "auto":
        head = intermediate // num_heads
    return intermediate, num_heads, _int(ctx.text, f"{prefix}d_head", ctx.model_type, head)


def _mamba2(ctx: _Context, *, prefix: str = "mamba_") -> MambaSpec:
    """A Mamba-2 state from `mamba_*` fields (Bamba, Granite-4.0-H, Falcon-H1)."""
    intermediate, num_heads, head = _mamba2_widths(ctx, prefix)
    return MambaSpec.mamba2(
        intermediate_size=intermediate,
        n_groups=_get_int(ctx, f"{prefix}n_groups", 1),
        num_heads=num_heads,
        head_dim=head,
        state_size=_get_int(ctx, f"{prefix}d_state"),
        conv_kernel=_get_int(ctx, f"{prefix}d_conv"),
        dtype=ctx.model_dtype,
        tensor_parallel_size=ctx.tp,
    )


def _bamba(ctx: _Context) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    indices = _require(ctx.text, "attn_layer_indices", ctx.model_type)
    if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
        raise CatalogueError(
            f"{ctx.model_type} config: 'attn_layer_indices' must be a list of ints"
        )
    kinds = ["full" if i in indices else "mamba" for i in range(num_layers)]
    return _build(ctx, kinds, kv_heads, head_dim, mamba=_mamba2(ctx))


def _granite_hybrid(ctx: _Context) -> dict[str, LayerSpec]:
    """Granite-4.0-H: `layer_types` of "mamba" and "attention"."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    kinds = _kinds_from_layer_types(ctx, num_layers, _LINEAR_KINDS)
    if kinds is None:
        raise CatalogueError(f"{ctx.model_type} config is missing 'layer_types'")
    return _build(ctx, kinds, kv_heads, head_dim, mamba=_mamba2(ctx))


def _falcon_h1(ctx: _Context) -> dict[str, LayerSpec]:
    """Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    mamba = _mamba2(ctx)
    layers: dict[str, LayerSpec] = {}
    for index in range(num_layers):
        with layer_context(_name(index)):
            layers[f"{_name(index)}.self_attn"] = _attention(
                ctx, "full", kv_heads, head_dim, None, None
            )
            layers[f"{_name(index)}.mamba"] = mamba
    return layers


def _nemotron_h(ctx: _Context) -> dict[str, LayerSpec]:
    """Nemotron-H: `hybrid_override_pattern`, one character per layer: `M` Mamba-2, `*`
    attention, `-` MLP and `E` MoE (no cache). The SSM state is float32 by default."""
    pattern = _require(ctx.text, "hybrid_override_pattern", ctx.model_type)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set("M*-E"):
        raise CatalogueError(
            f"{ctx.model_type} config: 'hybrid_override_pattern' must use M, *, - and E"
        )
    kv_heads = head_dim = 0
    if "*" in pattern:  # the attention fields matter only with attention layers
        _, kv_heads, head_dim = _attention_dims(ctx)
        kv_heads = ctx.kv_heads(kv_heads)
    num_heads = _get_int(ctx, "mamba_num_heads")
    mamba = MambaSpec.mamba2(
        intermediate_size=num_heads * _get_int(ctx, "mamba_head_dim"),
        n_groups=_get_int(ctx, "n_groups", 1),
        num_heads=num_heads,
        head_dim=_get_int(ctx, "mamba_head_dim"),
        state_size=_get_int(ctx, "ssm_state_size"),
        conv_kernel=_get_int(ctx, "conv_kernel"),
        dtype=ctx.model_dtype,
        ssm_dtype=_nemotron_h_ssm_dtype(ctx),
        tensor_parallel_size=ctx.tp,
    )
    kinds = {"M": "mamba", "*": "full", "-": "none", "E": "none"}
    return _build(ctx, [kinds[c] for c in pattern], kv_heads, head_dim, mamba=mamba)


# The config's `mamba_ssm_cache_dtype` values vLLM 0.33 reads as a state dtype (its
# STR_DTYPE_TO_TORCH_DTYPE names; the fp8 ones are stored as bytes).
_MAMBA_SSM_DTYPES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}


def _nemotron_h_ssm_dtype(ctx: _Context) -> str:
    """The SSM state's dtype: vLLM 0.33 keeps Nemotron-H's in the config's
    `mamba_ssm_cache_dtype`, float32 when the config has none (its NemotronH config hook, for
    accuracy), not in the checkpoint dtype as other Mamba models; `auto` is the conv state's."""
    value = ctx.text.get("mamba_ssm_cache_dtype", "float32")
    if value == "auto":
        return ctx.model_dtype
    if not isinstance(value, str) or value not in _MAMBA_SSM_DTYPES:
        raise CatalogueError(
            f"{ctx.model_type} config: 'mamba_ssm_cache_dtype' must be one of auto, "
            f"{', '.join(_MAMBA_SSM_DTYPES)}; got {value!r}"
        )
    return _MAMBA_SSM_DTYPES[value]


def _qwen3_next(ctx: _Context) -> dict[str, LayerSpec]:
    """Qwen3-Next: gated DeltaNet linear attention, full attention every
    `full_attention_interval`-th layer (or as `layer_types` lists)."""
    num_layers, kv_heads, head_dim = _attention_shape(ctx)
    kinds = _kinds_from_layer_types(ctx, num_layers, _LINEAR_KINDS)
    if kinds is None:
        interval = _get_int(ctx, "full_attention_interval", 4)
        kinds = ["full" if (i + 1) % interval == 0 else "mamba" for i in range(num_layers)]
    gdn = MambaSpec.gated_delta_net(
        num_k_heads=_get_int(ctx, "linear_num_key_heads"),
        num_v_heads=_get_int(ctx, "linear_num_value_heads"),
        head_k_dim=_get_int(ctx, "linear_key_head_dim"),
        head_v_dim=_get_int(ctx, "linear_value_head_dim"),
        conv_kernel=_get_int(ctx, "linear_conv_kernel_dim"),
        dtype=ctx.model_dtype,
        tensor_parallel_size=ctx.tp,
    )
    return _build(ctx, kinds, kv_heads, head_dim, mamba=gdn)


_BUILDERS: dict[str, Callable[[_Context], dict[str, LayerSpec]]] = {
    "gemma2": _sliding_pattern(2),
    "gemma3": _sliding_pattern(6, pattern_key="sliding_window_pattern"),
    "cohere2": _sliding_pattern(4, window_extra=1, pattern_key="sliding_window_pattern"),
    "gpt_oss": _gpt_oss,
    "gemma3n": _gemma3n,
    "mistral": _mistral,
    "phi3": _mistral,
    "qwen2": _qwen2,
    "llama": _llama,
    "llama4": _llama4,
    "deepseek_v2": _deepseek,
    "jamba": _jamba,
    "bamba": _bamba,
    "granitemoehybrid": _granite_hybrid,
    "falcon_h1": _falcon_h1,
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen3_next,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(set(_BUILDERS) | set(_MODEL_TYPE_ALIASES)))


# --------------------------------------------------------------------------- weights

_TIED_BY_DEFAULT = {"gemma2", "gemma3", "gemma3n", "cohere2"}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_QUANTIZED_BITS = {"fp8": 8, "mxfp4": 4.25, "awq": 4, "gptq": 4, "compressed-tensors": 8}
# AWQ and GPTQ pack 2, 3, 4 or 8 bits; more than 16 is no quantization.
_MAX_QUANTIZED_BITS = 16


def _weights_context(config: Config) -> _Context:
    text, model_type, source_type = _config_types(config)
    if model_type not in _BUILDERS:
        raise CatalogueError(_unsupported(text, model_type))
    return _Context(
        text, model_type, "bf16", "bf16", 1, _TRANSFORMERS_DEFAULTS.get(source_type, {})
    )


def _embedding_parts(ctx: _Context, config: Config) -> tuple[int, int]:
    """`(input embedding parameters, LM head parameters)`: the head is 0 when tied."""
    hidden = _get_int(ctx, "hidden_size")
    vocab = _int(ctx.text, "vocab_size", ctx.model_type, ctx.lookup("vocab_size"))
    tied = ctx.text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    if tied is None:
        tied = ctx.model_type in _TIED_BY_DEFAULT
    return vocab * hidden, 0 if tied else vocab * hidden


def _embedding_parameters(ctx: _Context, config: Config) -> int:
    return sum(_embedding_parts(ctx, config))


def _layer_parameters(ctx: _Context, config: Config) -> list[tuple[int, int]]:
    """Per decoder layer: `(parameters outside the routed experts, routed-expert parameters)`
    of its mixers and MLP."""
    hidden = _get_int(ctx, "hidden_size")
    result = []
    mixers, mlps = _layer_plan(ctx, config)
    for index, (mixer, mlp) in enumerate(zip(mixers, mlps, strict=True)):
        dense = sum(_mixer_parameters(ctx, kind, hidden) for kind in mixer)
        experts = 0
        if mlp == "dense":
            dense += _dense_mlp(ctx, hidden, index)
        elif mlp == "moe":
            routed, other = _moe_parameters(ctx, hidden)
            experts += routed
            dense += other
        result.append((dense, experts))
    return result


def estimate_parameters(config: Config) -> tuple[int, int]:
    """`(parameters outside the routed experts, routed-expert parameters)` of a text model,
    counted from its config: embeddings (and the LM head unless tied), each layer's mixer
    (attention, MLA, Mamba-1/2, gated DeltaNet) and MLP (gated, or routed experts with their
    shared experts and router). Norms and biases are left out (well under 0.1%).

    Raises `CatalogueError` naming a field the count needs and the config lacks or holds
    a value of the wrong type.
    """
    if not isinstance(config, Mapping):
        raise CatalogueError(f"a config must be a JSON object, got {type(config).__name__}")
    ctx = _weights_context(config)
    dense = _embedding_parameters(ctx, config)
    experts = 0
    for layer_dense, layer_experts in _layer_parameters(ctx, config):
        dense += layer_dense
        experts += layer_experts
    return dense, experts


def _quantized_bits(ctx: _Context, config: Config) -> tuple[float, float, str | None]:
    """`(bits of layer weights, bits of routed-expert weights, what was not understood)` from
    `quantization_config`: a config whose quantization is not understood is counted at 16 bits,
    and the third item says why (None when there is none or it is understood)."""
    quant = config.get("quantization_config") or ctx.text.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        return 16, 16, f"quantization_config {quant!r} is not a mapping"
    method = str(quant.get("quant_method", "")).lower()
    if method == "mxfp4":
        return 16, _QUANTIZED_BITS["mxfp4"], None
    if method in ("awq", "gptq") and quant.get("bits") is not None:
        bits = quant["bits"]
        if (
            isinstance(bits, bool)
            or not isinstance(bits, int)
            or not 0 < bits <= _MAX_QUANTIZED_BITS
        ):
            raise CatalogueError(
                f"{ctx.model_type} config: quantization_config 'bits' must be an int in "
                f"1..{_MAX_QUANTIZED_BITS}, got {bits!r}"
            )
        return bits, bits, None
    if method in _QUANTIZED_BITS:
        return _QUANTIZED_BITS[method], _QUANTIZED_BITS[method], None
    if not quant:
        return 16, 16, None
    return 16, 16, f"quantization method {method or '(none)'!r} not known"


def weight_estimate_note(config: Config) -> str | None:
    """Why `estimate_weight_bytes` counts a quantized checkpoint's weights at 16 bits (its
    `quantization_config` is not understood), or None. Raises as `estimate_weight_bytes`."""
    return _quantized_bits(_weights_context(config), config)[2]


def estimate_weight_bytes(config: Config, tensor_parallel_size: int = 1) -> int:
    """Bytes of weights one of `tensor_parallel_size` GPUs holds, estimated from the config:
    `estimate_parameters` at the checkpoint's precision (16-bit; fp32 checkpoints are served
    in bf16; `quantization_config` fp8 / mxfp4 (routed experts) / AWQ / GPTQ bits for layer
    weights), split evenly over the ranks.

    Raises `CatalogueError` when the config cannot be counted (see `estimate_parameters`) or
    its quantization bits are not an int in 1..16.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise CatalogueError(f"tensor_parallel_size must be an int, got {tensor_parallel_size!r}")
    if tensor_parallel_size < 1:
        raise CatalogueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    dense, experts = estimate_parameters(config)
    ctx = _weights_context(config)
    layer_bits, expert_bits, _ = _quantized_bits(ctx, config)
    embeddings = _embedding_parameters(ctx, config)
    # Exact (sizes past a float's range are counted, not an OverflowError).
    bits = (dense - embeddings) * Fraction(layer_bits) + experts * Fraction(expert_bits)
    total = embeddings * 2 + math.floor(bits / 8)
    return -(-total // tensor_parallel_size)


# vLLM 0.33's models that build the input embeddings on the first pipeline stage only and the
# LM head on the last only (`PPMissingLayer` elsewhere), by `model_type` as the config writes
# it; with tied embeddings the last stage builds the embeddings too, which its LM head shares
# (`is_first_rank or (tie_word_embeddings and is_last_rank)`). The others (gemma2, gemma3,
# gemma3n, cohere2, gpt_oss, mixtral, qwen2_moe, qwen3_moe, jamba, granitemoehybrid,
# nemotron_h, qwen3_next; bamba as its successor) build both on every stage.
_FIRST_AND_LAST_STAGE_EMBEDDINGS = frozenset(
    {
        "llama",
        "llama4",
        "llama4_text",
        "granite",
        "mistral",
        "ministral",
        "phi3",
        "phi4",
        "qwen2",
        "qwen3",
        "deepseek_v2",
        "deepseek_v3",
        "kimi_k2",
        "falcon_h1",
    }
)


def estimate_stage_weight_bytes(
    config: Config, layer_counts: Sequence[int], tensor_parallel_size: int = 1
) -> tuple[int, ...]:
    """Bytes of weights one GPU of each pipeline stage holds (one of `tensor_parallel_size`),
    the stages holding `layer_counts` consecutive decoder layers each, as vLLM 0.33 places
    them: every stage its decoder layers; the input embeddings on the first stage and the LM
    head on the last, or both on every stage for the models that build them there (see
    `_FIRST_AND_LAST_STAGE_EMBEDDINGS`); tied embeddings again on the last stage. Counted as
    `estimate_weight_bytes` counts them: the stages' bytes add up to its estimate plus the
    embeddings and heads built on more than one stage (one stage: the same figure).

    Raises `CatalogueError` as `estimate_weight_bytes`, or when `layer_counts` are not ints
    >= 0, one per stage, summing to the model's decoder layers.
    """
    estimate_weight_bytes(config, tensor_parallel_size)  # checks the config and the ranks
    ctx = _weights_context(config)
    if isinstance(layer_counts, (str, bytes)) or not isinstance(layer_counts, Sequence):
        raise CatalogueError(f"layer_counts must be a sequence of ints, got {layer_counts!r}")
    for count in layer_counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CatalogueError(f"layer counts must be ints >= 0, got {count!r}")
    layers = _layer_parameters(ctx, config)
    if not layer_counts or sum(layer_counts) != len(layers):
        raise CatalogueError(
            f"layer counts {list(layer_counts)} must be one per stage and sum to the model's "
            f"{len(layers)} decoder layers"
        )
    layer_bits, expert_bits, _ = _quantized_bits(ctx, config)
    embedding, head = _embedding_parts(ctx, config)
    # Exact byte positions along the model (embeddings, then each layer, the head at the end)
    # as `estimate_weight_bytes` counts them; each stage takes the span between its ends, so
    # the spans add up to the whole model's estimate.
    ends = [Fraction(embedding * 2)]
    for dense, experts in layers:
        ends.append(ends[-1] + (dense * Fraction(layer_bits) + experts * Fraction(expert_bits)) / 8)
    ends[-1] += head * 2
    positions = [Fraction(0)]
    cut = 0
    for count in layer_counts:
        cut += count
        positions.append(ends[cut])

    def per_rank(position: Fraction) -> int:
        return -(-math.floor(position) // tensor_parallel_size)

    stages = [per_rank(b) - per_rank(a) for a, b in itertools.pairwise(positions)]
    embedding_bytes = -(-embedding * 2 // tensor_parallel_size)
    head_bytes = -(-head * 2 // tensor_parallel_size)
    every_stage = _config_types(config)[2] not in _FIRST_AND_LAST_STAGE_EMBEDDINGS
    last = len(stages) - 1
    for index in range(1, len(stages)):
        if every_stage or (index == last and not head):
            stages[index] += embedding_bytes
    if every_stage:
        for index in range(last):
            stages[index] += head_bytes
    return tuple(stages)


def _count(ctx: _Context, key: str) -> int:
    """A non-negative int field that may be left out (0 then)."""
    value = ctx.text.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CatalogueError(
            f"{ctx.model_type} config: {key!r} must be a non-negative int, got {value!r}"
        )
    return value


def _expert_count(ctx: _Context) -> int:
    """Routed experts per MoE layer (0: no MoE layers)."""
    for key in _EXPERT_KEYS:
        if ctx.text.get(key):
            return _get_int(ctx, key)
    return 0


def _layer_plan(ctx: _Context, config: Config) -> tuple[list[tuple[str, ...]], list[str]]:
    """Per layer: its mixers and its MLP kind (`dense`, `moe` or `none`)."""
    text, model_type = ctx.text, ctx.model_type
    if model_type == "nemotron_h":
        layer_specs_from_config(config)  # validates the pattern and the mixer fields
        pattern = text["hybrid_override_pattern"]
        if "E" in pattern and not _expert_count(ctx):
            raise CatalogueError(
                f"{model_type} config: 'hybrid_override_pattern' has MoE layers (E) but the "
                f"config gives no expert count ({', '.join(map(repr, _EXPERT_KEYS))})"
            )
        mixer_of = {"M": ("mamba2",), "*": ("attention",), "-": (), "E": ()}
        mlp_of = {"M": "none", "*": "none", "-": "dense", "E": "moe"}
        return [mixer_of[c] for c in pattern], [mlp_of[c] for c in pattern]
    num_layers = _get_int(ctx, "num_hidden_layers")
    specs = layer_specs_from_config(config)
    mixers: list[tuple[str, ...]] = []
    for index in range(num_layers):
        name = _name(index)
        if model_type == "falcon_h1":
            mixers.append(("attention", "mamba2"))
            continue
        spec = specs.get(name)
        if isinstance(spec, MambaSpec):
            mixers.append(({"mamba1": "mamba1", "gdn": "gdn"}.get(spec.mamba_type, "mamba2"),))
        elif isinstance(spec, MLAAttentionSpec):
            mixers.append(("mla",))
        else:
            mixers.append(("attention",))
    if not _expert_count(ctx):
        return mixers, ["dense"] * num_layers
    return mixers, [_mlp_kind(ctx, i) for i in range(num_layers)]


def _mlp_kind(ctx: _Context, index: int) -> str:
    """`moe` or `dense` for layer `index` of a model with routed experts."""
    text = ctx.text
    if ctx.model_type == "deepseek_v2":
        first_dense = _count(ctx, "first_k_dense_replace")
        frequency = _get_int(ctx, "moe_layer_freq", 1)
        return "moe" if index >= first_dense and index % frequency == 0 else "dense"
    if ctx.model_type == "jamba":
        period = _get_int(ctx, "expert_layer_period", 1)
        offset = _count(ctx, "expert_layer_offset")
        return "moe" if index % period == offset else "dense"
    if ctx.model_type == "llama4":
        step = _get_int(ctx, "interleave_moe_layer_step", 1)
        return "moe" if (index + 1) % step == 0 else "dense"
    if ctx.model_type in ("qwen2", "qwen3_next"):
        dense_layers = text.get("mlp_only_layers") or []
        if not isinstance(dense_layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense_layers
        ):
            raise CatalogueError(
                f"{ctx.model_type} config: 'mlp_only_layers' must be a list of layer indices, "
                f"got {dense_layers!r}"
            )
        if index in dense_layers:
            return "dense"
        step = _get_int(ctx, "decoder_sparse_step", 1)
        return "moe" if (index + 1) % step == 0 else "dense"
    return "moe"


def _mixer_parameters(ctx: _Context, kind: str, hidden: int) -> int:
    if kind == "attention":
        heads, kv_heads, head_dim = _attention_dims(ctx)
        return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    if kind == "mla":
        heads = _int(
            ctx.text, "num_attention_heads", ctx.model_type, ctx.lookup("num_attention_heads")
        )
        rope, nope = _get_int(ctx, "qk_rope_head_dim"), _get_int(ctx, "qk_nope_head_dim")
        value, rank = _get_int(ctx, "v_head_dim"), _get_int(ctx, "kv_lora_rank")
        q_rank = _count(ctx, "q_lora_rank")
        query = (
            hidden * q_rank + q_rank * heads * (nope + rope)
            if q_rank
            else hidden * heads * (nope + rope)
        )
        return (
            query + hidden * (rank + rope) + rank * heads * (nope + value) + heads * value * hidden
        )
    if kind == "mamba1":
        inner = _get_int(ctx, "mamba_expand") * hidden
        state, conv = _get_int(ctx, "mamba_d_state"), _get_int(ctx, "mamba_d_conv")
        rank = _get_int(ctx, "mamba_dt_rank", -(-hidden // 16))
        return (
            hidden * 2 * inner
            + inner * conv
            + inner * (rank + 2 * state)
            + rank * inner
            + inner * state
            + inner
            + inner * hidden
        )
    if kind == "mamba2":
        if ctx.model_type == "nemotron_h":
            heads, head = _get_int(ctx, "mamba_num_heads"), _get_int(ctx, "mamba_head_dim")
            inner, groups = heads * head, _get_int(ctx, "n_groups", 1)
            state, conv = _get_int(ctx, "ssm_state_size"), _get_int(ctx, "conv_kernel")
        else:
            inner, heads, _ = _mamba2_widths(ctx)
            groups = _get_int(ctx, "mamba_n_groups", 1)
            state, conv = _get_int(ctx, "mamba_d_state"), _get_int(ctx, "mamba_d_conv")
        width = inner + 2 * groups * state
        return hidden * (inner + width + heads) + width * conv + inner * hidden + 3 * heads
    if kind != "gdn":
        raise CatalogueError(f"{ctx.model_type} config: no {kind} mixer in {ctx.model_type}")
    k_heads, v_heads = (
        _get_int(ctx, "linear_num_key_heads"),
        _get_int(ctx, "linear_num_value_heads"),
    )
    k_dim, v_dim = _get_int(ctx, "linear_key_head_dim"), _get_int(ctx, "linear_value_head_dim")
    conv = _get_int(ctx, "linear_conv_kernel_dim")
    width = 2 * k_heads * k_dim + v_heads * v_dim
    return (
        hidden * (2 * k_heads * k_dim + 2 * v_heads * v_dim)
        + hidden * 2 * v_heads
        + width * conv
        + v_heads * v_dim * hidden
    )


def _optional_int(ctx: _Context, key: str) -> int | None:
    """A positive int field, or None when the config leaves it out (or writes null or 0)."""
    return _get_int(ctx, key) if ctx.text.get(key) not in (None, 0) else None


def _dense_mlp(ctx: _Context, hidden: int, index: int) -> int:
    size = _optional_int(ctx, "intermediate_size_mlp") if ctx.model_type == "llama4" else None
    size = size or _get_int(ctx, "intermediate_size")
    matrices = 2 if ctx.model_type == "nemotron_h" else 3
    return matrices * hidden * size


def _moe_parameters(ctx: _Context, hidden: int) -> tuple[int, int]:
    """`(routed experts, router + shared experts)` of one MoE layer."""
    count = _expert_count(ctx)
    size = _optional_int(ctx, "moe_intermediate_size") or _get_int(ctx, "intermediate_size")
    routed = count * 3 * hidden * size
    shared = 0
    if num_shared := _count(ctx, "n_shared_experts"):
        shared = num_shared * 3 * hidden * size
    elif shared_size := _optional_int(ctx, "shared_expert_intermediate_size"):
        shared = 3 * hidden * shared_size
    elif shared_size := _optional_int(ctx, "shared_intermediate_size"):
        shared = 3 * hidden * shared_size
    elif ctx.model_type == "llama4":
        shared = 3 * hidden * size
    return routed, shared + hidden * count
