//! KV cache group specs and the manager's configuration.

use crate::error::{bad_config, Result};
use crate::hashing::HashAlgo;
use crate::types::MAX_BLOCKS;

/// How a Mamba group keeps its states (vLLM's `mamba_cache_mode`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MambaMode {
    /// One running state per request (plus speculative blocks); no prefix caching.
    None,
    /// States at block-aligned positions are kept and prefix-cached (vLLM's default with
    /// prefix caching on).
    Align,
}

/// The attention type of a KV cache group: decides how many blocks a request holds in the
/// group and which prefix of a prompt counts as a cache hit. The variants are vLLM 0.33's
/// single-type managers.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every token needs a slot; a hit needs every block of the prefix cached.
    Full,
    /// Full attention in the MLA cache format (same rules; reported as `mla_attention`).
    Mla,
    /// Reference sliding window (vLLM's `RSWASpec`): full attention over the prompt, and only
    /// the last `window` generated tokens; blocks between the prompt and that window are freed.
    Rswa { window: usize },
    /// Only the last `window` tokens are attended; blocks that fall out of the window are
    /// freed (replaced by the null block), and a hit needs only the blocks covering the last
    /// `window - 1` tokens before the hit point.
    SlidingWindow { window: usize },
    /// Sliding window in the MLA cache format; with `bounded_replay` its blocks are not
    /// prefix-cached.
    SlidingWindowMla { window: usize, bounded_replay: bool },
    /// Llama-4 style local attention over fixed chunks of `chunk` tokens: blocks before the
    /// current chunk are not needed.
    ChunkedLocal { chunk: usize },
    /// Recurrent state. `None` mode keeps one state block (plus `speculative_blocks`);
    /// `Align` mode keeps the state at block-aligned positions and prefix-caches them.
    ///
    /// `prefill_checkpoint_alignment` > 0 (vLLM's `num_prefill_checkpoint_blocks` > 0 with a
    /// `prefill_checkpoint_alignment`, as its Mamba-2 mixer declares): in align mode the
    /// worker exports the state at the prompt's checkpoint from inside a longer final chunk,
    /// into one more block the chunk reserves. 0: no such exports.
    Mamba {
        mode: MambaMode,
        speculative_blocks: usize,
        prefill_checkpoint_alignment: usize,
    },
    /// One block per request for its whole life (vLLM's `CircularBufferSpec`); never cached.
    CircularBuffer,
}

/// The parameters a kind may take, as a binding reads them (each optional).
#[derive(Clone, Debug, Default)]
pub struct KindParams {
    pub sliding_window: Option<usize>,
    pub attention_chunk_size: Option<usize>,
    pub rswa_window: Option<usize>,
    pub bounded_replay: Option<bool>,
    /// `"align"` or `"none"`; `None`: align with prefix caching on, none with it off.
    pub mamba_cache_mode: Option<String>,
    pub num_speculative_blocks: Option<usize>,
    /// vLLM's `num_prefill_checkpoint_blocks` (0 or 1) and `prefill_checkpoint_alignment`.
    pub num_prefill_checkpoint_blocks: Option<usize>,
    pub prefill_checkpoint_alignment: Option<usize>,
}

impl AttentionKind {
    /// The kind names a binding accepts (vLLM's spec-kind names and short forms).
    pub const NAMES: &'static str = "full, mla, rswa, sliding_window, sliding_window_mla, \
                                     chunked_local, mamba or circular_buffer";

    /// The kind named `name` with its parameters; `enable_caching` picks the default Mamba
    /// mode.
    pub fn parse(name: &str, params: &KindParams, enable_caching: bool) -> Result<Self> {
        let need = |value: Option<usize>, what: &str| {
            value.ok_or_else(|| {
                crate::error::CoreError::InvalidConfig(format!("missing {what} for kind {name:?}"))
            })
        };
        Ok(match name {
            "full" | "full_attention" => AttentionKind::Full,
            "mla" | "mla_attention" => AttentionKind::Mla,
            "rswa" | "reference_sliding_window" => AttentionKind::Rswa {
                window: need(params.rswa_window, "rswa_window")?,
            },
            "sliding_window" => AttentionKind::SlidingWindow {
                window: need(params.sliding_window, "sliding_window")?,
            },
            "sliding_window_mla" => AttentionKind::SlidingWindowMla {
                window: need(params.sliding_window, "sliding_window")?,
                bounded_replay: params.bounded_replay.unwrap_or(false),
            },
            "chunked_local" | "chunked_local_attention" => AttentionKind::ChunkedLocal {
                chunk: need(params.attention_chunk_size, "attention_chunk_size")?,
            },
            "mamba" => {
                let mode = match params.mamba_cache_mode.as_deref() {
                    Some("align") => MambaMode::Align,
                    Some("none") => MambaMode::None,
                    None if enable_caching => MambaMode::Align,
                    None => MambaMode::None,
                    Some(other) => {
                        return bad_config(format!(
                            "unknown mamba_cache_mode {other:?} (expected 'align' or 'none')"
                        ))
                    }
                };
                let checkpoint_blocks = params.num_prefill_checkpoint_blocks.unwrap_or(0);
                if checkpoint_blocks > 1 {
                    return bad_config(format!(
                        "num_prefill_checkpoint_blocks {checkpoint_blocks} (vLLM 0.33 reserves \
                         at most 1)"
                    ));
                }
                let alignment = params.prefill_checkpoint_alignment;
                if alignment == Some(0) {
                    return bad_config("prefill_checkpoint_alignment must be positive");
                }
                // Without an alignment vLLM never finds a checkpoint it can export (and none
                // mode never exports one): the same as declaring no checkpoint block.
                let prefill_checkpoint_alignment = match (mode, checkpoint_blocks) {
                    (MambaMode::Align, 1) => alignment.unwrap_or(0),
                    _ => 0,
                };
                AttentionKind::Mamba {
                    mode,
                    // Bounded by `GroupSpec::validate`, as for every constructor.
                    speculative_blocks: params.num_speculative_blocks.unwrap_or(0),
                    prefill_checkpoint_alignment,
                }
            }
            "circular_buffer" => AttentionKind::CircularBuffer,
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
            AttentionKind::Full | AttentionKind::Rswa { .. } => "full_attention",
            AttentionKind::Mla => "mla_attention",
            AttentionKind::SlidingWindow { .. } => "sliding_window",
            AttentionKind::SlidingWindowMla { .. } => "sliding_window_mla",
            AttentionKind::ChunkedLocal { .. } => "chunked_local_attention",
            AttentionKind::Mamba { .. } => "mamba",
            AttentionKind::CircularBuffer => "unknown",
        }
    }

    /// The sliding window in tokens, for sliding-window kinds (as vLLM's events report it).
    pub fn sliding_window(&self) -> Option<usize> {
        match self {
            AttentionKind::SlidingWindow { window }
            | AttentionKind::SlidingWindowMla { window, .. } => Some(*window),
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
    pub fn new(kind: AttentionKind, block_size: usize) -> Self {
        GroupSpec { kind, block_size }
    }

    pub fn full(block_size: usize) -> Self {
        Self::new(AttentionKind::Full, block_size)
    }

    pub fn sliding_window(block_size: usize, window: usize) -> Self {
        Self::new(AttentionKind::SlidingWindow { window }, block_size)
    }

    pub fn chunked_local(block_size: usize, chunk: usize) -> Self {
        Self::new(AttentionKind::ChunkedLocal { chunk }, block_size)
    }

    /// A Mamba group in align mode (prefix-cached states), vLLM's default with caching on.
    pub fn mamba(block_size: usize) -> Self {
        Self::mamba_with(block_size, MambaMode::Align, 0)
    }

    /// A Mamba group in none mode: one state block per request (no prefix caching).
    pub fn mamba_none(block_size: usize) -> Self {
        Self::mamba_with(block_size, MambaMode::None, 0)
    }

    pub fn mamba_with(block_size: usize, mode: MambaMode, speculative_blocks: usize) -> Self {
        Self::new(
            AttentionKind::Mamba {
                mode,
                speculative_blocks,
                prefill_checkpoint_alignment: 0,
            },
            block_size,
        )
    }

    /// An align-mode Mamba group whose worker exports prefill checkpoints (vLLM 0.33's
    /// Mamba-2 mixer: one checkpoint block, alignment 1).
    pub fn mamba_with_checkpoints(block_size: usize, alignment: usize) -> Self {
        Self::new(
            AttentionKind::Mamba {
                mode: MambaMode::Align,
                speculative_blocks: 0,
                prefill_checkpoint_alignment: alignment,
            },
            block_size,
        )
    }

    /// The alignment of prefill checkpoint exports (0: the group has none).
    pub fn prefill_checkpoint_alignment(&self) -> usize {
        match self.kind {
            AttentionKind::Mamba {
                prefill_checkpoint_alignment,
                ..
            } => prefill_checkpoint_alignment,
            _ => 0,
        }
    }

    /// Full-attention based (vLLM's `FullAttentionSpec` and subclasses): left-to-right hits,
    /// looked up first by the hybrid coordinator.
    pub fn is_full(&self) -> bool {
        matches!(
            self.kind,
            AttentionKind::Full | AttentionKind::Mla | AttentionKind::Rswa { .. }
        )
    }

    pub fn is_mamba(&self) -> bool {
        matches!(self.kind, AttentionKind::Mamba { .. })
    }

    pub fn is_mamba_align(&self) -> bool {
        matches!(
            self.kind,
            AttentionKind::Mamba {
                mode: MambaMode::Align,
                ..
            }
        )
    }

    pub fn is_sliding_window(&self) -> bool {
        matches!(
            self.kind,
            AttentionKind::SlidingWindow { .. } | AttentionKind::SlidingWindowMla { .. }
        )
    }

    /// Attention layers (vLLM's `AttentionSpec`): their new blocks are zeroed by the worker
    /// when the layout needs it (circular buffers excepted).
    pub fn zeroes_new_blocks(&self) -> bool {
        !matches!(
            self.kind,
            AttentionKind::Mamba { .. } | AttentionKind::CircularBuffer
        )
    }

    /// Whether the group's blocks enter the prefix cache.
    pub fn prefix_cacheable(&self) -> bool {
        !matches!(
            self.kind,
            AttentionKind::CircularBuffer
                | AttentionKind::SlidingWindowMla {
                    bounded_replay: true,
                    ..
                }
        )
    }

    /// Leading tokens whose KV is no longer needed once `num_computed_tokens` are computed
    /// (vLLM's `get_num_skipped_tokens`); `extra_retained` tokens below a sliding window are
    /// kept (multi-token prediction re-prefills them).
    pub fn skipped_tokens(&self, num_computed_tokens: usize, extra_retained: usize) -> usize {
        match self.kind {
            AttentionKind::Full
            | AttentionKind::Mla
            | AttentionKind::Rswa { .. }
            | AttentionKind::CircularBuffer => 0,
            // Saturating: a count or window near `usize::MAX` skips as if it were there.
            AttentionKind::SlidingWindow { window }
            | AttentionKind::SlidingWindowMla { window, .. } => num_computed_tokens
                .saturating_add(1)
                .saturating_sub(window.saturating_add(extra_retained)),
            // A chunk of 0 (which `validate` rejects) skips nothing.
            AttentionKind::ChunkedLocal { chunk } => num_computed_tokens
                .checked_div(chunk)
                .map_or(0, |chunks| chunks * chunk),
            AttentionKind::Mamba { .. } => num_computed_tokens.saturating_sub(1),
        }
    }

    /// Contiguous cached blocks a sliding-window hit needs: `cdiv(window - 1, block_size)`, one
    /// more when the EAGLE drop applies.
    pub(crate) fn sliding_window_contiguous_blocks(&self, use_eagle: bool) -> usize {
        match self.kind.sliding_window() {
            Some(window) => window.saturating_sub(1).div_ceil(self.block_size) + use_eagle as usize,
            None => 0,
        }
    }

    /// vLLM's `max_admission_blocks_per_request`: the blocks a request can hold at once in a
    /// group that recycles blocks (sliding window, chunked local); `None` for the others.
    pub fn max_admission_blocks(
        &self,
        max_in_flight_tokens: usize,
        max_model_len: usize,
        extra_retained: usize,
    ) -> Option<usize> {
        let bs = self.block_size;
        match self.kind {
            AttentionKind::SlidingWindow { window }
            | AttentionKind::SlidingWindowMla { window, .. } => {
                let tokens = window
                    .saturating_sub(1)
                    .saturating_add(extra_retained)
                    .saturating_add(max_in_flight_tokens)
                    .min(max_model_len);
                Some(tokens.div_ceil(bs).saturating_add(1))
            }
            AttentionKind::ChunkedLocal { chunk } => Some(
                chunk
                    .saturating_add(max_in_flight_tokens)
                    .min(max_model_len)
                    .div_ceil(bs),
            ),
            _ => None,
        }
    }

    fn validate(&self, index: usize) -> Result<()> {
        let bad = |what: String| bad_config(format!("KV cache group {index}: {what}"));
        if self.block_size == 0 {
            return bad("block_size must be positive".into());
        }
        match self.kind {
            AttentionKind::SlidingWindow { window: 0 }
            | AttentionKind::SlidingWindowMla { window: 0, .. }
            | AttentionKind::Rswa { window: 0 } => bad("the window must be positive".into()),
            AttentionKind::ChunkedLocal { chunk: 0 } => {
                bad("attention chunk size must be positive".into())
            }
            // More than any pool holds; larger counts would overflow block arithmetic.
            AttentionKind::Mamba {
                speculative_blocks, ..
            } if speculative_blocks > MAX_BLOCKS => bad(format!(
                "num_speculative_blocks {speculative_blocks} is more than a pool can hold \
                 ({MAX_BLOCKS})"
            )),
            _ => Ok(()),
        }
    }
}

/// Everything the manager needs to know at construction (vLLM's `KVCacheManager` arguments).
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// The KV cache groups, in group-id order (none for an attention-free model).
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
    /// vLLM's `prefix_cache_retention_interval`: `Some(0)` (vLLM's default) keeps only the
    /// checkpoint blocks of sliding-window and Mamba groups (the latest replay boundary of each
    /// prompt and shared-prefix junctions); `None` is dense (every full block of every group
    /// stays cached); `Some(n)` also keeps one checkpoint per `n` tokens.
    pub retention_interval: Option<usize>,
    /// EAGLE-style speculative decoding: hits drop their last block in the EAGLE groups
    /// (vLLM's manager `use_eagle`, which its scheduler clears when drafters hash lookahead
    /// tokens instead).
    pub use_eagle: bool,
    /// The groups holding draft layers (vLLM's `is_eagle_group`); `None` or empty: every group
    /// when `use_eagle`.
    pub eagle_groups: Option<Vec<usize>>,
    /// Tokens past a block its hash also covers (drafters that prove the boundary token).
    pub num_hash_lookahead_tokens: usize,
    /// Multi-token prediction: the last `num_prefill_lookahead - 1` tokens may be re-prefilled,
    /// so they are not cached and sliding windows keep them.
    pub num_prefill_lookahead: usize,
    /// vLLM's `enable_mamba_shared_prefix_checkpoint`: Mamba groups also key the state at a
    /// request's shared-prefix junction. Acts only with EAGLE groups, fine-grained partial
    /// hash hits and no multi-token re-prefill (see
    /// [`ManagerConfig::mamba_shared_prefix_checkpoint`]).
    pub enable_mamba_shared_prefix_checkpoint: bool,
    /// Whether the worker zeroes newly allocated attention blocks (vLLM's
    /// `KVCacheConfig.needs_kv_cache_zeroing`: a layout with Mamba layers, or a cache of more
    /// than one precision), so the manager records them (`take_new_block_ids`). `None`: when
    /// a group is a Mamba group (the groups do not say their precision).
    pub needs_kv_cache_zeroing: Option<bool>,
}

impl ManagerConfig {
    /// Caching on, events off, default hashing, vLLM's default retention.
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
            retention_interval: Some(0),
            use_eagle: false,
            eagle_groups: None,
            num_hash_lookahead_tokens: 0,
            num_prefill_lookahead: 0,
            enable_mamba_shared_prefix_checkpoint: false,
            needs_kv_cache_zeroing: None,
        }
    }

    /// The same config in dense retention.
    pub fn dense(mut self) -> Self {
        self.retention_interval = None;
        self
    }

    /// Whether the hybrid coordinator serves fine-grained partial hash hits with hashes at
    /// `hash_block_size` (vLLM's `partial_hash_hits_enabled` with the manager classes): some
    /// align-mode Mamba group's block is larger than the hash block, and every other
    /// prefix-cacheable group either looks up at hash granularity (full attention and its
    /// variants, Mamba) or has blocks of the hash block size. Hits then land on hash block
    /// boundaries, inside blocks.
    pub(crate) fn partial_hash_hits(&self, hash_block_size: usize) -> bool {
        if !self.enable_caching || self.groups.len() < 2 {
            return false;
        }
        let mamba = self
            .groups
            .iter()
            .any(|g| g.is_mamba_align() && g.block_size > hash_block_size);
        mamba
            && self.groups.iter().all(|g| {
                !g.prefix_cacheable()
                    || g.is_full()
                    || g.is_mamba()
                    || g.block_size == hash_block_size
            })
    }

    /// Whether Mamba groups key the state at shared-prefix junctions (vLLM's manager
    /// `mamba_shared_prefix_checkpoint`): the option, with EAGLE groups, partial hash hits and
    /// nothing re-prefilled.
    pub(crate) fn mamba_shared_prefix_checkpoint(&self, hash_block_size: usize) -> bool {
        let eagle_groups =
            self.use_eagle || self.eagle_groups.as_ref().is_some_and(|g| !g.is_empty());
        self.enable_mamba_shared_prefix_checkpoint
            && eagle_groups
            && self.partial_hash_hits(hash_block_size)
            && self.extra_retained_tokens() == 0
    }

    /// Tokens below a sliding window that are kept (vLLM's `extra_retained_tokens`).
    pub(crate) fn extra_retained_tokens(&self) -> usize {
        self.num_prefill_lookahead.saturating_sub(1)
    }

    /// Checks the config and resolves `(scheduler_block_size, hash_block_size)`.
    pub(crate) fn resolve_block_sizes(&self) -> Result<(usize, usize)> {
        let invalid = |msg: String| bad_config(msg);
        if self.max_model_len == 0 {
            return invalid("max_model_len must be positive".into());
        }
        if !(0.0..=1.0).contains(&self.watermark) {
            return invalid(format!("watermark {} must be in [0, 1]", self.watermark));
        }
        for (i, g) in self.groups.iter().enumerate() {
            g.validate(i)?;
            if self.enable_caching
                && matches!(
                    g.kind,
                    AttentionKind::Mamba {
                        mode: MambaMode::None,
                        ..
                    }
                )
            {
                return invalid(format!(
                    "KV cache group {i}: Mamba prefix caching requires mamba_cache_mode 'align' \
                     (or prefix caching off)"
                ));
            }
        }
        if let Some(eagle) = &self.eagle_groups {
            if let Some(&g) = eagle.iter().find(|&&g| g >= self.groups.len()) {
                return invalid(format!(
                    "eagle group {g} out of range ({} groups)",
                    self.groups.len()
                ));
            }
        }
        if !self.groups.is_empty() && self.num_blocks < 2 {
            return Err(crate::error::CoreError::PoolTooSmall(self.num_blocks));
        }
        if self.groups.is_empty() {
            // An attention-free model: no blocks to manage but the null block.
            let bs = self.scheduler_block_size.unwrap_or(16).max(1);
            return Ok((bs, self.hash_block_size.unwrap_or(bs).max(1)));
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
        // A Mamba group outside align mode breaks the divisibility of finer hashes: vLLM then
        // hashes at the scheduler block size.
        let any_mamba_none = self
            .groups
            .iter()
            .any(|g| g.is_mamba() && !g.is_mamba_align());
        let cacheable_gcd = self
            .groups
            .iter()
            .filter(|g| g.prefix_cacheable())
            .fold(0usize, |acc, g| gcd(acc, g.block_size));
        let hash = self.hash_block_size.unwrap_or(
            if cacheable_gcd == 0 || any_mamba_none || !self.enable_caching {
                scheduler
            } else {
                cacheable_gcd
            },
        );
        if hash == 0 || scheduler % hash != 0 {
            return invalid(format!(
                "hash_block_size {hash} must divide scheduler_block_size {scheduler}"
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if self.enable_caching && g.prefix_cacheable() && g.block_size % hash != 0 {
                return invalid(format!(
                    "KV cache group {i}: block_size {} is not a multiple of hash_block_size {hash}",
                    g.block_size
                ));
            }
        }
        if self.enable_caching {
            let cacheable = self.groups.iter().filter(|g| g.prefix_cacheable()).count();
            if cacheable == 0 && self.groups.len() > 1 {
                return invalid(
                    "prefix caching needs at least one prefix-cacheable KV cache group".into(),
                );
            }
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
        if let Some(interval) = self.retention_interval {
            let sparse = self
                .groups
                .iter()
                .any(|g| g.is_sliding_window() || g.is_mamba());
            if !sparse && interval != 0 {
                // vLLM refuses it too: retention only thins the checkpoints of sliding-window
                // and Mamba groups; other kinds cache every full block (or nothing) regardless.
                let mut kinds: Vec<&str> = Vec::new();
                for g in &self.groups {
                    if !kinds.contains(&g.kind.as_str()) {
                        kinds.push(g.kind.as_str());
                    }
                }
                return invalid(format!(
                    "prefix_cache_retention_interval {interval} has no effect: retention only \
                     thins the cached checkpoints of sliding-window and Mamba groups, and this \
                     layout's groups ({}) are neither; use 0 or None",
                    kinds.join(", ")
                ));
            }
            if interval % scheduler != 0 {
                return invalid(format!(
                    "prefix_cache_retention_interval {interval} must be a multiple of \
                     scheduler_block_size {scheduler}"
                ));
            }
        }
        let has_eagle_groups =
            self.use_eagle || self.eagle_groups.as_ref().is_some_and(|g| !g.is_empty());
        if self.enable_caching && has_eagle_groups && scheduler < self.num_prefill_lookahead {
            return invalid(format!(
                "multi-token prediction with prefix caching needs scheduler_block_size \
                 ({scheduler}) >= num_prefill_lookahead ({})",
                self.num_prefill_lookahead
            ));
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
