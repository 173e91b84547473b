//! Model checks of the racy parts of the pool: revive vs claim, concurrent claims, free-count
//! reservation, release vs revive. Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --lib loom`.
//!
//! Every racing actor runs in a spawned thread and the main thread only sets up and joins:
//! loom 0.7 explored too few interleavings when one actor ran on the main thread.

use super::states::BlockStates;
use crate::types::BlockId;
use loom::sync::Arc;
use loom::thread;

/// Every block's ref count equals the references the threads say they hold, and the free count
/// equals the number of unreferenced blocks, each listed exactly once in the free order.
fn check_consistent(states: &BlockStates, num_blocks: usize, held: &[BlockId]) {
    let mut free = 0;
    for id in 1..num_blocks as BlockId {
        let expected = held.iter().filter(|&&h| h == id).count() as u32;
        assert_eq!(states.ref_count(id), expected, "block {id}");
        if expected == 0 {
            free += 1;
        }
    }
    assert_eq!(states.num_free(), free);
    let mut order = states.free_order();
    assert_eq!(order.len(), free);
    order.sort_unstable();
    order.dedup();
    assert_eq!(order.len(), free, "a free block is listed twice");
}

fn allocate(states: &BlockStates, n: usize) -> Option<Vec<BlockId>> {
    states.reserve(n).ok()?;
    let mut out = Vec::new();
    states.claim_reserved(n, &mut out);
    Some(out)
}

#[test]
fn loom_concurrent_claims_get_distinct_blocks() {
    loom::model(|| {
        let states = Arc::new(BlockStates::new(3));
        let (s1, s2) = (states.clone(), states.clone());
        let a = thread::spawn(move || allocate(&s1, 1).unwrap());
        let b = thread::spawn(move || allocate(&s2, 1).unwrap());
        let (mine, theirs) = (a.join().unwrap(), b.join().unwrap());
        assert_ne!(mine, theirs);
        let held: Vec<BlockId> = mine.into_iter().chain(theirs).collect();
        check_consistent(&states, 3, &held);
    });
}

#[test]
fn loom_revive_vs_claim_exactly_one_wins() {
    loom::model(|| {
        // Block 1 is free (and last in the order); block 2 is held.
        let states = Arc::new(BlockStates::new(3));
        let all = allocate(&states, 2).unwrap();
        assert_eq!(all, vec![1, 2]);
        let entry = states.release(1).unwrap().unwrap();
        states.publish(&[], &[entry]);
        let (s1, s2) = (states.clone(), states.clone());
        let reviver = thread::spawn(move || s2.acquire(1).is_ok());
        let claimer = thread::spawn(move || allocate(&s1, 1));
        let claimed = claimer.join().unwrap();
        let revived = reviver.join().unwrap();
        // Exactly one of them takes the free block out of the free order. If both succeed, the
        // claim came first and the touch took a second reference to the claimed block.
        assert!(revived || claimed.is_some());
        if revived && claimed.is_some() {
            assert_eq!(states.ref_count(1), 2);
        }
        let mut held = vec![2];
        held.extend(claimed.unwrap_or_default());
        if revived {
            held.push(1);
        }
        check_consistent(&states, 3, &held);
    });
}

#[test]
fn loom_release_vs_revive_keeps_counts() {
    loom::model(|| {
        let states = Arc::new(BlockStates::new(3));
        allocate(&states, 1).unwrap(); // block 1, ref 1
        let s2 = states.clone();
        let releaser = thread::spawn(move || {
            // Reaches zero only if the release comes before the revive.
            if let Some(entry) = s2.release(1).unwrap() {
                s2.publish(&[], &[entry]);
            }
        });
        // Revive may land before or after the release is published.
        let s3 = states.clone();
        let reviver = thread::spawn(move || s3.acquire(1).is_ok());
        releaser.join().unwrap();
        let revived = reviver.join().unwrap();
        assert!(
            revived,
            "block 2 stays free, so a reservation is always possible"
        );
        check_consistent(&states, 3, &[1]);
        // The stale entry left by the revive is skipped: the next allocation gets block 2.
        assert_eq!(allocate(&states, 1).unwrap(), vec![2]);
    });
}

#[test]
fn loom_reservation_is_all_or_nothing() {
    loom::model(|| {
        let states = Arc::new(BlockStates::new(3));
        let (s1, s2) = (states.clone(), states.clone());
        let t = thread::spawn(move || allocate(&s2, 2));
        let m = thread::spawn(move || allocate(&s1, 1));
        let (mine, theirs) = (m.join().unwrap(), t.join().unwrap());
        // Two free blocks: either the pair or the single allocation succeeds, never a split.
        assert!(mine.is_some() ^ theirs.is_some());
        let held: Vec<BlockId> = mine.into_iter().chain(theirs).flatten().collect();
        check_consistent(&states, 3, &held);
    });
}

#[test]
fn loom_free_front_and_claim_race() {
    loom::model(|| {
        let states = Arc::new(BlockStates::new(3));
        let held = allocate(&states, 2).unwrap();
        let s2 = states.clone();
        let t = thread::spawn(move || {
            let entry = s2.release(held[0]).unwrap().unwrap();
            s2.publish(&[entry], &[]);
        });
        // Spins until the release is published, then must get that block.
        let s3 = states.clone();
        let claimer = thread::spawn(move || allocate(&s3, 1));
        t.join().unwrap();
        let got = claimer.join().unwrap();
        if let Some(got) = &got {
            assert_eq!(got, &vec![1]);
        }
        let mut holders = vec![2];
        holders.extend(got.unwrap_or_default());
        check_consistent(&states, 3, &holders);
    });
}

#[test]
fn loom_concurrent_front_frees_and_claims_keep_the_stack_intact() {
    loom::model(|| {
        let states = Arc::new(BlockStates::new(4));
        let held = allocate(&states, 3).unwrap();
        let entry1 = states.release(held[0]).unwrap().unwrap();
        states.publish(&[entry1], &[]);
        let s2 = states.clone();
        let freer = thread::spawn(move || {
            let entry = s2.release(2).unwrap().unwrap();
            s2.publish(&[entry], &[]);
        });
        let s3 = states.clone();
        let claimer = thread::spawn(move || allocate(&s3, 1));
        freer.join().unwrap();
        let got = claimer.join().unwrap().unwrap();
        assert!(got == vec![1] || got == vec![2], "{got:?}");
        let held: Vec<BlockId> = got.into_iter().chain([3]).collect();
        check_consistent(&states, 4, &held);
    });
}
