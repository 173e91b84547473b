//! Registration of caller-owned request objects with managers: the protocol a language binding
//! (the Python `Request` / `KVCacheManager` pair) runs on every call that names a request.
//!
//! A caller keeps one [`RequestRecord`] per request object: its id, prompt length, extra keys,
//! the output tokens appended so far, the scheduler's count of computed tokens, the prompt hashes
//! computed when the object was made, and the managers it is registered with. A manager keeps a
//! [`Registry`]: which object (by serial) is registered under each id. On each call,
//! [`Registry::sync`] registers the object on first use (taking over its prompt hashes when the
//! manager's hasher matches) or appends the output tokens the manager has not seen, and returns
//! the request's handle, so the hot path does no id lookup.
//!
//! Lifetimes: dropping a record queues its id on the [`DropQueue`] of every manager it is
//! registered with (lock-free, never blocking: the manager may be busy on another thread); the
//! manager removes those requests, and frees their blocks, on its next [`Registry::collect`].
//! An explicit [`Registry::remove`] invalidates every record's cached registration with that
//! manager (they are checked again by id on their next call).

use super::request::Request;
use super::{KVCacheManager, RequestHandle, RunningHorizon};
use crate::error::{CoreError, Result};
use crate::hashing::{BlockHasher, ExtraKeys};
use crate::types::{BlockHash, RequestMap};
use crossbeam_queue::SegQueue;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// Requests whose caller-side object was dropped, waiting to be removed from one manager.
#[derive(Debug, Default)]
pub struct DropQueue(SegQueue<(String, u64)>);

impl DropQueue {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A prompt hashed when its request object was made, for the first manager whose hasher
/// matches (as vLLM hashes a prompt when it builds the `Request`).
#[derive(Debug)]
pub struct Prehashed {
    pub hasher: BlockHasher,
    /// Hashes of the prompt's full blocks.
    pub hashes: Vec<BlockHash>,
    /// Prompt tokens after the last full block.
    pub tail: Vec<u32>,
}

/// One manager holding a registration of a record, and how much of it is up to date.
#[derive(Debug)]
struct Registration {
    drops: Weak<DropQueue>,
    handle: RequestHandle,
    /// Tokens the manager's copy holds.
    synced: usize,
    /// The manager's removal count when this was last checked.
    removals: u64,
}

impl Registration {
    fn of(&self, drops: *const DropQueue) -> bool {
        std::ptr::eq(self.drops.as_ptr(), drops)
    }
}

/// A record's registrations, the first held inline: a record is almost always registered
/// with one manager, and each call on it reads that registration (a separate allocation would
/// be one more cold line per call).
#[derive(Debug, Default)]
struct Registrations {
    first: Option<Registration>,
    more: Vec<Registration>,
}

impl Registrations {
    fn iter(&self) -> impl Iterator<Item = &Registration> {
        self.first.iter().chain(&self.more)
    }

    /// The registration with the manager owning `drops`.
    fn get(&self, drops: *const DropQueue) -> Option<&Registration> {
        self.iter().find(|r| r.of(drops))
    }

    fn get_mut(&mut self, drops: *const DropQueue) -> Option<&mut Registration> {
        self.first
            .iter_mut()
            .chain(&mut self.more)
            .find(|r| r.of(drops))
    }

    /// Drops the registration with the manager owning `drops`, if any.
    fn remove(&mut self, drops: *const DropQueue) {
        self.more.retain(|r| !r.of(drops));
        if self.first.as_ref().is_some_and(|r| r.of(drops)) {
            self.first = self.more.pop();
        }
    }

    /// Adds one (the caller removed any earlier one with the same manager).
    fn push(&mut self, registration: Registration) {
        if self.first.is_none() {
            self.first = Some(registration);
        } else {
            self.more.push(registration);
        }
    }

    /// Takes them all.
    fn take_all(&mut self) -> impl Iterator<Item = Registration> {
        self.first
            .take()
            .into_iter()
            .chain(std::mem::take(&mut self.more))
    }
}

/// The caller side of one request object.
#[derive(Debug)]
pub struct RequestRecord {
    id: String,
    serial: u64,
    num_prompt_tokens: usize,
    extra: ExtraKeys,
    /// Output tokens appended so far.
    pub output: Vec<u32>,
    /// The scheduler's count of computed tokens (it owns it; the manager is told per call).
    pub num_computed_tokens: usize,
    /// Tokens scheduled but not yet processed (async scheduling).
    pub num_in_flight_tokens: usize,
    /// The request reads no prefix-cache hit (prompt logprobs).
    pub skip_reading_prefix_cache: bool,
    prehashed: Option<Prehashed>,
    /// The caller's hashes of every full block so far (vLLM's `Request.block_hashes`), for a
    /// request whose hashes the caller supplies; the manager then hashes nothing.
    pub supplied: Option<Vec<BlockHash>>,
    /// Tokens per block of the `supplied` hashes: a manager hashing blocks of another size
    /// cannot take them.
    pub supplied_block_size: usize,
    registrations: Registrations,
    /// The running horizon a manager's last call on this request left, if any (the binding
    /// answers a running step inside it without that manager's lock; see [`HeldHorizon`]).
    pub horizon: Option<HeldHorizon>,
}

/// A [`RunningHorizon`] a manager read for a record, and what it holds for: the manager that
/// read it (`owner`, the binding's id of that manager) and that manager's count of changes
/// made by request id (`epoch`) when it was read. The binding drops it on every other call
/// that names the record, and moves the manager's epoch on with every call that may change a
/// request's blocks by id, so a horizon is only ever used while no call changed the
/// request's blocks since it was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldHorizon {
    pub owner: u64,
    pub epoch: u64,
    pub horizon: RunningHorizon,
}

impl RequestRecord {
    /// A record for a new request object with a non-empty prompt.
    pub fn new(
        id: String,
        num_prompt_tokens: usize,
        extra: ExtraKeys,
        prehashed: Option<Prehashed>,
    ) -> Result<Self> {
        if num_prompt_tokens == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "request {id:?} has an empty prompt"
            )));
        }
        Ok(RequestRecord {
            id,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
            num_prompt_tokens,
            extra,
            output: Vec::new(),
            num_computed_tokens: 0,
            num_in_flight_tokens: 0,
            skip_reading_prefix_cache: false,
            prehashed,
            supplied: None,
            supplied_block_size: 0,
            registrations: Registrations::default(),
            horizon: None,
        })
    }

    /// Whether `allocate_slots` of `num_new_tokens` new and `num_lookahead_tokens` lookahead
    /// tokens, with the record's counts and nothing else given, lies inside the horizon that
    /// manager `owner` left at `epoch` (so it would take, free and cache nothing, return no
    /// new blocks, and pass its argument checks).
    pub fn inside_horizon(
        &self,
        owner: u64,
        epoch: u64,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> bool {
        let Some(held) = self.horizon else {
            return false;
        };
        held.owner == owner
            && held.epoch == epoch
            && held.horizon.admits(
                self.num_computed_tokens,
                self.num_in_flight_tokens,
                self.num_tokens(),
                num_new_tokens,
                num_lookahead_tokens,
            )
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn extra(&self) -> &ExtraKeys {
        &self.extra
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    pub fn num_tokens(&self) -> usize {
        self.num_prompt_tokens + self.output.len()
    }

    /// Sets the scheduler's count of computed tokens: at most the request's tokens plus its
    /// tokens in flight (vLLM's count runs ahead of the known tokens by the draft and
    /// placeholder positions of unprocessed steps under async scheduling).
    pub fn set_num_computed_tokens(&mut self, value: usize) -> Result<()> {
        self.set_progress(Some(value), None)
    }

    /// Sets the scheduler's counts together, checked as a pair (`None` keeps a count):
    /// computed tokens at most the request's tokens plus those in flight (the processed
    /// tokens, computed minus in flight, are known tokens). Tokens in flight have no bound of
    /// their own: vLLM's count keeps the tokens of steps scheduled before a preemption until
    /// their outputs are in, so a request resumed meanwhile (a prefix-cache reset's, or under
    /// pipeline parallelism) has more in flight than computed, and its processed tokens are
    /// none (vLLM's `max(0, computed - in flight)`). Nothing changes on an error.
    pub fn set_progress(
        &mut self,
        computed: Option<usize>,
        in_flight: Option<usize>,
    ) -> Result<()> {
        let n = self.num_tokens();
        let c = computed.unwrap_or(self.num_computed_tokens);
        let f = in_flight.unwrap_or(self.num_in_flight_tokens);
        if computed.is_some() && c > n.saturating_add(f) {
            return Err(CoreError::OutOfRange(format!(
                "num_computed_tokens {c} exceeds the request's {n} tokens plus its {f} tokens \
                 in flight"
            )));
        }
        self.num_computed_tokens = c;
        self.num_in_flight_tokens = f;
        Ok(())
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        for drops in self
            .registrations
            .take_all()
            .filter_map(|r| r.drops.upgrade())
        {
            drops.0.push((self.id.clone(), self.serial));
        }
    }
}

/// What [`Registry::sync`] did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Synced {
    /// The request is up to date in the manager; `registered` when this call registered it.
    Ready {
        handle: RequestHandle,
        registered: bool,
    },
    /// A first registration needs the prompt's token ids: call again with them.
    NeedPrompt,
}

/// How a record stands with a manager (see [`Registry::lookup`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Registered(RequestHandle),
    NotRegistered,
    /// Another object is registered under the record's id.
    OtherObject,
}

/// A manager's side of the registrations; use it under the same lock as the manager.
#[derive(Debug, Default)]
pub struct Registry {
    /// Request id → serial of the record registered under it.
    serials: RequestMap<u64>,
    /// Explicit removals so far: a cached registration is trusted only while this is unchanged.
    removals: u64,
    drops: Arc<DropQueue>,
}

/// Appends a record's output `tokens` to its registration, with the record's supplied hashes
/// when it has them.
fn append_outputs(
    manager: &mut KVCacheManager,
    handle: RequestHandle,
    tokens: &[u32],
    supplied: &Option<Vec<BlockHash>>,
) -> Result<()> {
    match supplied {
        Some(hashes) => manager.append_token_ids_with_hashes(handle, tokens, hashes),
        None => manager.append_token_ids(handle, tokens),
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// The queue records push their id to when dropped (check it without the lock).
    pub fn drop_queue(&self) -> &Arc<DropQueue> {
        &self.drops
    }

    /// Removes the requests whose records were dropped, freeing their blocks.
    pub fn collect(&mut self, manager: &mut KVCacheManager) {
        while let Some((id, serial)) = self.drops.0.pop() {
            if self.serials.get(&id) == Some(&serial) {
                self.serials.remove(&id);
                // Removal frees blocks the manager handed out itself: it cannot fail.
                let _ = manager.remove_request(id.as_str());
            }
        }
    }

    /// The handle of `record` if its registration with this manager is current.
    pub fn handle_of(&self, record: &RequestRecord) -> Option<RequestHandle> {
        let me = Arc::as_ptr(&self.drops);
        record
            .registrations
            .get(me)
            .filter(|r| r.removals == self.removals)
            .map(|r| r.handle)
    }

    /// How `record` stands with this manager.
    pub fn lookup(&self, manager: &KVCacheManager, record: &RequestRecord) -> Result<Lookup> {
        if let Some(handle) = self.handle_of(record) {
            return Ok(Lookup::Registered(handle));
        }
        Ok(match self.serials.get(&record.id) {
            Some(&s) if s == record.serial => Lookup::Registered(manager.handle(&record.id)?),
            Some(_) => Lookup::OtherObject,
            None => Lookup::NotRegistered,
        })
    }

    /// Registers `record` with `manager`, or brings the manager's copy up to date with its
    /// output tokens. A first registration uses the record's prompt hashes when the manager's
    /// hasher made them, else the prompt's token ids (`prompt`; [`Synced::NeedPrompt`] when they
    /// were not given). Changes nothing on error.
    pub fn sync(
        &mut self,
        manager: &mut KVCacheManager,
        record: &mut RequestRecord,
        prompt: Option<&[u32]>,
    ) -> Result<Synced> {
        let removals = self.removals;
        let total = record.num_tokens();
        let num_prompt = record.num_prompt_tokens;
        let me = Arc::as_ptr(&self.drops);
        if let Some(reg) = record.registrations.get_mut(me) {
            if reg.removals == removals {
                let handle = reg.handle;
                manager.prefetch_tables(handle);
                if reg.synced < total {
                    let start = reg.synced - num_prompt;
                    append_outputs(manager, handle, &record.output[start..], &record.supplied)?;
                    reg.synced = total;
                }
                return Ok(Synced::Ready {
                    handle,
                    registered: false,
                });
            }
        }
        let id = record.id.as_str();
        let (handle, registered) = match self.serials.get(id) {
            Some(&serial) if serial != record.serial => {
                return Err(CoreError::InvalidArgument(format!(
                    "request id {id:?} is already used by another Request object"
                )))
            }
            Some(_) => {
                let handle = manager.handle(id)?;
                let start = manager.request(handle)?.num_tokens() - num_prompt;
                if start < record.output.len() {
                    append_outputs(manager, handle, &record.output[start..], &record.supplied)?;
                }
                (handle, false)
            }
            None => {
                let Some(handle) = self.register_new(manager, record, prompt)? else {
                    return Ok(Synced::NeedPrompt);
                };
                self.serials.insert(record.id.clone(), record.serial);
                (handle, true)
            }
        };
        record.registrations.remove(me);
        record.registrations.push(Registration {
            drops: Arc::downgrade(&self.drops),
            handle,
            synced: total,
            removals,
        });
        Ok(Synced::Ready { handle, registered })
    }

    /// Registers a new record with its output tokens: from its prompt hashes when this manager
    /// can take them (no KV events; made by the manager's hasher, or supplied hashes at its
    /// block size and lookahead), else from `prompt` (`None` when it is needed and not given).
    /// A record whose hashes the caller supplies (`record.supplied`) keeps them: nothing is
    /// hashed. Nothing stays registered on an error.
    fn register_new(
        &mut self,
        manager: &mut KVCacheManager,
        record: &mut RequestRecord,
        prompt: Option<&[u32]>,
    ) -> Result<Option<RequestHandle>> {
        let num_prompt = record.num_prompt_tokens;
        let supplied = manager.supplied_hasher()?;
        if record.supplied.is_some() && record.supplied_block_size != supplied.block_size() {
            return Err(CoreError::InvalidArgument(format!(
                "request {:?}: its block hashes are of {}-token blocks, the manager's hash \
                 blocks are {} tokens",
                record.id,
                record.supplied_block_size,
                supplied.block_size()
            )));
        }
        if manager.contains_request(&record.id) {
            return Err(CoreError::DuplicateRequest(record.id.clone()));
        }
        let fits = |p: &Prehashed| match record.supplied {
            Some(_) => {
                p.hasher.is_supplied()
                    && p.hasher.block_size() == supplied.block_size()
                    && p.hashes.len()
                        == num_prompt.saturating_sub(supplied.lookahead()) / supplied.block_size()
            }
            None => p.hasher == *manager.hasher(),
        };
        let reusable =
            !manager.pool().events_enabled() && record.prehashed.as_ref().is_some_and(fits);
        let id = record.id.as_str();
        let hashes = record.supplied.as_deref();
        let handle = if reusable {
            // Cannot fail now: a new id, a non-empty prompt, hashes that fit, no events.
            let pre = record.prehashed.take().expect("checked above");
            let extra = record.extra.clone();
            match hashes {
                Some(_) => manager.insert_prehashed(
                    id,
                    num_prompt,
                    (supplied, pre.hashes, pre.tail),
                    extra,
                    "add_request_with_hashes",
                )?,
                None => {
                    manager.add_request_prehashed(id, num_prompt, pre.hashes, pre.tail, extra)?
                }
            }
        } else {
            let Some(prompt) = prompt else {
                return Ok(None);
            };
            let extra = record.extra.clone();
            match hashes {
                Some(hashes) => manager.add_request_with_hashes(id, prompt, hashes, extra)?,
                None => manager.add_request(id, prompt, extra)?,
            }
        };
        // With supplied hashes even without outputs: the prompt's hashes too, for a request
        // made from its prompt.
        let appended = if record.supplied.is_some() || !record.output.is_empty() {
            append_outputs(manager, handle, &record.output, &record.supplied)
        } else {
            Ok(())
        };
        if let Err(err) = appended {
            self.unregister_new(manager, record, handle);
            return Err(err);
        }
        Ok(Some(handle))
    }

    /// Undoes the registration a [`Registry::sync`] of this call made (`registered: true`), for
    /// a call that was then rejected: the manager forgets the request and the record gets its
    /// prompt hashes back.
    pub fn rollback(
        &mut self,
        manager: &mut KVCacheManager,
        record: &mut RequestRecord,
        handle: RequestHandle,
    ) {
        self.serials.remove(&record.id);
        record.registrations.remove(Arc::as_ptr(&self.drops));
        self.unregister_new(manager, record, handle);
    }

    fn unregister_new(
        &mut self,
        manager: &mut KVCacheManager,
        record: &mut RequestRecord,
        handle: RequestHandle,
    ) {
        if let Ok(request) = manager.remove_request(handle) {
            if record.prehashed.is_none() {
                record.prehashed = Prehashed::from_request(&request, record.num_prompt_tokens);
            }
        }
    }

    /// Frees the request's blocks and forgets it (an explicit removal by id).
    pub fn remove(&mut self, manager: &mut KVCacheManager, id: &str) -> Result<()> {
        if self.serials.remove(id).is_none() {
            return Err(CoreError::UnknownRequest(id.to_owned()));
        }
        self.removals += 1;
        manager.remove_request(id)?;
        Ok(())
    }
}

impl Prehashed {
    /// The prompt hashes of a request that holds only its prompt (`None` if it cannot say).
    fn from_request(request: &Request, num_prompt_tokens: usize) -> Option<Self> {
        (request.num_tokens() == num_prompt_tokens).then(|| Prehashed {
            hasher: request.hasher().clone(),
            hashes: request.block_hashes().to_vec(),
            tail: request.tail().to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::{AllocateArgs, GroupSpec, ManagerConfig};

    fn manager() -> KVCacheManager {
        KVCacheManager::new(&ManagerConfig::new(vec![GroupSpec::full(4)], 64, 256)).unwrap()
    }

    fn record(id: &str, prompt: &[u32], m: &KVCacheManager) -> RequestRecord {
        let hasher = m.hasher().clone();
        let mut hashes = Vec::new();
        let full = prompt.len() / 4 * 4;
        hasher
            .hash_blocks(None, &prompt[..full], 0, &ExtraKeys::default(), &mut hashes)
            .unwrap();
        let pre = Prehashed {
            hasher,
            hashes,
            tail: prompt[full..].to_vec(),
        };
        RequestRecord::new(id.into(), prompt.len(), ExtraKeys::default(), Some(pre)).unwrap()
    }

    #[test]
    fn a_held_horizon_answers_only_its_own_manager_and_epoch_within_its_bounds() {
        let m = manager();
        let mut r = record("h", &[1, 2, 3, 4, 5, 6], &m);
        r.output.extend([7, 8]);
        r.set_progress(Some(8), Some(0)).unwrap();
        assert!(!r.inside_horizon(1, 0, 1, 0), "no horizon held");
        r.horizon = Some(HeldHorizon {
            owner: 1,
            epoch: 5,
            horizon: RunningHorizon {
                slots: 12,
                cache: 12,
                removal: 10,
            },
        });
        assert!(r.inside_horizon(1, 5, 1, 0));
        assert!(
            r.inside_horizon(1, 5, 3, 1),
            "8 + 3 + 1 slots, 11 < 12 cached"
        );
        assert!(!r.inside_horizon(2, 5, 1, 0), "another manager");
        assert!(!r.inside_horizon(1, 6, 1, 0), "a change by id since");
        assert!(!r.inside_horizon(1, 5, 0, 0), "no new tokens");
        assert!(
            !r.inside_horizon(1, 5, 4, 0),
            "fills the block to cache at 12"
        );
        assert!(!r.inside_horizon(1, 5, 3, 2), "one slot too many");
        assert!(
            !r.inside_horizon(1, 5, usize::MAX, 0),
            "overflow is outside"
        );
        assert!(
            !r.inside_horizon(1, 5, 1, usize::MAX),
            "overflow is outside"
        );
        // 10 processed tokens reach the removal bound; in-flight tokens are not processed.
        r.output.extend([9, 10]);
        r.set_progress(Some(10), Some(0)).unwrap();
        assert!(!r.inside_horizon(1, 5, 1, 0));
        r.set_progress(Some(10), Some(1)).unwrap();
        assert!(r.inside_horizon(1, 5, 1, 0));
        // More computed than known tokens plus those in flight cannot be answered here.
        r.output.truncate(2);
        r.set_progress(None, Some(0)).unwrap();
        assert!(!r.inside_horizon(1, 5, 1, 0));
    }

    #[test]
    fn tokens_in_flight_may_exceed_the_tokens_and_the_computed_ones() {
        // vLLM keeps the tokens of steps scheduled before a preemption in flight until their
        // outputs are in, also once the request resumed from fewer computed tokens.
        let m = manager();
        let mut r = record("p", &[1, 2, 3, 4, 5, 6], &m);
        r.set_progress(Some(0), Some(10)).unwrap();
        r.set_progress(Some(6), Some(16)).unwrap();
        assert_eq!((r.num_computed_tokens, r.num_in_flight_tokens), (6, 16));
        // Computed tokens are still at most the known ones plus those in flight.
        assert!(r.set_progress(Some(7), Some(0)).is_err());
        assert_eq!((r.num_computed_tokens, r.num_in_flight_tokens), (6, 16));
        r.set_progress(Some(22), None).unwrap();
        assert!(r.set_progress(Some(23), None).is_err());
    }

    fn ready(s: Synced) -> (RequestHandle, bool) {
        match s {
            Synced::Ready { handle, registered } => (handle, registered),
            Synced::NeedPrompt => panic!("needs the prompt"),
        }
    }

    #[test]
    fn first_sync_registers_with_the_prompt_hashes_and_later_ones_take_the_fast_path() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut r = record("a", &[1, 2, 3, 4, 5, 6], &m);
        let (h, new) = ready(reg.sync(&mut m, &mut r, None).unwrap());
        assert!(new);
        assert_eq!(m.request(h).unwrap().block_hashes().len(), 1);
        r.output.extend([7, 8]);
        let (h2, new) = ready(reg.sync(&mut m, &mut r, None).unwrap());
        assert_eq!((h2, new), (h, false));
        assert_eq!(m.request(h).unwrap().num_tokens(), 8);
        assert_eq!(m.request(h).unwrap().block_hashes().len(), 2);
    }

    #[test]
    fn a_record_without_matching_hashes_needs_its_prompt() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut r = RequestRecord::new("a".into(), 3, ExtraKeys::default(), None).unwrap();
        assert_eq!(reg.sync(&mut m, &mut r, None).unwrap(), Synced::NeedPrompt);
        assert_eq!(m.num_requests(), 0);
        let (_, new) = ready(reg.sync(&mut m, &mut r, Some(&[1, 2, 3])).unwrap());
        assert!(new);
        assert_eq!(m.num_requests(), 1);
    }

    #[test]
    fn another_object_under_the_same_id_is_refused() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut a = record("x", &[1, 2, 3], &m);
        let mut b = record("x", &[1, 2, 3], &m);
        reg.sync(&mut m, &mut a, None).unwrap();
        assert!(matches!(
            reg.sync(&mut m, &mut b, None),
            Err(CoreError::InvalidArgument(_))
        ));
        assert_eq!(reg.lookup(&m, &b).unwrap(), Lookup::OtherObject);
        assert_eq!(m.num_requests(), 1);
    }

    #[test]
    fn dropping_a_record_queues_its_request_and_collect_frees_its_blocks() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut r = record("a", &[1, 2, 3, 4, 5], &m);
        let (h, _) = ready(reg.sync(&mut m, &mut r, None).unwrap());
        let args = AllocateArgs {
            num_new_tokens: 5,
            ..Default::default()
        };
        assert!(m.allocate_slots(h, &args).unwrap().is_some());
        assert_eq!(m.num_free_blocks(), 61);
        drop(r);
        assert!(!reg.drop_queue().is_empty());
        assert_eq!(m.num_requests(), 1);
        reg.collect(&mut m);
        assert_eq!(m.num_requests(), 0);
        assert_eq!(m.num_free_blocks(), 63);
        assert!(reg.drop_queue().is_empty());
    }

    #[test]
    fn a_dropped_record_whose_id_was_reused_does_not_remove_the_new_request() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut a = record("x", &[1, 2, 3], &m);
        reg.sync(&mut m, &mut a, None).unwrap();
        reg.remove(&mut m, "x").unwrap();
        let mut b = record("x", &[4, 5, 6], &m);
        reg.sync(&mut m, &mut b, None).unwrap();
        drop(a);
        reg.collect(&mut m);
        assert_eq!(m.num_requests(), 1);
        assert!(matches!(reg.lookup(&m, &b).unwrap(), Lookup::Registered(_)));
    }

    #[test]
    fn rollback_forgets_a_new_registration_and_restores_the_prompt_hashes() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut r = record("a", &[1, 2, 3, 4, 5], &m);
        let (h, new) = ready(reg.sync(&mut m, &mut r, None).unwrap());
        assert!(new);
        reg.rollback(&mut m, &mut r, h);
        assert_eq!(m.num_requests(), 0);
        assert_eq!(reg.lookup(&m, &r).unwrap(), Lookup::NotRegistered);
        // The hashes came back: registering again needs no prompt.
        let (h, new) = ready(reg.sync(&mut m, &mut r, None).unwrap());
        assert!(new);
        assert_eq!(m.request(h).unwrap().block_hashes().len(), 1);
    }

    #[test]
    fn an_explicit_removal_makes_the_record_register_again() {
        let mut m = manager();
        let mut reg = Registry::new();
        let mut r = record("a", &[1, 2, 3, 4, 5], &m);
        r.output.push(9);
        reg.sync(&mut m, &mut r, Some(&[1, 2, 3, 4, 5])).unwrap();
        reg.remove(&mut m, "a").unwrap();
        assert!(matches!(
            reg.remove(&mut m, "a"),
            Err(CoreError::UnknownRequest(_))
        ));
        assert_eq!(reg.handle_of(&r), None);
        // The prompt hashes went to the first registration: the prompt is needed again.
        assert_eq!(reg.sync(&mut m, &mut r, None).unwrap(), Synced::NeedPrompt);
        let (h, new) = ready(reg.sync(&mut m, &mut r, Some(&[1, 2, 3, 4, 5])).unwrap());
        assert!(new);
        assert_eq!(m.request(h).unwrap().num_tokens(), 6);
    }

    #[test]
    fn a_record_registers_with_several_managers_independently() {
        let mut m1 = manager();
        let mut m2 = manager();
        let (mut reg1, mut reg2) = (Registry::new(), Registry::new());
        let mut r = record("a", &[1, 2, 3, 4, 5], &m1);
        reg1.sync(&mut m1, &mut r, None).unwrap();
        reg2.sync(&mut m2, &mut r, Some(&[1, 2, 3, 4, 5])).unwrap();
        r.output.push(6);
        reg1.sync(&mut m1, &mut r, None).unwrap();
        assert_eq!(m1.request("a").unwrap().num_tokens(), 6);
        assert_eq!(m2.request("a").unwrap().num_tokens(), 5);
        drop(r);
        reg1.collect(&mut m1);
        reg2.collect(&mut m2);
        assert_eq!((m1.num_requests(), m2.num_requests()), (0, 0));
    }
}
