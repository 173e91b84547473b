"""Block hashing through the Python bindings."""

import subprocess
import sys
import sysconfig

import hybrid_kv as hk
import numpy as np
import pytest


def test_one_hash_per_full_block_as_uint64_pairs() -> None:
    out = hk.hash_token_blocks(np.arange(50, dtype=np.int32), 16)
    assert out.dtype == np.uint64 and out.shape == (3, 2)
    assert len({tuple(r) for r in out.tolist()}) == 3


def test_int32_int64_uint32_and_lists_hash_identically() -> None:
    tokens = list(range(1000, 1064))
    ref = hk.hash_token_blocks(tokens, 16)
    for dtype in (np.int32, np.int64, np.uint32):
        np.testing.assert_array_equal(hk.hash_token_blocks(np.array(tokens, dtype=dtype), 16), ref)
    # A strided (non-contiguous) view hashes like its contents.
    strided = np.array(tokens * 2, dtype=np.int64).reshape(2, -1).T.ravel()[::2]
    np.testing.assert_array_equal(hk.hash_token_blocks(strided, 16), ref)


def test_list_ints_read_like_arrays_across_the_interpreter_digit_boundaries() -> None:
    # Lists are read straight from the int objects when they have one 30-bit digit; zero,
    # cached small ints, the largest one-digit value, two-digit values up to 2^32 - 1, an int
    # subclass (bool) and an int subclass with a digit must all read as their values.
    class Tok(int):
        pass

    values = [0, 1, 5, 256, 257, 2**30 - 1, 2**30, 2**31 + 3, 2**32 - 1, 128_255]
    tokens = values + [True, Tok(7), Tok(2**30 + 1), 0, 9, 2**30 - 2]
    ref = hk.hash_token_blocks(np.array([int(t) for t in tokens], dtype=np.int64), 4)
    np.testing.assert_array_equal(hk.hash_token_blocks(tokens, 4), ref)
    request = hk.Request("r", tokens, block_size=4)
    np.testing.assert_array_equal(request.prompt_token_ids, [int(t) for t in tokens])
    for bad in ([1, 2**32], [2**32 + 5], [-1], [3, -(2**30)], [2**70]):
        with pytest.raises(hk.HybridKvError):
            hk.hash_token_blocks(bad, 1)


# The `int` layout each CPython the README supports (with the GIL) must be read in.
SUPPORTED_INT_LAYOUTS = {
    (3, 10): "size_then_digits",
    (3, 11): "size_then_digits",
    (3, 12): "tag_then_digits",
    (3, 13): "tag_then_digits",
}


def test_supported_cpythons_read_one_digit_ints_directly() -> None:
    # The direct reads are enabled by a layout check at first use, and a failed check takes the
    # C API for every item (same values, slower): a supported CPython must pass it.
    version = sys.version_info[:2]
    if sys.implementation.name != "cpython" or version not in SUPPORTED_INT_LAYOUTS:
        pytest.skip(f"{sys.implementation.name} {version} is not a supported CPython (README)")
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        pytest.skip("free-threaded CPython is not supported yet (README)")
    assert hk._core._int_layout() == SUPPORTED_INT_LAYOUTS[version]


def test_chain_shares_prefix_hashes_and_diverges_after_a_change() -> None:
    a = np.arange(64, dtype=np.int64)
    b = a.copy()
    b[40] = 7
    ha, hb = hk.hash_token_blocks(a, 16), hk.hash_token_blocks(b, 16)
    np.testing.assert_array_equal(ha[:2], hb[:2])
    assert (ha[2:] != hb[2:]).any(axis=1).all()


def test_incremental_chain_equals_one_shot_and_resumes_from_a_parent() -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, size=200, dtype=np.int64)
    one_shot = hk.hash_token_blocks(tokens, 16, cache_salt="t1", lora_name="l")
    chain = hk.BlockHashChain(16, cache_salt="t1", lora_name="l")
    pieces = [chain.extend(tokens[i : i + 13]) for i in range(0, 200, 13)]
    assert sum(len(p) for p in pieces) == 12 == len(chain)
    np.testing.assert_array_equal(np.concatenate(pieces), one_shot)
    np.testing.assert_array_equal(chain.hashes, one_shot)
    assert chain.num_tokens == 200
    tail = hk.hash_token_blocks(
        tokens[64:], 16, parent_block_hash=one_shot[3], start=64, cache_salt="t1", lora_name="l"
    )
    np.testing.assert_array_equal(tail, one_shot[4:])


def test_salt_lora_and_multimodal_inputs_change_the_hashes() -> None:
    tokens = np.zeros(64, dtype=np.int32)
    plain = hk.hash_token_blocks(tokens, 16)
    salted = hk.hash_token_blocks(tokens, 16, cache_salt="tenant-a")
    other = hk.hash_token_blocks(tokens, 16, cache_salt="tenant-b")
    assert (salted != plain).any(axis=1).all() and (salted != other).any(axis=1).all()
    mm = hk.hash_token_blocks(tokens, 16, mm_inputs=[("img-1", 20, 8)])
    np.testing.assert_array_equal(mm[0], plain[0])
    assert (mm[1:] != plain[1:]).any(axis=1).all()


@pytest.mark.parametrize("algo", ["xxh3", "sha256", "blake3"])
def test_hashes_are_stable_across_processes_for_a_seed(algo: str) -> None:
    code = (
        "import hybrid_kv as hk, numpy as np;"
        f"print(hk.hash_token_blocks(np.arange(48), 16, algo='{algo}', seed='s').tolist())"
    )
    runs = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(2)}
    assert len(runs) == 1
    here = hk.hash_token_blocks(np.arange(48), 16, algo=algo, seed="s").tolist()
    assert str(here) == runs.pop().strip()
    assert hk.hash_token_blocks(np.arange(48), 16, algo=algo, seed="t").tolist() != here


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"token_ids": np.array([1.5]), "block_size": 16}, TypeError),
        ({"token_ids": np.zeros((2, 2), dtype=np.int32), "block_size": 1}, hk.HybridKvError),
        ({"token_ids": [1, -2], "block_size": 1}, hk.HybridKvError),
        ({"token_ids": np.array([1, 2**40]), "block_size": 1}, hk.HybridKvError),
        ({"token_ids": [1, 2], "block_size": 0}, hk.HybridKvError),
        ({"token_ids": [1, 2], "block_size": 1, "algo": "md5"}, hk.HybridKvError),
        ({"token_ids": [1, 2], "block_size": 2, "start": 1}, hk.HybridKvError),
        ({"token_ids": [1], "block_size": 1, "mm_inputs": [("x", 0, 0)]}, hk.HybridKvError),
    ],
)
def test_bad_hash_input_raises_typed_error(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        hk.hash_token_blocks(**kwargs)


def test_rejected_append_leaves_the_chain_unchanged() -> None:
    chain = hk.BlockHashChain(2)
    chain.extend([1, 2, 3])
    with pytest.raises(hk.HybridKvError):
        chain.extend([4, -1])
    assert chain.num_tokens == 3 and len(chain) == 1


def test_chain_repr_shows_its_block_size_and_progress() -> None:
    chain = hk.BlockHashChain(2)
    chain.extend([1, 2, 3])
    assert repr(chain) == "BlockHashChain(block_size=2, num_tokens=3, num_blocks=1)"


def test_import_does_not_import_torch() -> None:
    code = "import sys, hybrid_kv; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"
