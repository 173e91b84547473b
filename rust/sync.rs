//! Sync shim: the lock-free parts use these names so that the same code runs under `std` and
//! under loom (`RUSTFLAGS="--cfg loom" cargo test --release --test loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Mutex;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Back off while another thread finishes a step we depend on.
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// A multi-producer multi-consumer FIFO of `u64`.
///
/// Under std this is crossbeam's `SegQueue` (non-blocking in practice); under loom a
/// mutex-protected deque, so the model checker explores our own state machine around it.
#[cfg(not(loom))]
pub(crate) struct Fifo(crossbeam_queue::SegQueue<u64>);

#[cfg(not(loom))]
impl Fifo {
    pub(crate) fn new() -> Self {
        Fifo(crossbeam_queue::SegQueue::new())
    }
    #[inline]
    pub(crate) fn push(&self, v: u64) {
        self.0.push(v)
    }
    #[inline]
    pub(crate) fn pop(&self) -> Option<u64> {
        self.0.pop()
    }
}

#[cfg(loom)]
pub(crate) struct Fifo(Mutex<std::collections::VecDeque<u64>>);

#[cfg(loom)]
impl Fifo {
    pub(crate) fn new() -> Self {
        Fifo(Mutex::new(std::collections::VecDeque::new()))
    }
    pub(crate) fn push(&self, v: u64) {
        self.0.lock().unwrap().push_back(v)
    }
    pub(crate) fn pop(&self) -> Option<u64> {
        self.0.lock().unwrap().pop_front()
    }
}
