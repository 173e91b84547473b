"""`hybrid-kv simulate`: a built-in serving simulation over a catalogue model.

A synthetic workload (multi-turn chat with shared system prompts, long documents, or eviction
pressure) is driven through the conformance scheduler loop (`hybrid_kv.replay`) on a
`KVCacheManager` built from the planner's plan for the model and memory budget. It reports the
scheduler limits and the KV capacity it ran with, the prefix-cache hit rate, blocks in use,
evictions, preemptions and manager time per step.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from hybrid_kv._core import BlockRemoved, HybridKvError
from hybrid_kv.catalogue import ModelSpec, load_model
from hybrid_kv.manager import manager_from_plan
from hybrid_kv.planner import KVCachePlan, format_bytes, plan_kv_cache
from hybrid_kv.replay import ReplayResult, ReplayStalledError, replay

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "MAX_REQUESTS",
    "SCHEDULER_DEFAULTS",
    "WORKLOADS",
    "ProgressBar",
    "SimulationError",
    "SimulationReport",
    "make_workload",
    "simulate",
]

WORKLOADS = ("chat", "long-context", "eviction")
VOCAB = 150_000
DEFAULT_MAX_MODEL_LEN = 32_768
MAX_REQUESTS = 100_000
"""Most requests a simulation takes: every request's tokens are made before the replay starts
(a chat request holds a few thousand; 100,000 take a few GiB as Python lists)."""
SCHEDULER_DEFAULTS: dict[str, dict[str, int]] = {
    "chat": {"max_num_seqs": 64, "max_num_batched_tokens": 8192},
    "long-context": {"max_num_seqs": 16, "max_num_batched_tokens": 16_384},
    "eviction": {"max_num_seqs": 128, "max_num_batched_tokens": 8192},
}
"""Scheduler limits of each workload unless `max_num_seqs` / `max_num_batched_tokens` say
otherwise."""


class SimulationError(RuntimeError):
    """The replay stopped (`ReplayStalledError`: a request that can never be admitted, or a
    manager error); the message says why."""


def make_workload(
    kind: str,
    num_requests: int,
    max_model_len: int,
    seed: int = 0,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> dict[str, Any]:
    """A workload in the conformance interchange format (requests with prompts and outputs)."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r} (expected one of {', '.join(WORKLOADS)})")
    for name, value in (
        ("num_requests", num_requests),
        ("max_model_len", max_model_len),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_requests > MAX_REQUESTS:
        raise ValueError(
            f"num_requests must be at most {MAX_REQUESTS:,} (every request's tokens are made "
            f"before the replay starts), got {num_requests:,}"
        )
    if max_model_len < 2:
        raise ValueError(
            f"max_model_len must be at least 2 (a prompt token and an output token), "
            f"got {max_model_len}"
        )
    # vLLM accepts prompts shorter than max_model_len (an output token must fit).
    longest_prompt = max_model_len - 1
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
            prompt = prompt[: max(1, max_model_len // 2)]
            conversations.append(prompt + output)
            requests.append((i, prompt, output))
    elif kind == "long-context":
        docs = [tokens(min(max_model_len // 2, 24_000)) for _ in range(3)]
        for i in range(num_requests):
            prompt = docs[int(rng.integers(len(docs)))] + tokens(int(rng.integers(50, 500)))
            requests.append((i, prompt[:longest_prompt], tokens(int(rng.integers(20, 120)))))
    else:
        for i in range(num_requests):
            prompt = tokens(int(rng.integers(1000, 6000)))
            requests.append((i, prompt[:longest_prompt], tokens(int(rng.integers(50, 300)))))
    sched: dict[str, int] = dict(SCHEDULER_DEFAULTS[kind])
    if max_num_seqs is not None:
        sched["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens is not None:
        sched["max_num_batched_tokens"] = max_num_batched_tokens
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
    plan: KVCachePlan
    sched: dict[str, int]
    result: ReplayResult
    evictions: int = 0
    usage: list[float] = field(default_factory=list)
    hit_rate: list[float] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def groups(self) -> str:
        """`6 sliding_window bs 16, 1 full bs 16`: group kinds and block sizes, counted."""
        counts = Counter((g.kind, g.block_size) for g in self.plan.groups)
        return ", ".join(f"{n} {kind} bs {size}" for (kind, size), n in counts.items())

    def lines(self) -> list[str]:
        r = self.result
        pc = r.prefix_cache
        plan = self.plan
        steps = max(r.num_steps, 1)
        per_step = r.manager_seconds() / steps * 1e6
        decode = r.timings.get("allocate_slots.decode", [0])
        concurrency = plan.max_concurrency or 0.0
        return [
            f"model {self.model}: {plan.num_groups} group{'s' if plan.num_groups != 1 else ''} "
            f"({self.groups})",
            f"budget {format_bytes(plan.memory_bytes)}: {plan.num_blocks:,} blocks of "
            f"{format_bytes(plan.block_bytes)}; max_model_len {plan.max_model_len:,}; "
            f"KV cache {plan.kv_cache_tokens:,} tokens, max concurrency {concurrency:.2f}x",
            f"scheduler              max_num_seqs {self.sched['max_num_seqs']}, "
            f"max_num_batched_tokens {self.sched['max_num_batched_tokens']:,}; "
            f"{_in_flight(plan)}",
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

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        plan = self.plan
        return {
            "schema_version": 2,  # hybrid_kv.cli.JSON_SCHEMA_VERSION
            "model": self.model,
            "workload": self.workload,
            "memory_bytes": plan.memory_bytes,
            "max_model_len": plan.max_model_len,
            "scheduler": dict(self.sched),
            "in_flight": None if plan.in_flight is None else plan.in_flight.to_dict(),
            "num_blocks": plan.num_blocks,
            "block_bytes": plan.block_bytes,
            "kv_cache_tokens": plan.kv_cache_tokens,
            "max_concurrency": plan.max_concurrency,
            "groups": [
                {"kind": g.kind, "block_size": g.block_size, "num_layers": len(g.layer_names)}
                for g in plan.groups
            ],
            "num_requests_finished": r.num_finished,
            "num_steps": r.num_steps,
            "num_preemptions": r.num_preemptions,
            "evictions": self.evictions,
            "prefix_cache": r.prefix_cache,
            "peak_usage": max(self.usage, default=0.0),
            "mean_usage": float(np.mean(self.usage)) if self.usage else 0.0,
            "manager_seconds": r.manager_seconds(),
        }


def _in_flight(plan: KVCachePlan) -> str:
    """`8,192 tokens in flight (sync scheduling)`: what the plan and the manager reserve for."""
    if plan.in_flight is None:
        return f"{plan.max_in_flight_tokens:,} tokens in flight"
    scheduling = "async" if plan.in_flight.resolved_async_scheduling else "sync"
    return f"{plan.max_in_flight_tokens:,} tokens in flight ({scheduling} scheduling)"


def simulate(
    model: str | ModelSpec = "gemma-3-27b",
    workload: str = "chat",
    memory_bytes: int = 24 * 2**30,
    num_requests: int = 200,
    max_model_len: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int, int], None] | None = None,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    strategy: str = "min-waste",
    **plan_options: Any,
) -> SimulationReport:
    """Plan the model's KV cache for `memory_bytes`, build a manager from the plan, and
    replay a synthetic workload through it.

    `max_model_len` defaults to min(the model's, 32768); one given is used as given, above the
    model's too (as `plan_kv_cache` takes it). The planner reserves blocks for the
    workload's `max_num_batched_tokens` in flight (the replay runs one batch at a time, so the
    plan assumes sync scheduling unless `async_scheduling` is given among `plan_options`) and
    the manager admits with the same figure. `progress(step, finished, total)` is called after every
    step. Raises `InsufficientMemoryError` when one `max_model_len` request cannot be admitted
    and `SimulationError` when the replay stops without finishing.
    """
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    if max_model_len is None:
        max_len = min(spec.max_model_len, DEFAULT_MAX_MODEL_LEN)
    else:
        max_len = max_model_len
    wl = make_workload(
        workload,
        num_requests,
        max_len,
        seed,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    sched = {k: wl["sched"][k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    # The replay schedules synchronously: one batch in flight, not the two of vLLM's default
    # async scheduling (its report says so).
    plan_options.setdefault("async_scheduling", False)
    plan = plan_kv_cache(
        spec.layers,
        memory_bytes,
        max_len,
        strategy=strategy,
        max_num_batched_tokens=sched["max_num_batched_tokens"],
        **plan_options,
    )
    manager = manager_from_plan(
        plan, enable_kv_events=True, max_in_flight_tokens=plan.max_in_flight_tokens
    )
    report = SimulationReport(
        model=spec.name, workload=workload, plan=plan, sched=sched, result=ReplayResult()
    )

    def on_step(step: int, result: ReplayResult) -> None:
        report.evictions += sum(isinstance(e, BlockRemoved) for e in manager.take_events())
        report.usage.append(manager.usage)
        report.hit_rate.append(manager.prefix_cache_stats()["hit_rate"])
        if progress is not None:
            progress(result.num_steps, result.num_finished, num_requests)

    try:
        report.result = replay(wl, manager, on_step=on_step)
    except (ReplayStalledError, HybridKvError) as error:
        raise SimulationError(f"the replay stopped: {error}") from error
    return report


class ProgressBar:
    """Progress of a simulation on `stream` (stderr): on a terminal a bar redrawn in place
    with the steps run and requests finished; elsewhere (a pipe, a file) one plain line every
    `interval` seconds and one at the end, so logs get no carriage-return noise."""

    def __init__(
        self,
        total: int,
        stream: IO[str] | None = None,
        *,
        interval: float = 5.0,
        width: int = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval
        self.width = width
        self.clock = clock
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self.last_time = clock()
        self.last_done = -1
        self.step = 0
        self.done = 0

    def __call__(self, step: int, done: int, total: int) -> None:
        self.step, self.done, self.total = step, done, total
        now = self.clock()
        if self.terminal:
            if done != self.last_done or now - self.last_time >= 0.1:
                filled = self.width * done // max(total, 1)
                self.stream.write(
                    f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                    f"{done}/{total} requests, step {step}"
                )
                self.stream.flush()
                self.last_done, self.last_time = done, now
        elif now - self.last_time >= self.interval:
            self._line()
            self.last_time = now

    def close(self) -> None:
        """End the display: a newline after the bar, or the final line on a pipe."""
        if self.terminal:
            if self.last_done >= 0:
                self.stream.write("\n")
                self.stream.flush()
        elif self.step:
            self._line()

    def _line(self) -> None:
        self.stream.write(f"step {self.step}: {self.done}/{self.total} requests finished\n")
        self.stream.flush()


def report_figure(report: SimulationReport) -> Any:
    """The matplotlib figure of `plot_report` (blocks in use and the cumulative prefix-cache
    hit rate per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = range(len(report.usage))
    ax.plot(steps, [u * 100 for u in report.usage], label="blocks in use")
    ax.plot(
        steps,
        [h * 100 for h in report.hit_rate],
        label="prefix-cache hit rate (cumulative)",
        linewidth=2,
        clip_on=False,
        zorder=3,
    )
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("percent")
    ax.set_ylim(-2, 102)
    ax.set_xlim(0, max(len(report.usage) - 1, 1))
    plan = report.plan
    ax.set_title(
        f"{report.model} / {report.workload}: {format_bytes(plan.memory_bytes)} budget, "
        f"{plan.num_blocks:,} blocks, max_model_len {plan.max_model_len:,}",
        fontsize=10,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_report(report: SimulationReport, path: str) -> None:
    """Write `report_figure` to `path` (`hybrid_kv.plot.save_figure`: whole or not at all)."""
    from hybrid_kv.plot import save_figure

    save_figure(report_figure(report), path, dpi=110)
