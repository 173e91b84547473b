"""Differential tests, one per option an operator sets that changes what vLLM 0.33's scheduler
asks of its KV cache manager or when: pipeline parallelism (batches in flight), Model Runner V2,
data-parallel ranks, the per-step token budget, the admission limit, the adaptive long-prefill cap,
the prefill cadence, EAGLE without the trailing-block drop, a separate draft model, dynamic
speculative decoding, an embedding model, pausing the scheduler and context parallelism (decode
falls back to vLLM's manager). Stock vLLM and `hybrid_kv.vllm.Scheduler` run the same workload in
lock step and must agree on every step (`harness.summarize`), every engine-core output and every
KV event; each test also asserts that its option acted on the run. `test_vllm_random.py` draws
these options in combination."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from vllm.distributed.kv_events import EventPublisherFactory  # noqa: E402

WORKLOAD = harness.chat_workload(32, seed=3, salts=(None, None, "tenant-a"))


@dataclasses.dataclass
class Run:
    """What a lock-step run saw (hybrid-kv's side; stock vLLM's is equal)."""

    steps: int = 0
    preempted: int = 0
    hits: int = 0
    # Steps that scheduled a request while an earlier step of it was still in flight.
    overlapped: int = 0
    outputs: list[Any] = dataclasses.field(default_factory=list)
    # Engine-core outputs of each step.
    results: list[Any] = dataclasses.field(default_factory=list)


def run_both(
    options: harness.Options,
    workload: list[harness.RequestSpec] = WORKLOAD,
    before_step: Callable[[harness.Driver], None] | None = None,
) -> Run:
    """Stock vLLM and hybrid-kv driven in lock step (`before_step` acts on each side's driver
    before each of its steps); asserts every step, engine-core output and KV event equal."""
    stock = harness.build_scheduler(options)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv, f"fell back to vLLM's manager for {options}"
    stock_events, our_events = harness.EventRecorder(), harness.EventRecorder()
    stock.kv_event_publisher, ours.kv_event_publisher = stock_events, our_events
    drivers = harness.Driver(stock, workload), harness.Driver(ours, workload)
    # The requests of hybrid-kv's steps in flight when each step is scheduled.
    in_flight: list[set[str]] = []

    def hook(driver: harness.Driver) -> None:
        if driver is drivers[1]:
            in_flight.append({r for out, _ in driver._in_flight for r in out.num_scheduled_tokens})
        if before_step is not None:
            before_step(driver)

    for driver in drivers:
        driver.schedule = _before(driver.schedule, hook, driver)  # type: ignore[method-assign]
    run = Run()
    for (stock_out, stock_results), (our_out, our_results) in zip(
        drivers[0].run(), drivers[1].run(), strict=True
    ):
        where = f"step {run.steps}, {options}"
        expected = harness.summarize(stock_out)
        assert harness.summarize(our_out) == expected, f"{where}: SchedulerOutput differs"
        assert harness.summarize_results(our_results) == harness.summarize_results(stock_results), (
            f"{where}: engine-core outputs differ"
        )
        assert our_events.events == stock_events.events, f"{where}: KV events differ"
        run.overlapped += not in_flight[-1].isdisjoint(our_out.num_scheduled_tokens)
        run.steps += 1
        run.preempted += len(expected["preempted"])
        run.hits += sum(1 for _, _, n in expected["new"] if n > 0)
        run.outputs.append(our_out)
        run.results.append(our_results)
    assert drivers[1].done
    return run


def _before(
    schedule: Callable[[], Any], hook: Callable[[harness.Driver], None], driver: harness.Driver
) -> Callable[[], Any]:
    def wrapped() -> Any:
        hook(driver)
        return schedule()

    return wrapped


# ------------------------------------------------------------------------ pipeline parallelism


@pytest.mark.parametrize(
    "layout,num_blocks,changes",
    [
        ("full", 260, {}),
        ("gpt-oss", 250, {"max_num_batched_tokens": 256}),
        ("gemma3", 1400, {"eagle_tokens": 2}),
        ("jamba", 700, {"ngram_tokens": 3}),
        ("granite4", 500, {"max_num_batched_tokens": 512}),
        ("full", 200, {"eagle_tokens": 2, "eagle_method": "mtp"}),
    ],
)
@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_parallel_stages_keep_batches_in_flight_as_vllm(
    pp: int, layout: str, num_blocks: int, changes: dict[str, Any]
) -> None:
    # vLLM's engine core keeps `pipeline_parallel_size` batches in flight: a prompt's next
    # chunk is scheduled before the output of its last one, and the finished tokens go back to
    # the first stage in the scheduler output.
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, pipeline_parallel_size=pp, **changes
    )
    assert harness.max_concurrent_batches(harness.build_scheduler(options)) == pp
    run = run_both(options)
    assert run.overlapped > 0 and run.preempted > 0
    assert any(tokens for out in run.outputs for tokens in out.scheduled_cached_reqs.new_token_ids)


@pytest.mark.parametrize("layout", ["full", "gpt-oss", "jamba"])
def test_a_request_resumed_with_steps_of_its_own_in_flight_matches_vllm(layout: str) -> None:
    # Three pipeline stages and EAGLE drafts: prefix-cache resets before two consecutive steps
    # preempt the request while steps of its own are in flight, and vLLM resumes it at once
    # (their outputs will be dropped, their drafts are still proposed). vLLM's count of its
    # tokens in flight keeps those steps' tokens until their outputs are in, so it exceeds the
    # tokens the request has and has computed: its steps must still be served (the manager
    # once refused the count with OutOfRangeError).
    workload = [dataclasses.replace(WORKLOAD[0], prompt=WORKLOAD[0].prompt[:100], arrival_step=0)]
    options = harness.Options(layout=layout, pipeline_parallel_size=3, eagle_tokens=3)
    ahead: list[bool] = []

    def hook(driver: harness.Driver) -> None:
        if driver.step in (4, 5):
            assert driver.scheduler.reset_prefix_cache(reset_running_requests=True)
        ahead.extend(
            r.num_in_flight_tokens > max(r.num_tokens, r.num_computed_tokens)
            for r in driver.scheduler.running
        )

    run = run_both(options, workload, hook)
    assert any(ahead) and run.preempted == 2


# ------------------------------------------------------------------ the drafter's cache group


@pytest.mark.parametrize("lookahead_hashes", [True, False])
@pytest.mark.parametrize("block_drop", [True, False])
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_the_drafters_group_is_flagged_as_vllms_planner_flags_it(
    method: str, block_drop: bool, lookahead_hashes: bool
) -> None:
    # vLLM's planner (get_global_kv_cache_groups) flags the group holding the drafter's layers
    # whenever the drafter keeps EAGLE's trailing-block drop, lookahead hashes or not; the
    # harness's hand-built config must say the same (it once flagged it only without lookahead
    # hashes, so the shared-prefix Mamba checkpoints that need the flag were never drawn).
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    options = harness.Options(
        layout="gpt-oss",
        eagle_tokens=2,
        eagle_method=method,
        eagle_block_drop=block_drop,
        eagle_lookahead_hashes=lookahead_hashes,
    )
    config = harness.vllm_config(options)
    attention = {
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": harness.torch.float16,
    }
    specs = {
        f"model.layers.{i}.attn": FullAttentionSpec(**attention)
        if i % 2 == 0
        else SlidingWindowSpec(**attention, sliding_window=128)
        for i in range(4)
    }
    specs["draft.layers.0.attn"] = FullAttentionSpec(**attention, is_draft=True)
    resolve_kv_cache_layout(config, [["LBNHC"]], specs.values())
    flagged = [
        type(group.kv_cache_spec)
        for group in get_global_kv_cache_groups(config, [specs])
        if group.is_eagle_group
    ]
    assert flagged in ([], [FullAttentionSpec])
    ours = [
        group.is_eagle_group for group in harness.kv_cache_config(options, config).kv_cache_groups
    ]
    assert ours == [bool(flagged), False]
    assert bool(flagged) == block_drop


def test_shared_prefix_mamba_checkpoints_with_lookahead_hashes_match_vllm() -> None:
    # EAGLE with vLLM's default lookahead hashes, hashes every 8 tokens on Mamba blocks of 16:
    # the drafter's group is flagged, so vLLM's manager also checkpoints Mamba states at the
    # junctions where siblings resume.
    options = harness.Options(
        layout="jamba",
        num_blocks=700,
        prefix_match_unit=8,
        dense_retention=False,
        eagle_tokens=2,
        mamba_shared_prefix_checkpoint=True,
    )
    stock = harness.build_scheduler(options)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert stock.kv_cache_manager.mamba_shared_prefix_checkpoint
    assert ours.kv_cache_manager.mamba_shared_prefix_checkpoint
    run = run_both(options)
    assert run.hits > 0 and run.preempted > 0


# ---------------------------------------------------------------------------- Model Runner V2


def test_model_runner_v2_with_async_scheduling_and_pipeline_stages_matches_vllm() -> None:
    # Model Runner V2 (vLLM 0.33's default where Triton runs): with async scheduling the engine
    # keeps one batch more than the pipeline stages in flight, a request decodes once every PP
    # steps, and resumed requests are sent as new ones.
    options = harness.Options(
        layout="full",
        num_blocks=200,
        pipeline_parallel_size=2,
        async_scheduling=True,
        v2_model_runner=True,
    )
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.use_v2_model_runner and harness.max_concurrent_batches(ours) == 3
    run = run_both(options)
    assert run.overlapped > 0 and run.preempted > 0
    new = [r.req_id for out in run.outputs for r in out.scheduled_new_reqs]
    assert len(new) > len(set(new)), "a resumed request is sent as a new one"
    assert not any(out.scheduled_cached_reqs.resumed_req_ids for out in run.outputs)


@pytest.mark.parametrize("changes", [{"eagle_tokens": 3}, {"draft_model_tokens": 2}])
def test_model_runner_v2_skips_unused_drafts_as_vllm(changes: dict[str, Any]) -> None:
    # A drafter with its own forward pass on Model Runner V2 proposes nothing after a step
    # whose drafts no request can use (prefill chunks, last tokens).
    options = harness.Options(layout="full", num_blocks=160, v2_model_runner=True, **changes)
    run = run_both(options)
    assert any(out.skip_drafts for out in run.outputs)
    assert not all(out.skip_drafts for out in run.outputs)
    assert run.preempted > 0


# ----------------------------------------------------------------------------- data parallel


@pytest.mark.parametrize("moe", [False, True])
def test_a_data_parallel_ranks_kv_events_carry_its_rank(
    moe: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's engine core keeps the rank as `data_parallel_index` (a dense model's ranks then run
    # as one-rank engines); the scheduler makes its KV event publisher for that rank, which
    # annotates the batches it publishes.
    created = []
    make = EventPublisherFactory.create

    def create(config: Any, data_parallel_rank: int = 0) -> Any:
        created.append(data_parallel_rank)
        return make(config, data_parallel_rank)

    monkeypatch.setattr(EventPublisherFactory, "create", create)
    options = harness.Options(
        layout="gpt-oss", kv_events=True, data_parallel_size=4, data_parallel_rank=3, moe=moe
    )
    for cls in (None, hkv.Scheduler):
        scheduler = harness.build_scheduler(options, cls)
        assert scheduler.parallel_config.data_parallel_index == 3
        assert scheduler.parallel_config.data_parallel_size == (4 if moe else 1)
    assert created == [3, 3]
    # The rank reports finished requests to the data-parallel coordinator.
    run = run_both(options)
    assert run.hits > 0 and any(
        eco.finished_requests for results in run.results for r in results for eco in r.values()
    )


def _holds_prefills(options: harness.Options) -> None:
    """Runs both sides and asserts some step left a waiting request waiting with room for it
    and nothing else scheduled but decodes (the prefill cadence held it)."""
    held = []

    def hook(driver: harness.Driver) -> None:
        scheduler = driver.scheduler
        if isinstance(scheduler, hkv.Scheduler):
            held.append((len(scheduler.waiting), len(scheduler.running)))

    run = run_both(options, before_step=hook)
    assert any(
        waiting
        and running
        and not out.scheduled_new_reqs
        and out.total_num_scheduled_tokens < options.max_num_batched_tokens
        for (waiting, running), out in zip(held, run.outputs, strict=True)
    )


def test_a_coordinated_data_parallel_rank_throttles_prefills_as_vllm() -> None:
    # Ranks of a data-parallel MoE model: the engine core admits prefills every fourth step
    # of a wave (`schedule(throttle_prefills=True)` on the others).
    options = harness.Options(
        layout="gpt-oss",
        num_blocks=4096,
        moe=True,
        data_parallel_size=2,
        data_parallel_rank=1,
        prefill_schedule_interval=4,
    )
    _holds_prefills(options)


# ------------------------------------------------------------------------- scheduler knobs


def test_a_local_prefill_cadence_matches_vllm() -> None:
    # One engine (or a dense model's rank): the scheduler admits prefills every fourth step.
    _holds_prefills(harness.Options(layout="llama4", num_blocks=4096, prefill_schedule_interval=4))


def test_a_per_step_token_budget_below_the_batchs_matches_vllm() -> None:
    options = harness.Options(
        layout="gemma3", num_blocks=900, max_num_batched_tokens=512, max_num_scheduled_tokens=96
    )
    run = run_both(options)
    totals = [out.total_num_scheduled_tokens for out in run.outputs]
    assert max(totals) == 96 and run.preempted > 0


def test_an_admission_limit_below_max_num_seqs_matches_vllm() -> None:
    options = harness.Options(
        layout="jamba", num_blocks=150, max_num_seqs=16, max_num_active_seqs=3
    )
    run = run_both(options)
    assert max(len(out.num_scheduled_tokens) for out in run.outputs) == 3
    assert run.preempted > 0


def test_an_adaptive_long_prefill_cap_matches_vllm() -> None:
    # The cap (64 tokens) is floored at the budget's share per request.
    options = harness.Options(
        layout="gpt-oss",
        num_blocks=330,
        long_prefill_token_threshold=64,
        long_prefill_adaptive=True,
    )
    run = run_both(options)
    assert any(
        len(out.num_scheduled_tokens) > 1 and max(out.num_scheduled_tokens.values()) > 64
        for out in run.outputs
    )
    assert run.preempted > 0


# ---------------------------------------------------------------------- speculative decoding


def test_eagle_without_the_trailing_block_drop_matches_vllm() -> None:
    # `disable_eagle_block_drop`: hits keep their last block, hashes cover no lookahead.
    options = harness.Options(
        layout="gpt-oss",
        num_blocks=200,
        eagle_tokens=3,
        eagle_lookahead_hashes=False,
        eagle_block_drop=False,
    )
    stock = harness.build_scheduler(options)
    assert not stock.use_eagle_block_drop and stock.num_hash_lookahead_tokens == 0
    run = run_both(options)
    assert run.hits > 0 and run.preempted > 0


@pytest.mark.parametrize("parallel", [False, True])
def test_a_separate_draft_model_matches_vllm(parallel: bool) -> None:
    # vLLM's "draft_model" method: KV slots for every draft token and input slots for the
    # drafter (one per request, one per draft token with parallel drafting).
    options = harness.Options(
        layout="gemma3", num_blocks=1400, draft_model_tokens=3, parallel_drafting=parallel
    )
    stock = harness.build_scheduler(options)
    assert stock.num_lookahead_tokens == 3
    assert stock.vllm_config.speculative_config.max_num_new_slots_for_drafting == (
        3 if parallel else 1
    )
    run = run_both(options)
    assert any(out.scheduled_spec_decode_tokens for out in run.outputs)
    assert run.preempted > 0


@pytest.mark.parametrize("changes", [{"eagle_tokens": 3}, {"ngram_tokens": 3}])
def test_dynamic_speculative_decoding_matches_vllm(changes: dict[str, Any]) -> None:
    # Three drafts for batches of up to three requests, one for larger ones.
    options = harness.Options(
        layout="full",
        num_blocks=260,
        spec_tokens_per_batch_size=((1, 3, 3), (4, 1024, 1)),
        **changes,
    )
    run = run_both(options)
    counts = {out.num_spec_tokens_to_schedule for out in run.outputs if out.num_scheduled_tokens}
    assert counts == {1, 3}


# --------------------------------------------------------------------------------- pausing


@pytest.mark.parametrize("clear_cache", [False, True])
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pausing_and_resuming_the_scheduler_matches_vllm(mode: str, clear_cache: bool) -> None:
    # vLLM's pause_scheduler (as for sleep or a weight update): requests aborted, drained or
    # kept, the prefix cache optionally cleared (preempting those kept), then resumed.
    options = harness.Options(layout="gpt-oss", num_blocks=330, async_scheduling=True)
    logs = []

    def hook(driver: harness.Driver) -> None:
        if driver.step == 30:
            driver.pause(mode, clear_cache, resume_at=36)
        logs.append(driver.pause_log)

    run_both(options, before_step=hook)
    stock_log, our_log = logs[-2], logs[-1]
    assert stock_log == our_log
    assert [entry[0] for entry in our_log] == (
        ["abort all"] * (mode == "abort") + ["pause"] + ["cleared"] * clear_cache + ["resume"]
    )
    if clear_cache:
        assert our_log[-2][2] is True, "the cache was cleared"


# ------------------------------------------------------------------------------ embedding model


@pytest.mark.parametrize("layout,num_blocks", [("gpt-oss", 150), ("jamba", 150), ("full", 120)])
def test_an_embedding_model_filling_max_model_len_matches_vllm(
    layout: str, num_blocks: int
) -> None:
    # A pooling runner samples no token, so vLLM schedules a prompt's last chunk up to
    # max_model_len (1024 here; a generating model's requests would stop one token short):
    # every third prompt fills it, some are resent (hits), chunks of 256 without the
    # whole-prompt fit check preempt.
    options = harness.Options(
        layout=layout,
        num_blocks=num_blocks,
        pooling_runner=True,
        max_model_len=1024,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=256,
        reserve_full_isl=False,
    )
    stock = harness.build_scheduler(options)
    assert stock.num_sampled_tokens_per_step == 0
    workload = [
        dataclasses.replace(
            spec,
            pooling=True,
            prompt=(spec.prompt * 8)[: 1024 if i % 3 == 0 else 1024 - i],
            arrival_step=i // 8,
        )
        for i, spec in enumerate(WORKLOAD)
    ]
    workload += [
        dataclasses.replace(spec, request_id=f"again-{spec.request_id}", arrival_step=10)
        for spec in workload[:8]
    ]
    run = run_both(options, workload)
    assert run.hits > 0 and run.preempted > 0


# ---------------------------------------------------------------------- context parallelism


def test_decode_context_parallelism_falls_back_to_vllms_manager_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Four tensor-parallel ranks (more than the model's 2 KV heads), two decode-context ones.
    options = harness.Options(tensor_parallel_size=4, decode_context_parallel_size=2)
    with caplog.at_level("WARNING", logger="vllm.hybrid_kv"):
        ours = harness.build_scheduler(options, hkv.Scheduler)
    assert not ours.uses_hybrid_kv and ours.dcp_world_size == 2
    (line,) = [r.getMessage() for r in caplog.records if "hybrid-kv" in r.getMessage()]
    assert line == (
        "hybrid-kv: using vLLM's own KV cache manager: decode/prefill context parallelism: "
        "context-parallel block sizes are not implemented"
    )
    assert sum(1 for _ in harness.Driver(ours, WORKLOAD[:8]).run()) > 0


def test_prefill_context_parallelism_is_served_as_vllm_serves_it() -> None:
    # Model Runner V2 only; vLLM 0.33's scheduler builds its manager with pcp_world_size 1.
    options = harness.Options(
        layout="full", num_blocks=160, prefill_context_parallel_size=2, v2_model_runner=True
    )
    stock = harness.build_scheduler(options)
    assert stock.pcp_world_size == 2
    assert {m.pcp_world_size for m in stock.kv_cache_manager.coordinator.single_type_managers} == {
        1
    }
    assert run_both(options).preempted > 0
