"""KV-cache planning: layer grouping, page sizes, Mamba padding, pool sizing, memory layout.

* `plan` holds the values a plan is made of (groups, placements, buffers, waste, admission);
* `search` the grouping search (vLLM 0.33's grouping and the min-waste search);
* `entry` the entry point, `plan_kv_cache`;
* `inflight` the tokens in flight vLLM counts from its scheduler options (`InFlight`);
* `stages` the pipeline stages' layers, as vLLM splits them (`PipelineStage`);
* `layout` vLLM's six physical layouts; `lengths` request-length distributions; `memory`
  memory sizes and GPU budgets.

`strategy="vllm"` reproduces vLLM 0.33 (Mamba block-size alignment, page unification, the
group-size heuristic and strided assignment, one group for same-type layers with different
page sizes, its per-request reservation and refusals). `strategy="min-waste"` searches group
widths and Mamba block sizes for the least expected waste over a length distribution, and
never admits fewer `max_model_len` requests than vLLM's plan.
"""

from hybrid_kv.planner.entry import DEFAULT_MAX_IN_FLIGHT_TOKENS, plan_kv_cache
from hybrid_kv.planner.errors import InsufficientMemoryError, PlanError
from hybrid_kv.planner.inflight import DEFAULT_MODEL_RUNNER, MODEL_RUNNERS, InFlight
from hybrid_kv.planner.layout import DEFAULT_LAYOUT, KV_CACHE_LAYOUTS
from hybrid_kv.planner.lengths import LengthDistribution
from hybrid_kv.planner.memory import format_bytes, kv_cache_budget, parse_memory
from hybrid_kv.planner.plan import (
    PLAN_SCHEMA_VERSION,
    STRATEGIES,
    CandidateSummary,
    ExpectedWaste,
    KVCacheBuffer,
    KVCacheGroup,
    KVCachePlan,
    LayerPlacement,
    WasteReport,
    admission_blocks,
    blocks_held,
)
from hybrid_kv.planner.stages import PipelineStage, parse_partition, pp_partition

__all__ = [
    "DEFAULT_LAYOUT",
    "DEFAULT_MAX_IN_FLIGHT_TOKENS",
    "DEFAULT_MODEL_RUNNER",
    "KV_CACHE_LAYOUTS",
    "MODEL_RUNNERS",
    "PLAN_SCHEMA_VERSION",
    "STRATEGIES",
    "CandidateSummary",
    "ExpectedWaste",
    "InFlight",
    "InsufficientMemoryError",
    "KVCacheBuffer",
    "KVCacheGroup",
    "KVCachePlan",
    "LayerPlacement",
    "LengthDistribution",
    "PipelineStage",
    "PlanError",
    "WasteReport",
    "admission_blocks",
    "blocks_held",
    "format_bytes",
    "kv_cache_budget",
    "parse_memory",
    "parse_partition",
    "plan_kv_cache",
    "pp_partition",
]
