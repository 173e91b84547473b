"""The `allocate_slots` entry of `_RunningSteps` hands every call it does not answer to the
adapter's `_allocate_slots` with the arguments given: both counts, then the others by name, an
argument given as None left out (as not given), whichever way the call was made (keywords by
their usual names, the scheduler's admission, or names built at run time)."""

from __future__ import annotations

import inspect
from typing import Any

import hybrid_kv as hk
import pytest
from hybrid_kv import _core

# The arguments after the two counts, as the entry's signature names them.
NAMES = tuple(inspect.signature(_core._RunningSteps.allocate_slots).parameters)[3:]
assert len(NAMES) == 10 and "num_lookahead_tokens" in NAMES


class _Recorder(_core._RunningSteps):
    """An adapter whose Python path records what it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def _allocate_slots(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, kwargs))
        return "python"


class _EntryRecorder(_Recorder):
    """`_Recorder` with `allocate_slots` behind the direct entry, as `hybrid_kv.vllm`'s manager
    puts it in its class body."""

    allocate_slots = _core._running_steps_entry()


ADAPTERS = pytest.mark.parametrize("cls", [_Recorder, _EntryRecorder], ids=["method", "entry"])


def _built(name: str) -> str:
    """`name` as a str object made at run time (equal, not the interned one)."""
    return "".join(list(name))


@ADAPTERS
def test_the_schedulers_admission_reaches_the_adapter_with_its_arguments(
    cls: type[_Recorder],
) -> None:
    adapter = cls()
    hit = object()
    result = adapter.allocate_slots(
        "req",
        30,
        num_new_computed_tokens=16,
        new_computed_blocks=hit,
        num_lookahead_tokens=0,
        num_external_computed_tokens=0,
        delay_cache_blocks=False,
        skip_zeroing_group_ids=(),
        num_encoder_tokens=0,
        full_sequence_must_fit=False,
        reserved_blocks=0,
        has_scheduled_reqs=True,
    )
    assert result == "python"
    ((args, kwargs),) = adapter.calls
    assert args == ("req", 30)
    assert kwargs == {
        "num_new_computed_tokens": 16,
        "new_computed_blocks": hit,
        "num_lookahead_tokens": 0,
        "num_external_computed_tokens": 0,
        "delay_cache_blocks": False,
        "skip_zeroing_group_ids": (),
        "num_encoder_tokens": 0,
        "full_sequence_must_fit": False,
        "reserved_blocks": 0,
        "has_scheduled_reqs": True,
    }
    assert kwargs["new_computed_blocks"] is hit


@pytest.mark.parametrize("none_at", [None, *NAMES])
@pytest.mark.parametrize("built", [False, True])
@pytest.mark.parametrize("count", [2, 5, 10])
@ADAPTERS
def test_every_way_of_giving_the_arguments_reaches_the_adapter_alike(
    cls: type[_Recorder], none_at: str | None, built: bool, count: int
) -> None:
    given = {name: (i + 1) * 7 for i, name in enumerate(NAMES[:count])}
    if none_at is not None:
        given[none_at] = None
    call = {(_built(k) if built else k): v for k, v in given.items()}
    adapter = cls()
    assert adapter.allocate_slots("req", 3, **call) == "python"
    ((args, kwargs),) = adapter.calls
    assert args == ("req", 3)
    assert kwargs == {k: v for k, v in given.items() if v is not None}


@ADAPTERS
def test_an_unknown_or_repeated_argument_is_a_type_error_and_reaches_nothing(
    cls: type[_Recorder],
) -> None:
    adapter = cls()
    with pytest.raises(TypeError):
        adapter.allocate_slots("req", 3, num_new_computed_tokens=1, bogus=2)
    with pytest.raises(TypeError):
        adapter.allocate_slots("req", 3, 1, num_new_computed_tokens=1)
    assert adapter.calls == []


def test_companion_params_refuse_a_zero_block_size_and_new_companions_stay_unmade() -> None:
    # (A block size of 0 once divided by zero in `_new_companion`: a panic.)
    adapter = _Recorder()
    adapter._running_steps("slot", None)
    with pytest.raises(hk.OutOfRangeError, match="block_size"):
        adapter._companion_params(0, "sha256", "", 0, True)
    fields = {
        "lora_request": None,
        "prompt_embeds": None,
        "mm_features": [],
        "prompt_token_ids": [1, 2, 3, 4, 5],
        "_all_token_ids": [1, 2, 3, 4, 5],
        "num_prompt_tokens": 5,
        "request_id": "r",
        "cache_salt": None,
        "skip_reading_prefix_cache": False,
        "_block_hasher": object(),
        "block_hashes": [],
    }
    request = type("Request", (), {})()
    request.__dict__.update(fields)
    # No parameters set: the adapter makes the companion in Python.
    assert adapter._new_companion(request) is None
    assert "slot" not in request.__dict__
