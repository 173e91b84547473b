//! Stress test: several threads allocate, free, cache, look up, touch (revive) and evict on one
//! pool at once, and issue frees that must fail (double frees, frees of blocks they do not hold,
//! out-of-range ids) in the middle of valid batches. Afterwards no block may be lost, listed
//! twice or have been allocated to two owners at the same time, and every reference count must be
//! back to zero.

use hybrid_kv::{BlockHash, BlockId, BlockPool, CoreError, StoreInfo};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};

const THREADS: u32 = 4;
/// Per thread; `HYBRID_KV_STRESS_OPS` raises it for longer runs (`cargo test --release`).
const OPS_PER_THREAD: u32 = 250_000;
const NUM_BLOCKS: usize = 257;
/// References a thread holds at most, so no block's count can exceed `THREADS * MAX_HELD`.
const MAX_HELD: usize = 64;
/// Listing a block this many times in one free is a double free whatever the other threads
/// hold: validation must reject it (nothing freed), never release part of the batch.
const OVER_FREE: usize = THREADS as usize * MAX_HELD + 1;

/// xorshift: deterministic per thread, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn ops_per_thread() -> u32 {
    std::env::var("HYBRID_KV_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(OPS_PER_THREAD)
        .max(OPS_PER_THREAD)
}

fn worker(pool: &BlockPool, owner: &[AtomicU32], me: u32, start: &Barrier) -> u64 {
    start.wait(); // all threads race from the same moment
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((me as u64 + 1) << 32));
    let mut allocated: Vec<BlockId> = Vec::new(); // exclusive allocations, owner tag set
    let mut shared: Vec<BlockId> = Vec::new(); // references taken by touch
    let mut ops = 0;
    let mut failed_frees = 0;
    for _ in 0..ops_per_thread() {
        ops += 1;
        let room = MAX_HELD - (allocated.len() + shared.len());
        match rng.below(11) {
            10 => {
                // A batch of held references with a bad entry in the middle: it must fail and
                // free nothing, so the thread still holds everything afterwards.
                let mut batch: Vec<BlockId> = Vec::new();
                for list in [&allocated, &shared] {
                    for &b in list.iter() {
                        if rng.below(2) == 0 {
                            batch.push(b);
                        }
                    }
                }
                let cut = rng.below(batch.len() as u64 + 1) as usize;
                let expected = match rng.below(3) {
                    // A double free of a held block.
                    0 if !allocated.is_empty() => {
                        let b = allocated[rng.below(allocated.len() as u64) as usize];
                        batch.splice(cut..cut, std::iter::repeat_n(b, OVER_FREE));
                        CoreError::DoubleFree(b)
                    }
                    // A free of a block this thread does not hold (free or held by others).
                    1 => {
                        let b = 1 + rng.below(NUM_BLOCKS as u64 - 1) as BlockId;
                        if allocated.contains(&b) || shared.contains(&b) {
                            continue;
                        }
                        batch.splice(cut..cut, std::iter::repeat_n(b, OVER_FREE));
                        CoreError::DoubleFree(b)
                    }
                    _ => {
                        batch.insert(cut, NUM_BLOCKS as BlockId + rng.below(4) as BlockId);
                        CoreError::InvalidBlockId {
                            id: batch[cut] as i64,
                            num_blocks: NUM_BLOCKS,
                        }
                    }
                };
                assert_eq!(pool.free_blocks(&batch), Err(expected));
                failed_frees += 1;
            }
            0..=2 if room > 0 => {
                let n = 1 + rng.below(room.min(6) as u64) as usize;
                if let Ok(blocks) = pool.get_new_blocks(n) {
                    assert_eq!(blocks.len(), n);
                    for &b in &blocks {
                        assert_ne!(b, 0, "the null block was handed out");
                        let prev = owner[b as usize].swap(me + 1, Ordering::AcqRel);
                        assert_eq!(
                            prev,
                            0,
                            "block {b} allocated to {me} while owned by {}",
                            prev - 1
                        );
                    }
                    allocated.extend(blocks);
                }
            }
            3..=4 => {
                let k = rng.below(4) as usize;
                let mut to_free = Vec::new();
                for _ in 0..k.min(allocated.len()) {
                    let i = rng.below(allocated.len() as u64) as usize;
                    let b = allocated.swap_remove(i);
                    owner[b as usize].store(0, Ordering::Release);
                    to_free.push(b);
                }
                for _ in 0..k.min(shared.len()) {
                    let i = rng.below(shared.len() as u64) as usize;
                    to_free.push(shared.swap_remove(i));
                }
                pool.free_blocks(&to_free).expect("freeing held references");
            }
            5..=6 => {
                if !allocated.is_empty() {
                    let b = allocated[rng.below(allocated.len() as u64) as usize];
                    let h = BlockHash(rng.below(512) as u128);
                    pool.cache_full_blocks(&[b], &[h], rng.below(2) as u32, StoreInfo::default())
                        .expect("caching an allocated block");
                }
            }
            7..=8 if room > 0 => {
                let h = BlockHash(rng.below(512) as u128);
                if let Some(b) = pool.lookup(h, rng.below(2) as u32) {
                    // Revive vs concurrent reuse: either outcome is fine, never corruption.
                    if pool.touch(&[b]).is_ok() {
                        shared.push(b);
                    }
                }
            }
            0..=2 | 7..=8 => {}
            _ => {
                let b = 1 + rng.below(NUM_BLOCKS as u64 - 1) as u32;
                if rng.below(2) == 0 || room == 0 {
                    pool.evict_blocks(&[b]).unwrap();
                } else if pool.touch(&[b]).is_ok() {
                    // Any block, free or not, cached or not: revives uncached free blocks out of
                    // the LIFO too (stale stack entries, stack compaction).
                    shared.push(b);
                }
            }
        }
    }
    for &b in &allocated {
        owner[b as usize].store(0, Ordering::Release);
    }
    allocated.extend(shared);
    pool.free_blocks(&allocated).unwrap();
    assert!(failed_frees > 0);
    ops
}

#[test]
fn many_threads_mixed_operations_lose_nothing() {
    let pool = Arc::new(BlockPool::new(NUM_BLOCKS).unwrap());
    let owner: Arc<Vec<AtomicU32>> = Arc::new((0..NUM_BLOCKS).map(|_| AtomicU32::new(0)).collect());
    let start = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|me| {
            let (pool, owner, start) = (pool.clone(), owner.clone(), start.clone());
            std::thread::spawn(move || worker(&pool, &owner, me, &start))
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(total >= 1_000_000);

    // Quiescent: everything is free, each block exactly once, nothing referenced.
    assert_eq!(pool.num_free_blocks(), NUM_BLOCKS - 1);
    let mut order = pool.free_order();
    order.sort_unstable();
    assert_eq!(order, (1..NUM_BLOCKS as u32).collect::<Vec<_>>());
    for id in 0..NUM_BLOCKS as u32 {
        assert_eq!(pool.ref_count(id).unwrap(), 0, "block {id}");
    }
    // The map and the per-block keys agree.
    let mut keyed = 0;
    for id in 1..NUM_BLOCKS as u32 {
        if let Some(key) = pool.block_key(id).unwrap() {
            keyed += 1;
            assert!(pool.lookup(key.hash, key.group).is_some());
        }
    }
    assert!(pool.num_cached_keys() <= keyed);
    // And the pool still works: every block can be allocated once.
    let all = pool.get_new_blocks(NUM_BLOCKS - 1).unwrap();
    assert_eq!(all.len(), NUM_BLOCKS - 1);
    assert!(pool.get_new_blocks(1).is_err());
}
