//! Prefix-cache hit search across KV cache groups (vLLM's coordinators' `find_longest_cache_hit`
//! and the per-attention-type finders). Immutable and only reads the pool's hash map, so the
//! same [`HitFinder`] serves the scheduler and concurrent probes.

use super::request::HashView;
use super::spec::{AttentionKind, GroupSpec};
use crate::pool::BlockPool;
use crate::types::{BlockHash, BlockId, GroupId, NULL_BLOCK};

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
pub struct HitFinder {
    kind: CoordinatorKind,
    groups: Vec<GroupSpec>,
    spec_groups: Vec<SpecGroup>,
    hash_block_size: usize,
    alignment: usize,
    simple_hybrid: bool,
}

impl HitFinder {
    pub(crate) fn new(
        groups: &[GroupSpec],
        enable_caching: bool,
        scheduler_block_size: usize,
        hash_block_size: usize,
    ) -> Self {
        let kind = if !enable_caching {
            CoordinatorKind::NoPrefixCache
        } else if groups.len() == 1 {
            CoordinatorKind::Unitary
        } else {
            CoordinatorKind::Hybrid
        };
        let mut spec_groups: Vec<SpecGroup> = Vec::new();
        for (i, g) in groups.iter().enumerate() {
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
            CoordinatorKind::Unitary => groups[0].block_size,
            _ => scheduler_block_size,
        };
        HitFinder {
            kind,
            groups: groups.to_vec(),
            spec_groups,
            hash_block_size,
            alignment,
            simple_hybrid,
        }
    }

    pub fn kind(&self) -> CoordinatorKind {
        self.kind
    }

    /// Tokens a hit length must be a multiple of.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// A layout with a non-cacheable group (Mamba) never hits: its state cannot be rebuilt from
    /// cached attention blocks.
    fn has_uncacheable_group(&self) -> bool {
        self.groups.iter().any(|g| !g.prefix_cacheable())
    }

    /// Finds the longest cached prefix of `hashes` (at hash block size) of at most `max_len`
    /// tokens; fills `out[g]` with group `g`'s hit blocks (null blocks where a slot needs none).
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
            || self.has_uncacheable_group()
            || self.spec_groups.is_empty()
        {
            return Hit::default();
        }
        let mut scratch = Vec::new();
        if self.kind == CoordinatorKind::Unitary {
            let sg = &self.spec_groups[0];
            let tokens = self.find_for(sg, pool, hashes, max_len, out, &mut scratch);
            return Hit {
                tokens,
                uncached_common: 0,
            };
        }

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
        let bs = sg.spec.block_size;
        let view = HashView::new(hashes, bs / self.hash_block_size);
        let gids = &sg.group_ids;
        for &g in gids {
            out[g].clear();
        }
        match sg.spec.kind {
            AttentionKind::Full => {
                let max_blocks = (max_len / bs).min(view.len());
                for i in 0..max_blocks {
                    if !lookup_all(pool, view.get(i), gids, scratch) {
                        break;
                    }
                    for (&g, &b) in gids.iter().zip(scratch.iter()) {
                        out[g].push(b);
                    }
                }
                self.pop_to_alignment(bs, gids, out);
                out[gids[0]].len() * bs
            }
            AttentionKind::SlidingWindow { .. } => {
                let need = sg.spec.sliding_window_contiguous_blocks();
                let max_blocks = (max_len / bs).min(view.len());
                for &g in gids {
                    out[g].resize(max_blocks, NULL_BLOCK);
                }
                let mut run = 0;
                let mut found = false;
                for i in (0..max_blocks).rev() {
                    if lookup_all(pool, view.get(i), gids, scratch) {
                        // A run must end on an alignment boundary.
                        if run == 0 && bs != self.alignment && ((i + 1) * bs) % self.alignment != 0
                        {
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
                    self.pop_to_alignment(bs, gids, out);
                }
                out[gids[0]].len() * bs
            }
            AttentionKind::ChunkedLocal { chunk } => {
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

    fn pop_to_alignment(&self, bs: usize, gids: &[usize], out: &mut [Vec<BlockId>]) {
        if bs == self.alignment {
            return;
        }
        let len = out[gids[0]].len();
        let keep = len * bs / self.alignment * self.alignment / bs;
        for &g in gids {
            out[g].truncate(keep);
        }
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
