//! `hybrid_kv.vllm`'s running steps: the state it keeps with each vLLM request (`_VllmSlot`)
//! and its `allocate_slots` entry (`_RunningSteps`, reached through a method descriptor CPython
//! calls directly: `_running_steps_entry`). A running request's step inside its running horizon
//! is answered from the slot before any Python frame runs; one outside it goes to the core
//! straight from here; every other call goes on to the adapter's `_allocate_slots`.

use super::convert::Text;
use super::convert::{
    count_of, int_layout, read_int_list_slice, small_exact_int, small_int_of, Count, IntLayout,
    UInt, U32,
};
use super::errors::OutOfRangeError;
use super::manager::{id_lists, PyKVCacheBlocks, PyKVCacheManager};
use super::request::{lock, merge_supplied, read_supplied, PyRequest};
use crate::manager::RunningHorizon;
use crate::types::{BlockId, FastHashBuilder};
use pyo3::exceptions::PyNotImplementedError;
use pyo3::prelude::*;
use pyo3::pyclass::{PyTraverseError, PyVisit};
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, intern};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// What a slot knows besides its companion.
#[derive(Clone, Copy, Debug, Default)]
struct SlotState {
    /// Tokens of vLLM's request the companion has taken.
    seen: usize,
    /// The running horizon the core's last running call left; none when no later call is known
    /// to change nothing.
    horizon: Option<RunningHorizon>,
    /// Running calls that reached the core.
    running_calls: u64,
}

/// What `hybrid_kv.vllm` keeps with a vLLM request (in its `__dict__`): the companion
/// `hybrid_kv.Request`, how many of vLLM's tokens it has taken, and the running horizon the
/// core's last running call left. Thread-safe: the state is read and written under its own
/// lock, never held while Python code runs, and concurrent syncs take each token once. The
/// horizon is exact when one request's calls do not overlap each other (vLLM's scheduler
/// makes them from one thread); calls for different requests may run concurrently.
#[pyclass(frozen, name = "_VllmSlot", module = "hybrid_kv._core")]
pub(crate) struct PyVllmSlot {
    companion: Py<PyRequest>,
    state: Mutex<SlotState>,
}

impl PyVllmSlot {
    /// A running call reached the core and left `horizon`.
    pub(crate) fn ran(&self, horizon: Option<RunningHorizon>) {
        let mut state = lock(&self.state);
        state.horizon = horizon;
        state.running_calls += 1;
    }

    /// Brings the companion up to date with vLLM's `request._all_token_ids`; with `progress`,
    /// also sets its counts from the request's `num_computed_tokens` and
    /// `num_in_flight_tokens`. Nothing changes on an error. vLLM's request is read before the
    /// slot is locked (reading it may run Python code); a concurrent sync of the same slot in
    /// between is taken into account, so each token is taken once. A call with `progress`
    /// first drops the horizon: until the running call that follows succeeds, no later call
    /// is known to change nothing. The companion comes back borrowed from the slot (taking a
    /// reference would write its header, a line nothing else on a running step reads).
    pub(crate) fn sync<'a, 'py>(
        &'a self,
        request: &Bound<'py, PyAny>,
        fields: Option<&VllmFields<'_, 'py>>,
        progress: bool,
    ) -> PyResult<&'a Bound<'py, PyRequest>> {
        let py = request.py();
        // An attribute of vLLM's request: from its instance dict when given and there (vLLM's
        // `Request` keeps them there), else looked up.
        let read = |name: &Bound<'py, PyString>| match fields.map(|f| f.dict.get_item(name)) {
            Some(Ok(Some(value))) => Ok(value),
            _ => request.getattr(name),
        };
        let companion = self.companion.bind(py);
        let from = {
            let mut state = lock(&self.state);
            if progress {
                state.horizon = None;
            }
            state.seen
        };
        let all = read(intern!(py, "_all_token_ids"))?;
        let all = all.cast::<PyList>()?;
        let counts = match (progress, fields.and_then(|f| f.counts)) {
            (false, _) => None,
            (true, Some(read)) => Some((read.computed, read.in_flight)),
            (true, None) => {
                let count = |name, what: &str| count_of(&read(name)?, what);
                Some((
                    count(intern!(py, "num_computed_tokens"), "num_computed_tokens")?,
                    count(intern!(py, "num_in_flight_tokens"), "num_in_flight_tokens")?,
                ))
            }
        };
        let lost = |num_tokens: usize, seen: usize| {
            PyNotImplementedError::new_err(format!(
                "request {:?} lost tokens ({seen} -> {num_tokens}); streaming-input sessions \
                 are not served by hybrid-kv",
                companion.get().request_id_str()
            ))
        };
        let num_tokens = all.len();
        if num_tokens < from {
            return Err(lost(num_tokens, from));
        }
        // A running step brings a few tokens (one per step since the last core call): those
        // are read into a buffer on the stack, more into one on the heap.
        let mut inline = [0u32; 32];
        let mut heap = Vec::new();
        let tokens = if num_tokens - from <= inline.len() {
            &mut inline[..num_tokens - from]
        } else {
            heap.resize(num_tokens - from, 0);
            &mut heap[..]
        };
        if !read_int_list_slice(all, from, tokens)? {
            // An item that is not an int: its error.
            for (token, i) in tokens.iter_mut().zip(from..) {
                *token = all.get_item(i)?.extract::<U32>()?.get();
            }
        }
        let tokens = &*tokens;
        // vLLM's hashes of the new full blocks, for a companion that takes them.
        let supplied_from = lock(&companion.get().record)
            .supplied
            .as_ref()
            .map(Vec::len);
        let new_hashes = match supplied_from {
            Some(start) => {
                let hashes = read(intern!(py, "block_hashes"))?;
                Some((start, read_supplied(&hashes, start)?))
            }
            None => None,
        };
        let mut state = lock(&self.state);
        if state.seen > num_tokens {
            return Err(lost(num_tokens, state.seen));
        }
        let new = &tokens[state.seen.saturating_sub(from)..];
        {
            let mut record = lock(&companion.get().record);
            let before = record.output.len();
            if record.output.capacity() - before < new.len() {
                // Output grows a token a step: start at 64 rather than doubling from 4.
                record.output.reserve(new.len().max(64));
            }
            record.output.extend_from_slice(new);
            let hashes_before = record.supplied.as_ref().map_or(0, Vec::len);
            if let (Some(have), Some((start, hashes))) = (&mut record.supplied, &new_hashes) {
                merge_supplied(have, *start, hashes);
            }
            if let Some((computed, in_flight)) = counts {
                if let Err(e) = record.set_progress(Some(computed), Some(in_flight)) {
                    record.output.truncate(before);
                    if let Some(have) = &mut record.supplied {
                        have.truncate(hashes_before);
                    }
                    return Err(e.into());
                }
            }
        }
        state.seen = state.seen.max(num_tokens);
        drop(state);
        Ok(companion)
    }

    /// Whether `allocate_slots(request, n, num_lookahead_tokens=k)` of a running request lies
    /// inside the slot's horizon and its counts pass the call's checks, given the request's
    /// counts (`RunningCounts::read`). False whenever anything does not hold or the counts could
    /// not be read (the full call then decides, and raises if it must).
    fn inside_horizon(&self, counts: Option<RunningCounts>, n: i128, k: i128) -> bool {
        let count = |v: i128| usize::try_from(v).ok();
        match (counts, count(n), count(k)) {
            (Some(counts), Some(n), Some(k)) => self.admits(counts, n, k),
            _ => false,
        }
    }

    /// Whether the slot's horizon admits a step of `n` tokens and `k` lookahead tokens with
    /// these counts (false with no horizon).
    #[inline(always)]
    fn admits(&self, counts: RunningCounts, n: usize, k: usize) -> bool {
        let Some(h) = lock(&self.state).horizon else {
            return false;
        };
        h.admits(counts.computed, counts.in_flight, counts.num_tokens, n, k)
    }
}

/// What of a vLLM request the entry has read: its instance dict, and its counts when they are
/// exact ints there (`RunningCounts::read`; a sync then does not read them again).
pub(crate) struct VllmFields<'a, 'py> {
    pub(crate) dict: &'a Bound<'py, PyDict>,
    pub(crate) counts: Option<RunningCounts>,
}

/// A vLLM request's counts that a running step inside its horizon reads.
#[derive(Clone, Copy)]
pub(crate) struct RunningCounts {
    computed: usize,
    in_flight: usize,
    num_tokens: usize,
}

impl RunningCounts {
    /// The counts read from the request's `__dict__` (`fields`); None when one is not there or
    /// not an exact int (list) there.
    fn read(fields: &Bound<'_, PyDict>) -> Option<Self> {
        Self::read_with(fields, |value| usize::try_from(exact_int(value)?).ok())
    }

    /// `read`, when every count is a one-digit int (below 2^30; see `small_int`).
    #[inline(always)]
    fn read_small(fields: &Bound<'_, PyDict>, layout: IntLayout) -> Option<Self> {
        Self::read_with(fields, |value| {
            // SAFETY: `value` is alive (held by the caller).
            unsafe { small_int_of(value.as_ptr(), layout) }.map(|v| v as usize)
        })
    }

    /// The counts, each read from its field by `count`.
    #[inline(always)]
    fn read_with(
        fields: &Bound<'_, PyDict>,
        count: impl Fn(&Bound<'_, PyAny>) -> Option<usize>,
    ) -> Option<Self> {
        let py = fields.py();
        let computed = count(&dict_item(fields, intern!(py, "num_computed_tokens"))?)?;
        let in_flight = count(&dict_item(fields, intern!(py, "num_in_flight_tokens"))?)?;
        let all = dict_item(fields, intern!(py, "_all_token_ids"))?;
        Some(RunningCounts {
            computed,
            in_flight,
            num_tokens: all.cast::<PyList>().ok()?.len(),
        })
    }
}

#[pymethods]
impl PyVllmSlot {
    /// The slot of a vLLM request whose companion is `request`, which has taken `seen` of its
    /// tokens; no horizon yet.
    #[new]
    fn new(request: Py<PyRequest>, seen: Count) -> Self {
        PyVllmSlot {
            companion: request,
            state: Mutex::new(SlotState {
                seen: seen.get(),
                ..SlotState::default()
            }),
        }
    }

    /// The companion `hybrid_kv.Request`.
    #[getter]
    fn request(&self, py: Python<'_>) -> Py<PyRequest> {
        self.companion.clone_ref(py)
    }

    /// Tokens of vLLM's request the companion has taken.
    #[getter]
    fn seen(&self) -> usize {
        lock(&self.state).seen
    }

    /// `(slots, cache, removal)` as `KVCacheManager.running_horizon`, or None.
    #[getter]
    fn horizon(&self) -> Option<(usize, usize, usize)> {
        lock(&self.state)
            .horizon
            .map(|h| (h.slots, h.cache, h.removal))
    }

    /// Running calls that reached the core (the others were answered inside the horizon).
    #[getter]
    fn running_calls(&self) -> u64 {
        lock(&self.state).running_calls
    }

    /// Forgets the horizon: the next running call reaches the core.
    fn drop_horizon(&self) {
        lock(&self.state).horizon = None;
    }

    /// The companion, for the cycle collector (a slot lives in its vLLM request's `__dict__`).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.companion)
    }
}

/// What the entry needs from the adapter.
struct Entry {
    /// The key of the slot in a vLLM request's `__dict__`.
    key: Py<PyAny>,
    /// The adapter's shared empty result.
    empty: Py<PyAny>,
    /// Running steps outside the horizon go to this core straight from the entry, their new
    /// blocks wrapped by calling `wrap(blocks, None, False)`; None: they go to
    /// `_allocate_slots` (the adapter has more to do, e.g. collect KV events).
    direct: Option<(Py<PyKVCacheManager>, Py<PyAny>)>,
    /// The slots of the requests that reached the entry, by the address of vLLM's request.
    slots: Mutex<SlotCache>,
}

/// The slot of a vLLM request by its address (see [`Entry::slot`]).
type SlotCache = HashMap<usize, Cached, FastHashBuilder>;

/// A slot the entry found in a vLLM request's instance dict. The request and the dict are held,
/// so that no other object takes either address while it is here.
struct Cached {
    request: Py<PyAny>,
    fields: Py<PyDict>,
    slot: Py<PyVllmSlot>,
}

impl Cached {
    /// Whether the slot is still the one in the request's instance dict `fields`, as far as
    /// can be told without looking it up there: `fields` is the dict the slot was found in,
    /// and something besides the cache holds the slot (a slot deleted from that dict, or
    /// replaced there, is held by the cache alone, unless other code kept it).
    #[inline]
    fn current(&self, fields: &Bound<'_, PyDict>) -> bool {
        // SAFETY: the slot is alive (held here), and reading its reference count is a plain
        // read of its header (`ob_refcnt`; from 3.12 on an immortal object's count there has
        // bit 31 set, and a slot is never immortal). With the GIL no other thread changes the
        // count meanwhile. On a free-threaded build the count is the sum of two fields read
        // without a lock: another thread taking or dropping a reference to this slot meanwhile
        // can make it off by those references (never by the cache's own, which cannot change
        // while the cache's lock is held), and only a call for the same request does that (the
        // slot's calls do not overlap, see `PyVllmSlot`).
        self.fields.as_ptr() == fields.as_ptr() && unsafe { ffi::Py_REFCNT(self.slot.as_ptr()) } > 1
    }
}

/// Requests whose slots [`Entry::slot`] keeps at most; past it, it starts over.
const MOST_CACHED_SLOTS: usize = 1 << 14;

impl Entry {
    /// The slot of vLLM's `request`, whose instance dict is `fields`: the cached one while it
    /// is current ([`Cached::current`]), else the one in `fields` under the key, then cached;
    /// `Err(())` when `fields` holds none (the request's cached slot, if any, is then
    /// forgotten). `Ok(None)` when the step (`counts`, `n`, `k`) lies inside the slot's horizon
    /// (with the cached slot, decided under the cache's lock: the slot is not taken).
    fn slot<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        fields: &Bound<'py, PyDict>,
        step: (Option<RunningCounts>, i128, i128),
    ) -> Result<Option<Bound<'py, PyVllmSlot>>, ()> {
        let py = request.py();
        let address = request.as_ptr() as usize;
        let (counts, n, k) = step;
        if let Some(cached) = lock(&self.slots).get(&address) {
            if cached.current(fields) {
                if cached.slot.get().inside_horizon(counts, n, k) {
                    return Ok(None);
                }
                return Ok(Some(cached.slot.bind(py).clone()));
            }
        }
        let found = fields
            .get_item(self.key.bind(py))
            .ok()
            .flatten()
            .and_then(|s| s.cast_into::<PyVllmSlot>().ok());
        let Some(slot) = found else {
            // Its slot left its dict: a slot cached for it is no longer the request's.
            self.forget(request);
            return Err(());
        };
        let entry = Cached {
            request: request.clone().unbind(),
            fields: fields.clone().unbind(),
            slot: slot.clone().unbind(),
        };
        let mut slots = lock(&self.slots);
        // Dropped once the lock is released (a drop may run Python code that calls back).
        let dropped = (slots.len() >= MOST_CACHED_SLOTS).then(|| std::mem::take(&mut *slots));
        let replaced = slots.insert(address, entry);
        drop(slots);
        drop((dropped, replaced));
        if slot.get().inside_horizon(counts, n, k) {
            return Ok(None);
        }
        Ok(Some(slot))
    }

    /// Forgets the slot of vLLM's `request` (its slot left its dict).
    fn forget(&self, request: &Bound<'_, PyAny>) {
        let removed = lock(&self.slots).remove(&(request.as_ptr() as usize));
        drop(removed);
    }
}

/// The instance dict of `object` (as `object.__dict__` for an object of a class defined in
/// Python, without looking the attribute up on its type), or None if it has none.
#[inline]
fn instance_dict<'py>(object: &Bound<'py, PyAny>) -> Option<Bound<'py, PyDict>> {
    let py = object.py();
    // SAFETY: `object` is a live object (borrowed for 'py); PyObject_GenericGetDict returns a
    // new reference, or null with an exception set (no instance dict), which is cleared here.
    // It reads no Python attribute. An object that has no dict yet gets one, kept as its
    // `__dict__` from then on: empty, or from 3.11 on made from the attribute values CPython
    // keeps without a dict (3.13's dict shares them with the object). Making it may start a
    // collection (3.10 and 3.11 run it at once, finalizers included; 3.12 and 3.13 defer it to
    // the interpreter's next check): no caller holds a lock of this module meanwhile.
    let dict = unsafe {
        Bound::from_owned_ptr_or_opt(
            py,
            ffi::PyObject_GenericGetDict(object.as_ptr(), std::ptr::null_mut()),
        )
    };
    match dict {
        Some(dict) => dict.cast_into::<PyDict>().ok(),
        None => {
            drop(PyErr::take(py));
            None
        }
    }
}

/// Base class of `hybrid_kv.vllm`'s manager: its `allocate_slots`.
#[pyclass(frozen, subclass, name = "_RunningSteps", module = "hybrid_kv._core")]
pub(crate) struct PyRunningSteps {
    entry: OnceLock<Entry>,
    /// How a new request's companion is made (`_companion_params`).
    companions: OnceLock<CompanionParams>,
}

/// The adapter's hashing options for a new request's companion.
struct CompanionParams {
    block_size: u64,
    hash_algo: Py<PyString>,
    hash_seed: Py<PyString>,
    lookahead: usize,
    /// Whether vLLM's block hashes may be taken (a SHA-256 option, prefix caching on).
    supply: bool,
}

/// An exact Python int within i64 (no `__index__` call, so no Python code runs), widened so
/// that sums cannot overflow; `None` otherwise.
fn exact_int(value: &Bound<'_, PyAny>) -> Option<i128> {
    if let Some(small) = small_exact_int(value) {
        return Some(i128::from(small));
    }
    value
        .cast_exact::<PyInt>()
        .ok()?
        .extract::<i64>()
        .ok()
        .map(i128::from)
}

impl PyRunningSteps {
    /// The running step `allocate_slots(request, n, num_lookahead_tokens=k)` when the entry
    /// answers it: `Some(result)` inside the horizon, or from the core when the adapter lets
    /// the entry call it. `None` when `n` and `k` are not exact ints with `n > 0 <= k`, the
    /// request has no slot, or the step is outside and must go to `_allocate_slots`.
    fn running_step(
        &self,
        request: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let py = request.py();
        let Some(entry) = self.entry.get() else {
            return Ok(None);
        };
        let (Some(n), Some(k)) = (
            exact_int(num_new_tokens),
            num_lookahead_tokens.map_or(Some(0), exact_int),
        ) else {
            return Ok(None);
        };
        if n <= 0 || k < 0 {
            return Ok(None);
        }
        let Some(fields) = instance_dict(request) else {
            return Ok(None);
        };
        let counts = RunningCounts::read(&fields);
        let slot = match entry.slot(request, &fields, (counts, n, k)) {
            Err(()) => return Ok(None),
            Ok(None) => return Ok(Some(entry.empty.clone_ref(py))),
            Ok(Some(slot)) => slot,
        };
        let Some((core, wrap)) = &entry.direct else {
            return Ok(None);
        };
        let core = core.bind(py).get();
        // Both fit: exact ints within i64, positive.
        let count = |v: i128| UInt(v as u64);
        let new = core.allocate_running_with(
            py,
            request,
            Some(&VllmFields {
                dict: &fields,
                counts,
            }),
            &slot,
            count(n),
            count(k),
            NewIds::new,
        )?;
        Ok(Some(match new {
            None => py.None(),
            Some(None) => entry.empty.clone_ref(py),
            Some(Some(ids)) => Py::new(
                py,
                PyRunningBlocks {
                    ids,
                    manager_id: core.id(),
                    wrap: wrap.clone_ref(py),
                    wrapped: OnceLock::new(),
                },
            )?
            .into_any(),
        }))
    }
}

/// Words a running step's new blocks keep inline.
const INLINE_WORDS: usize = 31;

/// The new blocks of a running step, every group's in one buffer: `[groups, end of group 0,
/// ..., end of the last group, ids...]`, the ends counted from the buffer's start. A running
/// step takes a block or two per group: its blocks then fit inline, and the result that holds
/// them needs no allocation of its own (a step that reaches the core takes new blocks in every
/// group at once, and one allocation per group was a tenth of its time).
pub(crate) struct NewIds(Words);

enum Words {
    Inline {
        len: u8,
        words: [BlockId; INLINE_WORDS],
    },
    Heap(Box<[BlockId]>),
}

impl NewIds {
    /// Packs `groups` (the ends fit a block id: a request holds fewer blocks than the pool has
    /// ids).
    pub(crate) fn new(groups: &[Vec<BlockId>]) -> Self {
        let len = 1 + groups.len() + groups.iter().map(Vec::len).sum::<usize>();
        let fill = |words: &mut [BlockId]| {
            words[0] = groups.len() as BlockId;
            let mut end = 1 + groups.len();
            for (g, ids) in groups.iter().enumerate() {
                words[end..end + ids.len()].copy_from_slice(ids);
                end += ids.len();
                words[1 + g] = end as BlockId;
            }
        };
        NewIds(if len <= INLINE_WORDS {
            let mut words = [0; INLINE_WORDS];
            fill(&mut words[..len]);
            Words::Inline {
                len: len as u8,
                words,
            }
        } else {
            let mut words = vec![0; len].into_boxed_slice();
            fill(&mut words);
            Words::Heap(words)
        })
    }

    fn words(&self) -> &[BlockId] {
        match &self.0 {
            Words::Inline { len, words } => &words[..usize::from(*len)],
            Words::Heap(words) => words,
        }
    }

    /// Each group's ids, in group order.
    pub(crate) fn groups(&self) -> impl ExactSizeIterator<Item = &[BlockId]> + Clone + '_ {
        let words = self.words();
        let n = words[0] as usize;
        (0..n).map(move |g| {
            let start = if g == 0 { 1 + n } else { words[g] as usize };
            &words[start..words[1 + g] as usize]
        })
    }
}

/// The new blocks of a running step that reached the core from the entry: vLLM's scheduler
/// reads them with `get_block_ids`, answered here from the ids; anything else is the adapter's
/// `KVCacheBlocks` over the same blocks (made on first use).
#[pyclass(frozen, name = "_RunningBlocks", module = "hybrid_kv._core")]
pub(crate) struct PyRunningBlocks {
    ids: NewIds,
    /// The manager that allocated them.
    manager_id: u64,
    /// The adapter's wrapper: `wrap(blocks, None, False)`.
    wrap: Py<PyAny>,
    wrapped: OnceLock<Py<PyAny>>,
}

impl PyRunningBlocks {
    fn wrapped<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyAny>> {
        if let Some(wrapped) = self.wrapped.get() {
            return Ok(wrapped.bind(py));
        }
        let groups = self.ids.groups().map(<[BlockId]>::to_vec).collect();
        let blocks = Py::new(py, PyKVCacheBlocks::new_blocks(groups, self.manager_id))?;
        let made = self.wrap.bind(py).call1((blocks, py.None(), false))?;
        Ok(self.wrapped.get_or_init(|| made.unbind()).bind(py))
    }
}

#[pymethods]
impl PyRunningBlocks {
    /// vLLM's `KVCacheBlocks.get_block_ids`: block ids per group as lists; None if empty and
    /// `allow_none` (never: a running step's result that took no block is the empty result).
    /// (The class's `get_block_ids` is a direct entry, `running_block_ids`, which answers the
    /// scheduler's reads and passes every other call on to this method.)
    #[pyo3(signature = (allow_none = false, *, group_ids = None))]
    fn _get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        match group_ids {
            None => Ok(id_lists(py, self.ids.groups(), allow_none)?.map(Bound::into_any)),
            Some(groups) => {
                let kwargs = PyDict::new(py);
                kwargs.set_item(intern!(py, "group_ids"), groups)?;
                let ids = self.wrapped(py)?.call_method(
                    intern!(py, "get_block_ids"),
                    (allow_none,),
                    Some(&kwargs),
                )?;
                Ok((!ids.is_none()).then_some(ids))
            }
        }
    }

    fn __add__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.wrapped(py)?
            .call_method1(intern!(py, "__add__"), (other,))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.wrapped(py)?.repr()?.to_string())
    }

    /// Equal to the adapter's blocks holding the same block ids per group (and unhashable):
    /// the adapter's `KVCacheBlocks.__eq__`, as vLLM's compare.
    fn __eq__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.wrapped(py)?
            .call_method1(intern!(py, "__eq__"), (other,))
    }

    /// Pickles as the adapter's `KVCacheBlocks` over the same block ids.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.wrapped(py)?.call_method0(intern!(py, "__reduce__"))
    }

    /// `wrap` and what it made, for the cycle collector: a wrap referring to an object that
    /// keeps these blocks (a method bound to an adapter holding its last result, say) makes a
    /// cycle through them. There is no `__clear__` (`wrapped` is set once, without a lock): the
    /// object keeping the blocks (an instance, a dict, a list) is cleared instead.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.wrap)?;
        if let Some(wrapped) = self.wrapped.get() {
            visit.call(wrapped)?;
        }
        Ok(())
    }

    /// Every other attribute is the adapter's `KVCacheBlocks`'.
    fn __getattr__<'py>(
        &self,
        py: Python<'py>,
        name: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.wrapped(py)?.getattr(name)
    }
}

/// `allocate_slots`' parameters after `num_new_tokens`, in vLLM's order.
const PARAMETERS: [&str; 10] = [
    "num_new_computed_tokens",
    "new_computed_blocks",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "delay_cache_blocks",
    "num_encoder_tokens",
    "full_sequence_must_fit",
    "reserved_blocks",
    "has_scheduled_reqs",
    "skip_zeroing_group_ids",
];

/// Where `num_lookahead_tokens` is in [`PARAMETERS`].
const LOOKAHEAD: usize = 2;
const _: () = assert!(matches!(
    PARAMETERS[LOOKAHEAD].as_bytes(),
    b"num_lookahead_tokens"
));

#[pymethods]
impl PyRunningSteps {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        PyRunningSteps {
            entry: OnceLock::new(),
            companions: OnceLock::new(),
        }
    }

    /// Sets the slot key, the empty result and, with `core` and `wrap`, the core that running
    /// steps outside the horizon go to straight from the entry and the wrapper of their new
    /// blocks (once; later calls change nothing).
    #[pyo3(signature = (key, empty, core = None, wrap = None))]
    fn _running_steps(
        &self,
        key: Py<PyAny>,
        empty: Py<PyAny>,
        core: Option<Py<PyKVCacheManager>>,
        wrap: Option<Py<PyAny>>,
    ) {
        let direct = core.zip(wrap);
        let _ = self.entry.set(Entry {
            key,
            empty,
            direct,
            slots: Mutex::new(SlotCache::default()),
        });
    }

    /// Sets how `_new_companion` makes a request's companion (once; later calls change
    /// nothing): the hash block size, the core's hash algorithm and seed, vLLM's lookahead
    /// tokens, and whether vLLM's block hashes may be taken. A block size of 0 is an
    /// `OutOfRangeError` (no request's blocks could be counted).
    fn _companion_params(
        &self,
        block_size: Count,
        hash_algo: Py<PyString>,
        hash_seed: Py<PyString>,
        lookahead: Count,
        supply: bool,
    ) -> PyResult<()> {
        if block_size.0 == 0 {
            return Err(OutOfRangeError::new_err(
                "block_size must be at least 1, got 0",
            ));
        }
        let _ = self.companions.set(CompanionParams {
            block_size: block_size.0,
            hash_algo,
            hash_seed,
            lookahead: lookahead.get(),
            supply,
        });
        Ok(())
    }

    /// The adapter's `_companion` for a vLLM request that has no slot yet and nothing a plain
    /// prompt lacks (no LoRA, multimodal inputs or prompt embeddings; every field where vLLM's
    /// `Request` keeps it, of its type): its companion made, with vLLM's block hashes when they
    /// cover exactly its hashable blocks, its slot put in its `__dict__`, and anything past
    /// its prompt taken. None, with nothing changed, for any other request (the adapter then
    /// makes it in Python). The companion's own errors (e.g. a token id out of range) are
    /// raised as `hybrid_kv.Request` raises them, before the slot is put in the dict.
    fn _new_companion<'py>(
        &self,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyRequest>>> {
        let py = request.py();
        let (Some(entry), Some(params)) = (self.entry.get(), self.companions.get()) else {
            return Ok(None);
        };
        let Some(fields) = instance_dict(request) else {
            return Ok(None);
        };
        match entry.key.bind(py).cast::<PyString>() {
            Ok(key) if dict_item(&fields, key).is_none() => {}
            _ => return Ok(None),
        }
        let field = |name: &Bound<'py, PyString>| dict_item(&fields, name);
        let is_none = |name| field(name).is_some_and(|v| v.is_none());
        let empty_list = |name| {
            field(name).is_some_and(|v| v.cast_exact::<PyList>().is_ok_and(|l| l.is_empty()))
        };
        if !(is_none(intern!(py, "lora_request"))
            && is_none(intern!(py, "prompt_embeds"))
            && empty_list(intern!(py, "mm_features")))
        {
            return Ok(None);
        }
        let (Some(tokens), Some(all), Some(num_prompt), Some(request_id), Some(salt)) = (
            field(intern!(py, "prompt_token_ids")).filter(|t| t.cast::<PyList>().is_ok()),
            field(intern!(py, "_all_token_ids")).and_then(|a| a.cast_into::<PyList>().ok()),
            field(intern!(py, "num_prompt_tokens"))
                .and_then(|n| exact_int(&n))
                .and_then(|n| usize::try_from(n).ok()),
            field(intern!(py, "request_id")).and_then(|id| id.extract::<Text>().ok()),
            field(intern!(py, "cache_salt")).and_then(|salt| {
                if salt.is_none() {
                    Some(None)
                } else {
                    salt.extract::<Text>().ok().map(Some)
                }
            }),
        ) else {
            return Ok(None);
        };
        let Some(skip) = field(intern!(py, "skip_reading_prefix_cache"))
            .and_then(|v| v.cast_exact::<PyBool>().ok().map(|b| b.is_true()))
        else {
            return Ok(None);
        };
        // vLLM's hashes when they cover exactly the blocks hashable so far (as the adapter's
        // `_supplied_hashes`); none: the companion hashes its prompt itself.
        let hashes = if params.supply {
            let Some(hasher) = field(intern!(py, "_block_hasher")) else {
                return Ok(None);
            };
            let hashable = all.len().saturating_sub(params.lookahead) as u64 / params.block_size;
            match field(intern!(py, "block_hashes")) {
                None => return Ok(None),
                Some(hashes) => (!hasher.is_none()
                    && hashes
                        .cast::<PyList>()
                        .is_ok_and(|list| list.len() as u64 == hashable))
                .then_some(hashes),
            }
        } else {
            None
        };
        let companion = PyRequest::new(
            request_id,
            &tokens,
            salt,
            None,
            None,
            UInt(params.block_size),
            params.hash_algo.bind(py).extract::<Text>()?,
            params.hash_seed.bind(py).extract::<Text>()?,
            None,
            hashes.as_ref(),
        )?;
        if skip {
            companion.set_skip_reading_prefix_cache(true);
        }
        let companion = Bound::new(py, companion)?;
        let slot = Bound::new(
            py,
            PyVllmSlot::new(companion.clone().unbind(), UInt(num_prompt as u64)),
        )?;
        fields.set_item(entry.key.bind(py), &slot)?;
        if all.len() != num_prompt {
            slot.get().sync(request, None, false)?;
        }
        Ok(Some(companion))
    }

    /// Forgets the slot of vLLM's `request` (removed from its dict).
    fn _forget_slot(&self, request: &Bound<'_, PyAny>) {
        if let Some(entry) = self.entry.get() {
            entry.forget(request);
        }
    }

    /// The entry's references, for the cycle collector: a cycle through them and an object the
    /// collector can clear (a `_CallTimer`, an instance dict, the cache of slots) is collected.
    /// `__clear__` empties only the cache of slots: the rest of the entry is read on every
    /// `allocate_slots` without a lock, and clearing it would need one (measured at about 4% of
    /// `allocate_slots` in vLLM's scheduler). The adapter's entry holds the core manager, its
    /// empty result, the `KVCacheBlocks` class and a string, none of which refers back to the
    /// adapter; the cache holds vLLM's requests, their dicts and their slots.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(entry) = self.entry.get() {
            visit.call(&entry.key)?;
            visit.call(&entry.empty)?;
            if let Some((core, wrap)) = &entry.direct {
                visit.call(core)?;
                visit.call(wrap)?;
            }
            // Never held while Python code runs; held by another thread, its entries go
            // unvisited this time (a missed reference can only keep a cycle alive longer).
            if let Ok(slots) = entry.slots.try_lock() {
                for cached in slots.values() {
                    visit.call(&cached.request)?;
                    visit.call(&cached.fields)?;
                    visit.call(&cached.slot)?;
                }
            }
        }
        Ok(())
    }

    /// Empties the cache of slots (the cycle collector breaking a cycle through it; the cache
    /// is refilled from the requests' dicts).
    fn __clear__(&self) {
        if let Some(entry) = self.entry.get() {
            // As in `__traverse__`: never waits.
            let cached = entry.slots.try_lock().map(|mut s| std::mem::take(&mut *s));
            drop(cached);
        }
    }

    /// vLLM's `allocate_slots`: a running step (`num_lookahead_tokens` the only other argument
    /// given) inside its horizon returns the empty result here, one outside it goes to the core
    /// from here when the adapter set one; every other call is the adapter's `_allocate_slots`
    /// with the arguments given (by name after `num_new_tokens`; one given as None counts as
    /// not given, as Python's defaults are for the scheduler's calls).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        request,
        num_new_tokens,
        num_new_computed_tokens = None,
        new_computed_blocks = None,
        num_lookahead_tokens = None,
        num_external_computed_tokens = None,
        delay_cache_blocks = None,
        num_encoder_tokens = None,
        full_sequence_must_fit = None,
        reserved_blocks = None,
        has_scheduled_reqs = None,
        skip_zeroing_group_ids = None,
    ))]
    fn allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_new_computed_tokens: Option<Bound<'py, PyAny>>,
        new_computed_blocks: Option<Bound<'py, PyAny>>,
        num_lookahead_tokens: Option<Bound<'py, PyAny>>,
        num_external_computed_tokens: Option<Bound<'py, PyAny>>,
        delay_cache_blocks: Option<Bound<'py, PyAny>>,
        num_encoder_tokens: Option<Bound<'py, PyAny>>,
        full_sequence_must_fit: Option<Bound<'py, PyAny>>,
        reserved_blocks: Option<Bound<'py, PyAny>>,
        has_scheduled_reqs: Option<Bound<'py, PyAny>>,
        skip_zeroing_group_ids: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let given = [
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        ];
        let lookahead = given[LOOKAHEAD].as_ref();
        let only_lookahead = given
            .iter()
            .enumerate()
            .all(|(i, value)| i == LOOKAHEAD || value.is_none());
        if only_lookahead {
            if let Some(result) = slf.get().running_step(request, num_new_tokens, lookahead)? {
                return Ok(result);
            }
        }
        full_call(
            slf,
            request,
            num_new_tokens,
            parameter_names(py).iter().zip(given),
        )
    }
}

/// [`PARAMETERS`] as interned Python strings, made once: the keyword arguments an admission
/// passes on are set with them (a name made from the Rust text on each call was decoded,
/// allocated and compared by value).
fn parameter_names(py: Python<'_>) -> &[Py<PyString>; PARAMETERS.len()] {
    static NAMES: PyOnceLock<[Py<PyString>; PARAMETERS.len()]> = PyOnceLock::new();
    NAMES.get_or_init(py, || {
        PARAMETERS.map(|name| PyString::intern(py, name).unbind())
    })
}

/// The adapter's `_allocate_slots(request, num_new_tokens, **given)`, the arguments given as
/// None left out (as not given).
fn full_call<'py>(
    slf: &Bound<'py, PyRunningSteps>,
    request: &Bound<'py, PyAny>,
    num_new_tokens: &Bound<'py, PyAny>,
    given: impl IntoIterator<Item = (&'py Py<PyString>, Option<Bound<'py, PyAny>>)>,
) -> PyResult<Py<PyAny>> {
    let py = slf.py();
    let kwargs = PyDict::new(py);
    for (name, value) in given {
        if let Some(value) = value {
            kwargs.set_item(name.bind(py), value)?;
        }
    }
    slf.call_method(
        intern!(py, "_allocate_slots"),
        (request, num_new_tokens),
        Some(&kwargs),
    )
    .map(Bound::unbind)
}

/// `allocate_slots` as a method descriptor whose function CPython calls directly
/// (`METH_FASTCALL | METH_KEYWORDS`): the scheduler's running step, `allocate_slots(request, n,
/// num_lookahead_tokens=k)`, is recognized from the argument count and the one keyword's name
/// and goes to `PyRunningSteps::running_step` without the generic argument parsing; every other
/// call (or one that step does not answer) is passed on, arguments unchanged, to
/// `_RunningSteps.allocate_slots`. `hybrid_kv.vllm`'s manager class puts it in its body.
///
/// The scheduler makes this call for every running request on every step, between stretches of
/// its own Python code: what the call costs there is mostly the instructions and branches it
/// runs cold, so the path is kept short.
#[pyfunction]
fn _running_steps_entry(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    descriptor(&py.get_type::<PyRunningSteps>(), &ENTRY)
}

/// `get_block_ids` of `hybrid_kv.vllm`'s shared empty result, as a method descriptor of `cls`
/// (its class, whose instances are all empty) whose function CPython calls directly: the
/// scheduler's read of a running request's new blocks, `get_block_ids(allow_none=True)`, is
/// None here; every other call is passed on, arguments unchanged, to the instance's
/// `_get_block_ids`.
#[pyfunction]
fn _empty_block_ids_entry<'py>(cls: &Bound<'py, PyType>) -> PyResult<Bound<'py, PyAny>> {
    descriptor(cls, &EMPTY_IDS)
}

/// A method descriptor of `cls` for `def`.
fn descriptor<'py>(
    cls: &Bound<'py, PyType>,
    def: &'static EntryDef,
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `def` is a static CPython only reads, `cls` a live type object; the call returns
    // a new reference or null with an exception set, which `from_owned_ptr_or_err` takes over.
    unsafe {
        let descr = ffi::PyDescr_NewMethod(
            cls.as_ptr().cast::<ffi::PyTypeObject>(),
            std::ptr::addr_of!(def.0).cast_mut(),
        );
        Bound::from_owned_ptr_or_err(cls.py(), descr)
    }
}

/// The method definition behind a direct entry's descriptor (or function).
pub(crate) struct EntryDef(pub(crate) ffi::PyMethodDef);

// SAFETY: the definition is never written after it is made; CPython only reads it (its name,
// flags and function pointer), from any thread.
unsafe impl Sync for EntryDef {}

impl EntryDef {
    /// The definition of a `METH_FASTCALL | METH_KEYWORDS` method `name` calling `function`,
    /// documented by `doc` (its first line the signature, as CPython's `__text_signature__`
    /// reads it).
    pub(crate) const fn fast(
        name: &'static std::ffi::CStr,
        function: ffi::PyCFunctionFastWithKeywords,
        doc: &'static std::ffi::CStr,
    ) -> Self {
        EntryDef(ffi::PyMethodDef {
            ml_name: name.as_ptr(),
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunctionFastWithKeywords: function,
            },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: doc.as_ptr(),
        })
    }
}

// The signature line is `_RunningSteps.allocate_slots`' (tests compare them).
static ENTRY: EntryDef = EntryDef::fast(
    c"allocate_slots",
    allocate_slots_entry,
    c"allocate_slots($self, request, num_new_tokens, num_new_computed_tokens=None, \
new_computed_blocks=None, num_lookahead_tokens=None, num_external_computed_tokens=None, \
delay_cache_blocks=None, num_encoder_tokens=None, full_sequence_must_fit=None, \
reserved_blocks=None, has_scheduled_reqs=None, skip_zeroing_group_ids=None)\n--\n\n\
vLLM's `allocate_slots`: the running step `allocate_slots(request, n, num_lookahead_tokens=k)` \
is answered here; every other call is `_RunningSteps.allocate_slots`' with the same arguments.",
);

static EMPTY_IDS: EntryDef = EntryDef::fast(
    c"get_block_ids",
    empty_block_ids_entry,
    c"get_block_ids($self, allow_none=False, *, group_ids=None)\n--\n\n\
Block ids per group as lists (all empty); None with allow_none.",
);

/// Defines `$entry`, the C function of a direct entry's method descriptor
/// (`METH_FASTCALL | METH_KEYWORDS`: `slf` an instance of the descriptor's class, which CPython
/// checks before calling; `args` the `nargs` positional arguments followed by one value per name
/// in `kwnames`, null when there are none), as `$body` under `trampoline`: the body returns a
/// new reference, or null with an exception set, or an error, which is raised.
macro_rules! direct_entry {
    ($entry:ident, $body:ident) => {
        unsafe extern "C" fn $entry(
            slf: *mut ffi::PyObject,
            args: *const *mut ffi::PyObject,
            nargs: ffi::Py_ssize_t,
            kwnames: *mut ffi::PyObject,
        ) -> *mut ffi::PyObject {
            // SAFETY: CPython calls a method's function with the calling thread attached to
            // the interpreter (holding the GIL where there is one), and keeps `slf`, `kwnames`
            // and the `nargs + len(kwnames)` argument pointers alive for the call: the body's
            // contract.
            unsafe {
                trampoline(|py| {
                    $body(
                        py,
                        FastCall {
                            slf,
                            args,
                            nargs,
                            kwnames,
                        },
                    )
                })
            }
        }
    };
}

pub(crate) use direct_entry;

static RUNNING_IDS: EntryDef = EntryDef::fast(
    c"get_block_ids",
    running_block_ids_entry,
    c"get_block_ids($self, allow_none=False, *, group_ids=None)\n--\n\n\
vLLM's `KVCacheBlocks.get_block_ids`: block ids per group as lists; None if empty and allow_none \
(never: a running step's result that took no block is the empty result).",
);

direct_entry!(empty_block_ids_entry, empty_block_ids);
direct_entry!(running_block_ids_entry, running_block_ids);
direct_entry!(allocate_slots_entry, allocate_slots_call);

/// The arguments CPython passes a `METH_FASTCALL | METH_KEYWORDS` function (see
/// `direct_entry!`).
#[derive(Clone, Copy)]
pub(crate) struct FastCall {
    pub(crate) slf: *mut ffi::PyObject,
    pub(crate) args: *const *mut ffi::PyObject,
    pub(crate) nargs: ffi::Py_ssize_t,
    pub(crate) kwnames: *mut ffi::PyObject,
}

impl FastCall {
    /// How many keyword arguments the call got.
    ///
    /// # Safety
    /// The pointers are the live arguments CPython passed (`kwnames` null or a tuple).
    unsafe fn num_keywords(&self) -> usize {
        if self.kwnames.is_null() {
            0
        } else {
            // SAFETY: per the contract, a live tuple.
            unsafe { ffi::PyTuple_GET_SIZE(self.kwnames) as usize }
        }
    }

    /// The values: `nargs` positional ones, then one per keyword name.
    ///
    /// # Safety
    /// As for `num_keywords`; the slice lives no longer than the call.
    unsafe fn values<'a>(&self) -> &'a [*mut ffi::PyObject] {
        // SAFETY: per the contract, `args` holds that many live pointers.
        unsafe {
            let len = self.nargs as usize + self.num_keywords();
            if len == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(self.args, len)
            }
        }
    }

    /// `slf` followed by the values: the argument array of a vectorcall of the same call on
    /// another callable (`1 + nargs` positional values, `kwnames` unchanged).
    ///
    /// # Safety
    /// As for `values`.
    unsafe fn with_receiver(&self) -> Vec<*mut ffi::PyObject> {
        // SAFETY: per the contract.
        let values = unsafe { self.values() };
        let mut vector = Vec::with_capacity(values.len() + 1);
        vector.push(self.slf);
        vector.extend_from_slice(values);
        vector
    }
}

/// Runs a direct entry's body with the thread's `Python` token: its result, or null with its
/// error raised; a panic is caught before it could unwind into CPython and raised as an error.
///
/// # Safety
/// The calling thread is attached to the interpreter.
pub(crate) unsafe fn trampoline(
    body: impl FnOnce(Python<'_>) -> PyResult<*mut ffi::PyObject>,
) -> *mut ffi::PyObject {
    // SAFETY: per the contract.
    let py = unsafe { Python::assume_attached() };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(py))) {
        Ok(Ok(result)) => result,
        Ok(Err(error)) => {
            error.restore(py);
            std::ptr::null_mut()
        }
        Err(_) => {
            pyo3::panic::PanicException::new_err("a hybrid_kv direct entry panicked").restore(py);
            std::ptr::null_mut()
        }
    }
}

/// `get_block_ids` of an instance of the class `_empty_block_ids_entry` was made for.
///
/// # Safety
/// As `direct_entry!` states: the thread is attached and every pointer is alive for the call.
unsafe fn empty_block_ids(py: Python<'_>, call: FastCall) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: per the contract. Only identities are compared here (no Python code runs)
    // before the call is passed on.
    unsafe {
        let allow_none = match (call.nargs, call.num_keywords()) {
            // get_block_ids(True)
            (1, 0) => Some(*call.args),
            // get_block_ids(allow_none=True), the keyword name being the interned constant.
            (0, 1)
                if ffi::PyTuple_GET_ITEM(call.kwnames, 0) == intern!(py, "allow_none").as_ptr() =>
            {
                Some(*call.args)
            }
            _ => None,
        };
        if allow_none == Some(ffi::Py_True()) {
            return Ok(ffi::Py_NewRef(ffi::Py_None()));
        }
        Ok(forward(call, intern!(py, "_get_block_ids")))
    }
}

/// `get_block_ids` of a running step's new blocks (`_RunningBlocks`): the scheduler's read,
/// `get_block_ids()`, `get_block_ids(b)` or `get_block_ids(allow_none=b)` with `b` a bool (the
/// keyword name being the interned constant), builds the lists here; every other call is
/// passed on, arguments unchanged, to `_get_block_ids`.
///
/// # Safety
/// As `direct_entry!` states: the thread is attached and every pointer is alive for the call.
unsafe fn running_block_ids(py: Python<'_>, call: FastCall) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: per the contract; only identities are compared before the call is answered or
    // passed on. `slf` is an instance of `_RunningBlocks`: CPython checks a method
    // descriptor's receiver against the class it was made for (`register`) before calling.
    unsafe {
        let flag = match (call.nargs, call.num_keywords()) {
            (0, 0) => Some(ffi::Py_False()),
            (1, 0) => Some(*call.args),
            (0, 1)
                if ffi::PyTuple_GET_ITEM(call.kwnames, 0) == intern!(py, "allow_none").as_ptr() =>
            {
                Some(*call.args)
            }
            _ => None,
        };
        let allow_none = match flag {
            Some(flag) if flag == ffi::Py_True() => true,
            Some(flag) if flag == ffi::Py_False() => false,
            _ => return Ok(forward(call, intern!(py, "_get_block_ids"))),
        };
        let blocks = pyo3::Borrowed::from_ptr(py, call.slf).cast_unchecked::<PyRunningBlocks>();
        Ok(match id_lists(py, blocks.get().ids.groups(), allow_none)? {
            Some(lists) => lists.into_ptr(),
            None => ffi::Py_NewRef(ffi::Py_None()),
        })
    }
}

/// `slf.<name>(*args, **kwargs)` with the arguments CPython passed a direct entry: the new
/// reference it returns, or null with an exception set.
///
/// # Safety
/// The thread is attached, and the pointers are the live arguments of a METH_FASTCALL |
/// METH_KEYWORDS call, as CPython passes them.
unsafe fn forward(call: FastCall, name: &Bound<'_, PyString>) -> *mut ffi::PyObject {
    // SAFETY: per the contract: the array holds `slf` and the call's values, alive for the
    // call; `PyObject_VectorcallMethod` takes the method's name and the receiver from its first
    // slot and returns a new reference or null with an exception set.
    unsafe {
        let vector = call.with_receiver();
        ffi::PyObject_VectorcallMethod(
            name.as_ptr(),
            vector.as_ptr(),
            call.nargs as usize + 1,
            call.kwnames,
        )
    }
}

/// `allocate_slots` of a `_RunningSteps` instance.
///
/// # Safety
/// As `direct_entry!` states: the thread is attached and every pointer is alive for the call.
unsafe fn allocate_slots_call(py: Python<'_>, call: FastCall) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: per the contract.
    if let Some(empty) = unsafe { step_inside_cached(py, &call) } {
        return Ok(empty);
    }
    // SAFETY: per the contract.
    unsafe { allocate_slots_rest(py, call) }
}

/// The scheduler's running step, `allocate_slots(request, n)` or `allocate_slots(request, n,
/// num_lookahead_tokens=k)`, of a request whose slot is cached and current, inside the slot's
/// horizon, with every count a one-digit int (every count below 2^30): the shared empty result
/// (a new reference), decided with as little code as decides it. None for anything else, with
/// nothing changed and no error set: `allocate_slots_rest` then decides the call as it would
/// have.
///
/// Most of the scheduler's calls are such steps, each made between stretches of the
/// scheduler's Python, which leave little of this module's code in the instruction cache: the
/// path is kept short and straight, the rest of the entry out of line.
///
/// # Safety
/// As `direct_entry!` states: the thread is attached and every pointer is alive for the call.
#[inline(always)]
unsafe fn step_inside_cached(py: Python<'_>, call: &FastCall) -> Option<*mut ffi::PyObject> {
    if call.nargs != 2 {
        return None;
    }
    let layout = int_layout(py)?;
    // SAFETY: per the contract, `args` holds `nargs` live positional values, then one per name
    // in `kwnames` (null or a live tuple), and `slf` is an instance of the class the
    // descriptor was made for (`_running_steps_entry`: `_RunningSteps`), which CPython checks
    // before it calls the descriptor's function. The values are only read (`small_int_of`).
    let (steps, request, n, k) = unsafe {
        let k = if call.kwnames.is_null() {
            0
        } else if ffi::PyTuple_GET_SIZE(call.kwnames) == 1
            && ffi::PyTuple_GET_ITEM(call.kwnames, 0)
                == intern!(py, "num_lookahead_tokens").as_ptr()
        {
            small_int_of(*call.args.add(2), layout)?
        } else {
            return None;
        };
        let steps = pyo3::Borrowed::from_ptr(py, call.slf).cast_unchecked::<PyRunningSteps>();
        (
            steps,
            pyo3::Borrowed::from_ptr(py, *call.args),
            small_int_of(*call.args.add(1), layout)?,
            k,
        )
    };
    let entry = steps.get().entry.get()?;
    if n == 0 {
        return None;
    }
    let fields = instance_dict(&request)?;
    let counts = RunningCounts::read_small(&fields, layout)?;
    let slots = lock(&entry.slots);
    let cached = slots.get(&(request.as_ptr() as usize))?;
    let inside =
        cached.current(&fields) && cached.slot.get().admits(counts, n as usize, k as usize);
    drop(slots);
    inside.then(|| entry.empty.clone_ref(py).into_ptr())
}

/// `dict[key]` when it is there: a new reference; None when it is not or the lookup raised
/// (the error cleared: the caller's fallback looks again and raises it).
#[inline(always)]
fn dict_item<'py>(
    dict: &Bound<'py, PyDict>,
    key: &Bound<'py, PyString>,
) -> Option<Bound<'py, PyAny>> {
    let mut value = std::ptr::null_mut();
    // SAFETY: both are live; PyDict_GetItemRef stores a new reference (or null) in `value` and
    // returns 1 when found, 0 when not, -1 with an exception set. The lookup runs Python code
    // only if the dict holds a key of another type whose hash equals the str's and whose
    // `__eq__` is Python's (a str key's hash is cached; comparing strs calls nothing): no
    // caller holds a lock of this module while it runs, and what the caller uses it holds.
    unsafe {
        match ffi::compat::PyDict_GetItemRef(dict.as_ptr(), key.as_ptr(), &mut value) {
            1 => Some(Bound::from_owned_ptr(dict.py(), value)),
            0 => None,
            _ => {
                ffi::PyErr_Clear();
                None
            }
        }
    }
}

/// `allocate_slots` of a `_RunningSteps` instance, for every call `step_inside_cached` does not
/// answer.
///
/// # Safety
/// As `direct_entry!` states: the thread is attached and every pointer is alive for the call.
#[cold]
#[inline(never)]
unsafe fn allocate_slots_rest(py: Python<'_>, call: FastCall) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: per the contract, every pointer is a live object for the call (`kwnames` a
    // tuple or null).
    let (slf, argv, num_keywords, kwnames) = unsafe {
        (
            pyo3::Borrowed::from_ptr(py, call.slf),
            call.values(),
            call.num_keywords(),
            pyo3::Borrowed::from_ptr_or_opt(py, call.kwnames),
        )
    };
    if call.nargs == 2 {
        // SAFETY: the first two are the positional arguments, alive for the call.
        let request = unsafe { pyo3::Borrowed::from_ptr(py, argv[0]) };
        let num_new_tokens = unsafe { pyo3::Borrowed::from_ptr(py, argv[1]) };
        let lookahead = match (&kwnames, argv.get(2)) {
            (None, _) => Some(None),
            // SAFETY: a one-name tuple's item 0 is alive while the tuple is; its value is argv[2].
            // Given as None it counts as not given, as `_RunningSteps.allocate_slots` counts it.
            (Some(names), Some(&value)) if num_keywords == 1 => unsafe {
                let name = pyo3::Borrowed::from_ptr(py, ffi::PyTuple_GET_ITEM(names.as_ptr(), 0));
                let expected = intern!(py, "num_lookahead_tokens");
                (name.is(expected) || name.eq(expected)?)
                    .then(|| (value != ffi::Py_None()).then(|| pyo3::Borrowed::from_ptr(py, value)))
            },
            _ => None,
        };
        if let (Some(lookahead), Ok(steps)) = (lookahead, slf.cast::<PyRunningSteps>()) {
            let answered =
                steps
                    .get()
                    .running_step(&request, &num_new_tokens, lookahead.as_deref())?;
            // Unanswered: what the base method does next, without asking `running_step` again.
            let result = match answered {
                Some(result) => result,
                None => {
                    let lookahead = lookahead.map(|k| k.to_owned());
                    full_call(
                        &steps,
                        &request,
                        &num_new_tokens,
                        [(&parameter_names(py)[LOOKAHEAD], lookahead)],
                    )?
                }
            };
            return Ok(result.into_ptr());
        }
    }
    // The scheduler's admission (and any other call) with both counts positional and every
    // other argument a distinct known name given a value that is not None: the adapter's
    // `_allocate_slots` with the arguments as CPython passed them, which it binds as the
    // generic path below would (no dict built, no second parse of the arguments).
    // SAFETY: per the contract.
    if call.nargs == 2 && unsafe { plain_keywords(py, &call) } {
        // SAFETY: the array holds `slf` and the call's values, alive for the call; the result
        // is a new reference or null with an exception set.
        return unsafe {
            let vector = call.with_receiver();
            Ok(ffi::PyObject_VectorcallMethod(
                intern!(py, "_allocate_slots").as_ptr(),
                vector.as_ptr(),
                call.nargs as usize + 1,
                call.kwnames,
            ))
        };
    }
    // Anything else: `_RunningSteps.allocate_slots(slf, *args, **kwargs)`, as CPython passed
    // them.
    static METHOD: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let method = METHOD.get_or_try_init(py, || {
        py.get_type::<PyRunningSteps>()
            .getattr(intern!(py, "allocate_slots"))
            .map(Bound::unbind)
    })?;
    // SAFETY: the array holds `slf` and the call's values, alive for the call (borrowed from
    // CPython's, which it keeps alive); the result is a new reference or null with an
    // exception set.
    unsafe {
        let vector = call.with_receiver();
        Ok(ffi::PyObject_Vectorcall(
            method.as_ptr(),
            vector.as_ptr(),
            call.nargs as usize + 1,
            call.kwnames,
        ))
    }
}

/// Whether every keyword of `call` is one of [`PARAMETERS`] (the interned name itself), none
/// twice, and no keyword's value is None (which the generic path counts as not given).
///
/// # Safety
/// As `direct_entry!` states: every pointer is alive for the call.
unsafe fn plain_keywords(py: Python<'_>, call: &FastCall) -> bool {
    let names = parameter_names(py);
    let mut seen = [false; PARAMETERS.len()];
    // SAFETY: per the contract, `kwnames` is null or a live tuple whose items are alive, and
    // `values()` holds one live value per name after the positional ones.
    unsafe {
        let values = call.values();
        let count = call.num_keywords();
        if count == 0 {
            return false;
        }
        for k in 0..count {
            let name = ffi::PyTuple_GET_ITEM(call.kwnames, k as ffi::Py_ssize_t);
            let Some(i) = names.iter().position(|n| n.as_ptr() == name) else {
                return false;
            };
            if std::mem::replace(&mut seen[i], true) {
                return false;
            }
            if values[call.nargs as usize + k] == ffi::Py_None() {
                return false;
            }
        }
    }
    true
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_running_steps_entry, m)?)?;
    m.add_function(wrap_pyfunction!(_empty_block_ids_entry, m)?)?;
    m.add_class::<PyRunningSteps>()?;
    m.add_class::<PyRunningBlocks>()?;
    let running_blocks = m.py().get_type::<PyRunningBlocks>();
    running_blocks.setattr(
        intern!(m.py(), "get_block_ids"),
        descriptor(&running_blocks, &RUNNING_IDS)?,
    )?;
    m.add_class::<PyVllmSlot>()
}
