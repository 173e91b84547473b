"""Requests whose block hashes the caller supplies (`Request(..., block_hashes=)`, vLLM's
`Request.block_hashes`): the manager keys their blocks by those hashes, hashes nothing, and
decides exactly as for the hashes it computes; short or malformed hashes are refused whole."""

from __future__ import annotations

import hashlib
import random

import hybrid_kv as hk
import numpy as np
import pytest

GROUPS = [
    {"kind": "full", "block_size": 16},
    {"kind": "sliding_window", "block_size": 16, "sliding_window": 48},
]


def vllm_like_hashes(tokens: list[int], block_size: int = 16, lookahead: int = 0) -> list[bytes]:
    """Chained SHA-256 of each full block (and the lookahead tokens after it), as vLLM's
    request block hasher computes them."""
    out: list[bytes] = []
    parent = b"none"
    for end in range(block_size, len(tokens) - lookahead + 1, block_size):
        data = parent + repr(tokens[end - block_size : end + lookahead]).encode()
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def _run(supplied: bool, seed: int, lookahead: int = 0) -> list[object]:
    """A random shared-prefix workload (admissions, decode, frees, pool pressure); every
    manager answer in order."""
    rng = random.Random(seed)
    manager = hk.KVCacheManager(
        GROUPS, 40, 4096, num_hash_lookahead_tokens=lookahead, prefix_cache_retention_interval=None
    )
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(10, 60))] for _ in range(3)]
    running: list[tuple[hk.Request, list[int]]] = []
    seen: list[object] = []
    for n in range(30):
        if running and (rng.random() < 0.3 or len(running) > 4):
            request, _ = running.pop(rng.randrange(len(running)))
            manager.free(request)
            seen.append(("free", manager.num_free_blocks))
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        kwargs = {"block_hashes": vllm_like_hashes(prompt, 16, lookahead)} if supplied else {}
        request = hk.Request(f"r{n}", prompt, **kwargs)
        blocks, hit = manager.get_computed_blocks(request)
        new = manager.allocate_slots(
            request, len(prompt) - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
        )
        ids = None if new is None else [b.tolist() for b in new.get_block_ids()]
        seen.append(("admit", hit, ids))
        if new is None:
            continue
        request.num_computed_tokens = len(prompt)
        tokens = list(prompt)
        for _ in range(rng.randrange(0, 40)):
            tokens.append(rng.randrange(1000))
            if supplied:
                request.append_output_token_ids(
                    tokens[-1], block_hashes=vllm_like_hashes(tokens, 16, lookahead)
                )
            else:
                request.append_output_token_ids(tokens[-1])
            step = manager.allocate_slots(request, 1)
            ids = None if step is None else [b.tolist() for b in step.get_block_ids()]
            seen.append(("decode", ids))
            if step is None:
                break
            request.num_computed_tokens += 1
        running.append((request, tokens))
    return seen


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lookahead", [0, 2])
def test_supplied_hashes_decide_as_computed_hashes_do(seed: int, lookahead: int) -> None:
    assert _run(True, seed, lookahead) == _run(False, seed, lookahead)


def test_the_keys_are_the_first_16_bytes_of_each_hash() -> None:
    hashes = [bytes(range(32)), b"\x01", bytes(range(100, 116))]
    request = hk.Request("k", list(range(48)), block_hashes=hashes)
    keys = request.supplied_block_hashes
    assert keys is not None and keys.dtype == np.uint64 and keys.shape == (3, 2)
    for (lo, hi), h in zip(keys.tolist(), hashes, strict=True):
        assert int(lo) | int(hi) << 64 == int.from_bytes(h[:16].ljust(16, b"\0"), "little")
    assert hk.Request("own", list(range(48))).supplied_block_hashes is None


class _Hash(bytes):
    """A bytes subclass (read through the generic path, not the exact-bytes one)."""


@pytest.mark.parametrize("shape", ["list", "tuple", "subclass-first", "subclass-last"])
def test_a_long_list_of_hashes_is_keyed_the_same_whatever_holds_it(shape: str) -> None:
    # 40 hashes of assorted lengths (more than the reader loads ahead).
    hashes: list[bytes] = [bytes((i + k) % 256 for k in range(i % 33)) for i in range(40)]
    held: object = list(hashes)
    if shape == "tuple":
        held = tuple(hashes)
    elif shape == "subclass-first":
        held = [_Hash(hashes[0]), *hashes[1:]]
    elif shape == "subclass-last":
        held = [*hashes[:-1], _Hash(hashes[-1])]
    request = hk.Request("k", list(range(640)), block_hashes=held)
    keys = request.supplied_block_hashes
    assert keys is not None and keys.shape == (40, 2)
    for (lo, hi), h in zip(keys.tolist(), hashes, strict=True):
        assert int(lo) | int(hi) << 64 == int.from_bytes(h[:16].ljust(16, b"\0"), "little")


@pytest.mark.parametrize("bad", [None, "ab", bytearray(b"ab"), 7])
@pytest.mark.parametrize("at", [0, 20, 39])
def test_a_non_bytes_hash_anywhere_in_a_long_list_is_a_type_error(bad: object, at: int) -> None:
    hashes: list[object] = [bytes([i]) * 32 for i in range(40)]
    hashes[at] = bad
    with pytest.raises(TypeError, match="bytes"):
        hk.Request("t", list(range(640)), block_hashes=hashes)


def test_equal_hashes_share_blocks_whatever_the_tokens() -> None:
    # The hashes alone key the blocks: two prompts with the caller's same hashes hit.
    manager = hk.KVCacheManager(GROUPS[:1], 16, 1024, prefix_cache_retention_interval=None)
    hashes = vllm_like_hashes(list(range(64)))
    a = hk.Request("a", list(range(64)), block_hashes=hashes)
    manager.allocate_slots(a, 64)
    b = hk.Request("b", [7] * 64, block_hashes=hashes)
    _, hit = manager.get_computed_blocks(b)
    assert hit == 48
    c = hk.Request("c", list(range(64)), block_hashes=vllm_like_hashes([7] * 64))
    assert manager.get_computed_blocks(c)[1] == 0


def test_malformed_hashes_are_type_errors() -> None:
    for bad in ([1, 2], ["ab"], [b"x", None], 5, "abc"):
        with pytest.raises(TypeError):
            hk.Request("t", list(range(32)), block_hashes=bad)
    request = hk.Request("t", list(range(16)), block_hashes=[b"h" * 32])
    with pytest.raises(TypeError):
        request.append_output_token_ids(3, block_hashes=[b"h" * 32, 7])
    assert request.num_tokens == 16, "nothing appended"


def test_hashes_for_a_request_that_computes_its_own_are_refused() -> None:
    request = hk.Request("own", list(range(16)))
    with pytest.raises(hk.InvalidArgumentError, match="without block_hashes"):
        request.append_output_token_ids([1, 2], block_hashes=[b"h" * 32])
    assert request.num_tokens == 16


def test_short_hashes_are_refused_by_the_call_that_needs_them_and_change_nothing() -> None:
    manager = hk.KVCacheManager(GROUPS[:1], 16, 1024, prefix_cache_retention_interval=None)
    tokens = list(range(40))
    # 40 tokens: 2 full blocks, 1 hash.
    short = hk.Request("s", tokens, block_hashes=vllm_like_hashes(tokens)[:1])
    with pytest.raises(hk.InvalidArgumentError, match="block hashes"):
        manager.get_computed_blocks(short)
    assert manager.num_requests == 0, "nothing registered"
    free = manager.num_free_blocks
    with pytest.raises(hk.InvalidArgumentError, match="block hashes"):
        manager.allocate_slots(short, 40)
    assert manager.num_free_blocks == free
    # A request that got its hashes, then tokens without the hash of the block they fill.
    r = hk.Request("r", tokens, block_hashes=vllm_like_hashes(tokens))
    assert manager.allocate_slots(r, 40) is not None
    r.num_computed_tokens = 40
    r.append_output_token_ids(list(range(8)))
    with pytest.raises(hk.InvalidArgumentError, match="block hashes"):
        manager.allocate_slots(r, 8)
    assert manager.num_free_blocks == free - 3
    all_tokens = tokens + list(range(8))
    r.append_output_token_ids([], block_hashes=vllm_like_hashes(all_tokens))
    assert manager.allocate_slots(r, 8) is not None


def test_only_the_tokens_after_the_hashed_blocks_are_read_until_events_need_them() -> None:
    tokens = [-1] + list(range(1, 40))
    hashes = vllm_like_hashes(list(range(40)))
    # The bad id sits in a hashed block: not read when the request is made.
    request = hk.Request("e", tokens, block_hashes=hashes)
    assert request.num_prompt_tokens == 40
    with pytest.raises(hk.OutOfRangeError):
        hk.Request("e2", list(range(39)) + [-1], block_hashes=hashes)
    plain = hk.KVCacheManager(GROUPS[:1], 16, 1024)
    assert plain.allocate_slots(request, 40) is not None
    events = hk.KVCacheManager(GROUPS[:1], 16, 1024, enable_kv_events=True)
    with pytest.raises(hk.OutOfRangeError):
        events.allocate_slots(hk.Request("e3", tokens, block_hashes=hashes), 40)
    good = hk.Request("g", list(range(40)), block_hashes=hashes)
    assert events.allocate_slots(good, 40) is not None
    stored = [e for e in events.take_events() if isinstance(e, hk.BlockStored)]
    assert [list(e.token_ids) for e in stored] == [list(range(32))]
    keys = good.supplied_block_hashes
    assert [int(lo) | int(hi) << 64 for lo, hi in keys.tolist()] == list(stored[0].block_hashes)


def test_hashes_of_another_block_size_than_the_managers_are_refused() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 32}], 16, 1024)
    assert manager.hash_block_size == 32
    tokens = list(range(64))
    request = hk.Request("b", tokens, block_size=16, block_hashes=vllm_like_hashes(tokens))
    with pytest.raises(hk.InvalidArgumentError, match="16-token blocks"):
        manager.get_computed_blocks(request)
    assert manager.num_requests == 0
    fitting = hk.Request("f", tokens, block_size=32, block_hashes=vllm_like_hashes(tokens, 32))
    assert manager.allocate_slots(fitting, 64) is not None


@pytest.mark.parametrize(
    "prompt",
    [iter([1, 2, 3]), (t for t in [1, 2, 3]), map(int, "123"), reversed([3, 2, 1])],
    ids=["list_iterator", "generator", "map", "reversed"],
)
@pytest.mark.parametrize("supplied", [False, True])
def test_a_prompt_read_once_is_a_type_error_when_the_request_is_made(
    prompt: object, supplied: bool
) -> None:
    """A request keeps its prompt object and reads it again (`prompt_token_ids`, KV events): an
    iterator, empty after the first read, is refused when the request is made, not later as a
    prompt that "changed from 3 to 0 tokens"."""
    hashes = {"block_hashes": [b"h" * 32]} if supplied else {}
    with pytest.raises(TypeError, match="iterator"):
        hk.Request("r", prompt, block_size=2, **hashes)  # type: ignore[arg-type]
    # Sequences, ranges and arrays are read again as they were.
    for again in ([1, 2, 3], (1, 2, 3), range(1, 4), np.array([1, 2, 3])):
        request = hk.Request("r", again, block_size=2, **hashes)
        assert request.prompt_token_ids.tolist() == [1, 2, 3]
