"""Building a `KVCacheManager` from the planner's output."""

from __future__ import annotations

from typing import Any

from hybrid_kv._core import KVCacheManager
from hybrid_kv.planner import KVCachePlan

__all__ = ["manager_from_plan"]


def manager_from_plan(plan: KVCachePlan, **kwargs: Any) -> KVCacheManager:
    """A manager with the plan's groups, pool size and `max_model_len`.

    `kwargs` go to `KVCacheManager` (e.g. `enable_kv_events=True`, `hash_algo="sha256"`).
    """
    groups = [
        {
            "kind": g.kind,
            "block_size": g.block_size,
            "sliding_window": g.sliding_window,
            "attention_chunk_size": g.attention_chunk_size,
        }
        for g in plan.groups
    ]
    return KVCacheManager(groups, plan.num_blocks, plan.max_model_len, **kwargs)
