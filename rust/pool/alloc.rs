//! Fallible allocation of the pool's per-block arrays: a pool too large for the memory available
//! is an error naming the array and its size, never an abort.

use std::fmt;

/// An array that could not be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AllocFailed {
    pub(crate) what: &'static str,
    /// Bytes requested (`usize::MAX` if the size itself overflows).
    pub(crate) bytes: usize,
}

impl fmt::Display for AllocFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot allocate {} bytes for the {}",
            self.bytes, self.what
        )
    }
}

/// `len` elements made by `init(i)`, in one allocation that reports failure instead of aborting.
pub(crate) fn boxed_slice<T>(
    what: &'static str,
    len: usize,
    mut init: impl FnMut(usize) -> T,
) -> Result<Box<[T]>, AllocFailed> {
    let failed = AllocFailed {
        what,
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    };
    #[cfg(test)]
    if inject::should_fail() {
        return Err(failed);
    }
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(len).map_err(|_| failed)?;
    // Within the reserved capacity: no reallocation.
    v.extend((0..len).map(&mut init));
    Ok(v.into_boxed_slice())
}

/// Tests: make the `n`-th next allocation (0-based) of this thread fail.
#[cfg(test)]
pub(crate) mod inject {
    use std::cell::Cell;

    thread_local! {
        static FAIL_AFTER: Cell<Option<usize>> = const { Cell::new(None) };
    }

    pub(crate) fn fail_after(n: Option<usize>) {
        FAIL_AFTER.with(|c| c.set(n));
    }

    pub(crate) fn should_fail() -> bool {
        FAIL_AFTER.with(|c| match c.get() {
            Some(0) => {
                c.set(None);
                true
            }
            Some(n) => {
                c.set(Some(n - 1));
                false
            }
            None => false,
        })
    }
}
