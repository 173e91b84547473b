//! Per-block reference counts and the free order: the lock-free heart of the pool.
//!
//! Each block has one `AtomicU64` packing its reference count (low 32 bits) and an epoch (high 32
//! bits). The epoch moves on every time the block leaves the free order (claimed by an allocation
//! or revived by `touch`), so "revive" and "claim for reuse" race on one CAS from
//! `(ref 0, epoch e)` and exactly one wins; the loser sees a new epoch.
//!
//! `free_count` counts free blocks that nobody has reserved. Allocations reserve first (all or
//! nothing) and then claim that many entries; a revive reserves one unit. A freed block's entry is
//! pushed before its unit is published, so the valid entries in the free order (plus those a
//! claimer has popped and not yet tried) always number at least `free_count` plus the outstanding
//! reservations. Hence a claimer that still needs a block finds at least one valid entry whenever
//! it pops: claims never wait for a block to appear. Each pass of its loop removes at least one
//! entry from the order; it only loops again when an entry it popped was stale or a revive won
//! the block first, that is, when another thread made progress.

use super::alloc::{array_bytes, AllocFailed, PageArray};
use super::free_order::{entry_epoch, entry_id, pack_entry, FreeOrder};
use crate::error::{CoreError, Result};
use crate::sync::{spin_wait, AtomicU64, AtomicUsize, Ordering};
use crate::types::{BlockId, NULL_BLOCK};

#[inline]
fn refs(state: u64) -> u32 {
    state as u32
}

#[inline]
fn epoch(state: u64) -> u32 {
    (state >> 32) as u32
}

#[inline]
fn pack(refs: u32, epoch: u32) -> u64 {
    ((epoch as u64) << 32) | refs as u64
}

pub(crate) struct BlockStates {
    state: PageArray<AtomicU64>,
    free_count: AtomicUsize,
    order: FreeOrder,
}

impl BlockStates {
    /// Block 0 is the null block (never free); blocks `1..num_blocks` start free in id order.
    /// Bytes [`BlockStates::new`] allocates for `num_blocks`.
    pub(crate) fn heap_bytes(num_blocks: usize) -> usize {
        array_bytes::<AtomicU64>(num_blocks).saturating_add(FreeOrder::heap_bytes(num_blocks))
    }

    pub(crate) fn new(num_blocks: usize) -> Result<Self, AllocFailed> {
        Ok(BlockStates {
            state: PageArray::new("reference counts", num_blocks, |_| AtomicU64::new(0))?,
            free_count: AtomicUsize::new(num_blocks.saturating_sub(1)),
            order: FreeOrder::new(num_blocks)?,
        })
    }

    /// A small free order for model checks (compaction after a few pushes).
    #[cfg(loom)]
    pub(crate) fn with_lifo_capacity(num_blocks: usize, lifo_capacity: usize) -> Self {
        BlockStates {
            state: PageArray::new("reference counts", num_blocks, |_| AtomicU64::new(0)).unwrap(),
            free_count: AtomicUsize::new(num_blocks.saturating_sub(1)),
            order: FreeOrder::with_capacity(num_blocks, lifo_capacity, lifo_capacity).unwrap(),
        }
    }

    #[inline]
    pub(crate) fn num_free(&self) -> usize {
        self.free_count.load(Ordering::Acquire)
    }

    /// The state word of block `id`, if it exists.
    #[inline]
    pub(crate) fn cell(&self, id: BlockId) -> Option<&AtomicU64> {
        self.state.get(id as usize)
    }

    #[inline]
    pub(crate) fn ref_count(&self, id: BlockId) -> u32 {
        refs(self.state[id as usize].load(Ordering::Acquire))
    }

    /// Whether a free-order entry still stands for a free block.
    #[inline]
    fn is_valid(state: &[AtomicU64], entry: u64) -> bool {
        state[entry_id(entry) as usize].load(Ordering::Acquire) == pack(0, entry_epoch(entry))
    }

    /// For a compaction: if `entry` still stands for a free block, moves the block's epoch on
    /// (ref stays 0) and returns the entry for the new epoch, so any other entry of the block
    /// goes stale. A revive racing this CAS wins or retries; nothing else changes a free block.
    fn revalidate(state: &[AtomicU64], entry: u64) -> Option<u64> {
        let (id, e) = (entry_id(entry), entry_epoch(entry));
        let next = e.wrapping_add(1);
        state[id as usize]
            .compare_exchange(
                pack(0, e),
                pack(0, next),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .ok()
            .map(|_| pack_entry(id, next))
    }

    /// Reserves `n` free blocks, or reports how many are free. Changes nothing on failure, so a
    /// huge `n` costs nothing.
    pub(crate) fn reserve(&self, n: usize) -> std::result::Result<(), usize> {
        self.free_count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| {
                free.checked_sub(n)
            })
            .map(|_| ())
    }

    /// Claims `n` previously reserved blocks from the front of the free order (ref 0 → 1).
    /// Returns the entries of `ahead` filled: when the claim took FIFO entries, those then
    /// next in it (a hint for prefetching; some may be stale or taken meanwhile).
    pub(crate) fn claim_reserved(
        &self,
        n: usize,
        out: &mut Vec<BlockId>,
        ahead: &mut [u64],
    ) -> usize {
        // `n` was reserved, so it is at most the pool's size.
        let mut claimed = 0;
        let mut peeked = 0;
        out.reserve(n);
        let mut entries = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        while claimed < n {
            entries.clear();
            peeked = self
                .order
                .pop_many(n - claimed, &mut entries, &mut slots, ahead);
            if entries.is_empty() {
                // Not reached: while this claimer holds a reservation the order holds a valid
                // entry (module comment). Yield rather than fail if it ever were.
                spin_wait();
                continue;
            }
            for &entry in &entries {
                let (id, e) = (entry_id(entry), entry_epoch(entry));
                if self.state[id as usize]
                    .compare_exchange(
                        pack(0, e),
                        pack(1, e.wrapping_add(1)),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    out.push(id);
                    claimed += 1;
                }
            }
        }
        peeked
    }

    /// Takes one more reference to `id`, reviving it from the free order if it was free.
    #[cfg(loom)]
    pub(crate) fn acquire(&self, id: BlockId) -> Result<()> {
        let mut units = 0;
        let result = self.acquire_with(id, &mut units);
        self.return_units(units);
        result
    }

    /// Takes one more reference to each block (null blocks skipped). Reserves the free-count
    /// units of the free ones in one step. On error, reports how many leading blocks were taken.
    pub(crate) fn acquire_many(
        &self,
        ids: &[BlockId],
    ) -> std::result::Result<(), (usize, CoreError)> {
        // Within `ids.len()` of the limit, a block may overflow its count: checked before any
        // reference is taken (a revived block's place in the free order cannot be given back).
        let near = (u32::MAX as usize).saturating_sub(ids.len());
        let mut near_limit = false;
        let free = ids
            .iter()
            .filter(|&&id| {
                if id == NULL_BLOCK {
                    return false;
                }
                let refs = self.ref_count(id);
                near_limit |= refs as usize > near;
                refs == 0
            })
            .count();
        if near_limit {
            if let Some(err) = self.first_overflow(ids) {
                return Err((0, err));
            }
        }
        let mut units = if free > 0 && self.reserve(free).is_ok() {
            free
        } else {
            0
        };
        for (k, &id) in ids.iter().enumerate() {
            if id == NULL_BLOCK {
                continue;
            }
            if let Err(err) = self.acquire_with(id, &mut units) {
                self.return_units(units);
                return Err((k, err));
            }
        }
        self.return_units(units);
        Ok(())
    }

    /// Tests: sets the reference count of `id`, a block in use, to `refs` (at least 1), as
    /// that many `touch`es would, without making them.
    #[cfg(test)]
    pub(crate) fn set_ref_count(&self, id: BlockId, refs: u32) {
        let cell = &self.state[id as usize];
        let s = cell.load(Ordering::Acquire);
        assert!(self::refs(s) > 0 && refs > 0, "only blocks in use");
        cell.store(pack(refs, epoch(s)), Ordering::Release);
    }

    /// The overflow taking one more reference to each of `ids` would run into, if any (with
    /// the reference counts as they are now).
    fn first_overflow(&self, ids: &[BlockId]) -> Option<CoreError> {
        let mut taken: std::collections::HashMap<BlockId, usize> = std::collections::HashMap::new();
        for &id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            let n = taken.entry(id).or_insert(0);
            *n += 1;
            let ref_cnt = self.ref_count(id);
            if ref_cnt as usize + *n > u32::MAX as usize {
                return Some(CoreError::RefCountOverflow { id, ref_cnt });
            }
        }
        None
    }

    fn return_units(&self, units: usize) {
        if units > 0 {
            self.free_count.fetch_add(units, Ordering::AcqRel);
        }
    }

    /// `acquire` drawing on (and topping up) a batch of reserved free-count units.
    fn acquire_with(&self, id: BlockId, units: &mut usize) -> Result<()> {
        let cell = &self.state[id as usize];
        let mut s = cell.load(Ordering::Acquire);
        loop {
            if refs(s) == 0 {
                if *units == 0 {
                    if self.reserve(1).is_err() {
                        return Err(CoreError::Evicted(id));
                    }
                    *units = 1;
                }
                match cell.compare_exchange(
                    s,
                    pack(1, epoch(s).wrapping_add(1)),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        *units -= 1;
                        return Ok(());
                    }
                    Err(actual) => s = actual,
                }
            } else {
                if refs(s) == u32::MAX {
                    return Err(CoreError::RefCountOverflow {
                        id,
                        ref_cnt: refs(s),
                    });
                }
                match cell.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok(()),
                    Err(actual) => s = actual,
                }
            }
        }
    }

    /// Drops one reference. Returns the free-order entry to publish when it reached zero.
    pub(crate) fn release(&self, id: BlockId) -> Result<Option<u64>> {
        let cell = &self.state[id as usize];
        let mut s = cell.load(Ordering::Acquire);
        loop {
            if refs(s) == 0 {
                return Err(CoreError::DoubleFree(id));
            }
            match cell.compare_exchange_weak(s, s - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    return Ok((refs(s) == 1).then(|| pack_entry(id, epoch(s))));
                }
                Err(actual) => s = actual,
            }
        }
    }

    /// Publishes released blocks: `front` ahead of everything (given order kept), `back` at the
    /// tail, then makes them available to reservations.
    pub(crate) fn publish(&self, front: &[u64], back: &[u64]) {
        let state = &self.state[..];
        let revalidate = |entry| Self::revalidate(state, entry);
        if !front.is_empty() {
            self.order.push_front(front, revalidate);
        }
        if !back.is_empty() {
            self.order.push_back(back, revalidate);
        }
        self.free_count
            .fetch_add(front.len() + back.len(), Ordering::AcqRel);
    }

    /// Free blocks front to back (pushes and pops wait while it reads the order).
    pub(crate) fn free_order(&self) -> Vec<BlockId> {
        self.order
            .snapshot()
            .into_iter()
            .filter(|&entry| Self::is_valid(&self.state, entry))
            .map(entry_id)
            .collect()
    }

    #[cfg(all(test, not(loom)))]
    pub(crate) fn physical_len(&self) -> usize {
        self.order.physical_len()
    }
}
