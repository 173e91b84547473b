"""One manager, and one pool, driven from several Python threads at once with calls that succeed
and calls that fail (past capacity, unknown or dropped requests, stale hits, resets while others
allocate, events drained while others allocate, requests dropped from another thread). The
threads switch every microsecond so calls interleave. Afterwards the state adds up: every block
is free or held, no block is held twice without caching, the KV events replay to the cache's keys,
and once every request is gone every block is free and the cache resets. Each run is a
subprocess (a deadlock would hang the suite)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# The cache's keys a consumer of the events believes in, replaying them in order (each removal
# after a store of its key), as a KV-aware router does.
REPLAY = textwrap.dedent(
    r"""
    import collections
    import hybrid_kv as hk

    def replayed_keys(events):
        keys = collections.Counter()
        for e in events:
            if isinstance(e, hk.BlockStored):
                keys.update((h, e.group_id) for h in e.block_hashes)
            elif isinstance(e, hk.BlockRemoved):
                key = (e.block_hash, e.group_id)
                assert keys[key] > 0, f"{e} without a store before it"
                keys[key] -= 1
                keys += collections.Counter()
            else:
                keys.clear()
        return keys
    """
)

MANAGER_SCRIPT = REPLAY + textwrap.dedent(
    r"""
    import collections, gc, random, sys, threading
    import numpy as np
    import hybrid_kv as hk

    sys.setswitchinterval(1e-6)
    seed, caching, layout = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    layouts = {
        "full": [{"kind": "full", "block_size": 4}],
        "sw": [{"kind": "full", "block_size": 4},
               {"kind": "sliding_window", "block_size": 4, "sliding_window": 8}],
        "mamba": [{"kind": "mamba", "block_size": 8}, {"kind": "full", "block_size": 8}],
        "chunked": [{"kind": "chunked_local", "block_size": 4, "attention_chunk_size": 8},
                    {"kind": "full", "block_size": 4}],
    }
    NB = 48
    m = hk.KVCacheManager(layouts[layout], NB, 200, enable_caching=caching,
                          enable_kv_events=True)
    live, live_lock, event_lock = {}, threading.Lock(), threading.Lock()
    events, unexpected = [], []
    prefixes = [list(range(1, 20)), list(range(100, 130)), [7] * 25]

    def drain():
        with event_lock:
            events.extend(m.take_events())

    def pick(rng):
        with live_lock:
            return rng.choice(list(live.values())) if live else None

    def work(t):
        rng = random.Random(seed * 100 + t)
        for _ in range(1500):
            op = rng.randrange(13)
            try:
                if op == 0:
                    rid = f"r{rng.randrange(12)}"
                    tokens = rng.choice(prefixes)[: rng.randrange(1, 30)]
                    tokens += [rng.randrange(5) for _ in range(rng.randrange(10))]
                    request = hk.Request(rid, tokens, block_size=m.hash_block_size)
                    with live_lock:
                        live[rid] = request
                elif op <= 3:
                    r = pick(rng)
                    if r is None:
                        continue
                    if r.num_computed_tokens == 0:
                        blocks, hit = m.get_computed_blocks(r)
                        new = m.allocate_slots(r, max(r.num_tokens - hit, 1), hit, blocks,
                                               num_lookahead_tokens=rng.randrange(3))
                        if new is not None:
                            r.num_computed_tokens = r.num_tokens
                    else:
                        n = rng.choice([1, 5, 1000, r.num_tokens - r.num_computed_tokens])
                        if m.allocate_slots(r, n) is not None:
                            r.num_computed_tokens = min(r.num_computed_tokens + n, r.num_tokens)
                            r.append_output_token_ids(rng.randrange(50))
                elif op == 4:
                    r = pick(rng)
                    if r is not None:
                        m.free(r)
                elif op == 5:
                    m.remove_request(f"r{rng.randrange(16)}")
                elif op == 6:
                    m.reset_prefix_cache()
                elif op == 7:
                    drain()
                elif op == 8:
                    with live_lock:
                        if live:
                            del live[rng.choice(list(live))]
                elif op == 9:
                    m.get_block_ids(f"r{rng.randrange(12)}")
                elif op == 10:
                    out = np.full((3, 64), -1, dtype=np.int32)
                    ids = [f"r{rng.randrange(12)}" for _ in range(3)]
                    m.write_block_table(ids, out, rng.randrange(m.num_groups))
                elif op == 11:
                    m.probe(rng.choice(prefixes))
                    m.num_free_blocks, m.num_cached_blocks, repr(m)
                else:
                    ids = np.concatenate(m.get_block_ids(f"r{rng.randrange(12)}"))
                    m.evict_blocks(ids[: rng.randrange(len(ids) + 1)])
                    m.new_step_starts()
            except hk.HybridKvError:
                pass
            except BaseException as error:
                unexpected.append(repr(error))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not unexpected, unexpected[:5]
    drain()
    keys = replayed_keys(events)
    assert len(keys) == m.num_cached_blocks, (len(keys), m.num_cached_blocks)
    held = []
    for rid in list(live):
        try:
            held += [b for table in m.get_block_ids(rid) for b in table.tolist() if b]
        except hk.UnknownRequestError:
            pass
    if not caching:
        assert len(held) == len(set(held)), "a block held twice"
        assert m.num_free_blocks + len(held) == NB - 1, (m.num_free_blocks, len(held))
    live.clear()
    gc.collect()
    assert m.num_requests == 0 and m.num_free_blocks == NB - 1, m
    assert m.reset_prefix_cache() and m.num_cached_blocks == 0
    print("ok")
    """
)

POOL_SCRIPT = REPLAY + textwrap.dedent(
    r"""
    import collections, random, sys, threading
    import hybrid_kv as hk

    sys.setswitchinterval(1e-6)
    seed, NT, NB = int(sys.argv[1]), 4, 65
    pool = hk.BlockPool(NB, enable_kv_events=True)
    owned = [collections.Counter() for _ in range(NT)]
    unexpected, events, event_lock = [], [], threading.Lock()

    def work(t):
        rng = random.Random(seed * 10 + t)
        mine, freed = owned[t], []
        for _ in range(2500):
            op = rng.randrange(9)
            try:
                if op <= 1:
                    ids = pool.get_new_blocks(rng.choice([1, 2, 3, 20])).tolist()
                    assert 0 not in ids and not any(mine[b] for b in ids), ids
                    mine.update(ids)
                elif op == 2 and mine:
                    blocks = rng.sample(sorted(mine), min(len(mine), 3))
                    pool.cache_full_blocks(blocks, [(t << 32) | rng.randrange(64) for _ in blocks],
                                           rng.randrange(2))
                elif op == 3 and mine:
                    # A bad id anywhere in the call frees nothing.
                    try:
                        pool.free_blocks([rng.choice(sorted(mine)), NB + 5])
                        unexpected.append("an out-of-range id was freed")
                    except hk.InvalidBlockIdError:
                        pass
                elif op == 4 and mine:
                    blocks = sorted(mine)[: rng.randrange(1, 6)]
                    keys = [pool.block_hash(b) for b in blocks]
                    pool.free_blocks(blocks[::-1])
                    for b, key in zip(blocks, keys):
                        mine[b] -= 1
                        if key is not None:
                            freed.append(b)
                    mine += collections.Counter()
                elif op == 5 and freed:
                    # Revive a cached block freed earlier (with one held block): all or nothing.
                    b = freed.pop(rng.randrange(len(freed)))
                    extra = [rng.choice(sorted(mine))] if mine else []
                    try:
                        pool.touch(extra + [b])
                        mine.update(extra + [b])
                    except hk.BlockEvictedError:
                        pass
                elif op == 6:
                    pool.reset_prefix_cache()
                elif op == 7:
                    with event_lock:
                        events.extend(pool.take_events())
                elif mine:
                    pool.evict_blocks([rng.choice(sorted(mine))])
            except hk.NotEnoughFreeBlocksError:
                pass
            except BaseException as error:
                unexpected.append(repr(error))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(NT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not unexpected, unexpected[:5]
    total = sum(owned, collections.Counter())
    for b in range(1, NB):
        assert pool.ref_count(b) == total[b], (b, pool.ref_count(b), total[b])
    order = pool.free_order().tolist()
    assert len(order) == len(set(order)) == pool.num_free_blocks
    assert set(order) == {b for b in range(1, NB) if not total[b]}
    events.extend(pool.take_events())
    keys = replayed_keys(events)
    assert len(keys) == pool.num_cached_blocks, (len(keys), pool.num_cached_blocks)
    print("ok")
    """
)


def _run(script: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("caching", ["1", "0"])
@pytest.mark.parametrize("layout", ["full", "sw", "mamba", "chunked"])
def test_one_manager_used_from_several_threads_stays_consistent(layout: str, caching: str) -> None:
    _run(MANAGER_SCRIPT, "7", caching, layout)


@pytest.mark.parametrize("seed", [1, 2])
def test_one_pool_used_from_several_threads_keeps_exact_reference_counts(seed: int) -> None:
    _run(POOL_SCRIPT, str(seed))
