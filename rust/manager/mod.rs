//! The scheduler-facing KV cache manager: request state, per-attention-type block tables and
//! the prefix-cache coordinator over one shared [`BlockPool`], with vLLM 0.33's semantics in
//! dense retention mode (every full block of every group stays cached until evicted).
//!
//! Layers (as in vLLM): [`KVCacheManager`] (what a scheduler calls: the public API and the
//! validation of its arguments, here) → [`Coordinator`] (the loops over KV cache groups and the
//! hit search across them) → one set of single-type rules per group (`single_type`: allocation
//! and hit rules of full attention, sliding window, chunked local attention, Mamba).
//! [`registry`] runs the registration protocol of caller-owned request objects (the Python
//! binding's), [`slots`] keeps the requests.
//!
//! The pool and the coordinator are shared through `Arc`s; [`Prober`] answers "how much of this
//! prompt is cached" from other threads while the scheduler mutates the manager.

mod coordinator;
pub mod registry;
mod request;
mod single_type;
mod slots;
mod spec;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bad_input;
#[cfg(test)]
mod tests_defaults;
#[cfg(test)]
mod tests_partial;
#[cfg(test)]
mod tests_supplied;

pub use coordinator::{Coordinator, CoordinatorKind};
pub use request::Request;
pub(crate) use single_type::{checkpoint_exportable, mamba_checkpoint_position};
pub use slots::{RequestHandle, RequestKey};
pub use spec::{AttentionKind, GroupSpec, KindParams, MambaMode, ManagerConfig};

use crate::error::{invalid, CoreError, HitLoss, Result};
use crate::hashing::{BlockHasher, ExtraKeys, TokenId};
use crate::pool::BlockPool;
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, KvEvent, NULL_BLOCK};
use coordinator::RunningStep;
use single_type::{Allocation, Effects, GroupTable};
use slots::Slots;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// A prefix-cache hit as returned by [`KVCacheManager::get_computed_blocks`]; pass it back to
/// [`KVCacheManager::allocate_slots`] unchanged. Its blocks are read-only: a hit made otherwise
/// ([`ComputedBlocks::new`]) is checked block by block against the prompt when adopted, one the
/// manager found for the same request is not while no key has left a block since. Two hits are
/// equal when their blocks and lengths are (whichever manager made them).
#[derive(Clone, Debug, Default)]
pub struct ComputedBlocks {
    /// Per group, the hit blocks (null blocks where the group needs none).
    pub(crate) blocks: Vec<Vec<BlockId>>,
    /// Tokens covered by the hit.
    pub num_computed_tokens: usize,
    /// vLLM's `shared_prefix_boundary`: 0, or the longer prefix some group alone had cached.
    pub shared_prefix_boundary: usize,
    /// The id of the manager whose `get_computed_blocks` made it (0: made elsewhere).
    pub(crate) origin: u64,
    /// That manager's allocation count then: blocks can only have been evicted since if it moved.
    pub(crate) epoch: u64,
    /// The request it was found for and the pool's key removals before the lookup, when it is
    /// `get_computed_blocks`' result unchanged (`None` otherwise): while neither has moved,
    /// every block of it still carries the key it was found under.
    pub(crate) found: Option<Found>,
}

/// What makes a hit [`ComputedBlocks::found`] for: the request's serial and the pool's
/// [`BlockPool::key_removals`](crate::pool::BlockPool::key_removals) read before the lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    request: u64,
    key_removals: u64,
}

impl PartialEq for ComputedBlocks {
    fn eq(&self, other: &Self) -> bool {
        self.blocks == other.blocks
            && self.num_computed_tokens == other.num_computed_tokens
            && self.shared_prefix_boundary == other.shared_prefix_boundary
    }
}

impl Eq for ComputedBlocks {}

impl ComputedBlocks {
    /// A hit made by the caller (not by `get_computed_blocks`): checked block by block.
    pub fn new(blocks: Vec<Vec<BlockId>>, num_computed_tokens: usize) -> Self {
        ComputedBlocks {
            blocks,
            num_computed_tokens,
            ..ComputedBlocks::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(Vec::is_empty)
    }

    /// Per group, the hit blocks (null blocks where the group needs none).
    pub fn blocks(&self) -> &[Vec<BlockId>] {
        &self.blocks
    }

    /// The hit blocks, per group.
    pub fn into_blocks(self) -> Vec<Vec<BlockId>> {
        self.blocks
    }
}

/// Arguments of [`KVCacheManager::allocate_slots`] (vLLM's keyword arguments).
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocateArgs<'a> {
    /// Tokens to compute in this step.
    pub num_new_tokens: usize,
    /// The request's computed tokens before this call (the scheduler's count).
    pub num_computed_tokens: usize,
    /// Tokens newly covered by `new_computed_blocks` (the hit of `get_computed_blocks`).
    pub num_new_computed_tokens: usize,
    pub new_computed_blocks: Option<&'a ComputedBlocks>,
    /// Speculative tokens: they get slots but are never cached.
    pub num_lookahead_tokens: usize,
    /// Tokens scheduled but not yet processed (async scheduling); out-of-window blocks are
    /// freed on the processed-token basis.
    pub num_in_flight_tokens: usize,
    /// Skip caching the new full blocks in this call.
    pub delay_cache_blocks: bool,
    /// Admission: also fail unless the whole sequence would fit now (recycling-aware caps for
    /// sliding-window and chunked-local groups).
    pub full_sequence_must_fit: bool,
    /// Other requests are scheduled in this step: a waiting request must then leave the
    /// watermark free (vLLM's default is `true`; irrelevant with a zero watermark).
    pub has_scheduled_reqs: bool,
    /// Tokens a KV connector supplies after the local hit (their blocks are allocated, not
    /// hit).
    pub num_external_computed_tokens: usize,
    /// Free blocks the allocation must leave for other in-flight sequences.
    pub reserved_blocks: usize,
    /// Groups whose external-token blocks an asynchronous load writes (not to be zeroed).
    pub skip_zeroing_group_ids: &'a [usize],
}

impl AllocateArgs<'_> {
    /// Whether the call has the shape a [`RunningHorizon`] speaks of (a running request's
    /// step): no hit to adopt, no external tokens, no delayed caching, no full-sequence check,
    /// no reserved blocks, other requests scheduled and no groups left unzeroed; only the
    /// counts and the lookahead tokens may be anything.
    pub fn is_running_step(&self) -> bool {
        self.new_computed_blocks.is_none()
            && self.num_new_computed_tokens == 0
            && self.num_external_computed_tokens == 0
            && !self.delay_cache_blocks
            && !self.full_sequence_must_fit
            && self.reserved_blocks == 0
            && self.has_scheduled_reqs
            && self.skip_zeroing_group_ids.is_empty()
    }
}

/// How far a running request's next `allocate_slots` calls can go without changing anything
/// (see [`KVCacheManager::running_horizon`]).
///
/// A call with `n` new tokens, `k` lookahead tokens, `c` computed and `f` in flight, that adopts
/// no hit and has no external tokens, no delayed caching, no full-sequence admission check and
/// no reserved blocks, takes no block, frees none, caches none and returns no new blocks when
/// `c + n + k <= slots`, `c + n < cache` and `c - f < removal`, as long as no other call
/// changed the request's blocks since the horizon was read. Its argument checks still apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunningHorizon {
    /// Slots the request's blocks cover in every group, at most `max_model_len`.
    pub slots: usize,
    /// The fewest tokens to cache at which a group would cache another block
    /// (`usize::MAX`: caching is off).
    pub cache: usize,
    /// The fewest processed tokens at which a group would free a block that left its window
    /// or chunk (`usize::MAX`: none will).
    pub removal: usize,
}

impl RunningHorizon {
    /// Whether a running step of `num_new_tokens` (at least 1) and `num_lookahead_tokens`, with
    /// `computed` tokens computed and `in_flight` of them not yet processed, of a request that
    /// holds `num_tokens` known tokens, lies inside the horizon and passes the call's argument
    /// checks (see the type's docs).
    pub fn admits(
        &self,
        computed: usize,
        in_flight: usize,
        num_tokens: usize,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> bool {
        let Some(end) = computed.checked_add(num_new_tokens) else {
            return false;
        };
        num_new_tokens > 0
            && end
                .checked_add(num_lookahead_tokens)
                .is_some_and(|slots| slots <= self.slots)
            && end < self.cache
            && in_flight <= computed
            && computed - in_flight < self.removal
            && computed - in_flight <= num_tokens
    }
}

/// Prefix-cache hit statistics (vLLM's `PrefixCacheStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub requests: u64,
    pub queries: u64,
    pub hits: u64,
    pub preempted_requests: u64,
    pub preempted_queries: u64,
    pub preempted_hits: u64,
    /// Set when the prefix cache was reset since the stats were last taken.
    pub reset: bool,
}

impl PrefixCacheStats {
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

#[derive(Debug)]
struct RequestState {
    request: Request,
    /// Unique among the manager's requests, past and present (hits name it).
    serial: u64,
    tables: Vec<GroupTable>,
    /// The shared-prefix junction its last `get_computed_blocks` found (vLLM's
    /// `request.shared_prefix_boundary`, set by its scheduler from that call).
    shared_prefix_boundary: usize,
}

impl RequestState {
    /// Whether the request holds blocks or adopted a hit (a running request).
    fn is_tracked(&self) -> bool {
        self.tables
            .iter()
            .any(|t| t.num_cached.is_some() || !t.blocks.is_empty())
    }
}

/// A cheap, cloneable, `Send + Sync` handle answering how many tokens of a prompt are cached
/// right now, safe to call from any thread while the scheduler mutates the manager.
#[derive(Clone)]
pub struct Prober {
    pool: Arc<BlockPool>,
    coordinator: Arc<Coordinator>,
    hasher: BlockHasher,
}

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prober")
            .field("num_blocks", &self.pool.num_blocks())
            .field("coordinator", &self.coordinator)
            .finish_non_exhaustive()
    }
}

impl Prober {
    /// Tokens of `prompt` that `get_computed_blocks` would report as cached now (at most
    /// `prompt.len() - 1`: the last token is always recomputed). Token ids outside `0..2^32`
    /// are an error.
    pub fn probe<T: TokenId>(&self, prompt: &[T], extra: &ExtraKeys) -> Result<usize> {
        self.probe_with_max(prompt, extra, prompt.len().saturating_sub(1))
    }

    /// [`Prober::probe`] with an explicit cap on the hit length (clamped to the prompt).
    pub fn probe_with_max<T: TokenId>(
        &self,
        prompt: &[T],
        extra: &ExtraKeys,
        max_len: usize,
    ) -> Result<usize> {
        crate::hashing::check_tokens(prompt)?;
        let mut hashes = Vec::new();
        self.hasher
            .hash_blocks(None, prompt, 0, extra, &mut hashes)?;
        let mut out = Vec::new();
        let hit = self
            .coordinator
            .find(&self.pool, &hashes, max_len.min(prompt.len()), &mut out);
        Ok(hit.tokens.min(prompt.len()))
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }
}

/// The KV cache manager a scheduler drives: `add_request`, then per step
/// `get_computed_blocks` / `allocate_slots` / `append_token_ids`, and `free` /
/// `remove_request` at the end. Methods that change state take `&mut self`; the pool and the
/// coordinator are shared (`Arc`) with [`Prober`]s.
pub struct KVCacheManager {
    id: u64,
    pool: Arc<BlockPool>,
    coordinator: Arc<Coordinator>,
    hasher: BlockHasher,
    max_model_len: usize,
    watermark_blocks: usize,
    enable_caching: bool,
    scheduler_block_size: usize,
    hash_block_size: usize,
    requests: Slots<RequestState>,
    /// Side effects collected across calls (Mamba's step keys, blocks to zero, offloads).
    effects: Effects,
    /// Successful allocations and cache resets so far (only these evict cached blocks).
    epoch: u64,
    /// The `epoch` the last successful `reset_prefix_cache` moved to (0: none yet).
    reset_epoch: u64,
    /// The serial of the request registered last.
    next_serial: u64,
    stats: PrefixCacheStats,
    /// Blocks handed out as retained (by [`KVCacheManager::take_kv_cache_block_copies`] and
    /// [`KVCacheManager::pop_blocks_for_free`]) and not released yet, with how many of their
    /// references are retained: each holds one reference until
    /// [`KVCacheManager::free_retained_blocks`] drops it.
    retained: HashMap<BlockId, u32>,
    scratch: Vec<BlockId>,
    /// What `allocate_slots` may change in each table, to undo a failed allocation (kept
    /// between calls for its buffers).
    marks: Vec<single_type::TableMark>,
    /// Tests: take the general allocation path even for running requests.
    #[cfg(test)]
    general_path_only: bool,
    /// Tests: fail `allocate_slots` once it has taken its blocks, before it caches them.
    #[cfg(test)]
    fail_after_allocation: bool,
}

/// The longest hit a lookup for `request` may return: `max_cache_hit_length`, by default all
/// but the last token. A cap beyond the request's tokens is the request's tokens: no hit is
/// longer (and a chunked-local group's hit would otherwise pad past them).
fn hit_cap(request: &Request, max_cache_hit_length: Option<usize>) -> usize {
    max_cache_hit_length
        .unwrap_or_else(|| request.num_tokens().saturating_sub(1))
        .min(request.num_tokens())
}

impl std::fmt::Debug for KVCacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KVCacheManager")
            .field("num_blocks", &self.pool.num_blocks())
            .field("num_free_blocks", &self.pool.num_free_blocks())
            .field("groups", &self.group_specs())
            .field("coordinator", &self.coordinator.kind())
            .field("num_requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl KVCacheManager {
    pub fn new(config: &ManagerConfig) -> Result<Self> {
        let (scheduler_block_size, hash_block_size) = config.resolve_block_sizes()?;
        let pool = Arc::new(BlockPool::with_options(
            config.num_blocks,
            config.enable_caching,
            config.enable_events,
        )?);
        let hasher = BlockHasher::new(hash_block_size, config.hash_algo, &config.hash_seed)?
            .with_lookahead(config.num_hash_lookahead_tokens)?;
        let coordinator = Arc::new(Coordinator::new(
            config,
            scheduler_block_size,
            hash_block_size,
        )?);
        Ok(KVCacheManager {
            id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
            pool,
            coordinator,
            hasher,
            max_model_len: config.max_model_len,
            watermark_blocks: (config.watermark * config.num_blocks as f64) as usize,
            enable_caching: config.enable_caching,
            scheduler_block_size,
            hash_block_size,
            requests: Slots::default(),
            effects: Effects::default(),
            epoch: 0,
            reset_epoch: 0,
            next_serial: 0,
            stats: PrefixCacheStats::default(),
            retained: HashMap::new(),
            scratch: Vec::new(),
            marks: Vec::new(),
            #[cfg(test)]
            general_path_only: false,
            #[cfg(test)]
            fail_after_allocation: false,
        })
    }

    /// A process-unique id of this manager (stamped on the hits it hands out).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// A handle for concurrent read-only cache probes.
    pub fn prober(&self) -> Prober {
        Prober {
            pool: Arc::clone(&self.pool),
            coordinator: Arc::clone(&self.coordinator),
            hasher: self.hasher.clone(),
        }
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    pub fn num_groups(&self) -> usize {
        self.coordinator.num_groups()
    }

    pub fn group_specs(&self) -> Vec<GroupSpec> {
        self.coordinator.group_specs()
    }

    pub fn coordinator_kind(&self) -> CoordinatorKind {
        self.coordinator.kind()
    }

    pub fn scheduler_block_size(&self) -> usize {
        self.scheduler_block_size
    }

    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    // ----- requests ---------------------------------------------------------------------

    /// Registers a request with its prompt; hashes the prompt's full blocks.
    pub fn add_request<T: TokenId>(
        &mut self,
        request_id: &str,
        prompt: &[T],
        extra: ExtraKeys,
    ) -> Result<RequestHandle> {
        self.check_new_request(request_id, prompt.len())?;
        let request = Request::new(
            request_id.to_owned(),
            prompt,
            self.hasher.clone(),
            extra,
            self.pool.events_enabled(),
        )?;
        Ok(self.insert_request(request))
    }

    /// Registers a request whose block hashes the caller supplies (vLLM's `Request.block_hashes`,
    /// computed by its engine; keys longer than 128 bits are truncated by the caller), with its
    /// prompt: `hashes` holds at least the hashes of the prompt's full blocks (with the
    /// manager's lookahead tokens after them); any more are left for
    /// [`KVCacheManager::append_token_ids_with_hashes`]. The request's later tokens come with
    /// their hashes through that call. Nothing is registered on an error.
    pub fn add_request_with_hashes<T: TokenId>(
        &mut self,
        request_id: &str,
        prompt: &[T],
        hashes: &[crate::types::BlockHash],
        extra: ExtraKeys,
    ) -> Result<RequestHandle> {
        self.check_new_request(request_id, prompt.len())?;
        let mut request = Request::new(
            request_id.to_owned(),
            prompt,
            self.supplied_hasher()?,
            extra,
            self.pool.events_enabled(),
        )?;
        request.supply_hashes(hashes)?;
        Ok(self.insert_request(request))
    }

    /// Registers a request from its prompt's hashes (made by `hasher`, or supplied with
    /// [`KVCacheManager::supplied_hasher`]) and tail tokens; `full` names the call that takes
    /// the prompt itself (which KV events need).
    pub(crate) fn insert_prehashed(
        &mut self,
        request_id: &str,
        num_prompt_tokens: usize,
        (hasher, hashes, tail): (BlockHasher, Vec<crate::types::BlockHash>, Vec<u32>),
        extra: ExtraKeys,
        full: &str,
    ) -> Result<RequestHandle> {
        self.check_new_request(request_id, num_prompt_tokens)?;
        if self.pool.events_enabled() {
            return invalid(format!(
                "request {request_id:?}: KV events need the prompt's token ids; use {full}"
            ));
        }
        let request = Request::from_prehashed(
            request_id.to_owned(),
            num_prompt_tokens,
            hasher,
            extra,
            hashes,
            tail,
        )?;
        Ok(self.insert_request(request))
    }

    /// The hasher of requests whose hashes the caller supplies: this manager's block size and
    /// lookahead, no hashing.
    pub fn supplied_hasher(&self) -> Result<BlockHasher> {
        BlockHasher::supplied(self.hasher.block_size(), self.hasher.lookahead())
    }

    /// Registers a request whose prompt the caller already hashed with this manager's hasher
    /// (see [`KVCacheManager::hasher`]): the `hashes` of its full blocks and the `tail` tokens
    /// after them. With KV events on, use [`KVCacheManager::add_request`] (events report the
    /// prompt's token ids).
    pub fn add_request_prehashed(
        &mut self,
        request_id: &str,
        num_prompt_tokens: usize,
        hashes: Vec<crate::types::BlockHash>,
        tail: Vec<u32>,
        extra: ExtraKeys,
    ) -> Result<RequestHandle> {
        let prehashed = (self.hasher.clone(), hashes, tail);
        self.insert_prehashed(
            request_id,
            num_prompt_tokens,
            prehashed,
            extra,
            "add_request",
        )
    }

    fn check_new_request(&self, request_id: &str, num_prompt_tokens: usize) -> Result<()> {
        if self.requests.contains(request_id) {
            return Err(CoreError::DuplicateRequest(request_id.to_owned()));
        }
        if num_prompt_tokens == 0 {
            return invalid(format!("request {request_id:?} has an empty prompt"));
        }
        Ok(())
    }

    fn insert_request(&mut self, request: Request) -> RequestHandle {
        self.next_serial += 1;
        let tables = vec![GroupTable::default(); self.num_groups()];
        let id = request.id().to_owned();
        self.requests.insert(
            id,
            RequestState {
                request,
                serial: self.next_serial,
                tables,
                shared_prefix_boundary: 0,
            },
        )
    }

    /// Starts loading the line of each of a request's tables that a running step reads (see
    /// [`GroupTable`]), so that the groups' loads overlap each other and the work before the
    /// step. A hint: nothing when the request is unknown.
    #[inline]
    pub(crate) fn prefetch_tables(&self, handle: RequestHandle) {
        if let Ok(state) = self.requests.get(handle.into()) {
            for table in &state.tables {
                crate::sync::prefetch(table);
            }
        }
    }

    /// The handle of a registered request (see [`RequestHandle`]).
    pub fn handle(&self, request_id: &str) -> Result<RequestHandle> {
        self.requests.handle(request_id)
    }

    /// The hasher of request block hashes (at `hash_block_size`).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Appends output tokens to a request (hashing the blocks they complete).
    pub fn append_token_ids<'a, T: TokenId>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        tokens: &[T],
    ) -> Result<()> {
        self.requests
            .get_mut(request.into())?
            .request
            .append(tokens)
    }

    /// Appends output tokens to a request whose hashes the caller supplies, with `hashes`, the
    /// hashes of every full block of the request so far (vLLM's `Request.block_hashes` after
    /// the tokens were appended); those it holds already are not read again. All or nothing:
    /// `hashes` must cover every block the tokens make hashable.
    pub fn append_token_ids_with_hashes<'a, T: TokenId>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        tokens: &[T],
        hashes: &[crate::types::BlockHash],
    ) -> Result<()> {
        self.requests
            .get_mut(request.into())?
            .request
            .append_with_hashes(tokens, hashes)
    }

    /// Frees the request's blocks (if any) and forgets it; returns its state.
    pub fn remove_request<'a>(&mut self, request: impl Into<RequestKey<'a>>) -> Result<Request> {
        let key = request.into();
        self.free(key)?;
        Ok(self.requests.remove(key, |s| s.request.id())?.request)
    }

    pub fn request<'a>(&self, request: impl Into<RequestKey<'a>>) -> Result<&Request> {
        Ok(&self.state(request)?.request)
    }

    pub fn contains_request(&self, request_id: &str) -> bool {
        self.requests.contains(request_id)
    }

    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    fn state<'a>(&self, request: impl Into<RequestKey<'a>>) -> Result<&RequestState> {
        self.requests.get(request.into())
    }

    // ----- scheduler API ----------------------------------------------------------------

    /// The request's cached prefix: per-group hit blocks and the hit length, at most
    /// `num_tokens - 1` tokens (the last token is recomputed for its logits). Reference counts
    /// are not touched: pass the result to `allocate_slots` before any other allocation.
    pub fn get_computed_blocks<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
    ) -> Result<ComputedBlocks> {
        self.get_computed_blocks_capped(request, None)
    }

    /// [`KVCacheManager::get_computed_blocks`] with vLLM's `max_cache_hit_length` (default
    /// `num_tokens - 1`). A request that skips reading the prefix cache (prompt logprobs) gets
    /// no hit. The request's shared-prefix boundary becomes the one found here, as vLLM's
    /// scheduler sets it from this call.
    pub fn get_computed_blocks_capped<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        max_cache_hit_length: Option<usize>,
    ) -> Result<ComputedBlocks> {
        let state = self.requests.get_mut(request.into())?;
        let mut blocks = Vec::new();
        if state.request.skip_reading_prefix_cache() {
            state.shared_prefix_boundary = 0;
            blocks.resize_with(self.coordinator.num_groups(), Vec::new);
            return Ok(ComputedBlocks {
                blocks,
                origin: self.id,
                epoch: self.epoch,
                ..ComputedBlocks::default()
            });
        }
        let max_len = hit_cap(&state.request, max_cache_hit_length);
        let found = Found {
            request: state.serial,
            key_removals: self.pool.key_removals(),
        };
        let hit = self.coordinator.find(
            &self.pool,
            state.request.block_hashes(),
            max_len,
            &mut blocks,
        );
        let shared_prefix_boundary = if hit.uncached_common > 0 {
            hit.tokens + hit.uncached_common
        } else {
            0
        };
        state.shared_prefix_boundary = shared_prefix_boundary;
        Ok(ComputedBlocks {
            blocks,
            num_computed_tokens: hit.tokens,
            shared_prefix_boundary,
            origin: self.id,
            epoch: self.epoch,
            found: Some(found),
        })
    }

    /// The local prefix-cache lookup for a request scheduled with a KV connector (vLLM's
    /// `get_computed_blocks_for_connector`): for a Mamba hybrid with a full-attention group,
    /// the full-attention hit, and whether a lagging group hit less (`hit_diverged`: the
    /// connector must then supply the state at the boundary); otherwise `get_computed_blocks`.
    pub fn get_computed_blocks_for_connector<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        max_cache_hit_length: Option<usize>,
    ) -> Result<(ComputedBlocks, bool)> {
        let key = request.into();
        let coordinator = &*self.coordinator;
        let fa = coordinator.full_attention_group();
        let has_mamba = coordinator.groups().iter().any(|g| g.spec.is_mamba());
        let (Some(fa), CoordinatorKind::Hybrid, true) = (fa, coordinator.kind(), has_mamba) else {
            return Ok((
                self.get_computed_blocks_capped(key, max_cache_hit_length)?,
                false,
            ));
        };
        let state = self.requests.get(key)?;
        if state.request.skip_reading_prefix_cache() {
            return Ok((
                self.get_computed_blocks_capped(key, max_cache_hit_length)?,
                false,
            ));
        }
        let max_len = hit_cap(&state.request, max_cache_hit_length);
        let (mut blocks, mut lengths) = (Vec::new(), Vec::new());
        coordinator.find_per_group(
            &self.pool,
            state.request.block_hashes(),
            max_len,
            &mut blocks,
            &mut lengths,
        );
        let cacheable = |g: &usize| coordinator.groups()[*g].spec.prefix_cacheable();
        let fa_hit = lengths[fa];
        if (0..lengths.len())
            .filter(cacheable)
            .any(|g| lengths[g] > fa_hit)
        {
            // A lagging group hit deeper: full attention's tail was evicted.
            return Ok((
                self.get_computed_blocks_capped(key, max_cache_hit_length)?,
                false,
            ));
        }
        let diverged = (0..lengths.len())
            .filter(cacheable)
            .any(|g| lengths[g] < fa_hit);
        // vLLM's scheduler sets the request's junction from this call too: none.
        self.requests.get_mut(key)?.shared_prefix_boundary = 0;
        Ok((
            ComputedBlocks {
                blocks,
                num_computed_tokens: fa_hit,
                shared_prefix_boundary: 0,
                origin: self.id,
                epoch: self.epoch,
                found: None,
            },
            diverged,
        ))
    }

    /// Gives the request slots for `num_new_tokens` more tokens (plus lookahead), adopting a
    /// prefix-cache hit on its first allocation, and caches its newly full blocks. Returns the
    /// newly allocated blocks per group, or `Ok(None)` when the pool cannot supply them.
    ///
    /// What a `None` may have changed (as in vLLM, which frees before it counts): blocks that
    /// already left a sliding window or local-attention chunk of the request's computed tokens
    /// are freed, and stay freed. Nothing else changes: no block is taken, no hit adopted, no
    /// block cached. With `full_sequence_must_fit`, a refusal by the admission check comes first
    /// and changes nothing at all. Bad arguments are an error and change nothing. An error once
    /// the counts passed (the pool shared with a thread that took blocks meanwhile) leaves what
    /// a `None` leaves: the blocks the call took go back, tables and effects are as they were.
    pub fn allocate_slots<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        args: &AllocateArgs<'_>,
    ) -> Result<Option<Vec<Vec<BlockId>>>> {
        let mut new_blocks = Vec::new();
        Ok(self
            .allocate_slots_into(request, args, &mut new_blocks)?
            .then_some(new_blocks))
    }

    /// [`KVCacheManager::allocate_slots`] writing the new blocks into `new_blocks` (resized to
    /// one list per group; lists are cleared first, keeping their capacity). Returns `false`
    /// when the pool cannot supply the blocks (then `new_blocks` holds empty lists).
    pub fn allocate_slots_into<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        args: &AllocateArgs<'_>,
        new_blocks: &mut Vec<Vec<BlockId>>,
    ) -> Result<bool> {
        let coordinator = &*self.coordinator;
        new_blocks.resize_with(coordinator.num_groups(), Vec::new);
        new_blocks.iter_mut().for_each(Vec::clear);
        let empty: [Vec<BlockId>; 0] = [];
        let hits: &[Vec<BlockId>] = match args.new_computed_blocks {
            Some(c) if !c.is_empty() => &c.blocks,
            _ => &empty,
        };
        let key = request.into();
        self.validate_allocate(self.requests.get(key)?, args, hits)?;
        // Counted before the call can claim blocks: hits taken before it may be evicted by it.
        self.epoch += 1;
        let pool = &*self.pool;
        let state = self.requests.get_mut(key)?;

        let n_local = args.num_computed_tokens + args.num_new_computed_tokens;
        let n_external = args.num_external_computed_tokens;
        let total = (n_local + n_external).min(self.max_model_len);
        let main = total + args.num_new_tokens;
        let need_slot = main
            .saturating_add(args.num_lookahead_tokens)
            .min(self.max_model_len);
        let num_tokens = state.request.num_tokens();
        let num_prompt = state.request.num_prompt_tokens();
        let prefill_end = num_prompt.max(num_tokens.saturating_sub(1));
        let processed = total.saturating_sub(args.num_in_flight_tokens);
        // Draft tokens are never cached: at most the request's tokens.
        let cache_tokens =
            (self.enable_caching && !args.delay_cache_blocks).then(|| main.min(num_tokens));

        let running = state.tables.iter().all(|t| t.num_cached.is_some());
        #[cfg(test)]
        let running = running && !self.general_path_only;
        if running
            && coordinator.fast_running()
            && hits.is_empty()
            && n_external == 0
            && !args.full_sequence_must_fit
        {
            let step = RunningStep {
                processed,
                computed: n_local,
                need_slot,
                cache_tokens,
                reserved: args.reserved_blocks,
                shared_prefix_boundary: state.shared_prefix_boundary,
            };
            return coordinator.running_step(
                pool,
                &mut state.tables,
                &state.request,
                &step,
                new_blocks,
                &mut self.scratch,
                &mut self.effects,
            );
        }
        // Room for the null slots first, while nothing has changed (see
        // `try_reserve_null_slots`).
        if let Err(len) = coordinator.try_reserve_null_slots(&mut state.tables, main) {
            return Err(CoreError::OutOfRange(format!(
                "request {:?}: {main} tokens need a block table of {len} entries, more than \
                 memory allows",
                state.request.id()
            )));
        }
        // A waiting (or preempted) request holds no blocks yet.
        let watermark = if args.has_scheduled_reqs && !state.is_tracked() {
            self.watermark_blocks as i64
        } else {
            0
        };
        let free = pool.num_free_blocks() as i64;
        if args.full_sequence_must_fit {
            let full = num_tokens.min(self.max_model_len);
            let need = coordinator.num_blocks_to_allocate(
                pool,
                &state.tables,
                full,
                hits,
                total,
                n_local,
                full,
                true,
                prefill_end,
                &self.effects,
            );
            if need.saturating_add(watermark) > free {
                return Ok(false);
            }
        }

        // Free what fell out of the window before counting: fewer evictions.
        coordinator.remove_skipped_blocks(
            pool,
            &mut state.tables,
            processed,
            Some(num_prompt),
            &mut self.scratch,
        )?;
        let need = coordinator.num_blocks_to_allocate(
            pool,
            &state.tables,
            need_slot,
            hits,
            n_local + n_external,
            n_local,
            main,
            false,
            prefill_end,
            &self.effects,
        );
        coordinator.record_checkpoints(
            pool,
            &mut state.tables,
            hits,
            n_local + n_external,
            main,
            prefill_end,
            &self.effects,
        );
        let free = pool.num_free_blocks();
        // Saturating: a reservation past any pool leaves nothing available.
        let available =
            (free as i64).saturating_sub(i64::try_from(args.reserved_blocks).unwrap_or(i64::MAX));
        if need.saturating_add(watermark) > available {
            return Ok(false);
        }
        let adopts = (!hits.is_empty() || n_external > 0) && !state.is_tracked();
        // vLLM's count can fall short of what the allocation takes (Mamba align's block for
        // external tokens): vLLM 0.33 then fails its pool allocation halfway through the call,
        // leaving the request holding part of its blocks. hybrid-kv refuses the call instead,
        // before anything changes, as it refuses one the count rejects.
        let exact = (cfg!(test) || coordinator.count_may_fall_short()).then(|| {
            let allocation = Allocation {
                num_local_computed_tokens: n_local,
                num_external_computed_tokens: n_external,
                adopts,
                num_tokens: need_slot,
                num_tokens_main_model: main,
            };
            coordinator.blocks_taken(pool, &state.tables, hits, &allocation)
        });
        // Elsewhere the count covers what the allocation takes (checked by the tests).
        #[cfg(test)]
        assert!(
            coordinator.count_may_fall_short() || exact.is_some_and(|t| t as i64 <= need),
            "vLLM's count falls short of what the allocation takes"
        );
        if exact.is_some_and(|taken| taken > free) {
            return Ok(false);
        }
        // From here on the call takes blocks: should a step fail (it cannot once the counts
        // above passed, unless another thread sharing the pool took blocks meanwhile), the
        // tables and effects are put back and every reference taken is given back.
        if !state.is_tracked() {
            coordinator.reserve_tables(&mut state.tables, need_slot);
        }
        let mut marks = std::mem::take(&mut self.marks);
        marks.resize_with(coordinator.num_groups(), Default::default);
        for ((m, t), mark) in coordinator
            .groups()
            .iter()
            .zip(&state.tables)
            .zip(&mut marks)
        {
            m.mark(t, mark);
        }
        let effects_mark = self.effects.mark();
        let effects = &mut self.effects;
        let scratch = &mut self.scratch;
        let enable_caching = self.enable_caching;
        #[cfg(test)]
        let fail_after_allocation = self.fail_after_allocation;
        let mut apply = || -> Result<()> {
            if adopts {
                coordinator.allocate_new_computed_blocks(
                    pool,
                    &mut state.tables,
                    hits,
                    n_local,
                    n_external,
                    enable_caching,
                    args.skip_zeroing_group_ids,
                    effects,
                )?;
            }
            coordinator.allocate_new_blocks(
                pool,
                &mut state.tables,
                state.request.id(),
                need_slot,
                main,
                new_blocks,
                effects,
            )?;
            // The tests check the exact count against every allocation they make (one thread
            // per pool there).
            #[cfg(test)]
            assert_eq!(
                exact,
                Some(free - pool.num_free_blocks()),
                "blocks_taken differs from what the allocation took"
            );
            #[cfg(test)]
            if fail_after_allocation {
                return Err(CoreError::InvalidArgument("injected failure".into()));
            }
            if let Some(n) = cache_tokens {
                coordinator.cache_blocks(
                    pool,
                    &mut state.tables,
                    &state.request,
                    n,
                    args.num_computed_tokens,
                    state.shared_prefix_boundary,
                    scratch,
                    effects,
                )?;
            }
            Ok(())
        };
        let applied = apply();
        if let Err(e) = applied {
            let mut released = Vec::new();
            for ((m, t), mark) in coordinator
                .groups()
                .iter()
                .zip(&mut state.tables)
                .zip(&mut marks)
            {
                m.rollback(t, mark, &mut released);
            }
            self.effects.rollback(effects_mark, &mut released);
            new_blocks.iter_mut().for_each(Vec::clear);
            // Blocks the call took from the pool carry no key from before it (a cached block is
            // evicted when it is taken): whatever key they carry now is this call's.
            let hit_blocks: std::collections::HashSet<BlockId> =
                hits.iter().flatten().copied().collect();
            let taken: Vec<BlockId> = released
                .iter()
                .copied()
                .filter(|b| !hit_blocks.contains(b))
                .collect();
            let _ = pool.evict_blocks(&taken);
            let _ = pool.free_blocks(&released);
            self.marks = marks;
            return Err(e);
        }
        self.marks = marks;
        Ok(true)
    }

    /// Checks the arguments of `allocate_slots` against the request's state (nothing changes
    /// on error).
    fn validate_allocate(
        &self,
        state: &RequestState,
        args: &AllocateArgs<'_>,
        hits: &[Vec<BlockId>],
    ) -> Result<()> {
        let id = state.request.id();
        let max_model_len = self.max_model_len;
        if args.num_new_tokens == 0
            && args.num_new_computed_tokens == 0
            && args.num_external_computed_tokens == 0
        {
            return invalid(format!(
                "request {id:?}: num_new_tokens must be greater than 0 when there are no \
                 computed tokens to adopt"
            ));
        }
        let n_local = args
            .num_computed_tokens
            .checked_add(args.num_new_computed_tokens)
            .and_then(|n| n.checked_add(args.num_external_computed_tokens))
            .and_then(|n| n.checked_add(args.num_new_tokens));
        match n_local {
            Some(n) if n <= max_model_len => {}
            _ => {
                return Err(CoreError::OutOfRange(format!(
                    "request {id:?}: {} computed + {} newly computed + {} external + {} new \
                     tokens exceed max_model_len {max_model_len}",
                    args.num_computed_tokens,
                    args.num_new_computed_tokens,
                    args.num_external_computed_tokens,
                    args.num_new_tokens
                )))
            }
        }
        if let Some(&g) = args
            .skip_zeroing_group_ids
            .iter()
            .find(|&&g| g >= self.num_groups())
        {
            return Err(CoreError::OutOfRange(format!(
                "skip_zeroing_group_ids: group {g} out of range ({} groups)",
                self.num_groups()
            )));
        }
        // Under async scheduling the scheduler's count runs ahead of the known tokens by the
        // unprocessed steps' positions (drafts included); the processed ones are known. (The
        // sums cannot overflow: their total is at most max_model_len, checked above.)
        let computed = args.num_computed_tokens + args.num_new_computed_tokens;
        let claimed = computed + args.num_external_computed_tokens;
        if claimed.saturating_sub(args.num_in_flight_tokens) > state.request.num_tokens() {
            return Err(CoreError::OutOfRange(format!(
                "request {id:?}: {computed} computed and {} external tokens, {} in flight, but \
                 the request has only {}",
                args.num_external_computed_tokens,
                args.num_in_flight_tokens,
                state.request.num_tokens()
            )));
        }
        if args.num_lookahead_tokens > max_model_len {
            return Err(CoreError::OutOfRange(format!(
                "request {id:?}: {} lookahead tokens exceed max_model_len {max_model_len}",
                args.num_lookahead_tokens
            )));
        }
        // vLLM's scheduler invariant: a running request's computed tokens (in-flight and draft
        // tokens included) never run past the slots it holds, and a request holding nothing
        // (waiting, or preempted: its count was reset) starts from 0 plus the hit it adopts
        // plus the tokens a connector supplies. The count of blocks to allocate relies on it
        // (tokens past the held slots would count as skipped, null slots).
        if state.is_tracked() {
            let held = args.num_computed_tokens + args.num_external_computed_tokens;
            // One pass over the tables (each read once): the slots held, fewest over the
            // groups (a circular buffer's one block holds no count), and the Mamba align
            // states keyed inside blocks.
            //
            // vLLM's scheduler caches a request's blocks at its current computed count
            // (`cache_blocks(request, request.num_computed_tokens)`, or the count its
            // `allocate_slots` just scheduled) and passes that same count to the request's next
            // `allocate_slots`. A Mamba align state the request keyed inside one of its blocks at
            // `boundary` is copied by that next allocation, so the request resumes from at most
            // `boundary` (fewer after a failed load), with the block still in its table. A larger
            // count would free the block before the copy (vLLM asserts; the copy could land on
            // the freed block itself).
            let mut slots = usize::MAX;
            for (g, (m, t)) in self
                .coordinator
                .groups()
                .iter()
                .zip(&state.tables)
                .enumerate()
            {
                if !matches!(m.spec.kind, AttentionKind::CircularBuffer) {
                    slots = slots.min(t.blocks.len().saturating_mul(m.spec.block_size));
                }
                let Some((slot, block, boundary)) = m.pending_own_state(t) else {
                    continue;
                };
                if t.blocks.get(slot) != Some(&block) {
                    return invalid(format!(
                        "request {id:?}: group {g} keyed its Mamba state at {boundary} tokens in \
                         block {block}, which left the request's table (remove_skipped_blocks \
                         past {boundary} tokens?) before the allocation that copies it"
                    ));
                }
                if held > boundary {
                    return invalid(format!(
                        "request {id:?}: {} computed and {} external tokens, but group {g} \
                         cached its Mamba state at {boundary} tokens (cache_blocks with \
                         {boundary} tokens), so its next allocation resumes from at most \
                         {boundary}",
                        args.num_computed_tokens, args.num_external_computed_tokens
                    ));
                }
            }
            if held > slots {
                return invalid(format!(
                    "request {id:?}: {} computed and {} external tokens, but the request \
                     holds slots for only {slots}",
                    args.num_computed_tokens, args.num_external_computed_tokens
                ));
            }
        } else if self.num_groups() == 0 {
            // An attention-free model: no request ever holds a block, and no count refers to
            // one (the tokens the counts may reach were checked above).
        } else if args.num_computed_tokens > 0 {
            return invalid(format!(
                "request {id:?} holds no blocks, so its num_computed_tokens must be 0 (got {}); \
                 a prefix-cache hit goes in num_new_computed_tokens, a connector's tokens in \
                 num_external_computed_tokens",
                args.num_computed_tokens
            ));
        } else if claimed > state.request.num_tokens() {
            // A hit and a connector's tokens are tokens the request has (none in flight).
            return Err(CoreError::OutOfRange(format!(
                "request {id:?}: {} hit and {} external tokens, but the request has only {}",
                args.num_new_computed_tokens,
                args.num_external_computed_tokens,
                state.request.num_tokens()
            )));
        }
        if hits.is_empty() {
            if args.num_new_computed_tokens > 0 {
                return invalid(format!(
                    "request {id:?}: {} newly computed tokens but no computed blocks",
                    args.num_new_computed_tokens
                ));
            }
            return Ok(());
        }
        self.validate_hit(
            state,
            args.new_computed_blocks,
            hits,
            args.num_new_computed_tokens,
        )
    }

    /// Checks a prefix-cache hit of `n` tokens (`hits`, the blocks of `computed`, not empty)
    /// before a request adopts it: one list per group, as many blocks as `n` tokens need, the
    /// request holding nothing yet, and every block the cached block of this prompt.
    fn validate_hit(
        &self,
        state: &RequestState,
        computed: Option<&ComputedBlocks>,
        hits: &[Vec<BlockId>],
        n: usize,
    ) -> Result<()> {
        let id = state.request.id();
        let groups = self.coordinator.groups();
        if hits.len() != groups.len() {
            return invalid(format!(
                "request {id:?}: computed blocks for {} groups, the manager has {}",
                hits.len(),
                groups.len()
            ));
        }
        if state.is_tracked() {
            return invalid(format!(
                "request {id:?} already holds blocks; prefix-cache hits can only be adopted by \
                 its first allocation"
            ));
        }
        // A hit this manager found for this prompt, with allocations since: a block that no
        // longer matches was evicted (another caller allocated), not forged.
        let evicted_since = computed.is_some_and(|c| c.origin == self.id && c.epoch != self.epoch);
        // This request's own lookup, with no key taken off any block since: every block still
        // carries the key it was found under, which is all the check below would confirm. (A
        // thread sharing the pool that takes keys off blocks during this call may go unseen, as
        // it may between the check and the adoption.)
        let unchanged = computed.is_some_and(|c| {
            c.origin == self.id
                && c.found
                    == Some(Found {
                        request: state.serial,
                        key_removals: self.pool.key_removals(),
                    })
        });
        let hashes = state.request.block_hashes();
        for (g, (m, list)) in groups.iter().zip(hits).enumerate() {
            let bs = m.spec.block_size;
            let expected = if m.spec.prefix_cacheable() {
                n.div_ceil(bs)
            } else {
                0
            };
            // A Mamba group may hold its hit below the endpoint (a connector supplies the
            // state there).
            let fits = list.len() == expected || (m.spec.is_mamba() && list.len() < expected);
            if !fits {
                return invalid(format!(
                    "request {id:?}: group {g} got {} computed blocks for {n} computed tokens \
                     (expected {expected}); pass get_computed_blocks' result unchanged",
                    list.len()
                ));
            }
            if unchanged {
                continue;
            }
            let view = request::HashView::new(hashes, bs / self.hash_block_size);
            for (i, &b) in list.iter().enumerate() {
                if b == NULL_BLOCK && !m.spec.is_full() {
                    continue;
                }
                let key = self.pool.block_key(b)?;
                let matches =
                    i < view.len() && key.is_some_and(|k| k.group == m.id && k.hash == view.get(i));
                if matches || (i + 1 == list.len() && self.keyed_inside(b, m, i, hashes)?) {
                    continue;
                }
                if evicted_since && b != NULL_BLOCK {
                    // This manager found the block for this prompt: it has left the cache since.
                    return Err(CoreError::HitEvicted {
                        request: id.to_owned(),
                        group: g,
                        block: b,
                        cause: self.hit_loss(computed, b, key)?,
                    });
                }
                return invalid(format!(
                    "request {id:?}: block {b} (group {g}, position {i}) is not the cached \
                     block of this prompt; computed blocks must come from \
                     get_computed_blocks of this manager"
                ));
            }
        }
        Ok(())
    }

    /// How block `b` (carrying `key` now) of a hit this manager found left the cache since.
    fn hit_loss(
        &self,
        computed: Option<&ComputedBlocks>,
        b: BlockId,
        key: Option<CacheKey>,
    ) -> Result<HitLoss> {
        Ok(if computed.is_some_and(|c| c.epoch < self.reset_epoch) {
            HitLoss::Reset
        } else if key.is_some() || self.pool.ref_count(b)? > 0 {
            HitLoss::Reused
        } else {
            HitLoss::Evicted
        })
    }

    /// With partial hash hits: whether block `b` (slot `i` of group `m`) is cached at one of
    /// the prompt's hash boundaries inside the slot, as the last block of a hit may be.
    fn keyed_inside(
        &self,
        b: BlockId,
        m: &single_type::GroupManager,
        i: usize,
        hashes: &[BlockHash],
    ) -> Result<bool> {
        if !self.coordinator.partial_hash_hits() || b == NULL_BLOCK {
            return Ok(false);
        }
        let scale = m.spec.block_size / self.hash_block_size;
        let span = &hashes[(i * scale).min(hashes.len())..((i + 1) * scale).min(hashes.len())];
        Ok(self
            .pool
            .block_keys(b)?
            .iter()
            .any(|k| k.group == m.id && span.contains(&k.hash)))
    }

    /// Blocks the admission check of `allocate_slots(..., full_sequence_must_fit)` needs free
    /// for the request's whole sequence (with `hit` adopted; watermark not included).
    pub fn num_blocks_to_admit<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
        hit: Option<&ComputedBlocks>,
    ) -> Result<usize> {
        let state = self.state(request)?;
        let hits = hit
            .filter(|c| !c.is_empty())
            .map_or(&[][..], |c| &c.blocks[..]);
        let computed = hit.map_or(0, |c| c.num_computed_tokens);
        let num_tokens = state.request.num_tokens();
        // The checks `allocate_slots` applies to the hit it adopts.
        if computed > num_tokens {
            return Err(CoreError::OutOfRange(format!(
                "request {:?}: a hit of {computed} tokens, but the request has only {num_tokens}",
                state.request.id()
            )));
        }
        if !hits.is_empty() {
            self.validate_hit(state, hit, hits, computed)?;
        } else if computed > 0 {
            return invalid(format!(
                "request {:?}: a hit of {computed} tokens but no computed blocks",
                state.request.id()
            ));
        }
        let full = num_tokens.min(self.max_model_len);
        let prefill_end = state
            .request
            .num_prompt_tokens()
            .max(num_tokens.saturating_sub(1));
        let need = self.coordinator.num_blocks_to_allocate(
            &self.pool,
            &state.tables,
            full,
            hits,
            computed,
            computed,
            full,
            true,
            prefill_end,
            &self.effects,
        );
        Ok(need.max(0) as usize)
    }

    /// Frees all of a request's blocks, every group tail first (the request stays known, e.g.
    /// for a preempted request that will be re-admitted).
    pub fn free<'a>(&mut self, request: impl Into<RequestKey<'a>>) -> Result<()> {
        let state = self.requests.get_mut(request.into())?;
        self.effects.forget_offloads(state.request.id());
        self.coordinator.free(&self.pool, &mut state.tables)
    }

    /// Frees the blocks that fell out of the window after `num_computed_tokens` (vLLM's
    /// `remove_skipped_blocks`); `allocate_slots` already does this. With `num_prompt_tokens`,
    /// reference-sliding-window groups also free the gap after the prompt.
    pub fn remove_skipped_blocks<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        num_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        let max_model_len = self.max_model_len;
        let state = self.requests.get_mut(request.into())?;
        // The request may hold fewer tokens than the caller counts (vLLM's scheduler calls this
        // with a request id when a request finishes; its latest tokens reach the request only
        // at its next call): any count up to the model length is a count vLLM could pass.
        let bound = max_model_len.max(state.request.num_tokens());
        if num_computed_tokens > bound {
            return Err(CoreError::OutOfRange(format!(
                "request {:?}: {num_computed_tokens} computed tokens, above max_model_len \
                 {max_model_len} and the request's {} tokens",
                state.request.id(),
                state.request.num_tokens()
            )));
        }
        self.coordinator.remove_skipped_blocks(
            &self.pool,
            &mut state.tables,
            num_computed_tokens,
            num_prompt_tokens,
            &mut self.scratch,
        )
    }

    fn check_group(&self, group: usize) -> Result<()> {
        if group < self.num_groups() {
            Ok(())
        } else {
            Err(CoreError::OutOfRange(format!(
                "group {group} out of range ({} groups)",
                self.num_groups()
            )))
        }
    }

    /// The request's block table in `group` (null blocks included).
    pub fn block_ids<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
        group: usize,
    ) -> Result<&[BlockId]> {
        let state = self.state(request)?;
        self.check_group(group)?;
        Ok(&state.tables[group].blocks)
    }

    /// The request's [`RunningHorizon`]; `None` when its next call would not take the running
    /// path (it holds no blocks yet, or a Mamba or circular-buffer group keeps per-step state):
    /// then no call is known to change nothing.
    pub fn running_horizon<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
    ) -> Result<Option<RunningHorizon>> {
        self.horizon(request, None)
    }

    /// [`Self::running_horizon`] for the running steps that start with at least `computed`
    /// tokens computed (the next ones after a call that left the request with `computed`):
    /// also `None` when its blocks hold no slot past `computed`, as no such step lies inside.
    pub fn running_horizon_past<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
        computed: usize,
    ) -> Result<Option<RunningHorizon>> {
        self.horizon(request, Some(computed))
    }

    fn horizon<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
        past: Option<usize>,
    ) -> Result<Option<RunningHorizon>> {
        let state = self.state(request)?;
        Ok(self.coordinator.running_horizon(
            &self.pool,
            &state.tables,
            &state.request,
            self.enable_caching,
            self.max_model_len,
            past,
        ))
    }

    /// The request's block tables, one per group.
    pub fn get_block_ids<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
    ) -> Result<Vec<Vec<BlockId>>> {
        Ok(self
            .state(request)?
            .tables
            .iter()
            .map(|t| t.blocks.clone())
            .collect())
    }

    /// Writes the block tables of `group` for a batch of requests through `write(row, blocks)`,
    /// after checking every request exists and fits `row_len` entries. Nothing is written on
    /// error.
    pub fn write_block_tables(
        &self,
        req_ids: &[&str],
        group: usize,
        row_len: usize,
        mut write: impl FnMut(usize, &[BlockId]),
    ) -> Result<()> {
        self.check_group(group)?;
        let mut tables = Vec::with_capacity(req_ids.len());
        for id in req_ids {
            let blocks = &self.state(*id)?.tables[group].blocks;
            if blocks.len() > row_len {
                return invalid(format!(
                    "request {id:?} holds {} blocks in group {group}, more than a row holds \
                     ({row_len})",
                    blocks.len()
                ));
            }
            tables.push(blocks.as_slice());
        }
        for (row, blocks) in tables.into_iter().enumerate() {
            write(row, blocks);
        }
        Ok(())
    }

    /// Writes the block tables of `group` for a batch of requests into a caller-owned row-major
    /// `int32` buffer: row `r` starts at `r * row_stride` and receives `req_ids[r]`'s table;
    /// entries past a table's length are left as they are. Nothing is written on error.
    pub fn write_block_table(
        &self,
        req_ids: &[&str],
        group: usize,
        out: &mut [i32],
        row_stride: usize,
    ) -> Result<()> {
        match req_ids.len().checked_mul(row_stride) {
            Some(n) if n <= out.len() => {}
            _ => {
                return invalid(format!(
                    "buffer of {} entries is too small for {} rows of stride {row_stride}",
                    out.len(),
                    req_ids.len()
                ))
            }
        }
        self.write_block_tables(req_ids, group, row_stride, |row, blocks| {
            let dst = &mut out[row * row_stride..row * row_stride + blocks.len()];
            for (d, &b) in dst.iter_mut().zip(blocks) {
                *d = b as i32;
            }
        })
    }

    /// Records one admission's prefix-cache lookup in the stats (vLLM calls this after a
    /// successful `allocate_slots` of a waiting request). Re-admissions of preempted requests
    /// are counted apart (`preempted_*`), as in vLLM. `num_hits` is at most the request's tokens.
    pub fn record_prefix_cache_stats<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        num_hits: usize,
        preempted: bool,
    ) -> Result<()> {
        let request = &self.state(request)?.request;
        if request.skip_reading_prefix_cache() {
            // A request that skipped the lookup is not counted (as in vLLM).
            return Ok(());
        }
        let queries = request.num_tokens();
        if num_hits > queries {
            return Err(CoreError::OutOfRange(format!(
                "request {:?}: {num_hits} hit tokens but the request has only {queries}",
                request.id()
            )));
        }
        let s = &mut self.stats;
        if preempted {
            s.preempted_requests += 1;
            s.preempted_queries += queries as u64;
            s.preempted_hits += num_hits as u64;
        } else {
            s.requests += 1;
            s.queries += queries as u64;
            s.hits += num_hits as u64;
        }
        Ok(())
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Returns the stats and starts new ones (vLLM's `make_prefix_cache_stats`).
    pub fn take_prefix_cache_stats(&mut self) -> PrefixCacheStats {
        std::mem::take(&mut self.stats)
    }

    /// Clears the prefix cache; refused (`false`) while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let ok = self.pool.reset_prefix_cache();
        if ok {
            self.epoch += 1;
            self.reset_epoch = self.epoch;
            self.stats.reset = true;
        }
        ok
    }

    /// Call once at the start of every scheduler step: Mamba states cached in the previous step
    /// become usable by hits.
    pub fn new_step_starts(&mut self) {
        if !self.effects.cached_this_step.is_empty() {
            self.effects.cached_this_step.clear();
        }
    }

    /// Caches the request's full blocks of its first `num_computed_tokens` tokens (after an
    /// allocation with `delay_cache_blocks`, once the data has arrived).
    pub fn cache_blocks<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        num_computed_tokens: usize,
    ) -> Result<()> {
        let state = self.requests.get_mut(request.into())?;
        if num_computed_tokens > state.request.num_tokens() {
            return Err(CoreError::OutOfRange(format!(
                "request {:?}: {num_computed_tokens} tokens to cache but the request has only {}",
                state.request.id(),
                state.request.num_tokens()
            )));
        }
        if !self.enable_caching {
            return Ok(());
        }
        self.coordinator.cache_blocks(
            &self.pool,
            &mut state.tables,
            &state.request,
            num_computed_tokens,
            // The tokens cached are computed already: no shared-prefix junction is written now.
            num_computed_tokens,
            state.shared_prefix_boundary,
            &mut self.scratch,
            &mut self.effects,
        )
    }

    /// Empties the request's tables without freeing: its blocks in allocation order, groups
    /// concatenated, leading nulls of each group dropped (vLLM's `pop_blocks_for_free`). The
    /// blocks stay retained, each keeping the request's reference, until the caller releases
    /// them with [`KVCacheManager::free_retained_blocks`], in reverse order.
    pub fn pop_blocks_for_free<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
    ) -> Result<Vec<BlockId>> {
        let state = self.requests.get_mut(request.into())?;
        self.effects.forget_offloads(state.request.id());
        let mut out = Vec::new();
        self.coordinator.pop_blocks(&mut state.tables, &mut out);
        self.retain(&out);
        Ok(out)
    }

    /// Records one retained reference of each of `blocks`.
    fn retain(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            *self.retained.entry(b).or_insert(0) += 1;
        }
    }

    /// Removes the cache entries of the given blocks (reference counts untouched; a KV
    /// connector's invalidation).
    pub fn evict_blocks(&mut self, block_ids: &[BlockId]) -> Result<()> {
        self.pool.evict_blocks(block_ids)?;
        self.epoch += 1;
        Ok(())
    }

    /// Drains the ids of newly allocated attention blocks the worker must zero (recorded when
    /// [`ManagerConfig::needs_kv_cache_zeroing`] says so), group by group.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.effects.take_new_block_ids()
    }

    /// Records the request's attention blocks from `start_token` on for zeroing again (blocks
    /// a failed asynchronous load left unwritten). `start_token` must be block aligned in
    /// every recording group.
    pub fn record_blocks_for_zeroing<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        start_token: usize,
    ) -> Result<()> {
        let state = self.requests.get(request.into())?;
        let groups = self.coordinator.groups();
        for m in groups.iter().filter(|m| m.records_new_blocks) {
            if start_token % m.spec.block_size != 0 {
                return invalid(format!(
                    "start_token {start_token} is not a multiple of group {}'s block size {}",
                    m.id, m.spec.block_size
                ));
            }
        }
        for (m, t) in groups.iter().zip(&state.tables) {
            if m.records_new_blocks {
                let start = (start_token / m.spec.block_size).min(t.blocks.len());
                self.effects.record_new(m.id, &t.blocks[start..]);
            }
        }
        Ok(())
    }

    /// Drains this step's Mamba boundary states committed to the cache, for KV connectors:
    /// `(request id, group, block, boundary tokens)` each.
    pub fn take_boundary_state_offloads(&mut self) -> Vec<(String, GroupId, BlockId, usize)> {
        std::mem::take(&mut self.effects.boundary_offloads)
    }

    /// Drains the copy-on-write copies `(source, copy)` the worker must run before this step's
    /// forward pass, group by group, and the blocks retained for them: the endpoints of every
    /// copy, `[source, copy, ...]`, each holding one reference until
    /// [`KVCacheManager::free_retained_blocks`] gets it back once the copy ran (vLLM's
    /// `take_kv_cache_block_copies`).
    pub fn take_kv_cache_block_copies(&mut self) -> (Vec<(BlockId, BlockId)>, Vec<BlockId>) {
        let mut pending = std::mem::take(&mut self.effects.cow_copies);
        // vLLM drains its managers in group order.
        pending.sort_by_key(|&(group, _, _)| group);
        let copies: Vec<(BlockId, BlockId)> = pending.iter().map(|&(_, s, d)| (s, d)).collect();
        let retained: Vec<BlockId> = copies.iter().flat_map(|&(s, d)| [s, d]).collect();
        self.retain(&retained);
        (copies, retained)
    }

    /// Releases retained blocks (what `take_kv_cache_block_copies` or `pop_blocks_for_free`
    /// returned, or part of it), in the given order as `BlockPool::free_blocks` does: blocks no
    /// one else holds join the free order. Only blocks handed out as retained and not released
    /// yet are accepted (each as many times as it is retained); otherwise nothing changes.
    pub fn free_retained_blocks(&mut self, blocks: &[BlockId]) -> Result<()> {
        let mut asked: HashMap<BlockId, u32> = HashMap::with_capacity(blocks.len());
        for &b in blocks {
            let n = asked.entry(b).or_insert(0);
            *n += 1;
            if *n > self.retained.get(&b).copied().unwrap_or(0) {
                return Err(CoreError::InvalidArgument(format!(
                    "block {b} is not retained (for a copy or by pop_blocks_for_free), or was \
                     released already"
                )));
            }
        }
        self.pool.free_blocks(blocks)?;
        for (b, n) in asked {
            match self.retained.get_mut(&b) {
                Some(held) if *held > n => *held -= n,
                _ => {
                    self.retained.remove(&b);
                }
            }
        }
        Ok(())
    }

    /// Block references retained (for copies, or by `pop_blocks_for_free`) and not released
    /// yet.
    pub fn num_retained_blocks(&self) -> usize {
        self.retained.values().map(|&n| n as usize).sum()
    }

    /// The Mamba states the request keyed inside a block as its prompt's boundary, when it
    /// finishes exactly there (`num_computed_tokens` at that boundary, nothing in flight):
    /// `(group, block, boundary tokens)` for KV connectors to offload before the blocks are
    /// freed (vLLM's `finalize_partial_tail_offloads`). Forgets them either way.
    pub fn finalize_partial_tail_offloads<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
    ) -> Result<Vec<(GroupId, BlockId, usize)>> {
        let state = self.requests.get_mut(request.into())?;
        let groups = self.coordinator.groups();
        Ok(groups
            .iter()
            .zip(state.tables.iter_mut())
            .filter_map(|(m, t)| {
                m.finalize_partial_tail(t, num_computed_tokens, num_in_flight_tokens)
            })
            .collect())
    }

    /// Whether hits may end at hash block boundaries inside blocks (vLLM's coordinator
    /// `enable_partial_hash_hits`).
    pub fn partial_hash_hits(&self) -> bool {
        self.coordinator.partial_hash_hits()
    }

    /// Whether Mamba groups key states at shared-prefix junctions (vLLM's manager
    /// `mamba_shared_prefix_checkpoint`).
    pub fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.coordinator.mamba_shared_prefix_checkpoint()
    }

    /// The request's block tables with attention groups clipped to the blocks covering
    /// `num_computed_tokens` (Mamba groups whole).
    pub fn get_block_ids_for_computed_tokens<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
        num_computed_tokens: usize,
    ) -> Result<Vec<Vec<BlockId>>> {
        let state = self.state(request)?;
        Ok(self
            .coordinator
            .groups()
            .iter()
            .zip(&state.tables)
            .map(|(m, t)| {
                let keep = if m.spec.is_mamba() {
                    t.blocks.len()
                } else {
                    num_computed_tokens.div_ceil(m.spec.block_size)
                };
                t.blocks[..keep.min(t.blocks.len())].to_vec()
            })
            .collect())
    }

    /// Tokens of the request's own blocks in the prefix cache: per prefix-cacheable group the
    /// longest prefix one of its blocks is keyed for, the least over groups (vLLM's
    /// `estimate_cached_tokens`). A block's prefix is the one its key was cached with
    /// ([`BlockPool::block_key_tokens`]), whichever request keyed it: a Mamba checkpoint sits a
    /// slot before the prefix it covers under EAGLE's drop, a partial hash hit is keyed inside
    /// its block, and a state block can hold another request's key.
    pub fn estimate_cached_tokens<'a>(&self, request: impl Into<RequestKey<'a>>) -> Result<usize> {
        let state = self.state(request)?;
        let mut cached: Option<usize> = None;
        for (m, t) in self.coordinator.groups().iter().zip(&state.tables) {
            if !m.spec.prefix_cacheable() {
                continue;
            }
            let mut group = 0;
            for &b in &t.blocks {
                if b != NULL_BLOCK {
                    group = group.max(self.pool.block_key_tokens(b)?.unwrap_or(0));
                }
            }
            cached = Some(cached.map_or(group, |c| c.min(group)));
        }
        Ok(cached.unwrap_or(0))
    }

    /// A hit cut to its first `num_computed_tokens` tokens (a multiple of every prefix-cacheable
    /// group's block size, within the hit; Mamba groups keep what they have below it).
    pub fn truncate_computed_blocks(
        &self,
        blocks: &ComputedBlocks,
        num_computed_tokens: usize,
    ) -> Result<ComputedBlocks> {
        let groups = self.coordinator.groups();
        if !blocks.is_empty() && blocks.blocks.len() != groups.len() {
            return invalid(format!(
                "computed blocks for {} groups, the manager has {}",
                blocks.blocks.len(),
                groups.len()
            ));
        }
        let mut out = Vec::with_capacity(groups.len());
        for (g, m) in groups.iter().enumerate() {
            let list = blocks.blocks.get(g).map_or(&[][..], Vec::as_slice);
            if !m.spec.prefix_cacheable() {
                out.push(Vec::new());
                continue;
            }
            let bs = m.spec.block_size;
            if num_computed_tokens % bs != 0 {
                return invalid(format!(
                    "{num_computed_tokens} tokens is not a multiple of group {g}'s block size {bs}"
                ));
            }
            let mut keep = num_computed_tokens / bs;
            if m.spec.is_mamba() {
                keep = keep.min(list.len());
            } else if keep > list.len() {
                return Err(CoreError::OutOfRange(format!(
                    "{num_computed_tokens} tokens are more than group {g}'s hit of {} blocks",
                    list.len()
                )));
            }
            out.push(list[..keep].to_vec());
        }
        Ok(ComputedBlocks {
            blocks: out,
            num_computed_tokens,
            shared_prefix_boundary: 0,
            origin: blocks.origin,
            epoch: blocks.epoch,
            found: None,
        })
    }

    /// vLLM's deprecated cascade-attention query: always 0 per group.
    pub fn get_num_common_prefix_blocks(&self) -> Vec<usize> {
        vec![0; self.num_groups()]
    }

    /// Marks a request as one that reads no prefix-cache hit (prompt logprobs).
    pub fn set_skip_reading_prefix_cache<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        skip: bool,
    ) -> Result<()> {
        self.requests
            .get_mut(request.into())?
            .request
            .set_skip_reading_prefix_cache(skip);
        Ok(())
    }

    /// The request's shared-prefix boundary (set by `get_computed_blocks`).
    pub fn shared_prefix_boundary<'a>(&self, request: impl Into<RequestKey<'a>>) -> Result<usize> {
        Ok(self.state(request)?.shared_prefix_boundary)
    }

    /// Fraction of the usable blocks in use.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Free blocks, cached evictable ones included (null block excluded).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// `(hash, group)` keys in the prefix cache.
    pub fn num_cached_keys(&self) -> usize {
        self.pool.num_cached_keys()
    }

    pub fn take_events(&self) -> Vec<KvEvent> {
        self.pool.take_events()
    }
}
