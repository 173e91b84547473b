//! KV events of a pool used from several threads queue in the order their changes took effect:
//! a thread evicting blocks while another keys them never has a key's `BlockRemoved` queued
//! ahead of its `BlockStored`, so replaying the events gives the cache's keys.

use hybrid_kv::{BlockHash, BlockPool, KvEvent, StoreInfo};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

#[test]
fn events_of_evictions_racing_stores_replay_to_the_cache() {
    let pool = Arc::new(BlockPool::with_options(8, true, true).unwrap());
    let ids = pool.get_new_blocks(4).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let evictions = Arc::new(AtomicU64::new(0));
    let evictor = {
        let (pool, ids) = (Arc::clone(&pool), ids.clone());
        let (stop, evictions) = (Arc::clone(&stop), Arc::clone(&evictions));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                pool.evict_blocks(&ids).unwrap();
                evictions.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // Stores go on until the evictor has run as long as they have, however the threads are
    // scheduled.
    let mut i = 0u64;
    while i < 20_000 || evictions.load(Ordering::Relaxed) < 20_000 {
        i += 1;
        let hashes: Vec<BlockHash> = (0..4).map(|k| BlockHash(u128::from(i * 4 + k))).collect();
        pool.cache_full_blocks(&ids, &hashes, 0, StoreInfo::default())
            .unwrap();
        if i % 7 == 0 {
            pool.add_block_key(
                ids[0],
                BlockHash(u128::MAX - u128::from(i)),
                1,
                StoreInfo::default(),
            )
            .unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    evictor.join().unwrap();
    let mut cached: HashMap<(u128, u32), u32> = HashMap::new();
    for event in pool.take_events() {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                group_id,
                ..
            } => {
                for hash in block_hashes {
                    *cached.entry((hash.0, group_id)).or_default() += 1;
                }
            }
            KvEvent::BlockRemoved {
                block_hash,
                group_id,
                ..
            } => {
                let count = cached.get_mut(&(block_hash.0, group_id));
                let count = count.filter(|c| **c > 0).unwrap_or_else(|| {
                    panic!("BlockRemoved of {block_hash:?} (group {group_id}) before its store")
                });
                *count -= 1;
            }
            KvEvent::AllBlocksCleared => cached.clear(),
        }
    }
    cached.retain(|_, c| *c > 0);
    assert_eq!(cached.len(), pool.num_cached_keys());
}
