"""Planner: DESIGN.md worked examples, vLLM 0.33 grouping and admission, min-waste choices
under the capacity rule, Mamba options, uniform-type groups, layouts, pool sizing."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from hybrid_kv.catalogue import list_presets, load_model
from hybrid_kv.planner import (
    PLAN_SCHEMA_VERSION,
    InFlight,
    InsufficientMemoryError,
    LengthDistribution,
    PlanError,
    admission_blocks,
    blocks_held,
    kv_cache_budget,
    parse_memory,
    plan_kv_cache,
)
from hybrid_kv.planner.inflight import V1_PP_ASYNC_NOTE
from hybrid_kv.planner.stages import pp_partition
from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecError,
)

HUGE = 2**40  # budgets that bind nothing (block counts stay within int32 ids)
GIB = 2**30


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


def jamba() -> dict[str, LayerSpec]:
    mamba = MambaSpec.mamba1(intermediate_size=8192, state_size=16, conv_kernel=4)
    return {f"l{i}": full() if i % 8 == 4 else mamba for i in range(32)}


def bamba() -> dict[str, LayerSpec]:
    mamba = MambaSpec.mamba2(
        intermediate_size=8192,
        n_groups=1,
        num_heads=128,
        head_dim=64,
        state_size=128,
        conv_kernel=4,
    )
    return {f"l{i}": full() if i in (9, 18, 27) else mamba for i in range(32)}


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
    assert plan.blocks_held(112) == 11
    # vLLM reserves more to admit it: the window plus the tokens in flight, + 1 per sw group.
    assert plan.blocks_per_request == 7 + 2 * (-(-min(31 + 2048, 112) // 16) + 1)
    assert plan.num_padding_slots == 0


def test_design_memory_layout_layer_k_of_every_group_shares_region_k() -> None:
    layers = model(("full", full(), 10), ("sw", sw(32), 20))
    plan = plan_kv_cache(layers, HUGE, 112, strategy="vllm")
    # vLLM assigns strided: sw groups are sw[0::2] and sw[1::2]; in a layer-compact layout the
    # first layer of every group lives in the first region.
    firsts = {name for g in plan.groups for name in g.layer_names[:1]}
    assert firsts == {"full.0", "sw.0", "sw.1"}
    assert {plan.placement(n).offset_bytes for n in firsts} == {0}
    page = 16 * full().bytes_per_token
    assert plan.block_bytes == 10 * page
    assert plan.placement("full.1").offset_bytes == plan.num_blocks * page


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
    assert plan.block_bytes == 13 * 16 * full().bytes_per_token


def test_vllm_jamba_block_size_is_80() -> None:
    # Mamba-1 state (3*8192 + 8192*16) * 2 B = 311296 B; attention 4096 B/token:
    # 16 * ceil(311296 / (16 * 4096)) = 80.
    plan = plan_kv_cache(jamba(), HUGE, 4096, strategy="vllm")
    assert {g.block_size for g in plan.groups} == {80}
    assert plan.block_bytes == 4 * 80 * 4096
    assert kinds(plan) == [("mamba", 4)] * 7 + [("full", 4)]


def test_vllm_bamba_block_size_is_528_and_the_state_is_padded_to_a_page() -> None:
    plan = plan_kv_cache(bamba(), HUGE, 4096, strategy="vllm")
    assert {g.block_size for g in plan.groups} == {528}
    mamba_layer = plan.placement("l0")
    assert (mamba_layer.page_bytes, mamba_layer.used_bytes) == (528 * 4096, 2147840)


def test_unify_grows_block_size_when_pages_divide() -> None:
    # vllm-semantics §2.2: bs16, 2 heads, fp32: full hs64 + SWA hs32 -> SWA becomes bs32.
    layers = {"a": full(2, 64, "fp32"), "b": sw(64, 2, 32, "fp32")}
    plan = plan_kv_cache(layers, HUGE, 256, strategy="vllm")
    assert {g.kind: g.block_size for g in plan.groups} == {"full": 16, "sliding_window": 32}
    assert plan.block_bytes == 16384
    assert any("block size 32" in reason for reason in plan.reasons)


def test_unify_pads_when_pages_do_not_divide() -> None:
    # full hs64 (16384 B) + SWA hs96 (24576 B): full padded to 24576.
    layers = {"a": full(2, 64, "fp32"), "b": sw(64, 2, 96, "fp32")}
    plan = plan_kv_cache(layers, 64 * 24576, 256, strategy="vllm")
    assert plan.block_bytes == 24576
    assert (plan.placement("a").page_bytes, plan.placement("a").used_bytes) == (24576, 16384)
    assert plan.num_blocks == 64
    assert any("padded from 16384 B to 24576 B" in reason for reason in plan.reasons)


# ----------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("preset", "blocks"),
    # Bamba's Mamba-2 layers add a prefill checkpoint block per group (vLLM 0.33's MambaMixer2
    # declares one): 10 Mamba groups x 3 + 8 attention blocks.
    [("gemma-3-27b", 1414), ("gpt-oss-20b", 393), ("jamba-mini-1.5", 66), ("bamba-9b", 38)],
)
def test_per_request_reservation_is_vllms_at_4k_with_2048_in_flight(
    preset: str, blocks: int
) -> None:
    plan = plan_kv_cache(
        load_model(preset).layers, 40 * GIB, 4096, strategy="vllm", async_scheduling=False
    )
    assert plan.max_in_flight_tokens == 2048
    assert plan.blocks_per_request == blocks
    assert plan.max_concurrency == plan.num_blocks / blocks
    assert plan.kv_cache_tokens == int(plan.num_blocks / blocks * 4096)


def test_reservation_formulas_per_kind() -> None:
    # Sliding window: window - 1 + in flight tokens, capped at L, + 1 for the unaligned start.
    assert admission_blocks("sliding_window", 16, 4096, 2048, sliding_window=1024) == 193
    assert admission_blocks("sliding_window", 16, 512, 2048, sliding_window=1024) == 33
    assert admission_blocks("chunked_local", 16, 65536, 2048, attention_chunk_size=8192) == 640
    assert admission_blocks("full", 16, 4097, 2048) == 257
    assert admission_blocks("mamba", 528, 10**6, 2048) == 2
    assert admission_blocks("mamba", 528, 10**6, 2048, mamba_cache_mode="none") == 1
    # vLLM 0.33's Mamba-2 mixer exports a state from inside a prefill into one more block.
    assert admission_blocks("mamba", 528, 10**6, 2048, prefill_checkpoint_blocks=1) == 3
    assert (
        admission_blocks(
            "mamba", 528, 10**6, 2048, mamba_cache_mode="none", prefill_checkpoint_blocks=1
        )
        == 1
    )


def test_only_mamba2_layers_declare_a_prefill_checkpoint_block() -> None:
    jamba = load_model("jamba-mini-1.5").layers["model.layers.0"]
    bamba = load_model("bamba-9b").layers["model.layers.0"]
    gdn = next(
        spec
        for spec in load_model("qwen3-next-80b-a3b").layers.values()
        if getattr(spec, "mamba_type", None) == "gdn"
    )
    assert [s.prefill_checkpoint_blocks for s in (jamba, bamba, gdn)] == [0, 1, 0]  # type: ignore[union-attr]


def test_budget_vllm_refuses_is_refused_with_the_length_that_fits() -> None:
    # Gemma-3-27B at 1 GiB and 4096 tokens, one batch of 2048 tokens in flight (sync
    # scheduling): vLLM needs 1.73 GiB and estimates 1856 tokens.
    layers = load_model("gemma-3-27b").layers
    with pytest.raises(InsufficientMemoryError) as caught:
        plan_kv_cache(layers, GIB, 4096, strategy="vllm", async_scheduling=False)
    error = caught.value
    assert error.fitting_max_model_len == 1856
    assert f"{round(error.reserved_bytes / GIB, 2)}" == "1.73"
    assert "max_model_len of 1856 fits" in str(error) and "1.73 GiB" in str(error)
    assert error.needed_bytes == error.reserved_bytes + 1310720  # plus the null block
    # ... and the length it names does fit.
    plan_kv_cache(layers, GIB, 1856, strategy="vllm", async_scheduling=False)
    with pytest.raises(InsufficientMemoryError):
        plan_kv_cache(layers, GIB, 1857, strategy="vllm", async_scheduling=False)


def test_pool_reserves_the_null_block() -> None:
    # vllm-semantics §2.4: 512-token max len, block 16 -> 32 blocks; 32 blocks of memory
    # fail, 33 fit.
    layers = {"l0": full()}
    page = 16 * full().bytes_per_token
    with pytest.raises(InsufficientMemoryError, match=rf"needs 32 blocks.*= {33 * page} bytes"):
        plan_kv_cache(layers, 32 * page, 512)
    plan = plan_kv_cache(layers, 33 * page, 512)
    assert plan.num_blocks == 33
    assert plan.max_concurrency == 33 / 32  # vLLM counts the null block in num_blocks


def test_not_even_one_token_fits_says_so() -> None:
    # One block is 64 KiB: a budget past the null block but short of one more.
    with pytest.raises(InsufficientMemoryError, match="not even a 1-token request fits") as caught:
        plan_kv_cache({"l0": full()}, 100_000, 512)
    assert caught.value.fitting_max_model_len == 0
    # Not even the null block (vLLM: "No available memory for the cache blocks").
    for budget in (65536, 1):
        with pytest.raises(InsufficientMemoryError, match="does not hold even the null block") as c:
            plan_kv_cache({"l0": full()}, budget, 512)
        assert c.value.fitting_max_model_len == 0
        assert c.value.needed_bytes - c.value.reserved_bytes == 65536


def test_more_tokens_in_flight_reserve_more_sliding_window_blocks() -> None:
    layers = model(("full", full(), 4), ("sw", sw(1024), 4))
    sync = plan_kv_cache(layers, HUGE, 32768, strategy="vllm", max_in_flight_tokens=2048)
    two = plan_kv_cache(layers, HUGE, 32768, strategy="vllm", max_in_flight_tokens=4096)
    assert two.blocks_per_request - sync.blocks_per_request == 2048 // 16
    assert two.max_concurrency < sync.max_concurrency


@pytest.mark.parametrize(
    ("stages", "async_scheduling", "runner", "batches"),
    [
        (1, None, "v2", 2),
        (1, None, "v1", 2),
        (2, None, "v2", 3),
        (4, None, "v2", 5),
        (2, None, "v1", 2),
        (4, None, "v1", 4),
        (1, False, "v2", 1),
        (1, True, "v1", 2),
        (1, True, "v2", 2),
        (2, False, "v1", 2),
        (3, False, "v2", 3),
        (2, True, "v2", 3),
        (4, True, "v2", 5),
    ],
)
def test_every_batch_in_flight_reserves_sliding_window_blocks(
    stages: int, async_scheduling: bool | None, runner: str, batches: int
) -> None:
    # vLLM 0.33's `max_concurrent_batches`: one batch per pipeline stage, one more with async
    # scheduling on Model Runner V2 (2 with one stage on either runner). Async scheduling is
    # on by default (None) but for the V1 runner with pipeline parallelism.
    layers = model(("full", full(), 4), ("sw", sw(1024), 4))
    plan = plan_kv_cache(
        layers,
        HUGE,
        131072,
        strategy="vllm",
        max_num_batched_tokens=1024,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=stages,
        model_runner=runner,
    )
    assert plan.max_in_flight_tokens == batches * 1024
    sliding = next(g for g in plan.groups if g.kind == "sliding_window")
    assert sliding.admission_blocks(131072, plan.max_in_flight_tokens) == (
        -(-(1023 + batches * 1024) // 16) + 1
    )
    assert plan.in_flight is not None and plan.in_flight.max_concurrent_batches == batches
    turned_off = async_scheduling is None and runner == "v1" and stages > 1
    assert plan.to_dict()["in_flight"] == {
        "max_num_batched_tokens": 1024,
        "async_scheduling": not turned_off if async_scheduling is None else async_scheduling,
        "async_scheduling_vllm_default": async_scheduling is None,
        "pipeline_parallel_size": stages,
        "model_runner": runner,
        "max_concurrent_batches": batches,
        "max_in_flight_tokens": batches * 1024,
        "note": V1_PP_ASYNC_NOTE if turned_off else None,
    }
    # vLLM's warning when its default turns async scheduling off is the plan's too.
    assert (V1_PP_ASYNC_NOTE in plan.warnings) == turned_off


def test_the_default_is_vllms_default_async_scheduling_of_its_default_budget() -> None:
    # vLLM 0.33 turns async scheduling on by default: 2 batches of 2048 tokens in flight.
    plan = plan_kv_cache({"l0": full()}, HUGE, 128)
    assert plan.max_in_flight_tokens == 4096
    assert plan.in_flight == InFlight(2048)
    assert plan.in_flight.async_scheduling is None
    assert plan.in_flight.resolved_async_scheduling and plan.in_flight.vllm_default
    assert "async scheduling (vLLM's default)" in plan.in_flight.describe()
    sync = plan_kv_cache({"l0": full()}, HUGE, 128, async_scheduling=False)
    assert sync.max_in_flight_tokens == 2048
    assert "sync scheduling (given)" in sync.in_flight.describe()  # type: ignore[union-attr]
    # A count given as such names no options.
    counted = plan_kv_cache({"l0": full()}, HUGE, 128, max_in_flight_tokens=3000)
    assert counted.max_in_flight_tokens == 3000 and counted.in_flight is None
    assert counted.to_dict()["in_flight"] is None


def decoder(*kinds: LayerSpec) -> dict[str, LayerSpec]:
    """One layer per decoder layer, named `model.layers.{i}` as the catalogue names them."""
    return {f"model.layers.{i}": spec for i, spec in enumerate(kinds)}


def test_pipeline_stages_size_each_gpu_for_its_own_layers() -> None:
    # 5 full-attention layers over 2 stages: vLLM splits them 3 + 2 (the remainder goes to
    # the stages before the last) and sizes each GPU's blocks for its own layers; every stage
    # takes the smallest stage's block count.
    page = 16 * full().bytes_per_token
    layers = decoder(*[full()] * 5)
    memory = 100 * 3 * page + 7
    plan = plan_kv_cache(layers, memory, 128, strategy="vllm", pipeline_parallel_size=2)
    assert [(s.start_layer, s.end_layer) for s in plan.stages] == [(0, 3), (3, 5)]
    assert [s.block_bytes for s in plan.stages] == [3 * page, 2 * page]
    assert [s.budget_blocks for s in plan.stages] == [100, memory // (2 * page)]
    assert plan.num_blocks == 100
    assert plan.block_bytes == 5 * page  # the whole model's block, in which waste is measured
    assert [s.pool_bytes for s in plan.stages] == [100 * 3 * page, 100 * 2 * page]
    assert plan.pool_bytes == 100 * 5 * page
    assert {p.layer_name: p.stage for p in plan.placements} == {
        "model.layers.0": 0,
        "model.layers.1": 0,
        "model.layers.2": 0,
        "model.layers.3": 1,
        "model.layers.4": 1,
    }
    # Offsets are in the stage's own pool: each stage starts at byte 0.
    assert [p.offset_bytes for p in plan.placements] == [0, 100 * page, 200 * page, 0, 100 * page]
    assert not any("pipeline" in w for w in plan.warnings)
    one = plan_kv_cache(layers, memory, 128, strategy="vllm")
    assert one.num_blocks == memory // (5 * page)
    assert [(s.start_layer, s.end_layer, s.block_bytes) for s in one.stages] == [(0, 5, 5 * page)]


def test_pipeline_stages_split_as_vllm_splits_them() -> None:
    # vLLM's get_pp_indices: the remainder one apiece from the second-to-last stage backwards.
    assert pp_partition(62, 4) == (15, 16, 16, 15)
    assert pp_partition(62, 3) == (21, 21, 20)
    assert pp_partition(7, 4) == (2, 2, 2, 1)
    assert pp_partition(8, 1) == (8,)
    assert pp_partition(10, 3, [2, 3, 5]) == (2, 3, 5)
    for partition, message in (
        ([2, 3], "gives 2 layer counts, one per stage, but the pipeline parallel size is 3"),
        ([2, 3, 4], "sums to 9 layers, but the model has 10"),
        ([2, -1, 9], "counts must be ints >= 0"),
        ([2, True, 7], "counts must be ints >= 0"),
    ):
        with pytest.raises(PlanError, match=message):
            pp_partition(10, 3, partition)


def test_pipeline_stages_with_a_partition_and_hybrid_groups() -> None:
    # 4 sliding-window + 2 full layers, grouped for the whole model (group size 2: sw, sw,
    # full); stage 0 holds layers 0-3, so 2 of each sliding group and 1 full: its block is
    # 2 pages wide as on one GPU.
    layers = decoder(sw(512), sw(512), full(), sw(512), sw(512), full())
    page = 16 * full().bytes_per_token
    plan = plan_kv_cache(
        layers, GIB, 4096, strategy="vllm", pipeline_parallel_size=2, pp_layer_partition=[5, 1]
    )
    assert [(s.start_layer, s.end_layer) for s in plan.stages] == [(0, 5), (5, 6)]
    assert [s.block_bytes for s in plan.stages] == [2 * page, page]
    assert plan.num_blocks == GIB // (2 * page)
    assert "[5, 1] decoder layers (given)" in "\n".join(plan.reasons)


def test_pipeline_stage_refusals_name_the_problem() -> None:
    layers = decoder(*[full()] * 4)
    with pytest.raises(PlanError, match="stage 1 .*holds no layer with a KV cache"):
        plan_kv_cache(layers, GIB, 128, pipeline_parallel_size=2, pp_layer_partition=[4, 0])
    with pytest.raises(PlanError, match="one layer index in each layer name"):
        plan_kv_cache(gemma3_27b(), GIB, 128, pipeline_parallel_size=2)
    with pytest.raises(PlanError, match="beyond the model's 3 decoder layers"):
        plan_kv_cache(layers, GIB, 128, pipeline_parallel_size=2, num_hidden_layers=3)
    with pytest.raises(PlanError, match="pp_layer_partition must be a sequence of ints"):
        plan_kv_cache(layers, GIB, 128, pipeline_parallel_size=2, pp_layer_partition="2,2")  # type: ignore[arg-type]
    # Trailing decoder layers without a KV cache count when the model says how many it has.
    plan = plan_kv_cache(layers, GIB, 128, pipeline_parallel_size=2, num_hidden_layers=6)
    assert [(s.start_layer, s.end_layer, len(s.layer_names)) for s in plan.stages] == [
        (0, 3, 3),
        (3, 6, 1),
    ]
    with pytest.raises(PlanError, match=r"stage 1 \(decoder layers 4-7; split \[4, 4\]\)"):
        plan_kv_cache(layers, GIB, 128, pipeline_parallel_size=2, num_hidden_layers=8)


def test_min_waste_sizes_the_stages_as_vllm_and_keeps_its_capacity() -> None:
    # min-waste's grouping is projected onto the stages as vLLM's is; it still admits at
    # least as many max_model_len requests as vLLM's plan over the same stages.
    for name in ("gemma-3-27b", "bamba-9b", "jamba-mini-1.5", "gpt-oss-20b"):
        layers = load_model(name).layers
        for stages in (2, 3, 4):
            options = {"pipeline_parallel_size": stages}
            mine = plan_kv_cache(layers, 8 * GIB, 32768, **options)  # type: ignore[arg-type]
            vllm = plan_kv_cache(layers, 8 * GIB, 32768, strategy="vllm", **options)  # type: ignore[arg-type]
            assert len(mine.stages) == stages
            assert mine.num_blocks == min(s.budget_blocks for s in mine.stages)
            assert all(s.budget_blocks == 8 * GIB // s.block_bytes for s in mine.stages)
            assert mine.max_concurrency >= vllm.max_concurrency, (name, stages)  # type: ignore[operator]


def test_an_attention_free_model_has_no_stage_to_size() -> None:
    # vLLM plans one null block whatever the stages; no stage is refused for lacking a cache.
    plan = plan_kv_cache({}, GIB, 128, pipeline_parallel_size=2)
    assert (plan.num_blocks, plan.groups, plan.stages) == (1, (), ())


def test_kv_sharing_across_pipeline_stages_is_refused() -> None:
    layers: dict[str, LayerSpec] = decoder(full(), full())
    layers["model.layers.2"] = KVSharingSpec("model.layers.1")
    layers["model.layers.3"] = KVSharingSpec("model.layers.0")
    with pytest.raises(PlanError, match="reads layer 'model.layers.0' of stage 0"):
        plan_kv_cache(layers, GIB, 128, pipeline_parallel_size=2, pp_layer_partition=[1, 3])


def test_insufficient_memory_with_stages_names_the_first_stage_that_fails() -> None:
    # Stage 1 (3 layers) has the wider block: the budget holds stage 0's reservation only.
    layers = decoder(*[full()] * 5)
    page = 16 * full().bytes_per_token
    # 8 blocks per 128-token request plus the null block: 18 pages on stage 0, 27 on stage 1.
    arguments = {"strategy": "vllm", "pipeline_parallel_size": 2, "pp_layer_partition": [2, 3]}
    plan = plan_kv_cache(layers, 27 * page, 128, **arguments)  # type: ignore[arg-type]
    assert plan.num_blocks == 9
    with pytest.raises(InsufficientMemoryError, match="on pipeline stage 1's GPU") as error:
        plan_kv_cache(layers, 26 * page, 128, **arguments)  # type: ignore[arg-type]
    assert error.value.needed_bytes == 27 * page
    assert error.value.fitting_max_model_len == 112  # 7 blocks of 16 tokens fit stage 1


def test_each_stage_gpu_has_its_own_budget() -> None:
    # One budget per stage (each GPU's after its own weights): each stage's budget makes its
    # own block count; every stage takes the smallest, as vLLM does over its workers.
    page = 16 * full().bytes_per_token
    layers = decoder(*[full()] * 5)  # split 3 + 2
    budgets = [100 * 3 * page, 120 * 2 * page + 5]
    plan = plan_kv_cache(layers, budgets, 128, strategy="vllm", pipeline_parallel_size=2)
    assert [s.memory_bytes for s in plan.stages] == budgets
    assert [s.budget_blocks for s in plan.stages] == [100, 120]
    assert plan.num_blocks == 100
    assert plan.memory_bytes == min(budgets)
    assert plan.to_dict()["stages"][1]["memory_bytes"] == budgets[1]
    # Stage 1's smaller budget binds when it makes fewer blocks than stage 0's.
    tight = [100 * 3 * page, 90 * 2 * page]
    plan = plan_kv_cache(layers, tight, 128, strategy="vllm", pipeline_parallel_size=2)
    assert [s.budget_blocks for s in plan.stages] == [100, 90]
    assert plan.num_blocks == 90
    # The same budget given once or per stage makes the same plan.
    same = plan_kv_cache(layers, [budgets[0]] * 2, 128, pipeline_parallel_size=2)
    assert same == plan_kv_cache(layers, budgets[0], 128, pipeline_parallel_size=2)


def test_a_stage_whose_own_budget_is_short_is_named() -> None:
    # Stage 0's budget holds its reservation (8 blocks + null of 2 pages), stage 1's does not.
    page = 16 * full().bytes_per_token
    layers = decoder(*[full()] * 5)
    arguments = {"strategy": "vllm", "pipeline_parallel_size": 2, "pp_layer_partition": [2, 3]}
    with pytest.raises(InsufficientMemoryError, match="on pipeline stage 1's GPU") as error:
        plan_kv_cache(layers, [18 * page, 26 * page], 128, **arguments)  # type: ignore[arg-type]
    assert error.value.needed_bytes == 27 * page
    assert f"the budget is {26 * page} bytes" in str(error.value)
    plan = plan_kv_cache(layers, [18 * page, 27 * page], 128, **arguments)  # type: ignore[arg-type]
    assert plan.num_blocks == 9
    # min-waste's choice is held to every stage's own budget too.
    assert (
        plan_kv_cache(
            layers, [18 * page, 27 * page], 128, pipeline_parallel_size=2, pp_layer_partition=[2, 3]
        ).num_blocks
        == 9
    )


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ([GIB], "gives 1 budget, one per stage, but the pipeline parallel size is 2"),
        ([GIB] * 3, "gives 3 budgets"),
        ([], "one budget per pipeline stage, got none"),
        ([GIB, 0], r"memory_bytes\[1\] must be >= 1"),
        ([GIB, "1GiB"], r"memory_bytes\[1\] must be an int"),
    ],
)
def test_per_stage_budgets_are_checked(budgets: list[object], message: str) -> None:
    layers = decoder(*[full()] * 4)
    with pytest.raises(PlanError, match=message):
        plan_kv_cache(layers, budgets, 128, pipeline_parallel_size=2)  # type: ignore[arg-type]


def test_low_concurrency_is_warned_about() -> None:
    layers = {"l0": full()}
    page = 16 * full().bytes_per_token
    plan = plan_kv_cache(layers, 40 * page, 512)
    assert any("only 1.25 requests" in warning for warning in plan.warnings)


# ----------------------------------------------------------------------------- waste metric


def test_waste_counts_the_unfilled_tail_of_every_groups_last_block() -> None:
    # DESIGN toy case: 1 full + 3 sw, block 16, window 32, 40 tokens: every layer holds
    # 3 blocks (48 slots) for 40 tokens -> 8 of 48 slots unused in each layer.
    layers = {"f": full(), "s0": sw(32), "s1": sw(32), "s2": sw(32)}
    plan = plan_kv_cache(layers, HUGE, 40, strategy="vllm")
    assert plan.waste_at(40).waste_fraction == Fraction(8, 48)
    assert plan.waste_at(40).tail_bytes == plan.waste_at(40).waste_bytes


def test_expected_waste_weights_lengths_by_the_memory_they_hold() -> None:
    layers = {"f": full()}
    lengths = LengthDistribution.parse("17:3,64:1")
    plan = plan_kv_cache(layers, HUGE, 64, lengths=lengths)
    short, long = plan.waste_at(17), plan.waste_at(64)
    assert plan.waste.waste_fraction == Fraction(
        3 * short.waste_bytes + long.waste_bytes, 3 * short.held_bytes + long.held_bytes
    )


def test_padding_a_full_group_costs_more_than_padding_a_sliding_group() -> None:
    # 3 full + 4 sw (window 32): vLLM's width 4 (4 < 1.5 * 3) pads the full group; width 3
    # pads two sw slots instead, which hold 2-3 blocks at 4096 tokens instead of 256.
    layers = model(("full", full(), 3), ("sw", sw(32), 4))
    options = {"reference_len": 4096, "max_in_flight_tokens": 16}
    vllm = plan_kv_cache(layers, HUGE, 4096, strategy="vllm", **options)
    assert vllm.groups[0].num_padding_slots == 1 and vllm.groups[0].kind == "full"
    ours = plan_kv_cache(layers, HUGE, 4096, **options)
    assert all(g.num_padding_slots == 0 for g in ours.groups if g.kind == "full")
    assert ours.waste.waste_fraction < vllm.waste.waste_fraction
    # With 2048 tokens in flight vLLM reserves 131 blocks per sliding group: a second one
    # would admit fewer 4096-token requests, so the capacity rule keeps vLLM's grouping.
    ours = plan_kv_cache(layers, HUGE, 4096, reference_len=4096)
    assert [g.layer_names for g in ours.groups] == [g.layer_names for g in vllm.groups]


# ----------------------------------------------------------------------------- min-waste


def test_min_waste_20_full_30_sw_has_no_padding() -> None:
    layers = model(("full", full(), 20), ("sw", sw(128), 30))
    plan = plan_kv_cache(layers, HUGE, 4096)
    assert plan.num_padding_slots == 0
    assert plan.block_bytes == 10 * 16 * full().bytes_per_token
    assert (
        plan.waste.waste_fraction
        < plan_kv_cache(layers, HUGE, 4096, strategy="vllm").waste.waste_fraction
    )


def test_min_waste_gemma3_at_1024_tokens_pads_3_slots_instead_of_8() -> None:
    ours = plan_kv_cache(gemma3_27b(), HUGE, 1024)
    vllm = plan_kv_cache(gemma3_27b(), HUGE, 1024, strategy="vllm", reference_len=1024)
    # At 1024 tokens every group holds 64 blocks, so waste = padding slots / all slots.
    assert vllm.waste.waste_fraction == Fraction(8, 70)
    assert ours.waste_at(1024).waste_fraction == Fraction(3, 65)
    assert ours.num_padding_slots == 3
    assert ours.max_concurrency > vllm.max_concurrency


def test_a_short_reference_length_never_costs_long_requests_capacity() -> None:
    # The README's old example: tuned for 1k-token requests, the plan held 22% fewer 128k
    # ones. Under the capacity rule it keeps vLLM's grouping instead.
    ours = plan_kv_cache(gemma3_27b(), 40 * GIB, 131072, reference_len=1024)
    vllm = plan_kv_cache(gemma3_27b(), 40 * GIB, 131072, strategy="vllm")
    assert ours.max_concurrency >= vllm.max_concurrency
    assert any("would admit fewer 131072-token requests" in r for r in ours.reasons)


@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize("reference_len", [None, 16, 1024, 4096, 100_000])
def test_min_waste_admits_at_least_as_many_requests_as_vllm_and_wastes_no_more(
    preset: str, reference_len: int | None
) -> None:
    layers = load_model(preset).layers
    for max_model_len in (4096, 131072):
        for layout in ("LBNHC", "BLNHC"):
            options = {"reference_len": reference_len, "kv_cache_layout": layout}
            ours = plan_kv_cache(layers, 40 * GIB, max_model_len, **options)
            vllm = plan_kv_cache(layers, 40 * GIB, max_model_len, strategy="vllm", **options)
            assert ours.num_blocks * vllm.blocks_per_request >= (
                vllm.num_blocks * ours.blocks_per_request
            )
            assert ours.waste.waste_fraction <= vllm.waste.waste_fraction


def test_min_waste_respects_the_group_cap() -> None:
    layers = model(("full", full(), 20), ("sw", sw(128), 30))
    capped = plan_kv_cache(layers, HUGE, 4096, max_groups=3)
    assert capped.num_groups <= 3
    with pytest.raises(PlanError, match="max_groups=1"):
        plan_kv_cache(layers, HUGE, 4096, max_groups=1)


def test_a_cap_that_leaves_out_a_fitting_grouping_says_so() -> None:
    # Gemma-3's two groups (every sliding layer in one) need 53 GiB for a 128k request, vLLM's
    # seven 40 GiB: the refusal names the cap as the cause.
    layers = load_model("gemma-3-27b").layers
    with pytest.raises(InsufficientMemoryError) as caught:
        plan_kv_cache(layers, 40 * GIB, 131072, max_groups=2)
    assert "with at most 2 groups; vLLM's grouping of 7 groups fits this budget" in str(
        caught.value
    )
    assert caught.value.fitting_max_model_len > 0
    # A budget that vLLM's grouping does not fit either gets the plain refusal.
    with pytest.raises(InsufficientMemoryError) as caught:
        plan_kv_cache(layers, 10 * GIB, 131072, max_groups=2)
    assert "max_groups" not in str(caught.value)


def test_attention_groups_are_capped_at_vllms_count_plus_four() -> None:
    # Every layer its own group would pad nothing, but costs a block table per layer.
    plan = plan_kv_cache(gemma3_27b(), HUGE, 1024, reference_len=1024)
    vllm = plan_kv_cache(gemma3_27b(), HUGE, 1024, strategy="vllm")
    assert plan.num_groups <= vllm.num_groups + 4


# ----------------------------------------------------------------------------- Mamba


def test_bamba_past_the_group_cap_gets_176_token_blocks_in_a_block_outer_layout() -> None:
    ours = plan_kv_cache(bamba(), HUGE, 4096, reference_len=4096, kv_cache_layout="BLNHC")
    vllm = plan_kv_cache(bamba(), HUGE, 4096, reference_len=4096, strategy="vllm")
    assert (ours.attention_block_size, vllm.attention_block_size) == (176, 528)
    assert ours.num_groups > vllm.num_groups + 4
    assert round(ours.waste.waste_percent, 2) == 1.75
    assert round(vllm.waste.waste_percent, 2) == 3.57
    # A state spans three 176-token attention pages, in one contiguous page of its own.
    state = ours.placement("l0")
    assert state.page_bytes == 3 * 176 * 4096 and state.page_is_contiguous


def test_option_b_is_only_described_in_a_layer_compact_layout() -> None:
    plan = plan_kv_cache(bamba(), HUGE, 4096, reference_len=4096)
    assert len({p.page_bytes for p in plan.placements}) == 1
    option_b = next(a for a in plan.alternatives if a.label == "mamba-option-B")
    assert option_b.attention_block_size == 176
    assert "BLNHC" in option_b.note
    assert any("option B" in r and "BLNHC" in r for r in plan.reasons)


def test_mamba_tie_at_short_lengths_keeps_vllms_plan() -> None:
    vllm = plan_kv_cache(jamba(), HUGE, 4096, strategy="vllm")
    for length in (1, 8, 16):
        ours = plan_kv_cache(jamba(), HUGE, 4096, reference_len=length, kv_cache_layout="BLNHC")
        assert ours.attention_block_size == 80
        assert [g.layer_names for g in ours.groups] == [g.layer_names for g in vllm.groups]


def test_min_waste_reports_both_mamba_options() -> None:
    plan = plan_kv_cache(bamba(), HUGE, 4096, kv_cache_layout="BLNHC")
    labels = {a.label for a in plan.alternatives}
    assert {"mamba-option-A", "mamba-option-B", "vllm"} <= labels
    assert plan.waste.waste_fraction == min(a.waste_fraction for a in plan.alternatives)


def test_mamba_block_sizes_stay_multiples_of_the_alignment() -> None:
    mamba = MambaSpec(shapes=((1000,),), dtypes=("fp32",))
    layers = {"a0": full(1, 16, "fp16"), "a1": full(1, 16, "fp16"), "m": mamba}
    for alignment in (16, 32):
        for layout in ("LBNHC", "BLNHC"):
            plan = plan_kv_cache(
                layers, HUGE, 256, block_size=32, alignment=alignment, kv_cache_layout=layout
            )
            assert all(g.block_size % alignment == 0 for g in plan.groups)


def test_without_prefix_caching_mamba_groups_hold_one_block_of_max_model_len() -> None:
    plan = plan_kv_cache(jamba(), HUGE, 4096, strategy="vllm", enable_prefix_caching=False)
    mamba_groups = [g for g in plan.groups if g.kind == "mamba"]
    assert {g.block_size for g in mamba_groups} == {4096}
    assert plan.blocks_per_request == -(-4096 // 80) + len(mamba_groups)
    assert plan.hash_block_size == plan.scheduler_block_size


def test_prefix_match_unit_hashes_finer_than_the_blocks() -> None:
    plan = plan_kv_cache(bamba(), HUGE, 4096, strategy="vllm", prefix_match_unit=16)
    assert (plan.scheduler_block_size, plan.hash_block_size) == (528, 16)
    assert plan_kv_cache(bamba(), HUGE, 4096, strategy="vllm").hash_block_size == 528
    with pytest.raises(PlanError, match="must divide"):
        plan_kv_cache(bamba(), HUGE, 4096, strategy="vllm", prefix_match_unit=100)
    with pytest.raises(PlanError, match="one group"):
        plan_kv_cache({"l0": full()}, HUGE, 4096, prefix_match_unit=32)


def test_hash_block_size_is_the_gcd_of_group_block_sizes() -> None:
    layers = {"a": full(2, 64, "fp32"), "b": sw(64, 2, 32, "fp32")}
    plan = plan_kv_cache(layers, HUGE, 256, strategy="vllm")
    assert (plan.scheduler_block_size, plan.hash_block_size) == (32, 16)


# ----------------------------------------------------------------------------- uniform type


def test_same_type_layers_with_different_head_sizes_share_one_group() -> None:
    layers = {
        "a": full(8, 128),
        "b": full(8, 64),
        "c": full(8, 128),
        "m": MLAAttentionSpec(head_size=576),
    }
    for strategy in ("vllm", "min-waste"):
        plan = plan_kv_cache(layers, HUGE, 4096, strategy=strategy)
        assert kinds(plan) == [("full", 4)]
        pages = {n: plan.placement(n).page_bytes for n in layers}
        assert pages == {"a": 65536, "b": 32768, "c": 65536, "m": 16 * 576 * 2}
        assert plan.block_bytes == sum(pages.values())
        assert plan.groups[0].padding_bytes == 0
        # vLLM splits the group into one tensor per spec, in order of first appearance.
        assert [b.layer_names for b in plan.buffers] == [("a", "c"), ("b",), ("m",)]


def test_sliding_layers_with_different_windows_are_not_one_type() -> None:
    layers = {"a": sw(128), "b": sw(256)}
    assert plan_kv_cache(layers, HUGE, 4096, strategy="vllm").num_groups == 2


def test_attention_free_model_gets_one_block_and_no_groups() -> None:
    plan = plan_kv_cache({}, GIB, 4096)
    assert (plan.num_groups, plan.num_blocks, plan.block_bytes) == (0, 1, 0)
    assert plan.max_concurrency is None and plan.kv_cache_tokens == 0
    assert "attention-free" in plan.summary_line()
    assert json.loads(plan.to_json())["groups"] == []


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
    assert (shared.offset_bytes, shared.view_strides, shared.group_id) == (
        target.offset_bytes,
        target.view_strides,
        target.group_id,
    )
    assert with_sharing.group_of("l3").shared_layer_names == ("l3",)


def test_spec_errors_name_the_layer() -> None:
    with pytest.raises(SpecError, match="'l1'"):
        plan_kv_cache({"l0": full(), "l1": KVSharingSpec("ghost")}, HUGE, 16)


def test_layers_that_are_not_a_mapping_raise_spec_error() -> None:
    with pytest.raises(SpecError, match="mapping"):
        plan_kv_cache([full()], HUGE, 16)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="expected a layer spec"):
        plan_kv_cache({"l0": object()}, HUGE, 16)  # type: ignore[dict-item]


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


# ----------------------------------------------------------------------------- layouts


def test_layouts_are_case_insensitive_and_checked() -> None:
    plan = plan_kv_cache({"l0": full()}, HUGE, 256, kv_cache_layout="blnhc")
    assert plan.kv_cache_layout == "BLNHC"
    with pytest.raises(PlanError, match="unknown KV cache layout 'LNBHC'"):
        plan_kv_cache({"l0": full()}, HUGE, 256, kv_cache_layout="LNBHC")


def test_layer_compact_layouts_refuse_mixed_pages_over_several_groups() -> None:
    # Option B puts Mamba pages of several attention pages beside attention pages: only a
    # block-outermost, block-compact layout holds them; min-waste falls back in the others.
    for layout in ("LBNHC", "LBHNC", "BHLNC"):
        plan = plan_kv_cache(bamba(), HUGE, 4096, reference_len=4096, kv_cache_layout=layout)
        assert len({p.page_bytes for p in plan.placements}) == 1, layout


def test_lhbnc_refuses_layers_of_different_shapes() -> None:
    # Heads outside the blocks: an attention page is spread head by head over the layer's
    # region while a Mamba page is one run, so their blocks would overlap.
    for strategy in ("vllm", "min-waste"):
        with pytest.raises(PlanError, match="overlap each other's blocks"):
            plan_kv_cache(bamba(), HUGE, 4096, strategy=strategy, kv_cache_layout="LHBNC")
    plan_kv_cache(gemma3_27b(), HUGE, 4096, strategy="vllm", kv_cache_layout="LHBNC")
    # Other head counts: refused.
    with pytest.raises(PlanError, match="other head counts or page sizes"):
        plan_kv_cache(
            {"a": full(4, 128), "b": sw(128, 2, 256)}, HUGE, 4096, kv_cache_layout="LHBNC"
        )


def test_lhbnc_holds_layers_tiled_alike_whatever_their_block_and_head_sizes() -> None:
    # 4 heads of 256 at 16 tokens a block and 4 heads of 128 at 32: one page size, so vLLM
    # gives both the same head and block strides and no block overlaps another (a mix found
    # by tests/test_planner_vllm_random.py, which vLLM lays out).
    pytest.importorskip("torch")
    from hybrid_kv.buffers import allocate_kv_cache

    layers = {
        **{f"full.{i}": full(4, 256) for i in range(2)},
        **{
            f"chunk.{i}": ChunkedLocalAttentionSpec(
                num_kv_heads=4, head_size=128, attention_chunk_size=1024
            )
            for i in range(2)
        },
    }
    plan = plan_kv_cache(layers, HUGE, 4096, strategy="vllm", kv_cache_layout="LHBNC")
    assert {plan.placement(n).page_bytes for n in layers} == {16 * full(4, 256).bytes_per_token}
    views = allocate_kv_cache(plan, "meta").views
    wide, narrow = views["full.0"], views["chunk.0"]
    assert wide.shape[1:] == (4, 16, 2 * 256) and narrow.shape[1:] == (4, 32, 2 * 128)
    # Same bytes per head-block, same head stride: tiled alike.
    assert wide.stride()[:2] == narrow.stride()[:2]


def test_strategy_vllm_refuses_layouts_where_vllm_packs_pages() -> None:
    layers = {"a": full(2, 64, "fp32"), "b": sw(64, 2, 32, "fp32")}
    with pytest.raises(PlanError, match="packs"):
        plan_kv_cache(layers, HUGE, 256, strategy="vllm", kv_cache_layout="BLNHC")


def test_block_outer_layout_strides_blocks_by_the_block_size() -> None:
    layers = model(("full", full(), 2), ("sw", sw(128), 4))
    plan = plan_kv_cache(layers, HUGE, 4096, strategy="vllm", kv_cache_layout="BLNHC")
    page = 16 * full().bytes_per_token
    assert plan.block_bytes == 2 * page
    for placement in plan.placements:
        assert placement.block_stride_bytes == plan.block_bytes
        assert placement.offset_bytes in (0, page)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "best"}, "unknown strategy"),
        ({"block_size": 24}, "multiple of the kernel alignment"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"reference_len": 0}, "reference_len must be >= 1"),
        ({"max_groups": 0}, "max_groups must be >= 1"),
        ({"max_in_flight_tokens": 0}, "max_in_flight_tokens must be >= 1"),
        ({"prefix_match_unit": -16}, "prefix_match_unit must be >= 1"),
        ({"enable_prefix_caching": "yes"}, "must be a bool"),
        ({"lengths": [1024]}, "must be a LengthDistribution"),
        ({"reference_len": 4, "lengths": LengthDistribution.point(4)}, "not both"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1, got 0"),
        ({"pipeline_parallel_size": 2.0}, "pipeline_parallel_size must be an int"),
        ({"pipeline_parallel_size": True}, "pipeline_parallel_size must be an int"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"async_scheduling": 1}, "async_scheduling must be a bool or None"),
        ({"model_runner": "v3"}, "model_runner must be one of v1, v2, got 'v3'"),
        (
            {"async_scheduling": True, "pipeline_parallel_size": 2, "model_runner": "v1"},
            "not supported by vLLM's V1 model runner with pipeline parallelism",
        ),
        (
            {"max_in_flight_tokens": 4096, "pipeline_parallel_size": 2},
            r"max_in_flight_tokens or the scheduler options .*\(pipeline_parallel_size\)",
        ),
        (
            {"max_in_flight_tokens": 4096, "async_scheduling": True, "model_runner": "v1"},
            r"\(async_scheduling, model_runner\), not both",
        ),
        ({"max_in_flight_tokens": 4096, "pipeline_parallel_size": True}, "not both"),
        ({"max_in_flight_tokens": 4096, "async_scheduling": False}, r"\(async_scheduling\)"),
    ],
)
def test_bad_arguments_raise_plan_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_kv_cache({"l0": full()}, HUGE, 128, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GiB", 40 * GIB),
        ("40 gib", 40 * GIB),
        ("512MiB", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("2G", 2 * GIB),
        ("4096B", 4096),
        (123, 123),
    ],
)
def test_parse_memory(text: str | int, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "40XB", "-1GiB", "0GiB", "GiB", "1iB", "0.1B"])
def test_parse_memory_rejects_bad_strings(text: str) -> None:
    with pytest.raises(PlanError):
        parse_memory(text)


def test_a_size_without_a_unit_is_refused_with_a_suggestion() -> None:
    with pytest.raises(PlanError, match="no unit: write 40GiB"):
        parse_memory("40")


def test_gpu_budget_takes_the_weights_off_the_utilised_memory() -> None:
    assert kv_cache_budget(80 * GIB, 0.9, 16 * GIB) == -(-80 * GIB * 9 // 10) - 16 * GIB
    with pytest.raises(PlanError, match="do not fit"):
        kv_cache_budget(24 * GIB, 0.5, 16 * GIB)
    with pytest.raises(PlanError, match="in \\(0, 1\\]"):
        kv_cache_budget(24 * GIB, 1.5, GIB)


def test_plan_round_trips_through_json_with_a_schema_version() -> None:
    plan = plan_kv_cache(gemma3_27b(), HUGE, 4096)
    document = json.loads(plan.to_json())
    assert document["schema_version"] == PLAN_SCHEMA_VERSION
    assert document["num_blocks"] == plan.num_blocks
    assert [g["kind"] for g in document["groups"]] == [g.kind for g in plan.groups]
    assert document["groups"][0]["sliding_window"] == 1024
    assert "sliding_window" not in document["groups"][-1]
    assert document["blocks_per_request"] == plan.blocks_per_request
    assert document["kv_cache_tokens"] == plan.kv_cache_tokens
    assert document["placements"][0]["view_strides"] == list(plan.placements[0].view_strides)


def test_importing_the_planner_does_not_import_torch_or_matplotlib() -> None:
    code = (
        "import sys, hybrid_kv, hybrid_kv.specs, hybrid_kv.planner, hybrid_kv.catalogue, "
        "hybrid_kv.cli; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


def test_min_waste_reason_counts_one_grouping_and_one_group_in_the_singular() -> None:
    one = plan_kv_cache({"l0": full(), "l1": full()}, HUGE, 128)
    (reason,) = [r for r in one.reasons if r.startswith("min-waste:")]
    assert reason.startswith("min-waste: tried 1 grouping (")
    assert "; chose 1 group, " in reason and "(vLLM's grouping: 1 group, " in reason
