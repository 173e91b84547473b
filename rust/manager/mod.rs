//! The scheduler-facing KV cache manager: request state, per-attention-type block tables and
//! the prefix-cache coordinators over one shared [`BlockPool`], with vLLM 0.33's semantics in
//! dense retention mode (every full block of every group stays cached until evicted).
//!
//! Layers (as in vLLM): [`KVCacheManager`] (what a scheduler calls) → coordinator (hit search
//! across groups, [`HitFinder`]) → one single-type manager per group (allocation and hit rules
//! of full attention, sliding window, chunked local attention, Mamba).
//!
//! The pool is shared through an `Arc`; [`Prober`] answers "how much of this prompt is cached"
//! from other threads while the scheduler mutates the manager.

mod coordinator;
pub mod replay;
mod request;
mod single_type;
mod spec;

#[cfg(test)]
mod tests;

pub use coordinator::{CoordinatorKind, HitFinder};
pub use request::Request;
pub use spec::{AttentionKind, GroupSpec, ManagerConfig};

use crate::error::{CoreError, Result};
use crate::hashing::{BlockHasher, ExtraKeys, TokenId};
use crate::pool::BlockPool;
use crate::types::{BlockId, GroupId, KvEvent, RequestMap, NULL_BLOCK};
use single_type::{GroupManager, GroupTable};
use std::sync::Arc;

fn invalid<T>(msg: String) -> Result<T> {
    Err(CoreError::InvalidArgument(msg))
}

/// A prefix-cache hit as returned by [`KVCacheManager::get_computed_blocks`]; pass it back to
/// [`KVCacheManager::allocate_slots`] unchanged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// Per group, the hit blocks (null blocks where the group needs none).
    pub blocks: Vec<Vec<BlockId>>,
    /// Tokens covered by the hit.
    pub num_computed_tokens: usize,
    /// vLLM's `shared_prefix_boundary`: 0, or the longer prefix some group alone had cached.
    pub shared_prefix_boundary: usize,
}

impl ComputedBlocks {
    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(Vec::is_empty)
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

/// A request's slot in a [`KVCacheManager`], returned by `add_request`: naming a request by its
/// handle skips the id lookup. A handle goes stale when its request is removed (a later request
/// may reuse the slot, under a new generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestHandle {
    slot: u32,
    generation: u32,
}

/// Names a request in [`KVCacheManager`] calls: by id (`&str`) or by [`RequestHandle`].
#[derive(Clone, Copy, Debug)]
pub enum RequestKey<'a> {
    Id(&'a str),
    Handle(RequestHandle),
}

impl<'a> From<&'a str> for RequestKey<'a> {
    fn from(id: &'a str) -> Self {
        RequestKey::Id(id)
    }
}

impl<'a> From<&'a String> for RequestKey<'a> {
    fn from(id: &'a String) -> Self {
        RequestKey::Id(id)
    }
}

impl From<RequestHandle> for RequestKey<'_> {
    fn from(handle: RequestHandle) -> Self {
        RequestKey::Handle(handle)
    }
}

/// Request states in slots, with an id index; slots of removed requests are reused.
#[derive(Default)]
struct Requests {
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    ids: RequestMap<u32>,
}

struct Slot {
    generation: u32,
    state: Option<RequestState>,
}

impl Requests {
    fn len(&self) -> usize {
        self.ids.len()
    }

    fn contains(&self, id: &str) -> bool {
        self.ids.contains_key(id)
    }

    fn handle(&self, id: &str) -> Option<RequestHandle> {
        let slot = *self.ids.get(id)?;
        Some(RequestHandle {
            slot,
            generation: self.slots[slot as usize].generation,
        })
    }

    /// The slot `key` names. A live handle is resolved inline; ids and errors take the slow path.
    #[inline]
    fn index(&self, key: RequestKey<'_>) -> Result<usize> {
        if let RequestKey::Handle(h) = key {
            if let Some(s) = self.slots.get(h.slot as usize) {
                if s.generation == h.generation && s.state.is_some() {
                    return Ok(h.slot as usize);
                }
            }
        }
        self.index_slow(key)
    }

    #[cold]
    fn index_slow(&self, key: RequestKey<'_>) -> Result<usize> {
        match key {
            RequestKey::Id(id) => match self.ids.get(id) {
                Some(&slot) => Ok(slot as usize),
                None => invalid(format!("unknown request id {id:?}")),
            },
            RequestKey::Handle(h) => invalid(format!(
                "stale request handle {h:?}: its request was removed"
            )),
        }
    }

    #[inline]
    fn get(&self, key: RequestKey<'_>) -> Result<&RequestState> {
        let i = self.index(key)?;
        Ok(self.slots[i]
            .state
            .as_ref()
            .expect("index checks occupancy"))
    }

    #[inline]
    fn get_mut(&mut self, key: RequestKey<'_>) -> Result<&mut RequestState> {
        let i = self.index(key)?;
        Ok(self.slots[i]
            .state
            .as_mut()
            .expect("index checks occupancy"))
    }

    fn insert(&mut self, state: RequestState) -> RequestHandle {
        let id = state.request.id().to_owned();
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    state: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.state = Some(state);
        self.ids.insert(id, slot);
        RequestHandle {
            slot,
            generation: entry.generation,
        }
    }

    fn remove(&mut self, key: RequestKey<'_>) -> Result<RequestState> {
        let i = self.index(key)?;
        let entry = &mut self.slots[i];
        let state = entry.state.take().expect("index checks occupancy");
        entry.generation = entry.generation.wrapping_add(1);
        self.ids.remove(state.request.id());
        self.free_slots.push(i as u32);
        Ok(state)
    }
}

#[derive(Debug)]
struct RequestState {
    request: Request,
    tables: Vec<GroupTable>,
}

/// `allocate_slots` for a request that already holds its blocks in every group and adopts no
/// hit (decode steps and continued prefill): the same decisions as the general path, in one
/// pass that frees what left the window and counts the blocks needed, and a second that
/// allocates and caches.
struct RunningStep {
    /// Tokens processed: blocks before the window of these are freed.
    processed: usize,
    /// Slots the request needs after this step.
    need_slot: usize,
    /// Tokens whose full blocks are cached; `None` when caching is off or delayed.
    cache_tokens: Option<usize>,
    hash_block_size: usize,
}

impl RunningStep {
    fn apply(
        &self,
        groups: &[GroupManager],
        pool: &BlockPool,
        state: &mut RequestState,
        new_blocks: &mut [Vec<BlockId>],
        scratch: &mut Vec<BlockId>,
    ) -> Result<bool> {
        let mut need = 0;
        for (m, t) in groups.iter().zip(state.tables.iter_mut()) {
            m.remove_skipped_blocks(pool, t, self.processed, scratch)?;
            need += self
                .need_slot
                .div_ceil(m.spec.block_size)
                .saturating_sub(t.blocks.len());
        }
        if need > pool.num_free_blocks() {
            return Ok(false);
        }
        for ((m, t), out) in groups.iter().zip(state.tables.iter_mut()).zip(new_blocks) {
            if need > 0 {
                m.allocate_new_blocks(pool, t, self.need_slot, out)?;
            }
            if let Some(n) = self.cache_tokens {
                m.cache_blocks(pool, t, &state.request, n, self.hash_block_size, scratch)?;
            }
        }
        Ok(true)
    }
}

impl RequestState {
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
    finder: Arc<HitFinder>,
    hasher: BlockHasher,
}

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prober")
            .field("num_blocks", &self.pool.num_blocks())
            .field("finder", &self.finder)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for KVCacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KVCacheManager")
            .field("num_blocks", &self.pool.num_blocks())
            .field("num_free_blocks", &self.pool.num_free_blocks())
            .field("groups", &self.group_specs())
            .field("coordinator", &self.finder.kind())
            .field("num_requests", &self.requests.len())
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
            .finder
            .find(&self.pool, &hashes, max_len.min(prompt.len()), &mut out);
        Ok(hit.tokens.min(prompt.len()))
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }
}

/// The KV cache manager a scheduler drives: `add_request`, then per step
/// `get_computed_blocks` / `allocate_slots` / `append_token_ids`, and `free` /
/// `remove_request` at the end. Methods that change state take `&mut self`; the pool is shared
/// (`Arc`) with [`Prober`]s.
pub struct KVCacheManager {
    pool: Arc<BlockPool>,
    finder: Arc<HitFinder>,
    hasher: BlockHasher,
    groups: Vec<GroupManager>,
    max_model_len: usize,
    watermark_blocks: usize,
    enable_caching: bool,
    scheduler_block_size: usize,
    hash_block_size: usize,
    requests: Requests,
    stats: PrefixCacheStats,
    scratch: Vec<BlockId>,
    /// Tests: take the general allocation path even for running requests.
    #[cfg(test)]
    general_path_only: bool,
}

impl KVCacheManager {
    pub fn new(config: &ManagerConfig) -> Result<Self> {
        let (scheduler_block_size, hash_block_size) = config.resolve_block_sizes()?;
        let pool = Arc::new(BlockPool::with_options(
            config.num_blocks,
            config.enable_caching,
            config.enable_events,
        )?);
        let hasher = BlockHasher::new(hash_block_size, config.hash_algo, &config.hash_seed)?;
        let max_in_flight = config.max_in_flight_tokens.unwrap_or(config.max_model_len);
        let groups = config
            .groups
            .iter()
            .enumerate()
            .map(|(i, &spec)| GroupManager {
                spec,
                id: i as GroupId,
                hash_ratio: (spec.block_size / hash_block_size).max(1),
                admission_cap: spec.max_admission_blocks(max_in_flight, config.max_model_len),
                alignment: scheduler_block_size,
            })
            .collect();
        let finder = Arc::new(HitFinder::new(
            &config.groups,
            config.enable_caching,
            scheduler_block_size,
            hash_block_size,
        ));
        Ok(KVCacheManager {
            pool,
            finder,
            hasher,
            groups,
            max_model_len: config.max_model_len,
            watermark_blocks: (config.watermark * config.num_blocks as f64) as usize,
            enable_caching: config.enable_caching,
            scheduler_block_size,
            hash_block_size,
            requests: Requests::default(),
            stats: PrefixCacheStats::default(),
            scratch: Vec::new(),
            #[cfg(test)]
            general_path_only: false,
        })
    }

    /// A handle for concurrent read-only cache probes.
    pub fn prober(&self) -> Prober {
        Prober {
            pool: Arc::clone(&self.pool),
            finder: Arc::clone(&self.finder),
            hasher: self.hasher.clone(),
        }
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    pub fn group_specs(&self) -> Vec<GroupSpec> {
        self.groups.iter().map(|g| g.spec).collect()
    }

    pub fn coordinator_kind(&self) -> CoordinatorKind {
        self.finder.kind()
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
        self.check_new_request(request_id, num_prompt_tokens)?;
        if self.pool.events_enabled() {
            return invalid(format!(
                "request {request_id:?}: KV events need the prompt's token ids; use add_request"
            ));
        }
        let request = Request::from_prehashed(
            request_id.to_owned(),
            num_prompt_tokens,
            self.hasher.clone(),
            extra,
            hashes,
            tail,
        )?;
        Ok(self.insert_request(request))
    }

    fn check_new_request(&self, request_id: &str, num_prompt_tokens: usize) -> Result<()> {
        if self.requests.contains(request_id) {
            return invalid(format!("request {request_id:?} was already added"));
        }
        if num_prompt_tokens == 0 {
            return invalid(format!("request {request_id:?} has an empty prompt"));
        }
        Ok(())
    }

    fn insert_request(&mut self, request: Request) -> RequestHandle {
        let tables = vec![GroupTable::default(); self.groups.len()];
        self.requests.insert(RequestState { request, tables })
    }

    /// The handle of a registered request (see [`RequestHandle`]).
    pub fn handle(&self, request_id: &str) -> Result<RequestHandle> {
        match self.requests.handle(request_id) {
            Some(h) => Ok(h),
            None => invalid(format!("unknown request id {request_id:?}")),
        }
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

    /// Frees the request's blocks (if any) and forgets it.
    pub fn remove_request<'a>(&mut self, request: impl Into<RequestKey<'a>>) -> Result<()> {
        let key = request.into();
        self.free(key)?;
        self.requests.remove(key)?;
        Ok(())
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
        &self,
        request: impl Into<RequestKey<'a>>,
    ) -> Result<ComputedBlocks> {
        let state = self.state(request)?;
        let mut blocks = Vec::new();
        let max_len = state.request.num_tokens().saturating_sub(1);
        let hit = self.finder.find(
            &self.pool,
            state.request.block_hashes(),
            max_len,
            &mut blocks,
        );
        Ok(ComputedBlocks {
            blocks,
            num_computed_tokens: hit.tokens,
            shared_prefix_boundary: if hit.uncached_common > 0 {
                hit.tokens + hit.uncached_common
            } else {
                0
            },
        })
    }

    /// Gives the request slots for `num_new_tokens` more tokens (plus lookahead), adopting a
    /// prefix-cache hit on its first allocation, and caches its newly full blocks. Returns the
    /// newly allocated blocks per group, or `Ok(None)` when the pool cannot supply them: then
    /// nothing changed except that blocks out of the sliding window / chunk were freed (as
    /// vLLM does first). Bad arguments are an error and change nothing.
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
        new_blocks.resize_with(self.groups.len(), Vec::new);
        new_blocks.iter_mut().for_each(Vec::clear);
        let pool = &*self.pool;
        let state = self.requests.get_mut(request.into())?;
        let empty: [Vec<BlockId>; 0] = [];
        let hits: &[Vec<BlockId>] = match args.new_computed_blocks {
            Some(c) if !c.is_empty() => &c.blocks,
            _ => &empty,
        };
        Self::validate_allocate(
            &self.groups,
            pool,
            self.max_model_len,
            self.hash_block_size,
            state,
            args,
            hits,
        )?;
        let hit_of = |g: usize| -> &[BlockId] { hits.get(g).map_or(&[], Vec::as_slice) };

        let n_local = args.num_computed_tokens + args.num_new_computed_tokens;
        let total = n_local.min(self.max_model_len);
        let main = total + args.num_new_tokens;
        let need_slot = main
            .saturating_add(args.num_lookahead_tokens)
            .min(self.max_model_len);
        let num_tokens = state.request.num_tokens();

        let processed = total.saturating_sub(args.num_in_flight_tokens);
        // Full blocks of these tokens are cached after the allocation.
        let cache_tokens = (self.enable_caching && !args.delay_cache_blocks)
            .then(|| main.min(num_tokens) / self.scheduler_block_size * self.scheduler_block_size);

        let running = state.tables.iter().all(|t| t.num_cached.is_some());
        #[cfg(test)]
        let running = running && !self.general_path_only;
        if running && hits.is_empty() && !args.full_sequence_must_fit {
            let step = RunningStep {
                processed,
                need_slot,
                cache_tokens,
                hash_block_size: self.hash_block_size,
            };
            return step.apply(&self.groups, pool, state, new_blocks, &mut self.scratch);
        }
        // A waiting (or preempted) request holds no blocks yet.
        let watermark = if args.has_scheduled_reqs && !state.is_tracked() {
            self.watermark_blocks
        } else {
            0
        };
        if args.full_sequence_must_fit {
            let full = num_tokens.min(self.max_model_len);
            let need: usize = self
                .groups
                .iter()
                .zip(&state.tables)
                .enumerate()
                .map(|(g, (m, t))| m.num_blocks_to_allocate(pool, t, full, hit_of(g), total, true))
                .sum();
            if need + watermark > pool.num_free_blocks() {
                return Ok(false);
            }
        }

        // Free what fell out of the window before counting: fewer evictions.
        for (m, t) in self.groups.iter().zip(state.tables.iter_mut()) {
            m.remove_skipped_blocks(pool, t, processed, &mut self.scratch)?;
        }

        let need: usize = self
            .groups
            .iter()
            .zip(&state.tables)
            .enumerate()
            .map(|(g, (m, t))| {
                m.num_blocks_to_allocate(pool, t, need_slot, hit_of(g), total, false)
            })
            .sum();
        if need + watermark > pool.num_free_blocks() {
            return Ok(false);
        }

        if !hits.is_empty() {
            for (g, (m, t)) in self.groups.iter().zip(state.tables.iter_mut()).enumerate() {
                m.add_local_computed_blocks(pool, t, hit_of(g), total, self.enable_caching)?;
            }
        }

        for ((m, t), out) in self
            .groups
            .iter()
            .zip(state.tables.iter_mut())
            .zip(new_blocks.iter_mut())
        {
            m.allocate_new_blocks(pool, t, need_slot, out)?;
        }

        if let Some(n) = cache_tokens {
            for (m, t) in self.groups.iter().zip(state.tables.iter_mut()) {
                m.cache_blocks(
                    pool,
                    t,
                    &state.request,
                    n,
                    self.hash_block_size,
                    &mut self.scratch,
                )?;
            }
        }
        Ok(true)
    }

    fn validate_allocate(
        groups: &[GroupManager],
        pool: &BlockPool,
        max_model_len: usize,
        hash_block_size: usize,
        state: &RequestState,
        args: &AllocateArgs<'_>,
        hits: &[Vec<BlockId>],
    ) -> Result<()> {
        let id = state.request.id();
        if args.num_new_tokens == 0 && args.num_new_computed_tokens == 0 {
            return invalid(format!(
                "request {id:?}: num_new_tokens must be greater than 0 when there are no \
                 computed tokens to adopt"
            ));
        }
        let n_local = args
            .num_computed_tokens
            .checked_add(args.num_new_computed_tokens)
            .and_then(|n| n.checked_add(args.num_new_tokens));
        match n_local {
            Some(n) if n <= max_model_len => {}
            _ => {
                return invalid(format!(
                    "request {id:?}: {} computed + {} newly computed + {} new tokens exceed \
                     max_model_len {max_model_len}",
                    args.num_computed_tokens, args.num_new_computed_tokens, args.num_new_tokens
                ))
            }
        }
        if args.num_computed_tokens + args.num_new_computed_tokens > state.request.num_tokens() {
            return invalid(format!(
                "request {id:?}: {} computed tokens but the request has only {}",
                args.num_computed_tokens + args.num_new_computed_tokens,
                state.request.num_tokens()
            ));
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
        let n = args.num_new_computed_tokens;
        let hashes = state.request.block_hashes();
        for (g, (m, list)) in groups.iter().zip(hits).enumerate() {
            let bs = m.spec.block_size;
            let expected = if m.spec.prefix_cacheable() {
                n.div_ceil(bs)
            } else {
                0
            };
            if list.len() != expected {
                return invalid(format!(
                    "request {id:?}: group {g} got {} computed blocks for {n} computed tokens \
                     (expected {expected}); pass get_computed_blocks' result unchanged",
                    list.len()
                ));
            }
            let view = request::HashView::new(hashes, bs / hash_block_size);
            for (i, &b) in list.iter().enumerate() {
                if b == NULL_BLOCK && !m.spec.is_full() {
                    continue;
                }
                let key = pool.block_key(b)?;
                let matches =
                    i < view.len() && key.is_some_and(|k| k.group == m.id && k.hash == view.get(i));
                if !matches {
                    return invalid(format!(
                        "request {id:?}: block {b} (group {g}, position {i}) is not the cached \
                         block of this prompt; computed blocks must come from \
                         get_computed_blocks of this manager"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Frees all of a request's blocks, every group tail first (the request stays known, e.g.
    /// for a preempted request that will be re-admitted).
    pub fn free<'a>(&mut self, request: impl Into<RequestKey<'a>>) -> Result<()> {
        let pool = &*self.pool;
        let state = self.requests.get_mut(request.into())?;
        for (m, t) in self.groups.iter().zip(state.tables.iter_mut()) {
            m.free(pool, t, &mut self.scratch)?;
        }
        Ok(())
    }

    /// Frees the blocks that fell out of the window after `num_computed_tokens` (vLLM's
    /// `remove_skipped_blocks`); `allocate_slots` already does this.
    pub fn remove_skipped_blocks<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        num_computed_tokens: usize,
    ) -> Result<()> {
        let pool = &*self.pool;
        let state = self.requests.get_mut(request.into())?;
        for (m, t) in self.groups.iter().zip(state.tables.iter_mut()) {
            m.remove_skipped_blocks(pool, t, num_computed_tokens, &mut self.scratch)?;
        }
        Ok(())
    }

    /// The request's block table in `group` (null blocks included).
    pub fn block_ids<'a>(
        &self,
        request: impl Into<RequestKey<'a>>,
        group: usize,
    ) -> Result<&[BlockId]> {
        let state = self.state(request)?;
        match state.tables.get(group) {
            Some(t) => Ok(&t.blocks),
            None => invalid(format!(
                "group {group} out of range ({} groups)",
                self.groups.len()
            )),
        }
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
        if group >= self.groups.len() {
            return invalid(format!(
                "group {group} out of range ({} groups)",
                self.groups.len()
            ));
        }
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
        let mut tables = Vec::with_capacity(req_ids.len());
        for id in req_ids {
            let blocks = &self.state(*id)?.tables[group].blocks;
            if blocks.len() > row_stride {
                return invalid(format!(
                    "request {id:?} holds {} blocks in group {group}, more than the row stride \
                     {row_stride}",
                    blocks.len()
                ));
            }
            tables.push(blocks.as_slice());
        }
        for (row, blocks) in out.chunks_mut(row_stride.max(1)).zip(tables) {
            for (dst, &b) in row.iter_mut().zip(blocks) {
                *dst = b as i32;
            }
        }
        Ok(())
    }

    /// Records one admission's prefix-cache lookup in the stats (vLLM calls this after a
    /// successful `allocate_slots` of a waiting request). Re-admissions of preempted requests
    /// are counted apart (`preempted_*`), as in vLLM.
    pub fn record_prefix_cache_stats<'a>(
        &mut self,
        request: impl Into<RequestKey<'a>>,
        num_hits: usize,
        preempted: bool,
    ) -> Result<()> {
        let queries = self.state(request)?.request.num_tokens() as u64;
        let s = &mut self.stats;
        if preempted {
            s.preempted_requests += 1;
            s.preempted_queries += queries;
            s.preempted_hits += num_hits as u64;
        } else {
            s.requests += 1;
            s.queries += queries;
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
            self.stats.reset = true;
        }
        ok
    }

    /// Called once per scheduler step (kept for API parity; nothing to do without Mamba
    /// prefix caching).
    pub fn new_step_starts(&mut self) {}

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
