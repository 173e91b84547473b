"""Type stubs of the native module `hybrid_kv._core`."""

from collections.abc import Sequence
from typing import final

import numpy as np
import numpy.typing as npt

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
    "InvalidBlockIdError",
    "NotEnoughFreeBlocksError",
    "__version__",
    "hash_token_blocks",
]

_TokenIds = npt.NDArray[np.int32] | npt.NDArray[np.int64] | npt.NDArray[np.uint32] | Sequence[int]
_BlockIds = npt.NDArray[np.int32] | npt.NDArray[np.int64] | Sequence[int]
_BlockHashes = npt.NDArray[np.uint64] | Sequence[int]
_BlockHashLike = int | npt.NDArray[np.uint64]

class HybridKvError(ValueError): ...
class InvalidBlockIdError(HybridKvError): ...
class DoubleFreeError(HybridKvError): ...
class BlockNotInUseError(HybridKvError): ...
class NotEnoughFreeBlocksError(HybridKvError): ...
class BlockEvictedError(HybridKvError): ...

@final
class BlockStored:
    @property
    def block_hashes(self) -> list[int]: ...
    @property
    def parent_block_hash(self) -> int | None: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def group_id(self) -> int: ...

@final
class BlockRemoved:
    @property
    def block_hash(self) -> int: ...
    @property
    def group_id(self) -> int: ...

@final
class AllBlocksCleared: ...

_KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

@final
class BlockPool:
    def __new__(
        cls, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> BlockPool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def num_cached_blocks(self) -> int: ...
    def get_new_blocks(self, n: int) -> npt.NDArray[np.int32]: ...
    def free_blocks(self, block_ids: _BlockIds) -> None: ...
    def touch(self, block_ids: _BlockIds) -> None: ...
    def cache_full_blocks(
        self,
        block_ids: _BlockIds,
        block_hashes: _BlockHashes,
        group_id: int = 0,
        *,
        parent_block_hash: _BlockHashLike | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
    ) -> None: ...
    def get_cached_block(
        self, block_hash: _BlockHashLike, group_ids: Sequence[int]
    ) -> npt.NDArray[np.int32] | None: ...
    def evict_blocks(self, block_ids: _BlockIds) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def ref_count(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> tuple[int, int] | None: ...
    def free_order(self) -> npt.NDArray[np.int32]: ...
    def take_events(self) -> list[_KVEvent]: ...

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
    mm_inputs: Sequence[tuple[str, int, int]] | None = None,
) -> npt.NDArray[np.uint64]: ...

@final
class BlockHashChain:
    def __new__(
        cls,
        block_size: int,
        *,
        algo: str = "xxh3",
        seed: str = "",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_inputs: Sequence[tuple[str, int, int]] | None = None,
    ) -> BlockHashChain: ...
    def extend(self, token_ids: _TokenIds) -> npt.NDArray[np.uint64]: ...
    @property
    def hashes(self) -> npt.NDArray[np.uint64]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def __len__(self) -> int: ...
