"""The planner against vLLM 0.33 itself.

`--strategy vllm` must give what vLLM gives: groups, layer membership, block sizes, bytes per
block, `num_blocks`, the per-request reservation, max concurrency and KV-cache tokens, the
tensors, and the same refusals with the same fitting `max_model_len`, for every preset and
synthetic mix at 4k and 128k tokens and 1, 16 and 40 GiB, and, where vLLM is installed, for the
tokens in flight vLLM counts from 1 to 4 pipeline stages, with and without async scheduling and
with vLLM's default resolution of it, on either model runner (`VllmConfig.max_in_flight_tokens`);
every layer's view must have the
shape, strides, offset and dtype vLLM allocates, in all six layouts, for vLLM's plans and for
our min-waste plans laid out by vLLM's own code.

The numbers were recorded from vLLM 0.33 by `tests/vllm_reference.py`; where vLLM is installed
the tests also rebuild them live.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import vllm_reference as ref
from hybrid_kv.planner import InFlight, InsufficientMemoryError, PlanError, plan_kv_cache

RECORDED = ref.load_recorded()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
live = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM 0.33 is not installed")


def _case_id(case: dict[str, Any]) -> str:
    return f"{case['model']}-{case['memory']}-{case['max_model_len']}"


def refusal(error: InsufficientMemoryError, memory: int | list[int]) -> dict[str, Any]:
    """A refused plan in the recorded summary's terms. A budget that does not hold the null
    block (the smallest stage's, with a budget per stage) gets vLLM's refusal without a figure
    ("No available memory for the cache blocks")."""
    null_block = error.needed_bytes - error.reserved_bytes
    smallest = min(memory) if isinstance(memory, list) else memory
    return {
        "refused": True,
        "fitting_max_model_len": error.fitting_max_model_len,
        "needed_gib": None
        if smallest <= null_block
        else f"{round(error.reserved_bytes / 2**30, 2)}",
    }


def ours(model: str, memory: int, max_model_len: int, **scheduler: Any) -> dict[str, Any]:
    """Our `--strategy vllm` plan in the recorded summary's terms, with `ref.IN_FLIGHT` tokens
    in flight or those `scheduler` (`plan_kv_cache`'s scheduler options) counts."""
    layers = ref.model_layers(model)
    in_flight = scheduler or {"max_in_flight_tokens": ref.IN_FLIGHT}
    try:
        plan = plan_kv_cache(layers, memory, max_model_len, strategy="vllm", **in_flight)
    except InsufficientMemoryError as error:
        return refusal(error, memory)
    return {
        "refused": False,
        "num_blocks": plan.num_blocks,
        "bytes_per_block": plan.block_bytes,
        "blocks_per_request": plan.blocks_per_request,
        "max_concurrency": plan.max_concurrency,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "groups": [
            {
                "type": type(plan.placement(g.layer_names[0]).spec).__name__,
                "block_size": g.block_size,
                "layers": list(g.layer_names),
                "admission_blocks": g.admission_blocks(
                    plan.max_model_len, plan.max_in_flight_tokens, plan.mamba_cache_mode
                ),
            }
            for g in plan.groups
        ],
        "tensors": [
            {
                "layers": list(b.layer_names),
                "offset": b.offset_bytes,
                "layer_stride": b.layer_stride_bytes,
                "block_stride": b.block_stride_bytes,
            }
            for b in plan.buffers
        ],
    }


def test_the_recording_covers_every_preset_at_4k_and_128k() -> None:
    assert RECORDED["vllm_version"] == "0.33.0"
    covered = {(c["model"], c["max_model_len"]) for c in RECORDED["cases"]}
    assert {(m, n) for m in ref.model_names() for n in ref.LENGTHS} <= covered
    assert any(c["vllm"]["refused"] for c in RECORDED["cases"])


@pytest.mark.parametrize("case", RECORDED["cases"], ids=_case_id)
def test_vllm_strategy_matches_recorded_vllm(case: dict[str, Any]) -> None:
    memory = ref.MEMORIES[case["memory"]]
    assert ours(case["model"], memory, case["max_model_len"]) == case["vllm"]


@live
def test_vllm_strategy_matches_live_vllm() -> None:
    for case in RECORDED["cases"]:
        memory = ref.MEMORIES[case["memory"]]
        theirs = ref.summarise(ref.model_layers(case["model"]), memory, case["max_model_len"])
        assert theirs == case["vllm"], f"recording stale for {_case_id(case)}"
        assert ours(case["model"], memory, case["max_model_len"]) == theirs, _case_id(case)


# ----------------------------------------------------------------------------- in flight


def _scheduler_id(options: tuple[bool | None, int, str]) -> str:
    asynchronous, stages, runner = options
    scheduling = {None: "default", False: "sync", True: "async"}[asynchronous]
    return f"{scheduling}-pp{stages}-{runner}"


def _scheduler(options: tuple[bool | None, int, str], batched: int = 2048) -> dict[str, Any]:
    asynchronous, stages, runner = options
    return {
        "max_num_batched_tokens": batched,
        "async_scheduling": asynchronous,
        "pipeline_parallel_size": stages,
        "model_runner": runner,
    }


V1_ASYNC_PP = "Async scheduling is not supported by the V1 model runner with pipeline parallelism"
# Presets with sliding-window and chunked-local groups (whose reservation counts the tokens in
# flight), a Mamba hybrid and KV sharing.
IN_FLIGHT_MODELS = ("gemma-3-27b", "gpt-oss-20b", "llama-4-scout", "gemma-3n-e4b", "bamba-9b")


@live
@pytest.mark.parametrize("options", ref.SCHEDULER_OPTIONS, ids=_scheduler_id)
def test_tokens_in_flight_are_vllms(options: tuple[bool | None, int, str]) -> None:
    for batched in (256, 2048, 8192):
        theirs = ref.vllm_in_flight(batched, *options)
        if isinstance(theirs, str):
            # vLLM refuses the options; so do we, saying why.
            assert V1_ASYNC_PP in theirs
            with pytest.raises(PlanError, match="not supported by vLLM's V1 model runner"):
                InFlight(**_scheduler(options, batched))
            continue
        assert InFlight(**_scheduler(options, batched)).tokens == theirs, batched
        plan = plan_kv_cache(ref.model_layers("gpt-oss-20b"), 2**34, 8192, **_scheduler(options))
        assert plan.max_in_flight_tokens == ref.vllm_in_flight(2048, *options)
        # Async scheduling as vLLM's `VllmConfig` resolves it (None: vLLM's default).
        assert plan.in_flight is not None
        assert plan.in_flight.resolved_async_scheduling is ref.vllm_async_scheduling(*options)


@live
@pytest.mark.parametrize(
    "options",
    [o for o in ref.SCHEDULER_OPTIONS if not (o[0] and o[1] > 1 and o[2] == "v1")],
    ids=_scheduler_id,
)
def test_vllm_strategy_matches_live_vllm_with_every_batch_in_flight(
    options: tuple[bool | None, int, str],
) -> None:
    in_flight = ref.vllm_in_flight(2048, *options)
    assert isinstance(in_flight, int)
    stages = options[1]
    for model in IN_FLIGHT_MODELS:
        layers = ref.model_layers(model)
        for memory in (ref.MEMORIES["1GiB"], ref.MEMORIES["16GiB"]):
            for length in ref.LENGTHS:
                where = f"{model}-{memory}-{length}"
                if stages == 1:
                    theirs = ref.summarise(layers, memory, length, in_flight=in_flight)
                    assert ours(model, memory, length, **_scheduler(options)) == theirs, where
                    continue
                # Each stage's GPU sized for its own layers (`get_kv_cache_configs`).
                if model == "gemma-3n-e4b" and stages > 2:
                    # Its last stage holds only KV-sharing layers: vLLM cannot size that GPU.
                    assert ref.summarise_stages(layers, memory, length, stages)["refused"]
                    with pytest.raises(PlanError, match="holds no layer with a KV cache"):
                        ours_stages(layers, memory, length, **_scheduler(options))
                    continue
                theirs = ref.summarise_stages(layers, memory, length, stages, in_flight=in_flight)
                assert ours_stages(layers, memory, length, **_scheduler(options)) == theirs, where


# ----------------------------------------------------------------------------- pipeline stages


def ours_stages(
    layers: dict[str, Any], memory: int | list[int], max_model_len: int, **options: Any
) -> dict[str, Any]:
    """Our `--strategy vllm` plan in `ref.summarise_stages`' terms: the global groups,
    `num_blocks`, and each stage's bytes per block and tensors (or the refusal)."""
    try:
        plan = plan_kv_cache(layers, memory, max_model_len, strategy="vllm", **options)
    except InsufficientMemoryError as error:
        return refusal(error, memory)
    return {
        "refused": False,
        "num_blocks": plan.num_blocks,
        "blocks_per_request": plan.blocks_per_request,
        "groups": [list(g.layer_names) for g in plan.groups],
        "stages": [
            {
                "layers": [n for n in stage.layer_names if n not in plan.kv_sharing],
                "bytes_per_block": stage.block_bytes,
                "tensors": [
                    {
                        "layers": list(b.layer_names),
                        "offset": b.offset_bytes,
                        "layer_stride": b.layer_stride_bytes,
                        "block_stride": b.block_stride_bytes,
                        "size": b.size_bytes,
                    }
                    for b in plan.buffers
                    if b.stage == stage.index
                ],
            }
            for stage in plan.stages
        ],
    }


# A sliding-window mix (62 layers: 3 and 4 stages do not divide it), full attention only,
# MLA (61 layers), Mamba hybrids (Mamba-2 + attention, Mamba-1 + attention), gated DeltaNet
# with full attention (48 layers), chunked local attention.
STAGED_MODELS = (
    "gemma-3-27b",
    "llama-3.1-8b",
    "deepseek-v3",
    "bamba-9b",
    "jamba-mini-1.5",
    "qwen3-next-80b-a3b",
    "llama-4-scout",
    "gpt-oss-20b",
)


@live
@pytest.mark.parametrize("model", STAGED_MODELS)
def test_pipeline_stages_match_live_vllm(model: str) -> None:
    # vLLM sizes each stage's GPU for its own layers of the whole model's groups and keeps
    # the smallest stage's num_blocks (`get_kv_cache_configs`); the budget is per GPU.
    layers = ref.model_layers(model)
    for stages in (1, 2, 3, 4):
        options = {"async_scheduling": False, "pipeline_parallel_size": stages}
        for memory in (ref.MEMORIES["1GiB"], ref.MEMORIES["16GiB"]):
            for length in (4096, 131072):
                where = f"{model}-pp{stages}-{memory}-{length}"
                theirs = ref.summarise_stages(
                    layers, memory, length, stages, in_flight=2048 * stages
                )
                assert ours_stages(layers, memory, length, **options) == theirs, where


@live
@pytest.mark.parametrize("model", STAGED_MODELS)
def test_stage_budgets_of_their_own_match_live_vllm(model: str) -> None:
    # Each stage's GPU has its own budget (its own weights off the same GPU): vLLM sizes each
    # worker from its own available memory and keeps the smallest num_blocks.
    layers = ref.model_layers(model)
    for stages in (2, 3, 4):
        options = {"async_scheduling": False, "pipeline_parallel_size": stages}
        rising = [ref.MEMORIES["1GiB"] * (4 + s) // 4 for s in range(stages)]
        for budgets in (rising, rising[::-1]):
            for length in (4096, 131072):
                where = f"{model}-pp{stages}-{budgets}-{length}"
                theirs = ref.summarise_stages(
                    layers, budgets, length, stages, in_flight=2048 * stages
                )
                assert ours_stages(layers, budgets, length, **options) == theirs, where


def test_gemma_3_27b_blocks_per_gpu_are_vllms() -> None:
    # vLLM 0.33's figures at 16 GiB per GPU and 32k tokens (checked live above).
    layers = ref.model_layers("gemma-3-27b")
    for stages, blocks in ((1, 13_107), (2, 26_214), (3, 32_768), (4, 43_690)):
        plan = plan_kv_cache(
            layers, 16 * 2**30, 32768, strategy="vllm", pipeline_parallel_size=stages
        )
        assert plan.num_blocks == blocks, stages


@live
@pytest.mark.parametrize(
    ("model", "partition"),
    [
        ("gemma-3-27b", "10,20,32"),
        ("bamba-9b", "1,31"),
        ("bamba-9b", "9,1,22"),
        ("qwen3-next-80b-a3b", "3,45"),
        ("deepseek-v3", "20,20,20,1"),
    ],
)
def test_a_layer_partition_is_vllms(model: str, partition: str) -> None:
    layers = ref.model_layers(model)
    counts = [int(c) for c in partition.split(",")]
    options = {
        "async_scheduling": False,
        "pipeline_parallel_size": len(counts),
        "pp_layer_partition": counts,
    }
    for memory in (ref.MEMORIES["1GiB"], ref.MEMORIES["16GiB"]):
        theirs = ref.summarise_stages(
            layers, memory, 32768, len(counts), partition, in_flight=2048 * len(counts)
        )
        assert ours_stages(layers, memory, 32768, **options) == theirs, memory


@live
def test_a_stage_without_kv_cache_layers_is_refused_where_vllm_fails() -> None:
    # vLLM cannot size a pool for a GPU with no KV-cache layer (it fails dividing by its
    # zero bytes per block, or finding no backing allocation); we refuse, naming the stage.
    for model, stages, partition in (("deepseek-v3", 3, "30,0,31"), ("gemma-3n-e4b", 3, None)):
        layers = ref.model_layers(model)
        try:
            refused = ref.summarise_stages(layers, 2**34, 4096, stages, partition)["refused"]
        except ZeroDivisionError:
            refused = True
        assert refused, model
        counts = None if partition is None else [int(c) for c in partition.split(",")]
        with pytest.raises(PlanError, match="holds no layer with a KV cache of its own"):
            plan_kv_cache(
                layers, 2**34, 4096, pipeline_parallel_size=stages, pp_layer_partition=counts
            )


# ----------------------------------------------------------------------------- views


def _views(plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    from hybrid_kv.buffers import allocate_kv_cache

    buffers = allocate_kv_cache(plan, "meta")
    views = {name: ref._describe(view) for name, view in buffers.views.items()}
    states = {
        name: [ref._describe(state) for state in tensors]
        for name, tensors in buffers.mamba_states.items()
    }
    return views, states


_ELEMENT_SIZES = {
    "torch.int8": 1,
    "torch.uint8": 1,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e5m2": 1,
    "torch.bfloat16": 2,
    "torch.float16": 2,
    "torch.float32": 4,
}


def _intervals(view: list[Any], block: int) -> list[tuple[int, int]]:
    """Byte intervals of block `block` of a recorded `[B, H, N, C]` view (one per head)."""
    (_, heads, tokens, content), strides, offset, dtype = view
    size = _ELEMENT_SIZES[dtype]
    start = offset + block * strides[0] * size
    span = ((tokens - 1) * strides[2] + content) * size
    return [
        (start + h * strides[1] * size, start + h * strides[1] * size + span) for h in range(heads)
    ]


def _blocks_alias(views: dict[str, list[Any]]) -> bool:
    """Whether some layer's block 1 overlaps another layer's block other than 1."""
    for name, view in views.items():
        for start, end in _intervals(view, 1):
            for other_name, other in views.items():
                if other_name == name:
                    continue
                (_, _, _, _), strides, offset, dtype = other
                block_bytes = strides[0] * _ELEMENT_SIZES[dtype]
                for block in {(start - offset) // block_bytes, (end - 1 - offset) // block_bytes}:
                    if block in (1,) or not 0 <= block < other[0][0]:
                        continue
                    for a, b in _intervals(other, block):
                        if a < end and start < b:
                            return True
    return False


def _view_id(case: dict[str, Any]) -> str:
    return f"{case['model']}-{case['layout']}"


@pytest.mark.parametrize("case", RECORDED["views"], ids=_view_id)
def test_views_match_vllms_allocation_in_every_layout(case: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    layers = ref.model_layers(case["model"])
    arguments = (layers, case["memory"], case["max_model_len"])
    # Recorded with one batch of `ref.IN_FLIGHT` tokens in flight: sync scheduling.
    options = {"strategy": "vllm", "kv_cache_layout": case["layout"], "async_scheduling": False}
    if "error" in case:
        with pytest.raises(PlanError, match="layout"):
            plan_kv_cache(*arguments, **options)
        return
    try:
        plan = plan_kv_cache(*arguments, **options)
    except PlanError as error:
        # A deliberate refusal where vLLM 0.33 goes ahead: show its layout aliases blocks.
        assert "overlap each other's blocks" in str(error)
        assert _blocks_alias(case["views"]), "vLLM's layout was safe after all"
        return
    views, _ = _views(plan)
    # vLLM lists only layers that own memory; KV-sharing layers alias their target.
    assert {k: views[k] for k in case["views"]} == case["views"]
    for name, target in plan.kv_sharing.items():
        assert views[name] == views[target]


@pytest.mark.parametrize("case", RECORDED["plans"], ids=_view_id)
def test_min_waste_plans_have_the_views_vllm_gives_their_groups(case: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    layers = ref.model_layers(case["model"])
    # Recorded with sync scheduling (`ref.PLAN_SCHEDULING`).
    plan = plan_kv_cache(
        layers,
        case["memory"],
        case["max_model_len"],
        kv_cache_layout=case["layout"],
        **ref.PLAN_SCHEDULING,
    )
    assert [list(g.layer_names) for g in plan.groups] == case["groups"], (
        "the min-waste grouping changed: re-record with `python tests/vllm_reference.py`"
    )
    assert plan.num_blocks == case["num_blocks"]
    views, states = _views(plan)
    assert views == case["views"]
    assert states == case["states"]


@live
@pytest.mark.parametrize("case", RECORDED["views"], ids=_view_id)
def test_views_match_live_vllm(case: dict[str, Any]) -> None:
    layers = ref.model_layers(case["model"])
    theirs = ref.layer_views(layers, case["memory"], case["max_model_len"], case["layout"])
    assert theirs == {k: v for k, v in case.items() if k in ("views", "error")}


@live
@pytest.mark.parametrize("case", RECORDED["plans"], ids=_view_id)
def test_min_waste_views_match_live_vllm(case: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    layers = ref.model_layers(case["model"])
    plan = plan_kv_cache(
        layers,
        case["memory"],
        case["max_model_len"],
        kv_cache_layout=case["layout"],
        **ref.PLAN_SCHEDULING,
    )
    theirs = ref.plan_views(plan, case["layout"])
    views, states = _views(plan)
    assert (views, states, plan.num_blocks) == (
        theirs["views"],
        theirs["states"],
        theirs["num_blocks"],
    )
