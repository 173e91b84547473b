"""`hybrid_kv._core._CallTimer`, the scheduler benchmark's timer of the manager's calls: calls
pass through unchanged, and are counted and timed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hybrid_kv import _core


def test_calls_pass_through_with_their_arguments_and_result() -> None:
    seen = []

    def target(*args: object, **kwargs: object) -> tuple[object, ...]:
        seen.append((args, kwargs))
        return ("result", args, kwargs)

    timer = _core._CallTimer(target)
    timed = timer.function()
    assert timed(1, "two", three=3) == ("result", (1, "two"), {"three": 3})
    assert timed() == ("result", (), {})
    assert seen == [((1, "two"), {"three": 3}), ((), {})]
    assert timer.calls == 2
    assert timer.target is target


def test_time_of_the_calls_is_counted() -> None:
    timer = _core._CallTimer(time.sleep)
    timed = timer.function()
    assert timer.ns == 0
    timed(0.02)
    timed(0.01)
    assert timer.calls == 2
    # At least the time slept; the clock is the CPU's counter, calibrated against the OS's.
    assert 0.029e9 <= timer.ns <= 5e9


def test_exceptions_pass_through_and_the_call_is_counted() -> None:
    class Boom(Exception):
        pass

    def target(x: int) -> int:
        raise Boom(x)

    timer = _core._CallTimer(target)
    with pytest.raises(Boom, match="7"):
        timer.function()(7)
    with pytest.raises(TypeError):
        timer.function()()  # the target's own argument check
    assert timer.calls == 2


def test_method_binds_to_the_instance_it_is_read_from() -> None:
    class Blocks:
        def __init__(self, name: str) -> None:
            self.name = name

        def get_block_ids(self, allow_none: bool = False) -> tuple[str, bool]:
            return (self.name, allow_none)

    timer = _core._CallTimer(Blocks.__dict__["get_block_ids"])
    Blocks.get_block_ids = timer.method()  # type: ignore[method-assign]
    assert Blocks("a").get_block_ids(allow_none=True) == ("a", True)
    assert Blocks("b").get_block_ids() == ("b", False)
    assert timer.calls == 2


def test_results_of_the_given_types_come_back_wrapped() -> None:
    class Native:
        pass

    class Subclass(Native):
        pass

    wrapped = []

    def wrap(result: object) -> tuple[str, object]:
        wrapped.append(result)
        return ("proxy", result)

    values = {"native": Native(), "sub": Subclass(), "none": None, "int": 3}
    timer = _core._CallTimer(values.__getitem__, [Native], wrap)
    timed = timer.function()
    assert timed("native") == ("proxy", values["native"])
    # Only the exact types: a subclass, None and others come back as they are.
    assert timed("sub") is values["sub"]
    assert timed("none") is None
    assert timed("int") == 3
    assert wrapped == [values["native"]]
    with pytest.raises(KeyError):
        timed("missing")
    assert timer.calls == 5


def test_an_error_in_wrap_is_raised() -> None:
    def wrap(result: object) -> object:
        raise ValueError("cannot wrap")

    timer = _core._CallTimer(lambda: 1.5, [float], wrap)
    with pytest.raises(ValueError, match="cannot wrap"):
        timer.function()()
    assert timer.calls == 1


@pytest.mark.parametrize(
    "args",
    [
        (None,),
        (3,),
        (len, [int]),
        (len, None, len),
        (len, [int], 4),
        (len, [3], len),
    ],
)
def test_bad_arguments_are_refused(args: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError):
        _core._CallTimer(*args)


def test_calls_from_several_threads_are_all_counted() -> None:
    timer = _core._CallTimer(lambda x: x + 1)
    timed = timer.function()
    results: list[list[int]] = []

    def run() -> None:
        results.append([timed(i) for i in range(2000)])

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timer.calls == 8000
    assert all(r == list(range(1, 2001)) for r in results)
