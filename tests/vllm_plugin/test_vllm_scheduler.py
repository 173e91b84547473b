"""Differential tests: vLLM 0.33's own scheduler with its own KV cache manager against
`hybrid_kv.vllm.Scheduler` (the same scheduler with hybrid-kv's manager), driven through the same
workload with the same fake model, must produce identical `SchedulerOutput`s on every step
(scheduled requests and token counts, block ids of new and cached requests per group, preempted
and finished requests) and identical engine-core outputs (tokens, finish reasons, prefill stats,
prefix-cache stats, KV cache usage)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pickle
import random
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv as hk  # noqa: E402
import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from hybrid_kv.vllm._manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402


@dataclasses.dataclass
class Run:
    steps: int = 0
    preempted: int = 0
    finished: int = 0
    spec_tokens: int = 0
    hits: int = 0
    # Steps handing a request two or more new blocks of the last group (a Mamba group: its
    # state plus an exported prefill checkpoint).
    two_states: int = 0
    # Hits ending inside a block (fine-grained partial hash hits).
    partial_hits: int = 0
    # Copy-on-write block copies handed to the worker.
    copies: int = 0
    # Steps handing the worker blocks to zero.
    zeroed: int = 0


def run_both(
    options: harness.Options,
    workload: list[harness.RequestSpec],
    require_hybrid: bool = True,
    watch: Callable[[Any], None] | None = None,
) -> Run:
    """Drives stock vLLM and hybrid_kv.vllm.Scheduler in lock step; asserts every step equal.
    `watch` gets hybrid-kv's scheduler before the run."""
    stock = harness.build_scheduler(options)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert isinstance(stock.kv_cache_manager, VllmKVCacheManager)
    if require_hybrid:
        assert ours.uses_hybrid_kv, "hybrid_kv.vllm fell back to vLLM's manager"
    if watch is not None:
        watch(ours)
    run = Run()
    stock_steps = harness.Driver(stock, workload).run()
    our_steps = harness.Driver(ours, workload).run()
    for (stock_out, stock_results), (our_out, our_results) in zip(
        stock_steps, our_steps, strict=True
    ):
        expected = harness.summarize(stock_out)
        got = harness.summarize(our_out)
        assert got == expected, f"step {run.steps}: SchedulerOutput differs"
        assert harness.summarize_results(our_results) == harness.summarize_results(stock_results), (
            f"step {run.steps}: engine-core outputs differ"
        )
        run.steps += 1
        run.preempted += len(expected["preempted"])
        run.finished += len(expected["finished"])
        run.spec_tokens += sum(len(v) for v in expected["spec"].values())
        run.hits += sum(1 for _, _, n in expected["new"] if n > 0)
        run.partial_hits += sum(1 for _, _, n in expected["new"] if n % options.block_size)
        run.copies += len(expected["copies"] or ())
        run.zeroed += bool(expected["zero"])
        # New requests list their hit blocks too: count those past the hit. Resumed requests
        # list their whole table: left out.
        handed = [ids[-1][n // options.block_size :] for _, ids, n in expected["new"]]
        handed += [ids[-1] for _, ids, _, resumed, _ in expected["cached"] if ids and not resumed]
        run.two_states += sum(1 for ids in handed if sum(1 for b in ids if b) >= 2)
    assert run.finished == len(workload)
    return run


WORKLOAD = harness.chat_workload(48, seed=1, salts=(None, None, "tenant-a"))

# (layout, pool blocks under memory pressure); each pool is small enough to force preemptions.
DENSE_LAYOUTS = [
    ("full", 260),
    ("deepseek", 260),
    ("gpt-oss-unified", 260),
    ("gpt-oss", 330),
    ("gemma3", 1400),
    ("llama4", 1200),
    ("mixed-bs", 330),
]


def test_a_window_only_model_with_mtp_lookahead_hashes_is_served_where_vllm_fails() -> None:
    # One sliding-window group and multi-token prediction's lookahead hashes: a 33-token prompt
    # has one block hash (its second block's hash needs a token past it), but vLLM 0.33's
    # single-group coordinator looks up the 2 blocks of the tokens but the last, and its
    # sliding-window manager indexes past the hashes (IndexError) on the first lookup.
    # hybrid-kv looks up the blocks with a hash, and serves the prompt and its resend.
    options = harness.Options(
        layout="window-only", num_blocks=200, eagle_tokens=2, eagle_method="mtp"
    )
    prompt = tuple(range(1, 34))
    workload = [
        harness.RequestSpec("first", prompt, 3, 0),
        harness.RequestSpec("again", prompt, 3, 6),
    ]
    stock = harness.build_scheduler(options)
    assert stock.num_hash_lookahead_tokens > 0
    with pytest.raises(IndexError):
        list(harness.Driver(stock, workload).run())
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv
    driver = harness.Driver(ours, workload)
    outputs = [out for out, _ in driver.run()]
    assert driver.done
    finished = [r for out in outputs for r in out.finished_req_ids]
    assert sorted(finished) == ["again", "first"]
    hits = [r.num_computed_tokens for out in outputs for r in out.scheduled_new_reqs]
    assert hits == [0, 16]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("layout", ["swa-mamba", "mixed-precision"])
def test_blocks_to_zero_are_vllms_in_its_order(layout: str, prefix_caching: bool) -> None:
    # vLLM zeroes new attention blocks for a layout with Mamba layers or of two cache
    # precisions, and lists them group by group (every request's full-attention blocks of the
    # step, then the window's): hybrid-kv once listed them request by request, and zeroed none
    # for a cache of two precisions.
    options = harness.Options(layout=layout, num_blocks=700, prefix_caching=prefix_caching)
    run = run_both(options, WORKLOAD)
    assert run.zeroed > 0 and run.preempted > 0


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("layout", [name for name, _ in DENSE_LAYOUTS])
def test_same_outputs_as_vllm_with_room(layout: str, prefix_caching: bool) -> None:
    options = harness.Options(layout=layout, num_blocks=20000, prefix_caching=prefix_caching)
    run = run_both(options, WORKLOAD)
    assert run.preempted == 0
    assert (run.hits > 0) == prefix_caching


@pytest.mark.parametrize("layout,num_blocks", DENSE_LAYOUTS)
def test_same_outputs_as_vllm_under_memory_pressure(layout: str, num_blocks: int) -> None:
    options = harness.Options(layout=layout, num_blocks=num_blocks)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0, "the pool should be small enough to preempt"
    assert run.hits > 0


def test_same_outputs_as_vllm_without_prefix_caching_under_pressure() -> None:
    run = run_both(
        harness.Options(layout="gemma3", num_blocks=1400, prefix_caching=False), WORKLOAD
    )
    assert run.preempted > 0


def test_same_outputs_as_vllm_with_ngram_speculative_decoding() -> None:
    options = harness.Options(layout="full", num_blocks=300, ngram_tokens=3)
    run = run_both(options, WORKLOAD)
    assert run.spec_tokens > 0
    assert run.preempted > 0


def test_same_outputs_as_vllm_with_async_scheduling() -> None:
    options = harness.Options(layout="full", num_blocks=260, async_scheduling=True)
    stock = harness.build_scheduler(options)
    assert isinstance(stock, VllmAsyncScheduler)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0


@pytest.mark.parametrize("layout", ["gpt-oss", "gemma3"])
def test_same_outputs_as_vllm_with_async_scheduling_on_window_groups(layout: str) -> None:
    num_blocks = {"gpt-oss": 240, "gemma3": 1400}[layout]
    run = run_both(
        harness.Options(layout=layout, num_blocks=num_blocks, async_scheduling=True), WORKLOAD
    )
    assert run.preempted > 0


def test_same_outputs_as_vllm_with_ngram_on_window_groups() -> None:
    run = run_both(harness.Options(layout="gpt-oss", num_blocks=330, ngram_tokens=3), WORKLOAD)
    assert run.spec_tokens > 0 and run.preempted > 0


# (layout, pool blocks) for the EAGLE-family runs: small enough to preempt.
EAGLE_LAYOUTS = [
    ("full", 300),
    ("gpt-oss", 330),
    ("gemma3", 1400),
    ("llama4", 1200),
    ("jamba", 700),
    ("granite4", 700),
    ("mixed-bs", 300),
]


@pytest.mark.parametrize("lookahead_hashes", [True, False], ids=["lookahead-hashes", "block-drop"])
@pytest.mark.parametrize("layout,num_blocks", EAGLE_LAYOUTS)
def test_same_outputs_as_vllm_with_eagle(
    layout: str, num_blocks: int, lookahead_hashes: bool
) -> None:
    # vLLM's default for EAGLE-3: block hashes cover the next token and hits drop nothing;
    # with `disable_lookahead_block_hashes`, hits drop their last block in the drafter's group.
    options = harness.Options(
        layout=layout,
        num_blocks=num_blocks,
        dense_retention=False,
        eagle_tokens=3,
        eagle_lookahead_hashes=lookahead_hashes,
    )
    stock = harness.build_scheduler(options)
    assert stock.kv_cache_manager.coordinator.drop_eagle_group_ids == (
        set() if lookahead_hashes else {0}
    )
    assert stock.num_hash_lookahead_tokens == int(lookahead_hashes)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.hits > 0 and run.spec_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout,num_blocks", [EAGLE_LAYOUTS[i] for i in (1, 2, 5)])
def test_same_outputs_as_vllm_with_multi_token_prediction(
    layout: str, num_blocks: int, async_scheduling: bool
) -> None:
    # Two MTP modules: the drafter reads 2 prefill tokens ahead, so sliding windows keep one
    # more token, the last computed token is not cached, and hashes cover 2 more tokens.
    options = harness.Options(
        layout=layout,
        num_blocks=num_blocks,
        dense_retention=False,
        eagle_tokens=2,
        eagle_method="mtp",
        async_scheduling=async_scheduling,
    )
    config = harness.vllm_config(options)
    assert (config.num_prefill_lookahead_tokens, config.num_hash_lookahead_tokens) == (2, 2)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.hits > 0 and run.spec_tokens > 0


@pytest.mark.parametrize("layout,num_blocks", [("full", 300), ("gemma3", 1400), ("granite4", 700)])
def test_same_outputs_as_vllm_with_eagle_and_async_scheduling(layout: str, num_blocks: int) -> None:
    # The scheduler's computed count runs ahead of the known tokens by unprocessed drafts.
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, eagle_tokens=3, async_scheduling=True
    )
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.spec_tokens > 0


def test_under_async_scheduling_requests_schedule_draft_placeholders_as_in_vllms_engine() -> None:
    # vLLM's engine core hands the scheduler no drafts under async scheduling (they stay with
    # the worker): every scheduled draft is the scheduler's placeholder (-1). The driver once
    # handed it the fake drafter's tokens, as without async scheduling.
    options = harness.Options(layout="full", num_blocks=300, eagle_tokens=3, async_scheduling=True)
    scheduled: list[int] = []
    stock = harness.build_scheduler(options)
    for output, _ in harness.Driver(stock, WORKLOAD[:8]).run():
        for tokens in output.scheduled_spec_decode_tokens.values():
            scheduled.extend(tokens)
    assert scheduled and set(scheduled) == {-1}


@pytest.mark.parametrize(
    "changes",
    [{}, {"async_scheduling": True, "eagle_tokens": 2, "eagle_method": "mtp"}],
    ids=["default-retention", "mtp-async"],
)
def test_same_outputs_as_vllm_with_groups_of_different_block_sizes(changes: dict) -> None:
    # Window groups with half the KV heads get twice the block size from vLLM's planner: hits
    # land on the lcm of the block sizes (32), requests are hashed every gcd (16).
    options = harness.Options(layout="mixed-bs", num_blocks=300, dense_retention=False, **changes)
    stock = harness.build_scheduler(options)
    assert (stock.block_size, stock.hash_block_size) == (32, 16)
    assert [m.block_size for m in stock.kv_cache_manager.coordinator.single_type_managers] == [
        16,
        32,
    ]
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.hits > 0


def test_shared_prefix_mamba_checkpoints_are_inert_with_one_block_size() -> None:
    # vLLM turns the option on only with partial hash hits; with one block size its manager
    # leaves it off, and so does hybrid-kv's: served, with the same outputs.
    options = harness.Options(
        layout="granite4",
        num_blocks=700,
        dense_retention=False,
        eagle_tokens=2,
        eagle_lookahead_hashes=False,
        mamba_shared_prefix_checkpoint=True,
    )
    stock = harness.build_scheduler(options)
    assert stock.cache_config.enable_mamba_shared_prefix_checkpoint
    assert not stock.kv_cache_manager.mamba_shared_prefix_checkpoint
    run = run_both(options, WORKLOAD)
    assert run.hits > 0


# Requests naming LoRA adapters: two adapters share a name but not a path (vLLM keys blocks by
# both), and a step runs at most 2 adapters.
LORAS = (None, ("alpha", 1, "/adapters/alpha"), ("beta", 2, "/adapters/beta"))
LORAS += (("alpha", 3, "/adapters/alpha-v2"),)
LORA_WORKLOAD = [
    dataclasses.replace(spec, lora=LORAS[i % len(LORAS)]) for i, spec in enumerate(WORKLOAD)
]


@pytest.mark.parametrize("layout,num_blocks", [("full", 260), ("gpt-oss", 1000), ("jamba", 700)])
def test_same_outputs_as_vllm_with_lora_requests(layout: str, num_blocks: int) -> None:
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, dense_retention=False, lora=True
    )
    run = run_both(options, LORA_WORKLOAD)
    assert run.hits > 0 and run.preempted > 0


@pytest.mark.parametrize("hash_algo", ["xxhash", "xxhash_cbor"])
def test_adapters_whose_name_and_path_join_alike_share_no_blocks_as_in_vllm(hash_algo: str) -> None:
    # vLLM keys a LoRA request's blocks by the (name, path) pair; with its xxHash options the
    # core hashes the pair itself, and two adapters whose name and path hold the same characters
    # split elsewhere (a NUL in one, say) must not read each other's blocks.
    prompt = WORKLOAD[0].prompt
    workload = [
        harness.RequestSpec("first", prompt, 4, 0, lora=("x\0y", 1, "z")),
        harness.RequestSpec("second", prompt, 4, 8, lora=("x", 2, "y\0z")),
    ]
    options = harness.Options(num_blocks=260, lora=True, hash_algo=hash_algo)
    assert run_both(options, workload).hits == 0


@pytest.mark.parametrize("hash_algo", ["xxhash", "xxhash_cbor"])
def test_multimodal_identifiers_spelling_an_embeddings_key_share_no_blocks_as_in_vllm(
    hash_algo: str,
) -> None:
    # With vLLM's xxHash options the core keys a prompt's embeddings and its multimodal items
    # itself, both as keyed inputs. vLLM keeps the two kinds of extra key apart: a multimodal
    # item whose identifier (a client's `multi_modal_uuids`) spells an embeddings block's key,
    # at that key's position, must read none of the embedding prompt's blocks.
    from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

    prompt = WORKLOAD[0].prompt
    embedded = harness.RequestSpec("embedded", prompt, 4, 0, embeds=True)
    made = harness.make_request(embedded, hash_algo=hash_algo)
    size = harness.BLOCK_SIZE
    digests = [
        digest.hex()
        for start in range(0, len(prompt), size)
        for ((_, digest),) in [_gen_prompt_embeds_extra_hash_keys(made, start, start + size)]
    ]
    # Each imitation spells the keys one way (the bare digest, or behind a tag an
    # implementation might give the embeddings' keys); vLLM holds token id 0 where an
    # embedding stands, so the items stand on the same ids.
    imitations = [
        harness.RequestSpec(
            f"imitation-{i}",
            (0,) * len(prompt),
            4,
            0,
            mm=tuple((f"{tag}{d}", n * size, 1) for n, d in enumerate(digests)),
        )
        for i, tag in enumerate(["", "prompt_embeds:", "embeds:", "mm:embeds:"])
    ]
    options = harness.Options(layout="full", prompt_embeds=True, hash_algo=hash_algo)
    hits = []
    for cls in (None, hkv.Scheduler):
        scheduler = harness.build_scheduler(options, cls)
        manager = scheduler.kv_cache_manager
        got = []
        for spec in (embedded, *imitations):
            request = harness.make_request(spec, hash_algo=hash_algo)
            blocks, num_hit, _ = manager.get_computed_blocks(request)
            got.append(num_hit)
            manager.allocate_slots(request, len(prompt) - num_hit, num_hit, blocks)
        hits.append(got)
    assert hits[1] == hits[0] == [0] * (1 + len(imitations))


@pytest.mark.parametrize(
    "layout,num_blocks,dense,every",
    [
        ("full", 260, True, 1),
        ("full", 260, True, 2),
        ("gemma3", 1400, False, 1),
        ("llama4", 1200, False, 1),
        ("jamba", 700, False, 1),
    ],
)
def test_same_outputs_as_vllm_with_prompt_embeddings(
    layout: str, num_blocks: int, dense: bool, every: int
) -> None:
    # Every `every`-th request sends its prompt as embeddings: vLLM holds token id 0 at each of
    # those positions and keys each block by a digest of its embeddings. Without those keys
    # every embedding prompt would share blocks with every other (all zeros): the run would
    # differ from vLLM's at once.
    workload = [dataclasses.replace(spec, embeds=i % every == 0) for i, spec in enumerate(WORKLOAD)]
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, dense_retention=dense, prompt_embeds=True
    )
    run = run_both(options, workload)
    assert run.hits > 0 and run.preempted > 0


@pytest.mark.parametrize(
    "layout,num_blocks,changes",
    [
        ("full", 300, {"eagle_tokens": 3}),
        ("gemma3", 1400, {"eagle_tokens": 1}),
        ("gpt-oss", 330, {"eagle_tokens": 2, "eagle_method": "mtp"}),
        ("granite4", 700, {"eagle_tokens": 2, "eagle_method": "mtp", "async_scheduling": True}),
    ],
)
def test_same_outputs_as_vllm_with_prompt_embeddings_and_lookahead_hashes(
    layout: str, num_blocks: int, changes: dict
) -> None:
    # With EAGLE's lookahead hashes (1 token, or 2 with two MTP modules) each block's digest of
    # embeddings covers the block and the tokens after it, and keys that block only: a block
    # whose own embeddings and lookahead match is a hit even where the next block's differ.
    workload = [dataclasses.replace(spec, embeds=i % 2 == 0) for i, spec in enumerate(WORKLOAD)]
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, dense_retention=False, prompt_embeds=True, **changes
    )
    assert harness.vllm_config(options).num_hash_lookahead_tokens > 0
    run = run_both(options, workload)
    assert run.hits > 0 and run.preempted > 0 and run.spec_tokens > 0


@pytest.mark.parametrize("layout,num_blocks", [("full", 260), ("gpt-oss", 1000), ("granite4", 700)])
def test_same_outputs_as_vllm_with_prompt_logprobs_requests(layout: str, num_blocks: int) -> None:
    # Every third request asks for prompt logprobs: it reads no prefix-cache hit, its blocks are
    # still cached for others, and the prefix-cache stats leave it out.
    workload = [
        dataclasses.replace(spec, prompt_logprobs=1 if i % 3 == 0 else None)
        for i, spec in enumerate(WORKLOAD)
    ]
    stock = harness.make_request(workload[0])
    assert stock.skip_reading_prefix_cache
    options = harness.Options(layout=layout, num_blocks=num_blocks, dense_retention=False)
    run = run_both(options, workload)
    assert run.hits > 0


@pytest.mark.parametrize(
    "layout,num_blocks,async_scheduling",
    [("full", 150, False), ("gpt-oss", 200, True), ("jamba", 700, False)],
)
def test_same_outputs_as_vllm_with_pooling_requests(
    layout: str, num_blocks: int, async_scheduling: bool
) -> None:
    # Every other request is a pooling request (an embedding model's: no sampling parameters,
    # one pooler output when its prompt is done), some asking for their hits to be published.
    workload = harness.with_pooling(WORKLOAD)
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, kv_events=True, async_scheduling=async_scheduling
    )
    run = run_both(options, workload)
    assert run.hits > 0 and run.preempted > 0


def test_a_window_not_widened_for_the_drafter_falls_back() -> None:
    # vLLM's planner widens sliding windows by the tokens a multi-module drafter re-prefills; a
    # KVCacheConfig without that is not one the core's rules match.
    options = harness.Options(layout="gpt-oss", eagle_tokens=2, eagle_method="mtp")
    config = harness.vllm_config(options)
    kv = harness.kv_cache_config(options, config)
    group = kv.kv_cache_groups[1]
    group.kv_cache_spec = dataclasses.replace(group.kv_cache_spec, extra_retained_tokens=0)
    scheduler = hkv.Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=harness.StructuredOutputManager(config),
        block_size=options.block_size,
        log_stats=True,
    )
    assert not scheduler.uses_hybrid_kv
    assert isinstance(scheduler.kv_cache_manager, VllmKVCacheManager)


@pytest.mark.parametrize("layout", ["gpt-oss", "gemma3", "odd-window"])
def test_same_outputs_as_vllm_with_default_retention(layout: str) -> None:
    # vLLM's default: prefix_cache_retention_interval=0 (sparse checkpoints).
    num_blocks = {"gpt-oss": 240, "gemma3": 1400, "odd-window": 240}[layout]
    options = harness.Options(layout=layout, num_blocks=num_blocks, dense_retention=False)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.hits > 0


@pytest.mark.parametrize("layout,num_blocks", [("gpt-oss", 240), ("gemma3", 1400), ("jamba", 700)])
def test_same_outputs_as_vllm_with_a_retention_interval(layout: str, num_blocks: int) -> None:
    # prefix_cache_retention_interval=64: besides the default's checkpoints, one window (or
    # Mamba state) every 64 tokens stays cached.
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, dense_retention=False, retention_interval=64
    )
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.hits > 0


@pytest.mark.parametrize("scheduler_cls", [None, hkv.Scheduler], ids=["vllm", "hybrid-kv"])
@pytest.mark.parametrize("layout,interval", [("full", 64), ("llama4", 64), ("gpt-oss", 24)])
def test_a_retention_interval_vllm_refuses_is_refused(
    scheduler_cls: Any, layout: str, interval: int
) -> None:
    # vLLM refuses an interval on a model without sliding-window or Mamba groups, and one that
    # is not a multiple of the scheduler block size; the plugin raises as it does.
    options = harness.Options(layout=layout, dense_retention=False, retention_interval=interval)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        harness.build_scheduler(options, scheduler_cls)


def test_same_outputs_as_vllm_with_default_retention_async_and_room() -> None:
    options = harness.Options(
        layout="gemma3", num_blocks=20000, dense_retention=False, async_scheduling=True
    )
    run = run_both(options, WORKLOAD)
    assert run.hits > 0


def test_same_outputs_as_vllm_on_jamba_with_prefix_caching() -> None:
    # mamba_cache_mode="align": Mamba states cached at block-aligned checkpoints.
    run = run_both(harness.Options(layout="jamba", num_blocks=700), WORKLOAD)
    assert run.preempted > 0 and run.hits > 0
    assert run.two_states == 0, "Mamba-1 exports no prefill checkpoint"


def test_same_outputs_as_vllm_on_jamba_without_prefix_caching() -> None:
    run = run_both(harness.Options(layout="jamba", num_blocks=700, prefix_caching=False), WORKLOAD)
    assert run.preempted > 0


def long_context_workload(seed: int) -> list[harness.RequestSpec]:
    """Ten prompts of 2k-26k tokens, four of them opening with the same 12k tokens, decoding
    300-1200 tokens each: window and chunk groups free most of each table as they go."""
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, 30000) for _ in range(n))

    shared = tokens(12000)
    return [
        harness.RequestSpec(
            f"long-{i}",
            (shared if i % 3 == 0 else ()) + tokens(rng.randrange(2000, 14000)),
            rng.randrange(300, 1200),
            arrival_step=25 * i,
        )
        for i in range(10)
    ]


# Long sequences under vLLM's default retention, with room (requests run side by side and hit
# the shared prefix) and with a pool that holds about one of them at a time.
@pytest.mark.parametrize(
    "layout,num_blocks",
    [
        ("gpt-oss", 20000),
        ("gpt-oss", 3000),
        ("odd-window", 20000),
        ("odd-window", 3000),
        ("gemma3", 30000),
        ("gemma3", 9000),
        ("llama4", 20000),
        ("llama4", 4000),
    ],
)
def test_same_outputs_as_vllm_on_long_contexts(layout: str, num_blocks: int) -> None:
    options = harness.Options(
        layout=layout,
        num_blocks=num_blocks,
        dense_retention=False,
        max_model_len=32768,
        max_num_batched_tokens=4096,
        max_num_seqs=8,
    )
    run = run_both(options, long_context_workload(5))
    if num_blocks >= 20000:
        assert run.hits > 0


# Mamba-2 layers export the prompt's checkpoint from inside the final chunk into one more block:
# vLLM's scheduler then leaves that chunk whole, and both managers must reserve, hand out and
# cache the same blocks. Pressure forces preemptions (re-admissions replaying outputs) and
# frees of checkpoint blocks; dense retention lets every chunk export one.
@pytest.mark.parametrize(
    "dense,num_blocks",
    [(True, 700), (False, 700), (True, 20000), (False, 20000)],
    ids=["dense-pressure", "default-pressure", "dense-room", "default-room"],
)
def test_same_outputs_as_vllm_with_mamba2_prefill_checkpoints(dense: bool, num_blocks: int) -> None:
    options = harness.Options(layout="granite4", num_blocks=num_blocks, dense_retention=dense)
    run = run_both(options, WORKLOAD)
    assert run.hits > 0 and run.two_states > 0
    assert (run.preempted > 0) == (num_blocks < 1000)


def test_same_outputs_as_vllm_with_mamba2_prefill_checkpoints_and_small_chunks() -> None:
    # Chunks of 96 tokens: prompts prefill over several chunks, the last one may or may not be
    # long enough to export the checkpoint.
    options = harness.Options(layout="granite4", num_blocks=900, max_num_batched_tokens=96)
    run = run_both(options, WORKLOAD)
    assert run.hits > 0 and run.two_states > 0


def test_same_outputs_as_vllm_on_mamba2_without_prefix_caching() -> None:
    options = harness.Options(layout="granite4", num_blocks=700, prefix_caching=False)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0


# ------------------------------------------------------------------------------ construction


def test_scheduler_is_vllms_with_hybrid_kv_manager() -> None:
    scheduler = harness.build_scheduler(harness.Options(layout="gemma3"), hkv.Scheduler)
    assert isinstance(scheduler, VllmScheduler)
    assert not isinstance(scheduler, VllmAsyncScheduler)
    assert isinstance(scheduler.kv_cache_manager, hkv.HybridKVCacheManager)
    assert scheduler.kv_cache_manager.core.num_groups == 7


def test_async_scheduling_picks_the_async_variant_from_the_same_class_name() -> None:
    options = harness.Options(layout="full", async_scheduling=True)
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    assert isinstance(scheduler, hkv.AsyncScheduler)
    assert isinstance(scheduler, VllmAsyncScheduler)
    assert scheduler.uses_hybrid_kv


def test_construction_restores_vllms_manager_class() -> None:
    from vllm.v1.core.sched import scheduler as vllm_scheduler_module

    harness.build_scheduler(harness.Options(), hkv.Scheduler)
    assert vllm_scheduler_module.KVCacheManager is VllmKVCacheManager
    stock = harness.build_scheduler(harness.Options())
    assert type(stock.kv_cache_manager) is VllmKVCacheManager


def test_a_stock_scheduler_built_by_another_thread_meanwhile_keeps_vllms_manager() -> None:
    # While hybrid-kv's scheduler is built, the name vLLM's scheduler module builds its manager
    # by is rebound; a stock vLLM scheduler another thread builds meanwhile (two in-process
    # engines started together) still gets vLLM's own manager, for its own arguments.
    import threading

    from hybrid_kv.vllm import scheduler as plugin

    options = harness.Options(layout="gpt-oss", num_blocks=300)
    built: list[Any] = []
    build = plugin.build_kv_cache_manager
    calls = []

    def build_while_another_thread_builds_stock(*args: Any) -> Any:
        calls.append(threading.current_thread())
        if len(calls) == 1:
            other = threading.Thread(
                target=lambda: built.append(harness.build_scheduler(options, VllmScheduler))
            )
            other.start()
            other.join()
        return build(*args)

    with mock.patch.object(
        plugin, "build_kv_cache_manager", build_while_another_thread_builds_stock
    ):
        ours = harness.build_scheduler(harness.Options(), hkv.Scheduler)
    assert ours.uses_hybrid_kv
    assert calls == [threading.current_thread()]
    (stock,) = built
    assert type(stock.kv_cache_manager) is VllmKVCacheManager
    assert stock.kv_cache_manager.block_pool.num_gpu_blocks == 300


def _context(options: harness.Options, **config_changes: Any) -> hkv.BuildContext:
    config = harness.vllm_config(options)
    for name, value in config_changes.items():
        object.__setattr__(config, name, value)
    kv = harness.kv_cache_config(options)
    scheduler = harness.build_scheduler(options)  # vLLM's own: records the manager's arguments
    manager = scheduler.kv_cache_manager
    kwargs = {
        "kv_cache_config": kv,
        "max_model_len": options.max_model_len,
        "scheduler_block_size": options.block_size,
        "hash_block_size": options.block_size,
        "enable_caching": manager.enable_caching,
        "use_eagle": manager.use_eagle,
        "dcp_world_size": 1,
        "pcp_world_size": 1,
    }
    return hkv.BuildContext(config, kv, kwargs)


@pytest.mark.parametrize(
    "layout,unit,expected",
    [("jamba", 8, 8), ("jamba-2x", None, 16), ("gpt-oss", 8, 16), ("gemma3", None, 16)],
)
def test_the_hit_alignment_vllms_engine_core_sets_is_served(
    layout: str, unit: int | None, expected: int
) -> None:
    # vLLM's EngineCore writes where hits land into the KVCacheConfig before it builds the
    # scheduler: the hash block with fine-grained partial hash hits, else the scheduler block.
    options = harness.Options(layout=layout, prefix_match_unit=unit, dense_retention=False)
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    assert scheduler.kv_cache_manager.kv_cache_config.cache_hit_alignment_tokens == expected
    assert scheduler.uses_hybrid_kv
    # A value vLLM's coordinator would not use falls back (a connector reading it would
    # disagree with the manager's hits).
    ctx = _context(options)
    kwargs = {
        **ctx.manager_kwargs,
        "scheduler_block_size": scheduler.block_size,
        "hash_block_size": scheduler.hash_block_size,
    }
    served = scheduler.kv_cache_manager.kv_cache_config
    assert hkv.fallback_reason(hkv.BuildContext(ctx.vllm_config, served, kwargs)) is None
    changed = dataclasses.replace(served, cache_hit_alignment_tokens=expected * 2)
    reason = hkv.fallback_reason(hkv.BuildContext(ctx.vllm_config, changed, kwargs))
    assert reason is not None and "cache_hit_alignment_tokens" in reason


@pytest.mark.parametrize("lookahead,falls_back", [(15, False), (16, True)])
def test_prompt_embeddings_with_lookahead_hashes_of_a_hash_block_fall_back(
    lookahead: int, falls_back: bool
) -> None:
    # A block's embeddings key sits between the lookahead of the block before it and the
    # block's own end: there is no such position when the lookahead is a hash block (16) long.
    ctx = _context(harness.Options(layout="gpt-oss", prompt_embeds=True))
    ctx = hkv.BuildContext(
        ctx.vllm_config,
        ctx.kv_cache_config,
        {**ctx.manager_kwargs, "num_hash_lookahead_tokens": lookahead},
    )
    reason = hkv.fallback_reason(ctx)
    if falls_back:
        assert reason is not None and "enable_prompt_embeds" in reason
    else:
        assert reason is None


@pytest.mark.parametrize(
    "manager_kwargs,option",
    [
        ({"dcp_world_size": 2}, "context parallelism"),
        ({"metrics_collector": object()}, "kv_cache_metrics"),
    ],
)
def test_unsupported_manager_arguments_have_a_fallback_reason(
    manager_kwargs: dict[str, Any], option: str
) -> None:
    ctx = _context(harness.Options(layout="gpt-oss"))
    ctx = hkv.BuildContext(
        ctx.vllm_config, ctx.kv_cache_config, {**ctx.manager_kwargs, **manager_kwargs}
    )
    reason = hkv.fallback_reason(ctx)
    assert reason is not None and option in reason


def _hashed_every_8(layout: str, num_blocks: int, changes: dict) -> tuple[harness.Options, Any]:
    """Default retention and `changes`, requests hashed every 8 tokens (blocks of 16); and
    stock vLLM's scheduler for them."""
    settings = {"dense_retention": False, **changes}
    options = harness.Options(layout=layout, num_blocks=num_blocks, prefix_match_unit=8, **settings)
    stock = harness.build_scheduler(options)
    assert (stock.block_size, stock.hash_block_size) == (16, 8)
    return options, stock


@pytest.mark.parametrize(
    "layout,num_blocks,changes",
    [
        ("gpt-oss", 330, {"dense_retention": True}),
        ("gpt-oss", 290, {}),
        ("gemma3", 1400, {}),
        ("gemma3", 1400, {"eagle_tokens": 3, "eagle_lookahead_hashes": False}),
        ("gpt-oss", 330, {"async_scheduling": True, "eagle_tokens": 2, "eagle_method": "mtp"}),
    ],
)
def test_same_outputs_as_vllm_with_a_prefix_match_unit_below_the_full_attention_block(
    layout: str, num_blocks: int, changes: dict
) -> None:
    # Requests hashed every 8 tokens, blocks of 16: vLLM also keys each full-attention block
    # holding a prompt's last hash boundary at that boundary (a second key of the block).
    options, _ = _hashed_every_8(layout, num_blocks, changes)
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0 and run.hits > 0


def test_a_full_attention_block_larger_than_the_hash_block_is_served() -> None:
    # Full attention with twice the window groups' block size: hashes every 16 tokens, full
    # blocks of 32 with a second key at a prompt's tail.
    ctx = _context(harness.Options(layout="gpt-oss"))
    full = ctx.kv_cache_config.kv_cache_groups[0]
    full.kv_cache_spec = dataclasses.replace(full.kv_cache_spec, block_size=32)
    assert hkv.fallback_reason(ctx) is None


def test_a_mamba_block_larger_than_the_hash_block_is_served() -> None:
    # vLLM's coordinator turns fine-grained partial hash hits on for such a Mamba group.
    options = harness.Options(layout="jamba")
    ctx = _context(options)
    mamba = ctx.kv_cache_config.kv_cache_groups[1]
    mamba.kv_cache_spec = dataclasses.replace(mamba.kv_cache_spec, block_size=32)
    assert hkv.fallback_reason(ctx) is None


def _ending_inside_a_block(spec: harness.RequestSpec) -> harness.RequestSpec:
    # 13 tokens past a block boundary: a resend hits up to the prompt's last hash boundary
    # (8 tokens into the block).
    n = len(spec.prompt) - (len(spec.prompt) - 13) % 16
    return dataclasses.replace(spec, prompt=spec.prompt[:n])


# The chat workload with prompts ending inside blocks, then the first 24 prompts sent again.
_INSIDE = [_ending_inside_a_block(spec) for spec in WORKLOAD]
RESENT_WORKLOAD = _INSIDE + [
    dataclasses.replace(spec, request_id=f"again-{i}", arrival_step=spec.arrival_step + 30)
    for i, spec in enumerate(_INSIDE[:24])
]

_EAGLE = {"eagle_tokens": 2, "eagle_lookahead_hashes": False}


@pytest.mark.parametrize(
    "layout,num_blocks,changes",
    [
        # With room: resends hit inside blocks.
        ("jamba", 20000, {}),
        ("granite4", 20000, {}),
        ("jamba", 20000, {"dense_retention": True}),
        # Under memory pressure: preemptions.
        ("jamba", 400, {}),
        ("granite4", 400, {}),
        ("jamba", 700, {"async_scheduling": True}),
        ("jamba", 700, {"ngram_tokens": 3}),
        ("granite4", 700, {"eagle_tokens": 2, "eagle_method": "mtp"}),
        ("granite4", 700, _EAGLE),
        # Shared-prefix junctions keyed inside blocks: partial hits under pressure too.
        ("jamba", 700, {**_EAGLE, "mamba_shared_prefix_checkpoint": True}),
        ("granite4", 700, {**_EAGLE, "mamba_shared_prefix_checkpoint": True}),
    ],
)
def test_same_outputs_as_vllm_with_partial_hash_hits(
    layout: str, num_blocks: int, changes: dict
) -> None:
    # Requests hashed every 8 tokens, Mamba (and full-attention) blocks of 16: vLLM's hybrid
    # coordinator lets hits end on any hash boundary, inside blocks; a hit's shared tail block
    # and a Mamba state a request keyed inside the block it writes on into are copied
    # (`kv_cache_block_copies` in the scheduler outputs), the copies' ends retained until the
    # scheduler frees them.
    options, stock = _hashed_every_8(layout, num_blocks, changes)
    assert stock.kv_cache_manager.coordinator.enable_partial_hash_hits
    kept: list[Any] = []
    run = run_both(options, RESENT_WORKLOAD, watch=kept.append)
    (ours,) = kept
    assert ours.kv_cache_manager.coordinator.enable_partial_hash_hits
    assert (
        ours.kv_cache_manager.mamba_shared_prefix_checkpoint
        == stock.kv_cache_manager.mamba_shared_prefix_checkpoint
        == changes.get("mamba_shared_prefix_checkpoint", False)
    )
    assert run.hits > 0
    if num_blocks < 20000:
        assert run.preempted > 0, "the pool should be small enough to preempt"
    if num_blocks == 20000 or changes.get("mamba_shared_prefix_checkpoint"):
        assert run.partial_hits > 0, "some hit should end inside a block"
    if layout == "jamba" or changes.get("mamba_shared_prefix_checkpoint"):
        # Granite-4's Mamba layers export the prompt's state into a block of its own: copies
        # come from hits inside blocks only.
        assert run.copies > 0
    # Every retained block went back.
    assert ours.kv_cache_manager.core.num_retained_blocks == 0


def test_a_checkpoint_rekeyed_block_defers_no_hit_on_its_former_key() -> None:
    # Granite-4, hashes every 8 tokens. X (40 tokens) exports its prompt state at 32 into slot 1,
    # keyed at 32. A step later A (41 tokens sharing X's first 32, prompt logprobs: no hit)
    # caches its slot 1 at 32 too, and its exported checkpoint (40) re-keys that block at once;
    # C (sharing the 32 tokens), admitted in the same step, hits X's state. vLLM counts A's block
    # cached this step under its checkpoint key only, so C does not wait a step.
    shared = tuple(range(1, 33))

    def spec(name: str, tail: range, step: int, logprobs: int | None = None) -> harness.RequestSpec:
        return harness.RequestSpec(name, shared + tuple(tail), 4, step, prompt_logprobs=logprobs)

    workload = [
        spec("x", range(500, 508), 0),
        spec("a", range(600, 609), 1, logprobs=1),
        spec("c", range(700, 709), 1),
    ]
    options = harness.Options(layout="granite4", num_blocks=20000, prefix_match_unit=8)
    run = run_both(options, workload)
    assert run.hits > 0


@pytest.mark.parametrize("unit", [8, 16])
@pytest.mark.parametrize(
    "num_blocks,changes",
    [(20000, {}), (700, {**_EAGLE, "mamba_shared_prefix_checkpoint": True})],
)
def test_same_outputs_as_vllm_with_mamba_blocks_larger_than_the_attention_blocks(
    unit: int, num_blocks: int, changes: dict
) -> None:
    # Mamba blocks of 32, full-attention blocks of 16: hits on the scheduler block (32) would
    # be block-aligned; with hashes every 8 or 16 tokens vLLM's hits land inside Mamba blocks.
    options = harness.Options(
        layout="jamba-2x",
        num_blocks=num_blocks,
        prefix_match_unit=unit,
        dense_retention=False,
        **changes,
    )
    stock = harness.build_scheduler(options)
    assert (stock.block_size, stock.hash_block_size) == (32, unit)
    assert stock.kv_cache_manager.coordinator.enable_partial_hash_hits
    run = run_both(options, RESENT_WORKLOAD)
    assert run.hits > 0 and run.copies > 0
    if num_blocks < 20000:
        assert run.preempted > 0


def test_unsupported_configuration_builds_vllms_own_manager() -> None:
    options = harness.Options(layout="gemma3")
    config = harness.vllm_config(options)
    config.observability_config.kv_cache_metrics = True
    scheduler = harness.build_scheduler(options, hkv.Scheduler, config)
    assert type(scheduler.kv_cache_manager) is VllmKVCacheManager
    assert not scheduler.uses_hybrid_kv


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def vllm_log() -> Iterator[list[logging.LogRecord]]:
    """Records that reach the handlers of vLLM's `vllm` logger, with vLLM's logging configured
    as `vllm serve` configures it (its own handler on `vllm` only, which does not propagate)."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    root = logging.getLogger("vllm")
    saved = (root.handlers[:], root.level, root.propagate, logging.getLogRecordFactory())
    configure_logging(LoggingConfig())
    assert any(h.name == "vllm" for h in root.handlers) and not root.propagate
    records = _Records()
    root.addHandler(records)
    try:
        yield records.records
    finally:
        root.handlers[:], root.level, root.propagate = saved[:3]
        logging.setLogRecordFactory(saved[3])


def _hybrid_kv_lines(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.getMessage().startswith("hybrid-kv:")]


def test_the_fallback_reason_is_one_line_in_vllms_log(vllm_log) -> None:
    options = harness.Options(layout="gemma3")
    config = harness.vllm_config(options)
    config.observability_config.kv_cache_metrics = True
    scheduler = harness.build_scheduler(options, hkv.Scheduler, config)
    assert not scheduler.uses_hybrid_kv
    (line,) = _hybrid_kv_lines(vllm_log)
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        "hybrid-kv: using vLLM's own KV cache manager: kv_cache_metrics"
    )
    assert line.name.startswith("vllm.")


def _without_kv_cache_groups(options: harness.Options, scheduler_cls: Any = None) -> Any:
    """The scheduler for `options` over no KV cache group (an attention-free model's)."""
    with mock.patch.dict(harness.LAYOUTS, {options.layout: lambda block_size: []}):
        return harness.build_scheduler(options, scheduler_cls)


def test_no_kv_cache_group_with_prefix_caching_fails_as_vllm_does(vllm_log) -> None:
    # vLLM 0.33's prefix-caching coordinator fails an assertion building its manager over no
    # group; the scheduler falls back to that manager, so it fails the same way, after the
    # one line saying why.
    errors = []
    for scheduler_cls in (None, hkv.Scheduler):
        with pytest.raises(AssertionError) as error:
            _without_kv_cache_groups(harness.Options(), scheduler_cls)
        errors.append((str(error.value), error.traceback[-1].name))
    assert errors[0] == (
        "HybridKVCacheCoordinator requires at least one cacheable group.",
        "verify_and_split_kv_cache_groups",
    )
    assert errors[1] == errors[0]
    (line,) = _hybrid_kv_lines(vllm_log)
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        "hybrid-kv: using vLLM's own KV cache manager: no KV cache group, with prefix caching"
    )


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_pool_of_the_null_block_alone_is_vllms_managers(vllm_log, prefix_caching: bool) -> None:
    # vLLM builds its manager over one block (the null block: nothing can be allocated); the
    # core refuses such a pool, so vLLM's manager serves it, after the one line saying why
    # (the scheduler's build raised the core's error).
    options = harness.Options(num_blocks=1, prefix_caching=prefix_caching)
    stock = harness.build_scheduler(options)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert not ours.uses_hybrid_kv
    assert type(ours.kv_cache_manager) is type(stock.kv_cache_manager)
    (line,) = _hybrid_kv_lines(vllm_log)
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        "hybrid-kv: using vLLM's own KV cache manager: num_blocks must be at least 2"
    )


@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_no_kv_cache_group_without_prefix_caching_is_served_as_vllm(chunked_prefill: bool) -> None:
    options = harness.Options(prefix_caching=False, max_num_seqs=4, chunked_prefill=chunked_prefill)
    stock = _without_kv_cache_groups(options)
    ours = _without_kv_cache_groups(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv
    steps = 0
    for (stock_out, stock_results), (our_out, our_results) in zip(
        harness.Driver(stock, WORKLOAD).run(), harness.Driver(ours, WORKLOAD).run(), strict=True
    ):
        assert harness.summarize(our_out) == harness.summarize(stock_out), f"step {steps}"
        assert harness.summarize_results(our_results) == harness.summarize_results(stock_results)
        steps += 1
    assert steps > len(WORKLOAD)


def test_prefix_cache_resets_are_logged_as_vllms(vllm_log) -> None:
    # An operator resetting the prefix cache (after a weight update) reads in vLLM's log
    # whether it took effect, and why not.
    results = []
    for scheduler_cls in (None, hkv.Scheduler):
        scheduler = harness.build_scheduler(harness.Options(layout="gpt-oss"), scheduler_cls)
        harness.Driver(scheduler, WORKLOAD[:4]).schedule()  # running requests hold blocks
        start = len(vllm_log)
        refused = scheduler.reset_prefix_cache()
        forced = scheduler.reset_prefix_cache(reset_running_requests=True)
        lines = [
            (r.levelno, r.getMessage())
            for r in vllm_log[start:]
            if "reset prefix cache" in r.getMessage()
        ]
        results.append((refused, forced, lines))
    assert results[0][:2] == (False, True) and len(results[0][2]) == 2
    assert results[1] == results[0]


def test_a_served_scheduler_says_so_in_vllms_log(vllm_log) -> None:
    options = harness.Options(layout="gemma3")
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    assert scheduler.uses_hybrid_kv
    (line,) = _hybrid_kv_lines(vllm_log)
    assert line.levelno == logging.INFO
    assert line.getMessage() == (
        f"hybrid-kv: KV cache manager for 7 group(s), {options.num_blocks} blocks"
    )


def test_kv_connector_falls_back() -> None:
    from vllm.config import KVTransferConfig

    ctx = _context(
        harness.Options(),
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"),
    )
    reason = hkv.fallback_reason(ctx)
    assert reason is not None and reason.startswith("kv_transfer_config")


def test_unknown_group_kind_falls_back() -> None:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, KVCacheGroupSpec

    options = harness.Options()
    ctx = _context(options)
    ctx.kv_cache_config.kv_cache_groups.append(
        KVCacheGroupSpec(
            ["cross"],
            CrossAttentionSpec(
                block_size=16, num_kv_heads=8, head_size=128, dtype=harness.torch.float16
            ),
        )
    )
    reason = hkv.fallback_reason(ctx)
    assert reason is not None and "CrossAttentionSpec" in reason


def test_supported_configurations_have_no_fallback_reason() -> None:
    for layout in ("full", "gpt-oss", "gemma3", "llama4", "jamba", "granite4", "mixed-bs"):
        assert hkv.fallback_reason(_context(harness.Options(layout=layout))) is None
    assert hkv.fallback_reason(_context(harness.Options(prompt_embeds=True))) is None
    assert (
        hkv.fallback_reason(_context(harness.Options(layout="jamba", prefix_caching=False))) is None
    )
    for eagle in ("eagle3", "mtp"):
        options = harness.Options(layout="granite4", eagle_tokens=2, eagle_method=eagle)
        assert hkv.fallback_reason(_context(options)) is None


def test_block_ids_cross_as_lists_of_ints() -> None:
    scheduler = harness.build_scheduler(harness.Options(layout="gpt-oss"), hkv.Scheduler)
    driver = harness.Driver(scheduler, WORKLOAD[:4])
    output = driver.schedule()
    assert output.scheduled_new_reqs
    for new in output.scheduled_new_reqs:
        assert isinstance(new.block_ids, tuple) and len(new.block_ids) == 2
        for group in new.block_ids:
            assert type(group) is list and all(type(b) is int for b in group)


@pytest.mark.parametrize("kv_events", [False, True])
def test_the_shared_empty_result_reads_as_an_empty_kv_cache_blocks(kv_events: bool) -> None:
    # The manager's `empty_kv_cache_blocks` must read as vLLM's empty `KVCacheBlocks` does, and
    # be what a running step that allocated nothing returns (inside the horizon or not).
    options = harness.Options(layout="gemma3", kv_events=kv_events)
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    stock = harness.build_scheduler(options, None)
    ours, theirs = (
        scheduler.kv_cache_manager.empty_kv_cache_blocks,
        (stock.kv_cache_manager.empty_kv_cache_blocks),
    )
    groups = len(theirs.get_block_ids())
    assert groups == 7
    for allow_none in (False, True):
        assert ours.get_block_ids(allow_none) == theirs.get_block_ids(allow_none)
        assert ours.get_block_ids(allow_none=allow_none) == theirs.get_block_ids(
            allow_none=allow_none
        )
        for group_ids in ([0], [2, 5], []):
            assert ours.get_block_ids(allow_none, group_ids=group_ids) == (
                theirs.get_block_ids(allow_none, group_ids=group_ids)
            )
    lists = ours.get_block_ids()
    assert all(type(g) is list and not g for g in lists) and lists is not ours.get_block_ids()
    assert ours.is_empty() and ours.new_empty().is_empty()
    assert ours.new_empty().get_block_ids() == theirs.new_empty().get_block_ids()
    assert (ours + ours).get_block_ids() == theirs.get_block_ids()
    with pytest.raises(NotImplementedError):
        ours.blocks  # noqa: B018
    # Its `get_block_ids` is a direct entry: every call reads as `KVCacheBlocks.get_block_ids`
    # does (the keyword's name made at run time, not the interned constant, too), and a bad
    # one raises as it does.
    plain = KVCacheBlocks(ids=tuple(_ids for _ids in ours._arrays()), empty=True)
    assert ours.get_block_ids(**{"".join(["allow", "_none"]): True}) is None
    assert ours.get_block_ids(1) == plain.get_block_ids(1) is None
    bad_calls: list[tuple[tuple, dict]] = [
        ((True, 2), {}),
        ((), {"bogus": 1}),
        ((True,), {"allow_none": True}),
    ]
    for args, kwargs in bad_calls:
        with pytest.raises(TypeError) as raised:
            ours.get_block_ids(*args, **kwargs)
        with pytest.raises(TypeError) as expected:
            plain.get_block_ids(*args, **kwargs)
        assert str(raised.value) == str(expected.value)
    with pytest.raises(TypeError, match="get_block_ids"):
        type(ours).get_block_ids(plain, True)
    # Added to a hit, either way round, it changes nothing.
    driver = harness.Driver(scheduler, WORKLOAD[:6])
    for _ in range(30):
        driver.timed_step()
    request = next(iter(scheduler.running))
    blocks = scheduler.kv_cache_manager.get_blocks(request.request_id)
    assert blocks.get_block_ids() and any(blocks.get_block_ids())
    assert (blocks + ours).get_block_ids() == blocks.get_block_ids()
    assert (ours + blocks).get_block_ids() == blocks.get_block_ids()
    # A running step that allocates nothing returns it, inside the horizon or from the core.
    returned = []
    allocate = scheduler.kv_cache_manager.allocate_slots

    def keep(*args: Any, **kwargs: Any) -> Any:
        result = allocate(*args, **kwargs)
        returned.append(result)
        return result

    scheduler.kv_cache_manager.allocate_slots = keep
    for _ in range(20):
        driver.timed_step()
    empties = [r for r in returned if r is ours]
    assert empties and all(r is ours or r is None or r.get_block_ids(True) for r in returned)


def _refusals(results: list[Any]) -> list[Any]:
    return [
        out
        for outputs in results
        for eco in outputs.values()
        for out in eco.outputs
        if out.finish_reason is not None and out.error is not None
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("alone", [False, True])
def test_streaming_input_requests_are_refused_and_the_engine_serves_the_rest(
    async_scheduling: bool, alone: bool
) -> None:
    """A streaming-input (resumable) request is not served differently, nor does it stop the
    engine loop: it gets one error output (a validation error, vLLM's 400) at the next
    `update_from_output`, and every other request runs as it would without it."""
    options = harness.Options(layout="gpt-oss", async_scheduling=async_scheduling)
    workload = [] if alone else WORKLOAD[:6]
    plain = harness.Driver(harness.build_scheduler(options, hkv.Scheduler), workload)
    expected = [(harness.summarize(o), harness.summarize_results(r)) for o, r in plain.run()]

    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    assert scheduler.uses_hybrid_kv
    streaming = harness.make_request(dataclasses.replace(WORKLOAD[7], request_id="stream"))
    streaming.resumable = True
    scheduler.add_request(streaming)  # no exception: that would stop the engine loop
    assert "stream" not in scheduler.requests
    assert scheduler.has_requests()  # the engine keeps stepping until the refusal is out
    driver = harness.Driver(scheduler, workload)
    got, refusals = [], []
    for output, results in driver.run(max_steps=10_000):
        assert "stream" not in output.num_scheduled_tokens
        refusals += _refusals(results)
        for outputs in results:
            for eco in outputs.values():
                eco.outputs = [o for o in eco.outputs if o.request_id != "stream"]
        got.append((harness.summarize(output), harness.summarize_results(results)))
    assert len(refusals) == 1
    (refusal,) = refusals
    assert refusal.request_id == "stream"
    assert refusal.finish_reason == FinishReason.ERROR
    assert refusal.error.code == "validation_error"
    assert "streaming-input" in refusal.error.message
    assert not scheduler.has_requests()
    if alone:
        assert len(got) >= 1
    else:
        # The other requests' steps and outputs are those of the run without the refusal.
        assert got == expected


def _assert_refused_alone(options: harness.Options, bad: Any, message: str) -> None:
    """`bad` is refused when added (not queued, no exception): it gets one validation error at
    the next `update_from_output` naming the problem (`message`), and the other requests run
    as they would without it."""
    workload = WORKLOAD[:4]
    plain = harness.Driver(harness.build_scheduler(options, hkv.Scheduler), workload)
    expected = [(harness.summarize(o), harness.summarize_results(r)) for o, r in plain.run()]

    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    assert scheduler.uses_hybrid_kv
    scheduler.add_request(bad)  # no exception: that would stop the engine loop
    assert bad.request_id not in scheduler.requests
    got, refusals = [], []
    for output, results in harness.Driver(scheduler, workload).run(max_steps=10_000):
        refusals += _refusals(results)
        for outputs in results:
            for eco in outputs.values():
                eco.outputs = [o for o in eco.outputs if o.request_id != bad.request_id]
        got.append((harness.summarize(output), harness.summarize_results(results)))
    (refusal,) = refusals
    assert refusal.request_id == bad.request_id
    assert refusal.finish_reason == FinishReason.ERROR
    assert refusal.error.code == "validation_error"
    assert message in refusal.error.message
    assert got == expected


@pytest.mark.parametrize(
    "field,changes",
    [
        ("request id", {"request_id": "bad\ud800"}),
        ("cache_salt", {"cache_salt": "tenant\udfff"}),
        ("LoRA adapter", {"lora": ("alpha\ud800", 1, "/adapters/alpha")}),
        ("multimodal identifier", {"mm": (("image\udc80", 3, 20),)}),
    ],
)
def test_requests_with_text_that_is_not_unicode_are_refused_and_the_engine_serves_the_rest(
    field: str, changes: dict[str, Any]
) -> None:
    """A string holding a lone surrogate (valid in Python, not Unicode: an in-process engine
    can be handed one; vLLM's own msgpack transport cannot carry it) cannot key hybrid-kv's
    tables. Such a request does not stop the engine loop (the manager would raise inside
    `schedule()`): it gets one validation error at the next `update_from_output`, and the other
    requests run as they would without it."""
    options = harness.Options(layout="gpt-oss", lora=True)
    spec = dataclasses.replace(WORKLOAD[7], **{"request_id": "bad", **changes})
    _assert_refused_alone(options, harness.make_request(spec), f"{field} is not valid Unicode")


def _with_token(token: Any, position: int) -> tuple[Any, ...]:
    """A 40-token prompt (two full 16-token blocks and a tail of 8) holding `token` at
    `position`."""
    prompt: list[Any] = list(range(100, 140))
    prompt[position] = token
    return tuple(prompt)


def _set(attribute: str, value: Any) -> Callable[[Any], None]:
    def change(request: Any) -> None:
        target = request.mm_features[0] if attribute == "identifier" else request
        setattr(target, attribute, value)

    return change


def _without_block_hasher(request: Any) -> None:
    # As `Request(..., block_hasher=None)` makes it.
    request._block_hasher = None
    request.block_hashes = []


def _append(tokens: list[Any]) -> Callable[[Any], None]:
    def change(request: Any) -> None:
        request.append_output_token_ids(tokens)

    return change


@pytest.mark.parametrize(
    "changes,options,change,message",
    [
        # Token ids the core (u32 tokens) cannot hold, where it reads them: in the tail after
        # vLLM's hashed blocks, anywhere when it hashes the prompt itself (no prefix caching, or
        # an xxHash option), and in the hashed blocks too when KV events will read them.
        ({"prompt": _with_token(2**32, 38)}, {}, None, "prompt_token_ids[38] is 4294967296"),
        ({"prompt": _with_token(-1, 20)}, {"prefix_caching": False}, None, "[20] is -1, not a"),
        ({"prompt": _with_token(-1, 20)}, {"hash_algo": "xxhash"}, None, "[20] is -1, not a"),
        ({"prompt": _with_token(2**64, 3)}, {"kv_events": True}, None, "[3] is 184467"),
        ({"prompt": _with_token(5.0, 38)}, {}, None, "prompt_token_ids[38] is 5.0, not a"),
        ({"prompt": _with_token(None, 38)}, {}, None, "prompt_token_ids[38] is None, not a"),
        ({"prompt": ()}, {}, None, "prompt is empty"),
        ({"prompt": ()}, {"prefix_caching": False}, None, "prompt is empty"),
        # Multimodal placeholders the core cannot key (vLLM's processor makes none of them).
        ({"mm": (("img", -5, 10),)}, {}, None, "item 0's mm_position (offset -5, length 10)"),
        ({"mm": (("img", 5, 0),)}, {}, None, "item 0's mm_position length is 0, not positive"),
        ({"mm": (("img", 2**70, 1),)}, {}, None, "does not lie in [0, 2^63)"),
        ({"mm": (("img", 5.0, 3),)}, {}, None, "offset and length are not ints"),
        # Keyed text that is not a string.
        ({}, {}, _set("cache_salt", b"salt"), "cache_salt is of type bytes, not str"),
        ({}, {}, _set("cache_salt", 7), "cache_salt is of type int, not str"),
        ({"mm": (("img", 3, 20),)}, {}, _set("identifier", 7), "identifier is of type int"),
        # Output tokens a caller appended before handing the request over.
        ({}, {}, _append([7, 2**32]), "output_token_ids[1] is 4294967296, not a token id"),
        # Tokens counted computed in blocks it does not hold (a KV connector's requests only).
        ({}, {}, _set("num_computed_tokens", 5), "num_computed_tokens is 5 on arrival, not 0"),
        # No block hasher with prefix caching on (vLLM's engine core gives every request one):
        # vLLM's manager finds and caches no block of it; KV events would read its hashes.
        ({}, {"hash_algo": "xxhash"}, _without_block_hasher, "whose block hasher is missing"),
        ({}, {"kv_events": True}, _without_block_hasher, "whose block hasher is missing"),
        # Longer than max_model_len (16384 here), which vLLM's scheduler schedules (with slots
        # for max_model_len tokens only) and the core refuses to allocate: a prompt, and a
        # prompt whose outputs on arrival pass it.
        (
            {"prompt": tuple(range(16385))},
            {},
            None,
            "length (16385 tokens) is above max_model_len 16384",
        ),
        (
            {"prompt": tuple(range(16380))},
            {},
            _append(list(range(10))),
            "length (16390 tokens) is above max_model_len 16384",
        ),
    ],
    ids=[
        "token-2**32-tail",
        "token-negative-no-caching",
        "token-negative-xxhash",
        "token-2**64-hashed-kv-events",
        "token-float",
        "token-none",
        "empty-prompt",
        "empty-prompt-no-caching",
        "mm-negative-offset",
        "mm-zero-length",
        "mm-offset-beyond-2**63",
        "mm-float-offset",
        "salt-bytes",
        "salt-int",
        "mm-identifier-int",
        "outputs-on-arrival",
        "computed-on-arrival",
        "no-block-hasher-xxhash",
        "no-block-hasher-kv-events",
        "prompt-above-max-model-len",
        "outputs-past-max-model-len",
    ],
)
def test_requests_the_core_cannot_hold_are_refused_and_the_engine_serves_the_rest(
    changes: dict[str, Any],
    options: dict[str, Any],
    change: Callable[[Any], None] | None,
    message: str,
) -> None:
    """vLLM's scheduler takes these (its frontend refuses them; an in-process engine or another
    frontend can hand them over) and hybrid-kv's manager cannot hold them: each is refused when
    added, with a validation error naming the field, instead of raising inside `schedule()` (or
    `add_request`) and stopping the engine loop for every client."""
    config = dataclasses.replace(harness.Options(layout="gpt-oss"), **options)
    spec = dataclasses.replace(WORKLOAD[7], **{"request_id": "bad", **changes})
    scheduler = harness.build_scheduler(config, hkv.Scheduler)
    bad = harness.make_request(
        spec,
        scheduler.hash_block_size,
        scheduler.vllm_config.num_hash_lookahead_tokens,
        config.hash_algo,
    )
    if change is not None:
        change(bad)
    _assert_refused_alone(config, bad, message)


# ----- running horizon ----------------------------------------------------------------------------


def _count_core_running_calls(scheduler: Any, counts: dict[str, int]) -> None:
    manager = scheduler.kv_cache_manager
    allocate = manager.allocate_slots

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        slot = request.__dict__.get(manager._key)
        before = 0 if slot is None else slot.running_calls
        result = allocate(request, *args, **kwargs)
        if slot is not None and "new_computed_blocks" not in kwargs:
            counts["running"] += 1
            counts["core"] += slot.running_calls - before
        return result

    manager.allocate_slots = allocate_slots


@pytest.mark.parametrize(
    "layout,changes",
    [
        ("full", {}),
        ("gemma3", {}),
        ("gpt-oss", {"dense_retention": True}),
        ("llama4", {}),
        ("gpt-oss", {"async_scheduling": True}),
        ("gemma3", {"num_blocks": 1400}),
    ],
    ids=["full", "gemma3", "gpt-oss-dense", "llama4", "gpt-oss-async", "gemma3-pressure"],
)
def test_running_steps_inside_the_horizon_skip_the_core_and_match_vllm(
    layout: str, changes: dict
) -> None:
    # Decode steps that change nothing are answered without a core call; the outputs stay
    # vLLM's step for step, preemptions and async scheduling included.
    counts = {"running": 0, "core": 0}
    options = dataclasses.replace(harness.Options(layout=layout), **changes)
    run = run_both(options, WORKLOAD, watch=lambda s: _count_core_running_calls(s, counts))
    assert run.steps > 0
    assert counts["core"] < counts["running"] / 3, counts
    if "num_blocks" in changes:
        assert run.preempted > 0


@pytest.mark.parametrize("kv_events", [False, True], ids=["direct", "events"])
def test_running_steps_outside_the_horizon_reach_the_core_from_the_entry(
    kv_events: bool,
) -> None:
    # Without KV events the running steps that reach the core never run the adapter's Python
    # frame; with them, the adapter collects the events of each (and the outputs match vLLM's
    # either way: the differential tests).
    options = harness.Options(layout="gpt-oss", kv_events=kv_events)
    scheduler = harness.build_scheduler(options, hkv.Scheduler)
    manager = scheduler.kv_cache_manager
    full_call = manager._allocate_slots
    forwarded = {"running": 0, "other": 0}

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        forwarded["other" if "new_computed_blocks" in kwargs else "running"] += 1
        return full_call(*args, **kwargs)

    manager._allocate_slots = allocate_slots
    counts = {"running": 0, "core": 0}
    _count_core_running_calls(scheduler, counts)
    results = []
    allocate = manager.allocate_slots

    def keep(*args: Any, **kwargs: Any) -> Any:
        result = allocate(*args, **kwargs)
        if result is not None and result is not manager.empty_kv_cache_blocks:
            results.append(result)
        return result

    manager.allocate_slots = keep
    driver = harness.Driver(scheduler, WORKLOAD[:8])
    for _ in range(60):
        driver.timed_step()
    assert forwarded["other"] > 0 and counts["core"] > 0
    assert forwarded["running"] == (counts["core"] if kv_events else 0), (forwarded, counts)
    # A result made by the entry reads as the adapter's KVCacheBlocks over the same blocks.
    direct = [r for r in results if not isinstance(r, KVCacheBlocks)]
    assert (len(direct) > 0) is not kv_events
    for result in direct[:5]:
        same = KVCacheBlocks(result._core, None, False)
        for allow_none in (False, True):
            assert result.get_block_ids(allow_none) == same.get_block_ids(allow_none)
            assert result.get_block_ids(allow_none, group_ids=[1]) == same.get_block_ids(
                allow_none, group_ids=[1]
            )
        assert result.get_block_ids(group_ids=None) == same.get_block_ids()
        assert not result.is_empty() and repr(result) == repr(same)
        assert (result + same).get_block_ids() == (same + same).get_block_ids()
        assert (same + result).get_block_ids() == (same + same).get_block_ids()
        # Compared, hashed and pickled as the adapter's (vLLM's compare by value, unhashable).
        assert result == same and same == result and not result != same
        assert result != same.new_empty()
        with pytest.raises(TypeError, match="unhashable"):
            hash(result)
        assert pickle.loads(pickle.dumps(result)) == same
        with pytest.raises(NotImplementedError):
            result.get_unhashed_block_ids()


def test_results_from_the_entry_hold_any_number_of_blocks() -> None:
    # Chunked prefills of running requests take several blocks in each of Gemma-3's 7 groups
    # in one step (more than a result keeps inline), decode steps one: both read as vLLM's
    # block ids, step for step.
    options = harness.Options(layout="gemma3", max_num_batched_tokens=96, max_num_seqs=8)
    sizes: list[int] = []

    def watch(scheduler: Any) -> None:
        manager = scheduler.kv_cache_manager
        allocate = manager.allocate_slots

        def allocate_slots(*args: Any, **kwargs: Any) -> Any:
            result = allocate(*args, **kwargs)
            if result is not None and not isinstance(result, KVCacheBlocks):
                ids = result.get_block_ids()
                assert len(ids) == 7 and all(type(i) is int for g in ids for i in g)
                assert result.get_block_ids(True) == ids
                sizes.append(sum(map(len, ids)))
            return result

        manager.allocate_slots = allocate_slots

    run = run_both(options, WORKLOAD[:12], watch=watch)
    assert run.steps > 0
    # 1 + 7 + ids words: inline up to 23 ids, on the heap beyond.
    assert min(sizes) <= 7 and max(sizes) > 23, (min(sizes), max(sizes))


def _request_inside_its_horizon(layout: str = "gpt-oss") -> tuple[Any, Any]:
    """A scheduler and one of its running requests whose next one-token step lies inside its
    running horizon."""
    scheduler = harness.build_scheduler(harness.Options(layout=layout), hkv.Scheduler)
    driver = harness.Driver(scheduler, WORKLOAD[:4])
    manager = scheduler.kv_cache_manager

    def inside(request: Any) -> bool:
        horizon = request.__dict__[manager._key].horizon
        if horizon is None:
            return False
        slots, cache, removal = horizon
        c = request.num_computed_tokens
        return c + 1 <= slots and c + 1 < cache and c < removal

    for _ in range(40):
        driver.timed_step()
        candidates = [r for r in scheduler.running if inside(r)]
        if candidates:
            return scheduler, candidates[0]
    pytest.fail("no running request inside its horizon")


def _record_forwarded(manager: Any) -> list[tuple[tuple, dict]]:
    """Records the arguments (after the request) of every call `allocate_slots` passes on to the
    adapter's `_allocate_slots`, which still serves them."""
    forwarded: list[tuple[tuple, dict]] = []
    full_call = manager._allocate_slots

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        forwarded.append((args[1:], kwargs))
        return full_call(*args, **kwargs)

    manager._allocate_slots = allocate_slots
    return forwarded


def test_allocate_slots_checks_its_arguments_inside_the_horizon() -> None:
    # A running request inside its horizon: bad counts raise as they do outside it.
    scheduler, request = _request_inside_its_horizon()
    manager = scheduler.kv_cache_manager
    forwarded = _record_forwarded(manager)
    assert manager.allocate_slots(request, 1) is manager.empty_kv_cache_blocks
    assert manager.allocate_slots(request, 1, num_lookahead_tokens=0) is (
        manager.empty_kv_cache_blocks
    )
    assert forwarded == []
    # Any other argument given goes to the full call, by name (None counts as not given); the
    # answer is the same.
    assert manager.allocate_slots(request, 1, 0, None, 0) is manager.empty_kv_cache_blocks
    assert manager.allocate_slots(request, 1, has_scheduled_reqs=True) is (
        manager.empty_kv_cache_blocks
    )
    assert forwarded == [
        ((1,), {"num_new_computed_tokens": 0, "num_lookahead_tokens": 0}),
        ((1,), {"has_scheduled_reqs": True}),
    ]
    with pytest.raises(ValueError):
        manager.allocate_slots(request, 0)
    with pytest.raises(TypeError):
        manager.allocate_slots(request, 1.0)
    with pytest.raises(hk.OutOfRangeError):
        manager.allocate_slots(request, -1)
    with pytest.raises(hk.OutOfRangeError):
        manager.allocate_slots(request, 1, num_lookahead_tokens=-1)


def test_the_running_step_entry_passes_every_other_call_on_unchanged() -> None:
    # The manager class's `allocate_slots` is a direct entry that answers the scheduler's
    # running step itself; any other call reaches the base class's `allocate_slots` with the
    # same arguments, so its answers and its errors are the base's.
    scheduler, request = _request_inside_its_horizon()
    manager = scheduler.kv_cache_manager
    base = hk._core._RunningSteps.allocate_slots
    assert type(manager).allocate_slots is not base
    assert inspect.signature(type(manager).allocate_slots) == inspect.signature(base)
    empty = manager.empty_kv_cache_blocks
    forwarded = _record_forwarded(manager)
    # The running step, with the keyword's name made at run time (not the interned constant).
    name = "".join(["num_lookahead", "_tokens"])
    assert manager.allocate_slots(request, 1, **{name: 0}) is empty
    assert base(manager, request, 1, num_lookahead_tokens=0) is empty
    assert forwarded == []

    class Count(int):
        pass

    # Shapes the entry does not answer: an int subclass, the lookahead by position, another
    # keyword, two keywords.
    assert manager.allocate_slots(request, Count(1)) is empty
    assert manager.allocate_slots(request, 1, 0, None, 0) is empty
    assert manager.allocate_slots(request, 1, has_scheduled_reqs=True) is empty
    assert manager.allocate_slots(request, 1, num_lookahead_tokens=0, delay_cache_blocks=False) is (
        empty
    )
    assert [type(args[0]) for args, _ in forwarded] == [Count, int, int, int]
    assert [kwargs for _, kwargs in forwarded] == [
        {},
        {"num_new_computed_tokens": 0, "num_lookahead_tokens": 0},
        {"has_scheduled_reqs": True},
        {"num_lookahead_tokens": 0, "delay_cache_blocks": False},
    ]
    # Argument errors are the base method's, message for message.
    bad_calls: list[tuple[tuple, dict]] = [
        ((), {}),
        ((request,), {}),
        ((request, 1), {"bogus": 1}),
        ((request, 1), {"num_new_tokens": 1}),
        ((request, 1, 0), {"num_new_computed_tokens": 0}),
        ((request, 1, *([None] * 10), 0), {}),
        ((request,), {"num_lookahead_tokens": 0}),
    ]
    for args, kwargs in bad_calls:
        with pytest.raises(TypeError) as ours:
            manager.allocate_slots(*args, **kwargs)
        with pytest.raises(TypeError) as theirs:
            base(manager, *args, **kwargs)
        assert str(ours.value) == str(theirs.value), (args, kwargs)
    # Random call shapes with an argument no call accepts (an object that is not a request,
    # counts of the wrong type or sign): the same error as the base method's, every time.
    rng = random.Random(11)
    compared = set()
    names = [p for p in inspect.signature(base).parameters if p not in ("self", "request")]
    values = [None, 0, 1, -1, 1.5, "1", object(), True, 2**70]
    for _ in range(300):
        first = rng.choice([object(), None, request])
        positional = [first] + [rng.choice(values) for _ in range(rng.randrange(0, 4))]
        keywords = {
            name: rng.choice(values)
            for name in rng.sample(names + ["bogus"], rng.randrange(0, 3))
            if name not in names[: len(positional) - 1]
        }
        if first is request and all(
            type(v) is int and v >= 0 for v in [*positional[1:], *keywords.values()]
        ):
            continue  # a call that could allocate: the differential tests cover those
        try:
            base(manager, *positional, **keywords)
        except Exception as error:  # noqa: BLE001 - compared with the entry's below
            expected: Any = (type(error), str(error))
        else:
            expected = "returned"
        try:
            manager.allocate_slots(*positional, **keywords)
        except Exception as error:  # noqa: BLE001
            raised: Any = (type(error), str(error))
        else:
            raised = "returned"
        assert raised == expected, (positional, keywords)
        compared.add(raised if raised == "returned" else raised[0])
    assert {TypeError, AttributeError} <= compared, compared
    # The entry applies to the manager's instances only.
    with pytest.raises(TypeError, match="allocate_slots"):
        type(manager).allocate_slots(object(), request, 1)
    # An error inside the running step propagates from the entry.
    with pytest.raises(hk.OutOfRangeError):
        manager.allocate_slots(request, 1, num_lookahead_tokens=-1)


@pytest.mark.parametrize(
    "layout,num_blocks", [("full", 260), ("gemma3", 1400), ("llama4", 1200), ("jamba", 700)]
)
def test_same_outputs_as_vllm_without_chunked_prefill(layout: str, num_blocks: int) -> None:
    # A prompt is scheduled whole or waits (vLLM's `enable_chunked_prefill=False`), under
    # memory pressure and default retention.
    options = harness.Options(
        layout=layout,
        num_blocks=num_blocks,
        dense_retention=False,
        chunked_prefill=False,
        max_num_batched_tokens=512,
        max_model_len=2048,
    )
    run = run_both(options, WORKLOAD)
    assert run.preempted > 0, "the pool should be small enough to preempt"
    assert run.hits > 0
