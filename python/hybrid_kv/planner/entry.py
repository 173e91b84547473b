"""`plan_kv_cache`: the planner's entry point. Validates the arguments, picks a grouping
(vLLM's, or the least expected waste that never admits fewer `max_model_len` requests than
vLLM's), sizes the pool as vLLM does (its per-request reservation, the null block), and lays
every layer out in the chosen physical layout."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hybrid_kv.planner.errors import InsufficientMemoryError, PlanError
from hybrid_kv.planner.inflight import DEFAULT_MODEL_RUNNER, InFlight
from hybrid_kv.planner.layout import (
    DEFAULT_LAYOUT,
    LayerShape,
    check_layout,
    is_block_compact,
    is_block_outermost,
    is_layer_compact,
    place_groups,
)
from hybrid_kv.planner.lengths import LengthDistribution
from hybrid_kv.planner.memory import format_bytes, format_bytes_at_least, format_count
from hybrid_kv.planner.plan import (
    STRATEGIES,
    CandidateSummary,
    ExpectedWaste,
    KVCacheBuffer,
    KVCacheGroup,
    KVCachePlan,
    LayerPlacement,
    admission_blocks,
    measure_waste,
)
from hybrid_kv.planner.search import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    Bucket,
    Candidate,
    Scorer,
    attention_token_bytes,
    buckets_of,
    max_state_bytes,
    search,
    vllm_candidate,
    vllm_group_size,
)
from hybrid_kv.planner.stages import PipelineStage, StageSplit
from hybrid_kv.specs import (
    ATTENTION_SPEC_TYPES,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    validate_layers,
)

__all__ = ["DEFAULT_MAX_IN_FLIGHT_TOKENS", "plan_kv_cache"]

DEFAULT_MAX_IN_FLIGHT_TOKENS = 2048
"""vLLM's `SchedulerConfig.max_num_batched_tokens` default: the tokens of one batch in flight
(vLLM's default async scheduling keeps two batches in flight, `InFlight` counts them)."""

_SCHEDULER_DEFAULTS = {
    "max_num_batched_tokens": None,
    "async_scheduling": None,
    "pipeline_parallel_size": 1,
    "model_runner": DEFAULT_MODEL_RUNNER,
}

EXTRA_ATTENTION_GROUPS = 4
"""min-waste may use this many attention groups more than vLLM (each costs a block table
and a prefix scan per request); Mamba groups (one or two blocks per request) are not capped."""


def _check_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan_kv_cache(
    layers: Mapping[str, LayerSpec],
    memory_bytes: int | Sequence[int],
    max_model_len: int,
    *,
    block_size: int = 16,
    alignment: int = 16,
    strategy: str = "min-waste",
    reference_len: int | None = None,
    lengths: LengthDistribution | None = None,
    max_groups: int | None = None,
    max_in_flight_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    kv_cache_layout: str = DEFAULT_LAYOUT,
    prefix_match_unit: int | None = None,
    max_num_batched_tokens: int | None = None,
    async_scheduling: bool | None = None,
    pipeline_parallel_size: int = 1,
    model_runner: str = DEFAULT_MODEL_RUNNER,
    num_hidden_layers: int | None = None,
    pp_layer_partition: Sequence[int] | None = None,
) -> KVCachePlan:
    """Plan the KV cache of a model: `{layer_name: spec}` in model order.

    Args:
        memory_bytes: bytes for the whole pool (the null block included); with pipeline
            stages, for each stage's GPU (as vLLM's budget is per GPU): one int for every
            stage, or one per stage (each GPU's budget after its own weights).
        max_model_len: longest request; vLLM's reservation for one such request must fit.
        block_size: base attention block size (a multiple of `alignment`).
        alignment: kernel block-size alignment; grown block sizes stay multiples of it.
        strategy: `"min-waste"` (default) or `"vllm"` (vLLM 0.33's grouping).
        reference_len: measure waste with every request this long (instead of `lengths`).
        lengths: request lengths to minimise the expected waste over (default: log-uniform
            up to `max_model_len`, see `LengthDistribution.default`).
        max_groups: cap on the number of groups for `min-waste` (default: at most 4 attention
            groups more than vLLM, Mamba groups uncapped).
        max_in_flight_tokens: tokens scheduled but not yet processed, given as a count
            (instead of the scheduler options below, which vLLM counts them from);
            sliding-window and chunked groups reserve blocks for them.
        enable_prefix_caching: off puts Mamba layers in vLLM's `none` mode (one state block
            per request, block size `max_model_len`, hashing at the scheduler block size).
        kv_cache_layout: one of `KV_CACHE_LAYOUTS` (vLLM's physical layouts).
        prefix_match_unit: hash granularity in tokens (vLLM's option; default the gcd of the
            group block sizes); every block size must be a multiple of it.
        max_num_batched_tokens: tokens per scheduler step (vLLM's option; default 2048).
        async_scheduling: None (default) as vLLM resolves it: on (one more batch in flight),
            but off for the V1 model runner with pipeline parallelism (the plan's `warnings`
            carry vLLM's warning); True is vLLM's `--async-scheduling`, False its
            `--no-async-scheduling` (give False for what else vLLM turns it off for: pooling
            models, executors without support, ROCm DeepEP high-throughput DBO, some
            speculative methods on the V1 runner).
        pipeline_parallel_size: vLLM's `--pipeline-parallel-size`: one batch in flight per
            stage, and the layers split over the stages' GPUs as vLLM splits them. The groups
            are the whole model's; each stage's pool holds its own layers' pages, and
            `num_blocks` is the smallest stage's (`plan.stages` gives each stage's figures).
        model_runner: `"v2"` (default, vLLM 0.33's where Triton runs) or `"v1"`
            (`VLLM_USE_V2_MODEL_RUNNER=0`): with async scheduling and pipeline parallelism,
            V2 keeps `pipeline_parallel_size + 1` batches in flight; V1 refuses an explicit
            `async_scheduling=True` and resolves the default to off.
            `InFlight` counts them as vLLM's `max_in_flight_tokens`; the plan's `in_flight`
            says what was assumed.
        num_hidden_layers: the model's decoder layers, which the stages split (default: one
            more than the highest layer index in the names; give it when the last layers have
            no KV cache).
        pp_layer_partition: decoder layers per stage, as vLLM's `VLLM_PP_LAYER_PARTITION`
            gives them (one count per stage, summing to `num_hidden_layers`).

    Raises:
        SpecError: invalid layers (names the layer).
        PlanError: invalid arguments, or a layout that cannot hold the plan.
        InsufficientMemoryError: vLLM's reservation for one `max_model_len` request does not
            fit; the message names the `max_model_len` that would.
    """
    validate_layers(layers)
    budgets = _budgets(memory_bytes)
    max_model_len = _check_int("max_model_len", max_model_len)
    block_size = _check_int("block_size", block_size)
    if block_size > MAX_BLOCK_SIZE:
        raise PlanError(
            f"block_size must be at most {MAX_BLOCK_SIZE:,} tokens (the manager's largest "
            f"block), got {block_size:,}"
        )
    alignment = _check_int("alignment", alignment)
    in_flight = _in_flight(
        max_in_flight_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pipeline_parallel_size,
        model_runner=model_runner,
    )
    max_in_flight_tokens = (
        in_flight.tokens
        if in_flight is not None
        else _check_int("max_in_flight_tokens", max_in_flight_tokens)
    )
    if num_hidden_layers is not None:
        num_hidden_layers = _check_int("num_hidden_layers", num_hidden_layers)
    # A count of tokens in flight comes without scheduler options: one stage.
    stages = in_flight.pipeline_parallel_size if in_flight is not None else 1
    split = StageSplit.of(
        layers,
        stages,
        num_hidden_layers,
        None if pp_layer_partition is None else _partition(pp_layer_partition),
    )
    stage_memory = _stage_memory(budgets, stages, split)
    if block_size % alignment:
        raise PlanError(
            f"block_size {block_size} must be a multiple of the kernel alignment {alignment}"
        )
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    layout = check_layout(kv_cache_layout)
    if max_groups is not None:
        max_groups = _check_int("max_groups", max_groups)
    if prefix_match_unit is not None:
        prefix_match_unit = _check_int("prefix_match_unit", prefix_match_unit)
    if not isinstance(enable_prefix_caching, bool):
        raise PlanError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
    if reference_len is not None and lengths is not None:
        raise PlanError("give reference_len or lengths, not both")
    if reference_len is not None:
        distribution = LengthDistribution.point(_check_int("reference_len", reference_len))
    elif lengths is not None:
        if not isinstance(lengths, LengthDistribution):
            raise PlanError(f"lengths must be a LengthDistribution, got {lengths!r}")
        distribution = lengths
    else:
        distribution = LengthDistribution.default(max_model_len)
    distribution = distribution.clipped(max_model_len)
    mamba_mode = "align" if enable_prefix_caching else "none"

    settings = _Settings(
        strategy,
        min(stage_memory),
        max_model_len,
        block_size,
        max_in_flight_tokens,
        mamba_mode,
        layout,
        prefix_match_unit,
        enable_prefix_caching,
        in_flight,
        split,
        stage_memory,
    )
    buckets = buckets_of(layers)
    if not buckets:
        return _attention_free_plan(settings, distribution)
    scorer = Scorer(buckets, distribution, max_model_len, max_in_flight_tokens, mamba_mode)
    vllm = _staged(settings, vllm_candidate(layers, buckets, block_size, alignment, scorer))
    vllm_problem = _vllm_layout_problem(buckets, vllm, layout)
    reasons: list[str] = []
    alternatives: list[CandidateSummary] = []

    if strategy == "vllm":
        if vllm_problem:
            raise PlanError(vllm_problem)
        chosen = vllm
        if len(vllm.groups) == 1:
            reasons.append("vLLM grouping: one group (every layer needs the same token slots)")
        else:
            counts = [len(b.layers) for b in buckets]
            reasons.append(
                f"vLLM grouping: group size {vllm_group_size(buckets)} "
                f"(layer counts per spec {counts}; the largest count is used when it is below "
                "1.5x the smallest, else the smallest), layers assigned strided"
            )
        if not _fits_budget(settings, vllm):
            raise _insufficient(settings, buckets, vllm)
    else:
        chosen = _choose(
            settings,
            buckets,
            alignment,
            scorer,
            vllm,
            vllm_problem,
            max_groups,
            reasons,
            alternatives,
        )

    if chosen.sizing.base_block_size != block_size and not chosen.sizing.uniform_type:
        reasons.append(
            f"attention block size grown from {block_size} to {chosen.sizing.base_block_size} "
            f"for Mamba states of {max_state_bytes(buckets)} B "
            f"(attention: {attention_token_bytes(buckets)} B/token)"
        )
    reasons.extend(chosen.sizing.notes)
    largest = max(chosen.sizing.block_sizes)
    if largest > MAX_BLOCK_SIZE:
        raise PlanError(
            f"the plan needs blocks of {largest:,} tokens (grown for Mamba states of "
            f"{max_state_bytes(buckets):,} B, attention {attention_token_bytes(buckets)} B/token), "
            f"but the manager takes at most {MAX_BLOCK_SIZE:,}: use a wider KV dtype or smaller "
            "Mamba states"
        )
    return _build_plan(settings, layers, buckets, chosen, distribution, reasons, alternatives)


def _in_flight(
    max_in_flight_tokens: int | None,
    *,
    max_num_batched_tokens: int | None,
    async_scheduling: bool | None,
    pipeline_parallel_size: int,
    model_runner: str,
) -> InFlight | None:
    """The scheduler options the tokens in flight are counted from, or None when they are
    given as a count (`max_in_flight_tokens`), which the options must then not contradict."""
    if max_in_flight_tokens is not None:
        options = {
            "max_num_batched_tokens": max_num_batched_tokens,
            "async_scheduling": async_scheduling,
            "pipeline_parallel_size": pipeline_parallel_size,
            "model_runner": model_runner,
        }
        # By type too: `pipeline_parallel_size=True` is not the default 1.
        given = sorted(
            name
            for name, value in options.items()
            if (type(value), value) != (type(_SCHEDULER_DEFAULTS[name]), _SCHEDULER_DEFAULTS[name])
        )
        if given:
            raise PlanError(
                f"give max_in_flight_tokens or the scheduler options it is counted from "
                f"({', '.join(given)}), not both"
            )
        return None
    return InFlight(
        DEFAULT_MAX_IN_FLIGHT_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pipeline_parallel_size,
        model_runner=model_runner,
    )


@dataclass(frozen=True)
class _Settings:
    """The validated arguments every step of planning reads."""

    strategy: str
    memory_bytes: int
    max_model_len: int
    block_size: int
    max_in_flight_tokens: int
    mamba_mode: str
    layout: str
    prefix_match_unit: int | None
    prefix_caching: bool
    in_flight: InFlight | None
    split: StageSplit
    stage_memory: tuple[int, ...]
    """Each stage GPU's budget (`memory_bytes` is the smallest)."""


def _budgets(memory_bytes: object) -> int | tuple[int, ...]:
    """`memory_bytes` as given: one budget for every stage, or one per stage."""
    if isinstance(memory_bytes, Sequence) and not isinstance(memory_bytes, (str, bytes)):
        if not memory_bytes:
            raise PlanError("memory_bytes must give one budget per pipeline stage, got none")
        return tuple(
            _check_int(f"memory_bytes[{i}]", value) for i, value in enumerate(memory_bytes)
        )
    return _check_int("memory_bytes", memory_bytes)


def _stage_memory(
    budgets: int | tuple[int, ...], pipeline_parallel_size: int, split: StageSplit
) -> tuple[int, ...]:
    """Each of the split's stages' budget."""
    if isinstance(budgets, int):
        return (budgets,) * split.size
    if len(budgets) != pipeline_parallel_size:
        noun = "budget" if len(budgets) == 1 else "budgets"
        raise PlanError(
            f"memory_bytes gives {len(budgets)} {noun}, one per stage, but the pipeline "
            f"parallel size is {pipeline_parallel_size}"
        )
    if split.size == 1:
        # An attention-free model: one null block, whatever each GPU holds.
        return (min(budgets),)
    return budgets


def _num_blocks(settings: _Settings, candidate: Candidate) -> int:
    """Blocks every stage allocates: the smallest of each stage GPU's budget over its own
    bytes per block (at most `MAX_BLOCKS`), as vLLM takes it."""
    memory = settings.stage_memory
    if len(set(memory)) == 1:
        # `_staged` made `block_bytes` the widest stage's, whose budget makes the fewest.
        return candidate.num_blocks(memory[0])
    return min(
        replace(candidate, block_bytes=block_bytes).num_blocks(budget)
        for block_bytes, budget in zip(
            _stage_block_bytes(settings.split, candidate), memory, strict=True
        )
    )


def _fits_budget(settings: _Settings, candidate: Candidate) -> bool:
    """vLLM's admission check on every stage's GPU: its pool minus the null block holds one
    request."""
    return candidate.admission + 1 <= _num_blocks(settings, candidate)


def _partition(partition: object) -> tuple[int, ...]:
    if isinstance(partition, (str, bytes)) or not isinstance(partition, Sequence):
        raise PlanError(f"pp_layer_partition must be a sequence of ints, got {partition!r}")
    return tuple(partition)


def _stage_block_bytes(split: StageSplit, candidate: Candidate) -> tuple[int, ...]:
    """Each stage's bytes per block under this grouping: vLLM keeps every group on every
    stage with only the stage's layers, and a block holds the widest group's pages."""
    pages = candidate.sizing.page_bytes
    result = []
    for names in split.names:
        held = set(names)
        widths = (
            sum(pages[b] for b, name in members if name in held) for members in candidate.groups
        )
        result.append(max(widths, default=0))
    return tuple(result)


def _staged(settings: _Settings, candidate: Candidate) -> Candidate:
    """The candidate as its largest stage sizes it (`block_bytes` per GPU: the budget makes
    the smallest stage's `num_blocks`); unchanged on one stage."""
    if settings.split.size == 1:
        return candidate
    return replace(candidate, block_bytes=max(_stage_block_bytes(settings.split, candidate)))


def _search_staged(
    settings: _Settings,
    buckets: Sequence[Bucket],
    alignment: int,
    scorer: Scorer,
    allow_spans: bool,
    max_attention_groups: int | None,
    max_groups: int | None,
) -> list[Candidate]:
    """The search's candidates, each as its largest stage sizes it (`_staged`)."""
    found = search(
        buckets,
        settings.block_size,
        alignment,
        scorer,
        allow_spans=allow_spans,
        max_attention_groups=max_attention_groups,
        max_groups=max_groups,
    )
    return [_staged(settings, c) for c in found]


# --------------------------------------------------------------------------- choosing


def _layout_problem(buckets: Sequence[Bucket], candidate: Candidate, layout: str) -> str | None:
    """Why `layout` cannot hold this grouping (vLLM's layout validation), or None."""
    sizing = candidate.sizing
    if sizing.mixed_pages:
        if not is_block_compact(layout) or (candidate.num_groups > 1 and is_layer_compact(layout)):
            return (
                f"layout {layout} cannot hold pages of different sizes in one pool "
                "(use BLNHC or BLHNC)"
            )
    used = {b for members in candidate.groups for b, _ in members}
    shapes = set()
    for index in used:
        bucket = buckets[index]
        padded = sizing.page_bytes[index] != sizing.used_bytes[index]
        heads = 1 if sizing.mamba[index] else getattr(bucket.spec, "num_kv_heads", 1)
        if padded and heads > 1 and layout in ("LHBNC", "BHLNC"):
            return f"layout {layout} cannot pad attention pages (heads sit outside the page)"
        # With heads outside the blocks a layer's view is tiled by its head count and page
        # size alone: layers that agree on both (whatever their block sizes and head sizes,
        # e.g. 16 tokens of head size 256 and 32 of 128) cover the same bytes per block.
        shapes.add((heads, sizing.page_bytes[index]))
    if layout == "LHBNC" and len(shapes) > 1 and any(s[0] > 1 for s in shapes):
        return (
            "layout LHBNC puts heads outside the blocks, so layers with other head counts or "
            "page sizes would overlap each other's blocks (use LBNHC, LBHNC or a "
            "block-outermost layout)"
        )
    return None


def _caching_problem(
    settings: _Settings, buckets: Sequence[Bucket], candidate: Candidate
) -> str | None:
    """Why this grouping cannot serve prefix caching, or None: a chunked-local group's hits are
    found block by block from the current chunk, so its block must be the scheduler block
    (vLLM 0.33's `ChunkedLocalAttentionManager` asserts `block_size == alignment` at its first
    lookup; hybrid-kv's manager refuses such a configuration when it is built)."""
    if not settings.prefix_caching:
        return None
    used = sorted({b for members in candidate.groups for b, _ in members})
    sizes = [candidate.sizing.block_sizes[b] for b in used]
    scheduler = math.lcm(*sizes) if sizes else 0
    chunked = sorted(
        {s for b, s in zip(used, sizes, strict=True) if buckets[b].kind == "chunked_local"}
        - {scheduler}
    )
    if not chunked:
        return None
    return (
        f"chunked local attention with blocks of {chunked[0]} tokens and prefix caching needs "
        f"them to be the scheduler block ({scheduler} tokens, the lcm of the groups' block "
        "sizes): vLLM 0.33 asserts it at its first prefix-cache lookup (turn prefix caching "
        "off, or give the layers equal pages)"
    )


def _vllm_layout_problem(buckets: Sequence[Bucket], vllm: Candidate, layout: str) -> str | None:
    """Why vLLM's plan cannot be reproduced in `layout`, or None."""
    if not vllm.sizing.uniform_type and is_block_outermost(layout):
        attention_pages = {
            b.spec.bytes_per_token for b in buckets if isinstance(b.spec, ATTENTION_SPEC_TYPES)
        }
        if len(attention_pages) > 1:
            return (
                f"in block-outermost layouts ({layout}) vLLM packs layers with different page "
                "sizes side by side, which hybrid-kv does not reproduce; use a layer-compact "
                "layout (LBNHC) for --strategy vllm"
            )
    problem = _layout_problem(buckets, vllm, layout)
    return f"vLLM's plan: {problem}" if problem else None


def _choose(
    settings: _Settings,
    buckets: Sequence[Bucket],
    alignment: int,
    scorer: Scorer,
    vllm: Candidate,
    vllm_problem: str | None,
    max_groups: int | None,
    reasons: list[str],
    alternatives: list[CandidateSummary],
) -> Candidate:
    layout = settings.layout
    allow_spans = is_block_outermost(layout) and is_block_compact(layout)
    baseline = vllm if vllm_problem is None and _fits_budget(settings, vllm) else None
    if vllm.sizing.uniform_type:
        candidates = [vllm]
    else:
        cap = None if max_groups is not None else vllm.num_attention_groups + EXTRA_ATTENTION_GROUPS
        candidates = _search_staged(
            settings, buckets, alignment, scorer, allow_spans, cap, max_groups
        )
        if max_groups is None or vllm.num_groups <= max_groups:
            candidates.append(vllm)
    if not candidates:
        raise PlanError(f"no grouping fits within max_groups={max_groups}")
    expressible = [c for c in candidates if _layout_problem(buckets, c, layout) is None]
    if not expressible:
        problem = _layout_problem(buckets, min(candidates, key=Candidate.sort_key), layout)
        raise PlanError(f"no grouping of this model fits: {problem}")
    # Groupings that can serve prefix caching, when there are any (else the plan warns).
    expressible = [
        c for c in expressible if _caching_problem(settings, buckets, c) is None
    ] or expressible
    fitting = [c for c in expressible if _fits_budget(settings, c)]
    if not fitting:
        smallest = min(expressible, key=lambda c: (c.admission + 1) * c.block_bytes)
        error = _insufficient(settings, buckets, smallest)
        if max_groups is not None and vllm_problem is None and _fits_budget(settings, vllm):
            # The cap left out vLLM's grouping, whose smaller blocks fit: say so.
            error = InsufficientMemoryError(
                f"{error} (with at most {max_groups} groups; vLLM's grouping of "
                f"{vllm.num_groups} groups fits this budget: raise or drop max_groups)",
                reserved_bytes=error.reserved_bytes,
                needed_bytes=error.needed_bytes,
                fitting_max_model_len=error.fitting_max_model_len,
            )
        raise error

    def keeps_capacity(c: Candidate) -> bool:
        if baseline is None:
            return True
        mine, theirs = _num_blocks(settings, c), _num_blocks(settings, baseline)
        return mine * baseline.admission >= theirs * c.admission

    allowed = [c for c in fitting if keeps_capacity(c)]
    chosen = min(allowed, key=Candidate.sort_key)
    dropped = len(fitting) - len(allowed)
    cap_text = (
        f"at most {max_groups} groups"
        if max_groups is not None
        else f"at most {vllm.num_attention_groups + EXTRA_ATTENTION_GROUPS} attention groups"
    )
    reasons.append(
        f"min-waste: tried {format_count(len(candidates), 'grouping')} ({cap_text}); chose "
        f"{format_count(chosen.num_groups, 'group')}, {format_bytes(chosen.block_bytes)} blocks, "
        f"{float(chosen.waste_fraction * 100):.2f}% expected waste over "
        f"{scorer.lengths.source}"
        + (
            f" (vLLM's grouping: {format_count(vllm.num_groups, 'group')}, "
            f"{float(vllm.waste_fraction * 100):.2f}%)"
            if vllm_problem is None
            else ""
        )
    )
    if dropped:
        reasons.append(
            f"{dropped} groupings with less waste would admit fewer {settings.max_model_len}-token "
            "requests than vLLM's plan, and were not considered"
        )
    if vllm_problem is None:
        alternatives.append(_summary("vllm", vllm))
    if max_state_bytes(buckets) and attention_token_bytes(buckets):
        _mamba_options(
            settings,
            buckets,
            alignment,
            scorer,
            allowed,
            allow_spans,
            baseline,
            vllm.num_attention_groups + EXTRA_ATTENTION_GROUPS if max_groups is None else None,
            max_groups,
            reasons,
            alternatives,
        )
    return chosen


def _mamba_options(
    settings: _Settings,
    buckets: Sequence[Bucket],
    alignment: int,
    scorer: Scorer,
    allowed: list[Candidate],
    allow_spans: bool,
    baseline: Candidate | None,
    attention_cap: int | None,
    max_groups: int | None,
    reasons: list[str],
    alternatives: list[CandidateSummary],
) -> None:
    """Report the best plan of each Mamba option; option B (a state over several pages)
    needs a block-outermost layout, so in the others it is only described."""
    option_a = [c for c in allowed if c.label in ("A", "vllm")]
    if option_a:
        best = min(option_a, key=Candidate.sort_key)
        alternatives.append(_summary("mamba-option-A", best))
        reasons.append(
            f"Mamba option A (one attention page holds a state): attention block "
            f"{best.attention_block_size}, {best.num_groups} groups, "
            f"{float(best.waste_fraction * 100):.2f}% expected waste"
        )
    option_b = [c for c in allowed if c.label == "B"]
    note = ""
    if not allow_spans:
        wider = _search_staged(
            settings, buckets, alignment, scorer, True, attention_cap, max_groups
        )
        option_b = [
            c
            for c in wider
            if c.label == "B"
            and _fits_budget(settings, c)
            and (
                baseline is None
                or _num_blocks(settings, c) * baseline.admission
                >= _num_blocks(settings, baseline) * c.admission
            )
        ]
        note = "needs --kv-cache-layout BLNHC or BLHNC"
    if option_b:
        best = min(option_b, key=Candidate.sort_key)
        alternatives.append(_summary("mamba-option-B", best, note))
        reasons.append(
            f"Mamba option B (a state over several attention pages): attention block "
            f"{best.attention_block_size}, {best.num_groups} groups, "
            f"{float(best.waste_fraction * 100):.2f}% expected waste"
            + (f" ({note})" if note else "")
        )


def _summary(label: str, candidate: Candidate, note: str = "") -> CandidateSummary:
    return CandidateSummary(
        label,
        candidate.num_groups,
        candidate.block_bytes,
        candidate.attention_block_size,
        candidate.waste_fraction,
        candidate.admission,
        note,
    )


# --------------------------------------------------------------------------- admission


def _fits(
    candidate: Candidate, buckets: Sequence[Bucket], settings: _Settings, length: int
) -> bool:
    """vLLM's check at `max_model_len = length`: reservation + null block within budget."""
    reserved = 0
    for members in candidate.groups:
        first = members[0][0]
        bucket = buckets[first]
        reserved += admission_blocks(
            bucket.kind,
            candidate.sizing.block_sizes[first],
            length,
            settings.max_in_flight_tokens,
            sliding_window=bucket.window,
            attention_chunk_size=bucket.chunk,
            mamba_cache_mode=settings.mamba_mode,
            prefill_checkpoint_blocks=getattr(bucket.spec, "prefill_checkpoint_blocks", 0),
        )
    return candidate.block_bytes * (reserved + 1) <= settings.memory_bytes


def fitting_max_model_len(
    candidate: Candidate, buckets: Sequence[Bucket], settings: _Settings
) -> int:
    """The longest `max_model_len` whose reservation fits, found as vLLM finds it (binary
    search over 1..max_model_len); 0 when not even one token fits."""
    low, high = 1, settings.max_model_len
    if not _fits(candidate, buckets, settings, low):
        return 0
    best = 1
    while low <= high:
        middle = (low + high) // 2
        if _fits(candidate, buckets, settings, middle):
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def _insufficient(
    settings: _Settings, buckets: Sequence[Bucket], candidate: Candidate
) -> InsufficientMemoryError:
    where = ""
    if settings.split.size > 1:
        # vLLM checks the stages in order and refuses at the first whose GPU cannot hold the
        # reservation, with that stage's estimate of a fitting max_model_len.
        for stage, block_bytes in enumerate(_stage_block_bytes(settings.split, candidate)):
            staged = replace(candidate, block_bytes=block_bytes)
            budget = settings.stage_memory[stage]
            if not staged.fits(budget):
                candidate, where = staged, f" on pipeline stage {stage}'s GPU"
                settings = replace(settings, memory_bytes=budget)
                break
    needed = (candidate.admission + 1) * candidate.block_bytes
    fitting = fitting_max_model_len(candidate, buckets, settings)
    request = (
        f"one request of max_model_len={settings.max_model_len} tokens needs "
        f"{candidate.admission} blocks{where}"
    )
    if candidate.admission + 1 > MAX_BLOCKS:
        message = (
            f"{request} plus the null block, more than a pool can hold ({MAX_BLOCKS:,} blocks: "
            "block ids are 32-bit); lower max_model_len"
        )
    else:
        if fitting:
            hint = f"a max_model_len of {fitting} fits in this budget"
        elif settings.memory_bytes <= candidate.block_bytes:
            # vLLM refuses this budget before any reservation: "No available memory for the
            # cache blocks".
            hint = "the budget does not hold even the null block"
        else:
            hint = "not even a 1-token request fits"
        message = (
            f"{request} of {format_bytes(candidate.block_bytes)} (vLLM's reservation with "
            f"{settings.max_in_flight_tokens} tokens in flight) plus the null block = {needed} "
            f"bytes ({format_bytes(needed)}), but the budget is {settings.memory_bytes} bytes "
            f"({format_bytes(settings.memory_bytes)}); {hint}, or raise the memory to "
            f"{format_bytes_at_least(needed)}"
        )
    return InsufficientMemoryError(
        message,
        reserved_bytes=candidate.admission * candidate.block_bytes,
        needed_bytes=needed,
        fitting_max_model_len=fitting,
    )


# --------------------------------------------------------------------------- building


def _layer_shape(spec: LayerSpec, block_size: int, page_bytes: int) -> LayerShape:
    if isinstance(spec, MambaSpec):
        return LayerShape(1, 1, spec.state_bytes, page_bytes)
    if isinstance(spec, MLAAttentionSpec):
        return LayerShape(1, block_size, spec.bytes_per_token, page_bytes)
    heads = spec.num_kv_heads  # type: ignore[union-attr]
    return LayerShape(heads, block_size, spec.bytes_per_token // heads, page_bytes)


def _block_sizes(settings: _Settings, groups: Sequence[KVCacheGroup]) -> tuple[int, int]:
    """vLLM's `resolve_kv_cache_block_sizes`: (scheduler block size, hash block size)."""
    sizes = [g.block_size for g in groups]
    unit = settings.prefix_match_unit
    if len(sizes) <= 1:
        size = sizes[0] if sizes else settings.block_size
        if unit is not None and unit != size:
            raise PlanError(
                f"prefix_match_unit {unit} must equal the block size {size} with one group"
            )
        return size, size
    scheduler = math.lcm(*sizes)
    mamba_none = any(g.kind == "mamba" for g in groups) and settings.mamba_mode != "align"
    if not settings.prefix_caching or mamba_none:
        return scheduler, scheduler
    hashing = unit if unit is not None else math.gcd(*sizes)
    bad = sorted({s for s in sizes if s % hashing})
    if bad:
        raise PlanError(
            f"prefix_match_unit {hashing} must divide every group block size (not {bad})"
        )
    return scheduler, hashing


def _attention_free_plan(settings: _Settings, distribution: LengthDistribution) -> KVCachePlan:
    scheduler, hashing = _block_sizes(settings, [])
    return KVCachePlan(
        strategy=settings.strategy,
        groups=(),
        buffers=(),
        placements=(),
        num_blocks=1,
        block_bytes=0,
        kv_cache_layout=settings.layout,
        memory_bytes=settings.memory_bytes,
        max_model_len=settings.max_model_len,
        max_in_flight_tokens=settings.max_in_flight_tokens,
        in_flight=settings.in_flight,
        mamba_cache_mode=settings.mamba_mode,  # type: ignore[arg-type]
        blocks_per_request=0,
        scheduler_block_size=scheduler,
        hash_block_size=hashing,
        waste=ExpectedWaste(
            distribution,
            tuple(measure_waste((), (), 0, n) for n in distribution.lengths),
        ),
        reasons=("attention-free model: no KV cache, one (null) block, as in vLLM",),
    )


def _build_plan(
    settings: _Settings,
    layers: Mapping[str, LayerSpec],
    buckets: Sequence[Bucket],
    chosen: Candidate,
    distribution: LengthDistribution,
    reasons: list[str],
    alternatives: list[CandidateSummary],
) -> KVCachePlan:
    sizing = chosen.sizing
    split = settings.split
    # The whole model's bytes per block (one page of every layer in the widest group), and
    # each stage GPU's: with one stage, the same.
    block_bytes = max(sum(sizing.page_bytes[b] for b, _ in members) for members in chosen.groups)
    stage_bytes = _stage_block_bytes(split, chosen)
    budget_blocks = [m // b for m, b in zip(settings.stage_memory, stage_bytes, strict=True)]
    num_blocks = min(budget_blocks)
    if num_blocks > MAX_BLOCKS:
        reasons.append(
            f"pool capped at {MAX_BLOCKS:,} blocks: block ids are 32-bit (vLLM's block tables "
            f"are int32, as are hybrid-kv's); {format_bytes(settings.memory_bytes)} would make "
            f"{num_blocks:,} blocks of {format_bytes(max(stage_bytes))}"
        )
        num_blocks = MAX_BLOCKS

    groups: list[KVCacheGroup] = []
    shaped: list[list[tuple[str, object, LayerShape]]] = []
    for group_id, members in enumerate(chosen.groups):
        first = buckets[members[0][0]]
        bucket_block = sizing.block_sizes[members[0][0]]
        if first.kind == "mamba" and settings.mamba_mode != "align":
            bucket_block = settings.max_model_len
        padding = block_bytes - sum(sizing.page_bytes[b] for b, _ in members)
        slots = padding // sizing.slice_bytes if padding % sizing.slice_bytes == 0 else 0
        groups.append(
            KVCacheGroup(
                group_id=group_id,
                kind=first.kind,
                block_size=bucket_block,
                layer_names=tuple(name for _, name in members),
                sliding_window=first.window,
                attention_chunk_size=first.chunk,
                num_padding_slots=slots if not sizing.uniform_type else 0,
                padding_bytes=padding,
                prefill_checkpoint_blocks=getattr(first.spec, "prefill_checkpoint_blocks", 0),
            )
        )
        shaped.append(
            [
                (
                    name,
                    buckets[b].spec,
                    _layer_shape(buckets[b].spec, sizing.block_sizes[b], sizing.page_bytes[b]),
                )
                for b, name in members
            ]
        )
    used = {name: sizing.used_bytes[b] for members in chosen.groups for b, name in members}
    placements: dict[str, LayerPlacement] = {}
    buffers: list[KVCacheBuffer] = []
    stages: list[PipelineStage] = []
    for stage, names in enumerate(split.names):
        # Each stage's GPU lays out its own layers of every group (vLLM keeps every group on
        # every stage) in a pool of `num_blocks` blocks of its own size.
        held = set(names)
        runs = place_groups(
            [[entry for entry in members if entry[0] in held] for members in shaped],
            num_blocks,
            settings.layout,
        )
        pool_bytes = num_blocks * stage_bytes[stage]
        start, end = split.ranges[stage]
        stages.append(
            PipelineStage(
                stage,
                start,
                end,
                names,
                settings.stage_memory[stage],
                stage_bytes[stage],
                budget_blocks[stage],
                pool_bytes,
            )
        )
        for run in runs:
            index = len(buffers)
            buffers.append(
                KVCacheBuffer(
                    index=index,
                    group_id=run.group_id,
                    layer_names=run.layer_names,
                    offset_bytes=run.offset,
                    layer_stride_bytes=run.layer_stride,
                    block_stride_bytes=run.block_stride,
                    page_bytes=run.shape.page_bytes,
                    size_bytes=pool_bytes,
                    stage=stage,
                )
            )
            for position, name in enumerate(run.layer_names):
                placements[name] = LayerPlacement(
                    layer_name=name,
                    group_id=run.group_id,
                    offset_bytes=run.layer_offset(position),
                    block_stride_bytes=run.block_stride,
                    page_bytes=run.shape.page_bytes,
                    used_bytes=used[name],
                    spec=layers[name],
                    view_shape=(
                        num_blocks,
                        run.shape.heads,
                        run.shape.tokens,
                        run.shape.content_bytes,
                    ),
                    view_strides=run.view_strides,
                    buffer_index=index,
                    stage=stage,
                )

    shared: dict[int, list[str]] = {}
    for name, spec in layers.items():
        if isinstance(spec, KVSharingSpec):
            target = placements[spec.target]
            placements[name] = replace(
                target, layer_name=name, shared_from=spec.target, spec=layers[spec.target]
            )
            shared.setdefault(target.group_id, []).append(name)
    if shared:
        groups = [replace(g, shared_layer_names=tuple(shared.get(g.group_id, ()))) for g in groups]
        reasons.append(
            f"{sum(len(v) for v in shared.values())} KV-sharing layers get no memory; "
            "they read their target layer's pages"
        )

    blocks_per_request = sum(
        g.admission_blocks(
            settings.max_model_len, settings.max_in_flight_tokens, settings.mamba_mode
        )
        for g in groups
    )
    assert blocks_per_request == chosen.admission
    scheduler, hashing = _block_sizes(settings, groups)
    ordered = tuple(placements[name] for name in layers)
    waste = ExpectedWaste(
        distribution,
        tuple(measure_waste(groups, ordered, block_bytes, n) for n in distribution.lengths),
    )
    concurrency = num_blocks / blocks_per_request
    pool = (
        f"{num_blocks} blocks of {block_bytes} B"
        if split.size == 1
        else f"{num_blocks} blocks on each of {split.size} stage GPUs (of "
        f"{', '.join(str(b) for b in stage_bytes)} B; {block_bytes} B over all stages)"
    )
    reasons.append(
        f"pool: {pool} in layout {settings.layout}, block 0 "
        f"reserved as the null block; vLLM reserves {blocks_per_request} blocks per "
        f"{settings.max_model_len}-token request ({settings.max_in_flight_tokens} tokens in "
        f"flight), so {concurrency:.2f} such requests fit at once"
    )
    if hashing != scheduler:
        reasons.append(
            f"prefix hits at {hashing}-token granularity (hash block size) while groups "
            f"allocate {scheduler}-token scheduler blocks"
        )
    warnings = []
    caching = _caching_problem(settings, buckets, chosen)
    if caching:
        warnings.append(f"{caching}; hybrid-kv's manager refuses this plan")
    if concurrency < 2:
        warnings.append(
            f"only {concurrency:.2f} requests of {settings.max_model_len} tokens fit at once: "
            "a second long request waits for the first to finish"
        )
    if settings.in_flight is not None and settings.in_flight.note:
        warnings.append(settings.in_flight.note)
    if split.size > 1:
        smallest = budget_blocks.index(min(budget_blocks))
        reasons.append(
            f"{split.size} pipeline stages, {split.source}: the groups are the whole model's, "
            "each stage's GPU holds its own layers' pages of every group; num_blocks is the "
            f"smallest stage's (stage {smallest}, {format_bytes(stage_bytes[smallest])} blocks), "
            "as vLLM takes it"
        )
    return KVCachePlan(
        strategy=settings.strategy,
        groups=tuple(groups),
        buffers=tuple(buffers),
        placements=ordered,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        kv_cache_layout=settings.layout,
        memory_bytes=settings.memory_bytes,
        max_model_len=settings.max_model_len,
        max_in_flight_tokens=settings.max_in_flight_tokens,
        in_flight=settings.in_flight,
        mamba_cache_mode=settings.mamba_mode,  # type: ignore[arg-type]
        blocks_per_request=blocks_per_request,
        scheduler_block_size=scheduler,
        hash_block_size=hashing,
        waste=waste,
        reasons=tuple(reasons),
        alternatives=tuple(alternatives),
        warnings=tuple(warnings),
        stages=tuple(stages),
    )
