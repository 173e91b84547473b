//! hybrid-kv core: a concurrent KV block pool (lock-free reference counts and claims) with
//! prefix caching and chained block hashing, the pure-Rust half of a KV-cache manager for
//! hybrid LLMs. The PyO3 bindings live in [`python`] behind the `python` feature.

pub mod error;
pub mod hashing;
pub mod manager;
pub mod pool;
pub mod replay;
pub(crate) mod sync;
pub mod types;

#[cfg(feature = "python")]
mod python;

pub use error::{CoreError, HitLoss, Result};
pub use hashing::{BlockHashChain, BlockHasher, ExtraKeys, HashAlgo, MmInput};
pub use pool::reference::RefBlockPool;
pub use pool::BlockPool;
pub use types::{BlockHash, BlockId, CacheKey, GroupId, KvEvent, StoreInfo, NULL_BLOCK};
