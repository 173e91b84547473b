"""KV events as vLLM publishes them, for blocks hybrid-kv's manager stored and removed.

The core emits its own events, keyed by its own block hashes (XXH3). Routers that read vLLM's
event stream know blocks by vLLM's hashes (`Request.block_hashes`, SHA-256 of the pickled chain
by default), so each core event is turned into vLLM's event object with vLLM's fields:

- `BlockStored`: the core event says which group stored which of its blocks: the position of the
  call's first block and of each stored block in the request. The request that stored them is
  the one whose call produced the event, so the event covers the same block range vLLM's
  `cache_full_blocks` would, and every field (hashes, parent, token ids, LoRA, extra keys,
  session) is read from the vLLM request as vLLM reads it.
- `BlockRemoved`: one per evicted block, with the vLLM hash remembered when it was stored.
- `AllBlocksCleared`: as is.

Events are drained from the core after every call that can store or evict blocks, so each one is
attributed to its request and the order of the stream is the core's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.request import Request

import hybrid_kv as hk


class EventTranslator:
    """Turns the core's KV events into vLLM's, in order."""

    def __init__(
        self,
        core: hk.KVCacheManager,
        metadata: list[tuple[str, int | None]],
        block_sizes: list[int],
        hash_block_size: int,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        self._core = core
        self._metadata = metadata
        self._block_sizes = block_sizes
        self._hash_block_size = hash_block_size
        self._lookahead = num_hash_lookahead_tokens
        # (core hash, group) -> [vLLM external hash, blocks holding it]
        self._stored: dict[tuple[int, int], list[Any]] = {}
        self._pending: list[KVCacheEvent] = []

    def take(self) -> list[KVCacheEvent]:
        self.collect(None)
        events, self._pending = self._pending, []
        return events

    def collect(self, request: Request | None) -> None:
        """Converts the core's pending events; stores are attributed to `request`.

        Within one call vLLM allocates every group's blocks (evicting on reuse) before it caches
        any, so those removals come before its stores; the core interleaves them group by
        group. The events of one call are published in vLLM's order: removals on reuse, then
        stores and explicit removals (a Mamba state re-keyed at a longer prefix, a transient
        checkpoint dropped), each in the core's order, which is vLLM's for them.
        """
        stores: list[KVCacheEvent] = []
        for event in self._core.take_events():
            if isinstance(event, hk.BlockStored):
                if request is None:
                    raise RuntimeError("the core stored blocks outside a request's call")
                stores.append(self._stored_event(request, event))
            elif isinstance(event, hk.BlockRemoved):
                key = (event.block_hash, event.group_id)
                entry = self._stored[key]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._stored[key]
                removed = BlockRemoved(
                    block_hashes=[entry[0]], medium=MEDIUM_GPU, group_idx=event.group_id
                )
                (self._pending if event.on_reuse else stores).append(removed)
            else:
                # Everything the core published before the reset comes before it.
                self._pending.extend(stores)
                stores = []
                self._stored.clear()
                self._pending.append(AllBlocksCleared())
        self._pending.extend(stores)

    def reused(self, request: Request, hit: tuple[Any, ...]) -> None:
        """Publishes the blocks of a prefix hit, per group from the request's first block (vLLM's
        `emit_cached_block_events` for `kv_cache_report_mode="full"`); `hit` holds the hit's
        block ids per group. The blocks stay stored: nothing here is counted for removals.

        A fine-grained partial hash hit can end inside a block whose own hash the request does
        not have yet (its tokens end inside that block): vLLM 0.33 raises `IndexError` there,
        in its scheduler; this publishes the blocks up to the last one with a hash instead."""
        for group, ids in enumerate(hit):
            if len(ids):
                block_size = self._block_sizes[group]
                hashed = len(request.block_hashes) * self._hash_block_size // block_size
                n = min(len(ids), hashed)
                if n:
                    self._pending.append(self._event(request, group, block_size, 0, n, range(n)))

    def _stored_event(self, request: Request, event: hk.BlockStored) -> BlockStored:
        # Positions are in units of the event's block size: the group's, or the hash block
        # size for a Mamba state keyed at a hash boundary.
        group = event.group_id
        for i, core_hash in zip(event.block_indices, event.block_hashes, strict=True):
            entry = self._stored.setdefault(
                (core_hash, group), [self._vllm_hash(request, i, event.block_size), 0]
            )
            entry[1] += 1
        num_blocks = len(event.token_ids) // event.block_size
        return self._event(
            request,
            group,
            event.block_size,
            event.first_block,
            event.first_block + num_blocks,
            event.block_indices,
        )

    def _event(
        self,
        request: Request,
        group: int,
        block_size: int,
        start: int,
        end: int,
        indices: Sequence[int],
    ) -> BlockStored:
        """vLLM's `BlockStored` for the blocks at `indices` of a call covering blocks
        `[start, end)` of the request (vLLM's `_build_block_stored_event`)."""
        tokens = request.all_token_ids
        lookahead = self._lookahead
        extra_keys = []
        lookahead_ids: list[list[int]] | None = [] if lookahead else None
        mm_index = 0
        for i in indices:
            begin, stop = i * block_size, (i + 1) * block_size
            if lookahead_ids is None:
                keys, mm_index = generate_block_hash_extra_keys(request, begin, stop, mm_index)
            else:
                # The hash covers the tokens after the block too (vLLM's lookahead hashes).
                keys, mm_index = generate_lookahead_block_hash_extra_keys(
                    request, begin, stop, stop + lookahead, mm_index
                )
                lookahead_ids.append(tokens[stop : stop + lookahead])
            extra_keys.append(keys)
        lora = request.lora_request
        kind, sliding_window = self._metadata[group]
        return BlockStored(
            block_hashes=[self._vllm_hash(request, i, block_size) for i in indices],
            parent_block_hash=(
                None if start == 0 else self._vllm_hash(request, start - 1, block_size)
            ),
            token_ids=tokens[start * block_size : end * block_size],
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=sliding_window,
            session_id=request.session_id,
            lookahead_token_ids=lookahead_ids,
        )

    def _vllm_hash(self, request: Request, index: int, block_size: int) -> Any:
        """vLLM's external hash of block `index` of `block_size` tokens: the request's hash
        at the block's last hash boundary (vLLM's `BlockHashListWithBlockSize` view when the
        block is larger than the hash block)."""
        scale = block_size // self._hash_block_size
        return maybe_convert_block_hash(request.block_hashes[(index + 1) * scale - 1])
