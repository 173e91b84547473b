"""Random arguments into every public entry point, in a subprocess: whatever the arguments, a
call returns or raises an `Exception`; the process never panics (a `PanicException` is not an
`Exception`), aborts, crashes or hangs. The subprocess runs under a 3 GiB address-space limit,
so a call that tried to allocate from an argument it had not validated would fail there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import gc, random, resource, sys
    import numpy as np
    import hybrid_kv as hk

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    seed, iterations = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)

    class BadIndex:
        def __index__(self):
            raise RuntimeError("no index")

    class LyingLen:
        def __len__(self):
            return 10**12
        def __iter__(self):
            return iter([1, 2, 3])

    def arrays():
        out = []
        for dtype in ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", ">i8", ">u4", "f4", "f8",
                      "?", "O"]:
            for values in ([], [0, 1, 2], [-1, 5], [2**31 - 1, 7]):
                try:
                    out.append(np.array(values, dtype=dtype))
                except (OverflowError, ValueError):
                    pass
        out.append(np.zeros((2, 3), dtype=np.int32))
        out.append(np.zeros((3, 2), dtype=np.int32, order="F"))
        out.append(np.arange(20, dtype=np.int64)[::3])
        out.append(np.int64(3))
        ro = np.arange(8, dtype=np.int32).reshape(2, 4)
        ro.flags.writeable = False
        out.append(ro)
        out.append(np.zeros((4, 2), dtype=np.uint64))
        return out

    INTS = [0, 1, 2, 3, 15, 16, 17, 63, 64, 100, 1023, -1, -2**31, 2**31 - 1, 2**31, 2**32,
            2**40, 2**62, 2**63 - 1, 2**63, 2**64, -2**70, True, False]
    SCALARS = INTS + [1.5, float("nan"), float("inf"), "", "full", "x" * 300, b"abc",
                      bytearray(b"ab"), None, BadIndex(), object(), complex(1, 2)]
    GROUPS = [
        [{"kind": "full", "block_size": 16}],
        [{"kind": "full", "block_size": 16},
         {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}],
        [{"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64},
         {"kind": "full", "block_size": 16}],
        [{"kind": "mamba", "block_size": 16}, {"kind": "full", "block_size": 16}],
        [{"kind": "sliding_window", "block_size": 0, "sliding_window": -3}],
        [{"kind": 7}], [{}], "full", None, [None], [[1, 2]],
    ]

    def lists():
        return [[], [1, 2, 3], list(range(100)), [1, "2"], [[1]], [-1, 2], [2**40], [2**70],
                [None], [1.5], LyingLen(), (i for i in range(3)), {"a": 1}, range(10)]

    def mm():
        return [None, [], [("a", 0, 4)], [("a", -1, 2)], [("a", 2**62, 2**62)], [("a",)],
                [(1, 2, 3)], "abc", [("a", 0, 0)], [("a", 1.5, 2)], [["a", 0, 4]]]

    def anything():
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice(SCALARS)
        if kind == 1:
            return rng.choice(lists())
        if kind == 2:
            return rng.choice(arrays())
        if kind == 3:
            return rng.choice(GROUPS)
        if kind == 4:
            return rng.choice(mm())
        return rng.choice(objects) if objects else None

    objects = []

    def new_objects():
        m = hk.KVCacheManager(rng.choice(GROUPS[:4]), rng.choice([2, 8, 64]), 512,
                              enable_caching=rng.random() < 0.8,
                              enable_kv_events=rng.random() < 0.3)
        pool = hk.BlockPool(rng.choice([2, 8, 64]), enable_kv_events=rng.random() < 0.5)
        req = hk.Request(f"r{rng.randrange(5)}", list(range(rng.randrange(1, 80))),
                         block_size=m.hash_block_size)
        chain = hk.BlockHashChain(16)
        blocks, _ = m.get_computed_blocks(req)
        return [m, pool, req, chain, blocks]

    def call(fn, nargs_max=4):
        args = [anything() for _ in range(rng.randrange(nargs_max + 1))]
        kwargs = {}
        if rng.random() < 0.3:
            name = rng.choice(["block_size", "group", "group_id", "mm_inputs", "cache_salt",
                               "num_new_computed_tokens", "new_computed_blocks", "start",
                               "num_lookahead_tokens", "full_sequence_must_fit", "algo",
                               "parent_block_hash", "token_ids", "preempted", "watermark",
                               "max_in_flight_tokens", "enable_caching", "hash_algo"])
            kwargs[name] = anything()
        try:
            fn(*args, **kwargs)
        except Exception:
            pass

    def good_calls(m, pool, req):
        # Sensible calls in between, so the random ones meet live state.
        try:
            blocks, hit = m.get_computed_blocks(req)
            n = req.num_tokens - hit
            if n > 0 and m.allocate_slots(req, n, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                req.append_output_token_ids(rng.randrange(100))
            ids = pool.get_new_blocks(rng.randrange(3))
            pool.cache_full_blocks(ids, list(range(1, len(ids) + 1)))
            if rng.random() < 0.5:
                pool.free_blocks(ids[::-1])
        except Exception:
            pass

    entry_points = [hk.KVCacheManager, hk.BlockPool, hk.Request, hk.BlockHashChain,
                    hk.hash_token_blocks, hk.manager_from_plan]
    for i in range(iterations):
        if i % 50 == 0:
            objects[:] = new_objects()
        m, pool, req, chain, blocks = objects
        good_calls(m, pool, req)
        target = rng.choice(objects + [None])
        if target is None:
            call(rng.choice(entry_points), 6)
        else:
            names = [n for n in dir(target) if not n.startswith("_")]
            attr = getattr(target, rng.choice(names))
            if callable(attr):
                call(attr)
            elif rng.random() < 0.2:
                try:
                    setattr(target, "num_computed_tokens", anything())
                except Exception:
                    pass
        if i % 97 == 0:
            gc.collect()
    print("ok")
    """
)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_arguments_never_crash_or_hang(seed: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(seed), "1500"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip().endswith("ok")
