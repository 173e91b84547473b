"""The plan: KV-cache groups, per-layer placements, the pool, waste and admission.

Everything here is a frozen value. `plan_kv_cache` (in `entry`) builds a `KVCachePlan`; the
grouping search lives in `search`, the memory layouts in `layout`.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from hybrid_kv.planner.errors import PlanError
from hybrid_kv.planner.inflight import InFlight
from hybrid_kv.planner.lengths import LengthDistribution
from hybrid_kv.planner.stages import PipelineStage
from hybrid_kv.specs import LayerSpec, MambaSpec

__all__ = [
    "PLAN_SCHEMA_VERSION",
    "STRATEGIES",
    "CandidateSummary",
    "ExpectedWaste",
    "GroupKind",
    "KVCacheBuffer",
    "KVCacheGroup",
    "KVCachePlan",
    "LayerPlacement",
    "WasteReport",
    "admission_blocks",
    "blocks_held",
]

PLAN_SCHEMA_VERSION = 3
"""Version of `KVCachePlan.to_dict()` (and `hybrid-kv plan --json`); bumped on any change a
reader must know about."""

STRATEGIES = ("min-waste", "vllm")
GroupKind = Literal["full", "sliding_window", "chunked_local", "mamba"]
MambaCacheMode = Literal["align", "none"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_tokens(value: object) -> int:
    """A request's token count: an int (numpy integers too), at least 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"num_tokens must be an int, got {value!r}")
    if value < 0:
        raise PlanError(f"num_tokens must be at least 0, got {value}")
    return int(value)


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
    raise ValueError(f"unknown group kind {kind!r}")


def admission_blocks(
    kind: str,
    block_size: int,
    max_model_len: int,
    max_in_flight_tokens: int,
    *,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    mamba_cache_mode: str = "align",
    prefill_checkpoint_blocks: int = 0,
) -> int:
    """Blocks vLLM 0.33 reserves per request in one group of this kind when it sizes the pool
    and admits requests (`KVCacheSpec.max_memory_usage_bytes` / `max_admission_blocks_per_
    request`): full attention `cdiv(L, bs)`; sliding window
    `cdiv(min(window - 1 + in_flight, L), bs) + 1` (blocks leave the window only once the
    tokens scheduled but not yet processed are); chunked local
    `cdiv(min(chunk + in_flight, L), bs)`; Mamba 2 blocks in `align` mode (prefix caching on:
    the running state and the last block-aligned one) plus its prefill checkpoint blocks
    (`MambaSpec.prefill_checkpoint_blocks`), 1 in `none` mode."""
    if kind == "full":
        return _cdiv(max_model_len, block_size)
    if kind == "sliding_window":
        assert sliding_window is not None
        tokens = min(sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return _cdiv(tokens, block_size) + 1
    if kind == "chunked_local":
        assert attention_chunk_size is not None
        return _cdiv(min(attention_chunk_size + max_in_flight_tokens, max_model_len), block_size)
    if kind == "mamba":
        return 2 + prefill_checkpoint_blocks if mamba_cache_mode == "align" else 1
    raise ValueError(f"unknown group kind {kind!r}")


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block ids: one attention type, one block size.

    `layer_names` are the layers that own memory, in slot order; `shared_layer_names` are
    KV-sharing layers that read this group's blocks through their target's memory.
    `padding_bytes` is the part of every block this group leaves unused (its layers' pages
    add up to less than the widest group's); `num_padding_slots` counts it in pages when all
    pages have one size (the design's "padding layers").
    """

    group_id: int
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    shared_layer_names: tuple[str, ...] = ()
    num_padding_slots: int = 0
    padding_bytes: int = 0
    prefill_checkpoint_blocks: int = 0

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks a resident request of `num_tokens` tokens holds in this group."""
        return blocks_held(
            self.kind,
            self.block_size,
            _num_tokens(num_tokens),
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
        )

    def admission_blocks(
        self, max_model_len: int, max_in_flight_tokens: int, mamba_cache_mode: str = "align"
    ) -> int:
        """Blocks vLLM reserves per request in this group (see `admission_blocks`)."""
        return admission_blocks(
            self.kind,
            self.block_size,
            max_model_len,
            max_in_flight_tokens,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
            mamba_cache_mode=mamba_cache_mode,
            prefill_checkpoint_blocks=self.prefill_checkpoint_blocks,
        )

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "group_id": self.group_id,
            "kind": self.kind,
            "block_size": self.block_size,
            "layer_names": list(self.layer_names),
            "shared_layer_names": list(self.shared_layer_names),
            "num_padding_slots": self.num_padding_slots,
            "padding_bytes": self.padding_bytes,
        }
        if self.sliding_window is not None:
            result["sliding_window"] = self.sliding_window
        if self.attention_chunk_size is not None:
            result["attention_chunk_size"] = self.attention_chunk_size
        if self.prefill_checkpoint_blocks:
            result["prefill_checkpoint_blocks"] = self.prefill_checkpoint_blocks
        return result


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's cache lives in the pool.

    Its page of block `b` starts `offset_bytes + b * block_stride_bytes` bytes into the pool;
    the page is `page_bytes` long (vLLM's `page_size_bytes`, padding included), of which the
    layer's data fills `used_bytes`. `view_shape` / `view_strides` describe the layer's
    logical `[blocks, heads, tokens, bytes]` view exactly as vLLM 0.33 builds it for the
    plan's layout (strides in bytes). For a KV-sharing layer the placement is its target's
    (`shared_from` names the target, `spec` is the target's).
    """

    layer_name: str
    group_id: int
    offset_bytes: int
    block_stride_bytes: int
    page_bytes: int
    used_bytes: int
    spec: LayerSpec
    view_shape: tuple[int, int, int, int]
    view_strides: tuple[int, int, int, int]
    buffer_index: int
    shared_from: str | None = None
    stage: int = 0

    @property
    def page_is_contiguous(self) -> bool:
        """True when each page is one contiguous byte range (not in `LHBNC`, nor in `BHLNC`
        with several layers per buffer: there the heads lie outside the page)."""
        _, heads, tokens, content = self.view_shape
        _, head_stride, token_stride, _ = self.view_strides
        return (heads - 1) * head_stride + (tokens - 1) * token_stride + content <= self.page_bytes

    def block_range(self, block_id: int) -> tuple[int, int]:
        """Byte range `[start, end)` of this layer's page of `block_id` in the pool (pages of
        the `LHBNC` / `BHLNC` layouts are not contiguous and raise `ValueError`)."""
        if not self.page_is_contiguous:
            raise ValueError(f"{self.layer_name}: pages are not contiguous in this layout")
        start = self.offset_bytes + block_id * self.block_stride_bytes
        return start, start + self.page_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_name": self.layer_name,
            "group_id": self.group_id,
            "buffer_index": self.buffer_index,
            "offset_bytes": self.offset_bytes,
            "block_stride_bytes": self.block_stride_bytes,
            "page_bytes": self.page_bytes,
            "used_bytes": self.used_bytes,
            "view_shape": list(self.view_shape),
            "view_strides": list(self.view_strides),
            "spec": _spec_to_dict(self.spec),
            "shared_from": self.shared_from,
            "stage": self.stage,
        }


@dataclass(frozen=True)
class KVCacheBuffer:
    """vLLM's `KVCacheTensor`: a run of layers of one group with one spec. Layer `layer_names
    [l]`'s page of block `b` starts at `offset_bytes + l * layer_stride_bytes + b *
    block_stride_bytes`; every buffer spans the one backing allocation (`size_bytes`)."""

    index: int
    group_id: int
    layer_names: tuple[str, ...]
    offset_bytes: int
    layer_stride_bytes: int
    block_stride_bytes: int
    page_bytes: int
    size_bytes: int
    stage: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "group_id": self.group_id,
            "layer_names": list(self.layer_names),
            "offset_bytes": self.offset_bytes,
            "layer_stride_bytes": self.layer_stride_bytes,
            "block_stride_bytes": self.block_stride_bytes,
            "page_bytes": self.page_bytes,
            "size_bytes": self.size_bytes,
            "stage": self.stage,
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
class ExpectedWaste:
    """Waste of the requests resident in the pool when their lengths follow `distribution`:
    the weighted sum of wasted bytes over the weighted sum of held bytes (so long requests,
    which hold more memory, count for more, as they do in the pool)."""

    distribution: LengthDistribution
    per_length: tuple[WasteReport, ...]

    @property
    def held_bytes(self) -> int:
        """Weighted sum of held bytes (weights are the distribution's counts)."""
        return sum(
            w * r.held_bytes
            for w, r in zip(self.distribution.weights, self.per_length, strict=True)
        )

    @property
    def waste_bytes(self) -> int:
        return sum(
            w * r.waste_bytes
            for w, r in zip(self.distribution.weights, self.per_length, strict=True)
        )

    @property
    def waste_fraction(self) -> Fraction:
        held = self.held_bytes
        return Fraction(self.waste_bytes, held) if held else Fraction(0)

    @property
    def waste_percent(self) -> float:
        return float(self.waste_fraction * 100)

    def at(self, length: int) -> WasteReport:
        for report in self.per_length:
            if report.reference_len == length:
                return report
        raise KeyError(length)

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "distribution": self.distribution.source,
            "waste_percent": round(self.waste_percent, 4),
        }
        if len(self.per_length) <= 64:
            result["per_length"] = [r.to_dict() for r in self.per_length]
        return result


@dataclass(frozen=True)
class CandidateSummary:
    """One plan the planner considered (the vLLM baseline, the best Mamba options)."""

    label: str
    num_groups: int
    block_bytes: int
    attention_block_size: int | None
    waste_fraction: Fraction
    blocks_per_request: int
    note: str = ""

    @property
    def waste_percent(self) -> float:
        return float(self.waste_fraction * 100)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "num_groups": self.num_groups,
            "block_bytes": self.block_bytes,
            "attention_block_size": self.attention_block_size,
            "waste_percent": round(self.waste_percent, 4),
            "blocks_per_request": self.blocks_per_request,
            "note": self.note,
        }


@dataclass(frozen=True)
class KVCachePlan:
    """A KV-cache plan: groups, block sizes, the pool, per-layer placements, waste, admission.

    `num_blocks` includes the null block (block 0); the pool is `num_blocks * block_bytes`
    bytes. `blocks_per_request` is what vLLM 0.33 reserves to admit one `max_model_len`
    request (`admission_blocks` summed over the groups), so `max_concurrency` and
    `kv_cache_tokens` are the figures vLLM logs ("KV cache size: N tokens, maximum
    concurrency for L tokens per request: X"). An attention-free model has no groups and one
    block, as in vLLM. `in_flight` holds the scheduler options `max_in_flight_tokens` was
    counted from (None when it was given as a count).

    With pipeline stages, `stages` gives each stage GPU's layers, budget, bytes per block and
    pool (vLLM sizes each stage's pool for its own layers, within its own budget; the plan's
    `memory_bytes` is the smallest stage's budget); `num_blocks` is the smallest stage's,
    which every stage allocates; `block_bytes` is the whole model's (a page of every layer of
    the widest group, all stages together), in which waste is measured; each buffer and
    placement names its stage, its offsets in that stage's pool. With one stage, `stages`
    holds it alone and its pool is `num_blocks * block_bytes` bytes.
    """

    strategy: str
    groups: tuple[KVCacheGroup, ...]
    buffers: tuple[KVCacheBuffer, ...]
    placements: tuple[LayerPlacement, ...]
    num_blocks: int
    block_bytes: int
    kv_cache_layout: str
    memory_bytes: int
    max_model_len: int
    max_in_flight_tokens: int
    mamba_cache_mode: MambaCacheMode
    blocks_per_request: int
    scheduler_block_size: int
    hash_block_size: int
    waste: ExpectedWaste
    reasons: tuple[str, ...]
    alternatives: tuple[CandidateSummary, ...] = ()
    warnings: tuple[str, ...] = ()
    in_flight: InFlight | None = None
    stages: tuple[PipelineStage, ...] = ()

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether the plan was made with prefix caching on (its Mamba mode is `align` exactly
        then, as in vLLM)."""
        return self.mamba_cache_mode == "align"

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def pool_bytes(self) -> int:
        """Bytes every stage's pool takes together (one pool of `num_blocks * block_bytes`
        bytes with one stage)."""
        if not self.stages:
            return self.num_blocks * self.block_bytes
        return sum(stage.pool_bytes for stage in self.stages)

    @property
    def pipeline_parallel_size(self) -> int:
        return max(len(self.stages), 1)

    @property
    def num_padding_slots(self) -> int:
        return sum(group.num_padding_slots for group in self.groups)

    @property
    def layer_outer(self) -> bool:
        """Each layer owns one region of the pool (layouts starting with `L`)."""
        return self.kv_cache_layout.startswith("L")

    @property
    def attention_block_size(self) -> int | None:
        """Smallest attention group block size: the prefix-hit granularity of attention
        (None for models without attention)."""
        sizes = [g.block_size for g in self.groups if g.kind != "mamba"]
        return min(sizes) if sizes else None

    @property
    def max_concurrency(self) -> float | None:
        """Requests of `max_model_len` tokens the pool admits at once, as vLLM computes it
        (`num_blocks / blocks_per_request`); None for an attention-free model."""
        if not self.blocks_per_request:
            return None
        return self.num_blocks / self.blocks_per_request

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "KV cache size" in tokens: `int(max_concurrency * max_model_len)` (a float
        product, as vLLM's; exact where it is past a float's range)."""
        concurrency = self.max_concurrency
        if concurrency is None:
            return 0
        try:
            return int(concurrency * self.max_model_len)
        except OverflowError:
            return self.num_blocks * self.max_model_len // self.blocks_per_request

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

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks one resident request of `num_tokens` tokens holds over all groups."""
        return sum(g.blocks_held(_num_tokens(num_tokens)) for g in self.groups)

    def waste_at(self, num_tokens: int) -> WasteReport:
        """Waste of one resident request of `num_tokens` tokens in this plan."""
        return measure_waste(
            self.groups, self.placements, self.block_bytes, _num_tokens(num_tokens)
        )

    def summary_line(self) -> str:
        """vLLM's capacity log line: `KV cache: N tokens, max concurrency X at L tokens`."""
        if self.max_concurrency is None:
            return "KV cache: none (attention-free model)"
        return (
            f"KV cache: {self.kv_cache_tokens:,} tokens, max concurrency "
            f"{self.max_concurrency:.2f}x at {self.max_model_len:,} tokens per request"
        )

    def to_dict(self) -> dict[str, Any]:
        concurrency = self.max_concurrency
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "strategy": self.strategy,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "kv_cache_layout": self.kv_cache_layout,
            "memory_bytes": self.memory_bytes,
            "pool_bytes": self.pool_bytes,
            "stages": [stage.to_dict() for stage in self.stages],
            "max_model_len": self.max_model_len,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            "in_flight": None if self.in_flight is None else self.in_flight.to_dict(),
            "mamba_cache_mode": self.mamba_cache_mode,
            "blocks_per_request": self.blocks_per_request,
            "max_concurrency": None if concurrency is None else round(concurrency, 4),
            "kv_cache_tokens": self.kv_cache_tokens,
            "scheduler_block_size": self.scheduler_block_size,
            "hash_block_size": self.hash_block_size,
            "attention_block_size": self.attention_block_size,
            "groups": [g.to_dict() for g in self.groups],
            "buffers": [b.to_dict() for b in self.buffers],
            "placements": [p.to_dict() for p in self.placements],
            "kv_sharing": self.kv_sharing,
            "waste": self.waste.to_dict(),
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "alternatives": [a.to_dict() for a in self.alternatives],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def measure_waste(
    groups: Sequence[KVCacheGroup],
    placements: Sequence[LayerPlacement],
    block_bytes: int,
    num_tokens: int,
) -> WasteReport:
    """Bytes one resident request of `num_tokens` tokens holds and leaves unused: the blocks
    of every group (`block_bytes` each), minus what its layers write into them."""
    by_name = {p.layer_name: p for p in placements}
    held = padding = slice_padding = tail = 0
    for group in groups:
        count = group.blocks_held(num_tokens)
        if not count:
            continue
        members = [by_name[name] for name in group.layer_names]
        held += count * block_bytes
        padding += count * (block_bytes - sum(p.page_bytes for p in members))
        slice_padding += count * sum(p.page_bytes - p.used_bytes for p in members)
        if group.kind != "mamba":
            unfilled = _cdiv(num_tokens, group.block_size) * group.block_size - num_tokens
            tail += unfilled * sum(p.spec.bytes_per_token for p in members)
    return WasteReport(num_tokens, held, padding, slice_padding, tail)


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
