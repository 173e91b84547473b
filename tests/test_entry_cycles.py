"""`_RunningSteps` (through the entry `_running_steps` sets) and `_CallTimer` (through its
target) in reference cycles: the cycle collector sees their references and breaks the cycle,
even one where no other object can be cleared."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import hybrid_kv as hk
from hybrid_kv import _core


class _Adapter(_core._RunningSteps):
    """An adapter as `hybrid_kv.vllm`'s manager subclasses the entry's class."""

    def wrap(self, blocks: Any, *_: Any) -> Any:
        return blocks


def _collected(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


def test_running_steps_holding_itself_through_its_empty_result_is_collected() -> None:
    adapter = _Adapter()
    adapter._running_steps("slot", adapter)
    ref = weakref.ref(adapter)
    del adapter
    assert _collected(ref)


def test_running_steps_holding_itself_through_its_wrap_is_collected() -> None:
    # A bound method cannot be cleared, and the adapter's (empty) __dict__ is not in the
    # cycle: only the entry can break it.
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 4}], 8, 64)
    adapter = _Adapter()
    adapter._running_steps("slot", [], manager, adapter.wrap)
    ref = weakref.ref(adapter)
    del adapter
    assert _collected(ref)


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
