//! `hybrid_kv.vllm`'s `allocate_slots` entry: a running request's step inside its running
//! horizon answered from the integers the adapter keeps with the request, before any Python
//! frame runs; every other call goes on to the adapter's `_allocate_slots`.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyTuple};
use std::sync::OnceLock;

/// What the entry needs from the adapter: the key of the companion slot in a vLLM request's
/// `__dict__` and the shared empty result.
struct Entry {
    key: Py<PyAny>,
    empty: Py<PyAny>,
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
    /// The step `allocate_slots(request, n, num_lookahead_tokens=k)` of a running request,
    /// answered when it lies inside the horizon in the request's slot (`[companion, tokens
    /// seen, slots, cache, removal]`, the last three as the core's `running_horizon`) and its
    /// counts pass the call's checks: `Some(empty result)`. `None` whenever anything does not
    /// hold or cannot be read (the adapter's full call then decides, and raises if it must).
    fn inside_horizon(
        &self,
        request: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: Option<&Bound<'_, PyAny>>,
    ) -> Option<Py<PyAny>> {
        let py = request.py();
        let entry = self.entry.get()?;
        let n = exact_int(num_new_tokens)?;
        let k = num_lookahead_tokens.map_or(Some(0), exact_int)?;
        if n <= 0 || k < 0 {
            return None;
        }
        let dict = request.getattr(intern!(py, "__dict__")).ok()?;
        let slot = dict
            .cast::<PyDict>()
            .ok()?
            .get_item(entry.key.bind(py))
            .ok()??;
        let slot = slot.cast::<PyList>().ok()?;
        if slot.len() != 5 {
            return None;
        }
        let bound = |i: usize| slot.get_item(i).ok().as_ref().and_then(exact_int);
        let (slots, cache, removal) = (bound(2)?, bound(3)?, bound(4)?);
        let count = |name| exact_int(&request.getattr(name).ok()?);
        let computed = count(intern!(py, "num_computed_tokens"))?;
        let in_flight = count(intern!(py, "num_in_flight_tokens"))?;
        let tokens = request.getattr(intern!(py, "_all_token_ids")).ok()?;
        let num_tokens = tokens.cast::<PyList>().ok()?.len() as i128;
        let inside = computed + n + k <= slots
            && computed + n < cache
            && 0 <= in_flight
            && in_flight <= computed
            && computed - in_flight < removal
            && computed <= num_tokens + in_flight;
        inside.then(|| entry.empty.clone_ref(py))
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

    /// Sets the slot key and the empty result (once; later calls change nothing).
    fn _running_steps(&self, key: Py<PyAny>, empty: Py<PyAny>) {
        let _ = self.entry.set(Entry { key, empty });
    }

    /// vLLM's `allocate_slots`: a running step (`num_lookahead_tokens` the only other argument
    /// given) inside its horizon returns the empty result here; every other call is the
    /// adapter's `_allocate_slots` with the arguments given (by name after `num_new_tokens`; one
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
            if let Some(empty) = slf.get().inside_horizon(request, num_new_tokens, lookahead) {
                return Ok(empty);
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
    m.add_class::<PyRunningSteps>()
}
