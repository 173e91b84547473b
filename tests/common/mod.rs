//! Loading the conformance fixtures (`../shared/conformance`): shared by the conformance test
//! and the replay bench.
#![allow(dead_code)]

use flate2::read::GzDecoder;
use hybrid_kv::manager::{GroupSpec, ManagerConfig};
use hybrid_kv::replay::{SchedConfig, Workload, WorkloadRequest};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;

/// The fixtures of `conformance/README.md`, one name a line in `tests/conformance_fixtures.txt`
/// (the Python tests and benches read the same file).
pub fn fixtures() -> Vec<&'static str> {
    include_str!("../conformance_fixtures.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

pub fn fixture_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/conformance");
    assert!(
        dir.is_dir(),
        "conformance fixtures not found at {} (expected the shared checkout next to the repo)",
        dir.display()
    );
    dir
}

pub fn open_gz(path: &PathBuf) -> BufReader<GzDecoder<std::fs::File>> {
    let file = std::fs::File::open(path)
        .unwrap_or_else(|e| panic!("cannot open fixture {}: {e}", path.display()));
    BufReader::with_capacity(1 << 20, GzDecoder::new(file))
}

pub fn as_usize(v: &Value, what: &str) -> usize {
    v.as_u64()
        .unwrap_or_else(|| panic!("{what}: expected an unsigned integer, got {v}")) as usize
}

pub fn load_workload(name: &str) -> Workload {
    let path = fixture_dir().join(format!("{name}.workload.json.gz"));
    let mut text = String::new();
    open_gz(&path).read_to_string(&mut text).unwrap();
    let w: Value = serde_json::from_str(&text).unwrap();
    let s = &w["sched"];
    let tokens = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    Workload {
        name: w["name"].as_str().unwrap().to_owned(),
        sched: SchedConfig {
            max_num_seqs: as_usize(&s["max_num_seqs"], "max_num_seqs"),
            max_num_batched_tokens: as_usize(
                &s["max_num_batched_tokens"],
                "max_num_batched_tokens",
            ),
            long_prefill_token_threshold: as_usize(
                &s["long_prefill_token_threshold"],
                "long_prefill_token_threshold",
            ),
            max_model_len: as_usize(&s["max_model_len"], "max_model_len"),
        },
        num_blocks: as_usize(&w["num_blocks"], "num_blocks"),
        requests: w["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| WorkloadRequest {
                rid: r["rid"].as_str().unwrap().to_owned(),
                arrival_step: as_usize(&r["arrival_step"], "arrival_step"),
                prompt: tokens(&r["prompt"]),
                output: tokens(&r["output"]),
            })
            .collect(),
    }
}

pub struct Trace {
    pub header: Value,
    pub body: Vec<Value>,
    pub summary: Value,
}

pub fn load_trace(name: &str) -> Trace {
    let path = fixture_dir().join(format!("{name}.vllm.jsonl.gz"));
    let (mut header, mut body, mut summary) = (Value::Null, Vec::new(), Value::Null);
    for line in open_gz(&path).lines() {
        let d: Value = serde_json::from_str(&line.unwrap()).unwrap();
        match d["kind"].as_str() {
            Some("header") => header = d,
            Some("summary") => summary = d,
            Some("call") | Some("step") => body.push(d),
            _ => {}
        }
    }
    assert!(header.is_object(), "{name}: trace has no header");
    Trace {
        header,
        body,
        summary,
    }
}

pub fn manager_config(trace: &Trace, workload: &Workload) -> ManagerConfig {
    let kv = &trace.header["kv_cache"];
    let groups = kv["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let bs = as_usize(&g["block_size"], "block_size");
            // A header's `kind` is vLLM's coarse name (an RSWA group reads "full"): a spec
            // class this test does not build is refused rather than replayed as that kind.
            if let Some(spec) = g["spec"].as_str() {
                assert!(
                    matches!(
                        spec,
                        "FullAttentionSpec"
                            | "SlidingWindowSpec"
                            | "ChunkedLocalAttentionSpec"
                            | "MambaSpec"
                    ),
                    "unsupported group spec {spec:?} in the conformance test"
                );
            }
            match g["kind"].as_str().unwrap() {
                "full" => GroupSpec::full(bs),
                "sliding_window" => {
                    GroupSpec::sliding_window(bs, as_usize(&g["sliding_window"], "sliding_window"))
                }
                "chunked_local" => GroupSpec::chunked_local(
                    bs,
                    as_usize(&g["attention_chunk_size"], "attention_chunk_size"),
                ),
                "mamba" => {
                    assert_eq!(g["mamba_cache_mode"].as_str(), Some("align"));
                    GroupSpec::mamba(bs)
                }
                other => panic!("unsupported group kind {other:?} in the conformance test"),
            }
        })
        .collect();
    let num_blocks = as_usize(&kv["num_blocks"], "num_blocks");
    assert_eq!(num_blocks, workload.num_blocks);
    let mut config = ManagerConfig::new(groups, num_blocks, workload.sched.max_model_len);
    config.scheduler_block_size = Some(as_usize(
        &kv["scheduler_block_size"],
        "scheduler_block_size",
    ));
    config.hash_block_size = Some(as_usize(&kv["hash_block_size"], "hash_block_size"));
    // vLLM: max_concurrent_batches (1, synchronous scheduling) × max_num_batched_tokens.
    config.max_in_flight_tokens = Some(workload.sched.max_num_batched_tokens);
    config.retention_interval = kv["prefix_cache_retention_interval"]
        .as_u64()
        .map(|v| v as usize);
    config
}
