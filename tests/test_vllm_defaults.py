"""vLLM 0.33's default configuration through the Python API: sparse retention, Mamba align
prefix caching, EAGLE, connector calls, KV events with vLLM's fields, the spec kinds. Expected
values follow vLLM's rules (shared/reference/vllm-semantics.md), worked out by hand."""

from __future__ import annotations

import hybrid_kv as hk
import numpy as np
import pytest

FULL = {"kind": "full", "block_size": 4}
SW8 = {"kind": "sliding_window", "block_size": 4, "sliding_window": 8}
CHUNKED8 = {"kind": "chunked_local", "block_size": 4, "attention_chunk_size": 8}
MAMBA = {"kind": "mamba", "block_size": 4}


def ids(blocks: hk.KVCacheBlocks) -> list[list[int]]:
    return [x.tolist() for x in blocks.get_block_ids()]


def admit(m: hk.KVCacheManager, req: hk.Request, n: int | None = None) -> tuple:
    blocks, hit = m.get_computed_blocks(req)
    n = req.num_tokens - hit if n is None else n
    new = m.allocate_slots(
        req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks, full_sequence_must_fit=True
    )
    return blocks, hit, new


# ----- retention ----------------------------------------------------------------------------------


def test_retention_defaults_to_vllms_zero_and_can_be_dense_or_periodic() -> None:
    # A 26-token prompt, one window-8 group of 4-token blocks: 6 full blocks.
    kept = {}
    for retention in (0, None, 8):
        m = hk.KVCacheManager([SW8], 32, 1024, prefix_cache_retention_interval=retention)
        m.allocate_slots(hk.Request("a", list(range(26)), block_size=4), 26)
        kept[retention] = m.num_cached_blocks
    default = hk.KVCacheManager([SW8], 32, 1024)
    default.allocate_slots(hk.Request("a", list(range(26)), block_size=4), 26)
    # 0: the 2 blocks before the replay boundary 24; dense: all 6; 8 tokens = 2 blocks a
    # segment needs all of them (a hit needs 2 blocks): all 6.
    assert kept == {0: 2, None: 6, 8: 6}
    assert default.num_cached_blocks == 2
    with pytest.raises(hk.InvalidConfigError):
        hk.KVCacheManager([SW8], 32, 1024, prefix_cache_retention_interval=6)
    with pytest.raises(hk.InvalidConfigError):
        hk.KVCacheManager([FULL], 32, 1024, prefix_cache_retention_interval=8)


def test_retention_on_chunked_local_and_full_groups_is_refused_saying_why() -> None:
    # vLLM refuses it too: chunked local attention caches densely, retention only thins
    # sliding-window and Mamba checkpoints. 0 and None are accepted.
    why = r"only thins .* sliding-window and Mamba .*\(chunked_local_attention, full_attention\)"
    with pytest.raises(hk.InvalidConfigError, match=why):
        hk.KVCacheManager([CHUNKED8, FULL], 32, 1024, prefix_cache_retention_interval=8)
    for retention in (0, None):
        hk.KVCacheManager([CHUNKED8, FULL], 32, 1024, prefix_cache_retention_interval=retention)


def test_a_shared_prefix_junction_is_reported_and_pinned() -> None:
    m = hk.KVCacheManager([FULL, SW8], 64, 1024)
    m.allocate_slots(hk.Request("a", list(range(40)), block_size=4), 40)
    b = hk.Request("b", list(range(24)) + list(range(1000, 1016)), block_size=4)
    blocks, hit, new = admit(m, b)
    assert (hit, blocks.shared_prefix_boundary) == (0, 24)
    assert new is not None
    c = hk.Request("c", list(range(24)) + list(range(2000, 2016)), block_size=4)
    assert m.get_computed_blocks(c)[1] == 24


# ----- Mamba align --------------------------------------------------------------------------------


def test_mamba_align_caches_the_state_at_the_checkpoint_and_defers_same_step_hits() -> None:
    m = hk.KVCacheManager([FULL, MAMBA], 64, 1024)
    assert m.groups[1]["mamba_cache_mode"] == "align"
    a = hk.Request("a", list(range(18)), block_size=4)
    new = m.allocate_slots(a, 16)  # the scheduler's split ends the chunk at 16
    state = ids(new)[1]
    assert state[:3] == [0, 0, 0] and state[3] > 0
    assert m.take_boundary_state_offloads() == {"a": [(1, state[3], 16)]}
    assert m.take_new_block_ids().tolist() == ids(new)[0]
    b = hk.Request("b", list(range(18)), block_size=4)
    blocks, hit, new_b = admit(m, b, 2)
    assert hit == 16 and ids(blocks)[1] == [0, 0, 0, state[3]]
    assert new_b is None, "the state is written by this step's forward pass"
    m.new_step_starts()
    _, hit, new_b = admit(m, b, 2)
    assert hit == 16 and new_b is not None
    assert m.get_block_ids("b")[1].tolist()[3] == state[3]


def test_mamba_none_mode_needs_caching_off_and_holds_speculative_blocks() -> None:
    none = {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "none"}
    with pytest.raises(hk.InvalidConfigError, match="align"):
        hk.KVCacheManager([none], 64, 1024)
    spec = none | {"num_speculative_blocks": 2}
    m = hk.KVCacheManager([spec], 64, 1024, enable_caching=False)
    new = m.allocate_slots(hk.Request("a", list(range(40))), 40)
    assert len(ids(new)[0]) == 5


MAMBA2 = MAMBA | {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}


def test_mamba2_final_chunk_exports_the_prompt_checkpoint_into_a_block_of_its_own() -> None:
    # An 18-token prompt in one chunk (vLLM's scheduler leaves it whole when the worker can
    # export the checkpoint): the state after (18 - 1) // 4 * 4 = 16 tokens goes into slot
    # cdiv(18, 4) - 2 = 3, beside the running state in slot 4.
    m = hk.KVCacheManager([FULL, MAMBA2], 64, 1024)
    assert m.groups[1]["num_prefill_checkpoint_blocks"] == 1
    assert m.groups[1]["prefill_checkpoint_alignment"] == 1
    free = m.num_free_blocks
    a = hk.Request("a", list(range(18)), block_size=4)
    new = m.allocate_slots(a, 18)
    state = ids(new)[1]
    assert state[:3] == [0, 0, 0] and 0 not in state[3:] and len(state) == 5
    assert free - m.num_free_blocks == 5 + 2
    m.new_step_starts()
    blocks, hit, new_b = admit(m, hk.Request("b", list(range(18)), block_size=4), 2)
    assert hit == 16 and ids(blocks)[1] == [0, 0, 0, state[3]]
    assert new_b is not None
    # Mamba-1 (no exports): the same chunk holds one state and caches none.
    plain = hk.KVCacheManager([FULL, MAMBA], 64, 1024)
    plain.allocate_slots(hk.Request("a", list(range(18)), block_size=4), 18)
    _, hit, _ = admit(plain, hk.Request("b", list(range(18)), block_size=4), 2)
    assert hit == 0


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"num_prefill_checkpoint_blocks": 2}, hk.InvalidConfigError, "at most 1"),
        ({"prefill_checkpoint_alignment": 0}, hk.InvalidConfigError, "positive"),
        ({"prefill_checkpoint_alignment": -1}, hk.OutOfRangeError, "prefill_checkpoint_alignment"),
        ({"num_prefill_checkpoint_blocks": "1"}, TypeError, "num_prefill_checkpoint_blocks"),
    ],
)
def test_mamba2_checkpoint_parameters_are_validated(
    change: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        hk.KVCacheManager([FULL, MAMBA2 | change], 64, 1024)


def test_mamba2_checkpoints_need_align_mode_and_an_alignment() -> None:
    # In none mode, or without an alignment, vLLM never exports: no extra block.
    for group, caching in (
        (MAMBA2 | {"mamba_cache_mode": "none"}, False),
        (MAMBA | {"num_prefill_checkpoint_blocks": 1}, True),
    ):
        plain = {k: v for k, v in group.items() if "checkpoint" not in k}
        held = []
        for g in (group, plain):
            m = hk.KVCacheManager([FULL, g], 64, 1024, enable_caching=caching)
            assert "prefill_checkpoint_alignment" not in m.groups[1]
            a = hk.Request("a", list(range(18)), block_size=4)
            held.append(len([b for b in ids(m.allocate_slots(a, 18))[1] if b]))
        assert held[0] == held[1]


# ----- EAGLE --------------------------------------------------------------------------------------


def test_eagle_drops_the_last_matched_block() -> None:
    for eagle, hit in ((False, 16), (True, 12)):
        m = hk.KVCacheManager([FULL], 64, 1024, use_eagle=eagle)
        m.allocate_slots(hk.Request("a", list(range(20)), block_size=4), 20)
        assert m.get_computed_blocks(hk.Request("b", list(range(20)), block_size=4))[1] == hit


def test_eagle_groups_must_exist() -> None:
    with pytest.raises(hk.InvalidConfigError):
        hk.KVCacheManager([FULL], 64, 1024, use_eagle=True, eagle_groups=[3])


# ----- connectors and the rest of the API ---------------------------------------------------------


@pytest.mark.parametrize("spare", range(-3, 3))
def test_a_mamba_admission_with_external_tokens_fits_whole_or_changes_nothing(spare: int) -> None:
    # Full + Mamba align, blocks of 4: 11 external tokens and 20 new ones take 8 attention
    # blocks, one Mamba block for the external state and one for the running state: 10.
    # vLLM's count (9) leaves out the external state's block, and vLLM 0.33 fails its pool
    # allocation halfway when exactly 9 are free; hybrid-kv refuses the call untouched.
    num_blocks = 11 + spare  # one of them is the null block
    m = hk.KVCacheManager([FULL, MAMBA], num_blocks, 1024)
    req = hk.Request("a", list(range(40)), block_size=4)
    free = m.num_free_blocks
    new = m.allocate_slots(req, 20, num_external_computed_tokens=11)
    if free < 10:
        assert new is None
        assert m.num_free_blocks == free
        assert [len(g) for g in m.get_block_ids("a")] == [0, 0]
    else:
        assert new is not None and len(ids(new)[0]) == 5
        assert m.num_free_blocks == free - 10
        full, mamba = m.get_block_ids("a")
        assert len(full) == 8 and [i for i, b in enumerate(mamba) if b] == [2, 7]


def test_external_tokens_delayed_caching_and_the_connector_lookups() -> None:
    m = hk.KVCacheManager([FULL], 64, 1024)
    m.allocate_slots(hk.Request("a", list(range(16)), block_size=4), 16)
    b = hk.Request("b", list(range(30)), block_size=4)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16
    new = m.allocate_slots(
        b,
        4,
        num_new_computed_tokens=16,
        new_computed_blocks=blocks,
        num_external_computed_tokens=8,
        delay_cache_blocks=True,
    )
    assert len(ids(new)[0]) == 1
    assert len(m.get_block_ids("b")[0]) == 7
    before = m.num_cached_blocks
    m.cache_blocks(b, 28)
    assert m.num_cached_blocks == before + 3
    assert m.estimate_cached_tokens(b) == 28
    assert len(m.get_block_ids_for_computed_tokens("b", 9)[0]) == 3
    c = hk.Request("c", list(range(30)), block_size=4)
    blocks, n, diverged = m.get_computed_blocks_for_connector(c)
    assert (n, diverged) == (28, False)
    cut = m.truncate_computed_blocks(blocks, 8)
    assert ids(cut)[0] == ids(blocks)[0][:2]
    table = m.get_block_ids("b")[0].tolist()
    free = m.num_free_blocks
    popped = m.pop_blocks_for_free(b)
    assert popped.tolist() == table
    assert m.get_block_ids("b")[0].tolist() == []
    assert m.num_free_blocks == free, "popped, not freed"


def test_prompt_logprobs_requests_read_no_hit_and_are_not_counted() -> None:
    m = hk.KVCacheManager([FULL], 64, 1024)
    m.allocate_slots(hk.Request("a", list(range(20)), block_size=4), 20)
    b = hk.Request("b", list(range(20)), block_size=4)
    assert m.get_computed_blocks(b, max_cache_hit_length=10)[1] == 8
    b.skip_reading_prefix_cache = True
    assert m.get_computed_blocks(b)[1] == 0
    m.record_prefix_cache_stats(b, 0)
    assert m.prefix_cache_stats()["requests"] == 0
    b.skip_reading_prefix_cache = False
    assert m.get_computed_blocks(b)[1] == 16


def test_allocate_slots_can_set_the_schedulers_counts() -> None:
    m = hk.KVCacheManager([SW8], 64, 1024, enable_caching=False)
    req = hk.Request("a", list(range(16)), block_size=4)
    m.allocate_slots(req, 16)
    req.append_output_token_ids(1)
    m.allocate_slots(req, 1, num_computed_tokens=16, num_in_flight_tokens=0)
    assert (req.num_computed_tokens, req.num_in_flight_tokens) == (16, 0)
    assert m.get_block_ids("a")[0].tolist()[0] == 0, "16 computed: block 0 left the window"
    with pytest.raises(hk.OutOfRangeError):
        m.allocate_slots(req, 1, num_computed_tokens=18)
    assert req.num_computed_tokens == 16


def test_computed_tokens_run_ahead_of_the_known_tokens_only_by_those_in_flight() -> None:
    # Async scheduling with drafts: vLLM's count includes the positions of unprocessed steps.
    m = hk.KVCacheManager([FULL], 64, 1024)
    req = hk.Request("a", list(range(8)), block_size=4)
    # Slots for the prompt and the draft positions of the steps in flight.
    m.allocate_slots(req, 8, num_lookahead_tokens=8)
    with pytest.raises(hk.OutOfRangeError):
        req.num_computed_tokens = 9
    req.num_in_flight_tokens = 4
    req.num_computed_tokens = 12
    with pytest.raises(hk.OutOfRangeError):
        req.num_computed_tokens = 13
    assert req.num_computed_tokens == 12
    # Tokens in flight have no bound of their own (vLLM keeps those of steps scheduled before
    # a preemption until their outputs are in: test_manager.py).
    req.num_in_flight_tokens = 13
    req.num_in_flight_tokens = 4
    # Passed together, the pair is checked as a pair and nothing changes on a refusal.
    with pytest.raises(hk.OutOfRangeError):
        m.allocate_slots(req, 4, num_computed_tokens=14, num_in_flight_tokens=5)
    assert (req.num_computed_tokens, req.num_in_flight_tokens) == (12, 4)
    assert m.allocate_slots(req, 4, num_computed_tokens=13, num_in_flight_tokens=5) is not None
    assert (req.num_computed_tokens, req.num_in_flight_tokens) == (13, 5)


def test_reserved_blocks_are_left_free() -> None:
    m = hk.KVCacheManager([FULL], 6, 1024)
    req = hk.Request("a", list(range(20)), block_size=4)
    assert m.allocate_slots(req, 20, reserved_blocks=1) is None
    assert m.allocate_slots(req, 20) is not None


def test_in_flight_tokens_keep_the_window_until_processed() -> None:
    m = hk.KVCacheManager([SW8], 64, 1024, enable_caching=False)
    req = hk.Request("a", list(range(16)), block_size=4)
    m.allocate_slots(req, 16)
    req.num_computed_tokens = 16
    req.append_output_token_ids(1)
    req.num_in_flight_tokens = 8  # the last 8 tokens are scheduled but not processed
    m.allocate_slots(req, 1)
    # Processed 8 tokens: only block 0 left the window (token 8 - 8 + 1 = 1 skipped: none).
    assert m.get_block_ids("a")[0].tolist()[0] != 0
    req.num_in_flight_tokens = 0
    req.num_computed_tokens = 17
    req.append_output_token_ids(2)
    m.allocate_slots(req, 1)
    assert m.get_block_ids("a")[0].tolist()[:2] == [0, 0]


def test_kv_cache_blocks_add_and_select_groups() -> None:
    m = hk.KVCacheManager([FULL, SW8], 64, 1024)
    a = m.allocate_slots(hk.Request("a", list(range(8)), block_size=4), 8)
    b = m.allocate_slots(hk.Request("b", list(range(100, 104)), block_size=4), 4)
    both = a + b
    assert ids(both) == [ids(a)[0] + ids(b)[0], ids(a)[1] + ids(b)[1]]
    assert [x.tolist() for x in both.get_block_ids(group_ids=[1])] == [ids(a)[1] + ids(b)[1]]
    empty = a.new_empty()
    assert empty.get_block_ids(allow_none=True) is None
    assert ids(m.empty_kv_cache_blocks) == [[], []]
    # As lists of ints (vLLM's types), the null block included.
    lists = both.get_block_id_lists()
    assert lists == tuple(ids(both)) and all(type(b) is int for g in lists for b in g)
    assert empty.get_block_id_lists() == ([], []) and empty.get_block_id_lists(True) is None
    assert m.get_num_common_prefix_blocks("a") == [0, 0]


# ----- KV events ----------------------------------------------------------------------------------


def test_stored_events_carry_vllms_fields() -> None:
    m = hk.KVCacheManager([FULL], 64, 1024, enable_kv_events=True)
    req = hk.Request(
        "a",
        list(range(12)),
        cache_salt="tenant",
        lora_name="adapter",
        mm_inputs=[("img", 2, 4)],
        block_size=4,
        lora_id=7,
    )
    m.allocate_slots(req, 12)
    (stored,) = [e for e in m.take_events() if isinstance(e, hk.BlockStored)]
    assert (stored.medium, stored.lora_id, stored.lora_name) == ("GPU", 7, "adapter")
    assert stored.kv_cache_spec_kind == "full_attention"
    assert stored.extra_keys == [
        ("adapter", ("img", 2), "tenant"),
        ("adapter", ("img", -2)),
        ("adapter",),
    ]
    assert (stored.first_block, stored.block_indices) == (0, [0, 1, 2])
    # The next call's range starts after the cached blocks.
    req.num_computed_tokens = 12
    req.append_output_token_ids([5, 6, 7, 8])
    m.allocate_slots(req, 4)
    (stored,) = [e for e in m.take_events() if isinstance(e, hk.BlockStored)]
    assert (stored.first_block, stored.block_indices) == (3, [3])
    assert stored.parent_block_hash is not None


def test_a_full_block_larger_than_the_hash_block_is_keyed_again_at_the_prompt_tail() -> None:
    # Blocks of 8 hashed every 4 (a prefix match unit of 4): a 14-token prompt's last boundary
    # a resend can match is 13 // 4 * 4 = 12, inside full block 1. Hits stop at multiples of 8,
    # so the key at 12 comes with block 1's own, once 16 tokens are computed.
    full8 = {"kind": "full", "block_size": 8}
    sw8 = {"kind": "sliding_window", "block_size": 8, "sliding_window": 16}
    m = hk.KVCacheManager([full8, sw8], 12, 1024, hash_block_size=4, enable_kv_events=True)
    req = hk.Request("a", list(range(14)), block_size=4)
    m.allocate_slots(req, 14)
    (block0,) = [e for e in m.take_events() if isinstance(e, hk.BlockStored) and e.group_id == 0]
    req.num_computed_tokens = 14
    req.append_output_token_ids([100, 101])
    m.allocate_slots(req, 2)
    stored = [e for e in m.take_events() if isinstance(e, hk.BlockStored) and e.group_id == 0]
    assert [(e.block_size, e.first_block, len(e.block_hashes)) for e in stored] == [
        (8, 1, 1),
        (4, 2, 1),
    ]
    block1, tail = stored
    assert tail.token_ids == list(range(8, 12))
    assert tail.parent_block_hash == block0.block_hashes[0]  # the hash at 8 tokens
    # Again: nothing new. A 13-token resend hits the one whole block before the boundary.
    m.cache_blocks(req, 16)
    assert not [e for e in m.take_events() if isinstance(e, hk.BlockStored) and e.group_id == 0]
    other = hk.Request("b", list(range(13)), block_size=4)
    assert m.get_computed_blocks(other)[1] == 8
    # Reused, block 1 loses both keys, its own first.
    m.free(req)
    m.take_events()
    # Other requests take all but one free block (each takes a full and a window block).
    takers = [hk.Request(f"c{i}", [1000 + i] * 8, block_size=4) for i in range(6)]
    assert [m.allocate_slots(t, 8) is not None for t in takers] == [True] * 5 + [False]
    removed = [e.block_hash for e in m.take_events() if isinstance(e, hk.BlockRemoved)]
    at = removed.index(block1.block_hashes[0])
    assert removed[at + 1] == tail.block_hashes[0]


def test_a_masked_out_range_still_publishes_an_empty_stored_event() -> None:
    # Retention 0, window 5 (a hit needs 1 block of 4): a 26-token prompt keeps only block 5,
    # before its replay boundary 24. A first chunk of 20 tokens offers blocks 0..4 and stores
    # none of them; vLLM still publishes the event, with no hashes.
    sw5 = {"kind": "sliding_window", "block_size": 4, "sliding_window": 5}
    m = hk.KVCacheManager([sw5], 64, 1024, enable_kv_events=True)
    req = hk.Request("a", list(range(26)), block_size=4)
    m.allocate_slots(req, 20)  # blocks 0..4 full, none reachable
    events = [e for e in m.take_events() if isinstance(e, hk.BlockStored)]
    assert len(events) == 1 and events[0].block_hashes == [] and events[0].extra_keys is None
    assert len(events[0].token_ids) == 20


# ----- kinds --------------------------------------------------------------------------------------


def test_every_kind_vllm_accepts_builds_and_serves_a_request() -> None:
    groups = [
        FULL,
        {"kind": "mla", "block_size": 4},
        {"kind": "rswa", "block_size": 4, "rswa_window": 8},
        {"kind": "sliding_window_mla", "block_size": 4, "sliding_window": 8},
        {"kind": "circular_buffer", "block_size": 4},
    ]
    m = hk.KVCacheManager(groups, 128, 1024, prefix_cache_retention_interval=None)
    assert [g["kind"] for g in m.groups] == [
        "full",
        "mla",
        "rswa",
        "sliding_window_mla",
        "circular_buffer",
    ]
    new = m.allocate_slots(hk.Request("a", list(range(20)), block_size=4), 20)
    assert [len(x) for x in ids(new)] == [5, 5, 5, 5, 1]
    # Circular buffers and bounded-replay windows are never cached; the rest are.
    assert m.num_cached_blocks == 4 * 5
    m2 = hk.KVCacheManager(
        [
            FULL,
            {
                "kind": "sliding_window_mla",
                "block_size": 4,
                "sliding_window": 8,
                "bounded_replay": True,
            },
        ],
        64,
        1024,
        prefix_cache_retention_interval=None,
    )
    m2.allocate_slots(hk.Request("a", list(range(20)), block_size=4), 20)
    assert m2.num_cached_blocks == 5


def test_an_attention_free_model_needs_only_the_null_block() -> None:
    m = hk.KVCacheManager([], 1, 1024)
    req = hk.Request("r", np.arange(10))
    assert m.allocate_slots(req, 10).get_block_ids() == ()
    assert (m.num_free_blocks, m.usage) == (0, 0.0)


def test_allocate_running_syncs_a_vllm_request_in_one_call() -> None:
    # What hybrid_kv.vllm does for a running request: the companion takes the tokens vLLM
    # appended and the scheduler's counts, then allocates.
    import types

    from hybrid_kv._core import _VllmSlot

    m = hk.KVCacheManager([FULL], 64, 1024)
    prompt = list(range(8))
    req = hk.Request("a", prompt, block_size=4)
    m.allocate_slots(req, 8)
    vllm_req = types.SimpleNamespace(
        _all_token_ids=[*prompt, 100], num_computed_tokens=8, num_in_flight_tokens=0
    )
    slot = _VllmSlot(req, 8)
    assert (slot.request, slot.seen, slot.horizon, slot.running_calls) == (req, 8, None, 0)
    new = m.allocate_running(vllm_req, slot, 1, 0)
    assert new is not None and new.get_block_ids()[0].tolist() != []
    assert slot.seen == 9 and req.num_tokens == 9 and req.num_computed_tokens == 8
    # The running horizon follows: 3 blocks (12 slots), 2 cached (the third is cached at 12
    # tokens), nothing ever leaves full attention.
    assert slot.horizon == m.running_horizon(req) == (12, 12, 2**64 - 1)
    assert slot.running_calls == 1
    slot.drop_horizon()
    assert slot.horizon is None
    # Counts out of bounds change nothing, not even the tokens; the horizon is dropped.
    m.allocate_running(vllm_req, slot, 1, 0)
    vllm_req._all_token_ids.append(101)
    vllm_req.num_computed_tokens = 12
    with pytest.raises(hk.OutOfRangeError):
        m.allocate_running(vllm_req, slot, 1, 0)
    assert slot.seen == 9 and req.num_tokens == 9 and req.num_computed_tokens == 8
    assert slot.horizon is None and slot.running_calls == 2
    # A token id out of range, a slot of the wrong type, tokens that went away.
    vllm_req.num_computed_tokens = 9
    vllm_req._all_token_ids[-1] = 2**40
    with pytest.raises(hk.OutOfRangeError):
        m.allocate_running(vllm_req, slot, 1, 0)
    for not_a_token in ("x", 1.0, None):
        vllm_req._all_token_ids[-1] = not_a_token
        with pytest.raises(TypeError):
            m.allocate_running(vllm_req, slot, 1, 0)
    vllm_req._all_token_ids[-1] = 101
    with pytest.raises(TypeError):
        m.allocate_running(vllm_req, [req, 9, -1, 0, 0], 1, 0)
    with pytest.raises(TypeError):
        _VllmSlot("a", 9)
    with pytest.raises(NotImplementedError):
        m.allocate_running(
            types.SimpleNamespace(**{**vars(vllm_req), "_all_token_ids": prompt}), slot, 1, 0
        )
    assert slot.seen == 9 and req.num_tokens == 9
    assert m.allocate_running(vllm_req, slot, 1, 0) is not None
    assert slot.seen == 10 and req.num_tokens == 10 and req.num_computed_tokens == 9
    # A sync takes each token once, however often it runs.
    assert m.sync_companion(vllm_req, slot) is req and m.sync_companion(vllm_req, slot) is req
    assert slot.seen == 10 and req.num_tokens == 10
    # Ints of other types (numpy's, bool) are token ids as ints are.
    vllm_req._all_token_ids += [np.int64(102), True]
    vllm_req.num_computed_tokens = 11
    assert m.allocate_running(vllm_req, slot, 1, 0) is not None
    assert list(req.output_token_ids[-2:]) == [102, 1]
    # A step that fills the slots its blocks hold leaves no horizon in the slot: every later
    # step starts past them. The manager's own horizon (for any next call) still stands.
    assert (req.num_computed_tokens, m.running_horizon(req)) == (11, (12, 16, 2**64 - 1))
    assert slot.horizon is None and slot.running_calls == 4


def test_the_scheduler_and_hash_block_sizes_can_be_given_as_vllm_resolves_them() -> None:
    # vLLM's EngineCore resolves both: the lcm of the groups' block sizes, and their gcd or
    # `prefix_match_unit`. Blocks key on the hash at their last boundary; hits land on the
    # scheduler block size whatever the hashes.
    full8 = {"kind": "full", "block_size": 8}
    sw8 = {"kind": "sliding_window", "block_size": 8, "sliding_window": 16}
    default = hk.KVCacheManager([full8, sw8], 64, 1024)
    assert (default.scheduler_block_size, default.hash_block_size) == (8, 8)
    # Dense retention: the window group keeps every full block, so a hit can end anywhere.
    dense = {"prefix_cache_retention_interval": None}
    fine = hk.KVCacheManager([full8, sw8], 64, 1024, hash_block_size=4, **dense)
    assert (fine.scheduler_block_size, fine.hash_block_size) == (8, 4)
    coarse = hk.KVCacheManager(
        [full8, sw8], 64, 1024, scheduler_block_size=16, hash_block_size=4, **dense
    )
    assert (coarse.scheduler_block_size, coarse.hash_block_size) == (16, 4)
    prompt = list(range(40))
    for m, hit in ((fine, 24), (coarse, 16)):
        _, first_hit, _ = admit(m, hk.Request("a", prompt, block_size=4))
        assert first_hit == 0
        # 28 shared tokens: full blocks cover 24 of them; the coarse manager aligns to 16.
        other = prompt[:28] + [999] * 12
        _, got, new = admit(m, hk.Request("b", other, block_size=4))
        assert got == hit, (m.scheduler_block_size, got)
        assert new is not None
    for bad in ({"hash_block_size": 3}, {"hash_block_size": 16}, {"scheduler_block_size": 12}):
        with pytest.raises(hk.InvalidConfigError):
            hk.KVCacheManager([full8, sw8], 64, 1024, **bad)


# ----- running horizon ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups,retention",
    [([FULL], None), ([FULL, SW8], 0), ([FULL, SW8], None), ([SW8, CHUNKED8], 0)],
    ids=["full", "full+sw-default", "full+sw-dense", "sw+chunked"],
)
def test_running_horizon_bounds_the_steps_that_change_nothing(
    groups: list[dict], retention: int | None
) -> None:
    # One request decodes with 0-2 lookahead slots; before each step the horizon says whether
    # the step changes nothing. It must, exactly then: no new block, no free, no cache entry,
    # no event, and the block tables unchanged.
    m = hk.KVCacheManager(
        groups, 64, 1024, prefix_cache_retention_interval=retention, enable_kv_events=True
    )
    req = hk.Request("r", list(range(10)), block_size=4)
    assert m.running_horizon(req) is None  # holds no blocks yet
    admit(m, req)
    req.num_computed_tokens = 10
    inside_steps = 0
    for step in range(60):
        req.append_output_token_ids(100 + step)
        computed, lookahead = req.num_computed_tokens, step % 3
        slots, cache, removal = m.running_horizon(req)
        inside = computed + 1 + lookahead <= slots and computed + 1 < cache and computed < removal
        m.take_events()
        before = (m.get_block_ids("r"), m.num_free_blocks, m.num_cached_blocks)
        new = m.allocate_slots(req, 1, num_lookahead_tokens=lookahead)
        after = (m.get_block_ids("r"), m.num_free_blocks, m.num_cached_blocks)
        unchanged = (
            all(len(g) == 0 for g in new.get_block_ids())
            and not m.take_events()
            and before[1:] == after[1:]
            and all(np.array_equal(x, y) for x, y in zip(before[0], after[0], strict=True))
        )
        assert unchanged == inside, f"step {step}: horizon {(slots, cache, removal)}"
        inside_steps += inside
        req.num_computed_tokens = computed + 1
    # Most decode steps are inside: only block boundaries leave it.
    assert inside_steps >= 30


def test_concurrent_syncs_of_one_slot_take_each_token_once() -> None:
    # Reading vLLM's request may run Python code (here a property that yields to other
    # threads) between the slot's count of tokens seen and its update: each token is still
    # taken once, and a failing sync (a token id out of range) takes none.
    import time

    from hybrid_kv._core import _VllmSlot
    from thread_runner import run_threads

    m = hk.KVCacheManager([FULL], 256, 4096)
    prompt = list(range(8))
    req = hk.Request("a", prompt, block_size=4)
    m.allocate_slots(req, 8)
    tokens = list(prompt)

    class Slow:
        @property
        def _all_token_ids(self) -> list[int]:
            time.sleep(0.0001)
            return tokens

    vllm_req = Slow()
    slot = _VllmSlot(req, 8)

    def sync(i: int) -> None:
        for j in range(50):
            m.sync_companion(vllm_req, slot)
            if i == 0:
                tokens.append(1000 + j)

    run_threads(sync, 4)
    m.sync_companion(vllm_req, slot)
    assert slot.seen == len(tokens) == req.num_tokens == 58
    assert list(req.output_token_ids) == tokens[8:]
    tokens.append(2**40)
    with pytest.raises(hk.OutOfRangeError):
        m.sync_companion(vllm_req, slot)
    assert slot.seen == req.num_tokens == 58
