"""The scheduler-facing KVCacheManager through Python: vLLM 0.33's calls, errors, block tables."""

import gc

import hybrid_kv as hk
import numpy as np
import pytest

FULL_SW = [
    {"kind": "full", "block_size": 16},
    {"kind": "sliding_window", "block_size": 16, "sliding_window": 32},
]


def state(manager: hk.KVCacheManager, *requests: hk.Request) -> tuple:
    tables = tuple(
        tuple(tuple(t.tolist()) for t in manager.get_block_ids(r.request_id)) for r in requests
    )
    return (manager.num_free_blocks, manager.num_cached_blocks, tables)


def test_design_worked_example_7_full_blocks_and_2_per_sliding_window_group() -> None:
    # Block size 16, window 32, a 112-token request: the full group holds 7 blocks, each
    # sliding-window group only the 2 blocks still in its window (null slots before).
    groups = FULL_SW + [FULL_SW[1]]
    manager = hk.KVCacheManager(groups, 64, 1024)
    req = hk.Request("r", list(range(112)))
    assert manager.allocate_slots(req, 111) is not None
    req.num_computed_tokens = 111
    assert manager.allocate_slots(req, 1) is not None
    full, sw1, sw2 = manager.get_block_ids("r")
    assert np.count_nonzero(full) == 7
    assert np.count_nonzero(sw1) == 2 and np.count_nonzero(sw2) == 2
    assert sw1[:5].tolist() == [0] * 5, "out-of-window slots are the null block"
    assert 7 + 2 + 2 == 64 - 1 - manager.num_free_blocks


def test_prefix_hit_is_adopted_and_shared() -> None:
    manager = hk.KVCacheManager(FULL_SW, 64, 1024, prefix_cache_retention_interval=None)
    a = hk.Request("a", list(range(64)))
    manager.allocate_slots(a, 64)
    a.num_computed_tokens = 64
    b = hk.Request("b", list(range(64)) + [9] * 16)
    blocks, hit = manager.get_computed_blocks(b)
    assert hit == 64
    full_hit = blocks.get_block_ids()[0]
    assert full_hit.tolist() == manager.get_block_ids("a")[0].tolist()
    new = manager.allocate_slots(b, 16, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    assert new is not None and [len(x) for x in new.get_block_ids()] == [1, 1]
    assert manager.get_block_ids("b")[0][:4].tolist() == full_hit.tolist()


def test_hit_is_capped_at_num_tokens_minus_one() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 64, 1024)
    a = hk.Request("a", list(range(64)))
    manager.allocate_slots(a, 64)
    _, hit = manager.get_computed_blocks(hk.Request("b", list(range(64))))
    assert hit == 48, "the last token is recomputed, so only 3 of 4 full blocks hit"


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 5, 1024)
    a = hk.Request("a", list(range(48)))
    assert manager.allocate_slots(a, 48) is not None
    b = hk.Request("b", list(range(100, 148)))
    before = state(manager, a)
    assert manager.allocate_slots(b, 48) is None
    assert state(manager, a) == before
    assert len(manager.get_block_ids("b")[0]) == 0


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 16, 1024)
    req = hk.Request("r", list(range(32)))
    new = manager.allocate_slots(req, 32, num_lookahead_tokens=16)
    assert len(new.get_block_ids()[0]) == 3
    assert manager.num_cached_blocks == 2


def test_delay_cache_blocks_defers_caching() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 16, 1024)
    req = hk.Request("r", list(range(32)))
    manager.allocate_slots(req, 32, delay_cache_blocks=True)
    assert manager.num_cached_blocks == 0


def test_free_releases_tail_first_and_keeps_blocks_cached() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 8, 1024)
    req = hk.Request("r", list(range(48)))
    ids = manager.allocate_slots(req, 48).get_block_ids()[0].tolist()
    manager.free(req)
    assert manager.num_free_blocks == 7
    assert manager.num_cached_blocks == 3
    # Cached blocks are evicted last, tail first: a new 4-block request takes the 4 uncached
    # blocks, the next one the old tail block.
    other = hk.Request("o", list(range(1000, 1080)))
    got = manager.allocate_slots(other, 80).get_block_ids()[0].tolist()
    assert got[-1] == ids[-1] and ids[-1] not in got[:-1]


def test_write_block_table_fills_a_batch_in_one_call() -> None:
    manager = hk.KVCacheManager(FULL_SW, 64, 1024)
    reqs = [hk.Request(f"r{i}", list(range(i * 100, i * 100 + 20 + 16 * i))) for i in range(3)]
    for r in reqs:
        manager.allocate_slots(r, r.num_tokens)
    table = np.full((3, 8), -1, dtype=np.int32)
    manager.write_block_table([r.request_id for r in reqs], table, group=0)
    for row, r in zip(table, reqs, strict=True):
        ids = manager.get_block_ids(r.request_id)[0]
        assert row[: len(ids)].tolist() == ids.tolist()
        assert (row[len(ids) :] == -1).all()
    with pytest.raises(hk.HybridKvError, match="more than a row holds"):
        manager.write_block_table(["r2"], np.zeros((1, 2), dtype=np.int32))
    with pytest.raises(hk.HybridKvError, match="unknown request"):
        manager.write_block_table(["nope"], table)


def test_garbage_collected_request_is_forgotten() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 16, 1024)
    req = hk.Request("r", list(range(32)))
    manager.allocate_slots(req, 32)
    manager.free(req)
    assert manager.num_requests == 1
    del req
    gc.collect()
    assert manager.num_requests == 0, "its hashes went with the Request object"


def test_one_request_driven_through_three_managers_stays_in_step_with_each() -> None:
    # Each manager keeps its own hashed copy of the request; appends made between calls reach
    # every one of them, removing it from one leaves the others, and dropping it frees all.
    groups = [{"kind": "full", "block_size": 4}]
    managers = [hk.KVCacheManager(groups, 32, 1024) for _ in range(3)]
    req = hk.Request("r", list(range(10)), block_size=4)
    for m in managers:
        assert m.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    for step in range(6):
        req.append_output_token_ids(100 + step)
        for m in reversed(managers):
            m.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    # 16 tokens: four full blocks, each cached by every manager.
    assert [m.num_cached_blocks for m in managers] == [4, 4, 4]
    managers[1].remove_request("r")
    assert [m.num_requests for m in managers] == [1, 0, 1]
    req.append_output_token_ids(200)
    managers[2].allocate_slots(req, 1)
    assert len(managers[2].get_block_ids("r")[0]) == 5
    del req
    gc.collect()
    assert [m.num_requests for m in managers] == [0, 0, 0]


def test_appended_outputs_are_hashed_and_cached_incrementally() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 32, 1024)
    req = hk.Request("r", [1, 2, 3])
    manager.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    for t in (4, 5, 6, 7, 8):
        req.append_output_token_ids(t)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert req.num_tokens == 8
    assert manager.num_cached_blocks == 2
    assert manager.probe([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


@pytest.mark.parametrize(
    "call",
    [
        lambda m, a, b: m.get_block_ids("nope"),
        lambda m, a, b: m.remove_request("nope"),
        lambda m, a, b: m.allocate_slots(a, -1),
        lambda m, a, b: m.allocate_slots(b, 0),
        lambda m, a, b: m.allocate_slots(b, 5000),
        lambda m, a, b: m.allocate_slots(b, 8, num_new_computed_tokens=16),
        lambda m, a, b: m.allocate_slots(hk.Request("a", [1, 2]), 1),
        lambda m, a, b: m.allocate_slots(
            b, 1, num_new_computed_tokens=16, new_computed_blocks=m.get_computed_blocks(b)[0]
        ),
    ],
    ids=[
        "unknown-id",
        "remove-unknown",
        "negative-tokens",
        "zero-tokens",
        "beyond-max-model-len",
        "computed-without-blocks",
        "duplicate-request-id",
        "hit-adopted-twice",
    ],
)
def test_bad_calls_raise_typed_errors_and_change_nothing(call) -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 32, 1024)
    a = hk.Request("a", list(range(40)))
    manager.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    b = hk.Request("b", list(range(40)))
    manager.allocate_slots(b, 40)
    before = state(manager, a, b)
    with pytest.raises(hk.HybridKvError):
        call(manager, a, b)
    assert state(manager, a, b) == before


def test_computed_blocks_from_another_manager_are_rejected() -> None:
    groups = [{"kind": "full", "block_size": 16}]
    m1, m2 = hk.KVCacheManager(groups, 32, 1024), hk.KVCacheManager(groups, 32, 1024)
    m1.allocate_slots(hk.Request("a", list(range(64))), 64)
    req = hk.Request("b", list(range(64)))
    blocks, hit = m1.get_computed_blocks(req)
    before = (m2.num_free_blocks, m2.num_cached_blocks)
    with pytest.raises(hk.HybridKvError, match="another KVCacheManager"):
        m2.allocate_slots(req, 16, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    assert (m2.num_free_blocks, m2.num_cached_blocks) == before


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([{"kind": "attention", "block_size": 16}], "unknown attention kind"),
        ([{"kind": "sliding_window", "block_size": 16}], "sliding_window"),
        ([{"kind": "full"}], "block_size"),
        ([{"kind": "full", "block_size": -16}], "block_size"),
    ],
)
def test_bad_group_specs_are_rejected(groups, match) -> None:
    with pytest.raises(hk.HybridKvError, match=match):
        hk.KVCacheManager(groups, 32, 1024)


def test_groups_may_be_any_mapping_or_an_object_with_the_fields() -> None:
    import types
    from collections import UserDict

    group = {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}
    specs = [
        group,
        types.MappingProxyType(group),
        UserDict(group),
        types.SimpleNamespace(**group),
    ]
    for spec in specs:
        assert hk.KVCacheManager([spec], 32, 1024).groups == [group]
    with pytest.raises(hk.InvalidConfigError, match="missing kind"):
        hk.KVCacheManager([types.MappingProxyType({"block_size": 16})], 32, 1024)
    with pytest.raises(hk.InvalidConfigError, match="missing block_size"):
        hk.KVCacheManager([UserDict({"kind": "full"})], 32, 1024)


def test_bad_request_input() -> None:
    with pytest.raises(hk.HybridKvError, match="empty prompt"):
        hk.Request("r", [])
    with pytest.raises(TypeError):
        hk.Request("r", [1.5])
    req = hk.Request("r", [1, 2])
    with pytest.raises(hk.HybridKvError):
        req.num_computed_tokens = 3
    with pytest.raises(hk.HybridKvError):
        req.append_output_token_ids(-1)
    assert req.num_tokens == 2


def test_stats_and_reset() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 32, 1024)
    a = hk.Request("a", list(range(64)))
    manager.allocate_slots(a, 64)
    b = hk.Request("b", list(range(64)))
    blocks, hit = manager.get_computed_blocks(b)
    manager.allocate_slots(b, 64 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    manager.record_prefix_cache_stats(b, hit)
    stats = manager.make_prefix_cache_stats()
    assert (stats["requests"], stats["queries"], stats["hits"]) == (1, 64, 48)
    assert manager.prefix_cache_stats()["requests"] == 0
    assert not manager.reset_prefix_cache()
    manager.free(a)
    manager.free(b)
    assert manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0 and manager.usage == 0.0


def test_manager_events_are_drained() -> None:
    manager = hk.KVCacheManager(
        [{"kind": "full", "block_size": 16}], 32, 1024, enable_kv_events=True
    )
    manager.allocate_slots(hk.Request("a", list(range(32))), 32)
    events = manager.take_events()
    assert len(events) == 1 and isinstance(events[0], hk.BlockStored)
    assert len(events[0].block_hashes) == 2
    assert events[0].kv_cache_spec_kind == "full_attention"
    assert events[0].kv_cache_spec_sliding_window is None
    assert events[0].token_ids == list(range(32)) and events[0].parent_block_hash is None


def test_manager_events_name_each_groups_attention_type() -> None:
    manager = hk.KVCacheManager(FULL_SW, 32, 1024, enable_kv_events=True)
    manager.allocate_slots(hk.Request("a", list(range(40))), 40)
    stored = {e.group_id: e for e in manager.take_events() if isinstance(e, hk.BlockStored)}
    assert stored[0].kv_cache_spec_kind == "full_attention"
    assert (stored[1].kv_cache_spec_kind, stored[1].kv_cache_spec_sliding_window) == (
        "sliding_window",
        32,
    )
    pool = hk.BlockPool(4, enable_kv_events=True)
    pool.cache_full_blocks(pool.get_new_blocks(1), [1])
    assert pool.take_events()[0].kv_cache_spec_kind is None


def test_mamba_hybrid_allocates_and_reports_no_hit() -> None:
    # Mamba prefix caching is not implemented: a Mamba-bearing prefix must report a hit of 0,
    # never a wrong one, and allocation still works.
    groups = [{"kind": "full", "block_size": 16}, {"kind": "mamba", "block_size": 16}]
    manager = hk.KVCacheManager(groups, 64, 1024)
    a = hk.Request("a", list(range(64)))
    assert manager.allocate_slots(a, 64) is not None
    b = hk.Request("b", list(range(64)))
    blocks, hit = manager.get_computed_blocks(b)
    assert hit == 0 and manager.probe(list(range(64))) == 0
    assert manager.allocate_slots(b, 64, new_computed_blocks=blocks) is not None


def test_chunked_local_attention_skips_blocks_before_the_current_chunk() -> None:
    groups = [
        {"kind": "full", "block_size": 16},
        {"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64},
    ]
    manager = hk.KVCacheManager(groups, 64, 1024)
    req = hk.Request("r", list(range(150)))
    manager.allocate_slots(req, 149)
    req.num_computed_tokens = 149
    manager.allocate_slots(req, 1)
    full, local = manager.get_block_ids("r")
    assert np.count_nonzero(full) == 10
    # Tokens 128..149 are in the current chunk: only its blocks (8, 9) are held.
    assert local[:8].tolist() == [0] * 8 and np.count_nonzero(local) == 2


def test_removed_request_id_can_be_reused_by_a_new_request() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 32, 1024)
    old = hk.Request("a", [1, 2, 3, 4, 5])
    manager.allocate_slots(old, 5)
    old.num_computed_tokens = 5
    old.append_output_token_ids(6)
    manager.allocate_slots(old, 1)
    manager.remove_request("a")
    assert manager.num_requests == 0 and manager.num_free_blocks == 31
    new = hk.Request("a", [9, 9, 9, 9, 9, 9, 9, 9, 1])
    manager.allocate_slots(new, 9)
    assert manager.probe([9] * 8 + [2]) == 8, "the new prompt was hashed, not the old one"
    with pytest.raises(hk.HybridKvError, match="another Request object"):
        manager.allocate_slots(old, 1)


def test_tokens_appended_between_calls_are_all_hashed() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 2}], 32, 1024)
    req = hk.Request("r", [1, 2, 3])
    manager.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    req.append_output_token_ids([4, 5, 6])
    manager.allocate_slots(req, 3)
    req.num_computed_tokens = 6
    req.append_output_token_ids(np.array([7], dtype=np.int64))
    manager.allocate_slots(req, 1)
    assert manager.probe([1, 2, 3, 4, 5, 6, 7]) == 6


DEADLOCK_SCRIPT = """
import threading
import hybrid_kv as hk

manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 65536, 1 << 18)
shared = list(range(100_000))
errors = []
done = threading.Event()

def worker(k):
    try:
        for i in range(5):
            req = hk.Request(f"t{k}-{i}", shared + [k, i] * 100)
            blocks, hit = manager.get_computed_blocks(req)
            new = manager.allocate_slots(
                req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
            )
            assert new is not None
            manager.probe(shared)
            manager.free(req)
    except BaseException as e:
        errors.append(e)

def poller():
    # Takes the manager lock with the GIL held, as fast as it can.
    while not done.is_set():
        manager.num_requests

workers = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
pollers = [threading.Thread(target=poller) for _ in range(2)]
for t in workers + pollers:
    t.start()
for t in workers:
    t.join()
done.set()
for t in pollers:
    t.join()
assert errors == [], errors
assert manager.num_free_blocks == 65535
print("ok")
"""


def test_scheduler_calls_from_several_threads_with_long_prompts_do_not_deadlock() -> None:
    # Long prompts make the calls release the GIL; the manager lock must never be held while
    # the GIL is re-acquired, or a thread holding the GIL and waiting for the lock deadlocks
    # (the whole interpreter hangs, so the check runs in a subprocess with a timeout).
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", DEADLOCK_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "ok"


def test_token_lists_accept_int_like_items_and_survive_mutation_by_index() -> None:
    assert hk.Request("n", [np.int64(5), 7, True]).prompt_token_ids.tolist() == [5, 7, 1]

    class Shrinks:
        """An int-like whose conversion empties the list being read."""

        def __init__(self, items: list) -> None:
            self.items = items

        def __index__(self) -> int:
            self.items.clear()
            return 1

    items: list = [1, 2, 3]
    items.append(Shrinks(items))
    items.extend(range(100))
    req = hk.Request("m", items)  # must not read past the shrunken list
    assert req.num_tokens <= 104
    with pytest.raises(hk.HybridKvError, match="position 1"):
        hk.Request("x", [1, 2**70])


def test_prompt_hashes_made_with_another_block_size_are_recomputed() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 32, 1024)
    assert manager.hash_block_size == 16
    prompt = list(range(70))
    a = hk.Request("a", prompt, block_size=16)  # reused as is
    manager.allocate_slots(a, 70)
    b = hk.Request("b", prompt, block_size=4, hash_algo="sha256")  # re-read and rehashed
    _, hit = manager.get_computed_blocks(b)
    assert hit == 64 == manager.probe(prompt)


def test_prompt_resized_after_the_request_was_made_is_an_error() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 32, 1024)
    prompt = list(range(40))
    req = hk.Request("r", prompt, block_size=8)  # not reusable: the manager re-reads the prompt
    prompt.append(7)
    before = (manager.num_free_blocks, manager.num_cached_blocks, manager.num_requests)
    with pytest.raises(hk.HybridKvError, match="changed from 40 to 41 tokens"):
        manager.allocate_slots(req, 40)
    assert (manager.num_free_blocks, manager.num_cached_blocks, manager.num_requests) == before


# ----- hardening: behaviour a careful caller relies on --------------------------------------


@pytest.mark.parametrize("order", ["C", "F"])
def test_write_block_table_writes_each_request_its_own_row_in_any_memory_order(order: str) -> None:
    manager = hk.KVCacheManager(FULL_SW, 64, 1024)
    a, b = hk.Request("a", list(range(40))), hk.Request("b", list(range(500, 570)))
    manager.allocate_slots(a, 40)
    manager.allocate_slots(b, 70)
    out = np.full((3, 8), -1, dtype=np.int32, order=order)
    manager.write_block_table(["a", "b"], out, group=0)
    for row, rid in zip(out[:2], ["a", "b"], strict=True):
        ids = manager.get_block_ids(rid)[0]
        assert row[: len(ids)].tolist() == ids.tolist()
        assert (row[len(ids) :] == -1).all()
    assert (out[2] == -1).all()
    # A strided view (every other column of a wider table) is written through its strides.
    wide = np.full((2, 16), -1, dtype=np.int32)
    manager.write_block_table(["a", "b"], wide[:, ::2], group=0)
    assert wide[1, ::2][:5].tolist() == manager.get_block_ids("b")[0].tolist()
    assert (wide[:, 1::2] == -1).all()


def test_a_rejected_first_call_registers_nothing() -> None:
    manager = hk.KVCacheManager(FULL_SW, 64, 1024)
    req = hk.Request("r", list(range(40)))
    with pytest.raises(hk.OutOfRangeError):
        manager.allocate_slots(req, 2000)
    assert manager.num_requests == 0
    with pytest.raises(hk.OutOfRangeError):
        manager.record_prefix_cache_stats(req, 41)
    assert manager.num_requests == 0
    # The same request then registers normally, with the hashes it was made with.
    assert manager.allocate_slots(req, 40) is not None
    assert manager.num_requests == 1


def test_out_of_blocks_may_only_have_freed_blocks_that_left_the_window() -> None:
    # One sliding-window group (window 32, block 16), 4 usable blocks. `r` holds blocks 1-3
    # for its 48 prompt tokens, `hog` the last one. Scheduling 17 more tokens of `r` needs 2
    # blocks: the one that left the window (tokens 0-15) is freed first, as vLLM does, then
    # one free block is not enough and allocate_slots returns None. Nothing else changed.
    manager = hk.KVCacheManager([FULL_SW[1]], 5, 1024, enable_caching=False)
    req = hk.Request("r", list(range(48)))
    assert manager.allocate_slots(req, 48) is not None
    req.num_computed_tokens = 48
    hog = hk.Request("hog", list(range(20)))
    assert manager.allocate_slots(hog, 16) is not None
    assert manager.num_free_blocks == 0
    assert manager.get_block_ids("r")[0].tolist() == [1, 2, 3]
    req.append_output_token_ids(list(range(17)))
    assert manager.allocate_slots(req, 17) is None
    assert manager.get_block_ids("r")[0].tolist() == [0, 2, 3], "block 1 left the window"
    assert manager.num_free_blocks == 1
    assert manager.get_block_ids("hog")[0].tolist() == [4]
    # A refusal by the admission check changes nothing at all.
    late = hk.Request("late", list(range(900, 1000)))
    assert manager.allocate_slots(late, 100, full_sequence_must_fit=True) is None
    assert manager.num_free_blocks == 1
    assert [t.tolist() for t in manager.get_block_ids("late")] == [[]]


def test_a_resumed_request_may_have_more_tokens_in_flight_than_computed() -> None:
    # vLLM counts the tokens of steps scheduled before a preemption in flight until their
    # outputs are in (pipeline stages, async scheduling), also once the request resumed from
    # fewer computed tokens: the count is taken as it is, and none of the request's tokens then
    # counts as processed, so no block leaves the sliding window yet.
    manager = hk.KVCacheManager([FULL_SW[1]], 16, 1024, enable_caching=False)
    req = hk.Request("r", list(range(80)))
    # Resumed with 48 tokens of earlier steps in flight: a first chunk of 64.
    req.num_in_flight_tokens = 48
    assert manager.allocate_slots(req, 64) is not None
    req.num_in_flight_tokens = 112
    req.num_computed_tokens = 64
    assert (req.num_in_flight_tokens, req.num_computed_tokens) == (112, 64)
    assert manager.allocate_slots(req, 16) is not None
    assert manager.get_block_ids("r")[0].tolist() == [1, 2, 3, 4, 5]
    # Once those outputs are in, the blocks below the processed tokens' window are freed.
    req.num_in_flight_tokens = 16
    req.num_computed_tokens = 80
    req.append_output_token_ids(7)
    assert manager.allocate_slots(req, 1) is not None
    assert manager.get_block_ids("r")[0].tolist()[:3] == [0, 0, 3]
    # Computed tokens past the known ones plus those in flight are still refused.
    with pytest.raises(hk.OutOfRangeError, match="num_computed_tokens 98 exceeds"):
        req.num_computed_tokens = 98


def test_a_collected_request_returns_its_blocks_before_the_counters_are_read() -> None:
    manager = hk.KVCacheManager(FULL_SW, 64, 1024, enable_caching=False)
    req = hk.Request("r", list(range(100)))
    assert manager.allocate_slots(req, 100) is not None
    used = 63 - manager.num_free_blocks
    assert used > 0
    del req
    gc.collect()
    assert manager.num_free_blocks == 63
    assert manager.usage == 0.0
    assert manager.num_requests == 0


def test_a_hit_evicted_before_it_is_adopted_names_the_eviction() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 6, 1024)
    a = hk.Request("a", list(range(64)))
    manager.allocate_slots(a, 64)
    manager.free(a)  # cached, free, evictable
    b = hk.Request("b", list(range(64)) + [1])
    hit, n = manager.get_computed_blocks(b)
    assert n == 64
    # Another caller allocates every free block in between: the hit's blocks are reused.
    other = hk.Request("c", list(range(1000, 1080)))
    assert manager.allocate_slots(other, 80) is not None
    with pytest.raises(hk.BlockEvictedError, match="evicted and reused since"):
        manager.allocate_slots(b, 1, num_new_computed_tokens=n, new_computed_blocks=hit)


def test_a_hit_stale_after_a_reset_names_the_reset_not_an_eviction() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 6, 1024)
    a = hk.Request("a", list(range(64)))
    manager.allocate_slots(a, 64)
    manager.free(a)
    b = hk.Request("b", list(range(64)) + [1])
    hit, n = manager.get_computed_blocks(b)
    assert n == 64
    assert manager.reset_prefix_cache()
    with pytest.raises(hk.BlockEvictedError) as refused:
        manager.allocate_slots(b, 1, num_new_computed_tokens=n, new_computed_blocks=hit)
    assert "reset_prefix_cache cleared the prefix cache since get_computed_blocks" in str(
        refused.value
    )
    assert "evicted" not in str(refused.value)


def test_a_hit_is_adopted_only_by_the_request_it_was_found_for() -> None:
    # The lookup of one Request object, passed with another (a second request, or a new
    # Request under the first one's id after it was removed), is checked against that
    # request's prompt and refused when it is not that prompt's; nothing changes.
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 16, 1024)
    for rid, start in [("a", 0), ("z", 5000)]:
        r = hk.Request(rid, list(range(start, start + 64)))
        manager.allocate_slots(r, 64)
        manager.free(r)
    first = hk.Request("x", list(range(64)) + [1])
    hit, n = manager.get_computed_blocks(first)
    assert n == 64
    manager.remove_request("x")
    free, requests = manager.num_free_blocks, manager.num_requests
    for other in [
        hk.Request("x", list(range(5000, 5064)) + [1]),
        hk.Request("y", list(range(5000, 5064)) + [1]),
    ]:
        with pytest.raises(hk.HybridKvError, match="not the cached block"):
            manager.allocate_slots(other, 1, num_new_computed_tokens=n, new_computed_blocks=hit)
        assert (manager.num_free_blocks, manager.num_requests) == (free, requests)
    # The same prompt under another request takes the same blocks, checked.
    same = hk.Request("w", list(range(64)) + [1])
    assert manager.allocate_slots(same, 1, num_new_computed_tokens=n, new_computed_blocks=hit)
    assert manager.get_block_ids("w")[0].tolist()[:4] == hit.get_block_ids()[0].tolist()


def test_integer_arrays_of_any_width_and_byte_order_are_token_ids() -> None:
    prompt = list(range(40))
    expected = hk.hash_token_blocks(prompt, 16).tolist()
    for dtype in [">i8", "<i8", ">i4", ">u4", "u8", "i2", "u2", ">u8"]:
        arr = np.array(prompt, dtype=dtype)
        assert hk.hash_token_blocks(arr, 16).tolist() == expected, dtype
        assert hk.Request("r", arr).num_tokens == 40
    with pytest.raises(hk.OutOfRangeError):
        hk.Request("r", np.array([1, -1], dtype=">i8"))
    with pytest.raises(TypeError):
        hk.Request("r", b"abc")


@pytest.mark.parametrize("algo", ["xxh3", "sha256", "blake3"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_a_prompt_list_hashes_as_the_same_tokens_in_an_array(algo: str, block_size: int) -> None:
    # A long prompt list (16,384 tokens or more) is read and hashed in one pass, an array in
    # two: the prefix cache must not tell them apart (a request from one hits all the full
    # blocks the other cached, and up to the first changed block when one token differs),
    # whatever the extra keys and wherever an item is not a plain int (a numpy integer sends
    # the list down the general path). Shorter lists take the two passes.
    rng = np.random.default_rng(block_size)
    extras: list[dict] = [
        {},
        {"cache_salt": "tenant"},
        {"lora_name": "adapter"},
        {"mm_inputs": [("img", 3, 7), ("img2", 2 * block_size + 1, block_size)]},
    ]
    lengths = [1, block_size, 3 * block_size, 40 * block_size + 3]
    for n in lengths + [2**14 - 1, 2**14, 2**14 + 2 * block_size + 3]:
        for extra in extras:
            tokens = rng.integers(0, 2**32, n).tolist()
            tokens[: min(n, 4)] = [0, 1, 2**30 - 1, 2**30][: min(n, 4)]  # digit boundaries
            manager = hk.KVCacheManager(
                [{"kind": "full", "block_size": block_size}], 2 * n + 8, 4 * n + 64,
                hash_algo=algo, hash_seed="s",
            )  # fmt: skip
            kw = {"block_size": block_size, "hash_algo": algo, "hash_seed": "s", **extra}
            cached = hk.Request("array", np.array(tokens, dtype=np.int64), **kw)
            assert manager.allocate_slots(cached, n) is not None
            cached.num_computed_tokens = n
            manager.free(cached)
            full = (n - 1) // block_size * block_size  # a hit leaves the last token
            mixed = list(tokens)
            mixed[n // 2] = np.int64(tokens[n // 2])
            for name, prompt in [("list", list(tokens)), ("mixed", mixed)]:
                _, hit = manager.get_computed_blocks(hk.Request(name, prompt, **kw))
                assert hit == full, (name, n, extra)
            j = int(rng.integers(0, n))
            changed = list(tokens)
            changed[j] = (changed[j] + 1) % 2**32
            _, hit = manager.get_computed_blocks(hk.Request("changed", changed, **kw))
            assert hit == min(full, j // block_size * block_size), (n, extra, j)


# ----- vLLM's default configuration -----------------------------------------------------------


def test_default_retention_keeps_only_the_sliding_window_blocks_a_hit_can_reach() -> None:
    # vLLM's default (retention 0): the sliding-window group keeps only the blocks before the
    # prompt's replay boundary (P - 1 = 63 -> 48: blocks 1 and 2 for a window of 32); dense
    # retention keeps all four.
    for retention, cached_sw, hit in [(0, 2, 48), (None, 4, 64)]:
        manager = hk.KVCacheManager(FULL_SW, 64, 1024, prefix_cache_retention_interval=retention)
        a = hk.Request("a", list(range(64)))
        manager.allocate_slots(a, 64)
        assert manager.num_cached_blocks == 4 + cached_sw
        _, got = manager.get_computed_blocks(hk.Request("b", list(range(64)) + [9] * 16))
        assert got == hit
        # A resend of the same prompt hits at its replay boundary either way.
        _, resend = manager.get_computed_blocks(hk.Request("c", list(range(64))))
        assert resend == 48


def test_an_attention_free_model_has_no_groups_and_no_blocks() -> None:
    manager = hk.KVCacheManager([], 1, 1024)
    assert manager.num_groups == 0
    req = hk.Request("r", list(range(30)))
    blocks, hit = manager.get_computed_blocks(req)
    assert hit == 0 and blocks.get_block_ids() == ()
    new = manager.allocate_slots(req, 30)
    assert new is not None and new.get_block_ids() == ()
    assert manager.num_free_blocks == 0


def test_block_id_lists_share_one_int_per_id_across_lists_and_pools() -> None:
    # Lists of block ids take their ints from one table per process (grown as larger ids are
    # listed): equal to the arrays, the same object for the same id in any list, and each list
    # its own (changing one changes no other).
    small = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 600, 8192)
    large = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 20_000, 1 << 18)
    lists = []
    for m, name, tokens in ((small, "s", 16 * 500), (large, "l", 16 * 12_000)):
        req = hk.Request(name, list(range(tokens)))
        new = m.allocate_slots(req, tokens)
        assert new is not None
        arrays = new.get_block_ids()
        got = new.get_block_id_lists()
        assert got == tuple(ids.tolist() for ids in arrays)
        assert m._get_blocks(name).get_block_id_lists() == got
        lists.append(got[0])
    first, second = lists
    assert max(second) > 10_000, "ids past the first table's size are listed"
    again = large._get_blocks("l").get_block_id_lists()[0]
    for a, b in zip(second, again, strict=True):
        assert a is b
    shared = set(first) & set(second)
    assert shared and all(
        first[first.index(i)] is second[second.index(i)] for i in sorted(shared)[-50:]
    )
    again[0] = -1
    assert second[0] != -1 and large._get_blocks("l").get_block_id_lists()[0][0] != -1


def test_get_blocks_holds_a_requests_tables_as_get_block_ids_gives_them() -> None:
    # `_get_blocks` (vLLM's `get_blocks`, read as lists): the same ids as `get_block_ids`, per
    # group, null blocks included; an unknown request raises as `get_block_ids` does.
    m = hk.KVCacheManager(FULL_SW, 64, 1024)
    a = hk.Request("a", list(range(70)))
    assert m.allocate_slots(a, 70) is not None
    a.num_computed_tokens = 70
    for _ in range(40):
        a.append_output_token_ids(1)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    arrays = m.get_block_ids("a")
    blocks = m._get_blocks("a")
    assert [ids.tolist() for ids in blocks.get_block_ids()] == [ids.tolist() for ids in arrays]
    assert blocks.get_block_id_lists() == tuple(ids.tolist() for ids in arrays)
    assert 0 in arrays[1].tolist(), "the window group's null blocks are listed"
    with pytest.raises(hk.UnknownRequestError):
        m._get_blocks("c")
    with pytest.raises(hk.UnknownRequestError):
        m.get_block_ids("c")


# Full attention and Mamba blocks of 16, hashes every 8 (vLLM's fine-grained partial hash hits).
PARTIAL_HIT_GROUPS = [{"kind": "full", "block_size": 16}, {"kind": "mamba", "block_size": 16}]


def _partial_hit(manager: hk.KVCacheManager) -> tuple[hk.Request, hk.Request, hk.KVCacheBlocks]:
    """Request `a` computes 24 tokens; `b` hits them (a hit ending inside a block) and is
    admitted. Returns both and `b`'s new blocks."""
    a = hk.Request("a", list(range(29)), block_size=8)
    # A chunk ending on the prompt's last hash boundary (24) caches both groups' state there.
    assert manager.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    manager.new_step_starts()
    b = hk.Request("b", list(range(24)) + [1000 + i for i in range(10)], block_size=8)
    blocks, hit = manager.get_computed_blocks(b)
    assert hit == 24
    new = manager.allocate_slots(b, 10, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    assert new is not None
    return a, b, new


def test_the_adapters_list_variants_drain_what_the_array_variants_drain() -> None:
    # `hybrid_kv.vllm` reads copies and new block ids as lists: the same contents and the same
    # draining as the public calls, and None when no copy is queued.
    arrays, lists = (
        hk.KVCacheManager(PARTIAL_HIT_GROUPS, 64, 1024, hash_block_size=8) for _ in range(2)
    )
    assert lists._take_kv_cache_block_copy_lists() is None
    for manager in (arrays, lists):
        _partial_hit(manager)
    copies, retained = arrays.take_kv_cache_block_copies()
    assert copies
    assert lists._take_kv_cache_block_copy_lists() == (copies, retained.tolist())
    assert lists._take_kv_cache_block_copy_lists() is None, "drained"
    assert lists.num_retained_blocks == arrays.num_retained_blocks == 4
    new_ids = arrays.take_new_block_ids().tolist()
    assert new_ids
    assert lists._take_new_block_id_list() == new_ids
    assert lists._take_new_block_id_list() == [], "drained"


def test_partial_hash_hit_copies_the_shared_blocks_and_retains_them_until_released() -> None:
    # A hit may end inside a block, whose shared block the new request writes on into a copy.
    manager = hk.KVCacheManager(PARTIAL_HIT_GROUPS, 64, 1024, hash_block_size=8)
    assert manager.enable_partial_hash_hits and not manager.mamba_shared_prefix_checkpoint
    a, b, new = _partial_hit(manager)
    full_copy, state_copy = (ids[0] for ids in new.get_block_ids())
    a_full, a_mamba = manager.get_block_ids("a")
    copies, retained = manager.take_kv_cache_block_copies()
    assert copies == [(int(a_full[1]), full_copy), (int(a_mamba[1]), state_copy)]
    assert retained.tolist() == [int(a_full[1]), full_copy, int(a_mamba[1]), state_copy]
    assert manager.num_retained_blocks == 4
    assert manager.take_kv_cache_block_copies()[0] == [], "drained"
    free = manager.num_free_blocks
    manager.free_retained_blocks(retained.tolist())
    assert manager.num_retained_blocks == 0
    # Every end is still in a request's table: released references only.
    assert manager.num_free_blocks == free
    with pytest.raises(hk.InvalidArgumentError):
        manager.free_retained_blocks([full_copy])
    manager.free(b)
    manager.free(a)
    assert manager.num_free_blocks == 63


def test_popped_blocks_are_released_by_free_retained_blocks_tail_first() -> None:
    """`pop_blocks_for_free` hands a request's blocks over without freeing them (vLLM's deferred
    free); the manager retains them until `free_retained_blocks` gets them back, reversed, as
    vLLM's scheduler gives them to its block pool. They were held for good before: nothing in
    the Python API could free them, and the prefix cache could never be reset again."""
    groups = [
        {"kind": "full", "block_size": 4},
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 8},
    ]
    manager = hk.KVCacheManager(groups, 32, 256)
    request = hk.Request("a", list(range(21)), block_size=4)
    assert manager.allocate_slots(request, 21) is not None
    free = manager.num_free_blocks
    popped = manager.pop_blocks_for_free(request)
    assert len(popped) > 0 and manager.num_free_blocks == free
    assert manager.num_retained_blocks == len(popped)
    assert manager.reset_prefix_cache() is False
    # A block not popped, or popped blocks released twice, are refused whole.
    with pytest.raises(hk.InvalidArgumentError, match="not retained"):
        manager.free_retained_blocks([*popped[::-1].tolist(), int(popped[0])])
    assert manager.num_retained_blocks == len(popped) and manager.num_free_blocks == free
    manager.free_retained_blocks(popped[::-1].tolist())
    assert manager.num_retained_blocks == 0
    assert manager.num_free_blocks == free + len(popped)
    with pytest.raises(hk.InvalidArgumentError, match="not retained"):
        manager.free_retained_blocks([int(popped[0])])
    assert manager.reset_prefix_cache() is True
