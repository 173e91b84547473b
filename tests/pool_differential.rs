//! Differential test: the lock-free pool against the plain reference pool, driven by random
//! operation sequences; every result and the whole observable state must agree after each step.

use hybrid_kv::{BlockHash, BlockId, BlockPool, RefBlockPool, StoreInfo};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    /// Free some held references (picks by index into the held list; may include the null
    /// block, and a double free when `extra` names a free block).
    Free(Vec<usize>, Option<u32>),
    Touch(Vec<u32>),
    /// Cache held blocks under small hashes (collisions give duplicates).
    Cache(Vec<usize>, Vec<u8>, u32),
    Lookup(u8, u32),
    /// Key one more held block (or, with `Some`, any id: free, null or out of range) under a
    /// small hash: a second key for a block that has one.
    AddKey(usize, Option<u32>, u8, u32),
    Evict(Vec<u32>),
    Reset,
}

fn op(num_blocks: u32) -> impl Strategy<Value = Op> {
    let ids = prop::collection::vec(0..num_blocks + 2, 0..5);
    prop_oneof![
        3 => (0usize..8).prop_map(Op::Alloc),
        3 => (prop::collection::vec(any::<usize>(), 0..6), prop::option::weighted(0.1, 0..num_blocks + 1))
            .prop_map(|(picks, extra)| Op::Free(picks, extra)),
        2 => ids.clone().prop_map(Op::Touch),
        3 => (prop::collection::vec(any::<usize>(), 0..4), prop::collection::vec(0u8..12, 4), 0u32..2)
            .prop_map(|(picks, hashes, g)| Op::Cache(picks, hashes, g)),
        2 => (0u8..12, 0u32..2).prop_map(|(h, g)| Op::Lookup(h, g)),
        3 => (any::<usize>(), prop::option::weighted(0.15, 0..num_blocks + 2), 0u8..12, 0u32..2)
            .prop_map(|(p, id, h, g)| Op::AddKey(p, id, h, g)),
        1 => ids.prop_map(Op::Evict),
        1 => Just(Op::Reset),
    ]
}

fn pick(held: &[BlockId], picks: &[usize]) -> Vec<BlockId> {
    if held.is_empty() {
        return Vec::new();
    }
    picks.iter().map(|&p| held[p % held.len()]).collect()
}

fn check_same(fast: &BlockPool, oracle: &RefBlockPool, num_blocks: u32) {
    assert_eq!(fast.free_order(), oracle.free_order());
    assert_eq!(fast.num_free_blocks(), oracle.num_free_blocks());
    assert_eq!(fast.num_cached_keys(), oracle.num_cached_keys());
    assert_eq!(fast.usage(), oracle.usage());
    for id in 0..num_blocks {
        assert_eq!(fast.ref_count(id), oracle.ref_count(id), "ref of {id}");
        assert_eq!(fast.block_key(id), oracle.block_key(id), "key of {id}");
        assert_eq!(fast.block_keys(id), oracle.block_keys(id), "keys of {id}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn lock_free_pool_matches_reference(
        num_blocks in 1u32..14,
        caching in prop::bool::weighted(0.85),
        ops in prop::collection::vec(op(14), 1..120),
    ) {
        let fast = BlockPool::with_options(num_blocks as usize, caching, true).unwrap();
        let mut oracle = RefBlockPool::new(num_blocks as usize, caching, true).unwrap();
        // References held by the test (with multiplicity), to drive valid frees and caching.
        let mut held: Vec<BlockId> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let a = fast.get_new_blocks(n);
                    prop_assert_eq!(&a, &oracle.get_new_blocks(n));
                    held.extend(a.unwrap_or_default());
                }
                Op::Free(picks, extra) => {
                    let mut ids = pick(&held, &picks);
                    ids.extend(extra);
                    let r = fast.free_blocks(&ids);
                    prop_assert_eq!(&r, &oracle.free_blocks(&ids));
                    if r.is_ok() {
                        for id in ids.iter().filter(|&&id| id != 0) {
                            let pos = held.iter().position(|h| h == id).unwrap();
                            held.swap_remove(pos);
                        }
                    }
                }
                Op::Touch(ids) => {
                    let r = fast.touch(&ids);
                    prop_assert_eq!(&r, &oracle.touch(&ids));
                    if r.is_ok() {
                        held.extend(ids.iter().filter(|&&id| id != 0));
                    }
                }
                Op::Cache(picks, hashes, group) => {
                    let ids = pick(&held, &picks);
                    let hashes: Vec<BlockHash> =
                        hashes[..ids.len()].iter().map(|&h| BlockHash(h as u128)).collect();
                    let tokens = [1u32, 2, 3];
                    let info = StoreInfo { parent_block_hash: None, token_ids: &tokens, block_size: 4, ..StoreInfo::default() };
                    prop_assert_eq!(
                        fast.cache_full_blocks(&ids, &hashes, group, info),
                        oracle.cache_full_blocks(&ids, &hashes, group, info)
                    );
                }
                Op::Lookup(h, group) => {
                    let h = BlockHash(h as u128);
                    prop_assert_eq!(fast.lookup(h, group), oracle.lookup(h, group));
                    prop_assert_eq!(fast.get_cached_block(h, &[0, 1]), oracle.get_cached_block(h, &[0, 1]));
                }
                Op::AddKey(p, id, h, group) => {
                    let Some(id) = id.or_else(|| pick(&held, &[p]).first().copied()) else {
                        continue;
                    };
                    let tokens = [5u32, 6];
                    let info = StoreInfo { parent_block_hash: Some(BlockHash(1)), token_ids: &tokens, block_size: 2, first_block: 3, ..StoreInfo::default() };
                    let h = BlockHash(h as u128);
                    prop_assert_eq!(
                        fast.add_block_key(id, h, group, info),
                        oracle.add_block_key(id, h, group, info)
                    );
                }
                Op::Evict(ids) => {
                    prop_assert_eq!(fast.evict_blocks(&ids), oracle.evict_blocks(&ids));
                }
                Op::Reset => {
                    prop_assert_eq!(fast.reset_prefix_cache(), oracle.reset_prefix_cache());
                }
            }
            check_same(&fast, &oracle, num_blocks);
            prop_assert_eq!(fast.take_events(), oracle.take_events());
        }
    }
}
