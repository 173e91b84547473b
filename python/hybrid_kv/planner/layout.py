"""Physical KV-cache layouts (vLLM 0.33's `KVCacheLayout`) and where every layer's cache lives.

vLLM describes the cache of a run of layers as a logical array `[L, B, H, N, C]`: layers,
blocks, heads, token slots of a block, and the bytes of one head's state per token (`C = 2 *
head_size * dtype size` for attention: K then V side by side; the latent vector for MLA; the
whole packed state for Mamba, with `H = N = 1`). A layout is the order of those five axes in
memory, outermost first:

| layout | memory order | |
|---|---|---|
| `LBNHC` (default) | `[L, B, N, H, C]` | layer-compact: each layer's region holds its blocks |
| `LBHNC` | `[L, B, H, N, C]` | layer-compact |
| `LHBNC` | `[L, H, B, N, C]` | layer-compact, heads outside blocks (pages not contiguous) |
| `BLHNC` | `[B, L, H, N, C]` | block-outermost: each block holds every layer's page |
| `BLNHC` | `[B, L, N, H, C]` | block-outermost |
| `BHLNC` | `[B, H, L, N, C]` | block-outermost, heads outside layers |

Groups overlay each other from byte 0 of one backing allocation (vLLM's `KVCacheTensor`s):
in a layer-compact layout layer `k` of every group lives in the `k`-th region of
`num_blocks` pages; in a block-outermost layout block `b` is one span of `bytes_per_block`
bytes shared by the pages of every group's layers. A layer's view is its 4-D slice
`[B, H, N, C]` of that array, with the strides the layout gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hybrid_kv.planner.errors import PlanError

__all__ = [
    "DEFAULT_LAYOUT",
    "KV_CACHE_LAYOUTS",
    "KVCacheLayout",
    "LayerShape",
    "RunGeometry",
    "bytes_per_block",
    "check_expressible",
    "check_layout",
    "is_block_compact",
    "is_block_outermost",
    "is_layer_compact",
    "place_groups",
]

KVCacheLayout = Literal["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]

_L, _B, _H, _N, _C = 0, 1, 2, 3, 4
_ORDERS: dict[str, tuple[int, int, int, int, int]] = {
    "LBNHC": (_L, _B, _N, _H, _C),
    "LBHNC": (_L, _B, _H, _N, _C),
    "LHBNC": (_L, _H, _B, _N, _C),
    "BLHNC": (_B, _L, _H, _N, _C),
    "BLNHC": (_B, _L, _N, _H, _C),
    "BHLNC": (_B, _H, _L, _N, _C),
}
KV_CACHE_LAYOUTS: tuple[str, ...] = tuple(_ORDERS)
DEFAULT_LAYOUT: KVCacheLayout = "LBNHC"


def check_layout(name: object) -> KVCacheLayout:
    """The layout named `name` (case-insensitive), or `PlanError` listing the six."""
    if isinstance(name, str) and name.upper() in _ORDERS:
        return name.upper()  # type: ignore[return-value]
    raise PlanError(f"unknown KV cache layout {name!r} (choose from {', '.join(_ORDERS)})")


def is_layer_compact(layout: str) -> bool:
    """The layer axis is outermost: each layer owns one region of all its blocks."""
    return _ORDERS[layout][0] == _L


def is_block_outermost(layout: str) -> bool:
    """The block axis is outermost: each block is one span holding every layer's page."""
    return _ORDERS[layout][0] == _B


def is_block_compact(layout: str) -> bool:
    """Layers and blocks are the two outer axes, so every page is one contiguous run."""
    return set(_ORDERS[layout][:2]) == {_L, _B}


@dataclass(frozen=True)
class LayerShape:
    """One layer's page: `heads x tokens x content_bytes`, padded to `page_bytes`."""

    heads: int
    tokens: int
    content_bytes: int
    page_bytes: int

    @property
    def unpadded_bytes(self) -> int:
        return self.heads * self.tokens * self.content_bytes

    @property
    def padded(self) -> bool:
        return self.page_bytes != self.unpadded_bytes


@dataclass(frozen=True)
class RunGeometry:
    """vLLM's `KVCacheTensor`: a run of layers with one spec in one group. Layer `l` (index
    in `layer_names`) of block `b` starts at `offset + l * layer_stride + b * block_stride`;
    `view_strides` are the byte strides of each layer's `[B, H, N, C]` view."""

    group_id: int
    layer_names: tuple[str, ...]
    shape: LayerShape
    offset: int
    layer_stride: int
    block_stride: int
    view_strides: tuple[int, int, int, int]

    def layer_offset(self, index: int) -> int:
        return self.offset + index * self.layer_stride


def check_expressible(
    layout: str, groups: Sequence[Sequence[tuple[str, object, LayerShape]]]
) -> None:
    """Refuse what vLLM's layout validation refuses: several page sizes need a block-compact
    layout, and with more than one group a block-outermost one. Refuse too what vLLM 0.33
    accepts but cannot hold: in `LHBNC` a page with several heads is spread over the layer's
    region head by head, so layers tiled differently (a Mamba state beside attention, other
    head counts or page sizes) would place block `b` over other layers' blocks. Layers with
    the same head count and page size are tiled alike whatever their block and head sizes."""
    shapes = {(shape.heads, shape.page_bytes) for members in groups for _, _, shape in members}
    if layout == "LHBNC" and len(shapes) > 1 and any(heads > 1 for heads, _ in shapes):
        raise PlanError(
            "KV cache layout LHBNC puts heads outside the blocks, so layers with other head "
            "counts or page sizes would overlap each other's blocks; use LBNHC, LBHNC or a "
            "block-outermost layout"
        )
    pages = {shape.page_bytes for members in groups for _, _, shape in members}
    if len(pages) <= 1:
        return
    if not is_block_compact(layout) or (len(groups) > 1 and is_layer_compact(layout)):
        raise PlanError(
            f"KV cache layout {layout} cannot hold pages of different sizes "
            f"({', '.join(str(p) for p in sorted(pages))} B) in one pool; use BLNHC or BLHNC"
        )


def bytes_per_block(groups: Sequence[Sequence[tuple[str, object, LayerShape]]]) -> int:
    """The widest group's bytes per block: every group's block has this size."""
    return max((sum(shape.page_bytes for _, _, shape in members) for members in groups), default=0)


def place_groups(
    groups: Sequence[Sequence[tuple[str, object, LayerShape]]],
    num_blocks: int,
    layout: str,
) -> list[RunGeometry]:
    """Lay the groups out over one allocation of `num_blocks * bytes_per_block(groups)` bytes.

    `groups[g]` lists `(layer_name, spec_key, shape)` in group order; layers whose `spec_key`
    is equal form one run (one `KVCacheTensor`), in order of first appearance, as vLLM splits
    a group whose layers have different specs.
    """
    check_expressible(layout, groups)
    order = _ORDERS[layout]
    block_bytes = bytes_per_block(groups)
    block_outer = is_block_outermost(layout)
    runs: list[RunGeometry] = []
    for group_id, members in enumerate(groups):
        by_key: dict[object, list[tuple[str, LayerShape]]] = {}
        for name, key, shape in members:
            by_key.setdefault(key, []).append((name, shape))
        offset = 0
        for entries in by_key.values():
            shape = entries[0][1]
            dims = (len(entries), num_blocks, shape.heads, shape.tokens, shape.content_bytes)
            fixed_block = block_bytes if block_outer else None
            strides = _strides(dims, order, fixed_block, shape.page_bytes if shape.padded else None)
            runs.append(
                RunGeometry(
                    group_id=group_id,
                    layer_names=tuple(name for name, _ in entries),
                    shape=shape,
                    offset=offset,
                    layer_stride=strides[_L],
                    block_stride=strides[_B],
                    view_strides=(strides[_B], strides[_H], strides[_N], strides[_C]),
                )
            )
            offset += len(entries) * (shape.page_bytes if block_outer else strides[_L])
    return runs


def _strides(
    dims: tuple[int, int, int, int, int],
    order: tuple[int, ...],
    fixed_block_stride: int | None,
    padded_page: int | None,
) -> tuple[int, ...]:
    """Byte strides of the logical axes `[L, B, H, N, C]`: walk the memory order from the
    innermost axis out, each axis' stride being the extent of everything inside it. A padded
    page widens the step at the innermost of the layer and block axes to the padded size; a
    fixed block stride (block-outermost layouts) replaces the block axis' stride."""
    grid = max(order.index(_L), order.index(_B)) + 1
    if padded_page is not None and math.prod(dims[d] for d in order[:grid]) != dims[_L] * dims[_B]:
        layout = "".join("LBHNC"[d] for d in order)
        raise PlanError(
            f"KV cache layout {layout} cannot pad pages with several heads (heads sit outside "
            "the page); use LBNHC, LBHNC, BLHNC or BLNHC"
        )
    strides = [0] * 5
    extent = 1
    for position in range(len(order) - 1, -1, -1):
        axis = order[position]
        if padded_page is not None and position == grid - 1:
            extent = max(extent, padded_page)
        stride = fixed_block_stride if axis == _B and fixed_block_stride is not None else extent
        strides[axis] = stride
        extent = stride * dims[axis]
    return tuple(strides)
