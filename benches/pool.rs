//! Criterion benches of the block pool and block hashing.
//!
//! `cargo bench --bench pool` (full run); `cargo test --benches` runs each once as a smoke test.
//! `cargo bench --bench pool -- pool/mixed` runs only the pool against its mutex
//! baseline; `-- pool/free_cold` a request's free with cold CPU caches.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hybrid_kv::{
    BlockHash, BlockHasher, BlockId, BlockPool, ExtraKeys, HashAlgo, RefBlockPool, StoreInfo,
};
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn alloc_free(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool/alloc_free");
    for n in [1usize, 16, 256] {
        let pool = BlockPool::new(4096).unwrap();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut ids = Vec::with_capacity(n);
            b.iter(|| {
                ids.clear();
                pool.get_new_blocks_into(black_box(n), &mut ids).unwrap();
                pool.free_blocks(&ids).unwrap();
            })
        });
    }
    group.finish();
}

/// A cached chain of `n` free blocks, touched (revived) and freed again, as a prefix hit does.
fn touch_cached_chain(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool/touch_cached_chain");
    for n in [16usize, 256] {
        let pool = BlockPool::new(4096).unwrap();
        let ids = pool.get_new_blocks(n).unwrap();
        let hashes: Vec<BlockHash> = (0..n as u128).map(BlockHash).collect();
        pool.cache_full_blocks(&ids, &hashes, 0, StoreInfo::default())
            .unwrap();
        let reversed: Vec<u32> = ids.iter().rev().copied().collect();
        pool.free_blocks(&reversed).unwrap();
        group.throughput(Throughput::Elements(n as u64));
        // Times the touch alone; the free that puts the chain back is outside the clock.
        group.bench_with_input(BenchmarkId::new("touch", n), &n, |b, _| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    pool.touch(black_box(&ids)).unwrap();
                    spent += start.elapsed();
                    pool.free_blocks(&reversed).unwrap();
                }
                spent
            })
        });
        group.bench_with_input(BenchmarkId::new("touch_and_free", n), &n, |b, _| {
            b.iter(|| {
                pool.touch(black_box(&ids)).unwrap();
                pool.free_blocks(&reversed).unwrap();
            })
        });
    }
    group.finish();
}

/// A request's free as the scheduler meets it: 220 cached blocks scattered over a 30,000-block
/// pool, with the CPU caches cold (a 32 MiB buffer is written before each free, outside the
/// clock). Memory latency, not instructions, is what a free costs between Python calls.
fn free_cold(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool/free_cold");
    let num_blocks = 30_000;
    let pool = BlockPool::new(num_blocks).unwrap();
    let all = pool.get_new_blocks(num_blocks - 1).unwrap();
    let hashes: Vec<BlockHash> = (1..=all.len() as u128).map(BlockHash).collect();
    pool.cache_full_blocks(&all, &hashes, 0, StoreInfo::default())
        .unwrap();
    let mut table: Vec<BlockId> = (0..220).map(|i| all[(i * 7919 + 13) % all.len()]).collect();
    table.sort_unstable();
    table.dedup();
    let rest: Vec<BlockId> = all.iter().copied().filter(|b| !table.contains(b)).collect();
    pool.free_blocks(&rest).unwrap();
    let mut junk = vec![0u64; 4 << 20];
    group.throughput(Throughput::Elements(table.len() as u64));
    group.bench_function(BenchmarkId::from_parameter(table.len()), |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for round in 0..iters {
                for (i, word) in junk.iter_mut().enumerate().step_by(8) {
                    *word = word.wrapping_add(i as u64 ^ round);
                }
                let start = Instant::now();
                pool.free_blocks(black_box(&table)).unwrap();
                spent += start.elapsed();
                pool.touch(&table).unwrap();
            }
            black_box(&junk);
            spent
        })
    });
    group.finish();
}

fn lookup_chain(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool/lookup");
    let n = 1024usize;
    let pool = BlockPool::new(n + 1).unwrap();
    let ids = pool.get_new_blocks(n).unwrap();
    let hashes: Vec<BlockHash> = (0..n as u128).map(|i| BlockHash(i * 0x9E37_79B9)).collect();
    pool.cache_full_blocks(&ids, &hashes, 0, StoreInfo::default())
        .unwrap();
    group.throughput(Throughput::Elements(n as u64));
    group.bench_function("1024_hits", |b| {
        b.iter(|| {
            for &h in &hashes {
                black_box(pool.lookup(h, 0));
            }
        })
    });
    group.finish();
}

/// The same number of lookups split over 1 and 2 threads; criterion measures wall time. Beside
/// them the same lookups on the reference pool behind a `Mutex` (`mutex_reference/N`).
fn concurrent_lookups(c: &mut Criterion) {
    const LOOKUPS: usize = 1 << 18;
    fn run(pool: &impl SharedPool, hashes: &[BlockHash], threads: usize, iters: u64) -> Duration {
        let start = Instant::now();
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    for _ in 0..iters {
                        for k in 0..LOOKUPS / threads {
                            black_box(pool.lookup(hashes[(k * 7 + t) % hashes.len()]));
                        }
                    }
                });
            }
        });
        start.elapsed()
    }
    fn filled(pool: impl SharedPool, hashes: &[BlockHash]) -> impl SharedPool {
        let mut ids = Vec::with_capacity(hashes.len());
        assert!(pool.allocate(hashes.len(), &mut ids));
        pool.cache(&ids, hashes);
        pool
    }
    let mut group = c.benchmark_group("pool/concurrent_lookups");
    group.throughput(Throughput::Elements(LOOKUPS as u64));
    let n = 4096usize;
    let hashes: Vec<BlockHash> = (0..n as u128).map(|i| BlockHash(i * 0x9E37_79B9)).collect();
    let pool = filled(BlockPool::new(n + 1).unwrap(), &hashes);
    let mutex = filled(
        Mutex::new(RefBlockPool::new(n + 1, true, false).unwrap()),
        &hashes,
    );
    for threads in [1usize, 2] {
        group.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, &t| {
            b.iter_custom(|iters| run(&pool, &hashes, t, iters))
        });
    }
    for threads in [1usize, 2] {
        group.bench_with_input(
            BenchmarkId::new("mutex_reference", threads),
            &threads,
            |b, &t| b.iter_custom(|iters| run(&mutex, &hashes, t, iters)),
        );
    }
    group.finish();
}

/// The calls a request makes on a pool; one implementation per pool under test.
trait SharedPool: Sync {
    fn lookup(&self, hash: BlockHash) -> Option<BlockId>;
    fn touch(&self, ids: &[BlockId]) -> bool;
    fn allocate(&self, n: usize, out: &mut Vec<BlockId>) -> bool;
    fn cache(&self, ids: &[BlockId], hashes: &[BlockHash]);
    fn free(&self, ids: &[BlockId]);
}

impl SharedPool for BlockPool {
    fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        BlockPool::lookup(self, hash, 0)
    }
    fn touch(&self, ids: &[BlockId]) -> bool {
        BlockPool::touch(self, ids).is_ok()
    }
    fn allocate(&self, n: usize, out: &mut Vec<BlockId>) -> bool {
        self.get_new_blocks_into(n, out).is_ok()
    }
    fn cache(&self, ids: &[BlockId], hashes: &[BlockHash]) {
        self.cache_full_blocks(ids, hashes, 0, StoreInfo::default())
            .unwrap();
    }
    fn free(&self, ids: &[BlockId]) {
        self.free_blocks(ids).unwrap();
    }
}

/// The single-owner reference pool (vLLM's data structures) behind one mutex, locked per call.
impl SharedPool for Mutex<RefBlockPool> {
    fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.lock().unwrap().lookup(hash, 0)
    }
    fn touch(&self, ids: &[BlockId]) -> bool {
        self.lock().unwrap().touch(ids).is_ok()
    }
    fn allocate(&self, n: usize, out: &mut Vec<BlockId>) -> bool {
        match self.lock().unwrap().get_new_blocks(n) {
            Ok(ids) => {
                out.extend(ids);
                true
            }
            Err(_) => false,
        }
    }
    fn cache(&self, ids: &[BlockId], hashes: &[BlockHash]) {
        self.lock()
            .unwrap()
            .cache_full_blocks(ids, hashes, 0, StoreInfo::default())
            .unwrap();
    }
    fn free(&self, ids: &[BlockId]) {
        self.lock().unwrap().free_blocks(ids).unwrap();
    }
}

/// Blocks of a prompt; prompts come from `FAMILIES` shared prefixes.
const PROMPT_BLOCKS: usize = 8;
const FAMILIES: u64 = 64;

/// `requests` requests of one thread: look up the longest cached prefix of a prompt (one of
/// `FAMILIES`, so threads share prefixes), touch the hit, allocate the rest of the prompt plus
/// two decode blocks, cache the new prompt blocks, free everything tail first.
fn mixed_requests(pool: &impl SharedPool, seed: u64, requests: usize) {
    let mut rng = seed | 1;
    let mut blocks = Vec::with_capacity(PROMPT_BLOCKS + 2);
    let mut hashes = Vec::with_capacity(PROMPT_BLOCKS);
    for _ in 0..requests {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let family = (rng % FAMILIES) as u128;
        let hash = |i: usize| BlockHash((family << 32) | i as u128);
        blocks.clear();
        while blocks.len() < PROMPT_BLOCKS {
            match pool.lookup(hash(blocks.len())) {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        if !pool.touch(&blocks) {
            blocks.clear();
        }
        let hit = blocks.len();
        if !pool.allocate(PROMPT_BLOCKS - hit + 2, &mut blocks) {
            pool.free(&blocks);
            continue;
        }
        hashes.clear();
        hashes.extend((hit..PROMPT_BLOCKS).map(hash));
        pool.cache(&blocks[hit..PROMPT_BLOCKS], &hashes);
        blocks.reverse();
        pool.free(black_box(&blocks));
    }
}

/// The pool against the reference pool behind a `Mutex`, on the same requests split
/// over 1, 2 and 4 threads; criterion measures wall time (throughput in requests).
fn mixed_workload(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool/mixed");
    let per_round = 1usize << 13;
    group.throughput(Throughput::Elements(per_round as u64));
    let pool = BlockPool::new(4096).unwrap();
    let mutex = Mutex::new(RefBlockPool::new(4096, true, false).unwrap());
    fn run(pool: &impl SharedPool, threads: usize, iters: u64, per_round: usize) -> Duration {
        let start = Instant::now();
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    let seed = 0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) << 40);
                    mixed_requests(pool, seed, per_round / threads * iters as usize);
                });
            }
        });
        start.elapsed()
    }
    for threads in [1usize, 2, 4] {
        group.bench_with_input(
            BenchmarkId::new("hybrid_kv", threads),
            &threads,
            |b, &threads| b.iter_custom(|iters| run(&pool, threads, iters, per_round)),
        );
        group.bench_with_input(
            BenchmarkId::new("mutex_reference", threads),
            &threads,
            |b, &threads| b.iter_custom(|iters| run(&mutex, threads, iters, per_round)),
        );
    }
    group.finish();
}

fn hashing(c: &mut Criterion) {
    let mut group = c.benchmark_group("hashing");
    let tokens: Vec<u32> = (0..65_536u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let extra = ExtraKeys::default();
    group.throughput(Throughput::Elements(tokens.len() as u64));
    for algo in [HashAlgo::Xxh3, HashAlgo::Blake3, HashAlgo::Sha256] {
        for bs in [16usize, 64] {
            let hasher = BlockHasher::new(bs, algo, "").unwrap();
            let mut out = Vec::with_capacity(tokens.len() / bs);
            group.bench_function(BenchmarkId::new(algo.name(), bs), |b| {
                b.iter(|| {
                    out.clear();
                    hasher
                        .hash_blocks(None, black_box(&tokens), 0, &extra, &mut out)
                        .unwrap();
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = alloc_free, touch_cached_chain, free_cold, lookup_chain, concurrent_lookups, mixed_workload,
        hashing
}
criterion_main!(benches);
