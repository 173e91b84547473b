//! The coordinator (vLLM's `KVCacheCoordinator`): combines the per-group rules of
//! [`single_type`](super::single_type) into one request's allocation. It owns the loops over the
//! KV cache groups (count, free out-of-window blocks, adopt a hit, allocate, cache, free) and the
//! prefix-cache hit search across groups (the hybrid fixed point).
//!
//! A coordinator is immutable: block tables live in the manager's request state and are passed
//! in, so the same `Arc<Coordinator>` serves the scheduler and concurrent probes.

use super::request::Request;
use super::single_type::{find_longest_cache_hit, GroupManager, GroupTable};
use super::spec::GroupSpec;
use crate::error::Result;
use crate::pool::BlockPool;
use crate::types::{BlockHash, BlockId, GroupId};

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
    /// Tokens a hit length must be a multiple of.
    alignment: usize,
    /// Exactly one full-attention spec group and one other: one pass of the fixed point.
    simple_hybrid: bool,
    /// Some group is not prefix-cacheable: no hit can cover it.
    has_uncacheable_group: bool,
}

impl Coordinator {
    /// `specs` in group-id order; `max_in_flight_tokens` and `max_model_len` set the admission
    /// caps of groups that recycle blocks.
    pub(crate) fn new(
        specs: &[GroupSpec],
        enable_caching: bool,
        scheduler_block_size: usize,
        hash_block_size: usize,
        max_in_flight_tokens: usize,
        max_model_len: usize,
    ) -> Self {
        let kind = if !enable_caching {
            CoordinatorKind::NoPrefixCache
        } else if specs.len() == 1 {
            CoordinatorKind::Unitary
        } else {
            CoordinatorKind::Hybrid
        };
        let groups = specs
            .iter()
            .enumerate()
            .map(|(i, &spec)| GroupManager {
                spec,
                id: i as GroupId,
                hash_ratio: (spec.block_size / hash_block_size).max(1),
                admission_cap: spec.max_admission_blocks(max_in_flight_tokens, max_model_len),
                alignment: scheduler_block_size,
            })
            .collect();
        let mut spec_groups: Vec<SpecGroup> = Vec::new();
        for (i, g) in specs.iter().enumerate() {
            if !g.prefix_cacheable() {
                continue;
            }
            match spec_groups.iter_mut().find(|s| s.spec == *g) {
                Some(s) => s.group_ids.push(i),
                None => spec_groups.push(SpecGroup {
                    spec: *g,
                    group_ids: vec![i],
                }),
            }
        }
        // Full attention first (stable): its left-to-right scan bounds the others.
        spec_groups.sort_by_key(|s| !s.spec.is_full());
        let simple_hybrid = spec_groups.len() == 2 && spec_groups[0].spec.is_full();
        let alignment = match kind {
            CoordinatorKind::Unitary => specs[0].block_size,
            _ => scheduler_block_size,
        };
        Coordinator {
            kind,
            groups,
            spec_groups,
            hash_block_size,
            alignment,
            simple_hybrid,
            has_uncacheable_group: specs.iter().any(|g| !g.prefix_cacheable()),
        }
    }

    pub fn kind(&self) -> CoordinatorKind {
        self.kind
    }

    /// Tokens a hit length must be a multiple of.
    pub fn alignment(&self) -> usize {
        self.alignment
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
        if self.kind == CoordinatorKind::NoPrefixCache
            || self.has_uncacheable_group
            || self.spec_groups.is_empty()
        {
            return Hit::default();
        }
        let mut scratch = Vec::new();
        if self.kind == CoordinatorKind::Unitary {
            let tokens = self.find_for(
                &self.spec_groups[0],
                pool,
                hashes,
                max_len,
                out,
                &mut scratch,
            );
            return Hit {
                tokens,
                uncached_common: 0,
            };
        }

        // The hybrid fixed point: the candidate length only decreases; every non-full type
        // re-checks at the reduced length until a whole pass changes nothing.
        let n = self.spec_groups.len();
        let mut hit = max_len;
        let mut longest = 0;
        let mut looked_up = vec![false; n];
        let mut hit_by = vec![0usize; n];
        loop {
            let mut curr = hit;
            for (idx, sg) in self.spec_groups.iter().enumerate() {
                if sg.spec.is_full() && looked_up[idx] {
                    // Full attention is downward closed: one lookup, then trim.
                    curr = curr.min(hit_by[idx]);
                    continue;
                }
                let new = self.find_for(sg, pool, hashes, curr, out, &mut scratch);
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
        for sg in self.spec_groups.iter().filter(|s| s.spec.is_full()) {
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

    fn find_for(
        &self,
        sg: &SpecGroup,
        pool: &BlockPool,
        hashes: &[BlockHash],
        max_len: usize,
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
            out,
            scratch,
        )
    }

    // ----- allocation, over every group ---------------------------------------------------------

    /// Blocks the allocation of `num_tokens` slots would take, hit blocks that leave the free
    /// order included (vLLM's `get_num_blocks_to_allocate`).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        tables: &[GroupTable],
        num_tokens: usize,
        hits: &[Vec<BlockId>],
        total_computed_tokens: usize,
        apply_admission_cap: bool,
    ) -> usize {
        self.groups
            .iter()
            .zip(tables)
            .enumerate()
            .map(|(g, (m, t))| {
                let hit = hits.get(g).map_or(&[][..], Vec::as_slice);
                m.num_blocks_to_allocate(
                    pool,
                    t,
                    num_tokens,
                    hit,
                    total_computed_tokens,
                    apply_admission_cap,
                )
            })
            .sum()
    }

    /// Frees, in every group, the blocks no longer needed once `num_computed_tokens` are
    /// computed.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        num_computed_tokens: usize,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            m.remove_skipped_blocks(pool, t, num_computed_tokens, scratch)?;
        }
        Ok(())
    }

    /// Adopts a request's prefix-cache hit in every group (its first allocation).
    pub(crate) fn add_local_computed_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        hits: &[Vec<BlockId>],
        num_computed_tokens: usize,
        enable_caching: bool,
    ) -> Result<()> {
        for (g, (m, t)) in self.groups.iter().zip(tables.iter_mut()).enumerate() {
            let hit = hits.get(g).map_or(&[][..], Vec::as_slice);
            m.add_local_computed_blocks(pool, t, hit, num_computed_tokens, enable_caching)?;
        }
        Ok(())
    }

    /// Grows every group's table to cover `num_tokens` slots; the new ids go to `new_blocks[g]`.
    pub(crate) fn allocate_new_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        num_tokens: usize,
        new_blocks: &mut [Vec<BlockId>],
    ) -> Result<()> {
        for ((m, t), out) in self.groups.iter().zip(tables.iter_mut()).zip(new_blocks) {
            m.allocate_new_blocks(pool, t, num_tokens, out)?;
        }
        Ok(())
    }

    /// Enters the request's full blocks of its first `num_tokens` tokens into the prefix cache,
    /// in every group.
    pub(crate) fn cache_blocks(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        request: &Request,
        num_tokens: usize,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            m.cache_blocks(pool, t, request, num_tokens, self.hash_block_size, scratch)?;
        }
        Ok(())
    }

    /// Frees every group's blocks, tail first.
    pub(crate) fn free(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            m.free(pool, t, scratch)?;
        }
        Ok(())
    }

    /// One step of a request that already holds blocks in every group and adopts no hit
    /// (decode and continued prefill): the decisions of the general path in one pass that
    /// frees what left the window and counts the blocks needed, and one that allocates and
    /// caches. `false` when the pool cannot supply the blocks (out-of-window blocks are freed
    /// by then, as on the general path).
    pub(crate) fn running_step(
        &self,
        pool: &BlockPool,
        tables: &mut [GroupTable],
        request: &Request,
        step: &RunningStep,
        new_blocks: &mut [Vec<BlockId>],
        scratch: &mut Vec<BlockId>,
    ) -> Result<bool> {
        let mut need = 0;
        for (m, t) in self.groups.iter().zip(tables.iter_mut()) {
            m.remove_skipped_blocks(pool, t, step.processed, scratch)?;
            need += step
                .need_slot
                .div_ceil(m.spec.block_size)
                .saturating_sub(t.blocks.len());
        }
        if need > pool.num_free_blocks() {
            return Ok(false);
        }
        for ((m, t), out) in self.groups.iter().zip(tables.iter_mut()).zip(new_blocks) {
            if need > 0 {
                m.allocate_new_blocks(pool, t, step.need_slot, out)?;
            }
            if let Some(n) = step.cache_tokens {
                m.cache_blocks(pool, t, request, n, self.hash_block_size, scratch)?;
            }
        }
        Ok(true)
    }
}

/// What [`Coordinator::running_step`] needs to know about the step.
pub(crate) struct RunningStep {
    /// Tokens processed: blocks before the window of these are freed.
    pub(crate) processed: usize,
    /// Slots the request needs after this step.
    pub(crate) need_slot: usize,
    /// Tokens whose full blocks are cached; `None` when caching is off or delayed.
    pub(crate) cache_tokens: Option<usize>,
}
