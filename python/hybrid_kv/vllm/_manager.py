"""hybrid-kv's manager behind vLLM 0.33's `KVCacheManager` interface.

`HybridKVCacheManager` takes the constructor arguments of `vllm.v1.core.kv_cache_manager.
KVCacheManager` and answers the calls vLLM's `Scheduler` makes, with hybrid-kv's Rust manager
doing the work. Block ids stay in the core (int32 arrays) until vLLM asks for them as lists;
no per-block Python object is made on the scheduling path.

Each vLLM `Request` gets a companion `hybrid_kv.Request`, kept in the vLLM request's `__dict__`
(so it lives exactly as long as the vLLM request and its manager registration is dropped with
it) together with the number of tokens the companion has seen. Before each call the adapter
appends the tokens vLLM appended since and copies `num_computed_tokens`.

Most steps of a running request change nothing in the manager: no block fills, none is needed,
none leaves a window. The core's answer to each running step also says how far the request can
go that way (`KVCacheManager.running_horizon`); until then `allocate_slots` answers from the
state kept with the request (a `_VllmSlot`), in Rust before any Python frame runs and without
calling the core, which takes the tokens appended meanwhile at the request's next call.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.logger import init_logger
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlockCopy,
    _gen_prompt_embeds_extra_hash_keys,
    resolve_none_hash_seed,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

import hybrid_kv as hk
from hybrid_kv._core import (
    _empty_block_ids_entry,
    _running_steps_entry,
    _RunningBlocks,
    _RunningSteps,
    _VllmSlot,
)
from hybrid_kv.vllm._events import EventTranslator
from hybrid_kv.vllm._support import GROUP_KINDS

# Under vLLM's logger tree: its handler, level and `--log-config-file` apply to these lines.
logger = init_logger(f"vllm.{__name__}")

_EMPTY_IDS = np.zeros(0, dtype=np.int32)

# vLLM's `CacheConfig.prefix_caching_hash_algo` -> the core's hash of the prefix cache's keys.
# vLLM's default, SHA-256, is kept: blocks are keyed by a cryptographic hash, so a client cannot
# craft a prompt whose blocks another prompt's hits read. Its xxHash options, which vLLM
# documents as not cryptographically secure, get the core's XXH3-128.
HASH_ALGOS = {
    "sha256": "sha256",
    "sha256_cbor": "sha256",
    "xxhash": "xxh3",
    "xxhash_cbor": "xxh3",
}


def hash_seed(hash_algo: str) -> str:
    """The seed of the parent hash of every prompt's first block, by vLLM's rule for its own
    (`resolve_none_hash_seed`): `PYTHONHASHSEED` when it is set, otherwise a fixed seed for
    SHA-256 and a random one (per manager) for xxHash, whose keys are then not computable
    outside the process."""
    return resolve_none_hash_seed(get_hash_fn_by_name(hash_algo))


_ids_counter = itertools.count()


class Unsupported(NotImplementedError):
    """A call that only a configuration in the fallback table makes (vLLM's manager serves it)."""


def _prompt_embeds_inputs(
    request: Request, hash_block_size: int, lookahead: int
) -> list[tuple[str, int, int]]:
    """The prompt's embeddings as one keyed input per hash block: vLLM's extra key of each
    block (`_gen_prompt_embeds_extra_hash_keys`, a SHA-256 of the embeddings the block's hash
    covers, cached on the request), placed so that it keys that block only.

    A block's hash covers its tokens and the `lookahead` tokens after it (vLLM's
    `num_hash_lookahead_tokens`), and so does vLLM's digest; the core mixes into a block every
    input overlapping that range. The input of the block at `start` therefore sits at the one
    position `start + lookahead`: inside the block's own range, past the range of the block
    before it (which ends there) and before the next block. `lookahead < hash_block_size`
    (`fallback_reason` refuses the rest). Blocks past the prompt get vLLM's digest of an empty
    slice, the same for every request with embeddings, which matches no fewer and no more
    blocks than leaving it out."""
    num_prompt = request.num_prompt_tokens
    inputs = []
    for start in range(0, num_prompt, hash_block_size):
        ((_, digest),) = _gen_prompt_embeds_extra_hash_keys(
            request, start, start + hash_block_size + lookahead
        )
        inputs.append((f"embeds:{digest.hex()}", start + lookahead, 1))
    return inputs


# The core's token ids are u32; its multimodal offsets and ends are below 2^63.
_TOKEN_LIMIT = 1 << 32
_POSITION_LIMIT = (1 << 63) - 1


def _mm_problem(request: Request) -> str | None:
    """What of the request's multimodal placeholders the core cannot key (None if nothing):
    vLLM's processor places every item on at least one prompt token; an in-process engine
    can be handed any `PlaceholderRange`."""
    for index, feature in enumerate(request.mm_features):
        position = feature.mm_position
        try:
            offset = operator.index(position.offset)
            length = operator.index(position.length)
        except TypeError:
            return f"multimodal item {index}'s mm_position offset and length are not ints"
        if length <= 0:
            return f"multimodal item {index}'s mm_position length is {length}, not positive"
        if offset < 0 or offset + length > _POSITION_LIMIT:
            return (
                f"multimodal item {index}'s mm_position (offset {offset}, length {length}) "
                f"does not lie in [0, 2^63)"
            )
    return None


def _tokens_problem(request: Request, error: Exception) -> str:
    """Why the core refused to take the request's tokens (`error`, from making its companion),
    naming vLLM's field: found again here, on the refusal path only."""
    if request.num_prompt_tokens == 0:
        return "prompt is empty"
    fields = (
        ("prompt_token_ids", request.prompt_token_ids or ()),
        ("output_token_ids", request.output_token_ids),
    )
    for field, tokens in fields:
        for index, token in enumerate(tokens):
            try:
                value = operator.index(token)
            except TypeError:
                value = -1
            if not 0 <= value < _TOKEN_LIMIT:
                return f"{field}[{index}] is {token!r}, not a token id in [0, 2^32)"
    return f"tokens or block_hashes hybrid-kv cannot take: {error}"


class KVCacheBlocks:
    """vLLM's `KVCacheBlocks` interface over block ids held as int32 arrays (one per group).

    Either wraps a core `hybrid_kv.KVCacheBlocks` (a prefix hit or newly allocated blocks,
    converted only if vLLM reads them) or a tuple of arrays.
    """

    __slots__ = ("_core", "_empty", "_ids")

    def __init__(
        self,
        core: hk.KVCacheBlocks | None = None,
        ids: tuple[np.ndarray, ...] | None = None,
        empty: bool | None = None,
    ) -> None:
        self._core = core
        self._ids = ids
        # None: not known yet. The scheduler asks every running request's new blocks whether
        # they are empty on every step: the manager's shared empty instance answers at once.
        self._empty = empty

    def _arrays(self) -> tuple[np.ndarray, ...]:
        if self._ids is None:
            assert self._core is not None
            self._ids = self._core.get_block_ids()
        return self._ids

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """Block ids per group as lists (vLLM's types); None if empty and `allow_none`."""
        if allow_none and self._empty:
            return None
        if self._ids is None and group_ids is None:
            # The scheduler's read of new blocks or of a hit: lists straight from the core.
            assert self._core is not None
            return self._core.get_block_id_lists(allow_none)
        arrays = self._arrays()
        if group_ids is not None:
            arrays = tuple(arrays[g] for g in group_ids)
        if allow_none and all(len(a) == 0 for a in arrays):
            return None
        return tuple(a.tolist() for a in arrays)

    def __eq__(self, other: object) -> bool:
        # vLLM's (a dataclass) compares its block objects; these are equal when they hold the
        # same block ids per group.
        theirs = _ids_of(other)
        if theirs is None:
            return NotImplemented
        mine = self._arrays()
        return len(mine) == len(theirs) and all(
            np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)
        )

    # Mutable and compared by value, as vLLM's: not hashable.
    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled, the blocks are their ids: they read as the original, and are no lookup
        # result to pass to `allocate_slots` (the core's blocks stay in this process).
        return (KVCacheBlocks, (None, self._arrays(), self._empty))

    def __copy__(self) -> KVCacheBlocks:
        # A copy in the process is the original (the core's blocks are immutable): a lookup
        # result's copy is adopted as the original is, as with vLLM's.
        return KVCacheBlocks(self._core, self._ids, self._empty)

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCacheBlocks:
        ids = None if self._ids is None else tuple(a.copy() for a in self._ids)
        return KVCacheBlocks(self._core, ids, self._empty)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        theirs = _ids_of(other)
        if theirs is None:
            # vLLM's own (another manager's) blocks: Python's TypeError for the operands.
            return NotImplemented
        return KVCacheBlocks(
            ids=tuple(np.concatenate((a, b)) for a, b in zip(self._arrays(), theirs, strict=True))
        )

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(ids=tuple(_EMPTY_IDS for _ in self._arrays()), empty=True)

    def is_empty(self) -> bool:
        return all(len(a) == 0 for a in self._arrays())

    @property
    def blocks(self) -> Any:
        raise Unsupported("hybrid-kv keeps no per-block objects (KVCacheBlocks.blocks)")

    def get_unhashed_block_ids(self) -> list[int]:
        raise Unsupported("get_unhashed_block_ids is only used by KV connectors")

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        raise Unsupported("get_unhashed_block_ids_all_groups is only used by KV connectors")

    def __repr__(self) -> str:
        return f"KVCacheBlocks({[a.tolist() for a in self._arrays()]})"


def _ids_of(blocks: object) -> tuple[np.ndarray, ...] | None:
    """The block ids per group of the adapter's blocks: a `KVCacheBlocks`, or a running step's
    new blocks from the core's entry (`_RunningBlocks`, which reads as one); None for anything
    else (vLLM's own `KVCacheBlocks`)."""
    if isinstance(blocks, (KVCacheBlocks, _RunningBlocks)):
        return blocks._arrays()
    return None


def _reports_hits(request: Request) -> bool:
    """Whether the request asked for the blocks its prefix hits reuse to be published
    (`kv_cache_report_mode="full"`). vLLM's Request sets the mode from sampling parameters only:
    a pooling request has none (vLLM's manager reads it with the same default)."""
    return getattr(request, "kv_cache_report_mode", "incremental") == "full"


def _lookup_result(blocks: Any) -> hk.KVCacheBlocks | None:
    """The core's hit behind `new_computed_blocks` (None when it holds no block).

    vLLM's manager adopts whatever blocks it is handed. The core adopts a hit only as its lookup
    made it (it checks the hit against the request and its own pool), so blocks that are ids
    only (a sum, an unpickled copy, vLLM's own) are refused here, by name, before anything changes.
    """
    if isinstance(blocks, KVCacheBlocks):
        if blocks._core is not None or blocks.is_empty():
            return blocks._core
    elif all(len(ids) == 0 for ids in blocks.get_block_ids()):
        return None
    raise hk.InvalidArgumentError(
        f"new_computed_blocks must be get_computed_blocks' (or truncate_computed_blocks') "
        f"result of this manager, unchanged; got {type(blocks).__name__} holding block ids only"
    )


class _EmptyKVCacheBlocks(KVCacheBlocks):
    """The manager's shared empty result. The scheduler reads every running request's new
    blocks with `get_block_ids(allow_none=True)` on every step: here that is a direct entry
    answering None, and every other call is `KVCacheBlocks.get_block_ids`."""

    __slots__ = ()

    _get_block_ids = KVCacheBlocks.get_block_ids


_EmptyKVCacheBlocks.get_block_ids = _empty_block_ids_entry(_EmptyKVCacheBlocks)  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class RetainedBlock:
    """A block kept alive for a copy-on-write copy (vLLM hands its `KVCacheBlock`); the
    scheduler gives it back through `HybridKVCacheManager.block_pool.free_blocks`."""

    block_id: int


class RetainedBlockPool:
    """What vLLM's scheduler reads of the manager's `block_pool`: `free_blocks` of the blocks
    `take_kv_cache_block_copies` retained, once their copies ran. Anything else is a KV
    connector's (they use vLLM's own manager)."""

    __slots__ = ("_core",)

    def __init__(self, core: hk.KVCacheManager) -> None:
        self._core = core

    def free_blocks(self, ordered_blocks: Iterable[RetainedBlock]) -> None:
        self._core.free_retained_blocks([b.block_id for b in ordered_blocks])

    def __getattr__(self, name: str) -> Any:
        raise Unsupported(f"block_pool.{name} is only used by KV connectors")


class SingleTypeManagerView:
    """What vLLM reads of a per-group manager: `block_size`, `kv_cache_spec`, its group id."""

    __slots__ = ("block_size", "kv_cache_group_id", "kv_cache_spec")

    def __init__(self, group_id: int, spec: KVCacheSpec) -> None:
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        self.block_size = spec.block_size

    @property
    def records_new_block_ids(self) -> bool:
        return False


class CoordinatorView:
    """What vLLM's scheduler and engine core read of the coordinator."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, use_eagle: bool, num_prefill_lookahead: int
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.single_type_managers = [
            SingleTypeManagerView(i, group.kv_cache_spec) for i, group in enumerate(groups)
        ]
        # Set from the core once it is built.
        self.enable_partial_hash_hits = False
        # vLLM's: the groups holding draft layers, all of them when EAGLE drops and none is
        # flagged; the drop applies to them only with `use_eagle`.
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.drop_eagle_group_ids = self.eagle_group_ids if use_eagle else set()
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.full_attention_group_id = next(
            (
                i
                for i, m in enumerate(self.single_type_managers)
                if GROUP_KINDS.get(type(m.kv_cache_spec)) == "full"
            ),
            None,
        )

    def get_num_blocks_to_allocate(self, *args: Any, **kwargs: Any) -> int:
        raise Unsupported("coordinator.get_num_blocks_to_allocate is only used by KV connectors")


def _group_spec(index: int, spec: KVCacheSpec) -> dict[str, Any]:
    kind = GROUP_KINDS.get(type(spec))
    if kind is None:
        raise Unsupported(f"group {index}: {type(spec).__name__} is not served by hybrid-kv")
    group: dict[str, Any] = {"kind": kind, "block_size": spec.block_size}
    if kind == "sliding_window":
        group["sliding_window"] = spec.sliding_window  # type: ignore[attr-defined]
    elif kind == "chunked_local":
        group["attention_chunk_size"] = spec.attention_chunk_size  # type: ignore[attr-defined]
    elif kind == "mamba":
        group["mamba_cache_mode"] = spec.mamba_cache_mode  # type: ignore[attr-defined]
        group["num_speculative_blocks"] = spec.num_speculative_blocks  # type: ignore[attr-defined]
        group["num_prefill_checkpoint_blocks"] = spec.num_prefill_checkpoint_blocks  # type: ignore[attr-defined]
        group["prefill_checkpoint_alignment"] = spec.prefill_checkpoint_alignment  # type: ignore[attr-defined]
    return group


class HybridKVCacheManager(_RunningSteps):
    """vLLM 0.33's `KVCacheManager`, served by hybrid-kv's Rust manager.

    Built with the same arguments as vLLM's (the scheduler passes them); a configuration this
    class cannot serve is refused by `hybrid_kv.vllm._support.fallback_reason` before it is built.

    `allocate_slots` is the base class's, behind a direct entry that takes the scheduler's
    running step to it without generic argument parsing: a running request's step inside its
    horizon returns the empty result there (the horizon is the core's
    `KVCacheManager.running_horizon`, kept in the request's slot, with the call's argument
    checks); one outside it goes from there to the core's `allocate_running` unless KV events
    are on (they are collected here); every other call is `_allocate_slots`.
    """

    # The base class's `allocate_slots` behind an entry CPython calls directly, which takes the
    # scheduler's running step to it without generic argument parsing.
    allocate_slots = _running_steps_entry()

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        hash_algo: str = "sha256",
    ) -> None:
        # `hash_algo` is vLLM's `CacheConfig.prefix_caching_hash_algo` (not a vLLM manager
        # argument: the scheduler plugin passes it from the config).
        if hash_algo not in HASH_ALGOS:
            raise Unsupported(f"prefix_caching_hash_algo={hash_algo!r}")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise Unsupported("context parallelism")
        if metrics_collector is not None:
            raise Unsupported("kv_cache_metrics")
        if watermark < 0:
            raise ValueError("watermark must be non-negative")
        groups = kv_cache_config.kv_cache_groups
        # The core widens sliding windows by the tokens a multi-module drafter re-prefills, as
        # vLLM's planner tags the specs; a config tagged otherwise is not vLLM's planner's.
        extra_retained = max(0, num_prefill_lookahead - 1)
        for index, group in enumerate(groups):
            tagged = getattr(group.kv_cache_spec, "extra_retained_tokens", extra_retained)
            if tagged != extra_retained:
                raise Unsupported(
                    f"group {index} retains {tagged} extra tokens below its window "
                    f"(num_prefill_lookahead={num_prefill_lookahead} implies {extra_retained})"
                )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = None
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.coordinator = CoordinatorView(kv_cache_config, use_eagle, num_prefill_lookahead)
        eagle_groups = [i for i, g in enumerate(groups) if g.is_eagle_group]
        self.hash_algo = hash_algo
        self._core_hash = HASH_ALGOS[hash_algo]
        # With vLLM's SHA-256 options, its requests' own block hashes key the blocks (truncated
        # to 128 bits, still cryptographic). With its xxHash options the core keys them by
        # XXH3-128 seeded per manager, which a client cannot predict.
        self._supply_hashes = self._core_hash == "sha256"
        self._hash_seed = hash_seed(hash_algo)
        try:
            self.core = hk.KVCacheManager(
                [_group_spec(i, g.kv_cache_spec) for i, g in enumerate(groups)],
                kv_cache_config.num_blocks,
                max_model_len,
                enable_caching=enable_caching,
                enable_kv_events=enable_kv_cache_events,
                hash_algo=self._core_hash,
                hash_seed=self._hash_seed,
                watermark=watermark,
                max_in_flight_tokens=max_in_flight_tokens,
                prefix_cache_retention_interval=kv_cache_config.prefix_cache_retention_interval,
                use_eagle=use_eagle,
                eagle_groups=eagle_groups or None,
                num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                num_prefill_lookahead=num_prefill_lookahead,
                # As vLLM's EngineCore resolved them: the lcm of the block sizes, and their
                # gcd or `prefix_match_unit`.
                scheduler_block_size=scheduler_block_size,
                hash_block_size=hash_block_size,
                enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
                # Mamba layers or a cache of two precisions: the worker zeroes new blocks.
                needs_kv_cache_zeroing=kv_cache_config.needs_kv_cache_zeroing,
            )
        except (hk.InvalidConfigError, hk.OutOfRangeError) as error:
            # A combination vLLM accepts and the core refuses (a pool of the null block alone,
            # say): vLLM's manager serves it.
            raise Unsupported(str(error)) from error
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.coordinator.enable_partial_hash_hits = self.core.enable_partial_hash_hits
        self.mamba_shared_prefix_checkpoint = self.core.mamba_shared_prefix_checkpoint
        self._block_pool = RetainedBlockPool(self.core)
        # The core hands back this shared instance when a call allocated nothing.
        self._core_empty = self.core.empty_kv_cache_blocks
        self._allocate_running = self.core.allocate_running
        self._sync_companion = self.core.sync_companion
        self.empty_kv_cache_blocks = _EmptyKVCacheBlocks(
            ids=tuple(_EMPTY_IDS for _ in groups), empty=True
        )
        # Per-manager key of the companion request in a vLLM request's __dict__.
        self._key = f"_hybrid_kv_{next(_ids_counter)}"
        self._events: EventTranslator | None = None
        if enable_kv_cache_events:
            self._events = EventTranslator(
                self.core,
                [
                    (
                        get_kv_cache_spec_kind(g.kv_cache_spec).value,
                        get_kv_cache_spec_sliding_window(g.kv_cache_spec),
                    )
                    for g in groups
                ],
                [g.kv_cache_spec.block_size for g in groups],
                hash_block_size,
                num_hash_lookahead_tokens,
            )
            self._running_steps(self._key, self.empty_kv_cache_blocks)
        else:
            # Nothing to do after a running step but wrap its new blocks: steps outside the
            # horizon go to the core straight from `allocate_slots` too.
            self._running_steps(self._key, self.empty_kv_cache_blocks, self.core, KVCacheBlocks)
        self._companion_params(
            hash_block_size,
            self._core_hash,
            self._hash_seed,
            num_hash_lookahead_tokens,
            self._supply_hashes and enable_caching,
        )
        self._bind_per_step_calls()

    def _bind_per_step_calls(self) -> None:
        """The scheduler's once-a-step calls that only pass on to the core are the core's own
        bound methods on this instance (no Python frame in between; at 32 running requests
        these calls are a tenth of the manager's time). A subclass's override is kept."""
        cls = type(self)
        base = HybridKVCacheManager
        direct = {
            "new_step_starts": self.core.new_step_starts,
            "take_new_block_ids": self.core._take_new_block_id_list,
            "take_boundary_state_offloads": self.core.take_boundary_state_offloads,
        }
        if self._events is None:
            # No events are collected: a new empty list each step, as the method returns.
            direct["take_events"] = list
        for name, call in direct.items():
            if getattr(cls, name) is getattr(base, name):
                setattr(self, name, call)

    # ------------------------------------------------------------------ companion requests

    def _supplied_hashes(self, request: Request) -> list[Any] | None:
        """vLLM's block hashes of the request (`Request.block_hashes`, which its engine computes
        as tokens arrive), when the companion can take them instead of hashing: a SHA-256
        option, prefix caching on, a request with a block hasher whose hashes cover exactly its
        hashable blocks (the hash block size and lookahead match). None otherwise: the
        companion hashes its tokens itself, with the same keys' semantics."""
        if (
            not self._supply_hashes
            or not self.enable_caching
            or getattr(request, "_block_hasher", None) is None
        ):
            return None
        hashes = request.block_hashes
        hashable = (
            max(0, request.num_tokens - self.num_hash_lookahead_tokens) // self.hash_block_size
        )
        if not isinstance(hashes, list) or len(hashes) != hashable:
            return None
        return hashes

    def _companion(self, request: Request) -> hk.Request:
        """The request's `hybrid_kv.Request`, brought up to date with vLLM's."""
        slot = request.__dict__.get(self._key)
        if slot is None:
            # A plain request's companion is made in one call to the core's entry.
            companion = self._new_companion(request)
            if companion is not None:
                return companion
            lora = request.lora_request
            # Tagged by kind, as vLLM keeps its multimodal and embeddings extra keys apart: no
            # item's identifier (a client's `multi_modal_uuids`) spells an embeddings key.
            inputs = [
                (f"mm:{f.identifier}", f.mm_position.offset, f.mm_position.length)
                for f in request.mm_features
            ]
            tokens = request.prompt_token_ids
            # With vLLM's own block hashes nothing is hashed again.
            hashes = self._supplied_hashes(request)
            if request.prompt_embeds is not None:
                # vLLM hashes the token ids it holds (0 where an embedding stands) with a
                # per-block digest of the embeddings as an extra key.
                tokens = request.all_token_ids[: request.num_prompt_tokens]
            if request.prompt_embeds is not None and hashes is None:
                inputs += _prompt_embeds_inputs(
                    request, self.hash_block_size, self.num_hash_lookahead_tokens
                )
            companion = hk.Request(
                request.request_id,
                tokens,
                request.cache_salt,
                # vLLM keys LoRA blocks by the (name, path) pair; its repr holds the two apart
                # (adapters whose name and path join to the same text share no blocks).
                repr((lora.lora_name, lora.lora_path)) if lora is not None else None,
                inputs or None,
                block_size=self.hash_block_size,
                hash_algo=self._core_hash,
                hash_seed=self._hash_seed,
                block_hashes=hashes,
            )
            if request.skip_reading_prefix_cache:
                companion.skip_reading_prefix_cache = True
            num_prompt_tokens = request.num_prompt_tokens
            slot = _VllmSlot(companion, num_prompt_tokens)
            request.__dict__[self._key] = slot
            if len(request._all_token_ids) == num_prompt_tokens:
                # A new request: nothing past its prompt for the companion to take.
                return companion
        return self._sync_companion(request, slot)

    def refusal(self, request: Request) -> str | None:
        """What of a newly arrived request this manager cannot take, naming vLLM's field (None
        if it takes it all). The request's companion is made here, before vLLM queues the
        request, rather than at its first scheduling call: its prompt is converted and checked
        once, as that call would. A prompt whose hashed blocks the companion does not read
        (vLLM supplies their hashes) is read now only when KV events will read it."""
        if request.num_computed_tokens:
            # vLLM's scheduler counts them computed in blocks the request does not hold (only a
            # KV connector's requests, served by vLLM's manager, arrive so).
            return f"num_computed_tokens is {request.num_computed_tokens} on arrival, not 0"
        if self.enable_caching and getattr(request, "_block_hasher", None) is None:
            # vLLM's engine core gives every request one when prefix caching is on; vLLM's
            # manager finds and caches no block of a request without (the core would key its
            # blocks, and KV events read vLLM's hashes).
            return "block hasher is missing (prefix caching is on)"
        if request.num_tokens > self.max_model_len:
            # vLLM's frontend refuses such a prompt; its scheduler would schedule it with slots
            # for max_model_len tokens, which the core refuses to allocate.
            return (
                f"length ({request.num_tokens} tokens) is above max_model_len {self.max_model_len}"
            )
        problem = _mm_problem(request) if request.mm_features else None
        if problem is not None:
            return problem
        try:
            companion = self._companion(request)
            if self._events is not None and self._supplied_hashes(request) is not None:
                # KV events read those tokens at the request's first allocation: read now.
                companion.prompt_token_ids  # noqa: B018
        except (TypeError, ValueError, OverflowError) as error:
            request.__dict__.pop(self._key, None)
            # A request that ran before (a scheduler adding it again) may have its slot cached.
            self._forget_slot(request)
            return _tokens_problem(request, error)
        return None

    # ------------------------------------------------------------------ the scheduler's calls

    @property
    def usage(self) -> float:
        return self.core.usage

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        blocks, num_hit = self.core.get_computed_blocks(
            self._companion(request), max_cache_hit_length
        )
        if self._events is not None and num_hit and _reports_hits(request):
            # The request asked for the blocks its hit reuses to be published too.
            self._events.reused(request, blocks.get_block_ids())
        if len(blocks) == 0:
            return self.empty_kv_cache_blocks, num_hit, blocks.shared_prefix_boundary
        return KVCacheBlocks(blocks), num_hit, blocks.shared_prefix_boundary

    def _allocate_slots(
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
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and not num_new_computed_tokens
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        slot = None
        if (
            new_computed_blocks is None
            and has_scheduled_reqs
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or delay_cache_blocks
                or num_encoder_tokens
                or full_sequence_must_fit
                or reserved_blocks
            )
        ):
            slot = request.__dict__.get(self._key)
        if slot is not None:
            # A running request's step outside its horizon (inside, `allocate_slots` answered
            # already): the companion is brought up to date, the scheduler's counts read and
            # the next horizon left in the slot inside one core call.
            new = self._allocate_running(request, slot, num_new_tokens, num_lookahead_tokens)
        else:
            if num_encoder_tokens:
                raise Unsupported("encoder tokens (cross-attention groups)")
            hit = None
            if (
                new_computed_blocks is not None
                and new_computed_blocks is not self.empty_kv_cache_blocks
            ):
                hit = _lookup_result(new_computed_blocks)
            # Positional arguments cross faster; the scheduler's counts travel with the call.
            companion = self._companion(request)
            # Other calls change the request's blocks: no horizon until its next running call.
            request.__dict__[self._key].drop_horizon()
            new = self.core.allocate_slots(
                companion,
                num_new_tokens,
                num_new_computed_tokens,
                hit,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                0,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
                tuple(skip_zeroing_group_ids),
                request.num_computed_tokens,
                request.num_in_flight_tokens,
            )
        if self._events is not None:
            self._events.collect(request)
        if new is None:
            return None
        if new is self._core_empty:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new, empty=False)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks up to `num_computed_tokens`."""
        if not self.enable_caching:
            return
        # The running horizon stands: caching takes no block and frees none, and a group that
        # cached more would cache its next block only later than the horizon says.
        self.core.cache_blocks(self._companion(request), num_computed_tokens)
        if self._events is not None:
            self._events.collect(request)

    def free(self, request: Request) -> None:
        slot = request.__dict__.get(self._key)
        if slot is None:
            if request.is_finished():
                # A slot the running steps cached may have left its dict some other way.
                self._forget_slot(request)
            return
        slot.drop_horizon()
        self.core.free(slot.request)
        if request.is_finished():
            # Dropping the companion removes the request from the core.
            del request.__dict__[self._key]
            self._forget_slot(request)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        try:
            blocks = self.core._get_blocks(request_id)
        except hk.HybridKvError:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(blocks)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        ids = self.get_blocks(request_id).get_block_ids()
        assert ids is not None
        return ids

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        try:
            ids = self.core.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)
        except hk.UnknownRequestError:
            # As vLLM's manager: a request holding nothing (never allocated, or finished and
            # freed, as a connector's `request_finished` may see it) has empty tables.
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(a.tolist() for a in ids)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's own blocks in the prefix cache, the least over groups."""
        slot = request.__dict__.get(self._key)
        if slot is None:
            return 0
        return self.core.estimate_cached_tokens(self._sync_companion(request, slot))

    def take_events(self) -> list[Any]:
        if self._events is None:
            return []
        return self._events.take()

    def reset_prefix_cache(self) -> bool:
        # vLLM's block pool logs the outcome in these words; an operator resetting the cache
        # (after a weight update) reads it there.
        if not self.core.reset_prefix_cache():
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.core.num_blocks - self.core.num_free_blocks - 1,
            )
            return False
        logger.info("Successfully reset prefix cache")
        if self._events is not None:
            self._events.collect(None)
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def new_step_starts(self) -> None:
        self.core.new_step_starts()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def take_new_block_ids(self) -> list[int]:
        return self.core._take_new_block_id_list()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        # A request holding nothing has nothing to zero (vLLM's manager: a no-op).
        with contextlib.suppress(hk.UnknownRequestError):
            self.core.record_blocks_for_zeroing(request_id, start_token)

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[RetainedBlock]]:
        """The copy-on-write copies of partial hits for the worker, and their endpoints, which
        the core keeps referenced until the scheduler frees them through `block_pool`."""
        taken = self.core._take_kv_cache_block_copy_lists()
        if taken is None:
            return [], []
        copies, retained = taken
        return (
            [KVCacheBlockCopy(src_block_id=src, dst_block_id=dst) for src, dst in copies],
            [RetainedBlock(block_id) for block_id in retained],
        )

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return self.core.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        slot = request.__dict__.get(self._key)
        if slot is None:
            return []
        return self.core.finalize_partial_tail_offloads(
            slot.request, request.num_computed_tokens, request.num_in_flight_tokens
        )

    def create_kv_cache_blocks(self, blocks: Any) -> KVCacheBlocks:
        raise Unsupported("create_kv_cache_blocks takes vLLM block objects")

    # ------------------------------------------------------------------ connector calls

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local lookup for a request scheduled with a KV connector (vLLM's 4-tuple): for a
        Mamba hybrid, the full-attention hit and whether a lagging group hit less."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0, False
        blocks, num_hit, diverged = self.core.get_computed_blocks_for_connector(
            self._companion(request), max_cache_hit_length
        )
        if (
            self._events is not None
            and num_hit
            and blocks._is_lookup_hit
            and _reports_hits(request)
        ):
            # vLLM's answer here is its `get_computed_blocks`' (which publishes the hit) except
            # for a Mamba hybrid whose groups agree with or lag full attention.
            self._events.reused(request, blocks.get_block_ids())
        if len(blocks) == 0:
            return self.empty_kv_cache_blocks, num_hit, blocks.shared_prefix_boundary, diverged
        return KVCacheBlocks(blocks), num_hit, blocks.shared_prefix_boundary, diverged

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result cut to its first `num_computed_tokens` tokens (reference counts
        untouched, `blocks` unchanged)."""
        hit = _lookup_result(blocks)
        cut = self.core.truncate_computed_blocks(
            self._core_empty if hit is None else hit, num_computed_tokens
        )
        if len(cut) == 0:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(cut)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # A request holding nothing has nothing to free (vLLM's manager: a no-op).
        with contextlib.suppress(hk.UnknownRequestError):
            self.core.remove_skipped_blocks(
                request_id, processed_computed_tokens, num_prompt_tokens
            )

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Removes the prefix-cache entries of the given blocks (a connector's invalidation)."""
        self.core.evict_blocks(list(block_ids))
        if self._events is not None:
            # Published now, as vLLM's pool queues them: before any later call's events.
            self._events.collect(None)

    @property
    def block_pool(self) -> RetainedBlockPool:
        """Frees the blocks retained for copy-on-write copies (all vLLM's scheduler does with
        its manager's pool)."""
        return self._block_pool

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        raise Unsupported("pop_blocks_for_free returns vLLM block objects for its block pool")
