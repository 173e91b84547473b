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
