"""Torch buffers: view shapes, meta allocation, and byte-level checks that every (layer, block)
slice lies in its buffer, live slices never overlap and padding is where the plan says."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from hybrid_kv.buffers import allocate_kv_cache  # noqa: E402
from hybrid_kv.catalogue import load_model  # noqa: E402
from hybrid_kv.planner import KVCachePlan, plan_kv_cache  # noqa: E402
from hybrid_kv.specs import (  # noqa: E402
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)


def _full(dtype: str = "fp16") -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=2, head_size=8, dtype=dtype)


def _sw(window: int = 32) -> SlidingWindowSpec:
    return SlidingWindowSpec(num_kv_heads=2, head_size=8, dtype="fp16", sliding_window=window)


MIXES: dict[str, dict[str, LayerSpec]] = {
    "sw+full+sharing": {
        **{f"f{i}": _full() for i in range(3)},
        **{f"s{i}": _sw() for i in range(4)},
        "x0": KVSharingSpec("f0"),
    },
    "mamba-option-a": {
        "a0": _full(),
        "a1": _full(),
        "m0": MambaSpec(shapes=((4, 3), (20,)), dtypes=("fp16", "fp32")),
        "m1": MambaSpec(shapes=((4, 3), (20,)), dtypes=("fp16", "fp32")),
        "m2": MambaSpec(shapes=((4, 3), (20,)), dtypes=("fp16", "fp32")),
    },
    "mamba-option-b": {
        **{
            f"a{i}": FullAttentionSpec(num_kv_heads=1, head_size=16, dtype="fp16") for i in range(8)
        },
        "m": MambaSpec(shapes=((1024,),), dtypes=("fp32",)),
    },
    "mla": {"mla0": MLAAttentionSpec(head_size=24), "mla1": MLAAttentionSpec(head_size=24)},
}


def _plan(layers: dict[str, LayerSpec], length: int = 40, extra_blocks: int = 3) -> KVCachePlan:
    probe = plan_kv_cache(layers, 2**40, length)
    return plan_kv_cache(
        layers, (probe.blocks_per_request + extra_blocks) * probe.block_bytes, length
    )


def _tensors(view: object) -> list[torch.Tensor]:
    return list(view) if isinstance(view, tuple) else [view]  # type: ignore[list-item]


def _touched(buffers: object, layer: str, block: int) -> set[int]:
    """Pool byte offsets written when filling `layer`'s slice of `block` through its view."""
    pool = buffers.pool  # type: ignore[attr-defined]
    pool.zero_()
    for tensor in _tensors(buffers.layer_view(layer)):  # type: ignore[attr-defined]
        tensor[block].view(torch.uint8).fill_(0xFF)
    return set(torch.nonzero(pool).flatten().tolist())


def test_attention_view_shape_and_dtype() -> None:
    plan = _plan(MIXES["sw+full+sharing"])
    buffers = allocate_kv_cache(plan, "cpu")
    view = buffers.layer_view("f0")
    assert view.shape == (plan.num_blocks, 2, 16, 2, 8)
    assert view.dtype == torch.float16
    assert buffers.layer_view("x0") is view
    assert all(b.shape == (plan.num_blocks, plan.slice_bytes) for b in buffers.buffers)


def test_mla_and_mamba_view_shapes() -> None:
    plan = _plan(MIXES["mla"])
    assert allocate_kv_cache(plan, "cpu").layer_view("mla0").shape == (plan.num_blocks, 16, 24)
    plan = _plan(MIXES["mamba-option-a"])
    conv, ssm = allocate_kv_cache(plan, "cpu").layer_view("m0")
    assert (conv.shape, conv.dtype) == ((plan.num_blocks, 4, 3), torch.float16)
    assert (ssm.shape, ssm.dtype) == ((plan.num_blocks, 20), torch.float32)


def test_meta_device_plans_a_27b_model_without_memory() -> None:
    model = load_model("gemma-3-27b")
    plan = plan_kv_cache(model.layers, 60 * 2**30, 131072)
    buffers = allocate_kv_cache(plan, "meta")
    assert buffers.pool.numel() == plan.pool_bytes > 50 * 2**30
    assert buffers.layer_view("model.layers.5").shape == (plan.num_blocks, 2, 16, 16, 128)


def test_default_device_is_cpu_without_cuda() -> None:
    plan = _plan(MIXES["mla"])
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert allocate_kv_cache(plan).device.type == expected


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_slices_stay_in_their_buffers_and_live_slices_never_overlap(mix: str) -> None:
    plan = _plan(MIXES[mix])
    buffers = allocate_kv_cache(plan, "cpu")
    owners = [p for p in plan.placements if p.shared_from is None]
    touched = {}
    for placement, block in itertools.product(owners, range(plan.num_blocks)):
        region = _touched(buffers, placement.layer_name, block)
        allowed = set()
        for index in placement.buffers:
            buffer = plan.buffers[index]
            start = buffer.offset_bytes + block * buffer.block_stride_bytes
            allowed |= set(range(start, start + buffer.slice_bytes))
        assert region and region <= allowed, f"{placement.layer_name} block {block}"
        assert len(region) == placement.used_bytes
        touched[placement.layer_name, block] = (placement.group_id, region)
    for (key_a, (group_a, a)), (key_b, (group_b, b)) in itertools.combinations(touched.items(), 2):
        # Different groups never hold the same block id at once; everything else is live.
        if group_a != group_b and key_a[1] == key_b[1]:
            continue
        assert not (a & b), f"{key_a} overlaps {key_b}"


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_padding_is_where_the_plan_says(mix: str) -> None:
    length = 40
    plan = _plan(MIXES[mix], length)
    buffers = allocate_kv_cache(plan, "cpu")
    pool = buffers.pool
    next_block = 1
    held = torch.zeros_like(pool, dtype=torch.bool)
    for group in plan.groups:
        count = group.blocks_held(length)
        block_ids = list(range(next_block, next_block + count))
        next_block += count
        for block, buffer in itertools.product(block_ids, plan.buffers):
            start = buffer.offset_bytes + block * buffer.block_stride_bytes
            held[start : start + buffer.slice_bytes] = True
        first = -(-length // group.block_size) - count  # first block index still held
        for name in group.layer_names:
            for tensor in _tensors(buffers.layer_view(name)):
                as_bytes = tensor.view(torch.uint8)
                if plan.placement(name).spec.kind == "mamba":
                    as_bytes[block_ids[0]].fill_(0xFF)
                    continue
                # Fill token positions [first * bs, length) of the held blocks.
                flat = [as_bytes[b] for b in block_ids]
                for token in range(first * group.block_size, length):
                    block_tensor = flat[token // group.block_size - first]
                    index = token % group.block_size
                    if tensor.dim() == 5:  # [blocks, 2, bs, heads, head]
                        block_tensor[:, index].fill_(0xFF)
                    else:
                        block_tensor[index].fill_(0xFF)
    unwritten = int((held & (pool == 0)).sum())
    assert int(held.sum()) == plan.waste.held_bytes
    assert unwritten == plan.waste.waste_bytes
    assert int(((pool != 0) & ~held).sum()) == 0
