"""Property tests over random layer mixes: partition, one page size, measured waste, and
min-waste never worse than vLLM.

The waste check is independent of the planner's formula: it replays one resident request
byte by byte through the plan's placements (numpy bitmap) and counts what was written.
"""

from __future__ import annotations

import numpy as np
from hybrid_kv.planner import KVCachePlan, plan_kv_cache
from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from hypothesis import given, settings
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
    lambda a, b, dtype: MambaSpec(shapes=((a, 3), (b,)), dtypes=(dtype, "fp32")),
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
            for buffer in plan.buffers:
                start = buffer.offset_bytes + block * buffer.block_stride_bytes
                held[start : start + buffer.slice_bytes] = True
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
    assert held == plan.waste.held_bytes
    assert held - written == plan.waste.waste_bytes


@settings(max_examples=200, deadline=None)
@given(
    layers=layer_mixes(),
    length=st.integers(1, 5000),
    strategy=st.sampled_from(["vllm", "min-waste"]),
)
def test_every_layer_is_in_exactly_one_group_and_all_groups_share_one_page_size(
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
    assert plan.block_bytes == plan.num_buffers * plan.slice_bytes
    for group in plan.groups:
        members = [plan.placement(n) for n in group.layer_names]
        assert len({type(p.spec) for p in members}) == 1
        assert len({p.spec for p in members}) == 1, "a group mixes specs"
        slots = sum(len(p.buffers) for p in members) + group.num_padding_slots
        assert slots == plan.num_buffers, "every group spans the same page"
        assert all(p.used_bytes <= p.slice_bytes for p in members)
        assert group.block_size % 16 == 0


@settings(max_examples=200, deadline=None)
@given(layers=layer_mixes(), length=st.integers(1, 200_000))
def test_min_waste_never_wastes_more_than_vllm(layers: dict[str, LayerSpec], length: int) -> None:
    ours = plan_kv_cache(layers, 2**60, length)
    vllm = plan_kv_cache(layers, 2**60, length, strategy="vllm")
    assert ours.waste.waste_fraction <= vllm.waste.waste_fraction
    assert ours.num_groups <= vllm.num_groups + 4
