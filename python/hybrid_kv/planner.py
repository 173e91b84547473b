"""KV-cache planning: layer grouping, page sizes, Mamba padding, pool sizing, memory layout.

Model of memory (DESIGN.md "Allocation" and "Memory layout"):

* Non-sharing layers with equal specs form a *bucket*. Every layer slot is a *slice* of
  `slice_bytes`; attention layers take one slice per block, a Mamba state takes
  `span = ceil(state / slice)` consecutive slices.
* A *group* is a set of layers of one bucket that share block ids. Every group is laid out
  over the same `num_buffers` slices, so one block (a page) is `num_buffers * slice_bytes`
  bytes for every group. Buffer `i` is shared by the `i`-th slot of every group; slots a
  group leaves empty are padding.
* Waste is measured for one resident request of `reference_len` tokens: bytes of the blocks
  it holds that hold no data (padding slots, slices larger than the layer needs, the unfilled
  tail of each group's last block), divided by all bytes it holds.

`strategy="vllm"` reproduces vLLM 0.33 (Mamba block-size alignment, page unification, the
group-size heuristic and strided assignment). `strategy="min-waste"` searches group widths and
Mamba block sizes for the least waste, within a cap on the number of groups.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Literal, cast

from hybrid_kv.specs import (
    ATTENTION_SPEC_TYPES,
    DTYPE_SIZES,
    ChunkedLocalAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
    validate_layers,
)

__all__ = [
    "STRATEGIES",
    "CandidateSummary",
    "InsufficientMemoryError",
    "KVCacheBuffer",
    "KVCacheGroup",
    "KVCachePlan",
    "LayerPlacement",
    "PlanError",
    "WasteReport",
    "blocks_held",
    "format_bytes",
    "parse_memory",
    "plan_kv_cache",
]

STRATEGIES = ("min-waste", "vllm")
GroupKind = Literal["full", "sliding_window", "chunked_local", "mamba"]
Layout = Literal["layer_outer", "block_outer"]


class PlanError(ValueError):
    """Bad planner input (strategy, sizes, memory string)."""


class InsufficientMemoryError(PlanError):
    """The memory budget cannot hold one request of `max_model_len` tokens."""


# --------------------------------------------------------------------------- memory strings

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_UNIT_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_memory(text: str | int) -> int:
    """Bytes in a memory size: `"40GiB"`, `"512MiB"`, `"80GB"`, `"1.5TiB"`, `"4096"`.

    `KiB/MiB/GiB/TiB` (and the bare `K/M/G/T`) are powers of 1024; `KB/MB/GB/TB` are powers
    of 1000; a plain number is bytes.
    """
    if isinstance(text, bool):
        raise PlanError(f"memory size must be a string or int, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise PlanError(f"memory size must be > 0, got {text}")
        return text
    if not isinstance(text, str):
        raise PlanError(f"memory size must be a string or int, got {text!r}")
    match = _MEMORY_RE.match(text)
    if match is None:
        raise PlanError(
            f"bad memory size {text!r}: expected a number with an optional unit, e.g. 40GiB"
        )
    number, prefix, binary, byte_suffix = match.groups()
    prefix = prefix.lower()
    if binary and not prefix:
        raise PlanError(f"bad memory size {text!r}: 'i' needs a unit prefix (KiB, MiB, GiB)")
    decimal = bool(byte_suffix) and not binary and bool(prefix)
    base = 1000 if decimal else 1024
    value = Fraction(number) * base ** _UNIT_POWERS[prefix]
    result = math.floor(value)
    if result <= 0:
        raise PlanError(f"memory size must be at least one byte, got {text!r}")
    return result


def format_bytes(num_bytes: int) -> str:
    """Human-readable binary size: `1.50 GiB`."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- plan values


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_held(
    kind: str,
    block_size: int,
    num_tokens: int,
    *,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> int:
    """Blocks a resident request of `num_tokens` tokens holds in one group of this kind.

    Full attention holds every token; sliding window the blocks covering the last
    `sliding_window - 1` tokens; chunked local the blocks of the chunk holding the last
    token; Mamba one block (its state).
    """
    if num_tokens <= 0:
        return 0
    total = _cdiv(num_tokens, block_size)
    if kind == "full":
        return total
    if kind == "sliding_window":
        assert sliding_window is not None
        first_token = max(0, num_tokens - (sliding_window - 1))
        return total - first_token // block_size
    if kind == "chunked_local":
        assert attention_chunk_size is not None
        first_token = (num_tokens - 1) // attention_chunk_size * attention_chunk_size
        return total - first_token // block_size
    if kind == "mamba":
        return 1
    raise PlanError(f"unknown group kind {kind!r}")


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block ids: one attention type, one block size.

    `layer_names[j]` owns slot `j` (see `LayerPlacement.buffers`); `shared_layer_names` are
    KV-sharing layers that read this group's blocks through their target's memory.
    """

    group_id: int
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    shared_layer_names: tuple[str, ...] = ()
    num_padding_slots: int = 0

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks a resident request of `num_tokens` tokens holds in this group."""
        return blocks_held(
            self.kind,
            self.block_size,
            num_tokens,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
        )

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "group_id": self.group_id,
            "kind": self.kind,
            "block_size": self.block_size,
            "layer_names": list(self.layer_names),
            "shared_layer_names": list(self.shared_layer_names),
            "num_padding_slots": self.num_padding_slots,
        }
        if self.sliding_window is not None:
            result["sliding_window"] = self.sliding_window
        if self.attention_chunk_size is not None:
            result["attention_chunk_size"] = self.attention_chunk_size
        return result


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's slice of block `b` lives: `offset_bytes + b * block_stride_bytes`
    bytes into the pool, `slice_bytes` long, of which the layer fills `used_bytes`.

    For a KV-sharing layer the placement is its target's (`shared_from` names the target).
    """

    layer_name: str
    group_id: int
    buffers: tuple[int, ...]
    offset_bytes: int
    block_stride_bytes: int
    slice_bytes: int
    used_bytes: int
    spec: LayerSpec
    shared_from: str | None = None

    def block_range(self, block_id: int) -> tuple[int, int]:
        """Byte range `[start, end)` of this layer's slice of `block_id` in the pool."""
        start = self.offset_bytes + block_id * self.block_stride_bytes
        return start, start + self.slice_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_name": self.layer_name,
            "group_id": self.group_id,
            "buffers": list(self.buffers),
            "offset_bytes": self.offset_bytes,
            "block_stride_bytes": self.block_stride_bytes,
            "slice_bytes": self.slice_bytes,
            "used_bytes": self.used_bytes,
            "spec": _spec_to_dict(self.spec),
            "shared_from": self.shared_from,
        }


@dataclass(frozen=True)
class KVCacheBuffer:
    """Buffer `index`: `num_blocks` slices, slice `b` at `offset_bytes + b * block_stride_bytes`.

    Shared by the `index`-th slot of every group (`layer_names`, at most one per group).
    """

    index: int
    offset_bytes: int
    block_stride_bytes: int
    slice_bytes: int
    size_bytes: int
    layer_names: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "offset_bytes": self.offset_bytes,
            "block_stride_bytes": self.block_stride_bytes,
            "slice_bytes": self.slice_bytes,
            "size_bytes": self.size_bytes,
            "layer_names": list(self.layer_names),
        }


@dataclass(frozen=True)
class WasteReport:
    """Bytes a resident request of `reference_len` tokens holds, and how many are unused."""

    reference_len: int
    held_bytes: int
    padding_slot_bytes: int
    slice_padding_bytes: int
    tail_bytes: int

    @property
    def waste_bytes(self) -> int:
        return self.padding_slot_bytes + self.slice_padding_bytes + self.tail_bytes

    @property
    def used_bytes(self) -> int:
        return self.held_bytes - self.waste_bytes

    @property
    def waste_fraction(self) -> Fraction:
        return Fraction(self.waste_bytes, self.held_bytes) if self.held_bytes else Fraction(0)

    @property
    def waste_percent(self) -> float:
        return float(self.waste_fraction * 100)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference_len": self.reference_len,
            "held_bytes": self.held_bytes,
            "used_bytes": self.used_bytes,
            "waste_bytes": self.waste_bytes,
            "padding_slot_bytes": self.padding_slot_bytes,
            "slice_padding_bytes": self.slice_padding_bytes,
            "tail_bytes": self.tail_bytes,
            "waste_percent": round(self.waste_percent, 4),
        }


@dataclass(frozen=True)
class CandidateSummary:
    """One plan the planner considered (for reporting the Mamba options)."""

    label: str
    num_groups: int
    num_buffers: int
    attention_block_size: int
    waste: WasteReport

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "num_groups": self.num_groups,
            "num_buffers": self.num_buffers,
            "attention_block_size": self.attention_block_size,
            "waste": self.waste.to_dict(),
        }


@dataclass(frozen=True)
class KVCachePlan:
    """A KV-cache plan: groups, page size, pool size, buffers, per-layer placements, waste.

    `num_blocks` includes the null block (block 0). The pool is `num_blocks * block_bytes`
    bytes; with `layout == "layer_outer"` buffer `i` is the contiguous range starting at
    `i * num_blocks * slice_bytes`, with `"block_outer"` block `b` is the contiguous range
    starting at `b * block_bytes` (used when a Mamba state spans several slices).
    """

    strategy: str
    groups: tuple[KVCacheGroup, ...]
    buffers: tuple[KVCacheBuffer, ...]
    placements: tuple[LayerPlacement, ...]
    num_blocks: int
    block_bytes: int
    slice_bytes: int
    layout: Layout
    memory_bytes: int
    max_model_len: int
    blocks_per_request: int
    waste: WasteReport
    reasons: tuple[str, ...]
    alternatives: tuple[CandidateSummary, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_padding_slots(self) -> int:
        return sum(group.num_padding_slots for group in self.groups)

    @property
    def attention_block_size(self) -> int | None:
        """Smallest attention group block size (None for attention-free models)."""
        sizes = [g.block_size for g in self.groups if g.kind != "mamba"]
        return min(sizes) if sizes else None

    @property
    def max_concurrency(self) -> float:
        """Requests of `max_model_len` tokens the pool holds at once (null block excluded)."""
        return (self.num_blocks - 1) / self.blocks_per_request

    @property
    def kv_sharing(self) -> dict[str, str]:
        """`{sharing_layer: target_layer}`."""
        return {p.layer_name: p.shared_from for p in self.placements if p.shared_from}

    def placement(self, layer_name: str) -> LayerPlacement:
        for placement in self.placements:
            if placement.layer_name == layer_name:
                return placement
        raise KeyError(layer_name)

    def group_of(self, layer_name: str) -> KVCacheGroup:
        return self.groups[self.placement(layer_name).group_id]

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "slice_bytes": self.slice_bytes,
            "num_buffers": self.num_buffers,
            "layout": self.layout,
            "memory_bytes": self.memory_bytes,
            "pool_bytes": self.pool_bytes,
            "max_model_len": self.max_model_len,
            "blocks_per_request": self.blocks_per_request,
            "max_concurrency": round(self.max_concurrency, 4),
            "groups": [g.to_dict() for g in self.groups],
            "buffers": [b.to_dict() for b in self.buffers],
            "placements": [p.to_dict() for p in self.placements],
            "kv_sharing": self.kv_sharing,
            "waste": self.waste.to_dict(),
            "reasons": list(self.reasons),
            "alternatives": [a.to_dict() for a in self.alternatives],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def _spec_to_dict(spec: LayerSpec) -> dict[str, Any]:
    result: dict[str, Any] = {"type": type(spec).__name__, "kind": spec.kind}
    for name in (
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "sliding_window",
        "attention_chunk_size",
        "target",
        "mamba_type",
    ):
        if hasattr(spec, name) and getattr(spec, name) is not None:
            result[name] = getattr(spec, name)
    if isinstance(spec, MambaSpec):
        result["shapes"] = [list(s) for s in spec.shapes]
        result["dtypes"] = list(spec.dtypes)
        result["state_bytes"] = spec.state_bytes
    else:
        result["bytes_per_token"] = spec.bytes_per_token
    return result


# --------------------------------------------------------------------------- internals


@dataclass(frozen=True)
class _Bucket:
    """Non-sharing layers with equal specs, in model order."""

    spec: LayerSpec
    layers: tuple[str, ...]

    @property
    def kind(self) -> GroupKind:
        return cast(GroupKind, self.spec.kind)  # sharing layers never form buckets


@dataclass(frozen=True)
class _Sizing:
    """Slice size and per-bucket block size / span / used bytes for one base block size."""

    base_block_size: int
    slice_bytes: int
    block_sizes: tuple[int, ...]
    spans: tuple[int, ...]
    used_bytes: tuple[int, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Candidate:
    label: str
    sizing: _Sizing
    groups: tuple[tuple[int, tuple[str, ...]], ...]  # (bucket index, layers)
    num_buffers: int
    waste: WasteReport

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def sort_key(self) -> tuple[Fraction, int, int, int]:
        return (
            self.waste.waste_fraction,
            self.num_groups,
            max(self.sizing.block_sizes),
            self.num_buffers,
        )


def _buckets(layers: Mapping[str, LayerSpec]) -> list[_Bucket]:
    order: dict[LayerSpec, list[str]] = {}
    for name, spec in layers.items():
        if isinstance(spec, KVSharingSpec):
            continue
        order.setdefault(spec, []).append(name)
    return [_Bucket(spec, tuple(names)) for spec, names in order.items()]


def _round_up(value: int, multiple: int) -> int:
    return _cdiv(value, multiple) * multiple


def _unit_alignment(buckets: Sequence[_Bucket]) -> int:
    """Slices are a multiple of the largest element size so typed views stay aligned."""
    sizes = [1]
    for bucket in buckets:
        if isinstance(bucket.spec, MambaSpec):
            sizes.extend(DTYPE_SIZES[d] for d in bucket.spec.dtypes)
        else:
            sizes.append(DTYPE_SIZES[bucket.spec.dtype])  # type: ignore[union-attr]
    return max(sizes)


def _attention_token_bytes(buckets: Sequence[_Bucket]) -> int:
    return max(
        (b.spec.bytes_per_token for b in buckets if isinstance(b.spec, ATTENTION_SPEC_TYPES)),
        default=0,
    )


def _max_state_bytes(buckets: Sequence[_Bucket]) -> int:
    return max(
        (b.spec.state_bytes for b in buckets if isinstance(b.spec, MambaSpec)),
        default=0,
    )


def _sizing(buckets: Sequence[_Bucket], base_block_size: int) -> _Sizing:
    """Unify page sizes at `base_block_size` (vLLM's rule: grow the block size of a smaller
    attention page when it divides the largest, else pad; Mamba states take whole slices)."""
    unit = _unit_alignment(buckets)
    token_bytes = _attention_token_bytes(buckets)
    if token_bytes:
        slice_bytes = _round_up(base_block_size * token_bytes, unit)
    else:
        slice_bytes = _round_up(_max_state_bytes(buckets), unit)
    block_sizes: list[int] = []
    spans: list[int] = []
    used: list[int] = []
    notes: list[str] = []
    for bucket in buckets:
        spec = bucket.spec
        if isinstance(spec, MambaSpec):
            span = _cdiv(spec.state_bytes, slice_bytes)
            block_sizes.append(base_block_size)
            spans.append(span)
            used.append(spec.state_bytes)
            continue
        page = base_block_size * spec.bytes_per_token
        block_size = base_block_size
        if page != slice_bytes and slice_bytes % page == 0:
            block_size = base_block_size * (slice_bytes // page)
            notes.append(
                f"{spec.kind} layers with {spec.bytes_per_token} B/token ({bucket.layers[0]}, ...) "
                f"use block size {block_size} so their page matches {slice_bytes} B"
            )
        elif page != slice_bytes:
            notes.append(
                f"{spec.kind} layers with {spec.bytes_per_token} B/token ({bucket.layers[0]}, ...) "
                f"are padded from {page} B to {slice_bytes} B per block (pages do not divide)"
            )
        block_sizes.append(block_size)
        spans.append(1)
        used.append(block_size * spec.bytes_per_token)
    return _Sizing(
        base_block_size, slice_bytes, tuple(block_sizes), tuple(spans), tuple(used), tuple(notes)
    )


def _group(
    buckets: Sequence[_Bucket], spans: Sequence[int], width: int
) -> tuple[tuple[tuple[int, tuple[str, ...]], ...], int] | None:
    """Split every bucket into groups of at most `width` slots, strided like vLLM
    (`layers[i::num_groups]`). Returns the groups and the number of slots actually used by
    the widest group, or None if some layer does not fit in `width` slots."""
    groups: list[tuple[int, tuple[str, ...]]] = []
    widest = 0
    for index, (bucket, span) in enumerate(zip(buckets, spans, strict=True)):
        per_group = width // span
        if per_group == 0:
            return None
        num_groups = _cdiv(len(bucket.layers), per_group)
        for i in range(num_groups):
            members = bucket.layers[i::num_groups]
            groups.append((index, members))
            widest = max(widest, len(members) * span)
    return tuple(groups), widest


def _measure(
    buckets: Sequence[_Bucket],
    sizing: _Sizing,
    groups: Iterable[tuple[int, tuple[str, ...]]],
    num_buffers: int,
    reference_len: int,
) -> WasteReport:
    block_bytes = num_buffers * sizing.slice_bytes
    held = padding = slice_padding = tail = 0
    for index, members in groups:
        spec = buckets[index].spec
        block_size = sizing.block_sizes[index]
        span = sizing.spans[index]
        count = blocks_held(
            buckets[index].kind,
            block_size,
            reference_len,
            sliding_window=getattr(spec, "sliding_window", None),
            attention_chunk_size=getattr(spec, "attention_chunk_size", None),
        )
        held += count * block_bytes
        padding += count * (num_buffers - span * len(members)) * sizing.slice_bytes
        slice_padding += (
            count * len(members) * (span * sizing.slice_bytes - sizing.used_bytes[index])
        )
        if count and not isinstance(spec, MambaSpec):
            unfilled = _cdiv(reference_len, block_size) * block_size - reference_len
            tail += len(members) * unfilled * spec.bytes_per_token
    return WasteReport(reference_len, held, padding, slice_padding, tail)


def _candidate(
    label: str,
    buckets: Sequence[_Bucket],
    sizing: _Sizing,
    width: int,
    reference_len: int,
) -> _Candidate | None:
    grouped = _group(buckets, sizing.spans, width)
    if grouped is None:
        return None
    groups, widest = grouped
    waste = _measure(buckets, sizing, groups, widest, reference_len)
    return _Candidate(label, sizing, groups, widest, waste)


def _vllm_group_size(buckets: Sequence[_Bucket]) -> int:
    counts = [len(b.layers) for b in buckets]
    smallest, largest = min(counts), max(counts)
    return largest if largest < 1.5 * smallest else smallest


def _vllm_block_size(buckets: Sequence[_Bucket], block_size: int, alignment: int) -> int:
    """vLLM's platform alignment for Mamba hybrids: grow the attention block size (a
    multiple of max(kernel alignment, block_size)) until one attention page holds a state."""
    token_bytes = _attention_token_bytes(buckets)
    state_bytes = _max_state_bytes(buckets)
    if not token_bytes or not state_bytes:
        return block_size
    align = max(alignment, block_size)
    return max(block_size, align * _cdiv(state_bytes, align * token_bytes))


def _vllm_candidate(
    buckets: Sequence[_Bucket], block_size: int, alignment: int, reference_len: int
) -> _Candidate:
    sizing = _sizing(buckets, _vllm_block_size(buckets, block_size, alignment))
    candidate = _candidate("vllm", buckets, sizing, _vllm_group_size(buckets), reference_len)
    assert candidate is not None  # every span is 1 after vLLM's alignment
    return candidate


def _search_block_sizes(buckets: Sequence[_Bucket], block_size: int, alignment: int) -> list[int]:
    """Attention block sizes to try: for Mamba hybrids, option A (one attention slice holds a
    state) and option B for every group width k (k attention slices hold a state)."""
    token_bytes = _attention_token_bytes(buckets)
    state_bytes = _max_state_bytes(buckets)
    if not token_bytes or not state_bytes:
        return [block_size]
    sizes = set()
    num_layers = sum(len(b.layers) for b in buckets)
    for width in range(1, num_layers + 1):
        tokens = _cdiv(state_bytes, width * token_bytes)
        sizes.add(max(block_size, _round_up(tokens, alignment)))
    return sorted(sizes)


def _widths(buckets: Sequence[_Bucket], spans: Sequence[int], max_groups: int) -> set[int]:
    """Group widths worth trying: the tightest width for every bucket and group count."""
    widths = set()
    for bucket, span in zip(buckets, spans, strict=True):
        for num_groups in range(1, min(max_groups, len(bucket.layers)) + 1):
            widths.add(span * _cdiv(len(bucket.layers), num_groups))
    return widths


def _search(
    buckets: Sequence[_Bucket],
    block_size: int,
    alignment: int,
    reference_len: int,
    max_groups: int,
) -> list[_Candidate]:
    found: dict[tuple[int, int], _Candidate] = {}
    for base in _search_block_sizes(buckets, block_size, alignment):
        sizing = _sizing(buckets, base)
        label = "A" if max(sizing.spans) == 1 else "B"
        for width in _widths(buckets, sizing.spans, max_groups):
            candidate = _candidate(label, buckets, sizing, width, reference_len)
            if candidate is None or candidate.num_groups > max_groups:
                continue
            found.setdefault((base, candidate.num_buffers), candidate)
    return list(found.values())


def _check_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------- entry point


def plan_kv_cache(
    layers: Mapping[str, LayerSpec],
    memory_bytes: int,
    max_model_len: int,
    *,
    block_size: int = 16,
    alignment: int = 16,
    strategy: str = "min-waste",
    reference_len: int | None = None,
    max_groups: int | None = None,
) -> KVCachePlan:
    """Plan the KV cache of a model: `{layer_name: spec}` in model order.

    Args:
        memory_bytes: bytes for the whole pool (the null block included).
        max_model_len: longest request; one such request must fit.
        block_size: base attention block size (a multiple of `alignment`).
        alignment: kernel block-size alignment; grown block sizes stay multiples of it.
        strategy: `"min-waste"` (default) or `"vllm"` (vLLM 0.33's grouping).
        reference_len: request length the waste is measured at (default `max_model_len`).
        max_groups: cap on the number of groups for `min-waste` (default vLLM's count + 4).

    Raises:
        SpecError: invalid layers (names the layer).
        PlanError: invalid arguments.
        InsufficientMemoryError: one `max_model_len` request does not fit in `memory_bytes`.
    """
    validate_layers(layers)
    memory_bytes = _check_int("memory_bytes", memory_bytes)
    max_model_len = _check_int("max_model_len", max_model_len)
    block_size = _check_int("block_size", block_size)
    alignment = _check_int("alignment", alignment)
    if block_size % alignment:
        raise PlanError(
            f"block_size {block_size} must be a multiple of the kernel alignment {alignment}"
        )
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    reference_len = max_model_len if reference_len is None else reference_len
    reference_len = _check_int("reference_len", reference_len)
    if max_groups is not None:
        max_groups = _check_int("max_groups", max_groups)

    buckets = _buckets(layers)
    vllm = _vllm_candidate(buckets, block_size, alignment, reference_len)
    reasons: list[str] = []
    alternatives: list[CandidateSummary] = []
    if strategy == "vllm":
        chosen = vllm
        counts = [len(b.layers) for b in buckets]
        reasons.append(
            f"vLLM grouping: group size {_vllm_group_size(buckets)} "
            f"(layer counts per spec {counts}; the largest count is used when it is below "
            "1.5x the smallest, else the smallest), layers assigned strided"
        )
    else:
        cap = vllm.num_groups + 4 if max_groups is None else max_groups
        candidates = _search(buckets, block_size, alignment, reference_len, cap)
        if vllm.num_groups <= cap:
            candidates.append(vllm)
        if not candidates:
            raise PlanError(f"no grouping fits within max_groups={cap}")
        chosen = min(candidates, key=_Candidate.sort_key)
        reasons.append(
            f"min-waste: tried {len(candidates)} groupings (at most {cap} groups); chose "
            f"{chosen.num_groups} groups over {chosen.num_buffers} buffers with "
            f"{chosen.waste.waste_percent:.2f}% waste at {reference_len} tokens "
            f"(vLLM's grouping: {vllm.num_groups} groups, {vllm.waste.waste_percent:.2f}%)"
        )
        if _max_state_bytes(buckets) and _attention_token_bytes(buckets):
            for label, text in (
                ("A", "option A (one attention slice holds a Mamba state)"),
                ("B", "option B (a group's attention page holds a Mamba state)"),
            ):
                family = [c for c in candidates if c.label == label]
                if not family:
                    reasons.append(f"Mamba {text}: no plan within {cap} groups")
                    continue
                best = min(family, key=_Candidate.sort_key)
                alternatives.append(_summary(f"mamba-option-{label}", best))
                reasons.append(
                    f"Mamba {text}: best attention block size {best.sizing.base_block_size}, "
                    f"{best.num_groups} groups, {best.waste.waste_percent:.2f}% waste"
                )
        alternatives.append(_summary("vllm", vllm))
    if chosen.sizing.base_block_size != block_size:
        reasons.append(
            f"attention block size grown from {block_size} to {chosen.sizing.base_block_size} "
            f"for Mamba states of {_max_state_bytes(buckets)} B "
            f"(attention: {_attention_token_bytes(buckets)} B/token)"
        )
    reasons.extend(chosen.sizing.notes)
    return _build_plan(
        strategy,
        layers,
        buckets,
        chosen,
        memory_bytes,
        max_model_len,
        reasons,
        tuple(alternatives),
    )


def _summary(label: str, candidate: _Candidate) -> CandidateSummary:
    return CandidateSummary(
        label,
        candidate.num_groups,
        candidate.num_buffers,
        candidate.sizing.base_block_size,
        candidate.waste,
    )


def _build_plan(
    strategy: str,
    layers: Mapping[str, LayerSpec],
    buckets: Sequence[_Bucket],
    chosen: _Candidate,
    memory_bytes: int,
    max_model_len: int,
    reasons: list[str],
    alternatives: tuple[CandidateSummary, ...],
) -> KVCachePlan:
    sizing = chosen.sizing
    num_buffers = chosen.num_buffers
    slice_bytes = sizing.slice_bytes
    block_bytes = num_buffers * slice_bytes

    groups: list[KVCacheGroup] = []
    for group_id, (index, members) in enumerate(chosen.groups):
        spec = buckets[index].spec
        groups.append(
            KVCacheGroup(
                group_id=group_id,
                kind=buckets[index].kind,
                block_size=sizing.block_sizes[index],
                layer_names=members,
                sliding_window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
                attention_chunk_size=(
                    spec.attention_chunk_size
                    if isinstance(spec, ChunkedLocalAttentionSpec)
                    else None
                ),
                num_padding_slots=num_buffers - sizing.spans[index] * len(members),
            )
        )

    blocks_per_request = sum(g.blocks_held(max_model_len) for g in groups)
    num_blocks = memory_bytes // block_bytes
    if num_blocks - 1 < blocks_per_request:
        needed = (blocks_per_request + 1) * block_bytes
        raise InsufficientMemoryError(
            f"one request of max_model_len={max_model_len} tokens needs {blocks_per_request} "
            f"blocks of {format_bytes(block_bytes)} plus the null block = {needed} bytes "
            f"({format_bytes(needed)}), but the budget is {memory_bytes} bytes "
            f"({format_bytes(memory_bytes)}); raise the memory or lower max_model_len"
        )
    layout: Layout = "layer_outer" if max(sizing.spans) == 1 else "block_outer"

    def buffer_geometry(index: int) -> tuple[int, int]:
        if layout == "layer_outer":
            return index * num_blocks * slice_bytes, slice_bytes
        return index * slice_bytes, block_bytes

    placements: dict[str, LayerPlacement] = {}
    users: list[list[str]] = [[] for _ in range(num_buffers)]
    for group_id, (index, members) in enumerate(chosen.groups):
        span = sizing.spans[index]
        for slot, name in enumerate(members):
            first = slot * span
            offset, stride = buffer_geometry(first)
            placements[name] = LayerPlacement(
                layer_name=name,
                group_id=group_id,
                buffers=tuple(range(first, first + span)),
                offset_bytes=offset,
                block_stride_bytes=stride,
                slice_bytes=span * slice_bytes,
                used_bytes=sizing.used_bytes[index],
                spec=layers[name],
            )
            for buffer in range(first, first + span):
                users[buffer].append(name)

    shared: dict[int, list[str]] = {}
    for name, spec in layers.items():
        if isinstance(spec, KVSharingSpec):
            target = placements[spec.target]
            placements[name] = LayerPlacement(
                layer_name=name,
                group_id=target.group_id,
                buffers=target.buffers,
                offset_bytes=target.offset_bytes,
                block_stride_bytes=target.block_stride_bytes,
                slice_bytes=target.slice_bytes,
                used_bytes=target.used_bytes,
                spec=layers[spec.target],
                shared_from=spec.target,
            )
            shared.setdefault(target.group_id, []).append(name)
    if shared:
        groups = [replace(g, shared_layer_names=tuple(shared.get(g.group_id, ()))) for g in groups]
        reasons.append(
            f"{sum(len(v) for v in shared.values())} KV-sharing layers get no memory; "
            "they read their target layer's slices"
        )

    buffers = []
    for index in range(num_buffers):
        offset, stride = buffer_geometry(index)
        buffers.append(
            KVCacheBuffer(
                index=index,
                offset_bytes=offset,
                block_stride_bytes=stride,
                slice_bytes=slice_bytes,
                size_bytes=num_blocks * slice_bytes,
                layer_names=tuple(users[index]),
            )
        )
    reasons.append(
        f"pool: {num_blocks} blocks of {block_bytes} B ({num_buffers} buffers x {slice_bytes} B), "
        f"block 0 reserved as the null block; a {max_model_len}-token request holds "
        f"{blocks_per_request} blocks"
    )
    return KVCachePlan(
        strategy=strategy,
        groups=tuple(groups),
        buffers=tuple(buffers),
        placements=tuple(placements[name] for name in layers),
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        slice_bytes=slice_bytes,
        layout=layout,
        memory_bytes=memory_bytes,
        max_model_len=max_model_len,
        blocks_per_request=blocks_per_request,
        waste=chosen.waste,
        reasons=tuple(reasons),
        alternatives=alternatives,
    )
