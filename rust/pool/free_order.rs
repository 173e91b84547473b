//! The pool's free order: a LIFO stack of uncached frees in front of a FIFO of everything else
//! (vLLM 0.33's `FreeKVCacheBlockQueue` with `prepend_n` / `append_n`).
//!
//! Entries are `(epoch << 32) | block_id`. A block that leaves the free order without being popped
//! (a free block revived by `touch`) is not searched for: its epoch moves on, so its entry goes
//! stale and is skipped when it reaches the front (lazy invalidation). Stale entries are removed
//! by a compaction when the stack has no room for a push or the FIFO grows past its limit.
//!
//! Pushes and pops run concurrently with each other (the stack is a tagged Treiber stack; the
//! FIFO a deque behind a mutex held for one batch's copy, see [`Fifo`]). A compaction runs
//! alone: it closes a [`Gate`] that every push and pop passes, waits for the operations already
//! inside to leave, compacts, and opens it again. So a compaction never races a push (nothing
//! can be dropped, the order of concurrent frees is kept), and a pop never sees a half-compacted
//! order.
//!
//! Progress: an operation inside the gate waits for nothing but the FIFO's mutex, held by others
//! for one copy each (its loops retry only when another thread's CAS succeeded), so a compaction
//! waits for a bounded amount of other threads' work; a compaction is itself a bounded loop over
//! at most `lifo capacity + FIFO length` entries, so an operation waiting at the gate waits for
//! bounded work. Waits at the gate are `yield`s; the FIFO's mutex may park a waiter while
//! another thread copies.

use super::alloc::{array_bytes, AllocFailed, PageArray};
use crate::sync::{spin_wait, AtomicU32, AtomicU64, AtomicUsize, Fifo, Ordering};

const NIL: u32 = u32::MAX;

#[inline]
pub(crate) fn pack_entry(id: u32, epoch: u32) -> u64 {
    ((epoch as u64) << 32) | id as u64
}

#[inline]
pub(crate) fn entry_id(entry: u64) -> u32 {
    entry as u32
}

#[inline]
pub(crate) fn entry_epoch(entry: u64) -> u32 {
    (entry >> 32) as u32
}

/// An ABA-safe Treiber stack over the indices `0..capacity`: the head packs a 32-bit tag with the
/// top index, so a head that was popped and pushed again in between fails the CAS.
pub(crate) struct IndexStack {
    head: AtomicU64,
    next: PageArray<AtomicU32>,
}

impl IndexStack {
    /// A stack over `0..capacity` holding `first..end` linked in order, `first` on top (empty
    /// when `first == end`).
    fn with_run(
        what: &'static str,
        capacity: usize,
        first: usize,
        end: usize,
    ) -> Result<Self, AllocFailed> {
        let next = PageArray::new(what, capacity, |i| {
            AtomicU32::new(if i + 1 < end { i as u32 + 1 } else { NIL })
        })?;
        let head = if first < end {
            first as u64
        } else {
            NIL as u64
        };
        Ok(IndexStack {
            head: AtomicU64::new(head),
            next,
        })
    }

    fn push(&self, index: u32) {
        self.push_chain(index, index);
    }

    /// Pushes a chain already linked through `next` (`first` ... `last`), `first` on top, with
    /// one CAS.
    pub(crate) fn push_chain(&self, first: u32, last: u32) {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            self.next[last as usize].store(head as u32, Ordering::Relaxed);
            let tag = (head >> 32).wrapping_add(1);
            match self.head.compare_exchange_weak(
                head,
                (tag << 32) | first as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(actual) => head = actual,
            }
        }
    }

    /// Links `indices` into a chain in the given order; returns (first, last).
    fn link(&self, indices: &[u32]) -> Option<(u32, u32)> {
        for pair in indices.windows(2) {
            self.next[pair[0] as usize].store(pair[1], Ordering::Relaxed);
        }
        Some((*indices.first()?, *indices.last()?))
    }

    /// Pops up to `max` indices with one CAS, appending them top first; they stay linked in
    /// that order, so `push_chain(out[0], out[last])` can give them back in one CAS. The walk is
    /// safe: any push or pop in between changes the head's tag and fails the CAS.
    pub(crate) fn pop_many(&self, max: usize, out: &mut Vec<u32>) -> usize {
        if max == 0 {
            return 0;
        }
        let start = out.len();
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            out.truncate(start);
            let mut index = head as u32;
            while index != NIL && out.len() - start < max {
                out.push(index);
                index = self.next[index as usize].load(Ordering::Relaxed);
            }
            if out.len() == start {
                return 0;
            }
            let tag = (head >> 32).wrapping_add(1);
            match self.head.compare_exchange_weak(
                head,
                (tag << 32) | index as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return out.len() - start,
                Err(actual) => head = actual,
            }
        }
    }
}

/// LIFO of entries: an index stack of slots holding entries, with a second stack of spare slots.
struct Lifo {
    entries: IndexStack,
    spare: IndexStack,
    payload: PageArray<AtomicU64>,
}

impl Lifo {
    /// A LIFO of `capacity` slots holding `initial(0..n)` (`initial(0)` on top).
    fn new(capacity: usize, n: usize, initial: impl Fn(usize) -> u64) -> Result<Self, AllocFailed> {
        let n = n.min(capacity);
        Ok(Lifo {
            entries: IndexStack::with_run("free-order stack links", capacity, 0, n)?,
            spare: IndexStack::with_run("free-order spare-slot links", capacity, n, capacity)?,
            payload: PageArray::new("free-order stack slots", capacity, |i| {
                AtomicU64::new(if i < n { initial(i) } else { 0 })
            })?,
        })
    }

    fn capacity(&self) -> usize {
        self.payload.len()
    }

    /// Pushes `entries` with `entries[0]` on top, in two CASes; `false` (nothing pushed) when
    /// there are not enough free slots.
    fn push_many(&self, entries: &[u64], slots: &mut Vec<u32>) -> bool {
        slots.clear();
        if self.spare.pop_many(entries.len(), slots) < entries.len() {
            if let Some((first, last)) = self.spare.link(slots) {
                self.spare.push_chain(first, last);
            }
            return false;
        }
        for (&slot, &entry) in slots.iter().zip(entries) {
            self.payload[slot as usize].store(entry, Ordering::Relaxed);
        }
        if let Some((first, last)) = self.entries.link(slots) {
            self.entries.push_chain(first, last);
        }
        true
    }

    /// Pops up to `max` entries, top first, in two CASes.
    fn pop_many(&self, max: usize, out: &mut Vec<u64>, slots: &mut Vec<u32>) {
        slots.clear();
        if self.entries.pop_many(max, slots) == 0 {
            return;
        }
        out.extend(
            slots
                .iter()
                .map(|&slot| self.payload[slot as usize].load(Ordering::Relaxed)),
        );
        if let Some((first, last)) = self.spare.link(slots) {
            self.spare.push_chain(first, last);
        }
    }
}

/// Bit 0 of the gate word: a compaction holds (or is about to hold) the free order alone.
const EXCLUSIVE: usize = 1;
/// The gate word counts the operations inside in steps of 2.
const INSIDE: usize = 2;

/// Admits any number of ordinary operations at once, or one exclusive one.
struct Gate(AtomicUsize);

/// An ordinary operation inside the gate (leaves on drop, panics included).
struct Shared<'a>(&'a Gate);

/// The exclusive holder of the gate (opens it on drop, panics included).
struct Exclusive<'a>(&'a Gate);

impl Gate {
    /// Enters as an ordinary operation, first waiting for an exclusive holder to finish.
    #[inline]
    fn enter(&self) -> Shared<'_> {
        loop {
            if self.0.fetch_add(INSIDE, Ordering::Acquire) & EXCLUSIVE == 0 {
                return Shared(self);
            }
            self.0.fetch_sub(INSIDE, Ordering::Release);
            while self.0.load(Ordering::Acquire) & EXCLUSIVE != 0 {
                spin_wait();
            }
        }
    }

    /// Takes the gate alone, or `None` at once if another thread holds or is taking it. Waits
    /// for the ordinary operations inside to leave; newcomers wait outside meanwhile.
    fn try_exclusive(&self) -> Option<Exclusive<'_>> {
        if self.0.fetch_or(EXCLUSIVE, Ordering::Acquire) & EXCLUSIVE != 0 {
            return None;
        }
        let exclusive = Exclusive(self);
        while self.0.load(Ordering::Acquire) != EXCLUSIVE {
            spin_wait();
        }
        Some(exclusive)
    }

    /// Takes the gate alone, waiting for any other exclusive holder to finish first.
    fn exclusive(&self) -> Exclusive<'_> {
        loop {
            if let Some(exclusive) = self.try_exclusive() {
                return exclusive;
            }
            while self.0.load(Ordering::Acquire) & EXCLUSIVE != 0 {
                spin_wait();
            }
        }
    }
}

impl Drop for Shared<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0 .0.fetch_sub(INSIDE, Ordering::Release);
    }
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_and(!EXCLUSIVE, Ordering::Release);
    }
}

/// The free order. The pool supplies `revalidate(entry)`: `Some(entry')` if the entry still
/// stands for a free block (`entry'` then replaces it, see [`FreeOrder::compact`]), `None` if
/// it is stale.
pub(crate) struct FreeOrder {
    lifo: Lifo,
    fifo: Fifo,
    fifo_len: AtomicUsize,
    /// FIFO length above which a push compacts.
    fifo_limit: usize,
    gate: Gate,
}

impl FreeOrder {
    /// The order of a new pool of `num_blocks`: blocks `1..num_blocks` free in id order, a
    /// stack of `2 * num_blocks + 8` slots, compacted when full or when the FIFO passes as many
    /// entries.
    pub(crate) fn new(num_blocks: usize) -> Result<Self, AllocFailed> {
        let limit = Self::limit(num_blocks);
        Self::with_capacity(num_blocks, limit, limit)
    }

    /// The stack's slots and the FIFO's compaction limit of [`FreeOrder::new`].
    fn limit(num_blocks: usize) -> usize {
        num_blocks.saturating_mul(2).saturating_add(8)
    }

    /// Bytes [`FreeOrder::new`] allocates for `num_blocks`: its stack (two link arrays and the
    /// slots) and its FIFO.
    pub(crate) fn heap_bytes(num_blocks: usize) -> usize {
        let limit = Self::limit(num_blocks);
        let links = array_bytes::<AtomicU32>(limit);
        let stack = links
            .saturating_add(links)
            .saturating_add(array_bytes::<AtomicU64>(limit));
        let fifo = limit.saturating_add(num_blocks.saturating_sub(1));
        stack.saturating_add(fifo.saturating_mul(std::mem::size_of::<u64>()))
    }

    /// [`FreeOrder::new`] with other limits; `lifo_capacity` must be at least
    /// `2 * (num_blocks - 1)` (see [`FreeOrder::push_front`]).
    pub(crate) fn with_capacity(
        num_blocks: usize,
        lifo_capacity: usize,
        fifo_limit: usize,
    ) -> Result<Self, AllocFailed> {
        // The initial free blocks are all uncached, so they may start in the stack: the order
        // is the stack top to bottom, then the FIFO, and frees go on top or at the tail.
        let free = num_blocks.saturating_sub(1);
        debug_assert!(free <= lifo_capacity);
        // The FIFO's longest: past its limit by at most one call's frees before a compaction.
        let fifo_capacity = fifo_limit.saturating_add(free);
        let failed = AllocFailed {
            what: "free order's FIFO",
            bytes: fifo_capacity.saturating_mul(std::mem::size_of::<u64>()),
        };
        if !super::alloc::fits(failed.bytes) {
            return Err(failed);
        }
        let fifo = Fifo::with_capacity(fifo_capacity).ok_or(failed)?;
        Ok(FreeOrder {
            lifo: Lifo::new(lifo_capacity, free, |i| pack_entry(i as u32 + 1, 0))?,
            fifo,
            fifo_len: AtomicUsize::new(0),
            fifo_limit,
            gate: Gate(AtomicUsize::new(0)),
        })
    }

    /// Puts `entries` at the front, `entries[0]` first to pop.
    ///
    /// When the stack is full it is compacted, alone, and the entries pushed in the same
    /// exclusive section. They fit then: a compaction leaves at most one entry per free block
    /// (at most `num_blocks - 1`), and `entries` holds at most one per block that this call
    /// released, so at most `2 * (num_blocks - 1)` slots are used of `2 * num_blocks + 8`.
    pub(crate) fn push_front(&self, entries: &[u64], revalidate: impl Fn(u64) -> Option<u64>) {
        let mut slots = Vec::with_capacity(entries.len());
        {
            let _inside = self.gate.enter();
            if self.lifo.push_many(entries, &mut slots) {
                return;
            }
        }
        let _alone = self.gate.exclusive();
        if self.lifo.push_many(entries, &mut slots) {
            return;
        }
        self.compact_alone(&revalidate);
        if !self.lifo.push_many(entries, &mut slots) {
            // Unreachable by the count above. Should it ever be reached, the entries go to the
            // back rather than be lost (the pool stays exact; only their place in the order
            // differs).
            if cfg!(any(debug_assertions, loom)) {
                panic!("a compacted stack has room for one call's frees");
            }
            self.fifo_len.fetch_add(entries.len(), Ordering::Relaxed);
            self.fifo.push_many(entries);
        }
    }

    /// Puts `entries` at the back, in order.
    pub(crate) fn push_back(&self, entries: &[u64], revalidate: impl Fn(u64) -> Option<u64>) {
        let len = {
            let _inside = self.gate.enter();
            // Counted before pushing, so a concurrent pop never takes the count below zero.
            let len = self.fifo_len.fetch_add(entries.len(), Ordering::Relaxed) + entries.len();
            self.fifo.push_many(entries);
            len
        };
        if len > self.fifo_limit {
            // Housekeeping only: if another thread is compacting, its compaction will do.
            if let Some(_alone) = self.gate.try_exclusive() {
                if self.fifo_len.load(Ordering::Relaxed) > self.fifo_limit {
                    self.compact_alone(&revalidate);
                }
            }
        }
    }

    /// Up to `max` entries from the front (some may be stale: the caller checks and claims).
    /// When the pop reaches the FIFO, the entries then at its front are copied to `ahead`, as
    /// many as fit (a hint of what later pops may take); returns how many were copied.
    pub(crate) fn pop_many(
        &self,
        max: usize,
        out: &mut Vec<u64>,
        slots: &mut Vec<u32>,
        ahead: &mut [u64],
    ) -> usize {
        let _inside = self.gate.enter();
        let start = out.len();
        self.lifo.pop_many(max, out, slots);
        let want = max - (out.len() - start);
        let (popped, peeked) = if want > 0 {
            self.fifo.pop_many(want, out, ahead)
        } else {
            (0, 0)
        };
        if popped > 0 {
            self.fifo_len.fetch_sub(popped, Ordering::Relaxed);
        }
        peeked
    }

    /// Drops stale entries, keeping the order of the valid ones, while holding the gate alone.
    /// Each kept entry is replaced by what `revalidate` returns: the pool moves the block's epoch
    /// on, so any other entry of the same block (possible only once its 32-bit epoch has wrapped)
    /// goes stale and at most one entry per free block remains. No allocation, no panic.
    fn compact_alone(&self, revalidate: &impl Fn(u64) -> Option<u64>) {
        // The stack: take its whole chain of slots, unlink the stale ones and push the rest back
        // as one chain (nothing else pushes or pops meanwhile, and the slots are reused, so the
        // push cannot run out of room).
        let stack = &self.lifo.entries;
        let mut slot = stack.head.load(Ordering::Acquire) as u32;
        let (mut first, mut last) = (NIL, NIL);
        let capacity = self.lifo.capacity();
        let mut seen = 0;
        while slot != NIL && seen < capacity {
            seen += 1;
            let next = stack.next[slot as usize].load(Ordering::Relaxed);
            let payload = &self.lifo.payload[slot as usize];
            match revalidate(payload.load(Ordering::Relaxed)) {
                Some(entry) => {
                    payload.store(entry, Ordering::Relaxed);
                    if last == NIL {
                        first = slot;
                    } else {
                        stack.next[last as usize].store(slot, Ordering::Relaxed);
                    }
                    last = slot;
                }
                None => self.lifo.spare.push(slot),
            }
            slot = next;
        }
        if last != NIL {
            stack.next[last as usize].store(NIL, Ordering::Relaxed);
        }
        let head = stack.head.load(Ordering::Acquire);
        let tag = (head >> 32).wrapping_add(1);
        stack
            .head
            .store((tag << 32) | first as u64, Ordering::Release);
        // The FIFO: keep the valid entries in order (nothing pushes or pops meanwhile).
        let kept = self.fifo.retain_map(revalidate);
        self.fifo_len.store(kept, Ordering::Relaxed);
    }

    /// All entries front to back, stale ones included. Holds the gate alone meanwhile (pushes
    /// and pops wait), so it may be called at any time.
    pub(crate) fn snapshot(&self) -> Vec<u64> {
        let _alone = self.gate.exclusive();
        let mut out = Vec::new();
        let mut slot = self.lifo.entries.head.load(Ordering::Acquire) as u32;
        while slot != NIL && out.len() < self.lifo.capacity() {
            out.push(self.lifo.payload[slot as usize].load(Ordering::Relaxed));
            slot = self.lifo.entries.next[slot as usize].load(Ordering::Relaxed);
        }
        self.fifo.copy_into(&mut out);
        out
    }

    /// Entries physically held (valid and stale).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn physical_len(&self) -> usize {
        self.snapshot().len()
    }
}
