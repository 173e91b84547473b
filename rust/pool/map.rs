//! The prefix-cache map `(block_hash, group_id) → blocks`, over a lock-free hash map.
//!
//! Identical content may be cached in several blocks (block tables stay append-only), so a key
//! holds one block or, rarely, a short list; lookups return the first one inserted.

use crate::sync::{AtomicUsize, Ordering};
use crate::types::{BlockId, CacheKey};
use papaya::{Compute, Operation};
use std::hash::{BuildHasher, Hasher};

#[derive(Clone, Debug)]
enum Holders {
    One(BlockId),
    Many(Box<[BlockId]>),
}

impl Holders {
    fn first(&self) -> BlockId {
        match self {
            Holders::One(id) => *id,
            Holders::Many(ids) => ids[0],
        }
    }
}

/// Keys are already uniformly distributed hashes: fold them instead of hashing them again.
#[derive(Clone, Copy, Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.write_u64(v as u64 ^ (v >> 64) as u64);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(29) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
}

#[derive(Clone, Copy, Default)]
pub(crate) struct BuildKeyHasher;

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

pub(crate) struct CacheMap {
    map: papaya::HashMap<CacheKey, Holders, BuildKeyHasher>,
    keys: AtomicUsize,
}

impl CacheMap {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        CacheMap {
            map: papaya::HashMap::builder()
                .capacity(capacity)
                .hasher(BuildKeyHasher)
                .build(),
            keys: AtomicUsize::new(0),
        }
    }

    /// Number of keys (vLLM's `len(cached_block_hash_to_block)`).
    pub(crate) fn len(&self) -> usize {
        self.keys.load(Ordering::Acquire)
    }

    pub(crate) fn first(&self, key: &CacheKey) -> Option<BlockId> {
        self.map.pin().get(key).map(Holders::first)
    }

    pub(crate) fn insert(&self, key: CacheKey, id: BlockId) {
        let map = self.map.pin();
        let result = map.compute(key, |entry| -> Operation<Holders, ()> {
            match entry {
                None => Operation::Insert(Holders::One(id)),
                Some((_, Holders::One(first))) if *first == id => Operation::Abort(()),
                Some((_, Holders::Many(ids))) if ids.contains(&id) => Operation::Abort(()),
                Some((_, Holders::One(first))) => {
                    Operation::Insert(Holders::Many(vec![*first, id].into_boxed_slice()))
                }
                Some((_, Holders::Many(ids))) => {
                    let mut ids = ids.to_vec();
                    ids.push(id);
                    Operation::Insert(Holders::Many(ids.into_boxed_slice()))
                }
            }
        });
        if matches!(result, Compute::Inserted(..)) {
            self.keys.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Removes `id` from `key`; the key goes when its last block does. Returns whether `id` was
    /// mapped under `key`.
    pub(crate) fn remove(&self, key: &CacheKey, id: BlockId) -> bool {
        let map = self.map.pin();
        let result = map.compute(*key, |entry| -> Operation<Holders, ()> {
            match entry {
                Some((_, Holders::One(held))) if *held == id => Operation::Remove,
                Some((_, Holders::Many(ids))) if ids.contains(&id) => {
                    let rest: Vec<BlockId> = ids.iter().copied().filter(|&b| b != id).collect();
                    match rest.as_slice() {
                        [] => Operation::Remove,
                        [only] => Operation::Insert(Holders::One(*only)),
                        _ => Operation::Insert(Holders::Many(rest.into_boxed_slice())),
                    }
                }
                _ => Operation::Abort(()),
            }
        });
        match result {
            Compute::Removed(..) => {
                self.keys.fetch_sub(1, Ordering::AcqRel);
                true
            }
            Compute::Updated { .. } => true,
            _ => false,
        }
    }

    pub(crate) fn clear(&self) {
        self.map.pin().clear();
        self.keys.store(0, Ordering::Release);
    }
}
