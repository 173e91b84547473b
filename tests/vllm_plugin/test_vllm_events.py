"""KV events: `hybrid_kv.vllm.Scheduler` publishes vLLM's own event objects (BlockStored,
BlockRemoved, AllBlocksCleared) with the fields and block hashes stock vLLM publishes for the same
run, and vLLM's ZMQ publisher carries them to a subscriber unchanged."""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv.vllm as hkv  # noqa: E402
import msgspec  # noqa: E402
import zmq  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

WORKLOAD = harness.chat_workload(40, seed=2, salts=(None, "tenant-b"))


def recorded_events(
    options: harness.Options, scheduler_cls: Any = None, workload: Any = WORKLOAD
) -> list[Any]:
    scheduler = harness.build_scheduler(options, scheduler_cls)
    if scheduler_cls is not None:
        assert scheduler.uses_hybrid_kv
    recorder = harness.EventRecorder()
    scheduler.kv_event_publisher = recorder
    driver = harness.Driver(scheduler, workload)
    for _ in driver.run():
        pass
    events = [event for batch in recorder.batches for event in batch.events]
    assert scheduler.reset_prefix_cache()
    # No step follows to publish the reset: take its event from the manager.
    events.extend(scheduler.kv_cache_manager.take_events())
    return events


@pytest.mark.parametrize(
    "layout,num_blocks,dense,eagle",
    [
        ("full", 260, True, ""),
        # MLA groups: events name vLLM's MLA kind.
        ("deepseek", 260, True, ""),
        ("gpt-oss", 330, True, ""),
        ("gemma3", 1400, True, ""),
        ("gpt-oss", 330, False, ""),
        ("gemma3", 1400, False, ""),
        ("jamba", 700, False, ""),
        # Block sizes 16 and 32: the window group stores every second request hash.
        ("mixed-bs", 300, False, ""),
        ("mixed-bs", 300, True, ""),
        # Lookahead hashes (EAGLE-3's default): every stored block's hash covers the next token.
        ("gpt-oss", 330, False, "eagle3"),
        # Multi-token prediction: exported Mamba checkpoints re-keyed at their slot's prefix.
        ("granite4", 700, False, "mtp"),
        # Hashes every 8 tokens, blocks of 16: full-attention blocks also stored (and removed)
        # under the prompt's last hash boundary inside them.
        ("gpt-oss", 330, False, "unit8"),
        ("gemma3", 1400, True, "unit8"),
        ("gpt-oss", 330, False, "eagle3+unit8"),
        # Mamba blocks of 16 above the hash block: partial hash hits (Mamba states stored at
        # hash boundaries inside blocks, moved to copies without events).
        ("jamba", 700, False, "unit8"),
        ("granite4", 700, False, "unit8"),
    ],
)
def test_events_equal_stock_vllms(layout: str, num_blocks: int, dense: bool, eagle: str) -> None:
    # "+unit8" (or "unit8" alone): a prefix match unit of 8 tokens.
    unit8 = eagle.endswith("unit8")
    method = eagle.removesuffix("unit8").removesuffix("+")
    options = harness.Options(
        layout=layout,
        num_blocks=num_blocks,
        kv_events=True,
        dense_retention=dense,
        eagle_tokens=2 if method else 0,
        eagle_method=method or "eagle3",
        prefix_match_unit=8 if unit8 else None,
    )
    expected = recorded_events(options)
    got = recorded_events(options, hkv.Scheduler)
    kinds = {type(e) for e in expected}
    assert {BlockStored, BlockRemoved, AllBlocksCleared} <= kinds, "the run should evict"
    assert len(got) == len(expected)
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"event {i} differs"
    # vLLM's hashes (the low 64 bits of its SHA-256 chain, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
    # not the core's XXH3 ones.
    stored = [e for e in got if isinstance(e, BlockStored)]
    assert all(0 <= h < 2**64 for e in stored for h in e.block_hashes)


def test_events_of_prompt_embedding_requests_equal_stock_vllms() -> None:
    # Each stored block's extra keys carry vLLM's digest of its embeddings (published bare: a
    # 32-byte SHA-256).
    options = harness.Options(
        layout="gpt-oss", num_blocks=330, kv_events=True, dense_retention=False, prompt_embeds=True
    )
    workload = [dataclasses.replace(spec, embeds=i % 2 == 0) for i, spec in enumerate(WORKLOAD)]
    expected = recorded_events(options, workload=workload)
    got = recorded_events(options, hkv.Scheduler, workload=workload)
    assert any(
        key is not None and any(isinstance(k, bytes) and len(k) == 32 for k in key)
        for e in expected
        if isinstance(e, BlockStored)
        for key in (e.extra_keys or [])
    )
    assert got == expected


@pytest.mark.parametrize(
    "layout,num_blocks", [("full", 260), ("gpt-oss", 330), ("jamba", 700), ("mixed-bs", 300)]
)
def test_full_report_mode_publishes_the_blocks_a_hit_reuses(layout: str, num_blocks: int) -> None:
    # A request may ask (SamplingParams.extra_args) for the blocks its prefix hit reuses to be
    # published too; vLLM then emits a BlockStored per group for them.
    workload = [
        dataclasses.replace(spec, kv_cache_report_mode="full" if i % 2 else None)
        for i, spec in enumerate(WORKLOAD)
    ]
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, kv_events=True, dense_retention=False
    )
    expected = recorded_events(options, workload=workload)
    got = recorded_events(options, hkv.Scheduler, workload)
    baseline = recorded_events(options)
    assert len(expected) > len(baseline), "some hits should have been reported"
    assert len(got) == len(expected)
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"event {i} differs"


@pytest.mark.parametrize("layout,num_blocks", [("full", 260), ("gpt-oss", 330), ("jamba", 700)])
def test_events_of_pooling_requests_equal_stock_vllms(layout: str, num_blocks: int) -> None:
    # Pooling requests (no sampling parameters, so no `kv_cache_report_mode` on vLLM's Request)
    # among generation requests asking for their hits to be published.
    workload = harness.with_pooling(WORKLOAD)
    options = harness.Options(
        layout=layout, num_blocks=num_blocks, kv_events=True, dense_retention=False
    )
    expected = recorded_events(options, workload=workload)
    assert recorded_events(options, hkv.Scheduler, workload) == expected


def test_events_of_lora_requests_equal_stock_vllms() -> None:
    loras = (None, ("alpha", 1, "/adapters/alpha"), ("alpha", 2, "/adapters/alpha-v2"))
    workload = [dataclasses.replace(s, lora=loras[i % 3]) for i, s in enumerate(WORKLOAD)]
    options = harness.Options(
        layout="gpt-oss", num_blocks=330, kv_events=True, dense_retention=False, lora=True
    )
    expected = recorded_events(options, workload=workload)
    got = recorded_events(options, hkv.Scheduler, workload)
    assert any(isinstance(e, BlockStored) and e.lora_name == "alpha" for e in expected)
    assert len(got) == len(expected)
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"event {i} differs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replay_all(endpoint: str, expected_batches: int, timeout_s: float = 20.0) -> list[Any]:
    """Asks the publisher's replay socket for every batch from sequence 0 and decodes them."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    batches: list[KVEventBatch] = []
    while time.monotonic() < deadline:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            batches = []
            while dealer.poll(int((deadline - time.monotonic()) * 1000)):
                _, topic, seq, payload = dealer.recv_multipart()
                if payload == b"":  # end of the replay
                    break
                assert int.from_bytes(seq, "big") == len(batches)
                batches.append(decoder.decode(payload))
        finally:
            dealer.close(linger=0)
        if len(batches) >= expected_batches:
            return batches
        time.sleep(0.1)  # the publisher thread has not sent everything yet
    raise AssertionError(f"replayed {len(batches)} of {expected_batches} batches")


def test_events_cross_vllms_zmq_publisher_to_a_subscriber() -> None:
    options = harness.Options(layout="gpt-oss", num_blocks=330, kv_events=True)
    expected = recorded_events(options)

    replay = f"tcp://127.0.0.1:{_free_port()}"
    config = harness.vllm_config(options)
    config.kv_events_config.publisher = "zmq"
    config.kv_events_config.endpoint = f"inproc://hybrid-kv-events-{_free_port()}"
    config.kv_events_config.replay_endpoint = replay
    scheduler = harness.build_scheduler(options, hkv.Scheduler, config)
    assert scheduler.uses_hybrid_kv
    published = 0
    original_publish = scheduler.kv_event_publisher.publish

    def counting_publish(batch: KVEventBatch) -> None:
        nonlocal published
        published += 1
        original_publish(batch)

    scheduler.kv_event_publisher.publish = counting_publish
    try:
        for _ in harness.Driver(scheduler, WORKLOAD).run():
            pass
        batches = _replay_all(replay, published)
    finally:
        scheduler.kv_event_publisher.shutdown()
    events = [event for batch in batches for event in batch.events]
    # The stock run also recorded the final reset's AllBlocksCleared; this run has no reset.
    assert expected[-1] == AllBlocksCleared()
    assert events == expected[:-1]


def test_a_reported_partial_hit_past_the_requests_hashes_publishes_its_hashed_blocks() -> None:
    # Jamba hashed every 8 tokens (Mamba blocks of 16 above it: fine-grained partial hash
    # hits). A resend of a 105-token prompt hits 104 tokens, which end inside the request's
    # 7th block of 16; the request has 13 hashes of 8 tokens, so whole-block hashes for 6
    # blocks. Publishing the hit for `kv_cache_report_mode="full"`, vLLM 0.33's scheduler
    # indexes a 7th and raises IndexError; hybrid-kv publishes the 6 hashed blocks.
    prompt = tuple(range(1000, 1105))
    workload = [
        harness.RequestSpec("first", prompt, max_tokens=4, arrival_step=0),
        harness.RequestSpec(
            "resend", prompt, max_tokens=4, arrival_step=10, kv_cache_report_mode="full"
        ),
    ]
    options = harness.Options(layout="jamba", kv_events=True, prefix_match_unit=8)
    with pytest.raises(IndexError):
        recorded_events(options, workload=workload)
    got = recorded_events(options, hkv.Scheduler, workload)
    resend = harness.make_request(workload[1], block_size=8)
    whole_block_hashes = [int.from_bytes(h[-8:], "big") for h in resend.block_hashes[1::2]]
    reported = [
        e
        for e in got
        if isinstance(e, BlockStored) and e.group_idx == 0 and e.parent_block_hash is None
    ]
    # The first request stores its blocks as it runs; the resend's report is the last one.
    assert reported[-1].block_hashes == whole_block_hashes[:6]
    assert reported[-1].token_ids == list(prompt[:96])


def _stored_then_looked_up(manager: Any, evict_tail: bool) -> list[Any]:
    """A 70-token prompt computed in chunks of 32, 32 and 6 tokens (a Mamba group keeps its
    states at 32 and 64), cached and finished; then a resend asking for its hit's blocks to be
    published, looked up as a KV connector does: the events of that lookup. `evict_tail`: the
    first group's last hit block is invalidated before (as a connector does with blocks it
    learnt are bad), so a Mamba group hits deeper than full attention."""
    prompt = tuple(range(5000, 5070))
    first = harness.make_request(harness.RequestSpec("first", prompt, 4, 0))
    for chunk in (32, 32, 6):
        manager.allocate_slots(first, chunk)
        first.num_computed_tokens += chunk
        manager.cache_blocks(first, first.num_computed_tokens)
    first.status = RequestStatus.FINISHED_STOPPED
    manager.free(first)
    resend = harness.make_request(
        harness.RequestSpec("resend", prompt, 4, 0, kv_cache_report_mode="full")
    )
    if evict_tail:
        hit = manager.get_computed_blocks_for_connector(resend)[0].get_block_ids()
        manager.evict_blocks({hit[0][-1]})
    manager.take_events()
    assert manager.get_computed_blocks_for_connector(resend)[1] > 0
    return manager.take_events()


@pytest.mark.parametrize(
    "layout,evict_tail",
    [("full", False), ("gpt-oss", False), ("jamba", False), ("jamba", True)],
)
def test_a_connectors_lookup_publishes_a_reported_hit_as_vllms(
    layout: str, evict_tail: bool
) -> None:
    # vLLM's `get_computed_blocks_for_connector` is its `get_computed_blocks` (which publishes a
    # reported hit's blocks) except for a Mamba hybrid whose groups agree or lag full attention:
    # that per-group view publishes nothing.
    options = harness.Options(layout=layout, num_blocks=100, kv_events=True)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv
    expected = _stored_then_looked_up(harness.build_scheduler(options).kv_cache_manager, evict_tail)
    assert bool(expected) == (layout != "jamba" or evict_tail)
    assert _stored_then_looked_up(ours.kv_cache_manager, evict_tail) == expected


@pytest.mark.parametrize("layout", ["full", "gpt-oss"])
def test_a_pooling_requests_hit_publishes_as_vllms(layout: str) -> None:
    # A pooling request (an embedding model's) has no sampling parameters, so vLLM's Request
    # sets no `kv_cache_report_mode` on it: its hit is looked up, and published as incremental.
    prompt = list(range(5000, 5070))
    options = harness.Options(layout=layout, num_blocks=100, kv_events=True)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv
    published = []
    for manager in (harness.build_scheduler(options).kv_cache_manager, ours.kv_cache_manager):
        requests = [
            Request(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=None,
                pooling_params=PoolingParams(),
                block_hasher=harness._block_hasher(harness.BLOCK_SIZE),
            )
            for rid in ("first", "second")
        ]
        manager.allocate_slots(requests[0], len(prompt))
        requests[0].num_computed_tokens = len(prompt)
        manager.cache_blocks(requests[0], len(prompt))
        blocks, num_hit, _ = manager.get_computed_blocks(requests[1])
        assert num_hit == 64
        published.append((blocks.get_block_ids(), manager.take_events()))
    assert published[1] == published[0]
