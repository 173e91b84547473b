//! KV cache group specs and the manager's configuration.

use crate::error::{bad_config, Result};
use crate::hashing::HashAlgo;

/// The attention type of a KV cache group: decides how many blocks a request holds in the
/// group and which prefix of a prompt counts as a cache hit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every token needs a slot; a hit needs every block of the prefix cached.
    Full,
    /// Only the last `window` tokens are attended; blocks that fall out of the window are
    /// freed (replaced by the null block), and a hit needs only the blocks covering the last
    /// `window - 1` tokens before the hit point.
    SlidingWindow { window: usize },
    /// Llama-4 style local attention over fixed chunks of `chunk` tokens: blocks before the
    /// current chunk are not needed.
    ChunkedLocal { chunk: usize },
    /// One recurrent state per request (vLLM's mamba_cache_mode "none": only the last state is
    /// kept). Not prefix-cacheable here: a layout with a Mamba group always hits 0 tokens.
    Mamba,
}

impl AttentionKind {
    /// The kind names a binding accepts (vLLM's spec-kind names and short forms).
    pub const NAMES: &'static str = "full, sliding_window, chunked_local or mamba";

    /// The kind named `name`, with its parameter (`sliding_window` or `attention_chunk_size`)
    /// read by `param` only when the kind has one.
    pub fn parse(name: &str, param: impl FnOnce(&'static str) -> Result<usize>) -> Result<Self> {
        Ok(match name {
            "full" | "full_attention" => AttentionKind::Full,
            "sliding_window" => AttentionKind::SlidingWindow {
                window: param("sliding_window")?,
            },
            "chunked_local" | "chunked_local_attention" => AttentionKind::ChunkedLocal {
                chunk: param("attention_chunk_size")?,
            },
            "mamba" => AttentionKind::Mamba,
            other => {
                return bad_config(format!(
                    "unknown attention kind {other:?} (expected {})",
                    Self::NAMES
                ))
            }
        })
    }

    /// vLLM's `KVCacheSpecKind` name of this kind (as in its KV events).
    pub fn as_str(&self) -> &'static str {
        match self {
            AttentionKind::Full => "full_attention",
            AttentionKind::SlidingWindow { .. } => "sliding_window",
            AttentionKind::ChunkedLocal { .. } => "chunked_local_attention",
            AttentionKind::Mamba => "mamba",
        }
    }

    /// The sliding window in tokens, for sliding-window kinds.
    pub fn sliding_window(&self) -> Option<usize> {
        match self {
            AttentionKind::SlidingWindow { window } => Some(*window),
            _ => None,
        }
    }
}

/// One KV cache group: a set of layers of one attention type sharing block ids.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    pub kind: AttentionKind,
    /// Tokens per block in this group.
    pub block_size: usize,
}

impl GroupSpec {
    pub fn full(block_size: usize) -> Self {
        GroupSpec {
            kind: AttentionKind::Full,
            block_size,
        }
    }

    pub fn sliding_window(block_size: usize, window: usize) -> Self {
        GroupSpec {
            kind: AttentionKind::SlidingWindow { window },
            block_size,
        }
    }

    pub fn chunked_local(block_size: usize, chunk: usize) -> Self {
        GroupSpec {
            kind: AttentionKind::ChunkedLocal { chunk },
            block_size,
        }
    }

    pub fn mamba(block_size: usize) -> Self {
        GroupSpec {
            kind: AttentionKind::Mamba,
            block_size,
        }
    }

    pub fn is_full(&self) -> bool {
        matches!(self.kind, AttentionKind::Full)
    }

    /// Whether the group's blocks enter the prefix cache (everything but Mamba here).
    pub fn prefix_cacheable(&self) -> bool {
        !matches!(self.kind, AttentionKind::Mamba)
    }

    /// Leading tokens whose KV is no longer needed once `num_computed_tokens` are computed
    /// (vLLM's `get_num_skipped_tokens`).
    pub fn skipped_tokens(&self, num_computed_tokens: usize) -> usize {
        match self.kind {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow { window } => {
                (num_computed_tokens + 1).saturating_sub(window)
            }
            AttentionKind::ChunkedLocal { chunk } => num_computed_tokens / chunk * chunk,
            AttentionKind::Mamba => num_computed_tokens.saturating_sub(1),
        }
    }

    /// Contiguous cached blocks a sliding-window hit needs: `cdiv(window - 1, block_size)`.
    pub(crate) fn sliding_window_contiguous_blocks(&self) -> usize {
        match self.kind {
            AttentionKind::SlidingWindow { window } => {
                window.saturating_sub(1).div_ceil(self.block_size)
            }
            _ => 0,
        }
    }

    /// vLLM's `max_admission_blocks_per_request`: the blocks a request can hold at once in a
    /// group that recycles blocks (sliding window, chunked local); `None` for the others.
    pub fn max_admission_blocks(
        &self,
        max_in_flight_tokens: usize,
        max_model_len: usize,
    ) -> Option<usize> {
        let bs = self.block_size;
        match self.kind {
            AttentionKind::SlidingWindow { window } => {
                let tokens = (window - 1 + max_in_flight_tokens).min(max_model_len);
                Some(tokens.div_ceil(bs) + 1)
            }
            AttentionKind::ChunkedLocal { chunk } => Some(
                (chunk + max_in_flight_tokens)
                    .min(max_model_len)
                    .div_ceil(bs),
            ),
            AttentionKind::Full | AttentionKind::Mamba => None,
        }
    }

    fn validate(&self, index: usize) -> Result<()> {
        let bad = |what: String| bad_config(format!("KV cache group {index}: {what}"));
        if self.block_size == 0 {
            return bad("block_size must be positive".into());
        }
        match self.kind {
            AttentionKind::SlidingWindow { window: 0 } => {
                bad("sliding window must be positive".into())
            }
            AttentionKind::ChunkedLocal { chunk: 0 } => {
                bad("attention chunk size must be positive".into())
            }
            _ => Ok(()),
        }
    }
}

/// Everything the manager needs to know at construction.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// The KV cache groups, in group-id order.
    pub groups: Vec<GroupSpec>,
    /// Blocks in the pool, the null block 0 included.
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub enable_caching: bool,
    pub enable_events: bool,
    /// vLLM's `max_in_flight_tokens` (concurrent batches × `max_num_batched_tokens`), used by
    /// the admission caps of sliding-window and chunked-local groups. `None`: `max_model_len`.
    pub max_in_flight_tokens: Option<usize>,
    /// Hit granularity; `None`: the lcm of the group block sizes.
    pub scheduler_block_size: Option<usize>,
    /// Granularity of the request block hashes; `None`: the gcd of the block sizes of the
    /// prefix-cacheable groups (the scheduler block size when there are none).
    pub hash_block_size: Option<usize>,
    pub hash_algo: HashAlgo,
    pub hash_seed: String,
    /// Fraction of `num_blocks` kept free when admitting a waiting request while others are
    /// scheduled (vLLM's scheduler `watermark`; default 0).
    pub watermark: f64,
}

impl ManagerConfig {
    /// Caching on, events off, default hashing.
    pub fn new(groups: Vec<GroupSpec>, num_blocks: usize, max_model_len: usize) -> Self {
        ManagerConfig {
            groups,
            num_blocks,
            max_model_len,
            enable_caching: true,
            enable_events: false,
            max_in_flight_tokens: None,
            scheduler_block_size: None,
            hash_block_size: None,
            hash_algo: HashAlgo::default(),
            hash_seed: String::new(),
            watermark: 0.0,
        }
    }

    /// Checks the config and resolves `(scheduler_block_size, hash_block_size)`.
    pub(crate) fn resolve_block_sizes(&self) -> Result<(usize, usize)> {
        let invalid = |msg: String| bad_config(msg);
        if self.groups.is_empty() {
            return invalid("at least one KV cache group is required".into());
        }
        if self.max_model_len == 0 {
            return invalid("max_model_len must be positive".into());
        }
        if !(0.0..=1.0).contains(&self.watermark) {
            return invalid(format!("watermark {} must be in [0, 1]", self.watermark));
        }
        for (i, g) in self.groups.iter().enumerate() {
            g.validate(i)?;
        }
        let lcm = self
            .groups
            .iter()
            .try_fold(1usize, |acc, g| lcm(acc, g.block_size))
            .ok_or_else(|| {
                crate::error::CoreError::InvalidConfig("block sizes overflow their lcm".into())
            })?;
        let scheduler = self.scheduler_block_size.unwrap_or(lcm);
        if scheduler == 0 || self.groups.iter().any(|g| scheduler % g.block_size != 0) {
            return invalid(format!(
                "scheduler_block_size {scheduler} must be a positive multiple of every group \
                 block size"
            ));
        }
        if self.groups.len() == 1 && scheduler != self.groups[0].block_size {
            return invalid(format!(
                "a single KV cache group schedules at its own block size {}, not {scheduler}",
                self.groups[0].block_size
            ));
        }
        let cacheable_gcd = self
            .groups
            .iter()
            .filter(|g| g.prefix_cacheable())
            .fold(0usize, |acc, g| gcd(acc, g.block_size));
        let hash = self.hash_block_size.unwrap_or(if cacheable_gcd == 0 {
            scheduler
        } else {
            cacheable_gcd
        });
        if hash == 0 || scheduler % hash != 0 {
            return invalid(format!(
                "hash_block_size {hash} must divide scheduler_block_size {scheduler}"
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if g.prefix_cacheable() && g.block_size % hash != 0 {
                return invalid(format!(
                    "KV cache group {i}: block_size {} is not a multiple of hash_block_size {hash}",
                    g.block_size
                ));
            }
        }
        if self.enable_caching {
            let cacheable = self.groups.iter().filter(|g| g.prefix_cacheable()).count();
            if self.groups.len() == 1 && cacheable == 1 && self.groups[0].block_size != hash {
                return invalid(format!(
                    "a single group caches at its own block size {} but hash_block_size is {hash}",
                    self.groups[0].block_size
                ));
            }
            for (i, g) in self.groups.iter().enumerate() {
                if matches!(g.kind, AttentionKind::ChunkedLocal { .. }) && g.block_size != scheduler
                {
                    return invalid(format!(
                        "KV cache group {i}: chunked local attention with prefix caching needs \
                         its block size ({}) to equal scheduler_block_size ({scheduler})",
                        g.block_size
                    ));
                }
            }
        }
        Ok((scheduler, hash))
    }
}

pub(crate) fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b)
}
