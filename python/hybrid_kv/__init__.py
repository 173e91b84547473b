"""hybrid-kv: a KV-cache manager for hybrid LLMs (sliding window, full attention, Mamba,
chunked local attention, KV sharing), with a lock-free Rust core."""

from hybrid_kv._core import (
    AllBlocksCleared,
    BlockEvictedError,
    BlockHashChain,
    BlockNotInUseError,
    BlockPool,
    BlockRemoved,
    BlockStored,
    DoubleFreeError,
    HybridKvError,
    InvalidBlockIdError,
    NotEnoughFreeBlocksError,
    __version__,
    hash_token_blocks,
)

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
