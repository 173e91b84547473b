//! Requests whose block hashes the caller supplies (vLLM's `Request.block_hashes`): the manager
//! keys their blocks by those hashes and hashes nothing, with the same decisions as for hashes
//! it computes itself.

use super::registry::{Prehashed, Registry, RequestRecord, Synced};
use super::*;
use crate::error::CoreError;
use crate::types::BlockHash;

fn config(lookahead: usize, events: bool) -> ManagerConfig {
    let mut c = ManagerConfig::new(
        vec![GroupSpec::full(4), GroupSpec::sliding_window(4, 8)],
        64,
        4096,
    );
    c.num_hash_lookahead_tokens = lookahead;
    c.enable_events = events;
    c
}

fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// Hashes the caller "computed": any chained function of the tokens (here the manager's own
/// hasher of another manager, so equal prefixes get equal hashes).
fn caller_hashes(all: &[u32], lookahead: usize) -> Vec<BlockHash> {
    let hasher = BlockHasher::new(4, crate::hashing::HashAlgo::Sha256, "caller")
        .unwrap()
        .with_lookahead(lookahead)
        .unwrap();
    let mut out = Vec::new();
    hasher
        .hash_blocks(None, all, 0, &ExtraKeys::default(), &mut out)
        .unwrap();
    out
}

/// Admits `id` (hit, then the rest) and returns (hit tokens, new blocks).
fn admit(m: &mut KVCacheManager, id: &str) -> (usize, Vec<Vec<BlockId>>) {
    let hit = m.get_computed_blocks(id).unwrap();
    let n = m.request(id).unwrap().num_tokens() - hit.num_computed_tokens;
    let args = AllocateArgs {
        num_new_tokens: n,
        num_new_computed_tokens: hit.num_computed_tokens,
        new_computed_blocks: Some(&hit),
        ..Default::default()
    };
    let new = m.allocate_slots(id, &args).unwrap().unwrap();
    (hit.num_computed_tokens, new)
}

/// The same workload on a manager that hashes and on one given the caller's hashes: the same
/// hits, blocks and free counts at every call, decode steps with new hashes included.
#[test]
fn supplied_hashes_make_the_decisions_computed_hashes_make() {
    for lookahead in [0, 1, 3] {
        let mut own = KVCacheManager::new(&config(lookahead, false)).unwrap();
        let mut given = KVCacheManager::new(&config(lookahead, false)).unwrap();
        let shared = tokens(100, 13);
        let prompts: Vec<Vec<u32>> = (0..4u32)
            .map(|k| {
                let mut p = shared.clone();
                p.extend(tokens(1000 * (k + 1), 3 + 2 * k as usize));
                p
            })
            .collect();
        for (k, prompt) in prompts.iter().enumerate() {
            let id = format!("r{k}");
            own.add_request(&id, prompt, ExtraKeys::default()).unwrap();
            let hashes = caller_hashes(prompt, lookahead);
            given
                .add_request_with_hashes(&id, prompt, &hashes, ExtraKeys::default())
                .unwrap();
            assert_eq!(
                given.request(id.as_str()).unwrap().block_hashes(),
                &hashes[..],
                "lookahead {lookahead}: the prompt's hashable blocks take the caller's hashes"
            );
            let a = admit(&mut own, &id);
            let b = admit(&mut given, &id);
            assert_eq!(a, b, "lookahead {lookahead}, request {k}");
            // Decode: one token a step, with vLLM's hashes of the blocks it makes hashable.
            let mut all = prompt.clone();
            for step in 0..9u32 {
                let token = 7 + step;
                all.push(token);
                own.append_token_ids(id.as_str(), &[token]).unwrap();
                given
                    .append_token_ids_with_hashes(
                        id.as_str(),
                        &[token],
                        &caller_hashes(&all, lookahead),
                    )
                    .unwrap();
                let args = AllocateArgs {
                    num_new_tokens: 1,
                    num_computed_tokens: all.len() - 1,
                    ..Default::default()
                };
                assert_eq!(
                    own.allocate_slots(id.as_str(), &args).unwrap(),
                    given.allocate_slots(id.as_str(), &args).unwrap()
                );
                assert_eq!(
                    own.request(id.as_str()).unwrap().block_hashes().len(),
                    given.request(id.as_str()).unwrap().block_hashes().len()
                );
            }
            assert_eq!(own.num_free_blocks(), given.num_free_blocks());
            assert_eq!(own.pool().num_cached_keys(), given.pool().num_cached_keys());
        }
        for k in 0..prompts.len() {
            own.free(format!("r{k}").as_str()).unwrap();
            given.free(format!("r{k}").as_str()).unwrap();
        }
        assert_eq!(own.pool().free_order(), given.pool().free_order());
    }
}

/// Too few hashes is an error that changes nothing; hashes past the hashable blocks wait.
#[test]
fn short_supplied_hashes_are_refused_whole_and_extra_ones_wait() {
    let mut m = KVCacheManager::new(&config(2, false)).unwrap();
    let prompt = tokens(1, 10);
    let all_hashes = caller_hashes(&tokens(1, 40), 0);
    // 10 tokens, lookahead 2: two hashable blocks.
    assert!(matches!(
        m.add_request_with_hashes("a", &prompt, &all_hashes[..1], ExtraKeys::default()),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(!m.contains_request("a"), "nothing registered");
    m.add_request_with_hashes("a", &prompt, &all_hashes, ExtraKeys::default())
        .unwrap();
    assert_eq!(m.request("a").unwrap().block_hashes(), &all_hashes[..2]);
    assert_eq!(m.request("a").unwrap().tail(), &prompt[8..]);
    // 4 more tokens make block 2 hashable (14 - 2 = 12 = 3 blocks): 2 hashes are too few.
    let more = tokens(50, 4);
    assert!(matches!(
        m.append_token_ids_with_hashes("a", &more, &all_hashes[..2]),
        Err(CoreError::InvalidArgument(_))
    ));
    let r = m.request("a").unwrap();
    assert_eq!(
        (r.num_tokens(), r.block_hashes().len()),
        (10, 2),
        "unchanged"
    );
    m.append_token_ids_with_hashes("a", &more, &all_hashes)
        .unwrap();
    let r = m.request("a").unwrap();
    assert_eq!((r.num_tokens(), r.block_hashes()), (14, &all_hashes[..3]));
    assert_eq!(
        r.tail(),
        &[52, 53][..],
        "the tokens after the hashed blocks"
    );
    // Bad token ids are refused whole too.
    assert!(m
        .append_token_ids_with_hashes("a", &[u64::MAX], &all_hashes)
        .is_err());
    assert_eq!(m.request("a").unwrap().num_tokens(), 14);
}

/// A request that computes its hashes takes none, and a supplied one computes none.
#[test]
fn supplied_and_computed_hashes_do_not_mix() {
    let mut m = KVCacheManager::new(&config(0, false)).unwrap();
    m.add_request("own", &tokens(1, 9), ExtraKeys::default())
        .unwrap();
    let hashes = caller_hashes(&tokens(1, 16), 0);
    assert!(matches!(
        m.append_token_ids_with_hashes("own", &[5u32], &hashes),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(m.request("own").unwrap().num_tokens(), 9);
    m.add_request_with_hashes("given", &tokens(1, 9), &hashes, ExtraKeys::default())
        .unwrap();
    // Tokens without hashes: the request holds them but no hash of the block they fill.
    m.append_token_ids("given", &tokens(10, 7)).unwrap();
    let r = m.request("given").unwrap();
    assert_eq!((r.num_tokens(), r.block_hashes().len()), (16, 2));
    assert!(r.hasher().is_supplied());
    assert_ne!(r.hasher(), m.hasher());
}

fn record(id: &str, prompt: &[u32], hashes: &[BlockHash]) -> RequestRecord {
    let k = hashes.len().min(prompt.len() / 4);
    let pre = Prehashed {
        hasher: BlockHasher::supplied(4, 0).unwrap(),
        hashes: hashes[..k].to_vec(),
        tail: prompt[k * 4..].to_vec(),
    };
    let mut r =
        RequestRecord::new(id.into(), prompt.len(), ExtraKeys::default(), Some(pre)).unwrap();
    r.supplied = Some(hashes.to_vec());
    r.supplied_block_size = 4;
    r
}

/// Hashes of blocks of another size than the manager's hash blocks are refused.
#[test]
fn supplied_hashes_of_another_block_size_are_refused() {
    let mut m = KVCacheManager::new(&config(0, false)).unwrap();
    let mut registry = Registry::new();
    let prompt = tokens(1, 16);
    let mut r = record("z", &prompt, &caller_hashes(&prompt, 0));
    r.supplied_block_size = 8;
    assert!(matches!(
        registry.sync(&mut m, &mut r, Some(&prompt)),
        Err(CoreError::InvalidArgument(msg)) if msg.contains("8-token")
    ));
    assert!(!m.contains_request("z"));
}

/// The registry registers a supplied record from its prompt hashes when they fit (no prompt
/// needed), from the prompt otherwise (KV events, a lookahead the record did not know), and
/// brings output tokens in with their hashes; a short list registers nothing and a retry
/// with the full list works.
#[test]
fn the_registry_registers_supplied_records_from_their_hashes() {
    // (lookahead, events, prompt length, the record given every hash of the run at once)
    for (lookahead, events, len, given_all) in [
        (0, false, 11, false),
        (0, true, 11, false),
        (1, false, 11, false),
        (1, false, 12, false),
        // Hashes past the prompt's hashable blocks: block 2 of the prompt has a hash that a
        // lookahead of 1 does not allow yet, so the prompt is read.
        (1, false, 12, true),
    ] {
        let mut m = KVCacheManager::new(&config(lookahead, events)).unwrap();
        let mut registry = Registry::new();
        let prompt = tokens(1, len);
        let mut all = prompt.clone();
        all.extend(tokens(200, 6));
        let hashes = caller_hashes(&all, lookahead);
        let prompt_hashes = (prompt.len() - lookahead) / 4;
        let mut r = record(
            "x",
            &prompt,
            if given_all {
                &hashes
            } else {
                &hashes[..prompt_hashes]
            },
        );
        let needs_prompt = events || given_all;
        let synced = registry.sync(&mut m, &mut r, None).unwrap();
        if needs_prompt {
            assert_eq!(
                synced,
                Synced::NeedPrompt,
                "lookahead {lookahead}, events {events}"
            );
            assert!(!m.contains_request("x"));
            registry.sync(&mut m, &mut r, Some(&prompt)).unwrap();
        } else {
            assert!(matches!(
                synced,
                Synced::Ready {
                    registered: true,
                    ..
                }
            ));
        }
        assert_eq!(
            m.request("x").unwrap().block_hashes(),
            &hashes[..prompt_hashes]
        );
        // Outputs: a short list is refused and leaves the request as it was.
        r.output.extend_from_slice(&all[prompt.len()..]);
        r.supplied = Some(hashes[..prompt_hashes].to_vec());
        assert!(registry.sync(&mut m, &mut r, Some(&prompt)).is_err());
        assert_eq!(m.request("x").unwrap().num_tokens(), prompt.len());
        r.supplied = Some(hashes.clone());
        registry.sync(&mut m, &mut r, Some(&prompt)).unwrap();
        let held = m.request("x").unwrap();
        assert_eq!(
            (held.num_tokens(), held.block_hashes()),
            (all.len(), &hashes[..])
        );
    }
}

/// A new record whose list is short for its outputs registers nothing; with the full list
/// the same record registers.
#[test]
fn a_supplied_record_short_of_hashes_registers_nothing() {
    let mut m = KVCacheManager::new(&config(0, false)).unwrap();
    let mut registry = Registry::new();
    let prompt = tokens(1, 8);
    let mut all = prompt.clone();
    all.extend(tokens(300, 5));
    let hashes = caller_hashes(&all, 0);
    let mut r = record("y", &prompt, &hashes[..2]);
    r.output.extend_from_slice(&all[8..]);
    assert!(matches!(
        registry.sync(&mut m, &mut r, None),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(!m.contains_request("y"));
    r.supplied = Some(hashes.clone());
    assert!(matches!(
        registry.sync(&mut m, &mut r, None).unwrap(),
        Synced::Ready {
            registered: true,
            ..
        }
    ));
    assert_eq!(m.request("y").unwrap().block_hashes(), &hashes[..]);
}
