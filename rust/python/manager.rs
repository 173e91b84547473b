//! `hybrid_kv.KVCacheManager` and `hybrid_kv.KVCacheBlocks`.
//!
//! A Python `Request` keeps its own token ids (the scheduler appends outputs to it, as in vLLM);
//! the manager keeps a hashed copy per request, brought up to date at the start of every call
//! that takes the request, by the registration protocol of [`crate::manager::registry`]. The
//! copy goes away when the `Request` object is garbage collected (its blocks are freed before
//! any counter of the manager is read again) or `remove_request` is called.

use super::convert::{count_of, ids_to_numpy, Count, Text, TokenFn, Tokens, UInt};
use super::errors::{InvalidArgumentError, InvalidConfigError, OutOfRangeError};
use super::hashing::extra_keys;
use super::pool::event_to_py;
use super::request::{lock, PyRequest};
use super::running::{PyVllmSlot, VllmFields};
use crate::error::Result as CoreResult;
use crate::hashing::{ExtraKeys, HashAlgo, TokenId};
use crate::manager::registry::{DropQueue, HeldHorizon, Lookup, Registry, Synced};
use crate::manager::{
    AllocateArgs, AttentionKind, ComputedBlocks, GroupSpec, KVCacheManager, KindParams,
    ManagerConfig, PrefixCacheStats, Prober, RequestHandle, RunningHorizon,
};
use crate::types::BlockId;
use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyMapping, PyString, PyTuple};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Copies `[(src, dst), ...]` and the blocks retained for them, as lists.
type CopyLists = (Vec<(i32, i32)>, Vec<i32>);

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

/// Block ids per group as a tuple of Python lists of ints (vLLM's `get_block_ids()` types);
/// None with `allow_none` when every group is empty.
pub(crate) fn id_lists<'py, 'a>(
    py: Python<'py>,
    groups: impl Iterator<Item = &'a [BlockId]> + Clone,
    allow_none: bool,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    if allow_none && groups.clone().all(<[BlockId]>::is_empty) {
        return Ok(None);
    }
    PyTuple::new(py, super::convert::id_list_groups(py, groups)?).map(Some)
}

#[pymethods]
impl PyKVCacheBlocks {
    /// One int32 array of block ids per group (null block 0 where a slot needs no block); the
    /// groups in `group_ids` only, if given; None with `allow_none` when they are all empty.
    #[pyo3(signature = (allow_none = false, *, group_ids = None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<Vec<Count>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let blocks = &self.computed.blocks;
        let selected: Vec<&Vec<BlockId>> = match group_ids {
            None => blocks.iter().collect(),
            Some(ids) => ids
                .into_iter()
                .map(|g| {
                    blocks.get(g.get()).ok_or_else(|| {
                        OutOfRangeError::new_err(format!(
                            "group {} out of range ({} groups)",
                            g.get(),
                            blocks.len()
                        ))
                    })
                })
                .collect::<PyResult<_>>()?,
        };
        if allow_none && selected.iter().all(|b| b.is_empty()) {
            return Ok(None);
        }
        PyTuple::new(
            py,
            selected
                .into_iter()
                .map(|ids| ids_to_numpy(py, ids.clone())),
        )
        .map(Some)
    }

    /// The block ids per group as Python lists of ints (vLLM's `get_block_ids()` types, made
    /// without arrays in between); None with `allow_none` when every group is empty.
    #[pyo3(signature = (allow_none = false))]
    pub(crate) fn get_block_id_lists<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        id_lists(
            py,
            self.computed.blocks.iter().map(Vec::as_slice),
            allow_none,
        )
    }

    /// Group-wise concatenation (vLLM's `KVCacheBlocks.__add__`).
    fn __add__(&self, py: Python<'_>, other: &PyKVCacheBlocks) -> PyResult<Py<PyKVCacheBlocks>> {
        if other.manager_id != self.manager_id
            || other.computed.blocks.len() != self.computed.blocks.len()
        {
            return Err(InvalidArgumentError::new_err(
                "KVCacheBlocks of different managers or group counts cannot be added",
            ));
        }
        let blocks = self
            .computed
            .blocks
            .iter()
            .zip(&other.computed.blocks)
            .map(|(a, b)| a.iter().chain(b).copied().collect())
            .collect();
        Py::new(
            py,
            PyKVCacheBlocks {
                computed: ComputedBlocks::new(blocks, 0),
                manager_id: self.manager_id,
            },
        )
    }

    /// Blocks with the same groups and no block (vLLM's `new_empty`).
    fn new_empty(&self, py: Python<'_>) -> PyResult<Py<PyKVCacheBlocks>> {
        Py::new(
            py,
            PyKVCacheBlocks {
                computed: ComputedBlocks::new(vec![Vec::new(); self.computed.blocks.len()], 0),
                manager_id: self.manager_id,
            },
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

    /// Whether the blocks are a `get_computed_blocks` hit unchanged (not a truncation, nor the
    /// per-group view `get_computed_blocks_for_connector` gives a Mamba hybrid): the vLLM
    /// adapter publishes a reported hit's blocks for those only, as vLLM does.
    #[getter]
    fn _is_lookup_hit(&self) -> bool {
        self.computed.found.is_some()
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
    /// Calls so far that may have changed a request's blocks by its id (not through its
    /// `Request`): a running horizon a record holds is used only while this is unchanged.
    epoch: AtomicU64,
}

/// The KV cache manager a scheduler drives (vLLM 0.33's `KVCacheManager` methods). Thread-safe:
/// scheduler calls are serialised; `probe` runs concurrently without blocking them.
#[pyclass(frozen, name = "KVCacheManager", module = "hybrid_kv")]
pub(crate) struct PyKVCacheManager {
    shared: Arc<Shared>,
    empty: Py<PyKVCacheBlocks>,
    num_groups: usize,
}

/// The fields a group spec reads; a mapping with any other key is refused (a misspelt field
/// would otherwise be dropped unseen). `hybrid_kv._core._GROUP_FIELDS` in Python.
const GROUP_FIELDS: [&str; 10] = [
    "kind",
    "block_size",
    "sliding_window",
    "attention_chunk_size",
    "rswa_window",
    "bounded_replay",
    "mamba_cache_mode",
    "num_speculative_blocks",
    "num_prefill_checkpoint_blocks",
    "prefill_checkpoint_alignment",
];

/// `InvalidConfigError` for the first key of a group mapping that is not a group field.
fn check_group_keys(keys: &Bound<'_, PyList>, index: usize) -> PyResult<()> {
    for key in keys.iter() {
        let known = key
            .cast::<PyString>()
            .ok()
            .and_then(|k| k.to_str().ok().map(|k| GROUP_FIELDS.contains(&k)))
            .unwrap_or(false);
        if !known {
            return Err(InvalidConfigError::new_err(format!(
                "group {index}: unknown field {} (known: {})",
                key.repr()?,
                GROUP_FIELDS.join(", ")
            )));
        }
    }
    Ok(())
}

/// A group spec from a mapping or an object with the same attributes.
fn group_from_py(
    obj: &Bound<'_, PyAny>,
    index: usize,
    enable_caching: bool,
) -> PyResult<GroupSpec> {
    // A dict, any other mapping (`MappingProxyType`, `UserDict`, ...), or an object whose
    // attributes are the fields (an object may have others: vLLM's specs do).
    let dict = obj.cast::<PyDict>().ok();
    let mapping = match dict {
        Some(_) => None,
        None => obj.cast::<PyMapping>().ok(),
    };
    if let Some(d) = &dict {
        check_group_keys(&d.keys(), index)?;
    } else if let Some(m) = &mapping {
        check_group_keys(&m.keys()?, index)?;
    }
    let get = |name: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        let value = if let Some(d) = &dict {
            d.get_item(name)?
        } else if let Some(m) = &mapping {
            match m.get_item(name) {
                Ok(v) => Some(v),
                Err(e) if e.is_instance_of::<PyKeyError>(obj.py()) => None,
                Err(e) => return Err(e),
            }
        } else if obj.hasattr(name)? {
            Some(obj.getattr(name)?)
        } else {
            None
        };
        Ok(value.filter(|v| !v.is_none()))
    };
    let count = |name: &'static str| -> PyResult<Option<usize>> {
        get(name)?
            .map(|v| count_of(&v, &format!("group {index}: {name}")))
            .transpose()
    };
    let string = |name: &'static str| -> PyResult<Option<String>> {
        match get(name)? {
            Some(v) if v.is_instance_of::<PyString>() => {
                Ok(Some(v.extract::<Text>()?.into_string()))
            }
            Some(v) => Err(PyTypeError::new_err(format!(
                "group {index}: {name} must be a str, got {}",
                v.get_type().name()?
            ))),
            None => Ok(None),
        }
    };
    let kind = match string("kind")? {
        Some(kind) => kind,
        None if dict.is_none() && mapping.is_none() && !obj.hasattr("block_size")? => {
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
    let Some(block_size) = count("block_size")? else {
        return Err(InvalidConfigError::new_err(format!(
            "group {index}: missing block_size"
        )));
    };
    let bounded_replay = match get("bounded_replay")? {
        Some(v) => Some(v.extract::<bool>().map_err(|_| {
            PyTypeError::new_err(format!("group {index}: bounded_replay must be a bool"))
        })?),
        None => None,
    };
    let params = KindParams {
        sliding_window: count("sliding_window")?,
        attention_chunk_size: count("attention_chunk_size")?,
        rswa_window: count("rswa_window")?,
        bounded_replay,
        mamba_cache_mode: string("mamba_cache_mode")?,
        num_speculative_blocks: count("num_speculative_blocks")?,
        num_prefill_checkpoint_blocks: count("num_prefill_checkpoint_blocks")?,
        prefill_checkpoint_alignment: count("prefill_checkpoint_alignment")?,
    };
    let kind = AttentionKind::parse(&kind, &params, enable_caching)
        .map_err(|e| InvalidConfigError::new_err(format!("group {index}: {e}")))?;
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

/// `Prober::probe` over the tokens (run with the GIL released).
struct ProbeFn<'a> {
    prober: &'a Prober,
    extra: &'a ExtraKeys,
}

impl TokenFn<CoreResult<usize>> for ProbeFn<'_> {
    fn call<T: TokenId + Send + Sync>(self, tokens: &[T]) -> CoreResult<usize> {
        self.prober.probe(tokens, self.extra)
    }
}

/// A request brought up to date in the manager: its handle and the scheduler's count of its
/// computed tokens.
#[derive(Clone, Copy)]
struct Current {
    handle: RequestHandle,
    num_computed_tokens: usize,
    num_in_flight_tokens: usize,
}

impl PyKVCacheBlocks {
    /// New blocks of the manager `manager_id`, per group.
    pub(crate) fn new_blocks(blocks: Vec<Vec<BlockId>>, manager_id: u64) -> Self {
        PyKVCacheBlocks {
            computed: ComputedBlocks::new(blocks, 0),
            manager_id,
        }
    }
}

impl PyKVCacheManager {
    /// `allocate_running`, the new blocks (per group) handed back as `pack` makes them: None
    /// when out of blocks, `Some(None)` when nothing is new. vLLM's request's attributes are
    /// read from what the entry read of it (`fields`) when given (`_VllmSlot::sync`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn allocate_running_with<'py, T: Send>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        fields: Option<&VllmFields<'_, 'py>>,
        slot: &Bound<'py, PyVllmSlot>,
        num_new_tokens: Count,
        num_lookahead_tokens: Count,
        pack: impl Fn(&[Vec<BlockId>]) -> T + Send + Sync,
    ) -> PyResult<Option<Option<T>>> {
        let slot = slot.get();
        // Drops the horizon first: until the call succeeds, no later call is a known no-op.
        let companion = slot.sync(request, fields, true)?;
        let args = AllocateArgs {
            num_new_tokens: num_new_tokens.get(),
            num_lookahead_tokens: num_lookahead_tokens.get(),
            has_scheduled_reqs: true,
            ..Default::default()
        };
        let (new, horizon) = self.allocate_packing(py, companion.get(), &args, pack)?;
        slot.ran(horizon);
        Ok(new)
    }

    /// The manager's id (the owner of the blocks it hands out).
    pub(crate) fn id(&self) -> u64 {
        self.shared.id
    }

    /// `allocate_slots` once the request's counts are set.
    fn allocate_with(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        args: &AllocateArgs<'_>,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        Ok(self.allocate_reading_horizon(py, request, args)?.0)
    }

    /// `allocate_with`, also returning the request's [`RunningHorizon`] after the call (none
    /// when the pool could not supply the blocks), which the request's record keeps too.
    fn allocate_reading_horizon(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        args: &AllocateArgs<'_>,
    ) -> PyResult<(Option<Py<PyKVCacheBlocks>>, Option<RunningHorizon>)> {
        let (new, reach) = self.allocate_packing(py, request, args, <[Vec<BlockId>]>::to_vec)?;
        Ok((self.new_blocks_result(py, new)?, reach))
    }

    /// An allocation's result: None when out of blocks, the shared empty result when nothing
    /// is new, else the new blocks.
    fn new_blocks_result(
        &self,
        py: Python<'_>,
        new: Option<Option<Vec<Vec<BlockId>>>>,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        Ok(match new {
            None => None,
            Some(None) => Some(self.empty.clone_ref(py)),
            Some(Some(blocks)) => Some(self.blocks(py, ComputedBlocks::new(blocks, 0))?),
        })
    }

    /// The allocation of `allocate_reading_horizon`, its new blocks (per group) handed back as
    /// `pack` makes them: None when out of blocks, `Some(None)` when nothing is new.
    fn allocate_packing<T: Send>(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        args: &AllocateArgs<'_>,
        pack: impl Fn(&[Vec<BlockId>]) -> T + Send + Sync,
    ) -> PyResult<(Option<Option<T>>, Option<RunningHorizon>)> {
        let args = *args;
        let long = args.num_new_tokens >= DETACH_SCHEDULE_TOKENS;
        self.with_request_holding(py, request, long, |inner, r| {
            let args = AllocateArgs {
                num_computed_tokens: r.num_computed_tokens,
                num_in_flight_tokens: r.num_in_flight_tokens,
                ..args
            };
            let Inner {
                manager,
                new_blocks,
                ..
            } = inner;
            if !manager.allocate_slots_into(r.handle, &args, new_blocks)? {
                return Ok(((None, None), None));
            }
            let new = (!new_blocks.iter().all(Vec::is_empty)).then(|| pack(new_blocks));
            // The request's computed tokens after this step: later running steps start there.
            let computed = args
                .num_computed_tokens
                .saturating_add(args.num_new_computed_tokens)
                .saturating_add(args.num_external_computed_tokens)
                .saturating_add(args.num_new_tokens);
            let reach = manager.running_horizon_past(r.handle, computed)?;
            Ok(((Some(new), reach), reach))
        })
    }

    /// Moves the epoch of by-id changes on: a call that may change a request's blocks without
    /// naming its `Request` (its record's horizon is then unusable).
    fn changed_by_id(&self) {
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
    }

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
        self.with_request_holding(py, request, long, |inner, r| Ok((f(inner, r)?, None)))
    }

    /// [`Self::with_request`] whose `f` also returns the running horizon the call leaves
    /// (kept in the request's record, under the same locks, for `allocate_slots`' running
    /// steps); any horizon the record held is dropped first.
    fn with_request_holding<R: Send>(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        long: bool,
        f: impl Fn(&mut Inner, Current) -> PyResult<(R, Option<RunningHorizon>)> + Send + Sync,
    ) -> PyResult<R> {
        let mut prompt: Option<Vec<u32>> = None;
        loop {
            let given = prompt.as_deref();
            let done = self.run(py, long, || {
                let mut guard = self.inner();
                let inner = &mut *guard;
                let mut record = lock(&request.record);
                record.horizon = None;
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
                    num_in_flight_tokens: record.num_in_flight_tokens,
                };
                if record.skip_reading_prefix_cache {
                    inner.manager.set_skip_reading_prefix_cache(handle, true)?;
                } else if registered || inner.manager.request(handle)?.skip_reading_prefix_cache() {
                    inner.manager.set_skip_reading_prefix_cache(handle, false)?;
                }
                match f(inner, current) {
                    Ok((r, horizon)) => {
                        record.horizon = horizon.map(|horizon| HeldHorizon {
                            owner: self.shared.id,
                            epoch: self.shared.epoch.load(Ordering::Acquire),
                            horizon,
                        });
                        Ok(Some(r))
                    }
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

    /// Drains the copy-on-write copies (as vLLM's int32 ids) and the blocks retained for them.
    fn take_copies(&self) -> (Vec<(i32, i32)>, Vec<BlockId>) {
        let (copies, retained) = self.inner().manager.take_kv_cache_block_copies();
        let copies = copies
            .into_iter()
            .map(|(s, d)| (s as i32, d as i32))
            .collect();
        (copies, retained)
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
    #[pyo3(signature = (groups, num_blocks, max_model_len, *, enable_caching = true, enable_kv_events = false, hash_algo = Text::Static("xxh3"), hash_seed = Text::Static(""), watermark = 0.0, max_in_flight_tokens = None, prefix_cache_retention_interval = Some(UInt(0)), use_eagle = false, eagle_groups = None, num_hash_lookahead_tokens = UInt(0), num_prefill_lookahead = UInt(0), scheduler_block_size = None, hash_block_size = None, enable_mamba_shared_prefix_checkpoint = false, needs_kv_cache_zeroing = None), text_signature = "(groups, num_blocks, max_model_len, *, enable_caching=True, enable_kv_events=False, hash_algo='xxh3', hash_seed='', watermark=0.0, max_in_flight_tokens=None, prefix_cache_retention_interval=0, use_eagle=False, eagle_groups=None, num_hash_lookahead_tokens=0, num_prefill_lookahead=0, scheduler_block_size=None, hash_block_size=None, enable_mamba_shared_prefix_checkpoint=False, needs_kv_cache_zeroing=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        groups: &Bound<'_, PyAny>,
        num_blocks: Count,
        max_model_len: Count,
        enable_caching: bool,
        enable_kv_events: bool,
        hash_algo: Text,
        hash_seed: Text,
        watermark: f64,
        max_in_flight_tokens: Option<Count>,
        prefix_cache_retention_interval: Option<Count>,
        use_eagle: bool,
        eagle_groups: Option<Vec<Count>>,
        num_hash_lookahead_tokens: Count,
        num_prefill_lookahead: Count,
        scheduler_block_size: Option<Count>,
        hash_block_size: Option<Count>,
        enable_mamba_shared_prefix_checkpoint: bool,
        needs_kv_cache_zeroing: Option<bool>,
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
            .map(|(i, g)| group_from_py(&g?, i, enable_caching))
            .collect::<PyResult<Vec<_>>>()?;
        let mut config = ManagerConfig::new(specs, num_blocks.get(), max_model_len.get());
        config.enable_caching = enable_caching;
        config.enable_events = enable_kv_events;
        config.hash_algo = HashAlgo::parse(&hash_algo)?;
        config.hash_seed = hash_seed.into_string();
        config.watermark = watermark;
        config.max_in_flight_tokens = max_in_flight_tokens.map(Count::get);
        config.retention_interval = prefix_cache_retention_interval.map(Count::get);
        config.use_eagle = use_eagle;
        config.eagle_groups = eagle_groups.map(|g| g.into_iter().map(Count::get).collect());
        config.num_hash_lookahead_tokens = num_hash_lookahead_tokens.get();
        config.num_prefill_lookahead = num_prefill_lookahead.get();
        config.scheduler_block_size = scheduler_block_size.map(Count::get);
        config.hash_block_size = hash_block_size.map(Count::get);
        config.enable_mamba_shared_prefix_checkpoint = enable_mamba_shared_prefix_checkpoint;
        config.needs_kv_cache_zeroing = needs_kv_cache_zeroing;
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
                epoch: AtomicU64::new(0),
            }),
            empty,
            num_groups,
        })
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.num_groups
    }

    /// The shared empty result: no block in any group (vLLM's `empty_kv_cache_blocks`).
    #[getter]
    fn empty_kv_cache_blocks(&self, py: Python<'_>) -> Py<PyKVCacheBlocks> {
        self.empty.clone_ref(py)
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.shared.prober.pool().num_blocks()
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner().manager.max_model_len()
    }

    /// The KV cache groups as the constructor reads them: one dict per group (`kind`,
    /// `block_size`, and the kind's parameters).
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let specs = self.inner().manager.group_specs();
        specs
            .iter()
            .map(|g| {
                let d = PyDict::new(py);
                d.set_item("block_size", g.block_size)?;
                let kind = match g.kind {
                    AttentionKind::Full => "full",
                    AttentionKind::Mla => "mla",
                    AttentionKind::Rswa { window } => {
                        d.set_item("rswa_window", window)?;
                        "rswa"
                    }
                    AttentionKind::SlidingWindow { window } => {
                        d.set_item("sliding_window", window)?;
                        "sliding_window"
                    }
                    AttentionKind::SlidingWindowMla {
                        window,
                        bounded_replay,
                    } => {
                        d.set_item("sliding_window", window)?;
                        d.set_item("bounded_replay", bounded_replay)?;
                        "sliding_window_mla"
                    }
                    AttentionKind::ChunkedLocal { chunk } => {
                        d.set_item("attention_chunk_size", chunk)?;
                        "chunked_local"
                    }
                    AttentionKind::Mamba {
                        mode,
                        speculative_blocks,
                        prefill_checkpoint_alignment,
                    } => {
                        let mode = match mode {
                            crate::manager::MambaMode::Align => "align",
                            crate::manager::MambaMode::None => "none",
                        };
                        d.set_item("mamba_cache_mode", mode)?;
                        d.set_item("num_speculative_blocks", speculative_blocks)?;
                        if prefill_checkpoint_alignment > 0 {
                            d.set_item("num_prefill_checkpoint_blocks", 1)?;
                            d.set_item(
                                "prefill_checkpoint_alignment",
                                prefill_checkpoint_alignment,
                            )?;
                        }
                        "mamba"
                    }
                    AttentionKind::CircularBuffer => "circular_buffer",
                };
                d.set_item("kind", kind)?;
                Ok(d)
            })
            .collect()
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

    /// Whether hits may end at hash block boundaries inside blocks (vLLM's coordinator
    /// `enable_partial_hash_hits`): a hybrid layout with an align-mode Mamba group of blocks
    /// larger than the hash block.
    #[getter]
    fn enable_partial_hash_hits(&self) -> bool {
        self.inner().manager.partial_hash_hits()
    }

    /// Whether Mamba groups also key states at shared-prefix junctions (vLLM's manager
    /// `mamba_shared_prefix_checkpoint`).
    #[getter]
    fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.inner().manager.mamba_shared_prefix_checkpoint()
    }

    /// Blocks retained (for copy-on-write copies, or popped) and not released yet.
    #[getter]
    fn num_retained_blocks(&self) -> usize {
        self.inner().manager.num_retained_blocks()
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
    fn remove_request(&self, request_id: Text) -> PyResult<()> {
        let mut guard = self.inner();
        self.changed_by_id();
        let inner = &mut *guard;
        Ok(inner.registry.remove(&mut inner.manager, &request_id)?)
    }

    /// The request's cached prefix: `(blocks, num_computed_tokens)`, at most
    /// `max_cache_hit_length` (default `num_tokens - 1`) tokens. Reference counts are not
    /// touched until `allocate_slots` adopts the hit.
    #[pyo3(signature = (request, max_cache_hit_length = None))]
    fn get_computed_blocks(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        max_cache_hit_length: Option<Count>,
    ) -> PyResult<(Py<PyKVCacheBlocks>, usize)> {
        let long = request.num_tokens_now() >= DETACH_SCHEDULE_TOKENS;
        let computed = self.with_request(py, request, long, |inner, r| {
            Ok(inner
                .manager
                .get_computed_blocks_capped(r.handle, max_cache_hit_length.map(Count::get))?)
        })?;
        let n = computed.num_computed_tokens;
        Ok((self.blocks(py, computed)?, n))
    }

    /// The local lookup for a request scheduled with a KV connector: `(blocks,
    /// num_computed_tokens, hit_diverged)` (see the stub).
    #[pyo3(signature = (request, max_cache_hit_length = None))]
    fn get_computed_blocks_for_connector(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        max_cache_hit_length: Option<Count>,
    ) -> PyResult<(Py<PyKVCacheBlocks>, usize, bool)> {
        let long = request.num_tokens_now() >= DETACH_SCHEDULE_TOKENS;
        let (computed, diverged) = self.with_request(py, request, long, |inner, r| {
            Ok(inner.manager.get_computed_blocks_for_connector(
                r.handle,
                max_cache_hit_length.map(Count::get),
            )?)
        })?;
        let n = computed.num_computed_tokens;
        Ok((self.blocks(py, computed)?, n, diverged))
    }

    /// Slots for `num_new_tokens` more tokens (plus lookahead tokens, never cached), adopting a
    /// prefix-cache hit on the first allocation. Returns the newly allocated blocks, or None when
    /// the pool cannot supply them (see the stub's docstring for what None may have freed).
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens = UInt(0), new_computed_blocks = None, num_lookahead_tokens = UInt(0), num_external_computed_tokens = UInt(0), delay_cache_blocks = false, num_encoder_tokens = UInt(0), full_sequence_must_fit = false, reserved_blocks = UInt(0), has_scheduled_reqs = true, skip_zeroing_group_ids = Vec::new(), num_computed_tokens = None, num_in_flight_tokens = None), text_signature = "(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0, has_scheduled_reqs=True, skip_zeroing_group_ids=(), num_computed_tokens=None, num_in_flight_tokens=None)")]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        num_new_tokens: Count,
        num_new_computed_tokens: Count,
        new_computed_blocks: Option<&PyKVCacheBlocks>,
        num_lookahead_tokens: Count,
        num_external_computed_tokens: Count,
        delay_cache_blocks: bool,
        num_encoder_tokens: Count,
        full_sequence_must_fit: bool,
        reserved_blocks: Count,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Vec<Count>,
        num_computed_tokens: Option<Count>,
        num_in_flight_tokens: Option<Count>,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        if num_computed_tokens.is_some() || num_in_flight_tokens.is_some() {
            // The scheduler's counts, set on the request as by its setters (one call less).
            lock(&request.record).set_progress(
                num_computed_tokens.map(Count::get),
                num_in_flight_tokens.map(Count::get),
            )?;
        }
        let skip_zeroing: Vec<usize> = skip_zeroing_group_ids.into_iter().map(Count::get).collect();
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
            num_external_computed_tokens: num_external_computed_tokens.get(),
            reserved_blocks: reserved_blocks.get(),
            skip_zeroing_group_ids: &skip_zeroing,
        };
        if num_encoder_tokens.get() == 0
            && args.is_running_step()
            && lock(&request.record).inside_horizon(
                self.shared.id,
                self.shared.epoch.load(Ordering::Acquire),
                args.num_new_tokens,
                args.num_lookahead_tokens,
            )
        {
            // A running step inside the horizon the request's last call left: it would take,
            // free and cache nothing. Its tokens reach the manager at its next call.
            return Ok(Some(self.empty.clone_ref(py)));
        }
        if let Some(b) = new_computed_blocks {
            if b.manager_id != self.shared.id {
                return Err(InvalidArgumentError::new_err(
                    "new_computed_blocks come from another KVCacheManager",
                ));
            }
        }
        if num_encoder_tokens.get() != 0 {
            return Err(InvalidArgumentError::new_err(
                "num_encoder_tokens: cross-attention (encoder-decoder) layouts are not supported",
            ));
        }
        self.allocate_with(py, request, &args)
    }

    /// The step of a running request as vLLM's scheduler makes it (`hybrid_kv.vllm`'s
    /// `allocate_slots(request, n, num_lookahead_tokens=k)`), in one call: the companion in
    /// `slot` is brought up to date as by `sync_companion` and takes the scheduler's
    /// `num_computed_tokens` and `num_in_flight_tokens` from vLLM's `request`, then
    /// `allocate_slots` runs as above. Counts out of bounds change nothing; an error from the
    /// allocation leaves the companion's tokens taken (they are vLLM's).
    ///
    /// The slot then holds the request's running horizon (see `running_horizon`), or none
    /// when no later call is known to change nothing.
    pub(crate) fn allocate_running(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        slot: &Bound<'_, PyVllmSlot>,
        num_new_tokens: Count,
        num_lookahead_tokens: Count,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        let new = self.allocate_running_with(
            py,
            request,
            None,
            slot,
            num_new_tokens,
            num_lookahead_tokens,
            <[Vec<BlockId>]>::to_vec,
        )?;
        self.new_blocks_result(py, new)
    }

    /// `hybrid_kv.vllm`'s companion of a vLLM request, brought up to date with vLLM's
    /// `request._all_token_ids` (see `_VllmSlot`). Returns the companion.
    fn sync_companion<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        slot: &Bound<'py, PyVllmSlot>,
    ) -> PyResult<Bound<'py, PyRequest>> {
        slot.get().sync(request, None, false).cloned()
    }

    /// Caches the request's full blocks of its first `num_computed_tokens` tokens (after an
    /// allocation with `delay_cache_blocks`, once the data arrived).
    fn cache_blocks(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        num_computed_tokens: Count,
    ) -> PyResult<()> {
        self.with_request(py, request, false, |inner, r| {
            Ok(inner
                .manager
                .cache_blocks(r.handle, num_computed_tokens.get())?)
        })
    }

    /// Pops the request's blocks without freeing them (groups concatenated, allocation order,
    /// leading nulls dropped); they stay retained until the caller releases them with
    /// `free_retained_blocks`, reversed.
    fn pop_blocks_for_free<'py>(
        &self,
        py: Python<'py>,
        request: &PyRequest,
    ) -> PyResult<Bound<'py, numpy::PyArray1<i32>>> {
        let ids = {
            let mut guard = self.inner();
            let inner = &mut *guard;
            let mut record = lock(&request.record);
            record.horizon = None;
            match inner.registry.lookup(&inner.manager, &record)? {
                Lookup::Registered(handle) => inner.manager.pop_blocks_for_free(handle)?,
                Lookup::NotRegistered => Vec::new(),
                Lookup::OtherObject => {
                    return Err(InvalidArgumentError::new_err(format!(
                        "request id {:?} is registered by another Request object",
                        request.request_id_str()
                    )))
                }
            }
        };
        // The array is made after the locks are released (allocation may run a finalizer that
        // calls back into the manager or the request).
        Ok(ids_to_numpy(py, ids))
    }

    /// Removes the cache entries of the given blocks (reference counts untouched).
    fn evict_blocks(&self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = super::convert::extract_ids(block_ids)?;
        let mut inner = self.inner();
        self.changed_by_id();
        Ok(inner.manager.evict_blocks(&ids)?)
    }

    /// Drains the ids of new attention blocks the worker must zero (layouts with Mamba
    /// layers).
    fn take_new_block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArray1<i32>> {
        let ids = self.inner().manager.take_new_block_ids();
        ids_to_numpy(py, ids)
    }

    /// `take_new_block_ids` as a list (`hybrid_kv.vllm`'s adapter hands vLLM a list).
    fn _take_new_block_id_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = self.inner().manager.take_new_block_ids();
        let mut lists = super::convert::id_list_groups(py, std::iter::once(&ids[..]))?;
        Ok(lists.pop().unwrap_or_else(|| PyList::empty(py)))
    }

    /// Records the request's attention blocks from the block-aligned `start_token` on for
    /// zeroing again.
    fn record_blocks_for_zeroing(&self, request_id: Text, start_token: Count) -> PyResult<()> {
        Ok(self
            .inner()
            .manager
            .record_blocks_for_zeroing(&*request_id, start_token.get())?)
    }

    /// Drains this step's Mamba boundary states committed to the cache:
    /// `{request_id: [(group, block, boundary_tokens), ...]}`.
    fn take_boundary_state_offloads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let offloads = self.inner().manager.take_boundary_state_offloads();
        let d = PyDict::new(py);
        for (rid, group, block, tokens) in offloads {
            let entry = (group, block as i32, tokens);
            match d.get_item(&rid)? {
                Some(list) => list.call_method1("append", (entry,))?,
                None => {
                    d.set_item(&rid, vec![entry])?;
                    continue;
                }
            };
        }
        Ok(d)
    }

    /// Copy-on-write block copies for the worker and the blocks retained until they ran:
    /// `([(src, dst), ...], retained)`, `retained` the endpoints of every copy in order. Each
    /// retained block keeps one reference until `free_retained_blocks` gets it back.
    fn take_kv_cache_block_copies<'py>(
        &self,
        py: Python<'py>,
    ) -> (Vec<(i32, i32)>, Bound<'py, numpy::PyArray1<i32>>) {
        let (copies, retained) = self.take_copies();
        (copies, ids_to_numpy(py, retained))
    }

    /// `take_kv_cache_block_copies` with the retained blocks as a list, or None when there is
    /// no copy (every step, but for partial hits: `hybrid_kv.vllm`'s adapter then answers with
    /// empty lists without making any).
    fn _take_kv_cache_block_copy_lists(&self) -> Option<CopyLists> {
        let (copies, retained) = self.take_copies();
        if copies.is_empty() && retained.is_empty() {
            return None;
        }
        Some((copies, retained.into_iter().map(|b| b as i32).collect()))
    }

    /// Releases blocks `take_kv_cache_block_copies` or `pop_blocks_for_free` retained, in the
    /// given order (vLLM's `block_pool.free_blocks` of them once the copies ran, or the deferred
    /// free came due). Only blocks retained and not yet released are accepted; otherwise
    /// nothing changes.
    fn free_retained_blocks(&self, blocks: Vec<i64>) -> PyResult<()> {
        let ids = blocks
            .into_iter()
            .map(|b| {
                BlockId::try_from(b).map_err(|_| {
                    InvalidArgumentError::new_err(format!("block id {b} is out of range"))
                })
            })
            .collect::<PyResult<Vec<BlockId>>>()?;
        Ok(self.inner().manager.free_retained_blocks(&ids)?)
    }

    /// Mamba states the request keyed inside a block at its prompt boundary, when it finishes
    /// exactly there: `[(group, block, boundary_tokens), ...]` (vLLM's
    /// `finalize_partial_tail_offloads`). The counts default to the request's.
    #[pyo3(signature = (request, num_computed_tokens = None, num_in_flight_tokens = None))]
    fn finalize_partial_tail_offloads(
        &self,
        request: &PyRequest,
        num_computed_tokens: Option<Count>,
        num_in_flight_tokens: Option<Count>,
    ) -> PyResult<Vec<(u32, i32, usize)>> {
        let mut guard = self.inner();
        let inner = &mut *guard;
        let mut record = lock(&request.record);
        record.horizon = None;
        let computed = num_computed_tokens.map_or(record.num_computed_tokens, Count::get);
        let in_flight = num_in_flight_tokens.map_or(record.num_in_flight_tokens, Count::get);
        match inner.registry.lookup(&inner.manager, &record)? {
            Lookup::Registered(handle) => Ok(inner
                .manager
                .finalize_partial_tail_offloads(handle, computed, in_flight)?
                .into_iter()
                .map(|(g, b, t)| (g, b as i32, t))
                .collect()),
            _ => Ok(Vec::new()),
        }
    }

    /// The request's tables with attention groups clipped to `num_computed_tokens`.
    fn get_block_ids_for_computed_tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: Text,
        num_computed_tokens: Count,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let tables = self
            .inner()
            .manager
            .get_block_ids_for_computed_tokens(&*request_id, num_computed_tokens.get())?;
        PyTuple::new(py, tables.into_iter().map(|ids| ids_to_numpy(py, ids)))
    }

    /// Tokens of the request's own blocks that are in the prefix cache (least over groups).
    fn estimate_cached_tokens(&self, py: Python<'_>, request: &PyRequest) -> PyResult<usize> {
        self.with_request(py, request, false, |inner, r| {
            Ok(inner.manager.estimate_cached_tokens(r.handle)?)
        })
    }

    /// How far the request's next running steps can go without changing anything:
    /// `(slots, cache, removal)` (see `hybrid_kv.vllm`), or None when no step is known to.
    fn running_horizon(
        &self,
        py: Python<'_>,
        request: &PyRequest,
    ) -> PyResult<Option<(usize, usize, usize)>> {
        self.with_request(py, request, false, |inner, r| {
            Ok(inner
                .manager
                .running_horizon(r.handle)?
                .map(|h| (h.slots, h.cache, h.removal)))
        })
    }

    /// A hit cut to its first `num_computed_tokens` tokens.
    fn truncate_computed_blocks(
        &self,
        py: Python<'_>,
        blocks: &PyKVCacheBlocks,
        num_computed_tokens: Count,
    ) -> PyResult<Py<PyKVCacheBlocks>> {
        if blocks.manager_id != self.shared.id {
            return Err(InvalidArgumentError::new_err(
                "blocks come from another KVCacheManager",
            ));
        }
        let cut = self
            .inner()
            .manager
            .truncate_computed_blocks(&blocks.computed, num_computed_tokens.get())?;
        self.blocks(py, cut)
    }

    /// vLLM's deprecated cascade-attention query: 0 per group.
    fn get_num_common_prefix_blocks(&self, request_id: Text) -> Vec<usize> {
        let _ = request_id;
        vec![0; self.num_groups]
    }

    /// Frees the blocks that left the window after `processed_computed_tokens`
    /// (`allocate_slots` already does); with `num_prompt_tokens`, reference-sliding-window
    /// groups free the gap after the prompt.
    #[pyo3(signature = (request_id, processed_computed_tokens, num_prompt_tokens = None))]
    fn remove_skipped_blocks(
        &self,
        request_id: Text,
        processed_computed_tokens: Count,
        num_prompt_tokens: Option<Count>,
    ) -> PyResult<()> {
        let mut inner = self.inner();
        self.changed_by_id();
        Ok(inner.manager.remove_skipped_blocks(
            &*request_id,
            processed_computed_tokens.get(),
            num_prompt_tokens.map(Count::get),
        )?)
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
        if let Some(b) = new_computed_blocks {
            if b.manager_id != self.shared.id {
                return Err(InvalidArgumentError::new_err(
                    "new_computed_blocks come from another KVCacheManager",
                ));
            }
        }
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
        let mut record = lock(&request.record);
        record.horizon = None;
        match inner.registry.lookup(&inner.manager, &record)? {
            Lookup::Registered(handle) => Ok(inner.manager.free(handle)?),
            Lookup::NotRegistered => Ok(()),
            Lookup::OtherObject => Err(InvalidArgumentError::new_err(format!(
                "request id {:?} is registered by another Request object",
                request.request_id_str()
            ))),
        }
    }

    /// The request's block tables as `KVCacheBlocks` (`hybrid_kv.vllm`'s `get_blocks`: vLLM
    /// reads them as lists, which the result makes without arrays in between).
    fn _get_blocks(&self, py: Python<'_>, request_id: Text) -> PyResult<Py<PyKVCacheBlocks>> {
        let tables = self.inner().manager.get_block_ids(&*request_id)?;
        self.blocks(py, ComputedBlocks::new(tables, 0))
    }

    /// The request's block tables: one int32 array per group.
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: Text,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let tables = self.inner().manager.get_block_ids(&*request_id)?;
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
        let request_ids: Vec<Text> = request_ids.extract().map_err(|e: PyErr| {
            if e.is_instance_of::<InvalidArgumentError>(request_ids.py()) {
                e
            } else {
                PyTypeError::new_err("request_ids must be a sequence of request id strings")
            }
        })?;
        let out = out.cast::<PyArray2<i32>>().map_err(|_| {
            PyTypeError::new_err("out must be a writable 2-D numpy array of dtype int32")
        })?;
        if !out.is_aligned() {
            // Written through Rust slices and references, which must be aligned.
            return Err(PyTypeError::new_err(
                "out must be aligned for int32 (its data is at an odd byte offset)",
            ));
        }
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
        let ids: Vec<&str> = request_ids.iter().map(|id| &**id).collect();
        let inner = self.inner();
        if rw.is_c_contiguous() {
            let slice = rw
                .as_slice_mut()
                .map_err(|e| PyTypeError::new_err(format!("out cannot be written: {e}")))?;
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
        cache_salt: Option<Text>,
        lora_name: Option<Text>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let extra = extra_keys(cache_salt, lora_name, mm_inputs)?;
        Ok(Tokens::extract(token_ids)?.with_slice_detached(
            py,
            ProbeFn {
                prober: &self.shared.prober,
                extra: &extra,
            },
        )?)
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
        let mut inner = self.inner();
        self.changed_by_id();
        inner.manager.reset_prefix_cache()
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
    // What a group mapping may hold, for the Python code that builds one from a trace header.
    m.add("_GROUP_FIELDS", PyTuple::new(m.py(), GROUP_FIELDS)?)?;
    m.add_class::<PyRequest>()?;
    m.add_class::<PyKVCacheBlocks>()?;
    m.add_class::<PyKVCacheManager>()?;
    Ok(())
}
