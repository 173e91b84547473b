//! Per-group block tables and the rules of each attention type (vLLM's
//! `SingleTypeKVCacheManager` and subclasses): how many blocks a request holds, which ones it
//! frees as it advances, which it caches, and which prefix of a prompt counts as a cache hit
//! ([`find_longest_cache_hit`]).

use super::request::{HashView, Request};
use super::spec::{AttentionKind, GroupSpec};
use crate::error::Result;
use crate::pool::BlockPool;
use crate::types::{BlockHash, BlockId, GroupId, StoreInfo, NULL_BLOCK};

/// One request's blocks in one group.
#[derive(Clone, Debug, Default)]
pub(crate) struct GroupTable {
    /// Slot `i` covers tokens `[i * bs, (i + 1) * bs)`; the null block where none is needed.
    pub(crate) blocks: Vec<BlockId>,
    /// Blocks already entered into the prefix cache; `None` until the request's first
    /// allocation with a hit or its first cached block (vLLM's `num_cached_block`).
    pub(crate) num_cached: Option<usize>,
}

impl GroupTable {
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.num_cached = None;
    }
}

/// A group's spec plus the values derived from the manager's config.
#[derive(Clone, Debug)]
pub(crate) struct GroupManager {
    pub(crate) spec: GroupSpec,
    pub(crate) id: GroupId,
    /// Hash blocks per block of this group.
    pub(crate) hash_ratio: usize,
    pub(crate) admission_cap: Option<usize>,
    /// Only full blocks ending on a multiple of this many tokens are worth caching
    /// (`scheduler_block_size`); used by the sliding-window reachability mask.
    pub(crate) alignment: usize,
}

impl GroupManager {
    /// Blocks `allocate_new_blocks` will take for `num_tokens` slots, plus the hit blocks that
    /// touching will take out of the free order (vLLM's `get_num_blocks_to_allocate`).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        table: &GroupTable,
        num_tokens: usize,
        hits: &[BlockId],
        total_computed_tokens: usize,
        apply_admission_cap: bool,
    ) -> usize {
        let bs = self.spec.block_size;
        let mut required = num_tokens.div_ceil(bs);
        if apply_admission_cap {
            if let Some(cap) = self.admission_cap {
                required = required.min(cap);
            }
        }
        let held = table.blocks.len();
        if table.num_cached.is_some() {
            // A running request: no new hits.
            return required.saturating_sub(held);
        }
        let skipped_blocks = self.spec.skipped_tokens(total_computed_tokens) / bs;
        let new = required.saturating_sub(skipped_blocks.max(hits.len() + held));
        let skip_hits = skipped_blocks.saturating_sub(held).min(hits.len());
        let evictable = hits[skip_hits..]
            .iter()
            .filter(|&&b| b != NULL_BLOCK && pool.ref_count(b).unwrap_or(1) == 0)
            .count();
        new + evictable
    }

    /// Adopts a request's first hit: skipped positions become null, the rest are touched.
    pub(crate) fn add_local_computed_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        hits: &[BlockId],
        num_computed_tokens: usize,
        enable_caching: bool,
    ) -> Result<()> {
        let skipped = self.spec.skipped_tokens(num_computed_tokens) / self.spec.block_size;
        let kept = &hits[skipped.min(hits.len())..];
        if enable_caching {
            pool.touch(kept)?;
        }
        table.blocks.resize(skipped, NULL_BLOCK);
        table.blocks.extend_from_slice(kept);
        table.num_cached = Some(table.blocks.len());
        Ok(())
    }

    /// Appends new blocks until the table covers `num_tokens` slots; the new ids go to `out`.
    pub(crate) fn allocate_new_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        num_tokens: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let required = num_tokens.div_ceil(self.spec.block_size);
        let new = required.saturating_sub(table.blocks.len());
        if new > 0 {
            let start = table.blocks.len();
            pool.get_new_blocks_into(new, &mut table.blocks)?;
            out.extend_from_slice(&table.blocks[start..]);
        }
        Ok(())
    }

    /// Enters the request's full blocks covering the first `num_tokens` tokens into the prefix
    /// cache (dense retention: every non-null block, or the reachable ones when a hit can only
    /// end on coarser alignment boundaries).
    pub(crate) fn cache_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        request: &Request,
        num_tokens: usize,
        hash_block_size: usize,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        if !self.spec.prefix_cacheable() {
            return Ok(());
        }
        let bs = self.spec.block_size;
        let hashes = request.block_hashes();
        let num_full =
            (num_tokens.min(hashes.len() * hash_block_size) / bs).min(table.blocks.len());
        let num_cached = table.num_cached.unwrap_or(0);
        if num_cached >= num_full {
            return Ok(());
        }
        let view = HashView::new(hashes, self.hash_ratio);
        let mut blocks = &table.blocks[num_cached..num_full];
        if let Some(per) = self.reachable_period() {
            let need = self.spec.sliding_window_contiguous_blocks();
            scratch.clear();
            scratch.extend(blocks.iter().enumerate().map(|(j, &b)| {
                if (num_cached + j) % per >= per - need {
                    b
                } else {
                    NULL_BLOCK
                }
            }));
            blocks = scratch.as_slice();
        }
        let mut hash_buf;
        let block_hashes = if self.hash_ratio == 1 {
            &hashes[num_cached..num_full]
        } else {
            hash_buf = Vec::with_capacity(num_full - num_cached);
            hash_buf.extend((num_cached..num_full).map(|i| view.get(i)));
            hash_buf.as_slice()
        };
        let info = StoreInfo {
            parent_block_hash: (num_cached > 0).then(|| view.get(num_cached - 1)),
            token_ids: request.token_range(num_cached * bs, num_full * bs),
            block_size: bs as u32,
        };
        pool.cache_full_blocks(blocks, block_hashes, self.id, info)?;
        table.num_cached = Some(num_full);
        Ok(())
    }

    /// Sliding-window groups whose hits must end on `alignment` boundaries spanning several of
    /// their blocks only keep the `need` blocks before each boundary reachable; `None` when
    /// every block is.
    fn reachable_period(&self) -> Option<usize> {
        match self.spec.kind {
            AttentionKind::SlidingWindow { .. } => {
                let per = self.alignment / self.spec.block_size;
                let need = self.spec.sliding_window_contiguous_blocks();
                (need < per).then_some(per)
            }
            _ => None,
        }
    }

    /// Replaces blocks no longer needed after `num_computed_tokens` with the null block and
    /// frees them, last first, stopping at the first slot already null.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        num_computed_tokens: usize,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        let skipped = self.spec.skipped_tokens(num_computed_tokens);
        if skipped == 0 {
            return Ok(());
        }
        let last = (skipped / self.spec.block_size).min(table.blocks.len());
        scratch.clear();
        for i in (0..last).rev() {
            let b = table.blocks[i];
            if b == NULL_BLOCK {
                break;
            }
            scratch.push(b);
        }
        if scratch.is_empty() {
            return Ok(());
        }
        pool.free_blocks(scratch)?;
        let first = last - scratch.len();
        table.blocks[first..last].fill(NULL_BLOCK);
        Ok(())
    }

    /// Frees a request's blocks tail first (leading nulls dropped) and forgets them.
    pub(crate) fn free(
        &self,
        pool: &BlockPool,
        table: &mut GroupTable,
        scratch: &mut Vec<BlockId>,
    ) -> Result<()> {
        let lead = table
            .blocks
            .iter()
            .position(|&b| b != NULL_BLOCK)
            .unwrap_or(table.blocks.len());
        scratch.clear();
        scratch.extend(table.blocks[lead..].iter().rev());
        pool.free_blocks(scratch)?;
        table.clear();
        Ok(())
    }
}

/// The longest cached prefix of `hashes` (at `hash_block_size`) of at most `max_len` tokens under
/// the rule of `spec`'s attention type, for the groups `gids` (all with that spec: a hit needs
/// every one of them cached). Fills `out[g]` for each of them (null blocks where a slot needs
/// none) and returns the hit length in tokens, a multiple of `alignment` (vLLM's
/// `find_longest_cache_hit` of each single-type manager).
#[allow(clippy::too_many_arguments)]
pub(crate) fn find_longest_cache_hit(
    spec: &GroupSpec,
    pool: &BlockPool,
    hashes: &[BlockHash],
    hash_block_size: usize,
    max_len: usize,
    gids: &[usize],
    alignment: usize,
    out: &mut [Vec<BlockId>],
    scratch: &mut Vec<BlockId>,
) -> usize {
    let bs = spec.block_size;
    let view = HashView::new(hashes, bs / hash_block_size);
    for &g in gids {
        out[g].clear();
    }
    match spec.kind {
        AttentionKind::Full => {
            // Left to right, stopping at the first miss.
            let max_blocks = (max_len / bs).min(view.len());
            for i in 0..max_blocks {
                if !lookup_all(pool, view.get(i), gids, scratch) {
                    break;
                }
                for (&g, &b) in gids.iter().zip(scratch.iter()) {
                    out[g].push(b);
                }
            }
            pop_to_alignment(bs, alignment, gids, out);
            out[gids[0]].len() * bs
        }
        AttentionKind::SlidingWindow { .. } => {
            // Right to left: the first run of enough contiguous cached blocks wins.
            let need = spec.sliding_window_contiguous_blocks();
            let max_blocks = (max_len / bs).min(view.len());
            for &g in gids {
                out[g].resize(max_blocks, NULL_BLOCK);
            }
            let mut run = 0;
            let mut found = false;
            for i in (0..max_blocks).rev() {
                if lookup_all(pool, view.get(i), gids, scratch) {
                    // A run must end on an alignment boundary.
                    if run == 0 && bs != alignment && ((i + 1) * bs) % alignment != 0 {
                        continue;
                    }
                    for (&g, &b) in gids.iter().zip(scratch.iter()) {
                        out[g][i] = b;
                    }
                    run += 1;
                    if run >= need {
                        for &g in gids {
                            out[g].truncate(i + run);
                        }
                        found = true;
                        break;
                    }
                } else {
                    run = 0;
                }
            }
            if !found {
                // A run reaching block 0 is a hit even if shorter than the window.
                for &g in gids {
                    out[g].truncate(run);
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
        AttentionKind::Mamba => 0,
    }
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
