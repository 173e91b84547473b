"""The entry's cache of slots (`_RunningSteps`, by the address of vLLM's request) answers only
from the slot in the request's `__dict__`: a slot that left the dict (deleted, replaced, or the
dict replaced) is not used, and the cache no longer holds it. Each holds for `allocate_slots` as
the class's method and behind the direct entry (`_running_steps_entry`)."""

from __future__ import annotations

from typing import Any

import hybrid_kv as hk
import pytest
from hybrid_kv import _core

FULL = {"kind": "full", "block_size": 4}
PYTHON_PATH = "the adapter's _allocate_slots"


class _Adapter(_core._RunningSteps):
    """An adapter as `hybrid_kv.vllm`'s manager subclasses the entry's class; its Python path
    only says it was taken."""

    def wrap(self, blocks: Any, *_: Any) -> Any:
        return blocks

    def _allocate_slots(self, *_: Any, **__: Any) -> str:
        return PYTHON_PATH


class _EntryAdapter(_Adapter):
    """`_Adapter` with `allocate_slots` behind the direct entry, as `hybrid_kv.vllm`'s manager
    puts it in its class body: every test here holds for both."""

    allocate_slots = _core._running_steps_entry()


ADAPTERS = pytest.mark.parametrize("cls", [_Adapter, _EntryAdapter], ids=["method", "entry"])


class _Request:
    """A vLLM-like request (its counts and tokens in its `__dict__`, as vLLM's)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _running(manager: hk.KVCacheManager, request_id: str, first: int) -> tuple[Any, Any]:
    """A vLLM-like request whose next one-token step reaches the core (4 tokens computed in
    one full block), and its slot (under "slot")."""
    prompt = list(range(first, first + 4))
    companion = hk.Request(request_id, prompt, block_size=4)
    manager.allocate_slots(companion, 4)
    request = _Request(_all_token_ids=[*prompt, 9], num_computed_tokens=4, num_in_flight_tokens=0)
    slot = _core._VllmSlot(companion, 4)
    request.__dict__["slot"] = slot
    return request, slot


def _stepped(
    cls: type[_Adapter], empty: Any = None
) -> tuple[hk.KVCacheManager, _Adapter, Any, Any]:
    """A manager, an adapter whose empty result is `empty`, and a request and its slot after
    one step from the entry: 5 tokens computed in 8 slots, its next one-token steps inside its
    horizon."""
    manager = hk.KVCacheManager([FULL], 16, 64)
    adapter = cls()
    adapter._running_steps("slot", empty, manager, adapter.wrap)
    request, slot = _running(manager, "a", 0)
    # The first step reaches the core from the entry (block 2), which caches the slot.
    assert adapter.allocate_slots(request, 1).get_block_ids() == ([2],)
    request.num_computed_tokens = 5
    request._all_token_ids.append(10)
    return manager, adapter, request, slot


def _setup(cls: type[_Adapter]) -> tuple[hk.KVCacheManager, _Adapter, Any]:
    manager, adapter, request, _ = _stepped(cls)
    return manager, adapter, request


def _without_slot(request: Any) -> dict[str, Any]:
    return {k: v for k, v in request.__dict__.items() if k != "slot"}


@pytest.mark.parametrize("how", ["deleted", "dict-cleared", "dict-replaced"])
@ADAPTERS
def test_a_slot_that_left_the_requests_dict_is_not_used_and_not_kept(
    cls: type[_Adapter], how: str
) -> None:
    manager, adapter, request = _setup(cls)
    assert manager.num_requests == 1
    if how == "deleted":
        del request.__dict__["slot"]
    elif how == "dict-cleared":
        fields = _without_slot(request)
        request.__dict__.clear()
        request.__dict__.update(fields)
    else:
        request.__dict__ = _without_slot(request)
    # As with no slot ever cached: the adapter's path, and the companion, held by nothing,
    # has left the core.
    assert adapter.allocate_slots(request, 1) == PYTHON_PATH
    assert manager.num_requests == 0


@pytest.mark.parametrize("how", ["replaced-in-dict", "dict-replaced"])
@ADAPTERS
def test_a_slot_replaced_in_the_requests_dict_is_the_one_used(
    cls: type[_Adapter], how: str
) -> None:
    manager, adapter, request = _setup(cls)
    other, slot = _running(manager, "b", 100)  # holds block 3
    fields = dict(request.__dict__, slot=slot)
    fields["_all_token_ids"] = other._all_token_ids
    fields["num_computed_tokens"] = 4
    if how == "replaced-in-dict":
        request.__dict__.update(fields)
    else:
        request.__dict__ = fields
    del other
    # Request "b"'s step (its second block), not request "a"'s inside its horizon (no block).
    (new,) = adapter.allocate_slots(request, 1).get_block_ids()
    assert len(new) == 1
    assert [list(ids) for ids in manager.get_block_ids("b")] == [[3, *new]]
    assert manager.num_requests == 1  # "a" is held by nothing now


_EMPTY = object()


def _inside_setup(cls: type[_Adapter]) -> tuple[hk.KVCacheManager, _Adapter, Any, Any]:
    """`_stepped` with a distinct empty result."""
    manager, adapter, request, slot = _stepped(cls, _EMPTY)
    assert slot.horizon is not None and slot.running_calls == 1
    return manager, adapter, request, slot


@pytest.mark.parametrize(
    "call",
    [
        lambda a, r: a.allocate_slots(r, 1),
        lambda a, r: a.allocate_slots(r, 1, num_lookahead_tokens=0),
        lambda a, r: a.allocate_slots(r, 2, num_lookahead_tokens=1),
        # A keyword name equal to the interned one but another object.
        lambda a, r: a.allocate_slots(r, 1, **{"".join(["num_lookahead", "_tokens"]): 0}),
        lambda a, r: a.allocate_slots(r, 1, num_lookahead_tokens=None),
    ],
)
@ADAPTERS
def test_every_shape_of_a_running_step_inside_the_horizon_gets_the_empty_result(
    cls: type[_Adapter],
    call: Any,
) -> None:
    manager, adapter, request, slot = _inside_setup(cls)
    free = manager.num_free_blocks
    assert call(adapter, request) is _EMPTY
    assert (slot.running_calls, manager.num_free_blocks) == (1, free)


@pytest.mark.parametrize(
    "field, value",
    [
        # Two-digit ints whose low digit alone would put the step inside the horizon.
        ("num_new_tokens", 2**30 + 1),
        ("num_lookahead_tokens", 2**30),
        ("num_computed_tokens", 2**30 + 5),
        ("num_in_flight_tokens", 2**30),
        # Not exact ints.
        ("num_new_tokens", True),
        ("num_computed_tokens", 5.0),
    ],
)
@ADAPTERS
def test_a_step_with_a_count_the_short_path_does_not_read_is_decided_in_full(
    cls: type[_Adapter], field: str, value: Any
) -> None:
    manager, adapter, request, slot = _inside_setup(cls)
    n, k = 1, 0
    if field == "num_new_tokens":
        n = value
    elif field == "num_lookahead_tokens":
        k = value
    else:
        request.__dict__[field] = value
    try:
        result = adapter.allocate_slots(request, n, num_lookahead_tokens=k)
    except (TypeError, ValueError, OverflowError, hk.HybridKvError):
        return
    # Not answered inside the horizon: by the adapter's Python path, or by the core, whose
    # answer may be the empty result too (2^30 tokens in flight, none processed, need no block).
    assert result is not _EMPTY or slot.running_calls == 2


def _new_blocks() -> Any:
    """A running step's new blocks as the entry returns them (a `_RunningBlocks`)."""
    manager = hk.KVCacheManager([FULL, FULL], 16, 64)
    adapter = _Adapter()
    adapter._running_steps("slot", _EMPTY, manager, lambda blocks, *_: blocks)
    request, _ = _running(manager, "a", 0)
    blocks = adapter.allocate_slots(request, 1)
    assert type(blocks) is _core._RunningBlocks
    return blocks


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda b: b.get_block_ids(), ([3], [4])),
        (lambda b: b.get_block_ids(True), ([3], [4])),
        (lambda b: b.get_block_ids(False), ([3], [4])),
        (lambda b: b.get_block_ids(allow_none=True), ([3], [4])),
        (lambda b: b.get_block_ids(**{"".join(["allow", "_none"]): True}), ([3], [4])),
        (lambda b: b.get_block_ids(True, group_ids=[1]), ([4],)),
        (lambda b: b.get_block_ids(group_ids=[0]), ([3],)),
        (lambda b: b._get_block_ids(allow_none=True), ([3], [4])),
    ],
)
def test_a_running_steps_new_blocks_read_alike_every_way(call: Any, expected: Any) -> None:
    # (With `group_ids` the wrapped result answers: here the core's blocks, as arrays.)
    ids = call(_new_blocks())
    assert tuple(list(group) for group in ids) == expected
    assert type(ids) is tuple


@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.get_block_ids(1),
        lambda b: b.get_block_ids(allow_none=None),
        lambda b: b.get_block_ids(True, True),
        lambda b: b.get_block_ids(bogus=True),
    ],
)
def test_a_running_steps_new_blocks_refuse_what_the_method_refuses(call: Any) -> None:
    with pytest.raises(TypeError):
        call(_new_blocks())
