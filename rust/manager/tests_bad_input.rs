//! Bad input to the manager is an error that changes nothing: counts that run past the slots a
//! request holds, hits adopted with computed tokens, counts no table can hold, huge caps and
//! malformed hits; and an allocation that fails halfway gives back what it took.

use super::*;
use crate::hashing::MmInput;
use crate::types::MAX_BLOCKS;

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

/// What an `Err` must leave as it was: free blocks, the free order, the cached keys, every
/// request's tables and the effects handed to the worker.
#[derive(Debug, PartialEq)]
struct Snapshot {
    free: usize,
    order: Vec<BlockId>,
    keys: usize,
    tables: Vec<Vec<Vec<BlockId>>>,
    new_block_ids: usize,
    cow_copies: usize,
}

fn snapshot(m: &KVCacheManager, ids: &[&str]) -> Snapshot {
    Snapshot {
        free: m.num_free_blocks(),
        order: m.pool().free_order(),
        keys: m.num_cached_keys(),
        tables: ids.iter().map(|id| m.get_block_ids(*id).unwrap()).collect(),
        new_block_ids: m.effects.new_block_ids.len(),
        cow_copies: m.effects.cow_copies.len(),
    }
}

/// Runs `call`, which must fail with an error `is_expected` accepts, and checks it changed
/// nothing.
fn refused<T: std::fmt::Debug>(
    m: &mut KVCacheManager,
    ids: &[&str],
    is_expected: impl Fn(&CoreError) -> bool,
    call: impl FnOnce(&mut KVCacheManager) -> Result<T>,
) {
    let before = snapshot(m, ids);
    match call(m) {
        Err(e) if is_expected(&e) => {}
        other => panic!("expected the call to be refused, got {other:?}"),
    }
    assert_eq!(
        snapshot(m, ids),
        before,
        "a refused call changed the manager"
    );
}

fn invalid_argument(e: &CoreError) -> bool {
    matches!(e, CoreError::InvalidArgument(_))
}

fn out_of_range(e: &CoreError) -> bool {
    matches!(e, CoreError::OutOfRange(_))
}

fn run(n: usize, computed: usize) -> AllocateArgs<'static> {
    AllocateArgs {
        num_new_tokens: n,
        num_computed_tokens: computed,
        has_scheduled_reqs: true,
        ..Default::default()
    }
}

// ----- F1: computed tokens past the slots the request holds ----------------------------------

#[test]
fn computed_tokens_past_the_held_slots_are_refused_and_change_nothing() {
    // The count took the 19 tokens past the 8 held slots for skipped (null) slots of the
    // uncached sliding-window group; the allocation took real blocks, ran out in the second
    // group and left the first group's blocks taken.
    let groups = vec![
        GroupSpec::new(AttentionKind::Mla, 4),
        GroupSpec::new(
            AttentionKind::SlidingWindowMla {
                window: 6,
                bounded_replay: true,
            },
            4,
        ),
    ];
    let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 20, 128)).unwrap();
    m.add_request("a", &tokens(29), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &run(8, 0)).unwrap().unwrap();
    let ahead = AllocateArgs {
        num_in_flight_tokens: 9,
        ..run(15, 27)
    };
    refused(&mut m, &["a"], invalid_argument, |m| {
        m.allocate_slots("a", &ahead)
    });
    // Up to the held slots is fine.
    assert!(m.allocate_slots("a", &run(4, 8)).unwrap().is_some());
}

#[test]
fn a_request_holding_nothing_starts_from_zero_computed_tokens() {
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)];
    let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 18, 128)).unwrap();
    m.add_request("a", &tokens(34), ExtraKeys::default())
        .unwrap();
    let args = AllocateArgs {
        num_new_tokens: 5,
        num_computed_tokens: 25,
        num_lookahead_tokens: 3,
        ..Default::default()
    };
    refused(&mut m, &["a"], invalid_argument, |m| {
        m.allocate_slots("a", &args)
    });
    // A hit and a connector's tokens are the request's own tokens.
    let external = AllocateArgs {
        num_new_tokens: 1,
        num_external_computed_tokens: 35,
        ..Default::default()
    };
    refused(&mut m, &["a"], out_of_range, |m| {
        m.allocate_slots("a", &external)
    });
}

#[test]
fn external_tokens_of_a_running_request_past_its_slots_are_refused() {
    // Mamba none mode with caching off: the tables hold slots for 8 tokens.
    let mut c = ManagerConfig::new(vec![GroupSpec::full(4), GroupSpec::mamba_none(4)], 20, 128);
    c.enable_caching = false;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(30), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &run(8, 0)).unwrap().unwrap();
    let args = AllocateArgs {
        num_external_computed_tokens: 8,
        ..run(4, 8)
    };
    refused(&mut m, &["a"], invalid_argument, |m| {
        m.allocate_slots("a", &args)
    });
}

#[test]
fn vllms_own_counts_pass_the_slot_check() {
    // Speculative decoding under async scheduling: drafts get slots (lookahead), and the
    // scheduler's count runs ahead by the drafts and the tokens in flight, within those slots.
    let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
    let mut m = KVCacheManager::new(&ManagerConfig::new(groups.clone(), 64, 128)).unwrap();
    m.add_request("a", &tokens(10), ExtraKeys::default())
        .unwrap();
    let prefill = AllocateArgs {
        num_lookahead_tokens: 3,
        ..run(10, 0)
    };
    m.allocate_slots("a", &prefill).unwrap().unwrap();
    m.append_token_ids("a", &[100u32]).unwrap();
    // A decode step with 3 drafts: 4 new tokens after 10, 3 lookahead slots.
    let decode = AllocateArgs {
        num_lookahead_tokens: 3,
        ..run(4, 10)
    };
    m.allocate_slots("a", &decode).unwrap().unwrap();
    // Scheduled while that step is in flight: every draft counted.
    let next = AllocateArgs {
        num_in_flight_tokens: 4,
        num_lookahead_tokens: 3,
        ..run(4, 14)
    };
    m.allocate_slots("a", &next).unwrap().unwrap();

    // Preempted: freed, then readmitted from 0 with its hit.
    m.free("a").unwrap();
    let hit = m.get_computed_blocks("a").unwrap();
    let readmit = AllocateArgs {
        num_new_tokens: 11 - hit.num_computed_tokens,
        num_new_computed_tokens: hit.num_computed_tokens,
        new_computed_blocks: Some(&hit),
        ..Default::default()
    };
    m.allocate_slots("a", &readmit).unwrap().unwrap();

    // A connector's tokens loaded asynchronously: slots for them first, then the rest.
    m.add_request("b", &tokens(20), ExtraKeys::default())
        .unwrap();
    let load = AllocateArgs {
        num_external_computed_tokens: 12,
        delay_cache_blocks: true,
        ..Default::default()
    };
    m.allocate_slots("b", &load).unwrap().unwrap();
    m.allocate_slots("b", &run(8, 12)).unwrap().unwrap();

    // Mamba align with a connector's tokens and speculative blocks.
    let groups = vec![
        GroupSpec::full(4),
        GroupSpec::mamba_with(4, MambaMode::Align, 2),
    ];
    let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 64, 128)).unwrap();
    m.add_request("c", &tokens(20), ExtraKeys::default())
        .unwrap();
    let external = AllocateArgs {
        num_external_computed_tokens: 8,
        ..run(4, 0)
    };
    m.allocate_slots("c", &external).unwrap().unwrap();
    m.allocate_slots("c", &run(8, 12)).unwrap().unwrap();
}

#[test]
fn an_allocation_failing_halfway_gives_back_what_it_took() {
    // A hit adopted (its blocks held by a running request, so out of the free order), a
    // partial hit's copy, new blocks in every group; then a running Mamba align request whose
    // speculative blocks move: the failure comes after every block was taken.
    let layouts: [(Vec<GroupSpec>, usize); 3] = [
        (
            vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)],
            16,
        ),
        (vec![GroupSpec::full(4)], 14),
        (
            vec![
                GroupSpec::full(4),
                GroupSpec::mamba_with(4, MambaMode::Align, 2),
            ],
            16,
        ),
    ];
    for (groups, prompt) in layouts {
        let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 64, 128).dense()).unwrap();
        m.general_path_only = true;
        m.add_request("a", &tokens(prompt), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &run(prompt, 0)).unwrap().unwrap();
        // (A Mamba state cached in this step is a hit only in the next.)
        m.new_step_starts();
        m.add_request("b", &tokens(prompt + 8), ExtraKeys::default())
            .unwrap();
        let hit = m.get_computed_blocks("b").unwrap();
        assert!(hit.num_computed_tokens > 0);
        let admit = AllocateArgs {
            num_new_tokens: prompt + 8 - hit.num_computed_tokens,
            num_new_computed_tokens: hit.num_computed_tokens,
            new_computed_blocks: Some(&hit),
            ..Default::default()
        };
        m.fail_after_allocation = true;
        refused(&mut m, &["a", "b"], invalid_argument, |m| {
            m.allocate_slots("b", &admit)
        });
        // Running: the next step fails too, and changes nothing.
        m.fail_after_allocation = false;
        m.append_token_ids("a", &[500u32]).unwrap();
        m.allocate_slots("a", &run(1, prompt)).unwrap().unwrap();
        m.append_token_ids("a", &tokens(8)).unwrap();
        // Blocks that left the window stay freed, as on an `Ok(None)`: freed first here.
        m.remove_skipped_blocks("a", prompt + 1, Some(prompt))
            .unwrap();
        m.fail_after_allocation = true;
        refused(&mut m, &["a", "b"], invalid_argument, |m| {
            m.allocate_slots("a", &run(8, prompt + 1))
        });
        // And the same calls go through afterwards.
        m.fail_after_allocation = false;
        m.allocate_slots("a", &run(8, prompt + 1)).unwrap().unwrap();
        m.allocate_slots("b", &admit).unwrap().unwrap();
    }
}

// ----- F2: a hit adopted with computed tokens ----------------------------------------------

#[test]
fn adopting_a_hit_with_computed_tokens_is_an_error_not_a_panic() {
    let layouts = [
        vec![GroupSpec::full(4)],
        vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)],
        vec![
            GroupSpec::new(AttentionKind::Mla, 4),
            GroupSpec::new(
                AttentionKind::SlidingWindowMla {
                    window: 6,
                    bounded_replay: false,
                },
                4,
            ),
        ],
    ];
    for groups in layouts {
        let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 20, 128)).unwrap();
        m.add_request("a", &tokens(8), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &run(8, 0)).unwrap().unwrap();
        m.free("a").unwrap();
        m.add_request("b", &tokens(8), ExtraKeys::default())
            .unwrap();
        let hit = m.get_computed_blocks("b").unwrap();
        assert_eq!(hit.num_computed_tokens, 4);
        let args = AllocateArgs {
            num_new_tokens: 1,
            num_computed_tokens: 3,
            num_new_computed_tokens: hit.num_computed_tokens,
            new_computed_blocks: Some(&hit),
            ..Default::default()
        };
        refused(&mut m, &["a", "b"], invalid_argument, |m| {
            m.allocate_slots("b", &args)
        });
    }
}

// ----- F6: more slots than a table can hold ------------------------------------------------

#[test]
fn a_mamba_request_asking_for_more_slots_than_memory_holds_is_an_error() {
    // The Mamba group needs one real block whatever the count: the table would be padded with
    // 2^46 null blocks.
    let mut m = KVCacheManager::new(&ManagerConfig::new(
        vec![GroupSpec::mamba(16)],
        64,
        usize::MAX,
    ))
    .unwrap();
    m.add_request("a", &tokens(10), ExtraKeys::default())
        .unwrap();
    refused(&mut m, &["a"], out_of_range, |m| {
        m.allocate_slots("a", &run(1 << 50, 0))
    });
    assert!(m.allocate_slots("a", &run(10, 0)).unwrap().is_some());
}

// ----- F3: huge hit caps -------------------------------------------------------------------

#[test]
fn a_hit_cap_past_the_request_is_the_request() {
    let layouts = [
        vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)],
        vec![GroupSpec::full(4), GroupSpec::chunked_local(4, 8)],
        vec![GroupSpec::full(4), GroupSpec::mamba(4)],
    ];
    for (i, groups) in layouts.into_iter().enumerate() {
        let mut c = ManagerConfig::new(groups, 20, 128);
        c.use_eagle = i != 1; // EAGLE with chunked local attention is refused
        let mut m = KVCacheManager::new(&c).unwrap();
        m.add_request("a", &tokens(8), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &run(8, 0)).unwrap().unwrap();
        m.add_request("b", &tokens(8), ExtraKeys::default())
            .unwrap();
        let capped = m.get_computed_blocks_capped("b", Some(usize::MAX)).unwrap();
        assert!(capped.num_computed_tokens <= 8);
        assert_eq!(
            capped,
            m.get_computed_blocks_capped("b", Some(8)).unwrap(),
            "layout {i}"
        );
        let (hit, _) = m
            .get_computed_blocks_for_connector("b", Some(usize::MAX))
            .unwrap();
        assert!(hit.num_computed_tokens <= 8);
    }
}

// ----- F4, F5: configs and helpers at the edges --------------------------------------------

#[test]
fn configs_at_the_edges_build_or_are_refused_without_overflow() {
    let mut c = ManagerConfig::new(
        vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)],
        64,
        1024,
    );
    c.num_prefill_lookahead = usize::MAX;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(40), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &run(40, 0)).unwrap().unwrap();

    let mut c = ManagerConfig::new(
        vec![
            GroupSpec::full(16),
            GroupSpec::sliding_window(16, usize::MAX),
        ],
        64,
        1024,
    );
    c.num_prefill_lookahead = 3;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(40), ExtraKeys::default())
        .unwrap();
    assert_eq!(m.num_blocks_to_admit("a", None).unwrap(), 6);
    m.allocate_slots("a", &run(40, 0)).unwrap().unwrap();

    // Speculative blocks past any pool, however the spec was built.
    let mut c = ManagerConfig::new(
        vec![GroupSpec::mamba_with(16, MambaMode::None, MAX_BLOCKS + 1)],
        64,
        1024,
    );
    c.enable_caching = false;
    assert!(matches!(
        KVCacheManager::new(&c),
        Err(CoreError::InvalidConfig(_))
    ));
    let c = ManagerConfig::new(
        vec![
            GroupSpec::full(16),
            GroupSpec::mamba_with(16, MambaMode::Align, usize::MAX),
        ],
        64,
        1024,
    );
    assert!(matches!(
        KVCacheManager::new(&c),
        Err(CoreError::InvalidConfig(_))
    ));
}

#[test]
fn group_spec_helpers_saturate_at_the_edges() {
    let sw = GroupSpec::sliding_window(16, 32);
    assert_eq!(sw.skipped_tokens(usize::MAX, 0), usize::MAX - 32);
    assert_eq!(sw.skipped_tokens(100, usize::MAX), 0);
    assert_eq!(GroupSpec::chunked_local(16, 0).skipped_tokens(5, 0), 0);
    assert_eq!(
        GroupSpec::sliding_window(16, 0).max_admission_blocks(10, 100, 0),
        Some(2)
    );
    assert_eq!(sw.max_admission_blocks(10, 100, usize::MAX), Some(8));
    let split = crate::replay::SplitLimits {
        block_size: 0,
        max_num_batched_tokens: 8,
        long_prefill_token_threshold: 0,
        checkpoint_alignment: 0,
    };
    assert_eq!(
        crate::replay::mamba_block_aligned_split(&split, 10, 10, 0, 4, 0),
        4
    );
}

// ----- F7: token ranges ----------------------------------------------------------------------

#[test]
fn token_ranges_are_clamped_to_the_request() {
    let mut c = ManagerConfig::new(vec![GroupSpec::full(16)], 64, 1024);
    c.enable_events = true;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(10), ExtraKeys::default())
        .unwrap();
    let r = m.request("a").unwrap();
    assert_eq!(r.token_range(5, 100), &[5, 6, 7, 8, 9]);
    assert_eq!(r.token_range(50, 100), &[] as &[u32]);
    assert_eq!(r.token_range(7, 3), &[] as &[u32]);
    assert_eq!(r.token_range(2, 4), &[2, 3]);
}

// ----- F5, F9: hits num_blocks_to_admit is given ---------------------------------------------

#[test]
fn num_blocks_to_admit_checks_the_hit_as_allocate_slots_does() {
    let groups = vec![GroupSpec::full(16), GroupSpec::sliding_window(16, 32)];
    let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 64, 1024)).unwrap();
    m.add_request("a", &tokens(64), ExtraKeys::default())
        .unwrap();
    let huge = ComputedBlocks::new(vec![vec![1], vec![2]], usize::MAX);
    assert!(out_of_range(
        &m.num_blocks_to_admit("a", Some(&huge)).unwrap_err()
    ));
    let one_group = ComputedBlocks::new(vec![vec![1, 2]], 32);
    assert!(invalid_argument(
        &m.num_blocks_to_admit("a", Some(&one_group)).unwrap_err()
    ));
    let bad_ids = ComputedBlocks::new(vec![vec![1000, 2000], vec![3000, 4000]], 32);
    assert!(matches!(
        m.num_blocks_to_admit("a", Some(&bad_ids)),
        Err(CoreError::InvalidBlockId { .. })
    ));
    let no_blocks = ComputedBlocks::new(vec![vec![], vec![]], 32);
    assert!(invalid_argument(
        &m.num_blocks_to_admit("a", Some(&no_blocks)).unwrap_err()
    ));
    // A real hit still counts.
    m.allocate_slots("a", &run(64, 0)).unwrap().unwrap();
    m.add_request("b", &tokens(64), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("b").unwrap();
    assert!(hit.num_computed_tokens > 0);
    m.num_blocks_to_admit("b", Some(&hit)).unwrap();
}

#[test]
fn a_reservation_past_the_pool_leaves_no_block_available() {
    // `usize::MAX` reserved blocks wrapped to one block more than free.
    for general_path in [false, true] {
        let groups = vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)];
        let mut m = KVCacheManager::new(&ManagerConfig::new(groups, 20, 128)).unwrap();
        m.general_path_only = general_path;
        m.add_request("a", &tokens(30), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &run(8, 0)).unwrap().unwrap();
        let before = snapshot(&m, &["a"]);
        let args = AllocateArgs {
            reserved_blocks: usize::MAX,
            ..run(8, 8)
        };
        assert_eq!(m.allocate_slots("a", &args).unwrap(), None);
        assert_eq!(snapshot(&m, &["a"]), before);
    }
}

// ----- a running Mamba step past the state the request keyed inside a block ------------------

#[test]
fn a_running_step_past_the_mamba_state_it_keyed_inside_a_block_is_refused() {
    // vLLM caches a request's blocks at its current computed count and passes that count to
    // its next `allocate_slots`, which copies a state keyed inside a block before the request
    // writes on. Caching at 24 tokens a request that ran to 33, then resuming it from 33,
    // retired the keyed block, took it back as its own copy and failed halfway ("cannot move
    // the keys of block 3 onto itself"), leaving the block leaked and its key gone.
    for general_path in [false, true] {
        let mut c =
            ManagerConfig::new(vec![GroupSpec::full(16), GroupSpec::mamba(16)], 6, 4096).dense();
        c.hash_block_size = Some(8);
        let mut m = KVCacheManager::new(&c).unwrap();
        m.general_path_only = general_path;
        m.add_request("a", &tokens(29), ExtraKeys::default())
            .unwrap();
        m.allocate_slots("a", &run(29, 0)).unwrap().unwrap();
        m.append_token_ids("a", &[100u32, 101, 102, 103, 104])
            .unwrap();
        m.allocate_slots("a", &run(4, 29)).unwrap().unwrap();
        let state = m.block_ids("a", 1).unwrap()[1];
        assert_eq!(m.num_free_blocks(), 0);
        // The prompt's latest hash boundary a resend can reach, (29 - 1) / 8 * 8 = 24, falls
        // inside Mamba block 1: the request keys its state there.
        m.cache_blocks("a", 24).unwrap();
        refused(&mut m, &["a"], invalid_argument, |m| {
            m.allocate_slots("a", &run(1, 33))
        });
        assert_eq!(m.block_ids("a", 1).unwrap()[1], state);
        assert_eq!(m.pool().ref_count(state).unwrap(), 1);
        // Resuming from 24 (what vLLM passes) is accepted: the copy waits for a free block.
        assert_eq!(m.allocate_slots("a", &run(9, 24)).unwrap(), None);
        // A remove_skipped_blocks past 24 frees the keyed block: the copy has nothing to read.
        m.remove_skipped_blocks("a", 33, None).unwrap();
        refused(&mut m, &["a"], invalid_argument, |m| {
            m.allocate_slots("a", &run(9, 24))
        });
    }
}

// ----- counts of a max_model_len near usize::MAX ---------------------------------------------

#[test]
fn block_counts_past_any_pool_saturate_and_the_allocation_is_refused() {
    // Block sizes of 3 and 5 and a max_model_len of usize::MAX: each group's count of blocks
    // for the lookahead slots is near usize::MAX / 5, and their sum overflowed (a panic with
    // overflow checks, a wrapped count that let the allocation run into the pool otherwise).
    let mut c = ManagerConfig::new(
        vec![GroupSpec::full(3), GroupSpec::sliding_window(5, 7)],
        64,
        usize::MAX,
    );
    c.enable_caching = false;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(40), ExtraKeys::default())
        .unwrap();
    m.allocate_slots("a", &run(33, 0)).unwrap().unwrap();
    // What left the window goes first (a refused allocation frees it too).
    m.remove_skipped_blocks("a", 33, None).unwrap();
    let before = snapshot(&m, &["a"]);
    for fits in [false, true] {
        let args = AllocateArgs {
            num_lookahead_tokens: usize::MAX - 40,
            full_sequence_must_fit: fits,
            ..run(7, 33)
        };
        assert_eq!(m.allocate_slots("a", &args).unwrap(), None);
        assert_eq!(snapshot(&m, &["a"]), before);
    }
    // The admission cap of a sliding window of 1-token blocks over usize::MAX tokens.
    assert_eq!(
        GroupSpec::sliding_window(1, 7).max_admission_blocks(usize::MAX, usize::MAX, 0),
        Some(usize::MAX)
    );
    // An EAGLE group whose block is usize::MAX tokens: the tokens it may cache saturate.
    let mut c = ManagerConfig::new(
        vec![
            GroupSpec::mamba(usize::MAX),
            GroupSpec::sliding_window(5, 7),
        ],
        64,
        100,
    );
    c.use_eagle = true;
    let mut m = KVCacheManager::new(&c).unwrap();
    m.add_request("a", &tokens(40), ExtraKeys::default())
        .unwrap();
    assert!(m.get_computed_blocks("a").unwrap().is_empty());
    m.allocate_slots("a", &run(33, 0)).unwrap().unwrap();
    m.cache_blocks("a", 33).unwrap();
}

#[test]
fn a_request_whose_multimodal_inputs_new_would_refuse_is_refused() {
    let extra = ExtraKeys {
        mm_inputs: vec![MmInput {
            identifier: "img".into(),
            offset: 5,
            length: usize::MAX,
        }],
        ..ExtraKeys::default()
    };
    let mut m = KVCacheManager::new(&ManagerConfig::new(vec![GroupSpec::full(4)], 16, 64)).unwrap();
    assert!(matches!(
        m.add_request("a", &tokens(20), extra.clone()),
        Err(CoreError::OutOfRange(_))
    ));
    assert!(matches!(
        m.add_request_prehashed("a", 2, vec![], vec![1, 2], extra.clone()),
        Err(CoreError::OutOfRange(_))
    ));
    assert!(matches!(
        m.prober().probe(&tokens(20), &extra),
        Err(CoreError::OutOfRange(_))
    ));
    assert_eq!(m.num_requests(), 0);
}
