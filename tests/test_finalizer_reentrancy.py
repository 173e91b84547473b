"""A finalizer the cycle collector runs in the middle of a call (allocating the call's result
may start a collection) can call back into the object the call is on: no call holds one of its
locks while it makes Python objects. A call that did would deadlock on its own lock, so each
case runs in a subprocess with a timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    """
    import gc
    import numpy as np
    import hybrid_kv as hk

    reentered = []

    def arm(callback):
        # Cyclic garbage whose finalizers call `callback`, collected at the next allocation
        # of a tracked object.
        class Cycle:
            def __init__(self):
                self.me = self
            def __del__(self):
                reentered.append(callback())
        gc.collect()
        gc.disable()
        for _ in range(8):
            Cycle()
        gc.set_threshold(1)
        gc.enable()

    def disarm():
        gc.set_threshold(700)
        gc.collect()
        assert reentered, "no finalizer ran during the call"
        reentered.clear()

    m = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 64, 1000)
    req = hk.Request("a", list(range(1, 30)), block_size=4, block_hashes=[b"x" * 16] * 7)
    """
)

CASES = {
    "manager_pop_blocks_for_free": """
        m.allocate_slots(req, 29)
        arm(lambda: m.num_requests)
        assert len(m.pop_blocks_for_free(req)) == 8
        disarm()
    """,
    "hash_chain_extend_and_hashes": """
        chain = hk.BlockHashChain(4)
        arm(lambda: len(chain))
        assert chain.extend(list(range(9))).shape == (2, 2)
        disarm()
        arm(lambda: chain.num_tokens)
        assert chain.hashes.shape == (2, 2)
        disarm()
    """,
    "request_output_and_supplied_hashes": """
        req.append_output_token_ids([5, 6])
        arm(lambda: req.num_tokens)
        assert req.output_token_ids.tolist() == [5, 6]
        disarm()
        arm(lambda: req.num_output_tokens)
        assert req.supplied_block_hashes.shape == (7, 2)
        disarm()
    """,
    "running_steps_slot_cache": """
        from hybrid_kv import _core

        class Adapter(_core._RunningSteps):
            def wrap(self, blocks, *_):
                return blocks

        class VllmRequest:
            def __init__(self, **fields):
                self.__dict__.update(fields)

        def running(i):
            companion = hk.Request(f"v{i}", list(range(4)), block_size=4)
            m.allocate_slots(companion, 4)
            r = VllmRequest(_all_token_ids=[0, 1, 2, 3, 9], num_computed_tokens=4,
                            num_in_flight_tokens=0)
            r.__dict__["slot"] = _core._VllmSlot(companion, 4)
            return r

        adapter = Adapter()
        adapter._running_steps("slot", None, m, adapter.wrap)
        a, b = running(0), running(1)
        # The step caches `a`'s slot; its result's allocation runs a finalizer that steps `b`
        # (cached too) and forgets it.
        arm(lambda: (adapter.allocate_slots(b, 1), adapter._forget_slot(b)))
        assert adapter.allocate_slots(a, 1).get_block_ids() is not None
        disarm()
        # Inside the horizon now: answered from the cached slot.
        a.num_computed_tokens, a._all_token_ids = 5, [0, 1, 2, 3, 9, 10]
        arm(lambda: adapter._forget_slot(a))
        assert adapter.allocate_slots(a, 1) is None
        adapter.allocate_slots(b, 1)
        disarm()
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_finalizer_run_during_a_call_can_call_back_into_its_object(case: str) -> None:
    script = PRELUDE + textwrap.dedent(CASES[case]) + "print('ok')\n"
    try:
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: deadlocked (a lock held while the finalizer ran)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


SWEEP = textwrap.dedent(
    """
    import gc, random, sys
    import numpy as np
    import hybrid_kv as hk

    rng = random.Random(0)
    groups = {
        "sw": [{"kind": "full", "block_size": 4},
               {"kind": "sliding_window", "block_size": 4, "sliding_window": 8}],
        "mamba": [{"kind": "mamba", "block_size": 8}, {"kind": "full", "block_size": 8}],
    }[sys.argv[1]]
    m = hk.KVCacheManager(groups, 40, 300, enable_kv_events=True)
    bs = m.hash_block_size
    pool = hk.BlockPool(20, enable_kv_events=True)
    chain = hk.BlockHashChain(4)
    reqs = [hk.Request(f"r{i}", list(range(1, 5 + 4 * i)), block_size=bs) for i in range(4)]
    sup = hk.Request("s", list(range(1, 10)), block_size=bs, block_hashes=[b"x" * 16] * 2)
    reentered = [0]

    def call_back():
        reentered[0] += 1
        r = rng.choice(reqs)
        for f in (lambda: m.num_requests, lambda: m.num_free_blocks, lambda: repr(m),
                  lambda: r.num_tokens, lambda: repr(r), lambda: len(chain), lambda: sup.num_tokens,
                  lambda: pool.num_free_blocks, lambda: m.get_block_ids(r.request_id)):
            try:
                f()
            except hk.HybridKvError:
                pass

    class Cycle:
        def __init__(self):
            self.me = self
        def __del__(self):
            call_back()

    calls = [
        lambda r: m.get_computed_blocks(r), lambda r: m.allocate_slots(r, 3),
        lambda r: m.free(r), lambda r: m.pop_blocks_for_free(r),
        lambda r: m.get_block_ids(r.request_id), lambda r: m.take_events(),
        lambda r: m._get_blocks(r.request_id).get_block_id_lists(),
        lambda r: m.take_new_block_ids(), lambda r: m._take_new_block_id_list(),
        lambda r: m.take_boundary_state_offloads(), lambda r: m.take_kv_cache_block_copies(),
        lambda r: m.get_block_ids_for_computed_tokens(r.request_id, 4),
        lambda r: m.running_horizon(r), lambda r: m.groups, lambda r: m.prefix_cache_stats(),
        lambda r: m.finalize_partial_tail_offloads(r), lambda r: m.estimate_cached_tokens(r),
        lambda r: m.num_blocks_to_admit(r), lambda r: m.probe(list(range(1, 10))),
        lambda r: r.prompt_token_ids, lambda r: r.output_token_ids,
        lambda r: sup.supplied_block_hashes, lambda r: r.append_output_token_ids([1, 2]),
        lambda r: chain.extend([1, 2, 3]), lambda r: chain.hashes,
        lambda r: hk.hash_token_blocks([1] * 9, 4), lambda r: pool.get_new_blocks(2),
        lambda r: pool.free_order(), lambda r: pool.take_events(),
        lambda r: pool.get_cached_block(5, [0]),
        lambda r: m.write_block_table([r.request_id], np.zeros((1, 80), np.int32)),
        lambda r: m.remove_request(r.request_id), lambda r: m.reset_prefix_cache(),
        lambda r: m.get_computed_blocks_for_connector(r),
    ]
    gc.set_threshold(1)
    for i in range(1500):
        r, f = rng.choice(reqs + [sup]), calls[i % len(calls)]
        gc.disable()
        for _ in range(3):
            Cycle()
        gc.enable()
        try:
            f(r)
        except hk.HybridKvError:
            pass
        if i % 40 == 0:
            k = rng.randrange(len(reqs))
            reqs[k] = hk.Request(f"r{k}", list(range(1, rng.randrange(2, 40))), block_size=bs)
    gc.collect()
    assert reentered[0] == 4500, reentered[0]
    print("ok")
    """
)


@pytest.mark.parametrize("layout", ["sw", "mamba"])
def test_a_finalizer_run_during_any_call_can_call_back_into_the_objects(layout: str) -> None:
    # Every call in turn, with cyclic garbage pending: whichever allocation of the call starts
    # the collection, the finalizers' calls into the manager, requests, pool and chain return.
    try:
        run = subprocess.run(
            [sys.executable, "-c", SWEEP, layout], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{layout}: deadlocked (a lock held while a finalizer ran)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok"


FIRST_INT_READ = textwrap.dedent(
    """
    import gc
    import hybrid_kv as hk
    from hybrid_kv import _core

    class Adapter(_core._RunningSteps):
        def _allocate_slots(self, *_, **__):
            return "python"

    adapter = Adapter()
    adapter._running_steps("slot", None)
    reentered = []

    def read_ints(phase, info):
        # A collection that starts inside the process's first read of an int reads ints too.
        if phase == "start" and not reentered:
            reentered.append(hk.Request("x", [1, 2, 3], block_size=4).num_tokens)

    gc.collect()
    gc.callbacks.append(read_ints)
    gc.set_threshold(1)
    # The entry reads its count first: the process's first read of an int.
    assert adapter.allocate_slots(adapter, 1) == "python"
    gc.set_threshold(700)
    assert reentered == [3], reentered
    print("ok")
    """
)


def test_a_collection_inside_the_first_read_of_an_int_can_read_ints() -> None:
    # The first read of an int checks how this interpreter lays ints out, which makes Python
    # objects (a collection may start there, and its callbacks or finalizers read ints too).
    try:
        run = subprocess.run(
            [sys.executable, "-c", FIRST_INT_READ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("deadlocked (the first read of an int re-entered)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok"
