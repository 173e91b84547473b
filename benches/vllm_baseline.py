"""Manager CPU time of the real vLLM 0.33 `KVCacheManager` vs hybrid-kv, on the same machine.

`compare_manager.py` compares hybrid-kv with the timings stored in the conformance fixtures, which
were recorded on another machine. This script instead imports vLLM 0.33 itself, builds its
`KVCacheManager` from each fixture's trace header (the same KV cache groups, pool size, block and
hash sizes and dense retention), and replays the fixture's workload with the scheduler loop of
`hybrid_kv.replay.replay` (shared/conformance/README.md): the same manager calls in the same order,
each timed with `perf_counter_ns` around the manager call alone, under the same op names. In the
same process it then runs hybrid-kv's replay of the same workload, and prints both side by side.

Before timing, one traced vLLM replay per fixture is written as kvtrace/1 and compared with the
recorded vLLM trace by `trace_diff.py --ids`; `IDENTICAL` shows the harness reproduces the
recorded run call by call (hits, allocations, block ids, free-block counts).

Setup (vLLM is installed without its dependency tree; the second pip line is what importing
`vllm.v1.core.kv_cache_manager`, `vllm.v1.request` and `vllm.sampling_params` needs on top of a
Python 3.11 that already has numpy, torch, pydantic and hybrid_kv; pip warns that vLLM pins other
torch / transformers / xgrammar versions, which is harmless for the manager):

    python3 -m venv --system-site-packages VENV
    VENV/bin/pip install --no-deps vllm==0.33.0
    VENV/bin/pip install psutil pyzmq msgspec cbor2 transformers aiohttp openai-harmony openai \\
        pybase64 cachetools uvloop py-cpuinfo prometheus_client xgrammar fastapi \\
        partial-json-parser llguidance

Run (from the repository root):

    VENV/bin/python benches/vllm_baseline.py [--repeat 3] [--per-op] [--no-check] \
        [--prompts fresh|loaded]

Timed ops, as in hybrid_kv.replay: make_request (`Request(...)` construction on both sides; vLLM's
hashes the prompt with the engine's request block hasher, "sha256" = pickle + SHA-256 by default,
and the `SamplingParams` it takes arrive with the request and are built before the timer starts;
hybrid-kv's hashes it with XXH3, and the manager takes the hashes over in its first call),
get_computed_blocks, allocate_slots (+ .admit / .chunk / .decode), free, append_token
(`Request.append_output_token_ids`, incl. incremental hashing) and new_step_starts. The manager
total is the sum of the first five, as in vLLM's trace summaries. Each timed call also holds
the timer's own cost (about 60 ns on this VM, over half of a decode step's measured 100 ns); the
summary's last column takes the cost of an empty timed region, measured in the same process,
off every call of both sides.

The manager is built as vLLM's scheduler builds it, with log_stats=True (the recorded summaries
carry prefix-cache stats; the flag does not touch any timed call) and max_in_flight_tokens =
max_num_batched_tokens (a synchronous engine; `--max-in-flight` shows the fixtures replay
identically with any choice). Both sides get the same prompt lists, copied just before each
request is made unless `--prompts loaded` (see `hybrid_kv.replay.replay`). `--hash-algo` picks
vLLM's prefix_caching_hash_algo: the recorded make_request times match the default "sha256";
"sha256_cbor" is about twice as slow.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

CONFORMANCE = Path(__file__).resolve().parents[1].parent / "shared" / "conformance"
FIXTURES = (
    (Path(__file__).resolve().parents[1] / "tests" / "conformance_fixtures.txt").read_text().split()
)


def _import_hybrid_kv(attempts: int = 10, wait_s: float = 60.0) -> Any:
    """`hybrid_kv.replay`, retried while the native extension is being rebuilt."""
    for attempt in range(attempts):
        try:
            import hybrid_kv.replay as replay_module

            return replay_module
        except ImportError as error:
            if attempt == attempts - 1:
                raise
            print(f"import hybrid_kv failed ({error}); retrying in {wait_s:.0f} s", file=sys.stderr)
            for name in [m for m in sys.modules if m.startswith("hybrid_kv")]:
                del sys.modules[name]
            time.sleep(wait_s)
    raise AssertionError("unreachable")


HK = _import_hybrid_kv()
OPS = HK.MANAGER_OPS
ALL_OPS = HK.TIMED_OPS


# --------------------------------------------------------------------------- vLLM construction


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def vllm_kv_cache_config(header: dict[str, Any]) -> Any:
    """vLLM `KVCacheConfig` with exactly the groups, layers and pool size of a trace header."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    kv = header["kv_cache"]
    layers = header["layout"]["layers"]
    groups = []
    for group in kv["groups"]:
        layer = layers[group["layer_ids"][0]]
        kind = group["kind"]
        if kind == "mamba":
            spec = MambaSpec(
                block_size=group["block_size"],
                shapes=tuple(tuple(shape) for shape in layer["shapes"]),
                dtypes=tuple(_torch_dtype(d) for d in layer["dtypes"]),
                page_size_padded=group["page_size_bytes_per_layer"],
                mamba_cache_mode=group["mamba_cache_mode"],
            )
            names = [f"model.layers.{i}.mixer" for i in group["layer_ids"]]
            groups.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
            continue
        common = {
            "block_size": group["block_size"],
            "num_kv_heads": layer["num_kv_heads"],
            "head_size": layer["head_size"],
            "dtype": _torch_dtype(layer["dtype"]),
        }
        if kind == "full":
            spec = FullAttentionSpec(**common)
        elif kind == "sliding_window":
            spec = SlidingWindowSpec(**common, sliding_window=group["sliding_window"])
        elif kind == "chunked_local":
            spec = ChunkedLocalAttentionSpec(
                **common, attention_chunk_size=group["attention_chunk_size"]
            )
        else:
            raise ValueError(f"replaying {kind!r} groups is not supported")
        if spec.page_size_bytes != group["page_size_bytes_per_layer"]:
            raise ValueError(
                f"group {kind}: page size {spec.page_size_bytes} != "
                f"{group['page_size_bytes_per_layer']} in the header"
            )
        names = [f"model.layers.{i}.attn" for i in group["layer_ids"]]
        groups.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
    return KVCacheConfig(
        num_blocks=kv["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=kv.get("prefix_cache_retention_interval"),
        hash_block_size=kv["hash_block_size"],
    )


def vllm_manager(header: dict[str, Any], sched: dict[str, Any], max_in_flight: str) -> Any:
    """vLLM's `KVCacheManager` as its scheduler builds it (prefix caching on, log_stats on).

    `max_in_flight` is "batch" (VllmConfig.max_in_flight_tokens of a synchronous engine:
    max_num_batched_tokens), "async" (two batches in flight) or "unset" (the manager's
    fallback, max_model_len). It only matters for sliding-window admission caps.
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kv = header["kv_cache"]
    max_model_len = sched["max_model_len"]
    in_flight = {
        "batch": sched["max_num_batched_tokens"],
        "async": 2 * sched["max_num_batched_tokens"],
        "unset": None,
    }[max_in_flight]
    return KVCacheManager(
        kv_cache_config=vllm_kv_cache_config(header),
        max_model_len=max_model_len,
        scheduler_block_size=kv["scheduler_block_size"],
        hash_block_size=kv["hash_block_size"],
        max_in_flight_tokens=in_flight,
        enable_caching=True,
        log_stats=True,
    )


def vllm_block_hasher(hash_algo: str, hash_block_size: int) -> Callable[[Any], list[Any]]:
    """The request block hasher vLLM's engine core installs (`init_none_hash` first)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)


# --------------------------------------------------------------------------- vLLM replay


class VllmEngine:
    """vLLM's `KVCacheManager` and `Request` as a `hybrid_kv.replay.Engine`: the replay loop is
    hybrid-kv's own, so both sides run exactly the same calls, timed the same way."""

    def __init__(
        self, header: dict[str, Any], sched: dict[str, Any], hash_algo: str, max_in_flight: str
    ) -> None:
        from vllm.v1.request import RequestStatus

        self.manager = vllm_manager(header, sched, max_in_flight)
        self.pool = self.manager.block_pool
        self.hasher = vllm_block_hasher(hash_algo, header["kv_cache"]["hash_block_size"])
        self.status = RequestStatus

    def request_maker(self, r: dict[str, Any]) -> Callable[[], Any]:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        # The sampling parameters arrive with the request: built before the timer starts.
        params = SamplingParams(max_tokens=len(r["output"]))
        rid, prompt, hasher = r["rid"], r["prompt"], self.hasher
        return lambda: Request(rid, prompt, params, None, block_hasher=hasher)

    def hit(self, request: Any, result: Any) -> tuple[Any, int, int]:
        blocks, hit, spb = result
        request.shared_prefix_boundary = spb
        return blocks, hit, spb

    def block_ids(self, blocks: Any) -> Sequence[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in blocks.get_block_ids()]

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def num_cached_blocks(self) -> int:
        return len(self.pool.cached_block_hash_to_block)

    def admitted(self, request: Any, hit: int, preempted: bool) -> None:
        # vLLM tells re-admissions apart by the request's own preemption count.
        self.manager.record_prefix_cache_stats(request, hit)
        request.status = self.status.RUNNING

    def preempted(self, request: Any) -> None:
        request.status = self.status.PREEMPTED
        request.num_preemptions += 1

    def finished(self, request: Any) -> None:
        request.status = self.status.FINISHED_LENGTH_CAPPED

    def prefix_cache_stats(self) -> dict[str, Any]:
        pc = self.manager.make_prefix_cache_stats()
        return {
            "requests": pc.requests,
            "queries": pc.queries,
            "hits": pc.hits,
            "hit_rate": pc.hits / pc.queries if pc.queries else 0.0,
            "preempted_requests": pc.preempted_requests,
            "preempted_queries": pc.preempted_queries,
            "preempted_hits": pc.preempted_hits,
        }

    def num_blocks_to_admit(self, request: Any, blocks: Any) -> int:
        # vLLM's admission check (allocate_slots with full_sequence_must_fit), without a hit.
        return self.manager.coordinator.get_num_blocks_to_allocate(
            request.request_id,
            min(request.num_tokens, self.manager.max_model_len),
            tuple(() for _ in blocks.blocks),
            0,
            0,
            0,
            request.num_tokens,
            apply_admission_cap=True,
        )

    def num_blocks(self) -> int:
        return self.pool.num_gpu_blocks

    def end_step(self) -> None:
        self.manager.take_new_block_ids()
        self.manager.take_boundary_state_offloads()

    def mamba_block_size(self) -> int:
        groups = self.manager.kv_cache_config.kv_cache_groups
        align = any(getattr(g.kv_cache_spec, "mamba_cache_mode", None) == "align" for g in groups)
        return self.manager.coordinator.scheduler_block_size if align else 0

    def mamba_checkpoint_alignment(self) -> int:
        groups = self.manager.kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "mamba_cache_mode")]
        if not specs or any(s.num_prefill_checkpoint_blocks == 0 for s in specs):
            return 0
        return specs[0].prefill_checkpoint_alignment or 0


def vllm_replay(
    workload: dict[str, Any],
    header: dict[str, Any],
    hash_algo: str = "sha256",
    max_in_flight: str = "batch",
    out: IO[str] | None = None,
    freeze_gc: bool = False,
    fresh_prompts: bool = True,
) -> Any:
    """`hybrid_kv.replay.replay` driving vLLM's manager; returns a ReplayResult."""
    engine = VllmEngine(header, workload["sched"], hash_algo, max_in_flight)
    if freeze_gc:
        _freeze_gc()
    try:
        trace_header = _trace_header(workload, header, hash_algo, max_in_flight)
        return HK.replay(
            workload,
            engine,
            out,
            trace_header if out is not None else None,
            fresh_prompts=fresh_prompts,
        )
    finally:
        if freeze_gc:
            gc.unfreeze()


def _trace_header(
    workload: dict[str, Any], header: dict[str, Any], hash_algo: str, max_in_flight: str
) -> dict[str, Any]:
    import vllm

    return {
        "kind": "header",
        "format": "kvtrace/1",
        "impl": f"vllm-{vllm.__version__}",
        "harness": {
            "script": "benches/vllm_baseline.py",
            "prefix_caching_hash_algo": hash_algo,
            "max_in_flight_tokens": max_in_flight,
            "log_stats": True,
        },
        "layout": header.get("layout"),
        "workload": {
            "name": workload.get("name"),
            "seed": workload.get("seed"),
            "digest": HK._digest(workload),
            "sched": workload["sched"],
            "num_requests": len(workload["requests"]),
        },
        "kv_cache": header["kv_cache"],
    }


# --------------------------------------------------------------------------- reporting


def recorded_summary(path: Path) -> dict[str, Any]:
    with HK._open(path) as f:
        for line in f:
            if '"kind":"summary"' in line:
                return json.loads(line)
    raise ValueError(f"{path}: no summary line")


def check_trace(ours: Path, recorded: Path, verbose: bool) -> tuple[bool, str]:
    """Runs trace_diff.py --ids; returns (identical, its verdict line)."""
    diff = subprocess.run(
        [sys.executable, str(CONFORMANCE / "trace_diff.py"), str(ours), str(recorded), "--ids"],
        capture_output=True,
        text=True,
    )
    verdict = next(
        (ln for ln in diff.stdout.splitlines() if "IDENTICAL" in ln or "MISMATCH" in ln),
        diff.stdout.strip() or diff.stderr.strip(),
    )
    if verbose or diff.returncode != 0:
        print(diff.stdout + diff.stderr)
    return diff.returncode == 0, verdict


def _freeze_gc() -> None:
    """What vLLM's engine core does once the scheduler is built (`freeze_gc_heap`)."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()


def hybrid_kv_replay(
    workload: dict[str, Any],
    header: dict[str, Any],
    freeze_gc: bool = False,
    fresh_prompts: bool = True,
) -> Any:
    """hybrid-kv's own replay of the workload, as `compare_manager.py` runs it."""
    manager = HK.manager_from_header(
        header, workload["sched"]["max_model_len"], workload["sched"]["max_num_batched_tokens"]
    )
    if freeze_gc:
        _freeze_gc()
    try:
        return HK.replay(workload, manager, fresh_prompts=fresh_prompts)
    finally:
        if freeze_gc:
            gc.unfreeze()


def best_of(runs: int, *fns: Callable[[], Any]) -> list[Any]:
    """The fastest of `runs` results of each function, run in turns (A, B, A, B, ...) so that
    a slow spell of a shared machine weighs on both sides alike."""
    best: list[Any] = [None] * len(fns)
    for _ in range(runs):
        for k, fn in enumerate(fns):
            gc.collect()
            result = fn()
            if best[k] is None or result.manager_seconds() < best[k].manager_seconds():
                best[k] = result
    return best


def p50(result: Any, op: str) -> float:
    values = result.timings.get(op)
    return float(statistics.median(values)) if values else float("nan")


def total_s(result: Any, op: str) -> float:
    return sum(result.timings.get(op, [])) / 1e9


def timer_floor_ns(samples: int = 200_000) -> float:
    """What a timed region holds when it holds no call: the median of back-to-back
    `perf_counter_ns` differences, taken as the replay loop takes its times (the clock bound to a
    local). Each timed call includes it once, on both sides."""
    perf = time.perf_counter_ns
    values = []
    for _ in range(samples):
        t0 = perf()
        values.append(perf() - t0)
    return float(statistics.median(values))


def net_seconds(result: Any, floor_ns: float) -> float:
    """The manager time of `result` with `floor_ns` taken off each timed call (an op's total
    never below zero)."""
    total = 0.0
    for op in OPS:
        values = result.timings.get(op, [])
        total += max(0.0, sum(values) - floor_ns * len(values))
    return total / 1e9


def print_fixture(name: str, recorded: dict[str, Any], vllm: Any, ours: Any, per_op: bool) -> None:
    timing = recorded["timing"]
    rec_total = sum(timing[op]["total_s"] for op in OPS)
    v_total, h_total = vllm.manager_seconds(), ours.manager_seconds()
    print(f"\n### {name}\n")
    print(
        "| manager time (s) | vLLM recorded | vLLM here | hybrid-kv here | speed-up here |\n"
        "|---|---:|---:|---:|---:|"
    )
    print(f"| total | {rec_total:.4f} | {v_total:.4f} | {h_total:.4f} | {v_total / h_total:.1f}× |")
    print("\n| p50 (ns) | vLLM recorded | vLLM here | hybrid-kv here | speed-up here |")
    print("|---|---:|---:|---:|---:|")
    for op in ("allocate_slots.decode", "make_request"):
        v, h = p50(vllm, op), p50(ours, op)
        print(f"| {op} | {timing[op]['median_ns']} | {v:.0f} | {h:.0f} | {v / h:.1f}× |")
    if not per_op:
        return
    print(
        "\n| op | count | total s: vLLM recorded | vLLM here | hybrid-kv here | speed-up "
        "| p50 ns: vLLM here | hybrid-kv here |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for op in ALL_OPS:
        if op not in vllm.timings:
            continue
        v, h = total_s(vllm, op), total_s(ours, op)
        rec = timing.get(op, {}).get("total_s", float("nan"))
        # One decimal: the goals are bounds (15×, 25×), and a rounded ratio hides which side of
        # one a run is on.
        ratio = f"{v / h:.1f}×" if h else "-"
        print(
            f"| {op} | {len(vllm.timings[op])} | {rec:.4f} | {v:.4f} | {h:.4f} | {ratio} "
            f"| {p50(vllm, op):.0f} | {p50(ours, op):.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed replays per fixture (best)")
    parser.add_argument("--fixtures", nargs="+", default=FIXTURES, choices=FIXTURES)
    parser.add_argument("--conformance", type=Path, default=CONFORMANCE, help="fixture dir")
    parser.add_argument("--per-op", action="store_true", help="also print per-op totals")
    parser.add_argument(
        "--no-check", action="store_true", help="skip the traced replay and trace_diff.py --ids"
    )
    parser.add_argument("--trace-dir", type=Path, help="keep the vLLM harness traces here")
    parser.add_argument("--verbose", action="store_true", help="print trace_diff.py output")
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="gc.freeze() once each manager is built, as vLLM's engine core does",
    )
    parser.add_argument(
        "--prompts",
        choices=("fresh", "loaded"),
        default="fresh",
        help="make_request reads each prompt list just copied, as an engine gets it from its "
        "tokenizer or input thread (fresh), or as loaded with the workload, out of the CPU "
        "caches by then (loaded); both sides get the same lists",
    )
    parser.add_argument(
        "--hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="CacheConfig.prefix_caching_hash_algo (vLLM's default: sha256)",
    )
    parser.add_argument(
        "--max-in-flight",
        default="batch",
        choices=["batch", "async", "unset"],
        help="max_in_flight_tokens given to the manager (see vllm_manager)",
    )
    args = parser.parse_args(argv)

    import vllm

    print(
        f"vLLM {vllm.__version__} KVCacheManager vs hybrid-kv ({HK.IMPL}); Python "
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs; best of {args.repeat}; "
        f"hash {args.hash_algo}, max_in_flight_tokens={args.max_in_flight}, log_stats=True, "
        f"gc {'frozen after manager init' if args.freeze_gc else 'as is'}, "
        f"{args.prompts} prompts"
    )
    scratch = tempfile.TemporaryDirectory(prefix="vllm_baseline.")
    trace_dir = args.trace_dir or Path(scratch.name)
    trace_dir.mkdir(parents=True, exist_ok=True)
    all_identical = True
    fresh = args.prompts == "fresh"
    rows = []
    for name in args.fixtures:
        workload = HK.load_json(args.conformance / f"{name}.workload.json.gz")
        recorded_path = args.conformance / f"{name}.vllm.jsonl.gz"
        header = HK.read_header(recorded_path)
        recorded = recorded_summary(recorded_path)
        if not args.no_check:
            trace = trace_dir / f"{name}.vllm-harness.jsonl"
            with open(trace, "w") as out:
                vllm_replay(workload, header, args.hash_algo, args.max_in_flight, out)
            identical, verdict = check_trace(trace, recorded_path, args.verbose)
            all_identical &= identical
            print(f"\n{name}: trace_diff.py {trace} --ids: {verdict}")
        vllm_best, ours_best = best_of(
            args.repeat,
            lambda w=workload, h=header: vllm_replay(
                w,
                h,
                args.hash_algo,
                args.max_in_flight,
                freeze_gc=args.freeze_gc,
                fresh_prompts=fresh,
            ),
            lambda w=workload, h=header: hybrid_kv_replay(
                w, h, freeze_gc=args.freeze_gc, fresh_prompts=fresh
            ),
        )
        print_fixture(name, recorded, vllm_best, ours_best, args.per_op)
        rec_total = sum(recorded["timing"][op]["total_s"] for op in OPS)
        rows.append((name, rec_total, vllm_best, ours_best))

    floor = timer_floor_ns()
    print("\n### Summary (manager time, s)\n")
    print(
        "| fixture | vLLM recorded | vLLM here | hybrid-kv here | speed-up here "
        "| speed-up, timer cost off |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, rec_total, v, h in rows:
        vs, hs = v.manager_seconds(), h.manager_seconds()
        net = net_seconds(v, floor) / net_seconds(h, floor)
        print(f"| {name} | {rec_total:.4f} | {vs:.4f} | {hs:.4f} | {vs / hs:.1f}× | {net:.1f}× |")
    print(
        f"\nTimer cost: {floor:.0f} ns per timed call (median of back-to-back `perf_counter_ns`"
        " differences in this process), in every call's time on both sides; the last column"
        " takes it off each call of both."
    )
    if not args.no_check:
        verdict = "all IDENTICAL" if all_identical else "MISMATCH"
        kept = f" (kept in {trace_dir})" if args.trace_dir else ""
        print(f"\nvLLM harness traces vs recorded (trace_diff.py --ids): {verdict}{kept}")
    scratch.cleanup()
    options = shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"\nreproduce: VENV/bin/python benches/vllm_baseline.py {options}".rstrip())
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
