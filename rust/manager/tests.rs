use super::*;
use crate::types::{BlockHash, GroupId, StoreInfo};
use proptest::prelude::*;

/// A dense-retention config (every full block of every group cached): the classic design the
/// tests below pin down. Sparse retention has its own tests.
fn config(groups: Vec<GroupSpec>, num_blocks: usize) -> ManagerConfig {
    ManagerConfig::new(groups, num_blocks, 4096).dense()
}

fn manager(groups: Vec<GroupSpec>, num_blocks: usize) -> KVCacheManager {
    KVCacheManager::new(&config(groups, num_blocks)).unwrap()
}

/// A manager holding one request "r" with a prompt of tokens `0..prompt_len`.
fn manager_with_r(groups: Vec<GroupSpec>, num_blocks: usize, prompt_len: usize) -> KVCacheManager {
    let mut m = manager(groups, num_blocks);
    m.add_request("r", &tokens(0, prompt_len), ExtraKeys::default())
        .unwrap();
    m
}

fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

fn new_tokens(n: usize, computed: usize) -> AllocateArgs<'static> {
    AllocateArgs {
        num_new_tokens: n,
        num_computed_tokens: computed,
        ..Default::default()
    }
}

/// Admits a waiting request the way a scheduler does: look up, then allocate the rest.
fn admit(m: &mut KVCacheManager, id: &str) -> Option<(usize, Vec<Vec<BlockId>>)> {
    admit_up_to(m, id, usize::MAX).map(|(hit, _, blocks)| (hit, blocks))
}

/// Admits a waiting request with a first chunk of at most `max_new` (at least 1) tokens after
/// its hit: `(hit tokens, chunk tokens, new blocks)`.
fn admit_up_to(
    m: &mut KVCacheManager,
    id: &str,
    max_new: usize,
) -> Option<(usize, usize, Vec<Vec<BlockId>>)> {
    let hit = m.get_computed_blocks(id).unwrap();
    let n = (m.request(id).unwrap().num_tokens() - hit.num_computed_tokens).min(max_new.max(1));
    let args = AllocateArgs {
        num_new_tokens: n,
        num_new_computed_tokens: hit.num_computed_tokens,
        new_computed_blocks: Some(&hit),
        full_sequence_must_fit: true,
        ..Default::default()
    };
    m.allocate_slots(id, &args)
        .unwrap()
        .map(|b| (hit.num_computed_tokens, n, b))
}

/// A coordinator for `groups` with the given scheduler and hash block sizes.
fn finder(
    groups: &[GroupSpec],
    scheduler_block_size: usize,
    hash_block_size: usize,
) -> Coordinator {
    let config = ManagerConfig::new(groups.to_vec(), 4096, 4096);
    Coordinator::new(&config, scheduler_block_size, hash_block_size).unwrap()
}

fn non_null(ids: &[BlockId]) -> usize {
    ids.iter().filter(|&&b| b != NULL_BLOCK).count()
}

/// A pool where the blocks at `positions` are cached under `hash(i) = i + 1` in `group`.
fn pool_with_cached(num_blocks: usize, positions: &[usize], group: GroupId) -> BlockPool {
    let pool = BlockPool::new(num_blocks).unwrap();
    let blocks = pool.get_new_blocks(positions.len()).unwrap();
    let hashes: Vec<BlockHash> = positions
        .iter()
        .map(|&i| BlockHash(i as u128 + 1))
        .collect();
    pool.cache_full_blocks(&blocks, &hashes, group, StoreInfo::default())
        .unwrap();
    pool.free_blocks(&blocks).unwrap();
    pool
}

fn chain(n: usize) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(i as u128 + 1)).collect()
}

// ----- per-attention-type hit rules ---------------------------------------------------------

#[test]
fn sliding_window_hit_scans_right_to_left() {
    // DESIGN.md: window 4, block size 1, 15-token prompt. A hit at L needs tokens L-3..L-1
    // cached; candidates 5, 6 and 14: the rightmost (14) wins, only token 14 is recomputed.
    let groups = [GroupSpec::sliding_window(1, 4)];
    let finder = finder(&groups, 1, 1);
    let pool = pool_with_cached(16, &[2, 3, 4, 5, 11, 12, 13], 0);
    let mut out = Vec::new();
    let hit = finder.find(&pool, &chain(15), 14, &mut out);
    assert_eq!(hit.tokens, 14);
    assert_eq!(non_null(&out[0]), 3);
    assert_eq!(out[0].len(), 14);
    assert!(out[0][..11].iter().all(|&b| b == NULL_BLOCK));

    // Without block 12 the best hit is 6 (blocks 3, 4, 5).
    let pool = pool_with_cached(16, &[2, 3, 4, 5, 11, 13], 0);
    let hit = finder.find(&pool, &chain(15), 14, &mut out);
    assert_eq!(hit.tokens, 6);
    assert_eq!(out[0].len(), 6);
    assert_eq!(non_null(&out[0]), 3);
}

#[test]
fn sliding_window_run_reaching_the_first_block_is_a_hit_even_if_short() {
    let groups = [GroupSpec::sliding_window(1, 4)];
    let finder = finder(&groups, 1, 1);
    let pool = pool_with_cached(16, &[0, 1], 0);
    let mut out = Vec::new();
    assert_eq!(finder.find(&pool, &chain(15), 14, &mut out).tokens, 2);
}

#[test]
fn full_attention_hit_scans_left_to_right_and_stops_at_first_miss() {
    let groups = [GroupSpec::full(1)];
    let finder = finder(&groups, 1, 1);
    let pool = pool_with_cached(16, &[0, 1, 2, 4, 5, 6], 0);
    let mut out = Vec::new();
    assert_eq!(finder.find(&pool, &chain(10), 9, &mut out).tokens, 3);
    assert_eq!(out[0].len(), 3);
}

#[test]
fn chunked_local_hit_skips_blocks_before_the_current_chunk() {
    // vLLM's example: chunk 8, block size 4, max length 15: tokens 0-7 are outside the local
    // window (null blocks), block 2 (tokens 8-11) is looked up.
    let groups = [GroupSpec::chunked_local(4, 8)];
    let finder = finder(&groups, 4, 4);
    let mut out = Vec::new();
    let pool = pool_with_cached(8, &[2], 0);
    let hit = finder.find(&pool, &chain(4), 15, &mut out);
    assert_eq!(hit.tokens, 12);
    assert_eq!(out[0][..2], [NULL_BLOCK, NULL_BLOCK]);
    assert_ne!(out[0][2], NULL_BLOCK);
    let pool = pool_with_cached(8, &[], 0);
    assert_eq!(finder.find(&pool, &chain(4), 15, &mut out).tokens, 8);
    // Max length 16: everything before token 16 is outside the window.
    assert_eq!(finder.find(&pool, &chain(4), 16, &mut out).tokens, 16);
    assert_eq!(out[0], vec![NULL_BLOCK; 4]);
}

#[test]
fn hybrid_hit_is_the_sliding_window_hit_within_the_full_hit() {
    // Full attention cached blocks 0..6; sliding window (need 2 blocks) only 0..2 and 4..5.
    let groups = [GroupSpec::full(1), GroupSpec::sliding_window(1, 3)];
    let finder = finder(&groups, 1, 1);
    let pool = BlockPool::new(32).unwrap();
    let cache = |positions: &[usize], group| {
        let blocks = pool.get_new_blocks(positions.len()).unwrap();
        let hashes: Vec<_> = positions
            .iter()
            .map(|&i| BlockHash(i as u128 + 1))
            .collect();
        pool.cache_full_blocks(&blocks, &hashes, group, StoreInfo::default())
            .unwrap();
    };
    cache(&[0, 1, 2, 3, 4, 5, 6], 0);
    cache(&[0, 1, 2, 4, 5], 1);
    let mut out = Vec::new();
    let hit = finder.find(&pool, &chain(10), 9, &mut out);
    // Full hit 7; SWA within 7: blocks 4, 5 → 6.
    assert_eq!(hit.tokens, 6);
    assert_eq!(hit.uncached_common, 1);
    assert_eq!(out[0].len(), 6);
    assert_eq!(out[1], [0, 0, 0, 0, out[1][4], out[1][5]]);
}

#[test]
fn groups_with_identical_specs_hit_only_where_all_are_cached() {
    let groups = [
        GroupSpec::sliding_window(1, 3),
        GroupSpec::sliding_window(1, 3),
        GroupSpec::full(1),
    ];
    let finder = finder(&groups, 1, 1);
    let pool = BlockPool::new(64).unwrap();
    let cache = |positions: &[usize], group| {
        let blocks = pool.get_new_blocks(positions.len()).unwrap();
        let hashes: Vec<_> = positions
            .iter()
            .map(|&i| BlockHash(i as u128 + 1))
            .collect();
        pool.cache_full_blocks(&blocks, &hashes, group, StoreInfo::default())
            .unwrap();
    };
    cache(&[0, 1, 2, 3, 4, 5, 6, 7], 2);
    cache(&[0, 1, 2, 3, 4, 5, 6, 7], 0);
    cache(&[0, 1, 2, 3, 5], 1);
    let mut out = Vec::new();
    assert_eq!(finder.find(&pool, &chain(10), 9, &mut out).tokens, 4);
}

#[test]
fn fixed_point_loop_rechecks_every_type_at_the_reduced_length() {
    // Full + sliding window + chunked local (3 spec groups: not the simple hybrid). The chunked
    // group lowers the candidate to 8 tokens; the sliding window must re-check at 8.
    let groups = [
        GroupSpec::full(4),
        GroupSpec::sliding_window(4, 5),
        GroupSpec::chunked_local(4, 8),
    ];
    let finder = finder(&groups, 4, 4);
    let pool = BlockPool::new(64).unwrap();
    let cache = |positions: &[usize], group| {
        let blocks = pool.get_new_blocks(positions.len()).unwrap();
        let hashes: Vec<_> = positions
            .iter()
            .map(|&i| BlockHash(i as u128 + 1))
            .collect();
        pool.cache_full_blocks(&blocks, &hashes, group, StoreInfo::default())
            .unwrap();
    };
    cache(&[0, 1, 2, 3, 4], 0);
    cache(&[0, 1, 2, 3, 4], 1);
    cache(&[0, 1], 2); // chunk 8 = 2 blocks; block 2 (chunk 1) missing
    let mut out = Vec::new();
    let hit = finder.find(&pool, &chain(6), 20, &mut out);
    // Full: 20 → 5 blocks; SWA at 20: blocks 3, 4 → 20; chunked at 20: start block 4,
    // block 4 missing... cached? No: only 0, 1 → hit 16 (nulls); SWA at 16 → 16; chunked at 16
    // → 16. Stable at 16.
    assert_eq!(hit.tokens, 16);
    assert_eq!(out[0].len(), 4);
    assert_eq!(out[1].len(), 4);
    assert_eq!(out[2], vec![NULL_BLOCK; 4]);
}

#[test]
fn hit_is_a_multiple_of_the_scheduler_block_size_with_mixed_block_sizes() {
    // Full attention at 32 tokens per block, sliding window at 16: hashes at 16, hits at 32.
    let groups = [GroupSpec::full(32), GroupSpec::sliding_window(16, 32)];
    let mut m = manager(groups.to_vec(), 64);
    assert_eq!((m.scheduler_block_size(), m.hash_block_size()), (32, 16));
    m.add_request("a", &tokens(0, 112), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    // Cached up to the lcm boundary 96: 3 full blocks, 6 sliding-window blocks (need 2 ≥ 2
    // blocks per boundary: all reachable).
    assert_eq!(m.num_cached_keys(), 9);
    m.add_request("b", &tokens(0, 112), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 96);
    assert_eq!(hit.blocks[0].len(), 3);
    assert_eq!(hit.blocks[1].len(), 6);
}

#[test]
fn sliding_window_caches_only_blocks_reachable_at_alignment_boundaries() {
    // Window 16 needs 1 block; hits end on 32-token boundaries: only odd blocks are useful.
    let groups = [GroupSpec::full(32), GroupSpec::sliding_window(16, 16)];
    let mut m = manager(groups.to_vec(), 64);
    m.add_request("a", &tokens(0, 128), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    // 128 tokens: full 4 blocks (block 3 keyed again at the prompt's last hash boundary a
    // resend can match, 127 // 16 * 16 = 112), SWA blocks 1, 3, 5, 7.
    assert_eq!(m.num_cached_keys(), 9);
    m.add_request("b", &tokens(0, 129), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 128);
}

// ----- allocation ---------------------------------------------------------------------------

#[test]
fn design_worked_example_full_and_two_sliding_window_groups() {
    // Block size 16, window 32, 112 tokens: full attention holds 7 blocks, each sliding-window
    // group 2 (the tokens still in its window); 11 blocks in all.
    let groups = vec![
        GroupSpec::full(16),
        GroupSpec::sliding_window(16, 32),
        GroupSpec::sliding_window(16, 32),
    ];
    let mut m = manager_with_r(groups, 64, 112);
    let new = m.allocate_slots("r", &new_tokens(112, 0)).unwrap().unwrap();
    assert_eq!(new.iter().map(Vec::len).collect::<Vec<_>>(), [7, 7, 7]);
    m.remove_skipped_blocks("r", 112, None).unwrap();
    let held: Vec<usize> = (0..3)
        .map(|g| non_null(m.block_ids("r", g).unwrap()))
        .collect();
    assert_eq!(held, [7, 2, 2]);
    assert_eq!(m.block_ids("r", 1).unwrap()[..5], [NULL_BLOCK; 5]);
    assert_eq!(m.num_free_blocks(), 63 - 11);
}

#[test]
fn remove_skipped_blocks_takes_counts_past_the_known_tokens_up_to_the_model_length() {
    // vLLM's scheduler passes the finished request's processed count by request id; tokens
    // appended since the request's last call are not known here yet.
    let groups = vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)];
    let mut m = manager_with_r(groups, 64, 80);
    m.allocate_slots("r", &new_tokens(80, 0)).unwrap().unwrap();
    // 100 processed tokens, 80 known: the window (32) starts at token 69, so the blocks of
    // tokens 0..64 are skipped.
    m.remove_skipped_blocks("r", 100, None).unwrap();
    assert_eq!(m.block_ids("r", 1).unwrap()[..4], [NULL_BLOCK; 4]);
    assert_ne!(m.block_ids("r", 1).unwrap()[4], NULL_BLOCK);
    assert_eq!(non_null(m.block_ids("r", 0).unwrap()), 5);
    let max_model_len = m.max_model_len();
    let err = m.remove_skipped_blocks("r", max_model_len + 1, None);
    assert!(matches!(err, Err(CoreError::OutOfRange(_))), "{err:?}");
    assert_ne!(m.block_ids("r", 1).unwrap()[4], NULL_BLOCK);
}

#[test]
fn decode_frees_blocks_that_slide_out_of_the_window() {
    let groups = vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)];
    let mut m = manager_with_r(groups, 64, 112);
    m.allocate_slots("r", &new_tokens(112, 0)).unwrap().unwrap();
    m.append_token_ids("r", &[7u32]).unwrap();
    let new = m.allocate_slots("r", &new_tokens(1, 112)).unwrap().unwrap();
    assert_eq!(new.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1]);
    // 112 computed: tokens 0..80 (5 blocks) are outside the window of token 112.
    assert_eq!(non_null(m.block_ids("r", 1).unwrap()), 3);
    assert_eq!(m.num_free_blocks(), 63 - 8 - 3);
}

#[test]
fn get_computed_blocks_caps_the_hit_at_num_tokens_minus_one() {
    let mut m = manager(vec![GroupSpec::full(16)], 64);
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    m.add_request("b", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    // 4 full blocks cached, but the last token must be recomputed: 3 blocks.
    assert_eq!(hit.num_computed_tokens, 48);
    assert_eq!(hit.blocks[0].len(), 3);
    // Lookups do not take references.
    assert_eq!(m.pool().ref_count(hit.blocks[0][0]).unwrap(), 1);
}

#[test]
fn admitting_a_hit_touches_the_cached_blocks_and_shares_them() {
    let mut m = manager(vec![GroupSpec::full(16)], 64);
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    m.free("a").unwrap();
    let free_before = m.num_free_blocks();
    m.add_request("b", &tokens(0, 70), ExtraKeys::default())
        .unwrap();
    let (hit, new) = admit(&mut m, "b").unwrap();
    assert_eq!(hit, 64);
    assert_eq!(new[0].len(), 1);
    let table = m.block_ids("b", 0).unwrap().to_vec();
    assert_eq!(table.len(), 5);
    for &b in &table {
        assert_eq!(m.pool().ref_count(b).unwrap(), 1);
    }
    // The 4 revived blocks and the new one left the free count.
    assert_eq!(m.num_free_blocks(), free_before - 5);
}

#[test]
fn cache_salt_isolates_tenants() {
    let mut m = manager(vec![GroupSpec::full(16)], 64);
    let salted = |s: &str| ExtraKeys::new(Some(s.into()), None, vec![]).unwrap();
    m.add_request("a", &tokens(0, 64), salted("t1")).unwrap();
    admit(&mut m, "a").unwrap();
    m.add_request("b", &tokens(0, 64), salted("t2")).unwrap();
    assert_eq!(m.get_computed_blocks("b").unwrap().num_computed_tokens, 0);
    m.add_request("c", &tokens(0, 64), salted("t1")).unwrap();
    assert_eq!(m.get_computed_blocks("c").unwrap().num_computed_tokens, 48);
}

#[test]
fn allocate_slots_is_all_or_nothing_when_out_of_blocks() {
    let mut m = manager(vec![GroupSpec::full(16), GroupSpec::full(16)], 9);
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    m.add_request("b", &tokens(100, 64), ExtraKeys::default())
        .unwrap();
    assert!(admit(&mut m, "a").is_some()); // 8 blocks: the pool is full
    let free = m.num_free_blocks();
    assert_eq!(m.allocate_slots("b", &new_tokens(16, 0)).unwrap(), None);
    assert_eq!(m.num_free_blocks(), free);
    assert!(m.block_ids("b", 0).unwrap().is_empty());
    // A running request that needs a new block fails the same way.
    m.append_token_ids("a", &[1u32]).unwrap();
    assert_eq!(m.allocate_slots("a", &new_tokens(1, 64)).unwrap(), None);
    assert_eq!(m.block_ids("a", 0).unwrap().len(), 4);
}

#[test]
fn evictable_hit_blocks_count_against_free_blocks() {
    // 64 cached tokens (4 blocks, free but cached), pool of 5 usable blocks.
    let mut m = manager(vec![GroupSpec::full(16)], 6);
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    m.free("a").unwrap();
    assert_eq!(m.num_free_blocks(), 5);
    // 80 tokens: hit 64 (4 evictable blocks, touching takes them out of the free count) + 1
    // new block = 5 ≤ 5 free: fits.
    m.add_request("b", &tokens(0, 80), ExtraKeys::default())
        .unwrap();
    let (hit, new) = admit(&mut m, "b").unwrap();
    assert_eq!(hit, 64);
    assert_eq!(new[0].len(), 1);
    m.free("b").unwrap();
    // 97 tokens: hit 80 (5 evictable blocks) + 2 new blocks = 7 > 5 free.
    m.add_request("c", &tokens(0, 97), ExtraKeys::default())
        .unwrap();
    assert!(admit(&mut m, "c").is_none());
}

#[test]
fn watermark_holds_blocks_back_from_waiting_requests_only() {
    let mut c = config(vec![GroupSpec::full(16)], 10);
    c.watermark = 0.3; // 3 blocks
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(0, 100), ExtraKeys::default())
        .unwrap();
    let mut args = new_tokens(100, 0);
    args.has_scheduled_reqs = true;
    // 7 blocks + 3 watermark > 9 free.
    assert_eq!(m.allocate_slots("a", &args).unwrap(), None);
    args.has_scheduled_reqs = false;
    assert!(m.allocate_slots("a", &args).unwrap().is_some());
    // Running: no watermark.
    m.append_token_ids("a", &tokens(0, 20)).unwrap();
    let mut args = new_tokens(20, 100);
    args.has_scheduled_reqs = true;
    assert!(m.allocate_slots("a", &args).unwrap().is_some());
    assert_eq!(m.num_free_blocks(), 1);
}

#[test]
fn lookahead_tokens_get_slots_but_are_never_cached() {
    let mut m = manager_with_r(vec![GroupSpec::full(16)], 64, 32);
    let args = AllocateArgs {
        num_new_tokens: 32,
        num_lookahead_tokens: 16,
        ..Default::default()
    };
    let new = m.allocate_slots("r", &args).unwrap().unwrap();
    assert_eq!(new[0].len(), 3);
    assert_eq!(m.num_cached_keys(), 2);
}

#[test]
fn delay_cache_blocks_skips_caching() {
    let mut m = manager_with_r(vec![GroupSpec::full(16)], 64, 32);
    let args = AllocateArgs {
        num_new_tokens: 32,
        delay_cache_blocks: true,
        ..Default::default()
    };
    m.allocate_slots("r", &args).unwrap().unwrap();
    assert_eq!(m.num_cached_keys(), 0);
}

#[test]
fn free_returns_uncached_blocks_tail_first_to_the_front() {
    let mut m = manager_with_r(vec![GroupSpec::full(16)], 8, 40);
    let args = AllocateArgs {
        num_new_tokens: 40,
        delay_cache_blocks: true,
        ..Default::default()
    };
    let new = m.allocate_slots("r", &args).unwrap().unwrap();
    assert_eq!(new[0], [1, 2, 3]);
    m.free("r").unwrap();
    assert_eq!(m.pool().free_order(), [3, 2, 1, 4, 5, 6, 7]);
}

#[test]
fn free_puts_cached_blocks_at_the_back_tail_first() {
    let mut m = manager_with_r(vec![GroupSpec::full(16)], 8, 48);
    m.allocate_slots("r", &new_tokens(48, 0)).unwrap().unwrap();
    m.free("r").unwrap();
    // Tail evicted first.
    assert_eq!(m.pool().free_order(), [4, 5, 6, 7, 3, 2, 1]);
}

#[test]
fn admission_cap_bounds_the_sliding_window_share_of_the_full_sequence_check() {
    // Window 32, block 16, 16 tokens in flight: a request holds at most cdiv(31 + 16, 16) + 1
    // = 4 sliding-window blocks. A 160-token prompt needs 10 full + 4 window blocks = 14.
    let groups = vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)];
    for (num_blocks, fits) in [(15, true), (14, false)] {
        let mut c = config(groups.clone(), num_blocks);
        c.max_in_flight_tokens = Some(16);
        let mut m = KVCacheManager::new(&c).unwrap();
        m.add_request("r", &tokens(0, 160), ExtraKeys::default())
            .unwrap();
        let args = AllocateArgs {
            num_new_tokens: 16,
            full_sequence_must_fit: true,
            ..Default::default()
        };
        assert_eq!(m.allocate_slots("r", &args).unwrap().is_some(), fits);
    }
}

#[test]
fn mamba_none_mode_holds_one_state_block_and_needs_caching_off() {
    // vLLM without prefix caching: Mamba block size = max_model_len, one state block.
    let groups = vec![GroupSpec::full(16), GroupSpec::mamba_none(4096)];
    let mut c = config(groups.clone(), 64);
    assert!(matches!(
        KVCacheManager::new(&c),
        Err(CoreError::InvalidConfig(msg)) if msg.contains("align")
    ));
    c.enable_caching = false;
    let mut m = KVCacheManager::new(&c).unwrap();
    assert_eq!(m.scheduler_block_size(), 4096);
    m.add_request("a", &tokens(0, 100), ExtraKeys::default())
        .unwrap();
    let (hit, new) = admit(&mut m, "a").unwrap();
    assert_eq!(hit, 0);
    assert_eq!(new.iter().map(Vec::len).collect::<Vec<_>>(), [7, 1]);
    for step in 0..40 {
        m.append_token_ids("a", &[1u32]).unwrap();
        m.allocate_slots("a", &new_tokens(1, 100 + step))
            .unwrap()
            .unwrap();
        assert_eq!(non_null(m.block_ids("a", 1).unwrap()), 1);
    }
}

#[test]
fn mamba_none_mode_adds_speculative_blocks() {
    // vLLM allocates 1 + num_speculative_blocks state blocks: M(16, none, spec=2) at 40
    // tokens holds cdiv(40 + 2 * 16, 16) = 5 blocks.
    let groups = vec![GroupSpec::mamba_with(16, MambaMode::None, 2)];
    let mut c = config(groups, 64);
    c.enable_caching = false;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(0, 40), ExtraKeys::default())
        .unwrap();
    let new = m.allocate_slots("a", &new_tokens(40, 0)).unwrap().unwrap();
    assert_eq!(new[0].len(), 5);
}

#[test]
fn no_prefix_cache_coordinator_never_hits_or_caches() {
    let mut c = config(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
    );
    c.enable_caching = false;
    let mut m = KVCacheManager::new(&c).unwrap();
    assert_eq!(m.coordinator_kind(), CoordinatorKind::NoPrefixCache);
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    assert_eq!(m.num_cached_keys(), 0);
    m.add_request("b", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.blocks, vec![Vec::<BlockId>::new(), Vec::new()]);
    assert_eq!(
        (hit.num_computed_tokens, hit.shared_prefix_boundary),
        (0, 0)
    );
}

#[test]
fn preempted_request_is_readmitted_from_its_cached_prefix() {
    let mut m = manager(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
    );
    m.add_request("a", &tokens(0, 100), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    m.append_token_ids("a", &[5u32]).unwrap();
    m.free("a").unwrap();
    let (hit, _) = admit(&mut m, "a").unwrap();
    assert_eq!(hit, 96);
    m.record_prefix_cache_stats("a", hit, true).unwrap();
    let s = m.take_prefix_cache_stats();
    assert_eq!(
        (s.requests, s.preempted_requests, s.preempted_hits),
        (0, 1, 96)
    );
    assert_eq!(m.prefix_cache_stats(), PrefixCacheStats::default());
}

#[test]
fn reset_prefix_cache_is_refused_while_blocks_are_in_use() {
    let mut m = manager(vec![GroupSpec::full(16)], 16);
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    assert!(!m.reset_prefix_cache());
    m.remove_request("a").unwrap();
    assert!(m.reset_prefix_cache());
    assert_eq!(m.num_cached_keys(), 0);
    assert!(m.prefix_cache_stats().reset);
}

/// Caches a 16-token prompt in a full group of 4-token blocks (6 blocks), then looks up `b`,
/// the same prompt plus one token: a hit of 16 tokens, not yet adopted.
fn stale_hit_setup() -> (KVCacheManager, ComputedBlocks) {
    let mut m = manager(vec![GroupSpec::full(4)], 6);
    m.add_request("a", &tokens(0, 16), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    m.remove_request("a").unwrap();
    m.add_request("b", &tokens(0, 17), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 16);
    (m, hit)
}

/// Adopts `hit` for `b`; returns the refusal's cause and message.
fn adopt_stale(m: &mut KVCacheManager, hit: &ComputedBlocks) -> (HitLoss, String) {
    let args = AllocateArgs {
        num_new_tokens: 1,
        num_new_computed_tokens: 16,
        new_computed_blocks: Some(hit),
        ..Default::default()
    };
    match m.allocate_slots("b", &args) {
        Err(e @ CoreError::HitEvicted { cause, .. }) => (cause, e.to_string()),
        other => panic!("expected a stale hit, got {other:?}"),
    }
}

#[test]
fn a_hit_stale_after_a_reset_says_the_cache_was_reset() {
    let (mut m, hit) = stale_hit_setup();
    assert!(m.reset_prefix_cache());
    let (cause, msg) = adopt_stale(&mut m, &hit);
    assert_eq!(cause, HitLoss::Reset);
    assert!(
        msg.contains("reset_prefix_cache cleared the prefix cache"),
        "{msg}"
    );
    assert!(!msg.contains("evicted"), "{msg}");
}

#[test]
fn a_hit_stale_after_its_blocks_were_reused_says_evicted_and_reused() {
    let (mut m, hit) = stale_hit_setup();
    m.add_request("c", &tokens(1000, 20), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "c").unwrap(); // every free block, the hit's among them
    let (cause, msg) = adopt_stale(&mut m, &hit);
    assert_eq!(cause, HitLoss::Reused);
    assert!(
        msg.contains("was evicted and reused since get_computed_blocks"),
        "{msg}"
    );
}

#[test]
fn a_hit_stale_after_a_connector_invalidation_says_evicted_only() {
    let (mut m, hit) = stale_hit_setup();
    m.evict_blocks(&hit.blocks()[0]).unwrap();
    let (cause, msg) = adopt_stale(&mut m, &hit);
    assert_eq!(cause, HitLoss::Evicted);
    assert!(
        msg.contains("was evicted since get_computed_blocks"),
        "{msg}"
    );
}

#[test]
fn a_handle_names_its_request_until_removed_and_a_reused_slot_gets_a_new_one() {
    let mut m = manager(vec![GroupSpec::full(16)], 32);
    let a = m
        .add_request("a", &tokens(0, 40), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.handle("a").unwrap(), a);
    let b = m
        .add_request("b", &tokens(100, 20), ExtraKeys::default())
        .unwrap();
    assert_ne!(a, b);
    // Calls by handle and by id act on the same request.
    m.allocate_slots(a, &new_tokens(40, 0)).unwrap().unwrap();
    assert_eq!(m.block_ids("a", 0).unwrap().len(), 3);
    m.append_token_ids(a, &[1u32]).unwrap();
    assert_eq!(m.request("a").unwrap().num_tokens(), 41);
    m.remove_request(a).unwrap();
    assert!(!m.contains_request("a"));
    assert_eq!(m.num_free_blocks(), 31);
    // The removed request's handle is stale, also once its slot holds another request.
    let c = m
        .add_request("c", &tokens(200, 20), ExtraKeys::default())
        .unwrap();
    assert_ne!(c, a);
    for err in [
        m.allocate_slots(a, &new_tokens(1, 40)).map(|_| ()),
        m.free(a),
        m.append_token_ids(a, &[2u32]),
        m.remove_request(a).map(|_| ()),
    ] {
        assert!(matches!(err, Err(CoreError::StaleHandle { .. })), "{err:?}");
    }
    assert_eq!(m.handle("c").unwrap(), c);
    assert_eq!(m.handle("b").unwrap(), b);
    assert_eq!(m.num_requests(), 2);
    assert!(m.handle("a").is_err());
}

#[test]
fn events_report_stored_blocks_per_group() {
    let mut c = config(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
    );
    c.enable_events = true;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(0, 40), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    let events = m.take_events();
    let stored: Vec<(GroupId, usize)> = events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                group_id,
                token_ids,
                ..
            } => {
                assert_eq!(token_ids.len(), 32);
                Some((*group_id, block_hashes.len()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(stored, [(0, 2), (1, 2)]);
}

// ----- block tables -------------------------------------------------------------------------

#[test]
fn write_block_table_fills_one_row_per_request() {
    let mut m = manager(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 16)],
        64,
    );
    m.add_request("a", &tokens(0, 40), ExtraKeys::default())
        .unwrap();
    m.add_request("b", &tokens(500, 20), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &new_tokens(40, 0)).unwrap().unwrap();
    m.allocate_slots("b", &new_tokens(20, 0)).unwrap().unwrap();
    let mut out = vec![-1i32; 2 * 4];
    m.write_block_table(&["b", "a"], 0, &mut out, 4).unwrap();
    let a: Vec<i32> = m
        .block_ids("a", 0)
        .unwrap()
        .iter()
        .map(|&b| b as i32)
        .collect();
    let b: Vec<i32> = m
        .block_ids("b", 0)
        .unwrap()
        .iter()
        .map(|&b| b as i32)
        .collect();
    assert_eq!(out[..2], b[..]);
    assert_eq!(out[2..4], [-1, -1]);
    assert_eq!(out[4..7], a[..]);
    // Bad calls write nothing.
    let before = out.clone();
    assert!(m.write_block_table(&["a", "zzz"], 0, &mut out, 4).is_err());
    assert!(m.write_block_table(&["a"], 0, &mut out, 2).is_err());
    assert!(m
        .write_block_table(&["a", "b", "a"], 0, &mut out, 4)
        .is_err());
    assert!(m.write_block_table(&["a"], 2, &mut out, 4).is_err());
    assert_eq!(out, before);
}

// ----- bad input ----------------------------------------------------------------------------

fn is_invalid<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(CoreError::InvalidArgument(_)))
}

fn is_out_of_range<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(CoreError::OutOfRange(_)))
}

fn is_unknown<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(CoreError::UnknownRequest(_)))
}

/// A hit goes without a block-by-block check only while it is its request's own lookup and no
/// key has left any block since (the pool counts removals, whoever makes them). Otherwise it is
/// checked, which accepts it when its blocks are still the prompt's and refuses it, changing
/// nothing, when they are not.
#[test]
fn a_hit_is_checked_again_once_a_key_left_a_block_or_its_request_changed() {
    let groups = vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)];
    let mut m = manager(groups, 64);
    for (id, start) in [("a", 0), ("y", 7000), ("z", 5000)] {
        m.add_request(id, &tokens(start, 64), ExtraKeys::default())
            .unwrap();
        admit(&mut m, id).unwrap();
        m.free(id).unwrap();
    }
    fn adopt(hit: &ComputedBlocks) -> AllocateArgs<'_> {
        AllocateArgs {
            num_new_tokens: 16,
            num_new_computed_tokens: hit.num_computed_tokens,
            new_computed_blocks: Some(hit),
            ..Default::default()
        }
    }
    let z_block = {
        m.add_request("z2", &tokens(5000, 64), ExtraKeys::default())
            .unwrap();
        let hit = m.get_computed_blocks("z2").unwrap();
        m.remove_request("z2").unwrap();
        hit.blocks()[0][0]
    };

    // A key taken off a block outside the hit, behind the manager's back: checked, accepted.
    m.add_request("b", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 48);
    let removals = m.pool().key_removals();
    m.pool().evict_blocks(&[z_block]).unwrap();
    assert_eq!(m.pool().key_removals(), removals + 1);
    let new = m.allocate_slots("b", &adopt(&hit)).unwrap().unwrap();
    assert_eq!(new[0].len(), 1);
    assert_eq!(&m.block_ids("b", 0).unwrap()[..3], &hit.blocks()[0][..]);
    m.free("b").unwrap();

    // A key taken off a block of the hit, behind the manager's back: refused, nothing changed.
    m.add_request("c", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("c").unwrap();
    m.pool().evict_blocks(&[hit.blocks()[0][1]]).unwrap();
    let free = m.num_free_blocks();
    assert!(matches!(
        m.allocate_slots("c", &adopt(&hit)),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(m.num_free_blocks(), free);
    assert!(m.block_ids("c", 0).unwrap().is_empty());
    m.remove_request("c").unwrap();

    // Keys moved off a block of the hit to a copy: refused.
    m.add_request("d", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("d").unwrap();
    let copy = m.pool().get_new_blocks(1).unwrap()[0];
    assert!(!hit.blocks()[0].contains(&copy));
    m.pool().move_block_keys(hit.blocks()[0][0], copy).unwrap();
    assert!(m.allocate_slots("d", &adopt(&hit)).is_err());
    assert!(m.block_ids("d", 0).unwrap().is_empty());
    m.remove_request("d").unwrap();
    m.pool().free_blocks(&[copy]).unwrap();

    // The same id registered again with another prompt, no key removed in between: the old
    // lookup is not this request's, and its blocks are not this prompt's.
    m.add_request("e", &tokens(7000, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("e").unwrap();
    assert_eq!(hit.num_computed_tokens, 48);
    m.remove_request("e").unwrap();
    m.add_request("e", &tokens(9000, 64), ExtraKeys::default())
        .unwrap();
    let removals = m.pool().key_removals();
    assert!(matches!(
        m.allocate_slots("e", &adopt(&hit)),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(m.pool().key_removals(), removals);
    assert!(m.block_ids("e", 0).unwrap().is_empty());
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let mut m = manager(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
    );
    m.add_request("a", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "a").unwrap();
    let snapshot = |m: &KVCacheManager| {
        (
            m.num_free_blocks(),
            m.num_cached_keys(),
            m.get_block_ids("a").unwrap(),
        )
    };
    let before = snapshot(&m);

    assert!(matches!(
        m.add_request("a", &tokens(0, 4), ExtraKeys::default()),
        Err(CoreError::DuplicateRequest(_))
    ));
    assert!(is_invalid(m.add_request(
        "e",
        &[] as &[u32],
        ExtraKeys::default()
    )));
    assert!(m
        .add_request("neg", &[-1i64], ExtraKeys::default())
        .is_err());
    assert!(!m.contains_request("neg"));
    assert!(is_unknown(m.allocate_slots("nope", &new_tokens(1, 0))));
    assert!(is_unknown(m.get_computed_blocks("nope")));
    assert!(is_unknown(m.free("nope")));
    assert!(is_unknown(m.append_token_ids("nope", &[1u32])));
    assert!(m.append_token_ids("a", &[u64::MAX]).is_err());
    assert_eq!(m.request("a").unwrap().num_tokens(), 64);
    // Zero new tokens and nothing to adopt.
    assert!(is_invalid(m.allocate_slots("a", &new_tokens(0, 64))));
    // Beyond max_model_len.
    assert!(is_out_of_range(
        m.allocate_slots("a", &new_tokens(4096, 64))
    ));
    assert!(is_out_of_range(
        m.allocate_slots("a", &new_tokens(usize::MAX, 64))
    ));
    // More computed tokens than the request has.
    assert!(is_out_of_range(m.allocate_slots("a", &new_tokens(1, 65))));
    assert_eq!(snapshot(&m), before);

    // Hits for a request that already holds blocks.
    m.add_request("b", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert_eq!(hit.num_computed_tokens, 48);
    fn adopt(hit: &ComputedBlocks, n: usize) -> AllocateArgs<'_> {
        AllocateArgs {
            num_new_tokens: 16,
            num_new_computed_tokens: n,
            new_computed_blocks: Some(hit),
            ..Default::default()
        }
    }
    assert!(is_invalid(m.allocate_slots("a", &adopt(&hit, 48))));
    // Hits that do not match the computed token count, or the prompt.
    assert!(is_invalid(m.allocate_slots("b", &adopt(&hit, 32))));
    m.add_request("c", &tokens(1000, 64), ExtraKeys::default())
        .unwrap();
    assert!(is_invalid(m.allocate_slots("c", &adopt(&hit, 48))));
    // Forged block ids, nulls in a full-attention group, wrong group count.
    // (A caller cannot change a hit's blocks: it makes one of its own.)
    let forge = |edit: &dyn Fn(&mut Vec<Vec<BlockId>>)| {
        let mut blocks = hit.blocks().to_vec();
        edit(&mut blocks);
        ComputedBlocks::new(blocks, 48)
    };
    let forged = forge(&|b| b[0][1] = 60);
    assert!(is_invalid(m.allocate_slots("b", &adopt(&forged, 48))));
    let forged = forge(&|b| b[0][1] = 1_000_000);
    assert!(m.allocate_slots("b", &adopt(&forged, 48)).is_err());
    let forged = forge(&|b| b[0][1] = NULL_BLOCK);
    assert!(is_invalid(m.allocate_slots("b", &adopt(&forged, 48))));
    let swapped = forge(&|b| b.swap(0, 1));
    assert!(is_invalid(m.allocate_slots("b", &adopt(&swapped, 48))));
    let swapped = forge(&|b| {
        b.swap(0, 1);
        b.pop();
    });
    assert!(is_invalid(m.allocate_slots("b", &adopt(&swapped, 48))));
    // Hits from another manager's pool.
    let mut other = manager(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
    );
    other
        .add_request("x", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    admit(&mut other, "x").unwrap();
    other
        .add_request("y", &tokens(0, 64), ExtraKeys::default())
        .unwrap();
    let foreign = other.get_computed_blocks("y").unwrap();
    m.free("a").unwrap();
    m.add_request("z", &tokens(5000, 64), ExtraKeys::default())
        .unwrap();
    assert!(is_invalid(m.allocate_slots("z", &adopt(&foreign, 48))));
    // Computed tokens without blocks.
    assert!(is_invalid(m.allocate_slots(
        "z",
        &AllocateArgs {
            num_new_tokens: 16,
            num_new_computed_tokens: 48,
            ..Default::default()
        }
    )));
    assert!(m.block_ids("z", 0).unwrap().is_empty());
    // The genuine hit still works.
    assert!(m.allocate_slots("b", &adopt(&hit, 48)).unwrap().is_some());
}

#[test]
fn bad_configs_are_rejected() {
    let bad = [
        config(vec![GroupSpec::full(0)], 16),
        config(vec![GroupSpec::sliding_window(16, 0)], 16),
        config(vec![GroupSpec::full(16)], 1),
        ManagerConfig::new(vec![GroupSpec::full(16)], 16, 0),
        {
            let mut c = config(vec![GroupSpec::full(32), GroupSpec::full(16)], 16);
            c.hash_block_size = Some(32);
            c
        },
        {
            let mut c = config(vec![GroupSpec::full(32), GroupSpec::full(16)], 16);
            c.scheduler_block_size = Some(48);
            c
        },
        config(
            vec![GroupSpec::full(32), GroupSpec::chunked_local(16, 64)],
            16,
        ),
        {
            let mut c = config(vec![GroupSpec::full(16)], 16);
            c.scheduler_block_size = Some(32);
            c
        },
        {
            let mut c = config(vec![GroupSpec::full(16)], 16);
            c.watermark = 1.5;
            c
        },
    ];
    for c in &bad {
        assert!(KVCacheManager::new(c).is_err(), "{c:?}");
    }
}

// ----- concurrent probes --------------------------------------------------------------------

#[test]
fn probe_matches_get_computed_blocks() {
    let mut m = manager(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
    );
    let prober = m.prober();
    let prompt = tokens(0, 100);
    assert_eq!(prober.probe(&prompt, &ExtraKeys::default()).unwrap(), 0);
    m.add_request("a", &prompt, ExtraKeys::default()).unwrap();
    admit(&mut m, "a").unwrap();
    m.add_request("b", &prompt, ExtraKeys::default()).unwrap();
    let expected = m.get_computed_blocks("b").unwrap().num_computed_tokens;
    assert_eq!(expected, 96);
    assert_eq!(
        prober.probe(&prompt, &ExtraKeys::default()).unwrap(),
        expected
    );
    assert_eq!(
        prober.probe(&prompt[..40], &ExtraKeys::default()).unwrap(),
        32
    );
    assert_eq!(
        prober.probe(&[] as &[u32], &ExtraKeys::default()).unwrap(),
        0
    );
    assert!(prober.probe(&[-5i32], &ExtraKeys::default()).is_err());
    assert_eq!(
        prober
            .probe_with_max(&prompt, &ExtraKeys::default(), 1 << 40)
            .unwrap(),
        96
    );
}

#[test]
fn probes_from_other_threads_never_exceed_the_prompt_while_the_scheduler_runs() {
    let groups = vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 48)];
    let mut m = manager(groups, 40);
    let prober = m.prober();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let (prober, stop) = (prober.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut probes = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || probes < 100 {
                    let len = 17 + (probes as usize * 7 + t) % 200;
                    let prompt = tokens((probes % 3) as u32 * 1000, len);
                    let hit = prober.probe(&prompt, &ExtraKeys::default()).unwrap();
                    assert!(hit < len && hit % 16 == 0);
                    probes += 1;
                }
                probes
            })
        })
        .collect();
    for i in 0..300u32 {
        let id = format!("r{i}");
        let prompt = tokens((i % 3) * 1000, 20 + (i as usize * 13) % 180);
        m.add_request(&id, &prompt, ExtraKeys::default()).unwrap();
        // Admitted or not (out of blocks), the request leaves again.
        let _ = admit(&mut m, &id);
        m.remove_request(&id).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in handles {
        assert!(h.join().unwrap() >= 100);
    }
    assert_eq!(m.num_free_blocks(), 39);
}

// ----- invariants ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Add { prefix: u32, len: usize },
    Step { pick: usize, n: usize },
    Free { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..3, 1usize..120).prop_map(|(prefix, len)| Op::Add { prefix, len }),
        (any::<usize>(), 1usize..40).prop_map(|(pick, n)| Op::Step { pick, n }),
        any::<usize>().prop_map(|pick| Op::Free { pick }),
    ]
}

/// Every block's reference count equals the number of table slots holding it, and the pool's
/// free count is everything else.
fn check_invariants(m: &KVCacheManager, live: &[(String, usize)]) {
    let mut holders: std::collections::HashMap<BlockId, u32> = std::collections::HashMap::new();
    for (id, _) in live {
        for table in m.get_block_ids(id).unwrap() {
            for b in table.into_iter().filter(|&b| b != NULL_BLOCK) {
                *holders.entry(b).or_default() += 1;
            }
        }
    }
    for (&b, &n) in &holders {
        assert_eq!(m.pool().ref_count(b).unwrap(), n, "block {b}");
    }
    assert_eq!(
        m.num_free_blocks(),
        m.pool().num_blocks() - 1 - holders.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn allocate_and_free_keep_reference_counts_exact(ops in proptest::collection::vec(op(), 1..60)) {
        let groups = vec![
            GroupSpec::full(8),
            GroupSpec::sliding_window(8, 20),
            GroupSpec::sliding_window(8, 20),
            GroupSpec::chunked_local(8, 32),
        ];
        let mut m = manager(groups, 48);
        // (request id, computed tokens); 0 computed = waiting.
        let mut live: Vec<(String, usize)> = Vec::new();
        let mut next = 0;
        for op in ops {
            match op {
                Op::Add { prefix, len } => {
                    let id = format!("r{next}");
                    next += 1;
                    let mut prompt = tokens(prefix * 10_000, len.min(60));
                    prompt.extend(tokens(next as u32 * 100 + 50_000, len.saturating_sub(60)));
                    m.add_request(&id, &prompt, ExtraKeys::default()).unwrap();
                    live.push((id, 0));
                }
                Op::Step { pick, n } if !live.is_empty() => {
                    let k = pick % live.len();
                    let (id, computed) = live[k].clone();
                    let before = (m.num_free_blocks(), m.get_block_ids(&id).unwrap());
                    if computed == 0 {
                        if let Some((hit, _)) = admit(&mut m, &id) {
                            live[k].1 = m.request(&id).unwrap().num_tokens();
                            prop_assert!(hit < live[k].1);
                        } else {
                            prop_assert_eq!((m.num_free_blocks(), m.get_block_ids(&id).unwrap()), before);
                        }
                    } else {
                        let out: Vec<u32> = tokens(7, n);
                        m.append_token_ids(&id, &out).unwrap();
                        let args = new_tokens(n, computed);
                        if m.allocate_slots(&id, &args).unwrap().is_some() {
                            live[k].1 += n;
                        } else {
                            // Only out-of-window blocks may have been released.
                            prop_assert!(m.num_free_blocks() >= before.0);
                            m.remove_request(&id).unwrap();
                            live.remove(k);
                        }
                    }
                }
                Op::Free { pick } if !live.is_empty() => {
                    let k = pick % live.len();
                    m.remove_request(&live[k].0).unwrap();
                    live.remove(k);
                }
                _ => {}
            }
            check_invariants(&m, &live);
        }
        for (id, _) in live.drain(..) {
            m.remove_request(&id).unwrap();
        }
        prop_assert_eq!(m.num_free_blocks(), 47);
    }
}

#[test]
fn manager_and_prober_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<KVCacheManager>();
    check::<Prober>();
}

/// One scheduler-like call in `running_step_path_matches_the_general_path`.
#[derive(Clone, Debug)]
enum PairOp {
    /// Admit request `i` (if it holds nothing) or schedule up to `n` of its tokens, with
    /// `lookahead` speculative slots and caching delayed or not.
    Step {
        i: usize,
        n: usize,
        lookahead: usize,
        delay: bool,
    },
    /// Request `i` samples a token (once all its tokens are computed).
    Sample { i: usize },
    /// Request `i` is freed (finished or preempted) and will be admitted again.
    Free { i: usize },
}

fn pair_op() -> impl Strategy<Value = PairOp> {
    prop_oneof![
        4 => (0..4usize, 1..40usize, 0..5usize, any::<bool>())
            .prop_map(|(i, n, lookahead, delay)| PairOp::Step { i, n, lookahead, delay }),
        3 => (0..4usize).prop_map(|i| PairOp::Sample { i }),
        1 => (0..4usize).prop_map(|i| PairOp::Free { i }),
    ]
}

/// The prompt of request `k` of the running-path tests: all share their first 16 tokens, so
/// hits happen.
fn pair_prompt(k: usize) -> Vec<u32> {
    let mut prompt = tokens(100, 16);
    prompt.extend(tokens(1_000 * (k as u32 + 1), 3 + 5 * k));
    prompt
}

/// The layouts the running-request path is checked on (block sizes 4 and 8, every kind).
fn pair_layouts() -> Vec<Vec<GroupSpec>> {
    vec![
        vec![GroupSpec::full(4)],
        vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)],
        vec![
            GroupSpec::sliding_window(4, 5),
            GroupSpec::chunked_local(4, 8),
        ],
        vec![GroupSpec::full(8), GroupSpec::sliding_window(8, 12)],
        vec![GroupSpec::full(4), GroupSpec::mamba(4)],
        // Several groups free and claim in the same step (one claim and one free for all).
        vec![
            GroupSpec::full(4),
            GroupSpec::sliding_window(4, 6),
            GroupSpec::sliding_window(4, 6),
            GroupSpec::sliding_window(4, 9),
        ],
        vec![
            GroupSpec::sliding_window(4, 5),
            GroupSpec::full(4),
            GroupSpec::chunked_local(4, 8),
            GroupSpec::sliding_window(4, 5),
        ],
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// `allocate_slots` for a running request without a hit takes a shorter path; a manager
    /// forced onto the general path must make every decision the same way: results, block
    /// tables, free order and cache entries after every call.
    #[test]
    fn running_step_path_matches_the_general_path(
        layout in 0..7usize,
        num_blocks in 6..60usize,
        sparse in any::<bool>(),
        ops in proptest::collection::vec(pair_op(), 1..80),
    ) {
        let groups = pair_layouts().swap_remove(layout);
        // vLLM's default (sparse) retention leaves most window blocks uncached: they go to the
        // front of the free order, where the groups' order shows.
        let config = |groups: Vec<GroupSpec>| {
            let dense = config(groups.clone(), num_blocks);
            if sparse { ManagerConfig::new(groups, num_blocks, 4096) } else { dense }
        };
        let mut fast = KVCacheManager::new(&config(groups.clone())).unwrap();
        let mut general = KVCacheManager::new(&config(groups.clone())).unwrap();
        general.general_path_only = true;
        let ids = ["a", "b", "c", "d"];
        for (k, id) in ids.iter().enumerate() {
            let prompt = pair_prompt(k);
            fast.add_request(id, &prompt, ExtraKeys::default()).unwrap();
            general.add_request(id, &prompt, ExtraKeys::default()).unwrap();
        }
        let mut computed = [0usize; 4];
        for op in ops {
            match op {
                PairOp::Step { i, n, lookahead, delay } => {
                    let id = ids[i];
                    let num_tokens = fast.request(id).unwrap().num_tokens();
                    if computed[i] == num_tokens {
                        continue;
                    }
                    if computed[i] == 0 {
                        let hit_f = fast.get_computed_blocks(id).unwrap();
                        let hit_g = general.get_computed_blocks(id).unwrap();
                        prop_assert_eq!(&hit_f, &hit_g);
                        let n = (num_tokens - hit_f.num_computed_tokens).min(n.max(1));
                        let args = AllocateArgs {
                            num_new_tokens: n,
                            num_new_computed_tokens: hit_f.num_computed_tokens,
                            new_computed_blocks: Some(&hit_f),
                            full_sequence_must_fit: true,
                            ..Default::default()
                        };
                        let got = fast.allocate_slots(id, &args).unwrap();
                        let args = AllocateArgs { new_computed_blocks: Some(&hit_g), ..args };
                        prop_assert_eq!(&got, &general.allocate_slots(id, &args).unwrap());
                        if got.is_some() {
                            computed[i] = hit_f.num_computed_tokens + n;
                        }
                    } else {
                        let args = AllocateArgs {
                            num_new_tokens: (num_tokens - computed[i]).min(n),
                            num_computed_tokens: computed[i],
                            num_lookahead_tokens: lookahead,
                            delay_cache_blocks: delay,
                            ..Default::default()
                        };
                        let got = fast.allocate_slots(id, &args).unwrap();
                        prop_assert_eq!(&got, &general.allocate_slots(id, &args).unwrap());
                        if got.is_some() {
                            computed[i] += args.num_new_tokens;
                        }
                    }
                }
                PairOp::Sample { i } => {
                    let id = ids[i];
                    if computed[i] > 0 && computed[i] == fast.request(id).unwrap().num_tokens() {
                        let token = [7 + computed[i] as u32];
                        fast.append_token_ids(id, &token).unwrap();
                        general.append_token_ids(id, &token).unwrap();
                    }
                }
                PairOp::Free { i } => {
                    fast.free(ids[i]).unwrap();
                    general.free(ids[i]).unwrap();
                    computed[i] = 0;
                }
            }
            prop_assert_eq!(fast.pool().free_order(), general.pool().free_order());
            prop_assert_eq!(fast.num_cached_keys(), general.num_cached_keys());
            for id in ids {
                prop_assert_eq!(fast.get_block_ids(id).unwrap(), general.get_block_ids(id).unwrap());
            }
        }
    }
}

/// Layouts and configs the running horizon is checked on: every kind the running path takes,
/// dense and sparse retention, caching off, EAGLE and multi-token prediction.
fn horizon_configs() -> Vec<ManagerConfig> {
    let layouts = [
        vec![GroupSpec::full(4)],
        vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)],
        vec![
            GroupSpec::sliding_window(4, 5),
            GroupSpec::chunked_local(4, 8),
        ],
        vec![GroupSpec::full(8), GroupSpec::sliding_window(8, 12)],
        vec![
            GroupSpec::full(4),
            GroupSpec::new(AttentionKind::Rswa { window: 6 }, 4),
        ],
        vec![GroupSpec::full(4), GroupSpec::sliding_window(8, 9)],
        // Full blocks larger than the hash block: keyed again at the prompt's tail.
        vec![GroupSpec::full(8), GroupSpec::sliding_window(4, 9)],
        // Groups with the same spec in a row (Gemma-3's sliding-window groups), whose bounds
        // the horizon takes once while their tables agree.
        vec![
            GroupSpec::full(4),
            GroupSpec::sliding_window(4, 6),
            GroupSpec::sliding_window(4, 6),
            GroupSpec::sliding_window(4, 6),
        ],
        vec![
            GroupSpec::full(8),
            GroupSpec::full(8),
            GroupSpec::chunked_local(4, 8),
            GroupSpec::chunked_local(4, 8),
        ],
    ];
    let mut configs = Vec::new();
    for groups in layouts {
        let dense = ManagerConfig::new(groups.clone(), 64, 256).dense();
        let sparse = ManagerConfig::new(groups, 64, 256);
        let no_caching = ManagerConfig {
            enable_caching: false,
            ..sparse.clone()
        };
        let eagle = ManagerConfig {
            use_eagle: true,
            ..sparse.clone()
        };
        let mtp = ManagerConfig {
            num_prefill_lookahead: 3,
            ..dense.clone()
        };
        // EAGLE-3's lookahead hashes: a block's hash waits for the token after it.
        let lookahead = ManagerConfig {
            num_hash_lookahead_tokens: 1,
            ..eagle.clone()
        };
        configs.extend([dense, sparse, no_caching, eagle, mtp, lookahead]);
    }
    // EAGLE with chunked local attention is refused, as by vLLM.
    configs.retain(|c| KVCacheManager::new(c).is_ok());
    configs
}

/// Everything a call could change, for comparing before and after.
fn observable(m: &KVCacheManager, ids: &[&str]) -> impl PartialEq + std::fmt::Debug {
    let tables: Vec<_> = ids
        .iter()
        .filter_map(|id| m.state(*id).ok())
        .map(|s| {
            s.tables
                .iter()
                .map(|t| (t.blocks.clone(), t.num_cached))
                .collect::<Vec<_>>()
        })
        .collect();
    (
        m.pool().free_order(),
        m.num_cached_keys(),
        m.pool().num_free_blocks(),
        tables,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// A call the request's `running_horizon` covers changes nothing (blocks, free order,
    /// cache entries, events) and returns no new blocks, whatever the layout, retention and
    /// counts in flight.
    #[test]
    fn a_call_inside_the_running_horizon_changes_nothing(
        config in 0..horizon_configs().len(),
        num_blocks in 8..48usize,
        ops in proptest::collection::vec((pair_op(), 0..6usize), 1..90),
    ) {
        let mut config = horizon_configs().swap_remove(config);
        config.num_blocks = num_blocks;
        config.enable_events = true;
        let mut m = KVCacheManager::new(&config).unwrap();
        let ids = ["a", "b", "c", "d"];
        for (k, id) in ids.iter().enumerate() {
            m.add_request(id, &pair_prompt(k), ExtraKeys::default()).unwrap();
        }
        let mut computed = [0usize; 4];
        for (op, in_flight) in ops {
            match op {
                PairOp::Step { i, n, lookahead, delay } => {
                    let id = ids[i];
                    let num_tokens = m.request(id).unwrap().num_tokens();
                    if computed[i] == num_tokens {
                        continue;
                    }
                    if computed[i] == 0 {
                        if let Some((hit, n, _)) = admit_up_to(&mut m, id, n) {
                            computed[i] = hit + n;
                        }
                        continue;
                    }
                    let n = (num_tokens - computed[i]).min(n);
                    let f = in_flight.min(computed[i]);
                    let args = AllocateArgs {
                        num_new_tokens: n,
                        num_computed_tokens: computed[i],
                        num_in_flight_tokens: f,
                        num_lookahead_tokens: lookahead,
                        delay_cache_blocks: delay,
                        ..Default::default()
                    };
                    let c = computed[i];
                    let inside = !delay
                        && m.running_horizon(id).unwrap().is_some_and(|h| {
                            c + n + lookahead <= h.slots && c + n < h.cache && c - f < h.removal
                        });
                    let before = observable(&m, &ids);
                    m.take_events();
                    let got = m.allocate_slots(id, &args).unwrap();
                    if inside {
                        let groups = config.groups.len();
                        prop_assert_eq!(&got, &Some(vec![Vec::new(); groups]));
                        prop_assert_eq!(before, observable(&m, &ids));
                        prop_assert!(m.take_events().is_empty());
                    }
                    if got.is_some() {
                        computed[i] += n;
                    }
                }
                PairOp::Sample { i } => {
                    let id = ids[i];
                    if computed[i] > 0 && computed[i] == m.request(id).unwrap().num_tokens() {
                        m.append_token_ids(id, &[7 + computed[i] as u32]).unwrap();
                    }
                }
                PairOp::Free { i } => {
                    m.free(ids[i]).unwrap();
                    computed[i] = 0;
                }
            }
        }
    }
}

/// Blocks of 8 tokens hashed every 4: the key a prompt's tail block gets inside it (at
/// the last hash boundary a resend can match) bounds the horizon too. Under EAGLE with two
/// lookahead hashes, or with multi-token prediction re-prefilling two tokens, that key comes
/// on a decode step that needs no block and fills none: a step after the one that crossed the
/// boundary. Every step the horizon covers changes nothing.
#[test]
fn the_prompt_tail_key_bounds_the_running_horizon() {
    // Keys of the full-attention group's blocks, and how many of its blocks are cached whole.
    let keys = |m: &KVCacheManager| -> usize {
        let table = m.block_ids("r", 0).unwrap();
        table
            .iter()
            .map(|&b| m.pool().block_keys(b).unwrap().len())
            .sum()
    };
    let full_cached = |m: &KVCacheManager| m.state("r").unwrap().tables[0].num_cached;
    // Hashes every 4 tokens (a prefix match unit below every block size) and a wide window
    // (blocks leave it rarely): most steps are inside the horizon.
    let groups = vec![GroupSpec::full(8), GroupSpec::sliding_window(8, 33)];
    let mut checked_tail_steps = 0;
    for (eagle, lookahead, prefill_lookahead) in [
        (false, 0, 0),
        (true, 0, 0),
        (true, 1, 0),
        (true, 2, 0),
        (true, 0, 3),
        (true, 2, 3),
    ] {
        for prompt in 9..=30usize {
            let mut config = ManagerConfig::new(groups.clone(), 64, 256);
            config.use_eagle = eagle;
            config.num_hash_lookahead_tokens = lookahead;
            config.num_prefill_lookahead = prefill_lookahead;
            config.hash_block_size = Some(4);
            config.enable_events = true;
            let mut m = KVCacheManager::new(&config).unwrap();
            m.add_request("r", &tokens(0, prompt), ExtraKeys::default())
                .unwrap();
            admit(&mut m, "r").unwrap();
            for c in prompt..prompt + 24 {
                m.append_token_ids("r", &[500 + c as u32]).unwrap();
                let inside = m
                    .running_horizon("r")
                    .unwrap()
                    .is_some_and(|h| c < h.slots && c + 1 < h.cache && c < h.removal);
                let before = observable(&m, &["r"]);
                let (keys_before, cached_before) = (keys(&m), full_cached(&m));
                m.take_events();
                let got = m.allocate_slots("r", &new_tokens(1, c)).unwrap().unwrap();
                let filled = got.iter().any(|g| !g.is_empty());
                let changed = filled || before != observable(&m, &["r"]);
                let case =
                    format!("{eagle}/{lookahead}/{prefill_lookahead}, prompt {prompt}, at {c}");
                if inside {
                    assert!(!changed, "{case}");
                    assert!(m.take_events().is_empty(), "{case}");
                }
                // A step that needed no block, filled none, and keyed a full-attention block a
                // second time: the case this test is for.
                if !filled && full_cached(&m) == cached_before && keys(&m) > keys_before {
                    checked_tail_steps += 1;
                }
            }
        }
    }
    assert!(checked_tail_steps > 0, "no decode step keyed a prompt tail");
}

/// Decoding one token per step, a request's calls leave the horizon only where a call does
/// something: a block fills (it is cached), a new block is needed, or a block leaves the window.
#[test]
fn decode_leaves_the_running_horizon_only_at_block_boundaries() {
    for (groups, window) in [
        (vec![GroupSpec::full(16)], None),
        (
            vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 64)],
            Some(64),
        ),
        // Gemma-3's shape: the window groups' bounds are taken once, and are as tight.
        (
            vec![
                GroupSpec::full(16),
                GroupSpec::sliding_window(16, 64),
                GroupSpec::sliding_window(16, 64),
                GroupSpec::sliding_window(16, 64),
            ],
            Some(64),
        ),
    ] {
        let mut m = manager(groups.clone(), 400);
        m.add_request("r", &tokens(0, 40), ExtraKeys::default())
            .unwrap();
        admit(&mut m, "r").unwrap();
        let mut outside = Vec::new();
        for c in 40..400usize {
            m.append_token_ids("r", &[c as u32]).unwrap();
            let h = m.running_horizon("r").unwrap().unwrap();
            let n = 1;
            let inside = c + n <= h.slots && c + n < h.cache && c < h.removal;
            let before = observable(&m, &["r"]);
            let got = m.allocate_slots("r", &new_tokens(1, c)).unwrap().unwrap();
            let changed = got.iter().any(|g| !g.is_empty()) || before != observable(&m, &["r"]);
            assert_eq!(changed, !inside, "{groups:?} at {c} computed tokens: {h:?}");
            if !inside {
                outside.push(c);
            }
        }
        // Full attention: the block filling at c + 1 = 16k is cached, the next token needs a
        // new block; the window frees a block 16 tokens later each time.
        let expected: Vec<usize> = (40..400)
            .filter(|c| {
                (c + 1) % 16 == 0
                    || c % 16 == 0
                    || window.is_some_and(|w| (c + 1) >= w && (c + 1 - w) % 16 == 0)
            })
            .collect();
        assert_eq!(outside, expected, "{groups:?}");
    }
}

/// `running_horizon_past(r, c)` is the running horizon while the blocks hold a slot past `c`
/// tokens, and None once they hold none (no running step that starts at `c` or later fits).
#[test]
fn the_horizon_past_a_count_ends_where_the_slots_do() {
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)];
    let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 64, 256)).unwrap();
    m.add_request("r", &tokens(0, 6), ExtraKeys::default())
        .unwrap();
    admit(&mut m, "r").unwrap();
    let mut seen_none = 0;
    for c in 6..30usize {
        m.append_token_ids("r", &[500 + c as u32]).unwrap();
        m.allocate_slots("r", &new_tokens(1, c)).unwrap().unwrap();
        let full = m.running_horizon("r").unwrap().unwrap();
        let past = m.running_horizon_past("r", c + 1).unwrap();
        if full.slots <= c + 1 {
            assert_eq!(past, None, "at {c}");
            seen_none += 1;
        } else {
            assert_eq!(past, Some(full), "at {c}");
        }
        // Below the slots, any count gives the whole horizon.
        assert_eq!(m.running_horizon_past("r", 0).unwrap(), Some(full));
    }
    // Blocks of 4 fill every fourth step.
    assert_eq!(seen_none, 6);
}
