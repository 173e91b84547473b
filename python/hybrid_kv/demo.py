"""`hybrid-kv demo`: a short walk through the block pool that prints what happens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hybrid_kv._core import BlockPool, hash_token_blocks


def run_demo(
    num_blocks: int = 11, block_size: int = 16, echo: Callable[[str], None] = print
) -> dict[str, int]:
    """Allocates, caches, hits and evicts blocks; returns the counters it printed."""
    pool = BlockPool(num_blocks, enable_kv_events=True)
    echo(f"pool: {num_blocks} blocks of {block_size} tokens (block 0 is the null block)")
    echo(f"  free order: {pool.free_order().tolist()}")

    rng = np.random.default_rng(0)
    system = rng.integers(0, 32_000, size=3 * block_size, dtype=np.int64)
    prompt_a = np.concatenate([system, rng.integers(0, 32_000, size=block_size)])
    hashes_a = hash_token_blocks(prompt_a, block_size)
    blocks_a = pool.get_new_blocks(len(hashes_a))
    pool.cache_full_blocks(blocks_a, hashes_a)
    echo(f"request A: {len(prompt_a)} tokens -> blocks {blocks_a.tolist()}, all cached")
    pool.free_blocks(blocks_a[::-1])
    echo(f"request A finished; freed tail first, free order: {pool.free_order().tolist()}")

    prompt_b = np.concatenate([system, rng.integers(0, 32_000, size=2 * block_size)])
    hashes_b = hash_token_blocks(prompt_b, block_size)
    hit: list[int] = []
    for h in hashes_b:
        found = pool.get_cached_block(h, [0])
        if found is None:
            break
        hit.append(int(found[0]))
    pool.touch(hit)
    fresh = pool.get_new_blocks(len(hashes_b) - len(hit))
    echo(
        f"request B shares the {len(system)}-token system prompt: prefix hit of {len(hit)} "
        f"blocks {hit} ({len(hit) * block_size} tokens), new blocks {fresh.tolist()}"
    )
    hits = len(hit)

    filler = pool.get_new_blocks(pool.num_free_blocks)
    removed = [e for e in pool.take_events() if type(e).__name__ == "BlockRemoved"]
    echo(
        f"filling the pool with {len(filler)} more blocks evicts {len(removed)} cached "
        f"block(s) in LRU order; usage {pool.usage:.0%}"
    )
    pool.free_blocks(np.concatenate([filler, fresh, np.array(hit, dtype=np.int32)]))
    echo(f"all freed: {pool.num_free_blocks} free, {pool.num_cached_blocks} still cached")
    return {"hit_blocks": hits, "evicted": len(removed), "cached": pool.num_cached_blocks}
