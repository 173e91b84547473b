"""`hybrid_kv.vllm` keys its prefix cache with the hash vLLM's config names
(`CacheConfig.prefix_caching_hash_algo`): with vLLM's SHA-256 options, vLLM's own block hashes of
each request (`Request.block_hashes`, first 16 bytes), so nothing is hashed twice; with its
xxHash options, XXH3-128 seeded by vLLM's rule (`PYTHONHASHSEED`, else a random seed per
manager)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv as hk  # noqa: E402
import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from test_vllm_scheduler import run_both  # noqa: E402

ALGOS = {"sha256": "sha256", "sha256_cbor": "sha256", "xxhash": "xxh3", "xxhash_cbor": "xxh3"}
WORKLOAD = harness.chat_workload(24, seed=5, salts=(None, "tenant-a"))


def _stored(algo: str, layout: str = "gpt-oss") -> tuple[Any, list[Any]]:
    """Runs a few steps on hybrid-kv's scheduler with the core's own KV events kept (the
    adapter's translation of them is turned off) and returns the manager and the core's
    `BlockStored` events of the full-attention group."""
    options = harness.Options(layout=layout, kv_events=True, hash_algo=algo)
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    assert scheduler.uses_hybrid_kv
    manager = scheduler.kv_cache_manager
    manager._events = None
    driver = harness.Driver(scheduler, WORKLOAD[:6])
    for _ in range(40):
        driver.timed_step()
    full = next(
        i
        for i, g in enumerate(scheduler.kv_cache_config.kv_cache_groups)
        if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"
    )
    stored = [
        e
        for e in manager.core.take_events()
        if isinstance(e, hk.BlockStored) and e.group_id == full
    ]
    assert any(e.parent_block_hash is None for e in stored), "no prompt's first block stored"
    assert any(e.parent_block_hash is not None for e in stored), "no later block stored"
    return manager, stored


def _chain(
    tokens: list[int], algo: str, seed: str, salt: str | None, parent: int | None = None
) -> list[int]:
    pairs = hk.hash_token_blocks(
        np.asarray(tokens, dtype=np.uint32),
        16,
        parent_block_hash=parent,
        start=0 if parent is None else 16,
        algo=algo,
        seed=seed,
        cache_salt=salt,
    )
    return [int(lo) | int(hi) << 64 for lo, hi in pairs]


def _check_keys(stored: list[Any], algo: str, seed: str) -> None:
    """Every stored block's key is the chain of `algo` seeded with `seed`: a prompt's first
    blocks from the prompt (and its salt), later blocks from their parent."""
    for event in stored:
        tokens = list(event.token_ids)
        if event.parent_block_hash is None:
            candidates = [
                _chain(tokens, algo, seed, spec.cache_salt)
                for spec in WORKLOAD
                if list(spec.prompt[: len(tokens)]) == tokens
            ]
            assert list(event.block_hashes) in candidates
        else:
            assert list(event.block_hashes) == _chain(
                tokens, algo, seed, None, event.parent_block_hash
            )


def _vllm_keys(algo: str) -> list[list[int]]:
    """Per request of the run, the keys of vLLM's own block hashes (`prefix_caching_hash_algo`
    `algo`) of its prompt and every token the fake model samples for it."""
    keys = []
    for spec in WORKLOAD[:6]:
        request = harness.make_request(spec, hash_algo=algo)
        for position in range(request.num_tokens, request.num_tokens + spec.max_tokens):
            request.append_output_token_ids(harness.next_token(spec.request_id, position))
        keys.append([int.from_bytes(h[:16], "little") for h in request.block_hashes])
    return keys


def _check_vllm_keys(stored: list[Any], algo: str) -> None:
    """Every stored block's key is vLLM's hash of it: a run of one request's keys, starting
    after its parent's key (or at the request's first block)."""
    chains = _vllm_keys(algo)
    for event in stored:
        hashes = list(event.block_hashes)
        assert any(
            chain[k : k + len(hashes)] == hashes
            and (chain[k - 1] if k else None) == event.parent_block_hash
            for chain in chains
            for k in range(len(chain))
        ), f"{event} is not keyed by vLLM's {algo} hashes"


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_blocks_are_keyed_with_the_hash_vllms_config_names(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    manager, stored = _stored(algo)
    assert manager.hash_algo == algo
    seed = manager._hash_seed
    if ALGOS[algo] == "sha256":
        assert seed == "vllm-none-hash"
        _check_vllm_keys(stored, algo)
        # Not the other SHA-256 option's hashes, nor the core's own SHA-256 chain.
        with pytest.raises(AssertionError):
            _check_vllm_keys(stored, "sha256_cbor" if algo == "sha256" else "sha256")
        with pytest.raises(AssertionError):
            _check_keys(stored, "sha256", seed)
        return
    # Random per manager: the keys cannot be computed outside the process.
    assert len(seed) >= 32 and seed != _stored(algo)[0]._hash_seed
    _check_keys(stored, ALGOS[algo], seed)
    # Neither the other hash nor another seed gives those keys.
    other = "xxh3" if ALGOS[algo] == "sha256" else "sha256"
    with pytest.raises(AssertionError):
        _check_keys(stored, other, seed)
    with pytest.raises(AssertionError):
        _check_keys(stored, ALGOS[algo], "")


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_pythonhashseed_seeds_the_keys_as_it_seeds_vllms(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    first, stored = _stored(algo)
    second, again = _stored(algo)
    assert first._hash_seed == second._hash_seed == "1234"
    if ALGOS[algo] == "sha256":
        _check_vllm_keys(stored, algo)
    else:
        _check_keys(stored, ALGOS[algo], "1234")
    assert [e.block_hashes for e in stored] == [e.block_hashes for e in again]


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_same_outputs_as_vllm_with_each_hash(algo: str) -> None:
    run = run_both(harness.Options(layout="gemma3", hash_algo=algo, num_blocks=700), WORKLOAD)
    assert run.hits > 0 and run.preempted > 0


def test_a_hash_vllm_does_not_name_falls_back() -> None:
    options = harness.Options(layout="full")
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    kwargs = dict(
        kv_cache_config=scheduler.kv_cache_config,
        max_model_len=options.max_model_len,
        scheduler_block_size=16,
        hash_block_size=16,
    )
    with pytest.raises(hkv._manager.Unsupported, match="prefix_caching_hash_algo='md5'"):
        hkv._manager.HybridKVCacheManager(**kwargs, hash_algo="md5")
    assert hkv._manager.HybridKVCacheManager(**kwargs).hash_algo == "sha256"


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_vllms_hashes_are_taken_only_when_sha256_and_complete(algo: str) -> None:
    """The companion takes vLLM's `Request.block_hashes` with a SHA-256 option when they cover
    the request's hashable blocks; otherwise (xxHash options, a request without vLLM's block
    hasher, or hashes that fall short) the manager hashes the tokens itself, and either way
    the request is served."""
    scheduler = harness.build_scheduler(
        harness.Options(layout="gpt-oss", hash_algo=algo), hkv.Scheduler
    )
    manager = scheduler.kv_cache_manager
    spec = WORKLOAD[0]

    def served(request: Any) -> Any:
        companion = manager._companion(request)
        blocks, hit, *_ = manager.get_computed_blocks(request)
        assert hit == 0 and blocks is not None
        return companion.supplied_block_hashes

    request = harness.make_request(spec, hash_algo=algo)
    keys = served(request)
    if ALGOS[algo] == "sha256":
        assert keys is not None and len(keys) == len(request.block_hashes) > 0
        assert [int(lo) | int(hi) << 64 for lo, hi in keys.tolist()] == [
            int.from_bytes(h[:16], "little") for h in request.block_hashes
        ]
    else:
        assert keys is None
    no_hasher = harness.make_request(
        harness.RequestSpec("no-hasher", spec.prompt, spec.max_tokens, 0), hash_algo=algo
    )
    no_hasher._block_hasher = None
    assert served(no_hasher) is None
    short = harness.make_request(
        harness.RequestSpec("short", spec.prompt, spec.max_tokens, 0), hash_algo=algo
    )
    short.block_hashes.pop()
    assert served(short) is None


def test_requests_are_hashed_from_their_algorithms_none_hash_whatever_ran_before() -> None:
    # vLLM keeps the parent hash of every prompt's first block (NONE_HASH) in a module global
    # its engine core sets once per process; the harness hashes with several algorithms in one
    # process. A SHA-256 request made after an xxHash one once chained from the xxHash seed.
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        BlockHash,
        generate_block_hash_extra_keys,
        hash_block_tokens,
        resolve_none_hash_seed,
    )

    sha256 = get_hash_fn_by_name("sha256")
    spec = WORKLOAD[0]
    harness.make_request(spec)
    harness.make_request(spec, lookahead=5, hash_algo="xxhash")
    request = harness.make_request(spec)
    extra, _ = generate_block_hash_extra_keys(request, 0, harness.BLOCK_SIZE, 0)
    parent = BlockHash(sha256(resolve_none_hash_seed(sha256)))
    expected = hash_block_tokens(sha256, parent, list(spec.prompt[: harness.BLOCK_SIZE]), extra)
    assert request.block_hashes[0] == expected
