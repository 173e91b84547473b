//! Per-group block tables and the rules of each attention type (vLLM's
//! `SingleTypeKVCacheManager` and subclasses): how many blocks a request holds, which ones it
//! frees as it advances, which it caches (and, under sparse retention, which it keeps
//! reachable), and which prefix of a prompt counts as a cache hit ([`find_longest_cache_hit`]).

use super::request::{HashView, Request};
use super::spec::{AttentionKind, GroupSpec, MambaMode};
use crate::error::Result;
use crate::pool::{BlockPool, PREFETCH_AHEAD};
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, StoreInfo, NULL_BLOCK};
use std::collections::HashSet;

/// One request's blocks in one group.
///
/// A table starts a cache line, and the fields a running step reads come first, in that line
/// (`HOT_BYTES`): its blocks, how many are cached, where the window's walk stops and whether a
/// partial hit waits. A step over a request's groups then loads one line per group (a
/// request's tables are far apart in memory from one step to the next, and these loads were
/// most of a step's misses with the fields spread over three lines); Mamba align's and
/// connectors' state follows.
#[derive(Clone, Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct GroupTable {
    /// Slot `i` covers tokens `[i * bs, (i + 1) * bs)`; the null block where none is needed.
    pub(crate) blocks: Vec<BlockId>,
    /// Blocks already entered into the prefix cache; `None` until the request's first
    /// allocation with a hit or its first cached block (vLLM's `num_cached_block`).
    pub(crate) num_cached: Option<usize>,
    /// `remove_skipped_blocks` can no longer free a slot below this: its walk down from a
    /// window's edge stops at the first null, and slot `unreachable_below - 1` is null (the
    /// last walk ended there). 0 when nothing is known; never above `blocks.len()`.
    pub(crate) unreachable_below: usize,
    /// A hit (or, for Mamba align, a state keyed by the request itself) ending inside block
    /// `.0`: the shared block `.1` gets a private copy at the next allocation (vLLM's
    /// `_partial_hit_reqs`).
    pub(crate) partial_hit: Option<(usize, BlockId)>,
    /// Mamba align: blocks were allocated for the request before (vLLM's
    /// `_allocated_block_reqs`).
    pub(crate) allocated: bool,
    /// Mamba align: the slot of the state the previous step started from, freed once it is
    /// more than one block behind (vLLM's `last_state_block_idx`).
    pub(crate) last_state: Option<usize>,
    /// Mamba align: slots below this were already retired (vLLM's `_num_retired_blocks`).
    pub(crate) num_retired: usize,
    /// Mamba align with prefill checkpoint exports: `(position, slot)` of the checkpoint the
    /// worker exports in the chunk being allocated (vLLM's `_checkpoints`), set when the chunk
    /// is counted.
    pub(crate) checkpoint: Option<(usize, usize)>,
    /// Mamba align: the request keyed its own state inside a block at this prompt boundary
    /// `(block, tokens)`; the copy that preserves it, or the block itself when the request
    /// finishes there, goes to KV connectors (vLLM's `_producer_partial_tail_reqs`).
    pub(crate) producer_tail: Option<(BlockId, usize)>,
}

/// Bytes at the start of a [`GroupTable`] that hold what a running step reads: one cache line.
const HOT_BYTES: usize = 64;
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(align_of::<GroupTable>() == HOT_BYTES);
    assert!(offset_of!(GroupTable, blocks) + size_of::<Vec<BlockId>>() <= HOT_BYTES);
    assert!(offset_of!(GroupTable, num_cached) + size_of::<Option<usize>>() <= HOT_BYTES);
    assert!(offset_of!(GroupTable, unreachable_below) + size_of::<usize>() <= HOT_BYTES);
    // A step reads whether a partial hit waits: the option's tag, which rustc places at its
    // start (its payload is read only when one waits).
    assert!(offset_of!(GroupTable, partial_hit) + size_of::<usize>() <= HOT_BYTES);
};

impl GroupTable {
    pub(crate) fn clear(&mut self) {
        *self = GroupTable {
            blocks: std::mem::take(&mut self.blocks),
            ..GroupTable::default()
        };
        self.blocks.clear();
    }
}

/// What an allocation may change in one table, kept to undo it when the allocation fails
/// halfway (see [`GroupManager::mark`]).
#[derive(Debug, Default)]
pub(crate) struct TableMark {
    /// The table's fields other than its blocks.
    meta: GroupTable,
    /// The table's length.
    len: usize,
    /// The first slot the allocation may overwrite (slots below stay as they are).
    from: usize,
    /// The table's slots `from..len`.
    saved: Vec<BlockId>,
}

/// Side effects of allocation and caching the manager collects across calls.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    /// Mamba: keys cached in this scheduler step; a hit ending on one waits a step (its state
    /// is only written by this step's forward pass).
    pub(crate) cached_this_step: HashSet<CacheKey>,
    /// Newly allocated attention blocks the worker must zero (when the layout needs it), with
    /// their group: vLLM lists them group by group (`take_new_block_ids`).
    pub(crate) new_block_ids: Vec<(GroupId, BlockId)>,
    /// Mamba align: `(group, block, boundary tokens)` of each state committed to the cache
    /// this step, for KV connectors; keyed by request id.
    pub(crate) boundary_offloads: Vec<(String, GroupId, BlockId, usize)>,
    /// Copy-on-write copies `(group, source, copy)` for the worker, queued by partial hits;
    /// both blocks hold one reference more until the caller releases them after the copy.
    pub(crate) cow_copies: Vec<(GroupId, BlockId, BlockId)>,
}

/// The lengths of the [`Effects`] lists an allocation appends to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EffectsMark {
    new_block_ids: usize,
    boundary_offloads: usize,
    cow_copies: usize,
}

impl Effects {
    /// Records `blocks`, new in `group`, for zeroing.
    pub(crate) fn record_new(&mut self, group: GroupId, blocks: &[BlockId]) {
        self.new_block_ids
            .extend(blocks.iter().map(|&block| (group, block)));
    }

    /// Drains the blocks recorded for zeroing, group by group (each group's in the order they
    /// were recorded), as vLLM concatenates its per-group lists.
    pub(crate) fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        let mut recorded = std::mem::take(&mut self.new_block_ids);
        if !recorded.is_sorted_by_key(|&(group, _)| group) {
            // Stable: each group's blocks keep their order.
            recorded.sort_by_key(|&(group, _)| group);
        }
        recorded.into_iter().map(|(_, block)| block).collect()
    }

    pub(crate) fn mark(&self) -> EffectsMark {
        EffectsMark {
            new_block_ids: self.new_block_ids.len(),
            boundary_offloads: self.boundary_offloads.len(),
            cow_copies: self.cow_copies.len(),
        }
    }

    /// Drops what was appended since `mark`; the references the dropped copies held go to
    /// `released` (each copy holds one on its source and one on its copy).
    pub(crate) fn rollback(&mut self, mark: EffectsMark, released: &mut Vec<BlockId>) {
        self.new_block_ids.truncate(mark.new_block_ids);
        self.boundary_offloads.truncate(mark.boundary_offloads);
        for &(_, source, copy) in self.cow_copies.get(mark.cow_copies..).unwrap_or(&[]) {
            released.extend([source, copy]);
        }
        self.cow_copies.truncate(mark.cow_copies);
    }

    /// Drops the not yet taken offers of a request whose blocks go back to the pool (they may
    /// be handed to another request before a connector reads them), as vLLM does.
    pub(crate) fn forget_offloads(&mut self, request_id: &str) {
        if !self.boundary_offloads.is_empty() {
            self.boundary_offloads.retain(|o| o.0 != request_id);
        }
    }
}

/// What `cache_blocks` needs to know about the request beyond its hashes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CacheCtx<'a> {
    pub(crate) hash_block_size: usize,
    /// vLLM's `prefix_cache_retention_interval`.
    pub(crate) retention: Option<usize>,
    /// Positions a later request replaying the prompt can resume at.
    pub(crate) replay_boundaries: &'a [usize],
    /// The request's shared-prefix junction (0: none).
    pub(crate) shared_prefix_boundary: usize,
    pub(crate) num_hash_lookahead_tokens: usize,
    /// The request's computed tokens before this call (Mamba shared-prefix checkpoints).
    pub(crate) num_computed_tokens: usize,
}

/// What the prefill checkpoint rule of a Mamba group needs to know about a chunk beyond the
/// request's table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkCtx {
    /// Where the request's prefill ends (vLLM's `prefill_end`): only a chunk reaching it may
    /// export a checkpoint. 0 when retention is not 0: every chunk may.
    pub(crate) prefill_end: usize,
    pub(crate) hash_block_size: usize,
    pub(crate) num_hash_lookahead_tokens: usize,
}

/// vLLM's `is_mamba_prefill_checkpoint_valid`: whether a backend exporting checkpoints at
/// multiples of `alignment` (0: it exports none) can save the state after `position` tokens
/// from inside the chunk `[start, end)`, into a block of its own.
pub(crate) fn checkpoint_exportable(
    start: usize,
    end: usize,
    position: usize,
    hash_block_size: usize,
    block_size: usize,
    alignment: usize,
) -> bool {
    if alignment == 0 || start % hash_block_size != 0 {
        return false;
    }
    // The column of the chunk's initial state (-1 for a chunk from 0) and of the checkpoint
    // (the block before the chunk's last).
    let initial_col = (start as i64 - 1).div_euclid(block_size as i64);
    let checkpoint_col = end.div_ceil(block_size) as i64 - 2;
    checkpoint_col > initial_col
        && start + hash_block_size <= position
        && start < position
        && position < end
        && (position - start) % alignment == 0
}

/// A group's spec plus the values derived from the manager's config.
#[derive(Clone, Debug)]
pub(crate) struct GroupManager {
    pub(crate) spec: GroupSpec,
    pub(crate) id: GroupId,
    /// Hash blocks per block of this group.
    pub(crate) hash_ratio: usize,
    pub(crate) admission_cap: Option<usize>,
    /// Hit lengths are multiples of this many tokens (vLLM's `cache_hit_alignment_tokens`).
    pub(crate) alignment: usize,
    /// The group's hits drop the EAGLE block (vLLM's manager `use_eagle`).
    pub(crate) use_eagle: bool,
    /// Mamba checkpoints follow EAGLE's replay boundary.
    pub(crate) drop_eagle_checkpoint: bool,
    /// Tokens kept below a sliding window for multi-token prediction.
    pub(crate) extra_retained: usize,
    /// New blocks are recorded for the worker to zero.
    pub(crate) records_new_blocks: bool,
    /// Blocks in the pool, the null block included (Mamba's "wait a step" answer).
    pub(crate) num_gpu_blocks: usize,
    /// Mamba align: also key the state at the request's shared-prefix junction (vLLM's
    /// `shared_prefix_checkpoint`).
    pub(crate) shared_prefix_checkpoint: bool,
}

/// Mamba: the hit ends on a state cached in this step (written by this step's forward pass).
fn waits_a_step(pool: &BlockPool, hits: &[BlockId], effects: &Effects) -> bool {
    hits.last().is_some_and(|&last| {
        let key = pool.block_key(last).ok().flatten();
        key.is_some_and(|k| effects.cached_this_step.contains(&k))
    })
}

/// An allocation after a passed admission check, as `blocks_taken` reads it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocation {
    pub(crate) num_local_computed_tokens: usize,
    pub(crate) num_external_computed_tokens: usize,
    /// The request adopts its hit or external tokens now (it holds no blocks yet).
    pub(crate) adopts: bool,
    /// Slots the request needs (lookahead tokens included).
    pub(crate) num_tokens: usize,
    pub(crate) num_tokens_main_model: usize,
}

fn evictable(pool: &BlockPool, hits: &[BlockId]) -> usize {
    hits.iter()
        .filter(|&&b| b != NULL_BLOCK && pool.ref_count(b).unwrap_or(1) == 0)
        .count()
}

impl GroupManager {
    fn bs(&self) -> usize {
        self.spec.block_size
    }

    fn skipped_tokens(&self, num_computed_tokens: usize) -> usize {
        self.spec
            .skipped_tokens(num_computed_tokens, self.extra_retained)
    }

    /// Remembers what an allocation may change in `table` (into `mark`, reusing its buffer):
    /// its fields, its length and the slots it may overwrite (a partial hit's slot, Mamba
    /// align's speculative blocks that move to the end); everything else an allocation does to
    /// a table is appending.
    pub(crate) fn mark(&self, table: &GroupTable, mark: &mut TableMark) {
        let len = table.blocks.len();
        let mut from = match self.spec.kind {
            AttentionKind::Mamba {
                mode: MambaMode::Align,
                speculative_blocks,
                ..
            } => len.saturating_sub(speculative_blocks),
            _ => len,
        };
        if let Some((idx, _)) = table.partial_hit {
            from = from.min(idx);
        }
        mark.meta = GroupTable {
            blocks: Vec::new(),
            num_cached: table.num_cached,
            allocated: table.allocated,
            last_state: table.last_state,
            num_retired: table.num_retired,
            checkpoint: table.checkpoint,
            partial_hit: table.partial_hit,
            producer_tail: table.producer_tail,
            unreachable_below: table.unreachable_below,
        };
        mark.len = len;
        mark.from = from;
        mark.saved.clear();
        mark.saved.extend_from_slice(&table.blocks[from..]);
    }

    /// Puts `table` back as `mark` found it. The references the table holds now and did not
    /// then (blocks taken, hit blocks touched) go to `released`, for the caller to give back.
    pub(crate) fn rollback(
        &self,
        table: &mut GroupTable,
        mark: &mut TableMark,
        released: &mut Vec<BlockId>,
    ) {
        let mut kept = vec![false; mark.saved.len()];
        for &b in table.blocks.get(mark.from..).unwrap_or(&[]) {
            if b == NULL_BLOCK {
                continue;
            }
            let held_before = mark
                .saved
                .iter()
                .enumerate()
                .position(|(i, &s)| s == b && !kept[i]);
            match held_before {
                Some(i) => kept[i] = true,
                None => released.push(b),
            }
        }
        table.blocks.truncate(mark.from);
        table.blocks.extend_from_slice(&mark.saved);
        debug_assert_eq!(table.blocks.len(), mark.len);
        let blocks = std::mem::take(&mut table.blocks);
        *table = GroupTable {
            blocks,
            ..std::mem::take(&mut mark.meta)
        };
    }

    /// Blocks `allocate_new_blocks` will take for `num_tokens` slots, plus the hit blocks that
    /// touching will take out of the free order (vLLM's `get_num_blocks_to_allocate`). Signed:
    /// a Mamba align group may answer below zero, as in vLLM.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        num_tokens: usize,
        hits: &[BlockId],
        total_computed_tokens: usize,
        num_local_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        chunk: &ChunkCtx,
        effects: &Effects,
    ) -> i64 {
        let bs = self.bs();
        let partial_local_hit = self.partial_local_hit(hits, num_local_computed_tokens);
        match self.spec.kind {
            AttentionKind::CircularBuffer => return table.blocks.is_empty() as i64,
            AttentionKind::Mamba {
                mode,
                speculative_blocks,
                ..
            } => {
                if waits_a_step(pool, hits, effects) {
                    // Its state is written by this step's forward: wait a step.
                    return self.num_gpu_blocks as i64 + 1;
                }
                if mode == MambaMode::None {
                    let tokens = num_tokens.saturating_add(bs.saturating_mul(speculative_blocks));
                    return self.base_blocks_to_allocate(
                        pool,
                        table,
                        tokens,
                        hits,
                        total_computed_tokens,
                        apply_admission_cap,
                    ) + partial_local_hit as i64;
                }
                // Align: lookahead tokens get no state block.
                let required = i64::try_from(
                    num_tokens_main_model
                        .div_ceil(bs)
                        .saturating_add(speculative_blocks),
                )
                .unwrap_or(i64::MAX);
                let mut new = required - hits.len() as i64 - table.blocks.len() as i64;
                // A partial hit (or state keyed inside a block) takes one block for its copy.
                let partial = partial_local_hit || table.partial_hit.is_some();
                if partial {
                    new = new.max(0) + 1;
                }
                if new > 0 {
                    let checkpoint = self
                        .internal_checkpoint(
                            table,
                            total_computed_tokens,
                            num_tokens_main_model,
                            chunk,
                        )
                        .is_some();
                    let mut cap = 1 + partial as i64 + checkpoint as i64;
                    if !table.allocated {
                        cap += speculative_blocks as i64;
                    }
                    new = new.min(cap);
                }
                return new + evictable(pool, hits) as i64;
            }
            _ => {}
        }
        self.base_blocks_to_allocate(
            pool,
            table,
            num_tokens,
            hits,
            total_computed_tokens,
            apply_admission_cap,
        ) + partial_local_hit as i64 // the copy of a partially hit block
    }

    /// Exactly how far the allocation `a` after an admission check takes the pool's free count
    /// down for this group: the hit blocks touching takes out of the free order (when the
    /// request adopts its hit or external tokens now), the blocks for external tokens, the
    /// copy of a partially hit block and the new blocks for `num_tokens` slots
    /// (`num_tokens_main_model` for Mamba align). The same decisions as
    /// `add_local_computed_blocks`, `allocate_external_computed_blocks` and `allocate_new_blocks`
    /// on the table as it stands (after `remove_skipped_blocks` and `record_checkpoint`),
    /// without changing it. vLLM's count (`num_blocks_to_allocate`) leaves out Mamba align's
    /// block for external tokens.
    pub(crate) fn blocks_taken(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        hits: &[BlockId],
        a: &Allocation,
    ) -> usize {
        let Allocation {
            num_local_computed_tokens,
            num_external_computed_tokens,
            adopts,
            num_tokens,
            num_tokens_main_model,
        } = *a;
        let bs = self.bs();
        let mut len = table.blocks.len();
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return (len == 0) as usize;
        }
        let mut partial = table.partial_hit.is_some();
        let mut taken = 0;
        if adopts {
            let total = num_local_computed_tokens + num_external_computed_tokens;
            let skipped = self.skipped_tokens(total);
            let kept = &hits[(skipped / bs).min(hits.len())..];
            taken += evictable(pool, kept);
            len = skipped / bs + kept.len();
            partial |= self.partial_local_hit(kept, num_local_computed_tokens);
            let external = if skipped > 0 {
                (total - skipped).min(num_external_computed_tokens)
            } else {
                num_external_computed_tokens
            };
            if num_external_computed_tokens > 0 && external > 0 {
                let new = total.div_ceil(bs).saturating_sub(len);
                taken += new;
                len += new;
            }
        }
        let num_tokens = match self.spec.kind {
            AttentionKind::Mamba {
                mode: MambaMode::Align,
                speculative_blocks,
                ..
            } => {
                let required = num_tokens_main_model
                    .div_ceil(bs)
                    .saturating_add(speculative_blocks);
                let checkpoint = table.checkpoint.is_some() as usize;
                if required <= len && checkpoint == 0 && !partial {
                    return taken;
                }
                let null_end = required
                    .saturating_sub(speculative_blocks + 1)
                    .saturating_sub(checkpoint);
                let prev = len;
                len = len.max(null_end);
                if table.allocated {
                    // Relocated speculative blocks.
                    len += (prev.saturating_sub(speculative_blocks)..prev)
                        .take_while(|&idx| idx < null_end)
                        .count();
                }
                return taken + required.saturating_sub(len) + partial as usize;
            }
            AttentionKind::Mamba {
                mode: MambaMode::None,
                speculative_blocks,
                ..
            } => num_tokens.saturating_add(bs.saturating_mul(speculative_blocks)),
            _ => num_tokens,
        };
        taken + partial as usize + num_tokens.div_ceil(bs).saturating_sub(len)
    }

    /// The hit ends inside one of this group's blocks: the shared block needs a private copy
    /// (vLLM's `_has_partial_local_hit`).
    fn partial_local_hit(&self, hits: &[BlockId], num_local_computed_tokens: usize) -> bool {
        !hits.is_empty() && num_local_computed_tokens % self.bs() != 0
    }

    /// Mamba align: the state a running request keyed inside one of its own blocks (a
    /// `cache_blocks` ending on the prompt's latest hash boundary or the shared-prefix junction),
    /// which its next allocation copies before the request writes on: `(slot, block, boundary)`.
    /// `boundary` is the prefix the key covers; once a connector took the producer tail, the
    /// end of the slot's block (past it the allocation would free `block` before the copy).
    pub(crate) fn pending_own_state(&self, table: &GroupTable) -> Option<(usize, BlockId, usize)> {
        if !self.spec.is_mamba_align() || !table.allocated {
            return None;
        }
        let (slot, block) = table.partial_hit?;
        let boundary = match table.producer_tail {
            Some((tail, tokens)) if tail == block => tokens,
            _ => (slot + 1).saturating_mul(self.bs()),
        };
        Some((slot, block, boundary))
    }

    /// Mamba align with checkpoint exports: the `(position, slot)` of the prefill checkpoint
    /// the worker exports from inside the chunk `[start, end)` into a reserved block (vLLM's
    /// `_needs_internal_checkpoint`), or `None`.
    pub(crate) fn internal_checkpoint(
        &self,
        table: &GroupTable,
        start: usize,
        end: usize,
        chunk: &ChunkCtx,
    ) -> Option<(usize, usize)> {
        let AttentionKind::Mamba {
            mode: MambaMode::Align,
            speculative_blocks,
            prefill_checkpoint_alignment: alignment @ 1..,
        } = self.spec.kind
        else {
            return None;
        };
        if end < chunk.prefill_end {
            return None;
        }
        let bs = self.bs();
        let position = mamba_checkpoint_position(
            end,
            self.alignment,
            self.drop_eagle_checkpoint,
            chunk.num_hash_lookahead_tokens,
        );
        if !checkpoint_exportable(start, end, position, chunk.hash_block_size, bs, alignment) {
            return None;
        }
        let slot = end.div_ceil(bs).checked_sub(2)?;
        let held = table.blocks.len();
        // The slot must be free to take a block: beyond the table, a null, or one of the
        // running request's speculative blocks (it stays there instead of moving on).
        let free = slot >= held
            || table.blocks[slot] == NULL_BLOCK
            || (table.allocated && slot + speculative_blocks >= held);
        free.then_some((position, slot))
    }

    /// Remembers the checkpoint of the chunk `[start, end)` for the allocation and caching
    /// that follow, as vLLM's count does (not when the hit's state waits a step).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_checkpoint(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        hits: &[BlockId],
        start: usize,
        end: usize,
        chunk: &ChunkCtx,
        effects: &Effects,
    ) {
        if self.spec.prefill_checkpoint_alignment() == 0 || waits_a_step(pool, hits, effects) {
            return;
        }
        table.checkpoint = self.internal_checkpoint(table, start, end, chunk);
    }

    fn base_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        num_tokens: usize,
        hits: &[BlockId],
        total_computed_tokens: usize,
        apply_admission_cap: bool,
    ) -> i64 {
        let bs = self.bs();
        let mut required = num_tokens.div_ceil(bs);
        if apply_admission_cap {
            if let Some(cap) = self.admission_cap {
                required = required.min(cap);
            }
        }
        let held = table.blocks.len();
        if table.num_cached.is_some() {
            // A running request: no new hits.
            return required.saturating_sub(held) as i64;
        }
        let skipped_blocks = self.skipped_tokens(total_computed_tokens) / bs;
        let new = required.saturating_sub(skipped_blocks.max(hits.len() + held));
        let skip_hits = skipped_blocks.saturating_sub(held).min(hits.len());
        (new + evictable(pool, &hits[skip_hits..])) as i64
    }

    /// Adopts a request's first hit: skipped positions become null, the rest are touched.
    pub(crate) fn add_local_computed_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        hits: &[BlockId],
        num_local_computed_tokens: usize,
        total_computed_tokens: usize,
        enable_caching: bool,
    ) -> Result<()> {
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return Ok(());
        }
        let skipped = self.skipped_tokens(total_computed_tokens) / self.bs();
        let kept = &hits[skipped.min(hits.len())..];
        if enable_caching {
            pool.touch(kept)?;
        }
        table.blocks.resize(skipped, NULL_BLOCK);
        table.blocks.extend_from_slice(kept);
        table.unreachable_below = 0;
        table.num_cached = Some(table.blocks.len());
        if let (true, Some(&last)) = (
            self.partial_local_hit(kept, num_local_computed_tokens),
            kept.last(),
        ) {
            // The hit ends inside its last block: the next allocation copies it, and the copy
            // is cached once full.
            let idx = num_local_computed_tokens / self.bs();
            table.partial_hit = Some((idx, last));
            table.num_cached = Some(idx);
        }
        Ok(())
    }

    /// Blocks for tokens a KV connector supplies (after every group adopted its local hit).
    pub(crate) fn allocate_external_computed_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
        record_new: bool,
        effects: &mut Effects,
    ) -> Result<()> {
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return self.claim_ring_block(pool, table, record_new, effects);
        }
        let total = num_local_computed_tokens + num_external_computed_tokens;
        let skipped = self.skipped_tokens(total);
        let external = if skipped > 0 {
            (total - skipped).min(num_external_computed_tokens)
        } else {
            num_external_computed_tokens
        };
        if external == 0 {
            return Ok(());
        }
        let new = total.div_ceil(self.bs()).saturating_sub(table.blocks.len());
        let start = table.blocks.len();
        pool.get_new_blocks_into(new, &mut table.blocks)?;
        if self.records_new_blocks && record_new {
            effects.record_new(self.id, &table.blocks[start..]);
        }
        Ok(())
    }

    fn claim_ring_block(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        record_new: bool,
        effects: &mut Effects,
    ) -> Result<()> {
        if table.blocks.is_empty() {
            pool.get_new_blocks_into(1, &mut table.blocks)?;
            if self.records_new_blocks && record_new {
                effects.new_block_ids.push((self.id, table.blocks[0]));
            }
        }
        Ok(())
    }

    /// Grows the table to cover `num_tokens` slots; what the worker gets for this step goes to
    /// `out` (for Mamba align that may include null blocks and relocated speculative blocks).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn allocate_new_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) -> Result<()> {
        let bs = self.bs();
        let num_tokens = match self.spec.kind {
            AttentionKind::CircularBuffer => {
                let had = table.blocks.len();
                self.claim_ring_block(pool, table, true, effects)?;
                out.extend_from_slice(&table.blocks[had..]);
                return Ok(());
            }
            AttentionKind::Mamba {
                mode: MambaMode::Align,
                speculative_blocks,
                ..
            } => {
                return self.allocate_mamba_align(
                    pool,
                    table,
                    request_id,
                    num_tokens_main_model,
                    speculative_blocks,
                    out,
                    effects,
                )
            }
            AttentionKind::Mamba {
                mode: MambaMode::None,
                speculative_blocks,
                ..
            } => num_tokens.saturating_add(bs.saturating_mul(speculative_blocks)),
            _ => num_tokens,
        };
        if let Some((idx, source)) = table.partial_hit.take() {
            // The hit ends inside `source`, shared with others: the request writes on into a
            // private copy instead (recorded for zeroing whatever the layout, as vLLM does).
            let copy = self.copy_on_write(pool, table, idx, source, effects)?;
            effects.new_block_ids.push((self.id, copy));
            out.push(copy);
        }
        let new = num_tokens.div_ceil(bs).saturating_sub(table.blocks.len());
        if new > 0 {
            let start = table.blocks.len();
            reserve_for(table, new);
            pool.get_new_blocks_into(new, &mut table.blocks)?;
            self.hand_out(table, start, out, effects);
        }
        Ok(())
    }

    /// The blocks `allocate_new_blocks` would claim for `num_tokens` slots when it would only
    /// claim them (no ring, no Mamba state, no copy-on-write first), else None.
    pub(crate) fn plain_new_blocks(&self, table: &GroupTable, num_tokens: usize) -> Option<usize> {
        let plain = !matches!(
            self.spec.kind,
            AttentionKind::CircularBuffer | AttentionKind::Mamba { .. }
        ) && table.partial_hit.is_none();
        plain.then(|| {
            num_tokens
                .div_ceil(self.bs())
                .saturating_sub(table.blocks.len())
        })
    }

    /// Appends `claimed` (claimed from the pool for this group, as many as
    /// `plain_new_blocks` says) as `allocate_new_blocks` would have.
    pub(crate) fn take_claimed(
        &self,
        table: &mut GroupTable,
        claimed: &[BlockId],
        out: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) {
        let start = table.blocks.len();
        reserve_for(table, claimed.len());
        table.blocks.extend_from_slice(claimed);
        self.hand_out(table, start, out, effects);
    }

    /// The table's new blocks from `start` on go to the worker (`out`), and to be zeroed.
    fn hand_out(
        &self,
        table: &GroupTable,
        start: usize,
        out: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) {
        out.extend_from_slice(&table.blocks[start..]);
        if self.records_new_blocks {
            effects.record_new(self.id, &table.blocks[start..]);
        }
    }

    /// Takes a new block for slot `idx` of the table in place of `source` and queues the copy
    /// of `source` into it (vLLM's `_apply_cow`). Both blocks stay referenced until the copy
    /// ran: `source` keeps the reference the hit took, the copy gets one more than the table's.
    fn copy_on_write(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        idx: usize,
        source: BlockId,
        effects: &mut Effects,
    ) -> Result<BlockId> {
        let mut one = Vec::with_capacity(1);
        pool.get_new_blocks_into(1, &mut one)?;
        let copy = one[0];
        self.queue_copy(pool, table, idx, source, copy, effects)?;
        Ok(copy)
    }

    /// Puts the new block `copy` at slot `idx` in place of `source`, takes the copy's extra
    /// reference and queues the copy of `source` into it.
    fn queue_copy(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        idx: usize,
        source: BlockId,
        copy: BlockId,
        effects: &mut Effects,
    ) -> Result<()> {
        table.blocks[idx] = copy;
        pool.touch(&[copy])?;
        effects.cow_copies.push((self.id, source, copy));
        Ok(())
    }

    /// vLLM's align-mode Mamba allocation: the table keeps only live states (nulls elsewhere),
    /// one new state block per step (plus the speculative blocks on the first allocation),
    /// exclusively owned speculative blocks relocated to the end. A partial hit (or a state
    /// the request keyed inside a block) takes one block more, for its copy.
    #[allow(clippy::too_many_arguments)]
    fn allocate_mamba_align(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        request_id: &str,
        num_tokens: usize,
        spec_blocks: usize,
        out: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) -> Result<()> {
        let required = num_tokens.div_ceil(self.bs()).saturating_add(spec_blocks);
        // A chunk exporting a prefill checkpoint keeps one more block, at the checkpoint's slot.
        let checkpoint = table.checkpoint.is_some() as usize;
        if required <= table.blocks.len() && checkpoint == 0 && table.partial_hit.is_none() {
            table.allocated = true;
            return Ok(());
        }
        let prev = table.blocks.len();
        let allocated = table.allocated;
        if allocated {
            // The running state always sits in the last (1 + speculative) blocks.
            table.last_state = Some(prev - 1 - spec_blocks);
        } else if prev > 0 {
            // A new request's last hit block holds the hit state.
            table.last_state = Some(prev - 1);
        }
        let skipped = required - spec_blocks - 1;
        let null_end = skipped - checkpoint;
        if prev < null_end {
            table.blocks.resize(null_end, NULL_BLOCK);
        }
        if allocated {
            // Speculative blocks the step leaves behind move to the end; one at the
            // checkpoint's slot stays (the checkpoint is exported into it).
            for idx in prev.saturating_sub(spec_blocks)..prev {
                if idx >= null_end {
                    break;
                }
                let block = table.blocks[idx];
                table.blocks.push(block);
                table.blocks[idx] = NULL_BLOCK;
            }
        }
        let partial = table.partial_hit.take();
        let new = required.saturating_sub(table.blocks.len()) + partial.is_some() as usize;
        let kept_from = out.len();
        out.extend_from_slice(&table.blocks[prev..]);
        let start = table.blocks.len();
        pool.get_new_blocks_into(new, &mut table.blocks)?;
        if let Some((idx, source)) = partial {
            // The copy is the first of the new blocks.
            let copy = table.blocks.remove(start);
            if allocated {
                // A running request keyed its own state inside `source` and writes on into it
                // (the worker's table is append-only): the cache entry moves to the copy,
                // which the queued copy fills before this step's forward overwrites `source`.
                pool.move_block_keys(source, copy)?;
                pool.touch(&[source])?;
                effects.cow_copies.push((self.id, source, copy));
                if let Some((_, boundary)) = table.producer_tail.take() {
                    effects.boundary_offloads.push((
                        request_id.to_owned(),
                        self.id,
                        copy,
                        boundary,
                    ));
                }
                if let Some(key) = pool.block_key(copy)? {
                    // Filled by this step's copy: hits on it wait a step.
                    effects.cached_this_step.insert(key);
                }
            } else {
                // A new request's hit state: the request writes into a private copy (the hit's
                // reference to `source` goes with the queued copy).
                self.queue_copy(pool, table, idx, source, copy, effects)?;
                out.insert(kept_from, copy);
            }
        }
        out.extend_from_slice(&table.blocks[start..]);
        table.allocated = true;
        Ok(())
    }

    /// Enters the request's full blocks covering the first `num_tokens` tokens into the prefix
    /// cache: every non-null block in dense retention, under sparse retention only the blocks a
    /// later hit can reach (vLLM's `cache_blocks` with `reachable_block_mask`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cache_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        request: &Request,
        num_tokens: usize,
        ctx: &CacheCtx<'_>,
        scratch: &mut Vec<BlockId>,
        effects: &mut Effects,
    ) -> Result<()> {
        if !self.spec.prefix_cacheable() {
            return Ok(());
        }
        let bs = self.bs();
        let hashes = request.block_hashes();
        let num_cached = table.num_cached.unwrap_or(0);
        let num_full =
            (num_tokens.min(hashes.len() * ctx.hash_block_size) / bs).min(table.blocks.len());
        if num_cached < num_full {
            let mut blocks = &table.blocks[num_cached..num_full];
            if self.mask_blocks(num_cached, num_full, ctx, blocks, scratch) {
                blocks = scratch.as_slice();
            }
            // Retention keeps none of them (a window group's decode blocks): without events (vLLM
            // publishes one for such a call too) there is nothing to key or publish.
            let nothing = !pool.events_enabled() && blocks.iter().all(|&b| b == NULL_BLOCK);
            if !nothing {
                self.key_full_blocks(pool, request, num_cached, num_full, blocks, ctx)?;
            }
            table.num_cached = Some(num_full);
        }
        if self.spec.is_mamba_align() {
            self.cache_mamba_prompt_tail(pool, table, request, num_tokens, ctx, effects)?;
            // Recorded under the keys the blocks hold after the prompt tail: a block the
            // exported checkpoint re-keyed is cached this step under its checkpoint key only
            // (vLLM reads `block_hash` after `_cache_partial_tail_block`).
            self.record_cached_states(pool, table, request, num_cached, num_full, ctx, effects);
        } else if self.keys_prompt_tail(ctx.hash_block_size) {
            self.cache_prompt_tail_key(pool, table, request, num_tokens, ctx)?;
        }
        Ok(())
    }

    /// Keys `blocks` (a table's slots `[num_cached, num_full)`, masked by retention) under the
    /// request's hashes and publishes their store: `cache_blocks`' work in the pool.
    fn key_full_blocks(
        &self,
        pool: &BlockPool,
        request: &Request,
        num_cached: usize,
        num_full: usize,
        blocks: &[BlockId],
        ctx: &CacheCtx<'_>,
    ) -> Result<()> {
        let bs = self.bs();
        let hashes = request.block_hashes();
        let view = HashView::new(hashes, self.hash_ratio);
        let mut hash_buf;
        let block_hashes = if self.hash_ratio == 1 {
            &hashes[num_cached..num_full]
        } else {
            hash_buf = Vec::with_capacity(num_full - num_cached);
            hash_buf.extend((num_cached..num_full).map(|i| view.get(i)));
            hash_buf.as_slice()
        };
        if self.spec.prefill_checkpoint_alignment() > 0
            || self.keys_prompt_tail(ctx.hash_block_size)
        {
            // A block holding an exported checkpoint (or keyed at a prompt tail inside it)
            // is keyed at a shorter prefix than its slot: caching the slot's full prefix
            // re-keys it (vLLM's partial-to-full promotion in `cache_full_blocks`).
            for (&block, &hash) in blocks.iter().zip(block_hashes) {
                if block == NULL_BLOCK {
                    continue;
                }
                if pool.block_key(block)?.is_some_and(|k| k.hash != hash) {
                    pool.evict_blocks(&[block])?;
                }
            }
        }
        let extra = request.extra_keys();
        let keys_of = |i: usize| {
            let start = (num_cached + i) * bs;
            extra.event_keys(start, start + bs)
        };
        let info = StoreInfo {
            parent_block_hash: (num_cached > 0).then(|| view.get(num_cached - 1)),
            token_ids: request.token_range(num_cached * bs, num_full * bs),
            block_size: bs as u32,
            lora: extra.lora_name.as_deref().map(|n| (n, extra.lora_id)),
            block_extra_keys: pool.events_enabled().then_some(&keys_of as _),
            first_block: num_cached,
        };
        pool.cache_full_blocks(blocks, block_hashes, self.id, info)
    }

    /// Full attention with blocks larger than the hash block: also keys the block holding the
    /// prompt's last hash boundary at that boundary, when the boundary falls inside the block
    /// and is computed (vLLM's `FullAttentionManager._cache_partial_tail_block`). Lookups read
    /// it only with partial hash hits (hits inside blocks); it is published in KV events and
    /// removed with the block's other key.
    fn cache_prompt_tail_key(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        request: &Request,
        num_tokens: usize,
        ctx: &CacheCtx<'_>,
    ) -> Result<()> {
        let bs = self.bs();
        let hash_bs = ctx.hash_block_size;
        let hashes = request.block_hashes();
        let boundary = self
            .prompt_tail_boundary(request.num_prompt_tokens(), hash_bs)
            .min(hashes.len() * hash_bs);
        if boundary == 0 || boundary > num_tokens || boundary % bs == 0 {
            return Ok(());
        }
        let Some(&block) = table.blocks.get(boundary / bs) else {
            return Ok(());
        };
        if block == NULL_BLOCK {
            return Ok(());
        }
        let index = boundary / hash_bs - 1;
        let extra = request.extra_keys();
        let keys_of = |_| extra.event_keys(boundary - hash_bs, boundary);
        let info = StoreInfo {
            parent_block_hash: index.checked_sub(1).map(|i| hashes[i]),
            token_ids: request.token_range(boundary - hash_bs, boundary),
            block_size: hash_bs as u32,
            lora: extra.lora_name.as_deref().map(|n| (n, extra.lora_id)),
            block_extra_keys: pool.events_enabled().then_some(&keys_of as _),
            first_block: index,
        };
        pool.add_block_key(block, hashes[index], self.id, info)?;
        Ok(())
    }

    /// Whether the group keys the block holding a prompt's tail at the tail's last hash
    /// boundary as well (full attention with blocks larger than the hash block).
    pub(crate) fn keys_prompt_tail(&self, hash_block_size: usize) -> bool {
        self.spec.is_full() && self.bs() != hash_block_size
    }

    /// The last hash boundary of a prompt of `num_prompt_tokens` a resend can match: all but
    /// its last token, or the whole prompt for EAGLE lookups.
    pub(crate) fn prompt_tail_boundary(&self, num_prompt_tokens: usize, hash_bs: usize) -> usize {
        let limit = if self.use_eagle {
            num_prompt_tokens
        } else {
            num_prompt_tokens.saturating_sub(1)
        };
        limit / hash_bs * hash_bs
    }

    /// Mamba align: remembers the states cached in `[from, to)` under the keys they hold now
    /// (hits on them wait a step) and offers them to KV connectors at the prefix their key
    /// covers: the slot's full prefix, or the checkpoint's position for a block the exported
    /// checkpoint re-keyed.
    #[allow(clippy::too_many_arguments)]
    fn record_cached_states(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        request: &Request,
        from: usize,
        to: usize,
        ctx: &CacheCtx<'_>,
        effects: &mut Effects,
    ) {
        let hashes = request.block_hashes();
        let hash_bs = ctx.hash_block_size;
        let hash_at = |tokens: usize| {
            tokens
                .checked_div(hash_bs)
                .and_then(|n| n.checked_sub(1))
                .and_then(|i| hashes.get(i))
        };
        for idx in from..to.min(table.blocks.len()) {
            let block = table.blocks[idx];
            if block == NULL_BLOCK {
                continue;
            }
            if let Ok(Some(key)) = pool.block_key(block) {
                let full = (idx + 1) * self.bs();
                let boundary = match table.checkpoint {
                    Some((position, slot))
                        if slot == idx
                            && hash_at(full) != Some(&key.hash)
                            && hash_at(position) == Some(&key.hash) =>
                    {
                        position
                    }
                    _ => full,
                };
                effects.cached_this_step.insert(key);
                effects
                    .boundary_offloads
                    .push((request.id().to_owned(), self.id, block, boundary));
            }
        }
    }

    /// Mamba align: caches the state at the prompt's latest hash boundary (or, with shared-prefix
    /// checkpoints, at the request's shared-prefix junction) when this chunk ended exactly
    /// there, or the checkpoint this chunk exported (vLLM's `_cache_partial_tail_block`). A
    /// boundary inside a block makes the request the producer of a partial tail.
    fn cache_mamba_prompt_tail(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        request: &Request,
        num_tokens: usize,
        ctx: &CacheCtx<'_>,
        effects: &mut Effects,
    ) -> Result<()> {
        if let Some((position, slot)) = table.checkpoint {
            return self
                .cache_exported_checkpoint(pool, table, request, position, slot, ctx, effects);
        }
        let hash_bs = ctx.hash_block_size;
        if num_tokens == 0 || num_tokens % hash_bs != 0 {
            return Ok(());
        }
        let num_prompt = request.num_prompt_tokens();
        let latest = mamba_checkpoint_position(
            num_prompt,
            hash_bs,
            self.drop_eagle_checkpoint,
            ctx.num_hash_lookahead_tokens,
        );
        // The shared-prefix junction, where a sibling resumes, while the prompt chunk ending
        // there is being computed (later, the running state block no longer holds it).
        let junction = self.shared_prefix_checkpoint
            && num_tokens == ctx.shared_prefix_boundary
            && ctx.num_computed_tokens < num_tokens
            && num_tokens <= num_prompt;
        if num_tokens != latest && !junction {
            return Ok(());
        }
        let idx = num_tokens.div_ceil(self.bs()) - 1;
        let Some(&block) = table.blocks.get(idx) else {
            return Ok(());
        };
        if block == NULL_BLOCK {
            return Ok(());
        }
        // Not hashed that far yet (lookahead hashing lags the tokens): nothing to key.
        let Some(&hash) = request.block_hashes().get(num_tokens / hash_bs - 1) else {
            return Ok(());
        };
        let key = CacheKey {
            hash,
            group: self.id,
        };
        if pool.block_key(block)? == Some(key) {
            // Keyed here already (by a hit or an earlier step).
            return Ok(());
        }
        self.key_state_block(pool, request, block, num_tokens, ctx, effects)?;
        if num_tokens % self.bs() != 0 {
            // Keyed inside the block the request writes on into: the next allocation moves
            // the key to a copy of it, which is cached once full (vLLM's producer partial
            // tail).
            table.partial_hit = Some((idx, block));
            table.num_cached = Some(idx);
            table.producer_tail = Some((block, num_tokens));
        }
        Ok(())
    }

    /// Mamba align: the state this request keyed inside a block, if the request finishes
    /// exactly there with nothing in flight (vLLM's `finalize_partial_tail_offload`); forgets
    /// it either way.
    pub(crate) fn finalize_partial_tail(
        &self,
        table: &mut GroupTable,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
    ) -> Option<(GroupId, BlockId, usize)> {
        let (block, boundary) = table.producer_tail.take()?;
        (num_in_flight_tokens == 0 && num_computed_tokens == boundary)
            .then_some((self.id, block, boundary))
    }

    /// Mamba align: keys the block the worker exported this chunk's checkpoint into at the
    /// checkpoint's position, when a later hit can reach it: it is the prompt's checkpoint, a
    /// state retention keeps, or the shared-prefix junction. Otherwise the state is transient
    /// and any key the block has goes.
    #[allow(clippy::too_many_arguments)]
    fn cache_exported_checkpoint(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        request: &Request,
        position: usize,
        slot: usize,
        ctx: &CacheCtx<'_>,
        effects: &mut Effects,
    ) -> Result<()> {
        // The slot was reserved when the chunk was allocated; a chunk counted but never
        // allocated reserved nothing.
        let Some(&block) = table.blocks.get(slot) else {
            return Ok(());
        };
        if block == NULL_BLOCK {
            return Ok(());
        }
        let bs = self.bs();
        let prompt_checkpoint = mamba_checkpoint_position(
            request.num_prompt_tokens(),
            self.alignment,
            self.drop_eagle_checkpoint,
            ctx.num_hash_lookahead_tokens,
        );
        // Retention's segment states only (the replay boundaries are not consulted here).
        let retained = position % bs == 0
            && match ctx.retention {
                None => true,
                Some(0) => false,
                Some(r) => {
                    let per = r / bs;
                    per <= 1 || (position / bs) % per == 0
                }
            };
        if position != prompt_checkpoint && !retained && position != ctx.shared_prefix_boundary {
            if pool.block_key(block)?.is_some() {
                pool.evict_blocks(&[block])?;
            }
            return Ok(());
        }
        self.key_state_block(pool, request, block, position, ctx, effects)
    }

    /// Mamba align: keys `block` (in `slot`) as the state after `num_tokens` tokens, replacing
    /// any other key it has, and marks the key cached this step.
    #[allow(clippy::too_many_arguments)]
    fn key_state_block(
        &self,
        pool: &BlockPool,
        request: &Request,
        block: BlockId,
        num_tokens: usize,
        ctx: &CacheCtx<'_>,
        effects: &mut Effects,
    ) -> Result<()> {
        let hash_bs = ctx.hash_block_size;
        let hashes = request.block_hashes();
        let Some(&hash) = (num_tokens / hash_bs)
            .checked_sub(1)
            .and_then(|i| hashes.get(i))
        else {
            // Not hashed that far yet: with lookahead hashes a block is hashed once the tokens
            // after it exist, and a chunk scheduling draft tokens past the request's tokens
            // exports the state after all of them (vLLM 0.33 fails an assertion in
            // `_get_partial_block_hash` here). No key can name this state yet; a key the block
            // may still have names another state and goes.
            if pool.block_key(block)?.is_some() {
                pool.evict_blocks(&[block])?;
            }
            return Ok(());
        };
        let key = CacheKey {
            hash,
            group: self.id,
        };
        if pool.block_key(block)? == Some(key) {
            // Already keyed here (by a hit or an earlier step).
            return Ok(());
        }
        let extra = request.extra_keys();
        let keys_of = |_| extra.event_keys(num_tokens - hash_bs, num_tokens);
        let info = StoreInfo {
            parent_block_hash: (num_tokens > hash_bs).then(|| hashes[num_tokens / hash_bs - 2]),
            token_ids: request.token_range(num_tokens - hash_bs, num_tokens),
            block_size: hash_bs as u32,
            lora: extra.lora_name.as_deref().map(|n| (n, extra.lora_id)),
            block_extra_keys: pool.events_enabled().then_some(&keys_of as _),
            // The position of the keyed prefix's last hash block (the block after the parent
            // hash), not of the slot: an exported checkpoint can sit one slot further on.
            first_block: num_tokens / hash_bs - 1,
        };
        if pool.block_key(block)?.is_some() {
            // A key for a shorter prefix: the state moved on, the key goes.
            pool.evict_blocks(&[block])?;
        }
        pool.cache_full_blocks(&[block], &[hash], self.id, info)?;
        effects.cached_this_step.insert(key);
        Ok(())
    }

    /// Fills `scratch` with the blocks of `[start, end)` a later hit can reach (null blocks
    /// elsewhere) and returns `true`, or returns `false` when every block is reachable.
    fn mask_blocks(
        &self,
        start: usize,
        end: usize,
        ctx: &CacheCtx<'_>,
        blocks: &[BlockId],
        scratch: &mut Vec<BlockId>,
    ) -> bool {
        let bs = self.bs();
        let alignment = self.alignment;
        let mut boundaries = [0usize; 4];
        let mut n = 0;
        for &b in ctx.replay_boundaries {
            boundaries[n] = b;
            n += 1;
        }
        if ctx.shared_prefix_boundary > 0 {
            boundaries[n] = ctx.shared_prefix_boundary;
            n += 1;
            if self.use_eagle {
                // A sibling diverging right after the junction cannot use the block past it
                // as the EAGLE peek: its hit lands one block lower.
                boundaries[n] = ctx.shared_prefix_boundary.saturating_sub(bs);
                n += 1;
            }
        }
        let boundaries = &boundaries[..n];
        let mark = |scratch: &mut Vec<BlockId>, i: usize| scratch[i - start] = blocks[i - start];
        if self.spec.is_sliding_window() {
            if alignment % bs != 0 {
                return false;
            }
            let need = self.spec.sliding_window_contiguous_blocks(self.use_eagle);
            let shift = self.use_eagle as usize;
            let segment = match ctx.retention {
                None => Some(alignment),
                Some(0) => None,
                Some(r) => Some(r),
            };
            scratch.clear();
            scratch.resize(end - start, NULL_BLOCK);
            if let Some(segment) = segment {
                let per = segment / bs;
                if need >= per {
                    return false;
                }
                for i in start..end {
                    if i >= shift && (i - shift) % per >= per - need {
                        mark(scratch, i);
                    }
                }
            }
            if ctx.retention.is_some() {
                for &b in boundaries {
                    let aligned = b / alignment * alignment;
                    let e = aligned / bs + shift;
                    for j in e.saturating_sub(need).max(start)..e.min(end) {
                        mark(scratch, j);
                    }
                }
            }
            return true;
        }
        if self.spec.is_mamba() {
            let Some(retention) = ctx.retention else {
                return false;
            };
            scratch.clear();
            scratch.resize(end - start, NULL_BLOCK);
            if retention > 0 {
                let per = retention / bs;
                if per <= 1 {
                    return false;
                }
                let first = (start + per) / per * per - 1;
                let mut i = first;
                while i < end {
                    mark(scratch, i);
                    i += per;
                }
            }
            for &b in boundaries {
                let aligned = b / alignment * alignment;
                if let Some(block) = (aligned / bs).checked_sub(1) {
                    if (start..end).contains(&block) {
                        mark(scratch, block);
                    }
                }
            }
            return true;
        }
        false
    }

    /// Replaces blocks no longer needed after `num_computed_tokens` with the null block and
    /// frees them, last first (vLLM's `remove_skipped_blocks`). `num_prompt_tokens` lets a
    /// reference-sliding-window group free the gap between the prompt and its window.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        num_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return Ok(());
        }
        let (first, last) = self.skipped_range(num_computed_tokens, num_prompt_tokens);
        if !self.spec.is_mamba_align() {
            return remove_blocks_in_range(pool, table, first, last, scratch);
        }
        self.retire_mamba_blocks(pool, table, last.min(table.blocks.len()), scratch)?;
        // The state the previous step started from is no longer needed once the request is
        // more than one block past it.
        if let Some(idx) = table.last_state {
            if idx + 1 < num_computed_tokens.div_ceil(self.bs()) {
                if let Some(slot) = table.blocks.get_mut(idx) {
                    if *slot != NULL_BLOCK {
                        let block = std::mem::replace(slot, NULL_BLOCK);
                        pool.free_held(&[block], &[1])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The blocks `remove_skipped_blocks` would free after `num_computed_tokens`, appended to
    /// `out` in the order it frees them, for a group that frees by the plain window walk (not
    /// Mamba `align`, not a circular buffer); see `walk_down` for the answer. The caller frees
    /// them, nulls slots `[last - freed, last)` and raises `unreachable_below` to `last`.
    pub(crate) fn collect_skipped(
        &self,
        table: &GroupTable,
        num_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
        out: &mut Vec<BlockId>,
    ) -> Option<(usize, usize)> {
        debug_assert!(
            !self.spec.is_mamba_align() && !matches!(self.spec.kind, AttentionKind::CircularBuffer)
        );
        let (first, last) = self.skipped_range(num_computed_tokens, num_prompt_tokens);
        walk_down(table, first, last, out)
    }

    /// The slots `[first, last)` that `remove_skipped_blocks` empties after
    /// `num_computed_tokens` (from `last - 1` down to the first null block; `last` is not
    /// clamped to the table). Both grow with the tokens.
    fn skipped_range(
        &self,
        num_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> (usize, usize) {
        let bs = self.bs();
        if let (AttentionKind::Rswa { window }, Some(prompt)) = (self.spec.kind, num_prompt_tokens)
        {
            let last = prompt.max(num_computed_tokens.saturating_sub(window)) / bs;
            return (prompt.div_ceil(bs), last);
        }
        (0, self.skipped_tokens(num_computed_tokens) / bs)
    }

    /// Starts loading the table slots that `remove_skipped_blocks` after
    /// `num_computed_tokens` and then `removal_horizon` read first: the window's edge, far
    /// below a long table's tail and cold. A running step issues this for every group before
    /// the first walk, so the groups' loads overlap instead of following one another.
    pub(crate) fn prefetch_window_edge(
        &self,
        table: &GroupTable,
        num_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) {
        if cfg!(loom) || !self.frees_behind() {
            return;
        }
        let (first, last) = self.skipped_range(num_computed_tokens, num_prompt_tokens);
        let edge = last.max(first).max(table.unreachable_below);
        for slot in [edge.wrapping_sub(1), edge] {
            if let Some(block) = table.blocks.get(slot) {
                crate::sync::prefetch(block);
            }
        }
    }

    /// Whether `remove_skipped_blocks` ever frees a block of this group through the window
    /// walk (sliding windows, chunks, RSWA past its sink, Mamba `none`); full attention and
    /// MLA keep every block, circular buffers and Mamba `align` groups keep other state.
    fn frees_behind(&self) -> bool {
        !self.keeps_every_block()
            && !matches!(self.spec.kind, AttentionKind::CircularBuffer)
            && !self.spec.is_mamba_align()
    }

    /// Full attention and MLA: no block ever leaves a window.
    fn keeps_every_block(&self) -> bool {
        matches!(self.spec.kind, AttentionKind::Full | AttentionKind::Mla)
    }

    /// The fewest processed tokens at which `remove_skipped_blocks` would free one of the
    /// table's blocks (`usize::MAX`: at no count), for a table that takes no new block
    /// meanwhile. Not for circular buffers or Mamba `align` groups (they keep other state).
    /// (`Coordinator::running_horizon` takes its two parts apart.)
    #[cfg(test)]
    pub(crate) fn removal_horizon(&self, table: &GroupTable, num_prompt_tokens: usize) -> usize {
        match self.first_removable(table, num_prompt_tokens) {
            Some(live) => self.removal_horizon_at(live, num_prompt_tokens),
            None => usize::MAX,
        }
    }

    /// The slot whose block `removal_horizon` waits for: the first live slot the next window
    /// walk can reach. None when no walk can free anything (full attention, MLA, or no live
    /// slot in reach).
    pub(crate) fn first_removable(
        &self,
        table: &GroupTable,
        num_prompt_tokens: usize,
    ) -> Option<usize> {
        if self.keeps_every_block() {
            // No slot to look at.
            return None;
        }
        let (first, _) = self.skipped_range(0, Some(num_prompt_tokens));
        // A removal up to `last` frees something only if slot `last - 1` holds a block: the
        // first live slot the walk can still reach is the earliest that can go. Slots below
        // where the last walk stopped are out of its reach; starting there also keeps this
        // from reading every null slot of a long sequence on each call.
        let from = first.max(table.unreachable_below);
        debug_assert!(from == first || table.blocks[from - 1] == NULL_BLOCK);
        (from..table.blocks.len()).find(|&i| table.blocks[i] != NULL_BLOCK)
    }

    /// `removal_horizon` of a table whose first removable slot (`first_removable`) is `live`:
    /// it depends on the table through `live` alone.
    pub(crate) fn removal_horizon_at(&self, live: usize, num_prompt_tokens: usize) -> usize {
        let prompt = Some(num_prompt_tokens);
        // Slots below `live + 1` are skipped once the processed tokens cover them and the
        // window behind them: the answer is a step or two above this (a chunk at most).
        let behind = match self.spec.kind {
            AttentionKind::SlidingWindow { window }
            | AttentionKind::SlidingWindowMla { window, .. } => {
                window.saturating_add(self.extra_retained)
            }
            AttentionKind::Rswa { window } => window,
            _ => 0,
        };
        let hint = (live + 1)
            .saturating_mul(self.bs())
            .saturating_add(behind)
            .saturating_sub(3);
        first_at_least(|p| self.skipped_range(p, prompt).1, live + 1, hint)
    }

    /// Mamba align: frees the live blocks of `[retired, last)` (nulls between states are
    /// skipped, not a stop) and remembers that everything below `last` is retired.
    fn retire_mamba_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        last: usize,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        let first = table.num_retired;
        if first >= last {
            return Ok(());
        }
        scratch.clear();
        for i in (first..last).rev() {
            if table.blocks[i] != NULL_BLOCK {
                scratch.push(table.blocks[i]);
                table.blocks[i] = NULL_BLOCK;
            }
        }
        if !scratch.is_empty() {
            pool.free_held(scratch, &[scratch.len()])?;
        }
        table.num_retired = last;
        Ok(())
    }

    /// Empties the table: its blocks without the leading nulls, in allocation order (vLLM's
    /// `pop_blocks_for_free`).
    pub(crate) fn pop_blocks(&self, table: &mut GroupTable, out: &mut Vec<BlockId>) {
        let lead = table
            .blocks
            .iter()
            .position(|&b| b != NULL_BLOCK)
            .unwrap_or(table.blocks.len());
        out.extend_from_slice(&table.blocks[lead..]);
        table.clear();
    }
}

/// The smallest `x` with `f(x) >= target` for a non-decreasing `f`; `usize::MAX` if there is
/// none below `usize::MAX / 4`. When `f(hint) < target` the search gallops up from `hint`, so a
/// hint just below the answer takes a few evaluations of `f` instead of twice the answer's bit
/// length; the answer does not depend on the hint.
pub(crate) fn first_at_least(f: impl Fn(usize) -> usize, target: usize, hint: usize) -> usize {
    const LIMIT: usize = usize::MAX / 4;
    if f(LIMIT) < target {
        // Never (full attention never frees a block that left a window).
        return usize::MAX;
    }
    // Then f(lo) < target <= f(hi).
    let (mut lo, mut hi);
    if 0 < hint && hint < LIMIT && f(hint) < target {
        lo = hint;
        let mut step = 1;
        loop {
            hi = lo + step;
            if f(hi) >= target {
                break;
            }
            if hi >= LIMIT {
                return usize::MAX;
            }
            lo = hi;
            step *= 2;
        }
    } else {
        if f(0) >= target {
            return 0;
        }
        hi = 1;
        while f(hi) < target {
            if hi >= LIMIT {
                return usize::MAX;
            }
            hi *= 2;
        }
        lo = hi / 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if f(mid) >= target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// Makes room for `new` more blocks in the table and a quarter more (at least 16 blocks): the
/// decode steps after an admission then grow the table in place instead of copying it (cold by
/// then). Only a hint: without the room the table grows as it takes the blocks (and the pool,
/// not this, bounds `new`).
fn reserve_for(table: &mut GroupTable, new: usize) {
    let start = table.blocks.len();
    if table.blocks.capacity() - start < new {
        let _ = table
            .blocks
            .try_reserve(new.saturating_add((start.saturating_add(new) / 4).max(16)));
    }
}

/// Frees the blocks of `[first, last)` from the last backwards, stopping at the first null
/// (everything before it was removed already), and nulls their slots.
fn remove_blocks_in_range(
    pool: &BlockPool,
    table: &mut GroupTable,
    first: usize,
    last: usize,
    scratch: &mut Vec<BlockId>,
) -> Result<()> {
    scratch.clear();
    let Some((last, freed)) = walk_down(table, first, last, scratch) else {
        return Ok(());
    };
    if freed > 0 {
        pool.free_held(scratch, &[freed])?;
        table.blocks[last - freed..last].fill(NULL_BLOCK);
    }
    // Slot `last - 1` is null now: later walks stop at or above it.
    table.unreachable_below = table.unreachable_below.max(last);
    Ok(())
}

/// The walk of `remove_blocks_in_range` over `[first, last)`: appends to `out` the live blocks
/// from slot `last - 1` down to the first null (the order they are freed in) and returns
/// `(last, their number)` with `last` clamped to the table, or None when there is no walk to
/// make (an empty range, or one the last walk already passed).
fn walk_down(
    table: &GroupTable,
    first: usize,
    last: usize,
    out: &mut Vec<BlockId>,
) -> Option<(usize, usize)> {
    let last = last.min(table.blocks.len());
    if first >= last {
        return None;
    }
    if last <= table.unreachable_below {
        // A walk from this edge or above already ran, and the live slots form one run above
        // the nulls: slot `last - 1` is null, and the walk would free nothing. Its slot, far
        // below the tail, is not read.
        debug_assert_eq!(table.blocks[last - 1], NULL_BLOCK);
        return None;
    }
    let before = out.len();
    for i in (first..last).rev() {
        let b = table.blocks[i];
        if b == NULL_BLOCK {
            break;
        }
        out.push(b);
    }
    Some((last, out.len() - before))
}

/// vLLM's `get_mamba_prefill_checkpoint_position`: the latest hash boundary of a prefill of
/// `num_tokens` whose state a later request can reuse (leaving a token to recompute, or the
/// EAGLE block).
pub(crate) fn mamba_checkpoint_position(
    num_tokens: usize,
    hash_block_size: usize,
    drop_eagle_block: bool,
    num_hash_lookahead_tokens: usize,
) -> usize {
    let limit = if drop_eagle_block {
        num_tokens
    } else {
        num_tokens.saturating_sub(num_hash_lookahead_tokens.max(1))
    };
    let position = limit / hash_block_size * hash_block_size;
    if drop_eagle_block {
        position.saturating_sub(hash_block_size)
    } else {
        position
    }
}

/// Blocks a full-attention hit's list has room for before the search starts.
const HIT_ROOM: usize = 128;

/// The longest cached prefix of `hashes` (at `hash_block_size`) of at most `max_len` tokens
/// under the rule of `spec`'s attention type, for the groups `gids` (all with that spec: a hit
/// needs every one of them cached). Fills `out[g]` for each of them (null blocks where a slot
/// needs none) and returns the hit length in tokens, a multiple of `alignment` (vLLM's
/// `find_longest_cache_hit` of each single-type manager). `drop_eagle` drops the last matched
/// block (EAGLE drafting recomputes it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn find_longest_cache_hit(
    spec: &GroupSpec,
    pool: &BlockPool,
    hashes: &[BlockHash],
    hash_block_size: usize,
    max_len: usize,
    gids: &[usize],
    alignment: usize,
    drop_eagle: bool,
    out: &mut [Vec<BlockId>],
    scratch: &mut Vec<BlockId>,
) -> usize {
    let bs = spec.block_size;
    let view = HashView::new(hashes, bs / hash_block_size);
    for &g in gids {
        out[g].clear();
    }
    match spec.kind {
        AttentionKind::Full | AttentionKind::Mla | AttentionKind::Rswa { .. } => {
            // Left to right, stopping at the first miss.
            let max_blocks = (max_len / bs).min(view.len());
            for &g in gids {
                // Room for a typical hit at once (growing from empty took five reallocations
                // for a 1k-token prefix), at most 512 bytes a group when the hit is short.
                out[g].reserve(max_blocks.min(HIT_ROOM));
            }
            for i in 0..max_blocks.min(PREFETCH_AHEAD) {
                prefetch_all(pool, view.get(i), gids);
            }
            for i in 0..max_blocks {
                if i + PREFETCH_AHEAD < max_blocks {
                    prefetch_all(pool, view.get(i + PREFETCH_AHEAD), gids);
                }
                if !lookup_all(pool, view.get(i), gids, scratch) {
                    break;
                }
                for (&g, &b) in gids.iter().zip(scratch.iter()) {
                    out[g].push(b);
                }
            }
            let mut hit = out[gids[0]].len() * bs;
            if alignment < bs && alignment == hash_block_size {
                // Fine-grained: extend into the first block not wholly cached, probing its hash
                // boundaries from the highest down (a block keyed at a prompt tail inside it).
                let scale = bs / alignment;
                let first = out[gids[0]].len() * scale;
                let end = (first + scale - 1)
                    .min(max_len / alignment)
                    .min(hashes.len());
                for j in (first..end).rev() {
                    if lookup_all(pool, hashes[j], gids, scratch) {
                        for (&g, &b) in gids.iter().zip(scratch.iter()) {
                            out[g].push(b);
                        }
                        hit = (j + 1) * alignment;
                        break;
                    }
                }
            }
            if drop_eagle && hit > 0 {
                hit -= alignment.min(bs);
            }
            hit -= hit % alignment;
            let keep = hit.div_ceil(bs);
            for &g in gids {
                out[g].truncate(keep);
            }
            hit
        }
        AttentionKind::SlidingWindow { .. } | AttentionKind::SlidingWindowMla { .. } => {
            // The rightmost run of enough contiguous cached blocks ending on an alignment
            // boundary (after the EAGLE pop), else the cached run from block 0.
            let need = spec.sliding_window_contiguous_blocks(drop_eagle).max(1);
            let max_blocks = (max_len / bs).min(view.len());
            for &g in gids {
                out[g].resize(max_blocks, NULL_BLOCK);
            }
            let aligned = |end: usize| {
                let after_pop = if drop_eagle { end - 1 } else { end };
                bs == alignment || (after_pop * bs) % alignment == 0
            };
            let mut probe = |i: usize| {
                if !lookup_all(pool, view.get(i), gids, scratch) {
                    return false;
                }
                for (&g, &b) in gids.iter().zip(scratch.iter()) {
                    out[g][i] = b;
                }
                true
            };
            let prefetch = |i: usize| prefetch_all(pool, view.get(i), gids);
            match rightmost_window(max_blocks, need, aligned, &mut probe, prefetch) {
                Window::Found(end) => {
                    for &g in gids {
                        out[g].truncate(end);
                        // Windows are probed at falling starts: nothing below this one was.
                        debug_assert!(out[g][..end - need].iter().all(|&b| b == NULL_BLOCK));
                    }
                }
                Window::FromStart(end) => {
                    for &g in gids {
                        out[g].truncate(end);
                    }
                    pop_to_alignment(bs, alignment, gids, out);
                }
            }
            if drop_eagle && !out[gids[0]].is_empty() {
                for &g in gids {
                    out[g].pop();
                }
                pop_to_alignment(bs, alignment, gids, out);
            }
            out[gids[0]].len() * bs
        }
        AttentionKind::ChunkedLocal { chunk } => {
            // Blocks before the current chunk count as computed (null); then left to right.
            let max_blocks = max_len / bs;
            let start = if max_len > 0 {
                (max_len / chunk * chunk) / bs
            } else {
                0
            };
            for &g in gids {
                out[g].resize(start, NULL_BLOCK);
            }
            for i in start..max_blocks.min(view.len()) {
                if !lookup_all(pool, view.get(i), gids, scratch) {
                    break;
                }
                for (&g, &b) in gids.iter().zip(scratch.iter()) {
                    out[g].push(b);
                }
            }
            out[gids[0]].len() * bs
        }
        AttentionKind::Mamba { .. } if alignment < bs && alignment == hash_block_size => {
            // Fine-grained: the latest state cached at any hash boundary, right to left; no
            // EAGLE drop.
            let scale = bs / alignment;
            let units = (max_len / alignment).min(hashes.len());
            for j in (0..units).rev() {
                if lookup_all(pool, hashes[j], gids, scratch) {
                    for (&g, &b) in gids.iter().zip(scratch.iter()) {
                        out[g].resize(j / scale, NULL_BLOCK);
                        out[g].push(b);
                    }
                    return (j + 1) * alignment;
                }
            }
            0
        }
        AttentionKind::Mamba { .. } => {
            // Right to left: the latest cached state on an aligned boundary; no EAGLE drop
            // (draft models have no Mamba layers).
            let max_blocks = (max_len / bs).min(view.len());
            for i in (0..max_blocks).rev() {
                if !lookup_all(pool, view.get(i), gids, scratch) {
                    continue;
                }
                if bs != alignment && ((i + 1) * bs) % alignment != 0 {
                    continue;
                }
                for (&g, &b) in gids.iter().zip(scratch.iter()) {
                    out[g].resize(i, NULL_BLOCK);
                    out[g].push(b);
                }
                return (i + 1) * bs;
            }
            0
        }
        AttentionKind::CircularBuffer => 0,
    }
}

/// Where a sliding-window hit ends (see [`rightmost_window`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Window {
    /// Blocks `[end - need, end)` are cached: the hit ends at block `end`.
    Found(usize),
    /// No such run: blocks `[0, end)` are cached (`end < need`; 0 if block 0 is not).
    FromStart(usize),
}

/// The largest `end <= n` with `aligned(end)` whose `need` blocks before it all `probe` as
/// cached; failing that, the largest aligned `end` (or 0) whose blocks from 0 all are. This is
/// what vLLM's right-to-left scan finds (a run restarts at each miss and may only start on an
/// aligned end), without probing every block: a window is probed from its left end, and a miss
/// at block `j` rules out every end above `j` at once, so when cached blocks are sparse (vLLM's
/// default retention keeps a window's blocks only at checkpoints) a miss skips `need` blocks.
/// Each block is probed at most once; `prefetch(i)` hints that block `i` is probed next.
fn rightmost_window(
    n: usize,
    need: usize,
    aligned: impl Fn(usize) -> bool,
    probe: &mut impl FnMut(usize) -> bool,
    prefetch: impl Fn(usize),
) -> Window {
    const UNKNOWN: u8 = 0;
    const CACHED: u8 = 1;
    const MISSING: u8 = 2;
    let mut seen = vec![UNKNOWN; n];
    let mut cached = |i: usize| {
        if seen[i] == UNKNOWN {
            seen[i] = if probe(i) { CACHED } else { MISSING };
        }
        seen[i] == CACHED
    };
    let mut end = n;
    loop {
        while end >= need && !aligned(end) {
            end -= 1;
        }
        if end < need {
            break;
        }
        let start = end - need;
        for ahead in (start..end).take(PREFETCH_AHEAD) {
            prefetch(ahead);
        }
        // The first block of the window not cached: every window ending above it holds it.
        let miss = (start..end).find(|&i| {
            if i + PREFETCH_AHEAD < end {
                prefetch(i + PREFETCH_AHEAD);
            }
            !cached(i)
        });
        match miss {
            Some(i) => end = i,
            None => return Window::Found(end),
        }
    }
    // An aligned end at `need` or above with only cached blocks below it would have been found
    // above: the run from block 0 matters up to `need` blocks. (Prompts shorter than the window
    // come here without probing any window: the run is prefetched as a window's probes are.)
    let limit = n.min(need);
    for ahead in (0..limit).take(PREFETCH_AHEAD) {
        prefetch(ahead);
    }
    let mut run = 0;
    while run < limit && {
        if run + PREFETCH_AHEAD < limit {
            prefetch(run + PREFETCH_AHEAD);
        }
        cached(run)
    } {
        run += 1;
    }
    let end = (1..=run).rev().find(|&e| aligned(e)).unwrap_or(0);
    Window::FromStart(end)
}

/// Drops trailing hit blocks until the hit ends on a multiple of `alignment`.
fn pop_to_alignment(bs: usize, alignment: usize, gids: &[usize], out: &mut [Vec<BlockId>]) {
    if bs == alignment {
        return;
    }
    let len = out[gids[0]].len();
    let keep = len * bs / alignment * alignment / bs;
    for &g in gids {
        out[g].truncate(keep);
    }
}

#[inline]
fn prefetch_all(pool: &BlockPool, hash: BlockHash, gids: &[usize]) {
    for &g in gids {
        pool.prefetch_lookup(hash, g as GroupId);
    }
}

/// One cached block per group for `hash` into `scratch`, or `false` if any group misses.
#[inline]
fn lookup_all(
    pool: &BlockPool,
    hash: BlockHash,
    gids: &[usize],
    scratch: &mut Vec<BlockId>,
) -> bool {
    scratch.clear();
    for &g in gids {
        match pool.lookup(hash, g as GroupId) {
            Some(b) => scratch.push(b),
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::{
        first_at_least, rightmost_window, Effects, GroupManager, GroupTable, Window, NULL_BLOCK,
    };
    use crate::error::CoreError;
    use crate::manager::spec::{AttentionKind, GroupSpec};
    use crate::pool::BlockPool;

    /// A table grows with room for the decode steps after it (a quarter more, at least 16
    /// blocks), so they do not copy it; a count no pool could serve is the pool's error, with
    /// the table unchanged, not an allocation sized by the count.
    #[test]
    fn a_table_grows_with_room_and_a_huge_count_is_the_pools_error() {
        let g = group(GroupSpec::full(16));
        let pool = BlockPool::new(64).unwrap();
        let mut table = GroupTable::default();
        let mut out = Vec::new();
        let mut effects = Effects::default();
        g.allocate_new_blocks(
            &pool,
            &mut table,
            "r",
            40 * 16,
            40 * 16,
            &mut out,
            &mut effects,
        )
        .unwrap();
        assert_eq!(table.blocks.len(), 40);
        assert!(
            table.blocks.capacity() >= 40 + 16,
            "{}",
            table.blocks.capacity()
        );
        let (ptr, capacity) = (table.blocks.as_ptr(), table.blocks.capacity());
        for n in 41..=56 {
            g.allocate_new_blocks(
                &pool,
                &mut table,
                "r",
                n * 16,
                n * 16,
                &mut out,
                &mut effects,
            )
            .unwrap();
        }
        assert_eq!(table.blocks.len(), 56);
        assert_eq!(
            (table.blocks.as_ptr(), table.blocks.capacity()),
            (ptr, capacity)
        );
        let before = table.blocks.clone();
        for huge in [usize::MAX, usize::MAX / 2, 1 << 50] {
            let err = g
                .allocate_new_blocks(&pool, &mut table, "r", huge, huge, &mut out, &mut effects)
                .unwrap_err();
            assert!(
                matches!(err, CoreError::NotEnoughFreeBlocks { .. }),
                "{err:?}"
            );
            assert_eq!(table.blocks, before);
        }
    }

    fn group(spec: GroupSpec) -> GroupManager {
        GroupManager {
            spec,
            id: 0,
            hash_ratio: 1,
            admission_cap: None,
            alignment: spec.block_size,
            use_eagle: false,
            drop_eagle_checkpoint: false,
            extra_retained: 0,
            records_new_blocks: false,
            num_gpu_blocks: 64,
            shared_prefix_checkpoint: false,
        }
    }

    /// The removal horizon is the first processed count at which `remove_skipped_blocks`
    /// frees a block (for chunked-local groups, a count past the current one and at or before
    /// that): checked against removals at every count, for sliding-window, RSWA (its prompt's
    /// blocks are never freed) and chunked-local groups, on tables whose live slots sit below
    /// nulls too (a walk down from a window's edge stops at the first null, so a live slot
    /// below one it already passed is never freed).
    #[test]
    fn the_removal_horizon_is_the_first_count_that_frees_a_block() {
        let bs = 4;
        // (spec, prompt tokens, exact): a window's edge moves a slot at a time, so its
        // horizon is exact; a chunk's edge moves a chunk at a time and may land on a null
        // slot past the first live one (the walk then stops at once), so its horizon may come
        // earlier than the first count that frees anything.
        let chunked = GroupSpec::new(AttentionKind::ChunkedLocal { chunk: 8 }, bs);
        let groups = [
            (GroupSpec::sliding_window(bs, 9), 0, true),
            (
                GroupSpec::new(AttentionKind::Rswa { window: 6 }, bs),
                10,
                true,
            ),
            (chunked, 0, false),
        ];
        // Live slots of a 12-slot table (the others null).
        let patterns: [&[usize]; 5] = [
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
            &[3, 4, 5, 6, 7, 8, 9, 10, 11],
            &[0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
            &[0, 1, 4, 6, 7, 8, 9, 10, 11],
            &[],
        ];
        for (spec, prompt, exact) in groups {
            let m = group(spec);
            for live in patterns {
                for processed in 0..60 {
                    let pool = BlockPool::new(64).unwrap();
                    let mut table = GroupTable::default();
                    for i in 0..12 {
                        table.blocks.push(if live.contains(&i) {
                            pool.get_new_blocks(1).unwrap()[0]
                        } else {
                            NULL_BLOCK
                        });
                    }
                    let mut scratch = Vec::new();
                    let horizon = {
                        let at = Some(prompt);
                        m.remove_skipped_blocks(&pool, &mut table, processed, at, &mut scratch)
                            .unwrap();
                        m.removal_horizon(&table, prompt)
                    };
                    // Whether a removal at `p` frees something, on a copy each time.
                    let mut frees = |p: usize| {
                        let mut t = table.clone();
                        let free = pool.num_free_blocks();
                        m.remove_skipped_blocks(&pool, &mut t, p, Some(prompt), &mut scratch)
                            .unwrap();
                        let freed = pool.num_free_blocks() > free;
                        // Put the blocks back in use for the next probe.
                        for (&b, &now) in table.blocks.iter().zip(&t.blocks) {
                            if b != NULL_BLOCK && now == NULL_BLOCK {
                                pool.touch(&[b]).unwrap();
                            }
                        }
                        freed
                    };
                    let expected = (processed..300).find(|&p| frees(p)).unwrap_or(usize::MAX);
                    let case = format!("{spec:?}, live {live:?}, after {processed}");
                    assert!(horizon <= expected, "{case}: {horizon} passes {expected}");
                    // Slots the last walk passed are not counted: never behind.
                    assert!(horizon > processed, "{case}: {horizon} is behind");
                    if exact {
                        assert_eq!(horizon, expected, "{case}");
                    }
                }
            }
        }
    }

    /// vLLM's scan (`SlidingWindowManager.find_longest_cache_hit`): right to left, a run
    /// restarts at each miss and starts only on an aligned end.
    fn scan(cached: &[bool], need: usize, aligned: impl Fn(usize) -> bool) -> Window {
        let mut run = 0;
        for i in (0..cached.len()).rev() {
            if !cached[i] {
                run = 0;
                continue;
            }
            if run == 0 && !aligned(i + 1) {
                continue;
            }
            run += 1;
            if run >= need {
                return Window::Found(i + run);
            }
        }
        Window::FromStart(run)
    }

    #[test]
    fn the_window_search_finds_what_the_right_to_left_scan_finds() {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut found = 0;
        for case in 0..20_000 {
            let n = (next() % 90) as usize;
            let need = 1 + (next() % 12) as usize;
            // Dense, sparse, and runs of cached blocks with gaps.
            let density = [2, 10, 50, 90, 98, 100][case % 6];
            let cached: Vec<bool> = (0..n).map(|_| next() % 100 < density).collect();
            let step = [1, 1, 2, 4, 5][(next() % 5) as usize];
            let shift = (next() % 2) as usize;
            let aligned = |end: usize| (end - shift) % step == 0;
            let mut probes = vec![0; n];
            let mut probe = |i: usize| {
                probes[i] += 1;
                cached[i]
            };
            let got = rightmost_window(n, need, aligned, &mut probe, |i| assert!(i < n));
            let expected = scan(&cached, need, aligned);
            assert_eq!(
                got, expected,
                "case {case}: {cached:?}, need {need}, step {step}+{shift}"
            );
            assert!(
                probes.iter().all(|&p| p <= 1),
                "case {case}: a block probed twice"
            );
            found += matches!(got, Window::Found(_)) as usize;
        }
        assert!(
            found > 5_000 && found < 15_000,
            "{found} of 20000 found a window"
        );
    }

    #[test]
    fn a_miss_skips_the_windows_that_hold_it() {
        // One cached block in 64 (checkpoints), a window of 16: far fewer probes than blocks.
        let cached: Vec<bool> = (0..1024).map(|i| i % 64 == 63).collect();
        let mut probes = 0;
        let got = rightmost_window(
            1024,
            16,
            |_| true,
            &mut |i| {
                probes += 1;
                cached[i]
            },
            |_| {},
        );
        assert_eq!(got, Window::FromStart(0));
        assert!(probes <= 1024 / 16 * 2 + 16, "{probes} probes");
    }

    type Reach = fn(usize) -> usize;

    #[test]
    fn first_at_least_finds_the_first_reach_whatever_the_hint() {
        let functions: [(&str, Reach); 6] = [
            ("identity", |x| x),
            ("aligned", |x| x / 16 * 16),
            ("window", |x| x.saturating_sub(1023) / 16),
            ("chunk", |x| x / 8192 * 8192 / 16),
            ("prompt floor", |x| x.max(300) / 16),
            ("lagging", |x| x.saturating_sub(3)),
        ];
        for (name, f) in functions {
            for target in 0..40 {
                let expected = (0..20_000).find(|&x| f(x) >= target).unwrap();
                for hint in (0..expected + 40).chain([expected * 3, 100_000]) {
                    assert_eq!(
                        first_at_least(f, target, hint),
                        expected,
                        "{name}: target {target}, hint {hint}"
                    );
                }
            }
        }
        // Never reached: "never", from any hint.
        for hint in [0, 1, 5, usize::MAX / 8, usize::MAX / 4, usize::MAX] {
            assert_eq!(first_at_least(|_| 0, 1, hint), usize::MAX);
        }
        // Reached just below the limit: found; just above it: "never".
        assert_eq!(
            first_at_least(|x| x / 2, usize::MAX / 8, 7),
            usize::MAX / 4 - 1
        );
        assert_eq!(first_at_least(|x| x / 2, usize::MAX / 8 + 1, 7), usize::MAX);
    }
}
