//! `hybrid_kv.KVCacheManager`, `hybrid_kv.Request` and `hybrid_kv.KVCacheBlocks`.
//!
//! A Python `Request` keeps its own token ids (the scheduler appends outputs to it, as in vLLM);
//! the manager keeps a hashed copy per request id, brought up to date at the start of every call
//! that takes the request (only the new tokens are hashed). The copy goes away when the
//! `Request` object is garbage collected or `remove_request` is called, so hashes live exactly as
//! long as the request, as vLLM's live on its `Request`.

use super::convert::{ids_to_numpy, TokenFn, Tokens};
use super::errors::HybridKvError;
use super::hashing::extra_keys;
use super::pool::event_to_py;
use crate::error::Result as CoreResult;
use crate::hashing::{check_tokens, BlockHasher, ExtraKeys, HashAlgo, TokenId};
use crate::manager::{
    AllocateArgs, AttentionKind, ComputedBlocks, GroupSpec, KVCacheManager, ManagerConfig,
    PrefixCacheStats, Prober, RequestHandle,
};

use crate::types::{BlockHash, RequestMap};
use crossbeam_queue::SegQueue;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Calls that handle at least this many tokens release the GIL.
const DETACH_TOKENS: usize = 4096;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| HybridKvError::new_err(format!("{what} must be >= 0, got {v}")))
}

// ----------------------------------------------------------------------------- Request

/// A manager holding a hashed copy of a request, and how much of it is up to date.
struct Registration {
    shared: Weak<Shared>,
    /// The request's slot in that manager.
    handle: RequestHandle,
    /// Tokens the manager's copy holds.
    synced: usize,
    /// The manager's `removals` count when this was last checked.
    removals: u64,
}

/// The prompt's hashes computed when the `Request` was made, for the first manager whose
/// hasher matches (as vLLM hashes a prompt when it builds the `Request`).
struct Prehashed {
    hasher: BlockHasher,
    hashes: Vec<BlockHash>,
    /// Tokens after the last full block.
    tail: Vec<u32>,
}

struct RequestData {
    output: Vec<u32>,
    num_computed_tokens: usize,
    prehashed: Option<Prehashed>,
    /// Managers holding a hashed copy of this request.
    registered: Vec<Registration>,
}

/// A request as the scheduler sees it: prompt, outputs appended as they are sampled, and the
/// scheduler's count of computed tokens. The prompt is validated and hashed when the request is
/// made (with `block_size`, `hash_algo`, `hash_seed`: the manager's hashing, for the hashes to
/// be reused); like vLLM's `Request`, it keeps a reference to the caller's prompt rather than a
/// copy. Thread-safe.
#[pyclass(frozen, name = "Request", module = "hybrid_kv")]
pub(crate) struct PyRequest {
    request_id: String,
    extra: ExtraKeys,
    serial: u64,
    prompt: Py<PyAny>,
    num_prompt_tokens: usize,
    data: Mutex<RequestData>,
}

struct Prehash<'a> {
    py: Python<'a>,
    hasher: &'a BlockHasher,
    extra: &'a ExtraKeys,
}

impl TokenFn<CoreResult<(usize, Vec<BlockHash>, Vec<u32>)>> for Prehash<'_> {
    fn call<T: TokenId + Send + Sync>(
        self,
        tokens: &[T],
    ) -> CoreResult<(usize, Vec<BlockHash>, Vec<u32>)> {
        let run = || {
            check_tokens(tokens)?;
            let mut hashes = Vec::new();
            self.hasher
                .hash_blocks(None, tokens, 0, self.extra, &mut hashes)?;
            let full = hashes.len() * self.hasher.block_size();
            let tail = tokens[full..].iter().map(|t| t.as_u32()).collect();
            Ok((tokens.len(), hashes, tail))
        };
        if tokens.len() >= super::hashing::DETACH_TOKENS {
            // A long prompt is hashed with the GIL released, as `hash_token_blocks` does; the
            // tokens are borrowed read-only from numpy, or were copied out of the list.
            self.py.detach(run)
        } else {
            run()
        }
    }
}

#[pymethods]
impl PyRequest {
    #[new]
    #[pyo3(signature = (request_id, prompt_token_ids, cache_salt = None, lora_name = None, mm_inputs = None, *, block_size = 16, hash_algo = "xxh3", hash_seed = ""))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        request_id: String,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        mm_inputs: Option<Vec<(String, usize, usize)>>,
        block_size: usize,
        hash_algo: &str,
        hash_seed: &str,
    ) -> PyResult<Self> {
        let extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
        let hasher = BlockHasher::new(block_size, HashAlgo::parse(hash_algo)?, hash_seed)?;
        let (len, hashes, tail) = Tokens::extract(prompt_token_ids)?.with_slice(Prehash {
            py: prompt_token_ids.py(),
            hasher: &hasher,
            extra: &extra,
        })?;
        if len == 0 {
            return Err(HybridKvError::new_err(format!(
                "request {request_id:?} has an empty prompt"
            )));
        }
        Ok(PyRequest {
            request_id,
            extra,
            serial: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            prompt: prompt_token_ids.clone().unbind(),
            num_prompt_tokens: len,
            data: Mutex::new(RequestData {
                output: Vec::new(),
                num_computed_tokens: 0,
                prehashed: Some(Prehashed {
                    hasher,
                    hashes,
                    tail,
                }),
                registered: Vec::new(),
            }),
        })
    }

    #[getter]
    fn request_id(&self) -> &str {
        &self.request_id
    }

    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_prompt_tokens + lock(&self.data).output.len()
    }

    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    #[getter]
    fn num_output_tokens(&self) -> usize {
        lock(&self.data).output.len()
    }

    #[getter]
    fn num_computed_tokens(&self) -> usize {
        lock(&self.data).num_computed_tokens
    }

    #[setter]
    fn set_num_computed_tokens(&self, value: i64) -> PyResult<()> {
        let value = count(value, "num_computed_tokens")?;
        let mut d = lock(&self.data);
        let total = self.num_prompt_tokens + d.output.len();
        if value > total {
            return Err(HybridKvError::new_err(format!(
                "num_computed_tokens {value} exceeds the request's {total} tokens"
            )));
        }
        d.num_computed_tokens = value;
        Ok(())
    }

    #[getter]
    fn prompt_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        Ok(PyArray1::from_vec(py, self.read_prompt(py)?))
    }

    #[getter]
    fn output_token_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &lock(&self.data).output)
    }

    #[getter]
    fn cache_salt(&self) -> Option<&str> {
        self.extra.cache_salt.as_deref()
    }

    #[getter]
    fn lora_name(&self) -> Option<&str> {
        self.extra.lora_name.as_deref()
    }

    /// Appends sampled tokens: an int, a sequence of ints or a 1-D integer array.
    fn append_output_token_ids(&self, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(single) = token_ids.extract::<i64>() {
            let token = u32::try_from(single).map_err(|_| {
                HybridKvError::new_err(format!("token id {single} is outside [0, 2^32)"))
            })?;
            lock(&self.data).output.push(token);
            return Ok(());
        }
        let tokens = Tokens::extract(token_ids)?.into_u32()?;
        lock(&self.data).output.extend_from_slice(&tokens);
        Ok(())
    }

    fn __repr__(&self) -> String {
        let d = lock(&self.data);
        format!(
            "Request({:?}, num_tokens={}, num_computed_tokens={})",
            self.request_id,
            self.num_prompt_tokens + d.output.len(),
            d.num_computed_tokens
        )
    }
}

impl PyRequest {
    /// Whether calls with this request should release the GIL (hashing a long prompt).
    fn is_long(&self) -> bool {
        self.num_prompt_tokens + lock(&self.data).output.len() >= DETACH_TOKENS
    }

    /// The prompt's token ids, read again from the caller's object (which must not have
    /// changed length since the request was made).
    fn read_prompt(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let tokens = Tokens::extract(self.prompt.bind(py))?.into_u32()?;
        if tokens.len() != self.num_prompt_tokens {
            return Err(HybridKvError::new_err(format!(
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

impl Drop for PyRequest {
    fn drop(&mut self) {
        let d = self.data.get_mut().unwrap_or_else(|e| e.into_inner());
        for shared in d.registered.drain(..).filter_map(|r| r.shared.upgrade()) {
            // Never block here: the manager may be busy in another thread.
            shared.dropped.push((self.request_id.clone(), self.serial));
        }
    }
}

/// `Prober::probe` over borrowed tokens, with the GIL released.
struct ProbeFn<'a> {
    py: Python<'a>,
    prober: &'a Prober,
    extra: &'a ExtraKeys,
}

impl TokenFn<CoreResult<usize>> for ProbeFn<'_> {
    fn call<T: TokenId + Send + Sync>(self, tokens: &[T]) -> CoreResult<usize> {
        self.py.detach(|| self.prober.probe(tokens, self.extra))
    }
}

// ----------------------------------------------------------------------------- KVCacheBlocks

/// Blocks per KV cache group: a prefix-cache hit (`get_computed_blocks`) or the blocks newly
/// allocated by `allocate_slots`.
#[pyclass(frozen, name = "KVCacheBlocks", module = "hybrid_kv")]
pub(crate) struct PyKVCacheBlocks {
    computed: ComputedBlocks,
    manager_id: u64,
}

#[pymethods]
impl PyKVCacheBlocks {
    /// One int32 array of block ids per group (null block 0 where a slot needs no block).
    fn get_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(
            py,
            self.computed
                .blocks
                .iter()
                .map(|ids| ids_to_numpy(py, ids.clone())),
        )
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.computed.blocks.len()
    }

    /// Tokens the blocks cover (prefix-cache hits only).
    #[getter]
    fn num_computed_tokens(&self) -> usize {
        self.computed.num_computed_tokens
    }

    /// vLLM's shared-prefix boundary: 0, or the longer prefix some group alone had cached.
    #[getter]
    fn shared_prefix_boundary(&self) -> usize {
        self.computed.shared_prefix_boundary
    }

    fn __len__(&self) -> usize {
        self.computed.blocks.iter().map(Vec::len).max().unwrap_or(0)
    }

    fn __repr__(&self) -> String {
        format!("KVCacheBlocks({:?})", self.computed.blocks)
    }
}

// ----------------------------------------------------------------------------- KVCacheManager

struct Inner {
    manager: KVCacheManager,
    /// Request id → the serial of the `Request` object registered under it.
    serials: RequestMap<u64>,
    /// Reused for the new blocks of `allocate_slots`.
    new_blocks: Vec<Vec<crate::types::BlockId>>,
}

/// A request brought up to date in the manager: its handle and the scheduler's count of its
/// computed tokens.
#[derive(Clone, Copy)]
struct Synced {
    handle: RequestHandle,
    num_computed_tokens: usize,
}

struct Shared {
    id: u64,
    inner: Mutex<Inner>,
    prober: Prober,
    /// Requests whose Python object was garbage collected, removed at the next call.
    dropped: SegQueue<(String, u64)>,
    /// Explicit `remove_request` calls so far: a request's cached registration is trusted only
    /// while this is unchanged.
    removals: AtomicU64,
}

/// The KV cache manager a scheduler drives (vLLM 0.33's `KVCacheManager` methods). Thread-safe:
/// scheduler calls are serialised; `probe` runs concurrently without blocking them.
#[pyclass(frozen, name = "KVCacheManager", module = "hybrid_kv")]
pub(crate) struct PyKVCacheManager {
    shared: Arc<Shared>,
    empty: Py<PyKVCacheBlocks>,
    num_groups: usize,
}

fn group_from_py(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<GroupSpec> {
    let get = |name: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        let value = if let Ok(d) = obj.cast::<PyDict>() {
            d.get_item(name)?
        } else if obj.hasattr(name)? {
            Some(obj.getattr(name)?)
        } else {
            None
        };
        Ok(value.filter(|v| !v.is_none()))
    };
    let field = |name: &str| -> PyResult<usize> {
        match get(name)? {
            Some(v) => v
                .extract::<i64>()
                .and_then(|v| count(v, name))
                .map_err(|_| {
                    HybridKvError::new_err(format!(
                        "group {index}: {name} must be a non-negative int"
                    ))
                }),
            None => Err(HybridKvError::new_err(format!(
                "group {index}: missing {name}"
            ))),
        }
    };
    let kind: String = match get("kind")? {
        Some(k) => k.extract()?,
        None => {
            return Err(HybridKvError::new_err(format!(
                "group {index}: missing kind"
            )))
        }
    };
    let block_size = field("block_size")?;
    Ok(match kind.as_str() {
        "full" | "full_attention" => GroupSpec::full(block_size),
        "sliding_window" => GroupSpec::sliding_window(block_size, field("sliding_window")?),
        "chunked_local" | "chunked_local_attention" => {
            GroupSpec::chunked_local(block_size, field("attention_chunk_size")?)
        }
        "mamba" => GroupSpec::mamba(block_size),
        other => {
            return Err(HybridKvError::new_err(format!(
                "group {index}: unknown kind {other:?} (expected full, sliding_window, \
                 chunked_local or mamba)"
            )))
        }
    })
}

fn stats_dict<'py>(py: Python<'py>, s: &PrefixCacheStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("requests", s.requests)?;
    d.set_item("queries", s.queries)?;
    d.set_item("hits", s.hits)?;
    d.set_item("hit_rate", s.hit_rate())?;
    d.set_item("preempted_requests", s.preempted_requests)?;
    d.set_item("preempted_queries", s.preempted_queries)?;
    d.set_item("preempted_hits", s.preempted_hits)?;
    d.set_item("reset", s.reset)?;
    Ok(d)
}

impl PyKVCacheManager {
    /// Locks the manager and applies pending removals of garbage-collected requests.
    fn inner(&self) -> MutexGuard<'_, Inner> {
        let mut inner = lock(&self.shared.inner);
        while let Some((id, serial)) = self.shared.dropped.pop() {
            if inner.serials.get(&id) == Some(&serial) {
                inner.serials.remove(&id);
                let _ = inner.manager.remove_request(&id);
            }
        }
        inner
    }

    /// Registers `request` or brings the manager's copy up to date with its tokens; returns its
    /// handle and `num_computed_tokens`, or `None` when a first registration needs the prompt's
    /// token ids (`prompt`) and they were not given. The hot path (a registered request with a
    /// few new tokens) does no id lookup: the registration keeps the request's handle.
    fn sync(
        &self,
        inner: &mut Inner,
        request: &PyRequest,
        prompt: Option<&[u32]>,
    ) -> PyResult<Option<Synced>> {
        let mut data = lock(&request.data);
        let data = &mut *data;
        let removals = self.shared.removals.load(Ordering::Acquire);
        let me = Arc::as_ptr(&self.shared);
        let num_prompt = request.num_prompt_tokens;
        let total = num_prompt + data.output.len();
        if let Some(reg) = data
            .registered
            .iter_mut()
            .find(|r| r.removals == removals && std::ptr::eq(r.shared.as_ptr(), me))
        {
            if reg.synced < total {
                let start = reg.synced - num_prompt;
                inner
                    .manager
                    .append_token_ids(reg.handle, &data.output[start..])?;
                reg.synced = total;
            }
            return Ok(Some(Synced {
                handle: reg.handle,
                num_computed_tokens: data.num_computed_tokens,
            }));
        }
        let id = &request.request_id;
        let handle = match inner.serials.get(id) {
            Some(&serial) if serial != request.serial => {
                return Err(HybridKvError::new_err(format!(
                    "request id {id:?} is already used by another Request object"
                )))
            }
            Some(_) => {
                let handle = inner.manager.handle(id)?;
                let known = inner.manager.request(handle)?.num_tokens();
                let start = known - num_prompt;
                if start < data.output.len() {
                    inner
                        .manager
                        .append_token_ids(handle, &data.output[start..])?;
                }
                handle
            }
            None => {
                let reusable = !inner.manager.pool().events_enabled()
                    && data
                        .prehashed
                        .as_ref()
                        .is_some_and(|p| p.hasher == *inner.manager.hasher());
                let handle = if reusable {
                    let pre = data.prehashed.take().expect("checked above");
                    inner.manager.add_request_prehashed(
                        id,
                        num_prompt,
                        pre.hashes,
                        pre.tail,
                        request.extra.clone(),
                    )?
                } else {
                    let Some(prompt) = prompt else {
                        return Ok(None);
                    };
                    inner
                        .manager
                        .add_request(id, prompt, request.extra.clone())?
                };
                if !data.output.is_empty() {
                    inner.manager.append_token_ids(handle, &data.output)?;
                }
                inner.serials.insert(id.clone(), request.serial);
                handle
            }
        };
        data.registered
            .retain(|r| !std::ptr::eq(r.shared.as_ptr(), me));
        data.registered.push(Registration {
            shared: Arc::downgrade(&self.shared),
            handle,
            synced: total,
            removals,
        });
        Ok(Some(Synced {
            handle,
            num_computed_tokens: data.num_computed_tokens,
        }))
    }

    /// Brings `request` up to date (reading its prompt with the GIL if a first registration
    /// needs it), then runs `f` with the manager locked and the request's
    /// `num_computed_tokens`; the GIL is released meanwhile when `long`.
    fn with_request<R: Send>(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        long: bool,
        f: impl Fn(&mut Inner, Synced) -> PyResult<R> + Send + Sync,
    ) -> PyResult<R> {
        let mut prompt: Option<Vec<u32>> = None;
        loop {
            let given = prompt.as_deref();
            let done = self.run(py, long, || {
                let mut inner = self.inner();
                match self.sync(&mut inner, request, given)? {
                    Some(synced) => f(&mut inner, synced).map(Some),
                    None => Ok(None),
                }
            })?;
            match done {
                Some(result) => return Ok(result),
                // Read outside the lock: reading a Python object needs the GIL.
                None => prompt = Some(request.read_prompt(py)?),
            }
        }
    }

    /// Runs `f` (which takes the manager lock itself) with the GIL released when `long`. The
    /// lock is never held while the GIL is re-acquired: a thread holding the GIL and waiting
    /// for the lock would deadlock with it.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce() -> PyResult<R> + Send,
    ) -> PyResult<R> {
        if long {
            py.detach(f)
        } else {
            f()
        }
    }

    /// The request's handle in this manager if its registration is current (no explicit
    /// removal since); call with the manager locked.
    fn registered_handle(&self, request: &PyRequest) -> Option<RequestHandle> {
        let removals = self.shared.removals.load(Ordering::Acquire);
        let me = Arc::as_ptr(&self.shared);
        lock(&request.data)
            .registered
            .iter()
            .find(|r| r.removals == removals && std::ptr::eq(r.shared.as_ptr(), me))
            .map(|r| r.handle)
    }

    fn blocks(&self, py: Python<'_>, computed: ComputedBlocks) -> PyResult<Py<PyKVCacheBlocks>> {
        if computed.is_empty()
            && computed.num_computed_tokens == 0
            && computed.shared_prefix_boundary == 0
        {
            return Ok(self.empty.clone_ref(py));
        }
        Py::new(
            py,
            PyKVCacheBlocks {
                computed,
                manager_id: self.shared.id,
            },
        )
    }
}

#[pymethods]
impl PyKVCacheManager {
    #[new]
    #[pyo3(signature = (groups, num_blocks, max_model_len, *, enable_caching = true, enable_kv_events = false, hash_algo = "xxh3", hash_seed = "", watermark = 0.0, max_in_flight_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        groups: &Bound<'_, PyAny>,
        num_blocks: i64,
        max_model_len: i64,
        enable_caching: bool,
        enable_kv_events: bool,
        hash_algo: &str,
        hash_seed: &str,
        watermark: f64,
        max_in_flight_tokens: Option<i64>,
    ) -> PyResult<Self> {
        let specs = groups
            .try_iter()
            .map_err(|_| PyTypeError::new_err("groups must be a sequence of group specs"))?
            .enumerate()
            .map(|(i, g)| group_from_py(&g?, i))
            .collect::<PyResult<Vec<_>>>()?;
        let mut config = ManagerConfig::new(
            specs,
            count(num_blocks, "num_blocks")?,
            count(max_model_len, "max_model_len")?,
        );
        config.enable_caching = enable_caching;
        config.enable_events = enable_kv_events;
        config.hash_algo = HashAlgo::parse(hash_algo)?;
        config.hash_seed = hash_seed.to_owned();
        config.watermark = watermark;
        config.max_in_flight_tokens = max_in_flight_tokens
            .map(|v| count(v, "max_in_flight_tokens"))
            .transpose()?;
        let manager = KVCacheManager::new(&config)?;
        let num_groups = manager.num_groups();
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let empty = Py::new(
            py,
            PyKVCacheBlocks {
                computed: ComputedBlocks {
                    blocks: vec![Vec::new(); num_groups],
                    ..ComputedBlocks::default()
                },
                manager_id: id,
            },
        )?;
        Ok(PyKVCacheManager {
            shared: Arc::new(Shared {
                id,
                prober: manager.prober(),
                inner: Mutex::new(Inner {
                    manager,
                    serials: RequestMap::default(),
                    new_blocks: Vec::new(),
                }),
                dropped: SegQueue::new(),
                removals: AtomicU64::new(0),
            }),
            empty,
            num_groups,
        })
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.num_groups
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.shared.prober.pool().num_blocks()
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner().manager.max_model_len()
    }

    #[getter]
    fn block_sizes(&self) -> Vec<usize> {
        self.inner()
            .manager
            .group_specs()
            .iter()
            .map(|g| g.block_size)
            .collect()
    }

    #[getter]
    fn scheduler_block_size(&self) -> usize {
        self.inner().manager.scheduler_block_size()
    }

    /// Tokens per request block hash: pass it as `Request(..., block_size=...)` so the hashes
    /// computed when the request is made are the ones this manager uses.
    #[getter]
    fn hash_block_size(&self) -> usize {
        self.inner().manager.hash_block_size()
    }

    #[getter]
    fn usage(&self) -> f64 {
        self.shared.prober.pool().usage()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.shared.prober.pool().num_free_blocks()
    }

    /// `(block hash, group)` entries in the prefix cache.
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.shared.prober.pool().num_cached_keys()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner().manager.num_requests()
    }

    /// Registers a request and hashes its prompt now (otherwise done by its first call).
    fn add_request(&self, py: Python<'_>, request: &PyRequest) -> PyResult<()> {
        self.with_request(py, request, request.is_long(), |_, _| Ok(()))
    }

    /// Frees the request's blocks and forgets its hashes.
    fn remove_request(&self, request_id: &str) -> PyResult<()> {
        let mut inner = self.inner();
        if inner.serials.remove(request_id).is_none() {
            return Err(HybridKvError::new_err(format!(
                "unknown request id {request_id:?}"
            )));
        }
        self.shared.removals.fetch_add(1, Ordering::AcqRel);
        Ok(inner.manager.remove_request(request_id)?)
    }

    /// The request's cached prefix: `(blocks, num_computed_tokens)`, at most `num_tokens - 1`
    /// tokens. Reference counts are not touched until `allocate_slots` adopts the hit.
    fn get_computed_blocks(
        &self,
        py: Python<'_>,
        request: &PyRequest,
    ) -> PyResult<(Py<PyKVCacheBlocks>, usize)> {
        let computed = self.with_request(py, request, request.is_long(), |inner, r| {
            Ok(inner.manager.get_computed_blocks(r.handle)?)
        })?;
        let n = computed.num_computed_tokens;
        Ok((self.blocks(py, computed)?, n))
    }

    /// Slots for `num_new_tokens` more tokens (plus lookahead tokens, never cached), adopting a
    /// prefix-cache hit on the first allocation. Returns the newly allocated blocks, or None when
    /// the pool cannot supply them (then nothing changed).
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens = 0, new_computed_blocks = None, num_lookahead_tokens = 0, delay_cache_blocks = false, full_sequence_must_fit = false, has_scheduled_reqs = true))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<&PyKVCacheBlocks>,
        num_lookahead_tokens: i64,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        let num_new_tokens = count(num_new_tokens, "num_new_tokens")?;
        let num_new_computed_tokens = count(num_new_computed_tokens, "num_new_computed_tokens")?;
        let num_lookahead_tokens = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        if let Some(b) = new_computed_blocks {
            if b.manager_id != self.shared.id {
                return Err(HybridKvError::new_err(
                    "new_computed_blocks come from another KVCacheManager",
                ));
            }
        }
        let args = AllocateArgs {
            num_new_tokens,
            num_computed_tokens: 0,
            num_new_computed_tokens,
            new_computed_blocks: new_computed_blocks.map(|b| &b.computed),
            num_lookahead_tokens,
            num_in_flight_tokens: 0,
            delay_cache_blocks,
            full_sequence_must_fit,
            has_scheduled_reqs,
        };
        let long = num_new_tokens >= DETACH_TOKENS;
        // None: out of blocks; Some(None): nothing new (the shared empty result).
        let new = self.with_request(py, request, long, |inner, r| {
            let args = AllocateArgs {
                num_computed_tokens: r.num_computed_tokens,
                ..args
            };
            let Inner {
                manager,
                new_blocks,
                ..
            } = inner;
            if !manager.allocate_slots_into(r.handle, &args, new_blocks)? {
                return Ok(None);
            }
            Ok(Some(
                (!new_blocks.iter().all(Vec::is_empty)).then(|| new_blocks.clone()),
            ))
        })?;
        match new {
            None => Ok(None),
            Some(None) => Ok(Some(self.empty.clone_ref(py))),
            Some(Some(blocks)) => self
                .blocks(
                    py,
                    ComputedBlocks {
                        blocks,
                        ..ComputedBlocks::default()
                    },
                )
                .map(Some),
        }
    }

    /// Frees the request's blocks, tail first (a request never allocated is a no-op).
    fn free(&self, request: &PyRequest) -> PyResult<()> {
        let mut inner = self.inner();
        if let Some(handle) = self.registered_handle(request) {
            return Ok(inner.manager.free(handle)?);
        }
        match inner.serials.get(&request.request_id) {
            Some(&s) if s == request.serial => Ok(inner.manager.free(&request.request_id)?),
            Some(_) => Err(HybridKvError::new_err(format!(
                "request id {:?} is registered by another Request object",
                request.request_id
            ))),
            None => Ok(()),
        }
    }

    /// The request's block tables: one int32 array per group.
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let tables = self.inner().manager.get_block_ids(request_id)?;
        PyTuple::new(py, tables.into_iter().map(|ids| ids_to_numpy(py, ids)))
    }

    /// Writes the block tables of `group` for a batch of requests into `out`, a C-contiguous
    /// 2-D int32 array with one row per request (the model runner's block table), in one call.
    /// Entries past a request's table are left as they are.
    #[pyo3(signature = (request_ids, out, group = 0))]
    fn write_block_table(
        &self,
        request_ids: Vec<String>,
        out: &Bound<'_, PyArray2<i32>>,
        group: usize,
    ) -> PyResult<()> {
        let mut rw = out
            .try_readwrite()
            .map_err(|e| HybridKvError::new_err(e.to_string()))?;
        let shape = rw.shape().to_vec();
        if shape[0] < request_ids.len() {
            return Err(HybridKvError::new_err(format!(
                "out has {} rows for {} requests",
                shape[0],
                request_ids.len()
            )));
        }
        let slice = rw
            .as_slice_mut()
            .map_err(|_| HybridKvError::new_err("out must be C-contiguous"))?;
        let ids: Vec<&str> = request_ids.iter().map(String::as_str).collect();
        Ok(self
            .inner()
            .manager
            .write_block_table(&ids, group, slice, shape[1])?)
    }

    /// How many tokens of a prompt are cached right now (what `get_computed_blocks` would
    /// report). Runs without the GIL and without blocking the scheduler's calls.
    #[pyo3(signature = (token_ids, cache_salt = None, lora_name = None, mm_inputs = None))]
    fn probe(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        mm_inputs: Option<Vec<(String, usize, usize)>>,
    ) -> PyResult<usize> {
        let extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
        // A numpy prompt is probed in place (no copy made with the GIL held).
        Ok(Tokens::extract(token_ids)?.with_slice(ProbeFn {
            py,
            prober: &self.shared.prober,
            extra: &extra,
        })?)
    }

    /// Records one admission's prefix-cache lookup (call after a successful admission).
    #[pyo3(signature = (request, num_hits, preempted = false))]
    fn record_prefix_cache_stats(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        num_hits: i64,
        preempted: bool,
    ) -> PyResult<()> {
        let num_hits = count(num_hits, "num_hits")?;
        self.with_request(py, request, false, |inner, r| {
            Ok(inner
                .manager
                .record_prefix_cache_stats(r.handle, num_hits, preempted)?)
        })
    }

    /// The prefix-cache statistics so far (requests, queries, hits, hit_rate, preempted_*).
    fn prefix_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner().manager.prefix_cache_stats();
        stats_dict(py, &stats)
    }

    /// Returns the statistics and starts new ones (vLLM's `make_prefix_cache_stats`).
    fn make_prefix_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner().manager.take_prefix_cache_stats();
        stats_dict(py, &stats)
    }

    /// Clears the prefix cache; refused (False) while any block is in use.
    fn reset_prefix_cache(&self) -> bool {
        self.inner().manager.reset_prefix_cache()
    }

    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        // Python objects are made after the lock is released (allocation may run a finalizer
        // that calls back into the manager).
        let (events, kinds) = {
            let inner = self.inner();
            let kinds: Vec<(&'static str, Option<usize>)> = inner
                .manager
                .group_specs()
                .iter()
                .map(|g| match g.kind {
                    AttentionKind::Full => ("full_attention", None),
                    AttentionKind::SlidingWindow { window } => ("sliding_window", Some(window)),
                    AttentionKind::ChunkedLocal { .. } => ("chunked_local_attention", None),
                    AttentionKind::Mamba => ("mamba", None),
                })
                .collect();
            (inner.manager.take_events(), kinds)
        };
        events
            .into_iter()
            .map(|e| event_to_py(py, e, &kinds))
            .collect()
    }

    /// Call once per scheduler step.
    fn new_step_starts(&self) {
        self.inner().manager.new_step_starts()
    }

    fn __repr__(&self) -> String {
        format!(
            "KVCacheManager(num_groups={}, num_blocks={}, free={})",
            self.num_groups,
            self.num_blocks(),
            self.num_free_blocks()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRequest>()?;
    m.add_class::<PyKVCacheBlocks>()?;
    m.add_class::<PyKVCacheManager>()?;
    Ok(())
}
