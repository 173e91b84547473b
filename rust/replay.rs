//! Replays a conformance workload through a [`KVCacheManager`] with the exact scheduler loop of
//! `conformance/README.md` (vLLM 0.33's scheduling decisions as far as the KV cache manager
//! sees them), reporting every manager call as a [`TraceRecord`] (the `kvtrace/1` content).
//!
//! Parsing the workload JSON is left to the caller (tests, benches, bindings).

use crate::error::{CoreError, Result};
use crate::hashing::ExtraKeys;
use crate::manager::{
    checkpoint_exportable, mamba_checkpoint_position, AllocateArgs, ComputedBlocks, KVCacheManager,
    PrefixCacheStats, RequestHandle,
};
use crate::types::BlockId;
use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

/// The scheduler limits of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// 0: no limit.
    pub long_prefill_token_threshold: usize,
    pub max_model_len: usize,
}

/// One request of a workload: its prompt and the pre-drawn output tokens
/// (`max_tokens = output.len()`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadRequest {
    pub rid: String,
    pub arrival_step: usize,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub name: String,
    pub sched: SchedConfig,
    /// Blocks in the pool, the null block included.
    pub num_blocks: usize,
    pub requests: Vec<WorkloadRequest>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FreeReason {
    Finished,
    Preempted,
}

impl FreeReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FreeReason::Finished => "finished",
            FreeReason::Preempted => "preempted",
        }
    }
}

/// What one manager call did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallOp {
    GetComputedBlocks {
        num_tokens: usize,
        hit_tokens: usize,
        hit_blocks: Vec<Vec<BlockId>>,
        spb: usize,
    },
    AllocateSlots {
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        /// The request's computed tokens before the call.
        num_computed_tokens: usize,
        /// Admission of a waiting request (`full_sequence_must_fit`).
        admit: bool,
        /// `None`: out of blocks.
        new_blocks: Option<Vec<Vec<BlockId>>>,
    },
    Free {
        reason: FreeReason,
    },
}

impl CallOp {
    pub fn name(&self) -> &'static str {
        match self {
            CallOp::GetComputedBlocks { .. } => "get_computed_blocks",
            CallOp::AllocateSlots { .. } => "allocate_slots",
            CallOp::Free { .. } => "free",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call<'a> {
    pub step: usize,
    pub rid: &'a str,
    pub op: CallOp,
    /// Free blocks after the call (cached evictable ones included).
    pub free: usize,
    /// Prefix-cache keys after the call.
    pub cached: usize,
    /// Duration of the manager call alone.
    pub ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceRecord<'a> {
    Step {
        step: usize,
        running: usize,
        waiting: usize,
    },
    Call(Call<'a>),
}

/// Per-operation call durations.
#[derive(Clone, Debug, Default)]
pub struct OpTiming {
    pub samples_ns: Vec<u64>,
}

impl OpTiming {
    pub fn count(&self) -> usize {
        self.samples_ns.len()
    }

    /// Saturating: samples summing past `u64::MAX` give `u64::MAX`.
    pub fn total_ns(&self) -> u64 {
        self.samples_ns.iter().fold(0, |a, &b| a.saturating_add(b))
    }

    /// The `q`-quantile (0.5 = median) by nearest rank.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.samples_ns.is_empty() {
            return 0;
        }
        let mut s = self.samples_ns.clone();
        s.sort_unstable();
        let idx = ((s.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        s[idx]
    }

    pub fn mean_ns(&self) -> f64 {
        if self.samples_ns.is_empty() {
            0.0
        } else {
            self.total_ns() as f64 / self.samples_ns.len() as f64
        }
    }
}

/// What a replay did in total.
#[derive(Clone, Debug, Default)]
pub struct ReplaySummary {
    /// Keyed by op name; `allocate_slots` also under `.admit` / `.chunk` / `.decode`, plus
    /// `make_request`, `append_token` and `new_step_starts`.
    pub timing: BTreeMap<&'static str, OpTiming>,
    pub prefix_cache: PrefixCacheStats,
    pub num_steps: usize,
    pub num_preemptions: usize,
    pub num_finished: usize,
    pub num_calls: usize,
    pub free_at_end: usize,
}

impl ReplaySummary {
    /// Total time spent in manager calls (`get_computed_blocks`, `allocate_slots`, `free`).
    pub fn manager_ns(&self) -> u64 {
        ["get_computed_blocks", "allocate_slots", "free"]
            .iter()
            .filter_map(|op| self.timing.get(op))
            .map(OpTiming::total_ns)
            .sum()
    }

    fn time(&mut self, op: &'static str, ns: u64) {
        self.timing.entry(op).or_default().samples_ns.push(ns);
    }
}

struct ReqState {
    num_computed: usize,
    num_outputs: usize,
    num_preemptions: usize,
}

fn elapsed_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// What the Mamba block-aligned split needs of the scheduler's limits.
pub struct SplitLimits {
    /// The attention block size (Mamba states are kept at its multiples).
    pub block_size: usize,
    pub max_num_batched_tokens: usize,
    /// 0: no limit.
    pub long_prefill_token_threshold: usize,
    /// The alignment of the Mamba groups' prefill checkpoint exports (0: some Mamba group
    /// exports none). A final chunk the worker can export the prompt's checkpoint from is not
    /// split.
    pub checkpoint_alignment: usize,
}

/// vLLM's `_mamba_block_aligned_split` (align mode, hash block = block size, no EAGLE): clips a
/// prefill chunk of `n` tokens starting at `start` so it ends where a Mamba state must be
/// cached (a block boundary, the prompt's last cacheable position, a shared-prefix junction).
/// A `block_size` of 0 leaves the chunk whole.
pub fn mamba_block_aligned_split(
    limits: &SplitLimits,
    num_prompt_tokens: usize,
    num_tokens: usize,
    start: usize,
    n: usize,
    junction: usize,
) -> usize {
    let bs = limits.block_size;
    let prefill_end = num_prompt_tokens.max(num_tokens.saturating_sub(1));
    // A block size of 0 has no boundaries to keep: the chunk stays whole.
    if start >= prefill_end || bs == 0 {
        return n;
    }
    let mut end = start.saturating_add(n);
    let exports_checkpoint = limits.checkpoint_alignment > 0
        && end >= prefill_end
        && checkpoint_exportable(
            start,
            end,
            mamba_checkpoint_position(prefill_end, bs, false, 0),
            bs,
            bs,
            limits.checkpoint_alignment,
        );
    let last_cache_position = if exports_checkpoint {
        0
    } else {
        num_tokens.saturating_sub(1) / bs * bs
    };
    if end < prefill_end {
        let threshold = limits.long_prefill_token_threshold;
        let max_prefill = if threshold > 0 {
            threshold.min(limits.max_num_batched_tokens)
        } else {
            limits.max_num_batched_tokens
        };
        let aligned_end = end / bs * bs;
        if aligned_end > start || bs <= max_prefill {
            end = aligned_end;
        }
    }
    let next_block_boundary = (start / bs + 1).saturating_mul(bs);
    let mut stops = [usize::MAX; 3];
    if start % bs != 0 && !exports_checkpoint {
        stops[0] = next_block_boundary;
    }
    stops[1] = last_cache_position;
    if start < junction && junction < end {
        stops[2] = start + (junction - start) / bs * bs;
    }
    if let Some(&stop) = stops.iter().filter(|&&s| start < s && s < end).min() {
        end = stop;
    }
    end.saturating_sub(start)
}

/// Drives `manager` (built for the workload's KV cache layout, with no requests yet) through
/// the conformance scheduler loop, calling `sink` for every step and manager call in order.
pub fn replay<'w>(
    workload: &'w Workload,
    manager: &mut KVCacheManager,
    sink: &mut dyn FnMut(TraceRecord<'w>),
) -> Result<ReplaySummary> {
    let sched = &workload.sched;
    if sched.max_num_batched_tokens == 0 || sched.max_num_seqs == 0 {
        return Err(CoreError::InvalidConfig(
            "max_num_batched_tokens and max_num_seqs must be positive".into(),
        ));
    }
    if sched.max_model_len != manager.max_model_len() {
        return Err(CoreError::InvalidConfig(format!(
            "workload max_model_len {} differs from the manager's {}",
            sched.max_model_len,
            manager.max_model_len()
        )));
    }
    if let Some(r) = workload
        .requests
        .iter()
        .find(|r| r.prompt.is_empty() || r.prompt.len() >= sched.max_model_len)
    {
        return Err(CoreError::InvalidConfig(format!(
            "request {:?}: prompt of {} tokens must be non-empty and shorter than max_model_len",
            r.rid,
            r.prompt.len()
        )));
    }
    let reqs = &workload.requests;
    let threshold = if sched.long_prefill_token_threshold == 0 {
        usize::MAX
    } else {
        sched.long_prefill_token_threshold
    };
    let max_model_len = sched.max_model_len;
    // Mamba layouts end prefill chunks where a state must be cached (vLLM's scheduler does).
    let mamba_block = manager
        .group_specs()
        .iter()
        .any(|g| g.is_mamba_align())
        .then(|| manager.scheduler_block_size());
    // vLLM's scheduler: exports when every Mamba group has them, at the first one's alignment.
    let mamba_alignments: Vec<usize> = manager
        .group_specs()
        .iter()
        .filter(|g| g.is_mamba())
        .map(|g| g.prefill_checkpoint_alignment())
        .collect();
    let checkpoint_alignment = if mamba_alignments.contains(&0) {
        0
    } else {
        mamba_alignments.first().copied().unwrap_or(0)
    };
    let split_limits = |bs: usize| SplitLimits {
        block_size: bs,
        max_num_batched_tokens: sched.max_num_batched_tokens,
        long_prefill_token_threshold: sched.long_prefill_token_threshold,
        checkpoint_alignment,
    };
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| reqs[i].arrival_step);
    let mut states: Vec<ReqState> = (0..reqs.len())
        .map(|_| ReqState {
            num_computed: 0,
            num_outputs: 0,
            num_preemptions: 0,
        })
        .collect();
    let num_tokens = |s: &ReqState, i: usize| reqs[i].prompt.len() + s.num_outputs;
    // Requests are named by the handle `add_request` returns, as the Python layer does.
    let mut handles: Vec<Option<RequestHandle>> = vec![None; reqs.len()];
    let handle = |handles: &[Option<RequestHandle>], i: usize| {
        handles[i].expect("requests are added on arrival, before any call names them")
    };

    let mut summary = ReplaySummary::default();
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<usize> = Vec::new();
    let mut scheduled: Vec<(usize, usize)> = Vec::new();
    let mut next = 0;
    let mut step = 0;

    macro_rules! call {
        ($rid:expr, $op:expr, $ns:expr) => {{
            summary.num_calls += 1;
            sink(TraceRecord::Call(Call {
                step,
                rid: $rid,
                op: $op,
                free: manager.num_free_blocks(),
                cached: manager.num_cached_keys(),
                ns: $ns,
            }));
        }};
    }

    loop {
        while next < order.len() && reqs[order[next]].arrival_step <= step {
            let i = order[next];
            let t = Instant::now();
            handles[i] =
                Some(manager.add_request(&reqs[i].rid, &reqs[i].prompt, ExtraKeys::default())?);
            summary.time("make_request", elapsed_ns(t));
            waiting.push_back(i);
            next += 1;
        }
        if running.is_empty() && waiting.is_empty() {
            if next == order.len() {
                break;
            }
            step = reqs[order[next]].arrival_step;
            continue;
        }
        sink(TraceRecord::Step {
            step,
            running: running.len(),
            waiting: waiting.len(),
        });
        summary.num_steps += 1;
        let t = Instant::now();
        manager.new_step_starts();
        summary.time("new_step_starts", elapsed_ns(t));

        let mut budget = sched.max_num_batched_tokens;
        let mut preempted = false;
        scheduled.clear();

        // A) running requests, in order.
        let mut k = 0;
        'running: while k < running.len() && budget > 0 {
            let i = running[k];
            let s = &states[i];
            let n = (num_tokens(s, i) - s.num_computed)
                .min(threshold)
                .min(budget)
                .min(max_model_len.saturating_sub(1 + s.num_computed));
            let n = match mamba_block {
                Some(bs) => mamba_block_aligned_split(
                    &split_limits(bs),
                    reqs[i].prompt.len(),
                    num_tokens(s, i),
                    s.num_computed,
                    n,
                    manager.shared_prefix_boundary(handle(&handles, i))?,
                ),
                None => n,
            };
            if n == 0 {
                k += 1;
                continue;
            }
            loop {
                let computed = states[i].num_computed;
                let t = Instant::now();
                let r = manager.allocate_slots(
                    handle(&handles, i),
                    &AllocateArgs {
                        num_new_tokens: n,
                        num_computed_tokens: computed,
                        ..Default::default()
                    },
                )?;
                let ns = elapsed_ns(t);
                summary.time("allocate_slots", ns);
                summary.time(
                    if n == 1 {
                        "allocate_slots.decode"
                    } else {
                        "allocate_slots.chunk"
                    },
                    ns,
                );
                let ok = r.is_some();
                call!(
                    &reqs[i].rid,
                    CallOp::AllocateSlots {
                        num_new_tokens: n,
                        num_new_computed_tokens: 0,
                        num_computed_tokens: computed,
                        admit: false,
                        new_blocks: r,
                    },
                    ns
                );
                if ok {
                    scheduled.push((i, n));
                    budget -= n;
                    break;
                }
                let victim = running.pop().expect("the request itself is running");
                let t = Instant::now();
                manager.free(handle(&handles, victim))?;
                let ns = elapsed_ns(t);
                summary.time("free", ns);
                call!(
                    &reqs[victim].rid,
                    CallOp::Free {
                        reason: FreeReason::Preempted
                    },
                    ns
                );
                states[victim].num_computed = 0;
                states[victim].num_preemptions += 1;
                summary.num_preemptions += 1;
                waiting.push_front(victim);
                preempted = true;
                if victim == i {
                    break 'running;
                }
            }
            k += 1;
        }

        // B) admit waiting requests.
        if !preempted {
            while let Some(&i) = waiting.front() {
                if budget == 0 || running.len() >= sched.max_num_seqs {
                    break;
                }
                let rid = reqs[i].rid.as_str();
                let t = Instant::now();
                let computed = manager.get_computed_blocks(handle(&handles, i))?;
                let gcb_ns = elapsed_ns(t);
                summary.time("get_computed_blocks", gcb_ns);
                let (gcb_free, gcb_cached) = (manager.num_free_blocks(), manager.num_cached_keys());
                let hit = computed.num_computed_tokens;
                let total = num_tokens(&states[i], i);
                let n = (total - hit)
                    .min(threshold)
                    .min(budget)
                    .min(max_model_len.saturating_sub(1 + hit));
                let n = match mamba_block {
                    Some(bs) => mamba_block_aligned_split(
                        &split_limits(bs),
                        reqs[i].prompt.len(),
                        total,
                        states[i].num_computed + hit,
                        n,
                        computed.shared_prefix_boundary,
                    ),
                    None => n,
                };
                let emit_gcb = |sink: &mut dyn FnMut(TraceRecord<'w>), c: ComputedBlocks| {
                    sink(TraceRecord::Call(Call {
                        step,
                        rid,
                        op: CallOp::GetComputedBlocks {
                            num_tokens: total,
                            hit_tokens: c.num_computed_tokens,
                            hit_blocks: c.blocks,
                            spb: c.shared_prefix_boundary,
                        },
                        free: gcb_free,
                        cached: gcb_cached,
                        ns: gcb_ns,
                    }))
                };
                summary.num_calls += 1;
                if n == 0 {
                    emit_gcb(sink, computed);
                    break;
                }
                let t = Instant::now();
                let r = manager.allocate_slots(
                    handle(&handles, i),
                    &AllocateArgs {
                        num_new_tokens: n,
                        num_computed_tokens: 0,
                        num_new_computed_tokens: hit,
                        new_computed_blocks: Some(&computed),
                        full_sequence_must_fit: true,
                        has_scheduled_reqs: !running.is_empty(),
                        ..Default::default()
                    },
                )?;
                let ns = elapsed_ns(t);
                summary.time("allocate_slots", ns);
                summary.time("allocate_slots.admit", ns);
                emit_gcb(sink, computed);
                let ok = r.is_some();
                call!(
                    rid,
                    CallOp::AllocateSlots {
                        num_new_tokens: n,
                        num_new_computed_tokens: hit,
                        num_computed_tokens: 0,
                        admit: true,
                        new_blocks: r,
                    },
                    ns
                );
                if !ok {
                    break;
                }
                manager.record_prefix_cache_stats(
                    handle(&handles, i),
                    hit,
                    states[i].num_preemptions > 0,
                )?;
                waiting.pop_front();
                running.push(i);
                states[i].num_computed = hit;
                scheduled.push((i, n));
                budget -= n;
            }
        }

        if scheduled.is_empty() && !preempted && running.is_empty() {
            // Nothing can change any more: no running request will free blocks, so the head of
            // the queue is refused again on every later step.
            let &i = waiting
                .front()
                .expect("a step runs only with requests waiting or running");
            let h = handle(&handles, i);
            let hit = manager.get_computed_blocks(h)?;
            return Err(CoreError::Stalled {
                step,
                request: reqs[i].rid.clone(),
                blocks_needed: manager.num_blocks_to_admit(h, Some(&hit))?,
                free_blocks: manager.num_free_blocks(),
                num_blocks: manager.pool().num_blocks(),
            });
        }

        // C) "execute".
        for &(i, n) in &scheduled {
            states[i].num_computed += n;
        }

        // D) sample and finish.
        for &(i, _) in &scheduled {
            let s = &mut states[i];
            let r = &reqs[i];
            if s.num_computed != r.prompt.len() + s.num_outputs {
                continue;
            }
            if s.num_outputs < r.output.len() {
                let t = Instant::now();
                manager.append_token_ids(
                    handle(&handles, i),
                    &r.output[s.num_outputs..s.num_outputs + 1],
                )?;
                summary.time("append_token", elapsed_ns(t));
                s.num_outputs += 1;
            }
            if s.num_outputs >= r.output.len() || r.prompt.len() + s.num_outputs >= max_model_len {
                let t = Instant::now();
                manager.free(handle(&handles, i))?;
                let ns = elapsed_ns(t);
                summary.time("free", ns);
                call!(
                    &r.rid,
                    CallOp::Free {
                        reason: FreeReason::Finished
                    },
                    ns
                );
                manager.remove_request(handle(&handles, i))?;
                running.retain(|&x| x != i);
                summary.num_finished += 1;
            }
        }
        // What vLLM's scheduler hands its workers every step (untimed here): blocks to zero
        // and Mamba states to offload.
        manager.take_new_block_ids();
        manager.take_boundary_state_offloads();
        step = step.checked_add(1).ok_or_else(|| {
            CoreError::OutOfRange(format!(
                "step {step} is the last a step count holds (request arrival steps near \
                 usize::MAX)"
            ))
        })?;
    }
    summary.prefix_cache = manager.prefix_cache_stats();
    summary.free_at_end = manager.num_free_blocks();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::{GroupSpec, ManagerConfig};

    fn tokens(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    fn tiny_workload(num_blocks: usize) -> Workload {
        let request = |rid: &str, arrival_step, prompt: Vec<u32>, n_out| WorkloadRequest {
            rid: rid.into(),
            arrival_step,
            prompt,
            output: (0..n_out).collect(),
        };
        Workload {
            name: "tiny".into(),
            sched: SchedConfig {
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
                long_prefill_token_threshold: 0,
                max_model_len: 512,
            },
            num_blocks,
            requests: vec![
                request("a", 0, tokens(0, 100), 5),
                request("b", 0, tokens(0, 120), 3),
                request("c", 7, tokens(900, 40), 2),
            ],
        }
    }

    #[test]
    fn replay_runs_the_scheduler_loop_to_completion() {
        let w = tiny_workload(64);
        let c = ManagerConfig::new(
            vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
            64,
            512,
        );
        let mut m = KVCacheManager::new(&c).unwrap();
        let mut records = Vec::new();
        let s = replay(&w, &mut m, &mut |r| records.push(r)).unwrap();
        assert_eq!(s.num_finished, 3);
        assert_eq!(s.free_at_end, 63);
        assert_eq!(m.num_requests(), 0);
        // Chunked prefill of 64 tokens per step; b re-uses a's cached prefix.
        let first = &records[1];
        assert!(matches!(first, TraceRecord::Call(c) if c.rid == "a"));
        assert_eq!(s.prefix_cache.requests, 3);
        assert!(s.prefix_cache.hits > 0);
        assert!(s.timing["allocate_slots.decode"].count() > 0);
    }

    #[test]
    fn replay_reports_a_workload_that_cannot_make_progress() {
        // 3 usable blocks cannot hold a 100-token prompt: admission fails forever.
        let w = tiny_workload(4);
        let c = ManagerConfig::new(vec![GroupSpec::full(16)], 4, 512);
        let mut m = KVCacheManager::new(&c).unwrap();
        assert!(matches!(
            replay(&w, &mut m, &mut |_| {}),
            Err(CoreError::Stalled { step: 0, ref request, blocks_needed: 7, free_blocks: 3, num_blocks: 4 })
                if request == "a"
        ));
        let mut m =
            KVCacheManager::new(&ManagerConfig::new(vec![GroupSpec::full(16)], 64, 4096)).unwrap();
        assert!(replay(&w, &mut m, &mut |_| {}).is_err()); // max_model_len differs
    }

    #[test]
    fn an_attention_free_model_runs_its_requests_to_completion() {
        // No KV cache groups: no request holds a block, yet a running request's later steps
        // come with the tokens it computed (refused as counts past the slots held).
        let w = tiny_workload(1);
        let mut m = KVCacheManager::new(&ManagerConfig::new(vec![], 1, 512)).unwrap();
        let s = replay(&w, &mut m, &mut |_| {}).unwrap();
        assert_eq!(s.num_finished, 3);
        assert_eq!(m.num_requests(), 0);
    }

    #[test]
    fn a_step_count_past_usize_max_is_an_error() {
        let mut w = tiny_workload(64);
        w.requests.truncate(1);
        w.requests[0].arrival_step = usize::MAX;
        let c = ManagerConfig::new(vec![GroupSpec::full(16)], 64, 512);
        let mut m = KVCacheManager::new(&c).unwrap();
        let mut steps = Vec::new();
        let r = replay(&w, &mut m, &mut |r| {
            if let TraceRecord::Step { step, .. } = r {
                steps.push(step)
            }
        });
        assert!(matches!(r, Err(CoreError::OutOfRange(_))), "{r:?}");
        assert_eq!(steps, [usize::MAX]);
    }

    #[test]
    fn op_timing_totals_saturate() {
        let t = OpTiming {
            samples_ns: vec![u64::MAX, u64::MAX],
        };
        assert_eq!(t.total_ns(), u64::MAX);
        assert_eq!(t.mean_ns(), u64::MAX as f64 / 2.0);
    }

    #[test]
    fn a_final_chunk_exporting_the_checkpoint_is_not_split() {
        let limits = |checkpoint_alignment| SplitLimits {
            block_size: 4,
            max_num_batched_tokens: 64,
            long_prefill_token_threshold: 0,
            checkpoint_alignment,
        };
        // An 18-token prompt from 0: without exports the chunk stops at the last cacheable
        // boundary, 16; with them it runs to the end (the worker exports 16 from inside it).
        assert_eq!(mamba_block_aligned_split(&limits(0), 18, 18, 0, 18, 0), 16);
        assert_eq!(mamba_block_aligned_split(&limits(1), 18, 18, 0, 18, 0), 18);
        // A chunk not reaching the prefill end is still aligned down to a block boundary.
        assert_eq!(mamba_block_aligned_split(&limits(1), 18, 18, 0, 10, 0), 8);
        // A final chunk starting mid-block cannot export: it stops at the next boundary.
        assert_eq!(mamba_block_aligned_split(&limits(1), 18, 18, 6, 12, 0), 2);
        // From a block boundary one block before the checkpoint: exported too.
        assert_eq!(mamba_block_aligned_split(&limits(1), 18, 18, 12, 6, 0), 6);
        assert_eq!(mamba_block_aligned_split(&limits(0), 18, 18, 12, 6, 0), 4);
        // An alignment the checkpoint is not on (16 - 8 = 8 tokens in): stopped at 16.
        assert_eq!(mamba_block_aligned_split(&limits(3), 18, 18, 8, 10, 0), 8);
        // A junction inside the chunk still ends it.
        assert_eq!(mamba_block_aligned_split(&limits(1), 18, 18, 0, 18, 9), 8);
    }
}
