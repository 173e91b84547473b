//! `_CallTimer`: the benchmarks' timer of calls made on a callable, with as little as possible
//! between its two clock reads (a vectorcall passed on unchanged): what it counts beyond the
//! call is a few nanoseconds, where a Python wrapper around `time.perf_counter_ns` costs about
//! 1.4 µs per call inside vLLM's scheduler step (measured there with a second timer around it),
//! of which a benchmark can only estimate the counted part from no-ops.

use super::request::lock;
use super::running::{direct_entry, trampoline, EntryDef, FastCall};
use pyo3::exceptions::{PyReferenceError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pyclass::{PyTraverseError, PyVisit};
use pyo3::types::PyType;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// A monotonic clock read in ticks: the time-stamp counter on x86-64 (invariant on the
/// machines this is run on: `constant_tsc`, `nonstop_tsc`), nanoseconds since a fixed instant
/// elsewhere.
fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `rdtsc` has no preconditions; it reads the time-stamp counter.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Nanoseconds per tick, measured once per process against `Instant` over 20 ms.
fn ns_per_tick() -> f64 {
    static RATE: OnceLock<f64> = OnceLock::new();
    *RATE.get_or_init(|| {
        if cfg!(not(target_arch = "x86_64")) {
            return 1.0;
        }
        let (start, start_ticks) = (Instant::now(), ticks());
        while start.elapsed().as_millis() < 20 {
            std::hint::spin_loop();
        }
        let (elapsed, elapsed_ticks) = (start.elapsed(), ticks().wrapping_sub(start_ticks));
        elapsed.as_nanos() as f64 / elapsed_ticks.max(1) as f64
    })
}

/// Times the calls made through `function()` on `target`: each is passed on to `target` as the
/// same vectorcall (arguments, keyword names and exception unchanged) between two reads of the
/// clock; `ns` and `calls` add up the calls that returned or raised. A result whose type is
/// exactly one of `wrap_types` is returned as `wrap(result)`, called after the clock (a
/// benchmark's proxy for a result whose methods it times but cannot replace). Counters are
/// atomic: calls from several threads are all counted.
#[pyclass(frozen, name = "_CallTimer", module = "hybrid_kv._core")]
pub(crate) struct PyCallTimer {
    /// `None` once the cycle collector cleared the timer. Locked only to clone or take the
    /// `Arc`, outside the clock reads and never while Python code runs: a call keeps its own
    /// reference to the callables until it returns.
    callables: Mutex<Option<Arc<Callables>>>,
    ticks: AtomicU64,
    calls: AtomicU64,
}

/// The callables of a `_CallTimer`.
struct Callables {
    target: Py<PyAny>,
    wrap: Option<(Vec<Py<PyType>>, Py<PyAny>)>,
}

impl PyCallTimer {
    fn callables(&self) -> PyResult<Arc<Callables>> {
        lock(&self.callables)
            .clone()
            .ok_or_else(|| PyReferenceError::new_err("_CallTimer: cleared by the cycle collector"))
    }
}

#[pymethods]
impl PyCallTimer {
    #[new]
    #[pyo3(signature = (target, wrap_types = None, wrap = None))]
    fn new(
        target: Bound<'_, PyAny>,
        wrap_types: Option<Vec<Bound<'_, PyType>>>,
        wrap: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let not_callable =
            |what: &str| PyTypeError::new_err(format!("_CallTimer: {what} is not callable"));
        if !target.is_callable() {
            return Err(not_callable("the target"));
        }
        let wrap = match (wrap_types, wrap) {
            (None, None) => None,
            (Some(types), Some(wrap)) => {
                if !wrap.is_callable() {
                    return Err(not_callable("wrap"));
                }
                Some((
                    types.into_iter().map(Bound::unbind).collect(),
                    wrap.unbind(),
                ))
            }
            _ => {
                return Err(PyTypeError::new_err(
                    "_CallTimer: wrap_types and wrap go together",
                ))
            }
        };
        ns_per_tick();
        Ok(PyCallTimer {
            callables: Mutex::new(Some(Arc::new(Callables {
                target: target.unbind(),
                wrap,
            }))),
            ticks: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        })
    }

    /// The timed callable: a builtin function whose calls go to the target.
    fn function<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `TIMED` is a static CPython only reads; `slf` is a live `_CallTimer`, which
        // the new function keeps a reference to (its `self`) and passes to `timed_call`. The
        // call returns a new reference or null with an exception set.
        unsafe {
            let function = ffi::PyCFunction_NewEx(
                std::ptr::addr_of!(TIMED.0).cast_mut(),
                slf.as_ptr(),
                std::ptr::null_mut(),
            );
            Bound::from_owned_ptr_or_err(slf.py(), function)
        }
    }

    /// The timed callable as a method: a class attribute that binds, read from an instance, to
    /// that instance (its calls get it first), as a function defined in the class does.
    fn method<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let function = Self::function(slf)?;
        // SAFETY: `function` is a live callable; the call returns a new reference (an
        // `instancemethod` holding its own reference to `function`) or null with an exception
        // set.
        unsafe { Bound::from_owned_ptr_or_err(slf.py(), PyInstanceMethod_New(function.as_ptr())) }
    }

    /// Nanoseconds spent in the calls so far.
    #[getter]
    fn ns(&self) -> u64 {
        (self.ticks.load(Ordering::Relaxed) as f64 * ns_per_tick()).round() as u64
    }

    /// Calls so far.
    #[getter]
    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The callable the calls go to.
    #[getter]
    fn target(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(self.callables()?.target.clone_ref(py))
    }

    /// The callables, for the cycle collector (a target may hold the timer, e.g. as an
    /// attribute of the object it is bound to). Callables locked by another thread are not
    /// visited: the collector then counts them as outside references and frees nothing
    /// through them.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        let Ok(callables) = self.callables.try_lock() else {
            return Ok(());
        };
        let Some(callables) = callables.as_deref() else {
            return Ok(());
        };
        visit.call(&callables.target)?;
        if let Some((types, wrap)) = &callables.wrap {
            for t in types {
                visit.call(t)?;
            }
            visit.call(wrap)?;
        }
        Ok(())
    }

    /// Drops the callables (the cycle collector breaking a cycle through them); later calls
    /// raise `ReferenceError`.
    fn __clear__(&self) {
        let taken = lock(&self.callables).take();
        drop(taken); // after the lock is released: dropping may run Python code
    }
}

extern "C" {
    /// CPython's `instancemethod` constructor (`Include/cpython/classobject.h`).
    fn PyInstanceMethod_New(function: *mut ffi::PyObject) -> *mut ffi::PyObject;
}

static TIMED: EntryDef = EntryDef::fast(
    c"timed",
    timed_call,
    c"The target's call, timed by its _CallTimer.",
);

direct_entry!(timed_call, timed);

/// The body of `_CallTimer.function()`'s function: `call.slf` is the timer (the function's
/// `self`), the rest the call's vectorcall arguments, passed on unchanged.
fn timed(py: Python<'_>, call: FastCall) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: `call.slf` is the `_CallTimer` the function was made with (`function` makes it
    // so, and the function holds a reference to it for its lifetime).
    let timer = unsafe { Borrowed::from_ptr(py, call.slf).cast_unchecked::<PyCallTimer>() };
    let timer = timer.get();
    // Held for the call, so clearing the timer meanwhile cannot drop the target.
    let callables = timer.callables()?;
    // SAFETY: `args`, `nargs` and `kwnames` are the call's live vectorcall arguments
    // (`direct_entry!`'s contract), which `PyObject_Vectorcall` takes as they are (borrowed,
    // without `PY_VECTORCALL_ARGUMENTS_OFFSET`, so the callee does not write before `args`);
    // `callables` keeps the target alive. The counters are atomics, so calls from threads
    // running without the GIL are sound. The result is a new reference or null with an
    // exception set, taken over by `from_owned_ptr_or_err`.
    let result = unsafe {
        let start = ticks();
        let result = ffi::PyObject_Vectorcall(
            callables.target.as_ptr(),
            call.args,
            call.nargs as usize,
            call.kwnames,
        );
        let elapsed = ticks().wrapping_sub(start);
        timer.ticks.fetch_add(elapsed, Ordering::Relaxed);
        timer.calls.fetch_add(1, Ordering::Relaxed);
        Bound::from_owned_ptr_or_err(py, result)?
    };
    let wrapped = match &callables.wrap {
        Some((types, wrap)) if types.iter().any(|t| result.get_type().is(t.bind(py))) => {
            wrap.bind(py).call1((result,))?
        }
        _ => result,
    };
    Ok(wrapped.into_ptr())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCallTimer>()
}
