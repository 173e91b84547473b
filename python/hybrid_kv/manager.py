"""Building a `KVCacheManager` from the planner's output or from a vLLM trace's header."""

from __future__ import annotations

from typing import Any

from hybrid_kv._core import KVCacheManager
from hybrid_kv.planner import KVCachePlan

__all__ = ["manager_from_header", "manager_from_plan"]


def manager_from_plan(plan: KVCachePlan, **kwargs: Any) -> KVCacheManager:
    """A manager with the plan's groups, pool size and `max_model_len`.

    `kwargs` go to `KVCacheManager` (e.g. `enable_kv_events=True`, `hash_algo="sha256"`).
    """
    if not isinstance(plan, KVCachePlan):
        raise TypeError(
            f"manager_from_plan needs a KVCachePlan (from plan_kv_cache), got {type(plan).__name__}"
        )
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


def manager_from_header(header: dict[str, Any], max_model_len: int) -> KVCacheManager:
    """A manager with exactly the KV cache groups and pool size of a vLLM `kvtrace/1` header."""
    kv = header["kv_cache"]
    if any(g["kind"] == "mamba" for g in kv["groups"]):
        raise ValueError("replaying Mamba layouts is not supported yet")
    groups = [
        {
            "kind": g["kind"],
            "block_size": g["block_size"],
            "sliding_window": g.get("sliding_window"),
            "attention_chunk_size": g.get("attention_chunk_size"),
        }
        for g in kv["groups"]
    ]
    return KVCacheManager(groups, kv["num_blocks"], max_model_len)
