"""The planning API as a library user meets it: plans a manager can be built from (and that
build follows the plan), and typed errors for bad arguments to specs, length distributions,
plans and buffers."""

from __future__ import annotations

import itertools
from typing import Any

import hybrid_kv as hk
import numpy as np
import pytest
from hybrid_kv import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LengthDistribution,
    MambaSpec,
    PlanError,
    SlidingWindowSpec,
    SpecError,
    manager_from_plan,
    parse_memory,
    plan_kv_cache,
)

GIB = 2**30
FULL = FullAttentionSpec(num_kv_heads=8, head_size=128)
MAMBA = MambaSpec.mamba2(
    intermediate_size=8192, n_groups=8, num_heads=128, head_dim=64, state_size=128, conv_kernel=4
)
SWA = SlidingWindowSpec(num_kv_heads=8, head_size=128, sliding_window=1024)


def _hit(manager: hk.KVCacheManager, prompt: list[int]) -> int:
    first = hk.Request("first", prompt)
    manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, len(prompt)) is not None
    manager.free(first)
    return manager.get_computed_blocks(hk.Request("second", prompt))[1]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("layers", ["attention", "mixed", "hybrid"])
def test_a_manager_built_from_a_plan_caches_as_the_plan_says(layers: str, caching: bool) -> None:
    kinds = {"attention": FULL, "mixed": SWA, "hybrid": MAMBA}
    model = {f"l{i}": FULL if i % 4 == 0 else kinds[layers] for i in range(16)}
    plan = plan_kv_cache(model, 4 * GIB, 8192, enable_prefix_caching=caching)
    assert plan.enable_prefix_caching is caching
    manager = manager_from_plan(plan)
    assert manager.scheduler_block_size == plan.scheduler_block_size
    if caching:
        assert manager.hash_block_size == plan.hash_block_size
    modes = {g.get("mamba_cache_mode") for g in manager.groups if g["kind"] == "mamba"}
    assert modes <= {plan.mamba_cache_mode}
    prompt = list(range(1, min(4 * plan.scheduler_block_size, 4096) + 2))
    assert (_hit(manager, prompt) > 0) is caching
    # What the caller passes wins over the plan.
    assert (
        manager_from_plan(plan, enable_caching=False).get_computed_blocks(hk.Request("x", prompt))[
            1
        ]
        == 0
    )


@pytest.mark.parametrize(
    ("preset", "unit", "strategy"),
    list(
        itertools.product(
            ["gemma-3-27b", "jamba-mini-1.5", "bamba-9b"], [None, 8, 16], ["vllm", "min-waste"]
        )
    ),
)
def test_a_managers_block_sizes_are_the_plans(preset: str, unit: int | None, strategy: str) -> None:
    layers = hk.load_model(preset).layers
    try:
        plan = plan_kv_cache(layers, 40 * GIB, 8192, strategy=strategy, prefix_match_unit=unit)
    except PlanError:
        pytest.skip("no plan with this prefix_match_unit")
    manager = manager_from_plan(plan)
    assert (manager.scheduler_block_size, manager.hash_block_size) == (
        plan.scheduler_block_size,
        plan.hash_block_size,
    )


def test_chunked_local_blocks_other_than_the_scheduler_block_are_a_warning_not_a_surprise() -> None:
    # Full-attention layers with half the KV heads get blocks twice as long (vLLM's page
    # unification): the chunked-local groups' blocks are then not the scheduler block, which
    # vLLM 0.33 asserts at its first lookup and hybrid-kv's manager refuses.
    chunked = ChunkedLocalAttentionSpec(num_kv_heads=8, head_size=128, attention_chunk_size=8192)
    narrow = FullAttentionSpec(num_kv_heads=4, head_size=128)
    layers = {"l0": chunked, "l1": chunked, "l2": chunked, "l3": narrow}
    for strategy in ("vllm", "min-waste"):
        plan = plan_kv_cache(layers, GIB, 8192, strategy=strategy)
        (warning,) = [w for w in plan.warnings if "chunked local" in w]
        assert "scheduler block (32 tokens" in warning and "refuses this plan" in warning
        with pytest.raises(hk.InvalidConfigError, match="chunked local"):
            manager_from_plan(plan)
        off = plan_kv_cache(layers, GIB, 8192, strategy=strategy, enable_prefix_caching=False)
        assert not any("chunked local" in w for w in off.warnings)
        assert manager_from_plan(off).num_groups == len(off.groups)
    # Equal pages: no warning, and the manager is built.
    even = {"l0": chunked, "l1": chunked, "l2": chunked, "l3": FULL}
    plan = plan_kv_cache(even, GIB, 8192)
    assert not plan.warnings and manager_from_plan(plan).num_groups == len(plan.groups)


def test_a_histogram_longer_than_a_file_name_is_a_histogram() -> None:
    text = ",".join(f"{n * 100}:1" for n in range(1, 400))
    distribution = LengthDistribution.parse(text)
    assert distribution.lengths[:3] == (100, 200, 300)
    assert LengthDistribution.parse("64:2").lengths == (64,)


@pytest.mark.parametrize(
    ("factory", "kwargs", "name"),
    [
        (MambaSpec.mamba1, {"conv_kernel": None}, "conv_kernel"),
        (MambaSpec.mamba1, {"intermediate_size": -4}, "intermediate_size"),
        (MambaSpec.mamba1, {"state_size": 1.5}, "state_size"),
        (MambaSpec.mamba2, {"n_groups": 0}, "n_groups"),
        (MambaSpec.mamba2, {"n_groups": -8}, "n_groups"),
        (MambaSpec.mamba2, {"n_groups": None}, "n_groups"),
        (MambaSpec.mamba2, {"intermediate_size": -1000}, "intermediate_size"),
        (MambaSpec.mamba2, {"num_heads": "128"}, "num_heads"),
        (MambaSpec.mamba2, {"head_dim": True}, "head_dim"),
        (MambaSpec.gated_delta_net, {"num_k_heads": 0}, "num_k_heads"),
        (MambaSpec.gated_delta_net, {"num_k_heads": -1}, "num_k_heads"),
        (MambaSpec.gated_delta_net, {"head_v_dim": 2.0}, "head_v_dim"),
    ],
)
def test_mamba_factories_check_each_argument_before_using_it(
    factory: Any, kwargs: dict[str, Any], name: str
) -> None:
    defaults = {
        MambaSpec.mamba1: {"intermediate_size": 8192, "state_size": 16, "conv_kernel": 4},
        MambaSpec.mamba2: {
            "intermediate_size": 8192,
            "n_groups": 8,
            "num_heads": 128,
            "head_dim": 64,
            "state_size": 128,
            "conv_kernel": 4,
        },
        MambaSpec.gated_delta_net: {
            "num_k_heads": 16,
            "num_v_heads": 32,
            "head_k_dim": 128,
            "head_v_dim": 128,
            "conv_kernel": 4,
        },
    }
    factory(**defaults[factory])  # valid as given
    with pytest.raises(SpecError, match=name):
        factory(**{**defaults[factory], **kwargs})


@pytest.mark.parametrize("mamba_type", [None, 5, "xyz", "Mamba2", ""])
def test_mamba_type_is_one_the_planner_knows(mamba_type: Any) -> None:
    with pytest.raises(SpecError, match="mamba_type must be one of mamba1, mamba2, gdn"):
        MambaSpec(shapes=((3, 64),), dtypes="bf16", mamba_type=mamba_type)
    for known in ("mamba1", "mamba2", "gdn"):
        assert MambaSpec(shapes=((3, 64),), dtypes="bf16", mamba_type=known).mamba_type == known


def test_a_request_longer_than_any_pool_holds_is_insufficient_memory_naming_the_cap() -> None:
    with pytest.raises(hk.InsufficientMemoryError, match="block ids are 32-bit"):
        plan_kv_cache({"a": FULL}, 2**62, 2**40)


def test_a_pool_torch_cannot_size_is_a_value_error() -> None:
    torch = pytest.importorskip("torch")
    from hybrid_kv.buffers import allocate_kv_cache

    plan = plan_kv_cache({"a": FullAttentionSpec(num_kv_heads=2**40, head_size=128)}, 10**30, 64)
    assert plan.pool_bytes >= 2**63
    with pytest.raises(ValueError, match="beyond what a torch tensor can size"):
        allocate_kv_cache(plan, "meta")
    assert torch.empty(0).numel() == 0


@pytest.mark.parametrize("digits", [101, 5000])
def test_a_memory_size_of_too_many_digits_is_a_plan_error(digits: int) -> None:
    with pytest.raises(PlanError, match="more than 100 digits"):
        parse_memory("1" + "0" * digits + "GiB")
    assert parse_memory("1" + "0" * 20 + "B") == 10**20


@pytest.mark.parametrize(
    "lengths", [[1.7, 2.2], [True, True], "123", [float("nan")], [float("inf")], ["abc"], None, 5]
)
def test_lengths_must_be_ints(lengths: Any) -> None:
    with pytest.raises(PlanError):
        LengthDistribution.from_lengths(lengths, "test")


def test_lengths_take_numpy_integers_and_leave_out_non_positive_ones() -> None:
    distribution = LengthDistribution.from_lengths(np.array([5, 0, 5, 9, -3]), "test")
    assert (distribution.lengths, distribution.weights) == ((5, 9), (2, 1))


@pytest.mark.parametrize(
    "counts", [None, [(100, 1)], {"100": 1, 5: 1}, {100: 0}, {100: -1}, {-5: 1}, {100: 1.5}]
)
def test_counts_must_map_positive_int_lengths_to_positive_int_counts(counts: Any) -> None:
    with pytest.raises(PlanError):
        LengthDistribution.from_counts(counts, "test")


@pytest.mark.parametrize(
    ("value", "error"), [(100.5, TypeError), (None, TypeError), ("100", TypeError), (-5, PlanError)]
)
def test_plan_queries_take_token_counts(value: Any, error: type[Exception]) -> None:
    plan = plan_kv_cache({"a": FULL, "b": SWA}, GIB, 4096)
    for query in (plan.waste_at, plan.blocks_held, plan.groups[0].blocks_held):
        with pytest.raises(error, match="num_tokens"):
            query(value)
    assert plan.blocks_held(np.int64(100)) == plan.blocks_held(100) > 0
    assert plan.waste_at(0).held_bytes == 0


@pytest.mark.parametrize("needed", [1, 1023, 1024, 17_181_966_336, 1_854_668_800, 2**40 + 1])
def test_the_advised_memory_holds_what_is_needed(needed: int) -> None:
    from hybrid_kv.planner.memory import format_bytes_at_least

    advised = parse_memory(format_bytes_at_least(needed))
    assert needed <= advised <= needed * 1.01 + 1


def test_a_budget_just_short_advises_more_than_it(capsys: pytest.CaptureFixture[str]) -> None:
    # 16 GiB is 2 MiB short of one 131,072-token request of Llama-3.1-8B in vLLM's plan: the
    # advice was "raise the memory to 16.00 GiB", the budget given.
    from hybrid_kv.cli import main

    argv = ["plan", "llama-3.1-8b", "--memory", "16GiB", "--strategy", "vllm"]
    assert main(argv) == 2
    assert capsys.readouterr().err.rstrip().endswith("or raise the memory to 16.01 GiB")
    assert main([*argv[:3], "16.01 GiB", *argv[4:]]) == 0


@pytest.mark.parametrize("strategy", ["min-waste", "vllm"])
def test_a_block_size_the_manager_refuses_is_a_plan_error(strategy: str) -> None:
    """Blocks of more than 2**20 tokens, asked for or grown for a Mamba state, are refused when
    planning: the manager cannot be built from such a plan."""
    tiny = FullAttentionSpec(num_kv_heads=1, head_size=1, dtype="fp8_e4m3")
    with pytest.raises(PlanError, match=r"block_size must be at most 1,048,576 tokens"):
        plan_kv_cache({"a": tiny}, 2**44, 2**22, block_size=2**21, alignment=2**21)
    assert manager_from_plan(
        plan_kv_cache({"a": tiny}, 2**44, 2**22, block_size=2**20, alignment=2**20)
    ).block_sizes == [2**20]
    huge_state = MambaSpec(shapes=((2**20,),), dtypes=("fp32",))
    with pytest.raises(PlanError, match=r"2,097,152 tokens.*at most 1,048,576"):
        plan_kv_cache({"a": tiny, "m": huge_state}, 2**44, 2**16, strategy=strategy)
