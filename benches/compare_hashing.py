"""Block hashing: vLLM 0.33's default Python path vs hybrid-kv's Rust core.

vLLM hashes each block as `sha256(pickle.dumps((parent, tuple(tokens), extra_keys)))` in Python
(vllm/v1/core/kv_cache_utils.py, `hash_block_tokens` with the default "sha256"). This script
re-creates that path with the standard library and times it against `hash_token_blocks`.

    python3 benches/compare_hashing.py [--tokens 262144] [--block-size 16]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import time

import hybrid_kv as hk
import numpy as np


def vllm_style_sha256(tokens: list[int], block_size: int) -> list[bytes]:
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", pickle.HIGHEST_PROTOCOL)).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(
            pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        out.append(parent)
    return out


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 18)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 150_000, size=args.tokens, dtype=np.int32)
    as_list = arr.tolist()
    rows = [
        (
            "vLLM-style sha256 (Python)",
            best_of(lambda: vllm_style_sha256(as_list, args.block_size), 3),
        )
    ]
    for algo in ("xxh3", "blake3", "sha256"):
        t = best_of(lambda a=algo: hk.hash_token_blocks(arr, args.block_size, algo=a), 20)
        rows.append((f"hybrid-kv {algo} (int32 numpy)", t))
    t = best_of(lambda: hk.hash_token_blocks(as_list, args.block_size), 5)
    rows.append(("hybrid-kv xxh3 (Python list)", t))
    base = rows[0][1]
    print(f"{args.tokens} tokens, block size {args.block_size}")
    print("| path | M tokens/s | speed-up |\n|---|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {args.tokens / t / 1e6:,.1f} | {base / t:,.0f}x |")
    print(
        f"\nreproduce: python3 benches/compare_hashing.py --tokens {args.tokens} "
        f"--block-size {args.block_size}"
    )


if __name__ == "__main__":
    main()
