//! Conformance: replays vLLM 0.33's own workloads (../shared/conformance) through the pure-Rust
//! manager with the README's scheduler loop and compares every manager call with vLLM's trace:
//! hits, hit blocks, allocation decisions, exact new block ids, free and cached counts.

mod common;

use common::{load_trace, load_workload, manager_config};
use hybrid_kv::manager::KVCacheManager;
use hybrid_kv::replay::{replay, CallOp, TraceRecord};
use hybrid_kv::BlockId;
use serde_json::{json, Value};

/// `[[leading nulls, [remaining ids]], ...]`, the kvtrace/1 block-list encoding.
fn encode(lists: &[Vec<BlockId>]) -> Value {
    Value::Array(
        lists
            .iter()
            .map(|l| {
                let z = l.iter().take_while(|&&b| b == 0).count();
                json!([z, l[z..].to_vec()])
            })
            .collect(),
    )
}

fn ours_as_json(r: &TraceRecord<'_>) -> Value {
    match r {
        TraceRecord::Step {
            step,
            running,
            waiting,
        } => json!({"kind": "step", "step": step, "running": running, "waiting": waiting}),
        TraceRecord::Call(c) => {
            let mut d = json!({"kind": "call", "step": c.step, "op": c.op.name(), "rid": c.rid,
                               "free": c.free, "cached": c.cached});
            let m = d.as_object_mut().unwrap();
            match &c.op {
                CallOp::GetComputedBlocks {
                    num_tokens,
                    hit_tokens,
                    hit_blocks,
                    spb,
                } => {
                    m.insert("num_tokens".into(), json!(num_tokens));
                    m.insert("hit_tokens".into(), json!(hit_tokens));
                    m.insert("hit_blocks".into(), encode(hit_blocks));
                    m.insert("spb".into(), json!(spb));
                }
                CallOp::AllocateSlots {
                    num_new_tokens,
                    num_new_computed_tokens,
                    num_computed_tokens,
                    admit,
                    new_blocks,
                } => {
                    m.insert("num_new_tokens".into(), json!(num_new_tokens));
                    m.insert(
                        "num_new_computed_tokens".into(),
                        json!(num_new_computed_tokens),
                    );
                    m.insert("num_computed_tokens".into(), json!(num_computed_tokens));
                    m.insert("admit".into(), json!(admit));
                    m.insert("ok".into(), json!(new_blocks.is_some()));
                    m.insert(
                        "new_blocks".into(),
                        new_blocks.as_deref().map_or(Value::Null, encode),
                    );
                }
                CallOp::Free { reason } => {
                    m.insert("reason".into(), json!(reason.as_str()));
                }
            }
            d
        }
    }
}

/// The fields of vLLM's line that `ours` must reproduce (timing and sequence numbers aside).
fn expected_view(theirs: &Value, ours: &Value) -> Value {
    let mut d = serde_json::Map::new();
    for (k, _) in ours.as_object().unwrap() {
        d.insert(k.clone(), theirs.get(k).cloned().unwrap_or(Value::Null));
    }
    Value::Object(d)
}

fn check_fixture(name: &str) {
    let workload = load_workload(name);
    let trace = load_trace(name);
    let mut manager = KVCacheManager::new(&manager_config(&trace, &workload)).unwrap();
    let mut idx = 0;
    let mut first_mismatch: Option<String> = None;
    let mut mismatches = 0usize;
    let body = &trace.body;
    let summary = replay(&workload, &mut manager, &mut |rec| {
        let ours = ours_as_json(&rec);
        let theirs = body.get(idx).map(|t| expected_view(t, &ours));
        if theirs.as_ref() != Some(&ours) {
            mismatches += 1;
            if first_mismatch.is_none() {
                let show = |v: &Value| {
                    let s = v.to_string();
                    if s.len() > 1500 {
                        format!("{}...", &s[..1500])
                    } else {
                        s
                    }
                };
                first_mismatch = Some(format!(
                    "line {idx}:\n  ours:  {}\n  vllm:  {}",
                    show(&ours),
                    theirs.as_ref().map_or("<end of trace>".into(), show)
                ));
            }
        }
        idx += 1;
    })
    .unwrap();
    if idx != body.len() {
        mismatches += 1;
        first_mismatch.get_or_insert(format!(
            "length differs: we produced {idx} step/call lines, vLLM {}",
            body.len()
        ));
    }
    let pc = &trace.summary["prefix_cache"];
    let s = summary.prefix_cache;
    let ours_pc = json!({"requests": s.requests, "queries": s.queries, "hits": s.hits,
        "preempted_requests": s.preempted_requests, "preempted_queries": s.preempted_queries,
        "preempted_hits": s.preempted_hits, "num_preemptions": summary.num_preemptions,
        "num_finished": summary.num_finished, "num_steps": summary.num_steps});
    let vllm_pc = json!({"requests": pc["requests"], "queries": pc["queries"], "hits": pc["hits"],
        "preempted_requests": pc["preempted_requests"], "preempted_queries": pc["preempted_queries"],
        "preempted_hits": pc["preempted_hits"],
        "num_preemptions": trace.summary["num_preemptions"],
        "num_finished": trace.summary["num_finished"], "num_steps": trace.summary["num_steps"]});
    if ours_pc != vllm_pc {
        mismatches += 1;
        first_mismatch.get_or_insert(format!(
            "summary differs:\n  ours: {ours_pc}\n  vllm: {vllm_pc}"
        ));
    }
    eprintln!(
        "{name}: {} over {idx} step/call lines; manager time {:.3} ms (vLLM {:.3} s)",
        if mismatches == 0 {
            "IDENTICAL".to_string()
        } else {
            format!("{mismatches} MISMATCHES")
        },
        summary.manager_ns() as f64 / 1e6,
        ["get_computed_blocks", "allocate_slots", "free"]
            .iter()
            .map(|op| trace.summary["timing"][op]["total_s"]
                .as_f64()
                .unwrap_or(0.0))
            .sum::<f64>()
    );
    if let Some(m) = first_mismatch {
        panic!("{name}: not identical to vLLM 0.33 ({mismatches} mismatches); first: {m}");
    }
}

#[test]
fn gpt_oss_shared_prefix_is_identical_to_vllm() {
    check_fixture("gpt-oss.shared-prefix");
}

#[test]
fn full_attn_eviction_is_identical_to_vllm() {
    check_fixture("full-attn.eviction");
}

#[test]
fn gemma3_27b_eviction_is_identical_to_vllm() {
    check_fixture("gemma3-27b.eviction");
}

#[test]
fn gpt_oss_long_context_is_identical_to_vllm() {
    check_fixture("gpt-oss.long-context");
}

#[test]
fn jamba_eviction_is_identical_to_vllm() {
    check_fixture("jamba.eviction");
}

#[test]
fn jamba_shared_prefix_default_is_identical_to_vllm() {
    check_fixture("jamba.shared-prefix.default");
}

#[test]
fn gpt_oss_eviction_default_is_identical_to_vllm() {
    check_fixture("gpt-oss.eviction.default");
}

#[test]
fn gemma3_27b_shared_prefix_default_is_identical_to_vllm() {
    check_fixture("gemma3-27b.shared-prefix.default");
}

#[test]
fn llama4_long_context_default_is_identical_to_vllm() {
    check_fixture("llama4.long-context.default");
}
