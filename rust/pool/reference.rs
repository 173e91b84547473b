//! A plain single-owner block pool with the same semantics as [`super::BlockPool`], written as
//! directly as vLLM 0.33 describes it (a doubly ended free list, a hash map of lists). It is the
//! oracle of the differential tests, not something to serve from.

use crate::error::{CoreError, Result};
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, KvEvent, StoreInfo, NULL_BLOCK};
use std::collections::{HashMap, VecDeque};

pub struct RefBlockPool {
    num_blocks: usize,
    enable_caching: bool,
    ref_cnt: Vec<u32>,
    key: Vec<Option<CacheKey>>,
    free: VecDeque<BlockId>,
    map: HashMap<CacheKey, Vec<BlockId>>,
    events: Option<Vec<KvEvent>>,
}

impl RefBlockPool {
    pub fn new(num_blocks: usize, enable_caching: bool, enable_events: bool) -> Result<Self> {
        if num_blocks < 1 {
            return Err(CoreError::PoolTooSmall(num_blocks));
        }
        if num_blocks > super::MAX_BLOCKS {
            return Err(CoreError::PoolTooLarge(num_blocks));
        }
        Ok(RefBlockPool {
            num_blocks,
            enable_caching,
            ref_cnt: vec![0; num_blocks],
            key: vec![None; num_blocks],
            free: (1..num_blocks as BlockId).collect(),
            map: HashMap::new(),
            events: enable_events.then(Vec::new),
        })
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
        self.free.len()
    }

    pub fn usage(&self) -> f64 {
        if self.num_blocks <= 1 {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / (self.num_blocks - 1) as f64
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
        self.free.iter().copied().collect()
    }

    fn evict(&mut self, id: BlockId) {
        if let Some(key) = self.key[id as usize].take() {
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
                });
            }
        }
    }

    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n > self.free.len() {
            return Err(CoreError::NotEnoughFreeBlocks {
                requested: n,
                free: self.free.len(),
            });
        }
        let blocks: Vec<BlockId> = self.free.drain(..n).collect();
        for &id in &blocks {
            if self.enable_caching {
                self.evict(id);
            }
            self.ref_cnt[id as usize] = 1;
        }
        Ok(blocks)
    }

    pub fn free_blocks(&mut self, ordered: &[BlockId]) -> Result<()> {
        self.check_ids(ordered)?;
        let mut pending: HashMap<BlockId, u32> = HashMap::new();
        for &id in ordered.iter().filter(|&&id| id != NULL_BLOCK) {
            let count = pending.entry(id).or_insert(0);
            *count += 1;
            if *count > self.ref_cnt[id as usize] {
                return Err(CoreError::DoubleFree(id));
            }
        }
        let (mut front, mut back) = (Vec::new(), Vec::new());
        for &id in ordered.iter().filter(|&&id| id != NULL_BLOCK) {
            self.ref_cnt[id as usize] -= 1;
            if self.ref_cnt[id as usize] == 0 {
                if self.enable_caching && self.key[id as usize].is_some() {
                    back.push(id);
                } else {
                    front.push(id);
                }
            }
        }
        for &id in front.iter().rev() {
            self.free.push_front(id);
        }
        self.free.extend(back);
        Ok(())
    }

    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<()> {
        self.check_ids(blocks)?;
        for &id in blocks.iter().filter(|&&id| id != NULL_BLOCK) {
            if self.ref_cnt[id as usize] == 0 {
                let pos = self
                    .free
                    .iter()
                    .position(|&b| b == id)
                    .expect("free block in queue");
                self.free.remove(pos);
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
            block_indices.push(info.first_block + i);
        }
        if let Some(events) = &mut self.events {
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
            self.evict(id);
        }
        Ok(())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.free.len() != self.num_blocks - 1 {
            return false;
        }
        self.map.clear();
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
