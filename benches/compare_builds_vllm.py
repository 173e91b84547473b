"""Two builds of hybrid-kv inside vLLM 0.33's scheduler, side by side in one process.

`benches/compare_builds.py` compares two builds on the conformance replays; this compares them
where `hybrid_kv.vllm` runs: each build (a renamed copy of `python/hybrid_kv` with its own
`_core` library, as `compare_builds.py` loads it) serves one `hybrid_kv.vllm.Scheduler`, and both
schedulers are driven through `benches/vllm_scheduler.py`'s chat workload in alternating turns
(the first side flips every turn). Both must make the same decisions: the requests scheduled
and their token counts are compared on every step. Kept are the steps with `--size` requests
running; for each, the ratio new/base of the step time (`schedule()` + `update_from_output()`)
and of the time in `allocate_slots`, `get_computed_blocks` and `free`, each alone and the three
together ("manager"; its other manager calls and `get_block_ids` are not timed), each call timed
by its own build's `_CallTimer` (a builtin function reading the time-stamp counter around it).
Printed: per side the median per step, and per measure the median and quartiles of the per-step
ratios, with the number of steps the new build was faster in.

The setup has a bias of its own at this size: an A/A run (one library given twice, Gemma-3, 128
running, 200 steps) put the second side's `allocate_slots` at a median 0.960 of the first's
(quartiles 0.915-0.999), its steps at 0.992. Differences of a few percent are not evidence: run
both orders (`BASE NEW`, then `NEW BASE`) and believe only what both show.

Build each side the same way (see `compare_builds.py`), then, from the repository root:

    VLLM_TARGET_DEVICE=cpu VENV/bin/python benches/compare_builds_vllm.py BASE.so NEW.so \\
        [--layout gemma3] [--size 256] [--steps 300] [--turn 25]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_builds  # noqa: E402
import vllm_scheduler  # noqa: E402

TIMED = ("allocate_slots", "get_computed_blocks", "free")


class Side:
    """One build's scheduler, its manager calls timed by the build's own `_CallTimer`."""

    def __init__(self, package: str, options: Any, workload: Any) -> None:
        self.name = package
        vllm = importlib.import_module(f"{package}.vllm")
        core = importlib.import_module(f"{package}._core")
        self.side = vllm_scheduler.Side(package, options, workload, vllm.Scheduler)
        if not self.side.scheduler.uses_hybrid_kv:
            raise RuntimeError(f"{package}: the scheduler fell back to vLLM's manager")
        manager = self.side.scheduler.kv_cache_manager
        self.timers = {}
        for name in TIMED:
            timer = core._CallTimer(getattr(manager, name))
            setattr(manager, name, timer.function())
            self.timers[name] = timer
        self.steps: list[dict[str, int]] = []
        self.decisions: list[dict[str, int]] = []

    def turn(self, steps: int, size: int) -> bool:
        """Up to `steps` steps; False if the workload ended first."""
        return all(self.step(size) for _ in range(steps))

    def step(self, size: int) -> bool:
        """One step; False once the workload is done."""
        driver = self.side.driver
        if driver.done:
            return False
        before = {name: t.ns for name, t in self.timers.items()}
        schedule_ns, update_ns, running = driver.timed_step()
        self.decisions.append(dict(driver.last_output.num_scheduled_tokens))
        if running == size:
            row = {name: t.ns - before[name] for name, t in self.timers.items()}
            row["manager"] = sum(row.values())
            row["step"] = schedule_ns + update_ns
            self.steps.append(row)
        else:
            self.steps.append({})
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the base build's libhybrid_kv.so")
    parser.add_argument("new", type=Path, help="the new build's libhybrid_kv.so")
    parser.add_argument("--layout", default="gemma3", choices=("full", "gemma3"))
    parser.add_argument("--size", type=int, default=256, help="requests running in kept steps")
    parser.add_argument("--steps", type=int, default=300, help="steps per side")
    parser.add_argument("--turn", type=int, default=25, help="steps per turn")
    args = parser.parse_args(argv)
    for library in (args.base, args.new):
        if not library.is_file():
            parser.error(f"no such library: {library}")
    into = Path(tempfile.mkdtemp(prefix="hkv-builds-"))
    sys.path.insert(0, str(into))
    compare_builds.load_side("hkv_base", args.base, into)
    compare_builds.load_side("hkv_new", args.new, into)
    options = vllm_scheduler.options_for(args.layout, args.size)
    workload = vllm_scheduler.workload_for(args.size, args.steps)
    base, new = Side("hkv_base", options, workload), Side("hkv_new", options, workload)
    vllm_scheduler.freeze_heap(True)
    total = 0
    while total < args.steps:
        order = (base, new) if (total // args.turn) % 2 == 0 else (new, base)
        # Both sides take their turn even if the first one's workload ends.
        ran = [side.turn(args.turn, args.size) for side in order]
        if not all(ran):
            break
        total += args.turn
    n = min(len(base.decisions), len(new.decisions))
    for i in range(n):
        if base.decisions[i] != new.decisions[i]:
            raise RuntimeError(f"step {i}: the two builds scheduled different requests or tokens")
    kept = [i for i in range(n) if base.steps[i] and new.steps[i]]
    if not kept:
        raise RuntimeError(f"no step ran with {args.size} requests running")
    print(f"{args.layout}, {args.size} running: {len(kept)} steps kept of {n}")
    print(
        "| measure | base p50 (µs/step) | new p50 (µs/step) | new/base q1 / median / q3 "
        "| new faster |"
    )
    print("|---|---:|---:|---:|---:|")
    for measure in ("step", "manager", *TIMED):
        timed = [i for i in kept if base.steps[i][measure]]
        if not timed:
            continue
        q1, median, q3, faster = compare_builds.ratio_quartiles(
            [base.steps[i][measure] for i in timed], [new.steps[i][measure] for i in timed]
        )
        print(
            f"| {measure} | {statistics.median(base.steps[i][measure] for i in kept) / 1e3:,.1f} "
            f"| {statistics.median(new.steps[i][measure] for i in kept) / 1e3:,.1f} "
            f"| {q1:.3f} / {median:.3f} / {q3:.3f} | {faster}/{len(timed)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
