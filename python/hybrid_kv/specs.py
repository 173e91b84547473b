"""Per-layer KV-cache specs: what one layer stores per token (or per request, for Mamba).

Specs are frozen dataclasses and compare field-wise: the planner groups layers whose specs are
equal. A spec does not carry a block size; the planner chooses block sizes (it may grow them for
Mamba hybrids or to unify page sizes) and asks a spec for its page size at a given block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

__all__ = [
    "DTYPE_SIZES",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVSharingSpec",
    "LayerSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "SpecError",
    "canonical_dtype",
    "dtype_size",
    "layer_context",
    "validate_layers",
]


class SpecError(ValueError):
    """An invalid layer spec or an invalid set of layers (names the layer when known)."""


DTYPE_SIZES: Mapping[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

_DTYPE_ALIASES: Mapping[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


def _is_torch_dtype(value: object) -> bool:
    """Whether `value` is a `torch.dtype` (told without importing torch)."""
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def canonical_dtype(name: str) -> str:
    """Canonical dtype name (`fp32`, `bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2`) for an alias or a
    `torch.dtype` (as vLLM's specs hold them)."""
    if _is_torch_dtype(name):
        name = str(name)
    if not isinstance(name, str):
        raise SpecError(f"dtype must be a string, got {name!r}")
    try:
        return _DTYPE_ALIASES[name.strip().lower().removeprefix("torch.")]
    except KeyError:
        known = ", ".join(sorted(_DTYPE_ALIASES))
        raise SpecError(f"unknown dtype {name!r} (known: {known})") from None


def dtype_size(name: str) -> int:
    """Bytes per element of a dtype (any alias accepted)."""
    return DTYPE_SIZES[canonical_dtype(name)]


def _positive_int(owner: str, field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{owner}: {field_name} must be an int, got {value!r}")
    if value <= 0:
        raise SpecError(f"{owner}: {field_name} must be > 0, got {value}")


def _positive_ints(owner: str, **values: object) -> None:
    for name, value in values.items():
        _positive_int(owner, name, value)


def _shard(owner: str, field_name: str, value: int, ranks: int) -> int:
    _positive_int(owner, "tensor_parallel_size", ranks)
    if value % ranks:
        raise SpecError(f"{owner}: {field_name} {value} does not split over {ranks} TP ranks")
    return value // ranks


@dataclass(frozen=True, kw_only=True)
class _AttentionSpec:
    """Fields shared by the attention specs: K and V of `num_kv_heads` heads per token."""

    num_kv_heads: int
    head_size: int
    dtype: str = "bf16"
    head_size_v: int | None = None  # None: same as head_size

    kind: ClassVar[str] = "attention"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _positive_int(owner, "num_kv_heads", self.num_kv_heads)
        _positive_int(owner, "head_size", self.head_size)
        if self.head_size_v is not None:
            _positive_int(owner, "head_size_v", self.head_size_v)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take in one layer (the kv hidden size)."""
        head_v = self.head_size if self.head_size_v is None else self.head_size_v
        return self.num_kv_heads * (self.head_size + head_v) * DTYPE_SIZES[self.dtype]

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block of `block_size` tokens in one layer."""
        _positive_int(type(self).__name__, "block_size", block_size)
        return block_size * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(_AttentionSpec):
    """Full (global) attention: a request holds every token's KV."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(_AttentionSpec):
    """Sliding-window attention: a request holds only the last `sliding_window - 1` tokens."""

    sliding_window: int

    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(type(self).__name__, "sliding_window", self.sliding_window)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(_AttentionSpec):
    """Chunked local attention (Llama 4): a token attends only within its chunk."""

    attention_chunk_size: int

    kind: ClassVar[str] = "chunked_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(type(self).__name__, "attention_chunk_size", self.attention_chunk_size)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec:
    """Multi-head latent attention (full attention with one latent KV vector per token)."""

    head_size: int  # latent width, e.g. 512 + 64 for DeepSeek
    dtype: str = "bf16"

    kind: ClassVar[str] = "full"
    num_kv_heads: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _positive_int(type(self).__name__, "head_size", self.head_size)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def bytes_per_token(self) -> int:
        return self.head_size * DTYPE_SIZES[self.dtype]

    def page_size_bytes(self, block_size: int) -> int:
        _positive_int(type(self).__name__, "block_size", block_size)
        return block_size * self.bytes_per_token


MAMBA_TYPES = ("mamba1", "mamba2", "gdn")
"""`MambaSpec.mamba_type`: Mamba-1, Mamba-2, gated DeltaNet (vLLM's mixer kinds the planner
tells apart)."""


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """A Mamba layer's per-request state: several arrays (conv state, SSM state).

    The state does not grow with the sequence, so `bytes_per_token` is 0 and the page size
    is the state size whatever the block size. Sub-states are laid out one after another,
    each at an offset aligned to its dtype size.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mamba_type: str = "mamba2"

    kind: ClassVar[str] = "mamba"
    bytes_per_token: ClassVar[int] = 0

    @property
    def prefill_checkpoint_blocks(self) -> int:
        """Blocks per request vLLM 0.33 adds for states exported from inside a prefill in
        `align` mode: 1 for its Mamba-2 mixer, which always exports them; 0 for Mamba-1 and
        for gated DeltaNet (whose export depends on the attention backend)."""
        return 1 if self.mamba_type == "mamba2" else 0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.mamba_type not in MAMBA_TYPES:
            raise SpecError(
                f"{owner}: mamba_type must be one of {', '.join(MAMBA_TYPES)}, "
                f"got {self.mamba_type!r}"
            )
        try:
            shapes = tuple(tuple(shape) for shape in self.shapes)
            single = isinstance(self.dtypes, str) or _is_torch_dtype(self.dtypes)
            dtypes = (self.dtypes,) if single else tuple(self.dtypes)
        except TypeError:
            raise SpecError(f"{owner}: shapes and dtypes must be sequences") from None
        if not shapes:
            raise SpecError(f"{owner}: needs at least one state shape")
        for shape in shapes:
            if not shape:
                raise SpecError(f"{owner}: empty state shape in {shapes}")
            for dim in shape:
                _positive_int(owner, "state dimension", dim)
        if len(dtypes) == 1 and len(shapes) > 1:
            dtypes = dtypes * len(shapes)
        if len(dtypes) != len(shapes):
            raise SpecError(f"{owner}: {len(shapes)} state shapes but {len(dtypes)} dtypes")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", tuple(canonical_dtype(d) for d in dtypes))

    @classmethod
    def mamba1(
        cls,
        *,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        dtype: str = "bf16",
        ssm_dtype: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> MambaSpec:
        """Mamba-1 (Jamba): conv state `(d_conv - 1, d_inner)` (vLLM's default "SD" conv
        layout), SSM state `(d_inner, d_state)`; `d_inner` split over the TP ranks."""
        _positive_ints(
            "MambaSpec.mamba1",
            intermediate_size=intermediate_size,
            state_size=state_size,
            conv_kernel=conv_kernel,
            tensor_parallel_size=tensor_parallel_size,
        )
        _positive_int("MambaSpec.mamba1", "conv_kernel - 1", conv_kernel - 1)
        inner = _shard(
            "MambaSpec.mamba1", "intermediate_size", intermediate_size, tensor_parallel_size
        )
        return cls(
            shapes=((conv_kernel - 1, inner), (inner, state_size)),
            dtypes=(dtype, ssm_dtype or dtype),
            mamba_type="mamba1",
        )

    @classmethod
    def mamba2(
        cls,
        *,
        intermediate_size: int,
        n_groups: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        conv_kernel: int,
        dtype: str = "bf16",
        ssm_dtype: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> MambaSpec:
        """Mamba-2 (Bamba): conv state `(d_conv - 1, d_inner + 2·groups·d_state)`,
        SSM state `(heads, head_dim, d_state)`. Over `tensor_parallel_size` ranks the conv
        width and the heads are split, groups first replicated to a multiple of the ranks
        (vLLM's `extra_groups_for_head_shards`)."""
        _positive_ints(
            "MambaSpec.mamba2",
            intermediate_size=intermediate_size,
            n_groups=n_groups,
            num_heads=num_heads,
            head_dim=head_dim,
            state_size=state_size,
            conv_kernel=conv_kernel,
            tensor_parallel_size=tensor_parallel_size,
        )
        _positive_int("MambaSpec.mamba2", "conv_kernel - 1", conv_kernel - 1)
        tp = tensor_parallel_size
        if n_groups % tp:
            n_groups = tp
        conv_dim = _shard(
            "MambaSpec.mamba2", "conv width", intermediate_size + 2 * n_groups * state_size, tp
        )
        heads = _shard("MambaSpec.mamba2", "num_heads", num_heads, tp)
        return cls(
            shapes=((conv_kernel - 1, conv_dim), (heads, head_dim, state_size)),
            dtypes=(dtype, ssm_dtype or dtype),
            mamba_type="mamba2",
        )

    @classmethod
    def gated_delta_net(
        cls,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        dtype: str = "bf16",
        ssm_dtype: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> MambaSpec:
        """Gated DeltaNet linear attention (Qwen3-Next): conv state
        `(d_conv - 1, 2·k_heads·k_dim + v_heads·v_dim)`, recurrent state
        `(v_heads, v_dim, k_dim)`, conv width and value heads split over the TP ranks. vLLM
        keeps it in a Mamba-type cache."""
        _positive_ints(
            "MambaSpec.gated_delta_net",
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            conv_kernel=conv_kernel,
            tensor_parallel_size=tensor_parallel_size,
        )
        _positive_int("MambaSpec.gated_delta_net", "conv_kernel - 1", conv_kernel - 1)
        tp = tensor_parallel_size
        owner = "MambaSpec.gated_delta_net"
        conv_dim = _shard(
            owner, "conv width", 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim, tp
        )
        heads = _shard(owner, "num_v_heads", num_v_heads, tp)
        return cls(
            shapes=((conv_kernel - 1, conv_dim), (heads, head_v_dim, head_k_dim)),
            dtypes=(dtype, ssm_dtype or dtype),
            mamba_type="gdn",
        )

    @property
    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each sub-state inside the layer's state."""
        offsets = []
        position = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            size = DTYPE_SIZES[dtype]
            position = -(-position // size) * size
            offsets.append(position)
            position += math.prod(shape) * size
        return tuple(offsets)

    @property
    def state_bytes(self) -> int:
        """Bytes of the whole state (sub-states plus any alignment gap between them)."""
        last_shape, last_dtype = self.shapes[-1], self.dtypes[-1]
        return self.state_offsets[-1] + math.prod(last_shape) * DTYPE_SIZES[last_dtype]

    def page_size_bytes(self, block_size: int) -> int:
        """The state size (independent of the block size)."""
        _positive_int(type(self).__name__, "block_size", block_size)
        return self.state_bytes


@dataclass(frozen=True)
class KVSharingSpec:
    """A layer that reads another layer's KV cache (Gemma-3n): it gets no memory."""

    target: str
    kind: ClassVar[str] = "shared"
    bytes_per_token: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise SpecError(
                f"KVSharingSpec: target must be a non-empty layer name, got {self.target!r}"
            )

    def page_size_bytes(self, block_size: int) -> int:
        return 0


AttentionLayerSpec: TypeAlias = (
    FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MLAAttentionSpec
)
LayerSpec: TypeAlias = AttentionLayerSpec | MambaSpec | KVSharingSpec

_SPEC_TYPES = (
    FullAttentionSpec,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
    MLAAttentionSpec,
    MambaSpec,
    KVSharingSpec,
)
ATTENTION_SPEC_TYPES = (
    FullAttentionSpec,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
    MLAAttentionSpec,
)


@contextmanager
def layer_context(layer_name: str) -> Iterator[None]:
    """Prefix any `SpecError` raised inside with the layer's name.

    >>> with layer_context("model.layers.3"):
    ...     spec = FullAttentionSpec(num_kv_heads=8, head_size=128)
    """
    try:
        yield
    except SpecError as error:
        if str(error).startswith("layer "):
            raise
        raise SpecError(f"layer {layer_name!r}: {error}") from error


def validate_layers(layers: Mapping[str, LayerSpec]) -> None:
    """Check a `{layer_name: spec}` mapping: spec types and the KV-sharing graph.

    An empty mapping is valid: an attention-free model has no KV cache. Raises `SpecError`
    when `layers` is not a mapping, or naming the offending layer when a value is not a spec,
    a sharing target does not exist, is itself a sharing layer, is a Mamba layer, or sharing
    forms a cycle.
    """
    if not isinstance(layers, Mapping):
        raise SpecError(
            f"layers must be a mapping {{layer_name: spec}}, got {type(layers).__name__}"
        )
    for name, spec in layers.items():
        if not isinstance(name, str) or not name:
            raise SpecError(f"layer names must be non-empty strings, got {name!r}")
        if not isinstance(spec, _SPEC_TYPES):
            raise SpecError(f"layer {name!r}: expected a layer spec, got {type(spec).__name__}")
    for name, spec in layers.items():
        if not isinstance(spec, KVSharingSpec):
            continue
        chain = [name]
        current: LayerSpec = spec
        while isinstance(current, KVSharingSpec):
            nxt = current.target
            if nxt in chain:
                cycle = " -> ".join([*chain[chain.index(nxt) :], nxt])
                raise SpecError(f"layer {name!r}: KV-sharing cycle {cycle}")
            if nxt not in layers:
                raise SpecError(f"layer {chain[-1]!r}: KV-sharing target {nxt!r} does not exist")
            chain.append(nxt)
            current = layers[nxt]
        target = spec.target
        if isinstance(layers[target], KVSharingSpec):
            raise SpecError(
                f"layer {name!r}: KV-sharing target {target!r} is itself a sharing layer "
                "(point at the layer that owns the cache)"
            )
        if isinstance(layers[target], MambaSpec):
            raise SpecError(
                f"layer {name!r}: KV-sharing target {target!r} is a Mamba layer; "
                "only attention caches can be shared"
            )
