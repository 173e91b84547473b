"""Planner: DESIGN.md worked examples, vLLM 0.33 grouping, min-waste choices, pool sizing."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from hybrid_kv.planner import (
    InsufficientMemoryError,
    PlanError,
    blocks_held,
    parse_memory,
    plan_kv_cache,
)
from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
    SpecError,
)

HUGE = 2**50


def full(heads: int = 8, head: int = 128, dtype: str = "bf16") -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=heads, head_size=head, dtype=dtype)


def sw(window: int, heads: int = 8, head: int = 128, dtype: str = "bf16") -> SlidingWindowSpec:
    return SlidingWindowSpec(num_kv_heads=heads, head_size=head, dtype=dtype, sliding_window=window)


def model(*parts: tuple[str, LayerSpec, int]) -> dict[str, LayerSpec]:
    """Layers named `<prefix>.<i>`, in the order given."""
    return {f"{prefix}.{i}": spec for prefix, spec, n in parts for i in range(n)}


def gemma3_27b() -> dict[str, LayerSpec]:
    """62 layers, full attention at i % 6 == 5 (52 sw + 10 full), window 1024."""
    return {f"l{i}": full(16) if i % 6 == 5 else sw(1024, 16) for i in range(62)}


def kinds(plan: object) -> list[tuple[str, int]]:
    return [(g.kind, len(g.layer_names)) for g in plan.groups]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- DESIGN.md


def test_design_worked_example_112_tokens_hold_11_blocks() -> None:
    # 10 full + 20 sw, block 16, window 32: 3 groups of 10; a 112-token request holds 7 full
    # blocks and 2 per sw group.
    layers = model(("full", full(), 10), ("sw", sw(32), 20))
    plan = plan_kv_cache(layers, HUGE, 112, strategy="vllm")
    assert sorted(kinds(plan)) == [("full", 10), ("sliding_window", 10), ("sliding_window", 10)]
    assert [g.blocks_held(112) for g in plan.groups] == [7, 2, 2]
    assert plan.blocks_per_request == 11
    assert plan.num_buffers == 10
    assert plan.num_padding_slots == 0


def test_design_memory_layout_buffer_zero_is_shared_by_the_first_layer_of_each_group() -> None:
    layers = model(("full", full(), 10), ("sw", sw(32), 20))
    plan = plan_kv_cache(layers, HUGE, 112, strategy="vllm")
    assert len(plan.buffers) == 10
    # vLLM assigns strided: sw groups are sw[0::2] and sw[1::2].
    assert set(plan.buffers[0].layer_names) == {"full.0", "sw.0", "sw.1"}
    assert plan.block_bytes == 10 * 16 * full().bytes_per_token


def test_uniform_model_is_one_group_without_padding() -> None:
    layers = model(("l", full(), 32))
    for strategy in ("vllm", "min-waste"):
        plan = plan_kv_cache(layers, HUGE, 4096, strategy=strategy)
        assert kinds(plan) == [("full", 32)]
        assert plan.waste.waste_bytes == 0


# ----------------------------------------------------------------------------- vLLM grouping


def test_vllm_gemma3_27b_uses_strided_groups_of_9_9_9_9_8_8_and_10_full() -> None:
    plan = plan_kv_cache(gemma3_27b(), HUGE, 1024, strategy="vllm")
    assert kinds(plan) == [("sliding_window", n) for n in (9, 9, 9, 9, 8, 8)] + [("full", 10)]
    sw_layers = [f"l{i}" for i in range(62) if i % 6 != 5]
    assert plan.groups[0].layer_names == tuple(sw_layers[0::6])
    assert plan.num_padding_slots == 8


def test_vllm_20_full_30_sw_uses_group_size_20() -> None:
    layers = model(("full", full(), 20), ("sw", sw(128), 30))
    plan = plan_kv_cache(layers, HUGE, 4096, strategy="vllm")
    assert kinds(plan) == [("full", 20), ("sliding_window", 15), ("sliding_window", 15)]
    assert plan.num_padding_slots == 10


def test_vllm_uses_the_largest_count_below_1_5_times_the_smallest() -> None:
    # gpt-oss + EAGLE: 12 sw + 13 full -> groups of 13.
    layers = model(("sw", sw(128), 12), ("full", full(), 13))
    plan = plan_kv_cache(layers, HUGE, 4096, strategy="vllm")
    assert kinds(plan) == [("sliding_window", 12), ("full", 13)]
    assert plan.num_buffers == 13


def test_vllm_jamba_block_size_is_80() -> None:
    # Mamba-1 state (8192*3 + 8192*16) * 2 B = 311296 B; attention 4096 B/token:
    # 16 * ceil(311296 / (16 * 4096)) = 80.
    mamba = MambaSpec.mamba1(intermediate_size=8192, state_size=16, conv_kernel=4)
    layers = {f"l{i}": full() if i % 8 == 4 else mamba for i in range(32)}
    plan = plan_kv_cache(layers, HUGE, 4096, strategy="vllm")
    assert {g.block_size for g in plan.groups} == {80}
    assert plan.slice_bytes == 80 * 4096
    assert kinds(plan) == [("mamba", 4)] * 7 + [("full", 4)]


def test_vllm_bamba_block_size_is_528() -> None:
    mamba = MambaSpec.mamba2(
        intermediate_size=8192,
        n_groups=1,
        num_heads=128,
        head_dim=64,
        state_size=128,
        conv_kernel=4,
    )
    layers = {f"l{i}": full() if i in (9, 18, 27) else mamba for i in range(32)}
    plan = plan_kv_cache(layers, HUGE, 4096, strategy="vllm")
    assert {g.block_size for g in plan.groups} == {528}
    # The Mamba state is padded up to one attention page.
    mamba_layer = plan.placement("l0")
    assert (mamba_layer.slice_bytes, mamba_layer.used_bytes) == (528 * 4096, 2147840)


def test_unify_grows_block_size_when_pages_divide() -> None:
    # vllm-semantics §2.2: bs16, 2 heads, fp32: full hs64 + SWA hs32 -> SWA becomes bs32.
    layers = {"a": full(2, 64, "fp32"), "b": sw(64, 2, 32, "fp32")}
    plan = plan_kv_cache(layers, HUGE, 256, strategy="vllm")
    assert {g.kind: g.block_size for g in plan.groups} == {"full": 16, "sliding_window": 32}
    assert plan.slice_bytes == 16384
    assert any("block size 32" in reason for reason in plan.reasons)


def test_unify_pads_when_pages_do_not_divide() -> None:
    # full hs64 (16384 B) + SWA hs96 (24576 B): full padded to 24576.
    layers = {"a": full(2, 64, "fp32"), "b": sw(64, 2, 96, "fp32")}
    plan = plan_kv_cache(layers, 64 * 24576, 256, strategy="vllm")
    assert plan.slice_bytes == 24576
    assert plan.placement("a").used_bytes == 16384
    assert plan.num_blocks == 64
    assert any("padded from 16384 B to 24576 B" in reason for reason in plan.reasons)


# ----------------------------------------------------------------------------- waste metric


def test_waste_counts_the_unfilled_tail_of_every_groups_last_block() -> None:
    # DESIGN toy case: 1 full + 3 sw, block 16, window 32, 40 tokens: every layer holds
    # 3 blocks (48 slots) for 40 tokens -> 8 of 48 slots unused in each layer.
    layers = {"f": full(), "s0": sw(32), "s1": sw(32), "s2": sw(32)}
    plan = plan_kv_cache(layers, HUGE, 40, strategy="vllm")
    assert plan.waste.waste_fraction == Fraction(8, 48)
    assert plan.waste.tail_bytes == plan.waste.waste_bytes


def test_padding_a_full_group_costs_more_than_padding_a_sliding_group() -> None:
    # 3 full + 4 sw (window 32): vLLM's width 4 (4 < 1.5 * 3) pads the full group; width 3
    # pads two sw slots instead, which hold 2-3 blocks at 4096 tokens instead of 256.
    layers = model(("full", full(), 3), ("sw", sw(32), 4))
    vllm = plan_kv_cache(layers, HUGE, 4096, strategy="vllm")
    assert vllm.groups[0].num_padding_slots == 1 and vllm.groups[0].kind == "full"
    ours = plan_kv_cache(layers, HUGE, 4096)
    assert all(g.num_padding_slots == 0 for g in ours.groups if g.kind == "full")
    assert ours.num_buffers == 3
    assert ours.waste.waste_fraction < vllm.waste.waste_fraction


# ----------------------------------------------------------------------------- min-waste


def test_min_waste_20_full_30_sw_has_no_padding() -> None:
    layers = model(("full", full(), 20), ("sw", sw(128), 30))
    plan = plan_kv_cache(layers, HUGE, 4096)
    assert plan.num_padding_slots == 0
    assert plan.num_buffers == 10
    assert plan.waste.waste_bytes == 0


def test_min_waste_gemma3_at_1024_tokens_pads_3_slots_instead_of_8() -> None:
    ours = plan_kv_cache(gemma3_27b(), HUGE, 131072, reference_len=1024)
    vllm = plan_kv_cache(gemma3_27b(), HUGE, 131072, strategy="vllm", reference_len=1024)
    # At 1024 tokens every group holds 64 blocks, so waste = padding slots / all slots.
    assert vllm.waste.waste_fraction == Fraction(8, 70)
    assert ours.waste.waste_fraction == Fraction(3, 65)
    assert ours.num_buffers == 13 and ours.num_padding_slots == 3


def test_min_waste_gemma3_at_128k_keeps_padding_out_of_the_full_group() -> None:
    ours = plan_kv_cache(gemma3_27b(), HUGE, 131072)
    full_groups = [g for g in ours.groups if g.kind == "full"]
    assert full_groups and all(g.num_padding_slots == 0 for g in full_groups)
    vllm = plan_kv_cache(gemma3_27b(), HUGE, 131072, strategy="vllm")
    assert ours.waste.waste_fraction <= vllm.waste.waste_fraction


def test_min_waste_respects_the_group_cap() -> None:
    layers = model(("full", full(), 20), ("sw", sw(128), 30))
    capped = plan_kv_cache(layers, HUGE, 4096, max_groups=3)
    assert capped.num_groups <= 3
    with pytest.raises(PlanError, match="max_groups=1"):
        plan_kv_cache(layers, HUGE, 4096, max_groups=1)


def test_min_waste_reports_both_mamba_options() -> None:
    mamba = MambaSpec.mamba1(intermediate_size=8192, state_size=16, conv_kernel=4)
    layers = {f"l{i}": full() if i % 8 == 4 else mamba for i in range(32)}
    plan = plan_kv_cache(layers, HUGE, 4096)
    labels = {a.label for a in plan.alternatives}
    assert {"mamba-option-A", "mamba-option-B", "vllm"} <= labels
    option_b = next(a for a in plan.alternatives if a.label == "mamba-option-B")
    assert option_b.attention_block_size < 80
    assert any("option A" in r for r in plan.reasons) and any("option B" in r for r in plan.reasons)
    best = min(a.waste.waste_fraction for a in plan.alternatives)
    assert plan.waste.waste_fraction == best


def test_mamba_option_b_spreads_a_state_over_several_slices() -> None:
    # 8 attention layers of 64 B/token and one 4096 B state: option A needs block 64 (a
    # 64-token tail risk); option B with block 16 puts the state over 4 slices of 1024 B.
    mamba = MambaSpec(shapes=((1024,),), dtypes=("fp32",))
    layers = {f"a{i}": full(1, 16, "fp16") for i in range(8)} | {"m": mamba}
    plan = plan_kv_cache(layers, HUGE, 16)
    assert plan.attention_block_size == 16
    assert plan.layout == "block_outer"
    assert plan.placement("m").buffers == (0, 1, 2, 3)
    assert (
        plan.waste.waste_fraction
        < plan_kv_cache(layers, HUGE, 16, strategy="vllm").waste.waste_fraction
    )


def test_mamba_block_sizes_stay_multiples_of_the_alignment() -> None:
    mamba = MambaSpec(shapes=((1000,),), dtypes=("fp32",))
    layers = {"a0": full(1, 16, "fp16"), "a1": full(1, 16, "fp16"), "m": mamba}
    for alignment in (16, 32):
        plan = plan_kv_cache(layers, HUGE, 256, block_size=32, alignment=alignment)
        assert all(g.block_size % alignment == 0 for g in plan.groups)


# ----------------------------------------------------------------------------- sharing


def test_kv_sharing_layers_get_no_memory_and_map_onto_their_target() -> None:
    layers: dict[str, LayerSpec] = {
        "l0": sw(512),
        "l1": full(),
        "l2": KVSharingSpec("l0"),
        "l3": KVSharingSpec("l1"),
    }
    with_sharing = plan_kv_cache(layers, HUGE, 1024)
    without = plan_kv_cache({"l0": sw(512), "l1": full()}, HUGE, 1024)
    assert with_sharing.block_bytes == without.block_bytes
    assert with_sharing.num_blocks == without.num_blocks
    assert with_sharing.kv_sharing == {"l2": "l0", "l3": "l1"}
    shared, target = with_sharing.placement("l2"), with_sharing.placement("l0")
    assert (shared.offset_bytes, shared.buffers, shared.group_id) == (
        target.offset_bytes,
        target.buffers,
        target.group_id,
    )
    assert with_sharing.group_of("l3").shared_layer_names == ("l3",)


def test_spec_errors_name_the_layer() -> None:
    with pytest.raises(SpecError, match="'l1'"):
        plan_kv_cache({"l0": full(), "l1": KVSharingSpec("ghost")}, HUGE, 16)


# ----------------------------------------------------------------------------- chunked local


def test_chunked_local_holds_only_the_current_chunk() -> None:
    assert blocks_held("chunked_local", 16, 8192 + 40, attention_chunk_size=8192) == 3
    assert blocks_held("chunked_local", 16, 8192, attention_chunk_size=8192) == 512
    assert blocks_held("full", 16, 8192 + 40) == 515
    assert blocks_held("sliding_window", 16, 112, sliding_window=32) == 2
    assert blocks_held("mamba", 528, 10**6) == 1


def test_llama4_style_chunked_plus_full_groups_3_to_1() -> None:
    chunked = ChunkedLocalAttentionSpec(num_kv_heads=8, head_size=128, attention_chunk_size=8192)
    layers = {f"l{i}": full() if i % 4 == 3 else chunked for i in range(48)}
    plan = plan_kv_cache(layers, HUGE, 65536)
    assert kinds(plan) == [("chunked_local", 12)] * 3 + [("full", 12)]
    assert plan.groups[0].attention_chunk_size == 8192


# ----------------------------------------------------------------------------- pool sizing


def test_pool_reserves_the_null_block() -> None:
    # vllm-semantics §2.4: 512-token max len, block 16 -> 32 blocks; 32 blocks of memory
    # fail, 33 fit.
    layers = {"l0": full()}
    page = 16 * full().bytes_per_token
    with pytest.raises(InsufficientMemoryError, match=rf"needs 32 blocks.*= {33 * page} bytes"):
        plan_kv_cache(layers, 32 * page, 512)
    plan = plan_kv_cache(layers, 33 * page, 512)
    assert plan.num_blocks == 33
    assert plan.max_concurrency == 1.0


def test_num_blocks_is_budget_divided_by_page_and_concurrency_counts_windows() -> None:
    layers = model(("full", full(), 10), ("sw", sw(32), 20))
    page = 10 * 16 * full().bytes_per_token
    plan = plan_kv_cache(layers, 1000 * page + page // 2, 112, strategy="vllm")
    assert plan.num_blocks == 1000
    assert plan.max_concurrency == pytest.approx(999 / 11)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "best"}, "unknown strategy"),
        ({"block_size": 24}, "multiple of the kernel alignment"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"reference_len": 0}, "reference_len must be >= 1"),
        ({"max_groups": 0}, "max_groups must be >= 1"),
    ],
)
def test_bad_arguments_raise_plan_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_kv_cache({"l0": full()}, HUGE, 128, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- misc


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GiB", 40 * 2**30),
        ("40 gib", 40 * 2**30),
        ("512MiB", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("2G", 2 * 2**30),
        ("4096", 4096),
        ("4096B", 4096),
        (123, 123),
    ],
)
def test_parse_memory(text: str | int, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "40XB", "-1GiB", "0", "GiB", "1iB", "0.1B"])
def test_parse_memory_rejects_bad_strings(text: str) -> None:
    with pytest.raises(PlanError):
        parse_memory(text)


def test_plan_round_trips_through_json() -> None:
    plan = plan_kv_cache(gemma3_27b(), HUGE, 4096)
    document = json.loads(plan.to_json())
    assert document["num_blocks"] == plan.num_blocks
    assert [g["kind"] for g in document["groups"]] == [g.kind for g in plan.groups]
    assert document["groups"][0]["sliding_window"] == 1024
    assert "sliding_window" not in document["groups"][-1]
    assert document["waste"]["waste_bytes"] == plan.waste.waste_bytes


def test_importing_the_planner_does_not_import_torch_or_matplotlib() -> None:
    code = (
        "import sys, hybrid_kv, hybrid_kv.specs, hybrid_kv.planner, hybrid_kv.catalogue, "
        "hybrid_kv.cli; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]
