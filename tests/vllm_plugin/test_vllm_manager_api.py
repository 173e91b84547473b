"""The adapter's `KVCacheManager` API called directly, as a KV connector or an out-of-tree
scheduler would: where vLLM 0.33's own manager answers a call, hybrid-kv's answers the same;
where vLLM's accepts an argument that makes no sense (a hit from another manager, a hit that is
not a lookup's result), hybrid-kv's raises a `ValueError` naming it and changes nothing."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv as hk  # noqa: E402
import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT = tuple(range(5000, 5070))


def managers(layout: str) -> tuple[Any, Any]:
    """vLLM's manager and hybrid-kv's for the same small configuration."""
    options = harness.Options(layout=layout, num_blocks=100)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv
    return harness.build_scheduler(options).kv_cache_manager, ours.kv_cache_manager


def request(request_id: str) -> Any:
    return harness.make_request(harness.RequestSpec(request_id, PROMPT, 10, 0))


def run_and_finish(manager: Any, request_id: str) -> Any:
    """A request whose whole prompt was computed and cached, then finished and freed."""
    req = request(request_id)
    manager.allocate_slots(req, len(PROMPT))
    req.num_computed_tokens = len(PROMPT)
    manager.cache_blocks(req, len(PROMPT))
    req.status = RequestStatus.FINISHED_STOPPED
    manager.free(req)
    return req


def per_request_calls(manager: Any, req: Any) -> list[Any]:
    """Every per-request query and update vLLM's scheduler or a connector makes by id or by
    request, and what each answered."""
    rid = req.request_id
    return [
        manager.get_block_ids(rid),
        manager.get_blocks(rid).get_block_ids(),
        manager.get_block_ids_for_computed_tokens(rid, 32),
        manager.remove_skipped_blocks(rid, 32, len(PROMPT)),
        manager.remove_skipped_blocks(rid, 32),
        manager.record_blocks_for_zeroing(rid, 0),
        manager.take_new_block_ids(),
        manager.estimate_cached_tokens(req),
        manager.finalize_partial_tail_offloads(req),
        manager.free(req),
        manager.usage,
    ]


@pytest.mark.parametrize("layout", ["full", "gpt-oss", "jamba"])
def test_calls_on_an_unknown_request_answer_as_vllms(layout: str) -> None:
    stock, ours = managers(layout)
    assert per_request_calls(ours, request("never-seen")) == per_request_calls(
        stock, request("never-seen")
    )


@pytest.mark.parametrize("layout", ["full", "gpt-oss", "jamba"])
def test_calls_on_a_finished_request_answer_as_vllms(layout: str) -> None:
    # A connector's `request_finished` reads the block table of a request the scheduler has
    # freed already when the connector delays nothing.
    stock, ours = managers(layout)
    expected = per_request_calls(stock, run_and_finish(stock, "done"))
    assert per_request_calls(ours, run_and_finish(ours, "done")) == expected


def test_kv_cache_blocks_compare_by_their_block_ids() -> None:
    stock, ours = managers("gpt-oss")
    for manager in (stock, ours):
        run_and_finish(manager, "x")
    hits = [ours.get_computed_blocks(request(rid))[0] for rid in ("a", "b")]
    expected = [stock.get_computed_blocks(request(rid))[0] for rid in ("a", "b")]
    assert expected[0] == expected[1]
    assert hits[0] == hits[1]
    assert hits[0] != hits[0].new_empty()
    assert hits[0] + hits[1] != hits[0]
    assert ours.empty_kv_cache_blocks == hits[0].new_empty()
    assert stock.empty_kv_cache_blocks == expected[0].new_empty()
    # Another manager's blocks (vLLM's own) neither compare equal nor add.
    assert hits[0] != expected[0]
    with pytest.raises(TypeError, match="unsupported operand"):
        hits[0] + expected[0]
    # Mutable, as vLLM's (a dataclass with equality): not hashable.
    with pytest.raises(TypeError, match="unhashable"):
        hash(expected[0])
    with pytest.raises(TypeError, match="unhashable"):
        hash(hits[0])


def test_kv_cache_blocks_pickle_as_their_block_ids() -> None:
    stock, ours = managers("gpt-oss")
    for manager in (stock, ours):
        run_and_finish(manager, "x")
    hit = ours.get_computed_blocks(request("a"))[0]
    expected = stock.get_computed_blocks(request("a"))[0]
    copy = pickle.loads(pickle.dumps(hit))
    assert copy.get_block_ids() == hit.get_block_ids() == expected.get_block_ids()
    assert copy == hit
    empty = pickle.loads(pickle.dumps(ours.empty_kv_cache_blocks))
    assert empty.get_block_ids(allow_none=True) is None
    assert empty.get_block_ids() == ([], [])


@pytest.mark.parametrize("how", ["sum", "pickled", "vllm's"])
def test_a_hit_that_is_not_a_lookups_result_is_refused_by_name(how: str) -> None:
    # vLLM's manager adopts whatever blocks it is given; hybrid-kv's takes a hit only as its
    # own lookup (or truncation) returned it, and says so.
    stock, ours = managers("gpt-oss")
    for manager in (stock, ours):
        run_and_finish(manager, "x")
    req = request("y")
    hit, num_hit, _ = ours.get_computed_blocks(req)
    assert num_hit == 64
    other = {
        "sum": lambda: hit + ours.empty_kv_cache_blocks,
        "pickled": lambda: pickle.loads(pickle.dumps(hit)),
        "vllm's": lambda: stock.get_computed_blocks(request("y"))[0],
    }[how]()
    usage = ours.usage
    with pytest.raises(hk.InvalidArgumentError, match="get_computed_blocks"):
        ours.allocate_slots(req, len(PROMPT) - num_hit, num_hit, other)
    assert ours.get_block_ids("y") == ([], [])
    assert ours.usage == usage
    # The lookup's own result is still taken.
    assert ours.allocate_slots(req, len(PROMPT) - num_hit, num_hit, hit) is not None
    assert ours.get_block_ids("y")[0][:4] == hit.get_block_ids()[0]


def test_truncating_what_is_not_a_lookups_result_is_refused_by_name() -> None:
    _, ours = managers("gpt-oss")
    run_and_finish(ours, "x")
    hit = ours.get_computed_blocks(request("y"))[0]
    assert ours.truncate_computed_blocks(hit, 32).get_block_ids() == ([1, 2], [6, 7])
    with pytest.raises(hk.InvalidArgumentError, match="get_computed_blocks"):
        ours.truncate_computed_blocks(hit + hit, 32)
    empty = ours.empty_kv_cache_blocks
    assert ours.truncate_computed_blocks(empty, 0) is empty
    assert ours.truncate_computed_blocks(empty.new_empty(), 0) is empty
    # vLLM's manager fails an assertion there.
    with pytest.raises(hk.OutOfRangeError, match="16 tokens"):
        ours.truncate_computed_blocks(empty, 16)


@pytest.mark.parametrize("how", ["copy", "deepcopy"])
def test_a_copied_hit_is_adopted_as_the_original(how: str) -> None:
    # vLLM's manager adopts a copy of its lookup's result as the result itself.
    stock, ours = managers("gpt-oss")
    adopted = []
    for manager in (stock, ours):
        run_and_finish(manager, "x")
        req = request("y")
        hit, num_hit, _ = manager.get_computed_blocks(req)
        other = getattr(copy, how)(hit)
        new = manager.allocate_slots(req, len(PROMPT) - num_hit, num_hit, other)
        adopted.append((other.get_block_ids(), new.get_block_ids(), manager.get_block_ids("y")))
    assert adopted[1] == adopted[0]


@pytest.mark.parametrize("layout", ["full", "gemma3"])
def test_the_manager_keeps_no_request_once_it_is_freed_finished(layout: str) -> None:
    # The adapter caches running requests' slots by request (holding them) and forgets a
    # request when `free` sees it finished; preempted requests stay cached (they come back).
    import gc
    import weakref

    scheduler = harness.build_scheduler(
        harness.Options(layout=layout, num_blocks=120), hkv.Scheduler
    )
    refs = []
    add = scheduler.add_request

    def add_request(req: Any) -> None:
        refs.append(weakref.ref(req))
        add(req)

    scheduler.add_request = add_request  # type: ignore[method-assign]
    workload = [
        harness.RequestSpec(f"r{i}", tuple(range(7000 + i, 7060 + i)), 40, i % 5) for i in range(12)
    ]
    driver = harness.Driver(scheduler, workload)
    steps = 0
    while not driver.done:
        driver.timed_step()
        steps += 1
        if steps == 12:
            # Aborted, whether running, preempted or waiting.
            aborted = [r.request_id for r in [*scheduler.running, *scheduler.waiting][::3]]
            assert aborted
            scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    # Every block is back (but the null block).
    assert scheduler.kv_cache_manager.core.num_free_blocks == 119 and steps > 40
    assert len(refs) == 12
    del driver
    gc.collect()
    assert [ref() for ref in refs] == [None] * 12


def running_through_the_entry(manager: Any, request_id: str) -> Any:
    """A request whose prompt was computed and whose first decode step reached the manager's
    entry (which caches the request's slot)."""
    req = request(request_id)
    manager.allocate_slots(req, len(PROMPT))
    req.num_computed_tokens = len(PROMPT)
    req.append_output_token_ids(1)
    assert manager.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    return req


def test_a_preempted_request_refused_when_added_again_leaves_the_core() -> None:
    # A scheduler adding a preempted request again: its new token cannot be taken, so its
    # slot leaves its dict, and the entry's cache holds it no longer either.
    _, ours = managers("full")
    req = running_through_the_entry(ours, "a")
    ours.free(req)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.append_output_token_ids(-1)
    assert "is -1, not a token id" in ours.refusal(req)
    assert ours.core.num_requests == 0


def test_freeing_a_finished_request_whose_slot_left_its_dict_frees_its_blocks() -> None:
    _, ours = managers("full")
    req = running_through_the_entry(ours, "a")
    del req.__dict__[ours._key]
    req.status = RequestStatus.FINISHED_STOPPED
    ours.free(req)
    assert (ours.core.num_requests, ours.core.num_free_blocks) == (0, 99)


@pytest.mark.parametrize("outputs", [0, 1, 20])
def test_a_request_first_seen_with_outputs_has_a_companion_holding_them(outputs: int) -> None:
    # vLLM's own manager and ours answer the same for a request that already holds output
    # tokens when ours first sees it (e.g. one that ran under another manager): the
    # companion made for it takes every token, not only the prompt.
    stock, ours = managers("gemma3")
    answers = []
    for manager in (stock, ours):
        req = request("late")
        for token in range(outputs):
            req.append_output_token_ids(7000 + token)
        if manager is ours:
            assert ours.refusal(req) is None
        blocks, hit, _ = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, req.num_tokens, hit, blocks)
        answers.append((hit, None if new is None else new.get_block_ids()))
        if manager is ours:
            companion = req.__dict__[ours._key].request
            assert companion.num_tokens == len(PROMPT) + outputs
    assert answers[0] == answers[1]


PER_STEP = ("new_step_starts", "take_new_block_ids", "take_boundary_state_offloads", "take_events")


def test_the_per_step_calls_bound_to_the_core_answer_as_the_methods() -> None:
    _, ours = managers("gemma3")
    req = request("step")
    ours.allocate_slots(req, len(PROMPT))
    for name in PER_STEP:
        assert name in ours.__dict__, name
        method = getattr(type(ours), name).__get__(ours)
        assert getattr(ours, name)() == method()
    # Each call gives a new list (the scheduler may keep or change it).
    assert ours.take_events() is not ours.take_events()


def test_a_subclass_override_of_a_per_step_call_is_kept() -> None:
    _, ours = managers("gemma3")

    class Counting(type(ours)):  # type: ignore[misc]
        def new_step_starts(self) -> None:
            self.steps = getattr(self, "steps", 0) + 1
            super().new_step_starts()

    for name in PER_STEP:
        ours.__dict__.pop(name, None)
    ours.__class__ = Counting
    ours._bind_per_step_calls()
    assert "new_step_starts" not in ours.__dict__
    assert "take_new_block_ids" in ours.__dict__
    ours.new_step_starts()
    assert ours.steps == 1
