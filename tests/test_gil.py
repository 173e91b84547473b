"""Long calls release the GIL: another Python thread keeps running while they work in Rust."""

import sys
import threading
import time
from collections.abc import Callable

import hybrid_kv as hk
import numpy as np
import pytest

# Long enough for calls of tens of milliseconds, far above the switch interval set below.
LONG = np.arange(12_000_000, dtype=np.int32) % 150_000


def longest_pause(call: Callable[[], object]) -> tuple[float, float]:
    """Runs `call` while another thread records timestamps as fast as it can; returns the
    longest gap between its timestamps during the call, and the call's duration (seconds). A
    call that holds the GIL shows as one gap about as long as itself."""
    stamps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        while len(stamps) < 100:
            time.sleep(0.001)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    during = [start] + [t for t in stamps if start < t < end] + [end]
    return max(b - a for a, b in zip(during[:-1], during[1:], strict=True)), end - start


@pytest.mark.parametrize(
    "name",
    ["hash_token_blocks", "Request", "probe"],
)
def test_long_calls_let_other_threads_run(name: str) -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 64, 16_000_000)
    calls: dict[str, Callable[[], object]] = {
        "hash_token_blocks": lambda: hk.hash_token_blocks(LONG, 16),
        "Request": lambda: hk.Request("long", LONG),
        "probe": lambda: manager.probe(LONG),
    }
    pause, seconds = longest_pause(calls[name])
    assert seconds > 0.012, f"{name} took only {seconds:.4f} s: the test needs a longer call"
    # The GIL is held while numpy tokens are copied (so that no other thread writes to them
    # during the call), a fraction of the call; a call holding it throughout stalls it all.
    assert pause < seconds * 3 / 4, (
        f"other threads stalled {pause:.4f} s of {name}'s {seconds:.4f} s"
    )


def test_the_check_sees_a_call_that_holds_the_gil() -> None:
    # The same measurement on a C loop that never releases the GIL.
    pause, seconds = longest_pause(lambda: sum(range(20_000_000)))
    assert pause > seconds * 3 / 4


@pytest.mark.parametrize("name", ["hash_token_blocks", "Request", "probe"])
def test_a_numpy_prompt_written_during_a_long_call_is_read_as_one_snapshot(name: str) -> None:
    """Long calls read numpy tokens with the GIL released. Another thread flips the first token
    and one near the end (one that a prefix hit covers) together, in one assignment under the
    GIL, while they run: each call must see the array as it was at one moment, never the first
    token of one version and the later one of the other."""
    tokens = np.arange(400_000, dtype=np.int32) % 150_000
    versions = []
    for v in (1, 2):
        t = tokens.copy()
        t[[0, -20]] = v
        versions.append(t)
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 40_000, 1_000_000)
    # Version 1 fills the cache: a probe then answers all of it for version 1 and 0 for 2.
    first = hk.Request("v1", versions[0])
    blocks, _ = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, len(tokens)) is not None
    first.num_computed_tokens = len(tokens)
    manager.free(first)

    def probe_seen(t: np.ndarray) -> object:
        return manager.probe(t)

    def request_seen(t: np.ndarray) -> object:
        return manager.get_computed_blocks(hk.Request(f"r{next(serial)}", t))[1]

    serial = iter(range(1_000_000))
    seen = {
        "hash_token_blocks": lambda t: hk.hash_token_blocks(t, 16).tobytes(),
        "Request": request_seen,
        "probe": probe_seen,
    }[name]
    allowed = {seen(v) for v in versions}
    assert len(allowed) == 2, "the two versions must give different answers"

    shared = versions[0].copy()
    stop = threading.Event()

    def flipper() -> None:
        v = 1
        while not stop.is_set():
            v = 3 - v
            shared[[0, -20]] = v

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0001)
    thread = threading.Thread(target=flipper)
    thread.start()
    try:
        answers = [seen(shared) for _ in range(60)]
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    assert all(a in allowed for a in answers), "a call mixed two versions of the array"
