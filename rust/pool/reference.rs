//! A plain single-owner block pool with the same semantics as [`super::BlockPool`], written as
//! directly as vLLM 0.33 describes it: a doubly linked free list threaded through the blocks
//! (`FreeKVCacheBlockQueue`: O(1) append, prepend, pop and removal from the middle) and a hash
//! map of block lists. It is the oracle of the differential tests and, behind a `Mutex`, the
//! baseline of the concurrency benchmark (`benches/pool.rs`); it takes `&mut self` and is not
//! meant to serve from.

use super::alloc::{boxed_slice, AllocFailed};
use crate::error::{CoreError, Result};
use crate::types::{
    BlockHash, BlockId, CacheKey, GroupId, KvEvent, StoreInfo, MAX_BLOCKS, NULL_BLOCK,
};
use std::collections::HashMap;

/// End of the free list.
const NIL: u32 = u32::MAX;

pub struct RefBlockPool {
    num_blocks: usize,
    enable_caching: bool,
    ref_cnt: Box<[u32]>,
    key: Box<[Option<CacheKey>]>,
    /// The free list, front to back, linked through `prev` / `next` (`NIL` at the ends). A block
    /// is in it exactly when its reference count is 0 (the null block never is).
    prev: Box<[u32]>,
    next: Box<[u32]>,
    head: u32,
    tail: u32,
    num_free: usize,
    map: HashMap<CacheKey, Vec<BlockId>>,
    /// Keys a block holds besides `key` (vLLM's `cached_block_hashes_by_block`), in order.
    secondary: HashMap<BlockId, Vec<CacheKey>>,
    events: Option<Vec<KvEvent>>,
    /// `free_blocks` scratch: releases counted per block during validation, zero between calls.
    pending: Box<[u32]>,
}

impl RefBlockPool {
    pub fn new(num_blocks: usize, enable_caching: bool, enable_events: bool) -> Result<Self> {
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
        // Blocks 1..num_blocks free in id order (none in a pool of just the null block).
        let last = num_blocks as u32 - 1;
        let (head, tail) = if last == 0 { (NIL, NIL) } else { (1, last) };
        Ok(RefBlockPool {
            num_blocks,
            enable_caching,
            ref_cnt: boxed_slice("reference counts", num_blocks, |_| 0).map_err(oom)?,
            key: boxed_slice("cache keys", num_blocks, |_| None).map_err(oom)?,
            prev: boxed_slice("free-list links", num_blocks, |i| {
                if i <= 1 {
                    NIL
                } else {
                    i as u32 - 1
                }
            })
            .map_err(oom)?,
            next: boxed_slice("free-list links", num_blocks, |i| {
                if i == 0 || i as u32 == last {
                    NIL
                } else {
                    i as u32 + 1
                }
            })
            .map_err(oom)?,
            head,
            tail,
            num_free: num_blocks - 1,
            map: HashMap::new(),
            secondary: HashMap::new(),
            events: enable_events.then(Vec::new),
            pending: boxed_slice("free scratch", num_blocks, |_| 0).map_err(oom)?,
        })
    }

    fn unlink(&mut self, id: BlockId) {
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.num_free -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        self.prev[id as usize] = self.tail;
        self.next[id as usize] = NIL;
        match self.tail {
            NIL => self.head = id,
            t => self.next[t as usize] = id,
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        self.next[id as usize] = self.head;
        self.prev[id as usize] = NIL;
        match self.head {
            NIL => self.tail = id,
            h => self.prev[h as usize] = id,
        }
        self.head = id;
        self.num_free += 1;
    }

    fn check_ids(&self, ids: &[BlockId]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.num_blocks) {
            Some(&id) => Err(CoreError::InvalidBlockId {
                id: id as i64,
                num_blocks: self.num_blocks,
            }),
            None => Ok(()),
        }
    }

    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    pub fn usage(&self) -> f64 {
        if self.num_blocks <= 1 {
            return 0.0;
        }
        1.0 - self.num_free as f64 / (self.num_blocks - 1) as f64
    }

    pub fn num_cached_keys(&self) -> usize {
        self.map.len()
    }

    pub fn ref_count(&self, id: BlockId) -> Result<u32> {
        self.check_ids(&[id])?;
        Ok(self.ref_cnt[id as usize])
    }

    pub fn block_key(&self, id: BlockId) -> Result<Option<CacheKey>> {
        self.check_ids(&[id])?;
        Ok(self.key[id as usize])
    }

    pub fn free_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.next[id as usize];
        }
        out
    }

    fn evict(&mut self, id: BlockId, on_reuse: bool) {
        let Some(key) = self.key[id as usize].take() else {
            return;
        };
        let more = self.secondary.remove(&id).unwrap_or_default();
        for key in std::iter::once(key).chain(more) {
            if let Some(holders) = self.map.get_mut(&key) {
                holders.retain(|&b| b != id);
                if holders.is_empty() {
                    self.map.remove(&key);
                }
            }
            if let Some(events) = &mut self.events {
                events.push(KvEvent::BlockRemoved {
                    block_hash: key.hash,
                    group_id: key.group,
                    on_reuse,
                });
            }
        }
    }

    pub fn block_keys(&self, id: BlockId) -> Result<Vec<CacheKey>> {
        self.check_ids(&[id])?;
        let mut keys: Vec<CacheKey> = self.key[id as usize].into_iter().collect();
        keys.extend(self.secondary.get(&id).into_iter().flatten());
        Ok(keys)
    }

    pub fn add_block_key(
        &mut self,
        id: BlockId,
        hash: BlockHash,
        group: GroupId,
        info: StoreInfo<'_>,
    ) -> Result<bool> {
        self.check_ids(&[id])?;
        if id == NULL_BLOCK {
            return Ok(false);
        }
        if self.ref_cnt[id as usize] == 0 {
            return Err(CoreError::NotInUse(id));
        }
        if !self.enable_caching {
            return Ok(false);
        }
        let key = CacheKey { hash, group };
        match self.key[id as usize] {
            None => self.key[id as usize] = Some(key),
            Some(primary) if primary == key => return Ok(false),
            Some(_) => {
                let more = self.secondary.entry(id).or_default();
                if more.contains(&key) {
                    return Ok(false);
                }
                more.push(key);
            }
        }
        self.map.entry(key).or_default().push(id);
        if let Some(events) = &mut self.events {
            events.push(info.stored_one(group, hash));
        }
        Ok(true)
    }

    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n > self.num_free {
            return Err(CoreError::NotEnoughFreeBlocks {
                requested: n,
                free: self.num_free,
            });
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if self.enable_caching {
                self.evict(id, true);
            }
            self.ref_cnt[id as usize] = 1;
            blocks.push(id);
        }
        Ok(blocks)
    }

    pub fn free_blocks(&mut self, ordered: &[BlockId]) -> Result<()> {
        self.check_ids(ordered)?;
        let mut bad = None;
        for &id in ordered.iter().filter(|&&id| id != NULL_BLOCK) {
            self.pending[id as usize] += 1;
            if self.pending[id as usize] > self.ref_cnt[id as usize] {
                bad = Some(id);
                break;
            }
        }
        for &id in ordered {
            self.pending[id as usize] = 0;
        }
        if let Some(id) = bad {
            return Err(CoreError::DoubleFree(id));
        }
        let mut front = Vec::new();
        for &id in ordered.iter().filter(|&&id| id != NULL_BLOCK) {
            self.ref_cnt[id as usize] -= 1;
            if self.ref_cnt[id as usize] == 0 {
                if self.enable_caching && self.key[id as usize].is_some() {
                    self.push_back(id);
                } else {
                    front.push(id);
                }
            }
        }
        for &id in front.iter().rev() {
            self.push_front(id);
        }
        Ok(())
    }

    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<()> {
        self.check_ids(blocks)?;
        for &id in blocks.iter().filter(|&&id| id != NULL_BLOCK) {
            if self.ref_cnt[id as usize] == 0 {
                self.unlink(id);
            }
            self.ref_cnt[id as usize] += 1;
        }
        Ok(())
    }

    pub fn cache_full_blocks(
        &mut self,
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
            .find(|&&id| id != NULL_BLOCK && self.ref_cnt[id as usize] == 0)
        {
            return Err(CoreError::NotInUse(id));
        }
        if !self.enable_caching {
            return Ok(());
        }
        let mut stored = Vec::new();
        let mut extra_keys = Vec::new();
        let mut block_indices = Vec::new();
        for (i, (&id, &hash)) in blocks.iter().zip(hashes).enumerate() {
            if id == NULL_BLOCK || self.key[id as usize].is_some() {
                continue;
            }
            let key = CacheKey { hash, group };
            self.key[id as usize] = Some(key);
            self.map.entry(key).or_default().push(id);
            stored.push(hash);
            extra_keys.push(info.block_extra_keys.and_then(|f| f(i)));
            block_indices.push(info.first_block.saturating_add(i));
        }
        if let Some(events) = &mut self.events {
            if !blocks.is_empty() {
                events.push(info.stored_event(group, stored, extra_keys, block_indices));
            }
        }
        Ok(())
    }

    pub fn lookup(&self, hash: BlockHash, group: GroupId) -> Option<BlockId> {
        self.map
            .get(&CacheKey { hash, group })
            .map(|holders| holders[0])
    }

    pub fn get_cached_block(&self, hash: BlockHash, groups: &[GroupId]) -> Option<Vec<BlockId>> {
        groups.iter().map(|&g| self.lookup(hash, g)).collect()
    }

    pub fn evict_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        self.check_ids(ids)?;
        for &id in ids {
            self.evict(id, false);
        }
        Ok(())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.num_blocks - 1 {
            return false;
        }
        self.map.clear();
        self.secondary.clear();
        self.key.iter_mut().for_each(|k| *k = None);
        if let Some(events) = &mut self.events {
            events.push(KvEvent::AllBlocksCleared);
        }
        true
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }
}
