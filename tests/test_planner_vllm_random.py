"""The planner's `--strategy vllm` against vLLM 0.33 itself, on layer mixes drawn from a seed.

`test_planner_vllm.py` checks every preset and a few synthetic mixes; this draws others:
full-attention, sliding-window (windows from 32 to 32k tokens), chunked-local, MLA and Mamba
layers in random numbers and orders, with random head counts, head sizes and dtypes, layers
sharing another's KV cache, budgets from 64 MiB to 64 GiB and `max_model_len` from 256 to 256k,
and the scheduler options vLLM counts the tokens in flight from (`max_num_batched_tokens`, 1 to
4 pipeline stages, async scheduling given on or off or left to vLLM's default resolution, the
model runner). vLLM's plan (groups and their layers, block sizes, bytes per block,
`num_blocks`, the per-request reservation, concurrency, tensors; with pipeline stages each
stage's bytes per block and tensors, in a split drawn as vLLM's default or as a
`VLLM_PP_LAYER_PARTITION`) or its refusal with the fitting `max_model_len` must be ours, and
options vLLM refuses we refuse; and in a layout drawn from vLLM's six, every layer's view
(shape, strides, offset, dtype) must be what vLLM's `allocate_kv_cache` gives, for vLLM's
plan and for our min-waste plan laid out by vLLM's code. CI runs `HYBRID_KV_RANDOM_CASES`
cases (default 12) from `HYBRID_KV_RANDOM_SEED` (default 0); vLLM must be installed.
"""

from __future__ import annotations

import os
import random

import pytest

if os.environ.get("HYBRID_KV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI's vLLM step: a missing vLLM fails here instead of skipping)
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")

import vllm_reference as ref  # noqa: E402
from hybrid_kv import specs  # noqa: E402
from hybrid_kv.planner import PlanError, plan_kv_cache  # noqa: E402
from test_planner_vllm import V1_ASYNC_PP, _blocks_alias, _views, ours, ours_stages  # noqa: E402

NUM_CASES = int(os.environ.get("HYBRID_KV_RANDOM_CASES", "12"))
FIRST_SEED = int(os.environ.get("HYBRID_KV_RANDOM_SEED", "0"))
DTYPES = ("bf16", "bf16", "fp16", "fp32", "fp8_e4m3")


def draw_layers(rng: random.Random) -> dict[str, specs.LayerSpec]:
    """A decoder's layers: attention kinds vLLM groups together, in a random order."""
    heads = rng.choice([1, 2, 4, 8, 16])
    head = rng.choice([64, 80, 96, 128, 256])
    dtype = rng.choice(DTYPES)

    def attention_shape() -> dict[str, object]:
        # Mostly one shape per model; sometimes a kind of its own (vLLM pads or regroups).
        if rng.random() < 0.7:
            return {"num_kv_heads": heads, "head_size": head, "dtype": dtype}
        return {
            "num_kv_heads": rng.choice([1, 2, 4, 8]),
            "head_size": rng.choice([32, 64, 96, 128]),
            "dtype": dtype,
        }

    kinds: list[specs.LayerSpec] = []
    mla = rng.random() < 0.12
    if mla:
        spec = specs.MLAAttentionSpec(head_size=rng.choice([576, 512, 320]), dtype=dtype)
        kinds += [spec] * rng.randint(2, 40)
    else:
        full = specs.FullAttentionSpec(**attention_shape())
        kinds += [full] * rng.randint(0 if rng.random() < 0.15 else 1, 40)
        if rng.random() < 0.5:
            window = rng.choice([32, 128, 512, 1024, 4096, 32768])
            kinds += [
                specs.SlidingWindowSpec(**attention_shape(), sliding_window=window)
            ] * rng.randint(1, 50)
        if rng.random() < 0.2:
            chunk = rng.choice([1024, 8192])
            kinds += [
                specs.ChunkedLocalAttentionSpec(**attention_shape(), attention_chunk_size=chunk)
            ] * rng.randint(1, 36)
        if kinds and rng.random() < 0.25:
            nheads = rng.choice([8, 32, 64, 128])
            conv = (rng.choice([3, 4]), rng.choice([1024, 2048, 4096, 8192]))
            ssm = (nheads, rng.choice([32, 64]), rng.choice([64, 128]))
            mamba_dtype = rng.choice(["bf16", "fp32"])
            mamba = specs.MambaSpec(shapes=(conv, ssm), dtypes=(mamba_dtype, mamba_dtype))
            kinds += [mamba] * rng.randint(1, 40)
    if not kinds:
        kinds = [specs.FullAttentionSpec(num_kv_heads=heads, head_size=head, dtype=dtype)]
    rng.shuffle(kinds)
    layers: dict[str, specs.LayerSpec] = {f"layers.{i}": spec for i, spec in enumerate(kinds)}
    attention = [n for n, s in layers.items() if not isinstance(s, specs.MambaSpec)]
    if not mla and len(attention) > 4 and rng.random() < 0.2:
        # The last layers reuse an earlier layer's KV cache (Gemma-3n-style).
        for name in attention[-rng.randint(1, len(attention) // 3) :]:
            source = rng.choice(attention[: len(attention) // 2])
            layers[name] = specs.KVSharingSpec(target=source)
    return layers


def draw_budget(rng: random.Random) -> tuple[int, int]:
    memory = int(2 ** rng.uniform(26, 36))
    max_model_len = rng.choice([256, 1000, 4096, 8192, 32768, 131072, 262144])
    return memory, max_model_len


def draw_scheduler(rng: random.Random) -> dict[str, object]:
    """`plan_kv_cache`'s scheduler options, as an operator sets vLLM's."""
    return {
        "max_num_batched_tokens": rng.choice([256, 1024, 2048, 8192, 16384]),
        "async_scheduling": rng.choice([None, False, True]),  # None: vLLM's default
        "pipeline_parallel_size": rng.randint(1, 4),
        "model_runner": rng.choice(["v1", "v2"]),
    }


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_CASES))
def test_vllm_strategy_matches_live_vllm_on_random_mixes(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    layers = draw_layers(rng)
    memory, max_model_len = draw_budget(rng)
    scheduler = draw_scheduler(rng)
    kinds = sorted({type(s).__name__ for s in layers.values()})
    where = f"seed {seed}: {len(layers)} layers {kinds}, {memory} B, {max_model_len}, {scheduler}"
    in_flight = ref.vllm_in_flight(*scheduler.values())  # type: ignore[arg-type]
    if isinstance(in_flight, str):
        assert V1_ASYNC_PP in in_flight, where
        with pytest.raises(PlanError, match="not supported by vLLM's V1 model runner"):
            plan_kv_cache(layers, memory, max_model_len, strategy="vllm", **scheduler)  # type: ignore[arg-type]
        return
    stages = scheduler["pipeline_parallel_size"]
    assert isinstance(stages, int)
    if stages > 1:
        partition = draw_partition(rng, len(layers), stages)
        where += f", partition {partition}"
        _check_stages(layers, memory, max_model_len, scheduler, partition, in_flight, where)
        return
    # `ours` reads the layers by model name.
    monkeypatch.setattr(ref, "model_layers", lambda name: dict(layers))
    theirs = ref.summarise(layers, memory, max_model_len, in_flight=in_flight)
    mine = ours("random", memory, max_model_len, **scheduler)
    assert mine == theirs, where


def draw_partition(rng: random.Random, num_layers: int, stages: int) -> list[int] | None:
    """vLLM's split (None) or a `VLLM_PP_LAYER_PARTITION` of `num_layers` over the stages."""
    if rng.random() < 0.6:
        return None
    cuts = sorted(rng.randint(0, num_layers) for _ in range(stages - 1))
    bounds = [0, *cuts, num_layers]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def _check_stages(
    layers: dict[str, specs.LayerSpec],
    memory: int,
    max_model_len: int,
    scheduler: dict[str, object],
    partition: list[int] | None,
    in_flight: int,
    where: str,
) -> None:
    stages = scheduler["pipeline_parallel_size"]
    assert isinstance(stages, int)
    text = None if partition is None else ",".join(str(c) for c in partition)
    try:
        mine: dict[str, object] | str = ours_stages(
            layers, memory, max_model_len, pp_layer_partition=partition, **scheduler
        )
    except PlanError as error:
        mine = str(error)
    try:
        theirs: dict[str, object] | str = ref.summarise_stages(
            layers, memory, max_model_len, stages, text, in_flight=in_flight
        )
    except ZeroDivisionError as error:  # vLLM's division by a stage's 0 bytes per block
        theirs = repr(error)
    if isinstance(mine, str):
        if "holds no layer with a KV cache of its own" in mine:
            # vLLM fails to size that GPU's pool.
            assert isinstance(theirs, str) or theirs["refused"], where
            return
        # vLLM's model refuses a KV-sharing target on another stage when it is built; its
        # KV-cache planning alone (all the reference runs) does not look.
        assert "KV-sharing layer" in mine and "on its own stage" in mine, f"{where}: {mine}"
        return
    assert mine == theirs, where


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_CASES))
def test_views_match_live_vllm_on_random_mixes(seed: int) -> None:
    rng = random.Random(seed)
    layers = draw_layers(rng)
    memory, max_model_len = draw_budget(rng)
    layout = random.Random(-seed).choice(ref.LAYOUTS)
    where = f"seed {seed}: {layout}, {memory} B, {max_model_len}"
    theirs = ref.layer_views(layers, memory, max_model_len, layout)
    try:
        plan = plan_kv_cache(
            layers,
            memory,
            max_model_len,
            strategy="vllm",
            kv_cache_layout=layout,
            max_in_flight_tokens=ref.IN_FLIGHT,
        )
    except PlanError as error:
        if "error" in theirs:
            return  # both refuse (for a layout or memory: either reason refuses)
        if "overlap each other's blocks" in str(error):
            # The deliberate refusal (README): vLLM's layout aliases blocks here.
            assert "views" in theirs and _blocks_alias(theirs["views"]), where
        elif "which hybrid-kv does not reproduce" in str(error):
            # The documented limitation (README): vLLM's block-outermost packing of attention
            # pages of different sizes.
            assert "views" in theirs, where
            pages = {s.bytes_per_token for s in layers.values() if hasattr(s, "bytes_per_token")}
            assert len(pages) > 1 and layout in ("BLNHC", "BLHNC", "BHLNC"), where
        else:
            raise AssertionError(f"{where}: we refused ({error}), vLLM planned") from error
        return
    assert "views" in theirs, f"{where}: vLLM refused ({theirs.get('error')}), we planned"
    views, _ = _views(plan)
    # vLLM lists only layers that own memory; KV-sharing layers alias their target.
    assert {k: views[k] for k in theirs["views"]} == theirs["views"], where
    for name, target in plan.kv_sharing.items():
        assert views[name] == views[target], where
    # Our min-waste plan of the same layers, laid out by vLLM's code.
    try:
        mine = plan_kv_cache(
            layers, memory, max_model_len, kv_cache_layout=layout, max_in_flight_tokens=2048
        )
    except PlanError:
        return
    laid_out = ref.plan_views(mine, layout)
    views, states = _views(mine)
    owners = {k: v for k, v in views.items() if k not in mine.kv_sharing}
    assert (owners, states, mine.num_blocks) == (
        laid_out["views"],
        laid_out["states"],
        laid_out["num_blocks"],
    ), where
    for name, target in mine.kv_sharing.items():
        assert views[name] == views[target], where
