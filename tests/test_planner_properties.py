"""Property tests over random layer mixes: partition, one block size for every group, measured
waste, views that never overlap in any layout, and min-waste never worse than vLLM in waste or
in requests admitted.

The waste check is independent of the planner's formula: it replays one resident request
byte by byte through the plan's placements (numpy bitmap) and counts what was written.
"""

from __future__ import annotations

import numpy as np
from hybrid_kv.planner import (
    KV_CACHE_LAYOUTS,
    KVCachePlan,
    LayerPlacement,
    PlanError,
    plan_kv_cache,
)
from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

HEADS = st.sampled_from([1, 2])
HEAD_SIZES = st.sampled_from([4, 8, 16])
DTYPES = st.sampled_from(["fp16", "fp32", "fp8"])


@st.composite
def attention_specs(draw: st.DrawFn) -> LayerSpec:
    common = {"num_kv_heads": draw(HEADS), "head_size": draw(HEAD_SIZES), "dtype": draw(DTYPES)}
    kind = draw(st.sampled_from(["full", "sw", "chunk"]))
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sw":
        return SlidingWindowSpec(**common, sliding_window=draw(st.sampled_from([1, 8, 32, 100])))
    return ChunkedLocalAttentionSpec(**common, attention_chunk_size=draw(st.sampled_from([16, 48])))


MAMBA_SPECS = st.builds(
    lambda a, b, dtype: MambaSpec(shapes=((3, a), (b,)), dtypes=(dtype, "fp32")),
    st.integers(1, 40),
    st.integers(1, 300),
    st.sampled_from(["fp16", "fp32"]),
)


@st.composite
def layer_mixes(draw: st.DrawFn) -> dict[str, LayerSpec]:
    """Up to 4 distinct specs (optionally one Mamba), 1-30 layers, some KV sharing."""
    palette = draw(st.lists(attention_specs(), min_size=1, max_size=3))
    if draw(st.booleans()):
        palette.append(draw(MAMBA_SPECS))
    choices = draw(st.lists(st.integers(0, len(palette) - 1), min_size=1, max_size=30))
    layers: dict[str, LayerSpec] = {f"l{i}": palette[c] for i, c in enumerate(choices)}
    attention = [n for n, s in layers.items() if not isinstance(s, MambaSpec)]
    num_shared = draw(st.integers(0, 3)) if attention else 0
    for j in range(num_shared):
        layers[f"shared{j}"] = KVSharingSpec(draw(st.sampled_from(attention)))
    return layers


def _first_block(spec: LayerSpec, block_size: int, length: int) -> int:
    """Index of the first block a resident request of `length` tokens still holds."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, length - (spec.sliding_window - 1)) // block_size
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return (length - 1) // chunk * chunk // block_size
    return 0


def _page_bytes(placement: LayerPlacement, block: int) -> np.ndarray:
    """Pool offsets of `placement`'s page of `block` that its view can address."""
    _, heads, tokens, content = placement.view_shape
    _, head_stride, token_stride, _ = placement.view_strides
    start = placement.offset_bytes + block * placement.block_stride_bytes
    grid = (
        np.arange(heads)[:, None, None] * head_stride
        + np.arange(tokens)[None, :, None] * token_stride
        + np.arange(content)[None, None, :]
    )
    return start + grid.ravel()


def _block_region(plan: KVCachePlan, block: int) -> np.ndarray:
    """Pool offsets of block `block`: the pages of the widest group's layers (every group's
    block spans the same bytes, padding included)."""
    widest = max(
        plan.groups, key=lambda g: sum(plan.placement(n).page_bytes for n in g.layer_names)
    )
    parts = []
    for name in widest.layer_names:
        p = plan.placement(name)
        if p.page_is_contiguous:
            start = p.offset_bytes + block * p.block_stride_bytes
            parts.append(np.arange(start, start + p.page_bytes))
        else:  # heads outside the page (LHBNC, BHLNC): pages are never padded there
            parts.append(_page_bytes(p, block))
    return np.concatenate(parts)


def _replay_request(plan: KVCachePlan, length: int) -> tuple[int, int, int]:
    """Give every group the blocks one request of `length` tokens holds, write every token
    (and Mamba state) through the placements; return (held, written, overlapping) bytes."""
    pool = np.zeros(plan.pool_bytes, dtype=np.int32)
    held = np.zeros(plan.pool_bytes, dtype=bool)
    next_block = 1  # block 0 is the null block
    for group in plan.groups:
        owners = [plan.placement(name) for name in group.layer_names]
        spec0 = owners[0].spec
        bs = group.block_size
        if isinstance(spec0, MambaSpec):
            first, count = 0, 1
        else:
            first = _first_block(spec0, bs, length)
            count = -(-length // bs) - first
        block_ids = list(range(next_block, next_block + count))
        next_block += count
        for block in block_ids:
            held[_block_region(plan, block)] = True
        for placement in owners:
            spec = placement.spec
            if isinstance(spec, MambaSpec):
                start = placement.block_range(block_ids[0])[0]
                pool[start : start + spec.state_bytes] += 1
                continue
            per_token = spec.bytes_per_token
            for token in range(first * bs, length):
                block = block_ids[token // bs - first]
                start = placement.block_range(block)[0] + (token % bs) * per_token
                pool[start : start + per_token] += 1
    written = pool > 0
    assert not (written & ~held).any(), "a layer wrote outside the blocks its group holds"
    return int(held.sum()), int(written.sum()), int((pool > 1).sum())


@settings(max_examples=150, deadline=None)
@given(
    layers=layer_mixes(),
    length=st.integers(1, 120),
    strategy=st.sampled_from(["vllm", "min-waste"]),
)
def test_reported_waste_equals_bytes_left_unwritten(
    layers: dict[str, LayerSpec], length: int, strategy: str
) -> None:
    probe = plan_kv_cache(layers, 2**40, length, strategy=strategy)
    memory = (probe.blocks_per_request + 2) * probe.block_bytes
    plan = plan_kv_cache(layers, memory, length, strategy=strategy)
    held, written, overlapping = _replay_request(plan, length)
    assert overlapping == 0, "two layers wrote the same byte"
    report = plan.waste_at(length)
    assert held == report.held_bytes
    assert held - written == report.waste_bytes


@settings(max_examples=200, deadline=None)
@given(
    layers=layer_mixes(),
    length=st.integers(1, 5000),
    strategy=st.sampled_from(["vllm", "min-waste"]),
)
def test_every_layer_is_in_exactly_one_group_and_all_groups_share_one_block_size(
    layers: dict[str, LayerSpec], length: int, strategy: str
) -> None:
    plan = plan_kv_cache(layers, 2**50, length, strategy=strategy)
    owners = [name for g in plan.groups for name in g.layer_names]
    sharing = [name for g in plan.groups for name in g.shared_layer_names]
    expected_sharing = [n for n, s in layers.items() if isinstance(s, KVSharingSpec)]
    assert sorted(owners) == sorted(set(layers) - set(expected_sharing))
    assert sorted(sharing) == sorted(expected_sharing)
    for name in expected_sharing:
        target = layers[name].target  # type: ignore[union-attr]
        assert plan.group_of(name) is plan.group_of(target)
        assert plan.placement(name).offset_bytes == plan.placement(target).offset_bytes
    for group in plan.groups:
        members = [plan.placement(n) for n in group.layer_names]
        assert len({type(p.spec).__name__ for p in members}) == 1 or group.kind == "full"
        pages = sum(p.page_bytes for p in members)
        assert pages + group.padding_bytes == plan.block_bytes, "every block has one size"
        assert all(p.used_bytes <= p.page_bytes for p in members)
        assert group.block_size % 16 == 0


@settings(max_examples=60, deadline=None)
@given(
    layers=layer_mixes(),
    length=st.integers(1, 300),
    strategy=st.sampled_from(["vllm", "min-waste"]),
    layout=st.sampled_from(KV_CACHE_LAYOUTS),
)
def test_views_stay_in_their_blocks_and_never_overlap_within_a_group(
    layers: dict[str, LayerSpec], length: int, strategy: str, layout: str
) -> None:
    try:
        probe = plan_kv_cache(layers, 2**40, length, strategy=strategy, kv_cache_layout=layout)
    except PlanError as error:
        assert "layout" in str(error) or "packs" in str(error)
        return
    memory = (probe.blocks_per_request + 2) * probe.block_bytes
    plan = plan_kv_cache(layers, memory, length, strategy=strategy, kv_cache_layout=layout)
    for block in range(plan.num_blocks):
        region = set(_block_region(plan, block).tolist())
        assert len(region) == plan.block_bytes
        for group in plan.groups:
            seen = np.zeros(plan.pool_bytes, dtype=np.int32)
            for name in group.layer_names:
                placement = plan.placement(name)
                page = _page_bytes(placement, block)
                assert page.min() >= 0 and page.max() < plan.pool_bytes
                assert set(page.tolist()) <= region, f"{name} leaves block {block}"
                np.add.at(seen, page, 1)
            assert seen.max() <= 1, f"layers of group {group.group_id} overlap"


@settings(max_examples=200, deadline=None)
@given(
    layers=layer_mixes(), length=st.integers(1, 200_000), layout=st.sampled_from(["LBNHC", "BLNHC"])
)
def test_min_waste_never_wastes_more_than_vllm_nor_admits_fewer_requests(
    layers: dict[str, LayerSpec], length: int, layout: str
) -> None:
    options = {"reference_len": length, "kv_cache_layout": layout}
    try:
        vllm = plan_kv_cache(layers, 2**60, length, strategy="vllm", **options)
    except PlanError as error:
        assert "packs" in str(error)  # vLLM packs these pages side by side: not reproduced
        assume(False)
        return
    ours = plan_kv_cache(layers, 2**60, length, **options)
    assert ours.waste.waste_fraction <= vllm.waste.waste_fraction
    assert ours.num_blocks * vllm.blocks_per_request >= vllm.num_blocks * ours.blocks_per_request
    attention = [g for g in ours.groups if g.kind != "mamba"]
    assert len(attention) <= len([g for g in vllm.groups if g.kind != "mamba"]) + 4
