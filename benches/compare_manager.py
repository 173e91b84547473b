"""Manager CPU time: hybrid-kv's Python API vs vLLM 0.33, on the conformance fixtures.

Replays each fixture through `hybrid_kv.replay` (the same scheduler loop vLLM's traces were
recorded with) and compares per-op times with the `summary` line of vLLM's own trace (recorded on
a 2-core CPU machine of the same class). The pure-Rust floor of the same replay is
`cargo bench --bench replay`.

    python3 benches/compare_manager.py [--repeat 3] [--prompts fresh|loaded|numpy]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

import numpy as np
from hybrid_kv.replay import load_json, manager_from_header, read_header, replay

CONFORMANCE = Path(__file__).resolve().parents[1].parent / "shared" / "conformance"
FIXTURES = (
    (Path(__file__).resolve().parents[1] / "tests" / "conformance_fixtures.txt").read_text().split()
)
OPS = ("allocate_slots", "free", "get_computed_blocks", "make_request", "append_token")


def vllm_summary(name: str) -> dict:
    with gzip.open(CONFORMANCE / f"{name}.vllm.jsonl.gz", "rt") as f:
        for line in f:
            if '"kind":"summary"' in line:
                return json.loads(line)
    raise ValueError(f"{name}: no summary line")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="replays per fixture (best kept)")
    parser.add_argument(
        "--prompts",
        choices=("fresh", "loaded", "numpy"),
        default="fresh",
        help="prompt given to Request: a list just copied, as an engine gets it from its "
        "tokenizer or input thread (fresh); the workload's lists as loaded, out of the CPU "
        "caches by then (loaded); or int32 arrays made before the replay (numpy)",
    )
    args = parser.parse_args()
    print(
        "| fixture | vLLM manager s | hybrid-kv s | speed-up | decode p50 ns (vLLM) "
        "| make_request p50 µs (vLLM) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in FIXTURES:
        workload = load_json(CONFORMANCE / f"{name}.workload.json.gz")
        if args.prompts == "numpy":
            for r in workload["requests"]:
                r["prompt"] = np.array(r["prompt"], dtype=np.int32)
        header = read_header(CONFORMANCE / f"{name}.vllm.jsonl.gz")
        best = None
        for _ in range(args.repeat):
            manager = manager_from_header(
                header,
                workload["sched"]["max_model_len"],
                workload["sched"]["max_num_batched_tokens"],
            )
            result = replay(workload, manager, fresh_prompts=args.prompts == "fresh")
            if best is None or result.manager_seconds() < best.manager_seconds():
                best = result
        assert best is not None
        theirs = vllm_summary(name)["timing"]
        vllm_total = sum(theirs[op]["total_s"] for op in OPS)
        ours = best.manager_seconds()
        decode = statistics.median(best.timings["allocate_slots.decode"])
        make = statistics.median(best.timings["make_request"]) / 1e3
        print(
            f"| {name} | {vllm_total:.3f} | {ours:.4f} | {vllm_total / ours:.0f}× "
            f"| {decode:.0f} ({theirs['allocate_slots.decode']['median_ns']}) "
            f"| {make:.1f} ({theirs['make_request']['median_ns'] / 1e3:.0f}, "
            f"{theirs['make_request']['median_ns'] / 1e3 / make:.0f}×) |"
        )
    extra = f" --prompts {args.prompts}" if args.prompts != "fresh" else ""
    print(f"\nreproduce: python3 benches/compare_manager.py --repeat {args.repeat}{extra}")


if __name__ == "__main__":
    main()
