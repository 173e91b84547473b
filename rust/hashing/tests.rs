use super::*;

fn hasher(bs: usize) -> BlockHasher {
    BlockHasher::new(bs, HashAlgo::Xxh3, "seed").unwrap()
}

fn hashes(h: &BlockHasher, tokens: &[u32], extra: &ExtraKeys) -> Vec<BlockHash> {
    let mut out = Vec::new();
    h.hash_blocks(None, tokens, 0, extra, &mut out).unwrap();
    out
}

#[test]
fn one_hash_per_full_block_and_partial_tail_ignored() {
    let tokens: Vec<u32> = (0..37).collect();
    assert_eq!(hashes(&hasher(16), &tokens, &ExtraKeys::default()).len(), 2);
}

#[test]
fn chain_depends_on_every_earlier_block() {
    let h = hasher(4);
    let a: Vec<u32> = (0..12).collect();
    let mut b = a.clone();
    b[0] = 99;
    let (ha, hb) = (
        hashes(&h, &a, &Default::default()),
        hashes(&h, &b, &Default::default()),
    );
    assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
}

#[test]
fn same_prefix_gives_same_hashes() {
    let h = hasher(4);
    let a: Vec<u32> = (0..12).collect();
    let mut b = a.clone();
    b[9] = 1000;
    let (ha, hb) = (
        hashes(&h, &a, &Default::default()),
        hashes(&h, &b, &Default::default()),
    );
    assert_eq!(ha[..2], hb[..2]);
    assert_ne!(ha[2], hb[2]);
}

#[test]
fn incremental_chain_equals_one_shot() {
    let tokens: Vec<u32> = (0..100).map(|t| t * 7 + 3).collect();
    let h = hasher(16);
    let extra = ExtraKeys::new(Some("tenant".into()), Some("lora-a".into()), vec![]).unwrap();
    let mut out = Vec::new();
    h.hash_blocks(None, &tokens, 0, &extra, &mut out).unwrap();
    let mut chain = BlockHashChain::new(h.clone(), extra);
    let mut added = 0;
    for piece in tokens.chunks(7) {
        added += chain.extend(piece).unwrap();
    }
    assert_eq!(added, 6);
    assert_eq!(chain.hashes(), &out[..]);
    // Hashing a suffix from a parent continues the chain.
    let mut tail = Vec::new();
    h.hash_blocks(Some(out[2]), &tokens[48..], 48, &chain.extra, &mut tail)
        .unwrap();
    assert_eq!(tail, out[3..]);
}

#[test]
fn salt_changes_the_whole_chain_and_lora_every_block() {
    let h = hasher(4);
    let tokens: Vec<u32> = (0..8).collect();
    let plain = hashes(&h, &tokens, &ExtraKeys::default());
    let salted = hashes(
        &h,
        &tokens,
        &ExtraKeys::new(Some("a".into()), None, vec![]).unwrap(),
    );
    let salted_b = hashes(
        &h,
        &tokens,
        &ExtraKeys::new(Some("b".into()), None, vec![]).unwrap(),
    );
    let lora = hashes(
        &h,
        &tokens,
        &ExtraKeys::new(None, Some("a".into()), vec![]).unwrap(),
    );
    for v in [&salted, &salted_b, &lora] {
        assert!(v.iter().zip(&plain).all(|(x, y)| x != y));
    }
    assert!(salted.iter().zip(&salted_b).all(|(x, y)| x != y));
    // An empty salt is no salt.
    let empty = hashes(
        &h,
        &tokens,
        &ExtraKeys::new(Some(String::new()), None, vec![]).unwrap(),
    );
    assert_eq!(empty, plain);
}

#[test]
fn multimodal_inputs_change_only_blocks_they_overlap_and_after() {
    let h = hasher(4);
    let tokens = vec![0u32; 16];
    let plain = hashes(&h, &tokens, &ExtraKeys::default());
    let mm = |id: &str, offset| {
        ExtraKeys::new(
            None,
            None,
            vec![MmInput {
                identifier: id.into(),
                offset,
                length: 3,
            }],
        )
        .unwrap()
    };
    let a = hashes(&h, &tokens, &mm("img-a", 6));
    let b = hashes(&h, &tokens, &mm("img-b", 6));
    assert_eq!(a[0], plain[0]);
    assert_ne!(a[1], plain[1]);
    assert_ne!(a[1], b[1], "identifier is hashed in");
    let shifted = hashes(&h, &tokens, &mm("img-a", 5));
    assert_ne!(a[1], shifted[1], "offset is hashed in");
    assert!(ExtraKeys::new(
        None,
        None,
        vec![MmInput {
            identifier: "x".into(),
            offset: 0,
            length: 0
        }]
    )
    .is_err());
}

#[test]
fn algorithms_and_seeds_give_different_but_stable_hashes() {
    let tokens: Vec<u32> = (0..32).collect();
    let mut seen = Vec::new();
    for algo in [HashAlgo::Xxh3, HashAlgo::Sha256, HashAlgo::Blake3] {
        for seed in ["s1", "s2"] {
            let h = BlockHasher::new(16, algo, seed).unwrap();
            let a = hashes(&h, &tokens, &ExtraKeys::default());
            let b = hashes(
                &BlockHasher::new(16, algo, seed).unwrap(),
                &tokens,
                &ExtraKeys::default(),
            );
            assert_eq!(a, b);
            assert!(!seen.contains(&a[0]));
            seen.push(a[0]);
        }
    }
}

#[test]
fn the_none_hash_is_the_seeds_whatever_hasher_was_made_before() {
    // The last none hash made on a thread is kept: hashers made in any order of algorithms and
    // seeds (one a prefix of another) chain from the digest of their own seed.
    let expected = |algo: HashAlgo, seed: &str| {
        let mut bytes = b"hybrid-kv/none-hash/".to_vec();
        bytes.extend_from_slice(seed.as_bytes());
        algo.digest(&bytes)
    };
    let order = [
        (HashAlgo::Sha256, "s"),
        (HashAlgo::Sha256, "s"),
        (HashAlgo::Sha256, "s1"),
        (HashAlgo::Xxh3, "s1"),
        (HashAlgo::Blake3, "s1"),
        (HashAlgo::Sha256, ""),
        (HashAlgo::Sha256, "s"),
    ];
    for (algo, seed) in order {
        let h = BlockHasher::new(4, algo, seed).unwrap();
        assert_eq!(h.none_hash(), expected(algo, seed), "{algo:?} {seed:?}");
    }
    let other = std::thread::spawn(|| {
        BlockHasher::new(4, HashAlgo::Blake3, "t")
            .unwrap()
            .none_hash()
    });
    assert_eq!(other.join().unwrap(), expected(HashAlgo::Blake3, "t"));
    let h = BlockHasher::new(4, HashAlgo::Sha256, "s").unwrap();
    assert_eq!(h.none_hash(), expected(HashAlgo::Sha256, "s"));
}

#[test]
fn known_answer_for_the_default_hash_is_stable() {
    // Pins the byte encoding: a change here breaks caches shared across processes/versions.
    let h = BlockHasher::new(4, HashAlgo::Xxh3, "").unwrap();
    let mut buf = b"hybrid-kv/none-hash/".to_vec();
    let none = BlockHash(xxhash_rust::xxh3::xxh3_128(&buf));
    assert_eq!(h.none_hash(), none);
    buf.clear();
    buf.extend_from_slice(&none.0.to_le_bytes());
    buf.extend_from_slice(&4u32.to_le_bytes());
    for t in [1u32, 2, 3, 4] {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    let expected = BlockHash(xxhash_rust::xxh3::xxh3_128(&buf));
    assert_eq!(
        hashes(&h, &[1, 2, 3, 4], &ExtraKeys::default()),
        vec![expected]
    );
}

#[test]
fn signed_and_wide_inputs_hash_like_u32_and_bad_ids_are_rejected() {
    let h = hasher(2);
    let mut a = Vec::new();
    let mut b = Vec::new();
    h.hash_blocks(None, &[1i32, 2, 3, 4], 0, &ExtraKeys::default(), &mut a)
        .unwrap();
    h.hash_blocks(None, &[1i64, 2, 3, 4], 0, &ExtraKeys::default(), &mut b)
        .unwrap();
    assert_eq!(a, b);
    let mut out = Vec::new();
    assert!(h
        .hash_blocks(None, &[1i64, -2], 0, &ExtraKeys::default(), &mut out)
        .is_err());
    assert!(h
        .hash_blocks(None, &[1i64, 1 << 40], 0, &ExtraKeys::default(), &mut out)
        .is_err());
    assert!(out.is_empty());
    let mut chain = BlockHashChain::new(h, ExtraKeys::default());
    assert!(chain.extend(&[1i64, -1]).is_err());
    assert!(
        chain.tokens().is_empty(),
        "a rejected append changes nothing"
    );
    assert!(BlockHasher::new(0, HashAlgo::Xxh3, "").is_err());
    assert!(HashAlgo::parse("md5").is_err());
}

#[test]
fn positions_past_usize_are_an_error() {
    let h = BlockHasher::new(1, HashAlgo::default(), "").unwrap();
    let mut out = Vec::new();
    let r = h.hash_blocks(None, &[1u32], usize::MAX, &ExtraKeys::default(), &mut out);
    assert!(matches!(r, Err(CoreError::OutOfRange(_))));
    let e = ExtraKeys::new(None, Some("lora".into()), vec![]).unwrap();
    let h = BlockHasher::new(16, HashAlgo::default(), "").unwrap();
    let tokens: Vec<u32> = (0..16).collect();
    let r = h.hash_blocks(None, &tokens, usize::MAX / 16 * 16, &e, &mut out);
    assert!(matches!(r, Err(CoreError::OutOfRange(_))));
    assert!(out.is_empty());
    // The last block that fits still hashes.
    let start = (usize::MAX - 16) / 16 * 16;
    h.hash_blocks(None, &tokens, start, &e, &mut out).unwrap();
    assert_eq!(out.len(), 1);
}

#[test]
fn extra_keys_built_field_by_field_are_checked_where_they_are_hashed() {
    let mm = |offset, length| MmInput {
        identifier: "img".into(),
        offset,
        length,
    };
    let h = BlockHasher::new(4, HashAlgo::Xxh3, "").unwrap();
    let tokens: Vec<u32> = (0..16).collect();
    // Overflowing (a panic with overflow checks), empty and unsorted inputs: what
    // `ExtraKeys::new` refuses is refused when hashed too, and nothing is appended.
    for mm_inputs in [
        vec![mm(5, usize::MAX)],
        vec![mm(1 << 63, 1)],
        vec![mm(2, 0)],
        vec![mm(8, 2), mm(1, 2)],
    ] {
        let extra = ExtraKeys {
            mm_inputs,
            ..ExtraKeys::default()
        };
        let mut out = Vec::new();
        assert!(h.hash_blocks(None, &tokens, 0, &extra, &mut out).is_err());
        assert!(out.is_empty());
        let mut chain = BlockHashChain::new(h.clone(), extra.clone());
        assert!(chain.extend(&tokens).is_err());
        assert!(
            chain.tokens().is_empty(),
            "a rejected append changes nothing"
        );
        // Event keys of such inputs saturate instead of overflowing.
        let _ = extra.event_keys(4, 8);
    }
    let extra = ExtraKeys {
        mm_inputs: vec![mm(1 << 63, 1)],
        ..ExtraKeys::default()
    };
    assert_eq!(
        extra.event_keys(1 << 62, usize::MAX),
        Some(vec![crate::types::EventKey::Mm(
            "img".into(),
            i64::MAX - (1 << 62)
        )])
    );
}
