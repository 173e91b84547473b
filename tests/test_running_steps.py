"""Running steps inside the horizon: `allocate_slots` of a running request whose step changes
nothing (the running horizon its last allocation left) is answered from the request alone.

The reference in every differential test below is a twin manager whose requests never hold a
horizon: `running_horizon(request)` names the request, which ends the horizon, so the twin's
next `allocate_slots` takes the manager's whole path."""

from __future__ import annotations

import gc
import random

import hybrid_kv as hk
import numpy as np
import pytest

FULL = {"kind": "full", "block_size": 4}
SW6 = {"kind": "sliding_window", "block_size": 4, "sliding_window": 6}
CHUNKED8 = {"kind": "chunked_local", "block_size": 4, "attention_chunk_size": 8}
MAMBA = {"kind": "mamba", "block_size": 4}

LAYOUTS = {
    "full": [FULL],
    "full+sw": [FULL, SW6],
    "sw+chunked": [SW6, CHUNKED8],
    "full+mamba": [FULL, MAMBA],
    "full+sw-bs8": [{"kind": "full", "block_size": 8}, SW6, SW6],
}


def admit(m: hk.KVCacheManager, req: hk.Request) -> object:
    blocks, hit = m.get_computed_blocks(req)
    return m.allocate_slots(
        req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
    )


def events(m: hk.KVCacheManager) -> list[tuple]:
    """The manager's pending events as comparable tuples of their fields."""
    return [
        (type(e).__name__, *(repr(getattr(e, a)) for a in sorted(dir(e)) if not a.startswith("_")))
        for e in m.take_events()
    ]


def ids(blocks: object) -> list[list[int]] | None:
    if blocks is None:
        return None
    return [list(map(int, g)) for g in blocks.get_block_ids()]


def test_a_step_inside_the_horizon_changes_nothing_and_its_tokens_arrive_later() -> None:
    m = hk.KVCacheManager([FULL], 64, 1024, enable_kv_events=True)
    req = hk.Request("a", list(range(10)), block_size=4)
    assert req._held_horizon is None
    admit(m, req)
    req.num_computed_tokens = 10
    # 10 tokens: three blocks (12 slots), two cached; the third fills at 12 tokens.
    assert req._held_horizon == (12, 12, 2**64 - 1)
    m.take_events()
    req.append_output_token_ids(50)
    free, cached = m.num_free_blocks, m.num_cached_blocks
    new = m.allocate_slots(req, 1)
    assert ids(new) == [[]]
    assert (m.num_free_blocks, m.num_cached_blocks, events(m)) == (free, cached, [])
    assert req._held_horizon == (12, 12, 2**64 - 1)
    req.num_computed_tokens = 11
    req.append_output_token_ids(51)
    # The step to 12 tokens fills the third block: it reaches the manager, which takes both
    # tokens appended since its last call and caches the block under their hash.
    m.allocate_slots(req, 1)
    assert m.num_cached_blocks == cached + 1
    req.num_computed_tokens = 12
    other = hk.Request("b", [*range(10), 50, 51, 7], block_size=4)
    _, hit = m.get_computed_blocks(other)
    assert hit == 12


def test_every_other_call_naming_the_request_ends_its_horizon() -> None:
    m = hk.KVCacheManager([FULL, SW6], 64, 1024)
    calls = {
        "get_computed_blocks": lambda r: m.get_computed_blocks(r),
        "cache_blocks": lambda r: m.cache_blocks(r, 8),
        "estimate_cached_tokens": lambda r: m.estimate_cached_tokens(r),
        "running_horizon": lambda r: m.running_horizon(r),
        "finalize_partial_tail_offloads": lambda r: m.finalize_partial_tail_offloads(r),
        "pop_blocks_for_free": lambda r: m.pop_blocks_for_free(r),
        "free": lambda r: m.free(r),
    }
    for name, call in calls.items():
        req = hk.Request(name, list(range(10)), block_size=4)
        admit(m, req)
        req.num_computed_tokens = 10
        assert req._held_horizon is not None
        call(req)
        assert req._held_horizon is None, name
        m.free(req)


@pytest.mark.parametrize(
    "change",
    ["remove_request", "remove_skipped_blocks", "evict_blocks", "reset_prefix_cache", "free"],
)
def test_a_change_made_by_request_id_is_seen_by_the_next_running_step(change: str) -> None:
    # Each of these may change the request's blocks without naming its `Request` object; the
    # step after it must behave as the twin's (which takes the whole path), not be answered
    # from the horizon read before the change.
    sw16 = {**SW6, "sliding_window": 16}
    managers = [hk.KVCacheManager([FULL, sw16], 32, 1024) for _ in range(2)]
    reqs = [hk.Request("r", list(range(10)), block_size=4) for _ in managers]
    for m, req in zip(managers, reqs, strict=True):
        admit(m, req)
        req.num_computed_tokens = 10
        req.append_output_token_ids(3)
        # Before the change, the step to 11 tokens lies inside the horizon.
        slots, cache, removal = req._held_horizon
        assert 11 <= slots and 11 < cache and 10 < removal
        if change == "remove_request":
            m.remove_request("r")
        elif change == "remove_skipped_blocks":
            m.remove_skipped_blocks("r", 10)
        elif change == "evict_blocks":
            m.evict_blocks(np.concatenate(m.get_block_ids("r")))
        elif change == "reset_prefix_cache":
            m.reset_prefix_cache()
        else:
            m.free(req)
    fast, twin = managers
    fast_req, twin_req = reqs
    if change in ("remove_request", "free"):
        # The request holds nothing now: a step from 10 computed tokens is refused on both
        # (answered from the old horizon, it would have been the empty result), and both
        # re-admit it alike from 0, as vLLM re-admits a preempted request.
        for m, req in zip(managers, reqs, strict=True):
            free_before = m.num_free_blocks
            with pytest.raises(hk.InvalidArgumentError, match="holds no blocks"):
                m.allocate_slots(req, 1)
            assert m.num_free_blocks == free_before
            req.num_computed_tokens = 0
        assert ids(fast.allocate_slots(fast_req, 11)) == ids(twin.allocate_slots(twin_req, 11))
    else:
        twin.running_horizon(twin_req)
        assert ids(fast.allocate_slots(fast_req, 1)) == ids(twin.allocate_slots(twin_req, 1))
    assert fast.num_free_blocks == twin.num_free_blocks
    assert fast.num_cached_blocks == twin.num_cached_blocks
    for g_fast, g_twin in zip(fast.get_block_ids("r"), twin.get_block_ids("r"), strict=True):
        assert g_fast.tolist() == g_twin.tolist()


def test_a_horizon_one_manager_left_is_not_used_by_another() -> None:
    # One request object driven through two managers: the second manager's pool is full, so
    # its step must fail there even though the first manager's horizon says nothing is needed.
    roomy = hk.KVCacheManager([FULL], 16, 1024)
    tight = hk.KVCacheManager([FULL], 4, 1024)
    req = hk.Request("r", list(range(8)), block_size=4)
    admit(roomy, req)
    req.num_computed_tokens = 8
    assert roomy.allocate_slots(req, 1) is not None  # a new block: horizon (12, 12, max)
    assert req._held_horizon == (12, 12, 2**64 - 1)
    blocker = hk.Request("x", list(range(100, 112)), block_size=4)
    admit(tight, blocker)  # takes all 3 usable blocks
    # The request holds nothing in `tight`: its step is refused there (from the first
    # manager's horizon it would have been the empty result), and nothing changes.
    with pytest.raises(hk.InvalidArgumentError, match="holds no blocks"):
        tight.allocate_slots(req, 1)
    assert tight.num_free_blocks == 0


def _differential(layout: str, seed: int, steps: int) -> int:
    """Drives a manager and its twin through the same random scheduler calls and compares
    every answer; returns how many running steps the fast manager answered from a horizon."""
    rng = random.Random(seed)
    groups = LAYOUTS[layout]
    retention = rng.choice([0, None])
    fast, twin = (
        hk.KVCacheManager(
            groups, 48, 256, enable_kv_events=True, prefix_cache_retention_interval=retention
        )
        for _ in range(2)
    )
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    running: dict[str, tuple[hk.Request, hk.Request]] = {}
    answered = 0
    serial = 0

    def check(where: str) -> None:
        assert fast.num_free_blocks == twin.num_free_blocks, where
        assert fast.num_cached_blocks == twin.num_cached_blocks, where
        assert events(fast) == events(twin), where
        for rid in running:
            for x, y in zip(fast.get_block_ids(rid), twin.get_block_ids(rid), strict=True):
                assert x.tolist() == y.tolist(), where

    for step in range(steps):
        fast.new_step_starts()
        twin.new_step_starts()
        op = rng.random()
        if op < 0.15 or not running:
            serial += 1
            rid = f"r{serial}"
            prompt = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 9))
            ]
            pair = (hk.Request(rid, prompt, block_size=4), hk.Request(rid, prompt, block_size=4))
            results = [ids(admit(m, r)) for m, r in zip((fast, twin), pair, strict=True)]
            assert results[0] == results[1], f"step {step}: admit {rid}"
            if results[0] is not None:
                # (No loop variable may keep a request alive: the "gc" step drops them.)
                pair[0].num_computed_tokens = pair[1].num_computed_tokens = len(prompt)
                running[rid] = pair
            check(f"step {step}: admit")
            continue
        rid = rng.choice(sorted(running))
        a, b = running[rid]
        if op < 0.8:
            # A decode step: a token appended by the model, sometimes lookahead slots, sometimes
            # a token scheduled but not yet processed (async scheduling).
            a.append_output_token_ids(7)
            b.append_output_token_ids(7)
            lookahead = rng.choice([0, 0, 0, 1, 2])
            # Under async scheduling the newest computed token may not be processed yet: its
            # window blocks stay until it is (the counts are passed with the call).
            in_flight = rng.choice([0, 0, 1])
            held = a._held_horizon
            b_counts = (b.num_computed_tokens, b.num_in_flight_tokens)
            twin.running_horizon(b)
            results = [
                ids(
                    m.allocate_slots(
                        r,
                        1,
                        num_lookahead_tokens=lookahead,
                        num_computed_tokens=b_counts[0],
                        num_in_flight_tokens=in_flight,
                    )
                )
                for m, r in ((fast, a), (twin, b))
            ]
            assert results[0] == results[1], f"step {step}: decode {rid}"
            if results[0] is None:
                fast.free(a)
                twin.free(b)
                del running[rid]
            else:
                answered += (
                    held is not None
                    and a._held_horizon == held
                    and results[0] == [[] for _ in groups]
                )
                a.num_in_flight_tokens = b.num_in_flight_tokens = 0
                a.num_computed_tokens = b.num_computed_tokens = b_counts[0] + 1
        elif op < 0.86:
            fast.free(a)
            twin.free(b)
            del running[rid]
        elif op < 0.9:
            for m in (fast, twin):
                m.remove_request(rid)
            del running[rid]
        elif op < 0.93:
            processed = rng.randrange(a.num_computed_tokens + 1)
            for m in (fast, twin):
                m.remove_skipped_blocks(rid, processed)
        elif op < 0.96:
            victims = [int(x) for g in fast.get_block_ids(rid) for x in g if x][:2]
            for m in (fast, twin):
                m.evict_blocks(victims)
        elif op < 0.98:
            assert fast.reset_prefix_cache() == twin.reset_prefix_cache()
        else:
            del running[rid]
            del a, b
            pair = None
            gc.collect()
        check(f"step {step}: op {op:.2f}")
    return answered


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(4))
def test_running_steps_answered_from_the_horizon_match_the_whole_path(
    layout: str, seed: int
) -> None:
    answered = _differential(layout, seed, 300)
    if layout != "full+mamba":
        # The test reaches what it tests: most decode steps are answered from a horizon.
        assert answered > 20
    else:
        # Mamba groups keep per-step state: no running step is known to change nothing.
        assert answered == 0


def test_running_steps_on_many_threads_with_changes_by_id_keep_the_pool_exact() -> None:
    from thread_runner import run_threads

    m = hk.KVCacheManager([FULL, SW6], 4096, 4096)
    reqs = [hk.Request(f"t{i}", list(range(i, i + 20)), block_size=4) for i in range(4)]
    for req in reqs:
        admit(m, req)
        req.num_computed_tokens = 20

    def work(i: int) -> None:
        if i == len(reqs):
            # Changes by id while the others step: out-of-window removals and evictions.
            for k in range(2000):
                rid = f"t{k % len(reqs)}"
                m.remove_skipped_blocks(rid, 0)
                m.evict_blocks([1 + k % 64])
            return
        req = reqs[i]
        for _ in range(2000):
            req.append_output_token_ids(5)
            assert m.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1

    run_threads(work, len(reqs) + 1)
    held = set()
    for req in reqs:
        tables = m.get_block_ids(req.request_id)
        # The full group holds one block per 4 tokens; the window group its last blocks.
        assert len(tables[0]) == -(-req.num_computed_tokens // 4)
        held |= {int(x) for g in tables for x in g if x}
    for req in reqs:
        m.free(req)
    assert m.num_free_blocks == m.num_blocks - 1
    assert len(held) <= m.num_blocks - 1
