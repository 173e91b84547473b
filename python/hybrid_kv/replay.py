"""Replay a conformance workload through hybrid-kv's Python API and write a `kvtrace/1` trace.

    python -m hybrid_kv.replay WORKLOAD.json[.gz] --groups-from VLLM_TRACE.jsonl[.gz] \\
        --out ours.jsonl

The scheduler loop is the one of `shared/conformance/README.md` (vLLM 0.33's scheduler reduced to
what the KV cache manager sees); every manager call is timed with `perf_counter_ns`, like vLLM's
own traces, and written with its arguments and results so `trace_diff.py --ids` can compare the
two call by call.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from hybrid_kv._core import KVCacheManager, Request
from hybrid_kv.inputs import read_lines, read_text
from hybrid_kv.manager import manager_from_header

__all__ = [
    "Engine",
    "HybridKvEngine",
    "ReplayResult",
    "ReplayStalledError",
    "ReplayStuckError",
    "MANAGER_OPS",
    "TIMED_OPS",
    "check_workload",
    "load_json",
    "add_arguments",
    "main",
    "manager_from_header",
    "replay",
]

IMPL = "hybrid-kv-0.1.0"

# The ops whose times make a replay's manager total (the ones vLLM's trace summaries time).
MANAGER_OPS = ("allocate_slots", "free", "get_computed_blocks", "make_request", "append_token")
# Every op a replay times, `allocate_slots` also split by kind of call.
TIMED_OPS = (
    "make_request",
    "get_computed_blocks",
    "allocate_slots",
    "allocate_slots.admit",
    "allocate_slots.chunk",
    "allocate_slots.decode",
    "free",
    "append_token",
    "new_step_starts",
)


def load_json(path: str | Path) -> Any:
    """The JSON document of `path` (`.gz`: gzip-compressed), of at most `MAX_INPUT_CHARS`
    characters."""
    return json.loads(read_text(path))


def read_header(trace_path: str | Path) -> dict[str, Any]:
    """The `header` line of a kvtrace/1 file."""
    for line in read_lines(trace_path):
        record = json.loads(line)
        if isinstance(record, dict) and record.get("kind") == "header":
            return record
    raise ValueError(f"{trace_path}: no header line")


def _encode_blocks(block_ids: Sequence[np.ndarray]) -> list[list[Any]]:
    """kvtrace block-list encoding: per group `[leading nulls, remaining ids]`."""
    out = []
    for ids in block_ids:
        nonzero = np.flatnonzero(ids)
        z = int(nonzero[0]) if len(nonzero) else len(ids)
        out.append([z, ids[z:].tolist()])
    return out


class Engine(Protocol):
    """What the replay loop needs from a KV cache manager implementation, so that hybrid-kv and
    vLLM's own manager (`benches/vllm_baseline.py`) run the same loop, timed the same way.

    The loop calls `manager.allocate_slots`, `manager.get_computed_blocks`, `manager.free`,
    `manager.new_step_starts` and the requests' `append_output_token_ids` directly, each timed
    alone; everything else here runs outside the timed calls.
    """

    manager: Any

    def request_maker(self, r: dict[str, Any]) -> Callable[[], Any]:
        """Prepares workload request `r`; the returned call (timed as make_request) builds it."""
        ...

    def hit(self, request: Any, result: Any) -> tuple[Any, int, int]:
        """`get_computed_blocks`' result as (blocks, hit tokens, shared-prefix boundary)."""
        ...

    def block_ids(self, blocks: Any) -> Sequence[np.ndarray]: ...

    def num_free_blocks(self) -> int: ...

    def num_cached_blocks(self) -> int: ...

    def admitted(self, request: Any, hit: int, preempted: bool) -> None:
        """After a successful admission: prefix-cache stats (and request status)."""
        ...

    def preempted(self, request: Any) -> None: ...

    def finished(self, request: Any) -> None: ...

    def prefix_cache_stats(self) -> dict[str, Any]: ...

    def num_blocks_to_admit(self, request: Any, blocks: Any) -> int:
        """Free blocks the admission check needs for `request`'s whole sequence with hit
        `blocks` (only asked to explain a replay that cannot make progress)."""
        ...

    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        ...

    def mamba_block_size(self) -> int:
        """The block size prefill chunks are aligned to for Mamba states (0: no Mamba)."""
        ...

    def mamba_checkpoint_alignment(self) -> int:
        """The alignment of the Mamba groups' prefill checkpoint exports (0: some Mamba group
        exports none)."""
        ...

    def end_step(self) -> None:
        """After a step (untimed): drain what vLLM's scheduler hands its workers every step."""
        ...


def checkpoint_exportable(
    start: int, end: int, position: int, block_size: int, alignment: int
) -> bool:
    """vLLM's `is_mamba_prefill_checkpoint_valid` at hash block size = block size: whether the
    worker can export the state after `position` tokens from inside the chunk `[start, end)`."""
    return (
        alignment > 0
        and start % block_size == 0
        and -(-end // block_size) - 2 > (start - 1) // block_size
        and start + block_size <= position < end
        and (position - start) % alignment == 0
    )


def mamba_block_aligned_split(
    block_size: int,
    sched: dict[str, Any],
    req: _Req,
    start: int,
    n: int,
    junction: int,
    checkpoint_alignment: int = 0,
) -> int:
    """vLLM's `_mamba_block_aligned_split` (align mode, hash block = block size, no EAGLE):
    clips a prefill chunk of `n` tokens from `start` so it ends where a Mamba state must be
    cached (a block boundary, the prompt's last cacheable position, a shared-prefix junction).
    A final chunk the worker can export the prompt's checkpoint from (`checkpoint_alignment`
    > 0) is not clipped but at a junction."""
    num_tokens = req.num_tokens
    prefill_end = max(req.num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return n
    end = start + n
    exports = end >= prefill_end and checkpoint_exportable(
        start,
        end,
        max((prefill_end - 1) // block_size * block_size, 0),
        block_size,
        checkpoint_alignment,
    )
    last_cache_position = 0 if exports else max((num_tokens - 1) // block_size * block_size, 0)
    if end < prefill_end:
        max_prefill = sched["max_num_batched_tokens"]
        threshold = sched.get("long_prefill_token_threshold") or 0
        if 0 < threshold < max_prefill:
            max_prefill = threshold
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= max_prefill:
            end = aligned_end
    stops = [last_cache_position]
    if start % block_size and not exports:
        stops.append((start // block_size + 1) * block_size)
    if start < junction < end:
        stops.append(start + (junction - start) // block_size * block_size)
    inside = [s for s in stops if start < s < end]
    if inside:
        end = min(inside)
    return max(end - start, 0)


class ReplayStalledError(RuntimeError):
    """The scheduler loop can make no more progress: nothing is running, and the request at the
    head of the queue cannot be admitted into this pool (so it is refused on every later step).
    """

    def __init__(
        self, step: int, request_id: str, blocks_needed: int, free_blocks: int, num_blocks: int
    ) -> None:
        self.step = step
        self.request_id = request_id
        self.blocks_needed = blocks_needed
        self.free_blocks = free_blocks
        self.num_blocks = num_blocks
        super().__init__(
            f"no progress at step {step}: request {request_id!r} needs {blocks_needed} free "
            f"blocks to be admitted, but the pool has {num_blocks} blocks ({free_blocks} free) "
            "and nothing is running that could free more"
        )


class ReplayStuckError(ReplayStalledError):
    """The scheduler loop can make no more progress with requests running: a step scheduled no
    token and preempted nobody, so every later step would do the same."""

    def __init__(self, step: int, request_id: str, num_running: int) -> None:
        RuntimeError.__init__(
            self,
            f"no progress at step {step}: {num_running} requests running (first {request_id!r}) "
            "but none could be scheduled a token",
        )
        self.step = step
        self.request_id = request_id
        self.blocks_needed = 0
        self.free_blocks = 0
        self.num_blocks = 0


def _count(value: Any, what: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be an integer of at least {least}, got {value!r}")
    if value >= 1 << 63:
        raise ValueError(f"{what} must be below 2^63, got {value}")


def _check_tokens(rid: Any, what: str, tokens: Any) -> None:
    """A list of token ids the manager takes (ints in [0, 2^32)), or a `ValueError`."""
    if not isinstance(tokens, list):
        raise ValueError(
            f"request {rid!r}: {what} must be a list of token ids, got {type(tokens).__name__}"
        )
    if all(type(t) is int for t in tokens) and (
        not tokens or (min(tokens) >= 0 and max(tokens) < 1 << 32)
    ):
        return
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32:
            raise ValueError(
                f"request {rid!r}: {what} token {i} is {t!r}; token ids are integers in [0, 2^32)"
            )


def check_workload(workload: dict[str, Any]) -> None:
    """Raises `ValueError` naming the first field or request the loop or vLLM would not accept:
    `sched` with integer `max_model_len` (at least 2), `max_num_seqs` and
    `max_num_batched_tokens` (at least 1) and an optional `long_prefill_token_threshold` (at
    least 0); each request an object with a unique id (a string or an integer; an integer is
    the request id of its decimal string, so `1` and `"1"` are the same id), a prompt of 1 to
    `max_model_len - 1` token ids (vLLM's input processor refuses an empty prompt, and a prompt
    of `max_model_len` tokens or more leaves no room for an output token), at least one output
    token id (token ids are integers in [0, 2^32)) and a non-negative integer arrival step."""
    if not isinstance(workload, dict):
        raise ValueError(f"not a workload: a {type(workload).__name__}, not an object")
    try:
        sched = workload["sched"]
        requests = workload["requests"]
    except KeyError as error:
        raise ValueError(f"not a workload: missing {error}") from None
    if not isinstance(sched, dict):
        raise ValueError(f"not a workload: 'sched' is a {type(sched).__name__}, not an object")
    if "max_model_len" not in sched:
        raise ValueError("not a workload: missing sched 'max_model_len'")
    max_model_len = sched["max_model_len"]
    if not isinstance(requests, list):
        raise ValueError(f"not a workload: 'requests' is a {type(requests).__name__}, not a list")
    _count(max_model_len, "max_model_len", 2)
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if key not in sched:
            raise ValueError(f"not a workload: missing sched {key!r}")
        _count(sched[key], key, 1)
    if sched.get("long_prefill_token_threshold") is not None:
        _count(sched["long_prefill_token_threshold"], "long_prefill_token_threshold", 0)
    seen: set[Any] = set()
    for index, r in enumerate(requests):
        try:
            rid, prompt, output, arrival = r["rid"], r["prompt"], r["output"], r["arrival_step"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"request {index}: missing {error}") from None
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise ValueError(f"request {index}: id {rid!r} is not a string or an integer")
        if str(rid) in seen:
            raise ValueError(f"request {index}: id {rid!r} is used twice")
        seen.add(str(rid))
        _check_tokens(rid, "prompt", prompt)
        _check_tokens(rid, "output", output)
        if not 1 <= len(prompt) < max_model_len:
            raise ValueError(
                f"request {rid!r}: a prompt of {len(prompt)} tokens; vLLM accepts prompts of 1 "
                f"to max_model_len - 1 = {max_model_len - 1} tokens"
            )
        if len(output) < 1:
            raise ValueError(f"request {rid!r}: no output token (vLLM samples at least one)")
        if isinstance(arrival, bool) or not isinstance(arrival, int) or arrival < 0:
            raise ValueError(f"request {rid!r}: arrival_step must be a non-negative integer")


class HybridKvEngine:
    """hybrid-kv's `KVCacheManager` as a replay [`Engine`]."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.hash_block_size = manager.hash_block_size

    def request_maker(self, r: dict[str, Any]) -> Callable[[], Any]:
        # Request ids are strings (an integer id is its decimal string, as `check_workload` says).
        rid, prompt, bs = str(r["rid"]), r["prompt"], self.hash_block_size

        # As vLLM's make_request, this times `Request(...)` alone; the manager registers the
        # request (taking over its prompt hashes) in its first call, get_computed_blocks.
        return lambda: Request(rid, prompt, block_size=bs)

    def hit(self, request: Request, result: Any) -> tuple[Any, int, int]:
        blocks, hit = result
        return blocks, hit, blocks.shared_prefix_boundary

    def block_ids(self, blocks: Any) -> Sequence[np.ndarray]:
        return blocks.get_block_ids()

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def num_cached_blocks(self) -> int:
        return self.manager.num_cached_blocks

    def admitted(self, request: Request, hit: int, preempted: bool) -> None:
        self.manager.record_prefix_cache_stats(request, hit, preempted)

    def preempted(self, request: Request) -> None:
        pass

    def finished(self, request: Request) -> None:
        pass

    def prefix_cache_stats(self) -> dict[str, Any]:
        return self.manager.prefix_cache_stats()

    def num_blocks_to_admit(self, request: Request, blocks: Any) -> int:
        return self.manager.num_blocks_to_admit(request, blocks)

    def num_blocks(self) -> int:
        return self.manager.num_blocks

    def mamba_block_size(self) -> int:
        align = any(g.get("mamba_cache_mode") == "align" for g in self.manager.groups)
        return self.manager.scheduler_block_size if align else 0

    def mamba_checkpoint_alignment(self) -> int:
        mamba = [g for g in self.manager.groups if g["kind"] == "mamba"]
        alignments = [g.get("prefill_checkpoint_alignment", 0) for g in mamba]
        return alignments[0] if alignments and all(alignments) else 0

    def end_step(self) -> None:
        self.manager.take_new_block_ids()
        self.manager.take_boundary_state_offloads()


@dataclass
class _Req:
    rid: str
    arrival_step: int
    num_prompt_tokens: int
    output: list[int]
    request: Any
    num_preemptions: int = 0
    # vLLM's scheduler keeps the junction of the last get_computed_blocks on the request.
    shared_prefix_boundary: int = 0

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens


@dataclass
class ReplayResult:
    """What a replay did: per-op timings (ns) and counters."""

    timings: dict[str, list[int]] = field(default_factory=dict)
    num_steps: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    wall_s: float = 0.0
    prefix_cache: dict[str, Any] = field(default_factory=dict)

    def record(self, op: str, ns: int) -> None:
        self.timings.setdefault(op, []).append(ns)

    def manager_seconds(self) -> float:
        """Total time in manager calls (the ops vLLM's summary also times)."""
        return sum(sum(self.timings.get(op, [])) for op in MANAGER_OPS) / 1e9

    def summary(self) -> dict[str, Any]:
        timing = {}
        for op, values in sorted(self.timings.items()):
            ordered = sorted(values)
            timing[op] = {
                "count": len(values),
                "total_s": sum(values) / 1e9,
                "median_ns": int(statistics.median(ordered)),
                "p90_ns": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                "mean_ns": int(sum(values) / len(values)),
            }
        return {
            "kind": "summary",
            "timing": timing,
            "prefix_cache": self.prefix_cache,
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "num_finished": self.num_finished,
            "wall_s": self.wall_s,
        }


def replay(
    workload: dict[str, Any],
    manager: KVCacheManager | Engine,
    out: IO[str] | None = None,
    header: dict[str, Any] | None = None,
    max_steps: int | None = None,
    on_step: Callable[[int, ReplayResult], None] | None = None,
    fresh_prompts: bool = True,
) -> ReplayResult:
    """Runs the conformance scheduler loop over `manager` (a hybrid-kv manager or any
    [`Engine`]); writes kvtrace/1 lines to `out`. Trace records are only built when `out` is
    given, so a timing run does no work between calls besides the loop's own.

    With `fresh_prompts`, each list prompt is copied (untimed) just before its request is made,
    so `make_request` reads it from the CPU caches, as an engine does with a prompt its
    tokenizer or input thread has just produced. Otherwise it reads the lists as the workload
    was loaded, which by then have mostly left the caches: that measures memory reads of the
    cold int objects more than request creation."""
    check_workload(workload)
    engine = HybridKvEngine(manager) if isinstance(manager, KVCacheManager) else manager
    mgr = engine.manager
    sched = workload["sched"]
    max_model_len = sched["max_model_len"]
    max_num_seqs = sched["max_num_seqs"]
    max_batched = sched["max_num_batched_tokens"]
    threshold = sched.get("long_prefill_token_threshold") or 0
    perf = time.perf_counter_ns
    result = ResultWriter(out)
    stats = result.stats
    tracing = out is not None
    if header is not None:
        result.write(header)

    pending: deque[_Req] = deque()
    for r in workload["requests"]:
        if fresh_prompts and isinstance(r["prompt"], list):
            r = {**r, "prompt": list(r["prompt"])}
        make = engine.request_maker(r)
        t0 = perf()
        request = make()
        ns = perf() - t0
        stats.record("make_request", ns)
        pending.append(_Req(r["rid"], r["arrival_step"], len(r["prompt"]), r["output"], request))
        if tracing:
            result.write(
                {
                    "kind": "req",
                    "rid": r["rid"],
                    "arrival_step": r["arrival_step"],
                    "num_prompt_tokens": len(r["prompt"]),
                    "max_tokens": len(r["output"]),
                    "prompt_digest": _prompt_digest(r["prompt"]),
                }
            )
    # Every request was made up front: collect now, so that young-generation collections
    # walking the setup's objects (the prompt lists above all) do not land in timed calls.
    gc.collect()

    def cap(req: _Req, computed: int, budget: int) -> int:
        n = req.num_tokens - computed
        if threshold:
            n = min(n, threshold)
        return max(0, min(n, budget, max_model_len - 1 - computed))

    mamba_block = engine.mamba_block_size()
    checkpoint_alignment = engine.mamba_checkpoint_alignment()

    def call(op: str, rid: str, step: int, ns: int, **fields: Any) -> None:
        result.seq += 1
        record = {"kind": "call", "step": step, "op": op, "rid": rid, **fields, "ns": ns}
        record["free"] = engine.num_free_blocks()
        record["cached"] = engine.num_cached_blocks()
        record["seq"] = result.seq
        result.write(record)

    def allocated(
        req: _Req, step: int, ns: int, n: int, hit: int, computed: int, admit: bool, new: Any
    ) -> None:
        stats.record("allocate_slots", ns)
        kind = "admit" if admit else ("decode" if n == 1 else "chunk")
        stats.record(f"allocate_slots.{kind}", ns)
        if tracing:
            call(
                "allocate_slots",
                req.rid,
                step,
                ns,
                num_new_tokens=n,
                num_new_computed_tokens=hit,
                num_computed_tokens=computed,
                admit=admit,
                ok=new is not None,
                new_blocks=None if new is None else _encode_blocks(engine.block_ids(new)),
            )

    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    step = 0
    wall0 = time.perf_counter()
    while pending or waiting or running:
        if max_steps is not None and stats.num_steps >= max_steps:
            break
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.popleft())
        if not running and not waiting:
            step = pending[0].arrival_step
            continue
        if tracing:
            result.write(
                {"kind": "step", "step": step, "running": len(running), "waiting": len(waiting)}
            )
        t0 = perf()
        mgr.new_step_starts()
        ns = perf() - t0
        stats.record("new_step_starts", ns)
        stats.num_steps += 1
        budget = max_batched
        preempted = False
        scheduled: list[tuple[_Req, int]] = []

        # A) running requests, in order
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.request.num_computed_tokens
            n = cap(req, computed, budget)
            if mamba_block:
                n = mamba_block_aligned_split(
                    mamba_block,
                    sched,
                    req,
                    computed,
                    n,
                    req.shared_prefix_boundary,
                    checkpoint_alignment,
                )
            if n == 0:
                i += 1
                continue
            request = req.request
            while True:
                t0 = perf()
                new = mgr.allocate_slots(request, n)
                ns = perf() - t0
                allocated(req, step, ns, n, 0, computed, False, new)
                if new is not None:
                    scheduled.append((req, n))
                    budget -= n
                    i += 1
                    break
                victim = running.pop()
                victim_request = victim.request
                t0 = perf()
                mgr.free(victim_request)
                ns = perf() - t0
                stats.record("free", ns)
                if tracing:
                    call("free", victim.rid, step, ns, reason="preempted")
                engine.preempted(victim.request)
                victim.request.num_computed_tokens = 0
                victim.num_preemptions += 1
                stats.num_preemptions += 1
                waiting.appendleft(victim)
                preempted = True
                if victim is req:
                    break
            if preempted and (not running or req not in running):
                break

        # B) waiting requests
        if not preempted:
            while waiting and budget > 0 and len(running) < max_num_seqs:
                req = waiting[0]
                request = req.request
                t0 = perf()
                found = mgr.get_computed_blocks(request)
                ns = perf() - t0
                stats.record("get_computed_blocks", ns)
                blocks, hit, spb = engine.hit(req.request, found)
                req.shared_prefix_boundary = spb
                if tracing:
                    call(
                        "get_computed_blocks",
                        req.rid,
                        step,
                        ns,
                        num_tokens=req.num_tokens,
                        hit_tokens=hit,
                        hit_blocks=_encode_blocks(engine.block_ids(blocks)),
                        spb=spb,
                    )
                n = cap(req, hit, budget)
                if mamba_block:
                    n = mamba_block_aligned_split(
                        mamba_block,
                        sched,
                        req,
                        req.request.num_computed_tokens + hit,
                        n,
                        spb,
                        checkpoint_alignment,
                    )
                if n == 0:
                    break
                t0 = perf()
                new = mgr.allocate_slots(
                    request,
                    n,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    full_sequence_must_fit=True,
                    has_scheduled_reqs=bool(running),
                )
                ns = perf() - t0
                allocated(req, step, ns, n, hit, req.request.num_computed_tokens, True, new)
                if new is None:
                    break
                engine.admitted(req.request, hit, req.num_preemptions > 0)
                waiting.popleft()
                running.append(req)
                req.request.num_computed_tokens = hit
                scheduled.append((req, n))
                budget -= n

        if not scheduled and not preempted and not running:
            # Nothing runs, so nothing will free blocks: the head is refused forever.
            head = waiting[0]
            blocks, _, _ = engine.hit(head.request, mgr.get_computed_blocks(head.request))
            raise ReplayStalledError(
                step,
                head.rid,
                engine.num_blocks_to_admit(head.request, blocks),
                engine.num_free_blocks(),
                engine.num_blocks(),
            )

        if not scheduled and not preempted:
            # Requests run but none got a token: every later step would be this one.
            raise ReplayStuckError(step, running[0].rid, len(running))

        # C) execute, D) sample and finish
        for req, n in scheduled:
            req.request.num_computed_tokens += n
        for req, _ in scheduled:
            if req.request.num_computed_tokens != req.num_tokens:
                continue
            produced = req.num_tokens - req.num_prompt_tokens
            request, token = req.request, req.output[produced]
            t0 = perf()
            request.append_output_token_ids(token)
            ns = perf() - t0
            stats.record("append_token", ns)
            if produced + 1 == len(req.output) or req.num_tokens >= max_model_len:
                engine.finished(request)
                t0 = perf()
                mgr.free(request)
                ns = perf() - t0
                stats.record("free", ns)
                if tracing:
                    call("free", req.rid, step, ns, reason="finished")
                running.remove(req)
                stats.num_finished += 1
        engine.end_step()
        if on_step is not None:
            on_step(step, stats)
        step += 1
    stats.wall_s = time.perf_counter() - wall0
    stats.prefix_cache = engine.prefix_cache_stats()
    result.write(stats.summary())
    return stats


class ResultWriter:
    def __init__(self, out: IO[str] | None) -> None:
        self.out = out
        self.stats = ReplayResult()
        self.seq = 0

    def write(self, record: dict[str, Any]) -> None:
        if self.out is not None:
            self.out.write(json.dumps(record, separators=(",", ":")) + "\n")


def _prompt_digest(prompt: Sequence[int] | np.ndarray) -> str:
    """As vLLM's traces compute it (json.dumps' default separators); prompts may be arrays."""
    tokens = prompt.tolist() if isinstance(prompt, np.ndarray) else prompt
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _digest(workload: dict[str, Any]) -> str:
    blob = json.dumps(workload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay command's arguments (`python -m hybrid_kv.replay` and `hybrid-kv replay`)."""
    parser.add_argument("workload", help="workload JSON (.json or .json.gz)")
    parser.add_argument("--groups-from", required=True, help="vLLM kvtrace/1 file (its header)")
    parser.add_argument("--out", required=True, help="trace to write (kvtrace/1, .jsonl)")
    parser.add_argument(
        "--max-steps", type=_positive_int, default=None, help="stop after N steps (N >= 1)"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _load(path: str, what: str, read: Callable[[str], Any]) -> Any:
    """`read(path)`, its failures (missing, unreadable, not gzip, not JSON, not a regular
    file) a `ValueError` naming the file. A device or a pipe is refused before it is opened:
    it would be read to its end (/dev/zero never ends) or block (a FIFO nobody writes)."""
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):
        raise ValueError(f"{what} {path} is not a regular file")
    try:
        return read(path)
    except (OSError, EOFError, ValueError, zlib.error) as error:
        message = str(error)
        raise ValueError(message if path in message else f"{what} {path}: {message}") from None
    except RecursionError:
        raise ValueError(f"{what} {path}: not valid JSON (nested too deeply)") from None


def main(argv: list[str] | None = None) -> int:
    from hybrid_kv.cli import CommandParser, run_command

    parser = CommandParser(prog="python -m hybrid_kv.replay", description=__doc__.splitlines()[0])
    add_arguments(parser)

    return run_command(lambda: run(parser.parse_args(argv)))


def run(args: argparse.Namespace, prog: str = "replay") -> int:
    """Replays `args.workload` with the groups of `args.groups_from`, writing `args.out`; errors
    are one line on stderr starting with `prog`.

    The trace is written to `OUT.partial` and renamed to `OUT` when the replay completes, so
    `OUT` is never a trace cut short: a replay that stalls leaves its trace so far in
    `OUT.partial` (the message says so), any other failure leaves nothing. An `OUT` that exists
    and is not a regular file (a device such as /dev/stdout, a FIFO) is written directly."""

    def error(message: object, code: int) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return code

    try:
        workload = _load(args.workload, "workload", load_json)
        check_workload(workload)
        vllm_header = _load(args.groups_from, "trace", read_header)
        sched = workload["sched"]
        try:
            manager = manager_from_header(
                vllm_header, sched["max_model_len"], sched["max_num_batched_tokens"]
            )
        except (ValueError, TypeError) as failure:
            # TypeError: a header field of the wrong type, as the manager's constructor says.
            raise ValueError(
                f"cannot build a manager from the header of {args.groups_from} and the "
                f"workload's max_model_len {sched['max_model_len']}: {failure}"
            ) from None
        except MemoryError as failure:
            # The core refuses a pool this machine cannot hold before taking any of it.
            blocks = vllm_header["kv_cache"]["num_blocks"]
            return error(
                f"cannot build a manager from the header of {args.groups_from}: "
                f"{str(failure) or 'out of memory'} (the header's pool has {blocks:,} blocks)",
                1,
            )
    except ValueError as failure:
        return error(failure, 2)
    header = {
        "kind": "header",
        "format": "kvtrace/1",
        "impl": IMPL,
        "layout": vllm_header.get("layout"),
        "workload": {
            "name": workload.get("name"),
            "seed": workload.get("seed"),
            "digest": _digest(workload),
            "sched": workload["sched"],
            "num_requests": len(workload["requests"]),
        },
        "kv_cache": vllm_header["kv_cache"],
    }
    target = Path(args.out)
    direct = target.exists() and not target.is_file()
    partial = target if direct else target.with_name(target.name + ".partial")
    try:
        out = open(partial, "w")  # noqa: SIM115 (closed below; an open error is reported)
    except OSError as failure:
        return error(f"cannot write {args.out}: {failure}", 2)
    keep = False
    try:
        with out:
            result = replay(workload, manager, out, header, args.max_steps)
        if not direct:
            os.replace(partial, target)
    except ReplayStalledError as failure:
        keep = not direct
        where = f" (the trace so far is in {partial})" if keep else ""
        return error(f"{failure}{where}", 1)
    except OSError as failure:
        return error(f"cannot write {args.out}: {failure}", 2)
    finally:
        if not direct and not keep:
            partial.unlink(missing_ok=True)
    print(
        f"{result.num_steps} steps, {result.num_finished} finished, "
        f"{result.num_preemptions} preemptions; manager time {result.manager_seconds():.4f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
