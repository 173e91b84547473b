//! The prefix-cache map `(block_hash, group_id) → blocks`: sharded open-addressing tables with
//! optimistic (seqlock) readers.
//!
//! Identical content may be cached in several blocks (block tables stay append-only), so a key
//! may have several entries; lookups return the first one inserted that is still cached.
//!
//! Layout: the key's 64-bit mix picks a shard (top bits) and a home slot (low bits). The mix is
//! the block hash's, plus the group id: one hash's keys in a layout's groups (a hybrid model's
//! groups share their block hashes) have neighbouring home slots in one shard, so that the
//! lookups of one hash across groups (a hit's window groups after its full-attention ones, each
//! group's block of a filled position cached in turn) read the lines the first one loaded. Each
//! shard is a linear-probing table of `(lo, hi, group | id)` slots (keys inline, so a lookup
//! touches one cache line) sized from the pool (`2·num_blocks` slots in all), grown only if a
//! shard ever passes 3/4 full. Inserts go to the first empty slot of the probe sequence, so duplicates of
//! a key sit in insertion order; removals shift the rest of the cluster back (no tombstones,
//! nothing to rebuild), which keeps that order. The shards' first tables are one array, so a
//! key's home slot's address follows from its mix alone: a walk's prefetches issue the home
//! slot and the shard's header (its own 128 bytes: sequence word, live level, counters) without
//! waiting for any load, and the lookup that follows reads the header and the slot, which do not
//! depend on each other until the shard grows.
//!
//! Concurrency: writers (insert, remove, clear) of one shard serialise on that shard's sequence
//! word (odd while a writer is inside: a per-shard spin lock; there are up to 256 shards and no
//! global lock). Readers never write shared memory: they read the sequence, probe, and retry if
//! the sequence moved (a seqlock), so lookups scale with threads; a reader only waits while a
//! writer of the same shard is mid-update. Every shared word is an atomic (walks prefetch slots
//! with `crate::sync::prefetch`, a hint): slot words are stored with `Release` and loaded with `Acquire`, so a reader
//! that sees any word of a writer's update also sees that writer's odd sequence number on its
//! re-check.
//!
//! Grown tables are never freed before the map (a reader may still be probing one; it then
//! fails its re-check); doubling bounds that to the size of the live table. Every table is
//! allocated fallibly: the first ones when the map is made (an error names their size), later
//! ones when a shard grows. If a doubling cannot be allocated the shard keeps filling its table,
//! and once only one empty slot would remain an insert is refused (the block is simply not
//! cached); lookups and removals need that one empty slot to end their probes.

use super::alloc::{array_bytes, AllocFailed, PageArray};
use crate::sync::{spin_wait, AtomicU64, AtomicUsize, Ordering};
use crate::types::{BlockId, CacheKey};
use std::sync::OnceLock;

/// `meta` of an empty slot (block 0, the null block, is never cached).
const EMPTY: u64 = 0;
/// Most shards; fewer for small pools (at least `MIN_PER_SHARD` expected entries each).
const MAX_SHARDS: usize = 256;
const MIN_PER_SHARD: usize = 64;
const MIN_SLOTS: usize = 16;

struct Slot {
    /// `(group << 32) | block_id`; `EMPTY` when free.
    meta: AtomicU64,
    lo: AtomicU64,
    hi: AtomicU64,
}

impl Slot {
    fn empty() -> Self {
        Slot {
            meta: AtomicU64::new(EMPTY),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
        }
    }
}

#[inline]
fn pack_meta(group: u32, id: BlockId) -> u64 {
    ((group as u64) << 32) | id as u64
}

#[inline]
fn meta_id(meta: u64) -> BlockId {
    meta as u32
}

#[inline]
fn meta_group(meta: u64) -> u32 {
    (meta >> 32) as u32
}

/// A per-process random salt: block hashes come from user tokens and the default hash seed is
/// public, so without it a client could craft prompts whose keys all land in one probe cluster.
static SALT: OnceLock<u64> = OnceLock::new();

fn salt() -> u64 {
    *SALT.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x5EED);
        h.finish()
    })
}

/// Keys are already uniformly distributed hashes: one folded multiply (salted) mixes them enough.
/// The group is added after mixing, so that one hash's groups have consecutive home slots (see
/// the module's docs); the shard, from the top bits, is the hash's unless the addition carries
/// into them.
#[inline]
fn mix(salt: u64, lo: u64, hi: u64, group: u32) -> u64 {
    let a = lo ^ salt;
    let b = hi ^ 0xA076_1D64_78BD_642F;
    let m = (a as u128).wrapping_mul(b as u128);
    ((m as u64) ^ ((m >> 64) as u64)).wrapping_add(u64::from(group))
}

#[inline]
fn key_parts(key: &CacheKey) -> (u64, u64) {
    key.hash.to_parts()
}

type Table = PageArray<Slot>;

fn new_table(slots: usize) -> Result<Table, AllocFailed> {
    PageArray::new("prefix-cache map table", slots, |_| Slot::empty())
}

/// Doublings a shard's table can go through (from at least `MIN_SLOTS` slots: more than any
/// address space holds).
const LEVELS: usize = 40;

/// A shard's header: its seqlock word, its live level and counters, in one cache line of its
/// own (`align(128)`: no two shards' writers share a line, nor the pair the CPU fetches
/// together). Its first table is not here but in the map's array of first tables (see
/// [`CacheMap`]), so that finding a key's first slot reads no header; the grown tables live behind
/// a pointer.
#[repr(C, align(128))]
struct Shard {
    /// Seqlock word: odd while a writer is inside.
    seq: AtomicU64,
    /// Level of the live table: 0 for the first table, `k` for `grown[k - 1]`.
    current: AtomicUsize,
    /// Entries and distinct keys in this shard (written only under the shard's lock).
    entries: AtomicUsize,
    keys: AtomicUsize,
    /// Tables of doubling size, made as the shard grows.
    grown: Box<[OnceLock<Table>]>,
}

impl Shard {
    fn new() -> Self {
        Shard {
            seq: AtomicU64::new(0),
            current: AtomicUsize::new(0),
            entries: AtomicUsize::new(0),
            keys: AtomicUsize::new(0),
            grown: (1..LEVELS).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The live table, given the shard's first table (its part of the map's array).
    #[inline]
    fn table<'a>(&'a self, first: &'a [Slot], ordering: Ordering) -> &'a [Slot] {
        match self.current.load(ordering) {
            0 => first,
            k => self.grown[k - 1]
                .get()
                .expect("a grown table is initialised before it is published"),
        }
    }

    /// Takes the shard's writer lock; returns the (odd) sequence to pass to `unlock`.
    fn lock(&self) -> u64 {
        let mut spins = 0u32;
        loop {
            let s = self.seq.load(Ordering::Relaxed);
            if s & 1 == 0
                && self
                    .seq
                    .compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return s + 1;
            }
            backoff(&mut spins);
        }
    }

    fn unlock(&self, odd: u64) {
        self.seq.store(odd + 1, Ordering::Release);
    }
}

#[inline]
fn backoff(spins: &mut u32) {
    #[cfg(not(loom))]
    if *spins < 64 {
        *spins += 1;
        std::hint::spin_loop();
        return;
    }
    let _ = spins;
    spin_wait();
}

/// Whether slot `i` holds `(lo, hi, group)`; its meta is `meta`.
#[inline]
fn slot_matches(slot: &Slot, meta: u64, lo: u64, hi: u64, group: u32) -> bool {
    meta_group(meta) == group
        && slot.lo.load(Ordering::Acquire) == lo
        && slot.hi.load(Ordering::Acquire) == hi
}

pub(crate) struct CacheMap {
    shards: Box<[Shard]>,
    /// Every shard's first table, one array: shard `i`'s is `first[i * first_len..][..first_len]`,
    /// so a key's first slot follows from its mix alone (a prefetch reads no shard header).
    first: Table,
    /// Slots of each first table (a power of two).
    first_len: usize,
    /// The process's `salt()`, read once.
    salt: u64,
    /// `64 - log2(shards)`, or 64 for one shard.
    shard_shift: u32,
}

impl CacheMap {
    /// Bytes of the tables [`CacheMap::with_capacity`] allocates for `num_blocks` (at least).
    pub(crate) fn heap_bytes(num_blocks: usize) -> usize {
        array_bytes::<Slot>((2 * num_blocks.max(1)).next_power_of_two())
    }

    /// A map for a pool of `num_blocks` blocks (each block holds at most one entry).
    pub(crate) fn with_capacity(num_blocks: usize) -> Result<Self, AllocFailed> {
        let shards = (num_blocks / MIN_PER_SHARD).clamp(1, MAX_SHARDS);
        let shards = if shards.is_power_of_two() {
            shards
        } else {
            shards.next_power_of_two() / 2
        };
        let total = (2 * num_blocks.max(1)).next_power_of_two();
        let per_shard = (total / shards).max(MIN_SLOTS);
        Ok(CacheMap {
            shards: (0..shards).map(|_| Shard::new()).collect(),
            first: new_table(shards * per_shard)?,
            first_len: per_shard,
            salt: salt(),
            shard_shift: 64 - shards.trailing_zeros(),
        })
    }

    /// One shard of `slots` slots (model checks: growth after a few inserts).
    #[cfg(test)]
    fn with_table_slots(slots: usize) -> Self {
        CacheMap {
            shards: vec![Shard::new()].into_boxed_slice(),
            first: new_table(slots).unwrap(),
            first_len: slots,
            salt: salt(),
            shard_shift: 64,
        }
    }

    /// The index of the shard of mix `h`.
    #[inline]
    fn shard_index(&self, h: u64) -> usize {
        // `checked_shr`: one shard gives a shift of 64.
        h.checked_shr(self.shard_shift).unwrap_or(0) as usize
    }

    /// Shard `index`'s first table (its part of the array).
    #[inline]
    fn first_table(&self, index: usize) -> &[Slot] {
        &self.first[index * self.first_len..][..self.first_len]
    }

    /// The shard of mix `h` and its first table.
    #[inline]
    fn shard(&self, h: u64) -> (&Shard, &[Slot]) {
        let index = self.shard_index(h);
        (&self.shards[index], self.first_table(index))
    }

    /// The live table of shard `index`.
    #[cfg(test)]
    fn live_table(&self, index: usize) -> &[Slot] {
        self.shards[index].table(self.first_table(index), Ordering::Acquire)
    }

    /// Number of distinct keys (vLLM's `len(cached_block_hash_to_block)`).
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.keys.load(Ordering::Relaxed))
            .sum()
    }

    /// Starts loading the cache lines `first(key)` (or `insert(key, _)`) will read first (the
    /// shard's header and the key's home slot), so that accesses walked in a known order
    /// overlap their memory latency. A hint (x86_64's prefetch instruction; nothing elsewhere):
    /// it changes nothing, and the access itself still goes through the seqlock. It loads
    /// nothing itself: the home slot's address follows from the key alone, in the first table
    /// (in a shard that has grown, a rare case, that line is not the one the access reads).
    #[inline]
    pub(crate) fn prefetch(&self, key: &CacheKey) {
        #[cfg(not(loom))]
        {
            let (lo, hi) = key_parts(key);
            let h = mix(self.salt, lo, hi, key.group);
            let index = self.shard_index(h);
            let home = index * self.first_len + (h as usize & (self.first_len - 1));
            if let (Some(shard), Some(slot)) = (self.shards.get(index), self.first.get(home)) {
                crate::sync::prefetch(shard);
                crate::sync::prefetch(slot);
            }
        }
        #[cfg(loom)]
        let _ = key;
    }

    /// The first inserted block still mapped under `key`.
    #[inline]
    pub(crate) fn first(&self, key: &CacheKey) -> Option<BlockId> {
        let (lo, hi) = key_parts(key);
        let h = mix(self.salt, lo, hi, key.group);
        let (shard, first) = self.shard(h);
        let mut spins = 0u32;
        loop {
            let s1 = shard.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                backoff(&mut spins);
                continue;
            }
            let table = shard.table(first, Ordering::Acquire);
            let mask = table.len() - 1;
            let mut i = h as usize & mask;
            let mut found = None;
            // Bounded: a torn view (which the re-check below rejects) must not loop forever.
            for _ in 0..table.len() {
                let slot = &table[i];
                let meta = slot.meta.load(Ordering::Acquire);
                if meta == EMPTY {
                    break;
                }
                if slot_matches(slot, meta, lo, hi, key.group) {
                    found = Some(meta_id(meta));
                    break;
                }
                i = (i + 1) & mask;
            }
            // The loads above are `Acquire`, so this load cannot move before them.
            if shard.seq.load(Ordering::Relaxed) == s1 {
                return found;
            }
            backoff(&mut spins);
        }
    }

    /// Maps `id` under `key` after any blocks already there (a no-op if it already is).
    /// `false` (nothing changed) only if the shard's table is full and could not grow.
    pub(crate) fn insert(&self, key: CacheKey, id: BlockId) -> bool {
        debug_assert_ne!(id, 0, "the null block is never cached");
        let (lo, hi) = key_parts(&key);
        let h = mix(self.salt, lo, hi, key.group);
        let (shard, first) = self.shard(h);
        let odd = shard.lock();
        let entries = shard.entries.load(Ordering::Relaxed);
        let len = shard.table(first, Ordering::Relaxed).len();
        if (entries + 1) * 4 > len * 3 && !self.grow(shard, first) && entries + 2 > len {
            // Keep one empty slot: probes end at an empty slot.
            shard.unlock(odd);
            return false;
        }
        let table = shard.table(first, Ordering::Relaxed);
        let mask = table.len() - 1;
        let mut i = h as usize & mask;
        let mut duplicate = false;
        loop {
            let slot = &table[i];
            let meta = slot.meta.load(Ordering::Relaxed);
            if meta == EMPTY {
                break;
            }
            if slot_matches(slot, meta, lo, hi, key.group) {
                if meta_id(meta) == id {
                    shard.unlock(odd);
                    return true;
                }
                duplicate = true;
            }
            i = (i + 1) & mask;
        }
        let slot = &table[i];
        slot.lo.store(lo, Ordering::Release);
        slot.hi.store(hi, Ordering::Release);
        slot.meta.store(pack_meta(key.group, id), Ordering::Release);
        shard.entries.store(entries + 1, Ordering::Relaxed);
        if !duplicate {
            let keys = shard.keys.load(Ordering::Relaxed);
            shard.keys.store(keys + 1, Ordering::Relaxed);
        }
        shard.unlock(odd);
        true
    }

    /// Doubles the shard's table (under its lock), keeping each cluster's order. `false` if the
    /// new table cannot be allocated (the shard keeps its table).
    #[cold]
    fn grow(&self, shard: &Shard, first: &[Slot]) -> bool {
        let level = shard.current.load(Ordering::Relaxed);
        let old = shard.table(first, Ordering::Relaxed);
        let Some(slot) = shard.grown.get(level) else {
            return false;
        };
        if slot.get().is_none() {
            match new_table(old.len().saturating_mul(2)) {
                Ok(table) => {
                    let _ = slot.set(table);
                }
                Err(_) => return false,
            }
        }
        let Some(new) = slot.get() else {
            return false;
        };
        let new_mask = new.len() - 1;
        // Start at an empty slot so that every cluster is copied front to back (duplicates of a
        // key keep their order even where a cluster wraps around the end). There is one: an
        // insert never takes a table's last empty slot.
        let Some(start) = old
            .iter()
            .position(|s| s.meta.load(Ordering::Relaxed) == EMPTY)
        else {
            return false;
        };
        for k in 0..old.len() {
            let slot = &old[(start + k) % old.len()];
            let meta = slot.meta.load(Ordering::Relaxed);
            if meta == EMPTY {
                continue;
            }
            let (lo, hi) = (
                slot.lo.load(Ordering::Relaxed),
                slot.hi.load(Ordering::Relaxed),
            );
            let mut i = mix(self.salt, lo, hi, meta_group(meta)) as usize & new_mask;
            while new[i].meta.load(Ordering::Relaxed) != EMPTY {
                i = (i + 1) & new_mask;
            }
            new[i].lo.store(lo, Ordering::Release);
            new[i].hi.store(hi, Ordering::Release);
            new[i].meta.store(meta, Ordering::Release);
        }
        shard.current.store(level + 1, Ordering::Release);
        true
    }

    /// Removes `id` from `key`; the key goes when its last block does. Returns whether `id` was
    /// mapped under `key`.
    pub(crate) fn remove(&self, key: &CacheKey, id: BlockId) -> bool {
        let (lo, hi) = key_parts(key);
        let h = mix(self.salt, lo, hi, key.group);
        let (shard, first) = self.shard(h);
        let odd = shard.lock();
        let table = shard.table(first, Ordering::Relaxed);
        let mask = table.len() - 1;
        let mut i = h as usize & mask;
        let mut duplicate = false;
        loop {
            let slot = &table[i];
            let meta = slot.meta.load(Ordering::Relaxed);
            if meta == EMPTY {
                shard.unlock(odd);
                return false;
            }
            if slot_matches(slot, meta, lo, hi, key.group) {
                if meta_id(meta) == id {
                    break;
                }
                duplicate = true;
            }
            i = (i + 1) & mask;
        }
        // Backward-shift deletion: move later members of the cluster into the hole when their
        // home allows it, until an empty slot ends the cluster.
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let slot = &table[j];
            let meta = slot.meta.load(Ordering::Relaxed);
            if meta == EMPTY {
                break;
            }
            let (slo, shi) = (
                slot.lo.load(Ordering::Relaxed),
                slot.hi.load(Ordering::Relaxed),
            );
            let group = meta_group(meta);
            if !duplicate && group == key.group && slo == lo && shi == hi {
                duplicate = true;
            }
            let home = mix(self.salt, slo, shi, group) as usize & mask;
            // The entry may move back to `hole` if its home is not in (hole, j].
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                let dst = &table[hole];
                dst.lo.store(slo, Ordering::Release);
                dst.hi.store(shi, Ordering::Release);
                dst.meta.store(meta, Ordering::Release);
                hole = j;
            }
        }
        table[hole].meta.store(EMPTY, Ordering::Release);
        let entries = shard.entries.load(Ordering::Relaxed);
        shard.entries.store(entries - 1, Ordering::Relaxed);
        if !duplicate {
            let keys = shard.keys.load(Ordering::Relaxed);
            shard.keys.store(keys - 1, Ordering::Relaxed);
        }
        shard.unlock(odd);
        true
    }

    /// Empties the map (each shard under its lock; lookups meanwhile see a shard before or
    /// after).
    #[cfg(test)]
    pub(crate) fn clear(&self) {
        for (index, shard) in self.shards.iter().enumerate() {
            let odd = shard.lock();
            for slot in self.live_table(index).iter() {
                slot.meta.store(EMPTY, Ordering::Release);
            }
            shard.entries.store(0, Ordering::Relaxed);
            shard.keys.store(0, Ordering::Relaxed);
            shard.unlock(odd);
        }
    }

    /// Checks the table invariants (every entry reachable from its home without crossing an
    /// empty slot, counters right). Only while no other thread uses the map.
    #[cfg(test)]
    pub(crate) fn validate(&self) {
        for (index, shard) in self.shards.iter().enumerate() {
            let table = self.live_table(index);
            let mask = table.len() - 1;
            let mut entries = 0;
            let mut keys = std::collections::HashSet::new();
            for (j, slot) in table.iter().enumerate() {
                let meta = slot.meta.load(Ordering::Acquire);
                if meta == EMPTY {
                    continue;
                }
                entries += 1;
                let (lo, hi) = (
                    slot.lo.load(Ordering::Acquire),
                    slot.hi.load(Ordering::Acquire),
                );
                keys.insert((lo, hi, meta_group(meta)));
                let mut i = mix(self.salt, lo, hi, meta_group(meta)) as usize & mask;
                while i != j {
                    assert_ne!(table[i].meta.load(Ordering::Acquire), EMPTY, "unreachable");
                    i = (i + 1) & mask;
                }
            }
            assert_eq!(shard.entries.load(Ordering::Acquire), entries);
            assert_eq!(shard.keys.load(Ordering::Acquire), keys.len());
        }
    }
}

/// Two distinct keys of group 0 with the same shard and home slot in a map for `num_blocks`.
#[cfg(test)]
fn colliding_keys(map: &CacheMap, count: usize) -> Vec<CacheKey> {
    let key = |i: u128| CacheKey {
        hash: crate::types::BlockHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)),
        group: 0,
    };
    let place = |k: &CacheKey| {
        let (lo, hi) = key_parts(k);
        let h = mix(map.salt, lo, hi, k.group);
        let shard = h.checked_shr(map.shard_shift).unwrap_or(0);
        let slots = map.live_table(shard as usize).len() as u64;
        (shard, h & (slots - 1))
    };
    let target = place(&key(1));
    (1..)
        .map(key)
        .filter(|k| place(k) == target)
        .take(count)
        .collect()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::types::BlockHash;

    /// A plain model: `(key, id)` pairs in insertion order.
    struct Model(Vec<(CacheKey, BlockId)>);

    impl Model {
        fn first(&self, key: &CacheKey) -> Option<BlockId> {
            self.0.iter().find(|(k, _)| k == key).map(|&(_, id)| id)
        }
        fn keys(&self) -> usize {
            let mut keys: Vec<CacheKey> = self.0.iter().map(|&(k, _)| k).collect();
            keys.sort_unstable();
            keys.dedup();
            keys.len()
        }
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// A key's home slot is where its mix alone says in the map's array of first tables (what
    /// `prefetch` loads without reading a shard's header) until its shard grows; a shard's
    /// header is one cache line of its own; a grown shard's lookups still find their keys.
    #[test]
    fn a_keys_home_slot_follows_from_its_mix_and_growth_keeps_every_key() {
        use std::mem::{align_of, size_of};
        assert_eq!(align_of::<Shard>(), 128);
        assert_eq!(size_of::<Shard>(), 128);
        let big = CacheMap::with_capacity(100_000).unwrap();
        assert!(big.shards.len() > 1);
        let key = |i: u128| CacheKey {
            hash: crate::types::BlockHash(
                i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835),
            ),
            group: 3,
        };
        let mut homes = std::collections::HashSet::new();
        for i in 1..=2000u32 {
            let k = key(i as u128);
            let (lo, hi) = key_parts(&k);
            let h = mix(big.salt, lo, hi, k.group);
            let index = big.shard_index(h);
            let home = index * big.first_len + (h as usize & (big.first_len - 1));
            if !homes.insert(home) {
                continue;
            }
            // An empty home: the insert lands there, in shard `index`'s part of the array.
            assert!(big.insert(k, i));
            let slot = &big.first[home];
            assert_eq!(meta_id(slot.meta.load(Ordering::Relaxed)), i);
            assert_eq!(
                (
                    slot.lo.load(Ordering::Relaxed),
                    slot.hi.load(Ordering::Relaxed)
                ),
                (lo, hi)
            );
            assert_eq!(big.shards[index].entries.load(Ordering::Relaxed), {
                let first = big.first_table(index);
                first
                    .iter()
                    .filter(|s| s.meta.load(Ordering::Relaxed) != EMPTY)
                    .count()
            });
        }
        big.validate();
        let map = CacheMap::with_table_slots(MIN_SLOTS);
        let key = |i: u128| CacheKey {
            hash: crate::types::BlockHash(
                i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835),
            ),
            group: 1,
        };
        for i in 1..=200u32 {
            assert!(map.insert(key(i as u128), i));
        }
        assert!(
            map.shards[0].current.load(Ordering::Relaxed) >= 4,
            "the shard grew"
        );
        for i in 1..=200u32 {
            assert_eq!(map.first(&key(i as u128)), Some(i));
        }
        assert_eq!(map.first(&key(201)), None);
    }

    /// One block hash's keys in a layout's groups have neighbouring home slots in one shard
    /// (a lookup of each group's block of a hash reads the lines the first one loaded), and
    /// each is found there.
    #[test]
    fn one_hashs_keys_in_several_groups_sit_in_neighbouring_slots() {
        let map = CacheMap::with_capacity(100_000).unwrap();
        assert!(map.shards.len() > 1);
        for i in 1..=50u32 {
            let hash =
                BlockHash(u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835));
            let key = |group| CacheKey { hash, group };
            let (lo, hi) = key_parts(&key(0));
            let index = map.shard_index(mix(map.salt, lo, hi, 0));
            let homes: Vec<usize> = (0..7u32)
                .map(|group| {
                    let h = mix(map.salt, lo, hi, group);
                    assert_eq!(
                        map.shard_index(h),
                        index,
                        "group {group} in the hash's shard"
                    );
                    h as usize & (map.first_len - 1)
                })
                .collect();
            for pair in homes.windows(2) {
                assert_eq!(pair[1], (pair[0] + 1) & (map.first_len - 1));
            }
            for group in 0..7u32 {
                assert!(map.insert(key(group), i * 8 + group + 1));
            }
            for group in 0..7u32 {
                assert_eq!(map.first(&key(group)), Some(i * 8 + group + 1));
            }
        }
        map.validate();
    }

    /// Random inserts and removals over few keys (many duplicates, long clusters that wrap
    /// around the table's end, growth) agree with the model after every step.
    #[test]
    fn map_matches_a_plain_model_under_random_operations() {
        for (num_blocks, num_keys, ids) in [(8, 3, 40), (64, 10, 60), (300, 40, 400)] {
            let map = CacheMap::with_capacity(num_blocks).unwrap();
            let mut keys = colliding_keys(&map, num_keys / 2);
            keys.extend((0..num_keys as u128).map(|i| CacheKey {
                hash: BlockHash(i * 7919),
                group: (i % 2) as u32,
            }));
            // One hash in many groups: runs of neighbouring home slots.
            keys.extend((0..8).map(|group| CacheKey {
                hash: BlockHash(104_729),
                group,
            }));
            let mut model = Model(Vec::new());
            let mut rng = 0x1234_5678_9abc_def1u64;
            for _ in 0..20_000 {
                let r = xorshift(&mut rng);
                let id = (r % ids as u64) as BlockId + 1;
                let held = model.0.iter().position(|&(_, b)| b == id);
                match held {
                    Some(pos) => {
                        let (key, _) = model.0.remove(pos);
                        assert!(map.remove(&key, id));
                        assert!(!map.remove(&key, id));
                    }
                    None => {
                        let key = keys[(r >> 32) as usize % keys.len()];
                        map.insert(key, id);
                        model.0.push((key, id));
                    }
                }
                assert_eq!(map.len(), model.keys());
                for key in &keys {
                    assert_eq!(map.first(key), model.first(key));
                }
            }
            map.validate();
            map.clear();
            map.validate();
            assert_eq!(map.len(), 0);
            assert!(keys.iter().all(|k| map.first(k).is_none()));
        }
    }

    #[test]
    fn a_shard_that_cannot_grow_refuses_the_insert_that_would_fill_it() {
        let map = CacheMap::with_table_slots(4);
        let keys: Vec<CacheKey> = (1..=4u128)
            .map(|i| CacheKey {
                hash: BlockHash(i * 7919),
                group: 0,
            })
            .collect();
        for (i, &key) in keys[..3].iter().enumerate() {
            assert!(map.insert(key, i as BlockId + 1));
        }
        // The fourth entry needs a bigger table; its allocation fails.
        crate::pool::alloc::inject::fail_after(Some(0));
        let inserted = map.insert(keys[3], 4);
        crate::pool::alloc::inject::fail_after(None);
        assert!(!inserted, "the last empty slot is kept");
        assert_eq!(map.first(&keys[3]), None);
        assert_eq!(map.len(), 3);
        map.validate();
        for (i, key) in keys[..3].iter().enumerate() {
            assert_eq!(map.first(key), Some(i as BlockId + 1));
        }
        assert!(map.remove(&keys[0], 1));
        // With memory available again the table grows.
        assert!(map.insert(keys[0], 1));
        assert!(map.insert(keys[3], 4));
        assert_eq!(map.len(), 4);
        map.validate();
    }

    #[test]
    fn removal_shifts_a_colliding_key_back_and_keeps_duplicate_order() {
        let map = CacheMap::with_capacity(16).unwrap();
        let keys = colliding_keys(&map, 2);
        map.insert(keys[0], 1);
        map.insert(keys[1], 2);
        map.insert(keys[0], 3);
        map.insert(keys[1], 4);
        assert_eq!(map.len(), 2);
        assert!(map.remove(&keys[0], 1));
        assert_eq!(map.first(&keys[0]), Some(3));
        assert_eq!(map.first(&keys[1]), Some(2));
        assert!(map.remove(&keys[1], 2));
        assert_eq!(map.first(&keys[1]), Some(4));
        assert_eq!(map.len(), 2);
        assert!(map.remove(&keys[0], 3));
        assert_eq!(map.len(), 1);
        map.validate();
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::pool::loom_tests::model;
    use crate::types::BlockHash;
    use loom::sync::Arc;
    use loom::thread;

    /// A lookup racing a removal that shifts its key back into the hole still finds the key.
    #[test]
    fn loom_lookup_during_backward_shift_finds_the_moved_key() {
        model("map_lookup_during_backward_shift", 5, || {
            let map = Arc::new(CacheMap::with_capacity(4).unwrap());
            let keys = colliding_keys(&map, 2);
            map.insert(keys[0], 1);
            map.insert(keys[1], 2);
            let m2 = map.clone();
            let (k0, k1) = (keys[0], keys[1]);
            let reader = thread::spawn(move || {
                assert_eq!(m2.first(&k1), Some(2));
                let first0 = m2.first(&k0);
                assert!(first0 == Some(1) || first0.is_none());
            });
            assert!(map.remove(&k0, 1));
            reader.join().unwrap();
            assert_eq!(map.first(&keys[0]), None);
            assert_eq!(map.len(), 1);
            map.validate();
        });
    }

    /// A duplicate inserted and the first block removed while a lookup runs: the lookup never
    /// misses the key, and the distinct-key count ends exact.
    #[test]
    fn loom_lookup_during_duplicate_handover_never_misses() {
        model("map_lookup_during_duplicate_handover", 5, || {
            let map = Arc::new(CacheMap::with_capacity(4).unwrap());
            let key = colliding_keys(&map, 1)[0];
            map.insert(key, 1);
            // Readers run in spawned threads: loom explores their loads against the main
            // thread's stores.
            let m2 = map.clone();
            let reader = thread::spawn(move || {
                let seen = m2.first(&key);
                assert!(seen == Some(1) || seen == Some(2), "{seen:?}");
            });
            // Always at least one block under the key: 1, then 1 and 2, then 2.
            map.insert(key, 2);
            assert!(map.remove(&key, 1));
            reader.join().unwrap();
            assert_eq!(map.first(&key), Some(2));
            assert_eq!(map.len(), 1);
            map.validate();
        });
    }

    /// Two inserts of one key: both kept, counted once.
    #[test]
    fn loom_concurrent_duplicate_inserts_count_one_key() {
        model("map_concurrent_duplicate_inserts", 5, || {
            let map = Arc::new(CacheMap::with_capacity(4).unwrap());
            let key = colliding_keys(&map, 1)[0];
            let m2 = map.clone();
            let t = thread::spawn(move || m2.insert(key, 1));
            map.insert(key, 2);
            t.join().unwrap();
            assert_eq!(map.len(), 1);
            let first = map.first(&key).unwrap();
            let other = 3 - first;
            assert!(map.remove(&key, first));
            assert_eq!(map.first(&key), Some(other));
            map.validate();
        });
    }

    /// Issue 9 B.4, map growth: a lookup racing an insert that doubles the shard's table finds
    /// every key that was there throughout, in the old table or the new one.
    #[test]
    fn loom_lookup_during_growth_finds_every_key() {
        model("map_lookup_during_growth", 5, || {
            let map = Arc::new(CacheMap::with_table_slots(4));
            let keys: Vec<CacheKey> = (1..=4u128)
                .map(|i| CacheKey {
                    hash: BlockHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)),
                    group: 0,
                })
                .collect();
            for (i, &key) in keys[..3].iter().enumerate() {
                map.insert(key, i as BlockId + 1);
            }
            let m2 = map.clone();
            let (k0, k2) = (keys[0], keys[2]);
            let reader = thread::spawn(move || {
                assert_eq!(m2.first(&k0), Some(1));
                assert_eq!(m2.first(&k2), Some(3));
            });
            let m3 = map.clone();
            let k3 = keys[3];
            // The fourth entry passes 3/4 of four slots: the table doubles under the reader.
            let writer = thread::spawn(move || assert!(m3.insert(k3, 4)));
            reader.join().unwrap();
            writer.join().unwrap();
            assert_eq!(map.live_table(0).len(), 8, "grown");
            for (i, key) in keys.iter().enumerate() {
                assert_eq!(map.first(key), Some(i as BlockId + 1));
            }
            assert_eq!(map.len(), 4);
            map.validate();
        });
    }
}
