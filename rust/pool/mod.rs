//! The block pool: fixed-size KV blocks with reference counts, an LRU free order, the
//! prefix-cache map and KV events, with vLLM 0.33's semantics and no lock on the hot path.
//!
//! Free order (front = next to allocate or evict): blocks freed without a hash are put in front
//! (given order kept, reused first), cached blocks at the back (least recently used first);
//! `touch` takes cached blocks out of the order again. See [`reference::RefBlockPool`] for the
//! same semantics written plainly; the two are compared by a differential test.

mod free_order;
mod map;
pub mod reference;
pub(crate) mod states;

use crate::error::{CoreError, Result};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, KvEvent, StoreInfo, NULL_BLOCK};
use crossbeam_queue::SegQueue;
use map::CacheMap;
use states::BlockStates;

pub use crate::types::MAX_BLOCKS;

// A block's cache-key slot: written only by whoever moves it out of `KEY_NONE` (or `KEY_SET`),
// so the three words are never read while being written.
const KEY_NONE: u32 = 0;
const KEY_WRITING: u32 = 1;
const KEY_SET: u32 = 2;
const KEY_CLEARING: u32 = 3;

struct KeySlot {
    state: AtomicU32,
    group: AtomicU32,
    lo: AtomicU64,
    hi: AtomicU64,
}

impl KeySlot {
    fn new() -> Self {
        KeySlot {
            state: AtomicU32::new(KEY_NONE),
            group: AtomicU32::new(0),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
        }
    }

    /// Sets the key if the block has none; `false` if it already has one. `publish` runs before
    /// the key can be taken again, so a map entry is inserted before it can be removed.
    fn set(&self, key: CacheKey, publish: impl FnOnce(CacheKey)) -> bool {
        if self
            .state
            .compare_exchange(KEY_NONE, KEY_WRITING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let (lo, hi) = key.hash.to_parts();
        self.lo.store(lo, Ordering::Relaxed);
        self.hi.store(hi, Ordering::Relaxed);
        self.group.store(key.group, Ordering::Relaxed);
        publish(key);
        self.state.store(KEY_SET, Ordering::Release);
        true
    }

    /// Takes the key out (exclusive: one caller gets it). `done` runs before the slot is free
    /// again, so a key is removed from the map before the block can be given a new one.
    fn take(&self, done: impl FnOnce(CacheKey)) -> bool {
        if self.state.load(Ordering::Relaxed) != KEY_SET {
            return false;
        }
        if self
            .state
            .compare_exchange(KEY_SET, KEY_CLEARING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        done(self.read());
        self.state.store(KEY_NONE, Ordering::Release);
        true
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
        (self.state.load(Ordering::Acquire) == KEY_SET).then(|| self.read())
    }

    fn is_set(&self) -> bool {
        self.state.load(Ordering::Acquire) != KEY_NONE
    }
}

/// A pool of `num_blocks` KV blocks, block 0 being the null block. `Send + Sync`: every method
/// takes `&self` and may be called from any thread.
pub struct BlockPool {
    num_blocks: usize,
    enable_caching: bool,
    states: BlockStates,
    keys: Box<[KeySlot]>,
    map: CacheMap,
    events: Option<SegQueue<KvEvent>>,
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
        Ok(BlockPool {
            num_blocks,
            enable_caching,
            states: BlockStates::new(num_blocks),
            keys: (0..num_blocks).map(|_| KeySlot::new()).collect(),
            map: CacheMap::with_capacity(if enable_caching { num_blocks } else { 0 }),
            events: enable_events.then(SegQueue::new),
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
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

    /// The key a block is cached under, if any.
    pub fn block_key(&self, id: BlockId) -> Result<Option<CacheKey>> {
        self.check_id(id)?;
        Ok(self.keys[id as usize].get())
    }

    /// Takes `n` blocks from the front of the free order, evicting their cache entries.
    /// All or nothing: when fewer than `n` are free, nothing changes.
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
        self.states
            .reserve(n)
            .map_err(|free| CoreError::NotEnoughFreeBlocks { requested: n, free })?;
        let start = out.len();
        self.states.claim_reserved(n, out);
        if self.enable_caching {
            for &id in &out[start..] {
                self.evict_key(id);
            }
        }
        Ok(())
    }

    /// Drops one reference to each block (null blocks skipped). Blocks that reach zero join the
    /// free order: uncached ones in front in the given order, cached ones at the back. A double
    /// free is an error and changes nothing.
    pub fn free_blocks(&self, ordered: &[BlockId]) -> Result<()> {
        self.check_ids(ordered)?;
        let mut front = Vec::with_capacity(ordered.len());
        let mut back = Vec::with_capacity(ordered.len());
        for (k, &id) in ordered.iter().enumerate() {
            if id == NULL_BLOCK {
                continue;
            }
            match self.states.release(id) {
                Ok(None) => {}
                Ok(Some(entry)) => {
                    if self.enable_caching && self.keys[id as usize].is_set() {
                        back.push(entry)
                    } else {
                        front.push(entry)
                    }
                }
                Err(err) => {
                    for &undo in ordered[..k].iter().filter(|&&b| b != NULL_BLOCK) {
                        self.states.unrelease(undo);
                    }
                    return Err(err);
                }
            }
        }
        self.states.publish(&front, &back);
        Ok(())
    }

    /// Takes one more reference to each block (null blocks skipped), reviving free cached blocks
    /// out of the free order.
    pub fn touch(&self, blocks: &[BlockId]) -> Result<()> {
        self.check_ids(blocks)?;
        if let Err((k, err)) = self.states.acquire_many(blocks) {
            // Only under a race with allocations that took every free block: give back what
            // this call took, so it changes nothing.
            self.free_blocks(&blocks[..k])?;
            return Err(err);
        }
        Ok(())
    }

    /// Enters `blocks[i]` into the prefix cache under `(hashes[i], group)`. Null blocks and blocks
    /// that already carry a hash are skipped. Every non-null block must be in use.
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
        let mut stored = Vec::new();
        let mut extra_keys = Vec::new();
        let mut block_indices = Vec::new();
        for (i, (&id, &hash)) in blocks.iter().zip(hashes).enumerate() {
            if id == NULL_BLOCK {
                continue;
            }
            let key = CacheKey { hash, group };
            if self.keys[id as usize].set(key, |key| self.map.insert(key, id)) && events.is_some() {
                stored.push(hash);
                extra_keys.push(info.block_extra_keys.and_then(|f| f(i)));
                block_indices.push(info.first_block + i);
            }
        }
        if let Some(events) = events {
            // vLLM publishes an event for every call that had blocks to cache, even when all of
            // them were null or masked.
            if !blocks.is_empty() {
                events.push(KvEvent::BlockStored {
                    block_hashes: stored,
                    parent_block_hash: info.parent_block_hash,
                    token_ids: info.token_ids.to_vec(),
                    block_size: info.block_size,
                    group_id: group,
                    lora: info.lora.map(|(name, id)| (name.to_owned(), id)),
                    extra_keys: (!extra_keys.is_empty()).then_some(extra_keys),
                    first_block: info.first_block,
                    block_indices,
                });
            }
        }
        Ok(())
    }

    /// The block cached under `(hash, group)`, if any (first inserted among duplicates).
    #[inline]
    pub fn lookup(&self, hash: BlockHash, group: GroupId) -> Option<BlockId> {
        self.map.first(&CacheKey { hash, group })
    }

    /// One cached block per group for `hash`, or `None` if any group misses.
    pub fn get_cached_block(&self, hash: BlockHash, groups: &[GroupId]) -> Option<Vec<BlockId>> {
        groups.iter().map(|&g| self.lookup(hash, g)).collect()
    }

    fn evict_key(&self, id: BlockId) -> bool {
        self.keys[id as usize].take(|key| {
            self.map.remove(&key, id);
            if let Some(events) = &self.events {
                events.push(KvEvent::BlockRemoved {
                    block_hash: key.hash,
                    group_id: key.group,
                });
            }
        })
    }

    /// Removes the cache entries of the given blocks (reference counts untouched).
    pub fn evict_blocks(&self, ids: &[BlockId]) -> Result<()> {
        self.check_ids(ids)?;
        for &id in ids {
            self.evict_key(id);
        }
        Ok(())
    }

    /// Clears the whole prefix cache. Refused (returns `false`) while any block is in use.
    pub fn reset_prefix_cache(&self) -> bool {
        if self.num_free_blocks() != self.num_blocks - 1 {
            return false;
        }
        for slot in self.keys.iter() {
            slot.take(|_| {});
        }
        self.map.clear();
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

    /// Free blocks front to back (the order `get_new_blocks` hands them out). Only while no other
    /// thread uses the pool: it briefly takes the queues apart.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.states.free_order()
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
