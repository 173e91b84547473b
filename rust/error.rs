//! The one error type of the core. The Python layer maps each variant to an exception.

use crate::types::BlockId;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("num_blocks must be at least 2 (block 0 is the null block), got {0}")]
    PoolTooSmall(usize),
    #[error("num_blocks {0} is too large (at most {max})", max = crate::pool::MAX_BLOCKS)]
    PoolTooLarge(usize),
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
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

pub type Result<T, E = CoreError> = std::result::Result<T, E>;
