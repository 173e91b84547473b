"""`hybrid-kv simulate`: a built-in serving simulation over a catalogue model.

A synthetic workload (multi-turn chat with shared system prompts, long documents, or eviction
pressure) is driven through the conformance scheduler loop (`hybrid_kv.replay`) on a
`KVCacheManager` built from the planner's plan for the model and memory budget. It reports the
prefix-cache hit rate, blocks in use, evictions, preemptions and manager time per step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybrid_kv._core import BlockRemoved
from hybrid_kv.catalogue import load_model
from hybrid_kv.manager import manager_from_plan
from hybrid_kv.planner import plan_kv_cache
from hybrid_kv.replay import ReplayResult, replay

__all__ = ["WORKLOADS", "SimulationReport", "make_workload", "simulate"]

WORKLOADS = ("chat", "long-context", "eviction")
VOCAB = 150_000


def make_workload(kind: str, num_requests: int, max_model_len: int, seed: int = 0) -> dict:
    """A workload in the conformance interchange format (requests with prompts and outputs)."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r} (expected one of {', '.join(WORKLOADS)})")
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, VOCAB, size=n).tolist()

    requests = []
    if kind == "chat":
        systems = [tokens(int(rng.integers(300, 1500))) for _ in range(4)]
        conversations: list[list[int]] = []
        for i in range(num_requests):
            if conversations and rng.random() < 0.5:
                # A follow-up turn: the whole conversation so far is the new prompt's prefix.
                k = int(rng.integers(len(conversations)))
                prompt = conversations[k] + tokens(int(rng.integers(20, 200)))
            else:
                prompt = systems[int(rng.integers(len(systems)))] + tokens(
                    int(rng.integers(20, 400))
                )
            output = tokens(int(rng.integers(20, 250)))
            prompt = prompt[: max_model_len // 2]
            conversations.append(prompt + output)
            requests.append((i, prompt, output))
        sched = {"max_num_seqs": 64, "max_num_batched_tokens": 8192}
    elif kind == "long-context":
        docs = [tokens(min(max_model_len // 2, 24_000)) for _ in range(3)]
        for i in range(num_requests):
            prompt = docs[int(rng.integers(len(docs)))] + tokens(int(rng.integers(50, 500)))
            requests.append((i, prompt, tokens(int(rng.integers(20, 120)))))
        sched = {"max_num_seqs": 16, "max_num_batched_tokens": 16_384}
    else:
        for i in range(num_requests):
            prompt = tokens(int(rng.integers(1000, 6000)))
            requests.append((i, prompt, tokens(int(rng.integers(50, 300)))))
        sched = {"max_num_seqs": 128, "max_num_batched_tokens": 8192}
    sched |= {"long_prefill_token_threshold": 0, "max_model_len": max_model_len}
    return {
        "name": kind,
        "seed": seed,
        "sched": sched,
        "requests": [
            {"rid": f"r{i}", "arrival_step": i // 2, "prompt": p, "output": o}
            for i, p, o in requests
        ],
    }


@dataclass
class SimulationReport:
    model: str
    workload: str
    num_blocks: int
    groups: str
    result: ReplayResult
    evictions: int
    usage: list[float] = field(default_factory=list)
    hit_rate: list[float] = field(default_factory=list)

    def lines(self) -> list[str]:
        r = self.result
        pc = r.prefix_cache
        steps = max(r.num_steps, 1)
        per_step = r.manager_seconds() / steps * 1e6
        decode = r.timings.get("allocate_slots.decode", [0])
        return [
            f"model {self.model}: {self.groups}; {self.num_blocks} blocks",
            f"workload {self.workload}: {r.num_finished} requests finished in {r.num_steps} steps",
            f"prefix-cache hit rate  {pc.get('hit_rate', 0.0):.1%} "
            f"({pc.get('hits', 0):,} of {pc.get('queries', 0):,} prompt tokens)",
            f"blocks in use          peak {max(self.usage, default=0):.1%}, "
            f"mean {float(np.mean(self.usage)) if self.usage else 0:.1%}",
            f"evictions              {self.evictions:,} cached blocks reused",
            f"preemptions            {r.num_preemptions}",
            f"manager time           {per_step:.1f} us per step "
            f"({r.manager_seconds() * 1e3:.1f} ms total; decode allocate_slots median "
            f"{int(np.median(decode))} ns)",
        ]


def simulate(
    model: str = "gemma-3-27b",
    workload: str = "chat",
    memory_bytes: int = 24 * 2**30,
    num_requests: int = 200,
    max_model_len: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> SimulationReport:
    spec = load_model(model)
    max_len = min(spec.max_model_len, max_model_len or 32_768)
    plan = plan_kv_cache(spec.layers, memory_bytes, max_len)
    manager = manager_from_plan(plan, enable_kv_events=True)
    wl = make_workload(workload, num_requests, max_len, seed)
    report = SimulationReport(
        model=spec.name,
        workload=workload,
        num_blocks=plan.num_blocks,
        groups=", ".join(f"{g.kind}(bs {g.block_size})" for g in plan.groups),
        result=ReplayResult(),
        evictions=0,
    )

    def on_step(step: int, result: ReplayResult) -> None:
        report.evictions += sum(isinstance(e, BlockRemoved) for e in manager.take_events())
        report.usage.append(manager.usage)
        report.hit_rate.append(manager.prefix_cache_stats()["hit_rate"])
        if progress is not None:
            progress(result.num_finished, num_requests)

    report.result = replay(wl, manager, on_step=on_step)
    return report


_last_drawn = [-1]


def progress_bar(done: int, total: int, width: int = 40) -> None:
    """Draws a one-line progress bar on stderr (redrawn only when the count changes)."""
    if done == _last_drawn[0]:
        return
    _last_drawn[0] = done
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def plot_report(report: SimulationReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    steps = range(len(report.usage))
    ax.plot(steps, [u * 100 for u in report.usage], label="blocks in use (%)")
    ax.plot(steps, [h * 100 for h in report.hit_rate], label="prefix-cache hit rate (%)")
    ax.set_xlabel("scheduler step")
    ax.set_ylim(0, 105)
    ax.set_title(f"{report.model} / {report.workload}: {report.num_blocks} blocks")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
