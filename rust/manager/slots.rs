//! The manager's requests: states in reusable slots, named by id or by a generation-checked
//! [`RequestHandle`].

use crate::error::{CoreError, Result};
use crate::types::RequestMap;

/// A request's slot in a [`KVCacheManager`](super::KVCacheManager), returned by `add_request`:
/// naming a request by its handle skips the id lookup. A handle goes stale when its request is
/// removed (a later request may reuse the slot, under a new generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestHandle {
    slot: u32,
    generation: u32,
}

/// Names a request in [`KVCacheManager`](super::KVCacheManager) calls: by id (`&str`) or by
/// [`RequestHandle`].
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

/// Values in slots, with an id index; slots of removed values are reused.
pub(crate) struct Slots<T> {
    slots: Vec<Slot<T>>,
    free_slots: Vec<u32>,
    ids: RequestMap<u32>,
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            slots: Vec::new(),
            free_slots: Vec::new(),
            ids: RequestMap::default(),
        }
    }
}

impl<T> Slots<T> {
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    pub(crate) fn contains(&self, id: &str) -> bool {
        self.ids.contains_key(id)
    }

    pub(crate) fn handle(&self, id: &str) -> Result<RequestHandle> {
        match self.ids.get(id) {
            Some(&slot) => Ok(RequestHandle {
                slot,
                generation: self.slots[slot as usize].generation,
            }),
            None => Err(CoreError::UnknownRequest(id.to_owned())),
        }
    }

    /// The slot `key` names. A live handle is resolved inline; ids and errors take the slow path.
    #[inline]
    fn index(&self, key: RequestKey<'_>) -> Result<usize> {
        if let RequestKey::Handle(h) = key {
            if let Some(s) = self.slots.get(h.slot as usize) {
                if s.generation == h.generation && s.value.is_some() {
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
                None => Err(CoreError::UnknownRequest(id.to_owned())),
            },
            RequestKey::Handle(h) => Err(CoreError::StaleHandle { slot: h.slot }),
        }
    }

    #[inline]
    pub(crate) fn get(&self, key: RequestKey<'_>) -> Result<&T> {
        let i = self.index(key)?;
        Ok(self.slots[i]
            .value
            .as_ref()
            .expect("index checks occupancy"))
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: RequestKey<'_>) -> Result<&mut T> {
        let i = self.index(key)?;
        Ok(self.slots[i]
            .value
            .as_mut()
            .expect("index checks occupancy"))
    }

    /// Stores `value` under `id` (the caller checked `id` is new).
    pub(crate) fn insert(&mut self, id: String, value: T) -> RequestHandle {
        debug_assert!(!self.ids.contains_key(&id));
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    value: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.value = Some(value);
        self.ids.insert(id, slot);
        RequestHandle {
            slot,
            generation: entry.generation,
        }
    }

    /// Removes the value `key` names; `id_of` gives its id (to drop the index entry).
    pub(crate) fn remove(&mut self, key: RequestKey<'_>, id_of: impl Fn(&T) -> &str) -> Result<T> {
        let i = self.index(key)?;
        let entry = &mut self.slots[i];
        let value = entry.value.take().expect("index checks occupancy");
        entry.generation = entry.generation.wrapping_add(1);
        self.ids.remove(id_of(&value));
        self.free_slots.push(i as u32);
        Ok(value)
    }
}
