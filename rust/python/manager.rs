//! `hybrid_kv.KVCacheManager` and `hybrid_kv.KVCacheBlocks`.
//!
//! A Python `Request` keeps its own token ids (the scheduler appends outputs to it, as in vLLM);
//! the manager keeps a hashed copy per request, brought up to date at the start of every call
//! that takes the request, by the registration protocol of [`crate::manager::registry`]. The
//! copy goes away when the `Request` object is garbage collected (its blocks are freed before
//! any counter of the manager is read again) or `remove_request` is called.

use super::convert::{count_of, ids_to_numpy, Count, TokenFn, Tokens, UInt};
use super::errors::{InvalidArgumentError, InvalidConfigError};
use super::hashing::extra_keys;
use super::pool::event_to_py;
use super::request::{lock, PyRequest};
use crate::error::Result as CoreResult;
use crate::hashing::{ExtraKeys, HashAlgo, TokenId};
use crate::manager::registry::{DropQueue, Lookup, Registry, Synced};
use crate::manager::{
    AllocateArgs, AttentionKind, ComputedBlocks, GroupSpec, KVCacheManager, ManagerConfig,
    PrefixCacheStats, Prober, RequestHandle,
};
use crate::types::BlockId;
use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use std::sync::{Arc, Mutex, MutexGuard};

/// Scheduler calls that handle at least this many tokens release the GIL.
const DETACH_SCHEDULE_TOKENS: usize = 4096;

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
    registry: Registry,
    /// Reused for the new blocks of `allocate_slots`.
    new_blocks: Vec<Vec<BlockId>>,
}

struct Shared {
    inner: Mutex<Inner>,
    prober: Prober,
    /// The registry's queue of garbage-collected requests, checked without the lock.
    drops: Arc<DropQueue>,
    id: u64,
}

/// The KV cache manager a scheduler drives (vLLM 0.33's `KVCacheManager` methods). Thread-safe:
/// scheduler calls are serialised; `probe` runs concurrently without blocking them.
#[pyclass(frozen, name = "KVCacheManager", module = "hybrid_kv")]
pub(crate) struct PyKVCacheManager {
    shared: Arc<Shared>,
    empty: Py<PyKVCacheBlocks>,
    num_groups: usize,
}

/// A group spec from a dict or an object with the same attributes.
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
    let field = |name: &'static str| -> PyResult<usize> {
        match get(name)? {
            Some(value) => count_of(&value, &format!("group {index}: {name}")),
            None => Err(InvalidConfigError::new_err(format!(
                "group {index}: missing {name}"
            ))),
        }
    };
    let kind = match get("kind")? {
        Some(k) if k.is_instance_of::<PyString>() => k.extract::<String>()?,
        Some(k) => {
            return Err(PyTypeError::new_err(format!(
                "group {index}: kind must be a str, got {}",
                k.get_type().name()?
            )))
        }
        None if obj.cast::<PyDict>().is_err() && !obj.hasattr("block_size")? => {
            return Err(PyTypeError::new_err(format!(
                "group {index} must be a dict or an object with kind and block_size, got {}",
                obj.get_type().name()?
            )))
        }
        None => {
            return Err(InvalidConfigError::new_err(format!(
                "group {index}: missing kind"
            )))
        }
    };
    let block_size = field("block_size")?;
    // The kind's parameter is read inside the parser; its Python error is kept as raised.
    let mut param_error = None;
    let kind = AttentionKind::parse(&kind, |name| {
        field(name).map_err(|e| {
            param_error = Some(e);
            crate::error::CoreError::InvalidConfig(String::new())
        })
    });
    if let Some(e) = param_error {
        return Err(e);
    }
    let kind = kind.map_err(|e| InvalidConfigError::new_err(format!("group {index}: {e}")))?;
    Ok(GroupSpec { kind, block_size })
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

/// A request brought up to date in the manager: its handle and the scheduler's count of its
/// computed tokens.
#[derive(Clone, Copy)]
struct Current {
    handle: RequestHandle,
    num_computed_tokens: usize,
}

impl PyKVCacheManager {
    /// Locks the manager and removes the requests whose `Request` was garbage collected.
    fn inner(&self) -> MutexGuard<'_, Inner> {
        let mut guard = lock(&self.shared.inner);
        let inner = &mut *guard;
        inner.registry.collect(&mut inner.manager);
        guard
    }

    /// Before a counter is read: the blocks of collected requests are back in the pool.
    fn settle(&self) {
        if !self.shared.drops.is_empty() {
            drop(self.inner());
        }
    }

    /// Brings `request` up to date (reading its prompt with the GIL if a first registration
    /// needs it), then runs `f` with the manager locked; the GIL is released meanwhile when
    /// `long`. A call that registered the request and then failed registers nothing.
    fn with_request<R: Send>(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        long: bool,
        f: impl Fn(&mut Inner, Current) -> PyResult<R> + Send + Sync,
    ) -> PyResult<R> {
        let mut prompt: Option<Vec<u32>> = None;
        loop {
            let given = prompt.as_deref();
            let done = self.run(py, long, || {
                let mut guard = self.inner();
                let inner = &mut *guard;
                let mut record = lock(&request.record);
                let (handle, registered) =
                    match inner
                        .registry
                        .sync(&mut inner.manager, &mut record, given)?
                    {
                        Synced::Ready { handle, registered } => (handle, registered),
                        Synced::NeedPrompt => return Ok(None),
                    };
                let current = Current {
                    handle,
                    num_computed_tokens: record.num_computed_tokens,
                };
                match f(inner, current) {
                    Ok(r) => Ok(Some(r)),
                    Err(err) => {
                        if registered {
                            inner
                                .registry
                                .rollback(&mut inner.manager, &mut record, handle);
                        }
                        Err(err)
                    }
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
        num_blocks: Count,
        max_model_len: Count,
        enable_caching: bool,
        enable_kv_events: bool,
        hash_algo: &str,
        hash_seed: &str,
        watermark: f64,
        max_in_flight_tokens: Option<Count>,
    ) -> PyResult<Self> {
        if groups.is_instance_of::<PyString>() || groups.is_instance_of::<PyDict>() {
            return Err(PyTypeError::new_err(
                "groups must be a sequence of group specs (dicts or objects)",
            ));
        }
        let specs = groups
            .try_iter()
            .map_err(|_| PyTypeError::new_err("groups must be a sequence of group specs"))?
            .enumerate()
            .map(|(i, g)| group_from_py(&g?, i))
            .collect::<PyResult<Vec<_>>>()?;
        let mut config = ManagerConfig::new(specs, num_blocks.get(), max_model_len.get());
        config.enable_caching = enable_caching;
        config.enable_events = enable_kv_events;
        config.hash_algo = HashAlgo::parse(hash_algo)?;
        config.hash_seed = hash_seed.to_owned();
        config.watermark = watermark;
        config.max_in_flight_tokens = max_in_flight_tokens.map(Count::get);
        let manager = KVCacheManager::new(&config)?;
        let num_groups = manager.num_groups();
        let id = manager.id();
        let empty = Py::new(
            py,
            PyKVCacheBlocks {
                computed: ComputedBlocks::new(vec![Vec::new(); num_groups], 0),
                manager_id: id,
            },
        )?;
        let registry = Registry::new();
        Ok(PyKVCacheManager {
            shared: Arc::new(Shared {
                prober: manager.prober(),
                drops: Arc::clone(registry.drop_queue()),
                inner: Mutex::new(Inner {
                    manager,
                    registry,
                    new_blocks: Vec::new(),
                }),
                id,
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
        self.settle();
        self.shared.prober.pool().usage()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.settle();
        self.shared.prober.pool().num_free_blocks()
    }

    /// `(block hash, group)` entries in the prefix cache.
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.settle();
        self.shared.prober.pool().num_cached_keys()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner().manager.num_requests()
    }

    /// Registers a request and hashes its prompt now (otherwise done by its first call).
    fn add_request(&self, py: Python<'_>, request: &PyRequest) -> PyResult<()> {
        let long = request.num_tokens_now() >= DETACH_SCHEDULE_TOKENS;
        self.with_request(py, request, long, |_, _| Ok(()))
    }

    /// Frees the request's blocks and forgets its hashes.
    fn remove_request(&self, request_id: &str) -> PyResult<()> {
        let mut guard = self.inner();
        let inner = &mut *guard;
        Ok(inner.registry.remove(&mut inner.manager, request_id)?)
    }

    /// The request's cached prefix: `(blocks, num_computed_tokens)`, at most `num_tokens - 1`
    /// tokens. Reference counts are not touched until `allocate_slots` adopts the hit.
    fn get_computed_blocks(
        &self,
        py: Python<'_>,
        request: &PyRequest,
    ) -> PyResult<(Py<PyKVCacheBlocks>, usize)> {
        let long = request.num_tokens_now() >= DETACH_SCHEDULE_TOKENS;
        let computed = self.with_request(py, request, long, |inner, r| {
            Ok(inner.manager.get_computed_blocks(r.handle)?)
        })?;
        let n = computed.num_computed_tokens;
        Ok((self.blocks(py, computed)?, n))
    }

    /// Slots for `num_new_tokens` more tokens (plus lookahead tokens, never cached), adopting a
    /// prefix-cache hit on the first allocation. Returns the newly allocated blocks, or None when
    /// the pool cannot supply them (see the stub's docstring for what None may have freed).
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens = UInt(0), new_computed_blocks = None, num_lookahead_tokens = UInt(0), delay_cache_blocks = false, full_sequence_must_fit = false, has_scheduled_reqs = true), text_signature = "(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, delay_cache_blocks=False, full_sequence_must_fit=False, has_scheduled_reqs=True)")]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        num_new_tokens: Count,
        num_new_computed_tokens: Count,
        new_computed_blocks: Option<&PyKVCacheBlocks>,
        num_lookahead_tokens: Count,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        if let Some(b) = new_computed_blocks {
            if b.manager_id != self.shared.id {
                return Err(InvalidArgumentError::new_err(
                    "new_computed_blocks come from another KVCacheManager",
                ));
            }
        }
        let args = AllocateArgs {
            num_new_tokens: num_new_tokens.get(),
            num_computed_tokens: 0,
            num_new_computed_tokens: num_new_computed_tokens.get(),
            new_computed_blocks: new_computed_blocks.map(|b| &b.computed),
            num_lookahead_tokens: num_lookahead_tokens.get(),
            num_in_flight_tokens: 0,
            delay_cache_blocks,
            full_sequence_must_fit,
            has_scheduled_reqs,
        };
        let long = args.num_new_tokens >= DETACH_SCHEDULE_TOKENS;
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
            Some(Some(blocks)) => self.blocks(py, ComputedBlocks::new(blocks, 0)).map(Some),
        }
    }

    /// Free blocks the admission check (`allocate_slots(..., full_sequence_must_fit=True)`)
    /// needs for the request's whole sequence, with `new_computed_blocks` adopted.
    #[pyo3(signature = (request, new_computed_blocks = None))]
    fn num_blocks_to_admit(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        new_computed_blocks: Option<&PyKVCacheBlocks>,
    ) -> PyResult<usize> {
        self.with_request(py, request, false, |inner, r| {
            Ok(inner
                .manager
                .num_blocks_to_admit(r.handle, new_computed_blocks.map(|b| &b.computed))?)
        })
    }

    /// Frees the request's blocks, tail first (a request never allocated is a no-op).
    fn free(&self, request: &PyRequest) -> PyResult<()> {
        let mut guard = self.inner();
        let inner = &mut *guard;
        let record = lock(&request.record);
        match inner.registry.lookup(&inner.manager, &record)? {
            Lookup::Registered(handle) => Ok(inner.manager.free(handle)?),
            Lookup::NotRegistered => Ok(()),
            Lookup::OtherObject => Err(InvalidArgumentError::new_err(format!(
                "request id {:?} is registered by another Request object",
                request.request_id_str()
            ))),
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

    /// Writes the block tables of `group` for a batch of requests into `out`, a writable 2-D
    /// int32 numpy array with one row per request (any strides), in one call. Entries past a
    /// request's table are left as they are; nothing is written on error.
    #[pyo3(signature = (request_ids, out, group = UInt(0)), text_signature = "(self, request_ids, out, group=0)")]
    fn write_block_table(
        &self,
        request_ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        group: Count,
    ) -> PyResult<()> {
        if request_ids.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "request_ids must be a sequence of request id strings, not a str",
            ));
        }
        let request_ids: Vec<String> = request_ids.extract().map_err(|_| {
            PyTypeError::new_err("request_ids must be a sequence of request id strings")
        })?;
        let out = out.cast::<PyArray2<i32>>().map_err(|_| {
            PyTypeError::new_err("out must be a writable 2-D numpy array of dtype int32")
        })?;
        let mut rw = out.try_readwrite().map_err(|_| {
            PyTypeError::new_err("out must be a writable 2-D numpy array of dtype int32")
        })?;
        let shape = rw.shape().to_vec();
        if shape[0] < request_ids.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "out has {} rows for {} requests",
                shape[0],
                request_ids.len()
            )));
        }
        let ids: Vec<&str> = request_ids.iter().map(String::as_str).collect();
        let inner = self.inner();
        if rw.is_c_contiguous() {
            let slice = rw.as_slice_mut().expect("C-contiguous");
            return Ok(inner
                .manager
                .write_block_table(&ids, group.get(), slice, shape[1])?);
        }
        // Any other strides (Fortran order, slices): element by element through the view.
        let mut view = rw.as_array_mut();
        Ok(inner
            .manager
            .write_block_tables(&ids, group.get(), shape[1], |row, blocks| {
                for (col, &b) in blocks.iter().enumerate() {
                    view[[row, col]] = b as i32;
                }
            })?)
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
        mm_inputs: Option<&Bound<'_, PyAny>>,
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
        num_hits: Count,
        preempted: bool,
    ) -> PyResult<()> {
        self.with_request(py, request, false, |inner, r| {
            Ok(inner
                .manager
                .record_prefix_cache_stats(r.handle, num_hits.get(), preempted)?)
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
                .map(|g| (g.kind.as_str(), g.kind.sliding_window()))
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
