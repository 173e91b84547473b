//! The pool's free order: a LIFO stack of uncached frees in front of a FIFO of everything else
//! (vLLM 0.33's `FreeKVCacheBlockQueue` with `prepend_n` / `append_n`).
//!
//! Entries are `(epoch << 32) | block_id`. A block that leaves the free order without being popped
//! (a cached block revived by `touch`) is not searched for: its epoch moves on, so its entry goes
//! stale and is skipped when it reaches the front (lazy invalidation). Both sides are compacted
//! when stale entries pile up.

use crate::sync::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Fifo, Ordering};

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
    next: Box<[AtomicU32]>,
}

impl IndexStack {
    pub(crate) fn new(capacity: usize) -> Self {
        IndexStack {
            head: AtomicU64::new(NIL as u64),
            next: (0..capacity).map(|_| AtomicU32::new(NIL)).collect(),
        }
    }

    /// A stack holding `0..capacity`, 0 on top.
    pub(crate) fn full(capacity: usize) -> Self {
        let stack = Self::new(capacity);
        for i in (0..capacity as u32).rev() {
            stack.push(i);
        }
        stack
    }

    pub(crate) fn push(&self, index: u32) {
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

    pub(crate) fn pop(&self) -> Option<u32> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let index = head as u32;
            if index == NIL {
                return None;
            }
            let next = self.next[index as usize].load(Ordering::Relaxed);
            let tag = (head >> 32).wrapping_add(1);
            match self.head.compare_exchange_weak(
                head,
                (tag << 32) | next as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(index),
                Err(actual) => head = actual,
            }
        }
    }
}

/// LIFO of entries: an index stack of slots holding entries, with a second stack of spare slots.
struct Lifo {
    entries: IndexStack,
    spare: IndexStack,
    payload: Box<[AtomicU64]>,
}

impl Lifo {
    fn new(capacity: usize) -> Self {
        Lifo {
            entries: IndexStack::new(capacity),
            spare: IndexStack::full(capacity),
            payload: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Pushes an entry; `false` when every slot is taken (time to compact).
    fn push(&self, entry: u64) -> bool {
        match self.spare.pop() {
            Some(slot) => {
                self.payload[slot as usize].store(entry, Ordering::Relaxed);
                self.entries.push(slot);
                true
            }
            None => false,
        }
    }

    fn pop(&self) -> Option<u64> {
        let slot = self.entries.pop()?;
        let entry = self.payload[slot as usize].load(Ordering::Relaxed);
        self.spare.push(slot);
        Some(entry)
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
        let (first, last) = self.entries.link(slots).expect("non-empty");
        self.entries.push_chain(first, last);
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
        let (first, last) = self.spare.link(slots).expect("non-empty");
        self.spare.push_chain(first, last);
    }
}

/// The free order. `is_valid(entry)` (supplied by the pool) tells whether an entry still stands
/// for a free block.
pub(crate) struct FreeOrder {
    lifo: Lifo,
    fifo: Fifo,
    fifo_len: AtomicUsize,
    /// FIFO length above which a push compacts.
    fifo_limit: usize,
    compacting: AtomicBool,
}

impl FreeOrder {
    /// An order holding `initial` entries in the FIFO, first to pop first.
    pub(crate) fn new(num_blocks: usize, initial: impl IntoIterator<Item = u64>) -> Self {
        let order = FreeOrder {
            lifo: Lifo::new(2 * num_blocks + 8),
            fifo: Fifo::new(),
            fifo_len: AtomicUsize::new(0),
            fifo_limit: 2 * num_blocks + 8,
            compacting: AtomicBool::new(false),
        };
        for entry in initial {
            order.fifo.push(entry);
            order.fifo_len.fetch_add(1, Ordering::Relaxed);
        }
        order
    }

    /// Puts `entries` at the front, `entries[0]` first to pop.
    pub(crate) fn push_front(&self, entries: &[u64], is_valid: impl Fn(u64) -> bool) {
        let mut slots = Vec::with_capacity(entries.len());
        while !self.lifo.push_many(entries, &mut slots) {
            self.compact(&is_valid);
        }
    }

    /// Puts `entries` at the back, in order.
    pub(crate) fn push_back(&self, entries: &[u64], is_valid: impl Fn(u64) -> bool) {
        // Count before pushing, so a concurrent pop never takes the length below zero.
        let len = self.fifo_len.fetch_add(entries.len(), Ordering::Relaxed) + entries.len();
        for &entry in entries {
            self.fifo.push(entry);
        }
        if len > self.fifo_limit {
            self.compact(&is_valid);
        }
    }

    /// Up to `max` entries from the front (some may be stale: the caller checks and claims).
    pub(crate) fn pop_many(&self, max: usize, out: &mut Vec<u64>, slots: &mut Vec<u32>) {
        let start = out.len();
        self.lifo.pop_many(max, out, slots);
        let mut popped = 0;
        while out.len() - start < max {
            match self.fifo.pop() {
                Some(entry) => {
                    popped += 1;
                    out.push(entry);
                }
                None => break,
            }
        }
        // One update per batch: the length only triggers compaction, and `push_back` counts
        // before it pushes, so the count never drops below the entries actually held.
        if popped > 0 {
            self.fifo_len.fetch_sub(popped, Ordering::Relaxed);
        }
    }

    /// Drops stale entries, keeping the order of the valid ones. Returns at once if another
    /// thread is compacting (after waiting for it to finish, so a caller that needs room gets it).
    pub(crate) fn compact(&self, is_valid: &impl Fn(u64) -> bool) {
        if self
            .compacting
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            while self.compacting.load(Ordering::Acquire) {
                crate::sync::spin_wait();
            }
            return;
        }
        let mut front = Vec::new();
        while let Some(slot) = self.lifo.entries.pop() {
            let entry = self.lifo.payload[slot as usize].load(Ordering::Relaxed);
            self.lifo.spare.push(slot);
            if is_valid(entry) {
                front.push(entry);
            }
        }
        for &entry in front.iter().rev() {
            let pushed = self.lifo.push(entry);
            debug_assert!(pushed, "compacted LIFO must fit");
        }
        let mut back = Vec::new();
        while let Some(entry) = self.fifo.pop() {
            self.fifo_len.fetch_sub(1, Ordering::Relaxed);
            if is_valid(entry) {
                back.push(entry);
            }
        }
        for &entry in &back {
            self.fifo.push(entry);
        }
        self.fifo_len.fetch_add(back.len(), Ordering::Relaxed);
        self.compacting.store(false, Ordering::Release);
    }

    /// All entries front to back, stale ones included. Pops and re-pushes everything, so call it
    /// only while no other thread uses the pool (tests, debugging).
    pub(crate) fn snapshot(&self) -> Vec<u64> {
        let mut front = Vec::new();
        while let Some(entry) = self.lifo.pop() {
            front.push(entry);
        }
        for &entry in front.iter().rev() {
            self.lifo.push(entry);
        }
        let mut back = Vec::new();
        while let Some(entry) = self.fifo.pop() {
            back.push(entry);
        }
        for &entry in &back {
            self.fifo.push(entry);
        }
        front.extend(back);
        front
    }

    /// Entries physically held (valid and stale).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn physical_len(&self) -> usize {
        self.snapshot().len()
    }
}
