//! The machine's queue: where messages wait for the next run.
//!
//! Enqueueing a message whose `metadata.messageId` matches a queued one
//! replaces it in place (streaming updates). Non-ephemeral messages wake
//! [`Queue::wait`]ers.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};

use markov_core::{Message, Role};
use tokio::sync::Notify;

use crate::effect::Entry;

/// A callback told of every non-ephemeral message enqueued.
pub type OnEnqueue = dyn Fn(&Message) + Send + Sync;

struct Inner {
    entries: Mutex<VecDeque<Entry>>,
    notify: Notify,
    on_enqueue: std::sync::RwLock<Option<Arc<OnEnqueue>>>,
}

/// A shared handle to a machine's queue; clone it to enqueue from elsewhere.
#[derive(Clone)]
pub struct Queue(Arc<Inner>);

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue").field("len", &self.len()).finish()
    }
}

impl Default for Queue {
    fn default() -> Self {
        Self::new()
    }
}

/// Entries taken out of a queue by [`Queue::hold_back`], put back when
/// dropped.
#[derive(Debug)]
pub struct HeldBack {
    queue: Queue,
    entries: Vec<Entry>,
}

impl HeldBack {
    /// Whether anything was held back.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many entries are held back.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

impl Drop for HeldBack {
    fn drop(&mut self) {
        if self.entries.is_empty() {
            return;
        }
        // Back in the queue, not enqueued again: the callbacks saw them.
        self.queue.entries().extend(self.entries.drain(..));
        self.queue.notify();
    }
}

/// A step's messages, and what the resolver made of them.
pub(crate) type Drained<T> = (Vec<Message>, Vec<T>);

/// The resolver's error, and the entry it refused.
pub(crate) type Refused<E> = (E, Entry);

impl Queue {
    pub(crate) fn new() -> Self {
        Queue(Arc::new(Inner {
            entries: Mutex::new(VecDeque::new()),
            notify: Notify::new(),
            on_enqueue: std::sync::RwLock::new(None),
        }))
    }

    /// Calls `callback` with every non-ephemeral message enqueued from now
    /// on (replacements included), before it joins the queue: a service
    /// that shows messages as they arrive. A second call replaces the
    /// first callback.
    pub fn set_on_enqueue(&self, callback: impl Fn(&Message) + Send + Sync + 'static) {
        *self.0.on_enqueue.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(callback));
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, VecDeque<Entry>> {
        self.0.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enqueues messages in order.
    pub fn enqueue(&self, messages: impl IntoIterator<Item = Message>) {
        self.enqueue_entries(messages.into_iter().map(Entry::message));
    }

    /// Enqueues a batch atomically (one lock), so nothing another task
    /// enqueues can land inside it: a leaf's tool calls stay next to their
    /// results. A message whose `messageId` is already queued replaces it in
    /// place when enqueued alone (streaming updates); inside a larger batch the
    /// old slot is dropped and the message joins its batch at the end.
    pub(crate) fn enqueue_entries(&self, entries: impl IntoIterator<Item = Entry>) {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let mut wake = false;
        // Callbacks run outside the lock: one may enqueue in turn.
        let on_enqueue = self
            .0
            .on_enqueue
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for entry in &entries {
            let ephemeral = entry.message.role == Role::Ephemeral;
            if !ephemeral && let Some(cb) = &on_enqueue {
                cb(&entry.message);
            }
            wake |= !ephemeral;
        }
        let alone = entries.len() == 1;
        let mut q = self.entries();
        for entry in entries {
            let slot = entry
                .message
                .metadata
                .as_ref()
                .and_then(|m| m.message_id.as_ref())
                .and_then(|id| {
                    q.iter().position(|e| {
                        e.message
                            .metadata
                            .as_ref()
                            .and_then(|m| m.message_id.as_ref())
                            == Some(id)
                    })
                });
            match slot {
                Some(i) if alone => q[i] = entry,
                Some(i) => {
                    q.remove(i);
                    q.push_back(entry);
                }
                None => q.push_back(entry),
            }
        }
        drop(q);
        if wake {
            self.0.notify.notify_waiters();
        }
    }

    /// Completes when the queue holds a non-ephemeral message.
    pub async fn wait(&self) {
        loop {
            let notified = self.0.notify.notified();
            if self
                .entries()
                .iter()
                .any(|e| e.message.role != Role::Ephemeral)
            {
                return;
            }
            notified.await;
        }
    }

    /// Wakes every waiter.
    pub fn notify(&self) {
        self.0.notify.notify_waiters();
    }

    /// How many messages wait.
    pub fn len(&self) -> usize {
        self.entries().len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries().is_empty()
    }

    /// The queued messages (copies), in order.
    pub fn messages(&self) -> Vec<Message> {
        self.entries().iter().map(|e| e.message.clone()).collect()
    }

    /// Takes every queued entry out, in order (to hold new input back while
    /// an interrupted run finishes, say).
    pub fn drain_all(&self) -> Vec<Entry> {
        self.entries().drain(..).collect()
    }

    /// Takes the message `id` out of the queue (a streamed answer whose
    /// step paused: it is recorded when the step is resumed).
    pub(crate) fn remove_message(&self, id: &markov_core::MessageId) {
        self.entries().retain(|e| {
            e.message
                .metadata
                .as_ref()
                .and_then(|m| m.message_id.as_ref())
                != Some(id)
        });
    }

    /// Takes every queued entry out until the returned guard is dropped,
    /// which puts them back, in order, after whatever the run left queued
    /// (the entries of a step it was cancelled in, which came first): input
    /// held back while a run finishes what came before it, and not lost if
    /// that run is cancelled.
    pub fn hold_back(&self) -> HeldBack {
        HeldBack {
            queue: self.clone(),
            entries: self.drain_all(),
        }
    }

    /// Puts drained entries back at the front, in order (a failed step loses nothing).
    pub fn requeue_front(&self, entries: Vec<Entry>) {
        let mut q = self.entries();
        for entry in entries.into_iter().rev() {
            q.push_front(entry);
        }
    }

    /// Drains everything but ephemerals as messages, once `resolve` has
    /// accepted each of them in order (its values are returned beside the
    /// messages). On the first refusal nothing is drained: the refused entry
    /// is removed and returned with the error, the others stay queued.
    ///
    /// The common step (no ephemeral waiting) goes from the queue straight
    /// to the step's messages, with no list of entries in between.
    pub(crate) fn drain_messages<T, E>(
        &self,
        mut resolve: impl FnMut(&Entry) -> Result<Option<T>, E>,
    ) -> Result<Drained<T>, Box<Refused<E>>> {
        let mut q = self.entries();
        if q.iter().any(|e| e.message.role == Role::Ephemeral) {
            drop(q);
            let mut entries = self.drain_non_ephemeral();
            let mut resolved = Vec::new();
            for (at, entry) in entries.iter().enumerate() {
                match resolve(entry) {
                    Ok(value) => resolved.extend(value),
                    Err(error) => {
                        let refused = entries.remove(at);
                        self.requeue_front(entries);
                        return Err(Box::new((error, refused)));
                    }
                }
            }
            return Ok((entries.into_iter().map(|e| e.message).collect(), resolved));
        }
        let mut resolved = Vec::new();
        for at in 0..q.len() {
            match resolve(&q[at]) {
                Ok(value) => resolved.extend(value),
                Err(error) => {
                    return match q.remove(at) {
                        Some(refused) => Err(Box::new((error, refused))),
                        // `at` is in range: the loop's bound is the length.
                        None => Ok((Vec::new(), Vec::new())),
                    };
                }
            }
        }
        // The deque keeps its buffer for the next step.
        Ok((q.drain(..).map(|e| e.message).collect(), resolved))
    }

    /// Drains everything but ephemerals, which stay queued for the next run.
    pub(crate) fn drain_non_ephemeral(&self) -> Vec<Entry> {
        let mut q = self.entries();
        // The common case keeps the deque's buffer for the next step.
        if q.iter().all(|e| e.message.role != Role::Ephemeral) {
            return q.drain(..).collect();
        }
        let (keep, take): (VecDeque<Entry>, VecDeque<Entry>) =
            q.drain(..).partition(|e| e.message.role == Role::Ephemeral);
        *q = keep;
        take.into()
    }
}
