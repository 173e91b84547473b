use super::*;

fn h(x: u128) -> BlockHash {
    BlockHash(x)
}

fn cache(pool: &BlockPool, blocks: &[BlockId], hashes: &[u128], group: GroupId) {
    let hashes: Vec<BlockHash> = hashes.iter().map(|&x| h(x)).collect();
    pool.cache_full_blocks(blocks, &hashes, group, StoreInfo::default())
        .unwrap();
}

#[test]
fn initial_free_order_is_ids_one_to_n_minus_one() {
    let pool = BlockPool::new(6).unwrap();
    assert_eq!(pool.free_order(), vec![1, 2, 3, 4, 5]);
    assert_eq!(pool.num_free_blocks(), 5);
    assert_eq!(pool.usage(), 0.0);
}

#[test]
fn free_order_matches_vllm_worked_example() {
    // The observable check of the issue: uncached frees go in front (LIFO), cached ones at the
    // back (LRU), touched cached blocks leave the order.
    let pool = BlockPool::new(11).unwrap();
    assert_eq!(pool.get_new_blocks(4).unwrap(), vec![1, 2, 3, 4]);
    cache(&pool, &[1, 2, 3], &[11, 12, 13], 0);
    pool.touch(&[1, 2, 3]).unwrap();
    assert_eq!(pool.get_new_blocks(1).unwrap(), vec![5]);
    pool.free_blocks(&[4, 3, 2, 1]).unwrap();
    pool.free_blocks(&[5, 3, 2, 1]).unwrap();
    let expected = vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1];
    assert_eq!(pool.free_order(), expected);
    assert_eq!(pool.get_new_blocks(10).unwrap(), expected);
    assert_eq!(pool.num_free_blocks(), 0);
}

#[test]
fn get_new_blocks_is_all_or_nothing() {
    let pool = BlockPool::new(4).unwrap();
    let err = pool.get_new_blocks(4).unwrap_err();
    assert_eq!(
        err,
        CoreError::NotEnoughFreeBlocks {
            requested: 4,
            free: 3
        }
    );
    assert_eq!(pool.free_order(), vec![1, 2, 3]);
    assert_eq!(pool.get_new_blocks(0).unwrap(), Vec::<BlockId>::new());
}

#[test]
fn null_block_is_never_handed_out_and_ignored_by_free_and_touch() {
    let pool = BlockPool::new(3).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    assert!(!blocks.contains(&NULL_BLOCK));
    pool.touch(&[NULL_BLOCK]).unwrap();
    pool.free_blocks(&[NULL_BLOCK, blocks[0], NULL_BLOCK])
        .unwrap();
    assert_eq!(pool.num_free_blocks(), 1);
    assert_eq!(pool.ref_count(NULL_BLOCK).unwrap(), 0);
}

#[test]
fn reusing_a_cached_block_evicts_its_key_and_reports_it() {
    let pool = BlockPool::with_options(3, true, true).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    cache(&pool, &blocks, &[7, 8], 3);
    assert_eq!(pool.lookup(h(7), 3), Some(blocks[0]));
    assert_eq!(
        pool.lookup(h(7), 2),
        None,
        "groups are cached independently"
    );
    pool.free_blocks(&[blocks[1], blocks[0]]).unwrap();
    assert_eq!(
        pool.lookup(h(8), 3),
        Some(blocks[1]),
        "free cached block stays findable"
    );
    let events = pool.take_events();
    assert_eq!(events.len(), 1);
    assert!(
        matches!(&events[0], KvEvent::BlockStored { block_hashes, group_id: 3, .. }
        if block_hashes == &vec![h(7), h(8)])
    );
    // LRU: blocks[1] was freed first, so it is evicted first.
    assert_eq!(pool.get_new_blocks(1).unwrap(), vec![blocks[1]]);
    assert_eq!(pool.lookup(h(8), 3), None);
    assert_eq!(pool.num_cached_keys(), 1);
    assert_eq!(
        pool.take_events(),
        vec![KvEvent::BlockRemoved {
            block_hash: h(8),
            group_id: 3,
            on_reuse: true,
        }]
    );
}

#[test]
fn touch_revives_a_cached_block_out_of_the_free_order() {
    let pool = BlockPool::new(4).unwrap();
    let blocks = pool.get_new_blocks(3).unwrap();
    cache(&pool, &blocks[..1], &[1], 0);
    pool.free_blocks(&[1, 2, 3]).unwrap();
    assert_eq!(
        pool.free_order(),
        vec![2, 3, 1],
        "uncached in front in given order"
    );
    pool.touch(&[1]).unwrap();
    assert_eq!(pool.ref_count(1).unwrap(), 1);
    assert_eq!(pool.free_order(), vec![2, 3]);
    assert_eq!(pool.num_free_blocks(), 2);
    assert_eq!(pool.lookup(h(1), 0), Some(1));
}

#[test]
fn duplicates_of_identical_content_are_allowed() {
    let pool = BlockPool::new(4).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    cache(&pool, &blocks[..1], &[5], 0);
    cache(&pool, &blocks[1..], &[5], 0);
    assert_eq!(pool.num_cached_keys(), 1);
    assert_eq!(pool.lookup(h(5), 0), Some(blocks[0]), "first inserted wins");
    pool.evict_blocks(&blocks[..1]).unwrap();
    assert_eq!(pool.lookup(h(5), 0), Some(blocks[1]));
    pool.evict_blocks(&blocks[1..]).unwrap();
    assert_eq!(pool.lookup(h(5), 0), None);
    assert_eq!(pool.num_cached_keys(), 0);
}

#[test]
fn get_cached_block_needs_every_group() {
    let pool = BlockPool::new(4).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    cache(&pool, &blocks[..1], &[9], 0);
    assert_eq!(pool.get_cached_block(h(9), &[0, 1]), None);
    cache(&pool, &blocks[1..], &[9], 1);
    assert_eq!(pool.get_cached_block(h(9), &[0, 1]), Some(blocks.clone()));
}

#[test]
fn double_free_is_rejected_and_changes_nothing() {
    let pool = BlockPool::new(5).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    let order = pool.free_order();
    let err = pool
        .free_blocks(&[blocks[0], blocks[1], blocks[1]])
        .unwrap_err();
    assert_eq!(err, CoreError::DoubleFree(blocks[1]));
    assert_eq!(pool.free_order(), order);
    assert_eq!(pool.ref_count(blocks[0]).unwrap(), 1);
    assert_eq!(pool.ref_count(blocks[1]).unwrap(), 1);
    assert_eq!(pool.num_free_blocks(), 2);
    assert_eq!(
        pool.free_blocks(&[4]).unwrap_err(),
        CoreError::DoubleFree(4)
    );
}

#[test]
fn out_of_range_ids_are_rejected_and_change_nothing() {
    let pool = BlockPool::new(5).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    let bad = CoreError::InvalidBlockId {
        id: 5,
        num_blocks: 5,
    };
    assert_eq!(pool.free_blocks(&[blocks[0], 5]).unwrap_err(), bad);
    assert_eq!(pool.touch(&[blocks[0], 5]).unwrap_err(), bad);
    assert_eq!(pool.evict_blocks(&[5]).unwrap_err(), bad);
    assert_eq!(pool.ref_count(blocks[0]).unwrap(), 1);
    assert_eq!(pool.num_free_blocks(), 2);
}

#[test]
fn caching_a_free_block_is_rejected() {
    let pool = BlockPool::new(5).unwrap();
    let err = pool
        .cache_full_blocks(&[2], &[h(1)], 0, StoreInfo::default())
        .unwrap_err();
    assert_eq!(err, CoreError::NotInUse(2));
    assert_eq!(pool.num_cached_keys(), 0);
    let err = pool
        .cache_full_blocks(&[2, 3], &[h(1)], 0, StoreInfo::default())
        .unwrap_err();
    assert_eq!(
        err,
        CoreError::LengthMismatch {
            blocks: 2,
            hashes: 1
        }
    );
}

#[test]
fn reset_prefix_cache_is_refused_while_blocks_are_in_use() {
    let pool = BlockPool::with_options(4, true, true).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    cache(&pool, &blocks, &[1, 2], 0);
    assert!(!pool.reset_prefix_cache());
    assert_eq!(pool.num_cached_keys(), 2);
    pool.free_blocks(&blocks).unwrap();
    let order = pool.free_order();
    assert!(pool.reset_prefix_cache());
    assert_eq!(pool.num_cached_keys(), 0);
    assert_eq!(pool.lookup(h(1), 0), None);
    assert_eq!(pool.free_order(), order, "reset keeps the free order");
    assert_eq!(pool.take_events().last(), Some(&KvEvent::AllBlocksCleared));
}

#[test]
fn with_caching_off_every_free_goes_to_the_front() {
    let pool = BlockPool::with_options(4, false, false).unwrap();
    let blocks = pool.get_new_blocks(3).unwrap();
    cache(&pool, &blocks, &[1, 2, 3], 0);
    assert_eq!(pool.num_cached_keys(), 0);
    pool.free_blocks(&[3, 1]).unwrap();
    assert_eq!(pool.free_order(), vec![3, 1]);
}

#[test]
fn pool_size_limits_are_errors() {
    assert!(matches!(BlockPool::new(0), Err(CoreError::PoolTooSmall(0))));
    // Only the null block (an attention-free model): nothing to hand out, usage 0.
    let pool = BlockPool::new(1).unwrap();
    assert_eq!((pool.num_free_blocks(), pool.usage()), (0, 0.0));
    assert!(matches!(
        pool.get_new_blocks(1),
        Err(CoreError::NotEnoughFreeBlocks { .. })
    ));
    assert!(matches!(
        BlockPool::new(MAX_BLOCKS + 1),
        Err(CoreError::PoolTooLarge(_))
    ));
}

#[test]
fn stale_entries_are_compacted_and_order_is_kept() {
    // Revive and free the same cached blocks many times: each cycle leaves a stale entry.
    let pool = BlockPool::new(8).unwrap();
    let blocks = pool.get_new_blocks(7).unwrap();
    cache(&pool, &blocks, &[1, 2, 3, 4, 5, 6, 7], 0);
    pool.free_blocks(&blocks).unwrap();
    for _ in 0..100 {
        pool.touch(&[3, 5]).unwrap();
        pool.free_blocks(&[5, 3]).unwrap();
    }
    assert!(pool.states.physical_len() <= 2 * 8 + 8 + 2);
    assert_eq!(pool.free_order(), vec![1, 2, 4, 6, 7, 5, 3]);
    assert_eq!(pool.num_free_blocks(), 7);
}

#[test]
fn huge_allocation_requests_are_refused_before_anything_is_allocated() {
    let pool = BlockPool::new(16).unwrap();
    for n in [16, 1 << 40, 1 << 62, usize::MAX] {
        assert_eq!(
            pool.get_new_blocks(n),
            Err(CoreError::NotEnoughFreeBlocks {
                requested: n,
                free: 15
            })
        );
        let mut out = vec![7];
        assert!(pool.get_new_blocks_into(n, &mut out).is_err());
        assert_eq!(out, vec![7], "nothing appended");
    }
    assert_eq!(pool.free_order(), (1..16).collect::<Vec<_>>());
    assert_eq!(pool.num_free_blocks(), 15);
}

#[test]
fn a_huge_double_free_is_rejected_and_changes_nothing() {
    let pool = BlockPool::new(8).unwrap();
    let blocks = pool.get_new_blocks(3).unwrap();
    let mut batch = blocks.clone();
    batch.extend(std::iter::repeat_n(blocks[1], 100_000));
    assert_eq!(
        pool.free_blocks(&batch),
        Err(CoreError::DoubleFree(blocks[1]))
    );
    assert_eq!(pool.num_free_blocks(), 4);
    assert!(blocks.iter().all(|&b| pool.ref_count(b) == Ok(1)));
}

#[test]
fn a_block_listed_as_often_as_it_is_held_is_freed_in_one_batch() {
    let pool = BlockPool::new(8).unwrap();
    let blocks = pool.get_new_blocks(2).unwrap();
    pool.touch(&blocks[..1]).unwrap();
    pool.free_blocks(&[blocks[0], blocks[1], blocks[0]])
        .unwrap();
    assert_eq!(pool.num_free_blocks(), 7);
    assert_eq!(pool.free_order()[..2], [blocks[1], blocks[0]]);
}

#[test]
fn a_double_free_reports_the_block_a_sequential_release_would_fail_on() {
    let pool = BlockPool::new(8).unwrap();
    let [a, b] = pool.get_new_blocks(2).unwrap()[..] else {
        unreachable!()
    };
    let free = 5;
    // `a` is held once: its second listing fails before the free block is reached, and the
    // other way round.
    assert_eq!(
        pool.free_blocks(&[a, b, a, free]),
        Err(CoreError::DoubleFree(a))
    );
    assert_eq!(
        pool.free_blocks(&[free, a, a]),
        Err(CoreError::DoubleFree(free))
    );
    assert_eq!(
        pool.free_blocks(&[b, a, b, b]),
        Err(CoreError::DoubleFree(b))
    );
    assert_eq!(pool.num_free_blocks(), 5);
    assert_eq!((pool.ref_count(a), pool.ref_count(b)), (Ok(1), Ok(1)));
}

#[test]
fn blocks_that_share_a_validation_bucket_are_not_taken_for_duplicates() {
    // Ids 4096 apart share a bucket of the validation bitmap; they are still different blocks.
    let pool = BlockPool::new(9000).unwrap();
    let blocks = pool.get_new_blocks(8999).unwrap();
    let batch = [5, 4101, 8197, 6, 4102];
    pool.free_blocks(&batch).unwrap();
    assert_eq!(pool.num_free_blocks(), 5);
    assert_eq!(
        pool.free_blocks(&[7, 4103, 7]),
        Err(CoreError::DoubleFree(7))
    );
    assert_eq!(
        pool.free_blocks(&[7, 4103, 4103]),
        Err(CoreError::DoubleFree(4103))
    );
    assert_eq!(pool.ref_count(7), Ok(1));
    assert_eq!(pool.num_free_blocks(), 5);
    drop(blocks);
}

#[test]
fn a_pool_larger_than_the_memory_available_is_refused_before_its_pages_are_taken() {
    // A pool whose reference counts alone take `CHECKED_BYTES`: all its arrays are checked
    // together before any is allocated (the test would take ~1 GiB otherwise).
    let n = alloc::CHECKED_BYTES / 8;
    let arrays = BlockPool::heap_bytes(n, true);
    assert!(arrays > 100 * n, "{arrays}");
    assert!(BlockPool::heap_bytes(n, false) < arrays);
    alloc::inject::set_available(Some(arrays - 1));
    let result = BlockPool::new(n);
    alloc::inject::set_available(None);
    let Err(
        err @ CoreError::OutOfMemory {
            what,
            bytes,
            num_blocks,
        },
    ) = result
    else {
        panic!("{:?}", result.map(|p| p.num_blocks()));
    };
    assert_eq!(
        (what, bytes, num_blocks),
        ("per-block arrays", arrays, n),
        "{err}"
    );
    // Each large array is checked again as it is allocated (the memory available shrinks as
    // the ones before it are written): the free order's FIFO, which is not a page array.
    alloc::inject::set_available(Some(alloc::CHECKED_BYTES));
    let order = super::free_order::FreeOrder::new(n);
    alloc::inject::set_available(None);
    let Err(failed) = order else {
        panic!("the FIFO was allocated");
    };
    assert_eq!(failed.what, "free order's FIFO");
    assert!(failed.bytes > alloc::CHECKED_BYTES, "{failed}");
    // Under the threshold nothing is checked: a small pool builds whatever is reported.
    alloc::inject::set_available(Some(0));
    let small = BlockPool::new(1000);
    alloc::inject::set_available(None);
    assert_eq!(small.unwrap().get_new_blocks(999).unwrap().len(), 999);
    assert!(alloc::fits(alloc::CHECKED_BYTES - 1));
}

#[test]
fn the_memory_available_is_read_from_meminfo() {
    let info = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n\
                SwapTotal: 4 kB\nSwapFree:        2048 kB\n";
    assert_eq!(alloc::parse_meminfo(info), Some((20_000_000 + 2048) * 1024));
    // No swap line: swap counts as none; no MemAvailable (kernels before 3.14): unknown.
    assert_eq!(alloc::parse_meminfo("MemAvailable: 1 kB\n"), Some(1024));
    assert_eq!(
        alloc::parse_meminfo("MemFree: 1 kB\nSwapFree: 1 kB\n"),
        None
    );
    // A prefix of another field's name is not the field.
    assert_eq!(
        alloc::parse_meminfo("MemAvailableX: 5 kB\nMemAvailable: 2 kB\n"),
        Some(2048)
    );
    assert_eq!(alloc::parse_meminfo("MemAvailable: lots kB\n"), None);
}

#[test]
fn the_memory_limit_of_the_process_cgroup_bounds_the_memory_available() {
    // cgroup v1 (this list's memory line) and v2 (the unified `0::` line), as in a container.
    let groups = "9:name=systemd:/\n4:memory:/pods/a/\n2:cpu,cpuacct:/x\n0::/kubepods/b\n";
    assert_eq!(
        alloc::cgroup_memory_files(groups),
        vec![
            (
                "/sys/fs/cgroup/memory/pods/a/memory.limit_in_bytes".to_string(),
                "/sys/fs/cgroup/memory/pods/a/memory.usage_in_bytes".to_string()
            ),
            (
                "/sys/fs/cgroup/kubepods/b/memory.max".to_string(),
                "/sys/fs/cgroup/kubepods/b/memory.current".to_string()
            ),
        ]
    );
    // A group at the root of its mount (a container with its own cgroup namespace).
    assert_eq!(
        alloc::cgroup_memory_files("0::/\n")[0].0,
        "/sys/fs/cgroup/memory.max"
    );
    assert_eq!(alloc::cgroup_memory_files("garbage\n1:cpu:/\n"), vec![]);
    // Room under the limit; none without one (v2's `max`, v1's unlimited value) or on junk.
    assert_eq!(
        alloc::cgroup_room("4294967296\n", "1073741824\n"),
        Some(3 << 30)
    );
    assert_eq!(alloc::cgroup_room("100", "150"), Some(0));
    assert_eq!(alloc::cgroup_room("max\n", "5"), None);
    assert_eq!(
        alloc::cgroup_room("9223372036854771712", "3591593984"),
        None
    );
    assert_eq!(alloc::cgroup_room("12", "lots"), None);
}

#[test]
fn a_pool_whose_arrays_cannot_be_allocated_is_an_error_naming_the_size() {
    // Fail each allocation of the constructor in turn: every one is an error, none aborts.
    let mut failures = Vec::new();
    for k in 0.. {
        alloc::inject::fail_after(Some(k));
        let result = BlockPool::new(1000);
        alloc::inject::fail_after(None);
        match result {
            Ok(pool) => {
                assert_eq!(pool.get_new_blocks(999).unwrap().len(), 999);
                break;
            }
            Err(err) => failures.push(err),
        }
    }
    assert!(failures.len() >= 7, "{failures:?}");
    for err in &failures {
        let CoreError::OutOfMemory {
            what,
            bytes,
            num_blocks,
        } = err
        else {
            panic!("{err:?}");
        };
        assert_eq!(*num_blocks, 1000);
        // Every array has an entry of at least a byte per block (the cached flags: one byte).
        assert!(*bytes >= 1000, "{err}");
        assert!(err.to_string().contains(what), "{err}");
    }
}

#[test]
fn stale_stack_entries_are_compacted_and_order_is_kept() {
    // Uncached free blocks revived and freed again: each cycle leaves a stale stack entry, so
    // the stack fills and is compacted.
    let pool = BlockPool::new(8).unwrap();
    let mut oracle = crate::RefBlockPool::new(8, true, false).unwrap();
    let blocks = pool.get_new_blocks(7).unwrap();
    assert_eq!(oracle.get_new_blocks(7).unwrap(), blocks);
    pool.free_blocks(&blocks).unwrap();
    oracle.free_blocks(&blocks).unwrap();
    for i in 0..100u32 {
        let pair = [1 + i % 7, 1 + (i * 3) % 7];
        pool.touch(&pair).unwrap();
        oracle.touch(&pair).unwrap();
        pool.free_blocks(&pair).unwrap();
        oracle.free_blocks(&pair).unwrap();
        assert!(pool.states.physical_len() <= 2 * 8 + 8);
    }
    assert_eq!(pool.free_order(), oracle.free_order());
    assert_eq!(pool.num_free_blocks(), 7);
}

#[test]
fn pool_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<BlockPool>();
}

#[test]
fn a_request_sized_batch_is_validated_block_by_block() {
    // A batch listing at least one block per 256 of the pool is checked with a bit per block:
    // repeats of blocks held twice pass, a repeat of a block held once fails, wherever it is.
    let pool = BlockPool::new(9000).unwrap();
    let blocks = pool.get_new_blocks(8999).unwrap();
    pool.touch(&[blocks[10], blocks[7000]]).unwrap();
    let mut batch: Vec<BlockId> = blocks[..6000].iter().rev().copied().collect();
    batch.push(blocks[10]);
    let mut bad = batch.clone();
    bad.insert(3000, blocks[4500]);
    assert_eq!(
        pool.free_blocks(&bad),
        Err(CoreError::DoubleFree(blocks[4500]))
    );
    assert_eq!(pool.num_free_blocks(), 0);
    pool.free_blocks(&batch).unwrap();
    assert_eq!(pool.num_free_blocks(), 6000);
    assert_eq!(pool.ref_count(blocks[10]), Ok(0));
    let mut rest: Vec<BlockId> = blocks[6000..].to_vec();
    rest.push(blocks[7000]);
    pool.free_blocks(&rest).unwrap();
    assert_eq!(pool.num_free_blocks(), 8999);
}

/// Blocks 1..=12 held: 1-6 cached, 2, 5 and 9 held twice (a request's "groups" mix them).
fn twelve_held_blocks() -> BlockPool {
    let pool = BlockPool::new(16).unwrap();
    let blocks = pool.get_new_blocks(12).unwrap();
    cache(&pool, &blocks[..6], &[1, 2, 3, 4, 5, 6], 0);
    pool.touch(&[2, 5, 9]).unwrap();
    pool
}

/// The same blocks freed as `free_blocks` batches in turn and as one `free_held` of the
/// batches: the same free order, the same free count, for every way of cutting the list.
#[test]
fn free_held_in_batches_leaves_the_order_of_one_free_per_batch() {
    let build = twelve_held_blocks;
    let all: Vec<BlockId> = vec![9, 3, 1, 12, 8, 2, 11, 6, 5, 10, 7, 4];
    for cuts in [
        vec![12],
        vec![3, 12],
        vec![0, 5, 5, 12],
        vec![2, 4, 7, 9, 12],
    ] {
        let reference = build();
        let mut start = 0;
        for &end in &cuts {
            reference.free_blocks(&all[start..end]).unwrap();
            start = end;
        }
        let batched = build();
        batched.free_held(&all, &cuts).unwrap();
        assert_eq!(
            batched.free_order(),
            reference.free_order(),
            "cuts {cuts:?}"
        );
        assert_eq!(batched.num_free_blocks(), reference.num_free_blocks());
        for id in [2, 5, 9] {
            assert_eq!(batched.ref_count(id).unwrap(), 1);
        }
        // Allocations see the same order.
        let n = batched.num_free_blocks();
        assert_eq!(
            batched.get_new_blocks(n).unwrap(),
            reference.get_new_blocks(n).unwrap()
        );
    }
}

/// Tables freed tail first where they are (nulls among them) leave the pool as `free_held` of
/// the same tables reversed with their nulls dropped: the same order, count and references.
#[test]
fn free_held_tail_first_is_free_held_of_the_reversed_tables() {
    let build = twelve_held_blocks;
    let tables: Vec<Vec<BlockId>> = vec![
        vec![NULL_BLOCK, 9, 3, NULL_BLOCK, 1],
        vec![],
        vec![12, 8, 2, 11, NULL_BLOCK],
        vec![6, 5, 10, 7, 4],
    ];
    let reference = build();
    let mut flat = Vec::new();
    let mut ends = Vec::new();
    for t in &tables {
        flat.extend(t.iter().rev().filter(|&&b| b != NULL_BLOCK));
        ends.push(flat.len());
    }
    reference.free_held(&flat, &ends).unwrap();
    let tail_first = build();
    let listed = tables.iter().map(Vec::len).sum();
    tail_first
        .free_held_tail_first(tables.iter().map(|t| &t[..]), listed)
        .unwrap();
    assert_eq!(tail_first.free_order(), reference.free_order());
    assert_eq!(tail_first.num_free_blocks(), reference.num_free_blocks());
    for id in 1..=12 {
        assert_eq!(
            tail_first.ref_count(id).unwrap(),
            reference.ref_count(id).unwrap()
        );
    }
    // A block already at zero is reported after the rest are released, as `free_held` does.
    let pool = build();
    pool.free_blocks(&[7]).unwrap();
    assert_eq!(
        pool.free_held_tail_first(tables.iter().map(|t| &t[..]), listed),
        Err(CoreError::DoubleFree(7))
    );
    assert_eq!(pool.num_free_blocks(), reference.num_free_blocks());
}

/// Long tables whose null blocks come in runs of every length, at every offset (a free checks
/// slots for nulls several at a time): freed where they are, tail first or in order, the pool
/// ends as a free of the same tables with their nulls dropped.
#[test]
fn free_held_of_tables_with_null_runs_is_free_held_without_the_nulls() {
    const BLOCKS: usize = 400;
    let build = || {
        let pool = BlockPool::new(BLOCKS + 1).unwrap();
        let blocks = pool.get_new_blocks(BLOCKS).unwrap();
        // Every third block cached: those go to the back of the free order.
        let keyed: Vec<BlockId> = blocks.iter().copied().step_by(3).collect();
        let hashes: Vec<u128> = (1..=keyed.len() as u128).collect();
        cache(&pool, &keyed, &hashes, 0);
        (pool, blocks)
    };
    let mut seed = 0x9e37_79b9_u64;
    let mut next = |bound: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % bound
    };
    for round in 0..40 {
        let (pool, blocks) = build();
        // Tables alternate runs of nulls (0 to 40 long) and runs of held blocks.
        let mut tables = vec![Vec::new(); 1 + next(4) as usize];
        let mut held = blocks.iter().copied();
        'fill: loop {
            for t in tables.iter_mut() {
                t.extend(std::iter::repeat_n(NULL_BLOCK, next(41) as usize));
                for _ in 0..next(24) {
                    match held.next() {
                        Some(b) => t.push(b),
                        None => break 'fill,
                    }
                }
            }
        }
        let tail_first = round % 2 == 0;
        let (reference, _) = build();
        let mut flat = Vec::new();
        let mut ends = Vec::new();
        for t in &tables {
            let kept = t.iter().copied().filter(|&b| b != NULL_BLOCK);
            if tail_first {
                flat.extend(kept.rev());
            } else {
                flat.extend(kept);
            }
            ends.push(flat.len());
        }
        reference.free_held(&flat, &ends).unwrap();
        if tail_first {
            let listed = tables.iter().map(Vec::len).sum();
            pool.free_held_tail_first(tables.iter().map(|t| &t[..]), listed)
                .unwrap();
        } else {
            let mut all = Vec::new();
            let mut ends = Vec::new();
            for t in &tables {
                all.extend_from_slice(t);
                ends.push(all.len());
            }
            pool.free_held(&all, &ends).unwrap();
        }
        assert_eq!(pool.free_order(), reference.free_order(), "round {round}");
        assert_eq!(pool.num_free_blocks(), reference.num_free_blocks());
        let released = |p: &BlockPool| {
            (1..=BLOCKS as BlockId)
                .filter(|&b| p.ref_count(b).unwrap() == 0)
                .count()
        };
        assert_eq!(released(&pool), released(&reference), "round {round}");
    }
}

/// `key_removals` moves by one for each block whose key is taken off, by whichever path, and
/// not for blocks that had none or for anything else a pool does.
#[test]
fn key_removals_count_each_key_taken_off_a_block() {
    let pool = BlockPool::new(16).unwrap();
    let blocks = pool.get_new_blocks(8).unwrap();
    cache(&pool, &blocks[..4], &[1, 2, 3, 4], 0);
    assert_eq!(pool.key_removals(), 0);
    // Frees, touches, lookups and more caching take no key off.
    pool.free_blocks(&blocks).unwrap();
    pool.touch(&blocks[..2]).unwrap();
    assert!(pool.lookup(h(3), 0).is_some());
    pool.free_blocks(&blocks[..2]).unwrap();
    assert_eq!(pool.key_removals(), 0);
    // An eviction of two keyed blocks and one without a key.
    pool.evict_blocks(&[blocks[0], blocks[1], blocks[6]])
        .unwrap();
    assert_eq!(pool.key_removals(), 2);
    // A move of a key to a copy.
    pool.touch(&[blocks[2]]).unwrap();
    let copy = pool.get_new_blocks(1).unwrap()[0];
    pool.move_block_keys(blocks[2], copy).unwrap();
    assert_eq!(pool.key_removals(), 3);
    pool.free_blocks(&[blocks[2], copy]).unwrap();
    // Allocations that reuse every free block: the one keyed block still there (blocks[3])
    // loses its key (the copy keeps its own until the reset below).
    let all = pool.get_new_blocks(pool.num_free_blocks()).unwrap();
    assert!(all.contains(&blocks[3]));
    assert_eq!(pool.key_removals(), 5, "blocks[3] and the copy");
    cache(&pool, &all[..3], &[7, 8, 9], 1);
    pool.free_blocks(&all).unwrap();
    assert_eq!(pool.key_removals(), 5);
    assert!(pool.reset_prefix_cache());
    assert_eq!(pool.key_removals(), 8);
}

/// A block that someone else freed without holding it is found at zero: reported as a double
/// free, every other block still released, nothing counted twice.
#[test]
fn free_held_reports_a_block_already_at_zero_and_releases_the_rest() {
    let pool = BlockPool::new(8).unwrap();
    let blocks = pool.get_new_blocks(4).unwrap();
    pool.free_blocks(&[blocks[1]]).unwrap();
    let free_before = pool.num_free_blocks();
    assert_eq!(
        pool.free_held(&blocks, &[2, 4]),
        Err(CoreError::DoubleFree(blocks[1]))
    );
    assert_eq!(pool.num_free_blocks(), free_before + 3);
    for &b in &blocks {
        assert_eq!(pool.ref_count(b).unwrap(), 0);
    }
    let order = pool.free_order();
    assert_eq!(order.len(), 7);
    let mut sorted = order.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 7, "each free block once: {order:?}");
}

/// The flag a free reads to place a block follows the block's key through every way a key comes
/// and goes: caching, a second caching refused, reuse by an allocation, `evict_blocks` and
/// `reset_prefix_cache`; and the free order follows the flag.
#[test]
fn the_cached_flag_follows_the_key_through_every_transition() {
    let pool = BlockPool::new(6).unwrap();
    let flags = |pool: &BlockPool| -> Vec<bool> { (1..6).map(|id| pool.keyed_flag(id)).collect() };
    let keys = |pool: &BlockPool| -> Vec<bool> {
        (1..6)
            .map(|id| pool.block_key(id).unwrap().is_some())
            .collect()
    };
    let blocks = pool.get_new_blocks(5).unwrap();
    assert_eq!(flags(&pool), vec![false; 5]);
    cache(&pool, &blocks[..3], &[1, 2, 3], 0);
    cache(&pool, &blocks[..1], &[9], 0); // already keyed: refused, flag unchanged
    assert_eq!(flags(&pool), vec![true, true, true, false, false]);
    assert_eq!(flags(&pool), keys(&pool));
    pool.evict_blocks(&blocks[1..2]).unwrap();
    assert_eq!(flags(&pool), vec![true, false, true, false, false]);
    assert_eq!(flags(&pool), keys(&pool));
    // Keyed blocks go to the back, the rest in front.
    pool.free_blocks(&blocks).unwrap();
    assert_eq!(pool.free_order(), vec![2, 4, 5, 1, 3]);
    // Reuse evicts: taking every block clears every flag.
    let again = pool.get_new_blocks(5).unwrap();
    assert_eq!(flags(&pool), vec![false; 5]);
    cache(&pool, &again[..2], &[4, 5], 1);
    pool.free_blocks(&again).unwrap();
    assert_eq!(flags(&pool), keys(&pool));
    assert!(pool.reset_prefix_cache());
    assert_eq!(flags(&pool), vec![false; 5]);
    // A pool of more than 64 blocks: flags on different cache lines.
    let big = BlockPool::new(200).unwrap();
    let ids = big.get_new_blocks(199).unwrap();
    cache(
        &big,
        &[ids[62], ids[63], ids[64], ids[150]],
        &[1, 2, 3, 4],
        0,
    );
    for &id in &ids {
        assert_eq!(
            big.keyed_flag(id),
            big.block_key(id).unwrap().is_some(),
            "block {id}"
        );
    }
}

#[test]
fn a_second_key_is_kept_beside_the_first_and_leaves_with_it() {
    let pool = BlockPool::with_options(4, true, true).unwrap();
    let ids = pool.get_new_blocks(2).unwrap();
    let key = |x: u128| CacheKey {
        hash: h(x),
        group: 0,
    };
    // A block without a key gets the added key as its key.
    assert!(pool
        .add_block_key(ids[1], h(8), 0, StoreInfo::default())
        .unwrap());
    assert_eq!(pool.block_keys(ids[1]).unwrap(), vec![key(8)]);
    cache(&pool, &ids[..1], &[5], 0);
    assert!(pool
        .add_block_key(ids[0], h(6), 0, StoreInfo::default())
        .unwrap());
    // Adding a key the block has is a no-op, its own key included.
    assert!(!pool
        .add_block_key(ids[0], h(6), 0, StoreInfo::default())
        .unwrap());
    assert!(!pool
        .add_block_key(ids[0], h(5), 0, StoreInfo::default())
        .unwrap());
    assert_eq!(pool.block_keys(ids[0]).unwrap(), vec![key(5), key(6)]);
    assert_eq!(pool.lookup(h(6), 0), Some(ids[0]));
    assert_eq!(pool.num_cached_keys(), 3);
    // The null block, a free block and an unknown id.
    assert_eq!(
        pool.add_block_key(0, h(1), 0, StoreInfo::default()),
        Ok(false)
    );
    assert_eq!(
        pool.add_block_key(3, h(1), 0, StoreInfo::default()),
        Err(CoreError::NotInUse(3))
    );
    assert!(pool
        .add_block_key(9, h(1), 0, StoreInfo::default())
        .is_err());
    pool.take_events();
    // Freed, both blocks are cached (back of the free order, block 3 before them); reused,
    // every key goes, a block's own first.
    pool.free_blocks(&ids).unwrap();
    assert_eq!(pool.free_order(), vec![3, ids[0], ids[1]]);
    pool.get_new_blocks(3).unwrap();
    let removed: Vec<BlockHash> = pool
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved { block_hash, .. } => Some(block_hash),
            _ => None,
        })
        .collect();
    assert_eq!(removed, vec![h(5), h(6), h(8)]);
    assert_eq!(pool.num_cached_keys(), 0);
    assert_eq!(pool.lookup(h(6), 0), None);
}

#[test]
fn an_added_key_the_map_has_no_room_for_is_refused_without_waiting() {
    // A map that cannot grow: every allocation from here on fails.
    let pool = BlockPool::with_options(3, true, false).unwrap();
    let ids = pool.get_new_blocks(2).unwrap();
    cache(&pool, &ids[..1], &[1], 0);
    let mut refused = None;
    for i in 0..200u128 {
        crate::pool::alloc::inject::fail_after(Some(0));
        let added = pool
            .add_block_key(ids[0], h(100 + i), 0, StoreInfo::default())
            .unwrap();
        if !added {
            refused = Some(i);
            break;
        }
    }
    let refused = refused.expect("the map filled up");
    // Still no room: a block without a key is refused too (and keeps none).
    crate::pool::alloc::inject::fail_after(Some(0));
    let added = pool.add_block_key(ids[1], h(7), 0, StoreInfo::default());
    crate::pool::alloc::inject::fail_after(None);
    assert_eq!(added, Ok(false));
    assert_eq!(pool.block_key(ids[1]).unwrap(), None);
    assert!(!pool.keyed_flag(ids[1]));
    assert_eq!(pool.block_keys(ids[0]).unwrap().len(), 1 + refused as usize);
    assert_eq!(pool.num_cached_keys(), 1 + refused as usize);
    // Evicting the block removes every key it got.
    pool.evict_blocks(&ids[..1]).unwrap();
    assert_eq!(pool.num_cached_keys(), 0);
}

#[test]
fn moving_keys_re_points_every_key_without_events() {
    let pool = BlockPool::with_options(8, true, true).unwrap();
    assert_eq!(pool.get_new_blocks(3).unwrap(), vec![1, 2, 3]);
    cache(&pool, &[1], &[9], 1);
    assert!(pool
        .add_block_key(1, h(4), 1, StoreInfo::default())
        .unwrap());
    pool.take_events();
    pool.move_block_keys(1, 2).unwrap();
    assert!(pool.take_events().is_empty(), "the entries stay live");
    let key = |x| CacheKey {
        hash: h(x),
        group: 1,
    };
    assert_eq!(pool.block_keys(2).unwrap(), vec![key(9), key(4)]);
    assert!(pool.block_keys(1).unwrap().is_empty());
    assert_eq!(pool.lookup(h(9), 1), Some(2));
    assert_eq!(pool.lookup(h(4), 1), Some(2));
    assert_eq!(pool.num_cached_keys(), 2);
    // Freed, the destination is a cached block (back of the free order), the source is not.
    pool.free_blocks(&[1, 2]).unwrap();
    assert_eq!(pool.free_order().first(), Some(&1));
    assert_eq!(pool.free_order().last(), Some(&2));
}

#[test]
fn a_key_carries_the_prefix_length_it_was_cached_with() {
    // vLLM's `block_hash_num_tokens`: `(first_block + i + 1) * block_size` of the call that set
    // the slot's key; a key added beside it leaves it; it moves with the keys and goes with them.
    let pool = BlockPool::new(8).unwrap();
    assert_eq!(pool.get_new_blocks(4).unwrap(), vec![1, 2, 3, 4]);
    let info = |first_block, block_size| StoreInfo {
        first_block,
        block_size,
        ..StoreInfo::default()
    };
    pool.cache_full_blocks(&[1, NULL_BLOCK, 2], &[h(1), h(2), h(3)], 0, info(5, 16))
        .unwrap();
    assert_eq!(pool.block_key_tokens(1).unwrap(), Some(96));
    assert_eq!(pool.block_key_tokens(2).unwrap(), Some(128));
    assert_eq!(pool.block_key_tokens(3).unwrap(), None);
    // A block that already has a key keeps it and its length.
    pool.cache_full_blocks(&[1], &[h(9)], 0, info(0, 16))
        .unwrap();
    assert_eq!(pool.block_key_tokens(1).unwrap(), Some(96));
    // A key added beside the slot's leaves the length; on a block without one it sets it.
    assert!(pool.add_block_key(1, h(4), 0, info(2, 4)).unwrap());
    assert_eq!(pool.block_key_tokens(1).unwrap(), Some(96));
    assert!(pool.add_block_key(3, h(5), 0, info(2, 4)).unwrap());
    assert_eq!(pool.block_key_tokens(3).unwrap(), Some(12));
    pool.move_block_keys(1, 4).unwrap();
    assert_eq!(pool.block_key_tokens(4).unwrap(), Some(96));
    assert_eq!(pool.block_key_tokens(1).unwrap(), None);
    pool.evict_blocks(&[4]).unwrap();
    assert_eq!(pool.block_key_tokens(4).unwrap(), None);
    assert!(pool.block_key_tokens(99).is_err());
}

#[test]
fn moving_keys_needs_a_held_unkeyed_destination() {
    let pool = BlockPool::new(8).unwrap();
    assert_eq!(pool.get_new_blocks(3).unwrap(), vec![1, 2, 3]);
    cache(&pool, &[1, 3], &[9, 7], 0);
    assert!(matches!(
        pool.move_block_keys(1, NULL_BLOCK),
        Err(CoreError::NullBlock(_))
    ));
    assert!(pool.move_block_keys(1, 1).is_err());
    assert!(
        pool.move_block_keys(1, 3).is_err(),
        "the destination has a key"
    );
    pool.free_blocks(&[2]).unwrap();
    assert!(matches!(
        pool.move_block_keys(1, 2),
        Err(CoreError::NotInUse(2))
    ));
    assert!(pool.move_block_keys(1, 99).is_err());
    // Nothing moved.
    assert_eq!(pool.lookup(h(9), 0), Some(1));
    assert_eq!(pool.lookup(h(7), 0), Some(3));
}

/// A thread's free buffers come back empty after every free and keep room for at most
/// `KEEP_FREE_ENTRIES` entries each, whatever the size of the frees before.
#[test]
fn free_buffers_are_emptied_and_trimmed_after_a_large_free() {
    let n = 3 * KEEP_FREE_ENTRIES;
    let pool = BlockPool::new(n + 1).unwrap();
    let blocks = pool.get_new_blocks(n).unwrap();
    let hashes: Vec<u128> = (1..=n as u128 / 2).collect();
    cache(&pool, &blocks[..n / 2], &hashes, 0);
    let cut = [n / 3, n];
    pool.free_held(&blocks, &cut).unwrap();
    assert_eq!(pool.num_free_blocks(), n);
    let bufs = FREE_BUFFERS.with(std::cell::Cell::take);
    for (len, capacity) in [
        (bufs.front.len(), bufs.front.capacity()),
        (bufs.back.len(), bufs.back.capacity()),
        (bufs.starts.len(), bufs.starts.capacity()),
        (bufs.ordered.len(), bufs.ordered.capacity()),
    ] {
        assert_eq!(len, 0);
        assert!(capacity <= KEEP_FREE_ENTRIES, "{capacity} entries kept");
    }
    assert!(
        bufs.front.capacity() > 0,
        "the buffers are kept for the next free"
    );
    FREE_BUFFERS.with(|cell| cell.set(bufs));
}

// ----- page arrays ----------------------------------------------------------------------------

/// The mapping flags (`VmFlags` of `/proc/self/smaps`) of the mapping holding `addr`.
#[cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
))]
fn vm_flags_at(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                inside = (start..end).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.trim().to_string());
            }
        }
    }
    None
}

#[test]
fn a_large_array_starts_on_a_huge_page_and_is_offered_for_huge_pages() {
    let len = alloc::HUGE_FROM / 8 + 3;
    let array = alloc::PageArray::new("test array", len, |i| i as u64 * 3).unwrap();
    assert_eq!(array.len(), len);
    assert!(array.iter().enumerate().all(|(i, &v)| v == i as u64 * 3));
    let addr = array.as_ptr() as usize;
    assert_eq!(addr % (2 << 20), 0, "{addr:#x}");
    // Whole huge pages: the rounding is what the pool's size estimate counts.
    let bytes = alloc::array_bytes::<u64>(len);
    assert_eq!(bytes % (2 << 20), 0);
    assert!(bytes >= len * 8 && bytes < len * 8 + (2 << 20), "{bytes}");
    // The kernel was asked for huge pages for the array's mapping (`hg`: `MADV_HUGEPAGE`);
    // whether it grants them is the system's setting. A kernel built without transparent huge
    // pages (no `/sys/kernel/mm/transparent_hugepage`) refuses the advice.
    #[cfg(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    ))]
    if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
        let flags = vm_flags_at(addr).expect("the array's mapping is in smaps");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
    }
}

#[test]
fn a_small_array_takes_its_own_size() {
    let len = alloc::HUGE_FROM / 8 - 1;
    assert_eq!(alloc::array_bytes::<u64>(len), len * 8);
    assert_eq!(alloc::array_bytes::<u32>(10), 40);
    let array = alloc::PageArray::new("test array", len, |i| i as u64).unwrap();
    assert_eq!(array.len(), len);
    assert_eq!(array[len - 1], len as u64 - 1);
}

#[test]
fn a_page_array_drops_each_element_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static DROPS: AtomicUsize = AtomicUsize::new(0);
    struct Counted(#[allow(dead_code)] u64);
    impl Drop for Counted {
        fn drop(&mut self) {
            DROPS.fetch_add(1, Ordering::Relaxed);
        }
    }
    for len in [0, 1, 1000, alloc::HUGE_FROM / 8 + 1] {
        DROPS.store(0, Ordering::Relaxed);
        let array = alloc::PageArray::new("test array", len, |i| Counted(i as u64)).unwrap();
        assert_eq!(array.len(), len);
        drop(array);
        assert_eq!(DROPS.load(Ordering::Relaxed), len, "len {len}");
    }
    // Zero-sized elements: made and dropped, nothing allocated.
    DROPS.store(0, Ordering::Relaxed);
    struct Unit;
    impl Drop for Unit {
        fn drop(&mut self) {
            DROPS.fetch_add(1, Ordering::Relaxed);
        }
    }
    let units = alloc::PageArray::new("units", 7, |_| Unit).unwrap();
    assert_eq!(units.len(), 7);
    drop(units);
    assert_eq!(DROPS.load(Ordering::Relaxed), 7);
}

#[test]
fn a_page_array_that_cannot_be_allocated_is_an_error_naming_it() {
    // A size that overflows: refused before anything is allocated.
    assert_eq!(alloc::array_bytes::<u64>(usize::MAX), usize::MAX);
    let Err(failed) = alloc::PageArray::new("huge array", usize::MAX, |_| 0u64) else {
        panic!("allocated usize::MAX elements");
    };
    assert_eq!((failed.what, failed.bytes), ("huge array", usize::MAX));
    // A failed allocation reports the bytes it asked for (whole huge pages when large).
    let len = alloc::HUGE_FROM / 8 + 1;
    alloc::inject::fail_after(Some(0));
    let result = alloc::PageArray::new("large array", len, |_| 0u64);
    alloc::inject::fail_after(None);
    let Err(failed) = result else {
        panic!("the injected failure was ignored");
    };
    assert_eq!(
        (failed.what, failed.bytes),
        ("large array", alloc::array_bytes::<u64>(len))
    );
    // More than the memory available: refused, nothing written.
    alloc::inject::set_available(Some(0));
    let result = alloc::PageArray::new("checked array", alloc::CHECKED_BYTES / 8, |_| 0u64);
    alloc::inject::set_available(None);
    assert!(result.is_err());
}

#[test]
fn a_touch_that_would_overflow_a_count_changes_nothing() {
    // A cached free block first, then a block at the largest count: the overflow is found
    // before the free block is revived (reviving it and freeing it again would move it to the
    // back of the free order).
    let pool = BlockPool::new(8).unwrap();
    let b = pool.get_new_blocks(1).unwrap()[0];
    let xy = pool.get_new_blocks(2).unwrap();
    let x = xy[0];
    cache(&pool, &xy, &[7, 8], 0);
    pool.free_blocks(&xy).unwrap();
    pool.states.set_ref_count(b, u32::MAX);
    let order = pool.free_order();
    assert_eq!(
        pool.touch(&[x, b]),
        Err(CoreError::RefCountOverflow {
            id: b,
            ref_cnt: u32::MAX
        })
    );
    assert_eq!(pool.free_order(), order);
    assert_eq!(pool.ref_count(x).unwrap(), 0);
    // One below the limit: one more reference fits, two of the same block do not.
    pool.states.set_ref_count(b, u32::MAX - 1);
    assert!(pool.touch(&[x, b, b]).is_err());
    assert_eq!(pool.free_order(), order);
    assert_eq!(pool.ref_count(b).unwrap(), u32::MAX - 1);
    pool.touch(&[x, b]).unwrap();
    assert_eq!(pool.ref_count(b).unwrap(), u32::MAX);
    pool.states.set_ref_count(b, 1);
    pool.free_blocks(&[x, b]).unwrap();
}

#[test]
fn store_info_positions_past_usize_saturate() {
    // A first block index near usize::MAX overflowed the prefix length a key covers (a panic
    // with overflow checks, a length of 0 tokens otherwise) and the event's block indices.
    let pool = BlockPool::with_options(8, true, true).unwrap();
    let b = pool.get_new_blocks(2).unwrap();
    let info = StoreInfo {
        first_block: usize::MAX,
        block_size: 16,
        ..StoreInfo::default()
    };
    pool.cache_full_blocks(&b, &[h(1), h(2)], 0, info).unwrap();
    assert_eq!(
        pool.block_key_tokens(b[0]).unwrap(),
        Some(u32::MAX as usize)
    );
    assert_eq!(
        pool.block_key_tokens(b[1]).unwrap(),
        Some(u32::MAX as usize)
    );
    match &pool.take_events()[..] {
        [KvEvent::BlockStored { block_indices, .. }] => {
            assert_eq!(block_indices, &[usize::MAX, usize::MAX])
        }
        other => panic!("expected one BlockStored, got {other:?}"),
    }
    let mut r = crate::pool::reference::RefBlockPool::new(8, true, true).unwrap();
    let b = r.get_new_blocks(2).unwrap();
    r.cache_full_blocks(&b, &[h(1), h(2)], 0, info).unwrap();
}

#[test]
fn the_extra_keys_callback_may_call_into_the_pool() {
    // The callback ran under the event-order lock, which is not reentrant: a callback that
    // changed the pool deadlocked. It now runs before any lock is taken.
    use crate::types::EventKey;
    let pool = BlockPool::with_options(8, true, true).unwrap();
    let b = pool.get_new_blocks(3).unwrap();
    let keys = |i: usize| {
        assert!(pool.event_order.try_lock().is_ok(), "called under the lock");
        pool.evict_blocks(&[]).unwrap();
        Some(vec![EventKey::Lora(format!("block {i}"))])
    };
    let info = StoreInfo {
        block_extra_keys: Some(&keys),
        ..StoreInfo::default()
    };
    pool.cache_full_blocks(&b[..2], &[h(1), h(2)], 0, info)
        .unwrap();
    assert!(pool.add_block_key(b[0], h(3), 0, info).unwrap());
    let stored: Vec<_> = pool
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { extra_keys, .. } => Some(extra_keys),
            _ => None,
        })
        .collect();
    let lora = |i: usize| Some(vec![EventKey::Lora(format!("block {i}"))]);
    assert_eq!(stored, [Some(vec![lora(0), lora(1)]), Some(vec![lora(0)])]);
}
