//! The coordinator (vLLM's `KVCacheCoordinator`): combines the per-group rules of
//! [`single_type`](super::single_type) into one request's allocation. It owns the loops over the
//! KV cache groups (count, free out-of-window blocks, adopt a hit, allocate, cache, free) and the
//! prefix-cache hit search across groups (the hybrid fixed point).
//!
//! A coordinator is immutable: block tables live in the manager's request state and are passed
//! in, so the same `Arc<Coordinator>` serves the scheduler and concurrent probes.

use super::request::Request;
use super::single_type::{
    find_longest_cache_hit, first_at_least, Allocation, CacheCtx, ChunkCtx, Effects, GroupManager,
    GroupTable,
};
use super::spec::{AttentionKind, GroupSpec, MambaMode, ManagerConfig};
use super::RunningHorizon;
use crate::error::{bad_config, Result};
use crate::pool::BlockPool;
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, NULL_BLOCK};

/// Blocks a request's first allocation leaves room for in its tables beyond the slots it asks
/// for: 256 tokens of decode at block size 16 before the table grows.
pub(crate) const TABLE_HEADROOM: usize = 16;

/// Which coordinator vLLM would build for this layout.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CoordinatorKind {
    /// Prefix caching off: every lookup hits nothing.
    NoPrefixCache,
    /// One group: its own rule, no intersection.
    Unitary,
    /// Several groups: fixed-point intersection of the attention types' hits.
    Hybrid,
}

/// Groups with identical specs, looked up together (a hit needs every one of them cached).
#[derive(Clone, Debug)]
struct SpecGroup {
    spec: GroupSpec,
    group_ids: Vec<usize>,
    /// Some member drops the EAGLE block.
    use_eagle: bool,
}

/// The result of a hit search.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Hit {
    /// Tokens of the reconciled hit.
    pub(crate) tokens: usize,
    /// Longest hit any single attention type reported minus `tokens` (vLLM's
    /// `num_uncached_common_prefix_tokens`).
    pub(crate) uncached_common: usize,
}

#[derive(Debug)]
pub struct Coordinator {
    kind: CoordinatorKind,
    groups: Vec<GroupManager>,
    spec_groups: Vec<SpecGroup>,
    hash_block_size: usize,
    scheduler_block_size: usize,
    /// Tokens a hit length must be a multiple of.
    alignment: usize,
    /// Fine-grained partial hash hits: hits at hash block boundaries inside blocks (vLLM's
    /// `enable_partial_hash_hits`).
    partial_hash_hits: bool,
    /// Mamba groups key the state at shared-prefix junctions too (vLLM's
    /// `mamba_shared_prefix_checkpoint`).
    mamba_shared_prefix_checkpoint: bool,
    /// Exactly one full-attention spec group and one other: one pass of the fixed point.
    simple_hybrid: bool,
    /// Some group drops the EAGLE block (the replay boundaries move).
    eagle: bool,
    /// vLLM's `prefix_cache_retention_interval`.
    retention: Option<usize>,
    /// Tokens at the end that multi-token prediction may re-prefill (never cached).
    num_reprefillable: usize,
    num_hash_lookahead_tokens: usize,
    /// Running requests may take the one-pass allocation path (no group with its own
    /// allocation rules for running requests).
    fast_running: bool,
    /// Some Mamba group exports prefill checkpoints into blocks of their own.
    has_checkpoint_exports: bool,
    /// Per group: its bounds in `running_horizon` follow the previous group's rules (same
    /// spec, EAGLE drop and retained tokens, and no prompt-tail key of its own), so the same
    /// table state gives the same bounds.
    same_horizon_rules: Vec<bool>,
}

impl Coordinator {
    pub(crate) fn new(
        config: &ManagerConfig,
        scheduler_block_size: usize,
        hash_block_size: usize,
    ) -> Result<Self> {
        let specs = &config.groups;
        let kind = if !config.enable_caching || specs.is_empty() {
            CoordinatorKind::NoPrefixCache
        } else if specs.len() == 1 {
            CoordinatorKind::Unitary
        } else {
            CoordinatorKind::Hybrid
        };
        // Groups that get the EAGLE drop: the flagged ones, or every group.
        let eagle_groups: Vec<usize> = match &config.eagle_groups {
            Some(g) if !g.is_empty() => g.clone(),
            _ if config.use_eagle => (0..specs.len()).collect(),
            _ => Vec::new(),
        };
        let drops = |g: usize| config.use_eagle && eagle_groups.contains(&g);
        let partial_hash_hits = config.partial_hash_hits(hash_block_size);
        let alignment = match kind {
            CoordinatorKind::Unitary => specs[0].block_size,
            _ if partial_hash_hits => hash_block_size,
            _ => scheduler_block_size,
        };
        let mamba_shared_prefix_checkpoint = config.mamba_shared_prefix_checkpoint(hash_block_size);
        let max_in_flight = config.max_in_flight_tokens.unwrap_or(config.max_model_len);
        let extra_retained = config.extra_retained_tokens();
        let needs_zeroing = config
            .needs_kv_cache_zeroing
            .unwrap_or_else(|| specs.iter().any(|g| g.is_mamba()));
        let mut spec_groups: Vec<SpecGroup> = Vec::new();
        for (i, g) in specs.iter().enumerate() {
            if !g.prefix_cacheable() {
                continue;
            }
            match spec_groups.iter_mut().find(|s| s.spec == *g) {
                Some(s) => {
                    s.group_ids.push(i);
                    s.use_eagle |= drops(i);
                }
                None => spec_groups.push(SpecGroup {
                    spec: *g,
                    group_ids: vec![i],
                    use_eagle: drops(i),
                }),
            }
        }
        // Full attention first (stable): its left-to-right scan bounds the others.
        spec_groups.sort_by_key(|s| !s.spec.is_full());
        if config.enable_caching {
            if let Some(s) = spec_groups
                .iter()
                .find(|s| s.use_eagle && matches!(s.spec.kind, AttentionKind::ChunkedLocal { .. }))
            {
                return bad_config(format!(
                    "EAGLE with chunked local attention (group {}) and prefix caching is not \
                     supported (vLLM refuses it too)",
                    s.group_ids[0]
                ));
            }
        }
        let groups: Vec<GroupManager> = specs
            .iter()
            .enumerate()
            .map(|(i, &spec)| {
                // A hybrid's managers drop the EAGLE block as their spec group does; a single
                // group as itself.
                let use_eagle = match kind {
                    CoordinatorKind::Hybrid => spec_groups
                        .iter()
                        .any(|s| s.use_eagle && s.group_ids.contains(&i)),
                    _ => drops(i),
                };
                GroupManager {
                    spec,
                    id: i as GroupId,
                    hash_ratio: (spec.block_size / hash_block_size).max(1),
                    admission_cap: spec.max_admission_blocks(
                        max_in_flight,
                        config.max_model_len,
                        extra_retained,
                    ),
                    alignment: if partial_hash_hits {
                        hash_block_size
                    } else {
                        scheduler_block_size
                    },
                    use_eagle,
                    drop_eagle_checkpoint: config.use_eagle,
                    extra_retained,
                    records_new_blocks: needs_zeroing && spec.zeroes_new_blocks(),
                    num_gpu_blocks: config.num_blocks,
                    shared_prefix_checkpoint: mamba_shared_prefix_checkpoint && spec.is_mamba(),
                }
            })
            .collect();
        let simple_hybrid = spec_groups.len() == 2 && spec_groups[0].spec.is_full();
        let same_horizon_rules = (0..groups.len())
            .map(|g| {
                g > 0 && {
                    let (a, b) = (&groups[g - 1], &groups[g]);
                    a.spec == b.spec
                        && a.use_eagle == b.use_eagle
                        && a.extra_retained == b.extra_retained
                        && !b.keys_prompt_tail(hash_block_size)
                }
            })
            .collect();
        Ok(Coordinator {
            same_horizon_rules,
            kind,
            groups,
            simple_hybrid,
            eagle: !eagle_groups.is_empty() && config.use_eagle,
            spec_groups,
            hash_block_size,
            scheduler_block_size,
            alignment,
            partial_hash_hits,
            mamba_shared_prefix_checkpoint,
            retention: config.retention_interval,
            num_reprefillable: config.num_prefill_lookahead.saturating_sub(1),
            num_hash_lookahead_tokens: config.num_hash_lookahead_tokens,
            fast_running: specs
                .iter()
                .all(|g| !g.is_mamba() && !matches!(g.kind, AttentionKind::CircularBuffer)),
            has_checkpoint_exports: specs.iter().any(|g| g.prefill_checkpoint_alignment() > 0),
        })
    }

    pub fn kind(&self) -> CoordinatorKind {
        self.kind
    }

    /// Tokens a hit length must be a multiple of.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Whether hits may end at hash block boundaries inside blocks (vLLM's coordinator
    /// `enable_partial_hash_hits`).
    pub fn partial_hash_hits(&self) -> bool {
        self.partial_hash_hits
    }

    /// Whether Mamba groups key the state at shared-prefix junctions (vLLM's manager
    /// `mamba_shared_prefix_checkpoint`).
    pub fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.mamba_shared_prefix_checkpoint
    }

    /// Tokens an EAGLE group matches past a candidate hit before dropping them (vLLM's
    /// `eagle_proof_margin`): one hash block for a fine-grained lookup in a group of larger
    /// blocks, else one block.
    fn eagle_margin(&self, spec: &GroupSpec) -> usize {
        let fine_grained = spec.is_full() || spec.is_mamba();
        if self.partial_hash_hits && fine_grained && spec.block_size > self.hash_block_size {
            self.hash_block_size
        } else {
            spec.block_size
        }
    }

    pub(crate) fn groups(&self) -> &[GroupManager] {
        &self.groups
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    pub fn group_specs(&self) -> Vec<GroupSpec> {
        self.groups.iter().map(|g| g.spec).collect()
    }

    pub(crate) fn fast_running(&self) -> bool {
        self.fast_running
    }

    // ----- prefix-cache hits ------------------------------------------------------------------

    /// Finds the longest cached prefix of `hashes` (at hash block size) of at most `max_len`
    /// tokens; fills `out[g]` with group `g`'s hit blocks (null blocks where a slot needs none).
    /// Only reads the pool's map, so it may run on any thread.
    pub(crate) fn find(
        &self,
        pool: &BlockPool,
        hashes: &[BlockHash],
        max_len: usize,
        out: &mut Vec<Vec<BlockId>>,
    ) -> Hit {
        out.resize_with(self.groups.len(), Vec::new);
        out.truncate(self.groups.len());
        for list in out.iter_mut() {
            list.clear();
        }
        if self.kind == CoordinatorKind::NoPrefixCache || self.spec_groups.is_empty() {
            return Hit::default();
        }
        let mut scratch = Vec::new();
        if self.kind == CoordinatorKind::Unitary {
            let sg = &self.spec_groups[0];
            let tokens = self.find_for(sg, pool, hashes, max_len, sg.use_eagle, out, &mut scratch);
            return Hit {
                tokens,
                uncached_common: 0,
            };
        }

        // The hybrid fixed point: the candidate length only decreases; every non-full type
        // re-checks at the reduced length until a whole pass changes nothing. An EAGLE group
        // drops its block at most once per candidate length.
        let n = self.spec_groups.len();
        let hashed = hashes.len() * self.hash_block_size;
        let mut hit = max_len;
        let mut longest = 0;
        let mut looked_up = vec![false; n];
        let mut hit_by = vec![0usize; n];
        let mut verified = vec![false; n];
        loop {
            let mut curr = hit;
            for (idx, sg) in self.spec_groups.iter().enumerate() {
                if sg.spec.is_full() && looked_up[idx] {
                    // Full attention is downward closed: one lookup, then trim.
                    curr = curr.min(hit_by[idx]);
                    continue;
                }
                let drop = sg.use_eagle && !verified[idx];
                let mut max = curr;
                if drop && !sg.spec.is_mamba() {
                    // Match one block (or hash block) past the candidate, then drop it.
                    max = curr.saturating_add(self.eagle_margin(&sg.spec)).min(hashed);
                }
                let new = self.find_for(sg, pool, hashes, max, drop, out, &mut scratch);
                if drop {
                    verified[idx] = true;
                } else if new < curr {
                    verified.iter_mut().for_each(|v| *v = false);
                }
                looked_up[idx] = true;
                hit_by[idx] = new;
                curr = new;
                longest = longest.max(curr);
            }
            if curr >= hit {
                break;
            }
            hit = curr;
            if self.simple_hybrid {
                break;
            }
        }
        for (idx, sg) in self.spec_groups.iter().enumerate() {
            if !sg.spec.is_full() || !looked_up[idx] {
                continue;
            }
            let keep = hit.div_ceil(sg.spec.block_size);
            for &g in &sg.group_ids {
                out[g].truncate(keep);
            }
        }
        Hit {
            tokens: hit,
            uncached_common: longest.saturating_sub(hit),
        }
    }

    /// Each spec group's own longest hit, with no intersection (vLLM's
    /// `find_longest_cache_hit_per_group`, the KV-connector path); fills `out` and `lengths`.
    pub(crate) fn find_per_group(
        &self,
        pool: &BlockPool,
        hashes: &[BlockHash],
        max_len: usize,
        out: &mut Vec<Vec<BlockId>>,
        lengths: &mut Vec<usize>,
    ) {
        out.resize_with(self.groups.len(), Vec::new);
        out.iter_mut().for_each(Vec::clear);
        lengths.clear();
        lengths.resize(self.groups.len(), 0);
        if self.kind == CoordinatorKind::NoPrefixCache {
            return;
        }
        let hashed = hashes.len() * self.hash_block_size;
        let mut scratch = Vec::new();
        for sg in &self.spec_groups {
            let mut max = max_len;
            if sg.use_eagle && !sg.spec.is_mamba() {
                max = max_len
                    .saturating_add(self.eagle_margin(&sg.spec))
                    .min(hashed);
            }
            let hit = self.find_for(sg, pool, hashes, max, sg.use_eagle, out, &mut scratch);
            for &g in &sg.group_ids {
                lengths[g] = hit;
            }
        }
    }

    /// The first full-attention group, if any (vLLM's `full_attention_group_id`).
    pub(crate) fn full_attention_group(&self) -> Option<usize> {
        self.spec_groups
            .first()
            .filter(|s| s.spec.is_full())
            .map(|s| s.group_ids[0])
    }

    #[allow(clippy::too_many_arguments)]
    fn find_for(
        &self,
        sg: &SpecGroup,
        pool: &BlockPool,
        hashes: &[BlockHash],
        max_len: usize,
        drop_eagle: bool,
        out: &mut [Vec<BlockId>],
        scratch: &mut Vec<BlockId>,
    ) -> usize {
        find_longest_cache_hit(
            &sg.spec,
            pool,
            hashes,
            self.hash_block_size,
            max_len,
            &sg.group_ids,
            self.alignment,
            drop_eagle,
            out,
            scratch,
        )
    }

    // ----- allocation, over every group ---------------------------------------------------------

    /// Blocks the allocation of `num_tokens` slots would take, hit blocks that leave the free
    /// order included (vLLM's `get_num_blocks_to_allocate`; signed, as vLLM's sum may be).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        tables: &[GroupTable],
        num_tokens: usize,
        hits: &[Vec<BlockId>],
        total_computed_tokens: usize,
        num_local_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
        effects: &Effects,
    ) -> i64 {
        let chunk = self.chunk_ctx(prefill_end);
        self.with_hits(tables, hits)
            .map(|(m, t, hit)| {
                m.num_blocks_to_allocate(
                    pool,
                    t,
                    num_tokens,
                    hit,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                    &chunk,
                    effects,
                )
            })
            // Saturating: with a `max_model_len` near `usize::MAX` each group's count may be
            // near `i64::MAX` (a count no pool meets, refused as such).
            .fold(0, i64::saturating_add)
    }

    /// Exactly how far the allocation `a` after a passed admission check takes the pool's free
    /// count down, over every group (`GroupManager::blocks_taken`).
    pub(crate) fn blocks_taken(
        &self,
        pool: &BlockPool,
        tables: &[GroupTable],
        hits: &[Vec<BlockId>],
        a: &Allocation,
    ) -> usize {
        self.with_hits(tables, hits)
            .map(|(m, t, hit)| m.blocks_taken(pool, t, hit, a))
            .sum()
    }

    /// Each group with its table and its part of `hits` (empty past the hit's groups).
    fn with_hits<'a>(
        &'a self,
        tables: &'a [GroupTable],
        hits: &'a [Vec<BlockId>],
    ) -> impl Iterator<Item = (&'a GroupManager, &'a GroupTable, &'a [BlockId])> + 'a {
        self.groups
            .iter()
            .zip(tables)
            .enumerate()
            .map(|(g, (m, t))| (m, t, hits.get(g).map_or(&[][..], Vec::as_slice)))
    }

    /// Whether vLLM's count (`num_blocks_to_allocate`) can fall short of what an allocation
    /// takes: a Mamba align group's count leaves out the block for external tokens.
    pub(crate) fn count_may_fall_short(&self) -> bool {
        self.groups.iter().any(|g| {
            matches!(
                g.spec.kind,
                AttentionKind::Mamba {
                    mode: MambaMode::Align,
                    ..
                }
            )
        })
    }

    /// What the prefill checkpoint rule needs of a chunk of a request whose prefill ends at
    /// `prefill_end`: under sparse retention (0) only the chunk reaching it may export one.
    fn chunk_ctx(&self, prefill_end: usize) -> ChunkCtx {
        ChunkCtx {
            prefill_end: if self.retention == Some(0) {
                prefill_end
            } else {
                0
            },
            hash_block_size: self.hash_block_size,
            num_hash_lookahead_tokens: self.num_hash_lookahead_tokens,
        }
    }

    /// Remembers, in every Mamba group that exports prefill checkpoints, the checkpoint of the
    /// chunk `[start, end)` about to be allocated (as vLLM's count before an allocation does).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_checkpoints(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        hits: &[Vec<BlockId>],
        start: usize,
        end: usize,
        prefill_end: usize,
        effects: &Effects,
    ) {
        if !self.has_checkpoint_exports {
            return;
        }
        let chunk = self.chunk_ctx(prefill_end);
        for (g, (m, t)) in self.groups.iter().zip(tables.iter_mut()).enumerate() {
            let hit = hits.get(g).map_or(&[][..], Vec::as_slice);
            m.record_checkpoint(pool, t, hit, start, end, &chunk, effects);
        }
    }

    /// Frees, in every group, the blocks no longer needed once `num_computed_tokens` are
    /// computed.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        num_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            m.remove_skipped_blocks(pool, t, num_computed_tokens, num_prompt_tokens, scratch)?;
        }
        Ok(())
    }

    /// Sizes the empty tables of a request's first allocation for `num_tokens` slots and
    /// [`TABLE_HEADROOM`] blocks after them: one allocation per table, where growing it with
    /// the hit, then the new blocks, then the decode took several (with copies) on every
    /// admission. Tables of groups that hold a fixed few blocks are left to grow.
    pub(crate) fn reserve_tables(&self, tables: &mut [GroupTable], num_tokens: usize) {
        for (m, t) in self.groups.iter().zip(tables) {
            let fixed = matches!(
                m.spec.kind,
                AttentionKind::CircularBuffer
                    | AttentionKind::Mamba {
                        mode: MambaMode::None,
                        ..
                    }
            );
            if t.blocks.capacity() == 0 && !fixed {
                // Only a hint: without the room the table grows as it takes blocks (and the
                // pool, not this, bounds them).
                let _ = t
                    .blocks
                    .try_reserve(num_tokens.div_ceil(m.spec.block_size) + TABLE_HEADROOM);
            }
        }
    }

    /// Makes room in every Mamba align table for the slots an allocation of
    /// `num_tokens_main_model` tokens pads with null blocks, before anything changes. Those
    /// slots take no block from the pool, so the pool does not bound them as it bounds every
    /// other group's: a table that cannot grow that far is an error (`Err` with the length it
    /// needs), not an abort halfway through the allocation.
    pub(crate) fn try_reserve_null_slots(
        &self,
        tables: &mut [GroupTable],
        num_tokens_main_model: usize,
    ) -> std::result::Result<(), usize> {
        for (m, t) in self.groups.iter().zip(tables) {
            let AttentionKind::Mamba {
                mode: MambaMode::Align,
                speculative_blocks,
                ..
            } = m.spec.kind
            else {
                continue;
            };
            // Room enough already (a multiplication: a running step's usual case).
            let spare = t.blocks.capacity().saturating_sub(speculative_blocks + 2);
            if num_tokens_main_model <= spare.saturating_mul(m.spec.block_size) {
                continue;
            }
            // The state blocks, a partial hit's copy and a checkpoint's block.
            let len = num_tokens_main_model
                .div_ceil(m.spec.block_size)
                .saturating_add(speculative_blocks)
                .saturating_add(2);
            let grow = len.saturating_sub(t.blocks.len());
            // A first allocation's table gets its headroom too (see `reserve_tables`).
            let headroom = if t.blocks.capacity() == 0 {
                TABLE_HEADROOM
            } else {
                0
            };
            if t.blocks.capacity() - t.blocks.len() < grow
                && t.blocks.try_reserve(grow.saturating_add(headroom)).is_err()
            {
                return Err(len);
            }
        }
        Ok(())
    }

    /// Adopts a request's prefix-cache hit in every group (its first allocation), then
    /// allocates the blocks of tokens a KV connector supplies: local hits are all touched
    /// before any external block is taken, so no group evicts another group's hit.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn allocate_new_computed_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        hits: &[Vec<BlockId>],
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
        enable_caching: bool,
        skip_zeroing: &[usize],
        effects: &mut Effects,
    ) -> Result<()> {
        let total = num_local_computed_tokens + num_external_computed_tokens;
        for (g, (m, t)) in self.groups.iter().zip(tables.iter_mut()).enumerate() {
            let hit = hits.get(g).map_or(&[][..], Vec::as_slice);
            m.add_local_computed_blocks(
                pool,
                t,
                hit,
                num_local_computed_tokens,
                total,
                enable_caching,
            )?;
        }
        if num_external_computed_tokens > 0 {
            for (g, (m, t)) in self.groups.iter().zip(tables.iter_mut()).enumerate() {
                m.allocate_external_computed_blocks(
                    pool,
                    t,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                    !skip_zeroing.contains(&g),
                    effects,
                )?;
            }
        }
        Ok(())
    }

    /// Grows every group's table to cover `num_tokens` slots; what each group hands the worker
    /// goes to `new_blocks[g]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn allocate_new_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        new_blocks: &mut [Vec<BlockId>],
        effects: &mut Effects,
    ) -> Result<()> {
        for ((m, t), out) in self.groups.iter().zip(tables.iter_mut()).zip(new_blocks) {
            m.allocate_new_blocks(
                pool,
                t,
                request_id,
                num_tokens,
                num_tokens_main_model,
                out,
                effects,
            )?;
        }
        Ok(())
    }

    /// Positions a later request replaying a prompt of `num_prompt_tokens` can resume at
    /// (vLLM's `replay_boundaries`): the resend (capped at `P - 1`), and with EAGLE the
    /// aligned block below each reach.
    fn replay_boundaries(&self, num_prompt_tokens: usize) -> ([usize; 2], usize) {
        if !self.eagle {
            return ([num_prompt_tokens.saturating_sub(1), 0], 1);
        }
        let block = self.scheduler_block_size;
        let resend = num_prompt_tokens.saturating_sub(1) / block * block;
        let extension = num_prompt_tokens / block * block;
        let (a, b) = (
            resend.saturating_sub(block),
            extension.saturating_sub(block),
        );
        if a == b {
            ([a, 0], 1)
        } else {
            ([a.min(b), a.max(b)], 2)
        }
    }

    /// Tokens group `m` may cache of `num_tokens` computed ones (vLLM's
    /// `get_num_cacheable_tokens`): finalized tokens only, in a hybrid rounded down to the
    /// scheduler block size (plus the EAGLE peek block).
    fn cacheable_tokens(&self, m: &GroupManager, num_tokens: usize) -> usize {
        if self.kind != CoordinatorKind::Hybrid {
            return num_tokens.saturating_sub(self.num_reprefillable);
        }
        let align = |n: usize| {
            if self.partial_hash_hits {
                // Hits may end anywhere on a hash boundary: no rounding (rounding even to the
                // hash block would re-key a privatized Mamba tail).
                n
            } else {
                n / self.scheduler_block_size * self.scheduler_block_size
            }
        };
        let aligned = align(num_tokens);
        if m.use_eagle && aligned > 0 {
            let finalized = num_tokens.saturating_sub(self.num_reprefillable);
            return finalized.min(align(finalized).saturating_add(m.spec.block_size));
        }
        aligned
    }

    /// Enters the request's full blocks of its first `num_tokens` tokens into the prefix cache,
    /// in every group (what each group keeps depends on retention).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cache_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        request: &Request,
        num_tokens: usize,
        num_computed_tokens: usize,
        shared_prefix_boundary: usize,
        scratch: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) -> Result<()> {
        let (boundaries, n) = self.replay_boundaries(request.num_prompt_tokens());
        let ctx = CacheCtx {
            hash_block_size: self.hash_block_size,
            retention: self.retention,
            replay_boundaries: &boundaries[..n],
            shared_prefix_boundary,
            num_hash_lookahead_tokens: self.num_hash_lookahead_tokens,
            num_computed_tokens,
        };
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            let tokens = self.cacheable_tokens(m, num_tokens);
            m.cache_blocks(pool, t, request, tokens, &ctx, scratch, effects)?;
        }
        Ok(())
    }

    /// Frees every group's blocks, tail first, group after group (vLLM's order), in one
    /// release of the pool.
    pub(crate) fn free(&self, pool: &BlockPool, tables: &mut [GroupTable]) -> Result<()> {
        let listed = tables.iter().map(|t| t.blocks.len()).sum();
        let freed = pool.free_held_tail_first(tables.iter().map(|t| &t.blocks[..]), listed);
        for t in tables.iter_mut() {
            t.clear();
        }
        freed
    }

    /// Empties every group's table without freeing: the blocks in allocation order, groups
    /// concatenated (vLLM's `pop_blocks_for_free`).
    pub(crate) fn pop_blocks(&self, tables: &mut [GroupTable], out: &mut Vec<BlockId>) {
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            m.pop_blocks(t, out);
        }
    }

    /// One step of a request that already holds blocks in every group and adopts no hit
    /// (decode and continued prefill), for layouts without per-kind running rules: the
    /// decisions of the general path in one pass that frees what left the window and counts
    /// the blocks needed, and one that allocates and caches. `false` when the pool cannot
    /// supply the blocks (out-of-window blocks are freed by then, as on the general path).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn running_step(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        request: &Request,
        step: &RunningStep,
        new_blocks: &mut [Vec<BlockId>],
        scratch: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) -> Result<bool> {
        let prompt = Some(request.num_prompt_tokens());
        for (m, t) in self.groups.iter().zip(tables.iter()) {
            m.prefetch_window_edge(t, step.processed, prompt);
        }
        self.remove_skipped_together(pool, tables, step.processed, prompt, scratch)?;
        let mut need = 0;
        for (m, t) in self.groups.iter().zip(tables.iter()) {
            need = step
                .need_slot
                .div_ceil(m.spec.block_size)
                .saturating_sub(t.blocks.len())
                .saturating_add(need);
        }
        if need.saturating_add(step.reserved) > pool.num_free_blocks() {
            return Ok(false);
        }
        // Blocks to claim when every group only claims (None otherwise).
        let plain: Option<usize> = if need > 0 {
            self.groups
                .iter()
                .zip(tables.iter())
                .map(|(m, t)| m.plain_new_blocks(t, step.need_slot))
                .sum()
        } else {
            None
        };
        if let Some(total) = plain {
            // One claim of every group's blocks, handed out in group order, takes the same
            // blocks in the same order as a claim per group (nothing else takes a block in
            // between) and loads them together.
            scratch.clear();
            pool.get_new_blocks_into(total, scratch)?;
            let mut claimed = &scratch[..];
            for ((m, t), out) in self
                .groups
                .iter()
                .zip(tables.iter_mut())
                .zip(new_blocks.iter_mut())
            {
                let n = m.plain_new_blocks(t, step.need_slot).unwrap_or(0);
                let (mine, rest) = claimed.split_at(n);
                m.take_claimed(t, mine, out, effects);
                claimed = rest;
            }
            scratch.clear();
        } else if need > 0 {
            for ((m, t), out) in self
                .groups
                .iter()
                .zip(tables.iter_mut())
                .zip(new_blocks.iter_mut())
            {
                m.allocate_new_blocks(
                    pool,
                    t,
                    request.id(),
                    step.need_slot,
                    step.need_slot,
                    out,
                    effects,
                )?;
            }
        }
        if let Some(n) = step.cache_tokens {
            self.cache_blocks(
                pool,
                tables,
                request,
                n,
                step.computed,
                step.shared_prefix_boundary,
                scratch,
                effects,
            )?;
        }
        Ok(true)
    }

    /// Every group's `remove_skipped_blocks` after `processed` tokens, for a layout whose
    /// groups all free behind a window by the plain walk (no Mamba, no circular buffer: the
    /// layouts [`Coordinator::running_step`] serves), with one release of the pool for all
    /// groups: the groups' runs are released as batches in group order, which frees them in
    /// the order one release per group would, and their blocks' states are loaded together.
    fn remove_skipped_together(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        processed: usize,
        prompt: Option<usize>,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        const MOST: usize = 16;
        if self.groups.len() > MOST {
            return self.remove_skipped_blocks(pool, tables, processed, prompt, scratch);
        }
        // Per group with a walk to make: (group, slot the walk starts below, blocks freed).
        let mut walks = [(0usize, 0usize, 0usize); MOST];
        let mut ends = [0usize; MOST];
        let mut n = 0;
        scratch.clear();
        for (g, (m, t)) in self.groups.iter().zip(tables.iter()).enumerate() {
            if let Some((last, freed)) = m.collect_skipped(t, processed, prompt, scratch) {
                walks[n] = (g, last, freed);
                ends[n] = scratch.len();
                n += 1;
            }
        }
        if !scratch.is_empty() {
            for &block in scratch.iter() {
                pool.prefetch_block(block);
            }
            pool.free_held(scratch, &ends[..n])?;
        }
        for &(g, last, freed) in &walks[..n] {
            let t = &mut tables[g];
            t.blocks[last - freed..last].fill(NULL_BLOCK);
            t.unreachable_below = t.unreachable_below.max(last);
        }
        Ok(())
    }

    /// [`RunningHorizon`] of a request with these tables, `None` unless its next call takes
    /// [`Coordinator::running_step`]. Each bound is the tightest over the groups: a step that
    /// needs no new block in any group, caches no block in any group and removes none is the
    /// running step's no-op. With `past`, also `None` when the blocks hold no slot past `past`
    /// tokens: no running step that starts with at least that many computed lies inside (the
    /// other bounds are then not searched).
    pub(crate) fn running_horizon(
        &self,
        pool: &BlockPool,
        tables: &[GroupTable],
        request: &Request,
        enable_caching: bool,
        max_model_len: usize,
        past: Option<usize>,
    ) -> Option<RunningHorizon> {
        let num_prompt_tokens = request.num_prompt_tokens();
        if !self.fast_running || tables.iter().any(|t| t.num_cached.is_none()) {
            return None;
        }
        let slots = self
            .groups
            .iter()
            .zip(tables)
            .map(|(m, t)| t.blocks.len() * m.spec.block_size)
            .fold(max_model_len, usize::min);
        if past.is_some_and(|past| slots <= past) {
            return None;
        }
        let mut horizon = RunningHorizon {
            slots,
            cache: usize::MAX,
            removal: usize::MAX,
        };
        // The previous group's table state and bounds: a group with the same rules and the
        // same state has the same bounds (Gemma-3's six sliding-window groups, in step).
        let mut previous: Option<(HorizonState, usize, usize)> = None;
        for (g, (m, t)) in self.groups.iter().zip(tables).enumerate() {
            let bs = m.spec.block_size;
            let state = HorizonState {
                num_cached: t.num_cached,
                removable: m.first_removable(t, num_prompt_tokens),
            };
            let (cache, removal) = match previous {
                Some((same, cache, removal)) if self.same_horizon_rules[g] && same == state => {
                    (cache, removal)
                }
                _ => {
                    let mut cache = usize::MAX;
                    if enable_caching && m.spec.prefix_cacheable() {
                        // Caching is bounded by the request's hashes and blocks too; leaving
                        // those bounds out can only make the horizon earlier.
                        let next = (t.num_cached.unwrap_or(0) + 1) * bs;
                        // No more tokens are cacheable than there are: at least `next`.
                        let hint = next - 1;
                        cache =
                            first_at_least(|tokens| self.cacheable_tokens(m, tokens), next, hint);
                        if m.keys_prompt_tail(self.hash_block_size) {
                            cache = cache.min(self.tail_key_horizon(pool, m, t, request));
                        }
                    }
                    let removal = state.removable.map_or(usize::MAX, |live| {
                        m.removal_horizon_at(live, num_prompt_tokens)
                    });
                    (cache, removal)
                }
            };
            horizon.cache = horizon.cache.min(cache);
            horizon.removal = horizon.removal.min(removal);
            previous = Some((state, cache, removal));
        }
        Some(horizon)
    }

    /// The fewest tokens to cache at which a full-attention group with blocks larger than the
    /// hash block would key the block holding the prompt's tail (see
    /// `GroupManager::cache_prompt_tail_key`): `usize::MAX` when it has that key or never gets
    /// one, 0 while the prompt's hashes are still arriving (lookahead hashing: the boundary
    /// moves with them).
    fn tail_key_horizon(
        &self,
        pool: &BlockPool,
        m: &GroupManager,
        t: &GroupTable,
        request: &Request,
    ) -> usize {
        let (bs, hash_bs) = (m.spec.block_size, self.hash_block_size);
        let hashes = request.block_hashes();
        let boundary = m.prompt_tail_boundary(request.num_prompt_tokens(), hash_bs);
        let full = boundary / hash_bs;
        if hashes.len() < full {
            return 0;
        }
        if boundary == 0 || boundary % bs == 0 {
            return usize::MAX;
        }
        let key = CacheKey {
            hash: hashes[full - 1],
            group: m.id,
        };
        let keyed = t
            .blocks
            .get(boundary / bs)
            .and_then(|&block| pool.block_keys(block).ok())
            .is_some_and(|keys| keys.contains(&key));
        if keyed {
            return usize::MAX;
        }
        first_at_least(
            |tokens| self.cacheable_tokens(m, tokens),
            boundary,
            boundary - 1,
        )
    }
}

/// What a group's bounds in [`Coordinator::running_horizon`] read of its table, besides its
/// length (the slot bound is taken per group).
#[derive(Copy, Clone, PartialEq, Eq)]
struct HorizonState {
    num_cached: Option<usize>,
    /// `GroupManager::first_removable`.
    removable: Option<usize>,
}

/// What [`Coordinator::running_step`] needs to know about the step.
pub(crate) struct RunningStep {
    /// Tokens processed: blocks before the window of these are freed.
    pub(crate) processed: usize,
    /// The request's computed tokens before this step.
    pub(crate) computed: usize,
    /// Slots the request needs after this step.
    pub(crate) need_slot: usize,
    /// Tokens to cache (finalized ones); `None` when caching is off or delayed.
    pub(crate) cache_tokens: Option<usize>,
    /// Free blocks the step must leave for others.
    pub(crate) reserved: usize,
    pub(crate) shared_prefix_boundary: usize,
}
