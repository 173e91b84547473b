//! Fine-grained partial hash hits (vLLM 0.33's `enable_partial_hash_hits`): a hybrid layout with
//! an align-mode Mamba group of blocks larger than the hash block. Written from vLLM's rules
//! (`partial_hash_hits_enabled`, `FullAttentionManager` / `MambaManager.find_longest_cache_hit`,
//! `_has_partial_local_hit`, `_apply_cow`, `_cache_partial_tail_block`,
//! `take_kv_cache_block_copies`).

use super::*;
use crate::types::{BlockHash, CacheKey, GroupId, StoreInfo};

/// Full attention and Mamba, blocks of 16, requests hashed every 8 tokens.
fn jamba() -> Vec<GroupSpec> {
    vec![GroupSpec::full(16), GroupSpec::mamba(16)]
}

fn config(groups: Vec<GroupSpec>, hash_block_size: usize) -> ManagerConfig {
    let mut config = ManagerConfig::new(groups, 64, 4096).dense();
    config.hash_block_size = Some(hash_block_size);
    config
}

fn manager(config: &ManagerConfig) -> KVCacheManager {
    KVCacheManager::new(config).unwrap()
}

fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// A coordinator for `groups` hashing every `hash_block_size` tokens, with `use_eagle`.
fn finder(groups: &[GroupSpec], hash_block_size: usize, use_eagle: bool) -> Coordinator {
    let mut config = config(groups.to_vec(), hash_block_size);
    config.use_eagle = use_eagle;
    let (scheduler, hash) = config.resolve_block_sizes().unwrap();
    Coordinator::new(&config, scheduler, hash).unwrap()
}

/// The request hash at index `i` of `chain`: `i + 1`.
fn chain(n: usize) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(i as u128 + 1)).collect()
}

/// A pool with one free cached block per `(hash index, group)`, keyed at `chain`'s hash; the
/// blocks in the order given.
fn pool_with_keys(keys: &[(usize, GroupId)]) -> (BlockPool, Vec<BlockId>) {
    let pool = BlockPool::new(64).unwrap();
    let blocks = pool.get_new_blocks(keys.len()).unwrap();
    for (&block, &(i, group)) in blocks.iter().zip(keys) {
        let hash = BlockHash(i as u128 + 1);
        pool.cache_full_blocks(&[block], &[hash], group, StoreInfo::default())
            .unwrap();
    }
    pool.free_blocks(&blocks).unwrap();
    (pool, blocks)
}

fn admit_chunk(m: &mut KVCacheManager, id: &str, max_new: usize) -> (usize, Vec<Vec<BlockId>>) {
    let hit = m.get_computed_blocks(id).unwrap();
    let n = (m.request(id).unwrap().num_tokens() - hit.num_computed_tokens).min(max_new);
    let args = AllocateArgs {
        num_new_tokens: n,
        num_new_computed_tokens: hit.num_computed_tokens,
        new_computed_blocks: Some(&hit),
        ..Default::default()
    };
    let blocks = m.allocate_slots(id, &args).unwrap().expect("room");
    (hit.num_computed_tokens, blocks)
}

fn key(hash_index: usize, group: GroupId, m: &KVCacheManager, id: &str) -> CacheKey {
    CacheKey {
        hash: m.request(id).unwrap().block_hashes()[hash_index],
        group,
    }
}

// ----- when vLLM turns them on ----------------------------------------------------------------

#[test]
fn partial_hash_hits_need_a_mamba_align_block_above_the_hash_block() {
    let on = |groups: Vec<GroupSpec>, hash: usize| {
        let m = manager(&config(groups, hash));
        (m.partial_hash_hits(), m.coordinator.alignment())
    };
    // Mamba blocks of 16, hashes every 8: hits at hash boundaries.
    assert_eq!(on(jamba(), 8), (true, 8));
    // Hashes at the Mamba block size: block-aligned hits.
    assert_eq!(on(jamba(), 16), (false, 16));
    // A sliding window at the hash block size looks up at hash granularity anyway.
    let swa_at_hash = vec![GroupSpec::sliding_window(8, 64), GroupSpec::mamba(16)];
    assert_eq!(on(swa_at_hash, 8), (true, 8));
    // A sliding window of larger blocks cannot: hits stay at the scheduler block size (the
    // layout is still served).
    let swa_above = vec![
        GroupSpec::full(8),
        GroupSpec::sliding_window(16, 64),
        GroupSpec::mamba(16),
    ];
    assert_eq!(on(swa_above, 8), (false, 16));
    // Mamba without prefix caching, or a single group: never.
    let mut off = config(jamba(), 8);
    off.enable_caching = false;
    assert!(!manager(&off).partial_hash_hits());
    let single = ManagerConfig::new(vec![GroupSpec::mamba(16)], 64, 4096);
    assert!(!manager(&single).partial_hash_hits());
}

#[test]
fn shared_prefix_checkpoints_need_eagle_partial_hits_and_no_re_prefill() {
    let with = |f: &dyn Fn(&mut ManagerConfig)| {
        let mut c = config(jamba(), 8);
        c.enable_mamba_shared_prefix_checkpoint = true;
        c.use_eagle = true;
        f(&mut c);
        manager(&c).mamba_shared_prefix_checkpoint()
    };
    assert!(with(&|_| {}));
    assert!(!with(&|c| c.enable_mamba_shared_prefix_checkpoint = false));
    assert!(!with(&|c| c.use_eagle = false));
    // Groups flagged as holding draft layers count as EAGLE groups even without the drop.
    assert!(with(&|c| {
        c.use_eagle = false;
        c.eagle_groups = Some(vec![0]);
    }));
    assert!(!with(&|c| c.hash_block_size = Some(16)));
    assert!(!with(&|c| c.num_prefill_lookahead = 2));
}

// ----- lookups ------------------------------------------------------------------------------------

#[test]
fn full_attention_extends_its_hit_into_a_block_keyed_inside_it() {
    // Full block 0 cached whole (hash 1), block 1 keyed at the prompt tail 24 (hash 2); the
    // Mamba state cached at 24 too.
    let (pool, b) = pool_with_keys(&[(1, 0), (2, 0), (2, 1)]);
    let coordinator = finder(&jamba(), 8, false);
    let mut out = Vec::new();
    let hit = coordinator.find(&pool, &chain(6), 47, &mut out);
    assert_eq!(hit.tokens, 24);
    assert_eq!(out[0], vec![b[0], b[1]]);
    assert_eq!(out[1], vec![NULL_BLOCK, b[2]]);
    // Block-aligned lookups (hashes at 16) never read the key inside the block.
    let (pool, _) = pool_with_keys(&[(0, 0), (1, 0), (0, 1)]);
    let coordinator = finder(&jamba(), 16, false);
    let hit = coordinator.find(&pool, &chain(3), 47, &mut out);
    assert_eq!(hit.tokens, 16);
}

#[test]
fn mamba_hits_the_latest_state_at_any_hash_boundary() {
    // Full blocks 0-2 cached whole; Mamba states at 8 and at 40 tokens (hash indices 0, 4).
    let (pool, b) = pool_with_keys(&[(1, 0), (3, 0), (5, 0), (0, 1), (4, 1)]);
    let coordinator = finder(&jamba(), 8, false);
    let mut out = Vec::new();
    let hit = coordinator.find(&pool, &chain(7), 55, &mut out);
    assert_eq!(hit.tokens, 40);
    // The Mamba state sits in the block of its boundary; full attention keeps the blocks
    // covering the hit.
    assert_eq!(out[1], vec![NULL_BLOCK, NULL_BLOCK, b[4]]);
    assert_eq!(out[0], vec![b[0], b[1], b[2]]);
    // Capped below 40: the state at 8.
    let hit = coordinator.find(&pool, &chain(7), 39, &mut out);
    assert_eq!(hit.tokens, 8);
    assert_eq!(out[1], vec![b[3]]);
    assert_eq!(out[0], vec![b[0]]);
}

#[test]
fn eagle_drops_one_hash_block_and_looks_one_hash_block_further() {
    // Full blocks 0-1 whole, block 2 keyed at 40 (hash 4); Mamba states at 32 and 40.
    let keys = [(1, 0), (3, 0), (4, 0), (3, 1), (4, 1)];
    let (pool, _) = pool_with_keys(&keys);
    let mut out = Vec::new();
    let plain = finder(&jamba(), 8, false);
    assert_eq!(plain.find(&pool, &chain(6), 40, &mut out).tokens, 40);
    // EAGLE: full attention matches up to one hash block past the candidate (40 + 8) and
    // drops one hash block (not a whole block): 32; Mamba does not drop.
    let eagle = finder(&jamba(), 8, true);
    let hit = eagle.find(&pool, &chain(6), 40, &mut out);
    assert_eq!(hit.tokens, 32);
    assert_eq!(out[0].len(), 2);
    assert_eq!(out[1].len(), 2);
    // Without the margin the drop from 40 would land on 32 anyway; from a candidate of 32 it
    // is the margin that lets the hit stay at 32 rather than 24.
    let hit = eagle.find(&pool, &chain(6), 32, &mut out);
    assert_eq!(hit.tokens, 32);
}

// ----- caching --------------------------------------------------------------------------------

#[test]
fn cacheable_tokens_are_not_rounded_to_the_scheduler_block() {
    // Full blocks of 16, Mamba blocks of 32 (scheduler block 32), hashes every 8 or 16: after
    // a 16-token chunk the full block is cached at once. With a window group of 32-token
    // blocks partial hits are off and caching waits for the scheduler block (32 tokens).
    let partial = vec![GroupSpec::full(16), GroupSpec::mamba(32)];
    let aligned = vec![
        GroupSpec::full(16),
        GroupSpec::sliding_window(32, 64),
        GroupSpec::mamba(32),
    ];
    for (groups, hash, cached) in [
        (&partial, 8, true),
        (&partial, 16, true),
        (&aligned, 16, false),
    ] {
        let mut m = manager(&config(groups.clone(), hash));
        assert_eq!(m.partial_hash_hits(), cached);
        m.add_request("a", &tokens(0, 41), ExtraKeys::default())
            .unwrap();
        admit_chunk(&mut m, "a", 16);
        let block = m.block_ids("a", 0).unwrap()[0];
        assert_eq!(
            m.pool().block_key(block).unwrap().is_some(),
            cached,
            "hash {hash}"
        );
    }
}

#[test]
fn a_chunk_ending_on_the_prompts_hash_boundary_keys_both_groups_inside_their_blocks() {
    let mut m = manager(&config(jamba(), 8));
    m.add_request("a", &tokens(0, 29), ExtraKeys::default())
        .unwrap();
    // The prompt's last boundary a resend can reach: (29 - 1) / 8 * 8 = 24.
    admit_chunk(&mut m, "a", 24);
    let full = m.block_ids("a", 0).unwrap().to_vec();
    let mamba = m.block_ids("a", 1).unwrap().to_vec();
    assert_eq!(mamba[0], NULL_BLOCK);
    let pool = m.pool();
    assert_eq!(pool.block_key(full[0]).unwrap(), Some(key(1, 0, &m, "a")));
    assert_eq!(pool.block_key(full[1]).unwrap(), Some(key(2, 0, &m, "a")));
    assert_eq!(pool.block_key(mamba[1]).unwrap(), Some(key(2, 1, &m, "a")));
    // Cached tokens are read off the keys (vLLM's `block_hash_num_tokens`), not the slots.
    assert_eq!(m.estimate_cached_tokens("a").unwrap(), 24);
    // The request finishing right there hands its state to connectors (once).
    assert_eq!(
        m.finalize_partial_tail_offloads("a", 24, 0).unwrap(),
        vec![(1, mamba[1], 24)]
    );
    assert!(m
        .finalize_partial_tail_offloads("a", 24, 0)
        .unwrap()
        .is_empty());
}

#[test]
fn a_running_request_moves_its_state_key_to_a_copy_before_writing_on() {
    let mut m = manager(&config(jamba(), 8));
    m.add_request("a", &tokens(0, 29), ExtraKeys::default())
        .unwrap();
    admit_chunk(&mut m, "a", 24);
    m.take_boundary_state_offloads();
    let source = m.block_ids("a", 1).unwrap()[1];
    let state_key = key(2, 1, &m, "a");
    m.new_step_starts();
    // The next chunk: one block, the copy (the running state stays in `source`).
    let args = AllocateArgs {
        num_new_tokens: 5,
        num_computed_tokens: 24,
        ..Default::default()
    };
    let new = m.allocate_slots("a", &args).unwrap().unwrap();
    assert!(new[1].is_empty(), "the copy is not in the request's table");
    assert_eq!(m.block_ids("a", 1).unwrap(), &[NULL_BLOCK, source]);
    let (copies, retained) = m.take_kv_cache_block_copies();
    assert_eq!(copies.len(), 1);
    let (src, copy) = copies[0];
    assert_eq!(src, source);
    assert_eq!(retained, vec![source, copy]);
    // The cache entry now names the copy; the source is the request's alone.
    let pool = Arc::clone(m.pool());
    assert_eq!(pool.block_key(copy).unwrap(), Some(state_key));
    assert_eq!(pool.block_key(source).unwrap(), None);
    assert_eq!(pool.lookup(state_key.hash, 1), Some(copy));
    assert_eq!(pool.ref_count(source).unwrap(), 2);
    assert_eq!(pool.ref_count(copy).unwrap(), 1);
    // The copy is offered to connectors as the producer's partial tail.
    assert_eq!(
        m.take_boundary_state_offloads(),
        vec![("a".into(), 1, copy, 24)]
    );
    // Released after the copy ran: the copy becomes a free cached block, found by the next
    // lookup only in a later step.
    let free = pool.num_free_blocks();
    m.free_retained_blocks(&retained).unwrap();
    assert_eq!(pool.num_free_blocks(), free + 1);
    assert_eq!(pool.ref_count(source).unwrap(), 1);
    assert_eq!(pool.ref_count(copy).unwrap(), 0);
    assert_eq!(pool.free_order().last(), Some(&copy));
}

#[test]
fn a_hit_ending_inside_a_block_copies_the_shared_block_and_retains_both_ends() {
    let mut m = manager(&config(jamba(), 8));
    m.add_request("a", &tokens(0, 29), ExtraKeys::default())
        .unwrap();
    admit_chunk(&mut m, "a", 24);
    let a_full = m.block_ids("a", 0).unwrap().to_vec();
    let a_state = m.block_ids("a", 1).unwrap()[1];
    m.take_kv_cache_block_copies();
    // A state cached in this step is written by this step's forward: the sibling waits.
    let mut prompt = tokens(0, 24);
    prompt.extend(tokens(1000, 10));
    m.add_request("b", &prompt, ExtraKeys::default()).unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 24);
    let args = AllocateArgs {
        num_new_tokens: 10,
        num_new_computed_tokens: 24,
        new_computed_blocks: Some(&hit),
        ..Default::default()
    };
    assert!(m.allocate_slots("b", &args).unwrap().is_none());
    m.new_step_starts();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.blocks, vec![a_full.clone(), vec![NULL_BLOCK, a_state]]);
    // Each group takes one block more than a block-aligned hit: the copy of its tail block.
    let free = m.pool().num_free_blocks();
    let args = AllocateArgs {
        num_new_tokens: 10,
        num_new_computed_tokens: 24,
        new_computed_blocks: Some(&hit),
        ..Default::default()
    };
    let new = m.allocate_slots("b", &args).unwrap().unwrap();
    // Full: the copy of block 1, then block 2; Mamba: the copy of the hit state, then the new
    // state block.
    assert_eq!(new[0].len(), 2);
    assert_eq!(new[1].len(), 2);
    assert_eq!(free - m.pool().num_free_blocks(), 4);
    let (full_copy, state_copy) = (new[0][0], new[1][0]);
    assert_eq!(
        m.block_ids("b", 0).unwrap(),
        &[a_full[0], full_copy, new[0][1]]
    );
    assert_eq!(m.block_ids("b", 1).unwrap()[1], state_copy);
    // Copies group by group; the retained ends, in order, hold one reference each.
    let (copies, retained) = m.take_kv_cache_block_copies();
    assert_eq!(copies, vec![(a_full[1], full_copy), (a_state, state_copy)]);
    assert_eq!(retained, vec![a_full[1], full_copy, a_state, state_copy]);
    let pool = Arc::clone(m.pool());
    assert_eq!(pool.ref_count(a_full[1]).unwrap(), 2);
    assert_eq!(pool.ref_count(full_copy).unwrap(), 2);
    // The full-attention copy is zeroed like any new attention block (vLLM records it).
    assert!(m.take_new_block_ids().contains(&full_copy));
    assert_eq!(m.num_retained_blocks(), 4);
    m.free_retained_blocks(&retained).unwrap();
    assert_eq!(m.num_retained_blocks(), 0);
    assert_eq!(pool.ref_count(a_full[1]).unwrap(), 1);
    assert_eq!(pool.ref_count(full_copy).unwrap(), 1);
    // Only retained blocks, once each.
    assert!(m.free_retained_blocks(&[full_copy]).is_err());
    assert_eq!(pool.ref_count(full_copy).unwrap(), 1);
}

#[test]
fn the_copy_of_a_partial_block_is_cached_once_full() {
    let mut m = manager(&config(jamba(), 8));
    m.add_request("a", &tokens(0, 29), ExtraKeys::default())
        .unwrap();
    admit_chunk(&mut m, "a", 24);
    m.new_step_starts();
    let prompt = tokens(0, 40);
    m.add_request("b", &prompt, ExtraKeys::default()).unwrap();
    let (hit, new) = admit_chunk(&mut m, "b", 16);
    assert_eq!(hit, 24);
    let copy = new[0][0];
    // 24 + 16 = 40 tokens computed: the copied block 1 (tokens 16-32) is full and cached
    // under b's hash of 32 tokens.
    assert_eq!(m.pool().block_key(copy).unwrap(), Some(key(3, 0, &m, "b")));
}

#[test]
fn a_shared_prefix_junction_inside_a_block_keys_the_mamba_state_there() {
    for enabled in [true, false] {
        let mut c = config(jamba(), 8);
        c.use_eagle = true;
        c.enable_mamba_shared_prefix_checkpoint = enabled;
        let mut m = manager(&c);
        let mut a = tokens(0, 24);
        a.extend(tokens(500, 16));
        m.add_request("a", &a, ExtraKeys::default()).unwrap();
        admit_chunk(&mut m, "a", 40);
        m.new_step_starts();
        // B shares 24 tokens with A: full attention alone matches 16 and drops one hash block
        // (EAGLE), Mamba matches nothing: no hit, a junction at 8 tokens.
        let mut b = tokens(0, 24);
        b.extend(tokens(900, 16));
        m.add_request("b", &b, ExtraKeys::default()).unwrap();
        let hit = m.get_computed_blocks("b").unwrap();
        assert_eq!(hit.num_computed_tokens, 0);
        assert_eq!(m.shared_prefix_boundary("b").unwrap(), 8);
        // The scheduler ends B's first chunk at the junction.
        let args = AllocateArgs {
            num_new_tokens: 8,
            ..Default::default()
        };
        m.allocate_slots("b", &args).unwrap().unwrap();
        let state = m.block_ids("b", 1).unwrap()[0];
        let keyed = m.pool().block_key(state).unwrap();
        if enabled {
            assert_eq!(keyed, Some(key(0, 1, &m, "b")));
            // Keyed inside the block B writes on into: its next chunk copies it.
            let args = AllocateArgs {
                num_new_tokens: 8,
                num_computed_tokens: 8,
                ..Default::default()
            };
            m.new_step_starts();
            m.allocate_slots("b", &args).unwrap().unwrap();
            let (copies, retained) = m.take_kv_cache_block_copies();
            assert_eq!(copies.len(), 1);
            assert_eq!(copies[0].0, state);
            m.free_retained_blocks(&retained).unwrap();
        } else {
            assert_eq!(keyed, None);
        }
    }
}

#[test]
fn a_block_rekeyed_at_its_checkpoint_counts_as_cached_this_step_under_that_key_only() {
    // Full attention and a Mamba group exporting prefill checkpoints, blocks of 16, hashes
    // every 8. vLLM's `MambaManager.cache_blocks` records the newly cached blocks' hashes
    // after `_cache_partial_tail_block` re-keyed the checkpoint block: a hit on another block
    // keyed at the checkpoint block's former (full-prefix) hash does not wait a step.
    let groups = vec![
        GroupSpec::full(16),
        GroupSpec::mamba_with_checkpoints(16, 8),
    ];
    let mut m = manager(&config(groups, 8));
    let shared = tokens(0, 32);
    let with_tail = |start: u32, n: usize| {
        let mut prompt = shared.clone();
        prompt.extend(tokens(start, n));
        prompt
    };
    // A: 41 tokens, a first chunk of 16 (its state at 16 cached).
    m.add_request("a", &with_tail(1000, 9), ExtraKeys::default())
        .unwrap();
    admit_chunk(&mut m, "a", 16);
    m.new_step_starts();
    // X: 40 tokens sharing A's first 32, hits A's state at 16 and computes the rest; its
    // checkpoint (39 // 8 * 8 = 32) is exported into slot 1, keyed at its full prefix.
    m.add_request("x", &with_tail(2000, 8), ExtraKeys::default())
        .unwrap();
    let (hit, _) = admit_chunk(&mut m, "x", 64);
    assert_eq!(hit, 16);
    let x_state = m.block_ids("x", 1).unwrap()[1];
    assert_eq!(
        m.pool().block_key(x_state).unwrap(),
        Some(key(3, 1, &m, "x"))
    );
    m.new_step_starts();
    m.take_boundary_state_offloads();
    // A's last chunk [16, 41): slot 1 is cached at its full prefix (32, the hash X's state
    // holds), then re-keyed at the exported checkpoint 40.
    let args = AllocateArgs {
        num_new_tokens: 25,
        num_computed_tokens: 16,
        ..Default::default()
    };
    m.allocate_slots("a", &args).unwrap().unwrap();
    let a_state = m.block_ids("a", 1).unwrap()[1];
    assert_eq!(
        m.pool().block_key(a_state).unwrap(),
        Some(key(4, 1, &m, "a"))
    );
    // Offered to connectors at the prefix its key covers.
    assert_eq!(
        m.take_boundary_state_offloads(),
        vec![("a".into(), 1, a_state, 40)]
    );
    // C shares the 32 tokens: its hit ends on X's state, cached in an earlier step.
    m.add_request("c", &with_tail(3000, 9), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("c").unwrap();
    assert_eq!(hit.num_computed_tokens, 32);
    assert_eq!(hit.blocks[1].last(), Some(&x_state));
    let args = AllocateArgs {
        num_new_tokens: 9,
        num_new_computed_tokens: 32,
        new_computed_blocks: Some(&hit),
        ..Default::default()
    };
    assert!(m.allocate_slots("c", &args).unwrap().is_some());
}
