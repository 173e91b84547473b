//! Request-level state the manager keeps: token ids and their block hashes.

use crate::error::Result;
use crate::hashing::{BlockHashChain, BlockHasher, ExtraKeys, TokenId};
use crate::types::BlockHash;

/// A request's tokens (prompt, then outputs as they are appended) and its chained block
/// hashes at `hash_block_size`, extended incrementally. `num_computed_tokens` is not kept
/// here: the scheduler owns it (as in vLLM) and passes it to `allocate_slots`.
#[derive(Clone, Debug)]
pub struct Request {
    id: String,
    num_prompt_tokens: usize,
    chain: BlockHashChain,
}

impl Request {
    pub(crate) fn new<T: TokenId>(
        id: String,
        prompt: &[T],
        hasher: BlockHasher,
        extra: ExtraKeys,
    ) -> Result<Self> {
        let mut chain = BlockHashChain::new(hasher, extra);
        chain.extend(prompt)?;
        Ok(Request {
            id,
            num_prompt_tokens: prompt.len(),
            chain,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// Prompt plus output tokens.
    pub fn num_tokens(&self) -> usize {
        self.chain.tokens().len()
    }

    pub fn token_ids(&self) -> &[u32] {
        self.chain.tokens()
    }

    /// Hashes of the full `hash_block_size` blocks of `token_ids`.
    pub fn block_hashes(&self) -> &[BlockHash] {
        self.chain.hashes()
    }

    /// Appends output tokens (all or nothing: out-of-range ids are rejected).
    pub(crate) fn append<T: TokenId>(&mut self, tokens: &[T]) -> Result<()> {
        self.chain.extend(tokens).map(|_| ())
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
