"""Torch buffers for a `KVCachePlan` and per-layer views. The only module that imports torch.

One `int8` backing allocation of `plan.num_blocks * plan.block_bytes` bytes holds every
layer (with pipeline stages, one stage's pool holds that stage's layers); each layer's view
is a strided view of it with exactly the shape, strides and storage offset vLLM 0.33 gives
the same plan in the same layout (`plan.kv_cache_layout`), so the views can be handed to
vLLM's attention backends:

* attention: `[num_blocks, num_kv_heads, block_size, head_size + head_size_v]` in the KV
  dtype, K and V side by side in the last axis (strides from the layout);
* MLA: `[num_blocks, 1, block_size, head_size]`;
* Mamba: the raw `int8` page `[num_blocks, 1, 1, state_bytes]`, and in `mamba_states` one
  `[num_blocks, *shape]` view per state (conv, SSM), unpacked as vLLM's Mamba layers do;
* KV-sharing layers: their target's view (the same object).

Views of groups that share block ids alias the same memory exactly as the plan says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "hybrid_kv.buffers needs torch: pip install 'hybrid-kv[torch]'", name="torch"
    ) from error

from hybrid_kv import _core
from hybrid_kv.planner import KVCachePlan, LayerPlacement, PlanError
from hybrid_kv.planner.memory import format_bytes
from hybrid_kv.specs import DTYPE_SIZES, MambaSpec

__all__ = ["KVCacheBuffers", "allocate_kv_cache", "default_device", "torch_dtype"]

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
    """The allocated pool (`int8`), every layer's cache view, and the Mamba layers' states."""

    plan: KVCachePlan
    pool: torch.Tensor
    views: Mapping[str, torch.Tensor]
    mamba_states: Mapping[str, tuple[torch.Tensor, ...]]

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def layer_view(self, layer_name: str) -> torch.Tensor:
        return self.views[layer_name]


def allocate_kv_cache(
    plan: KVCachePlan,
    device: str | torch.device | None = None,
    *,
    zero: bool = True,
    stage: int | None = None,
) -> KVCacheBuffers:
    """Allocate the plan's memory on `device` (default `default_device()`; `"meta"` allocates
    nothing) and build the per-layer views. `zero` fills the pool with zeros (Mamba states
    must start from zero). A plan with pipeline stages is allocated one stage at a time, as
    each stage's GPU holds its own layers: `stage` picks it (with one stage, 0 or None).

    On the CPU, a pool larger than the memory the kernel can hand out (`MemAvailable` plus
    `SwapFree`, within the process's cgroup limits, where Linux tells) is a `MemoryError`
    before anything is allocated: under Linux's default overcommit a pool that fits the machine
    but not its free memory would be granted, and filling it could wake the OOM killer. On a
    GPU, torch's allocator refuses for itself.

    A plan whose views do not fit it (a view outside the stage's pool, with another block count
    than `num_blocks`, not four axes of non-negative ints, splitting an element of its dtype, a
    Mamba state past its page, a KV-sharing layer whose target the stage lacks), as a plan edited
    by hand may be, is a `PlanError` naming the layer, before anything is allocated."""
    if not isinstance(plan, KVCachePlan):
        raise TypeError(f"allocate_kv_cache needs a KVCachePlan, got {type(plan).__name__}")
    stages = max(len(plan.stages), 1)
    if stage is None:
        if stages > 1:
            raise ValueError(
                f"the plan has {stages} pipeline stages, each with its own pool: give stage= "
                f"(0 to {stages - 1})"
            )
        stage = 0
    elif isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be an int in 0..{stages - 1}, got {stage!r}")
    pool_bytes = plan.stages[stage].pool_bytes if plan.stages else plan.pool_bytes
    _check_views(plan, stage, pool_bytes)
    device = default_device() if device is None else torch.device(device)
    if pool_bytes >= 2**63:
        # torch sizes tensors with signed 64-bit counts (no device holds this much anyway).
        raise ValueError(
            f"the KV cache pool of {format_bytes(pool_bytes)} is beyond what a torch "
            "tensor can size (2**63 bytes): plan a smaller budget"
        )
    if device.type == "cpu":
        available = _core._available_memory()
        if available is not None and pool_bytes > available:
            raise MemoryError(
                f"the KV cache pool needs {format_bytes(pool_bytes)} on the CPU, but only "
                f"{format_bytes(available)} can be allocated (MemAvailable plus SwapFree, within "
                "the cgroup's limit): plan a smaller budget or allocate it on a GPU"
            )
    pool = torch.empty(pool_bytes, dtype=torch.int8, device=device)
    if zero and device.type != "meta":
        pool.zero_()
    views: dict[str, torch.Tensor] = {}
    states: dict[str, tuple[torch.Tensor, ...]] = {}
    for placement in plan.placements:
        if placement.shared_from is not None or placement.stage != stage:
            continue
        view = _layer_view(pool, placement)
        views[placement.layer_name] = view
        if isinstance(placement.spec, MambaSpec):
            states[placement.layer_name] = _mamba_states(view, placement.spec)
    for placement in plan.placements:
        if placement.shared_from is not None and placement.stage == stage:
            views[placement.layer_name] = views[placement.shared_from]
    return KVCacheBuffers(plan, pool, views, states)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_views(plan: KVCachePlan, stage: int, pool_bytes: int) -> None:
    """Every view `allocate_kv_cache` would build for `stage` lies in its pool of `pool_bytes`
    bytes, has one page per block of the plan and reads whole elements of its dtype; every
    KV-sharing layer's target is a layer of the stage with a view. A `PlanError` otherwise
    (torch checks no bounds on `meta`, and elsewhere raises untyped errors or aliases another
    layer's memory without a word)."""
    if not _is_count(pool_bytes) or not _is_count(plan.num_blocks):
        raise PlanError(
            f"the plan's pool of stage {stage} ({pool_bytes!r} bytes) and num_blocks "
            f"({plan.num_blocks!r}) must be non-negative ints"
        )
    owners = {
        p.layer_name
        for p in plan.placements
        if p.shared_from is None and p.stage == stage and isinstance(p.layer_name, str)
    }
    for placement in plan.placements:
        if placement.stage != stage:
            continue
        name = placement.layer_name
        if placement.shared_from is not None:
            if placement.shared_from not in owners:
                raise PlanError(
                    f"{name}: shares the cache of {placement.shared_from!r}, which has no view "
                    f"in stage {stage}"
                )
            continue
        shape, strides = placement.view_shape, placement.view_strides
        offset = placement.offset_bytes
        for field, value in (("view_shape", shape), ("view_strides", strides)):
            if not isinstance(value, (tuple, list)) or len(value) != 4:
                raise PlanError(f"{name}: {field} must hold 4 ints, got {value!r}")
            if not all(_is_count(v) for v in value):
                raise PlanError(f"{name}: {field} must be non-negative ints, got {value!r}")
        if not _is_count(offset):
            raise PlanError(f"{name}: offset_bytes must be a non-negative int, got {offset!r}")
        if shape[0] != plan.num_blocks:
            raise PlanError(
                f"{name}: its view has {shape[0]} blocks, the plan's pool {plan.num_blocks}"
            )
        end = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
        if all(shape) and end > pool_bytes:
            raise PlanError(
                f"{name}: its view ends at byte {end}, outside the pool of {pool_bytes} bytes"
            )
        spec = placement.spec
        if strides[3] != 1:
            raise PlanError(f"{name}: view_strides must end in 1 (bytes), got {strides!r}")
        if isinstance(spec, MambaSpec):
            if spec.state_bytes > shape[3]:
                raise PlanError(
                    f"{name}: its Mamba state of {spec.state_bytes} bytes does not fit its page "
                    f"view of {shape[3]} bytes"
                )
            continue
        dtype = spec.dtype  # type: ignore[union-attr]
        size = DTYPE_SIZES[dtype]
        if offset % size or shape[3] % size or any(s % size for s in strides[:3]):
            raise PlanError(
                f"{name}: offset {offset}, strides {strides} or shape {shape} split elements "
                f"of the {dtype} element size {size}"
            )


def _layer_view(pool: torch.Tensor, placement: LayerPlacement) -> torch.Tensor:
    """vLLM's per-layer view: the `[B, H, N, C]` byte view, reinterpreted in the KV dtype
    (`_check_views` checked it fits)."""
    raw = pool.as_strided(placement.view_shape, placement.view_strides, placement.offset_bytes)
    spec = placement.spec
    if isinstance(spec, MambaSpec):
        return raw
    return raw.view(torch_dtype(spec.dtype))  # type: ignore[union-attr]


def _mamba_states(page: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """Unpack a `[B, 1, 1, C]` page view into one `[B, *shape]` view per state."""
    rows = page.squeeze(2).squeeze(1)
    result = []
    for shape, dtype, offset in zip(spec.shapes, spec.dtypes, spec.state_offsets, strict=True):
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * DTYPE_SIZES[dtype]
        state = rows[:, offset : offset + nbytes].view(torch_dtype(dtype))
        result.append(state.view(-1, *shape))
    return tuple(result)
