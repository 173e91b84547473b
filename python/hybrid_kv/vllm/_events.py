"""KV events as vLLM publishes them, for blocks hybrid-kv's manager stored and removed.

The core emits its own events, keyed by its own block hashes (XXH3). Routers that read vLLM's
event stream know blocks by vLLM's hashes (`Request.block_hashes`, SHA-256 of the pickled chain
by default), so each core event is turned into vLLM's event object with vLLM's fields:

- `BlockStored`: the core event says which group stored which of its blocks, with the core hash
  of the block before them. The request that stored them is the one whose call produced the
  event; a per-request chain of core hashes gives the block index of that parent, so the event
  covers the same block range vLLM's `cache_full_blocks` would, and every field (hashes, parent,
  token ids, LoRA, extra keys, session) is read from the vLLM request as vLLM reads it.
- `BlockRemoved`: one per evicted block, with the vLLM hash remembered when it was stored.
- `AllBlocksCleared`: as is.

Events are drained from the core after every call that can store or evict blocks, so each one is
attributed to its request and the order of the stream is the core's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.request import Request

import hybrid_kv as hk

_CHAIN_KEY = "_hybrid_kv_event_chain"


def _hash_ints(rows: np.ndarray) -> list[int]:
    """Core hashes as the ints its events carry: (lo, hi) uint64 rows -> hi << 64 | lo."""
    return [(int(hi) << 64) | int(lo) for lo, hi in rows]


class _Chain:
    """A request's core block hashes, extended as its tokens grow, indexed by value."""

    __slots__ = ("chain", "index")

    def __init__(self, request: Request, hash_block_size: int) -> None:
        lora = request.lora_request
        self.chain = hk.BlockHashChain(
            hash_block_size,
            cache_salt=request.cache_salt,
            lora_name=f"{lora.lora_name}\0{lora.lora_path}" if lora is not None else None,
            mm_inputs=[
                (f.identifier, f.mm_position.offset, f.mm_position.length)
                for f in request.mm_features
            ]
            or None,
        )
        self.index: dict[int, int] = {}

    def position(self, request: Request, core_hash: int) -> int:
        """The block index of `core_hash` in the request's chain."""
        found = self.index.get(core_hash)
        if found is None:
            tokens = request.all_token_ids[self.chain.num_tokens :]
            new = _hash_ints(self.chain.extend(np.asarray(tokens, dtype=np.int64)))
            start = len(self.index)
            self.index.update((h, start + i) for i, h in enumerate(new))
            found = self.index.get(core_hash)
        if found is None:
            raise RuntimeError(
                f"a stored block of request {request.request_id!r} is not in its hash chain"
            )
        return found


class EventTranslator:
    """Turns the core's KV events into vLLM's, in order."""

    def __init__(
        self,
        core: hk.KVCacheManager,
        metadata: list[tuple[str, int | None]],
        block_sizes: list[int],
        hash_block_size: int,
    ) -> None:
        self._core = core
        self._metadata = metadata
        self._block_sizes = block_sizes
        self._hash_block_size = hash_block_size
        # (core hash, group) -> [vLLM external hash, blocks holding it]
        self._stored: dict[tuple[int, int], list[Any]] = {}
        self._pending: list[KVCacheEvent] = []

    def take(self) -> list[KVCacheEvent]:
        self.collect(None)
        events, self._pending = self._pending, []
        return events

    def collect(self, request: Request | None) -> None:
        """Converts the core's pending events; stores are attributed to `request`.

        Within one call vLLM allocates every group's blocks (evicting) before it caches any, so
        its removals come before its stores; the core interleaves them group by group. The
        events of one call are published in vLLM's order: removals, then stores, each in the
        core's order.
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
                self._pending.append(
                    BlockRemoved(
                        block_hashes=[entry[0]], medium=MEDIUM_GPU, group_idx=event.group_id
                    )
                )
            else:
                self._stored.clear()
                self._pending.append(AllBlocksCleared())
        self._pending.extend(stores)

    def _stored_event(self, request: Request, event: hk.BlockStored) -> BlockStored:
        group = event.group_id
        block_size = self._block_sizes[group]
        chain = request.__dict__.get(_CHAIN_KEY)
        if chain is None:
            chain = request.__dict__[_CHAIN_KEY] = _Chain(request, self._hash_block_size)
        parent = event.parent_block_hash
        start = 0 if parent is None else chain.position(request, parent) + 1
        num_blocks = len(event.token_ids) // block_size
        stored = {chain.position(request, h): h for h in event.block_hashes}
        vllm_hashes = request.block_hashes
        hashes = []
        extra_keys = []
        mm_index = 0
        for i in range(start, start + num_blocks):
            core_hash = stored.get(i)
            if core_hash is None:
                continue  # a null block in the range, skipped as vLLM skips it
            external = maybe_convert_block_hash(vllm_hashes[i])
            hashes.append(external)
            entry = self._stored.setdefault((core_hash, group), [external, 0])
            entry[1] += 1
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * block_size, (i + 1) * block_size, mm_index
            )
            extra_keys.append(keys)
        lora = request.lora_request
        kind, sliding_window = self._metadata[group]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None
            if start == 0
            else maybe_convert_block_hash(vllm_hashes[start - 1]),
            token_ids=request.all_token_ids[start * block_size : (start + num_blocks) * block_size],
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=sliding_window,
            session_id=request.session_id,
        )
