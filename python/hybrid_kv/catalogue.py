"""Layer specs from Hugging Face `config.json` contents (no network), and shipped presets.

Supported `model_type`s: gemma2, gemma3 (+ gemma3_text), gemma3n (+ gemma3n_text), gpt_oss,
llama4 (+ llama4_text), mistral / ministral, cohere2, jamba, bamba, llama. Multimodal configs
are read through their `text_config`. Layers are named `model.layers.{i}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
    SpecError,
    canonical_dtype,
    layer_context,
)

__all__ = [
    "PRESETS_DIR",
    "CatalogueError",
    "ModelSpec",
    "layer_specs_from_config",
    "list_presets",
    "load_config",
    "load_model",
    "max_model_len_from_config",
]

PRESETS_DIR = Path(__file__).with_name("presets")

Config = Mapping[str, Any]


class CatalogueError(ValueError):
    """Unknown model, unreadable config, or a config missing fields."""


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers (in model order) and its longest supported context."""

    name: str
    layers: Mapping[str, LayerSpec]
    max_model_len: int
    model_type: str


def list_presets() -> list[str]:
    """Names of the shipped presets (`hybrid-kv plan NAME`)."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


def load_config(model: str) -> dict[str, Any]:
    """A preset name (see `list_presets`) or a path to a `config.json` (or its directory)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        preset = PRESETS_DIR / f"{model}.json"
        if not preset.is_file():
            raise CatalogueError(
                f"unknown model {model!r}: not a preset ({', '.join(list_presets())}) "
                "and not a path to a config.json"
            )
        path = preset
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise CatalogueError(f"cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise CatalogueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise CatalogueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def load_model(model: str, *, dtype: str | None = None) -> ModelSpec:
    """Load a preset or config file and build its layer specs."""
    config = load_config(model)
    name = Path(model).stem if model.endswith(".json") else Path(model).name
    layers = layer_specs_from_config(config, dtype=dtype)
    return ModelSpec(
        name=name,
        layers=layers,
        max_model_len=max_model_len_from_config(config),
        model_type=_text_config(config)[1],
    )


def max_model_len_from_config(config: Config) -> int:
    """`max_position_embeddings` of the text model (transformers' default when omitted)."""
    text, model_type = _text_config(config)
    default = _DEFAULT_MAX_POSITIONS.get(model_type)
    value = text.get("max_position_embeddings", default)
    if value is None:
        raise CatalogueError(f"{model_type} config is missing 'max_position_embeddings'")
    return _int(text, "max_position_embeddings", model_type, value)


def layer_specs_from_config(config: Config, *, dtype: str | None = None) -> dict[str, LayerSpec]:
    """`{layer_name: spec}` for a Hugging Face config.

    `dtype` is the attention KV-cache dtype; by default the checkpoint's dtype when it is 16-bit,
    else bf16 (fp32 checkpoints are served in bf16). Mamba states use the checkpoint dtype
    rule too, independently of `dtype` (like vLLM's separate Mamba cache dtype).
    """
    text, model_type = _text_config(config)
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise CatalogueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(_BUILDERS))})"
        )
    model_dtype = _model_dtype(config, text)
    kv_dtype = model_dtype if dtype is None else dtype
    try:
        canonical_dtype(kv_dtype)
    except SpecError as error:
        raise CatalogueError(str(error)) from None
    return builder(text, model_type, kv_dtype, model_dtype)


# --------------------------------------------------------------------------- helpers

_DEFAULT_MAX_POSITIONS = {"gemma3": 131072, "gemma3_text": 131072}
_MODEL_TYPE_ALIASES = {
    "gemma3_text": "gemma3",
    "gemma3n_text": "gemma3n",
    "llama4_text": "llama4",
    "ministral": "mistral",
}


def _text_config(config: Config) -> tuple[Config, str]:
    text = config.get("text_config", config)
    if not isinstance(text, Mapping):
        raise CatalogueError("text_config must be a JSON object")
    model_type = text.get("model_type", config.get("model_type"))
    if not isinstance(model_type, str):
        raise CatalogueError("config is missing 'model_type'")
    return text, _MODEL_TYPE_ALIASES.get(model_type, model_type)


def _model_dtype(config: Config, text: Config) -> str:
    raw = text.get("torch_dtype", config.get("torch_dtype", config.get("dtype", "bfloat16")))
    try:
        dtype = canonical_dtype(str(raw))
    except SpecError:
        return "bf16"
    return dtype if dtype in ("bf16", "fp16") else "bf16"


def _require(text: Config, key: str, model_type: str) -> Any:
    if key not in text or text[key] is None:
        raise CatalogueError(f"{model_type} config is missing {key!r}")
    return text[key]


def _int(text: Config, key: str, model_type: str, value: Any = None) -> int:
    value = _require(text, key, model_type) if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CatalogueError(f"{model_type} config: {key!r} must be a positive int, got {value!r}")
    return value


def _attention_shape(text: Config, model_type: str) -> tuple[int, int, int]:
    layers = _int(text, "num_hidden_layers", model_type)
    heads = _int(text, "num_attention_heads", model_type)
    kv_heads = _int(text, "num_key_value_heads", model_type, text.get("num_key_value_heads", heads))
    head_dim = text.get("head_dim")
    if head_dim is None:
        head_dim = _int(text, "hidden_size", model_type) // heads
    return layers, kv_heads, _int(text, "head_dim", model_type, head_dim)


def _name(index: int) -> str:
    return f"model.layers.{index}"


def _build(
    kinds: list[str],
    kv_heads: int,
    head_dim: int,
    dtype: str,
    *,
    window: int | None = None,
    chunk: int | None = None,
    mamba: MambaSpec | None = None,
) -> dict[str, LayerSpec]:
    layers: dict[str, LayerSpec] = {}
    for index, kind in enumerate(kinds):
        name = _name(index)
        with layer_context(name):
            spec: LayerSpec
            if kind == "full":
                spec = FullAttentionSpec(num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype)
            elif kind == "sliding_window":
                assert window is not None
                spec = SlidingWindowSpec(
                    num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype, sliding_window=window
                )
            elif kind == "chunked_local":
                assert chunk is not None
                spec = ChunkedLocalAttentionSpec(
                    num_kv_heads=kv_heads,
                    head_size=head_dim,
                    dtype=dtype,
                    attention_chunk_size=chunk,
                )
            else:
                assert mamba is not None
                spec = mamba
        layers[name] = spec
    return layers


def _kinds_from_layer_types(text: Config, num_layers: int, model_type: str) -> list[str] | None:
    layer_types = text.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise CatalogueError(f"{model_type} config: 'layer_types' must list {num_layers} entries")
    mapping = {
        "full_attention": "full",
        "sliding_attention": "sliding_window",
        "chunked_attention": "chunked_local",
    }
    kinds = []
    for value in layer_types:
        if value not in mapping:
            raise CatalogueError(f"{model_type} config: unknown layer type {value!r}")
        kinds.append(mapping[value])
    return kinds


def _window(text: Config, model_type: str, kinds: list[str]) -> int | None:
    if "sliding_window" not in kinds:
        return None
    return _int(text, "sliding_window", model_type)


# --------------------------------------------------------------------------- builders


def _sliding_pattern(pattern_default: int | None) -> Callable[..., dict[str, LayerSpec]]:
    """Gemma-2/3, Cohere2, gpt-oss: `layer_types`, else every `pattern`-th layer is full."""

    def build(text: Config, model_type: str, dtype: str, _model_dtype: str) -> dict[str, LayerSpec]:
        num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
        kinds = _kinds_from_layer_types(text, num_layers, model_type)
        if kinds is None:
            pattern = text.get("sliding_window_pattern", pattern_default)
            pattern = _int(text, "sliding_window_pattern", model_type, pattern)
            kinds = [
                "full" if (i + 1) % pattern == 0 else "sliding_window" for i in range(num_layers)
            ]
        return _build(kinds, kv_heads, head_dim, dtype, window=_window(text, model_type, kinds))

    return build


def _gemma3n(text: Config, model_type: str, dtype: str, _model_dtype: str) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
    kinds = _kinds_from_layer_types(text, num_layers, model_type)
    if kinds is None:
        kinds = ["full" if (i + 1) % 5 == 0 else "sliding_window" for i in range(num_layers)]
    layers = _build(kinds, kv_heads, head_dim, dtype, window=_window(text, model_type, kinds))
    num_shared = text.get("num_kv_shared_layers", 0)
    if num_shared:
        num_shared = _int(text, "num_kv_shared_layers", model_type, num_shared)
        first_shared = num_layers - num_shared
        if first_shared <= 0:
            raise CatalogueError(f"{model_type} config: every layer is a KV-sharing layer")
        for index in range(first_shared, num_layers):
            # The last non-shared layer of the same attention type owns the cache.
            owners = [i for i in range(first_shared) if kinds[i] == kinds[index]]
            if not owners:
                raise CatalogueError(
                    f"{model_type} config: layer {index} ({kinds[index]}) has no "
                    "non-shared layer of its type to share KV with"
                )
            layers[_name(index)] = KVSharingSpec(_name(owners[-1]))
    return layers


def _mistral(text: Config, model_type: str, dtype: str, _model_dtype: str) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
    kinds = _kinds_from_layer_types(text, num_layers, model_type)
    window = text.get("sliding_window")
    if kinds is not None:
        return _build(kinds, kv_heads, head_dim, dtype, window=_window(text, model_type, kinds))
    if isinstance(window, list):  # params.json-style per-layer pattern, repeated
        if not window:
            raise CatalogueError(f"{model_type} config: empty 'sliding_window' pattern")
        layers: dict[str, LayerSpec] = {}
        for index in range(num_layers):
            size = window[index % len(window)]
            if size is None:
                spec = _build(["full"], kv_heads, head_dim, dtype)
            else:
                size = _int(text, "sliding_window", model_type, size)
                spec = _build(["sliding_window"], kv_heads, head_dim, dtype, window=size)
            layers[_name(index)] = spec[_name(0)]
        return layers
    kind = "full" if window is None else "sliding_window"
    size = None if window is None else _int(text, "sliding_window", model_type)
    return _build([kind] * num_layers, kv_heads, head_dim, dtype, window=size)


def _llama(text: Config, model_type: str, dtype: str, _model_dtype: str) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
    return _build(["full"] * num_layers, kv_heads, head_dim, dtype)


def _llama4(text: Config, model_type: str, dtype: str, _model_dtype: str) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
    chunk = text.get("attention_chunk_size")
    no_rope = text.get("no_rope_layers") or None
    if no_rope is None:
        interval = _int(
            text, "no_rope_layer_interval", model_type, text.get("no_rope_layer_interval", 4)
        )
        no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(no_rope, list) or len(no_rope) != num_layers:
        raise CatalogueError(f"{model_type} config: 'no_rope_layers' must list {num_layers} flags")
    if chunk is None:
        return _build(["full"] * num_layers, kv_heads, head_dim, dtype)
    chunk = _int(text, "attention_chunk_size", model_type)
    # RoPE layers (flag 1) use chunked local attention; NoPE layers attend globally.
    kinds = ["chunked_local" if flag else "full" for flag in no_rope]
    return _build(kinds, kv_heads, head_dim, dtype, chunk=chunk)


def _jamba(text: Config, model_type: str, dtype: str, model_dtype: str) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
    period = _int(text, "attn_layer_period", model_type)
    offset = text.get("attn_layer_offset")
    if not isinstance(offset, int) or offset < 0:
        raise CatalogueError(f"{model_type} config is missing 'attn_layer_offset'")
    hidden = _int(text, "hidden_size", model_type)
    try:
        mamba = MambaSpec.mamba1(
            intermediate_size=_int(text, "mamba_expand", model_type) * hidden,
            state_size=_int(text, "mamba_d_state", model_type),
            conv_kernel=_int(text, "mamba_d_conv", model_type),
            dtype=model_dtype,
        )
    except SpecError as error:
        raise CatalogueError(f"{model_type} config: {error}") from None
    kinds = ["full" if i % period == offset else "mamba" for i in range(num_layers)]
    return _build(kinds, kv_heads, head_dim, dtype, mamba=mamba)


def _bamba(text: Config, model_type: str, dtype: str, model_dtype: str) -> dict[str, LayerSpec]:
    num_layers, kv_heads, head_dim = _attention_shape(text, model_type)
    indices = _require(text, "attn_layer_indices", model_type)
    if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
        raise CatalogueError(f"{model_type} config: 'attn_layer_indices' must be a list of ints")
    hidden = _int(text, "hidden_size", model_type)
    num_heads = _int(text, "mamba_n_heads", model_type)
    intermediate = _int(text, "mamba_expand", model_type) * hidden
    head = text.get("mamba_d_head", intermediate // num_heads)
    try:
        mamba = MambaSpec.mamba2(
            intermediate_size=intermediate,
            n_groups=_int(text, "mamba_n_groups", model_type, text.get("mamba_n_groups", 1)),
            num_heads=num_heads,
            head_dim=_int(text, "mamba_d_head", model_type, head),
            state_size=_int(text, "mamba_d_state", model_type),
            conv_kernel=_int(text, "mamba_d_conv", model_type),
            dtype=model_dtype,
        )
    except SpecError as error:
        raise CatalogueError(f"{model_type} config: {error}") from None
    kinds = ["full" if i in indices else "mamba" for i in range(num_layers)]
    return _build(kinds, kv_heads, head_dim, dtype, mamba=mamba)


_BUILDERS: dict[str, Callable[[Config, str, str, str], dict[str, LayerSpec]]] = {
    "gemma2": _sliding_pattern(2),
    "gemma3": _sliding_pattern(6),
    "cohere2": _sliding_pattern(4),
    "gpt_oss": _sliding_pattern(2),
    "gemma3n": _gemma3n,
    "mistral": _mistral,
    "llama": _llama,
    "llama4": _llama4,
    "jamba": _jamba,
    "bamba": _bamba,
}
