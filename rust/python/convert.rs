//! Conversions at the boundary: integer arguments, block ids, token ids and hashes in and out
//! of numpy. Every integer argument of the module goes through [`UInt`] (or, for block ids,
//! [`id_from_i64`]): a non-integer is a `TypeError`, a value outside the argument's range an
//! `OutOfRangeError`.

use super::errors::{InvalidArgumentError, InvalidBlockIdError, OutOfRangeError};
use crate::hashing::MmInput;
use crate::types::{BlockHash, BlockId};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyUnicodeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyList, PyString, PyTuple};

/// A non-negative integer argument of at most `MAX`: a Python `int` (`bool` included) or any
/// object with `__index__` (numpy integers). Anything else is a `TypeError`; a negative value or
/// one above `MAX` is an `OutOfRangeError` (never `OverflowError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UInt<const MAX: u64>(pub u64);

/// A count, size or token position: `0..=i64::MAX`.
pub(crate) type Count = UInt<{ i64::MAX as u64 }>;
/// A group id, token id or other 32-bit value.
pub(crate) type U32 = UInt<{ u32::MAX as u64 }>;

impl Count {
    pub(crate) fn get(self) -> usize {
        self.0 as usize
    }
}

impl U32 {
    pub(crate) fn get(self) -> u32 {
        self.0 as u32
    }
}

impl<'a, 'py, const MAX: u64> FromPyObject<'a, 'py> for UInt<MAX> {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<i64>() {
            Ok(v) if v >= 0 && v as u64 <= MAX => Ok(UInt(v as u64)),
            Ok(v) => Err(out_of_range(&v.to_string(), MAX)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                let text = obj.str().map(|s| s.to_string()).unwrap_or_default();
                Err(out_of_range(&text, MAX))
            }
            Err(e) => Err(e),
        }
    }
}

/// A text argument (request id, salt, LoRA name, hash algorithm, seed): a Python `str`, read
/// as UTF-8 without a copy. Anything else is a `TypeError`; a `str` that has no UTF-8 form (a
/// lone surrogate) is an `InvalidArgumentError`, not pyo3's `UnicodeEncodeError`.
pub(crate) enum Text {
    Py(PyBackedStr),
    /// A default in a pyo3 signature.
    Static(&'static str),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Text {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<PyBackedStr>() {
            Ok(text) => Ok(Text::Py(text)),
            Err(e) if e.is_instance_of::<PyUnicodeError>(obj.py()) => Err(not_utf8(e, obj.py())),
            Err(e) => Err(e),
        }
    }
}

impl std::ops::Deref for Text {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            Text::Py(text) => text,
            Text::Static(text) => text,
        }
    }
}

impl Text {
    pub(crate) fn into_string(self) -> String {
        self.to_string()
    }
}

#[cold]
fn not_utf8(err: PyErr, py: Python<'_>) -> PyErr {
    InvalidArgumentError::new_err(format!("text is not valid Unicode: {}", err.value(py)))
}

#[cold]
fn out_of_range(value: &str, max: u64) -> PyErr {
    OutOfRangeError::new_err(format!("{value} is outside the valid range [0, {max}]"))
}

/// An integer argument that must be non-negative, named in the error (for values that are not
/// a pyo3 argument, such as dict fields): the same rules as [`Count`].
pub(crate) fn count_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    obj.extract::<Count>().map(Count::get).map_err(|e| {
        let py = obj.py();
        if e.is_instance_of::<OutOfRangeError>(py) {
            OutOfRangeError::new_err(format!("{what}: {}", e.value(py)))
        } else {
            PyTypeError::new_err(format!("{what} must be an int, got {}", type_name(obj)))
        }
    })
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// `mm_inputs`: a sequence of `(identifier: str, offset: int, length: int)`.
pub(crate) fn extract_mm_inputs(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<MmInput>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let bad = |what: String| PyTypeError::new_err(format!("mm_inputs: {what}"));
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(bad(
            "expected a sequence of (identifier, offset, length) tuples".into(),
        ));
    }
    let items = obj
        .try_iter()
        .map_err(|_| bad("expected a sequence of (identifier, offset, length) tuples".into()))?;
    let mut out = Vec::new();
    for (i, item) in items.enumerate() {
        let item = item?;
        let tuple = item
            .cast::<PyTuple>()
            .ok()
            .filter(|t| t.len() == 3)
            .ok_or_else(|| {
                bad(format!(
                    "item {i} must be an (identifier, offset, length) tuple, got {}",
                    type_name(&item)
                ))
            })?;
        let identifier = tuple.get_item(0)?.extract::<Text>().map_err(|e| {
            if e.is_instance_of::<InvalidArgumentError>(obj.py()) {
                e
            } else {
                bad(format!("item {i}: the identifier must be a str"))
            }
        })?;
        out.push(MmInput {
            identifier: identifier.into_string(),
            offset: count_of(&tuple.get_item(1)?, &format!("mm_inputs item {i} offset"))?,
            length: count_of(&tuple.get_item(2)?, &format!("mm_inputs item {i} length"))?,
        });
    }
    Ok(out)
}

/// An integer numpy array in a layout the typed extractors do not take (non-native byte order,
/// 8/16-bit integers) converted to a native `int64` array; `None` if `obj` is not one.
/// (`uint64` stays unsigned: its values may not fit `int64`.)
fn native_int64<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Ok(dtype) = obj.getattr("dtype") else {
        return Ok(None);
    };
    let kind: String = dtype.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Ok(None);
    }
    let itemsize: usize = dtype.getattr("itemsize")?.extract()?;
    let target = if kind == "u" && itemsize == 8 {
        "uint64"
    } else {
        "int64"
    };
    let numpy = obj.py().import("numpy")?;
    Ok(Some(
        numpy.call_method1("ascontiguousarray", (obj, target))?,
    ))
}

/// The `TypeError` for an array of a non-integer dtype.
fn bad_dtype(obj: &Bound<'_, PyAny>, what: &str) -> PyErr {
    let dtype = obj
        .getattr("dtype")
        .and_then(|d| d.str().map(|s| s.to_string()))
        .unwrap_or_default();
    PyTypeError::new_err(format!(
        "{what} must be an integer array, got dtype {dtype}"
    ))
}

/// `bytes`, `bytearray` and `str` iterate as ints or characters: never token or block ids.
fn reject_text(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    if obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyString>()
    {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a 1-D integer numpy array or a sequence of ints, got {}",
            type_name(obj)
        )));
    }
    Ok(())
}

/// Block ids a table of shared int objects covers at most: 2^20 ids, 36 MB of ints and
/// pointers at most; lists with a larger id make fresh ints.
const ID_TABLE_MAX: usize = 1 << 20;

/// The smallest table made (ids below it are covered from the first list on).
const ID_TABLE_MIN: usize = 1 << 12;

/// Python ints `0..len` for block ids, shared by every list of block ids the process makes
/// (vLLM's scheduler reads block ids as lists of ints on every step). A list then takes a
/// reference to an int made once instead of allocating one per id: the ints of a block table
/// are scattered over the heap by the time it is read, and allocating them was most of a list's
/// cost. Grown (never shrunk) to cover the largest id listed so far, up to `ID_TABLE_MAX`. The
/// lock is held only to read or replace the table's pointer, never while Python code runs.
static ID_INTS: std::sync::RwLock<Option<Py<PyList>>> = std::sync::RwLock::new(None);

/// The shared ints covering ids `0..need`, or None past `ID_TABLE_MAX`.
fn id_table(py: Python<'_>, need: usize) -> PyResult<Option<Bound<'_, PyList>>> {
    if need > ID_TABLE_MAX {
        return Ok(None);
    }
    let current = ID_INTS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .map(|t| t.bind(py).clone());
    if let Some(table) = &current {
        if table.len() >= need {
            return Ok(current);
        }
    }
    // Made outside the lock (making ints may run the collector, and with it any Python code),
    // keeping the ints already handed out.
    let len = need.next_power_of_two().clamp(ID_TABLE_MIN, ID_TABLE_MAX);
    let have = current.as_ref().map_or(0, |t| t.len());
    let grown = PyList::empty(py);
    if let Some(table) = &current {
        for item in table.iter() {
            grown.append(item)?;
        }
    }
    for id in have..len {
        grown.append(id)?;
    }
    let replaced = {
        let mut slot = ID_INTS
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another thread may have grown it meanwhile: the longer table stays.
        if slot.as_ref().is_none_or(|t| t.bind(py).len() < len) {
            slot.replace(grown.clone().unbind())
        } else {
            None
        }
    };
    drop(replaced);
    Ok(Some(grown))
}

/// Block ids per group as Python lists of ints (vLLM's `get_block_ids()` types), the ints
/// shared (see `ID_INTS`).
pub(crate) fn id_list_groups<'py, 'a>(
    py: Python<'py>,
    groups: impl Iterator<Item = &'a [BlockId]> + Clone,
) -> PyResult<Vec<Bound<'py, PyList>>> {
    let top = groups
        .clone()
        .filter_map(|ids| ids.iter().max())
        .max()
        .map_or(0, |&id| id as usize + 1);
    // Sized once (a `Result` collect would grow the vector from empty).
    let mut lists = Vec::with_capacity(groups.size_hint().0);
    let Some(table) = id_table(py, top)? else {
        for ids in groups {
            lists.push(PyList::new(py, ids)?);
        }
        return Ok(lists);
    };
    for ids in groups {
        // Every id is below the table's length: the fresh int is never made.
        lists.push(PyList::new(
            py,
            ids.iter().map(|&id| {
                table.get_item(id as usize).unwrap_or_else(|_| {
                    let Ok(int) = id.into_pyobject(py);
                    int.into_any()
                })
            }),
        )?);
    }
    Ok(lists)
}

/// Block ids as a numpy `int32` array (the Vec is moved, not copied).
pub(crate) fn ids_to_numpy(py: Python<'_>, ids: Vec<BlockId>) -> Bound<'_, PyArray1<i32>> {
    // Pool sizes are capped at i32::MAX, so every id fits.
    let ids: Vec<i32> = ids.into_iter().map(|id| id as i32).collect();
    PyArray1::from_vec(py, ids)
}

pub(crate) fn id_from_i64(v: i64) -> PyResult<BlockId> {
    id_from_i128(v.into())
}

/// A block id in `[0, 2**31)`, from any integer width; the error names the value given.
fn id_from_i128(v: i128) -> PyResult<BlockId> {
    u32::try_from(v)
        .ok()
        .filter(|&id| id <= i32::MAX as u32)
        .ok_or_else(|| InvalidBlockIdError::new_err(format!("block id {v} is out of range")))
}

/// A block id argument: an int in `[0, 2**31)`.
pub(crate) fn block_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<BlockId> {
    match obj.extract::<i64>() {
        Ok(v) => id_from_i64(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(
            InvalidBlockIdError::new_err(format!("block id {} is out of range", obj.str()?)),
        ),
        Err(e) => Err(e),
    }
}

/// `obj` itself, or an aligned copy of a numpy array whose data is not aligned for its dtype
/// (a view at an odd byte offset of a buffer): arrays are read in place through Rust slices and
/// references, which must be aligned.
pub(crate) fn aligned<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match obj.cast::<PyUntypedArray>() {
        Ok(array) if !array.is_aligned() => obj.call_method0(pyo3::intern!(obj.py(), "copy")),
        _ => Ok(obj.clone()),
    }
}

/// `InvalidArgumentError` for an array of more than one dimension; `TypeError` for a 0-d one (a
/// numpy scalar or `np.array(5)`: one value, no sequence, as an `int` given there).
fn check_1d(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    if let Ok(ndim) = obj.getattr("ndim").and_then(|n| n.extract::<usize>()) {
        if ndim == 0 {
            return Err(PyTypeError::new_err(format!(
                "{what} must be a 1-D integer numpy array or a sequence of ints, got a \
                 0-dimensional {}",
                obj.get_type().name()?
            )));
        }
        if ndim != 1 {
            return Err(InvalidArgumentError::new_err(format!(
                "{what} must be one-dimensional, got {ndim} dimensions"
            )));
        }
    }
    Ok(())
}

/// Block ids from a 1-D numpy integer array or a sequence of ints.
pub(crate) fn extract_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    reject_text(obj, "block ids")?;
    check_1d(obj, "block ids")?;
    let obj = &aligned(obj)?;
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return match arr.as_slice() {
            Ok(s) => s.iter().map(|&v| id_from_i64(v as i64)).collect(),
            Err(_) => arr
                .as_array()
                .iter()
                .map(|&v| id_from_i64(v as i64))
                .collect(),
        };
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return arr.as_array().iter().map(|&v| id_from_i64(v)).collect();
    }
    if obj.hasattr("dtype")? {
        return match native_int64(obj)? {
            Some(native) => extract_native_ids(&native),
            None => Err(bad_dtype(obj, "block ids")),
        };
    }
    let items = obj.try_iter().map_err(|_| {
        PyTypeError::new_err("block ids must be a 1-D integer numpy array or a sequence of ints")
    })?;
    items.map(|item| block_id_arg(&item?)).collect()
}

fn extract_native_ids(native: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    if let Ok(arr) = native.extract::<PyReadonlyArray1<'_, i64>>() {
        return arr.as_array().iter().map(|&v| id_from_i64(v)).collect();
    }
    let arr = native.extract::<PyReadonlyArray1<'_, u64>>()?;
    arr.as_array()
        .iter()
        .map(|&v| id_from_i128(v.into()))
        .collect()
}

/// How this interpreter stores a one-digit `int`, read directly by [`read_int_list`]; `None`
/// when the layout is not one we know (then every item goes through the C API).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntLayout {
    /// CPython 3.10 and 3.11: `ob_size` (signed digit count), then 30-bit digits.
    SizeThenDigits,
    /// CPython 3.12 and later: `lv_tag` (digit count << 3 | sign bits), then 30-bit digits.
    TagThenDigits,
}

static INT_LAYOUT: std::sync::OnceLock<Option<IntLayout>> = std::sync::OnceLock::new();

/// The `int` layout of this interpreter ([`detect_int_layout`], at first use). Detecting it
/// makes Python objects, so a collection may start inside it and its callbacks or finalizers
/// read ints too: it runs outside the cell's lock (`get_or_init` would deadlock on that
/// re-entry, or on a thread it switched to meanwhile). Callers that race all detect the same.
#[inline]
pub(crate) fn int_layout(py: Python<'_>) -> Option<IntLayout> {
    match INT_LAYOUT.get() {
        Some(layout) => *layout,
        None => first_int_layout(py),
    }
}

#[cold]
fn first_int_layout(py: Python<'_>) -> Option<IntLayout> {
    let layout = detect_int_layout(py);
    let _ = INT_LAYOUT.set(layout);
    layout
}

/// The layout [`int_layout`] found ("size_then_digits" or "tag_then_digits"), or None when
/// every `int` goes through the C API: read-only, for a test to pin the direct reads on.
#[pyfunction]
pub(crate) fn _int_layout(py: Python<'_>) -> Option<&'static str> {
    int_layout(py).map(|layout| match layout {
        IntLayout::SizeThenDigits => "size_then_digits",
        IntLayout::TagThenDigits => "tag_then_digits",
    })
}

/// Offsets of the size word and of the first digit in an `int` object, after the object header.
/// `ffi::PyObject` is the header of the interpreter PyO3 builds for (two words with the GIL,
/// four on free-threaded builds).
const INT_SIZE_OFFSET: usize = std::mem::size_of::<pyo3::ffi::PyObject>();
const INT_DIGIT_OFFSET: usize = INT_SIZE_OFFSET + std::mem::size_of::<usize>();

/// The value of a non-negative one-digit `int` (or zero), `None` for any other `int`.
///
/// # Safety
/// `item` must point to a live object whose type is exactly `int`, laid out as `layout` says.
#[inline(always)]
unsafe fn small_int(item: *mut pyo3::ffi::PyObject, layout: IntLayout) -> Option<u32> {
    let base = item.cast::<u8>();
    // SAFETY: per the contract, `item` is an exact `int`: its header is followed by the size
    // word (`ob_size` up to 3.11, `lv_tag` from 3.12: `cpython/longintrepr.h`), then as many
    // digits as it counts. Zero may have no digit (3.10 and 3.11 allocate none for it), so the
    // digit is read only where the size word counts exactly one. An `int` is immutable: no
    // word is written after the object is made, so reading them races with nothing, with or
    // without the GIL.
    let size = unsafe { base.add(INT_SIZE_OFFSET).cast::<usize>().read() };
    // SAFETY: as above, only once the size word counts one digit.
    let digit = || unsafe { base.add(INT_DIGIT_OFFSET).cast::<u32>().read() };
    match layout {
        IntLayout::SizeThenDigits => match size as isize {
            0 => Some(0),
            1 => Some(digit()),
            _ => None,
        },
        // Bits 0-1 hold the sign (0 positive, 1 zero, 2 negative), bit 2 is reserved for an
        // immortality flag (unused in 3.12 and 3.13; 3.14 marks small ints with it), and the
        // digit count starts at bit 3.
        IntLayout::TagThenDigits => match (size >> 3, size & 3) {
            (1, 0) => Some(digit()),
            (0, 1) => Some(0),
            _ => None,
        },
    }
}

/// The `int` layout of the running interpreter, checked against the C API on sample values
/// (cached small ints and freshly made ones); any disagreement disables direct reads.
fn detect_int_layout(py: Python<'_>) -> Option<IntLayout> {
    let v = py.version_info();
    let layout = match (v.major, v.minor) {
        (3, 10) | (3, 11) => IntLayout::SizeThenDigits,
        (3, m) if m >= 12 => IntLayout::TagThenDigits,
        _ => return None,
    };
    let int_info = py.import("sys").and_then(|s| s.getattr("int_info")).ok()?;
    let bits: u32 = int_info.getattr("bits_per_digit").ok()?.extract().ok()?;
    let size: u32 = int_info.getattr("sizeof_digit").ok()?.extract().ok()?;
    if bits != 30 || size != 4 {
        return None;
    }
    let int_type = std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type);
    let samples: [i64; 12] = [
        0,
        1,
        7,
        255,
        256,
        257,
        1000,
        65_535,
        128_256,
        (1 << 30) - 1,
        1 << 30,
        -5,
    ];
    for value in samples {
        let obj = value.into_pyobject(py).ok()?;
        // SAFETY: `obj` is alive for the read (we hold a reference), `Py_TYPE` reads a word
        // CPython changes only with every other thread stopped, and `small_int` is only called
        // once the type is known to be exactly `int` (immutable, see `small_int`).
        let read = unsafe {
            if pyo3::ffi::Py_TYPE(obj.as_ptr()) != int_type {
                return None;
            }
            small_int(obj.as_ptr(), layout)
        };
        let expected = (0..1 << 30).contains(&value).then_some(value as u32);
        if read != expected {
            return None;
        }
    }
    Some(layout)
}

/// Reads a list of Python `int`s straight into range-checked `u32`s; `None` if an item is not
/// an `int` (numpy scalars, objects with `__index__`), for the caller's generic path.
///
/// Lists are the common case (vLLM's `prompt_token_ids`). Exact one-digit ints (every token id
/// below 2^30) are read from the object in the layout [`detect_int_layout`] verified, in one
/// pass over the list's item array into the vector's spare capacity; other items go through
/// `PyLong_AsLongLong`. A `Request` made from a warm 3,000-token list (reading and hashing)
/// takes 4.9 ns per token with every item read through the C API, 1.85 ns with this loop.
///
/// Free-threaded Python: the read holds the list's critical section (its per-object lock; a
/// no-op on builds with the GIL), so no other thread can resize or change the list meanwhile.
/// Nothing inside runs Python code or waits, so the critical section is never suspended. Hence
/// the module keeps PyO3's default (`gil_used = false`) and a free-threaded build can ship.
fn read_int_list(list: &Bound<'_, PyList>) -> PyResult<Option<Vec<u32>>> {
    read_int_list_in_steps(list, usize::MAX, |_| {})
}

/// [`read_int_list`], calling `on_step` with the tokens read so far after every `step` of them
/// (and after the last ones): a caller that hashes blocks as they arrive runs the hashing of
/// one block while the next block's items load, which overlaps the two (a long prompt's items
/// are spread over megabytes of `int` objects, and a hash chain is one long dependency; see
/// `hash_list` in `request.rs`). `on_step` runs inside the list's critical section: it must
/// not run Python code.
pub(crate) fn read_int_list_in_steps(
    list: &Bound<'_, PyList>,
    step: usize,
    on_step: impl FnMut(&[u32]),
) -> PyResult<Option<Vec<u32>>> {
    let py = list.py();
    // Runs Python code the first time: outside the critical section.
    let layout = int_layout(py);
    pyo3::sync::critical_section::with_critical_section(list.as_any(), || {
        read_int_list_locked(list, layout, step.max(1), on_step)
    })
}

/// The value of an exact `int` below 2^30 read from the object in the layout
/// [`detect_int_layout`] verified; None for anything else (the caller's generic path).
#[inline]
pub(crate) fn small_exact_int(value: &Bound<'_, PyAny>) -> Option<u32> {
    let layout = int_layout(value.py())?;
    // SAFETY: `value` is alive (borrowed).
    unsafe { small_int_of(value.as_ptr(), layout) }
}

/// The value of `item` when it is an exact one-digit int (`small_int`), else None.
///
/// # Safety
/// `item` is a live object, borrowed for the call.
#[inline(always)]
pub(crate) unsafe fn small_int_of(
    item: *mut pyo3::ffi::PyObject,
    layout: IntLayout,
) -> Option<u32> {
    // SAFETY: per the contract; `Py_TYPE` reads a word CPython changes only with every other
    // thread stopped, and `small_int` only gets an exact `int` (immutable).
    unsafe {
        if pyo3::ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type) {
            return None;
        }
        small_int(item, layout)
    }
}

/// Items `from..from + out.len()` of a list of token ids, read into `out` as [`read_int_list`]
/// reads a list (exact one-digit `int`s directly): `Ok(false)` if the list is shorter or an
/// item is not an `int` (`out` then holds no meaning), an error if one is out of range. A
/// running request's new tokens (a few a step) are read so.
pub(crate) fn read_int_list_slice(
    list: &Bound<'_, PyList>,
    from: usize,
    out: &mut [u32],
) -> PyResult<bool> {
    let py = list.py();
    let layout = int_layout(py);
    let int_type = std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type);
    pyo3::sync::critical_section::with_critical_section(list.as_any(), || {
        let Some(end) = from.checked_add(out.len()).filter(|&end| end <= list.len()) else {
            return Ok(false);
        };
        // SAFETY: as in `read_int_list_locked`: the list cannot change while this runs (its
        // critical section, or the GIL and no Python code run below), so `ob_item` points to
        // at least `end` live item pointers for the whole loop.
        let items: &[*mut pyo3::ffi::PyObject] = unsafe {
            let list = list.as_ptr().cast::<pyo3::ffi::PyListObject>();
            &std::slice::from_raw_parts((*list).ob_item, end)[from..]
        };
        for (i, (slot, &item)) in out.iter_mut().zip(items).enumerate() {
            // SAFETY: as in `read_int_list_locked`.
            let fast = match layout {
                Some(layout) if unsafe { pyo3::ffi::Py_TYPE(item) } == int_type => unsafe {
                    small_int(item, layout)
                },
                _ => None,
            };
            *slot = match fast {
                Some(token) => token,
                None => match int_item(py, item, from + i)? {
                    Some(token) => token,
                    None => return Ok(false),
                },
            };
        }
        Ok(true)
    })
}

/// [`read_int_list_in_steps`] while the list cannot change: inside its critical section
/// (free-threaded builds) or with the GIL held and no Python code run (other builds).
fn read_int_list_locked(
    list: &Bound<'_, PyList>,
    layout: Option<IntLayout>,
    step: usize,
    mut on_step: impl FnMut(&[u32]),
) -> PyResult<Option<Vec<u32>>> {
    let py = list.py();
    let int_type = std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type);
    let len = list.len();
    if len == 0 {
        return Ok(Some(Vec::new()));
    }
    // SAFETY: no other thread changes the list while we read it: on free-threaded builds we
    // hold its critical section, which every list mutation takes, and on other builds this
    // thread holds the GIL (`list` is bound to it). This thread changes it neither: nothing
    // below runs Python code (only `int`s and subclasses are converted, which runs none; a
    // conversion that raises returns at once, before the slice is read again; `on_step` runs
    // none by its contract), and nothing waits, so the critical section is not suspended. So
    // `ob_item` points to `len` item pointers for the whole loop, and each item is a reference
    // the list keeps alive.
    let items: &[*mut pyo3::ffi::PyObject] = unsafe {
        let list = list.as_ptr().cast::<pyo3::ffi::PyListObject>();
        std::slice::from_raw_parts((*list).ob_item, len)
    };
    let mut values: Vec<u32> = Vec::with_capacity(len);
    for (first, items) in (0..len).step_by(step).zip(items.chunks(step)) {
        for (i, (slot, &item)) in values.spare_capacity_mut()[..items.len()]
            .iter_mut()
            .zip(items)
            .enumerate()
        {
            // SAFETY: `item` is alive (see above); `Py_TYPE` reads a word CPython changes only
            // with every other thread stopped; `small_int` only gets exact `int`s, in the
            // layout `detect_int_layout` verified for this interpreter.
            let fast = match layout {
                Some(layout) if unsafe { pyo3::ffi::Py_TYPE(item) } == int_type => unsafe {
                    small_int(item, layout)
                },
                _ => None,
            };
            let token = match fast {
                Some(token) => token,
                None => match int_item(py, item, first + i)? {
                    Some(token) => token,
                    None => return Ok(None),
                },
            };
            slot.write(token);
        }
        // SAFETY: the loop wrote the `items.len()` slots after the first `first` (it returns
        // early otherwise).
        unsafe { values.set_len(first + items.len()) };
        on_step(&values);
    }
    Ok(Some(values))
}

/// A list item that is not an exact one-digit `int`, read through the C API: its token id,
/// `None` if it is not an `int` at all, or an error if it is out of range.
#[cold]
fn int_item(py: Python<'_>, item: *mut pyo3::ffi::PyObject, i: usize) -> PyResult<Option<u32>> {
    // SAFETY: `item` is a live object (a list item the list keeps alive, see
    // `read_int_list_locked`). `PyLong_Check` reads the type's flags (types change only with
    // every other thread stopped); converting an `int` (or subclass) runs no Python code and
    // reads only immutable words. An overflow sets an exception and the caller returns at once.
    let v = unsafe {
        if pyo3::ffi::PyLong_Check(item) == 0 {
            return Ok(None);
        }
        pyo3::ffi::PyLong_AsLongLong(item)
    };
    if v == -1 && PyErr::take(py).is_some() {
        // Overflow of i64: certainly outside the token id range.
        return Err(OutOfRangeError::new_err(format!(
            "token id at position {i} is outside [0, 2^32)"
        )));
    }
    match u32::try_from(v) {
        Ok(t) => Ok(Some(t)),
        Err(_) => Err(OutOfRangeError::new_err(format!(
            "token id {v} at position {i} is outside [0, 2^32)"
        ))),
    }
}

/// Token ids, borrowed from numpy without copying where possible.
pub(crate) enum Tokens<'py> {
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
    U32(PyReadonlyArray1<'py, u32>),
    U64(PyReadonlyArray1<'py, u64>),
    /// A Python list, read and range-checked into `u32`.
    List(Vec<u32>),
    Owned(Vec<i64>),
}

impl<'py> Tokens<'py> {
    pub(crate) fn extract(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(list) = obj.cast::<PyList>() {
            if let Some(values) = read_int_list(list)? {
                return Ok(Tokens::List(values));
            }
        }
        reject_text(obj, "token ids")?;
        check_1d(obj, "token ids")?;
        let obj = &aligned(obj)?;
        if let Some(tokens) = Self::typed(obj)? {
            return Ok(tokens);
        }
        if obj.hasattr("dtype")? {
            if let Some(native) = native_int64(obj)? {
                if let Some(tokens) = Self::typed(&native)? {
                    return Ok(tokens);
                }
            }
            return Err(bad_dtype(obj, "token ids"));
        }
        let items = obj.try_iter().map_err(|_| {
            PyTypeError::new_err(
                "token ids must be a 1-D integer numpy array or a sequence of ints",
            )
        })?;
        let values = items
            .map(|item| {
                let item = item?;
                match item.extract::<i64>() {
                    Ok(v) => Ok(v),
                    // Beyond i64: certainly outside the token id range.
                    Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Ok(-1),
                    Err(e) => Err(e),
                }
            })
            .collect::<PyResult<Vec<i64>>>()?;
        Ok(Tokens::Owned(values))
    }

    /// The tokens of a numpy array of a dtype read in place.
    fn typed(obj: &Bound<'py, PyAny>) -> PyResult<Option<Self>> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i32>>() {
            return Ok(Some(Tokens::I32(a)));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i64>>() {
            return Ok(Some(Tokens::I64(a)));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, u32>>() {
            return Ok(Some(Tokens::U32(a)));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, u64>>() {
            return Ok(Some(Tokens::U64(a)));
        }
        Ok(None)
    }

    /// Runs `f` over the tokens as a contiguous slice (copying only non-contiguous arrays).
    pub(crate) fn with_slice<R>(&self, f: impl TokenFn<R>) -> R {
        match self {
            Tokens::I32(a) => match a.as_slice() {
                Ok(s) => f.call(s),
                Err(_) => f.call(&a.as_array().to_vec()),
            },
            Tokens::I64(a) => match a.as_slice() {
                Ok(s) => f.call(s),
                Err(_) => f.call(&a.as_array().to_vec()),
            },
            Tokens::U32(a) => match a.as_slice() {
                Ok(s) => f.call(s),
                Err(_) => f.call(&a.as_array().to_vec()),
            },
            Tokens::U64(a) => match a.as_slice() {
                Ok(s) => f.call(s),
                Err(_) => f.call(&a.as_array().to_vec()),
            },
            Tokens::List(v) => f.call(v),
            Tokens::Owned(v) => f.call(v),
        }
    }

    /// How many tokens there are.
    pub(crate) fn len(&self) -> usize {
        match self {
            Tokens::I32(a) => a.len(),
            Tokens::I64(a) => a.len(),
            Tokens::U32(a) => a.len(),
            Tokens::U64(a) => a.len(),
            Tokens::List(v) => v.len(),
            Tokens::Owned(v) => v.len(),
        }
    }

    /// Runs `f` over the tokens with the GIL released. Tokens borrowed from a numpy array are
    /// copied first, with the GIL held: once it is released (and at any time on free-threaded
    /// Python) another thread may write to the array, and `f` must read tokens that stay put.
    pub(crate) fn with_slice_detached<R: Send>(
        &self,
        py: Python<'_>,
        f: impl TokenFn<R> + Send,
    ) -> R {
        match self {
            Tokens::I32(a) => {
                let owned = a.as_array().to_vec();
                py.detach(|| f.call(&owned))
            }
            Tokens::I64(a) => {
                let owned = a.as_array().to_vec();
                py.detach(|| f.call(&owned))
            }
            Tokens::U32(a) => {
                let owned = a.as_array().to_vec();
                py.detach(|| f.call(&owned))
            }
            Tokens::U64(a) => {
                let owned = a.as_array().to_vec();
                py.detach(|| f.call(&owned))
            }
            Tokens::List(v) => {
                let v = v.as_slice();
                py.detach(|| f.call(v))
            }
            Tokens::Owned(v) => {
                let v = v.as_slice();
                py.detach(|| f.call(v))
            }
        }
    }

    /// The tokens as an owned, range-checked `Vec<u32>` (a list's is moved, not copied).
    pub(crate) fn into_u32(self) -> PyResult<Vec<u32>> {
        match self {
            Tokens::List(v) => Ok(v),
            other => Ok(other.with_slice(CollectU32)?),
        }
    }
}

struct CollectU32;

impl TokenFn<crate::error::Result<Vec<u32>>> for CollectU32 {
    fn call<T: crate::hashing::TokenId + Send + Sync>(
        self,
        tokens: &[T],
    ) -> crate::error::Result<Vec<u32>> {
        crate::hashing::check_tokens(tokens)?;
        Ok(tokens.iter().map(|t| t.as_u32()).collect())
    }
}

/// A function generic over the token element type.
pub(crate) trait TokenFn<R> {
    fn call<T: crate::hashing::TokenId + Send + Sync>(self, tokens: &[T]) -> R;
}

/// Hashes as an `(n, 2)` uint64 array of (low, high) halves.
pub(crate) fn hashes_to_numpy<'py>(
    py: Python<'py>,
    hashes: &[BlockHash],
) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let mut flat = Vec::with_capacity(2 * hashes.len());
    for h in hashes {
        let (lo, hi) = h.to_parts();
        flat.push(lo);
        flat.push(hi);
    }
    PyArray1::from_vec(py, flat).reshape([hashes.len(), 2])
}

/// Hashes from an `(n, 2)` uint64 array or a sequence of Python ints.
pub(crate) fn extract_hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    let obj = &aligned(obj)?;
    if let Ok(arr) = obj.extract::<PyReadonlyArray2<'_, u64>>() {
        let shape = arr.shape();
        if shape[1] != 2 {
            return Err(InvalidArgumentError::new_err(format!(
                "block hashes must have shape (n, 2), got {shape:?}"
            )));
        }
        let view = arr.as_array();
        return Ok(view
            .rows()
            .into_iter()
            .map(|row| BlockHash::from_parts(row[0], row[1]))
            .collect());
    }
    let bad = || {
        PyTypeError::new_err(
            "block hashes must be a uint64 array of shape (n, 2) or a sequence of ints",
        )
    };
    if obj.hasattr("dtype")? {
        return Err(bad());
    }
    reject_text(obj, "block hashes")?;
    let items = obj.try_iter().map_err(|_| bad())?;
    items.map(|item| int_hash(&item?)).collect()
}

/// A hash given as a Python int: in `[0, 2**128)`.
fn int_hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    match obj.extract::<u128>() {
        Ok(v) => Ok(BlockHash(v)),
        // An int out of range: an OverflowError, or (Python 3.13) a ValueError for a negative.
        Err(e)
            if obj.is_instance_of::<PyInt>()
                || e.is_instance_of::<PyOverflowError>(obj.py())
                || e.is_instance_of::<PyValueError>(obj.py()) =>
        {
            Err(OutOfRangeError::new_err(format!(
                "block hash {} is outside [0, 2**128)",
                obj.str()?
            )))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "a block hash must be an int in [0, 2**128) or a uint64 array of shape (2,), got {}",
            type_name(obj)
        ))),
    }
}

/// One hash: a Python int in `[0, 2^128)` or a length-2 uint64 array.
pub(crate) fn extract_hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let obj = &aligned(obj)?;
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
        if let [lo, hi] = arr.as_array().to_vec()[..] {
            return Ok(BlockHash::from_parts(lo, hi));
        }
        return Err(PyTypeError::new_err(
            "a block hash array must have shape (2,) (low and high 64-bit halves)",
        ));
    }
    int_hash(obj)
}
