"""Torch buffers: view shapes as vLLM gives them, meta allocation, Mamba state unpacking, and
byte-level checks that every (layer, block) page lies in its block, live pages never overlap
and padding is where the plan says, in every layout."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from hybrid_kv.buffers import allocate_kv_cache  # noqa: E402
from hybrid_kv.catalogue import load_model  # noqa: E402
from hybrid_kv.planner import KV_CACHE_LAYOUTS, KVCachePlan, PlanError, plan_kv_cache  # noqa: E402
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
        "m0": MambaSpec(shapes=((3, 4), (20,)), dtypes=("fp16", "fp32")),
        "m1": MambaSpec(shapes=((3, 4), (20,)), dtypes=("fp16", "fp32")),
        "m2": MambaSpec(shapes=((3, 4), (20,)), dtypes=("fp16", "fp32")),
    },
    "mamba-option-b": {
        **{
            f"a{i}": FullAttentionSpec(num_kv_heads=1, head_size=16, dtype="fp16") for i in range(8)
        },
        "m": MambaSpec(shapes=((1024,),), dtypes=("fp32",)),
    },
    "mla": {"mla0": MLAAttentionSpec(head_size=24), "mla1": MLAAttentionSpec(head_size=24)},
    "uniform-type": {
        "u0": FullAttentionSpec(num_kv_heads=2, head_size=8, dtype="fp16"),
        "u1": FullAttentionSpec(num_kv_heads=1, head_size=16, head_size_v=8, dtype="fp32"),
    },
}


def _plan(
    layers: dict[str, LayerSpec], length: int = 40, extra_blocks: int = 3, layout: str = "LBNHC"
) -> KVCachePlan:
    probe = plan_kv_cache(layers, 2**40, length, kv_cache_layout=layout)
    memory = (probe.blocks_per_request + extra_blocks) * probe.block_bytes
    return plan_kv_cache(layers, memory, length, kv_cache_layout=layout)


def _tensors(buffers: object, layer: str) -> list[torch.Tensor]:
    states = buffers.mamba_states.get(layer)  # type: ignore[attr-defined]
    return list(states) if states else [buffers.layer_view(layer)]  # type: ignore[attr-defined]


def _touched(buffers: object, layer: str, block: int) -> set[int]:
    """Pool byte offsets written when filling `layer`'s page of `block` through its view."""
    pool = buffers.pool  # type: ignore[attr-defined]
    pool.zero_()
    for tensor in _tensors(buffers, layer):
        tensor[block].view(torch.uint8).fill_(0xFF)
    return set(torch.nonzero(pool).flatten().tolist())


def test_attention_view_is_blocks_heads_tokens_and_k_beside_v() -> None:
    plan = _plan(MIXES["sw+full+sharing"])
    buffers = allocate_kv_cache(plan, "cpu")
    view = buffers.layer_view("f0")
    assert view.shape == (plan.num_blocks, 2, 16, 16)  # [B, H, N, K+V]
    assert view.dtype == torch.float16
    assert buffers.layer_view("x0") is view
    # LBNHC: within a page tokens are outside heads, K and V side by side per head.
    assert view.stride() == (16 * 2 * 16, 16, 2 * 16, 1)
    assert buffers.pool.dtype == torch.int8


def test_mla_and_mamba_view_shapes() -> None:
    plan = _plan(MIXES["mla"])
    assert allocate_kv_cache(plan, "cpu").layer_view("mla0").shape == (plan.num_blocks, 1, 16, 24)
    plan = _plan(MIXES["mamba-option-a"])
    buffers = allocate_kv_cache(plan, "cpu")
    state_bytes = 3 * 4 * 2 + 20 * 4
    assert buffers.layer_view("m0").shape == (plan.num_blocks, 1, 1, state_bytes)
    conv, ssm = buffers.mamba_states["m0"]
    assert (conv.shape, conv.dtype) == ((plan.num_blocks, 3, 4), torch.float16)
    assert (ssm.shape, ssm.dtype) == ((plan.num_blocks, 20), torch.float32)


def test_jamba_conv_state_is_kernel_by_channels_as_in_vllm() -> None:
    plan = plan_kv_cache(load_model("jamba-mini-1.5").layers, 8 * 2**30, 4096)
    conv, ssm = allocate_kv_cache(plan, "meta").mamba_states["model.layers.0"]
    assert conv.shape[1:] == (3, 8192) and ssm.shape[1:] == (8192, 16)


def test_meta_device_plans_a_27b_model_without_memory() -> None:
    plan = plan_kv_cache(load_model("gemma-3-27b").layers, 60 * 2**30, 131072)
    buffers = allocate_kv_cache(plan, "meta")
    assert buffers.pool.numel() == plan.pool_bytes > 50 * 2**30
    assert buffers.layer_view("model.layers.5").shape == (plan.num_blocks, 16, 16, 256)


def test_a_pipeline_plan_is_allocated_one_stage_at_a_time() -> None:
    layers = load_model("gemma-3-27b").layers
    plan = plan_kv_cache(layers, 2**34, 32768, strategy="vllm", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="3 pipeline stages, each with its own pool: give stage="):
        allocate_kv_cache(plan, "meta")
    for bad in (3, -1, True, "0"):
        with pytest.raises(ValueError, match=r"stage must be an int in 0\.\.2"):
            allocate_kv_cache(plan, "meta", stage=bad)  # type: ignore[arg-type]
    for stage in plan.stages:
        buffers = allocate_kv_cache(plan, "meta", stage=stage.index)
        assert buffers.pool.numel() == stage.pool_bytes == plan.num_blocks * stage.block_bytes
        assert set(buffers.views) == set(stage.layer_names)
        assert all(view.shape[0] == plan.num_blocks for view in buffers.views.values())
    # One stage: as before, with or without stage=0.
    single = plan_kv_cache(layers, 2**34, 32768, strategy="vllm")
    assert allocate_kv_cache(single, "meta").pool.numel() == single.pool_bytes
    assert allocate_kv_cache(single, "meta", stage=0).pool.numel() == single.pool_bytes


def test_default_device_is_cpu_without_cuda() -> None:
    plan = _plan(MIXES["mla"])
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert allocate_kv_cache(plan).device.type == expected


def test_allocate_refuses_what_is_not_a_plan() -> None:
    with pytest.raises(TypeError, match="KVCachePlan"):
        allocate_kv_cache({"num_blocks": 3}, "meta")  # type: ignore[arg-type]


def test_a_cpu_pool_larger_than_the_memory_left_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hybrid_kv.buffers as buffers_module

    plan = _plan(MIXES["sw+full+sharing"])
    allocated: list[int] = []
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        allocated.append(1)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(buffers_module.torch, "empty", empty)
    monkeypatch.setattr(buffers_module._core, "_available_memory", lambda: plan.pool_bytes - 1)
    with pytest.raises(MemoryError, match="needs .* on the CPU, but only"):
        allocate_kv_cache(plan, "cpu")
    assert allocated == []
    # The meta device takes no memory; a pool that fits, or an unknown amount left, allocates.
    assert allocate_kv_cache(plan, "meta").pool.numel() == plan.pool_bytes
    monkeypatch.setattr(buffers_module._core, "_available_memory", lambda: plan.pool_bytes)
    assert allocate_kv_cache(plan, "cpu").pool.numel() == plan.pool_bytes
    monkeypatch.setattr(buffers_module._core, "_available_memory", lambda: None)
    assert allocate_kv_cache(plan, "cpu").pool.numel() == plan.pool_bytes


def test_the_memory_left_is_what_the_kernel_reports() -> None:
    from hybrid_kv import _core

    available = _core._available_memory()
    if not sys.platform.startswith("linux"):
        assert available is None
        return
    meminfo = dict(
        (line.split(":")[0], int(line.split()[1]) * 1024)
        for line in open("/proc/meminfo")  # noqa: SIM115
        if line.split()[1].isdigit()
    )
    assert available is not None
    assert 0 < available <= meminfo["MemTotal"] + meminfo.get("SwapTotal", 0)


def _layout_plans() -> list[tuple[str, str]]:
    cases = []
    for mix, layout in itertools.product(sorted(MIXES), KV_CACHE_LAYOUTS):
        try:
            _plan(MIXES[mix], layout=layout)
        except PlanError:
            continue
        cases.append((mix, layout))
    return cases


@pytest.mark.parametrize(("mix", "layout"), _layout_plans())
def test_pages_stay_in_their_blocks_and_live_pages_never_overlap(mix: str, layout: str) -> None:
    plan = _plan(MIXES[mix], layout=layout)
    buffers = allocate_kv_cache(plan, "cpu")
    owners = [p for p in plan.placements if p.shared_from is None]
    touched = {}
    for placement, block in itertools.product(owners, range(plan.num_blocks)):
        region = _touched(buffers, placement.layer_name, block)
        if placement.page_is_contiguous:
            start = placement.offset_bytes + block * placement.block_stride_bytes
            assert region <= set(range(start, start + placement.page_bytes))
        assert len(region) == placement.used_bytes, f"{placement.layer_name} block {block}"
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
    widest = max(
        plan.groups, key=lambda g: sum(plan.placement(n).page_bytes for n in g.layer_names)
    )
    for group in plan.groups:
        count = group.blocks_held(length)
        block_ids = list(range(next_block, next_block + count))
        next_block += count
        for block, name in itertools.product(block_ids, widest.layer_names):
            start, end = plan.placement(name).block_range(block)
            held[start:end] = True
        first = -(-length // group.block_size) - count  # first block index still held
        for name in group.layer_names:
            if plan.placement(name).spec.kind == "mamba":
                for state in buffers.mamba_states[name]:
                    state[block_ids[0]].view(torch.uint8).fill_(0xFF)
                continue
            view = buffers.layer_view(name).view(torch.uint8)  # [B, H, N, C bytes]
            for token in range(first * group.block_size, length):
                block = block_ids[token // group.block_size - first]
                view[block, :, token % group.block_size, :].fill_(0xFF)
    unwritten = int((held & (pool == 0)).sum())
    report = plan.waste_at(length)
    assert int(held.sum()) == report.held_bytes
    assert unwritten == report.waste_bytes
    assert int(((pool != 0) & ~held).sum()) == 0


def test_importing_buffers_without_torch_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import hybrid_kv.buffers\n"
        "except ModuleNotFoundError as e:\n    print(e.name, '|', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    name, message = result.stdout.strip().split(" | ")
    assert name == "torch" and "pip install 'hybrid-kv[torch]'" in message


@pytest.mark.parametrize("layout", KV_CACHE_LAYOUTS)
def test_mamba_states_of_mixed_widths_stay_aligned_in_every_block(layout: str) -> None:
    # An fp32 state then an fp8 one: 5 bytes of state, whose pages must still start at a
    # multiple of 4 bytes for the fp32 views.
    spec = MambaSpec(shapes=((1,), (1,)), dtypes=("fp32", "fp8_e4m3"))
    plan = plan_kv_cache({"m0": spec, "m1": spec}, 1 << 12, 32, kv_cache_layout=layout)
    buffers = allocate_kv_cache(plan, "cpu")
    for name in ("m0", "m1"):
        ssm, conv = buffers.mamba_states[name]
        assert ssm.dtype == torch.float32 and tuple(ssm.shape) == (plan.num_blocks, 1)
        ssm[1].fill_(1.5)
        conv[1].view(torch.uint8).fill_(7)
        assert ssm[1].item() == 1.5 and int(conv[1].view(torch.uint8)) == 7
        assert not ssm[0].any() and not ssm[2].any()
    # Layers of one group hold the same block ids in separate memory.
    assert buffers.mamba_states["m0"][0][1].item() == 1.5
    assert plan.waste_at(32).waste_bytes > 0


def _edited(plan: KVCachePlan, layer: str, **changes: object) -> KVCachePlan:
    """The plan with one placement's fields changed, as a plan edited by hand would be."""
    placements = tuple(
        dataclasses.replace(p, **changes) if p.layer_name == layer else p  # type: ignore[arg-type]
        for p in plan.placements
    )
    return dataclasses.replace(plan, placements=placements)


def _inconsistent_plans() -> list[tuple[str, KVCachePlan, str]]:
    plan = _plan(MIXES["sw+full+sharing"])
    first = plan.placement("f0")
    shape, strides = first.view_shape, first.view_strides
    mamba = _plan(MIXES["mamba-option-a"])
    m0 = mamba.placement("m0")
    return [
        ("past the pool", _edited(plan, "f0", offset_bytes=plan.pool_bytes), "outside the pool"),
        ("negative offset", _edited(plan, "f0", offset_bytes=-2), "offset_bytes"),
        (
            "more blocks than the pool",
            _edited(plan, "f0", view_shape=(plan.num_blocks + 1, *shape[1:])),
            "blocks",
        ),
        (
            "fewer blocks than the pool",
            _edited(plan, "f0", view_shape=(plan.num_blocks - 1, *shape[1:])),
            "blocks",
        ),
        ("three axes", _edited(plan, "f0", view_shape=shape[:3]), "view_shape"),
        ("negative stride", _edited(plan, "f0", view_strides=(-strides[0], *strides[1:])), "view"),
        ("element split", _edited(plan, "f0", view_strides=(*strides[:3], 2)), "f0"),
        ("a str shape", _edited(plan, "f0", view_shape="abcd"), "view_shape"),
        ("unknown sharing target", _edited(plan, "x0", shared_from="nope"), "nope"),
        (
            "Mamba state past the page",
            _edited(mamba, "m0", view_shape=(*m0.view_shape[:3], m0.view_shape[3] - 1)),
            "m0",
        ),
    ]


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize(
    ("plan", "message"),
    [pytest.param(plan, message, id=name) for name, plan, message in _inconsistent_plans()],
)
def test_an_inconsistent_plan_is_refused_before_allocating(
    plan: KVCachePlan, message: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan whose views leave the pool, miss blocks the manager hands out or name a layer the
    stage lacks is a `PlanError` naming the layer, on every device (on `meta` torch checks no
    bounds), before anything is allocated."""
    import hybrid_kv.buffers as buffers_module

    allocated: list[object] = []
    real_empty = torch.empty
    monkeypatch.setattr(
        buffers_module.torch,
        "empty",
        lambda *a, **k: allocated.append(a) or real_empty(*a, **k),  # type: ignore[func-returns-value]
    )
    with pytest.raises(PlanError, match=message):
        allocate_kv_cache(plan, device)
    assert allocated == []
