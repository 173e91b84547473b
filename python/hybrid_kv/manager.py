"""Building a `KVCacheManager` from the planner's output or from a vLLM trace's header."""

from __future__ import annotations

from typing import Any

from hybrid_kv._core import KVCacheManager
from hybrid_kv.planner import KVCachePlan

__all__ = ["manager_from_header", "manager_from_plan"]


def manager_from_plan(plan: KVCachePlan, **kwargs: Any) -> KVCacheManager:
    """A manager with the plan's groups, pool size, `max_model_len` and the tokens in flight the
    plan's admission assumed (`max_in_flight_tokens`).

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
            # vLLM 0.33's Mamba-2 mixer exports prefill checkpoints at any token (alignment 1).
            "num_prefill_checkpoint_blocks": g.prefill_checkpoint_blocks,
            "prefill_checkpoint_alignment": 1 if g.prefill_checkpoint_blocks else None,
        }
        for g in plan.groups
    ]
    kwargs.setdefault("max_in_flight_tokens", plan.max_in_flight_tokens)
    return KVCacheManager(groups, plan.num_blocks, plan.max_model_len, **kwargs)


def manager_from_header(
    header: dict[str, Any], max_model_len: int, max_in_flight_tokens: int | None = None
) -> KVCacheManager:
    """A manager with exactly the KV cache groups, pool size, block sizes (the scheduler's and
    the hash block size, as vLLM resolved them, when the header gives them) and prefix-cache
    retention of a vLLM `kvtrace/1` header. `max_in_flight_tokens` is what vLLM's scheduler
    passes (its `max_num_batched_tokens` for a synchronous engine)."""
    kv = header["kv_cache"]
    groups = []
    for g in kv["groups"]:
        group = {"kind": g["kind"], "block_size": g["block_size"]}
        for key in (
            "sliding_window",
            "attention_chunk_size",
            "mamba_cache_mode",
            "num_prefill_checkpoint_blocks",
            "prefill_checkpoint_alignment",
        ):
            if g.get(key) is not None:
                group[key] = g[key]
        groups.append(group)
    return KVCacheManager(
        groups,
        kv["num_blocks"],
        max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        prefix_cache_retention_interval=kv.get("prefix_cache_retention_interval"),
        scheduler_block_size=kv.get("scheduler_block_size"),
        hash_block_size=kv.get("hash_block_size"),
    )
