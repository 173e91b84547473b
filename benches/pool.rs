//! Criterion benches of the block pool and block hashing.
//!
//! `cargo bench --bench pool` (full run); `cargo test --benches` runs each once as a smoke test.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hybrid_kv::{BlockHash, BlockHasher, BlockPool, ExtraKeys, HashAlgo, StoreInfo};
use std::hint::black_box;
use std::sync::Arc;
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

/// The same number of lookups split over 1 and 2 threads; criterion measures wall time.
fn concurrent_lookups(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool/concurrent_lookups");
    let n = 4096usize;
    let pool = Arc::new(BlockPool::new(n + 1).unwrap());
    let ids = pool.get_new_blocks(n).unwrap();
    let hashes: Arc<Vec<BlockHash>> =
        Arc::new((0..n as u128).map(|i| BlockHash(i * 0x9E37_79B9)).collect());
    pool.cache_full_blocks(&ids, &hashes, 0, StoreInfo::default())
        .unwrap();
    let per_round = 1u64 << 18;
    group.throughput(Throughput::Elements(per_round));
    for threads in [1usize, 2] {
        group.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    std::thread::scope(|s| {
                        for t in 0..threads {
                            let (pool, hashes) = (&pool, &hashes);
                            s.spawn(move || {
                                let share = per_round as usize / threads;
                                for _ in 0..iters {
                                    for k in 0..share {
                                        let h = hashes[(k * 7 + t) % hashes.len()];
                                        black_box(pool.lookup(h, 0));
                                    }
                                }
                            });
                        }
                    });
                    start.elapsed()
                })
            },
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
    targets = alloc_free, touch_cached_chain, lookup_chain, concurrent_lookups, hashing
}
criterion_main!(benches);
