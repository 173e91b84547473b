"""Two builds of hybrid-kv's core side by side: replays in one process, alternating turns.

This VM's speed drifts by 2-3x within minutes, so two builds timed in separate processes (or
one after the other) compare the machine's moods as much as the code. This loads both builds in
one process, each as a renamed copy of `python/hybrid_kv` with its own `_core` library, and
replays each fixture through both in turns (the order flips every round). It prints, per op,
each build's median total and the median and quartiles of the per-round ratios new/base, with
how many rounds the new build was faster in; `build` is the time to build the manager (its pool
included) before the replay.

Build each side the same way, e.g. for the working tree against HEAD:

    git stash && CARGO_TARGET_DIR=/tmp/t-base cargo build --release --features python --lib
    git stash pop && CARGO_TARGET_DIR=/tmp/t-new cargo build --release --features python --lib
    python3 benches/compare_builds.py /tmp/t-base/release/libhybrid_kv.so \\
        /tmp/t-new/release/libhybrid_kv.so --rounds 20 --fixtures jamba.shared-prefix.default

The Python package of both sides is this checkout's `python/hybrid_kv`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
CONFORMANCE = ROOT.parent / "shared" / "conformance"
FIXTURES = (ROOT / "tests" / "conformance_fixtures.txt").read_text().split()


def load_side(name: str, library: Path, into: Path) -> ModuleType:
    """`python/hybrid_kv` copied as package `name` under `into`, with `library` as its core."""
    package = into / name
    shutil.copytree(ROOT / "python" / "hybrid_kv", package, ignore=shutil.ignore_patterns("*.so"))
    for source in package.rglob("*.py"):
        text = source.read_text()
        source.write_text(re.sub(r"\bhybrid_kv\b", name, text))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    shutil.copy(library, package / f"_core{suffix}")
    return importlib.import_module(f"{name}.replay")


def ratio_quartiles(base: list[float], new: list[float]) -> tuple[float, float, float, int]:
    """The first quartile, median and third quartile of the pairwise ratios new/base (nonzero
    `base`), and how many of them are below 1 (new faster)."""
    ratios = sorted(n / b for b, n in zip(base, new, strict=True))
    q = len(ratios) // 4
    return ratios[q], statistics.median(ratios), ratios[-1 - q], sum(r < 1 for r in ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the base build's libhybrid_kv.so")
    parser.add_argument("new", type=Path, help="the new build's libhybrid_kv.so")
    parser.add_argument("--rounds", type=int, default=12, help="replays per build and fixture")
    parser.add_argument("--fixtures", nargs="+", default=FIXTURES, choices=FIXTURES)
    args = parser.parse_args()
    if not CONFORMANCE.is_dir():
        parser.error(f"{CONFORMANCE} is missing (the conformance fixtures sit beside the clone)")
    for library in (args.base, args.new):
        if not library.is_file():
            parser.error(f"{library}: no such library")

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        sides = {
            "base": load_side("hk_compare_base", args.base, Path(tmp)),
            "new": load_side("hk_compare_new", args.new, Path(tmp)),
        }
        replay = sides["base"]
        ops = ("total", *replay.TIMED_OPS, "build")
        print(f"{'fixture':34} {'op':20} {'base µs':>10} {'new µs':>10}  new/base (quartiles)")
        for fixture in args.fixtures:
            workload = replay.load_json(CONFORMANCE / f"{fixture}.workload.json.gz")
            header = replay.read_header(CONFORMANCE / f"{fixture}.vllm.jsonl.gz")
            sched = workload["sched"]
            totals: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
            for round_ in range(args.rounds):
                order = ("base", "new") if round_ % 2 == 0 else ("new", "base")
                for side in order:
                    module = sides[side]
                    gc.collect()
                    start = time.perf_counter_ns()
                    manager = module.manager_from_header(
                        header, sched["max_model_len"], sched["max_num_batched_tokens"]
                    )
                    built = time.perf_counter_ns() - start
                    gc.collect()
                    result = module.replay(workload, manager)
                    row = {op: sum(ns) / 1e3 for op, ns in result.timings.items()}
                    row["total"] = result.manager_seconds() * 1e6
                    row["build"] = built / 1e3
                    totals[side].append(row)
                    del manager, result
            for op in ops:
                base = [row.get(op, 0.0) for row in totals["base"]]
                new = [row.get(op, 0.0) for row in totals["new"]]
                if not all(base):
                    continue
                q1, median, q3, faster = ratio_quartiles(base, new)
                print(
                    f"{fixture:34} {op:20} {statistics.median(base):10.1f} "
                    f"{statistics.median(new):10.1f}  {median:.3f} "
                    f"({q1:.3f}-{q3:.3f}; faster in {faster}/{len(base)})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
