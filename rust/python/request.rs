//! `hybrid_kv.Request`: the scheduler's view of a request, a [`RequestRecord`] behind a lock
//! plus a reference to the caller's prompt.

use super::convert::{Count, Text, TokenFn, Tokens, UInt};
use super::errors::InvalidArgumentError;
use super::hashing::{extra_keys, DETACH_HASH_TOKENS};
use crate::error::Result as CoreResult;
use crate::hashing::{check_tokens, BlockHasher, ExtraKeys, HashAlgo, TokenId};
use crate::manager::registry::{Prehashed, RequestRecord};
use numpy::PyArray1;
use pyo3::prelude::*;
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

#[pymethods]
impl PyRequest {
    #[new]
    #[pyo3(signature = (request_id, prompt_token_ids, cache_salt = None, lora_name = None, mm_inputs = None, *, block_size = UInt(16), hash_algo = Text::Static("xxh3"), hash_seed = Text::Static(""), lora_id = None), text_signature = "(request_id, prompt_token_ids, cache_salt=None, lora_name=None, mm_inputs=None, *, block_size=16, hash_algo='xxh3', hash_seed='', lora_id=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        request_id: Text,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<Text>,
        lora_name: Option<Text>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
        block_size: Count,
        hash_algo: Text,
        hash_seed: Text,
        lora_id: Option<Count>,
    ) -> PyResult<Self> {
        let mut extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
        extra.lora_id = lora_id.map(|id| id.0);
        let hasher = BlockHasher::new(block_size.get(), HashAlgo::parse(&hash_algo)?, &hash_seed)?;
        let tokens = Tokens::extract(prompt_token_ids)?;
        let prehash = Prehash {
            hasher: &hasher,
            extra: &extra,
        };
        // A long prompt is hashed with the GIL released, as `hash_token_blocks` does.
        let (len, prehashed) = if tokens.len() >= DETACH_HASH_TOKENS {
            tokens.with_slice_detached(prompt_token_ids.py(), prehash)
        } else {
            tokens.with_slice(prehash)
        }?;
        let request_id = request_id.into_string();
        let record = RequestRecord::new(request_id.clone(), len, extra, Some(prehashed))?;
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

    /// Tokens scheduled but not yet processed (async scheduling): blocks out of the window are
    /// only freed once processed.
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
    fn set_skip_reading_prefix_cache(&self, value: bool) {
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
        PyArray1::from_slice(py, &lock(&self.record).output)
    }

    #[getter]
    fn cache_salt(&self) -> Option<String> {
        lock(&self.record).extra().cache_salt.clone()
    }

    #[getter]
    fn lora_name(&self) -> Option<String> {
        lock(&self.record).extra().lora_name.clone()
    }

    /// Appends sampled tokens: an int, a sequence of ints or a 1-D integer array.
    fn append_output_token_ids(&self, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        match token_ids.extract::<super::convert::U32>() {
            Ok(single) => {
                lock(&self.record).output.push(single.get());
                return Ok(());
            }
            // An int out of range.
            Err(e) if e.is_instance_of::<super::errors::OutOfRangeError>(token_ids.py()) => {
                return Err(e)
            }
            // Not an int: a sequence or an array.
            Err(_) => {}
        }
        let tokens = Tokens::extract(token_ids)?.into_u32()?;
        lock(&self.record).output.extend_from_slice(&tokens);
        Ok(())
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
