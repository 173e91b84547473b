//! The block pool: fixed-size KV blocks with reference counts, an LRU free order, the
//! prefix-cache map and KV events, with vLLM 0.33's semantics and no global lock.
//!
//! Free order (front = next to allocate or evict): blocks freed without a hash are put in front
//! (given order kept, reused first), cached blocks at the back (least recently used first);
//! `touch` takes cached blocks out of the order again. See [`reference::RefBlockPool`] for the
//! same semantics written plainly; the two are compared by a differential test.
//!
//! # Progress: what is lock-free and what waits
//!
//! Lock-free (a thread retries only when another thread's atomic step succeeded):
//! - reference counts: `touch` (whose one failure, under a race with allocations that took
//!   every free block, frees what it took), `ref_count`, the validation and releases of
//!   `free_blocks`, and the reservation of `get_new_blocks` (one CAS loop on the free counter,
//!   all or nothing);
//! - the claim of reserved blocks (revive and claim race on one CAS per block; exactly one
//!   wins) and the stack of uncached frees (a tagged Treiber stack, one CAS per batch);
//! - key slots (`cache_full_blocks` and evictions never wait on a key slot being written or
//!   cleared by another thread: it is skipped), except as below for a block's second key.
//!
//! Not lock-free:
//! - The free order's gate. The pushes of `free_blocks` and the pops of `get_new_blocks` pass
//!   a gate that a compaction closes: while stale entries are compacted away (when the stack
//!   is full, or the FIFO of cached frees passes `2 × num_blocks + 8` entries) frees and claims
//!   wait. `free_order` takes the gate alone too.
//! - The FIFO of cached frees is a deque behind a mutex, held for one batch's copy (a free
//!   appends its cached blocks at once, a claim takes what it needs at once); nothing else is
//!   locked while it is held.
//! - The prefix-cache map. With caching on, `cache_full_blocks`, `get_new_blocks` (which evicts
//!   the keys of the cached blocks it reuses), `evict_blocks` and `reset_prefix_cache` take a
//!   per-shard spin lock (up to 256 shards; no global lock). Lookups (`lookup`,
//!   `get_cached_block`) take no lock and write no shared memory; they retry while a writer of
//!   their shard is mid-update.
//! - Second keys of a block (`add_block_key` on a block that has a key: vLLM's partial
//!   prompt-tail keys). They live in a table behind a mutex, taken only for blocks that have
//!   such keys (a flag per block says which). While a thread adds one, the block's key slot is
//!   held: an eviction or reset of that block waits for the add (one table insert and one map
//!   insert) to finish, so it removes the new key with the others.
//!
//! Progress. Nothing in the pool waits while holding something another waiter needs, and every
//! wait is for a bounded piece of work by a thread that is not itself waiting: a compaction waits
//! for the pushes and pops already inside the gate (each a few CAS loops and at most one hold
//! of the FIFO's mutex, for a copy); pushes and pops wait for one compaction (one pass over at most `stack capacity + FIFO length`
//! entries, no allocation); a shard's writers and readers wait for one probe sequence or one
//! table doubling. Retries happen only after another thread's step succeeded: a CAS loop retries
//! when another CAS won, a lookup when a writer entered its shard, a claim when an entry it
//! popped was stale or had just been revived. So the pool as a whole always makes progress (no
//! deadlock, no livelock) while its threads are scheduled, and a call can only keep waiting or
//! retrying while other calls keep completing. A claim that has reserved its blocks never waits
//! for blocks to appear (the counting argument in `states.rs`); its only wait is at the gate.
//! Waits at the gate and the shard locks yield the CPU (`std::thread::yield_now`); a wait for
//! the FIFO's mutex may park in the kernel (std's futex mutex). Either way a thread preempted
//! inside a compaction, a shard update or a FIFO copy delays the others until it runs again.
//!
//! Each method is atomic on its own; a sequence of them is not. In particular a `lookup`
//! followed by `touch` can race an allocation that claims the block in between (its key is
//! evicted just after the claim), and the `touch` then takes a reference to the new owner's
//! block. The manager makes hits and allocations under one lock; direct users of the pool who
//! take prefix hits from several threads must do the same.
//!
//! # Failing frees
//!
//! `free_blocks` validates the whole batch before releasing anything: every block must have at
//! least as many references as the batch lists it (a double free changes nothing). A reference
//! a caller holds cannot be dropped by another thread, so a batch of references the caller holds
//! always passes and is released in full. The only failure left after validation is a block
//! the caller does not hold whose holders free it meanwhile (a double free racing the real
//! frees, which no check can prevent); then every other block of the batch is still released,
//! the block that reached zero is reported as `DoubleFree`, and no count is ever undone, so no
//! block gets two owners and the free counter stays exact.
//!
//! The manager frees the blocks its requests' tables hold with `free_held`: no validation pass
//! (those references are its own), and a request's groups released in one publication, in the
//! free order one `free_blocks` per group would give. A block found at zero there can only be
//! one someone else freed without holding it; it is reported the same way.
//!
//! # Memory
//!
//! Every per-block array (reference counts, key slots, map tables, the free-order stack) is
//! allocated fallibly: a pool too large for the memory available is
//! [`CoreError::OutOfMemory`] naming the array and its size. No count a caller passes
//! (`get_new_blocks(n)`) sizes an allocation before it is checked against the free blocks, and
//! no buffer a method allocates is larger than the pool or than an input slice the caller holds.
//! Frees fill buffers each thread keeps between frees (four, of at most 256 KB each once a free
//! is done), so that a free allocates only when it is larger than the frees before it.

pub(crate) mod alloc;
mod free_order;
mod map;
pub mod reference;
pub(crate) mod states;

use crate::error::{CoreError, Result};
use crate::sync::{spin_wait, AtomicU32, AtomicU64, AtomicU8, Mutex, MutexGuard, Ordering};
use crate::types::{
    BlockHash, BlockId, CacheKey, EventKey, GroupId, KvEvent, StoreInfo, NULL_BLOCK,
};
use alloc::AllocFailed;
use crossbeam_queue::SegQueue;
use free_order::entry_id;
use map::CacheMap;
use states::BlockStates;
use std::collections::HashMap;

pub use crate::types::MAX_BLOCKS;

/// How many keys (or blocks) ahead of a walk over the prefix-cache map (or a free's validation)
/// its accesses are prefetched: the map and the per-block arrays of a large pool are larger than
/// the CPU caches, and prefetches let the accesses overlap.
pub const PREFETCH_AHEAD: usize = 8;

/// FIFO entries a claim that reaches the FIFO reads ahead of what it takes, for the
/// prefetch hints of the claims after it.
const PEEK_AHEAD: usize = 4;

/// Table slots a free checks for null blocks at once: a sliding-window or chunked-local group's
/// table holds a null block in every slot behind its window, most of a long request's table.
const NULL_RUN: usize = 16;

/// Buckets of the bitmap `free_blocks` validates with (ids 4096 apart share one).
const BUCKETS: usize = 4096;
const _: () = assert!(BUCKETS.is_power_of_two() && BUCKETS % 64 == 0);

// A block's cache-key slot: written only by whoever moves it out of `KEY_NONE` (or `KEY_SET`),
// so the three words are never read while being written.
const KEY_NONE: u32 = 0;
const KEY_WRITING: u32 = 1;
const KEY_SET: u32 = 2;
const KEY_CLEARING: u32 = 3;
/// Set, and held by a thread adding a key beside it (`add_block_key`): readable, and taken
/// only once the hold ends.
const KEY_HELD: u32 = 4;

struct KeySlot {
    state: AtomicU32,
    group: AtomicU32,
    lo: AtomicU64,
    hi: AtomicU64,
    /// The prefix length the key covers (vLLM's `block_hash_num_tokens`), written with it.
    tokens: AtomicU32,
}

impl KeySlot {
    fn new() -> Self {
        KeySlot {
            state: AtomicU32::new(KEY_NONE),
            group: AtomicU32::new(0),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
            tokens: AtomicU32::new(0),
        }
    }

    /// Sets the key if the block has none; `false` if it already has one or `publish` refuses
    /// (the map had no room). `publish` runs before the key can be taken again, so a map entry is
    /// inserted before it can be removed. `tokens` is the prefix length the key covers.
    fn set(
        &self,
        key: CacheKey,
        tokens: u32,
        mark: Marker<'_>,
        publish: impl FnOnce(CacheKey) -> bool,
    ) -> bool {
        if self
            .state
            .compare_exchange(KEY_NONE, KEY_WRITING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        mark.set();
        let (lo, hi) = key.hash.to_parts();
        self.lo.store(lo, Ordering::Relaxed);
        self.hi.store(hi, Ordering::Relaxed);
        self.group.store(key.group, Ordering::Relaxed);
        self.tokens.store(tokens, Ordering::Relaxed);
        if !publish(key) {
            mark.clear();
            self.state.store(KEY_NONE, Ordering::Release);
            return false;
        }
        self.state.store(KEY_SET, Ordering::Release);
        true
    }

    /// Takes the key out (exclusive: one caller gets it). `done` runs before the slot is free
    /// again, so a key is removed from the map before the block can be given a new one.
    ///
    /// A held key is waited for: the hold is one insert into the table of added keys and the map,
    /// by a thread that waits for nothing this thread holds.
    fn take(&self, mark: Marker<'_>, done: impl FnOnce(CacheKey, u32)) -> bool {
        loop {
            match self.state.load(Ordering::Relaxed) {
                KEY_SET => {}
                KEY_HELD => {
                    spin_wait();
                    continue;
                }
                _ => return false,
            }
            match self.state.compare_exchange(
                KEY_SET,
                KEY_CLEARING,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(KEY_HELD) => spin_wait(),
                Err(_) => return false,
            }
        }
        done(self.read(), self.tokens.load(Ordering::Relaxed));
        mark.clear();
        self.state.store(KEY_NONE, Ordering::Release);
        true
    }

    /// Holds a set key for the caller alone (`KEY_SET` → `KEY_HELD`) so that keys can be
    /// added beside it; `Err` with the slot's state if it is not set. Until [`KeySlot::unhold`]
    /// the key cannot be taken, so whatever is added beside it is removed with it later.
    fn hold(&self) -> std::result::Result<CacheKey, u32> {
        self.state
            .compare_exchange(KEY_SET, KEY_HELD, Ordering::Acquire, Ordering::Relaxed)
            .map(|_| self.read())
    }

    fn unhold(&self) {
        self.state.store(KEY_SET, Ordering::Release);
    }

    fn read(&self) -> CacheKey {
        CacheKey {
            hash: BlockHash::from_parts(
                self.lo.load(Ordering::Relaxed),
                self.hi.load(Ordering::Relaxed),
            ),
            group: self.group.load(Ordering::Relaxed),
        }
    }

    fn get(&self) -> Option<CacheKey> {
        matches!(self.state.load(Ordering::Acquire), KEY_SET | KEY_HELD).then(|| self.read())
    }

    fn get_tokens(&self) -> Option<u32> {
        matches!(self.state.load(Ordering::Acquire), KEY_SET | KEY_HELD)
            .then(|| self.tokens.load(Ordering::Relaxed))
    }
}

/// One flag byte per block, set while its key slot is not `KEY_NONE` (written, set or being
/// cleared): what a free reads to put a block at the back (cached) or in front. A free reads a
/// byte among those of 63 other blocks instead of the block's 32-byte slot, so a request's free
/// touches a few cache lines of flags rather than one slot line per block.
///
/// The flag changes just after a slot leaves `KEY_NONE` and just before it returns to it, by
/// the thread that owns the slot's transition, and by no other: a plain store (a byte per
/// block, not a bit: bits shared by 64 blocks would each need a locked read-modify-write).
/// So a thread sees the flag as it would see "the slot is not `KEY_NONE`" after any call it
/// made or synchronized with; a free racing a concurrent keying or eviction of the same block
/// reads one side of it, as a read of the slot would.
struct KeyedFlags(alloc::PageArray<AtomicU8>);

/// The flag of one block, for the slot's transitions to set or clear.
#[derive(Clone, Copy)]
struct Marker<'a>(&'a AtomicU8);

impl Marker<'_> {
    fn set(self) {
        self.0.store(1, Ordering::Release);
    }

    fn clear(self) {
        self.0.store(0, Ordering::Release);
    }
}

impl KeyedFlags {
    fn new(num_blocks: usize) -> Result<Self, AllocFailed> {
        Ok(KeyedFlags(alloc::PageArray::new(
            "cached-block flags",
            num_blocks,
            |_| AtomicU8::new(0),
        )?))
    }

    #[inline]
    fn marker(&self, id: BlockId) -> Marker<'_> {
        Marker(&self.0[id as usize])
    }

    #[inline]
    fn get(&self, id: BlockId) -> bool {
        self.0[id as usize].load(Ordering::Acquire) != 0
    }
}

/// What a free fills before it publishes: the entries that go in front and at the back of the
/// free order, and for a free in batches where each batch starts and the reordered front. Each
/// thread reuses its own between frees (a free of a long request's blocks would otherwise
/// allocate and free tens of KB each time): plain memory no other thread sees. A free made
/// while another of the same thread is inside (none is today) gets fresh buffers, and so does
/// every free under loom, whose model threads share one OS thread.
#[derive(Default)]
struct FreeBuffers {
    front: Vec<u64>,
    back: Vec<u64>,
    starts: Vec<usize>,
    ordered: Vec<u64>,
}

/// Entries each of a thread's buffers keeps room for between frees (256 KB).
#[cfg(not(loom))]
const KEEP_FREE_ENTRIES: usize = 1 << 15;

#[cfg(not(loom))]
std::thread_local! {
    static FREE_BUFFERS: std::cell::Cell<FreeBuffers> = std::cell::Cell::default();
}

impl FreeBuffers {
    /// Runs `f` with this thread's buffers, empty; empties them again afterwards.
    #[inline]
    fn with<R>(f: impl FnOnce(&mut FreeBuffers) -> R) -> R {
        #[cfg(not(loom))]
        {
            let mut bufs = FREE_BUFFERS
                .try_with(std::cell::Cell::take)
                .unwrap_or_default();
            let result = f(&mut bufs);
            bufs.clear();
            let _ = FREE_BUFFERS.try_with(|cell| cell.set(bufs));
            result
        }
        #[cfg(loom)]
        f(&mut FreeBuffers::default())
    }

    #[cfg(not(loom))]
    fn clear(&mut self) {
        fn keep<T>(v: &mut Vec<T>) {
            v.clear();
            v.shrink_to(KEEP_FREE_ENTRIES);
        }
        keep(&mut self.front);
        keep(&mut self.back);
        keep(&mut self.starts);
        keep(&mut self.ordered);
    }
}

/// A pool of `num_blocks` KV blocks, block 0 being the null block. `Send + Sync`: every method
/// takes `&self` and may be called from any thread.
pub struct BlockPool {
    num_blocks: usize,
    enable_caching: bool,
    states: BlockStates,
    keys: alloc::PageArray<KeySlot>,
    keyed: KeyedFlags,
    map: CacheMap,
    /// The keys a block holds besides the one in its slot (vLLM's
    /// `cached_block_hashes_by_block`), in the order they were added. Only blocks whose flag in
    /// `multi` is set have an entry, so blocks with one key never take the mutex. Entries are
    /// added while the block's slot is held ([`KeySlot::hold`]) and removed while it is being
    /// cleared, so they never outlive the key in the slot.
    secondary: Mutex<HashMap<BlockId, Vec<CacheKey>>>,
    multi: KeyedFlags,
    events: Option<SegQueue<KvEvent>>,
    /// With events on: held by the calls that key blocks (`cache_full_blocks`,
    /// `add_block_key`) or take keys off blocks in use (`evict_blocks`, `reset_prefix_cache`)
    /// from their first key change to their event, so their events queue in the order their
    /// changes took effect (a `BlockRemoved` never ahead of the `BlockStored` of its key). An
    /// allocation's evictions need not take it: the blocks it reuses are free, and keys go only
    /// on blocks in use.
    event_order: Mutex<()>,
    /// Blocks whose keys were taken off so far (see [`BlockPool::key_removals`]).
    key_removals: AtomicU64,
}

impl BlockPool {
    /// A pool with prefix caching on and KV events off.
    pub fn new(num_blocks: usize) -> Result<Self> {
        Self::with_options(num_blocks, true, false)
    }

    pub fn with_options(
        num_blocks: usize,
        enable_caching: bool,
        enable_events: bool,
    ) -> Result<Self> {
        if num_blocks < 1 {
            return Err(CoreError::PoolTooSmall(num_blocks));
        }
        if num_blocks > MAX_BLOCKS {
            return Err(CoreError::PoolTooLarge(num_blocks));
        }
        let oom = |e: AllocFailed| CoreError::OutOfMemory {
            what: e.what,
            bytes: e.bytes,
            num_blocks,
        };
        // All arrays at once first: a pool far beyond the memory available is refused before
        // any of them is written (each is checked again as it is allocated).
        let arrays = Self::heap_bytes(num_blocks, enable_caching);
        if !alloc::fits(arrays) {
            return Err(oom(AllocFailed {
                what: "per-block arrays",
                bytes: arrays,
            }));
        }
        Ok(BlockPool {
            num_blocks,
            enable_caching,
            states: BlockStates::new(num_blocks).map_err(oom)?,
            keys: alloc::PageArray::new("cache-key slots", num_blocks, |_| KeySlot::new())
                .map_err(oom)?,
            keyed: KeyedFlags::new(num_blocks).map_err(oom)?,
            map: CacheMap::with_capacity(if enable_caching { num_blocks } else { 0 })
                .map_err(oom)?,
            secondary: Mutex::new(HashMap::new()),
            multi: KeyedFlags::new(num_blocks).map_err(oom)?,
            events: enable_events.then(SegQueue::new),
            event_order: Mutex::new(()),
            key_removals: AtomicU64::new(0),
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes of the per-block arrays a pool of `num_blocks` allocates (at least: what does not
    /// grow with the pool is left out).
    pub(crate) fn heap_bytes(num_blocks: usize, enable_caching: bool) -> usize {
        let keys = alloc::array_bytes::<KeySlot>(num_blocks);
        let map = if enable_caching {
            CacheMap::heap_bytes(num_blocks)
        } else {
            0
        };
        BlockStates::heap_bytes(num_blocks)
            .saturating_add(keys)
            .saturating_add(map)
            .saturating_add(2 * alloc::array_bytes::<AtomicU8>(num_blocks))
    }

    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Whether KV events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Free blocks, cached-but-unused ones included; the null block never counts.
    pub fn num_free_blocks(&self) -> usize {
        self.states.num_free()
    }

    /// Fraction of the usable blocks in use (vLLM's `get_usage`).
    pub fn usage(&self) -> f64 {
        if self.num_blocks <= 1 {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f64 / (self.num_blocks - 1) as f64
    }

    /// Number of `(hash, group)` keys in the prefix cache.
    pub fn num_cached_keys(&self) -> usize {
        self.map.len()
    }

    fn check_id(&self, id: BlockId) -> Result<()> {
        if (id as usize) < self.num_blocks {
            Ok(())
        } else {
            Err(CoreError::InvalidBlockId {
                id: id as i64,
                num_blocks: self.num_blocks,
            })
        }
    }

    fn check_ids(&self, ids: &[BlockId]) -> Result<()> {
        ids.iter().try_for_each(|&id| self.check_id(id))
    }

    pub fn ref_count(&self, id: BlockId) -> Result<u32> {
        self.check_id(id)?;
        Ok(self.states.ref_count(id))
    }

    /// The cached flag a free reads (tests check it against the key slot).
    #[cfg(test)]
    pub(crate) fn keyed_flag(&self, id: BlockId) -> bool {
        self.keyed.get(id)
    }

    /// The key a block is cached under, if any.
    pub fn block_key(&self, id: BlockId) -> Result<Option<CacheKey>> {
        self.check_id(id)?;
        Ok(self.keys[id as usize].get())
    }

    /// The prefix length, in tokens, that the key in the block's slot covers (vLLM's
    /// `block_hash_num_tokens`): `(first_block + i + 1) * block_size` of the [`StoreInfo`] it
    /// was cached with, carried along when its keys move. `None` for a block without a key.
    pub fn block_key_tokens(&self, id: BlockId) -> Result<Option<usize>> {
        self.check_id(id)?;
        Ok(self.keys[id as usize].get_tokens().map(|t| t as usize))
    }

    /// Every key a block is cached under: the one in its slot first, then those added beside it
    /// ([`BlockPool::add_block_key`]) in the order they were added.
    pub fn block_keys(&self, id: BlockId) -> Result<Vec<CacheKey>> {
        let mut keys: Vec<CacheKey> = self.block_key(id)?.into_iter().collect();
        if !keys.is_empty() && self.multi.get(id) {
            if let Some(more) = self.secondary_keys().get(&id) {
                keys.extend_from_slice(more);
            }
        }
        Ok(keys)
    }

    /// The table of keys beside the slots. Nothing run under its mutex panics (short of running
    /// out of memory), so a poisoned mutex still holds a consistent table.
    fn secondary_keys(&self) -> crate::sync::MutexGuard<'_, HashMap<BlockId, Vec<CacheKey>>> {
        self.secondary.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `n` blocks from the front of the free order, evicting their cache entries.
    /// All or nothing: when fewer than `n` are free, nothing changes (and nothing is allocated,
    /// whatever `n` is).
    pub fn get_new_blocks(&self, n: usize) -> Result<Vec<BlockId>> {
        // No capacity before the reservation: `n` is the caller's and may be anything.
        let mut out = Vec::new();
        self.get_new_blocks_into(n, &mut out)?;
        Ok(out)
    }

    /// [`BlockPool::get_new_blocks`] appending to `out`.
    pub fn get_new_blocks_into(&self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // Reserve before sizing anything by `n`: a reservation bounds `n` by the free blocks.
        self.states
            .reserve(n)
            .map_err(|free| CoreError::NotEnoughFreeBlocks { requested: n, free })?;
        let start = out.len();
        // No hint under loom: the reads would add interleavings for nothing.
        let mut ahead = [0u64; PEEK_AHEAD];
        let peek = if cfg!(loom) { 0 } else { PEEK_AHEAD };
        let peeked = self.states.claim_reserved(n, out, &mut ahead[..peek]);
        if self.enable_caching {
            // Reused cached blocks lose their keys: each a key slot and a map slot, both cold
            // in a large pool. The key slots load `2 * PREFETCH_AHEAD` blocks ahead, the map
            // slots (whose place needs the key) `PREFETCH_AHEAD` ahead.
            let claimed = &out[start..];
            let mut evicted = 0;
            for (k, &id) in claimed.iter().enumerate() {
                if let Some(&far) = claimed.get(k + 2 * PREFETCH_AHEAD) {
                    self.prefetch_key_slot(far);
                }
                if let Some(&ahead) = claimed.get(k + PREFETCH_AHEAD) {
                    self.prefetch_key_home(ahead);
                }
                evicted += u64::from(self.evict_key(id, true));
            }
            self.count_key_removals(evicted);
        }
        // The next claims (often the next request's, one block each) take the entries now at
        // the FIFO's front: start loading their state words and key slots, and the map slot of
        // the first, whose key slot the previous claim's hint has usually loaded.
        for (k, &entry) in ahead[..peeked].iter().enumerate() {
            let id = entry_id(entry);
            self.prefetch_block(id);
            if self.enable_caching {
                if k == 0 {
                    self.prefetch_key_home(id);
                } else {
                    self.prefetch_key_slot(id);
                }
            }
        }
        Ok(())
    }

    /// Drops one reference to each block (null blocks skipped). Blocks that reach zero join the
    /// free order: uncached ones in front in the given order, cached ones at the back.
    ///
    /// A double free (a block listed more often than it is referenced) is an error and changes
    /// nothing: the whole batch is validated before anything is released. A batch of references
    /// the caller holds always passes. See the module docs for the one race validation cannot
    /// see (freeing a block the caller does not hold while its holders free it).
    pub fn free_blocks(&self, ordered: &[BlockId]) -> Result<()> {
        self.check_ids(ordered)?;
        self.check_releasable(ordered)?;
        // Validated: released as one batch of held references.
        self.free_held(ordered, &[ordered.len()])
    }

    /// Drops one reference to `id` (not the null block); if that was the last, queues its
    /// free-order entry: at the back if the block is cached, in front otherwise. A block found
    /// at zero is kept in `failed` (the first one): only when a caller frees a reference it does
    /// not hold while its holders free it. Nothing released is undone then (an undo could give
    /// a block that another thread freed and reallocated meanwhile a second owner).
    #[inline(always)]
    fn release_one(
        &self,
        id: BlockId,
        front: &mut Vec<u64>,
        back: &mut Vec<u64>,
        failed: &mut Option<CoreError>,
    ) {
        match self.states.release(id) {
            Ok(None) => {}
            Ok(Some(entry)) if self.enable_caching && self.keyed.get(id) => back.push(entry),
            Ok(Some(entry)) => front.push(entry),
            Err(err) => {
                failed.get_or_insert(err);
            }
        }
    }

    /// [`BlockPool::free_blocks`] of references the caller holds (a request's block table), in
    /// batches: `blocks[..ends[0]]`, then `blocks[ends[0]..ends[1]]`, and so on, each in its
    /// given order. The free order ends as calls of `free_blocks` on each batch in turn would
    /// leave it (a later batch's uncached blocks ahead of an earlier one's, cached ones after
    /// them), and the blocks become available to allocations at once.
    ///
    /// No validation pass: a reference the caller holds cannot reach zero under it. A block
    /// found without references (someone freed a reference they did not hold) is reported as
    /// `DoubleFree` after every other block is released, as `free_blocks` does for that race.
    /// Ids must be in range (the manager's tables only hold the pool's ids).
    pub(crate) fn free_held(&self, blocks: &[BlockId], ends: &[usize]) -> Result<()> {
        debug_assert!(ends.windows(2).all(|w| w[0] <= w[1]));
        debug_assert_eq!(ends.last().copied().unwrap_or(0), blocks.len());
        let batches = ends.iter().scan(0, |start, &end| {
            let batch = &blocks[*start..end];
            *start = end;
            Some(batch)
        });
        self.release_batches::<false>(batches, blocks.len())
    }

    /// [`BlockPool::free_held`] of batches each freed last block first (a request's block tables,
    /// tail first, group after group), read where they are: `listed` is their total length.
    pub(crate) fn free_held_tail_first<'a>(
        &self,
        batches: impl Iterator<Item = &'a [BlockId]>,
        listed: usize,
    ) -> Result<()> {
        self.release_batches::<true>(batches, listed)
    }

    /// The release of [`BlockPool::free_held`], each batch walked from its end if `TAIL_FIRST`.
    fn release_batches<'a, const TAIL_FIRST: bool>(
        &self,
        batches: impl Iterator<Item = &'a [BlockId]>,
        listed: usize,
    ) -> Result<()> {
        let most = listed.min(self.num_blocks);
        FreeBuffers::with(|bufs| {
            let FreeBuffers {
                front,
                back,
                starts,
                ordered,
            } = bufs;
            // At most one entry per distinct block reaches zero; the buffers keep their room
            // between frees, so this allocates only for a free larger than those before.
            front.reserve(most);
            back.reserve(most);
            let mut failed = None;
            for batch in batches {
                // Where this batch's uncached entries start in `front`.
                starts.push(front.len());
                let n = batch.len();
                let at = |k: usize| {
                    if TAIL_FIRST {
                        batch[n - 1 - k]
                    } else {
                        batch[k]
                    }
                };
                for k in 0..n.min(PREFETCH_AHEAD) {
                    self.prefetch_block(at(k));
                }
                let mut k = 0;
                while k < n {
                    // A window group's table is mostly null blocks: skip them a run at a time.
                    if k + NULL_RUN <= n {
                        let run = if TAIL_FIRST {
                            &batch[n - k - NULL_RUN..n - k]
                        } else {
                            &batch[k..k + NULL_RUN]
                        };
                        if run.iter().fold(0, |any, &id| any | (id ^ NULL_BLOCK)) == 0 {
                            k += NULL_RUN;
                            continue;
                        }
                    }
                    for k in k..n.min(k + NULL_RUN) {
                        if k + PREFETCH_AHEAD < n {
                            self.prefetch_block(at(k + PREFETCH_AHEAD));
                        }
                        let id = at(k);
                        if id == NULL_BLOCK {
                            continue;
                        }
                        self.release_one(id, front, back, &mut failed);
                    }
                    k += NULL_RUN;
                }
            }
            let front = if starts.len() > 1 {
                // Later batches go in front of earlier ones.
                ordered.reserve(front.len());
                let mut end = front.len();
                for &s in starts.iter().rev() {
                    ordered.extend_from_slice(&front[s..end]);
                    end = s;
                }
                &ordered[..]
            } else {
                &front[..]
            };
            self.states.publish(front, back);
            failed.map_or(Ok(()), Err)
        })
    }

    /// Every non-null block of `ids` has at least as many references as `ids` lists it;
    /// otherwise `DoubleFree` of the block whose count runs out first in batch order (as a
    /// sequential release would report). Allocates only for a large batch (at most 32 bytes per
    /// listed block) or when blocks may repeat.
    fn check_releasable(&self, ids: &[BlockId]) -> Result<()> {
        // One pass: every block is referenced, and no bit of a bitmap is hit twice. If one is, a
        // block may be listed twice: count exactly. A batch listing at least one block per 256
        // of the pool gets a bit per block, so only a real repeat sends it to the count (a
        // request's thousands of blocks would fill every bucket); smaller ones a bit per bucket
        // (block id modulo BUCKETS), on the stack.
        let words = self.num_blocks.div_ceil(64);
        let exact = self.num_blocks > BUCKETS && words <= 4 * ids.len();
        let mut buckets = [0u64; BUCKETS / 64];
        let mut per_block = Vec::new();
        let (seen, mask) = if exact {
            per_block.resize(words, 0u64);
            (&mut per_block[..], usize::MAX)
        } else {
            (&mut buckets[..], BUCKETS - 1)
        };
        let mut repeats = false;
        let mut first_bad = None;
        let mut limit = ids.len();
        for (k, &id) in ids.iter().enumerate() {
            if let Some(&ahead) = ids.get(k + PREFETCH_AHEAD) {
                self.prefetch_block(ahead);
            }
            if id == NULL_BLOCK {
                continue;
            }
            if self.states.ref_count(id) == 0 {
                first_bad = Some((k, id));
                limit = k;
                break;
            }
            let bit = id as usize & mask;
            let (word, bit) = (&mut seen[bit / 64], 1u64 << (bit % 64));
            repeats |= *word & bit != 0;
            *word |= bit;
        }
        if repeats {
            self.check_repeats(&ids[..limit], &mut first_bad);
        }
        match first_bad {
            Some((_, id)) => Err(CoreError::DoubleFree(id)),
            None => Ok(()),
        }
    }

    /// For blocks that may be listed more than once in `ids` (all referenced): the position
    /// where a block is listed once more than its count, if before `first_bad`.
    #[cold]
    fn check_repeats(&self, ids: &[BlockId], first_bad: &mut Option<(usize, BlockId)>) {
        let bucket = |id: BlockId| (id as usize % BUCKETS / 64, 1u64 << (id as usize % 64));
        let (mut seen, mut twice) = ([0u64; BUCKETS / 64], [0u64; BUCKETS / 64]);
        for &id in ids.iter().filter(|&&id| id != NULL_BLOCK) {
            let (word, mask) = bucket(id);
            if seen[word] & mask != 0 {
                twice[word] |= mask;
            }
            seen[word] |= mask;
        }
        // Positions of the blocks in buckets hit twice, sorted by block: for each block, its
        // (count + 1)-th listing is where a sequential release would fail.
        let mut maybe: Vec<(BlockId, usize)> = ids
            .iter()
            .enumerate()
            .filter(|&(_, &id)| {
                let (word, mask) = bucket(id);
                id != NULL_BLOCK && twice[word] & mask != 0
            })
            .map(|(k, &id)| (id, k))
            .collect();
        maybe.sort_unstable();
        for run in maybe.chunk_by(|a, b| a.0 == b.0) {
            let refs = self.states.ref_count(run[0].0) as usize;
            if let Some(&(id, k)) = run.get(refs) {
                if first_bad.is_none_or(|(bad, _)| k < bad) {
                    *first_bad = Some((k, id));
                }
            }
        }
    }

    /// Takes one more reference to each block (null blocks skipped), reviving free cached blocks
    /// out of the free order.
    pub fn touch(&self, blocks: &[BlockId]) -> Result<()> {
        self.check_ids(blocks)?;
        if let Err((k, err)) = self.states.acquire_many(blocks) {
            // Only under a race with allocations that took every free block (a count that would
            // overflow is refused before anything is taken): give back what this call took.
            self.free_blocks(&blocks[..k])?;
            return Err(err);
        }
        Ok(())
    }

    /// Enters `blocks[i]` into the prefix cache under `(hashes[i], group)`, covering a prefix of
    /// `(info.first_block + i + 1) * info.block_size` tokens ([`BlockPool::block_key_tokens`]).
    /// Null blocks and blocks that already carry a hash are skipped. Every non-null block must
    /// be in use.
    pub fn cache_full_blocks(
        &self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        group: GroupId,
        info: StoreInfo<'_>,
    ) -> Result<()> {
        if blocks.len() != hashes.len() {
            return Err(CoreError::LengthMismatch {
                blocks: blocks.len(),
                hashes: hashes.len(),
            });
        }
        self.check_ids(blocks)?;
        if self.enable_caching && !cfg!(loom) {
            // The first blocks' map slots, key slots and state words are loaded together (a
            // decode step caches one block, whose lines are cold by then); the loop below
            // loads the later ones `PREFETCH_AHEAD` blocks ahead.
            // Null blocks (masked by sparse retention) are never keyed: nothing to load.
            let keyed = blocks
                .iter()
                .zip(hashes)
                .filter(|(&id, _)| id != NULL_BLOCK);
            for (&id, &hash) in keyed.take(PREFETCH_AHEAD) {
                self.prefetch_lookup(hash, group);
                self.prefetch_block(id);
                if let Some(slot) = self.keys.get(id as usize) {
                    crate::sync::prefetch(slot);
                }
            }
        }
        if let Some(&id) = blocks
            .iter()
            .find(|&&id| id != NULL_BLOCK && self.states.ref_count(id) == 0)
        {
            return Err(CoreError::NotInUse(id));
        }
        if !self.enable_caching {
            return Ok(());
        }
        let events = self.events.as_ref();
        // The caller's extra keys, read before any lock is taken or any key set: the callback
        // may call into the pool (the event-order lock is not reentrant) or panic (nothing has
        // changed yet).
        let mut block_keys: Vec<Option<Vec<EventKey>>> = match (events, info.block_extra_keys) {
            (Some(_), Some(f)) => blocks
                .iter()
                .enumerate()
                .map(|(i, &id)| if id == NULL_BLOCK { None } else { f(i) })
                .collect(),
            _ => Vec::new(),
        };
        let _order = self.order_events();
        let mut stored = Vec::new();
        let mut extra_keys = Vec::new();
        let mut block_indices = Vec::new();
        for (i, (&id, &hash)) in blocks.iter().zip(hashes).enumerate() {
            if let Some(&ahead) = hashes.get(i + PREFETCH_AHEAD) {
                let ahead_id = blocks[i + PREFETCH_AHEAD];
                if ahead_id != NULL_BLOCK {
                    self.prefetch_lookup(ahead, group);
                    if let Some(slot) = self.keys.get(ahead_id as usize) {
                        crate::sync::prefetch(slot);
                    }
                }
            }
            if id == NULL_BLOCK {
                continue;
            }
            let key = CacheKey { hash, group };
            let tokens = info.key_tokens(i);
            if self.keys[id as usize].set(key, tokens, self.keyed.marker(id), |key| {
                self.map.insert(key, id)
            }) && events.is_some()
            {
                stored.push(hash);
                extra_keys.push(block_keys.get_mut(i).and_then(Option::take));
                block_indices.push(info.first_block.saturating_add(i));
            }
        }
        if let Some(events) = events {
            // vLLM publishes an event for every call that had blocks to cache, even when all of
            // them were null or masked.
            if !blocks.is_empty() {
                events.push(info.stored_event(group, stored, extra_keys, block_indices));
            }
        }
        Ok(())
    }

    /// Enters a block already in the cache under one more key, `(hash, group)` (vLLM's
    /// `cache_partial_block`: a full-attention block larger than the hash block is also keyed
    /// at the prompt's last hash boundary inside it). A block without a key gets this one as
    /// its key. Returns whether the key was added: not for the null block, nor when the block
    /// already has it, caching is off or the map has no room. A concurrent change of the
    /// block's key (set, eviction, another added key) is waited for: each is a bounded step of a
    /// thread that waits for nothing this call holds. Eviction removes every key of a block
    /// together, the slot's first, and waits for an add in progress.
    /// `info` describes the one hash block the key covers (the prefix it ends,
    /// `(info.first_block + 1) * info.block_size` tokens, is recorded when the key becomes the
    /// block's own); its store is published as one `BlockStored` with that single hash.
    pub fn add_block_key(
        &self,
        id: BlockId,
        hash: BlockHash,
        group: GroupId,
        info: StoreInfo<'_>,
    ) -> Result<bool> {
        self.check_id(id)?;
        if id == NULL_BLOCK {
            return Ok(false);
        }
        if self.states.ref_count(id) == 0 {
            return Err(CoreError::NotInUse(id));
        }
        if !self.enable_caching {
            return Ok(false);
        }
        // Made before any lock is taken or key set (see `cache_full_blocks`).
        let event = self.events.as_ref().map(|_| info.stored_one(group, hash));
        let _order = self.order_events();
        let added = self.add_key(id, CacheKey { hash, group }, info.key_tokens(0));
        if let (true, Some(events), Some(event)) = (added, &self.events, event) {
            events.push(event);
        }
        Ok(added)
    }

    /// Enters block `id` (in use, not null) under one more key, as its slot's key if it has
    /// none (covering `tokens`); no event. Whether the key was added (see
    /// [`BlockPool::add_block_key`]).
    fn add_key(&self, id: BlockId, key: CacheKey, tokens: u32) -> bool {
        let slot = &self.keys[id as usize];
        loop {
            match slot.hold() {
                Ok(primary) => {
                    let added = primary != key && self.add_secondary(id, key);
                    slot.unhold();
                    break added;
                }
                Err(KEY_NONE) => {
                    let mut refused = false;
                    let set = slot.set(key, tokens, self.keyed.marker(id), |key| {
                        refused = !self.map.insert(key, id);
                        !refused
                    });
                    if set || refused {
                        break set;
                    }
                    // Another thread keyed the block meanwhile: add beside its key.
                }
                // Another thread is writing, clearing or holding the key: a bounded step.
                Err(_) => spin_wait(),
            }
        }
    }

    /// Re-points every key of block `src` at block `dst` (vLLM's `move_block_hashes`): the
    /// prefix cache keeps a copy of `src`'s contents in `dst` while `src`'s holder writes on
    /// into it. No events (the entries stay live). `dst` must be in use and carry no key.
    pub fn move_block_keys(&self, src: BlockId, dst: BlockId) -> Result<()> {
        self.check_id(src)?;
        self.check_id(dst)?;
        if src == NULL_BLOCK || dst == NULL_BLOCK {
            return Err(CoreError::NullBlock(NULL_BLOCK));
        }
        if src == dst {
            return Err(CoreError::InvalidArgument(format!(
                "cannot move the keys of block {src} onto itself"
            )));
        }
        if self.states.ref_count(dst) == 0 {
            return Err(CoreError::NotInUse(dst));
        }
        if self.keys[dst as usize].get().is_some() {
            return Err(CoreError::InvalidArgument(format!(
                "block {dst} already has a key: the keys of block {src} cannot move to it"
            )));
        }
        if !self.enable_caching {
            return Ok(());
        }
        // The slot's key, then those beside it in the order they were added; the ones beside
        // go while the slot is being cleared, as an eviction removes them.
        let mut moved = Vec::new();
        let mut beside = Vec::new();
        let mut covered = 0;
        let taken = self.keys[src as usize].take(self.keyed.marker(src), |key, tokens| {
            self.map.remove(&key, src);
            moved.push(key);
            covered = tokens;
            self.remove_secondary(src, |key| beside.push(key));
        });
        self.count_key_removals(u64::from(taken));
        moved.append(&mut beside);
        // The prefix length goes with the first key, which becomes `dst`'s slot key.
        for key in moved {
            self.add_key(dst, key, covered);
        }
        Ok(())
    }

    /// Adds `key` beside the key in `id`'s slot, which the caller holds.
    fn add_secondary(&self, id: BlockId, key: CacheKey) -> bool {
        let mut table = self.secondary_keys();
        let keys = table.entry(id).or_default();
        if keys.contains(&key) {
            return false;
        }
        if !self.map.insert(key, id) {
            if keys.is_empty() {
                table.remove(&id);
            }
            return false;
        }
        keys.push(key);
        self.multi.marker(id).set();
        true
    }

    /// Removes the keys beside `id`'s slot (whose key the caller is clearing) from the table
    /// and the map, passing each to `removed` in the order they were added.
    fn remove_secondary(&self, id: BlockId, mut removed: impl FnMut(CacheKey)) {
        if !self.multi.get(id) {
            return;
        }
        let keys = self.secondary_keys().remove(&id);
        self.multi.marker(id).clear();
        for key in keys.into_iter().flatten() {
            self.map.remove(&key, id);
            removed(key);
        }
    }

    /// The block cached under `(hash, group)`, if any (first inserted among duplicates).
    #[inline]
    pub fn lookup(&self, hash: BlockHash, group: GroupId) -> Option<BlockId> {
        self.map.first(&CacheKey { hash, group })
    }

    /// A hint that `lookup(hash, group)` (or caching a block under it) follows soon: starts
    /// loading its cache line. Walks over many keys issue it [`PREFETCH_AHEAD`] keys ahead.
    #[inline]
    pub fn prefetch_lookup(&self, hash: BlockHash, group: GroupId) {
        self.map.prefetch(&CacheKey { hash, group })
    }

    /// Block `id`'s key slot if it is keyed, for the prefetch hints below. None under loom
    /// (the reads would add interleavings for a hint).
    #[inline]
    fn keyed_slot(&self, id: BlockId) -> Option<&KeySlot> {
        if cfg!(loom) || !self.keyed.get(id) {
            return None;
        }
        self.keys.get(id as usize)
    }

    /// Starts loading block `id`'s key slot (if it is keyed).
    #[inline]
    fn prefetch_key_slot(&self, id: BlockId) {
        if let Some(slot) = self.keyed_slot(id) {
            crate::sync::prefetch(slot);
        }
    }

    /// Starts loading the map slot where block `id`'s key lives (if it is keyed). The key is
    /// read without claiming it: a key changing meanwhile only makes the hint miss.
    #[inline]
    fn prefetch_key_home(&self, id: BlockId) {
        if let Some(slot) = self.keyed_slot(id) {
            self.map.prefetch(&slot.read());
        }
    }

    /// Starts loading the state word a free of block `id` reads and updates (its cached flag
    /// shares a line with 63 other blocks' and is usually loaded already).
    #[inline]
    pub(crate) fn prefetch_block(&self, id: BlockId) {
        if let Some(state) = self.states.cell(id) {
            crate::sync::prefetch(state);
        }
    }

    /// One cached block per group for `hash`, or `None` if any group misses.
    pub fn get_cached_block(&self, hash: BlockHash, groups: &[GroupId]) -> Option<Vec<BlockId>> {
        groups.iter().map(|&g| self.lookup(hash, g)).collect()
    }

    fn evict_key(&self, id: BlockId, on_reuse: bool) -> bool {
        let removed = |key: CacheKey| {
            if let Some(events) = &self.events {
                events.push(KvEvent::BlockRemoved {
                    block_hash: key.hash,
                    group_id: key.group,
                    on_reuse,
                });
            }
        };
        self.keys[id as usize].take(self.keyed.marker(id), |key, _| {
            self.map.remove(&key, id);
            removed(key);
            self.remove_secondary(id, removed);
        })
    }

    /// How many blocks have had their keys taken off so far: by the reuse of a cached block, an
    /// eviction, a move of keys to a copy or a reset (a block's keys beside the first go with
    /// it and count with it). Keys leave blocks only this way, and each removal is counted once
    /// complete: when two reads of the count agree, no removal completed by the second took a
    /// key off a block that a lookup between them found under it (one still running may have).
    pub fn key_removals(&self) -> u64 {
        self.key_removals.load(Ordering::Acquire)
    }

    /// Counts `n` completed key removals (after them: see [`BlockPool::key_removals`]).
    #[inline]
    fn count_key_removals(&self, n: u64) {
        if n > 0 {
            self.key_removals.fetch_add(n, Ordering::AcqRel);
        }
    }

    /// The event-order lock (see `event_order`), when events are on.
    #[inline]
    fn order_events(&self) -> Option<MutexGuard<'_, ()>> {
        self.events
            .as_ref()
            .map(|_| self.event_order.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Removes the cache entries of the given blocks (reference counts untouched).
    pub fn evict_blocks(&self, ids: &[BlockId]) -> Result<()> {
        self.check_ids(ids)?;
        let _order = self.order_events();
        let mut evicted = 0;
        for &id in ids {
            evicted += u64::from(self.evict_key(id, false));
        }
        self.count_key_removals(evicted);
        Ok(())
    }

    /// Clears the whole prefix cache. Refused (returns `false`) while any block is in use.
    ///
    /// Each block's key leaves its slot and the map together, as an eviction does, so a block
    /// allocated and cached by another thread while the reset runs stays findable.
    pub fn reset_prefix_cache(&self) -> bool {
        if self.num_free_blocks() != self.num_blocks - 1 {
            return false;
        }
        let _order = self.order_events();
        let mut taken = 0;
        for (id, slot) in self.keys.iter().enumerate() {
            taken += u64::from(slot.take(self.keyed.marker(id as BlockId), |key, _| {
                self.map.remove(&key, id as BlockId);
                self.remove_secondary(id as BlockId, |_| {});
            }));
        }
        self.count_key_removals(taken);
        if let Some(events) = &self.events {
            events.push(KvEvent::AllBlocksCleared);
        }
        true
    }

    /// Drains the KV events (empty when events are off).
    pub fn take_events(&self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        if let Some(events) = &self.events {
            while let Some(event) = events.pop() {
                out.push(event);
            }
        }
        out
    }

    /// Free blocks front to back (the order `get_new_blocks` hands them out). Frees and
    /// allocations wait while it reads the order; under concurrent use the result is a snapshot.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.states.free_order()
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
