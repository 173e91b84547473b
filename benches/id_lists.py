"""Time of `KVCacheBlocks.get_block_id_lists`, the block ids as lists of ints that vLLM's
scheduler reads for every admitted request (`hybrid_kv.vllm`'s `get_block_ids`).

A seven-group layout (one full-attention group, six sliding-window groups, as Gemma-3's) holds
300 requests of 1,000 tokens each in dense retention; each request's tables are read once per
pass, with other Python allocations made between reads, and everything a pass makes lives until
the pass ends (as a scheduler step's outputs do), so that the lists are made the way they are in a
running engine rather than from a hot allocator.
Prints the best of `--passes` passes: ns per list-of-lists and per block id.

Run (from the repository root, after `pip install -e .`):

    python3 benches/id_lists.py [--requests 300] [--tokens 1000] [--passes 5]

To compare two builds, put each build's `hybrid_kv` directory on `PYTHONPATH` in turn and
alternate the runs.
"""

from __future__ import annotations

import argparse
import random
import time

import hybrid_kv as hk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    groups = [{"kind": "full", "block_size": 16}] + [
        {"kind": "sliding_window", "block_size": 16, "sliding_window": 1024}
    ] * 6
    blocks_per_request = len(groups) * -(-args.tokens // 16)
    manager = hk.KVCacheManager(
        groups,
        num_blocks=args.requests * blocks_per_request + 1,
        max_model_len=max(args.tokens, 16),
        prefix_cache_retention_interval=None,
    )
    rng = random.Random(1)
    results = []
    for i in range(args.requests):
        request = hk.Request(f"r{i}", [rng.randrange(30_000) for _ in range(args.tokens)])
        new = manager.allocate_slots(request, args.tokens)
        if new is None:
            raise SystemExit("the pool is too small for the requests")
        results.append(new)
    ids = sum(len(ids) for ids in results[0].get_block_id_lists() or ())
    best = float("inf")
    for _ in range(args.passes):
        total = 0
        kept = []
        for blocks in results:
            churn = [object() for _ in range(200)]
            t0 = time.perf_counter_ns()
            lists = blocks.get_block_id_lists()
            total += time.perf_counter_ns() - t0
            kept.append((lists, churn))
        del kept
        best = min(best, total / len(results))
    print(f"hybrid_kv from {hk.__file__}")
    print(f"get_block_id_lists: {best:,.0f} ns per call, {ids} ids, {best / ids:.1f} ns per id")


if __name__ == "__main__":
    main()
