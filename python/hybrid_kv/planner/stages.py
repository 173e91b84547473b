"""Pipeline stages: which layers each GPU of vLLM 0.33's pipeline holds.

vLLM splits the model's `num_hidden_layers` decoder layers into `pipeline_parallel_size`
consecutive stages (`vllm.distributed.utils.get_pp_indices`): `num_hidden_layers // N` each,
the remainder spread one apiece over the stages before the last, from the second-to-last
backwards; `VLLM_PP_LAYER_PARTITION` ("a,b,...", one count per stage, summing to the layer
count) overrides the split. A layer with a KV cache belongs to the stage of the decoder layer
its name's index names (`model.layers.{i}`, as vLLM's `extract_layer_index` reads it).

vLLM groups the whole model's layers, then sizes each stage's GPU for its own layers: each
group keeps only the stage's layers, a block of that GPU's pool holds their pages, and the
engine takes the smallest stage's `num_blocks` for every stage (`get_kv_cache_configs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv.planner.errors import PlanError
from hybrid_kv.specs import KVSharingSpec, LayerSpec

__all__ = ["PipelineStage", "StageSplit", "layer_index", "parse_partition", "pp_partition"]


def pp_partition(
    num_hidden_layers: int, pipeline_parallel_size: int, partition: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Decoder layers per stage as vLLM 0.33's `get_pp_indices` splits them, or `partition`
    (`VLLM_PP_LAYER_PARTITION`'s counts) checked as vLLM checks it."""
    if pipeline_parallel_size > num_hidden_layers:
        # vLLM would leave a stage without a decoder layer; refused before a count per stage
        # is made (the size may be anything a user typed).
        raise PlanError(
            f"pipeline parallel size {pipeline_parallel_size} is more stages than the model's "
            f"{num_hidden_layers} decoder layers: each stage needs at least one"
        )
    if partition is not None:
        counts = tuple(partition)
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise PlanError(f"pp_layer_partition counts must be ints >= 0, got {count!r}")
        if len(counts) != pipeline_parallel_size:
            noun = "count" if len(counts) == 1 else "counts"
            raise PlanError(
                f"pp_layer_partition gives {len(counts)} layer {noun}, one per stage, but the "
                f"pipeline parallel size is {pipeline_parallel_size}"
            )
        if sum(counts) != num_hidden_layers:
            raise PlanError(
                f"pp_layer_partition sums to {sum(counts)} layers, but the model has "
                f"{num_hidden_layers}"
            )
        return counts
    counts_list = [num_hidden_layers // pipeline_parallel_size] * pipeline_parallel_size
    for i in range(2, num_hidden_layers % pipeline_parallel_size + 2):
        counts_list[-i] += 1
    return tuple(counts_list)


def parse_partition(text: str) -> tuple[int, ...]:
    """`VLLM_PP_LAYER_PARTITION`'s format: comma-separated layer counts ("20,21,21")."""
    try:
        counts = tuple(int(part, 10) for part in text.split(","))
    except ValueError:
        raise PlanError(
            f"invalid layer partition {text!r}: give one layer count per stage, e.g. 20,21,21"
        ) from None
    return counts


def layer_index(name: str) -> int:
    """The decoder layer a KV-cache layer belongs to: the one integer among the dot-separated
    parts of its name, as vLLM's `extract_layer_index` reads it."""
    indices = []
    for part in name.split("."):
        try:
            indices.append(int(part, 10))
        except ValueError:
            continue
    if len(indices) != 1:
        raise PlanError(
            f"layer {name!r}: pipeline stages need one layer index in each layer name "
            "(model.layers.{i}, as vLLM reads it)"
        )
    return indices[0]


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage's GPU: decoder layers `[start_layer, end_layer)`, the KV-cache
    layers among them (`layer_names`, in model order, KV-sharing ones included), its GPU's KV
    cache budget (`memory_bytes`), the bytes a block of its pool holds (its layers' pages in
    the widest group), the blocks its budget alone would make, and the bytes its pool takes at
    the plan's `num_blocks`."""

    index: int
    start_layer: int
    end_layer: int
    layer_names: tuple[str, ...]
    memory_bytes: int
    block_bytes: int
    budget_blocks: int
    pool_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "start_layer": self.start_layer,
            "end_layer": self.end_layer,
            "layer_names": list(self.layer_names),
            "memory_bytes": self.memory_bytes,
            "block_bytes": self.block_bytes,
            "budget_blocks": self.budget_blocks,
            "pool_bytes": self.pool_bytes,
        }


@dataclass(frozen=True)
class StageSplit:
    """The layers of each stage: `ranges[s]` decoder layers, `names[s]` the KV-cache layers."""

    ranges: tuple[tuple[int, int], ...]
    names: tuple[tuple[str, ...], ...]
    source: str

    @property
    def size(self) -> int:
        return len(self.ranges)

    @classmethod
    def whole(cls, layers: Mapping[str, LayerSpec], num_hidden_layers: int | None) -> StageSplit:
        """One stage holding every layer."""
        end = num_hidden_layers if num_hidden_layers is not None else len(layers)
        return cls(((0, end),), (tuple(layers),), "one stage")

    @classmethod
    def of(
        cls,
        layers: Mapping[str, LayerSpec],
        pipeline_parallel_size: int,
        num_hidden_layers: int | None = None,
        partition: Sequence[int] | None = None,
    ) -> StageSplit:
        """Split `layers` over the stages; every stage must hold a layer with a KV cache (vLLM
        cannot size a pool without one) and a KV-sharing layer its target."""
        if pipeline_parallel_size == 1 and partition is None:
            return cls.whole(layers, num_hidden_layers)
        if all(isinstance(spec, KVSharingSpec) for spec in layers.values()):
            # Attention-free: no GPU has a KV cache to size (vLLM's one null block).
            return cls.whole(layers, num_hidden_layers)
        indices = {name: layer_index(name) for name in layers}
        deepest = max(indices.values(), default=-1) + 1
        if num_hidden_layers is None:
            num_hidden_layers = deepest
        elif deepest > num_hidden_layers:
            name = max(indices, key=indices.__getitem__)
            raise PlanError(
                f"layer {name!r} is beyond the model's {num_hidden_layers} decoder layers"
            )
        counts = pp_partition(num_hidden_layers, pipeline_parallel_size, partition)
        ranges = []
        start = 0
        for count in counts:
            ranges.append((start, start + count))
            start += count
        stage_of = {
            name: next(s for s, (a, b) in enumerate(ranges) if a <= index < b)
            for name, index in indices.items()
        }
        names = tuple(tuple(n for n in layers if stage_of[n] == s) for s in range(len(ranges)))
        for s, members in enumerate(names):
            if not any(not isinstance(layers[n], KVSharingSpec) for n in members):
                a, b = ranges[s]
                held = f"decoder layers {a}-{b - 1}" if b > a else "no decoder layer"
                raise PlanError(
                    f"pipeline stage {s} ({held}; split {list(counts)}) holds no layer with a "
                    "KV cache of its own: vLLM cannot size that GPU's pool; choose another split"
                )
        for name, spec in layers.items():
            if isinstance(spec, KVSharingSpec) and stage_of[name] != stage_of[spec.target]:
                raise PlanError(
                    f"KV-sharing layer {name!r} (stage {stage_of[name]}) reads layer "
                    f"{spec.target!r} of stage {stage_of[spec.target]}: vLLM needs a layer's "
                    "KV-sharing target on its own stage; choose another split"
                )
        source = "given" if partition is not None else "vLLM's split"
        return cls(tuple(ranges), names, f"{list(counts)} decoder layers ({source})")
