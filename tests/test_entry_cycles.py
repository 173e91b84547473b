"""`_CallTimer` (through its target) and `_RunningSteps` (through the entry `_running_steps`
sets) in reference cycles: the cycle collector sees their references, and a timer breaks a cycle
no other object in it can. (`_RunningSteps` has no `__clear__`: see its `__traverse__`.)"""

from __future__ import annotations

import gc
import weakref
from typing import Any

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
