"""Which vLLM configurations hybrid-kv's manager serves, in one table.

Each entry names a vLLM option (or a kind of KV cache group) that hybrid-kv's manager does not
implement with vLLM 0.33's semantics yet, and the reason. When the scheduler is built, the first
matching entry makes `hybrid_kv.vllm.Scheduler` keep vLLM's own `KVCacheManager` and log that
reason once; no configuration is served with different semantics. The table shrinks as the core
gains features: an entry whose feature lands is deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

# vLLM spec types served by hybrid-kv, matched by exact type (vLLM's subclasses such as RSWASpec,
# SlidingWindowMLASpec or SinkFullAttentionSpec have other managers) -> the core's group kind.
GROUP_KINDS: Mapping[type[KVCacheSpec], str] = {
    FullAttentionSpec: "full",
    MLAAttentionSpec: "full",
    SlidingWindowSpec: "sliding_window",
    ChunkedLocalAttentionSpec: "chunked_local",
    MambaSpec: "mamba",
}


@dataclass(frozen=True)
class BuildContext:
    """What the scheduler knows when it builds its KV cache manager."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    manager_kwargs: Mapping[str, Any]

    @property
    def specs(self) -> list[KVCacheSpec]:
        return [group.kv_cache_spec for group in self.kv_cache_config.kv_cache_groups]

    def has(self, *types: type[KVCacheSpec]) -> bool:
        return any(type(spec) in types for spec in self.specs)

    @property
    def caching(self) -> bool:
        return bool(self.manager_kwargs.get("enable_caching", True))


def _unknown_group(ctx: BuildContext) -> str | None:
    for index, group in enumerate(ctx.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) not in GROUP_KINDS:
            return f"group {index} is a {type(spec).__name__}"
        if group.role != KVCacheGroupRole.DEFAULT:
            return f"group {index} has role {group.role.value}"
        if spec.prefix_replay_tokens > 0:
            return f"group {index} replays {spec.prefix_replay_tokens} tokens after a hit"
    return None


def _hit_alignment(ctx: BuildContext) -> str | None:
    # vLLM's EngineCore sets the config's alignment to where its coordinator puts hits (the hash
    # block with fine-grained partial hash hits, else the scheduler block); the manager derives
    # the same. Any other value was set by someone else, and vLLM's manager ignores it too, but
    # a connector reading it would then disagree with hybrid-kv's hits.
    alignment = ctx.kv_cache_config.cache_hit_alignment_tokens
    scheduler_block_size = ctx.manager_kwargs.get("scheduler_block_size")
    hash_block_size = ctx.manager_kwargs.get("hash_block_size")
    if alignment is None or scheduler_block_size is None or hash_block_size is None:
        return None
    expected = resolve_cache_hit_alignment_tokens(
        ctx.kv_cache_config, ctx.vllm_config, scheduler_block_size, hash_block_size
    )
    if alignment != expected:
        return f"{alignment}, where vLLM's coordinator puts hits every {expected} tokens"
    return None


Check = Callable[[BuildContext], "str | bool | None"]

# (vLLM option or feature, check, why hybrid-kv cannot serve it yet). A check returns a truthy
# value (True or a detail string) when the configuration has that feature.
FALLBACKS: tuple[tuple[str, Check, str], ...] = (
    (
        "kv_transfer_config (KV connectors, P/D disaggregation, offloading)",
        lambda ctx: ctx.vllm_config.kv_transfer_config is not None,
        "connectors need external computed tokens, block_pool access and delayed caching",
    ),
    (
        "no KV cache group, with prefix caching",
        lambda ctx: ctx.caching and not ctx.kv_cache_config.kv_cache_groups,
        "vLLM 0.33's prefix-caching coordinator needs a cacheable group and fails its "
        "assertion building the manager (so does this scheduler, with vLLM's manager)",
    ),
    (
        "KV cache group kind",
        _unknown_group,
        "only full, MLA, sliding-window, chunked-local and Mamba groups are implemented",
    ),
    (
        "decode/prefill context parallelism",
        lambda ctx: (
            ctx.manager_kwargs.get("dcp_world_size", 1) > 1
            or ctx.manager_kwargs.get("pcp_world_size", 1) > 1
        ),
        "context-parallel block sizes are not implemented",
    ),
    (
        "kv_cache_metrics (observability)",
        lambda ctx: ctx.manager_kwargs.get("metrics_collector") is not None,
        "per-block residency metrics need vLLM's block objects",
    ),
    (
        "HiSparse host tier",
        lambda ctx: ctx.kv_cache_config.hisparse_host_num_blocks is not None,
        "host-resident block pools are not implemented",
    ),
    (
        "cache_hit_alignment_tokens",
        _hit_alignment,
        "hits aligned to other than where vLLM's coordinator puts them are not implemented",
    ),
    (
        "aux_output_config",
        lambda ctx: ctx.vllm_config.aux_output_config.enabled,
        "auxiliary-output connectors cap cache hits (max_cache_hit_length)",
    ),
    (
        "enable_prompt_embeds with lookahead hashes of a hash block or more",
        lambda ctx: (
            ctx.caching
            and ctx.vllm_config.model_config.enable_prompt_embeds
            and ctx.manager_kwargs.get("num_hash_lookahead_tokens", 0)
            >= ctx.manager_kwargs.get("hash_block_size", 1)
        ),
        "a block's prompt-embeddings key is placed between the lookahead of the block before "
        "it and its own end, which needs fewer lookahead tokens than a hash block",
    ),
    (
        "encoder-decoder models",
        lambda ctx: ctx.vllm_config.model_config.is_encoder_decoder,
        "cross-attention blocks (num_encoder_tokens) are not implemented",
    ),
)


def fallback_reason(ctx: BuildContext) -> str | None:
    """The reason vLLM's own manager must serve this configuration, or None."""
    for option, check, why in FALLBACKS:
        found = check(ctx)
        if found:
            detail = f" ({found})" if isinstance(found, str) else ""
            return f"{option}{detail}: {why}"
    return None
