//! Sync shim: the concurrent parts use these names so that the same code runs under `std` and
//! under loom (`RUSTFLAGS="--cfg loom" cargo test --release --test loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// Back off while another thread finishes a step we depend on.
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// Starts loading the cache line that holds `value`, so that accesses walked in a known order
/// overlap their memory latency. A hint (x86_64's prefetch instruction; nothing elsewhere and
/// under loom): it changes nothing the program can observe.
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    // SAFETY: `_mm_prefetch` is a hint: it never faults, reads nothing the program can observe
    // and writes nothing, whatever the address; SSE is part of x86_64's baseline. The address
    // is that of a live value in any case, borrowed for the call.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = value;
}

/// The FIFO of the free order: a deque of `u64` behind a mutex, held for one batch's copy (a
/// free appends its whole batch at once, a claim takes what it needs at once). The same type
/// under std and loom, so the model checker explores exactly what runs.
pub(crate) struct Fifo(Mutex<std::collections::VecDeque<u64>>);

impl Fifo {
    /// An empty FIFO with room for `capacity` entries (`None` if that cannot be allocated). Its
    /// memory is written once here, so that pushes do not fault pages in on the calls that
    /// first reach them.
    pub(crate) fn with_capacity(capacity: usize) -> Option<Self> {
        let mut q = std::collections::VecDeque::new();
        q.try_reserve_exact(capacity).ok()?;
        q.resize(capacity, 0);
        q.clear();
        Some(Fifo(Mutex::new(q)))
    }

    /// Runs `f` on the deque under the mutex. Nothing run under it panics (short of running out
    /// of memory), so a poisoned mutex still holds a consistent deque.
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut std::collections::VecDeque<u64>) -> R) -> R {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    /// Appends `entries` in order, contiguously.
    #[inline]
    pub(crate) fn push_many(&self, entries: &[u64]) {
        self.with(|q| q.extend(entries.iter().copied()))
    }

    /// Moves up to `max` entries from the front to `out`, and copies the entries then at the
    /// front to `ahead`, as many as fit; returns how many moved and how many were copied.
    #[inline]
    pub(crate) fn pop_many(
        &self,
        max: usize,
        out: &mut Vec<u64>,
        ahead: &mut [u64],
    ) -> (usize, usize) {
        self.with(|q| {
            let n = max.min(q.len());
            out.extend(q.drain(..n));
            let mut peeked = 0;
            for (slot, &entry) in ahead.iter_mut().zip(q.iter()) {
                *slot = entry;
                peeked += 1;
            }
            (n, peeked)
        })
    }

    /// Keeps, in order, the entries `f` maps to `Some` (replaced by what it returns); returns
    /// how many remain. Allocates nothing.
    pub(crate) fn retain_map(&self, mut f: impl FnMut(u64) -> Option<u64>) -> usize {
        self.with(|q| {
            q.retain_mut(|e| match f(*e) {
                Some(new) => {
                    *e = new;
                    true
                }
                None => false,
            });
            q.len()
        })
    }

    /// Appends every entry, front to back, to `out`.
    pub(crate) fn copy_into(&self, out: &mut Vec<u64>) {
        self.with(|q| out.extend(q.iter().copied()))
    }
}
