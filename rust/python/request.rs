//! `hybrid_kv.Request`: the scheduler's view of a request, a [`RequestRecord`] behind a lock
//! plus a reference to the caller's prompt.

use super::convert::{read_int_list_in_steps, type_name, Count, Text, TokenFn, Tokens, UInt, U32};
use super::errors::InvalidArgumentError;
use super::hashing::{extra_keys, DETACH_HASH_TOKENS};
use crate::error::Result as CoreResult;
use crate::hashing::{check_tokens, BlockHasher, Chain, ExtraKeys, HashAlgo, TokenId};
use crate::manager::registry::{Prehashed, RequestRecord};
use crate::types::BlockHash;
use numpy::{PyArray1, PyArray2};
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pyclass::{PyTraverseError, PyVisit};
use pyo3::types::{PyBytes, PyIterator, PyList, PySequence};
use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, ignoring poisoning (no panic leaves a record half-updated).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request as the scheduler sees it: prompt, outputs appended as they are sampled, and the
/// scheduler's count of computed tokens. The prompt is validated and hashed when the request is
/// made (with `block_size`, `hash_algo`, `hash_seed`: the manager's hashing, for the hashes to
/// be reused); like vLLM's `Request`, it keeps a reference to the caller's prompt rather than a
/// copy. Thread-safe.
#[pyclass(frozen, name = "Request", module = "hybrid_kv")]
pub(crate) struct PyRequest {
    pub(crate) prompt: Py<PyAny>,
    pub(crate) record: Mutex<RequestRecord>,
    request_id: String,
    num_prompt_tokens: usize,
}

/// Validates and hashes a prompt: `(length, hashes of its full blocks, tail tokens)`.
struct Prehash<'a> {
    hasher: &'a BlockHasher,
    extra: &'a ExtraKeys,
}

impl TokenFn<CoreResult<(usize, Prehashed)>> for Prehash<'_> {
    fn call<T: TokenId + Send + Sync>(self, tokens: &[T]) -> CoreResult<(usize, Prehashed)> {
        check_tokens(tokens)?;
        let mut hashes = Vec::new();
        self.hasher
            .hash_blocks(None, tokens, 0, self.extra, &mut hashes)?;
        let full = hashes.len() * self.hasher.block_size();
        let tail = tokens[full..].iter().map(|t| t.as_u32()).collect();
        Ok((
            tokens.len(),
            Prehashed {
                hasher: self.hasher.clone(),
                hashes,
                tail,
            },
        ))
    }
}

/// A prompt list read and hashed in one pass (see `read_int_list_in_steps`): `(length,
/// hashes and tail)`, or `None` if an item is not an `int` (the caller then takes the general
/// path). The list is read under its critical section, and the hashing with it: the list
/// keeps the GIL for the pass, where the general path releases it to hash what it copied.
/// For long lists, whose items are mostly not in the CPU caches: a `Request` made from a
/// 128k-token list took 310-338 µs reading then hashing, 260-270 µs this way (four alternating
/// pairs), but one of 2-4k tokens 5-10% longer.
fn hash_list(
    list: &Bound<'_, PyList>,
    hasher: &BlockHasher,
    extra: &ExtraKeys,
) -> PyResult<Option<(usize, Prehashed)>> {
    let (bs, look) = (hasher.block_size(), hasher.lookahead());
    let mut chain = Chain::new(hasher, None, 0, extra);
    let mut hashes = Vec::with_capacity(list.len() / bs);
    let read = read_int_list_in_steps(list, bs, |tokens| {
        while (hashes.len() + 1) * bs + look <= tokens.len() {
            let end = (hashes.len() + 1) * bs;
            hashes.push(chain.push(&tokens[end - bs..end], &tokens[end..end + look]));
        }
    })?;
    let Some(tokens) = read else {
        return Ok(None);
    };
    let tail = tokens[hashes.len() * bs..].to_vec();
    Ok(Some((
        tokens.len(),
        Prehashed {
            hasher: hasher.clone(),
            hashes,
            tail,
        },
    )))
}

/// Validates a prompt whose block hashes the caller supplies: `(length, hashes of its full
/// blocks it takes, tail tokens after them)`.
struct Supplied {
    block_size: usize,
    num_hashes: usize,
}

impl TokenFn<CoreResult<(usize, usize, Vec<u32>)>> for Supplied {
    fn call<T: TokenId + Send + Sync>(self, tokens: &[T]) -> CoreResult<(usize, usize, Vec<u32>)> {
        check_tokens(tokens)?;
        let k = self.num_hashes.min(tokens.len() / self.block_size);
        let tail = tokens[k * self.block_size..]
            .iter()
            .map(|t| t.as_u32())
            .collect();
        Ok((tokens.len(), k, tail))
    }
}

/// One of vLLM's block hashes (`BlockHash`, bytes: 32 from its SHA-256 options, 16 from
/// xxHash) as a key: its first 16 bytes (zero-padded if shorter).
fn supplied_hash(item: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let bytes = item.cast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err(format!(
            "block hashes must be bytes (vLLM's BlockHash), got {}",
            item.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    Ok(hash_of_bytes(bytes.as_bytes()))
}

/// Ahead of the item read, the items whose contents are loaded (each is an object of its own,
/// usually not in the caches when a request arrives).
const PREFETCH_HASHES: usize = 8;

/// [`read_supplied`] of a list whose items from `start` on are all exact `bytes`, each read
/// straight from the object; None (nothing read) if one is not.
fn read_bytes_list(list: &Bound<'_, PyList>, start: usize) -> Option<Vec<BlockHash>> {
    let bytes_type = std::ptr::addr_of_mut!(ffi::PyBytes_Type);
    pyo3::sync::critical_section::with_critical_section(list.as_any(), || {
        let len = list.len();
        if start >= len {
            return Some(Vec::new());
        }
        // SAFETY: the list cannot change while this runs: on free-threaded builds we hold its
        // critical section, which every list mutation takes, and on other builds this thread
        // holds the GIL (`list` is bound to it) and runs no Python code below (only reads
        // `bytes` objects, which are immutable), nor waits, so the critical section is not
        // suspended. So `ob_item` points to `len` live item pointers for the whole loop, each a
        // reference the list keeps alive; an exact `bytes` object's size and contents are
        // never written after it is made.
        unsafe {
            let items = std::slice::from_raw_parts(
                (*list.as_ptr().cast::<ffi::PyListObject>()).ob_item,
                len,
            );
            let items = &items[start..];
            for &item in items.iter().take(PREFETCH_HASHES) {
                crate::sync::prefetch(&*item);
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, &item) in items.iter().enumerate() {
                if let Some(&ahead) = items.get(i + PREFETCH_HASHES) {
                    crate::sync::prefetch(&*ahead);
                }
                if ffi::Py_TYPE(item) != bytes_type {
                    return None;
                }
                let size = usize::try_from(ffi::Py_SIZE(item)).ok()?;
                let data =
                    std::slice::from_raw_parts(ffi::PyBytes_AS_STRING(item).cast::<u8>(), size);
                out.push(hash_of_bytes(data));
            }
            Some(out)
        }
    })
}

/// The key of a supplied hash: its first 16 bytes (fewer: zero-padded), little-endian.
#[inline]
fn hash_of_bytes(data: &[u8]) -> BlockHash {
    let mut key = [0u8; 16];
    let n = data.len().min(16);
    key[..n].copy_from_slice(&data[..n]);
    BlockHash(u128::from_le_bytes(key))
}

/// The items of `hashes` (a sequence of bytes) from index `start` on, as keys.
pub(crate) fn read_supplied(hashes: &Bound<'_, PyAny>, start: usize) -> PyResult<Vec<BlockHash>> {
    // Sized once (a `Result` collect would grow the vector from empty).
    let mut out = Vec::new();
    if let Ok(list) = hashes.cast::<PyList>() {
        if let Some(read) = read_bytes_list(list, start) {
            return Ok(read);
        }
        out.reserve(list.len().saturating_sub(start));
        for i in start..list.len() {
            out.push(supplied_hash(&list.get_item(i)?)?);
        }
        return Ok(out);
    }
    let seq = hashes
        .cast::<PySequence>()
        .map_err(|_| PyTypeError::new_err("block_hashes must be a sequence of bytes"))?;
    for i in start..seq.len()? {
        out.push(supplied_hash(&seq.get_item(i)?)?);
    }
    Ok(out)
}

/// Adds to `have` (the hashes of a record's first blocks) those of `new`, the hashes of its
/// blocks from `start` on, that it lacks.
pub(crate) fn merge_supplied(have: &mut Vec<BlockHash>, start: usize, new: &[BlockHash]) {
    if start <= have.len() && start + new.len() > have.len() {
        have.extend_from_slice(&new[have.len() - start..]);
    }
}

#[pymethods]
impl PyRequest {
    #[new]
    #[pyo3(signature = (request_id, prompt_token_ids, cache_salt = None, lora_name = None, mm_inputs = None, *, block_size = UInt(16), hash_algo = Text::Static("xxh3"), hash_seed = Text::Static(""), lora_id = None, block_hashes = None), text_signature = "(request_id, prompt_token_ids, cache_salt=None, lora_name=None, mm_inputs=None, *, block_size=16, hash_algo='xxh3', hash_seed='', lora_id=None, block_hashes=None)")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        request_id: Text,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<Text>,
        lora_name: Option<Text>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
        block_size: Count,
        hash_algo: Text,
        hash_seed: Text,
        lora_id: Option<Count>,
        block_hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // The request keeps its prompt object and reads it again (`prompt_token_ids`, KV
        // events): an iterator would be empty then.
        if prompt_token_ids.cast::<PyIterator>().is_ok() {
            return Err(PyTypeError::new_err(format!(
                "prompt_token_ids is an iterator ({}), which reads only once, but a Request \
                 reads its prompt again: give a list, a tuple or an integer array",
                type_name(prompt_token_ids)
            )));
        }
        let mut extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
        extra.lora_id = lora_id.map(|id| id.0);
        let hasher = BlockHasher::new(block_size.get(), HashAlgo::parse(&hash_algo)?, &hash_seed)?;
        let (len, prehashed, supplied) = match block_hashes {
            // The caller's hashes (vLLM's): the prompt is not hashed, and of a list only the
            // tokens after its hashed blocks are read (KV events read and check the rest).
            Some(block_hashes) => {
                let supplied = read_supplied(block_hashes, 0)?;
                let bs = block_size.get();
                let (len, k, tail) = match prompt_token_ids.cast::<PyList>() {
                    Ok(list) => {
                        let len = list.len();
                        let k = supplied.len().min(len / bs);
                        let tail = (k * bs..len)
                            .map(|i| Ok(list.get_item(i)?.extract::<U32>()?.get()))
                            .collect::<PyResult<Vec<u32>>>()?;
                        (len, k, tail)
                    }
                    Err(_) => Tokens::extract(prompt_token_ids)?.with_slice(Supplied {
                        block_size: bs,
                        num_hashes: supplied.len(),
                    })?,
                };
                let prehashed = Prehashed {
                    hasher: BlockHasher::supplied(bs, 0)?,
                    hashes: supplied[..k].to_vec(),
                    tail,
                };
                (len, prehashed, Some(supplied))
            }
            // A long list is read and hashed in one pass; a shorter one reads faster on its
            // own (its items are in the caches, so there is no load to overlap the hashing
            // with), and is hashed after.
            None => match prompt_token_ids
                .cast::<PyList>()
                .ok()
                .filter(|list| list.len() >= DETACH_HASH_TOKENS)
                .map(|list| hash_list(list, &hasher, &extra))
                .transpose()?
                .flatten()
            {
                Some((len, prehashed)) => (len, prehashed, None),
                None => {
                    let tokens = Tokens::extract(prompt_token_ids)?;
                    let prehash = Prehash {
                        hasher: &hasher,
                        extra: &extra,
                    };
                    // A long array is hashed with the GIL released, as `hash_token_blocks` does.
                    let (len, prehashed) = if tokens.len() >= DETACH_HASH_TOKENS {
                        tokens.with_slice_detached(prompt_token_ids.py(), prehash)
                    } else {
                        tokens.with_slice(prehash)
                    }?;
                    (len, prehashed, None)
                }
            },
        };
        let request_id = request_id.into_string();
        let mut record = RequestRecord::new(request_id.clone(), len, extra, Some(prehashed))?;
        if supplied.is_some() {
            record.supplied = supplied;
            record.supplied_block_size = block_size.get();
        }
        Ok(PyRequest {
            prompt: prompt_token_ids.clone().unbind(),
            record: Mutex::new(record),
            request_id,
            num_prompt_tokens: len,
        })
    }

    #[getter]
    fn request_id(&self) -> &str {
        &self.request_id
    }

    #[getter]
    fn num_tokens(&self) -> usize {
        lock(&self.record).num_tokens()
    }

    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    #[getter]
    fn num_output_tokens(&self) -> usize {
        lock(&self.record).output.len()
    }

    #[getter]
    fn num_computed_tokens(&self) -> usize {
        lock(&self.record).num_computed_tokens
    }

    #[setter]
    fn set_num_computed_tokens(&self, value: Count) -> PyResult<()> {
        Ok(lock(&self.record).set_num_computed_tokens(value.get())?)
    }

    /// Tokens scheduled but not yet processed (async scheduling, pipeline parallelism): blocks
    /// out of the window are only freed once processed. May exceed the computed tokens (those
    /// of steps scheduled before a preemption stay counted until their outputs are in).
    #[getter]
    fn num_in_flight_tokens(&self) -> usize {
        lock(&self.record).num_in_flight_tokens
    }

    #[setter]
    fn set_num_in_flight_tokens(&self, value: Count) -> PyResult<()> {
        Ok(lock(&self.record).set_progress(None, Some(value.get()))?)
    }

    /// The request reads no prefix-cache hit (vLLM sets this for prompt-logprobs requests); its
    /// blocks are still cached.
    #[getter]
    fn skip_reading_prefix_cache(&self) -> bool {
        lock(&self.record).skip_reading_prefix_cache
    }

    #[setter]
    pub(crate) fn set_skip_reading_prefix_cache(&self, value: bool) {
        lock(&self.record).skip_reading_prefix_cache = value;
    }

    /// `(slots, cache, removal)` of the running horizon the request's last allocation left
    /// (see `KVCacheManager.running_horizon`), or None once another call naming the request
    /// ended it. A running step inside it is answered by that manager without its lock, while
    /// none of the manager's calls changed a request's blocks by id since it was left.
    #[getter]
    fn _held_horizon(&self) -> Option<(usize, usize, usize)> {
        lock(&self.record)
            .horizon
            .map(|h| (h.horizon.slots, h.horizon.cache, h.horizon.removal))
    }

    #[getter]
    fn prompt_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        Ok(PyArray1::from_vec(py, self.read_prompt(py)?))
    }

    #[getter]
    fn output_token_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        // Copied out first: the array is made after the lock is released (allocation may run
        // a finalizer that uses the request).
        let output = lock(&self.record).output.clone();
        PyArray1::from_vec(py, output)
    }

    #[getter]
    fn cache_salt(&self) -> Option<String> {
        lock(&self.record).extra().cache_salt.clone()
    }

    #[getter]
    fn lora_name(&self) -> Option<String> {
        lock(&self.record).extra().lora_name.clone()
    }

    /// The caller's hashes of the request's full blocks so far (a request made with
    /// `block_hashes`), or None when the manager hashes its tokens.
    #[getter]
    fn supplied_block_hashes<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, PyArray2<u64>>>> {
        // Copied out first: the array is made after the lock is released.
        let supplied = lock(&self.record).supplied.clone();
        supplied
            .as_deref()
            .map(|hashes| super::convert::hashes_to_numpy(py, hashes))
            .transpose()
    }

    /// Appends sampled tokens: an int, a sequence of ints or a 1-D integer array. A request
    /// made with `block_hashes` takes the hashes of its new full blocks from `block_hashes`,
    /// the hashes of every full block so far (vLLM's `Request.block_hashes` after the append);
    /// those it has are not read again.
    #[pyo3(signature = (token_ids, block_hashes = None))]
    fn append_output_token_ids(
        &self,
        token_ids: &Bound<'_, PyAny>,
        block_hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // The hashes first: a request made without them refuses them before anything is read.
        let new_hashes = match block_hashes {
            Some(hashes) => {
                let start = lock(&self.record)
                    .supplied
                    .as_ref()
                    .map(Vec::len)
                    .ok_or_else(|| {
                        InvalidArgumentError::new_err(format!(
                            "request {:?} was made without block_hashes: the manager hashes its \
                             tokens",
                            self.request_id
                        ))
                    })?;
                Some((start, read_supplied(hashes, start)?))
            }
            None => None,
        };
        // One sampled token (a decode step) needs no buffer.
        let one;
        let many;
        let tokens: &[u32] = match token_ids.extract::<U32>() {
            Ok(single) => {
                one = [single.get()];
                &one
            }
            // An int out of range.
            Err(e) if e.is_instance_of::<super::errors::OutOfRangeError>(token_ids.py()) => {
                return Err(e)
            }
            // Not an int: a sequence or an array.
            Err(_) => {
                many = Tokens::extract(token_ids)?.into_u32()?;
                &many
            }
        };
        let mut record = lock(&self.record);
        record.output.extend_from_slice(tokens);
        if let (Some(have), Some((start, new))) = (&mut record.supplied, &new_hashes) {
            merge_supplied(have, *start, new);
        }
        Ok(())
    }

    /// The prompt, for the cycle collector: a prompt that refers back to its request (a list
    /// subclass with an attribute, say) makes a cycle it must see to free the request.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.prompt)
    }

    fn __repr__(&self) -> String {
        let r = lock(&self.record);
        format!(
            "Request({:?}, num_tokens={}, num_computed_tokens={})",
            self.request_id,
            r.num_tokens(),
            r.num_computed_tokens
        )
    }
}

impl PyRequest {
    pub(crate) fn request_id_str(&self) -> &str {
        &self.request_id
    }

    /// The request's tokens so far.
    pub(crate) fn num_tokens_now(&self) -> usize {
        lock(&self.record).num_tokens()
    }

    /// The prompt's token ids, read again from the caller's object (which must not have
    /// changed length since the request was made).
    pub(crate) fn read_prompt(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let tokens = Tokens::extract(self.prompt.bind(py))?.into_u32()?;
        if tokens.len() != self.num_prompt_tokens {
            return Err(InvalidArgumentError::new_err(format!(
                "the prompt of request {:?} changed from {} to {} tokens after the Request was \
                 made",
                self.request_id,
                self.num_prompt_tokens,
                tokens.len()
            )));
        }
        Ok(tokens)
    }
}
