"""Per-step time of vLLM 0.33's real scheduler with its own KV cache manager and with hybrid-kv's.

Both schedulers are vLLM's `Scheduler` (`hybrid_kv.vllm.Scheduler` differs only in its
`kv_cache_manager`), built offline on CPU with `hybrid_kv.vllm.testing` and driven through the same
chat workload (shared system prompts, so most admissions hit the prefix cache) with a fake model
that samples one token per running request. A step is the scheduler's `add_request` calls for the
requests arriving at it + `schedule()` + `update_from_output()`, each timed with `perf_counter_ns`
around the call alone (making the arriving requests, which vLLM's engine core does on its input
thread, and playing the model are outside the timer; `hybrid_kv.vllm.Scheduler.add_request`
makes a request's companion and checks what the core cannot hold, so it is counted, as its
manager's `refusal` is in the share).
Synchronous scheduling, vLLM's default prefix-cache retention unless `--retention dense`; the pool
is large enough that nobody is preempted.

The two sides run in alternating turns of `--turn` steps in one process; both make exactly the
same decisions (the differential tests check this), so step i of one side is step i of the other.
Only steps with the target number of running requests are kept. The first step of each turn runs
with the other side's data in the CPU caches (its scheduler and requests were the last memory
touched), and those steps are about one in `--turn`: at the default 25 they are most of each
side's slowest 1%, and cost the faster side relatively more. So the table gives the p99 speed-up
twice: over every kept step, and over the steps that do not open a turn (the same steps on both
sides). A second, instrumented pass times
every call the scheduler makes on its `kv_cache_manager`, and on the `KVCacheBlocks` it returns
(`get_block_ids`), to give the manager's share of the step. By default the timers are
hybrid-kv's `_CallTimer` (`--timers native`): a builtin function that reads the CPU's
time-stamp counter, passes the call on unchanged as a vectorcall and reads the counter again,
so that it counts a few nanoseconds beyond the call (nothing is taken off for them: the
manager's time is if anything overstated), and what it adds to the step outside its clock
reads (measured on no-ops in the same process) is taken off the step. `--timers python` gives
the earlier Python wrappers around `time.perf_counter_ns`, whose calibrated cost is taken off
both the manager's time and the step's; `allocate_slots`, made for every running request on
every step, then has a wrapper of its own that makes the scheduler's call as the scheduler makes
it (a generic `*args, **kwargs` wrapper costs more inside the scheduler than its no-op
calibration measures). The two gave the same shares within a point (one run of each).

Once both schedulers and the workload are built, the heap is frozen (`gc.freeze()`), as vLLM's
`EngineCore` freezes its startup heap before serving (`freeze_gc_heap`): the collector then scans
only what the steps allocate, not the prebuilt workload nor vLLM's and torch's modules.
`--no-freeze-gc` leaves them in the collector's scans, as earlier versions of this bench did.

Setup: as for the tests, vLLM 0.33 without its dependency tree (`.ci/vllm`):

    python3 -m venv --system-site-packages VENV
    VENV/bin/pip install --no-deps vllm==0.33.0 && VENV/bin/pip install -r .ci/vllm-requirements.txt
    VENV/bin/pip install -e .

Run (from the repository root):

    VLLM_TARGET_DEVICE=cpu VENV/bin/python benches/vllm_scheduler.py [--sizes 32 128 256] \\
        [--layouts full gemma3] [--steps 300] [--turn 25] [--retention default|dense] \\
        [--per-call] [--timers native|python] [--no-freeze-gc]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from types import MethodType
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv import _core  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402

MANAGER_CALLS = (
    "allocate_slots",
    "get_computed_blocks",
    "free",
    "get_blocks",
    "new_step_starts",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "estimate_cached_tokens",
    "take_events",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "cache_blocks",
    # hybrid-kv's, from its scheduler's add_request (the request's companion is made there).
    "refusal",
)


def options_for(layout: str, size: int, dense: bool = False) -> harness.Options:
    return harness.Options(
        layout=layout,
        dense_retention=dense,
        num_blocks=200_000,
        max_num_seqs=size,
        max_num_batched_tokens=8192,
        max_model_len=16384,
        log_stats=True,
    )


def workload_for(size: int, steps: int) -> list[harness.RequestSpec]:
    """Twice `size` requests waiting at the start, then arrivals at a quarter above the rate
    at which requests finish (`size` running, 160 output tokens on average): `size` stay
    running and every step's `add_request` calls are those of a server in its steady state."""
    backlog, rate = 2 * size, size / 128
    specs = harness.chat_workload(
        backlog + int(steps * rate) + size,
        seed=7,
        num_system_prompts=8,
        system_len=(600, 1400),
        user_len=(50, 300),
        max_tokens=(64, 256),
        arrivals_per_step=10**9,
    )
    return [
        dataclasses.replace(spec, arrival_step=0 if i < backlog else int((i - backlog) / rate))
        for i, spec in enumerate(specs)
    ]


class Side:
    def __init__(self, name: str, options: harness.Options, workload: Any, cls: Any) -> None:
        self.name = name
        self.scheduler = harness.build_scheduler(options, cls)
        self.driver = harness.Driver(self.scheduler, workload)
        self.times: list[int] = []
        # Whether each kept step was the first of its turn (the other side ran just before).
        self.turn_first: list[bool] = []
        self.size = options.max_num_seqs

    def steps(self, n: int) -> int:
        """Runs n steps (one turn); keeps the times of those with the target number running."""
        done = 0
        for _ in range(n):
            if self.driver.done:
                break
            schedule_ns, update_ns, running = self.driver.timed_step()
            if running == self.size:
                self.times.append(schedule_ns + update_ns)
                self.turn_first.append(done == 0)
            done += 1
        return done


READ_IDS = "KVCacheBlocks.get_block_ids"


def _timed(method: Callable[..., Any], totals: dict[str, int], name: str) -> Callable[..., Any]:
    totals.setdefault(name, 0)
    totals.setdefault(f"{name}#calls", 0)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return method(*args, **kwargs)
        finally:
            elapsed = time.perf_counter_ns() - t0
            totals["manager"] += elapsed
            totals["calls"] += 1
            totals[name] += elapsed
            totals[f"{name}#calls"] += 1

    return timed


class _Timed:
    """A result of another type than the manager's `KVCacheBlocks` class (hybrid-kv's native
    `_RunningBlocks`, whose method cannot be replaced on the class): the scheduler reads it
    with `get_block_ids` only, timed here."""

    __slots__ = ("get_block_ids",)

    def __init__(self, result: Any, totals: dict[str, int]) -> None:
        self.get_block_ids = _timed(result.get_block_ids, totals, READ_IDS)


_MISSING = object()


def _timed_allocate(
    allocate: Callable[..., Any], blocks: type | tuple[type, ...], totals: dict[str, int]
) -> Callable[..., Any]:
    """`allocate_slots` timed with as little as possible around the call (it is made for every
    running request on every step, where a generic `*args, **kwargs` wrapper would add more than
    a no-op measures): the scheduler's running step, `allocate_slots(request, n,
    num_lookahead_tokens=k)`, is passed on as the same call. A result of another type than
    `blocks` comes back as `_Timed` (counted in `totals["proxies"]`), made after the timer."""
    totals.setdefault("proxies", 0)
    totals.setdefault("allocate_slots", 0)
    totals.setdefault("allocate_slots#calls", 0)
    clock = time.perf_counter_ns

    def allocate_slots(
        request: Any,
        num_new_tokens: int,
        *args: Any,
        num_lookahead_tokens: Any = _MISSING,
        **kwargs: Any,
    ) -> Any:
        if args or kwargs:
            if num_lookahead_tokens is not _MISSING:
                kwargs["num_lookahead_tokens"] = num_lookahead_tokens
            t0 = clock()
            result = allocate(request, num_new_tokens, *args, **kwargs)
            t1 = clock()
        elif num_lookahead_tokens is _MISSING:
            t0 = clock()
            result = allocate(request, num_new_tokens)
            t1 = clock()
        else:
            t0 = clock()
            result = allocate(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
            t1 = clock()
        totals["manager"] += t1 - t0
        totals["allocate_slots"] += t1 - t0
        totals["allocate_slots#calls"] += 1
        if result is None or isinstance(result, blocks):
            return result
        totals["proxies"] += 1
        return _Timed(result, totals)

    return allocate_slots


def instrument(manager: Any) -> tuple[dict[str, int], Callable[[], None]]:
    """Wraps the manager's methods, and `get_block_ids` of the blocks it returns (the
    scheduler reads every running request's new blocks with it), with timers. Returns the
    accumulating totals (ns, calls) and a function undoing the class's wrapper."""
    totals = {"manager": 0, "calls": 0}
    # The result classes: the empty result's and those it inherits `get_block_ids` from.
    blocks = tuple(
        c for c in type(manager.empty_kv_cache_blocks).__mro__ if "get_block_ids" in c.__dict__
    )
    manager.allocate_slots = _timed_allocate(manager.allocate_slots, blocks, totals)
    for name in MANAGER_CALLS[1:]:
        method = getattr(manager, name, None)
        if method is not None:
            setattr(manager, name, _timed(method, totals, name))
    originals = [(c, c.__dict__["get_block_ids"]) for c in blocks]
    for c, original in originals:
        c.get_block_ids = _timed(original, totals, READ_IDS)

    def restore() -> None:
        for c, original in originals:
            c.get_block_ids = original

    return totals, restore


class NativeTimers:
    """The manager's calls timed by hybrid-kv's `_CallTimer`: each call passes through a
    builtin function that reads the CPU's time-stamp counter before and after passing the call
    on unchanged, so that what is counted beyond the call is a few nanoseconds (a Python wrapper
    around `time.perf_counter_ns` costs about 1.4 µs per call inside the scheduler's step, of
    which only an estimate from no-ops can be taken off). `read()` gives the same totals as
    `instrument`'s dict."""

    def __init__(self) -> None:
        self.timers: dict[str, list[Any]] = {}
        self.proxies = 0

    def timer(self, name: str, target: Callable[..., Any], *wrap: Any) -> Any:
        """A `_CallTimer` of `target` (`wrap`: its `wrap_types` and `wrap`), counted as `name`."""
        timer = _core._CallTimer(target, *wrap)
        self.timers.setdefault(name, []).append(timer)
        return timer

    def wrap(self, name: str, target: Callable[..., Any]) -> Callable[..., Any]:
        return self.timer(name, target).function()

    def read(self) -> dict[str, int]:
        totals = {"manager": 0, "calls": 0, "proxies": self.proxies}
        for name, timers in self.timers.items():
            ns = sum(t.ns for t in timers)
            calls = sum(t.calls for t in timers)
            totals[name], totals[f"{name}#calls"] = ns, calls
            totals["manager"] += ns
            totals["calls"] += calls
        return totals


class _NativeTimed:
    """A result of another type than the manager's `KVCacheBlocks` class (see `_Timed`): its
    `get_block_ids` goes through one shared timer of that type's method."""

    __slots__ = ("get_block_ids",)

    def __init__(self, result: Any, read_ids: Callable[..., Any]) -> None:
        self.get_block_ids = MethodType(read_ids, result)


def instrument_native(manager: Any) -> tuple[NativeTimers, Callable[[], None]]:
    """`instrument` with `NativeTimers`."""
    timers = NativeTimers()
    blocks = tuple(
        c for c in type(manager.empty_kv_cache_blocks).__mro__ if "get_block_ids" in c.__dict__
    )
    # hybrid-kv's native running-step result (`_RunningBlocks`), whose method cannot be
    # replaced on its class: its results come back in a proxy (made by the timer after its
    # clock) whose `get_block_ids` goes through one shared timer.
    native = _core._RunningBlocks
    read_ids = timers.wrap(READ_IDS, native.get_block_ids)

    def proxy(result: Any) -> _NativeTimed:
        timers.proxies += 1
        return _NativeTimed(result, read_ids)

    manager.allocate_slots = timers.timer(
        "allocate_slots", manager.allocate_slots, (native,), proxy
    ).function()
    for name in MANAGER_CALLS[1:]:
        method = getattr(manager, name, None)
        if method is not None:
            setattr(manager, name, timers.wrap(name, method))
    originals = [(c, c.__dict__["get_block_ids"]) for c in blocks]
    for c, original in originals:
        c.get_block_ids = timers.timer(READ_IDS, original).method()

    def restore() -> None:
        for c, original in originals:
            c.get_block_ids = original

    return timers, restore


class _Probe:
    """A manager whose `allocate_slots` does nothing: the timers' calibration target."""

    def allocate_slots(self, request: Any, n: int, num_lookahead_tokens: int = 0) -> None:
        return None


def _per_call(call: Callable[..., Any], samples: int) -> float:
    """ns per call of `call` with the scheduler's running-step arguments, in a loop."""
    t0 = time.perf_counter_ns()
    for _ in range(samples):
        call(None, 1, num_lookahead_tokens=0)
    return (time.perf_counter_ns() - t0) / samples


def wrapper_bias(samples: int = 200_000) -> dict[str, float]:
    """What the timers add, in ns, measured on no-ops with the scheduler's call shapes: for the
    generic wrapper (`_timed`), what it adds to the manager's total beyond the call itself
    (`counted`) and to the step (`step`); the same for `allocate_slots`' own wrapper
    (`allocate_counted`, `allocate_step`, its running-step shape); and the making of one
    `_Timed` proxy (`proxy`, outside the timers, inside the step). Each is subtracted per call."""

    class Result:
        def get_block_ids(self) -> None:
            return None

    probe = _Probe()
    plain = _per_call(probe.allocate_slots, samples)
    bias = {}
    totals = {"manager": 0, "calls": 0}
    step = _per_call(_timed(probe.allocate_slots, totals, "probe"), samples)
    bias["counted"] = totals["manager"] / samples - plain
    bias["step"] = step - plain
    totals = {"manager": 0, "calls": 0}
    step = _per_call(_timed_allocate(probe.allocate_slots, Result, totals), samples)
    bias["allocate_counted"] = totals["manager"] / samples - plain
    bias["allocate_step"] = step - plain
    result = Result()
    t0 = time.perf_counter_ns()
    for _ in range(samples):
        _Timed(result, totals)
    bias["proxy"] = (time.perf_counter_ns() - t0) / samples
    return bias


def native_bias(samples: int = 200_000) -> dict[str, float]:
    """`wrapper_bias` for `NativeTimers`: what a timer adds to the step, measured on no-ops with
    the scheduler's call shapes (`step` and `allocate_step`: a timed function in the manager's
    `__dict__`; `ids_step`: a timed method read from an instance, which binds it; `proxy`: a
    proxy made after the clock, by the Python function the timer calls). What a timer counts
    beyond the call, its clock reads (a few nanoseconds), is not taken off: `counted` and
    `allocate_counted` are 0, so the manager's time is if anything overstated."""

    class Result:
        def get_block_ids(self, allow_none: bool = False) -> None:
            return None

    def per_read(result: Any) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(samples):
            result.get_block_ids(allow_none=True)
        return (time.perf_counter_ns() - t0) / samples

    probe = _Probe()
    plain = _per_call(probe.allocate_slots, samples)
    timed = _per_call(_core._CallTimer(probe.allocate_slots).function(), samples)
    bias = {"counted": 0.0, "allocate_counted": 0.0}
    bias["step"] = bias["allocate_step"] = timed - plain
    result = Result()
    plain = per_read(result)
    Result.get_block_ids = _core._CallTimer(Result.__dict__["get_block_ids"]).method()
    bias["ids_step"] = per_read(result) - plain
    # The proxy as `instrument_native` makes it: the timer calls a Python function.
    read_ids = _core._CallTimer(Result.__dict__["get_block_ids"]).function()
    made = [0]

    def proxy(result: Any) -> _NativeTimed:
        made[0] += 1
        return _NativeTimed(result, read_ids)

    plain = _per_call(probe.allocate_slots, samples)
    wrapped = _per_call(
        _core._CallTimer(lambda *a, **k: result, (Result,), proxy).function(), samples
    )
    bias["proxy"] = max(0.0, wrapped - plain - bias["allocate_step"])
    return bias


def freeze_heap(enabled: bool) -> None:
    """What `EngineCore` does once built (vLLM's `freeze_gc_heap`): collect, then freeze."""
    gc.collect()
    if enabled:
        gc.freeze()


def manager_share(
    options: harness.Options,
    workload: Any,
    cls: Any,
    steps: int,
    freeze: bool,
    native: bool = True,
) -> tuple[float, dict[str, tuple[float, float, float]]]:
    """The manager's share of the step, and per call: (share, ns per call, calls per step);
    timed by `NativeTimers`, or with `native=False` by Python wrappers (`instrument`).

    The cycle collector's automatic collections are off meanwhile, and its youngest generation
    is collected after each step, outside the timers: a collection is triggered by the objects
    that survive the step (mostly the arriving requests, vLLM's `Request`s with their token
    lists, the same on both sides) and lands in whichever call allocates past the threshold,
    which would count a pause of hundreds of microseconds to that call. Its cost is in the steps
    the first pass times."""
    side = Side("share", options, workload, cls)
    if native:
        timers, restore = instrument_native(side.scheduler.kv_cache_manager)
        read = timers.read
    else:
        totals, restore = instrument(side.scheduler.kv_cache_manager)

        def read() -> dict[str, int]:
            return dict(totals)

    freeze_heap(freeze)
    gc.disable()
    step_total = 0
    kept: dict[str, int] = {}
    num_steps = 0
    try:
        for _ in range(steps):
            if side.driver.done:
                break
            gc.collect(0)
            before = read()
            schedule_ns, update_ns, running = side.driver.timed_step()
            if running == side.size:
                num_steps += 1
                step_total += schedule_ns + update_ns
                for key, value in read().items():
                    kept[key] = kept.get(key, 0) + value - before.get(key, 0)
    finally:
        restore()
        gc.enable()
        gc.unfreeze()
    bias = native_bias() if native else wrapper_bias()
    allocations = kept.get("allocate_slots#calls", 0)
    # Reads of the results' block ids by a timed method (native timers: they bind apart).
    reads = kept.get(f"{READ_IDS}#calls", 0) if native else 0
    # The other calls through a generic timer (`instrument`'s "calls" leave allocate_slots out;
    # `NativeTimers` count every call).
    generic = kept.get("calls", 0) - (allocations + reads if native else 0)
    step = (
        step_total
        - generic * bias["step"]
        - reads * bias.get("ids_step", 0.0)
        - allocations * bias["allocate_step"]
        - kept.get("proxies", 0) * bias["proxy"]
    )
    if num_steps == 0 or step <= 0:
        return float("nan"), {}
    per_call = {}
    for key, calls in kept.items():
        if key.endswith("#calls") and calls:
            name = key.removesuffix("#calls")
            counted = bias["allocate_counted" if name == "allocate_slots" else "counted"]
            ns = kept[name] - calls * counted
            per_call[name] = (ns / step, ns / calls, calls / num_steps)
    manager = kept["manager"] - generic * bias["counted"] - allocations * bias["allocate_counted"]
    return manager / step, per_call


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def measure(
    layout: str, size: int, steps: int, turn: int, dense: bool, freeze: bool, native: bool = True
) -> dict[str, Any]:
    options = options_for(layout, size, dense)
    workload = workload_for(size, steps)
    stock = Side("vLLM", options, workload, None)
    ours = Side("hybrid-kv", options, workload, hkv.Scheduler)
    assert ours.scheduler.uses_hybrid_kv
    freeze_heap(freeze)
    total = 0
    while total < steps and not (stock.driver.done or ours.driver.done):
        for side in (stock, ours) if (total // turn) % 2 == 0 else (ours, stock):
            side.steps(turn)
        total += turn
    n = min(len(stock.times), len(ours.times))
    if n == 0:
        raise RuntimeError(f"{layout} @ {size}: no step ran with {size} requests running")
    stock_times, our_times = stock.times[:n], ours.times[:n]
    # Both sides make the same decisions in turns of the same steps, so the same kept steps
    # open a turn on each side.
    first = stock.turn_first[:n]
    assert first == ours.turn_first[:n], "the two sides' turns differ"
    stock_warm = [t for t, f in zip(stock_times, first, strict=True) if not f]
    our_warm = [t for t, f in zip(our_times, first, strict=True) if not f]
    del stock, ours
    gc.unfreeze()
    row = {
        "layout": layout,
        "size": size,
        "steps": n,
        "stock_p50": percentile(stock_times, 0.5),
        "stock_p99": percentile(stock_times, 0.99),
        "ours_p50": percentile(our_times, 0.5),
        "ours_p99": percentile(our_times, 0.99),
        "stock_p99_warm": percentile(stock_warm, 0.99),
        "ours_p99_warm": percentile(our_warm, 0.99),
        "stock_mean": statistics.fmean(stock_times) / 1e3,
        "ours_mean": statistics.fmean(our_times) / 1e3,
    }
    row["stock_share"], row["stock_calls"] = manager_share(
        options, workload, None, steps, freeze, native
    )
    row["ours_share"], row["ours_calls"] = manager_share(
        options, workload, hkv.Scheduler, steps, freeze, native
    )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--layouts", nargs="+", default=["full", "gemma3"])
    parser.add_argument("--steps", type=int, default=300, help="steps per side and size")
    parser.add_argument("--turn", type=int, default=25, help="steps per turn")
    parser.add_argument(
        "--retention",
        choices=["default", "dense"],
        default="default",
        help="prefix_cache_retention_interval: vLLM's default 0 (sparse) or None (dense)",
    )
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="also print each manager call's calls per step, time per call and share",
    )
    parser.add_argument(
        "--timers",
        choices=["native", "python"],
        default="native",
        help="how the instrumented pass times the manager's calls: hybrid-kv's native call "
        "timer (default) or Python wrappers around time.perf_counter_ns (earlier versions)",
    )
    parser.add_argument(
        "--no-freeze-gc",
        action="store_true",
        help="leave the startup heap (workload, modules) in the collector's scans",
    )
    args = parser.parse_args(argv)
    rows = [
        measure(
            layout,
            size,
            args.steps,
            args.turn,
            args.retention == "dense",
            not args.no_freeze_gc,
            args.timers == "native",
        )
        for layout in args.layouts
        for size in args.sizes
    ]
    print(
        "| layout | running | steps | vLLM p50 / p99 (µs) | hybrid-kv p50 / p99 (µs) "
        "| speed-up p50 / p99 | p99 speed-up, turns' first steps left out "
        "| manager share vLLM → hybrid-kv |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['size']} | {r['steps']} "
            f"| {r['stock_p50']:,.0f} / {r['stock_p99']:,.0f} "
            f"| {r['ours_p50']:,.0f} / {r['ours_p99']:,.0f} "
            f"| {r['stock_p50'] / r['ours_p50']:.2f}× / {r['stock_p99'] / r['ours_p99']:.2f}× "
            f"| {r['stock_p99_warm'] / r['ours_p99_warm']:.2f}× "
            f"| {r['stock_share']:.1%} → {r['ours_share']:.1%} |"
        )
    if args.per_call:
        print(
            "\n| layout | running | call | vLLM calls/step, ns/call, share "
            "| hybrid-kv calls/step, ns/call, share |"
        )
        print("|---|---:|---|---:|---:|")
        for r in rows:
            stock, ours = r["stock_calls"], r["ours_calls"]
            for name in sorted(set(stock) | set(ours), key=lambda n: -stock.get(n, (0,))[0]):

                def cell(calls: dict, name: str = name) -> str:
                    if name not in calls:
                        return "-"
                    share, ns, per_step = calls[name]
                    return f"{per_step:,.1f}, {ns:,.0f}, {share:.1%}"

                print(f"| {r['layout']} | {r['size']} | {name} | {cell(stock)} | {cell(ours)} |")
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    print(f"\nCommand: VLLM_TARGET_DEVICE=cpu {command}")


if __name__ == "__main__":
    main()
