"""Torch buffers for a `KVCachePlan` and per-layer views. The only module that imports torch.

One byte pool of `plan.num_blocks * plan.block_bytes` bytes backs every buffer; each layer's
view is a strided view of it (`LayerPlacement.offset_bytes`, `block_stride_bytes`), so views
of groups that alias the same block ids share memory exactly as the plan says.

Views (first dimension = block id):
* attention: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (K then V); when
  `head_size_v != head_size` a `(K, V)` pair of `[num_blocks, block_size, heads, size]` views;
* MLA: `[num_blocks, block_size, head_size]`;
* Mamba: a tuple with one `[num_blocks, *shape]` view per state (conv, SSM);
* KV-sharing layers: their target's view (the same object).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybrid_kv.planner import KVCachePlan, LayerPlacement
from hybrid_kv.specs import DTYPE_SIZES, MambaSpec, MLAAttentionSpec

__all__ = ["KVCacheBuffers", "LayerView", "allocate_kv_cache", "default_device", "torch_dtype"]

LayerView = torch.Tensor | tuple[torch.Tensor, ...]

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name."""
    return _TORCH_DTYPES[name]


def default_device() -> torch.device:
    """`cuda` when available, else `cpu`."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class KVCacheBuffers:
    """The allocated pool, one `[num_blocks, slice_bytes]` uint8 view per plan buffer, and
    the per-layer views."""

    plan: KVCachePlan
    pool: torch.Tensor
    buffers: tuple[torch.Tensor, ...]
    views: Mapping[str, LayerView]

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def layer_view(self, layer_name: str) -> LayerView:
        return self.views[layer_name]


def allocate_kv_cache(
    plan: KVCachePlan,
    device: str | torch.device | None = None,
    *,
    zero: bool = True,
) -> KVCacheBuffers:
    """Allocate the plan's memory on `device` (default `default_device()`; `"meta"` allocates
    nothing) and build the per-layer views. `zero` fills the pool with zeros (Mamba states
    must start from zero)."""
    device = default_device() if device is None else torch.device(device)
    pool = torch.empty(plan.pool_bytes, dtype=torch.uint8, device=device)
    if zero and device.type != "meta":
        pool.zero_()
    buffers = tuple(
        pool.as_strided(
            (plan.num_blocks, buffer.slice_bytes),
            (buffer.block_stride_bytes, 1),
            buffer.offset_bytes,
        )
        for buffer in plan.buffers
    )
    views: dict[str, LayerView] = {}
    for placement in plan.placements:
        if placement.shared_from is None:
            views[placement.layer_name] = _layer_view(pool, plan, placement)
    for placement in plan.placements:
        if placement.shared_from is not None:
            views[placement.layer_name] = views[placement.shared_from]
    return KVCacheBuffers(plan, pool, buffers, views)


def _typed(
    pool: torch.Tensor,
    dtype_name: str,
    num_blocks: int,
    shape: tuple[int, ...],
    offset_bytes: int,
    block_stride_bytes: int,
) -> torch.Tensor:
    """A `[num_blocks, *shape]` view of `dtype_name`, contiguous within each block."""
    size = DTYPE_SIZES[dtype_name]
    if offset_bytes % size or block_stride_bytes % size:
        raise ValueError(
            f"misaligned view: offset {offset_bytes} / stride {block_stride_bytes} "
            f"not a multiple of {size}"
        )
    typed = pool.view(torch_dtype(dtype_name))
    strides = [block_stride_bytes // size]
    inner = 1
    inner_strides = []
    for dim in reversed(shape):
        inner_strides.append(inner)
        inner *= dim
    strides.extend(reversed(inner_strides))
    return typed.as_strided((num_blocks, *shape), tuple(strides), offset_bytes // size)


def _layer_view(pool: torch.Tensor, plan: KVCachePlan, placement: LayerPlacement) -> LayerView:
    spec = placement.spec
    num_blocks = plan.num_blocks
    offset = placement.offset_bytes
    stride = placement.block_stride_bytes
    if isinstance(spec, MambaSpec):
        return tuple(
            _typed(pool, dtype, num_blocks, shape, offset + state_offset, stride)
            for shape, dtype, state_offset in zip(
                spec.shapes, spec.dtypes, spec.state_offsets, strict=True
            )
        )
    block_size = plan.groups[placement.group_id].block_size
    if isinstance(spec, MLAAttentionSpec):
        return _typed(pool, spec.dtype, num_blocks, (block_size, spec.head_size), offset, stride)
    heads = spec.num_kv_heads  # type: ignore[union-attr]
    head_k = spec.head_size  # type: ignore[union-attr]
    head_v = spec.head_size_v or head_k  # type: ignore[union-attr]
    dtype = spec.dtype  # type: ignore[union-attr]
    if head_v == head_k:
        return _typed(pool, dtype, num_blocks, (2, block_size, heads, head_k), offset, stride)
    k_bytes = math.prod((block_size, heads, head_k)) * DTYPE_SIZES[dtype]
    return (
        _typed(pool, dtype, num_blocks, (block_size, heads, head_k), offset, stride),
        _typed(pool, dtype, num_blocks, (block_size, heads, head_v), offset + k_bytes, stride),
    )
