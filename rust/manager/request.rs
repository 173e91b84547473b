//! Request-level state the manager keeps: token counts and the request's block hashes.

use crate::error::Result;
use crate::hashing::{check_tokens, BlockHasher, ExtraKeys, TokenId};
use crate::types::BlockHash;

/// A request's chained block hashes at `hash_block_size`, extended incrementally as tokens are
/// appended. Only the tokens after the last full hash block are kept (to finish that block),
/// plus every token when KV events are on (they report the token ids of stored blocks): the
/// prompt itself stays with the caller. `num_computed_tokens` is not kept here: the scheduler
/// owns it (as in vLLM) and passes it to `allocate_slots`.
#[derive(Clone, Debug)]
pub struct Request {
    id: String,
    num_prompt_tokens: usize,
    num_tokens: usize,
    hasher: BlockHasher,
    extra: ExtraKeys,
    hashes: Vec<BlockHash>,
    /// Tokens after the last full hash block.
    tail: Vec<u32>,
    /// Every token, kept only for KV events.
    all: Option<Vec<u32>>,
    /// Prompt-logprobs requests read no prefix-cache hit (their blocks are still cached).
    skip_reading: bool,
}

impl Request {
    pub(crate) fn new<T: TokenId>(
        id: String,
        prompt: &[T],
        hasher: BlockHasher,
        extra: ExtraKeys,
        keep_tokens: bool,
    ) -> Result<Self> {
        check_tokens(prompt)?;
        let bs = hasher.block_size();
        let mut hashes = Vec::new();
        hasher.hash_blocks(None, prompt, 0, &extra, &mut hashes)?;
        let full = hashes.len() * bs;
        Ok(Request {
            id,
            num_prompt_tokens: prompt.len(),
            num_tokens: prompt.len(),
            tail: prompt[full..].iter().map(|t| t.as_u32()).collect(),
            all: keep_tokens.then(|| prompt.iter().map(|t| t.as_u32()).collect()),
            hasher,
            extra,
            hashes,
            skip_reading: false,
        })
    }

    /// A request whose prompt was hashed by the caller with `hasher`: `hashes` of its full
    /// blocks and the `tail` tokens after them (the prompt itself is not needed).
    pub(crate) fn from_prehashed(
        id: String,
        num_prompt_tokens: usize,
        hasher: BlockHasher,
        extra: ExtraKeys,
        hashes: Vec<BlockHash>,
        tail: Vec<u32>,
    ) -> Result<Self> {
        extra.check()?;
        let bs = hasher.block_size();
        let num_hashed = num_prompt_tokens.saturating_sub(hasher.lookahead()) / bs;
        if hashes.len() != num_hashed || tail.len() != num_prompt_tokens - num_hashed * bs {
            return Err(crate::error::CoreError::InvalidArgument(format!(
                "request {id:?}: {} hashes and {} tail tokens do not make a {num_prompt_tokens}-token \
                 prompt at block size {bs}",
                hashes.len(),
                tail.len()
            )));
        }
        Ok(Request {
            id,
            num_prompt_tokens,
            num_tokens: num_prompt_tokens,
            hasher,
            extra,
            hashes,
            tail,
            all: None,
            skip_reading: false,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the request reads no prefix-cache hit (vLLM's `skip_reading_prefix_cache`).
    pub fn skip_reading_prefix_cache(&self) -> bool {
        self.skip_reading
    }

    pub(crate) fn set_skip_reading_prefix_cache(&mut self, skip: bool) {
        self.skip_reading = skip;
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// Prompt plus output tokens.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Token ids `[start, end)` when they are kept (KV events on); empty otherwise. The range
    /// is clamped to the request's tokens (an empty or inverted range gives an empty slice).
    pub fn token_range(&self, start: usize, end: usize) -> &[u32] {
        self.all.as_deref().map_or(&[], |all| {
            let end = end.min(all.len());
            &all[start.min(end)..end]
        })
    }

    /// Hashes of the full `hash_block_size` blocks of the request's tokens.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// The tokens after the last full hash block.
    pub fn tail(&self) -> &[u32] {
        &self.tail
    }

    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    pub fn extra_keys(&self) -> &ExtraKeys {
        &self.extra
    }

    /// Appends output tokens (all or nothing: out-of-range ids are rejected).
    pub(crate) fn append<T: TokenId>(&mut self, tokens: &[T]) -> Result<()> {
        if let ([token], None) = (tokens, &self.all) {
            // One sampled token (a decode step): no division, no bulk copy.
            check_tokens(std::slice::from_ref(token))?;
            self.tail.push(token.as_u32());
            self.num_tokens += 1;
            if self.tail.len() < self.hasher.tokens_per_hash() {
                return Ok(());
            }
            return self.hash_tail();
        }
        check_tokens(tokens)?;
        self.tail.extend(tokens.iter().map(|t| t.as_u32()));
        if let Some(all) = &mut self.all {
            all.extend(tokens.iter().map(|t| t.as_u32()));
        }
        self.num_tokens += tokens.len();
        self.hash_tail()
    }

    /// Hashes the full blocks of `tail` (those whose lookahead tokens are there too) and keeps
    /// only the tokens after them.
    fn hash_tail(&mut self) -> Result<()> {
        let bs = self.hasher.block_size();
        if self.tail.len() >= self.hasher.tokens_per_hash() && !self.hasher.is_supplied() {
            let start = self.hashes.len() * bs;
            let parent = self.hashes.last().copied();
            let before = self.hashes.len();
            self.hasher
                .hash_blocks(parent, &self.tail, start, &self.extra, &mut self.hashes)?;
            self.tail.drain(..(self.hashes.len() - before) * bs);
        }
        Ok(())
    }
}

impl Request {
    /// Full blocks whose hashes the request's tokens allow: those whose lookahead tokens are
    /// there too.
    pub fn num_hashable_blocks(&self) -> usize {
        self.hashable_blocks(self.num_tokens)
    }

    fn hashable_blocks(&self, num_tokens: usize) -> usize {
        num_tokens.saturating_sub(self.hasher.lookahead()) / self.hasher.block_size()
    }

    /// An error if `all` cannot give the request, once it holds `num_tokens` tokens, the hashes
    /// of its hashable blocks (or the request computes its own).
    fn check_supplied(&self, num_tokens: usize, all: &[BlockHash]) -> Result<()> {
        if !self.hasher.is_supplied() {
            return Err(crate::error::CoreError::InvalidArgument(format!(
                "request {:?} computes its own block hashes",
                self.id
            )));
        }
        let want = self.hashable_blocks(num_tokens);
        if want > self.hashes.len() && all.len() < want {
            return Err(crate::error::CoreError::InvalidArgument(format!(
                "request {:?}: {} block hashes for {num_tokens} tokens, {want} expected",
                self.id,
                all.len(),
            )));
        }
        Ok(())
    }

    /// Takes the hashes of its new full blocks from `all`, the hashes of every full block of
    /// the request so far (vLLM's `Request.block_hashes`), for a request whose hasher is
    /// supplied. Hashes it already holds are not read again; hashes past its tokens are left
    /// for later. An error changes nothing: a request with a computing hasher, or `all`
    /// shorter than the request's hashable blocks.
    pub(crate) fn supply_hashes(&mut self, all: &[BlockHash]) -> Result<()> {
        self.check_supplied(self.num_tokens, all)?;
        let (have, want) = (self.hashes.len(), self.num_hashable_blocks());
        if want > have {
            self.hashes.extend_from_slice(&all[have..want]);
            self.tail.drain(..(want - have) * self.hasher.block_size());
        }
        Ok(())
    }

    /// Appends output tokens and takes the hashes they make hashable from `all` (see
    /// [`Request::supply_hashes`]); changes nothing on an error.
    pub(crate) fn append_with_hashes<T: TokenId>(
        &mut self,
        tokens: &[T],
        all: &[BlockHash],
    ) -> Result<()> {
        self.check_supplied(self.num_tokens + tokens.len(), all)?;
        self.append(tokens)?;
        self.supply_hashes(all)
    }
}

/// The hashes of a group whose block size is `k` times the hash block size (vLLM's
/// `BlockHashListWithBlockSize`): block `i`'s hash is the chained hash at its last hash
/// boundary, `hashes[(i + 1) * k - 1]`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct HashView<'a> {
    hashes: &'a [BlockHash],
    k: usize,
}

impl<'a> HashView<'a> {
    pub(crate) fn new(hashes: &'a [BlockHash], k: usize) -> Self {
        HashView { hashes, k }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.hashes.len() / self.k
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> BlockHash {
        self.hashes[(i + 1) * self.k - 1]
    }
}
