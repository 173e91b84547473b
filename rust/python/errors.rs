//! The exception tree and the one mapping from [`CoreError`].
//!
//! ```text
//! ValueError
//! └── HybridKvError
//!     ├── OutOfRangeError            an integer argument outside its range
//!     │   └── InvalidBlockIdError    a block id outside the pool, or the null block misused
//!     ├── InvalidArgumentError       any other argument not valid for the call
//!     ├── InvalidConfigError         a manager or pool configuration that cannot work
//!     ├── UnknownRequestError        no such request in the manager
//!     ├── DoubleFreeError
//!     ├── BlockNotInUseError
//!     ├── NotEnoughFreeBlocksError
//!     └── BlockEvictedError          a block left the cache before it could be used
//! ```
//! Wrong argument types raise `TypeError`; a failed allocation of the pool's own memory raises
//! `MemoryError`.

use crate::error::CoreError;
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    hybrid_kv,
    HybridKvError,
    PyValueError,
    "Base class of hybrid-kv's errors (a ValueError)."
);
pyo3::create_exception!(
    hybrid_kv,
    OutOfRangeError,
    HybridKvError,
    "An integer argument outside its valid range (negative counts, values of 2**63 or more, \
     token ids outside [0, 2**32), more tokens than max_model_len, ...)."
);
pyo3::create_exception!(
    hybrid_kv,
    InvalidBlockIdError,
    OutOfRangeError,
    "A block id outside the pool, or the null block where it cannot be used."
);
pyo3::create_exception!(
    hybrid_kv,
    InvalidArgumentError,
    HybridKvError,
    "An argument that is not valid for the call; the message says which and why."
);
pyo3::create_exception!(
    hybrid_kv,
    InvalidConfigError,
    HybridKvError,
    "A manager or pool configuration that cannot work (group specs, block sizes, sizes)."
);
pyo3::create_exception!(
    hybrid_kv,
    UnknownRequestError,
    HybridKvError,
    "No request of this id is registered with the manager."
);
pyo3::create_exception!(
    hybrid_kv,
    DoubleFreeError,
    HybridKvError,
    "A block freed more often than it was referenced."
);
pyo3::create_exception!(
    hybrid_kv,
    BlockNotInUseError,
    HybridKvError,
    "An operation that needs a block in use got a free block."
);
pyo3::create_exception!(
    hybrid_kv,
    NotEnoughFreeBlocksError,
    HybridKvError,
    "More blocks requested than are free."
);
pyo3::create_exception!(
    hybrid_kv,
    BlockEvictedError,
    HybridKvError,
    "A cached block left the cache before it could be used: claimed by a concurrent \
     allocation before it was revived, or gone from a prefix-cache hit before it was adopted \
     (evicted, invalidated, or the prefix cache was reset; the message says which)."
);

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        let msg = err.to_string();
        match err {
            CoreError::InvalidBlockId { .. } | CoreError::NullBlock(_) => {
                InvalidBlockIdError::new_err(msg)
            }
            CoreError::DoubleFree(_) => DoubleFreeError::new_err(msg),
            CoreError::NotInUse(_) => BlockNotInUseError::new_err(msg),
            CoreError::NotEnoughFreeBlocks { .. } => NotEnoughFreeBlocksError::new_err(msg),
            CoreError::Evicted(_) | CoreError::HitEvicted { .. } => BlockEvictedError::new_err(msg),
            CoreError::OutOfMemory { .. } => PyMemoryError::new_err(msg),
            CoreError::PoolTooSmall(_)
            | CoreError::PoolTooLarge(_)
            | CoreError::RefCountOverflow { .. }
            | CoreError::OutOfRange(_) => OutOfRangeError::new_err(msg),
            CoreError::UnknownRequest(_) | CoreError::StaleHandle { .. } => {
                UnknownRequestError::new_err(msg)
            }
            CoreError::InvalidConfig(_) => InvalidConfigError::new_err(msg),
            CoreError::LengthMismatch { .. }
            | CoreError::DuplicateRequest(_)
            | CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
            CoreError::Stalled { .. } => HybridKvError::new_err(msg),
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HybridKvError", py.get_type::<HybridKvError>())?;
    m.add("OutOfRangeError", py.get_type::<OutOfRangeError>())?;
    m.add("InvalidBlockIdError", py.get_type::<InvalidBlockIdError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("InvalidConfigError", py.get_type::<InvalidConfigError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("BlockNotInUseError", py.get_type::<BlockNotInUseError>())?;
    m.add(
        "NotEnoughFreeBlocksError",
        py.get_type::<NotEnoughFreeBlocksError>(),
    )?;
    m.add("BlockEvictedError", py.get_type::<BlockEvictedError>())?;
    Ok(())
}
