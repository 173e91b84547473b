"""Building a `KVCacheManager` from the planner's output or from a vLLM trace's header."""

from __future__ import annotations

from typing import Any

from hybrid_kv._core import _GROUP_FIELDS as _CORE_GROUP_FIELDS
from hybrid_kv._core import KVCacheManager
from hybrid_kv.planner import KVCachePlan

__all__ = ["manager_from_header", "manager_from_plan"]


def manager_from_plan(plan: KVCachePlan, **kwargs: Any) -> KVCacheManager:
    """A manager with the plan's groups (Mamba groups in the plan's `mamba_cache_mode`), pool
    size, `max_model_len`, prefix caching on or off as the plan was made, its scheduler and hash
    block sizes, and the tokens in flight the plan's admission assumed (`max_in_flight_tokens`).

    `kwargs` go to `KVCacheManager` (e.g. `enable_kv_events=True`, `hash_algo="sha256"`) and
    override what the plan sets.
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
            **({"mamba_cache_mode": plan.mamba_cache_mode} if g.kind == "mamba" else {}),
        }
        for g in plan.groups
    ]
    caching = kwargs.setdefault("enable_caching", plan.enable_prefix_caching)
    kwargs.setdefault("max_in_flight_tokens", plan.max_in_flight_tokens)
    if plan.groups:
        kwargs.setdefault("scheduler_block_size", plan.scheduler_block_size)
        if caching and plan.enable_prefix_caching:
            # Without caching the plan's hash block size means nothing (vLLM's is then the
            # scheduler block); the manager's default is used.
            kwargs.setdefault("hash_block_size", plan.hash_block_size)
    return KVCacheManager(groups, plan.num_blocks, plan.max_model_len, **kwargs)


# vLLM 0.33 spec class (a trace header's `spec`) -> the core's group kind, or None where the
# header's `kind` says it (layers of one kind with different shapes). A header's `kind` is vLLM's
# coarser kind name (an RSWASpec group may read "full"): the spec decides when given.
_SPEC_KINDS: dict[str, str | None] = {
    "FullAttentionSpec": "full",
    "MLAAttentionSpec": "mla",
    # vLLM serves these groups with its full-attention manager.
    "HiddenStateCacheSpec": "full",
    "RSWASpec": "rswa",
    "SlidingWindowSpec": "sliding_window",
    "SlidingWindowMLASpec": "sliding_window_mla",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MambaSpec": "mamba",
    "CircularBufferSpec": "circular_buffer",
    "UniformTypeKVCacheSpecs": None,
}
# A header group's fields the core's group spec reads besides its kind and block size (vLLM's
# spec attributes of the same name).
_GROUP_FIELDS = tuple(f for f in _CORE_GROUP_FIELDS if f not in ("kind", "block_size"))


def _header_group(index: int, g: dict[str, Any]) -> dict[str, Any]:
    """The core's group spec for group `index` of a trace header. A spec whose manager the core
    does not implement is a `ValueError` naming it (a replay must not run it as another kind)."""
    spec = g.get("spec")
    if spec is not None and (not isinstance(spec, str) or spec not in _SPEC_KINDS):
        raise ValueError(
            f"header group {index}: vLLM spec {spec!r} has no hybrid-kv group kind (known: "
            f"{', '.join(sorted(_SPEC_KINDS))})"
        )
    kind = (_SPEC_KINDS[spec] if spec is not None else None) or g.get("kind")
    for key, value in (("kind", kind), ("block_size", g.get("block_size"))):
        if value is None:
            raise ValueError(f"header group {index}: missing {key!r}")
    group = {"kind": kind, "block_size": g["block_size"]}
    for key in _GROUP_FIELDS:
        if g.get(key) is not None:
            group[key] = g[key]
    return group


def manager_from_header(
    header: dict[str, Any], max_model_len: int, max_in_flight_tokens: int | None = None
) -> KVCacheManager:
    """A manager with exactly the KV cache groups, pool size, block sizes (the scheduler's and
    the hash block size, as vLLM resolved them, when the header gives them) and prefix-cache
    retention of a vLLM `kvtrace/1` header. `max_in_flight_tokens` is what vLLM's scheduler
    passes (its `max_num_batched_tokens` for a synchronous engine). A group is built from its
    `spec` (vLLM's class name) when the header gives one, with every field of it the core reads
    (`sliding_window`, `rswa_window`, `num_speculative_blocks`, ...); a spec hybrid-kv has no
    group kind for is a `ValueError`, as is a header without a `kv_cache` object holding
    `num_blocks` and a list of group objects."""
    kv = header.get("kv_cache") if isinstance(header, dict) else None
    if not isinstance(kv, dict):
        raise ValueError("not a kvtrace/1 header: no 'kv_cache' object")
    if "num_blocks" not in kv:
        raise ValueError("header kv_cache: missing 'num_blocks'")
    raw = kv.get("groups")
    if not isinstance(raw, list) or not all(isinstance(g, dict) for g in raw):
        raise ValueError("header kv_cache: 'groups' must be a list of objects")
    groups = [_header_group(i, g) for i, g in enumerate(raw)]
    return KVCacheManager(
        groups,
        kv["num_blocks"],
        max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        prefix_cache_retention_interval=kv.get("prefix_cache_retention_interval"),
        scheduler_block_size=kv.get("scheduler_block_size"),
        hash_block_size=kv.get("hash_block_size"),
    )
