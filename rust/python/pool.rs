//! `hybrid_kv.BlockPool` and the KV event classes.

use super::convert::{
    block_id_arg, extract_hash, extract_hashes, extract_ids, ids_to_numpy, Count, UInt, U32,
};
use super::errors::InvalidArgumentError;
use crate::pool::BlockPool;
use crate::types::{EventKey, KvEvent, StoreInfo};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::sync::Arc;

/// A pool of KV blocks with prefix caching (block 0 is the null block). Thread-safe.
#[pyclass(frozen, name = "BlockPool", module = "hybrid_kv")]
pub(crate) struct PyBlockPool {
    pub(crate) inner: Arc<BlockPool>,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, *, enable_caching = true, enable_kv_events = false))]
    fn new(num_blocks: Count, enable_caching: bool, enable_kv_events: bool) -> PyResult<Self> {
        let n = num_blocks.get();
        Ok(PyBlockPool {
            inner: Arc::new(BlockPool::with_options(
                n,
                enable_caching,
                enable_kv_events,
            )?),
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.num_cached_keys()
    }

    fn get_new_blocks<'py>(
        &self,
        py: Python<'py>,
        n: Count,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = n.get();
        let pool = &self.inner;
        let ids = py.detach(|| pool.get_new_blocks(n))?;
        Ok(ids_to_numpy(py, ids))
    }

    fn free_blocks(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(block_ids)?;
        let pool = &self.inner;
        Ok(py.detach(|| pool.free_blocks(&ids))?)
    }

    fn touch(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(block_ids)?;
        let pool = &self.inner;
        Ok(py.detach(|| pool.touch(&ids))?)
    }

    #[pyo3(signature = (block_ids, block_hashes, group_id = UInt(0), *, parent_block_hash = None, token_ids = None, block_size = UInt(0)), text_signature = "(self, block_ids, block_hashes, group_id=0, *, parent_block_hash=None, token_ids=None, block_size=0)")]
    fn cache_full_blocks(
        &self,
        block_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        group_id: U32,
        parent_block_hash: Option<&Bound<'_, PyAny>>,
        token_ids: Option<Vec<U32>>,
        block_size: U32,
    ) -> PyResult<()> {
        let (group_id, block_size) = (group_id.get(), block_size.get());
        let ids = extract_ids(block_ids)?;
        let hashes = extract_hashes(block_hashes)?;
        let parent = parent_block_hash.map(extract_hash).transpose()?;
        let tokens: Vec<u32> = token_ids
            .unwrap_or_default()
            .into_iter()
            .map(U32::get)
            .collect();
        // Given, they are the blocks' tokens (the event's `token_ids`): every block's, no more.
        let covered = ids.len() as u64 * u64::from(block_size);
        if !tokens.is_empty() && tokens.len() as u64 != covered {
            return Err(InvalidArgumentError::new_err(format!(
                "token_ids holds {} tokens, but {} blocks of block_size {block_size} hold \
                 {covered}",
                tokens.len(),
                ids.len()
            )));
        }
        let info = StoreInfo {
            parent_block_hash: parent,
            token_ids: &tokens,
            block_size,
            ..StoreInfo::default()
        };
        Ok(self
            .inner
            .cache_full_blocks(&ids, &hashes, group_id, info)?)
    }

    /// One cached block per group for `block_hash`, or None if any group misses.
    fn get_cached_block<'py>(
        &self,
        py: Python<'py>,
        block_hash: &Bound<'py, PyAny>,
        group_ids: Vec<U32>,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let hash = extract_hash(block_hash)?;
        let group_ids: Vec<u32> = group_ids.into_iter().map(U32::get).collect();
        Ok(self
            .inner
            .get_cached_block(hash, &group_ids)
            .map(|ids| ids_to_numpy(py, ids)))
    }

    fn evict_blocks(&self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(block_ids)?;
        Ok(self.inner.evict_blocks(&ids)?)
    }

    fn reset_prefix_cache(&self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn ref_count(&self, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.inner.ref_count(block_id_arg(block_id)?)?)
    }

    /// The cache key `(hash, group_id)` of a block, or None.
    fn block_hash(&self, block_id: &Bound<'_, PyAny>) -> PyResult<Option<(u128, u32)>> {
        Ok(self
            .inner
            .block_key(block_id_arg(block_id)?)?
            .map(|k| (k.hash.0, k.group)))
    }

    /// Free blocks front to back: the order `get_new_blocks` hands them out. Not for use while
    /// other threads use the pool.
    fn free_order<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        ids_to_numpy(py, self.inner.free_order())
    }

    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| event_to_py(py, e, &[]))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockPool(num_blocks={}, free={}, cached={})",
            self.inner.num_blocks(),
            self.inner.num_free_blocks(),
            self.inner.num_cached_keys()
        )
    }
}

/// Blocks newly entered into the prefix cache by one call (vLLM's `BlockStored` fields).
#[pyclass(frozen, get_all, module = "hybrid_kv")]
pub(crate) struct BlockStored {
    block_hashes: Vec<u128>,
    parent_block_hash: Option<u128>,
    token_ids: Vec<u32>,
    block_size: u32,
    group_id: u32,
    /// The group's attention type ("full_attention", "sliding_window", ...) when the event
    /// comes from a `KVCacheManager` (vLLM's annotation); None from a bare `BlockPool`.
    kv_cache_spec_kind: Option<&'static str>,
    kv_cache_spec_sliding_window: Option<usize>,
    /// Where the blocks live ("GPU").
    medium: &'static str,
    lora_id: Option<u64>,
    lora_name: Option<String>,
    /// Per stored block, its extra keys as vLLM publishes them: the LoRA name, `(identifier,
    /// offset)` per multimodal input, the cache salt; None for a block without any.
    extra_keys: Option<Vec<Option<Py<PyTuple>>>>,
    /// The position in the request of the first block of the call's range (the block after
    /// `parent_block_hash`); 0 for a `BlockPool` call.
    first_block: usize,
    /// The position of each stored block (in the request; in the call for a `BlockPool`).
    block_indices: Vec<usize>,
}

#[pymethods]
impl BlockStored {
    fn __repr__(&self) -> String {
        format!(
            "BlockStored(num_blocks={}, group_id={}, block_size={})",
            self.block_hashes.len(),
            self.group_id,
            self.block_size
        )
    }
}

/// One cache key removed.
#[pyclass(frozen, get_all, module = "hybrid_kv")]
pub(crate) struct BlockRemoved {
    block_hash: u128,
    group_id: u32,
    on_reuse: bool,
}

#[pymethods]
impl BlockRemoved {
    fn __repr__(&self) -> String {
        format!(
            "BlockRemoved(block_hash={:#x}, group_id={}, on_reuse={})",
            self.block_hash,
            self.group_id,
            if self.on_reuse { "True" } else { "False" }
        )
    }
}

/// The whole prefix cache was reset.
#[pyclass(frozen, module = "hybrid_kv")]
pub(crate) struct AllBlocksCleared;

#[pymethods]
impl AllBlocksCleared {
    fn __repr__(&self) -> &'static str {
        "AllBlocksCleared()"
    }
}

/// Per group: the attention kind and sliding window used to annotate `BlockStored` events.
pub(crate) type GroupKinds = [(&'static str, Option<usize>)];

pub(crate) fn event_to_py(
    py: Python<'_>,
    event: KvEvent,
    kinds: &GroupKinds,
) -> PyResult<Py<PyAny>> {
    Ok(match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            group_id,
            lora,
            extra_keys,
            first_block,
            block_indices,
        } => {
            let kind = kinds.get(group_id as usize);
            let extra_keys = extra_keys
                .map(|blocks| {
                    blocks
                        .into_iter()
                        .map(|keys| keys.map(|keys| event_keys_to_py(py, keys)).transpose())
                        .collect::<PyResult<Vec<_>>>()
                })
                .transpose()?;
            let (lora_name, lora_id) = match lora {
                Some((name, id)) => (Some(name), id),
                None => (None, None),
            };
            Py::new(
                py,
                BlockStored {
                    block_hashes: block_hashes.into_iter().map(|h| h.0).collect(),
                    parent_block_hash: parent_block_hash.map(|h| h.0),
                    token_ids,
                    block_size,
                    group_id,
                    kv_cache_spec_kind: kind.map(|k| k.0),
                    kv_cache_spec_sliding_window: kind.and_then(|k| k.1),
                    medium: "GPU",
                    lora_id,
                    lora_name,
                    extra_keys,
                    first_block,
                    block_indices,
                },
            )?
            .into_any()
        }
        KvEvent::BlockRemoved {
            block_hash,
            group_id,
            on_reuse,
        } => Py::new(
            py,
            BlockRemoved {
                block_hash: block_hash.0,
                group_id,
                on_reuse,
            },
        )?
        .into_any(),
        KvEvent::AllBlocksCleared => Py::new(py, AllBlocksCleared)?.into_any(),
    })
}

/// One block's extra keys as a tuple of vLLM's untagged values.
fn event_keys_to_py(py: Python<'_>, keys: Vec<EventKey>) -> PyResult<Py<PyTuple>> {
    let items = keys
        .into_iter()
        .map(|k| match k {
            EventKey::Lora(name) | EventKey::Salt(name) => Ok(name.into_pyobject(py)?.into_any()),
            EventKey::Mm(id, offset) => Ok((id, offset).into_pyobject(py)?.into_any()),
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyTuple::new(py, items)?.unbind())
}

/// Bytes this process can take without the kernel killing anyone, as the pool checks its own
/// arrays against: `MemAvailable` plus `SwapFree`, within the memory limits of its cgroups
/// (Linux); None where that is not known.
#[pyfunction]
fn _available_memory() -> Option<usize> {
    crate::pool::alloc::available_memory()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_available_memory, m)?)?;
    m.add_class::<PyBlockPool>()?;
    m.add_class::<BlockStored>()?;
    m.add_class::<BlockRemoved>()?;
    m.add_class::<AllBlocksCleared>()?;
    Ok(())
}
