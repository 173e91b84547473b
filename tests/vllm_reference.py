"""Build vLLM 0.33's own KV-cache plan for a hybrid-kv layer mapping (used by the tests that
compare the planner with vLLM, and by `python tests/vllm_reference.py` which records the
numbers those tests check when vLLM is not installed).

vLLM is driven through its planning functions (`get_global_kv_cache_groups`,
`get_kv_cache_configs`, `get_max_concurrency_for_kv_cache_config`, and the worker's
`allocate_kv_cache` on the `meta` device) with a minimal stand-in for `VllmConfig` carrying
only the fields those functions read. The one step that needs a real model class, the
platform's Mamba block-size alignment (`Platform._align_hybrid_block_size`), is restated here
from its definition: `block = align * cdiv(mamba_page, align * attention_page_per_token)`
with `align = max(16, block_size)`, Mamba pages padded to the attention page.

    VENV/bin/python tests/vllm_reference.py     # rewrites tests/data/vllm_reference.json.gz
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hybrid_kv.catalogue import list_presets, load_model
from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

RECORDED = Path(__file__).with_name("data") / "vllm_reference.json.gz"
LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
MEMORIES = {"1GiB": 2**30, "16GiB": 16 * 2**30, "40GiB": 40 * 2**30}
LENGTHS = (4096, 131072)
IN_FLIGHT = 2048
SCHEDULER_OPTIONS = [  # (async_scheduling, pipeline_parallel_size, model_runner)
    (asynchronous, stages, runner)
    for runner in ("v1", "v2")
    for stages in (1, 2, 3, 4)
    for asynchronous in (None, False, True)  # None: vLLM's default resolution
]
PLAN_SCHEDULING = {"async_scheduling": False}
"""The scheduling the recorded min-waste plans (`PLAN_CASES`) were made with: sync, one batch
of 2048 tokens in flight (the planner's default before it followed vLLM's async default)."""
LAYOUT_CASES = [  # (model, max_model_len, memory): vLLM's per-layer views in every layout
    ("gemma-3-27b", 4096, 2**30 * 3),
    ("jamba-mini-1.5", 4096, 2**30),
    ("gemma-3n-e4b", 4096, 2**30),
    ("uniform-full", 4096, 2**30),
]
PLAN_CASES = [  # (model, max_model_len, memory, layout): our min-waste plans, vLLM's geometry
    ("gemma-3-27b", 4096, 2**30 * 3, "LBNHC"),
    ("gemma-3-27b", 131072, 2**30 * 40, "BHLNC"),
    ("bamba-9b", 8192, 2**30 * 16, "BLNHC"),
    ("jamba-mini-1.5", 4096, 2**30 * 4, "BLHNC"),
    ("20-full-30-sw", 4096, 2**30, "LHBNC"),
    ("full-hs64-sw-hs96", 4096, 2**30, "LBNHC"),
]


def _full(heads: int = 8, head: int = 128, dtype: str = "bf16") -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=heads, head_size=head, dtype=dtype)


def _sw(window: int, heads: int = 8, head: int = 128, dtype: str = "bf16") -> SlidingWindowSpec:
    return SlidingWindowSpec(num_kv_heads=heads, head_size=head, dtype=dtype, sliding_window=window)


SYNTHETIC: dict[str, dict[str, LayerSpec]] = {
    # vLLM's FIXME case: group size 20, 10 padding slots.
    "20-full-30-sw": {
        **{f"full.{i}": _full() for i in range(20)},
        **{f"sw.{i}": _sw(128) for i in range(30)},
    },
    # gpt-oss + EAGLE: 12 sw + 13 full -> groups of 13 (the 1.5x rule).
    "12-sw-13-full": {
        **{f"sw.{i}": _sw(128, head=64) for i in range(12)},
        **{f"full.{i}": _full(head=64) for i in range(13)},
    },
    # One type, two head sizes and MLA: one UniformTypeKVCacheSpecs group.
    "uniform-full": {
        **{f"a.{i}": _full(8, 128 if i % 2 else 64) for i in range(6)},
        "mla.0": MLAAttentionSpec(head_size=576),
    },
    # Pages that divide: the sliding-window block size grows to 32.
    "full-hs64-sw-hs32": {
        **{f"full.{i}": _full(2, 64, "fp32") for i in range(4)},
        **{f"sw.{i}": _sw(256, 2, 32, "fp32") for i in range(4)},
    },
    # Pages that do not divide: the full-attention pages are padded.
    "full-hs64-sw-hs96": {
        **{f"full.{i}": _full(2, 64, "fp32") for i in range(4)},
        **{f"sw.{i}": _sw(256, 2, 96, "fp32") for i in range(8)},
    },
}


def model_layers(name: str) -> dict[str, LayerSpec]:
    """A preset's layers, or one of the synthetic mixes."""
    if name in SYNTHETIC:
        return dict(SYNTHETIC[name])
    return dict(load_model(name).layers)


def model_names() -> list[str]:
    return [*list_presets(), *SYNTHETIC]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _checkpoints(spec: MambaSpec) -> dict[str, Any]:
    """vLLM's Mamba-2 mixer declares a prefill checkpoint block (its `get_kv_cache_spec`)."""
    if spec.prefill_checkpoint_blocks == 0:
        return {}
    return {
        "num_prefill_checkpoint_blocks": spec.prefill_checkpoint_blocks,
        "prefill_checkpoint_alignment": 1,
    }


def vllm_specs(layers: dict[str, LayerSpec], block_size: int = 16) -> dict[str, Any]:
    """vLLM `KVCacheSpec`s for our layers (KV-sharing layers produce none, as in vLLM),
    with the platform's Mamba alignment applied."""
    import torch
    from vllm.v1 import kv_cache_interface as ki

    dtypes = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
    token_bytes = max(
        (
            s.bytes_per_token
            for s in layers.values()
            if not isinstance(s, (MambaSpec, KVSharingSpec))
        ),
        default=0,
    )
    state = max((s.state_bytes for s in layers.values() if isinstance(s, MambaSpec)), default=0)
    padded = None
    if token_bytes and state:
        align = max(16, block_size)
        block_size = max(block_size, align * _cdiv(state, align * token_bytes))
        if block_size * token_bytes != state:
            padded = block_size * token_bytes
    specs: dict[str, Any] = {}
    for name, spec in layers.items():
        if isinstance(spec, KVSharingSpec):
            continue
        if isinstance(spec, MambaSpec):
            specs[name] = ki.MambaSpec(
                block_size=block_size,
                shapes=spec.shapes,
                dtypes=tuple(dtypes[d] for d in spec.dtypes),
                page_size_padded=padded,
                mamba_cache_mode="align",
                **_checkpoints(spec),
            )
            continue
        common = {"block_size": block_size, "dtype": dtypes[spec.dtype]}
        if isinstance(spec, MLAAttentionSpec):
            specs[name] = ki.MLAAttentionSpec(num_kv_heads=1, head_size=spec.head_size, **common)
            continue
        common |= {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size}
        if spec.head_size_v is not None:
            common["head_size_v"] = spec.head_size_v
        if isinstance(spec, SlidingWindowSpec):
            specs[name] = ki.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            specs[name] = ki.ChunkedLocalAttentionSpec(
                attention_chunk_size=spec.attention_chunk_size, **common
            )
        else:
            assert isinstance(spec, FullAttentionSpec)
            specs[name] = ki.FullAttentionSpec(**common)
    return specs


def vllm_config(max_model_len: int, layout: str = "LBNHC", in_flight: int = IN_FLIGHT) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    resolved = KVCacheLayout[layout]
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=16,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=0,
            mamba_cache_mode="align",
            get_resolved_kv_cache_layout=lambda: resolved,
        ),
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=in_flight
        ),
        model_config=SimpleNamespace(
            max_model_len=max_model_len,
            original_max_model_len=max_model_len,
            supports_kv_cache_grouping=False,
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1),
        attention_config=SimpleNamespace(hisparse_config=None),
        max_in_flight_tokens=in_flight,
        num_prefill_lookahead_tokens=0,
        speculative_config=None,
    )


def vllm_in_flight(
    max_num_batched_tokens: int,
    async_scheduling: bool | None,
    pipeline_parallel_size: int,
    runner: str,
) -> int | str:
    """vLLM's `VllmConfig.max_in_flight_tokens` for these scheduler options, from a
    `VllmConfig` vLLM builds with `VLLM_USE_V2_MODEL_RUNNER` set for `runner` ("v1" or "v2"),
    or the message with which vLLM refuses the options. `async_scheduling=None` is vLLM's
    default (`--async-scheduling` not given), which `VllmConfig` resolves itself."""
    return _vllm_scheduler_config(
        max_num_batched_tokens,
        async_scheduling,
        pipeline_parallel_size,
        runner,
        lambda config: int(config.max_in_flight_tokens),
    )


def vllm_async_scheduling(
    async_scheduling: bool | None, pipeline_parallel_size: int, runner: str
) -> bool | str:
    """`SchedulerConfig.async_scheduling` as vLLM's `VllmConfig` resolves it, or the message
    with which vLLM refuses the options."""
    return _vllm_scheduler_config(
        2048,
        async_scheduling,
        pipeline_parallel_size,
        runner,
        lambda config: bool(config.scheduler_config.async_scheduling),
    )


def _vllm_scheduler_config(
    max_num_batched_tokens: int,
    async_scheduling: bool | None,
    pipeline_parallel_size: int,
    runner: str,
    read: Callable[[Any], Any],
) -> Any:
    """`read(config)` of the `VllmConfig` vLLM builds for these options (read while
    `VLLM_USE_V2_MODEL_RUNNER` selects `runner`), or vLLM's message refusing them."""
    from vllm.config import ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms import current_platform

    old = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    # vLLM's CPU platform turns async scheduling off afterwards (`check_and_update_config`);
    # the GPU engine keeps what `VllmConfig` resolved, which is taken as that hook sees it.
    platform_update = current_platform.check_and_update_config
    resolved: list[bool | None] = []

    def check_and_update_config(vllm_config: Any) -> None:
        resolved.append(vllm_config.scheduler_config.async_scheduling)
        platform_update(vllm_config)

    current_platform.check_and_update_config = check_and_update_config  # type: ignore[method-assign]
    try:
        scheduler = SchedulerConfig(
            async_scheduling=async_scheduling,
            max_model_len=max(max_num_batched_tokens, 4096),
            is_encoder_decoder=False,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        parallel = ParallelConfig(
            pipeline_parallel_size=pipeline_parallel_size, distributed_executor_backend="mp"
        )
        try:
            config = VllmConfig(parallel_config=parallel, scheduler_config=scheduler)
        except ValueError as error:  # pydantic's ValidationError
            return str(error)
        assert len(resolved) == 1 and isinstance(resolved[0], bool), resolved
        config.scheduler_config.async_scheduling = resolved[0]
        return read(config)
    finally:
        del current_platform.check_and_update_config
        if old is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = old


def vllm_plan(
    layers: dict[str, LayerSpec],
    memory: int,
    max_model_len: int,
    layout: str = "LBNHC",
    in_flight: int = IN_FLIGHT,
):
    """`(config, kv_cache_config)` or `(config, error message)` when vLLM refuses."""
    from vllm.v1.core import kv_cache_planning as planning

    config = vllm_config(max_model_len, layout, in_flight)
    specs = vllm_specs(layers)
    groups = planning.get_global_kv_cache_groups(config, [specs])
    try:
        (kv_cache_config,) = planning.get_kv_cache_configs(config, [specs], [memory], groups)
    except ValueError as error:
        return config, str(error)
    return config, kv_cache_config


def vllm_stage_specs(
    layers: dict[str, LayerSpec], stages: int, partition: str | None = None
) -> list[dict[str, Any]]:
    """Each pipeline stage's `{layer: KVCacheSpec}`: the layers of the decoder layers vLLM's
    `get_pp_indices` gives the stage (`partition` as `VLLM_PP_LAYER_PARTITION`), each layer's
    index read by vLLM's `extract_layer_index`."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.utils import extract_layer_index

    specs = vllm_specs(layers)
    num_layers = max(extract_layer_index(name) for name in layers) + 1
    old = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if partition is None:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    else:
        os.environ["VLLM_PP_LAYER_PARTITION"] = partition
    try:
        ranges = [get_pp_indices(num_layers, rank, stages) for rank in range(stages)]
    finally:
        if old is None:
            os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        else:
            os.environ["VLLM_PP_LAYER_PARTITION"] = old
    return [
        {n: s for n, s in specs.items() if start <= extract_layer_index(n) < end}
        for start, end in ranges
    ]


def summarise_stages(
    layers: dict[str, LayerSpec],
    memory: int | list[int],
    max_model_len: int,
    stages: int,
    partition: str | None = None,
    in_flight: int = IN_FLIGHT,
) -> dict[str, Any]:
    """vLLM's plan over `stages` pipeline stages of `memory` bytes each (or `memory[s]` on
    stage `s`): the global groups, `num_blocks`, and each stage worker's bytes per block and
    tensors (or the refusal)."""
    import re

    from vllm.v1.core import kv_cache_planning as planning

    config = vllm_config(max_model_len, in_flight=in_flight)
    workers = vllm_stage_specs(layers, stages, partition)
    groups = planning.get_global_kv_cache_groups(config, workers)
    try:
        configs = planning.get_kv_cache_configs(
            config, workers, memory if isinstance(memory, list) else [memory] * stages, groups
        )
    except ValueError as error:
        fit = re.search(r"estimated maximum model length is (\d+)", str(error))
        needed = re.search(r"\(([\d.]+) GiB KV cache is needed", str(error))
        return {
            "refused": True,
            "fitting_max_model_len": int(fit.group(1)) if fit else 0,
            "needed_gib": needed.group(1) if needed else None,
        }
    (num_blocks,) = {c.num_blocks for c in configs}
    per_request = sum(
        _cdiv(g.kv_cache_spec.max_memory_usage_bytes(config), g.kv_cache_spec.page_size_bytes)
        for g in groups
    )
    return {
        "refused": False,
        "num_blocks": num_blocks,
        "blocks_per_request": per_request,
        "groups": [list(g.layer_names) for g in groups],
        "stages": [
            {
                "layers": list(worker),
                "bytes_per_block": c.kv_cache_tensors[0].size // num_blocks,
                "tensors": [
                    {
                        "layers": list(t.layers),
                        "offset": t.offset,
                        "layer_stride": t.layer_stride,
                        "block_stride": t.block_stride,
                        "size": t.size,
                    }
                    for t in c.kv_cache_tensors
                ],
            }
            for worker, c in zip(workers, configs, strict=True)
        ],
    }


def summarise(
    layers: dict[str, LayerSpec], memory: int, max_model_len: int, in_flight: int = IN_FLIGHT
) -> dict[str, Any]:
    """What the tests compare: groups, pool, admission, concurrency (or the refusal), with
    `in_flight` tokens in flight (vLLM's `max_in_flight_tokens`)."""
    import re

    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    config, result = vllm_plan(layers, memory, max_model_len, in_flight=in_flight)
    if isinstance(result, str):
        fit = re.search(r"estimated maximum model length is (\d+)", result)
        needed = re.search(r"\(([\d.]+) GiB KV cache is needed", result)
        return {
            "refused": True,
            "fitting_max_model_len": int(fit.group(1)) if fit else 0,
            "needed_gib": needed.group(1) if needed else None,
        }
    groups = []
    per_request = 0
    for group in result.kv_cache_groups:
        spec = group.kv_cache_spec
        members = getattr(spec, "kv_cache_specs", None)
        first = next(iter(members.values())) if members else spec
        blocks = _cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)
        per_request += blocks
        groups.append(
            {
                "type": type(first).__name__,
                "block_size": first.block_size,
                "layers": list(group.layer_names),
                "admission_blocks": blocks,
            }
        )
    concurrency = get_max_concurrency_for_kv_cache_config(config, result)
    return {
        "refused": False,
        "num_blocks": result.num_blocks,
        "bytes_per_block": result.kv_cache_tensors[0].size // result.num_blocks,
        "blocks_per_request": per_request,
        "max_concurrency": concurrency,
        "kv_cache_tokens": int(concurrency * max_model_len),
        "groups": groups,
        "tensors": [
            {
                "layers": list(t.layers),
                "offset": t.offset,
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
            }
            for t in result.kv_cache_tensors
        ],
    }


def layer_views(
    layers: dict[str, LayerSpec], memory: int, max_model_len: int, layout: str
) -> dict[str, Any]:
    """vLLM's per-layer views on `meta`: `{"views": {layer: [shape, strides, byte offset,
    dtype]}}`, or `{"error": message}` when vLLM cannot lay the model out so."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    try:
        _, result = vllm_plan(layers, memory, max_model_len, layout)
        if isinstance(result, str):
            return {"error": result}
        views = allocate_kv_cache(result, torch.device("meta"), KVCacheLayout[layout])
    except (AssertionError, ValueError) as error:
        return {"error": str(error) or type(error).__name__}
    return {"views": {name: _describe(view) for name, view in views.items()}}


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }


def _describe(view: Any) -> list[Any]:
    return [
        list(view.shape),
        list(view.stride()),
        view.storage_offset() * view.element_size(),
        str(view.dtype),
    ]


def plan_views(plan: Any, layout: str) -> dict[str, Any]:
    """vLLM's geometry for one of our plans: its groups handed to vLLM's
    `get_kv_cache_config_from_groups` and allocated on `meta`; Mamba layers unpacked by
    vLLM's `MambaBase.bind_kv_cache`. `{"views": {...}, "states": {...}}`."""
    import torch
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1 import kv_cache_interface as ki
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    dtypes = _torch_dtypes()
    groups = []
    for group in plan.groups:
        specs = {}
        for name in group.layer_names:
            placement = plan.placement(name)
            spec = placement.spec
            padded = placement.page_bytes if placement.page_bytes != placement.used_bytes else None
            if isinstance(spec, MambaSpec):
                specs[name] = ki.MambaSpec(
                    block_size=group.block_size,
                    shapes=spec.shapes,
                    dtypes=tuple(dtypes[d] for d in spec.dtypes),
                    page_size_padded=padded,
                    mamba_cache_mode="align",
                    **_checkpoints(spec),
                )
            elif isinstance(spec, MLAAttentionSpec):
                specs[name] = ki.MLAAttentionSpec(
                    block_size=group.block_size,
                    num_kv_heads=1,
                    head_size=spec.head_size,
                    dtype=dtypes[spec.dtype],
                )
            else:
                common = {
                    "block_size": group.block_size,
                    "num_kv_heads": spec.num_kv_heads,
                    "head_size": spec.head_size,
                    "dtype": dtypes[spec.dtype],
                    "page_size_padded": padded,
                }
                if isinstance(spec, SlidingWindowSpec):
                    specs[name] = ki.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
                else:
                    specs[name] = ki.FullAttentionSpec(**common)
        first = next(iter(specs.values()))
        merged = first if all(s == first for s in specs.values()) else None
        if merged is None:
            merged = ki.UniformTypeKVCacheSpecs.from_specs(specs)
        groups.append(ki.KVCacheGroupSpec(list(group.layer_names), merged))
    config = vllm_config(plan.max_model_len, layout)
    kv_config = get_kv_cache_config_from_groups(config, groups, plan.memory_bytes)
    views = allocate_kv_cache(kv_config, torch.device("meta"), KVCacheLayout[layout])
    states = {}
    for name, view in views.items():
        spec = plan.placement(name).spec
        if isinstance(spec, MambaSpec):
            layer = SimpleNamespace(
                get_state_shape=lambda spec=spec: spec.shapes,
                get_state_dtype=lambda spec=spec: tuple(dtypes[d] for d in spec.dtypes),
            )
            MambaBase.bind_kv_cache(layer, view)  # type: ignore[arg-type]
            states[name] = [_describe(state) for state in layer.kv_cache]
    return {
        "num_blocks": kv_config.num_blocks,
        "views": {name: _describe(view) for name, view in views.items()},
        "states": states,
    }


def record() -> dict[str, Any]:
    import vllm
    from hybrid_kv.planner import plan_kv_cache

    cases = []
    for model in model_names():
        layers = model_layers(model)
        for memory_name, memory in MEMORIES.items():
            for length in LENGTHS:
                cases.append(
                    {
                        "model": model,
                        "memory": memory_name,
                        "max_model_len": length,
                        "vllm": summarise(layers, memory, length),
                    }
                )
    views = []
    for model, length, memory in LAYOUT_CASES:
        layers = model_layers(model)
        for layout in LAYOUTS:
            views.append(
                {
                    "model": model,
                    "max_model_len": length,
                    "memory": memory,
                    "layout": layout,
                    **layer_views(layers, memory, length, layout),
                }
            )
    plans = []
    for model, length, memory, layout in PLAN_CASES:
        plan = plan_kv_cache(
            model_layers(model), memory, length, kv_cache_layout=layout, **PLAN_SCHEDULING
        )
        plans.append(
            {
                "model": model,
                "max_model_len": length,
                "memory": memory,
                "layout": layout,
                "groups": [list(g.layer_names) for g in plan.groups],
                **plan_views(plan, layout),
            }
        )
    return {
        "vllm_version": vllm.__version__,
        "max_in_flight_tokens": IN_FLIGHT,
        "cases": cases,
        "views": views,
        "plans": plans,
    }


def load_recorded() -> dict[str, Any]:
    """The numbers recorded from vLLM by `record()`."""
    with gzip.open(RECORDED, "rt") as f:
        return json.load(f)


if __name__ == "__main__":
    RECORDED.parent.mkdir(exist_ok=True)
    with gzip.open(RECORDED, "wt") as out:
        json.dump(record(), out, indent=1)
        out.write("\n")
    print(f"wrote {RECORDED}", file=sys.stderr)
