//! vLLM 0.33's default configuration, feature by feature: sparse retention, Mamba align prefix
//! caching, EAGLE, lookahead hashing, long-context admission, connector calls and the spec
//! kinds. Expected values are worked out from vLLM's rules (shared/reference), not from traces.

use super::*;
use crate::types::{BlockHash, CacheKey};

fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

fn config(groups: Vec<GroupSpec>, num_blocks: usize, retention: Option<usize>) -> ManagerConfig {
    let mut c = ManagerConfig::new(groups, num_blocks, 1024);
    c.retention_interval = retention;
    c
}

fn manager(groups: Vec<GroupSpec>, num_blocks: usize, retention: Option<usize>) -> KVCacheManager {
    KVCacheManager::new(&config(groups, num_blocks, retention)).unwrap()
}

fn chunk(n: usize, computed: usize) -> AllocateArgs<'static> {
    AllocateArgs {
        num_new_tokens: n,
        num_computed_tokens: computed,
        ..Default::default()
    }
}

/// Looks the request up and allocates `n` tokens after its hit; returns the hit and the new
/// blocks (None: out of blocks).
fn admit_n(
    m: &mut KVCacheManager,
    id: &str,
    n: usize,
) -> (ComputedBlocks, Option<Vec<Vec<BlockId>>>) {
    let hit = m.get_computed_blocks(id).unwrap();
    let args = AllocateArgs {
        num_new_tokens: n,
        num_new_computed_tokens: hit.num_computed_tokens,
        new_computed_blocks: Some(&hit),
        full_sequence_must_fit: true,
        ..Default::default()
    };
    let new = m.allocate_slots(id, &args).unwrap();
    (hit, new)
}

fn non_null(ids: &[BlockId]) -> Vec<BlockId> {
    ids.iter().copied().filter(|&b| b != NULL_BLOCK).collect()
}

fn key_of(m: &KVCacheManager, block: BlockId) -> Option<CacheKey> {
    m.pool().block_key(block).unwrap()
}

// ----- sparse retention -----------------------------------------------------------------------

#[test]
fn default_retention_keeps_only_the_window_before_the_replay_boundary() {
    // One sliding-window group, block 4, window 8 (a hit needs 2 blocks), 26-token prompt: 6
    // full blocks. The replay boundary P - 1 = 25 rounds down to 24, so retention 0 keeps the
    // 2 blocks before it (4, 5); dense retention keeps all 6.
    for (retention, kept) in [(Some(0), 2), (None, 6)] {
        let mut m = manager(vec![GroupSpec::sliding_window(4, 8)], 32, retention);
        m.add_request("a", &tokens(0, 26), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &chunk(26, 0)).unwrap().unwrap();
        assert_eq!(m.num_cached_keys(), kept, "{retention:?}");
        let table = m.block_ids("a", 0).unwrap().to_vec();
        let cached: Vec<usize> = (0..6).filter(|&i| key_of(&m, table[i]).is_some()).collect();
        let expected: Vec<usize> = if kept == 2 {
            vec![4, 5]
        } else {
            (0..6).collect()
        };
        assert_eq!(cached, expected);
        // The same prompt again hits at 24 either way ...
        m.add_request("b", &tokens(0, 26), ExtraKeys::default())
            .unwrap();
        assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 24);
        // ... a prompt sharing only the first 16 tokens hits only where they were kept.
        let mut other = tokens(0, 16);
        other.extend(tokens(500, 10));
        m.add_request("c", &other, ExtraKeys::default()).unwrap();
        let hit = m.get_computed_blocks("c").unwrap().num_computed_tokens;
        assert_eq!(hit, if kept == 2 { 0 } else { 16 });
    }
}

#[test]
fn a_retention_interval_also_keeps_one_window_per_segment() {
    // Window 5 needs 1 block of 4; interval 8 = 2 blocks: the last block of every segment
    // (1, 3, 5) plus the replay boundary's (block 5).
    let mut m = manager(vec![GroupSpec::sliding_window(4, 5)], 32, Some(8));
    m.add_request("a", &tokens(0, 26), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(26, 0)).unwrap().unwrap();
    let table = m.block_ids("a", 0).unwrap().to_vec();
    let cached: Vec<usize> = (0..6).filter(|&i| key_of(&m, table[i]).is_some()).collect();
    assert_eq!(cached, vec![1, 3, 5]);
}

#[test]
fn retention_is_validated_as_vllm_does() {
    let bad = |groups: Vec<GroupSpec>, r| KVCacheManager::new(&config(groups, 16, Some(r)));
    // Not a multiple of the scheduler block size.
    assert!(matches!(
        bad(vec![GroupSpec::sliding_window(4, 8)], 6),
        Err(CoreError::InvalidConfig(_))
    ));
    // An interval on a layout without sliding-window or Mamba groups has no effect.
    assert!(matches!(
        bad(vec![GroupSpec::full(4)], 8),
        Err(CoreError::InvalidConfig(_))
    ));
    assert!(bad(vec![GroupSpec::full(4)], 0).is_ok());
}

#[test]
fn retention_on_chunked_local_and_full_groups_is_refused_saying_why() {
    // vLLM's coordinator refuses a non-zero interval without a sliding-window or Mamba group:
    // chunked local attention is not a sliding window for retention, it caches densely.
    let groups = || vec![GroupSpec::chunked_local(4, 8), GroupSpec::full(4)];
    let Err(CoreError::InvalidConfig(msg)) = KVCacheManager::new(&config(groups(), 16, Some(8)))
    else {
        panic!("retention 8 on chunked local + full attention must be refused");
    };
    assert!(msg.contains("only thins the cached checkpoints of sliding-window and Mamba"));
    assert!(msg.contains("(chunked_local_attention, full_attention) are neither"));
    assert!(msg.contains("use 0 or None"));
    assert!(KVCacheManager::new(&config(groups(), 16, Some(0))).is_ok());
    assert!(KVCacheManager::new(&config(groups(), 16, None)).is_ok());
}

#[test]
fn a_shared_prefix_junction_is_pinned_for_the_next_request() {
    // Full + sliding window (block 4, window 8), retention 0. A caches the window before its
    // replay boundary only (blocks 7, 8). B shares A's first 24 tokens: full attention hits 24,
    // the window misses, so B's hit is 0 with a shared-prefix boundary of 24, and B keeps the
    // window before 24 (blocks 4, 5) when it caches. C, sharing the same 24 tokens, now hits.
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
    let mut m = manager(groups, 64, Some(0));
    m.add_request("a", &tokens(0, 40), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(40, 0)).unwrap().unwrap();
    let sw_a = m.block_ids("a", 1).unwrap().to_vec();
    let cached_a: Vec<usize> = (0..10).filter(|&i| key_of(&m, sw_a[i]).is_some()).collect();
    assert_eq!(cached_a, vec![7, 8]);

    let mut b = tokens(0, 24);
    b.extend(tokens(1000, 16));
    m.add_request("b", &b, ExtraKeys::default()).unwrap();
    let (hit, new) = admit_n(&mut m, "b", 40);
    assert_eq!(
        (hit.num_computed_tokens, hit.shared_prefix_boundary),
        (0, 24)
    );
    assert!(new.is_some());
    let sw_b = m.block_ids("b", 1).unwrap().to_vec();
    let cached_b: Vec<usize> = (0..10).filter(|&i| key_of(&m, sw_b[i]).is_some()).collect();
    assert_eq!(cached_b, vec![4, 5, 7, 8]);

    let mut c = tokens(0, 24);
    c.extend(tokens(2000, 16));
    m.add_request("c", &c, ExtraKeys::default()).unwrap();
    assert_eq!(m.get_computed_blocks("c").unwrap().num_computed_tokens, 24);
}

// ----- long-context admission ---------------------------------------------------------------------

#[test]
fn admission_bounds_a_sliding_window_by_its_window_not_the_sequence() {
    // Window 8, block 4, 2 tokens in flight: the admission check reserves
    // cdiv(min(8 - 1 + 2, L), 4) + 1 = 4 window blocks however long the prompt, plus the full
    // group's 25 for a 100-token prompt: 29 of 30 free blocks.
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
    let mut c = config(groups, 31, Some(0));
    c.max_in_flight_tokens = Some(2);
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(0, 100), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.num_blocks_to_admit("a", None).unwrap(), 29);
    let (_, new) = admit_n(&mut m, "a", 2);
    assert!(
        new.is_some(),
        "admitted although the whole sequence needs 50 blocks"
    );
}

// ----- Mamba align ---------------------------------------------------------------------------------

fn full_mamba(num_blocks: usize) -> KVCacheManager {
    manager(
        vec![GroupSpec::full(4), GroupSpec::mamba(4)],
        num_blocks,
        Some(0),
    )
}

#[test]
fn mamba_align_keeps_only_the_live_state_and_caches_it_at_the_checkpoint() {
    // An 18-token prompt: the scheduler's split ends the first chunk at the last cacheable
    // position 16. The Mamba table holds nulls and one state block at slot 3; caching 16
    // tokens keys that state (the replay boundary 17 rounds down to 16).
    let mut m = full_mamba(64);
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(16, 0)).unwrap().unwrap();
    assert_eq!(new[0].len(), 4);
    assert_eq!(new[1].len(), 4);
    assert_eq!(&new[1][..3], &[NULL_BLOCK; 3]);
    let state = new[1][3];
    assert!(key_of(&m, state).is_some(), "the state at 16 is cached");
    // Second chunk (2 tokens): one more state block; the first is kept until left behind.
    let new = m.allocate_slots("a", &chunk(2, 16)).unwrap().unwrap();
    assert_eq!(new[1].len(), 1);
    assert_eq!(m.block_ids("a", 1).unwrap()[3], state);
    // A decode step: the state two steps back is freed (still cached, evictable).
    m.append_token_ids("a", &[7u32]).unwrap();
    m.new_step_starts();
    m.allocate_slots("a", &chunk(1, 18)).unwrap().unwrap();
    assert_eq!(m.block_ids("a", 1).unwrap()[3], NULL_BLOCK);
    assert_eq!(m.pool().ref_count(state).unwrap(), 0);
    assert!(key_of(&m, state).is_some());
    // The same prompt hits 16 tokens: the state's slot, nulls before it.
    m.add_request("b", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 16);
    assert_eq!(
        hit.blocks[1],
        vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, state]
    );
    assert_eq!(hit.blocks[0].len(), 4);
}

#[test]
fn a_prompt_prefilled_past_its_checkpoint_in_one_chunk_caches_no_mamba_state() {
    // Without the split, the chunk ends at 18: the state written there is not at the
    // checkpoint (16), so no Mamba state is cached and the prompt cannot be hit.
    let mut m = full_mamba(64);
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(18, 0)).unwrap().unwrap();
    let mamba = non_null(m.block_ids("a", 1).unwrap());
    assert!(mamba.iter().all(|&b| key_of(&m, b).is_none()));
    m.add_request("b", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 0);
}

#[test]
fn a_mamba_hit_on_a_state_cached_in_the_same_step_waits_a_step() {
    let mut m = full_mamba(64);
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(16, 0)).unwrap().unwrap();
    m.add_request("b", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let (hit, new) = admit_n(&mut m, "b", 2);
    assert_eq!(hit.num_computed_tokens, 16);
    assert!(
        new.is_none(),
        "the state is only written by this step's forward pass"
    );
    assert!(m.block_ids("b", 1).unwrap().is_empty());
    m.new_step_starts();
    let (hit, new) = admit_n(&mut m, "b", 2);
    let new = new.unwrap();
    assert_eq!(hit.num_computed_tokens, 16);
    // The hit state is adopted at slot 3 and a new state block appended.
    assert_eq!(m.block_ids("b", 1).unwrap()[3], hit.blocks[1][3]);
    assert_eq!(new[1].len(), 1);
}

#[test]
fn mamba_speculative_blocks_are_allocated_once_and_relocated() {
    // Align mode with 2 speculative blocks, block 4. An 8-token prompt needs cdiv(8, 4) + 2 = 4
    // slots: one null, then 1 + 2 new blocks (the speculative ones only on the first
    // allocation).
    let groups = vec![GroupSpec::mamba_with(4, MambaMode::Align, 2)];
    let mut m = manager(groups, 64, Some(0));
    m.add_request("a", &tokens(0, 8), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    assert_eq!(new[0].len(), 4);
    assert_eq!(new[0][0], NULL_BLOCK);
    let (state, spec) = (new[0][1], new[0][2..].to_vec());
    // One block at a time the speculative blocks become the live window: nothing moves.
    let mut other = manager(
        vec![GroupSpec::mamba_with(4, MambaMode::Align, 2)],
        64,
        Some(0),
    );
    other
        .add_request("a", &tokens(0, 8), ExtraKeys::default())
        .unwrap();
    other.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    other.append_token_ids("a", &tokens(50, 4)).unwrap();
    let new = other.allocate_slots("a", &chunk(4, 8)).unwrap().unwrap();
    assert_eq!(new[0].len(), 1);
    // Two blocks at once: the live slots start past slot 2, whose speculative block moves to
    // the end of the table and is handed over again with the one new block.
    m.append_token_ids("a", &tokens(50, 8)).unwrap();
    let new = m.allocate_slots("a", &chunk(8, 8)).unwrap().unwrap();
    let table = m.block_ids("a", 0).unwrap().to_vec();
    assert_eq!(table.len(), 6);
    assert_eq!(
        &table[..5],
        &[NULL_BLOCK, state, NULL_BLOCK, spec[1], spec[0]]
    );
    assert_eq!(new[0], vec![spec[0], table[5]]);
}

#[test]
fn mamba_boundary_states_are_offered_and_attention_blocks_recorded_for_zeroing() {
    let mut m = full_mamba(64);
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(16, 0)).unwrap().unwrap();
    let offloads = m.take_boundary_state_offloads();
    assert_eq!(offloads, vec![("a".to_owned(), 1, new[1][3], 16)]);
    assert!(m.take_boundary_state_offloads().is_empty());
    // A layout with Mamba layers zeroes new attention blocks (not Mamba states).
    assert_eq!(m.take_new_block_ids(), new[0]);
    m.record_blocks_for_zeroing("a", 8).unwrap();
    assert_eq!(m.take_new_block_ids(), new[0][2..].to_vec());
    assert!(matches!(
        m.record_blocks_for_zeroing("a", 6),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn blocks_to_zero_are_taken_group_by_group_as_vllms_managers_list_them() {
    // vLLM keeps one list per group and concatenates them in group order: with two attention
    // groups the blocks of every request's full-attention group come before any window block.
    let mut m = manager(
        vec![
            GroupSpec::full(4),
            GroupSpec::sliding_window(4, 8),
            GroupSpec::mamba(4),
        ],
        64,
        Some(0),
    );
    let mut new = Vec::new();
    for id in ["a", "b"] {
        m.add_request(id, &tokens(0, 10), ExtraKeys::default())
            .unwrap();
        new.push(m.allocate_slots(id, &chunk(8, 0)).unwrap().unwrap());
    }
    let expected: Vec<BlockId> = [&new[0][0], &new[1][0], &new[0][1], &new[1][1]]
        .into_iter()
        .flatten()
        .copied()
        .collect();
    assert_eq!(m.take_new_block_ids(), expected);
}

#[test]
fn a_mixed_precision_layout_zeroes_new_attention_blocks_without_mamba_layers() {
    // vLLM's `needs_kv_cache_zeroing` also holds for caches of more than one precision,
    // which the caller says; without it, only Mamba layouts zero.
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
    let mut plain = manager(groups.clone(), 64, Some(0));
    let mut c = config(groups, 64, Some(0));
    c.needs_kv_cache_zeroing = Some(true);
    let mut mixed = KVCacheManager::new(&c).unwrap();
    for m in [&mut plain, &mut mixed] {
        m.add_request("a", &tokens(0, 10), ExtraKeys::default())
            .unwrap();
    }
    plain.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    let new = mixed.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    assert!(plain.take_new_block_ids().is_empty());
    assert_eq!(
        mixed.take_new_block_ids(),
        [new[0].clone(), new[1].clone()].concat()
    );
    // And a Mamba layout told otherwise zeroes nothing.
    let mut c = config(vec![GroupSpec::full(4), GroupSpec::mamba(4)], 64, Some(0));
    c.needs_kv_cache_zeroing = Some(false);
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(0, 10), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    assert!(m.take_new_block_ids().is_empty());
}

// ----- Mamba prefill checkpoint exports ---------------------------------------------------------

fn mamba2(retention: Option<usize>) -> KVCacheManager {
    manager(vec![GroupSpec::mamba_with_checkpoints(4, 1)], 64, retention)
}

#[test]
fn a_chunk_is_exportable_when_the_checkpoint_lies_a_block_inside_it() {
    use super::single_type::checkpoint_exportable as ok;
    // Block 4, hash block 4, alignment 1; the checkpoint of a chunk ending at e is
    // (e - 1) // 4 * 4.
    assert!(ok(0, 18, 16, 4, 4, 1));
    assert!(ok(0, 5, 4, 4, 4, 1)); // the state after the first block, from inside [0, 5)
    assert!(!ok(0, 4, 0, 4, 4, 1)); // nothing before the chunk's last block
    assert!(!ok(2, 18, 16, 4, 4, 1)); // a chunk starting mid-block
    assert!(ok(8, 13, 12, 4, 4, 1));
    assert!(!ok(8, 12, 8, 4, 4, 1)); // the checkpoint is the chunk's start
    assert!(!ok(8, 18, 16, 4, 4, 3)); // 8 tokens in, not a multiple of the alignment
    assert!(ok(8, 18, 16, 4, 4, 2));
    assert!(!ok(0, 18, 16, 4, 4, 0)); // no exports at all
}

#[test]
fn the_final_chunk_reserves_a_block_for_the_prompt_checkpoint_and_caches_it() {
    // An 18-token prompt in one chunk: the checkpoint is (18 - 1) // 4 * 4 = 16, exported into
    // slot cdiv(18, 4) - 2 = 3 beside the running state in slot 4; two blocks taken, not one.
    for retention in [Some(0), None] {
        let mut m = mamba2(retention);
        m.add_request("a", &tokens(0, 18), ExtraKeys::default())
            .unwrap();
        let free = m.num_free_blocks();
        let new = m.allocate_slots("a", &chunk(18, 0)).unwrap().unwrap();
        assert_eq!(free - m.num_free_blocks(), 2, "{retention:?}");
        assert_eq!(&new[0][..3], &[NULL_BLOCK; 3]);
        let checkpoint = new[0][3];
        assert_ne!(checkpoint, NULL_BLOCK);
        assert_eq!(m.block_ids("a", 0).unwrap(), &new[0][..]);
        // Keyed as the state after 16 tokens: the same prompt hits it.
        let hash = m.request("a").unwrap().block_hashes()[3];
        assert_eq!(key_of(&m, checkpoint), Some(CacheKey { hash, group: 0 }));
        m.add_request("b", &tokens(0, 18), ExtraKeys::default())
            .unwrap();
        m.new_step_starts();
        let hit = m.get_computed_blocks("b").unwrap();
        assert_eq!(hit.num_computed_tokens, 16);
        assert_eq!(hit.blocks[0][3], checkpoint);
    }
    // Without exports the same chunk keeps one state block and caches nothing (vLLM's
    // scheduler stops the chunk at 16 instead).
    let mut m = manager(vec![GroupSpec::mamba(4)], 64, Some(0));
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(18, 0)).unwrap().unwrap();
    assert_eq!(non_null(&new[0]).len(), 1);
    assert_eq!(m.num_cached_keys(), 0);
}

#[test]
fn under_default_retention_only_the_chunk_reaching_the_prefill_end_exports() {
    let mut m = mamba2(Some(0));
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let first = m.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    assert_eq!(first[0].len(), 2);
    assert_eq!(first[0][0], NULL_BLOCK);
    let state = first[0][1];
    // [8, 18): the checkpoint 16 is 8 tokens in, slot 3; slot 2 stays null and the previous
    // state (slot 1) is kept until the request is past it.
    let second = m.allocate_slots("a", &chunk(10, 8)).unwrap().unwrap();
    let table = m.block_ids("a", 0).unwrap().to_vec();
    assert_eq!(table.len(), 5);
    assert_eq!(&table[..3], &[NULL_BLOCK, state, NULL_BLOCK]);
    assert_eq!(second[0], table[2..].to_vec());
    assert_eq!(non_null(&second[0]).len(), 2);
    let hash = m.request("a").unwrap().block_hashes()[3];
    assert_eq!(key_of(&m, table[3]), Some(CacheKey { hash, group: 0 }));
}

#[test]
fn under_dense_retention_every_long_enough_chunk_exports() {
    // Dense: the chunk [0, 8) exports the state after 4 tokens into slot 0, and both it and the
    // running state are cached.
    let mut m = mamba2(None);
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let first = m.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    assert_eq!(non_null(&first[0]).len(), 2);
    let hashes = m.request("a").unwrap().block_hashes().to_vec();
    for (slot, &block) in first[0].iter().enumerate() {
        let key = CacheKey {
            hash: hashes[slot],
            group: 0,
        };
        assert_eq!(key_of(&m, block), Some(key));
    }
}

#[test]
fn a_transient_checkpoint_is_not_cached_between_retention_segments() {
    // Retention every 8 tokens (2 blocks) on a 30-token prompt: the chunk [0, 14) exports the
    // state after 12 tokens into slot 2. 12 is neither a segment end (8, 16, ...), the prompt's
    // checkpoint (28) nor a junction: the block holds it for the step, uncached. Dense
    // retention caches it.
    for (retention, cached) in [(Some(8), false), (None, true)] {
        let mut m = mamba2(retention);
        m.add_request("a", &tokens(0, 30), ExtraKeys::default())
            .unwrap();
        let new = m.allocate_slots("a", &chunk(14, 0)).unwrap().unwrap();
        let table = m.block_ids("a", 0).unwrap().to_vec();
        assert_eq!(new[0], table);
        assert_eq!(&table[..2], &[NULL_BLOCK; 2]);
        assert_ne!(table[2], NULL_BLOCK);
        assert_eq!(key_of(&m, table[2]).is_some(), cached, "{retention:?}");
    }
}

#[test]
fn the_admission_check_counts_the_checkpoint_block() {
    // 3 free blocks: the 18-token prompt needs 2 now; its whole sequence with output too.
    let mut m = manager(vec![GroupSpec::mamba_with_checkpoints(4, 1)], 3, Some(0));
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.num_blocks_to_admit("a", None).unwrap(), 2);
    let mut plain = manager(vec![GroupSpec::mamba(4)], 3, Some(0));
    plain
        .add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    assert_eq!(plain.num_blocks_to_admit("a", None).unwrap(), 1);
    // With one free block the exporting chunk cannot be allocated, and nothing changes.
    let mut tight = manager(vec![GroupSpec::mamba_with_checkpoints(4, 1)], 2, Some(0));
    tight
        .add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    assert!(tight.allocate_slots("a", &chunk(18, 0)).unwrap().is_none());
    assert!(tight.block_ids("a", 0).unwrap().is_empty());
    assert_eq!(tight.num_free_blocks(), 1);
}

#[test]
fn checkpoint_blocks_are_freed_as_the_request_moves_on() {
    let mut m = mamba2(Some(0));
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(18, 0)).unwrap().unwrap();
    let before = m.num_free_blocks();
    // Decode past the next block: the checkpoint (slot 3) falls behind the state and is freed
    // into the cache (it keeps its key).
    m.append_token_ids("a", &tokens(100, 8)).unwrap();
    m.allocate_slots("a", &chunk(8, 18)).unwrap().unwrap();
    let table = m.block_ids("a", 0).unwrap().to_vec();
    assert_eq!(table[3], NULL_BLOCK);
    assert_eq!(m.num_cached_keys(), 1);
    assert_eq!(m.num_free_blocks(), before);
    m.free("a").unwrap();
    assert_eq!(m.num_free_blocks(), 63);
}

// ----- EAGLE and lookahead hashing ------------------------------------------------------------------

fn eagle(groups: Vec<GroupSpec>, retention: Option<usize>) -> KVCacheManager {
    let mut c = config(groups, 64, retention);
    c.use_eagle = true;
    KVCacheManager::new(&c).unwrap()
}

#[test]
fn eagle_drops_the_last_matched_full_attention_block() {
    let mut m = eagle(vec![GroupSpec::full(4)], Some(0));
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    m.add_request("b", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    // 4 blocks match below 19 tokens; the drafter recomputes the last: 12.
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 12);
}

#[test]
fn eagle_sliding_window_needs_one_more_block_and_drops_it() {
    // Window 8: 2 blocks, plus the EAGLE block: a run of 3 whose last is dropped.
    let mut m = eagle(vec![GroupSpec::sliding_window(4, 8)], None);
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    m.add_request("b", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 12);
    assert_eq!(non_null(&hit.blocks[0]).len(), 2);
}

#[test]
fn eagle_moves_the_replay_boundaries_and_caches_the_peek_block() {
    // Hybrid full + window (block 4, window 8), retention 0, EAGLE: a 20-token prompt's
    // boundaries are 12 (resend 16 - 4) and 16 (extension 20 - 4); the window keeps its tail
    // before each, shifted by the peek block: blocks 2..4 and 3..5.
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
    let mut m = eagle(groups, Some(0));
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    let sw = m.block_ids("a", 1).unwrap().to_vec();
    let cached: Vec<usize> = (0..5).filter(|&i| key_of(&m, sw[i]).is_some()).collect();
    assert_eq!(cached, vec![1, 2, 3, 4]);
    // A resend looks one block past its cap (19 + 4, within the 20 hashed tokens) and drops
    // it: 16. A longer sibling also lands at 16.
    m.add_request("b", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 16);
    m.add_request("c", &tokens(0, 30), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.get_computed_blocks("c").unwrap().num_computed_tokens, 16);
}

#[test]
fn eagle_moves_the_exported_checkpoint_back_a_block_and_the_estimate_reads_its_key() {
    // An 18-token prompt in one chunk, block 4: EAGLE's drop moves the checkpoint from 16 to
    // 12, still exported into slot cdiv(18, 4) - 2 = 3. The block there holds the state after
    // 12 tokens: its key and the cached-token estimate say 12, not the slot's 16.
    let mut m = eagle(vec![GroupSpec::mamba_with_checkpoints(4, 1)], Some(0));
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(18, 0)).unwrap().unwrap();
    let checkpoint = new[0][3];
    assert_ne!(checkpoint, NULL_BLOCK);
    let hash = m.request("a").unwrap().block_hashes()[2];
    assert_eq!(key_of(&m, checkpoint), Some(CacheKey { hash, group: 0 }));
    assert_eq!(m.estimate_cached_tokens("a").unwrap(), 12);
    // Without EAGLE the same slot holds the state after 16 tokens.
    let mut plain = mamba2(Some(0));
    plain
        .add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    plain.allocate_slots("a", &chunk(18, 0)).unwrap().unwrap();
    assert_eq!(plain.estimate_cached_tokens("a").unwrap(), 16);
}

/// Multi-token prediction over one Mamba group of block 4 exporting prefill checkpoints: 2
/// prefill lookahead tokens, hashes covering 2 more tokens.
fn mtp_mamba_config() -> ManagerConfig {
    let mut c = config(vec![GroupSpec::mamba_with_checkpoints(4, 1)], 64, Some(0));
    c.num_hash_lookahead_tokens = 2;
    c.num_prefill_lookahead = 2;
    c
}

/// A decode step allocated while the request's `computed` tokens are still in flight
/// (asynchronous scheduling).
fn decode_in_flight(computed: usize) -> AllocateArgs<'static> {
    AllocateArgs {
        num_new_tokens: 1,
        num_computed_tokens: computed,
        num_in_flight_tokens: computed,
        ..Default::default()
    }
}

#[test]
fn the_estimate_reads_the_prefix_a_shared_state_block_is_keyed_at_now() {
    // As above (MTP, block 4, 17-token prompt, asynchronous steps): "a"'s checkpoint after 12
    // tokens sits in slot 3. "b" shares those 12 tokens and the 2 lookahead tokens their hash
    // covers, and hits that state block. Then "a"'s sampled token proves its slot-3 prefix and
    // re-keys the block at "a"'s 16 tokens, a prefix "b" does not have. vLLM's estimate reads
    // the block's `block_hash_num_tokens`, whichever request set it: 16 for "b" too.
    let mut m = KVCacheManager::new(&mtp_mamba_config()).unwrap();
    m.add_request("a", &tokens(0, 17), ExtraKeys::default())
        .unwrap();
    let block = m.allocate_slots("a", &chunk(17, 0)).unwrap().unwrap()[0][3];
    m.allocate_slots("a", &decode_in_flight(17))
        .unwrap()
        .unwrap();
    m.new_step_starts();
    let mut prompt = tokens(0, 14);
    prompt.extend(tokens(500, 3));
    m.add_request("b", &prompt, ExtraKeys::default()).unwrap();
    let (hit, new) = admit_n(&mut m, "b", 5);
    assert_eq!(hit.num_computed_tokens, 12);
    assert!(new.is_some());
    assert_eq!(m.block_ids("b", 0).unwrap()[2], block);
    assert_eq!(m.estimate_cached_tokens("b").unwrap(), 12);
    m.append_token_ids("a", &[100u32]).unwrap();
    m.cache_blocks("a", 17).unwrap();
    let a16 = m.request("a").unwrap().block_hashes()[3];
    assert_eq!(
        key_of(&m, block),
        Some(CacheKey {
            hash: a16,
            group: 0
        })
    );
    assert!(!m.request("b").unwrap().block_hashes().contains(&a16));
    assert_eq!(m.estimate_cached_tokens("b").unwrap(), 16);
}

#[test]
fn a_checkpoint_exported_past_the_last_hash_is_left_unkeyed() {
    // Dense retention: every chunk long enough exports a Mamba checkpoint. With lookahead
    // hashes (multi-token prediction) a block is hashed once the tokens after it exist; a
    // chunk that schedules draft tokens past the request's tokens can export the state after
    // every token it has, whose last block has no hash until the next token is sampled (vLLM
    // 0.33 fails an assertion in `_get_partial_block_hash` there). No key can name that state:
    // the block is left unkeyed, and every key the request's blocks carry is one of its
    // hashes.
    for (block, hash) in [(4, 4), (8, 4)] {
        for lookahead in [1, 2] {
            for prompt in 5..40 {
                for (step, drafts) in [(3, 1), (4, 1), (8, 2), (prompt, 1), (prompt, 3)] {
                    // Granite-4.0-H-like: full attention and Mamba-2, as vLLM groups them.
                    let groups = vec![
                        GroupSpec::full(block),
                        GroupSpec::mamba_with_checkpoints(block, 1),
                    ];
                    let mut c = config(groups, 64, None);
                    c.num_hash_lookahead_tokens = lookahead;
                    c.hash_block_size = Some(hash);
                    let mut m = KVCacheManager::new(&c).unwrap();
                    m.add_request("a", &tokens(0, prompt), ExtraKeys::default())
                        .unwrap();
                    let mut computed = 0;
                    let mut sampled = 0u32;
                    while computed < prompt + 6 {
                        let num_tokens = m.request("a").unwrap().num_tokens();
                        let n = step.min(num_tokens - computed);
                        // Drafts scheduled with the chunk that reaches the last token.
                        let drafted = if computed + n == num_tokens {
                            drafts
                        } else {
                            0
                        };
                        let case = format!(
                            "block {block}, hash {hash}, lookahead {lookahead}, prompt \
                             {prompt}, chunks of {step}, at {computed}"
                        );
                        let args = chunk(n + drafted, computed);
                        assert!(m.allocate_slots("a", &args).unwrap().is_some(), "{case}");
                        m.new_step_starts();
                        computed += n;
                        let hashes = m.request("a").unwrap().block_hashes().to_vec();
                        for b in non_null(m.block_ids("a", 1).unwrap()) {
                            if let Some(key) = key_of(&m, b) {
                                assert!(hashes.contains(&key.hash), "{case}: block {b}");
                            }
                        }
                        if computed == num_tokens {
                            m.append_token_ids("a", &[900 + sampled]).unwrap();
                            sampled += 1;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_checkpoint_keyed_below_its_slot_is_rekeyed_when_the_slot_prefix_is_cached() {
    // Multi-token prediction (2 prefill lookahead tokens, hashes covering 2 more tokens),
    // block 4, a 17-token prompt in one chunk: the checkpoint is (17 - 2) // 4 * 4 = 12,
    // exported into slot cdiv(17, 4) - 2 = 3, whose full prefix is 16 tokens.
    let c = mtp_mamba_config();
    for caches_before_next_step in [true, false] {
        let mut m = KVCacheManager::new(&c).unwrap();
        m.add_request("a", &tokens(0, 17), ExtraKeys::default())
            .unwrap();
        let new = m.allocate_slots("a", &chunk(17, 0)).unwrap().unwrap();
        let block = new[0][3];
        let hashes = |m: &KVCacheManager| m.request("a").unwrap().block_hashes().to_vec();
        let key = |h: crate::BlockHash| Some(CacheKey { hash: h, group: 0 });
        assert_eq!(key_of(&m, block), key(hashes(&m)[2]));
        if caches_before_next_step {
            // The sampled token proves block 3's hash. The step's checkpoint is still
            // recorded: the slot's full prefix is cached and the block keyed back at its
            // checkpoint, as vLLM's `_cache_partial_tail_block` does after `cache_full_blocks`.
            m.append_token_ids("a", &[100u32]).unwrap();
            assert_eq!(hashes(&m).len(), 4);
            m.cache_blocks("a", 17).unwrap();
            assert_eq!(key_of(&m, block), key(hashes(&m)[2]));
            assert_eq!(m.estimate_cached_tokens("a").unwrap(), 12);
        } else {
            // Async scheduling: the next step is allocated while the prefill is in flight (the
            // slot stays), then the sampled token arrives and the slot's full prefix is cached:
            // the block is re-keyed at 16 tokens, the shorter key removed.
            m.allocate_slots("a", &decode_in_flight(17))
                .unwrap()
                .unwrap();
            assert_eq!(m.block_ids("a", 0).unwrap()[3], block);
            m.append_token_ids("a", &[100u32]).unwrap();
            m.cache_blocks("a", 17).unwrap();
            assert_eq!(key_of(&m, block), key(hashes(&m)[3]));
            assert_eq!(m.num_cached_keys(), 1);
            // The estimate reads the prefix the block's key covers now (vLLM's
            // `block_hash_num_tokens`), not the prefix the state in it was computed for.
            assert_eq!(m.estimate_cached_tokens("a").unwrap(), 16);
        }
    }
}

#[test]
fn under_async_scheduling_the_computed_count_runs_ahead_by_the_tokens_in_flight() {
    // An 8-token prompt prefilled, then a decode step with 3 drafts scheduled while that step
    // is in flight: vLLM's count is 8 + 4 = 12 before the next step, 4 ahead of the 8 known
    // tokens, all of them in flight (and in the slots the decode step got).
    let mut m = manager(vec![GroupSpec::full(4)], 64, Some(0));
    m.add_request("a", &tokens(0, 8), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    m.allocate_slots("a", &chunk(4, 8)).unwrap().unwrap();
    let ahead = |in_flight| AllocateArgs {
        num_new_tokens: 4,
        num_computed_tokens: 12,
        num_in_flight_tokens: in_flight,
        ..Default::default()
    };
    let before = m.block_ids("a", 0).unwrap().to_vec();
    assert!(matches!(
        m.allocate_slots("a", &ahead(3)),
        Err(CoreError::OutOfRange(_))
    ));
    assert_eq!(m.block_ids("a", 0).unwrap(), &before[..]);
    let new = m.allocate_slots("a", &ahead(4)).unwrap().unwrap();
    assert_eq!(new[0].len(), 1, "slots up to 16 tokens: block 3");
    // Only known tokens are cached: still the two prompt blocks.
    assert_eq!(m.num_cached_keys(), 2);
}

#[test]
fn eagle_with_chunked_local_attention_is_refused_as_in_vllm() {
    let mut c = config(
        vec![GroupSpec::full(4), GroupSpec::chunked_local(4, 16)],
        64,
        Some(0),
    );
    c.use_eagle = true;
    assert!(matches!(
        KVCacheManager::new(&c),
        Err(CoreError::InvalidConfig(_))
    ));
}

#[test]
fn lookahead_hashing_hashes_a_block_once_the_tokens_after_it_exist() {
    let mut c = config(vec![GroupSpec::full(4)], 64, Some(0));
    c.num_hash_lookahead_tokens = 2;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(0, 9), ExtraKeys::default())
        .unwrap();
    // Blocks 0 and 1 need tokens up to 6 and 10: only block 0 is hashed.
    assert_eq!(m.request("a").unwrap().block_hashes().len(), 1);
    m.append_token_ids("a", &[100u32]).unwrap();
    assert_eq!(m.request("a").unwrap().block_hashes().len(), 2);
    // The hash covers the lookahead tokens: a different token 4 or 5 changes block 0's hash.
    let h = m.request("a").unwrap().block_hashes()[0];
    m.add_request("b", &[0u32, 1, 2, 3, 4, 99, 6], ExtraKeys::default())
        .unwrap();
    assert_ne!(m.request("b").unwrap().block_hashes()[0], h);
    m.add_request("c", &[0u32, 1, 2, 3, 4, 5, 42], ExtraKeys::default())
        .unwrap();
    assert_eq!(m.request("c").unwrap().block_hashes()[0], h);
}

// ----- connectors and the rest of the API ---------------------------------------------------------

#[test]
fn a_diverged_connector_lookup_leaves_the_request_no_junction() {
    // Full attention and Mamba, blocks of 4, sparse retention. A 12-token prompt prefilled in
    // one chunk caches full attention's blocks but no Mamba state: a sibling sharing 8 tokens
    // hits nothing, with full attention alone ahead (its junction: 8 tokens).
    let mut m = manager(vec![GroupSpec::full(4), GroupSpec::mamba(4)], 64, Some(0));
    m.add_request("a", &tokens(0, 12), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(12, 0)).unwrap().unwrap();
    let mut b = tokens(0, 8);
    b.extend(tokens(100, 8));
    m.add_request("b", &b, ExtraKeys::default()).unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 0);
    assert_eq!(hit.shared_prefix_boundary, 8);
    assert_eq!(m.shared_prefix_boundary("b").unwrap(), 8);
    // The connector lookup reports full attention's hit, flagged as diverged, and no junction;
    // vLLM's scheduler stores that junction on the request, which caching then reads.
    let (hit, diverged) = m.get_computed_blocks_for_connector("b", None).unwrap();
    assert!(diverged);
    assert_eq!(hit.num_computed_tokens, 8);
    assert_eq!(hit.shared_prefix_boundary, 0);
    assert_eq!(m.shared_prefix_boundary("b").unwrap(), 0);
}

#[test]
fn external_tokens_get_blocks_after_the_local_hit_and_delayed_caching_waits() {
    let mut m = manager(vec![GroupSpec::full(4)], 64, Some(0));
    m.add_request("a", &tokens(0, 16), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(16, 0)).unwrap().unwrap();
    m.add_request("b", &tokens(0, 30), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 16);
    // 8 more tokens come from a connector; 4 are computed; caching waits for the transfer.
    let args = AllocateArgs {
        num_new_tokens: 4,
        num_new_computed_tokens: 16,
        new_computed_blocks: Some(&hit),
        num_external_computed_tokens: 8,
        delay_cache_blocks: true,
        ..Default::default()
    };
    let new = m.allocate_slots("b", &args).unwrap().unwrap();
    assert_eq!(m.block_ids("b", 0).unwrap().len(), 7);
    assert_eq!(
        new[0].len(),
        1,
        "the external blocks are not among the new ones"
    );
    let cached = m.num_cached_keys();
    m.cache_blocks("b", 28).unwrap();
    assert_eq!(m.num_cached_keys(), cached + 3);
    assert_eq!(m.estimate_cached_tokens("b").unwrap(), 28);
    assert_eq!(
        m.get_block_ids_for_computed_tokens("b", 9).unwrap()[0].len(),
        3
    );
}

#[test]
fn a_mamba_admission_with_external_tokens_is_refused_when_its_external_block_does_not_fit() {
    // Full + Mamba align, blocks of 4. A new request with 11 tokens from a connector and 20
    // to compute needs slots for 31 tokens: 8 full-attention blocks, and in the Mamba group
    // one block for the external state (slot 2, after 2 nulls) plus the running state (slot
    // 7). vLLM's count says 9 (its Mamba count leaves out the external state's block); with 9
    // free, vLLM 0.33 fails its pool allocation halfway through the call. hybrid-kv refuses
    // the call, nothing changed, and takes exactly 10 when they are free.
    for num_blocks in 6..16 {
        let mut m = full_mamba(num_blocks);
        m.add_request("a", &tokens(0, 40), ExtraKeys::default())
            .unwrap();
        let free = m.num_free_blocks();
        let args = AllocateArgs {
            num_new_tokens: 20,
            num_external_computed_tokens: 11,
            ..Default::default()
        };
        let new = m.allocate_slots("a", &args).unwrap();
        if free < 10 {
            assert!(new.is_none(), "{free} free");
            assert_eq!(m.num_free_blocks(), free);
            assert!(m.block_ids("a", 0).unwrap().is_empty());
            assert!(m.block_ids("a", 1).unwrap().is_empty());
            assert!(m.take_new_block_ids().is_empty());
        } else {
            let new = new.unwrap();
            assert_eq!(m.num_free_blocks(), free - 10);
            assert_eq!(m.block_ids("a", 0).unwrap().len(), 8);
            let mamba = m.block_ids("a", 1).unwrap();
            assert_eq!(non_null(mamba).len(), 2);
            assert_eq!(
                (mamba[2] != NULL_BLOCK, mamba[7] != NULL_BLOCK),
                (true, true)
            );
            assert_eq!(
                new[0].len(),
                5,
                "the external blocks are not among the new ones"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Admissions with a local hit and external tokens on layouts with Mamba align (with
    /// speculative blocks, with prefill checkpoints, beside a window), in pools from nearly
    /// full to roomy: each call returns (None leaves everything as it was), none fails, and
    /// what a call takes equals `blocks_taken` (checked inside every allocation of a test
    /// build).
    #[test]
    fn mamba_admissions_with_external_tokens_fit_or_change_nothing(
        layout in 0usize..4,
        first_len in 1usize..60,
        shared in 0usize..60,
        second_len in 1usize..60,
        use_hit in any::<bool>(),
        external in 0usize..40,
        num_new in 1usize..60,
        num_blocks in 8usize..48,
    ) {
        let groups = match layout {
            0 => vec![GroupSpec::full(4), GroupSpec::mamba(4)],
            1 => vec![GroupSpec::full(4), GroupSpec::mamba_with(4, MambaMode::Align, 2)],
            2 => vec![GroupSpec::full(4), GroupSpec::mamba_with_checkpoints(4, 1)],
            _ => vec![GroupSpec::sliding_window(4, 8), GroupSpec::mamba(4)],
        };
        let mut m = manager(groups, num_blocks, Some(0));
        let first = tokens(0, first_len);
        m.add_request("a", &first, ExtraKeys::default()).unwrap();
        // The first request holds its blocks (or none if they do not fit).
        let _ = m.allocate_slots("a", &chunk(first_len, 0)).unwrap();
        m.new_step_starts();
        let mut second = first[..shared.min(first_len)].to_vec();
        second.extend(tokens(1000, second_len));
        m.add_request("b", &second, ExtraKeys::default()).unwrap();
        let hit = m.get_computed_blocks("b").unwrap();
        let local = if use_hit { hit.num_computed_tokens } else { 0 };
        let external = external.min(second.len() - local);
        let num_new = num_new.min(second.len() - local - external).max(1);
        let free = m.num_free_blocks();
        let args = AllocateArgs {
            num_new_tokens: num_new,
            num_new_computed_tokens: local,
            new_computed_blocks: use_hit.then_some(&hit),
            num_external_computed_tokens: external,
            ..Default::default()
        };
        let new = m.allocate_slots("b", &args).unwrap();
        if new.is_none() {
            prop_assert_eq!(m.num_free_blocks(), free);
            prop_assert!(m.block_ids("b", 0).unwrap().is_empty());
            prop_assert!(m.block_ids("b", 1).unwrap().is_empty());
        }
    }
}

#[test]
fn pop_blocks_for_free_hands_the_blocks_over_without_freeing() {
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
    let mut m = manager(groups, 64, None);
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    m.append_token_ids("a", &[1u32]).unwrap();
    m.allocate_slots("a", &chunk(1, 20)).unwrap().unwrap();
    let free = m.num_free_blocks();
    let full = m.block_ids("a", 0).unwrap().to_vec();
    let sw = m.block_ids("a", 1).unwrap().to_vec();
    let popped = m.pop_blocks_for_free("a").unwrap();
    let lead = sw.iter().take_while(|&&b| b == NULL_BLOCK).count();
    let mut expected = full.clone();
    expected.extend_from_slice(&sw[lead..]);
    assert_eq!(popped, expected);
    assert_eq!(m.num_free_blocks(), free);
    assert!(m.block_ids("a", 0).unwrap().is_empty());
    assert_eq!(m.num_retained_blocks(), popped.len());
    let mut tail_first = popped.clone();
    tail_first.reverse();
    m.free_retained_blocks(&tail_first).unwrap();
    assert_eq!(m.num_free_blocks(), free + popped.len());
    assert_eq!(m.num_retained_blocks(), 0);
    assert!(m.free_retained_blocks(&popped[..1]).is_err());
}

#[test]
fn reserved_blocks_and_hit_caps_and_prompt_logprobs() {
    let mut m = manager(vec![GroupSpec::full(4)], 11, Some(0));
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    m.add_request("b", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    // max_cache_hit_length caps the hit (rounded down to a block).
    let capped = m.get_computed_blocks_capped("b", Some(10)).unwrap();
    assert_eq!(capped.num_computed_tokens, 8);
    // Prompt-logprobs requests read no hit.
    m.set_skip_reading_prefix_cache("b", true).unwrap();
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 0);
    // 5 free blocks; b needs 5 without a hit: reserving 1 for others refuses it.
    let args = AllocateArgs {
        num_new_tokens: 20,
        reserved_blocks: 1,
        ..Default::default()
    };
    assert!(m.allocate_slots("b", &args).unwrap().is_none());
    let args = AllocateArgs {
        reserved_blocks: 0,
        ..args
    };
    assert!(m.allocate_slots("b", &args).unwrap().is_some());
}

#[test]
fn truncating_a_hit_keeps_whole_blocks_and_mamba_what_it_has() {
    let mut m = full_mamba(64);
    m.add_request("a", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(16, 0)).unwrap().unwrap();
    m.new_step_starts();
    m.add_request("b", &tokens(0, 18), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    let cut = m.truncate_computed_blocks(&hit, 8).unwrap();
    assert_eq!(cut.blocks[0], hit.blocks[0][..2].to_vec());
    assert_eq!(cut.blocks[1], hit.blocks[1][..2].to_vec());
    assert!(m.truncate_computed_blocks(&hit, 6).is_err());
    assert!(m.truncate_computed_blocks(&hit, 20).is_err());
}

// ----- spec kinds ----------------------------------------------------------------------------------

#[test]
fn reference_sliding_window_frees_the_gap_between_prompt_and_window() {
    // R-SWA window 8, block 4, prompt 8: after 23 processed tokens the window starts at 15, so
    // the gap is block 2 (tokens 8..11); the prompt's blocks and blocks 3.. stay.
    let groups = vec![GroupSpec::new(AttentionKind::Rswa { window: 8 }, 4)];
    let mut m = manager(groups, 64, None);
    m.add_request("a", &tokens(0, 8), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(8, 0)).unwrap().unwrap();
    for computed in 8..24 {
        m.append_token_ids("a", &[1u32]).unwrap();
        m.allocate_slots("a", &chunk(1, computed)).unwrap().unwrap();
    }
    let table = m.block_ids("a", 0).unwrap();
    assert_eq!(table.len(), 6);
    assert_ne!(table[0], NULL_BLOCK);
    assert_ne!(table[1], NULL_BLOCK);
    assert_eq!(table[2], NULL_BLOCK);
    assert!(table[3..].iter().all(|&b| b != NULL_BLOCK));
}

#[test]
fn a_circular_buffer_holds_one_block_per_request_and_is_never_cached() {
    let groups = vec![
        GroupSpec::full(4),
        GroupSpec::new(AttentionKind::CircularBuffer, 4),
    ];
    let mut m = manager(groups, 64, Some(0));
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    assert_eq!((new[0].len(), new[1].len()), (5, 1));
    m.append_token_ids("a", &[1u32]).unwrap();
    let new = m.allocate_slots("a", &chunk(1, 20)).unwrap().unwrap();
    assert_eq!((new[0].len(), new[1].len()), (1, 0));
    assert_eq!(m.num_cached_keys(), 5);
    m.add_request("b", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!((hit.num_computed_tokens, hit.blocks[1].len()), (16, 0));
}

#[test]
fn bounded_replay_sliding_window_mla_is_not_cached() {
    let kind = AttentionKind::SlidingWindowMla {
        window: 8,
        bounded_replay: true,
    };
    let groups = vec![GroupSpec::full(4), GroupSpec::new(kind, 4)];
    let mut m = manager(groups, 64, None);
    m.add_request("a", &tokens(0, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &chunk(20, 0)).unwrap().unwrap();
    assert_eq!(m.num_cached_keys(), 5, "only the full-attention blocks");
}

#[test]
fn an_attention_free_layout_has_no_groups() {
    let mut m = KVCacheManager::new(&ManagerConfig::new(vec![], 1, 64)).unwrap();
    m.add_request("a", &tokens(0, 10), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.get_computed_blocks("a").unwrap().num_computed_tokens, 0);
    assert_eq!(m.allocate_slots("a", &chunk(10, 0)).unwrap(), Some(vec![]));
    assert_eq!((m.num_free_blocks(), m.usage()), (0, 0.0));
    // With groups, a pool of only the null block is too small.
    assert!(KVCacheManager::new(&ManagerConfig::new(vec![GroupSpec::full(4)], 1, 64)).is_err());
}

// ----- Async scheduling with drafts, fuzzed -------------------------------------------------------

use proptest::prelude::*;

#[derive(Debug, Clone)]
enum AsyncOp {
    /// Schedule request `i`: `new` tokens past its computed ones, `drafts` lookahead slots.
    Schedule { i: usize, new: usize, drafts: usize },
    /// The oldest unprocessed step of request `i` completes: `rejected` of its positions roll
    /// back, `sampled` tokens become known, and the processed prefix is cached.
    Process {
        i: usize,
        rejected: usize,
        sampled: usize,
    },
    /// Request `i` is preempted or finishes: its blocks go back.
    Free { i: usize },
}

fn async_op() -> impl Strategy<Value = AsyncOp> {
    prop_oneof![
        4 => (0..3usize, 1..24usize, 0..4usize)
            .prop_map(|(i, new, drafts)| AsyncOp::Schedule { i, new, drafts }),
        3 => (0..3usize, 0..4usize, 1..5usize)
            .prop_map(|(i, rejected, sampled)| AsyncOp::Process { i, rejected, sampled }),
        1 => (0..3usize).prop_map(|i| AsyncOp::Free { i }),
    ]
}

fn async_layouts() -> Vec<Vec<GroupSpec>> {
    vec![
        vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)],
        vec![GroupSpec::full(4), GroupSpec::chunked_local(4, 16)],
        vec![GroupSpec::full(4), GroupSpec::mamba(4)],
        vec![GroupSpec::full(4), GroupSpec::mamba_with_checkpoints(4, 1)],
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Async scheduling with drafts, as vLLM's scheduler drives a manager: steps scheduled
    /// while earlier ones are in flight (the computed count runs ahead of the known tokens),
    /// rejected drafts rolled back, tokens sampled, processed prefixes cached, requests freed
    /// at any point. Every call within the documented bounds succeeds (never a panic), the
    /// request's counts stay what was set, and nothing leaks.
    #[test]
    fn async_steps_with_drafts_stay_within_the_contract(
        layout in 0..4usize,
        lookahead in 0..3usize,
        retention in prop_oneof![Just(None), Just(Some(0usize))],
        num_blocks in 12..64usize,
        ops in proptest::collection::vec(async_op(), 1..60),
    ) {
        let mut c = config(async_layouts().swap_remove(layout), num_blocks, retention);
        c.num_hash_lookahead_tokens = lookahead;
        c.num_prefill_lookahead = lookahead;
        let mut m = KVCacheManager::new(&c).unwrap();
        let ids = ["a", "b", "c"];
        // Per request: computed count, steps in flight (sizes, oldest first), running.
        let mut computed = [0usize; 3];
        let mut in_flight: [Vec<usize>; 3] = Default::default();
        let mut running = [false; 3];
        for (k, id) in ids.iter().enumerate() {
            // Shared first 12 tokens: hits happen.
            let mut prompt = tokens(0, 12);
            prompt.extend(tokens(1_000 * (k as u32 + 1), 5 + 7 * k));
            m.add_request(id, &prompt, ExtraKeys::default()).unwrap();
        }
        for op in ops {
            match op {
                AsyncOp::Schedule { i, new, drafts } => {
                    let id = ids[i];
                    let known = m.request(id).unwrap().num_tokens();
                    let flight: usize = in_flight[i].iter().sum();
                    if !running[i] {
                        if !in_flight[i].is_empty() {
                            continue;
                        }
                        let hit = m.get_computed_blocks(id).unwrap();
                        let n = (known - hit.num_computed_tokens).min(new);
                        let args = AllocateArgs {
                            num_new_tokens: n,
                            num_new_computed_tokens: hit.num_computed_tokens,
                            new_computed_blocks: Some(&hit),
                            num_lookahead_tokens: drafts,
                            full_sequence_must_fit: true,
                            ..Default::default()
                        };
                        if m.allocate_slots(id, &args).unwrap().is_some() {
                            running[i] = true;
                            computed[i] = hit.num_computed_tokens + n;
                            in_flight[i].push(n);
                        }
                        continue;
                    }
                    // Decode (1 + drafts) once the prompt is scheduled, a chunk before.
                    let prompt = m.request(id).unwrap().num_prompt_tokens();
                    let n = if computed[i] >= prompt { 1 + drafts } else { new.min(prompt - computed[i]) };
                    if computed[i] + n > 1024 {
                        continue;
                    }
                    let args = AllocateArgs {
                        num_new_tokens: n,
                        num_computed_tokens: computed[i],
                        num_in_flight_tokens: flight,
                        num_lookahead_tokens: drafts,
                        ..Default::default()
                    };
                    prop_assert!(computed[i] - flight <= known);
                    if m.allocate_slots(id, &args).unwrap().is_some() {
                        computed[i] += n;
                        in_flight[i].push(n);
                    }
                }
                AsyncOp::Process { i, rejected, sampled } => {
                    let id = ids[i];
                    if in_flight[i].is_empty() {
                        continue;
                    }
                    let step = in_flight[i].remove(0);
                    let prompt = m.request(id).unwrap().num_prompt_tokens();
                    let flight: usize = in_flight[i].iter().sum();
                    let processed = computed[i] - flight;
                    // Drafts are rejected only past the prompt; the rest become known tokens.
                    let rejected = if processed > prompt { rejected.min(step - 1) } else { 0 };
                    computed[i] -= rejected;
                    let processed = processed - rejected;
                    let known = m.request(id).unwrap().num_tokens();
                    if processed >= prompt {
                        let grow = (processed + sampled).saturating_sub(known);
                        let out = tokens(50_000 + known as u32, grow);
                        m.append_token_ids(id, &out).unwrap();
                    }
                    if running[i] {
                        let known = m.request(id).unwrap().num_tokens();
                        m.cache_blocks(id, processed.min(known)).unwrap();
                    }
                }
                AsyncOp::Free { i } => {
                    m.free(ids[i]).unwrap();
                    running[i] = false;
                    computed[i] = 0;
                    in_flight[i].clear();
                }
            }
            prop_assert!(m.num_free_blocks() < num_blocks);
        }
        for id in ids {
            m.free(id).unwrap();
        }
        prop_assert_eq!(m.num_free_blocks(), num_blocks - 1);
    }
}

// ----- prompt-tail keys of full-attention blocks larger than the hash block ---------------------

/// Full attention of block 32 beside a sliding window of block 16: hashes every 16 tokens, hits
/// at 32.
fn full32_swa16(eagle: bool) -> KVCacheManager {
    let mut c = config(
        vec![GroupSpec::full(32), GroupSpec::sliding_window(16, 32)],
        64,
        Some(0),
    );
    c.enable_events = true;
    c.use_eagle = eagle;
    KVCacheManager::new(&c).unwrap()
}

fn stored(events: &[KvEvent], group: GroupId) -> Vec<(Vec<BlockHash>, u32, usize, usize)> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                block_size,
                group_id,
                first_block,
                token_ids,
                ..
            } if *group_id == group => Some((
                block_hashes.clone(),
                *block_size,
                *first_block,
                token_ids.len(),
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn a_full_block_larger_than_the_hash_block_is_also_keyed_at_the_prompt_tail_inside_it() {
    // 56-token prompt: the last hash boundary a resend can match is 55 // 16 * 16 = 48, inside
    // full block 1 (tokens 32..64). Hybrid caching stops at multiples of 32, so the key at 48 is
    // added once block 1 is cached whole (64 computed tokens), beside its own key.
    let mut m = full32_swa16(false);
    m.add_request("a", &tokens(0, 56), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &chunk(56, 0)).unwrap().unwrap();
    let block1 = new[0][1];
    let hashes = |m: &KVCacheManager| m.request("a").unwrap().block_hashes().to_vec();
    assert_eq!(m.pool().block_keys(block1).unwrap(), vec![]);
    m.take_events();
    for t in 56..64u32 {
        m.append_token_ids("a", &[1000 + t]).unwrap();
        m.allocate_slots("a", &chunk(1, t as usize + 1))
            .unwrap()
            .unwrap();
    }
    m.cache_blocks("a", 64).unwrap();
    let h = hashes(&m);
    let key = |i: usize| CacheKey {
        hash: h[i],
        group: 0,
    };
    assert_eq!(m.pool().block_keys(block1).unwrap(), vec![key(3), key(2)]);
    // Published as vLLM does: the whole block, then one hash block ending at 48 (parent: the
    // hash at 32).
    let events = m.take_events();
    assert_eq!(
        stored(&events, 0),
        vec![(vec![h[3]], 32, 1, 32), (vec![h[2]], 16, 2, 16)]
    );
    let parent = events.iter().rev().find_map(|e| match e {
        KvEvent::BlockStored {
            group_id: 0,
            parent_block_hash,
            ..
        } => Some(*parent_block_hash),
        _ => None,
    });
    assert_eq!(parent, Some(Some(h[1])));
    // Caching again adds nothing; the tail key is never a hit of its own (hits are whole
    // blocks): a 48-token prefix hits one block.
    m.cache_blocks("a", 64).unwrap();
    assert!(stored(&m.take_events(), 0).is_empty());
    m.add_request("b", &tokens(0, 49), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 32);
    // Freed, the block is cached (back of the free order); reused, both keys go, its own first.
    m.free("a").unwrap();
    assert_eq!(m.pool().free_order().last(), Some(&new[0][0]));
    let keys_before = m.num_cached_keys();
    let all = m.pool().num_free_blocks();
    let taken = m.pool().get_new_blocks(all).unwrap();
    assert!(taken.contains(&block1));
    let removed: Vec<BlockHash> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved {
                block_hash,
                group_id: 0,
                ..
            } => Some(block_hash),
            _ => None,
        })
        .collect();
    let at = removed.iter().position(|&x| x == h[3]).unwrap();
    assert_eq!(removed[at + 1], h[2]);
    assert!(keys_before >= 3);
    assert_eq!(m.num_cached_keys(), 0);
}

#[test]
fn the_prompt_tail_key_sits_at_the_last_boundary_a_resend_can_match() {
    // 40-token prompt (+ outputs): boundary 39 // 16 * 16 = 32 is a whole-block boundary, no
    // tail key; 56 tokens: 48. EAGLE reads the whole prompt: a 64-token prompt's boundary is
    // 64 (a whole block), without EAGLE 48.
    for (eagle, prompt, tail) in [
        (false, 40, None),
        (false, 56, Some(48)),
        (false, 64, Some(48)),
        (true, 64, None),
        (true, 56, Some(48)),
    ] {
        let mut m = full32_swa16(eagle);
        m.add_request("a", &tokens(0, prompt), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &chunk(prompt, 0)).unwrap().unwrap();
        let mut computed = prompt;
        while computed < 96 {
            // Decode: the sampled token is known, its KV not yet computed.
            m.append_token_ids("a", &[2000 + computed as u32]).unwrap();
            m.allocate_slots("a", &chunk(1, computed)).unwrap().unwrap();
            computed += 1;
        }
        m.cache_blocks("a", 96).unwrap();
        let h = m.request("a").unwrap().block_hashes().to_vec();
        let table = m.block_ids("a", 0).unwrap().to_vec();
        let expected: Vec<usize> = match tail {
            Some(b) => vec![b / 16 - 1],
            None => vec![],
        };
        let extra: Vec<usize> = table
            .iter()
            .flat_map(|&b| m.pool().block_keys(b).unwrap().into_iter().skip(1))
            .map(|k| h.iter().position(|&x| x == k.hash).unwrap())
            .collect();
        assert_eq!(extra, expected, "eagle {eagle}, prompt {prompt}");
        let full_keys: usize = table
            .iter()
            .map(|&b| m.pool().block_keys(b).unwrap().len())
            .sum();
        assert_eq!(
            full_keys,
            3 + expected.len(),
            "eagle {eagle}, prompt {prompt}"
        );
    }
}
