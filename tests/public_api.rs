//! The public Rust API under extreme and malformed arguments, as a user of the rlib calls it:
//! every configuration either builds a manager or is refused, and every call either works or
//! returns an error that changes nothing (free blocks, the free order, reference counts, cached
//! keys, every request's tables and the effects handed to the worker). A panic anywhere is a
//! failure; each case is named in the report.

use hybrid_kv::manager::{
    AllocateArgs, AttentionKind, ComputedBlocks, GroupSpec, KVCacheManager, MambaMode,
    ManagerConfig,
};
use hybrid_kv::replay::{replay, SchedConfig, Workload, WorkloadRequest};
use hybrid_kv::{BlockHash, BlockId, BlockPool, ExtraKeys, MmInput, StoreInfo};
use std::panic::{catch_unwind, AssertUnwindSafe};

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

/// A case: `Some(description)` when it found a problem.
type Case = Box<dyn FnOnce() -> Option<String>>;

/// Runs every case, each under `catch_unwind`, and fails naming those that panicked or
/// reported a problem (`Some(description)`).
fn run_cases(cases: impl IntoIterator<Item = (String, Case)>) {
    let mut failures = Vec::new();
    for (name, case) in cases {
        match catch_unwind(AssertUnwindSafe(case)) {
            Ok(None) => {}
            Ok(Some(problem)) => failures.push(format!("{name}: {problem}")),
            Err(_) => failures.push(format!("{name}: panicked")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// What an error must leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    free: usize,
    order: Vec<BlockId>,
    refs: Vec<u32>,
    keys: usize,
    tables: Vec<Option<Vec<Vec<BlockId>>>>,
    retained: usize,
}

const IDS: [&str; 4] = ["a", "b", "c", "unknown"];

fn snapshot(m: &KVCacheManager) -> Snapshot {
    let pool = m.pool();
    Snapshot {
        free: m.num_free_blocks(),
        order: pool.free_order(),
        refs: (0..pool.num_blocks() as BlockId)
            .map(|b| pool.ref_count(b).unwrap())
            .collect(),
        keys: m.num_cached_keys(),
        tables: IDS.iter().map(|id| m.get_block_ids(*id).ok()).collect(),
        retained: m.num_retained_blocks(),
    }
}

/// Drains the effects handed to the worker; how many there were.
fn drain_effects(m: &mut KVCacheManager) -> usize {
    m.take_events().len()
        + m.take_new_block_ids().len()
        + m.take_boundary_state_offloads().len()
        + m.take_kv_cache_block_copies().0.len()
}

fn layouts() -> Vec<(&'static str, ManagerConfig)> {
    let base = |groups| ManagerConfig::new(groups, 40, 256);
    let mut out = vec![
        ("full", base(vec![GroupSpec::full(4)])),
        (
            "full+sw",
            base(vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)]),
        ),
        (
            "full+mamba",
            base(vec![GroupSpec::full(4), GroupSpec::mamba(8)]),
        ),
        (
            "full+mamba-checkpoints",
            base(vec![
                GroupSpec::full(4),
                GroupSpec::mamba_with_checkpoints(8, 1),
            ]),
        ),
        (
            "mla+sw-mla",
            base(vec![
                GroupSpec::new(AttentionKind::Mla, 4),
                GroupSpec::new(
                    AttentionKind::SlidingWindowMla {
                        window: 6,
                        bounded_replay: true,
                    },
                    4,
                ),
            ]),
        ),
        (
            "chunked",
            base(vec![GroupSpec::full(4), GroupSpec::chunked_local(4, 8)]),
        ),
        (
            "circular",
            base(vec![
                GroupSpec::full(4),
                GroupSpec::new(AttentionKind::CircularBuffer, 4),
            ]),
        ),
        (
            "rswa",
            base(vec![
                GroupSpec::full(4),
                GroupSpec::new(AttentionKind::Rswa { window: 6 }, 4),
            ]),
        ),
        ("attention-free", ManagerConfig::new(vec![], 1, 256)),
    ];
    let mut c = base(vec![GroupSpec::full(4), GroupSpec::mamba_none(4)]);
    c.enable_caching = false;
    out.push(("mamba-none", c));
    let mut c = base(vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 6)]);
    c.use_eagle = true;
    c.num_hash_lookahead_tokens = 1;
    c.num_prefill_lookahead = 2;
    out.push(("eagle", c));
    let mut c = base(vec![GroupSpec::full(4), GroupSpec::mamba(8)]);
    c.use_eagle = true;
    c.enable_mamba_shared_prefix_checkpoint = true;
    c.hash_block_size = Some(4);
    out.push(("mamba-shared-prefix", c));
    // Each with KV events on and another retention.
    let with_events: Vec<_> = out
        .iter()
        .map(|(name, c)| {
            let mut c = c.clone();
            c.enable_events = true;
            if c.groups
                .iter()
                .any(|g| g.is_sliding_window() || g.is_mamba())
            {
                c.retention_interval = None;
            }
            (*name, c)
        })
        .collect();
    out.extend(with_events);
    out
}

/// `b` cached and freed, `a` running with 33 of its 40 tokens, `c` waiting; the hit `c` finds.
fn setup(c: &ManagerConfig) -> (KVCacheManager, ComputedBlocks) {
    let mut m = KVCacheManager::new(c).unwrap();
    m.add_request("b", &tokens(40), ExtraKeys::default())
        .unwrap();
    let first = AllocateArgs {
        num_new_tokens: 40,
        ..Default::default()
    };
    m.allocate_slots("b", &first).unwrap();
    m.free("b").unwrap();
    m.add_request("a", &tokens(40), ExtraKeys::default())
        .unwrap();
    let first = AllocateArgs {
        num_new_tokens: 33,
        ..Default::default()
    };
    m.allocate_slots("a", &first).unwrap();
    m.add_request("c", &tokens(41), ExtraKeys::default())
        .unwrap();
    let hit = m.get_computed_blocks("c").unwrap();
    (m, hit)
}

type Call = Box<dyn Fn(&mut KVCacheManager, &ComputedBlocks, &ComputedBlocks) -> String>;

/// The calls, by name: each returns its result's `Debug` form.
fn calls(num_groups: usize) -> Vec<(String, Call)> {
    let big = usize::MAX;
    let mut out: Vec<(String, Call)> = Vec::new();
    let mut add = |name: String, call: Call| out.push((name, call));
    // Hits: none, the one found for c (h), another manager's (f), and malformed ones.
    let malformed = [
        (
            "repeated",
            ComputedBlocks::new(vec![vec![1, 1, 0, 39]; num_groups], 16),
        ),
        (
            "out-of-range",
            ComputedBlocks::new(vec![vec![1000, u32::MAX]; num_groups], 8),
        ),
        (
            "extra-group",
            ComputedBlocks::new(vec![vec![1]; num_groups + 1], 4),
        ),
        (
            "null",
            ComputedBlocks::new(vec![vec![0; 4]; num_groups], 16),
        ),
        ("huge", ComputedBlocks::new(vec![vec![]; num_groups], big)),
    ];
    // (new, computed, new computed (16: the hit's), lookahead, in flight, external, reserved)
    let counts = [
        (1, 0, 0, 0, 0, 0, 0),
        (8, 33, 0, 0, 0, 0, 0),
        (1, 40, 0, 0, 0, 0, 0),
        (7, 33, 0, 3, 0, 0, 0),
        (big, 0, 0, 0, 0, 0, 0),
        (1, big, 0, 0, 0, 0, 0),
        (1, 0, big, 0, 0, 0, 0),
        (1, 0, 0, big, 0, 0, 0),
        (1, 33, 0, 0, big, 0, 0),
        (1, 0, 0, 0, 0, big, 0),
        (1, 0, 0, 0, 0, 0, big),
        (200, 33, 0, 23, 0, 0, 0),
        (1, 33, 0, 0, 33, 0, 0),
        (5, 20, 0, 0, 0, 8, 0),
        (0, 0, 16, 0, 0, 0, 0),
        (4, 0, 16, 0, 0, 8, 0),
        (1, 36, 0, 0, 0, 0, 0),
        (3, 30, 0, 0, 10, 0, 0),
        (1, 0, 36, 0, 0, 0, 0),
        (4, 16, 16, 0, 0, 0, 0),
    ];
    for r in IDS {
        for hit in ["none", "found", "foreign", "malformed"] {
            for (i, &(n, computed, new_computed, look, in_flight, external, reserved)) in
                counts.iter().enumerate()
            {
                for must_fit in [false, true] {
                    let malformed = malformed.clone();
                    add(
                        format!("allocate_slots {r} hit={hit} counts#{i} must_fit={must_fit}"),
                        Box::new(move |m, found, foreign| {
                            let blocks = match hit {
                                "none" => None,
                                "found" => Some(found),
                                "foreign" => Some(foreign),
                                _ => Some(&malformed[i % malformed.len()].1),
                            };
                            let new_computed = match (new_computed, blocks) {
                                (16, Some(b)) => b.num_computed_tokens,
                                _ => new_computed,
                            };
                            let args = AllocateArgs {
                                num_new_tokens: n,
                                num_computed_tokens: computed,
                                num_new_computed_tokens: new_computed,
                                new_computed_blocks: blocks,
                                num_lookahead_tokens: look,
                                num_in_flight_tokens: in_flight,
                                num_external_computed_tokens: external,
                                reserved_blocks: reserved,
                                full_sequence_must_fit: must_fit,
                                delay_cache_blocks: must_fit,
                                has_scheduled_reqs: true,
                                skip_zeroing_group_ids: &[],
                            };
                            format!("{:?}", m.allocate_slots(r, &args))
                        }),
                    );
                }
            }
        }
        for (name, hit) in malformed.clone() {
            let h = hit.clone();
            add(
                format!("num_blocks_to_admit {r} {name}"),
                Box::new(move |m, _, _| format!("{:?}", m.num_blocks_to_admit(r, Some(&h)))),
            );
            add(
                format!("truncate_computed_blocks {name}"),
                Box::new(move |m, _, _| format!("{:?}", m.truncate_computed_blocks(&hit, 7))),
            );
        }
        add(
            format!("skip_zeroing_group_ids {r}"),
            Box::new(move |m, _, _| {
                let args = AllocateArgs {
                    num_new_tokens: 1,
                    num_external_computed_tokens: 4,
                    skip_zeroing_group_ids: &[0, 0, 99],
                    ..Default::default()
                };
                format!("{:?}", m.allocate_slots(r, &args))
            }),
        );
        for n in [0, 1, 4, 33, 40, 41, big] {
            let mut per_count: Vec<(&str, Call)> = vec![
                (
                    "cache_blocks",
                    Box::new(move |m, _, _| format!("{:?}", m.cache_blocks(r, n))),
                ),
                (
                    "remove_skipped_blocks",
                    Box::new(move |m, _, _| {
                        format!("{:?}", m.remove_skipped_blocks(r, n, Some(n)))
                    }),
                ),
                (
                    "record_blocks_for_zeroing",
                    Box::new(move |m, _, _| format!("{:?}", m.record_blocks_for_zeroing(r, n))),
                ),
                (
                    "finalize_partial_tail_offloads",
                    Box::new(move |m, _, _| {
                        format!("{:?}", m.finalize_partial_tail_offloads(r, 33, n))
                    }),
                ),
                (
                    "get_block_ids_for_computed_tokens",
                    Box::new(move |m, _, _| {
                        format!("{:?}", m.get_block_ids_for_computed_tokens(r, n))
                    }),
                ),
                (
                    "running_horizon_past",
                    Box::new(move |m, _, _| format!("{:?}", m.running_horizon_past(r, n))),
                ),
                (
                    "record_prefix_cache_stats",
                    Box::new(move |m, _, _| {
                        format!("{:?}", m.record_prefix_cache_stats(r, n, true))
                    }),
                ),
                (
                    "get_computed_blocks_capped",
                    Box::new(move |m, _, _| {
                        format!("{:?}", m.get_computed_blocks_capped(r, Some(n)))
                    }),
                ),
                (
                    "get_computed_blocks_for_connector",
                    Box::new(move |m, _, _| {
                        format!("{:?}", m.get_computed_blocks_for_connector(r, Some(n)))
                    }),
                ),
                (
                    "block_ids",
                    Box::new(move |m, _, _| format!("{:?}", m.block_ids(r, n))),
                ),
                (
                    "write_block_table",
                    Box::new(move |m, _, _| {
                        let mut out = [0i32; 20];
                        format!("{:?}", m.write_block_table(&[r, r], 0, &mut out, n))
                    }),
                ),
            ];
            for (name, call) in per_count.drain(..) {
                add(format!("{name} {r} {n}"), call);
            }
        }
        let mut per_request: Vec<(&str, Call)> = vec![
            (
                "append_token_ids negative",
                Box::new(move |m, _, _| format!("{:?}", m.append_token_ids(r, &[1i64, -1]))),
            ),
            (
                "append_token_ids past u32",
                Box::new(move |m, _, _| format!("{:?}", m.append_token_ids(r, &[1u64 << 40]))),
            ),
            (
                "append_token_ids past max_model_len",
                Box::new(move |m, _, _| format!("{:?}", m.append_token_ids(r, &[1u32; 300]))),
            ),
            (
                "append_token_ids_with_hashes mismatched",
                Box::new(move |m, _, _| {
                    let hashes = [BlockHash(1); 5];
                    format!(
                        "{:?}",
                        m.append_token_ids_with_hashes(r, &[1u32; 8], &hashes)
                    )
                }),
            ),
            (
                "estimate_cached_tokens",
                Box::new(move |m, _, _| format!("{:?}", m.estimate_cached_tokens(r))),
            ),
            (
                "pop_blocks_for_free",
                Box::new(move |m, _, _| format!("{:?}", m.pop_blocks_for_free(r))),
            ),
            ("free", Box::new(move |m, _, _| format!("{:?}", m.free(r)))),
            (
                "remove_request",
                Box::new(move |m, _, _| format!("{:?}", m.remove_request(r).map(|_| ()))),
            ),
            (
                "add_request again",
                Box::new(move |m, _, _| {
                    format!("{:?}", m.add_request(r, &tokens(5), ExtraKeys::default()))
                }),
            ),
        ];
        for (name, call) in per_request.drain(..) {
            add(format!("{name} {r}"), call);
        }
    }
    for ids in [&[0u32][..], &[1, 1], &[39], &[40], &[u32::MAX], &[5, 6, 7]] {
        add(
            format!("evict_blocks {ids:?}"),
            Box::new(move |m, _, _| format!("{:?}", m.evict_blocks(ids))),
        );
        add(
            format!("free_retained_blocks {ids:?}"),
            Box::new(move |m, _, _| format!("{:?}", m.free_retained_blocks(ids))),
        );
    }
    let overflowing = || ExtraKeys {
        mm_inputs: vec![MmInput {
            identifier: "img".into(),
            offset: 5,
            length: usize::MAX,
        }],
        ..ExtraKeys::default()
    };
    let mut others: Vec<(&str, Call)> = vec![
        (
            "add_request empty",
            Box::new(|m, _, _| {
                format!(
                    "{:?}",
                    m.add_request("n", &[] as &[u32], ExtraKeys::default())
                )
            }),
        ),
        (
            "add_request past max_model_len",
            Box::new(|m, _, _| {
                format!(
                    "{:?}",
                    m.add_request("n", &tokens(257), ExtraKeys::default())
                )
            }),
        ),
        (
            "add_request negative token",
            Box::new(|m, _, _| {
                format!(
                    "{:?}",
                    m.add_request("n", &[3i32, -3], ExtraKeys::default())
                )
            }),
        ),
        (
            "add_request overflowing multimodal input",
            Box::new(move |m, _, _| {
                format!("{:?}", m.add_request("n", &tokens(20), overflowing()))
            }),
        ),
        (
            "add_request_with_hashes mismatched",
            Box::new(|m, _, _| {
                let hashes = [BlockHash(1); 9];
                format!(
                    "{:?}",
                    m.add_request_with_hashes("n", &tokens(20), &hashes, ExtraKeys::default())
                )
            }),
        ),
        (
            "add_request_prehashed mismatched",
            Box::new(|m, _, _| {
                let r = m.add_request_prehashed(
                    "n",
                    20,
                    vec![BlockHash(1); 9],
                    vec![1, 2],
                    ExtraKeys::default(),
                );
                format!("{r:?}")
            }),
        ),
        (
            "add_request_prehashed huge",
            Box::new(|m, _, _| {
                let r =
                    m.add_request_prehashed("n", usize::MAX, vec![], vec![], ExtraKeys::default());
                format!("{r:?}")
            }),
        ),
        (
            "write_block_table no rows",
            Box::new(|m, _, _| format!("{:?}", m.write_block_table(&[], 0, &mut [], usize::MAX))),
        ),
        (
            "probe_with_max",
            Box::new(|m, _, _| {
                let p = m.prober();
                format!(
                    "{:?}",
                    p.probe_with_max(&tokens(41), &ExtraKeys::default(), usize::MAX)
                )
            }),
        ),
    ];
    for (name, call) in others.drain(..) {
        add(name.to_string(), call);
    }
    out
}

#[test]
fn calls_with_bad_arguments_are_errors_that_change_nothing() {
    let mut cases: Vec<(String, Case)> = Vec::new();
    for (layout, config) in layouts() {
        for (name, call) in calls(config.groups.len()) {
            let call = std::rc::Rc::new(call);
            // As set up; after a prefix-cache reset with `a` freed; after `a`'s blocks were
            // popped without freeing.
            for state in ["", " after reset", " after pop"] {
                let (config, call) = (config.clone(), call.clone());
                cases.push((
                    format!("{layout}{state}: {name}"),
                    Box::new(move || {
                        let (mut m, found) = setup(&config);
                        let (_, foreign) = setup(&config);
                        match state {
                            " after reset" => {
                                m.reset_prefix_cache();
                                m.free("a").unwrap();
                            }
                            " after pop" => {
                                m.pop_blocks_for_free("a").unwrap();
                            }
                            _ => {}
                        }
                        drain_effects(&mut m);
                        let before = snapshot(&m);
                        let result = call(&mut m, &found, &foreign);
                        if !result.starts_with("Err") {
                            return None;
                        }
                        let after = snapshot(&m);
                        let effects = drain_effects(&mut m);
                        (after != before || effects > 0).then(|| {
                            format!(
                                "{result} changed the manager: {before:?} -> {after:?}, \
                                 {effects} effects"
                            )
                        })
                    }),
                ));
            }
        }
    }
    run_cases(cases);
}

#[test]
fn every_configuration_builds_a_working_manager_or_is_refused() {
    let kinds = [
        AttentionKind::Full,
        AttentionKind::Rswa { window: usize::MAX },
        AttentionKind::SlidingWindow { window: 1 },
        AttentionKind::SlidingWindow { window: usize::MAX },
        AttentionKind::SlidingWindowMla {
            window: usize::MAX,
            bounded_replay: true,
        },
        AttentionKind::ChunkedLocal { chunk: 1 },
        AttentionKind::ChunkedLocal { chunk: usize::MAX },
        AttentionKind::Mamba {
            mode: MambaMode::Align,
            speculative_blocks: 0,
            prefill_checkpoint_alignment: usize::MAX,
        },
        AttentionKind::Mamba {
            mode: MambaMode::None,
            speculative_blocks: i32::MAX as usize,
            prefill_checkpoint_alignment: 7,
        },
        AttentionKind::CircularBuffer,
    ];
    let block_sizes = [1, 3, 16, 1 << 20, u32::MAX as usize, usize::MAX];
    let others = [
        None,
        Some(GroupSpec::full(16)),
        Some(GroupSpec::sliding_window(5, 7)),
    ];
    let mut cases: Vec<(String, Case)> = Vec::new();
    for kind in kinds {
        for bs in block_sizes {
            for other in others.iter().copied().chain([Some(GroupSpec::mamba(bs))]) {
                for caching in [true, false] {
                    for max_model_len in [1, 100, usize::MAX] {
                        for (eagle, lookahead) in [(false, 0), (true, 1), (true, 7)] {
                            let mut groups = vec![GroupSpec::new(kind, bs)];
                            groups.extend(other);
                            let mut c = ManagerConfig::new(groups, 64, max_model_len);
                            c.enable_caching = caching;
                            c.use_eagle = eagle;
                            c.num_hash_lookahead_tokens = lookahead;
                            c.num_prefill_lookahead = lookahead;
                            if lookahead == 7 {
                                c.retention_interval = None;
                                c.max_in_flight_tokens = Some(usize::MAX);
                            }
                            cases.push((format!("{c:?}"), Box::new(move || exercise(&c))));
                        }
                    }
                }
            }
        }
    }
    run_cases(cases);
}

/// Builds a manager for `c` (if it is accepted) and runs a request through it with extreme
/// counts; `Some` when an error changed the manager.
fn exercise(c: &ManagerConfig) -> Option<String> {
    let mut m = KVCacheManager::new(c).ok()?;
    let _ = m.add_request("a", &tokens(40), ExtraKeys::default());
    let _ = m.get_computed_blocks("a");
    let _ = m.get_computed_blocks_capped("a", Some(usize::MAX));
    let _ = m.num_blocks_to_admit("a", None);
    let admit = AllocateArgs {
        num_new_tokens: 33,
        full_sequence_must_fit: true,
        ..Default::default()
    };
    let _ = m.allocate_slots("a", &admit);
    let _ = m.remove_skipped_blocks("a", 33, None);
    let before = snapshot(&m);
    let step = AllocateArgs {
        num_new_tokens: 7,
        num_computed_tokens: 33,
        num_lookahead_tokens: usize::MAX - 40,
        ..Default::default()
    };
    let r = m.allocate_slots("a", &step);
    if r.is_err() && snapshot(&m) != before {
        return Some(format!("{r:?} changed the manager"));
    }
    let _ = m.running_horizon("a");
    let _ = m.estimate_cached_tokens("a");
    let _ = m.get_block_ids_for_computed_tokens("a", usize::MAX);
    let _ = m.free("a");
    let _ = m.add_request("b", &tokens(40), ExtraKeys::default());
    let _ = m.get_computed_blocks("b");
    None
}

#[test]
fn pool_calls_with_bad_ids_are_errors_that_change_nothing() {
    type PoolCall = Box<dyn Fn(&BlockPool, &[BlockId]) -> String>;
    let calls: Vec<(&str, PoolCall)> = vec![
        (
            "free_blocks",
            Box::new(|p, ids| format!("{:?}", p.free_blocks(ids))),
        ),
        ("touch", Box::new(|p, ids| format!("{:?}", p.touch(ids)))),
        (
            "evict_blocks",
            Box::new(|p, ids| format!("{:?}", p.evict_blocks(ids))),
        ),
        (
            "cache_full_blocks",
            Box::new(|p, ids| {
                let info = StoreInfo {
                    first_block: usize::MAX,
                    block_size: u32::MAX,
                    token_ids: &[1, 2],
                    ..StoreInfo::default()
                };
                let hashes = vec![BlockHash(7); ids.len()];
                format!("{:?}", p.cache_full_blocks(ids, &hashes, 3, info))
            }),
        ),
        (
            "cache_full_blocks mismatched",
            Box::new(|p, ids| {
                let r = p.cache_full_blocks(ids, &[BlockHash(7)], 0, StoreInfo::default());
                format!("{r:?}")
            }),
        ),
        (
            "add_block_key",
            Box::new(|p, ids| {
                let id = ids.last().copied().unwrap_or(u32::MAX);
                format!(
                    "{:?}",
                    p.add_block_key(id, BlockHash(2), 0, StoreInfo::default())
                )
            }),
        ),
        (
            "move_block_keys",
            Box::new(|p, ids| match ids {
                [a, b, ..] => format!("{:?}", p.move_block_keys(*a, *b)),
                [a] => format!("{:?}", p.move_block_keys(*a, *a)),
                [] => format!("{:?}", p.move_block_keys(1, u32::MAX)),
            }),
        ),
        (
            "get_new_blocks",
            Box::new(|p, ids| format!("{:?}", p.get_new_blocks(ids.len() * 3))),
        ),
    ];
    let id_lists: [&[BlockId]; 9] = [
        &[],
        &[0],
        &[1],
        &[2, 2],
        &[3],
        &[8],
        &[u32::MAX],
        &[2, 3, 9],
        &[3, 1, 2],
    ];
    let mut cases: Vec<(String, Case)> = Vec::new();
    let calls = std::rc::Rc::new(calls);
    for ids in id_lists {
        for i in 0..calls.len() {
            let calls = calls.clone();
            cases.push((
                format!("{} {ids:?}", calls[i].0),
                Box::new(move || {
                    // Block 1 cached and free, 2 cached and held, 3 held.
                    let p = BlockPool::with_options(8, true, true).unwrap();
                    let b = p.get_new_blocks(3).unwrap();
                    let hashes = [BlockHash(1), BlockHash(2)];
                    p.cache_full_blocks(&b[..2], &hashes, 0, StoreInfo::default())
                        .unwrap();
                    p.free_blocks(&b[..1]).unwrap();
                    p.take_events();
                    let state = |p: &BlockPool| {
                        let ids = 0..p.num_blocks() as BlockId;
                        (
                            p.num_free_blocks(),
                            p.num_cached_keys(),
                            p.free_order(),
                            ids.clone()
                                .map(|b| p.ref_count(b).unwrap())
                                .collect::<Vec<_>>(),
                            ids.map(|b| p.block_keys(b).unwrap()).collect::<Vec<_>>(),
                        )
                    };
                    let before = state(&p);
                    let result = (calls[i].1)(&p, ids);
                    let events = p.take_events().len();
                    (result.starts_with("Err") && (state(&p) != before || events > 0))
                        .then(|| format!("{result} changed the pool"))
                }),
            ));
        }
    }
    run_cases(cases);
}

#[test]
fn replay_of_extreme_workloads_ends_or_is_refused() {
    let request = |rid: &str, arrival_step, prompt, output| WorkloadRequest {
        rid: rid.into(),
        arrival_step,
        prompt: tokens(prompt),
        output: tokens(output),
    };
    let workload = |requests, max_num_seqs, max_num_batched_tokens| Workload {
        name: "extreme".into(),
        sched: SchedConfig {
            max_num_seqs,
            max_num_batched_tokens,
            long_prefill_token_threshold: 0,
            max_model_len: 256,
        },
        num_blocks: 64,
        requests,
    };
    let full = || ManagerConfig::new(vec![GroupSpec::full(4)], 64, 256);
    let cases: Vec<(&str, Workload, ManagerConfig, bool)> = vec![
        (
            "arrival at usize::MAX",
            workload(vec![request("a", usize::MAX, 10, 3)], 4, 64),
            full(),
            false,
        ),
        (
            "duplicate ids",
            workload(vec![request("a", 0, 10, 3), request("a", 0, 10, 3)], 4, 64),
            full(),
            false,
        ),
        (
            "huge limits",
            workload(vec![request("a", 0, 10, 3)], usize::MAX, usize::MAX),
            full(),
            true,
        ),
        (
            "mamba, small batches",
            workload(
                vec![request("a", 0, 100, 3), request("b", 1, 100, 30)],
                2,
                3,
            ),
            ManagerConfig::new(
                vec![GroupSpec::full(4), GroupSpec::mamba_with_checkpoints(8, 1)],
                64,
                256,
            ),
            true,
        ),
        (
            "attention-free",
            workload(vec![request("a", 0, 10, 3)], 1, 4),
            ManagerConfig::new(vec![], 1, 256),
            true,
        ),
    ];
    run_cases(cases.into_iter().map(|(name, w, c, ends)| {
        let case: Case = Box::new(move || {
            let mut m = KVCacheManager::new(&c).unwrap();
            let r = replay(&w, &mut m, &mut |_| {});
            (r.is_ok() != ends).then(|| format!("{:?}", r.map(|s| s.num_finished)))
        });
        (name.to_string(), case)
    }));
}
