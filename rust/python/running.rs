//! `hybrid_kv.vllm`'s running steps: the state it keeps with each vLLM request (`_VllmSlot`)
//! and its `allocate_slots` entry (`_RunningSteps`). A running request's step inside its
//! running horizon is answered from the slot before any Python frame runs; one outside it goes
//! to the core straight from here; every other call goes on to the adapter's `_allocate_slots`.

use super::convert::{count_of, Count, UInt, U32};
use super::manager::{PyKVCacheBlocks, PyKVCacheManager};
use super::request::{lock, PyRequest};
use crate::manager::RunningHorizon;
use pyo3::exceptions::PyNotImplementedError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyString, PyTuple};
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
    /// No later call is known to change nothing (until the next running call succeeds).
    pub(crate) fn drop_horizon(&self) {
        lock(&self.state).horizon = None;
    }

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
    /// between is taken into account, so each token is taken once.
    pub(crate) fn sync<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        progress: bool,
    ) -> PyResult<Bound<'py, PyRequest>> {
        let py = request.py();
        let companion = self.companion.bind(py).clone();
        let from = lock(&self.state).seen;
        let all = request.getattr(intern!(py, "_all_token_ids"))?;
        let all = all.cast::<PyList>()?;
        let counts = if progress {
            let count = |name, what: &str| count_of(&request.getattr(name)?, what);
            Some((
                count(intern!(py, "num_computed_tokens"), "num_computed_tokens")?,
                count(intern!(py, "num_in_flight_tokens"), "num_in_flight_tokens")?,
            ))
        } else {
            None
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
        for (token, i) in tokens.iter_mut().zip(from..) {
            *token = all.get_item(i)?.extract::<U32>()?.get();
        }
        let tokens = &*tokens;
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
            if let Some((computed, in_flight)) = counts {
                if let Err(e) = record.set_progress(Some(computed), Some(in_flight)) {
                    record.output.truncate(before);
                    return Err(e.into());
                }
            }
        }
        state.seen = state.seen.max(num_tokens);
        drop(state);
        Ok(companion)
    }

    /// Whether `allocate_slots(request, n, num_lookahead_tokens=k)` of a running request lies
    /// inside the slot's horizon and its counts pass the call's checks, the request's counts
    /// read from its `__dict__` (`fields`). False whenever anything does not hold or cannot be
    /// read there (the full call then decides, and raises if it must).
    fn inside_horizon(&self, fields: &Bound<'_, PyDict>, n: i128, k: i128) -> bool {
        let py = fields.py();
        let field = |name| fields.get_item(name).ok().flatten();
        let count = |name| exact_int(&field(name)?);
        let (Some(computed), Some(in_flight), Some(num_tokens)) = (
            count(intern!(py, "num_computed_tokens")),
            count(intern!(py, "num_in_flight_tokens")),
            field(intern!(py, "_all_token_ids"))
                .and_then(|t| t.cast::<PyList>().ok().map(|t| t.len() as i128)),
        ) else {
            return false;
        };
        let Some(h) = lock(&self.state).horizon else {
            return false;
        };
        let count = |v: i128| usize::try_from(v).ok();
        let (Some(computed), Some(in_flight), Some(num_tokens), Some(n), Some(k)) = (
            count(computed),
            count(in_flight),
            count(num_tokens),
            count(n),
            count(k),
        ) else {
            return false;
        };
        h.admits(computed, in_flight, num_tokens, n, k)
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
    #[pyo3(name = "drop_horizon")]
    fn py_drop_horizon(&self) {
        self.drop_horizon();
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
}

/// Base class of `hybrid_kv.vllm`'s manager: its `allocate_slots`.
#[pyclass(frozen, subclass, name = "_RunningSteps", module = "hybrid_kv._core")]
pub(crate) struct PyRunningSteps {
    entry: OnceLock<Entry>,
}

/// An exact Python int within i64 (no `__index__` call, so no Python code runs), widened so
/// that sums cannot overflow; `None` otherwise.
fn exact_int(value: &Bound<'_, PyAny>) -> Option<i128> {
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
        let Some(fields) = request
            .getattr(intern!(py, "__dict__"))
            .ok()
            .and_then(|d| d.cast_into::<PyDict>().ok())
        else {
            return Ok(None);
        };
        let Some(slot) = fields
            .get_item(entry.key.bind(py))
            .ok()
            .flatten()
            .and_then(|s| s.cast_into::<PyVllmSlot>().ok())
        else {
            return Ok(None);
        };
        if slot.get().inside_horizon(&fields, n, k) {
            return Ok(Some(entry.empty.clone_ref(py)));
        }
        let Some((core, wrap)) = &entry.direct else {
            return Ok(None);
        };
        let core = core.bind(py).get();
        // Both fit: exact ints within i64, positive.
        let count = |v: i128| UInt(v as u64);
        let new = core.allocate_running(py, request, &slot, count(n), count(k))?;
        Ok(Some(match new {
            None => py.None(),
            Some(blocks) if blocks.is(core.empty_blocks()) => entry.empty.clone_ref(py),
            Some(blocks) => Py::new(
                py,
                PyRunningBlocks {
                    blocks,
                    wrap: wrap.clone_ref(py),
                    wrapped: OnceLock::new(),
                },
            )?
            .into_any(),
        }))
    }
}

/// The new blocks of a running step that reached the core from the entry: vLLM's scheduler
/// reads them with `get_block_ids`, answered here from the core's blocks; anything else is the
/// adapter's `KVCacheBlocks` over the same blocks (made on first use).
#[pyclass(frozen, name = "_RunningBlocks", module = "hybrid_kv._core")]
pub(crate) struct PyRunningBlocks {
    blocks: Py<PyKVCacheBlocks>,
    /// The adapter's wrapper: `wrap(blocks, None, False)`.
    wrap: Py<PyAny>,
    wrapped: OnceLock<Py<PyAny>>,
}

impl PyRunningBlocks {
    fn wrapped<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyAny>> {
        if let Some(wrapped) = self.wrapped.get() {
            return Ok(wrapped.bind(py));
        }
        let made = self
            .wrap
            .bind(py)
            .call1((self.blocks.clone_ref(py), py.None(), false))?;
        Ok(self.wrapped.get_or_init(|| made.unbind()).bind(py))
    }
}

#[pymethods]
impl PyRunningBlocks {
    /// vLLM's `KVCacheBlocks.get_block_ids`: block ids per group as lists; None if empty and
    /// `allow_none` (never: a running step's result that took no block is the empty result).
    #[pyo3(signature = (allow_none = false, *, group_ids = None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        match group_ids {
            None => Ok(self
                .blocks
                .get()
                .get_block_id_lists(py, allow_none)?
                .map(Bound::into_any)),
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

#[pymethods]
impl PyRunningSteps {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        PyRunningSteps {
            entry: OnceLock::new(),
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
        let _ = self.entry.set(Entry { key, empty, direct });
    }

    /// vLLM's `allocate_slots`: a running step (`num_lookahead_tokens` the only other argument
    /// given) inside its horizon returns the empty result here, one outside it goes to the core
    /// from here when the adapter set one; every other call is the adapter's `_allocate_slots` with the arguments given (by name after `num_new_tokens`; one
    /// given as None counts as not given, as Python's defaults are for the scheduler's calls).
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
        let lookahead = given[2].as_ref();
        let only_lookahead = given
            .iter()
            .enumerate()
            .all(|(i, value)| i == 2 || value.is_none());
        if only_lookahead {
            if let Some(result) = slf.get().running_step(request, num_new_tokens, lookahead)? {
                return Ok(result);
            }
        }
        let kwargs = PyDict::new(py);
        for (name, value) in PARAMETERS.iter().zip(given) {
            if let Some(value) = value {
                kwargs.set_item(name, value)?;
            }
        }
        slf.call_method(
            intern!(py, "_allocate_slots"),
            (request, num_new_tokens),
            Some(&kwargs),
        )
        .map(Bound::unbind)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRunningSteps>()?;
    m.add_class::<PyRunningBlocks>()?;
    m.add_class::<PyVllmSlot>()
}
