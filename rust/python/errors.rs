//! The exception tree and the one mapping from [`CoreError`].

use crate::error::CoreError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pyo3::create_exception!(
    hybrid_kv,
    HybridKvError,
    PyValueError,
    "Base class of hybrid-kv's errors (a ValueError)."
);
pyo3::create_exception!(
    hybrid_kv,
    InvalidBlockIdError,
    HybridKvError,
    "A block id outside the pool, or the null block where it cannot be used."
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
    "A free block was claimed by a concurrent allocation before it could be revived."
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
            CoreError::Evicted(_) => BlockEvictedError::new_err(msg),
            CoreError::PoolTooSmall(_)
            | CoreError::PoolTooLarge(_)
            | CoreError::RefCountOverflow { .. }
            | CoreError::LengthMismatch { .. }
            | CoreError::InvalidArgument(_) => HybridKvError::new_err(msg),
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HybridKvError", py.get_type::<HybridKvError>())?;
    m.add("InvalidBlockIdError", py.get_type::<InvalidBlockIdError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("BlockNotInUseError", py.get_type::<BlockNotInUseError>())?;
    m.add(
        "NotEnoughFreeBlocksError",
        py.get_type::<NotEnoughFreeBlocksError>(),
    )?;
    m.add("BlockEvictedError", py.get_type::<BlockEvictedError>())?;
    Ok(())
}
