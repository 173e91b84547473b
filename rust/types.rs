//! Identifiers shared by every part of the core.

use std::fmt;

/// Index of a block in the pool. Block 0 is the permanent null block.
pub type BlockId = u32;

/// Index of a KV cache group (a set of layers that share block ids).
pub type GroupId = u32;

/// Largest pool: block ids must fit an `i32` (they cross into Python as `int32`).
pub const MAX_BLOCKS: usize = i32::MAX as usize;

/// The null block: stands for a slot that needs no memory (e.g. tokens that fell out of a
/// sliding window). Never handed out, never counted as free.
pub const NULL_BLOCK: BlockId = 0;

/// A 128-bit chained block hash (see [`crate::hashing`]).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The hash as 16 big-endian bytes.
    pub fn to_be_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// The (low, high) 64-bit halves, the form used to pass hashes to numpy.
    pub fn to_parts(self) -> (u64, u64) {
        (self.0 as u64, (self.0 >> 64) as u64)
    }

    /// Inverse of [`BlockHash::to_parts`].
    pub fn from_parts(lo: u64, hi: u64) -> Self {
        BlockHash(((hi as u128) << 64) | lo as u128)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

/// A prefix-cache key: the same content in different groups is cached independently.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct CacheKey {
    pub hash: BlockHash,
    pub group: GroupId,
}

/// One extra key of a stored block as KV events publish it (vLLM's untagged form).
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum EventKey {
    /// The LoRA adapter's name.
    Lora(String),
    /// A multimodal input overlapping the block: its identifier and its offset relative to the
    /// block's first token (negative when it starts before the block).
    Mm(String, i64),
    /// The cache salt (first block of a prompt only).
    Salt(String),
}

/// What the pool reports to a KV-event consumer (vLLM's `kv_events`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum KvEvent {
    /// Blocks newly entered into the prefix cache by one `cache_full_blocks` call (emitted even
    /// when every block of the call was null or masked, with no hashes, as vLLM does).
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        group_id: GroupId,
        /// The request's LoRA adapter `(name, id)`.
        lora: Option<(String, Option<u64>)>,
        /// Per stored block, its extra keys (`None` for a block without any); `None` when no
        /// block was stored.
        extra_keys: Option<Vec<Option<Vec<EventKey>>>>,
        /// The position (block index) in the request of the first block of the call's range.
        first_block: usize,
        /// The positions of the stored blocks (`first_block` plus their index in the call).
        block_indices: Vec<usize>,
    },
    /// One cache key removed (eviction on reuse, explicit eviction).
    BlockRemoved {
        block_hash: BlockHash,
        group_id: GroupId,
        /// The block was handed out again (an allocation evicted it), rather than its key
        /// removed explicitly (`evict_blocks`: a key replaced, a transient state dropped).
        on_reuse: bool,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// Optional event payload for [`crate::pool::BlockPool::cache_full_blocks`].
#[derive(Clone, Copy, Default)]
pub struct StoreInfo<'a> {
    /// Hash of the block before the first newly cached one (`None` at the start of a prompt).
    pub parent_block_hash: Option<BlockHash>,
    /// Token ids covered by the newly cached blocks.
    pub token_ids: &'a [u32],
    /// Tokens per block of the group.
    pub block_size: u32,
    /// The request's LoRA adapter `(name, id)`.
    pub lora: Option<(&'a str, Option<u64>)>,
    /// The extra keys of the `i`-th block of the call (by position in `blocks`). With events on,
    /// the pool calls it for every block of the call but the null block, before it changes
    /// anything and with none of its locks held: it may call into the pool.
    pub block_extra_keys: Option<&'a dyn Fn(usize) -> Option<Vec<EventKey>>>,
    /// The position (block index) in the request of `blocks[0]`.
    pub first_block: usize,
}

impl StoreInfo<'_> {
    /// The prefix length the key of the `i`-th block of the call covers: through the end of
    /// that block (vLLM's `block_hash_num_tokens`), saturating.
    pub(crate) fn key_tokens(&self, i: usize) -> u32 {
        let end = self
            .first_block
            .saturating_add(i)
            .saturating_add(1)
            .saturating_mul(self.block_size as usize);
        u32::try_from(end).unwrap_or(u32::MAX)
    }

    /// The `BlockStored` event of a call that stored `block_hashes` in `group` (the blocks at
    /// `block_indices`, each with its entry of `extra_keys`: empty when none was stored).
    pub(crate) fn stored_event(
        &self,
        group: GroupId,
        block_hashes: Vec<BlockHash>,
        extra_keys: Vec<Option<Vec<EventKey>>>,
        block_indices: Vec<usize>,
    ) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash: self.parent_block_hash,
            token_ids: self.token_ids.to_vec(),
            block_size: self.block_size,
            group_id: group,
            lora: self.lora.map(|(name, id)| (name.to_owned(), id)),
            extra_keys: (!extra_keys.is_empty()).then_some(extra_keys),
            first_block: self.first_block,
            block_indices,
        }
    }

    /// The `BlockStored` event of one block stored in `group` under `hash`, the call's first.
    pub(crate) fn stored_one(&self, group: GroupId, hash: BlockHash) -> KvEvent {
        let extra_keys = vec![self.block_extra_keys.and_then(|f| f(0))];
        self.stored_event(group, vec![hash], extra_keys, vec![self.first_block])
    }
}

impl std::fmt::Debug for StoreInfo<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreInfo")
            .field("parent_block_hash", &self.parent_block_hash)
            .field("token_ids", &self.token_ids.len())
            .field("block_size", &self.block_size)
            .field("lora", &self.lora)
            .finish_non_exhaustive()
    }
}

/// A fast hasher for maps keyed by request ids (short strings chosen by the caller), salted
/// once per process so colliding ids cannot be precomputed. Several times cheaper than SipHash on
/// the per-call path of the manager.
#[derive(Clone, Copy)]
pub struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            self.add(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 56));
        }
    }

    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.add(v as u64);
    }

    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // Final avalanche so the low bits used by hashbrown depend on every input bit.
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^ (h >> 33)
    }
}

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517C_C1B7_2722_0A95);
    }
}

/// Builds [`FastHasher`]s seeded with a per-process random salt.
#[derive(Clone, Copy)]
pub struct FastHashBuilder(u64);

impl Default for FastHashBuilder {
    fn default() -> Self {
        static SALT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        FastHashBuilder(*SALT.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(0x6B76);
            h.finish()
        }))
    }
}

impl std::hash::BuildHasher for FastHashBuilder {
    type Hasher = FastHasher;
    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher(self.0)
    }
}

/// A `HashMap` keyed by request id.
pub type RequestMap<V> = std::collections::HashMap<String, V, FastHashBuilder>;
