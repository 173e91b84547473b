"""A new vLLM request's companion (`hybrid_kv.Request`), made by the adapter's `_companion`: a
plain request's in one call to the core's entry (`_new_companion`), any other in Python. Both
make the same companion: the same tokens, hashes (vLLM's when they cover exactly the hashable
blocks), salt and flags, with the tokens past the prompt taken; a request the entry does not
make is left unchanged for the Python path; a companion that cannot be made leaves no slot."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv as hk  # noqa: E402
import hybrid_kv.vllm as hkv  # noqa: E402
import numpy as np  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402

PROMPT = tuple(range(5000, 5070))


def manager(**options: Any) -> Any:
    built = harness.build_scheduler(harness.Options(layout="gemma3", **options), hkv.Scheduler)
    assert built.uses_hybrid_kv
    return built.kv_cache_manager


def request(request_id: str = "r", **spec: Any) -> Any:
    fields = {"prompt": PROMPT, "max_tokens": 10, "arrival_step": 0, **spec}
    return harness.make_request(harness.RequestSpec(request_id, **fields))


def python_made(m: Any, req: Any) -> hk.Request:
    """The companion as `_companion`'s Python path makes it (the entry turned off)."""
    entry = m._new_companion
    m._new_companion = lambda _request: None
    try:
        return m._companion(req)
    finally:
        m._new_companion = entry


def summary(companion: hk.Request, slot: Any) -> tuple[Any, ...]:
    hashes = companion.supplied_block_hashes
    return (
        companion.request_id,
        companion.num_prompt_tokens,
        companion.num_tokens,
        companion.prompt_token_ids.tolist(),
        companion.output_token_ids.tolist(),
        companion.cache_salt,
        companion.lora_name,
        companion.skip_reading_prefix_cache,
        None if hashes is None else np.asarray(hashes).tolist(),
        slot.seen,
        slot.horizon,
    )


CASES = {
    "plain": {},
    "salted": {"cache_salt": "tenant-7"},
    "outputs": {"outputs": 21},
    "outputs-a-block": {"outputs": 16},
    "skip-reading": {"skip": True},
    "short": {"prompt": (1, 2, 3)},
    "block-aligned": {"prompt": tuple(range(64))},
    "hashes-short": {"drop_hash": True},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_entry_makes_the_companion_the_python_path_makes(
    case: str, prefix_caching: bool
) -> None:
    spec = dict(CASES[case])
    outputs = spec.pop("outputs", 0)
    skip = spec.pop("skip", False)
    drop_hash = spec.pop("drop_hash", False)
    made = []
    for via_entry in (True, False):
        m = manager(prefix_caching=prefix_caching)
        req = request(**spec)
        for token in range(outputs):
            req.append_output_token_ids(9000 + token)
        req.skip_reading_prefix_cache = skip
        if drop_hash and req.block_hashes:
            req.block_hashes.pop()
        if via_entry:
            companion = m._new_companion(req)
            assert companion is not None
            assert m._companion(req) is companion
        else:
            companion = python_made(m, req)
        made.append(summary(companion, req.__dict__[m._key]))
    assert made[0] == made[1]


@pytest.mark.parametrize(
    "change",
    ["slot", "lora", "mm", "embeds", "tokens-tuple", "no-field", "salt-int", "skip-int", "id-int"],
)
def test_a_request_the_entry_does_not_make_is_left_unchanged(change: str) -> None:
    m = manager()
    req = request()
    if change == "slot":
        m._companion(req)
    elif change == "lora":
        req.__dict__["lora_request"] = object()
    elif change == "mm":
        req.__dict__["mm_features"] = [object()]
    elif change == "embeds":
        req.__dict__["prompt_embeds"] = object()
    elif change == "tokens-tuple":
        req.__dict__["prompt_token_ids"] = tuple(req.prompt_token_ids)
    elif change == "no-field":
        del req.__dict__["_block_hasher"]
    elif change == "salt-int":
        req.__dict__["cache_salt"] = 7
    elif change == "skip-int":
        req.__dict__["skip_reading_prefix_cache"] = 0
    else:
        req.__dict__["request_id"] = 7
    before = dict(req.__dict__)
    assert m._new_companion(req) is None
    assert req.__dict__ == before


@pytest.mark.parametrize("bad", [-1, 2**32, "x"])
@pytest.mark.parametrize("where", ["prompt-tail", "output"])
def test_a_companion_that_cannot_be_made_raises_as_the_python_path_and_leaves_no_slot(
    bad: Any, where: str
) -> None:
    errors = []
    for via_entry in (True, False):
        m = manager()
        # 70 tokens: 4 hashed blocks, a tail of 6 the companion reads.
        req = request()
        if where == "prompt-tail":
            req.prompt_token_ids[-1] = bad
            req._all_token_ids[len(PROMPT) - 1] = bad
        else:
            req._all_token_ids.append(bad)
            req._output_token_ids.append(bad)
        with pytest.raises((TypeError, ValueError, OverflowError)) as raised:
            if via_entry:
                m._new_companion(req)
            else:
                python_made(m, req)
        errors.append(type(raised.value))
        if via_entry:
            # The entry puts the slot in only once the companion is made (the output's sync
            # comes after: the adapter's refusal removes that slot, as for the Python path).
            if where == "prompt-tail":
                assert m._key not in req.__dict__
    assert errors[0] == errors[1]


def test_refusal_of_a_bad_token_leaves_no_slot_either_way() -> None:
    m = manager()
    req = request()
    req._all_token_ids.append(-5)
    req._output_token_ids.append(-5)
    assert m.refusal(req) is not None
    assert m._key not in req.__dict__
