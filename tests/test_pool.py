"""BlockPool through the Python bindings: vLLM 0.33 free order, prefix cache, events, errors."""

import subprocess
import sys
import textwrap

import hybrid_kv as hk
import numpy as np
import pytest
from thread_runner import run_threads


def snapshot(pool: hk.BlockPool) -> tuple:
    refs = tuple(pool.ref_count(i) for i in range(pool.num_blocks))
    keys = tuple(pool.block_hash(i) for i in range(pool.num_blocks))
    return (tuple(pool.free_order()), pool.num_free_blocks, pool.num_cached_blocks, refs, keys)


def test_free_order_matches_vllm_worked_example() -> None:
    pool = hk.BlockPool(11)
    first = pool.get_new_blocks(4)
    assert first.dtype == np.int32
    assert first.tolist() == [1, 2, 3, 4]
    pool.cache_full_blocks([1, 2, 3], [101, 102, 103])
    pool.touch([1, 2, 3])
    assert pool.get_new_blocks(1).tolist() == [5]
    pool.free_blocks([4, 3, 2, 1])
    pool.free_blocks(np.array([5, 3, 2, 1], dtype=np.int64))
    expected = [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert pool.free_order().tolist() == expected
    assert pool.get_new_blocks(10).tolist() == expected


def test_cached_block_is_found_until_reused_and_usage_counts_it_free() -> None:
    pool = hk.BlockPool(4)
    ids = pool.get_new_blocks(2)
    hashes = hk.hash_token_blocks(np.arange(32, dtype=np.int32), 16)
    pool.cache_full_blocks(ids, hashes, 0)
    assert pool.usage == pytest.approx(2 / 3)
    pool.free_blocks(ids[::-1])
    assert pool.usage == 0.0
    assert pool.get_cached_block(hashes[0], [0]).tolist() == [ids[0]]
    assert pool.get_cached_block(hashes[0], [0, 1]) is None, "group 1 never cached it"
    # Free order: one uncached block (3) first, then the cached ones, tail first.
    assert pool.get_new_blocks(2).tolist() == [3, ids[1]]
    assert pool.get_cached_block(hashes[1], [0]) is None
    assert pool.get_cached_block(hashes[0], [0]).tolist() == [ids[0]]


def test_events_report_stored_removed_and_cleared() -> None:
    pool = hk.BlockPool(3, enable_kv_events=True)
    ids = pool.get_new_blocks(2)
    pool.cache_full_blocks(ids, [7, 8], 1, token_ids=list(range(8)), block_size=4)
    pool.free_blocks(ids)
    pool.get_new_blocks(1)
    events = pool.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    stored, removed = events
    assert isinstance(stored, hk.BlockStored) and isinstance(removed, hk.BlockRemoved)
    assert stored.block_hashes == [7, 8] and stored.group_id == 1 and stored.block_size == 4
    assert stored.token_ids == list(range(8)) and stored.parent_block_hash is None
    assert (removed.block_hash, removed.group_id) == (7, 1)
    assert pool.take_events() == []
    pool.free_blocks(pool.free_order()[:0])
    assert not pool.reset_prefix_cache(), "one block still in use"
    pool.free_blocks([ids[0]])
    assert pool.reset_prefix_cache()
    assert isinstance(pool.take_events()[-1], hk.AllBlocksCleared)
    assert pool.num_cached_blocks == 0


@pytest.mark.parametrize(
    ("tokens", "block_size"),
    [([1], 4), (list(range(7)), 4), (list(range(9)), 4), (list(range(8)), 0), ([1, 2], 2**32 - 1)],
)
def test_token_ids_that_are_not_the_blocks_tokens_are_refused_before_caching(
    tokens: list[int], block_size: int
) -> None:
    # The event's token ids are the stored blocks' tokens: block_size for every block.
    pool = hk.BlockPool(3, enable_kv_events=True)
    ids = pool.get_new_blocks(2)
    with pytest.raises(hk.InvalidArgumentError, match="token_ids holds"):
        pool.cache_full_blocks(ids, [7, 8], 1, token_ids=tokens, block_size=block_size)
    assert pool.num_cached_blocks == 0 and pool.take_events() == []


def test_events_are_off_by_default() -> None:
    pool = hk.BlockPool(3)
    pool.cache_full_blocks(pool.get_new_blocks(1), [1])
    assert pool.take_events() == []


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda p: p.get_new_blocks(5), hk.NotEnoughFreeBlocksError),
        (lambda p: p.get_new_blocks(2**40), hk.NotEnoughFreeBlocksError),
        (lambda p: p.get_new_blocks(2**62), hk.NotEnoughFreeBlocksError),
        (lambda p: p.free_blocks([1, 2, 1]), hk.DoubleFreeError),
        (lambda p: p.free_blocks([1] * 100_000), hk.DoubleFreeError),
        (lambda p: p.free_blocks([2, 4, 1]), hk.DoubleFreeError),
        (lambda p: p.get_new_blocks(-1), hk.HybridKvError),
        (lambda p: p.free_blocks([1, 1]), hk.DoubleFreeError),
        (lambda p: p.free_blocks([3]), hk.DoubleFreeError),
        (lambda p: p.free_blocks([1, 9]), hk.InvalidBlockIdError),
        (lambda p: p.free_blocks([1, -1]), hk.InvalidBlockIdError),
        (lambda p: p.touch([2, 5]), hk.InvalidBlockIdError),
        (lambda p: p.touch(np.array([1.0])), TypeError),
        (lambda p: p.touch(np.array([[1, 2]], dtype=np.int32)), hk.HybridKvError),
        (lambda p: p.free_blocks(["a"]), TypeError),
        (lambda p: p.cache_full_blocks([3], [1]), hk.BlockNotInUseError),
        (lambda p: p.cache_full_blocks([1, 2], [1]), hk.HybridKvError),
        (lambda p: p.cache_full_blocks([1], np.zeros((1, 3), dtype=np.uint64)), hk.HybridKvError),
        (lambda p: p.cache_full_blocks([1], [-5]), hk.OutOfRangeError),
        (lambda p: p.evict_blocks([2**40]), hk.InvalidBlockIdError),
        (lambda p: p.ref_count(-3), hk.InvalidBlockIdError),
    ],
)
def test_bad_input_raises_typed_error_and_changes_nothing(call, exc) -> None:
    pool = hk.BlockPool(5)
    held = pool.get_new_blocks(2)
    pool.cache_full_blocks(held[:1], [42])
    before = snapshot(pool)
    with pytest.raises(exc):
        call(pool)
    assert snapshot(pool) == before


@pytest.mark.parametrize("num_blocks", [-1, 0, 2**31])
def test_absurd_pool_sizes_are_rejected(num_blocks: int) -> None:
    with pytest.raises(hk.HybridKvError) as raised:
        hk.BlockPool(num_blocks)
    # A negative count fails the argument's conversion; pyo3 names the argument in an exception
    # note, which Python 3.10 does not have.
    if num_blocks >= 0 or sys.version_info >= (3, 11):
        notes = getattr(raised.value, "__notes__", [])
        assert "num_blocks" in " ".join([str(raised.value), *notes])


def test_huge_requests_name_the_shortfall_without_allocating() -> None:
    pool = hk.BlockPool(16)
    for n in (2**40, 2**62, 2**63 - 1):
        with pytest.raises(hk.NotEnoughFreeBlocksError, match=f"requested {n} blocks but only 15"):
            pool.get_new_blocks(n)
    assert pool.num_free_blocks == 15


def run_under_memory_limit(code: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter limited to about 4 GB of address space."""
    script = 'ulimit -v 4000000 && exec "$0" -c "$1"'
    return subprocess.run(
        ["bash", "-c", script, sys.executable, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ulimit -v is Linux-only")
def test_a_pool_too_large_for_memory_raises_memory_error_naming_the_size() -> None:
    done = run_under_memory_limit(
        """
        import hybrid_kv as hk
        try:
            hk.BlockPool(2**31 - 1)
        except MemoryError as e:
            print("MemoryError:", e)
        else:
            raise SystemExit("no MemoryError")
        pool = hk.BlockPool(1024)  # the process is fine afterwards
        assert pool.get_new_blocks(1023).size == 1023
        """
    )
    assert done.returncode == 0, done.stderr
    assert "MemoryError: out of memory: cannot allocate" in done.stdout
    assert "bytes for the" in done.stdout and f"of a pool of {2**31 - 1} blocks" in done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ulimit -v is Linux-only")
def test_a_manager_with_a_pool_too_large_for_memory_raises_memory_error() -> None:
    done = run_under_memory_limit(
        """
        import hybrid_kv as hk
        try:
            hk.KVCacheManager(
                [{"kind": "full", "block_size": 16}], num_blocks=2**31 - 1, max_model_len=1024
            )
        except MemoryError as e:
            print("MemoryError:", e)
        else:
            raise SystemExit("no MemoryError")
        """
    )
    assert done.returncode == 0, done.stderr
    assert "MemoryError: out of memory" in done.stdout


def test_errors_are_value_errors_with_clear_messages() -> None:
    pool = hk.BlockPool(3)
    with pytest.raises(ValueError, match=r"requested 3 blocks but only 2 are free"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError, match=r"block 1 is already free"):
        pool.free_blocks([1])


def test_null_block_is_skipped_by_free_and_touch() -> None:
    pool = hk.BlockPool(3)
    ids = pool.get_new_blocks(2)
    pool.touch([0])
    pool.free_blocks([0, ids[0], 0])
    assert pool.num_free_blocks == 1
    assert 0 not in pool.free_order().tolist()


def test_pool_is_usable_from_several_python_threads() -> None:
    pool = hk.BlockPool(1025)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(2000):
            ids = pool.get_new_blocks(int(rng.integers(1, 8)))
            pool.cache_full_blocks(ids[:1], [int(rng.integers(0, 64))])
            pool.free_blocks(ids[::-1])

    run_threads(work, 4)
    assert pool.num_free_blocks == 1024
    assert sorted(pool.free_order().tolist()) == list(range(1, 1025))
