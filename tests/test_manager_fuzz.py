"""Random call sequences against the manager: bad input is a typed error or None, never a panic,
and the pool's accounting stays consistent."""

import hybrid_kv as hk
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

GROUPS = [
    [{"kind": "full", "block_size": 4}],
    [
        {"kind": "full", "block_size": 4},
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 6},
    ],
    [
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 5},
        {"kind": "chunked_local", "block_size": 4, "attention_chunk_size": 8},
    ],
    [{"kind": "full", "block_size": 4}, {"kind": "mamba", "block_size": 4}],
    # Mamba-2: prefill checkpoints exported into blocks of their own.
    [
        {"kind": "full", "block_size": 4},
        {
            "kind": "mamba",
            "block_size": 4,
            "num_prefill_checkpoint_blocks": 1,
            "prefill_checkpoint_alignment": 1,
        },
    ],
]

counts = st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**62, -(2**62)]))
call = st.tuples(
    st.sampled_from(["get", "alloc", "admit", "free", "append", "computed", "probe"]),
    st.integers(0, 3),
    counts,
    counts,
)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(GROUPS) - 1), st.integers(2, 40), st.lists(call, max_size=40))
def test_random_calls_never_panic_and_keep_the_pool_consistent(g, num_blocks, calls) -> None:
    manager = hk.KVCacheManager(GROUPS[g], num_blocks, 64)
    rng = np.random.default_rng(len(calls))
    reqs = [
        hk.Request(f"r{i}", rng.integers(0, 5, size=int(rng.integers(1, 30))).tolist())
        for i in range(4)
    ]
    hits: dict[int, tuple] = {}
    for op, i, a, b in calls:
        req = reqs[i]
        try:
            if op == "get":
                hits[i] = manager.get_computed_blocks(req)
            elif op == "alloc":
                manager.allocate_slots(req, a, num_lookahead_tokens=max(b, 0) % 8)
            elif op == "admit" and i in hits:
                blocks, hit = hits.pop(i)
                manager.allocate_slots(
                    req,
                    a,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    full_sequence_must_fit=True,
                )
            elif op == "free":
                manager.free(req)
            elif op == "append":
                req.append_output_token_ids(a)
            elif op == "computed":
                req.num_computed_tokens = a
            elif op == "probe":
                assert 0 <= manager.probe(req.prompt_token_ids) < req.num_prompt_tokens
        except (hk.HybridKvError, OverflowError):
            pass
        assert 0 <= manager.num_free_blocks <= num_blocks - 1
    for req in reqs:
        manager.free(req)
    assert manager.num_free_blocks == num_blocks - 1
