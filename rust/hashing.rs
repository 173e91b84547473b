//! Chained block hashing: `hash(block i) = H(hash(block i-1), token ids of block i, extra keys)`,
//! with the first block chained to a per-seed "none hash" (vLLM's `NONE_HASH`).
//!
//! The input of `H` is an unambiguous byte string: the 16-byte parent, the token count, the
//! tokens as little-endian `u32`, then tagged, length-prefixed extra keys (LoRA name, multimodal
//! inputs overlapping the block with their offset relative to the block start, and the cache salt
//! on the first block only). The default `H` is XXH3-128; SHA-256 and BLAKE3 are truncated to 128
//! bits. Results depend only on the algorithm, the seed and the input, so they are stable across
//! processes and machines.

use crate::error::{CoreError, Result};
use crate::types::BlockHash;
use sha2::Digest;

#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum HashAlgo {
    #[default]
    Xxh3,
    Sha256,
    Blake3,
}

impl HashAlgo {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "xxh3" | "xxh3_128" | "xxhash" => Ok(HashAlgo::Xxh3),
            "sha256" => Ok(HashAlgo::Sha256),
            "blake3" => Ok(HashAlgo::Blake3),
            other => Err(CoreError::InvalidArgument(format!(
                "unknown hash algorithm {other:?} (expected 'xxh3', 'sha256' or 'blake3')"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Xxh3 => "xxh3",
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Blake3 => "blake3",
        }
    }

    #[inline]
    pub fn digest(self, bytes: &[u8]) -> BlockHash {
        match self {
            HashAlgo::Xxh3 => BlockHash(xxhash_rust::xxh3::xxh3_128(bytes)),
            HashAlgo::Sha256 => {
                let d = sha2::Sha256::digest(bytes);
                BlockHash(u128::from_le_bytes(
                    d[..16].try_into().expect("32-byte digest"),
                ))
            }
            HashAlgo::Blake3 => {
                let d = blake3::hash(bytes);
                BlockHash(u128::from_le_bytes(
                    d.as_bytes()[..16].try_into().expect("32 bytes"),
                ))
            }
        }
    }
}

/// A multimodal input occupying `length` prompt positions from `offset`, identified by a
/// content hash or id chosen by the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmInput {
    pub identifier: String,
    pub offset: usize,
    pub length: usize,
}

/// Per-request keys mixed into the block hashes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// Per-tenant isolation: mixed into the first block, so the whole chain differs.
    pub cache_salt: Option<String>,
    pub lora_name: Option<String>,
    /// The LoRA adapter's id: reported in KV events, not hashed (vLLM hashes the name).
    pub lora_id: Option<u64>,
    /// Sorted by offset.
    pub mm_inputs: Vec<MmInput>,
}

impl ExtraKeys {
    pub fn new(
        cache_salt: Option<String>,
        lora_name: Option<String>,
        mut mm_inputs: Vec<MmInput>,
    ) -> Result<Self> {
        mm_inputs.sort_by_key(|m| m.offset);
        let extra = ExtraKeys {
            cache_salt: cache_salt.filter(|s| !s.is_empty()),
            lora_name,
            lora_id: None,
            mm_inputs,
        };
        extra.check()?;
        Ok(extra)
    }

    /// Checks what [`ExtraKeys::new`] ensures of the multimodal inputs (the fields are public,
    /// so keys built otherwise are checked where they are hashed): each has a positive length,
    /// ends at a position below `i64::MAX`, and they are sorted by offset.
    pub(crate) fn check(&self) -> Result<()> {
        let mm = &self.mm_inputs;
        if let Some(bad) = mm.iter().find(|m| m.length == 0) {
            return Err(CoreError::OutOfRange(format!(
                "multimodal input {:?} has length 0",
                bad.identifier
            )));
        }
        if let Some(bad) = mm.iter().find(|m| {
            m.offset
                .checked_add(m.length)
                .is_none_or(|end| end > i64::MAX as usize)
        }) {
            return Err(CoreError::OutOfRange(format!(
                "multimodal input {:?}: offset {} + length {} overflows",
                bad.identifier, bad.offset, bad.length
            )));
        }
        if let Some(pair) = mm.windows(2).find(|p| p[1].offset < p[0].offset) {
            return Err(CoreError::InvalidArgument(format!(
                "multimodal input {:?} (offset {}) comes after {:?} (offset {}): the inputs \
                 must be sorted by offset",
                pair[1].identifier, pair[1].offset, pair[0].identifier, pair[0].offset
            )));
        }
        Ok(())
    }

    /// The keys of the block `[start, end)` as KV events publish them (vLLM's order: LoRA name,
    /// multimodal inputs overlapping the block, cache salt on the first block), `None` when the
    /// block has none.
    pub fn event_keys(&self, start: usize, end: usize) -> Option<Vec<crate::types::EventKey>> {
        use crate::types::EventKey;
        let mut keys = Vec::new();
        if let Some(lora) = &self.lora_name {
            keys.push(EventKey::Lora(lora.clone()));
        }
        for mm in &self.mm_inputs {
            // Saturating: keys not made by `new` may hold any offsets.
            if mm.offset < end && mm.offset.saturating_add(mm.length) > start {
                let offset = i64::try_from(mm.offset).unwrap_or(i64::MAX);
                let start = i64::try_from(start).unwrap_or(i64::MAX);
                keys.push(EventKey::Mm(
                    mm.identifier.clone(),
                    offset.saturating_sub(start),
                ));
            }
        }
        if start == 0 {
            if let Some(salt) = &self.cache_salt {
                keys.push(EventKey::Salt(salt.clone()));
            }
        }
        (!keys.is_empty()).then_some(keys)
    }

    fn is_empty(&self) -> bool {
        self.cache_salt.is_none() && self.lora_name.is_none() && self.mm_inputs.is_empty()
    }
}

/// A token id as accepted from callers: `u32`, or signed/wider integers in `0..2^32`.
pub trait TokenId: Copy {
    fn to_u32(self) -> Option<u32>;
    /// The id as `u32`, for values already checked with [`TokenId::to_u32`].
    fn as_u32(self) -> u32;
}

macro_rules! token_id {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline]
            fn as_u32(self) -> u32 {
                self as u32
            }
            #[inline]
            fn to_u32(self) -> Option<u32> {
                u32::try_from(self).ok()
            }
        }
    )*};
}

// `u32 as u32` is the identity; clippy's unnecessary-cast lint does not apply to macro output.
token_id!(u32, i32, i64, u64);

/// Checks every token id is in `0..2^32`; reports the first that is not.
pub fn check_tokens<T: TokenId>(tokens: &[T]) -> Result<()> {
    if tokens.iter().all(|t| t.to_u32().is_some()) {
        return Ok(());
    }
    let pos = tokens
        .iter()
        .position(|t| t.to_u32().is_none())
        .unwrap_or(0);
    Err(CoreError::OutOfRange(format!(
        "token id at position {pos} is outside [0, 2^32)"
    )))
}

/// Hashes token sequences into chained block hashes. Two hashers are equal when they produce
/// the same hashes (same algorithm, block size, seed and lookahead).
///
/// A *supplied* hasher hashes nothing: the caller hands over each block's hash as it does for
/// vLLM's requests, whose `block_hashes` its engine computes (see [`BlockHasher::supplied`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    algo: HashAlgo,
    block_size: usize,
    none_hash: BlockHash,
    /// Tokens after each block its hash also covers (vLLM's `num_hash_lookahead_tokens`: a
    /// drafter proves the boundary token), so a block is hashed only once they exist.
    lookahead: usize,
    supplied: bool,
}

pub const MAX_BLOCK_SIZE: usize = 1 << 20;

/// The hash a request's first block chains from, for `algo` and `seed`. The last one made on
/// each thread is kept: every request of a manager has the same, and a SHA-256 of the seed
/// cost about as much as the rest of making a request whose block hashes are supplied.
fn none_hash(algo: HashAlgo, seed: &str) -> BlockHash {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(HashAlgo, String, BlockHash)>> =
            const { std::cell::RefCell::new(None) };
    }
    let kept = LAST.with_borrow(|last| match last {
        Some((a, s, hash)) if *a == algo && s == seed => Some(*hash),
        _ => None,
    });
    if let Some(hash) = kept {
        return hash;
    }
    let mut seed_bytes = b"hybrid-kv/none-hash/".to_vec();
    seed_bytes.extend_from_slice(seed.as_bytes());
    let hash = algo.digest(&seed_bytes);
    LAST.set(Some((algo, seed.to_owned(), hash)));
    hash
}

/// A hash block size hashers accept: 1 to [`MAX_BLOCK_SIZE`] tokens.
fn check_block_size(block_size: usize) -> Result<()> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return Err(CoreError::OutOfRange(format!(
            "block_size must be in 1..={MAX_BLOCK_SIZE}, got {block_size}"
        )));
    }
    Ok(())
}

impl BlockHasher {
    pub fn new(block_size: usize, algo: HashAlgo, seed: &str) -> Result<Self> {
        check_block_size(block_size)?;
        Ok(BlockHasher {
            algo,
            block_size,
            none_hash: none_hash(algo, seed),
            lookahead: 0,
            supplied: false,
        })
    }

    /// A hasher of `block_size` blocks covering `lookahead` tokens past each, whose hashes the
    /// caller supplies: [`BlockHasher::hash_blocks`] only validates the tokens and adds no hash.
    /// Its hashes are keys from another hasher (vLLM's `Request.block_hashes`), so it equals
    /// no hasher that computes them.
    pub fn supplied(block_size: usize, lookahead: usize) -> Result<Self> {
        check_block_size(block_size)?;
        BlockHasher {
            algo: HashAlgo::Xxh3,
            block_size,
            none_hash: BlockHash(0),
            lookahead: 0,
            supplied: true,
        }
        .with_lookahead(lookahead)
    }

    /// Whether the caller supplies the hashes (see [`BlockHasher::supplied`]).
    pub fn is_supplied(&self) -> bool {
        self.supplied
    }

    /// The same hasher covering `lookahead` tokens past each block.
    pub fn with_lookahead(mut self, lookahead: usize) -> Result<Self> {
        if lookahead > MAX_BLOCK_SIZE {
            return Err(CoreError::OutOfRange(format!(
                "num_hash_lookahead_tokens must be at most {MAX_BLOCK_SIZE}, got {lookahead}"
            )));
        }
        self.lookahead = lookahead;
        Ok(self)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Tokens a block needs before it can be hashed: the block and its lookahead.
    #[inline]
    pub fn tokens_per_hash(&self) -> usize {
        self.block_size + self.lookahead
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The parent of a sequence's first block.
    pub fn none_hash(&self) -> BlockHash {
        self.none_hash
    }

    /// Appends to `out` the hashes of the full blocks of `tokens`, where `tokens[0]` is at
    /// sequence position `start` (a multiple of the block size) and `parent` is the hash of the
    /// block before it (`None` at the start of a sequence). A block is hashed once the
    /// `lookahead` tokens after it are present too; the trailing tokens are not hashed, but every
    /// token must be a valid id, and `extra`'s multimodal inputs as [`ExtraKeys::new`] makes
    /// them.
    pub fn hash_blocks<T: TokenId>(
        &self,
        parent: Option<BlockHash>,
        tokens: &[T],
        start: usize,
        extra: &ExtraKeys,
        out: &mut Vec<BlockHash>,
    ) -> Result<()> {
        let bs = self.block_size;
        if start % bs != 0 {
            return Err(CoreError::InvalidArgument(format!(
                "start {start} is not a multiple of the block size {bs}"
            )));
        }
        let look = self.lookahead;
        let num_full = tokens.len().saturating_sub(look) / bs;
        // Positions are `usize`: the tokens (and the lookahead past the last block) must fit.
        if start
            .checked_add(tokens.len())
            .and_then(|end| end.checked_add(look))
            .is_none()
        {
            return Err(CoreError::OutOfRange(format!(
                "start {start} plus {} tokens and {look} lookahead tokens overflow a position",
                tokens.len()
            )));
        }
        check_tokens(tokens)?;
        extra.check()?;
        if self.supplied {
            return Ok(());
        }
        out.reserve(num_full);
        let mut chain = Chain::new(self, parent, start, extra);
        for (i, block) in tokens.chunks_exact(bs).take(num_full).enumerate() {
            out.push(chain.push(block, &tokens[(i + 1) * bs..(i + 1) * bs + look]));
        }
        Ok(())
    }
}

/// The state of a hash chain between its blocks ([`BlockHasher::hash_blocks`]' loop), for
/// callers that hash blocks as their tokens arrive: each [`Chain::push`] hashes the next block.
pub(crate) struct Chain<'a> {
    hasher: &'a BlockHasher,
    extra: &'a ExtraKeys,
    /// Header (parent, token count) and tokens at fixed offsets; extra keys appended after.
    /// The parent in front is the next block's.
    buf: Vec<u8>,
    body: usize,
    /// Sequence position of the next block.
    start: usize,
    /// Where the next block's scan of the (sorted) multimodal inputs starts.
    mm_next: usize,
}

impl<'a> Chain<'a> {
    /// A chain whose next block starts at sequence position `start` (a multiple of the block
    /// size), after the block hashed `parent` (`None` at the start of a sequence).
    pub(crate) fn new(
        hasher: &'a BlockHasher,
        parent: Option<BlockHash>,
        start: usize,
        extra: &'a ExtraKeys,
    ) -> Self {
        let body = 20 + 4 * hasher.block_size;
        let mut buf: Vec<u8> = vec![0; body];
        let parent = parent.unwrap_or(hasher.none_hash);
        buf[..16].copy_from_slice(&parent.0.to_le_bytes());
        buf[16..20].copy_from_slice(&(hasher.block_size as u32).to_le_bytes());
        Chain {
            hasher,
            extra,
            buf,
            body,
            start,
            mm_next: 0,
        }
    }

    /// The hash of the next block, `block` (`block_size` valid tokens), followed in the
    /// sequence by `after` (the hasher's `lookahead` tokens).
    #[inline(always)]
    pub(crate) fn push<T: TokenId>(&mut self, block: &[T], after: &[T]) -> BlockHash {
        let (bs, look, body) = (self.hasher.block_size, self.hasher.lookahead, self.body);
        debug_assert_eq!((block.len(), after.len()), (bs, look));
        let buf = &mut self.buf;
        buf.truncate(body);
        for (dst, &t) in buf[20..body].chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.as_u32().to_le_bytes());
        }
        if !self.extra.is_empty() {
            // With lookahead, the extra keys cover the block and the tokens after it.
            let end = self.start + bs + look;
            self.mm_next = encode_extra(buf, self.extra, self.start, end, self.mm_next);
        }
        if look > 0 {
            buf.push(b'A');
            for &t in after {
                buf.extend_from_slice(&t.as_u32().to_le_bytes());
            }
        }
        let hash = self.hasher.algo.digest(buf);
        // The next block's parent, written here: the chain's next step then starts from the
        // buffer (a round trip of the hash through the struct was on the chain's critical
        // path).
        buf[..16].copy_from_slice(&hash.0.to_le_bytes());
        self.start += bs;
        hash
    }
}

fn push_str(buf: &mut Vec<u8>, tag: u8, s: &str) {
    buf.push(tag);
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

/// Encodes the extra keys of the block `[start, end)`; returns where the next block's scan of
/// the (sorted) multimodal inputs starts.
fn encode_extra(
    buf: &mut Vec<u8>,
    extra: &ExtraKeys,
    start: usize,
    end: usize,
    from: usize,
) -> usize {
    if let Some(lora) = &extra.lora_name {
        push_str(buf, b'L', lora);
    }
    let mut next = from;
    for (k, mm) in extra.mm_inputs.iter().enumerate().skip(from) {
        if mm.offset >= end {
            break;
        }
        let mm_end = mm.offset + mm.length;
        if mm_end <= start {
            if k == next {
                next += 1;
            }
            continue;
        }
        push_str(buf, b'M', &mm.identifier);
        buf.extend_from_slice(&(mm.offset as i64 - start as i64).to_le_bytes());
        if mm_end <= end && k == next {
            next += 1;
        }
    }
    if start == 0 {
        if let Some(salt) = &extra.cache_salt {
            push_str(buf, b'S', salt);
        }
    }
    next
}

/// An incrementally extended hash chain over a growing token sequence.
#[derive(Clone, Debug)]
pub struct BlockHashChain {
    hasher: BlockHasher,
    extra: ExtraKeys,
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
}

impl BlockHashChain {
    pub fn new(hasher: BlockHasher, extra: ExtraKeys) -> Self {
        BlockHashChain {
            hasher,
            extra,
            tokens: Vec::new(),
            hashes: Vec::new(),
        }
    }

    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Appends tokens and hashes every block they complete; returns how many hashes were added.
    /// Rejects the whole call (nothing appended) if any token id is out of range, or the chain's
    /// extra keys are not as [`ExtraKeys::new`] makes them.
    pub fn extend<T: TokenId>(&mut self, tokens: &[T]) -> Result<usize> {
        check_tokens(tokens)?;
        self.extra.check()?;
        self.tokens.extend(tokens.iter().map(|t| t.as_u32()));
        let bs = self.hasher.block_size;
        let done = self.hashes.len() * bs;
        let before = self.hashes.len();
        if self.tokens.len() >= done + self.hasher.tokens_per_hash() {
            let parent = self.hashes.last().copied();
            let (tokens, hashes) = (&self.tokens[done..], &mut self.hashes);
            self.hasher
                .hash_blocks(parent, tokens, done, &self.extra, hashes)?;
        }
        Ok(self.hashes.len() - before)
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
