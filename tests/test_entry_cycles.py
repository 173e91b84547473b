"""`_CallTimer` (through its target), `_RunningSteps` (through the entry `_running_steps` sets)
and the entry's results, `_RunningBlocks` (through their wrap), in reference cycles: the cycle
collector sees their references, and a timer breaks a cycle no other object in it can.
(`_RunningSteps` and `_RunningBlocks` have no `__clear__`: see their `__traverse__`.)"""

from __future__ import annotations

import gc
import types
import weakref
from typing import Any

import hybrid_kv as hk
import pytest
from hybrid_kv import _core


class _Adapter(_core._RunningSteps):
    """An adapter as `hybrid_kv.vllm`'s manager subclasses the entry's class."""

    def wrap(self, blocks: Any, *_: Any) -> Any:
        return blocks


def _collected(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


def test_a_call_timer_in_a_cycle_through_its_target_is_collected() -> None:
    class Target:
        timer: Any = None

        def __call__(self) -> int:
            return 1

    target = Target()
    target.timer = _core._CallTimer(target)
    assert target.timer.function()() == 1
    ref = weakref.ref(target)
    del target
    assert _collected(ref)


def test_a_call_timer_timing_its_own_holder_is_collected() -> None:
    # The timer's target is a builtin method bound to an adapter whose entry holds the timer:
    # neither the bound method nor the adapter's (empty) __dict__ can break the cycle.
    adapter = _Adapter()
    timer = _core._CallTimer(adapter._running_steps)
    adapter._running_steps("slot", timer)
    ref = weakref.ref(adapter)
    del adapter, timer
    assert _collected(ref)


class _Holder:
    """Keeps the last result of a running step; its `wrap` is the adapter's."""

    last: Any = None

    def wrap(self, blocks: Any, *_: Any) -> Any:
        return blocks


@pytest.mark.parametrize("through", ["wrap", "wrapped"])
def test_running_blocks_kept_by_what_their_wrap_refers_to_are_collected(through: str) -> None:
    # A running step's new blocks from the entry hold the adapter's wrap and what it made: an
    # object keeping a result, that the wrap is bound to (or that the object it made refers
    # to), is in a cycle through the result.
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 16, 64)
    prompt = list(range(4))
    companion = hk.Request("a", prompt, block_size=4)
    manager.allocate_slots(companion, 4)
    request = types.SimpleNamespace(
        _all_token_ids=[*prompt, 9], num_computed_tokens=4, num_in_flight_tokens=0
    )
    request.__dict__["slot"] = _core._VllmSlot(companion, 4)
    holder = _Holder()
    # The "wrapped" wrap refers to nothing once it made its object (a list holding `holder`).
    box = {} if through == "wrap" else {"holder": holder}
    wrap = holder.wrap if through == "wrap" else (lambda blocks, *_: [box.pop("holder")])
    adapter = _Adapter()
    adapter._running_steps("slot", None, manager, wrap)
    holder.last = adapter.allocate_slots(request, 1)
    assert type(holder.last) is _core._RunningBlocks
    assert holder.last.get_block_ids() == ([2],)
    if through == "wrapped":
        repr(holder.last)  # makes the wrapped object
        assert not box
    ref = weakref.ref(holder)
    del adapter, holder, wrap
    assert _collected(ref)


class _Request:
    """A vLLM-like request (its counts and tokens in its `__dict__`, as vLLM's)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _running_request(manager: hk.KVCacheManager, key: str) -> Any:
    """A vLLM-like request whose next one-token step the entry answers (its slot under `key`)."""
    prompt = list(range(4))
    companion = hk.Request("a", prompt, block_size=4)
    manager.allocate_slots(companion, 4)
    request = _Request(_all_token_ids=[*prompt, 9], num_computed_tokens=4, num_in_flight_tokens=0)
    request.__dict__[key] = _core._VllmSlot(companion, 4)
    return request


def test_the_entry_holds_a_request_whose_slot_it_cached_until_it_is_forgotten() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 16, 64)
    adapter = _Adapter()
    adapter._running_steps("slot", None, manager, adapter.wrap)
    request = _running_request(manager, "slot")
    ref = weakref.ref(request)
    assert adapter.allocate_slots(request, 1).get_block_ids() == ([2],)
    del request
    gc.collect()
    request = ref()
    assert request is not None  # cached: held by the entry
    adapter._forget_slot(request)
    adapter._forget_slot(request)  # forgetting twice changes nothing
    del request
    assert ref() is None  # no cycle: freed at once


def test_a_request_in_a_cycle_through_the_entrys_cache_of_slots_is_collected() -> None:
    # The adapter caches the request's slot (holding the request); the request refers back to
    # the adapter.
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 16, 64)
    adapter = _Adapter()
    adapter._running_steps("slot", None, manager, adapter.wrap)
    request = _running_request(manager, "slot")
    request.manager = adapter
    assert adapter.allocate_slots(request, 1).get_block_ids() == ([2],)
    refs = weakref.ref(adapter), weakref.ref(request)
    del adapter, request
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
