//! Replays the conformance workloads (vLLM 0.33's own traces, ../shared/conformance) through the
//! pure-Rust manager: the floor under the Python API. Prints, per fixture, the total time spent
//! in manager calls next to vLLM's, then benchmarks whole replays and decode `allocate_slots`.
//!
//!     CARGO_TARGET_DIR=target-mgr cargo bench --bench replay

#[path = "../tests/common/mod.rs"]
mod common;

use common::{load_trace, load_workload, manager_config};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use hybrid_kv::manager::{AllocateArgs, GroupSpec, KVCacheManager, ManagerConfig};
use hybrid_kv::replay::{replay, ReplaySummary, Workload};
use hybrid_kv::ExtraKeys;
use std::hint::black_box;
use std::time::{Duration, Instant};

struct Fixture {
    name: &'static str,
    workload: Workload,
    config: ManagerConfig,
    vllm_timing: serde_json::Value,
}

fn fixtures() -> Vec<Fixture> {
    common::fixtures()
        .into_iter()
        .map(|name| {
            let workload = load_workload(name);
            let trace = load_trace(name);
            let config = manager_config(&trace, &workload);
            Fixture {
                name,
                workload,
                config,
                vllm_timing: trace.summary["timing"].clone(),
            }
        })
        .collect()
}

fn run(f: &Fixture) -> ReplaySummary {
    let mut manager = KVCacheManager::new(&f.config).unwrap();
    replay(&f.workload, &mut manager, &mut |_| {}).unwrap()
}

fn print_table(fixtures: &[Fixture]) {
    println!(
        "\n{:<32} {:>7} {:>10} {:>10} {:>8} | {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "fixture (manager calls)",
        "calls",
        "ours ms",
        "vLLM ms",
        "speedup",
        "decode p50",
        "vLLM p50",
        "admit p50",
        "vLLM p50",
        "gcb p50",
        "vLLM p50",
        "free p50",
        "vLLM p50"
    );
    for f in fixtures {
        // Best of 3 runs (the machine is shared); one under `cargo test --benches`.
        let runs = if std::env::args().any(|a| a == "--bench") {
            3
        } else {
            1
        };
        let s = (0..runs)
            .map(|_| run(f))
            .min_by_key(|s| s.manager_ns())
            .unwrap();
        let vllm_s: f64 = ["get_computed_blocks", "allocate_slots", "free"]
            .iter()
            .map(|op| f.vllm_timing[op]["total_s"].as_f64().unwrap_or(0.0))
            .sum();
        let ours_ms = s.manager_ns() as f64 / 1e6;
        let p50 = |op: &str| s.timing.get(op).map_or(0, |t| t.quantile_ns(0.5));
        let vp50 = |op: &str| f.vllm_timing[op]["median_ns"].as_u64().unwrap_or(0);
        println!(
            "{:<32} {:>7} {:>10.2} {:>10.2} {:>7.1}x | {:>7}ns {:>7}ns {:>7}ns {:>7}ns {:>7}ns {:>7}ns {:>7}ns {:>7}ns",
            f.name,
            s.num_calls,
            ours_ms,
            vllm_s * 1e3,
            vllm_s * 1e3 / ours_ms,
            p50("allocate_slots.decode"),
            vp50("allocate_slots.decode"),
            p50("allocate_slots.admit"),
            vp50("allocate_slots.admit"),
            p50("get_computed_blocks"),
            vp50("get_computed_blocks"),
            p50("free"),
            vp50("free"),
        );
    }
    println!();
}

/// Whole replays; the reported time is the manager calls' alone (scheduler loop excluded).
fn bench_replay(c: &mut Criterion, fixtures: &[Fixture]) {
    let mut group = c.benchmark_group("replay_manager_time");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    for f in fixtures {
        let calls = run(f).num_calls as u64;
        group.throughput(Throughput::Elements(calls));
        group.bench_function(BenchmarkId::from_parameter(f.name), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += Duration::from_nanos(black_box(run(f)).manager_ns());
                }
                total
            })
        });
    }
    group.finish();
}

/// One decode step (`allocate_slots` of 1 token) of a running request, on each layout,
/// with 64 requests running and their window / chunk boundaries crossed as in real decoding.
fn bench_decode(c: &mut Criterion, fixtures: &[Fixture]) {
    let mut group = c.benchmark_group("decode_allocate_slots");
    group.throughput(Throughput::Elements(1));
    for f in fixtures {
        let groups: Vec<GroupSpec> = f.config.groups.clone();
        group.bench_function(BenchmarkId::from_parameter(f.name), |b| {
            b.iter_custom(|iters| {
                const RUNNING: usize = 64;
                const PROMPT: usize = 1000;
                const MAX_LEN: usize = 4000;
                let mut config = f.config.clone();
                config.groups = groups.clone();
                let per_request: usize = groups.iter().map(|g| MAX_LEN / g.block_size + 2).sum();
                config.num_blocks = config.num_blocks.max(RUNNING * per_request + 1);
                let mut m = KVCacheManager::new(&config).unwrap();
                let mut computed = vec![0usize; RUNNING];
                let mut generation = 0u32;
                let admit = |m: &mut KVCacheManager, k: usize, generation: u32| {
                    let id = format!("r{k}");
                    let _ = m.remove_request(&id);
                    let prompt: Vec<u32> = (0..PROMPT as u32)
                        .map(|t| t * 31 + k as u32 * 7 + generation * 1_000_003)
                        .collect();
                    m.add_request(&id, &prompt, ExtraKeys::default()).unwrap();
                    let args = AllocateArgs {
                        num_new_tokens: PROMPT,
                        ..Default::default()
                    };
                    m.allocate_slots(&id, &args).unwrap().unwrap();
                    m.append_token_ids(&id, &[1u32]).unwrap();
                    PROMPT
                };
                for (k, c) in computed.iter_mut().enumerate() {
                    *c = admit(&mut m, k, generation);
                }
                let ids: Vec<String> = (0..RUNNING).map(|k| format!("r{k}")).collect();
                let mut total = Duration::ZERO;
                for i in 0..iters as usize {
                    let k = i % RUNNING;
                    if computed[k] + 1 >= MAX_LEN {
                        generation += 1;
                        computed[k] = admit(&mut m, k, generation);
                    }
                    let args = AllocateArgs {
                        num_new_tokens: 1,
                        num_computed_tokens: computed[k],
                        ..Default::default()
                    };
                    let t = Instant::now();
                    let r = m.allocate_slots(&ids[k], &args).unwrap();
                    total += t.elapsed();
                    black_box(r);
                    computed[k] += 1;
                    m.append_token_ids(&ids[k], &[2u32]).unwrap();
                }
                total
            })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    let fixtures = fixtures();
    print_table(&fixtures);
    bench_replay(c, &fixtures);
    bench_decode(c, &fixtures);
}

criterion_group!(replay_benches, benches);

fn main() {
    replay_benches();
    Criterion::default().configure_from_args().final_summary();
}
