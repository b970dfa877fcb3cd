//! Replays: a call whose idempotency key was already answered gets the stored
//! result, and the tool does not run again.
//!
//! The key is `provider:<tool_call_id>` (providers' call ids are stable),
//! prefixed with the leaf instance when the call has one
//! (`provider:<instance>:<tool_call_id>`), so that two machines whose
//! providers number their calls alike (`call_1`, ...) never share results.
//! The store is in memory and bounded (oldest first out). Two concurrent
//! calls with one key may both run.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use markov_core::tool::ToolExecutionResult;
use serde_json::Value;

use super::error::ToolErrorKind;
use super::service::{ToolLayer, ToolRequest, ToolService};

#[derive(Debug, Clone)]
struct Stored {
    result: ToolExecutionResult,
    error: Option<ToolErrorKind>,
    intents: Vec<Value>,
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<String, Stored>,
    order: VecDeque<String>,
}

/// The in-memory, bounded store of answered calls.
#[derive(Debug)]
pub struct IdempotencyStore {
    capacity: usize,
    entries: Mutex<Entries>,
}

impl Default for IdempotencyStore {
    fn default() -> Self {
        Self::new(1024)
    }
}

impl IdempotencyStore {
    /// A store keeping the last `capacity` results (at least one).
    pub fn new(capacity: usize) -> Self {
        IdempotencyStore {
            capacity: capacity.max(1),
            entries: Mutex::new(Entries::default()),
        }
    }

    /// The key of a request.
    pub fn key(req: &ToolRequest<'_>) -> String {
        match req.cx.instance_id() {
            Some(instance) => format!("provider:{instance}:{}", req.call_id),
            None => format!("provider:{}", req.call_id),
        }
    }

    /// How many results are stored.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, key: &str) -> Option<Stored> {
        self.lock().map.get(key).cloned()
    }

    fn insert(&self, key: String, stored: Stored) {
        let mut entries = self.lock();
        if entries.map.insert(key.clone(), stored).is_none() {
            entries.order.push_back(key);
        }
        while entries.map.len() > self.capacity {
            match entries.order.pop_front() {
                Some(old) => {
                    entries.map.remove(&old);
                }
                None => break,
            }
        }
    }
}

/// The idempotency stage's layer.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    store: Arc<IdempotencyStore>,
}

impl IdempotencyLayer {
    /// A layer over `store`.
    pub fn new(store: Arc<IdempotencyStore>) -> Self {
        IdempotencyLayer { store }
    }
}

impl<S> ToolLayer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            store: Arc::clone(&self.store),
        }
    }
}

/// A service behind the idempotency stage.
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    store: Arc<IdempotencyStore>,
}

impl<S: ToolService> ToolService for Idempotency<S> {
    fn call<'a>(&'a self, req: ToolRequest<'a>) -> BoxFuture<'a, ToolExecutionResult> {
        let key = IdempotencyStore::key(&req);
        if let Some(stored) = self.store.get(&key) {
            tracing::debug!(key = %key, "idempotent replay: the stored result is returned");
            if let Some(kind) = stored.error {
                req.report.set_error(kind);
            }
            req.report.set_intents(stored.intents);
            return Box::pin(std::future::ready(stored.result));
        }
        let report = req.report;
        Box::pin(async move {
            let result = self.inner.call(req).await;
            self.store.insert(
                key,
                Stored {
                    result: result.clone(),
                    error: report.error_kind(),
                    intents: report.intents(),
                },
            );
            result
        })
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("idempotency");
        self.inner.stages(out);
    }
}
