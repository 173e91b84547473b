//! `hybrid_kv.hash_token_blocks` and `hybrid_kv.BlockHashChain`.

use super::convert::{
    extract_hash, extract_mm_inputs, hashes_to_numpy, Count, Text, TokenFn, Tokens, UInt,
};
use crate::error::Result;
use crate::hashing::{BlockHashChain, BlockHasher, ExtraKeys, HashAlgo, TokenId};
use crate::types::BlockHash;
use numpy::PyArray2;
use pyo3::prelude::*;
use std::sync::Mutex;

/// Token arrays at least this long are hashed with the GIL released (also by `Request`).
pub(crate) const DETACH_HASH_TOKENS: usize = 1 << 14;

/// The extra keys of a request or a hash chain, from the Python arguments.
pub(crate) fn extra_keys(
    cache_salt: Option<Text>,
    lora_name: Option<Text>,
    mm_inputs: Option<&Bound<'_, PyAny>>,
) -> PyResult<ExtraKeys> {
    Ok(ExtraKeys::new(
        cache_salt.map(Text::into_string),
        lora_name.map(Text::into_string),
        extract_mm_inputs(mm_inputs)?,
    )?)
}

struct HashAll<'a> {
    hasher: &'a BlockHasher,
    parent: Option<BlockHash>,
    start: usize,
    extra: &'a ExtraKeys,
}

impl TokenFn<Result<Vec<BlockHash>>> for HashAll<'_> {
    fn call<T: TokenId + Send + Sync>(self, tokens: &[T]) -> Result<Vec<BlockHash>> {
        let mut out = Vec::new();
        self.hasher
            .hash_blocks(self.parent, tokens, self.start, self.extra, &mut out)
            .map(|_| out)
    }
}

/// Chained hashes of the full blocks of `token_ids`, as an `(n, 2)` uint64 array of
/// (low, high) 64-bit halves.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, *, parent_block_hash = None, start = UInt(0), algo = Text::Static("xxh3"), seed = Text::Static(""), cache_salt = None, lora_name = None, mm_inputs = None), text_signature = "(token_ids, block_size, *, parent_block_hash=None, start=0, algo='xxh3', seed='', cache_salt=None, lora_name=None, mm_inputs=None)")]
#[allow(clippy::too_many_arguments)]
fn hash_token_blocks<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: Count,
    parent_block_hash: Option<&Bound<'py, PyAny>>,
    start: Count,
    algo: Text,
    seed: Text,
    cache_salt: Option<Text>,
    lora_name: Option<Text>,
    mm_inputs: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let hasher = BlockHasher::new(block_size.get(), HashAlgo::parse(&algo)?, &seed)?;
    let start = start.get();
    let extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
    let parent = parent_block_hash.map(extract_hash).transpose()?;
    let tokens = Tokens::extract(token_ids)?;
    let hash = HashAll {
        hasher: &hasher,
        parent,
        start,
        extra: &extra,
    };
    let hashes = if tokens.len() >= DETACH_HASH_TOKENS {
        tokens.with_slice_detached(py, hash)
    } else {
        tokens.with_slice(hash)
    }?;
    hashes_to_numpy(py, &hashes)
}

/// An incrementally extended hash chain: `extend(tokens)` hashes each block the new tokens
/// complete and returns the new hashes. Thread-safe.
#[pyclass(frozen, name = "BlockHashChain", module = "hybrid_kv")]
struct PyBlockHashChain {
    inner: Mutex<BlockHashChain>,
}

struct Extend<'a>(&'a mut BlockHashChain);

impl TokenFn<Result<usize>> for Extend<'_> {
    fn call<T: TokenId + Send + Sync>(self, tokens: &[T]) -> Result<usize> {
        self.0.extend(tokens)
    }
}

impl PyBlockHashChain {
    fn lock(&self) -> std::sync::MutexGuard<'_, BlockHashChain> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyBlockHashChain {
    #[new]
    #[pyo3(signature = (block_size, *, algo = Text::Static("xxh3"), seed = Text::Static(""), cache_salt = None, lora_name = None, mm_inputs = None), text_signature = "(block_size, *, algo='xxh3', seed='', cache_salt=None, lora_name=None, mm_inputs=None)")]
    fn new(
        block_size: Count,
        algo: Text,
        seed: Text,
        cache_salt: Option<Text>,
        lora_name: Option<Text>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let hasher = BlockHasher::new(block_size.get(), HashAlgo::parse(&algo)?, &seed)?;
        let extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
        Ok(PyBlockHashChain {
            inner: Mutex::new(BlockHashChain::new(hasher, extra)),
        })
    }

    /// Appends tokens; returns the hashes of the blocks they completed, shape `(k, 2)`.
    fn extend<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let tokens = Tokens::extract(token_ids)?;
        // The array is made after the lock is released (allocation may run a finalizer that
        // uses the chain).
        let new = {
            let mut chain = self.lock();
            let added = tokens.with_slice(Extend(&mut chain))?;
            let all = chain.hashes();
            all[all.len() - added..].to_vec()
        };
        hashes_to_numpy(py, &new)
    }

    /// All hashes so far, shape `(n, 2)`.
    #[getter]
    fn hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let all = self.lock().hashes().to_vec();
        hashes_to_numpy(py, &all)
    }

    #[getter]
    fn num_tokens(&self) -> usize {
        self.lock().tokens().len()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.lock().hasher().block_size()
    }

    fn __len__(&self) -> usize {
        self.lock().hashes().len()
    }

    fn __repr__(&self) -> String {
        let chain = self.lock();
        format!(
            "BlockHashChain(block_size={}, num_tokens={}, num_blocks={})",
            chain.hasher().block_size(),
            chain.tokens().len(),
            chain.hashes().len()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_token_blocks, m)?)?;
    m.add_class::<PyBlockHashChain>()?;
    Ok(())
}
