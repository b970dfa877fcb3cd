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
    /// Its history's size, each message written as JSON: its weight against the cache's
    /// budget of bytes (kept as the history is written, never measured
    /// again).
    pub(crate) bytes: u64,
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
/// Two bounds keep its memory: a number of sessions, and a number of bytes
/// of their histories (their size written as JSON, as the store holds
/// them; a machine in memory takes about as much again). The least
/// recently used sessions make room for a new one; a session whose
/// history alone is over the budget of bytes is not kept.
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
    inner: Arc<Mutex<Parking>>,
}

/// The parked machines, and the bytes of their histories.
struct Parking {
    lru: LruCache<SessionId, Parked>,
    bytes: u64,
    max_bytes: u64,
}

impl Parking {
    /// Takes `id`'s machine out, and its bytes from the total.
    fn pop(&mut self, id: &SessionId) -> Option<Parked> {
        let parked = self.lru.pop(id)?;
        self.bytes = self.bytes.saturating_sub(parked.bytes);
        Some(parked)
    }
}

impl std::fmt::Debug for SessionCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parking = self.lock();
        f.debug_struct("SessionCache")
            .field("len", &parking.lru.len())
            .field("capacity", &parking.lru.cap())
            .field("bytes", &parking.bytes)
            .field("max_bytes", &parking.max_bytes)
            .finish()
    }
}

impl SessionCache {
    /// A cache of at most `sessions` machines, whose histories take at
    /// most `max_bytes` written as JSON.
    pub fn new(sessions: NonZeroUsize, max_bytes: u64) -> Self {
        SessionCache {
            inner: Arc::new(Mutex::new(Parking {
                lru: LruCache::new(sessions),
                bytes: 0,
                max_bytes,
            })),
        }
    }

    /// How many machines it holds.
    pub fn len(&self) -> usize {
        self.lock().lru.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.lock().lru.is_empty()
    }

    /// The bytes of the histories it holds, written as JSON.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Whether it holds session `id`'s machine.
    pub fn contains(&self, id: &SessionId) -> bool {
        self.lock().lru.contains(id)
    }

    /// Drops session `id`'s machine (a session deleted, say).
    pub fn forget(&self, id: &SessionId) {
        let forgotten = self.lock().pop(id);
        drop(forgotten);
    }

    pub(crate) fn take(&self, id: &SessionId) -> Option<Parked> {
        self.lock().pop(id)
    }

    pub(crate) fn park(&self, id: SessionId, parked: Parked) {
        // The machines pushed out are dropped after the lock is given back.
        let mut dropped = Vec::new();
        {
            let mut parking = self.lock();
            dropped.extend(parking.pop(&id));
            if parked.bytes > parking.max_bytes {
                dropped.push(parked);
            } else {
                parking.bytes = parking.bytes.saturating_add(parked.bytes);
                if let Some((_, evicted)) = parking.lru.push(id, parked) {
                    parking.bytes = parking.bytes.saturating_sub(evicted.bytes);
                    dropped.push(evicted);
                }
                while parking.bytes > parking.max_bytes {
                    let Some((_, evicted)) = parking.lru.pop_lru() else {
                        break;
                    };
                    parking.bytes = parking.bytes.saturating_sub(evicted.bytes);
                    dropped.push(evicted);
                }
            }
        }
        drop(dropped);
    }

    fn lock(&self) -> MutexGuard<'_, Parking> {
        // Every operation leaves the map and its total whole: a panic
        // elsewhere while it was held cannot have broken them.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}
