"""Type stubs of the native module `hybrid_kv._core` (the Rust core's Python bindings).

Errors: every exception hybrid-kv raises for bad input is a `HybridKvError` (a `ValueError`)
or a `TypeError` for an argument of the wrong type; a failed allocation of the pool's own memory
is a `MemoryError`. Integer arguments accept `int` (and objects with `__index__`, e.g. numpy
integers); a negative value or one beyond the argument's range raises `OutOfRangeError`.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__version__: str
__all__ = [
    "AllBlocksCleared",
    "BlockEvictedError",
    "BlockHashChain",
    "BlockNotInUseError",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "DoubleFreeError",
    "HybridKvError",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "InvalidConfigError",
    "KVCacheBlocks",
    "KVCacheManager",
    "NotEnoughFreeBlocksError",
    "OutOfRangeError",
    "Request",
    "UnknownRequestError",
    "_CallTimer",
    "_GROUP_FIELDS",
    "_RunningBlocks",
    "_RunningSteps",
    "_VllmSlot",
    "__version__",
    "_available_memory",
    "_empty_block_ids_entry",
    "_int_layout",
    "_running_steps_entry",
    "hash_token_blocks",
]

_TokenIds = npt.NDArray[np.integer] | Sequence[int]
_BlockIds = npt.NDArray[np.integer] | Sequence[int]
_BlockHashes = npt.NDArray[np.uint64] | Sequence[int]
_BlockHashLike = int | npt.NDArray[np.uint64]
_MmInputs = Sequence[tuple[str, int, int]]

class HybridKvError(ValueError):
    """Base class of hybrid-kv's errors (a `ValueError`)."""

class OutOfRangeError(HybridKvError):
    """An integer argument outside its valid range: a negative count, a value of 2**63 or more,
    a token id outside [0, 2**32), more tokens than `max_model_len`, a hit count above the
    request's tokens, ..."""

class InvalidBlockIdError(OutOfRangeError):
    """A block id outside the pool, or the null block (0) where it cannot be used."""

class InvalidArgumentError(HybridKvError):
    """An argument that is not valid for the call (the message says which and why)."""

class InvalidConfigError(HybridKvError):
    """A manager or pool configuration that cannot work (group specs, block sizes, sizes)."""

class UnknownRequestError(HybridKvError):
    """No request of this id is registered with the manager."""

class DoubleFreeError(HybridKvError):
    """A block freed more often than it was referenced."""

class BlockNotInUseError(HybridKvError):
    """An operation that needs a block in use got a free block."""

class NotEnoughFreeBlocksError(HybridKvError):
    """More blocks requested than are free."""

class BlockEvictedError(HybridKvError):
    """A cached block left the cache before it could be used: claimed by a concurrent
    allocation before `BlockPool.touch` revived it, or gone from a prefix-cache hit that
    `KVCacheManager.allocate_slots` adopts, because another caller allocated, a KV connector
    invalidated it or `reset_prefix_cache` ran since `get_computed_blocks` (call it again; the
    message says which)."""

@final
class BlockStored:
    """KV event: blocks newly entered into the prefix cache by one call (vLLM's
    `BlockStored`)."""

    @property
    def block_hashes(self) -> list[int]:
        """Hashes of the newly cached blocks (128-bit ints), in order."""
    @property
    def parent_block_hash(self) -> int | None:
        """Hash of the block before the first one, or None at the start of a prompt."""
    @property
    def token_ids(self) -> list[int]:
        """Token ids the stored blocks cover (empty unless the manager keeps tokens: events
        on)."""
    @property
    def block_size(self) -> int:
        """Tokens per block of the group."""
    @property
    def group_id(self) -> int:
        """KV cache group of the blocks."""
    @property
    def kv_cache_spec_kind(self) -> str | None:
        """The group's attention kind as vLLM names it (`"full_attention"`, `"sliding_window"`,
        `"chunked_local_attention"`, `"mamba"`); None for a `BlockPool` event."""
    @property
    def kv_cache_spec_sliding_window(self) -> int | None:
        """The group's sliding window, for sliding-window groups."""
    @property
    def medium(self) -> str:
        """Where the blocks live: `"GPU"`."""
    @property
    def lora_id(self) -> int | None:
        """The request's LoRA adapter id, if given."""
    @property
    def lora_name(self) -> str | None:
        """The request's LoRA adapter name."""
    @property
    def extra_keys(self) -> list[tuple[object, ...] | None] | None:
        """Per stored block, its extra keys as vLLM publishes them (the LoRA name,
        `(identifier, offset)` per multimodal input, the cache salt on the first block), None for
        a block without any; None when no block was stored."""
    @property
    def first_block(self) -> int:
        """The position in the request of the first block of the call's range (the block after
        `parent_block_hash`); 0 for a `BlockPool` call."""
    @property
    def block_indices(self) -> list[int]:
        """The position of each stored block (in the request; in the call for a
        `BlockPool`)."""

@final
class BlockRemoved:
    """KV event: one `(hash, group)` key left the prefix cache (eviction on reuse, explicit
    eviction)."""

    @property
    def block_hash(self) -> int:
        """The removed key's hash."""
    @property
    def group_id(self) -> int:
        """The removed key's group."""
    @property
    def on_reuse(self) -> bool:
        """True when an allocation handed the block out again (vLLM evicts on reuse before
        it caches anything in the call); False when the key was removed explicitly
        (`evict_blocks`, a Mamba state keyed at a longer prefix, a transient checkpoint)."""

@final
class AllBlocksCleared:
    """KV event: the whole prefix cache was reset."""

_KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

@final
class BlockPool:
    """A pool of KV blocks with reference counts, vLLM's free order and a prefix-cache map.

    Block 0 is the null block: never handed out, never counted as free. Thread-safe; calls
    that take block lists release the GIL.
    """

    def __new__(
        cls, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> BlockPool:
        """A pool of `num_blocks` blocks (2 to 2**31 - 1, the null block included).

        Raises:
            OutOfRangeError: `num_blocks` outside that range.
            MemoryError: the pool's bookkeeping could not be allocated.
        """
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached evictable ones included (vLLM's `get_num_free_blocks`)."""
    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use (vLLM's `get_usage`)."""
    @property
    def num_cached_blocks(self) -> int:
        """`(hash, group)` keys in the prefix cache."""
    def get_new_blocks(self, n: int) -> npt.NDArray[np.int32]:
        """Takes `n` blocks from the front of the free order (evicting their cache keys).

        All or nothing. Raises:
            NotEnoughFreeBlocksError: fewer than `n` blocks are free (nothing changes).
        """
    def free_blocks(self, block_ids: _BlockIds) -> None:
        """Drops one reference to each block, in the given order (null blocks skipped).

        Blocks reaching zero join the free order: uncached ones in front, cached ones at the
        back. Pass a request's blocks tail first so its tail is evicted first.

        Raises:
            InvalidBlockIdError: an id outside the pool.
            DoubleFreeError: a block already free (nothing changes).
        """
    def touch(self, block_ids: _BlockIds) -> None:
        """Takes one more reference to each block, reviving free cached blocks.

        Raises:
            InvalidBlockIdError: an id outside the pool.
            BlockEvictedError: a free block was claimed by a concurrent allocation first
                (nothing changes).
        """
    def cache_full_blocks(
        self,
        block_ids: _BlockIds,
        block_hashes: _BlockHashes,
        group_id: int = 0,
        *,
        parent_block_hash: _BlockHashLike | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
    ) -> None:
        """Enters `block_ids[i]` into the prefix cache under `(block_hashes[i], group_id)`.

        Null blocks and blocks that already carry a key are skipped. `parent_block_hash`,
        `token_ids` and `block_size` only fill the `BlockStored` event.

        Raises:
            InvalidArgumentError: `block_ids` and `block_hashes` differ in length, or
                `token_ids` (given) are not `block_size` tokens for every block.
            BlockNotInUseError: a (non-null) block is free.
        """
    def get_cached_block(
        self, block_hash: _BlockHashLike, group_ids: Sequence[int]
    ) -> npt.NDArray[np.int32] | None:
        """One cached block per group for `block_hash` (first cached among duplicates), or
        None if any group misses."""
    def evict_blocks(self, block_ids: _BlockIds) -> None:
        """Removes the cache keys of the given blocks (reference counts untouched)."""
    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache; refused (False, nothing changes) while a block is in
        use."""
    def ref_count(self, block_id: int) -> int:
        """The block's reference count (0 when free)."""
    def block_hash(self, block_id: int) -> tuple[int, int] | None:
        """The `(hash, group)` key the block is cached under, or None."""
    def free_order(self) -> npt.NDArray[np.int32]:
        """Free blocks front to back (the order `get_new_blocks` hands them out). Not for use
        while other threads use the pool."""
    def take_events(self) -> list[_KVEvent]:
        """Drains the KV events (empty unless `enable_kv_events`)."""

def _available_memory() -> int | None:
    """Bytes this process can take without the kernel killing anyone (`MemAvailable` plus
    `SwapFree`, within its cgroups' memory limits; Linux); None where that is not known."""

_GROUP_FIELDS: tuple[str, ...]
"""The fields a group given to `KVCacheManager` as a mapping may hold."""

def _int_layout() -> str | None:
    """How the extension reads one-digit `int`s straight from the objects: "size_then_digits"
    (CPython 3.10, 3.11), "tag_then_digits" (3.12 and later), or None when the layout check
    failed at first use and every `int` goes through the C API (slower)."""

def hash_token_blocks(
    token_ids: _TokenIds,
    block_size: int,
    *,
    parent_block_hash: _BlockHashLike | None = None,
    start: int = 0,
    algo: str = "xxh3",
    seed: str = "",
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_inputs: _MmInputs | None = None,
) -> npt.NDArray[np.uint64]:
    """Chained hashes of the full blocks of `token_ids`, shape `(n, 2)` (low, high halves).

    Args:
        token_ids: token ids in [0, 2**32); trailing partial tokens are checked, not hashed.
        block_size: tokens per block, 1 to 2**20.
        parent_block_hash: hash of the block before `token_ids[0]` (None: start of a prompt).
        start: position of `token_ids[0]` in the sequence, a multiple of `block_size`.
        algo: `"xxh3"` (default), `"sha256"` or `"blake3"`.
        seed: seeds the parent hash of a sequence's first block.
        cache_salt: per-tenant isolation, mixed into the first block.
        lora_name: mixed into every block.
        mm_inputs: `(identifier, offset, length)` of each multimodal input.

    Long inputs (16,384 tokens or more) are hashed with the GIL released.
    """

@final
class BlockHashChain:
    """An incrementally extended hash chain over a growing token sequence. Thread-safe."""

    def __new__(
        cls,
        block_size: int,
        *,
        algo: str = "xxh3",
        seed: str = "",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_inputs: _MmInputs | None = None,
    ) -> BlockHashChain:
        """A chain hashing `block_size`-token blocks as `hash_token_blocks` does."""
    def extend(self, token_ids: _TokenIds) -> npt.NDArray[np.uint64]:
        """Appends tokens; returns the hashes of the blocks they completed, shape `(k, 2)`.
        All or nothing: an out-of-range id rejects the whole call."""
    @property
    def hashes(self) -> npt.NDArray[np.uint64]:
        """All hashes so far, shape `(n, 2)`."""
    @property
    def num_tokens(self) -> int:
        """Tokens appended so far."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    def __len__(self) -> int: ...

_GroupLike = Mapping[str, object] | object

@final
class Request:
    """A request as the scheduler sees it: prompt, appended outputs and the scheduler's count
    of computed tokens. Thread-safe.

    The prompt is validated and hashed when the request is made, with `block_size`, `hash_algo`
    and `hash_seed` (pass the manager's `hash_block_size` for the hashes to be reused). From
    16,384 tokens, a list is read and hashed in one pass with the GIL held, an array copied and
    then hashed with the GIL released. Like vLLM's `Request`, it keeps a reference to the
    caller's prompt, which must not change length afterwards. A manager keeps a hashed copy of
    every request it has seen; the copy and the request's blocks go when the `Request` is
    garbage collected (before any counter of the manager is read again) or `remove_request` is
    called.

    With `block_hashes` (vLLM's `Request.block_hashes`: one `bytes` per full block of
    `block_size` tokens, chained, as its engine computes them), those hashes key the request's
    blocks and nothing is hashed: each is keyed by its first 16 bytes (zero-padded if
    shorter), `hash_algo` and `hash_seed` are not used, and output tokens come with the hashes
    of the blocks they fill (`append_output_token_ids(..., block_hashes=)`). Of a list prompt
    only the tokens after its hashed blocks are read when the request is made; the rest are
    read and checked if KV events need them. A manager takes the request's hashes when they
    cover its hashable blocks (those whose `num_hash_lookahead_tokens` after them are there
    too) at its `hash_block_size`; a call that finds them short raises `InvalidArgumentError`
    and changes nothing. Two requests share a block only if their hashes are equal.
    """

    def __new__(
        cls,
        request_id: str,
        prompt_token_ids: _TokenIds,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_inputs: _MmInputs | None = None,
        *,
        block_size: int = 16,
        hash_algo: str = "xxh3",
        hash_seed: str = "",
        lora_id: int | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> Request:
        """Raises:
        InvalidArgumentError: an empty prompt.
        OutOfRangeError: a token id outside [0, 2**32), a bad `block_size`, a negative or
            overflowing multimodal offset or length.
        TypeError: a prompt that is not a 1-D integer array or a sequence of ints (`bytes` and
            `str` included, and iterators, which read only once); `block_hashes` not a sequence
            of `bytes`.
        """
    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int:
        """The scheduler's count of computed tokens (it owns it, as in vLLM); at most
        `num_tokens + num_in_flight_tokens` (a larger value raises `OutOfRangeError`): under
        async scheduling vLLM's count runs ahead of the known tokens by the positions of
        unprocessed steps, draft tokens included; set `num_in_flight_tokens` first."""
    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None: ...
    @property
    def num_in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet processed (async scheduling, pipeline parallelism):
        out-of-window blocks are freed only once processed. May exceed `num_computed_tokens`:
        as in vLLM, the tokens of steps scheduled before a preemption stay counted until their
        outputs are in, and the request then has no processed tokens."""
    @num_in_flight_tokens.setter
    def num_in_flight_tokens(self, value: int) -> None: ...
    @property
    def skip_reading_prefix_cache(self) -> bool:
        """The request reads no prefix-cache hit (vLLM sets it for prompt logprobs); its blocks
        are still cached."""
    @skip_reading_prefix_cache.setter
    def skip_reading_prefix_cache(self, value: bool) -> None: ...
    @property
    def _held_horizon(self) -> tuple[int, int, int] | None:
        """`(slots, cache, removal)` of the running horizon the request's last allocation left
        (see `KVCacheManager.allocate_slots`), or None once another call naming the request
        ended it. A manager uses it only while none of its calls changed a request's blocks by
        id (`remove_request`, ...) since it was left."""
    @property
    def prompt_token_ids(self) -> npt.NDArray[np.uint32]:
        """The prompt, read again from the caller's object."""
    @property
    def output_token_ids(self) -> npt.NDArray[np.uint32]: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def supplied_block_hashes(self) -> npt.NDArray[np.uint64] | None:
        """The keys of the `block_hashes` the request was given so far, as an `(n, 2)` array of
        (low, high) 64-bit halves; None for a request whose manager hashes its tokens."""
    def append_output_token_ids(
        self, token_ids: int | _TokenIds, block_hashes: Sequence[bytes] | None = None
    ) -> None:
        """Appends sampled tokens: an int, a sequence of ints or a 1-D integer array. A request
        made with `block_hashes` takes those of its new blocks from `block_hashes`, the hashes
        of every full block so far (vLLM's `Request.block_hashes` after the append); the ones
        it has are not read again. All or nothing.

        Raises:
            InvalidArgumentError: `block_hashes` for a request made without them.
            TypeError: `block_hashes` not a sequence of `bytes`.
        """

@final
class KVCacheBlocks:
    """Blocks per KV cache group: a prefix-cache hit (`get_computed_blocks`; pass it back to
    `allocate_slots` unchanged) or the blocks newly allocated by `allocate_slots`."""

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[npt.NDArray[np.int32], ...] | None:
        """One int32 array of block ids per group (the null block 0 where a slot needs none), or
        of the groups in `group_ids`; None with `allow_none` when they are all empty."""
    def get_block_id_lists(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """The block ids per group as lists of ints (made without arrays in between); None with
        `allow_none` when every group is empty. The ints come from one table per process (ids
        below 2^20): the same id is the same int object in every list."""
    def __add__(self, other: KVCacheBlocks, /) -> KVCacheBlocks:
        """Group-wise concatenation."""
    def __radd__(self, other: KVCacheBlocks, /) -> KVCacheBlocks: ...
    def new_empty(self) -> KVCacheBlocks:
        """Blocks with the same groups and no block."""
    @property
    def num_groups(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int:
        """Tokens the blocks cover (prefix-cache hits only; 0 for new blocks)."""
    @property
    def shared_prefix_boundary(self) -> int:
        """vLLM's shared-prefix boundary: 0, or the longer prefix some group alone had
        cached."""
    @property
    def _is_lookup_hit(self) -> bool:
        """Whether the blocks are a `get_computed_blocks` hit unchanged (not a truncation, nor
        the per-group view `get_computed_blocks_for_connector` gives a Mamba hybrid)."""
    def __len__(self) -> int: ...

@final
class KVCacheManager:
    """The KV cache manager a scheduler drives, with vLLM 0.33's `KVCacheManager` semantics.

    Thread-safe: scheduler calls are serialised on one lock; `probe` runs concurrently without
    blocking them. Calls on requests of 4,096 tokens or more release the GIL.
    """

    def __new__(
        cls,
        groups: Sequence[_GroupLike],
        num_blocks: int,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        hash_algo: str = "xxh3",
        hash_seed: str = "",
        watermark: float = 0.0,
        max_in_flight_tokens: int | None = None,
        prefix_cache_retention_interval: int | None = 0,
        use_eagle: bool = False,
        eagle_groups: Sequence[int] | None = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        needs_kv_cache_zeroing: bool | None = None,
    ) -> KVCacheManager:
        """A manager over a pool of `num_blocks` blocks (the null block included), with
        vLLM 0.33's `KVCacheManager` semantics as vLLM configures itself by default.

        Args:
            groups: the KV cache groups in group-id order (none for an attention-free model),
                each a mapping (a dict or any other) or an object with these attributes:
                `kind` and `block_size` (tokens per block), and the kind's parameters:
                `"full"`/`"full_attention"`, `"mla"`; `"rswa"` (`rswa_window`: full attention
                over the prompt, a window over the output); `"sliding_window"`
                (`sliding_window`); `"sliding_window_mla"` (`sliding_window`,
                `bounded_replay`: not prefix-cached when true); `"chunked_local"`/
                `"chunked_local_attention"` (`attention_chunk_size`); `"mamba"`
                (`mamba_cache_mode` `"align"`, the default with caching on, or `"none"`;
                `num_speculative_blocks`; `num_prefill_checkpoint_blocks`, 0 or 1, with
                `prefill_checkpoint_alignment`: the worker exports prefill checkpoints, as
                vLLM's Mamba-2 mixer does); `"circular_buffer"` (one block per request, never
                cached).
            num_blocks: blocks in the pool, the null block included.
            max_model_len: the longest sequence a request may reach.
            enable_caching: prefix caching (off: every hit is 0 and nothing is cached).
            enable_kv_events: record KV events for `take_events` (the manager then keeps every
                request's token ids, which the events report).
            hash_algo: `"xxh3"` (default), `"sha256"` or `"blake3"`.
            hash_seed: seeds the parent hash of every prompt's first block.
            watermark: fraction of `num_blocks` an admission must leave free while other
                requests are scheduled (vLLM's scheduler watermark), in [0, 1].
            max_in_flight_tokens: tokens scheduled but not yet processed at most (concurrent
                batches times `max_num_batched_tokens`); bounds what sliding-window and
                chunked-local groups reserve at admission. None: `max_model_len`.
            prefix_cache_retention_interval: vLLM's `CacheConfig` option: 0 (its default)
                keeps only the sliding-window and Mamba blocks a later hit can reach (each
                prompt's replay boundary, shared-prefix junctions); None is dense (every full
                block of every group); N also keeps one checkpoint per N tokens.
            use_eagle: EAGLE speculative decoding: hits drop their last block (the drafter
                recomputes it).
            eagle_groups: the groups holding draft layers (vLLM's `is_eagle_group`); None or
                empty: every group when `use_eagle`.
            num_hash_lookahead_tokens: tokens past a block its hash covers (drafters proving
                the boundary token).
            num_prefill_lookahead: multi-token prediction: the last
                `num_prefill_lookahead - 1` tokens may be re-prefilled: not cached, kept below
                sliding windows.
            scheduler_block_size: the token alignment of hits and cached prefixes (vLLM's
                scheduler block size). None: the lcm of the groups' block sizes.
            hash_block_size: tokens per request hash (vLLM's `prefix_match_unit` when set).
                None: the gcd of the prefix-cacheable groups' block sizes (the scheduler block
                size with caching off or a Mamba group outside `align` mode). It must divide
                every prefix-cacheable group's block size. Below the block size of an `align`
                Mamba group of a hybrid layout, hits land on hash boundaries inside blocks
                (vLLM's fine-grained partial hash hits, `enable_partial_hash_hits`) when every
                other prefix-cacheable group is full-attention-like, Mamba or of the hash
                block size.
            enable_mamba_shared_prefix_checkpoint: vLLM's `CacheConfig` option: Mamba groups
                also cache the state at a request's shared-prefix junction; acts only with
                EAGLE groups, partial hash hits and `num_prefill_lookahead` at most 1.
            needs_kv_cache_zeroing: whether the worker zeroes newly allocated attention blocks
                (vLLM's `KVCacheConfig.needs_kv_cache_zeroing`: Mamba layers, or a cache of
                more than one precision), which `take_new_block_ids` then lists, group by
                group. None: when a group is a Mamba group.

        Raises:
            InvalidConfigError: an unknown kind, a missing field, block sizes that do not
                combine, no group, a watermark outside [0, 1].
            OutOfRangeError: a negative or too large size.
        """
    @property
    def num_groups(self) -> int: ...
    @property
    def empty_kv_cache_blocks(self) -> KVCacheBlocks:
        """The shared empty result: no block in any group."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def groups(self) -> list[dict[str, object]]:
        """The groups as the constructor reads them (`kind`, `block_size`, parameters)."""
    @property
    def block_sizes(self) -> list[int]:
        """Tokens per block of each group."""
    @property
    def scheduler_block_size(self) -> int:
        """Hits are multiples of this many tokens (the lcm of the group block sizes)."""
    @property
    def hash_block_size(self) -> int:
        """Tokens per request block hash: pass it as `Request(..., block_size=...)`."""
    @property
    def enable_partial_hash_hits(self) -> bool:
        """Whether hits may end at hash block boundaries inside blocks (vLLM's coordinator
        `enable_partial_hash_hits`)."""
    @property
    def mamba_shared_prefix_checkpoint(self) -> bool:
        """Whether Mamba groups also cache states at shared-prefix junctions (vLLM's manager
        `mamba_shared_prefix_checkpoint`)."""
    @property
    def num_retained_blocks(self) -> int:
        """Blocks retained (for copy-on-write copies, or popped by `pop_blocks_for_free`) and
        not released yet."""
    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use (vLLM's `usage`)."""
    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached evictable ones included (the null block never counts)."""
    @property
    def num_cached_blocks(self) -> int:
        """`(block hash, group)` entries in the prefix cache."""
    @property
    def num_requests(self) -> int:
        """Requests the manager holds a copy of."""
    def add_request(self, request: Request) -> None:
        """Registers a request now (otherwise its first call does)."""
    def remove_request(self, request_id: str) -> None:
        """Frees the request's blocks and forgets it.

        Raises:
            UnknownRequestError: no such request.
        """
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int]:
        """The request's cached prefix: `(blocks, num_computed_tokens)`, at most
        `max_cache_hit_length` (default `num_tokens - 1`) tokens; `blocks.shared_prefix_boundary`
        is vLLM's junction, which the manager also keeps for the request's caching. A request
        with `skip_reading_prefix_cache` gets no hit. Reference counts are untouched until
        `allocate_slots` adopts the hit."""
    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, bool]:
        """The local lookup for a request scheduled with a KV connector: for a Mamba hybrid with
        full attention, the full-attention hit and `hit_diverged` (a lagging group hit less,
        so the connector must supply the state there); otherwise `get_computed_blocks` and
        False."""
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Sequence[int] = (),
        num_computed_tokens: int | None = None,
        num_in_flight_tokens: int | None = None,
    ) -> KVCacheBlocks | None:
        """Slots for `num_new_tokens` more tokens, adopting a prefix-cache hit on the request's
        first allocation; caches the request's newly full blocks (vLLM's `allocate_slots`).

        Args:
            request: the request; its `num_computed_tokens` is the scheduler's count before
                this call, its `num_in_flight_tokens` the tokens not yet processed.
            num_new_tokens: tokens to compute in this step.
            num_new_computed_tokens: tokens of the hit to adopt (`get_computed_blocks`' count).
            new_computed_blocks: the hit's blocks, unchanged.
            num_lookahead_tokens: speculative tokens: slots, never cached.
            num_external_computed_tokens: tokens a KV connector supplies after the hit (their
                blocks are allocated here).
            delay_cache_blocks: do not cache the new full blocks in this call (`cache_blocks`
                later).
            num_encoder_tokens: must be 0 (cross-attention layouts are not supported).
            full_sequence_must_fit: admission: also refuse unless the whole sequence fits now
                (sliding-window and chunked-local groups reserve what they hold at once).
            reserved_blocks: free blocks to leave for other in-flight sequences.
            has_scheduled_reqs: other requests run this step (the watermark then applies).
            skip_zeroing_group_ids: groups whose external-token blocks an asynchronous load
                writes (not recorded for zeroing).
            num_computed_tokens, num_in_flight_tokens: when given, set on the request first,
                checked as a pair (the setters' bounds, in-flight tokens first), saving a call
                each. They are the scheduler's counts: a call refused after they were set
                (bad arguments) keeps them, as the setters would have; counts out of bounds
                are refused before anything is set.

        Returns:
            The blocks handed to the worker per group (for Mamba align, null blocks and
            relocated state blocks included), or None when the pool cannot supply them.
            A None may have freed blocks that already left the sliding window or local chunk
            of the request's computed tokens (as vLLM does, which frees before it counts); it
            changes nothing else. A refusal by the `full_sequence_must_fit` check changes
            nothing at all. A Mamba hit on a state cached in this same step waits a step
            (None), as in vLLM.

        A running step (no argument besides the counts and `num_lookahead_tokens`) inside the
        request's running horizon (`running_horizon`, which every successful allocation leaves
        with the request) changes nothing and is answered from the request alone, without the
        manager's lock; the tokens appended since reach the manager at the request's next call.
        Any other call naming the request, and `remove_request`, `remove_skipped_blocks`,
        `evict_blocks` and `reset_prefix_cache`, end the horizon.

        Raises:
            InvalidArgumentError: no tokens and nothing to adopt; a hit that does not match
                the request or its count, or a request that already holds blocks.
            OutOfRangeError: more tokens than `max_model_len`, more computed tokens than the
                request has.
            BlockEvictedError: a block of the hit left the cache since `get_computed_blocks`
                (evicted, or the prefix cache was reset).

        A rejected call changes nothing and registers nothing.
        """
    def allocate_running(
        self, request: object, slot: _VllmSlot, num_new_tokens: int, num_lookahead_tokens: int
    ) -> KVCacheBlocks | None:
        """The step of a running request as vLLM's scheduler makes it, for `hybrid_kv.vllm`:
        the companion in `slot` takes the tokens vLLM's `request` appended since
        (`request._all_token_ids`) and its `num_computed_tokens` and `num_in_flight_tokens`,
        then `allocate_slots` runs with `num_new_tokens` and `num_lookahead_tokens`, and the
        slot keeps the request's `running_horizon()` (or none). Counts out of bounds change
        nothing; an error from `allocate_slots` leaves the companion's tokens taken (they are
        vLLM's) and no horizon."""
    def sync_companion(self, request: object, slot: _VllmSlot) -> Request:
        """`hybrid_kv.vllm`'s companion of vLLM's `request`: the companion in `slot` takes the
        tokens vLLM appended since (`request._all_token_ids`) and is returned. A request with
        fewer tokens than seen raises `NotImplementedError`."""
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks of its first `num_computed_tokens` tokens (after
        `allocate_slots(..., delay_cache_blocks=True)`, once the data arrived)."""
    def pop_blocks_for_free(self, request: Request) -> npt.NDArray[np.int32]:
        """Empties the request's tables without freeing: its blocks in allocation order, groups
        concatenated, leading nulls dropped (vLLM's deferred free). They stay retained, counted
        in `num_retained_blocks`, until `free_retained_blocks` gets them back, reversed."""
    def evict_blocks(self, block_ids: _BlockIds) -> None:
        """Removes the cache entries of the given blocks (a KV connector's invalidation)."""
    def take_new_block_ids(self) -> npt.NDArray[np.int32]:
        """Drains the new attention blocks the worker must zero (`needs_kv_cache_zeroing`),
        group by group in group order, as vLLM concatenates its per-group lists."""
    def _get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block tables as `KVCacheBlocks`."""
    def _take_new_block_id_list(self) -> list[int]:
        """`take_new_block_ids` as a list."""
    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Records the request's attention blocks from the block-aligned `start_token` on for
        zeroing again (blocks a failed asynchronous load left unwritten)."""
    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drains this step's Mamba states committed to the cache:
        `{request_id: [(group, block, boundary_tokens), ...]}`."""
    def take_kv_cache_block_copies(
        self,
    ) -> tuple[list[tuple[int, int]], npt.NDArray[np.int32]]:
        """Drains the copy-on-write copies `[(src, dst), ...]` partial hits queued for the
        worker (group by group) and the blocks retained for them: the endpoints of every copy,
        `[src, dst, ...]`, each keeping one reference until `free_retained_blocks` gets it
        back (vLLM's `take_kv_cache_block_copies`)."""
    def _take_kv_cache_block_copy_lists(
        self,
    ) -> tuple[list[tuple[int, int]], list[int]] | None:
        """`take_kv_cache_block_copies` with the retained blocks as a list, or None when there
        is no copy."""
    def free_retained_blocks(self, blocks: Sequence[int]) -> None:
        """Releases blocks `take_kv_cache_block_copies` retained, once their copies ran, or
        `pop_blocks_for_free` popped, in the given order (vLLM's `block_pool.free_blocks`).

        Raises:
            InvalidArgumentError: a block not retained, or released already (nothing changes).
        """
    def finalize_partial_tail_offloads(
        self,
        request: Request,
        num_computed_tokens: int | None = None,
        num_in_flight_tokens: int | None = None,
    ) -> list[tuple[int, int, int]]:
        """Mamba states the request cached inside a block at its prompt boundary, when it
        finishes exactly there with nothing in flight: `[(group, block, boundary_tokens)]`
        (vLLM's `finalize_partial_tail_offloads`); forgotten either way. The counts default
        to the request's."""
    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[npt.NDArray[np.int32], ...]:
        """The request's tables with attention groups clipped to the blocks covering
        `num_computed_tokens` (Mamba groups whole)."""
    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's own blocks in the prefix cache, the least over groups."""
    def running_horizon(self, request: Request) -> tuple[int, int, int] | None:
        """How far the running request's next `allocate_slots` calls can go without changing
        anything, as `(slots, cache, removal)`: a call with `n` new tokens, `k` lookahead tokens,
        `c` computed and `f` in flight, adopting no hit, with no external tokens, no delayed
        caching, no full-sequence check and no reserved blocks, takes, frees and caches no
        block and returns no new blocks when `c + n + k <= slots`, `c + n < cache` and
        `c - f < removal`, until another call changes the request's blocks. None when the
        request holds no blocks yet or a Mamba or circular-buffer group keeps per-step state."""
    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A hit cut to its first `num_computed_tokens` tokens (Mamba groups keep what they
        hold below it)."""
    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """vLLM's deprecated cascade-attention query: 0 per group."""
    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Frees the blocks that left the window (`allocate_slots` already does); with
        `num_prompt_tokens`, reference-sliding-window groups free the gap after the prompt."""
    def num_blocks_to_admit(
        self, request: Request, new_computed_blocks: KVCacheBlocks | None = None
    ) -> int:
        """Free blocks the admission check (`full_sequence_must_fit`) needs for the request's
        whole sequence with `new_computed_blocks` adopted (watermark not included)."""
    def free(self, request: Request) -> None:
        """Frees the request's blocks, every group tail first; the request stays known (a
        preempted request is re-admitted later). A request never allocated is a no-op."""
    def get_block_ids(self, request_id: str) -> tuple[npt.NDArray[np.int32], ...]:
        """The request's block tables, one int32 array per group."""
    def write_block_table(
        self, request_ids: Sequence[str], out: npt.NDArray[np.int32], group: int = 0
    ) -> None:
        """Writes the block tables of `group` for a batch of requests into `out`, a writable
        2-D int32 array with one row per request (any memory order). Entries past a table's
        length are left as they are; nothing is written on error.

        Raises:
            TypeError: `out` is not a writable, aligned 2-D int32 numpy array.
            InvalidArgumentError: too few rows, or a table longer than a row.
            UnknownRequestError: an unknown request id.
            OutOfRangeError: `group` out of range.
        """
    def probe(
        self,
        token_ids: _TokenIds,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_inputs: _MmInputs | None = None,
    ) -> int:
        """Tokens of this prompt cached right now (what `get_computed_blocks` would report),
        from any thread, without the GIL and without blocking the scheduler's calls."""
    def record_prefix_cache_stats(
        self, request: Request, num_hits: int, preempted: bool = False
    ) -> None:
        """Records one admission's lookup (after a successful admission). Re-admissions of
        preempted requests count apart. `num_hits` above the request's tokens raises
        `OutOfRangeError`."""
    def prefix_cache_stats(self) -> dict[str, int | float | bool]:
        """The statistics so far: `requests`, `queries`, `hits`, `hit_rate`,
        `preempted_requests`, `preempted_queries`, `preempted_hits`, `reset`."""
    def make_prefix_cache_stats(self) -> dict[str, int | float | bool]:
        """Returns the statistics and starts new ones (vLLM's `make_prefix_cache_stats`)."""
    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache; refused (False, nothing changes) while a block is in
        use."""
    def take_events(self) -> list[_KVEvent]:
        """Drains the KV events (empty unless `enable_kv_events`); `BlockStored` events carry
        their group's kind and sliding window."""
    def new_step_starts(self) -> None:
        """Call once at the start of every scheduler step (Mamba states cached in the previous
        step become usable by hits)."""

@final
class _CallTimer:
    """The scheduler benchmark's timer of the calls made on `target` through `function()` (or
    `method()`): each is passed on unchanged between two reads of the CPU's time-stamp counter;
    `ns` and `calls` add up the calls that returned or raised. A result whose type is exactly
    one of `wrap_types` comes back as `wrap(result)`, called after the clock."""

    def __new__(
        cls,
        target: Callable[..., Any],
        wrap_types: Sequence[type] | None = None,
        wrap: Callable[[Any], Any] | None = None,
    ) -> _CallTimer: ...
    def function(self) -> Callable[..., Any]:
        """The timed callable: a builtin function whose calls go to the target."""
    def method(self) -> Any:
        """The timed callable as a class attribute that binds to the instance it is read from."""
    @property
    def ns(self) -> int:
        """Nanoseconds spent in the calls so far."""
    @property
    def calls(self) -> int:
        """Calls so far."""
    @property
    def target(self) -> Callable[..., Any]: ...

@final
class _RunningBlocks:
    """The new blocks of a running step that reached the core from `_RunningSteps`'s entry:
    `get_block_ids` (vLLM's lists) is answered from the core's blocks; every other attribute is
    the adapter's `KVCacheBlocks`' over the same blocks."""

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...
    def __add__(self, value: Any, /) -> Any: ...
    def __radd__(self, value: Any, /) -> Any: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __reduce__(self) -> Any: ...

@final
class _VllmSlot:
    """What `hybrid_kv.vllm` keeps with a vLLM request: its companion `Request`, how many of
    vLLM's tokens it has taken, and the running horizon the core's last running call left."""

    def __new__(cls, request: Request, seen: int) -> _VllmSlot: ...
    @property
    def request(self) -> Request: ...
    @property
    def seen(self) -> int: ...
    @property
    def horizon(self) -> tuple[int, int, int] | None:
        """`(slots, cache, removal)` as `KVCacheManager.running_horizon`, or None."""
    @property
    def running_calls(self) -> int:
        """Running calls that reached the core (the others were answered inside the horizon)."""
    def drop_horizon(self) -> None:
        """Forgets the horizon: the next running call reaches the core."""

def _running_steps_entry() -> Any:
    """`_RunningSteps.allocate_slots` as a method descriptor whose function CPython calls
    directly: the scheduler's running step (two positional arguments, `num_lookahead_tokens` by
    name or not at all) is answered without generic argument parsing; every other call is passed
    on, arguments unchanged, to `_RunningSteps.allocate_slots`. For a subclass's body."""

def _empty_block_ids_entry(cls: type) -> Any:
    """A `get_block_ids` method descriptor for `cls`, a class whose instances are all empty
    `KVCacheBlocks`: `get_block_ids(True)` and `get_block_ids(allow_none=True)` return None
    there; every other call is passed on, arguments unchanged, to the instance's
    `_get_block_ids`."""

@disjoint_base
class _RunningSteps:
    """Base class of `hybrid_kv.vllm`'s manager: its `allocate_slots`. A running request's step
    `allocate_slots(request, n, num_lookahead_tokens=k)` (no other argument given) inside the
    horizon kept in the request's slot (`request.__dict__[key]`, a `_VllmSlot`; see
    `KVCacheManager.running_horizon`) returns `empty` at once; one outside it is
    `core.allocate_running` with its new blocks wrapped, when a core was set; every other call
    is `self._allocate_slots(request, num_new_tokens, **given)`, the other arguments given passed
    by name (an argument given as None counts as not given). A request's slot is cached by the
    request's address (the request held meanwhile) until `_forget_slot(request)`, and used only
    while it is still the one in the request's `__dict__` (that dict, and held by it)."""

    def __new__(cls, *_args: object, **_kwargs: object) -> _RunningSteps: ...
    def _running_steps(
        self,
        key: str,
        empty: object,
        core: KVCacheManager | None = None,
        wrap: Callable[[KVCacheBlocks, None, bool], object] | None = None,
    ) -> None:
        """Sets the slot key, the empty result and, with `core` and `wrap`, the core that
        running steps outside the horizon go to straight from `allocate_slots` and the wrapper
        of their new blocks (once; later calls change nothing)."""
    def _forget_slot(self, request: Any) -> None:
        """Forgets the slot `allocate_slots` cached for `request` (its slot left its dict)."""
    def _companion_params(
        self, block_size: int, hash_algo: str, hash_seed: str, lookahead: int, supply: bool
    ) -> None:
        """Sets how `_new_companion` makes companions (once; later calls change nothing): the
        hash block size, the core's hash algorithm and seed, vLLM's lookahead tokens, and
        whether vLLM's block hashes may be taken."""
    def _new_companion(self, request: Any) -> Request | None:
        """A plain vLLM request's companion, made and put in a new slot in its `__dict__` (its
        tokens past the prompt taken): None, nothing changed, for a request that has a slot,
        LoRA, multimodal inputs or prompt embeddings, or a field vLLM's `Request` keeps
        elsewhere or of another type."""
    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: Any,
        num_new_computed_tokens: Any = None,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: Any = None,
        num_external_computed_tokens: Any = None,
        delay_cache_blocks: Any = None,
        num_encoder_tokens: Any = None,
        full_sequence_must_fit: Any = None,
        reserved_blocks: Any = None,
        has_scheduled_reqs: Any = None,
        skip_zeroing_group_ids: Any = None,
    ) -> Any: ...
