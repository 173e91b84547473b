//! The one error type of the core. The Python layer maps each variant to an exception once
//! (`rust/python/errors.rs`).

use crate::types::{BlockId, MAX_BLOCKS};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    // ----- the block pool -------------------------------------------------------------------
    #[error(
        "num_blocks must be at least 2 (block 0 is the null block; 1 only without KV cache \
         groups), got {0}"
    )]
    PoolTooSmall(usize),
    #[error("num_blocks {0} is too large (at most {MAX_BLOCKS})")]
    PoolTooLarge(usize),
    /// A per-block array of a pool could not be allocated (the pool is not created).
    #[error(
        "out of memory: cannot allocate {bytes} bytes for the {what} of a pool of {num_blocks} blocks"
    )]
    OutOfMemory {
        what: &'static str,
        bytes: usize,
        num_blocks: usize,
    },
    #[error("block id {id} is out of range for a pool of {num_blocks} blocks")]
    InvalidBlockId { id: i64, num_blocks: usize },
    #[error("block {0} is the null block and cannot be used here")]
    NullBlock(BlockId),
    #[error("block {0} is already free (double free)")]
    DoubleFree(BlockId),
    #[error("block {0} is free; only blocks in use can be cached")]
    NotInUse(BlockId),
    #[error("block {id} has reference count {ref_cnt}; cannot take another reference")]
    RefCountOverflow { id: BlockId, ref_cnt: u32 },
    #[error("requested {requested} blocks but only {free} are free")]
    NotEnoughFreeBlocks { requested: usize, free: usize },
    #[error("block {0} was claimed by a concurrent allocation before it could be revived")]
    Evicted(BlockId),
    #[error("{blocks} blocks but {hashes} hashes")]
    LengthMismatch { blocks: usize, hashes: usize },

    // ----- the manager ----------------------------------------------------------------------
    /// No request of this id is registered.
    #[error("unknown request id {0:?}")]
    UnknownRequest(String),
    /// A request handle whose request was removed (its slot may hold another request now).
    #[error("stale request handle (slot {slot}): its request was removed")]
    StaleHandle { slot: u32 },
    /// A request id registered twice.
    #[error("request {0:?} was already added")]
    DuplicateRequest(String),
    /// A prefix-cache hit whose block left the cache between `get_computed_blocks` and
    /// `allocate_slots` (another allocation reused it, a KV connector invalidated it, or the
    /// prefix cache was reset).
    #[error(
        "request {request:?}: block {block} of its prefix-cache hit (group {group}) {cause} \
         since get_computed_blocks; call get_computed_blocks again"
    )]
    HitEvicted {
        request: String,
        group: usize,
        block: BlockId,
        cause: HitLoss,
    },
    /// A manager or pool configuration that cannot work (group specs, block sizes, sizes).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A numeric argument outside its valid range.
    #[error("{0}")]
    OutOfRange(String),
    /// A scheduler loop that can make no more progress: nothing is running, and the request
    /// at the head of the queue can never be admitted into this pool.
    #[error(
        "no progress at step {step}: request {request:?} needs {blocks_needed} free blocks to be \
         admitted, but the pool has {num_blocks} blocks ({free_blocks} free) and nothing is \
         running that could free more"
    )]
    Stalled {
        step: usize,
        request: String,
        blocks_needed: usize,
        free_blocks: usize,
        num_blocks: usize,
    },
    /// Any other argument that is not valid for the call (the message says which and why).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// How the block of a stale prefix-cache hit left the cache ([`CoreError::HitEvicted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitLoss {
    /// `reset_prefix_cache` cleared the cache (whatever happened to the block after).
    Reset,
    /// Evicted, and now in use or cached under another key.
    Reused,
    /// Evicted and not reused (yet), as a KV connector's invalidation leaves it.
    Evicted,
}

impl std::fmt::Display for HitLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HitLoss::Reset => "was dropped when reset_prefix_cache cleared the prefix cache",
            HitLoss::Reused => "was evicted and reused",
            HitLoss::Evicted => "was evicted",
        })
    }
}

pub type Result<T, E = CoreError> = std::result::Result<T, E>;

/// `Err(CoreError::InvalidArgument(msg))`.
pub(crate) fn invalid<T>(msg: impl Into<String>) -> Result<T> {
    Err(CoreError::InvalidArgument(msg.into()))
}

/// `Err(CoreError::InvalidConfig(msg))`.
pub(crate) fn bad_config<T>(msg: impl Into<String>) -> Result<T> {
    Err(CoreError::InvalidConfig(msg.into()))
}
