//! [`SessionCache`]: machines a worker released, kept to open their sessions
//! again without reading their history back.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard};

use lru::LruCache;
use markov_executor::{Agent, Machine};

use crate::{Revision, SessionId};

/// A machine released at `revision`, restored over `agent`.
pub(crate) struct Parked {
    pub(crate) machine: Machine,
    pub(crate) revision: Revision,
    pub(crate) agent: Agent,
}

/// The machines of sessions this worker released, the most recently used
/// ones, so that the next message of a busy session does not read and
/// decode its whole history again (and the provider's encoded-request cache
/// of that history keeps working across turns).
///
/// A session opened with a cache ([`OpenOptions::cache`]) is parked in it
/// by [`DurableMachine::release`] when it is at rest (everything written,
/// no run to continue, no input queued). Opening it again takes the parked
/// machine only if the session's [`Revision`] is still the one it was
/// released at — no worker wrote it in between — and it was restored over
/// the same [`Agent`]; otherwise the session is loaded from the store as
/// without a cache. The lease is given up on release as always, so any
/// worker may take the session meanwhile; holding no idle leases keeps a
/// load balancer free to send a session's next message anywhere.
///
/// In test and debug builds, every machine taken from the cache is also
/// loaded from the store and the two are compared, so every test that
/// opens a session twice checks that the parked machine is the stored one.
///
/// Cheap to clone: clones share one cache.
///
/// [`OpenOptions::cache`]: crate::OpenOptions::cache
/// [`DurableMachine::release`]: crate::DurableMachine::release
#[derive(Clone)]
pub struct SessionCache {
    inner: Arc<Mutex<LruCache<SessionId, Parked>>>,
}

impl std::fmt::Debug for SessionCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lru = self.lock();
        f.debug_struct("SessionCache")
            .field("len", &lru.len())
            .field("capacity", &lru.cap())
            .finish()
    }
}

impl SessionCache {
    /// A cache of at most `capacity` machines; the least recently used one
    /// is dropped to make room.
    pub fn new(capacity: NonZeroUsize) -> Self {
        SessionCache {
            inner: Arc::new(Mutex::new(LruCache::new(capacity))),
        }
    }

    /// How many machines it holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Whether it holds session `id`'s machine.
    pub fn contains(&self, id: &SessionId) -> bool {
        self.lock().contains(id)
    }

    /// Drops session `id`'s machine (a session deleted, say).
    pub fn forget(&self, id: &SessionId) {
        self.lock().pop(id);
    }

    pub(crate) fn take(&self, id: &SessionId) -> Option<Parked> {
        self.lock().pop(id)
    }

    pub(crate) fn park(&self, id: SessionId, parked: Parked) {
        // The machine pushed out is dropped after the lock is given back.
        let evicted = self.lock().push(id, parked);
        drop(evicted);
    }

    fn lock(&self) -> MutexGuard<'_, LruCache<SessionId, Parked>> {
        // Every operation leaves the map whole: a panic elsewhere while it
        // was held cannot have broken it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}
