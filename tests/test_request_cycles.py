"""A `Request` that is part of a reference cycle (through its prompt, which it keeps a reference
to, as vLLM's `Request` does) is found by the cycle collector: once the cycle is unreachable the
request goes and the manager frees its blocks."""

from __future__ import annotations

import gc

import hybrid_kv as hk
import numpy as np


class _Prompt(list):  # type: ignore[type-arg]
    """A prompt list that can refer back to its request."""


class _PromptArray(np.ndarray):
    """A prompt array that can refer back to its request."""


def _manager() -> hk.KVCacheManager:
    return hk.KVCacheManager([{"kind": "full", "block_size": 4}], 20, 100)


def test_a_request_in_a_cycle_through_its_prompt_list_is_collected() -> None:
    manager = _manager()
    prompt = _Prompt(range(1, 10))
    request = hk.Request("a", prompt)
    prompt.request = request  # type: ignore[attr-defined]
    assert manager.allocate_slots(request, 9) is not None
    assert manager.num_free_blocks == 16
    del prompt, request
    gc.collect()
    assert manager.num_requests == 0
    assert manager.num_free_blocks == 19


def test_a_request_in_a_cycle_through_its_prompt_array_is_collected() -> None:
    manager = _manager()
    prompt = np.arange(1, 10).view(_PromptArray)
    request = hk.Request("a", prompt)
    prompt.request = request  # type: ignore[attr-defined]
    assert manager.allocate_slots(request, 9) is not None
    del prompt, request
    gc.collect()
    assert manager.num_requests == 0
    assert manager.num_free_blocks == 19


def test_a_vllm_slot_in_a_cycle_through_its_companion_is_collected() -> None:
    manager = _manager()
    prompt = _Prompt(range(1, 10))
    request = hk.Request("a", prompt)
    slot = hk._core._VllmSlot(request, 0)
    prompt.slot = slot  # type: ignore[attr-defined]
    assert manager.allocate_slots(request, 9) is not None
    del prompt, request, slot
    gc.collect()
    assert manager.num_requests == 0
    assert manager.num_free_blocks == 19
