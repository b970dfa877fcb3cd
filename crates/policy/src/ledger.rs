//! The idempotency ledger: the answered calls of one conversation
//! ([`IdempotencyLedger`]), what an entry keeps, and its limits.
//!
//! The key is `t<turn>:<instance>:<tool_call_id>`: the conversation's user
//! turn, the leaf instance the call runs for, and the provider's call id.
//! An entry binds the key to the tool and its exact arguments. The ledger
//! belongs to one conversation (a machine's
//! [`PolicyState`](crate::PolicyState)) and travels with it in the
//! machine's snapshot. Entries of earlier turns expire after
//! [`IdempotencyLimits::ttl`] and are bounded in entries and in bytes
//! (oldest first out); entries of the current turn are never evicted, since
//! a resumed step may still need them. A result too large to keep whole
//! (over a quarter of [`IdempotencyLimits::max_bytes`]) is kept as a stub:
//! the key, the tool, a digest of the arguments and a note that the call
//! completed, which is what a replay then answers.
//!
//! What the idempotency stage does with the ledger — replays, conflicts,
//! at-most-once calls — is said in its own file.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::channel::oneshot;
use markov_core::ids::{InstanceId, ToolCallId};
use markov_core::tool::{TerminateResponse, ToolExecutionResult, UserMessage};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// How long answered calls are kept and how much room they may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotencyLimits {
    /// How long an answer is replayed.
    pub ttl: Duration,
    /// Answers kept at most.
    pub max_entries: usize,
    /// Approximate bytes of keys, arguments and results kept at most.
    pub max_bytes: usize,
}

impl Default for IdempotencyLimits {
    /// A day, 4 096 answers, 8 MiB.
    fn default() -> Self {
        IdempotencyLimits {
            ttl: Duration::from_secs(24 * 60 * 60),
            max_entries: 4096,
            max_bytes: 8 << 20,
        }
    }
}

/// A recorded result, as a snapshot stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredResult {
    /// The text the model read.
    pub content: String,
    /// Whether the call failed.
    pub is_error: bool,
    /// Whether it was a successful terminal call.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_terminal: bool,
    /// Set when the tool asked to end the run: its message, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminate: Option<Option<String>>,
    /// Text for the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_message: Option<UserMessage>,
}

impl StoredResult {
    /// The record of `result`. Its images are not kept (a ledger holds
    /// text, within its byte limit): a replay reads each one's note.
    pub(crate) fn of(result: &ToolExecutionResult) -> Self {
        let mut content = result.content.clone();
        for image in &result.images {
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&image.note());
        }
        StoredResult {
            content,
            is_error: result.is_error,
            is_terminal: result.is_terminal,
            terminate: result.terminate.as_ref().map(|t| t.message.clone()),
            user_message: result.user_message.clone(),
        }
    }

    pub(crate) fn to_result(&self, call_id: &markov_core::ids::ToolCallId) -> ToolExecutionResult {
        let mut result = if self.is_error {
            ToolExecutionResult::error(call_id.clone(), self.content.clone())
        } else {
            ToolExecutionResult::success(call_id.clone(), self.content.clone())
        };
        result.is_terminal = self.is_terminal;
        result.terminate = self.terminate.clone().map(TerminateResponse::new);
        result.user_message = self.user_message.clone();
        result
    }
}

/// One answered call: the key, what it was for, and its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LedgerEntry {
    /// The idempotency key.
    pub key: String,
    /// The tool.
    pub tool: String,
    /// The exact arguments.
    pub args: Value,
    /// The result.
    pub result: StoredResult,
    /// The error kind of a failure (its wire name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The intents of a success.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub intents: Vec<Value>,
    /// When it was recorded, in Unix milliseconds.
    pub recorded_at: u64,
    /// The user turn of the conversation the call was made in.
    #[serde(default)]
    pub turn: u64,
    /// Set when the entry is a stub of a result too large to keep: the
    /// digest of the arguments (which are then `null`), and the result's
    /// content is a note that the call completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_digest: Option<String>,
    /// The state patches the call wrote, in order (accepted or not): a
    /// replay writes them again, so the step that records the replayed
    /// result applies what the call did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_updates: Vec<Value>,
    /// Set on the entry an at-most-once call writes before its tool runs:
    /// the call started, and its result (the `INTERRUPTED` error) stands
    /// until the call's real entry replaces it. Found on resume, it means
    /// the call was interrupted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub started: bool,
    /// Set on an entry that is not an answered call but a record a running
    /// call kept in the conversation's journal
    /// ([`CallJournal`](markov_core::tool::CallJournal)): a sub-agent's
    /// model answer or one of its own ledger entries. Its key is the call's
    /// namespace ([`IdempotencyLedger::namespace_of`]), `>`, and the
    /// record's name; its tool is empty, so no call ever matches it. A
    /// record is kept whole, never as a stub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<Value>,
}

/// What separates a call's namespace from the name of a record it kept. A
/// namespace never holds it ([`IdempotencyLedger::namespace_of`] escapes
/// it), so a record's key splits at its first one, whatever the call id.
pub(crate) const RECORD_SEPARATOR: char = '>';

/// `key` as a namespace holds it: `%`, `>` and `@` escaped as `%25`, `%3E`
/// and `%40` (a key without them, as every provider's call ids make, is
/// itself).
fn escape_key(key: &str) -> std::borrow::Cow<'_, str> {
    if !key.contains(['%', '>', '@']) {
        return std::borrow::Cow::Borrowed(key);
    }
    let mut out = String::with_capacity(key.len() + 8);
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '>' => out.push_str("%3E"),
            '@' => out.push_str("%40"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The call key and answer length `namespace` was made of, if it is one
/// [`IdempotencyLedger::namespace_of`] makes.
fn parse_namespace(namespace: &str) -> Option<(String, Option<u64>)> {
    let (key, len) = match namespace.rsplit_once('@') {
        Some((key, len)) => (key, Some(len.parse::<u64>().ok()?)),
        None => (namespace, None),
    };
    let mut out = String::with_capacity(key.len());
    let mut rest = key;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let escape = rest.get(at..at + 3)?;
        out.push(match escape {
            "%25" => '%',
            "%3E" => '>',
            "%40" => '@',
            _ => return None,
        });
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    (IdempotencyLedger::namespace_of(&out, len) == namespace).then_some((out, len))
}

/// A namespace in the form it had before keys were escaped in it (the key
/// as it was, `@`, the answer's length), in the current one. Only a
/// namespace [`parse_namespace`] refuses can be an earlier one: any other
/// is read as current.
fn from_earlier_form(namespace: &str) -> String {
    match namespace.rsplit_once('@') {
        Some((key, len)) if !len.is_empty() && len.bytes().all(|b| b.is_ascii_digit()) => {
            IdempotencyLedger::namespace_of(key, len.parse().ok())
        }
        _ => IdempotencyLedger::namespace_of(namespace, None),
    }
}

/// Whether `keep`, a set of ledger keys and call namespaces, keeps the
/// entry `key` (a `record` or an answered call): an answered call by its
/// key, a record by its call's namespace, the part before the first
/// separator. A record written before namespaces were escaped, by a call
/// whose id holds `%` or `@`, is kept by its namespace in the current form.
pub(crate) fn kept_by(keep: &std::collections::HashSet<String>, key: &str, record: bool) -> bool {
    if !record {
        return keep.contains(key);
    }
    let Some((namespace, _)) = key.split_once(RECORD_SEPARATOR) else {
        return keep.contains(key);
    };
    keep.contains(namespace)
        || (parse_namespace(namespace).is_none() && keep.contains(&from_earlier_form(namespace)))
}

/// An at-most-once call a resumed step found started and never finished
/// (its process died while it ran, or its run was dropped): it was
/// answered `INTERRUPTED` and not run again. Its outcome is unknown; the
/// application shows it to a person, who reconciles it (checks whether the
/// effect happened).
///
/// Its JSON form (as `markov-server`'s step event carries it) has the
/// fields' names: `call_id`, `tool`, `args`, `instance`, `key`,
/// `started_at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterruptedCall {
    /// The call's id in the model's answer.
    pub call_id: ToolCallId,
    /// The tool.
    pub tool: String,
    /// The arguments it was called with (`null` when they were too large
    /// to keep).
    pub args: Value,
    /// The leaf instance the call ran for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<InstanceId>,
    /// The call's ledger key (user turn, instance, call id).
    pub key: String,
    /// When the call started, in Unix milliseconds.
    pub started_at: u64,
}

/// The hex SHA-256 of `args`' JSON text.
pub(crate) fn digest_of(args: &Value) -> String {
    let text = serde_json::to_vec(args).unwrap_or_default();
    markov_core::ids::hex(&Sha256::digest(&text))
}

impl LedgerEntry {
    /// Whether this entry answers a call of `tool` with `args`.
    fn matches(&self, tool: &str, args: &Value) -> bool {
        self.tool == tool
            && match &self.args_digest {
                Some(digest) => *digest == digest_of(args),
                None => self.args == *args,
            }
    }

    /// The entry itself, or its stub when it is too large to keep within
    /// `limits`: the call is still known to have completed, with which tool
    /// and arguments, and a replay says so instead of running it again.
    pub(crate) fn within(mut self, limits: &IdempotencyLimits) -> Self {
        if self.size() <= limits.max_bytes / 4
            || self.args_digest.is_some()
            || self.record.is_some()
        {
            return self;
        }
        let size = self.result.content.len();
        self.args_digest = Some(digest_of(&self.args));
        self.args = Value::Null;
        self.intents = Vec::new();
        if self.started {
            // Its result is the short `INTERRUPTED` error: only the
            // arguments were too large, and the call did not complete.
            return self;
        }
        self.result.content = format!(
            "This call already completed; its result ({size} bytes) was too large to keep and is not repeated. The tool was not run again."
        );
        self
    }

    /// Approximate bytes the entry holds.
    fn size(&self) -> usize {
        self.key.len()
            + self.tool.len()
            + value_size(&self.args)
            + self.result.content.len()
            + self.intents.iter().map(value_size).sum::<usize>()
            + self.state_updates.iter().map(value_size).sum::<usize>()
            + self.record.as_ref().map_or(0, value_size)
            + 64
    }
}

fn value_size(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 2,
        Value::Array(items) => 2 + items.iter().map(value_size).sum::<usize>(),
        Value::Object(map) => {
            2 + map
                .iter()
                .map(|(k, v)| k.len() + 3 + value_size(v))
                .sum::<usize>()
        }
        _ => 8,
    }
}

enum Slot {
    InFlight {
        tool: String,
        args: Value,
        waiters: Vec<oneshot::Sender<()>>,
    },
    Done(Box<LedgerEntry>),
}

#[derive(Default)]
struct Inner {
    // A key is shared by its slot, its place in the order and the claim of
    // its call: one allocation each.
    slots: HashMap<Arc<str>, Slot>,
    /// Answered keys, oldest first.
    order: VecDeque<Arc<str>>,
    bytes: usize,
    /// Entries seeded from an earlier run ([`IdempotencyLedger::seed`]),
    /// taken into `slots` when a call asks for their key.
    seeded: HashMap<String, LedgerEntry>,
    /// The seeded keys, in the order seeded.
    seeded_order: Vec<String>,
}

impl Inner {
    /// Drops expired entries and the oldest ones over the bounds, but never
    /// an entry of `turn`, the current user turn: a resumed step of this
    /// turn may still need it. Entries are in the order they were answered
    /// and turns only grow, so the current turn's are all at the back.
    fn evict(&mut self, limits: &IdempotencyLimits, now_ms: u64, turn: u64) {
        let ttl_ms = u64::try_from(limits.ttl.as_millis()).unwrap_or(u64::MAX);
        while let Some(oldest) = self.order.front() {
            let expired = match self.slots.get(oldest) {
                Some(Slot::Done(e)) if e.turn >= turn => break,
                Some(Slot::Done(e)) => now_ms.saturating_sub(e.recorded_at) >= ttl_ms,
                // Re-claimed or gone: its place in the order is stale.
                _ => true,
            };
            let over =
                self.order.len() > limits.max_entries.max(1) || self.bytes > limits.max_bytes;
            if !(expired || over) {
                break;
            }
            if let Some(key) = self.order.pop_front()
                && let Some(Slot::Done(e)) = self.slots.get(&key)
            {
                self.bytes = self.bytes.saturating_sub(e.size());
                self.slots.remove(&key);
            }
        }
    }
}

/// What [`IdempotencyLedger::begin`] found for a key.
pub(crate) enum Begin<'l> {
    /// Run the call; complete the claim with its result.
    Run(Claim<'l>),
    /// Answered before: replay.
    Replay(Box<LedgerEntry>),
    /// The key was used for another tool or other arguments.
    Conflict,
    /// Another call with this key is running: wait, then look again.
    Wait(oneshot::Receiver<()>),
}

/// The answered calls of one conversation.
#[derive(Default)]
pub struct IdempotencyLedger {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for IdempotencyLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("IdempotencyLedger")
            .field("entries", &inner.order.len())
            .field("bytes", &inner.bytes)
            .finish()
    }
}

pub(crate) fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl IdempotencyLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key of the call `call_id` made for `instance` in user turn
    /// `turn`.
    pub fn key_of(
        turn: u64,
        instance: Option<&markov_core::ids::InstanceId>,
        call_id: &markov_core::ids::ToolCallId,
    ) -> String {
        use std::fmt::Write as _;
        // Sized first, so the key is one allocation (a call's key is made
        // on every call).
        let instance = instance.map(InstanceId::as_str);
        let digits = turn.checked_ilog10().map_or(1, |d| d as usize + 1);
        let len = 1 + digits + instance.map_or(0, |i| i.len() + 1) + 1 + call_id.as_str().len();
        let mut key = String::with_capacity(len);
        let _ = write!(key, "t{turn}:");
        if let Some(instance) = instance {
            key.push_str(instance);
            key.push(':');
        }
        key.push_str(call_id.as_str());
        debug_assert_eq!(key.len(), len);
        key
    }

    /// How many answers are stored.
    pub fn len(&self) -> usize {
        self.lock()
            .slots
            .values()
            .filter(|s| matches!(s, Slot::Done(_)))
            .count()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate bytes stored.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Forgets the answers of turns before `turn`: their keys name their
    /// turn, so no call of `turn` or later can ever match them.
    pub fn forget_before(&self, turn: u64) {
        self.forget_answered(|_, entry| entry.turn < turn);
    }

    /// Forgets every answered call whose key `keep` does not hold. Once a
    /// step is recorded, its results are in the history and its answer is
    /// never replayed: only the calls of answers still to be replayed (a
    /// paused step's, or a step's in flight when its state was written)
    /// can be asked for again. Dropping the rest also means a provider that
    /// reuses a call id in a later step of the same turn gets a new call,
    /// never an earlier step's stored answer. A call in flight is kept.
    ///
    /// `keep` may also name a call's namespace
    /// ([`namespace_of`](Self::namespace_of)): the records that call kept
    /// stay too.
    pub fn retain_only(&self, keep: &std::collections::HashSet<String>) {
        self.forget_answered(|key, entry| !kept_by(keep, key, entry.record.is_some()));
    }

    /// The namespace of the records kept by the call whose ledger key is
    /// `key`, made by the answer asked over a history of `answer` messages
    /// (`None`: no answer is recorded for it): the key and the answer's
    /// length, so that a provider that reuses a call id in a later step of
    /// the turn names another namespace. The key's `%`, `>` and `@` are
    /// escaped (`%25`, `%3E`, `%40`), so that no two calls share a
    /// namespace and a record's key splits at its first `>`, whatever the
    /// call ids hold.
    pub fn namespace_of(key: &str, answer: Option<u64>) -> String {
        let key = escape_key(key);
        match answer {
            Some(len) => format!("{key}@{len}"),
            None => key.into_owned(),
        }
    }

    /// The records kept under `namespace`, `(name, record)` in the order
    /// they were kept: those read back with the conversation and those
    /// seeded ([`seed`](Self::seed)).
    ///
    /// A record written before namespaces were escaped, by a call whose id
    /// holds `%` or `@`, is read under its namespace in the current form
    /// (one whose id held `>` never read back, in either form).
    pub fn records_under(&self, namespace: &str) -> Vec<(String, Value)> {
        let inner = self.lock();
        let under = |key: &str| {
            let (of, name) = key.split_once(RECORD_SEPARATOR)?;
            (of == namespace
                || (parse_namespace(of).is_none() && from_earlier_form(of) == namespace))
                .then(|| name.to_owned())
        };
        let mut found: Vec<(String, Value)> = Vec::new();
        let done = inner.order.iter().filter_map(|k| match inner.slots.get(k) {
            Some(Slot::Done(e)) => Some(&**e),
            _ => None,
        });
        for entry in done.chain(
            inner
                .seeded_order
                .iter()
                .filter_map(|k| inner.seeded.get(k)),
        ) {
            if let Some(record) = &entry.record
                && let Some(name) = under(&entry.key)
            {
                match found.iter_mut().find(|(n, _)| *n == name) {
                    Some(slot) => slot.1 = record.clone(),
                    None => found.push((name, record.clone())),
                }
            }
        }
        found
    }

    /// Seeds the ledger with `entries` recorded by an earlier run of this
    /// conversation that nothing else keeps (a sub-agent run again after a
    /// crash): each stays aside, out of the bounds and of
    /// [`retain_only`](Self::retain_only), until a call asks for its key,
    /// which then finds it answered as if it had been read back with the
    /// conversation.
    pub fn seed(&self, entries: impl IntoIterator<Item = LedgerEntry>) {
        let mut inner = self.lock();
        for entry in entries {
            let key = entry.key.clone();
            if inner.seeded.insert(key.clone(), entry).is_none() {
                inner.seeded_order.push(key);
            }
        }
    }

    /// Forgets the answered calls `forget` picks (by key and entry); calls
    /// in flight stay.
    fn forget_answered(&self, forget: impl Fn(&str, &LedgerEntry) -> bool) {
        let mut inner = self.lock();
        let Inner {
            slots,
            order,
            bytes,
            ..
        } = &mut *inner;
        order.retain(|key| match slots.get(key) {
            Some(Slot::Done(e)) if forget(key, e) => {
                *bytes = bytes.saturating_sub(e.size());
                slots.remove(key);
                false
            }
            _ => true,
        });
    }

    /// The answers, oldest first, for a snapshot.
    pub fn snapshot(&self) -> Vec<LedgerEntry> {
        let inner = self.lock();
        inner
            .order
            .iter()
            .filter_map(|k| match inner.slots.get(k) {
                Some(Slot::Done(e)) => Some(LedgerEntry::clone(e)),
                _ => None,
            })
            .collect()
    }

    /// Adds the answers of a snapshot (oldest first), within `limits`;
    /// `turn` is the conversation's current user turn, whose entries are
    /// never evicted.
    pub fn restore(
        &self,
        entries: impl IntoIterator<Item = LedgerEntry>,
        limits: &IdempotencyLimits,
        turn: u64,
    ) {
        let mut inner = self.lock();
        for entry in entries {
            let entry = entry.within(limits);
            inner.bytes += entry.size();
            let key: Arc<str> = Arc::from(entry.key.as_str());
            if let Some(Slot::Done(old)) =
                inner.slots.insert(key.clone(), Slot::Done(Box::new(entry)))
            {
                inner.bytes = inner.bytes.saturating_sub(old.size());
            } else {
                inner.order.push_back(key);
            }
        }
        inner.evict(limits, unix_millis(SystemTime::now()), turn);
    }

    pub(crate) fn begin(
        &self,
        key: &str,
        tool: &str,
        args: &Value,
        limits: &IdempotencyLimits,
        now: SystemTime,
        turn: u64,
    ) -> Begin<'_> {
        let mut inner = self.lock();
        inner.evict(limits, unix_millis(now), turn);
        if !inner.seeded.is_empty()
            && !inner.slots.contains_key(key)
            && let Some(entry) = inner.seeded.remove(key)
        {
            // Answered in an earlier run: as if read back now.
            let entry = entry.within(limits);
            inner.bytes += entry.size();
            let key: Arc<str> = Arc::from(key);
            inner
                .slots
                .insert(Arc::clone(&key), Slot::Done(Box::new(entry)));
            inner.order.push_back(key);
        }
        match inner.slots.get_mut(key) {
            Some(Slot::Done(e)) if e.matches(tool, args) => Begin::Replay(e.clone()),
            Some(Slot::Done(_)) => Begin::Conflict,
            // An empty tool name: the call is being journaled (its tool and
            // arguments moved into the entry); wait for it like any other.
            Some(Slot::InFlight {
                tool: t, args: a, ..
            }) if !t.is_empty() && (t != tool || a != args) => Begin::Conflict,
            Some(Slot::InFlight { waiters, .. }) => {
                let (tx, rx) = oneshot::channel();
                waiters.push(tx);
                Begin::Wait(rx)
            }
            None => {
                let key: Arc<str> = Arc::from(key);
                inner.slots.insert(
                    Arc::clone(&key),
                    Slot::InFlight {
                        tool: tool.to_owned(),
                        args: args.clone(),
                        waiters: Vec::new(),
                    },
                );
                Begin::Run(Claim {
                    ledger: self,
                    key: Some(key),
                    started: None,
                })
            }
        }
    }
}

impl IdempotencyLedger {
    /// Claims again the key of an at-most-once call found started and never
    /// finished, to run it again: for a tool that resumes from its call's
    /// journal, whose side effects that journal keeps. `None` when the key
    /// holds anything else now (another call claimed it, or it finished):
    /// look again.
    pub(crate) fn resume_started(&self, key: &str) -> Option<Claim<'_>> {
        let mut inner = self.lock();
        let entry = match inner.slots.get(key) {
            Some(Slot::Done(entry)) if entry.started => entry,
            _ => return None,
        };
        let size = entry.size();
        let (tool, args) = (entry.tool.clone(), entry.args.clone());
        inner.bytes = inner.bytes.saturating_sub(size);
        // Answered again when the claim completes, it goes to the back.
        inner.order.retain(|k| **k != *key);
        let key: Arc<str> = Arc::from(key);
        inner.slots.insert(
            Arc::clone(&key),
            Slot::InFlight {
                tool,
                args,
                waiters: Vec::new(),
            },
        );
        Some(Claim {
            ledger: self,
            key: Some(key),
            started: None,
        })
    }
}

/// A key being run; dropped without [`Claim::complete`] (a cancelled call),
/// it frees the key and wakes the waiters, one of which then runs.
pub(crate) struct Claim<'l> {
    ledger: &'l IdempotencyLedger,
    key: Option<Arc<str>>,
    /// An at-most-once call's start, once its tool may have run: what a
    /// dropped claim leaves in the ledger, so the call never runs again.
    pub(crate) started: Option<Box<(LedgerEntry, IdempotencyLimits)>>,
}

impl Claim<'_> {
    /// The tool and arguments of the call in flight (the slot keeps its
    /// waiters until [`complete`](Self::complete)).
    pub(crate) fn take_call(&self) -> (String, Value) {
        let Some(key) = &self.key else {
            return (String::new(), Value::Null);
        };
        match self.ledger.lock().slots.get_mut(key) {
            Some(Slot::InFlight { tool, args, .. }) => (std::mem::take(tool), std::mem::take(args)),
            _ => (String::new(), Value::Null),
        }
    }

    /// Stores the call's entry and frees the key.
    pub(crate) fn complete(mut self, entry: LedgerEntry, limits: &IdempotencyLimits) {
        self.started = None;
        let Some(key) = self.key.take() else { return };
        self.ledger.insert_done(key, entry, limits);
    }
}

impl IdempotencyLedger {
    /// Stores `entry` as the answer of `key` (in flight until now).
    fn insert_done(&self, key: Arc<str>, entry: LedgerEntry, limits: &IdempotencyLimits) {
        let turn = entry.turn;
        let mut inner = self.lock();
        // Waiters are woken by their senders being dropped with the slot.
        inner.bytes += entry.size();
        inner
            .slots
            .insert(Arc::clone(&key), Slot::Done(Box::new(entry)));
        inner.order.push_back(key);
        inner.evict(limits, unix_millis(SystemTime::now()), turn);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        match self.started.take() {
            // The tool may have run: the call is never run again.
            Some(started) => {
                let (entry, limits) = *started;
                self.ledger.insert_done(key, entry, &limits);
            }
            None => {
                self.ledger.lock().slots.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_names_the_turn_the_instance_and_the_call() {
        let call = ToolCallId::from("call_7");
        let instance = InstanceId::from("root");
        assert_eq!(IdempotencyLedger::key_of(0, None, &call), "t0:call_7");
        assert_eq!(
            IdempotencyLedger::key_of(12_345, Some(&instance), &call),
            "t12345:root:call_7"
        );
        assert_eq!(
            IdempotencyLedger::key_of(u64::MAX, Some(&instance), &call),
            format!("t{}:root:call_7", u64::MAX)
        );
    }
    use serde_json::json;

    #[test]
    fn a_recorded_results_images_replay_as_their_notes() {
        let mut result = ToolExecutionResult::success("c1".into(), "a chart");
        result.images = vec![markov_core::message::ImageData::new(
            "image/png",
            "aGVsbG8=",
        )];
        let replayed = StoredResult::of(&result).to_result(&"c1".into());
        assert_eq!(replayed.content, "a chart\n[image image/png, 5 bytes]");
        assert!(replayed.images.is_empty());
    }

    fn entry(key: &str, content: &str, at: u64) -> LedgerEntry {
        LedgerEntry {
            key: key.into(),
            tool: "pay".into(),
            args: json!({"amount": 1}),
            result: StoredResult {
                content: content.into(),
                is_error: false,
                is_terminal: false,
                terminate: None,
                user_message: None,
            },
            error: None,
            intents: Vec::new(),
            recorded_at: at,
            turn: 0,
            args_digest: None,
            state_updates: Vec::new(),
            started: false,
            record: None,
        }
    }

    fn now_ms() -> u64 {
        unix_millis(SystemTime::now())
    }

    #[test]
    fn the_key_binds_tool_and_arguments() {
        let ledger = IdempotencyLedger::new();
        let limits = IdempotencyLimits::default();
        ledger.restore([entry("k", "paid", now_ms())], &limits, 0);
        let now = SystemTime::now();
        assert!(matches!(
            ledger.begin("k", "pay", &json!({"amount": 1}), &limits, now, 0),
            Begin::Replay(e) if e.result.content == "paid"
        ));
        assert!(matches!(
            ledger.begin("k", "pay", &json!({"amount": 2}), &limits, now, 0),
            Begin::Conflict
        ));
        assert!(matches!(
            ledger.begin("k", "refund", &json!({"amount": 1}), &limits, now, 0),
            Begin::Conflict
        ));
    }

    #[test]
    fn entries_expire_and_the_ledger_is_bounded_in_bytes() {
        let limits = IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_entries: 1000,
            max_bytes: 1200,
        };
        let ledger = IdempotencyLedger::new();
        let old = now_ms() - 61_000;
        ledger.restore([entry("old", "x", old)], &limits, 1);
        assert!(ledger.is_empty(), "expired on restore");
        let big = "y".repeat(200);
        ledger.restore(
            (0..5).map(|i| entry(&format!("k{i}"), &big, now_ms())),
            &limits,
            1,
        );
        assert!(ledger.bytes() <= 1200, "{} bytes", ledger.bytes());
        assert_eq!(ledger.len(), 4, "the oldest went first");
        let keys: Vec<String> = ledger.snapshot().into_iter().map(|e| e.key).collect();
        assert_eq!(keys, ["k1", "k2", "k3", "k4"]);
    }

    #[test]
    fn a_cancelled_claim_frees_the_key_and_wakes_waiters() {
        let ledger = IdempotencyLedger::new();
        let limits = IdempotencyLimits::default();
        let args = json!({"amount": 1});
        let now = SystemTime::now();
        let Begin::Run(claim) = ledger.begin("k", "pay", &args, &limits, now, 0) else {
            panic!("the first call runs");
        };
        let Begin::Wait(mut waiter) = ledger.begin("k", "pay", &args, &limits, now, 0) else {
            panic!("the second call waits");
        };
        assert!(matches!(waiter.try_recv(), Ok(None)), "still waiting");
        drop(claim);
        assert!(waiter.try_recv().is_err(), "woken: the sender is gone");
        assert!(matches!(
            ledger.begin("k", "pay", &args, &limits, now, 0),
            Begin::Run(_)
        ));
    }

    #[test]
    fn a_dropped_claim_of_a_started_call_leaves_its_start_and_the_call_never_runs_again() {
        let ledger = IdempotencyLedger::new();
        let limits = IdempotencyLimits::default();
        let args = json!({"amount": 1});
        let now = SystemTime::now();
        let Begin::Run(mut claim) = ledger.begin("k", "pay", &args, &limits, now, 0) else {
            panic!("the first call runs");
        };
        let mut started = entry("k", "interrupted", now_ms());
        started.started = true;
        claim.started = Some(Box::new((started, limits)));
        drop(claim);
        assert!(matches!(
            ledger.begin("k", "pay", &args, &limits, now, 0),
            Begin::Replay(e) if e.started && e.result.content == "interrupted"
        ));
        // A completed claim replaces the start with its real entry.
        let ledger = IdempotencyLedger::new();
        let Begin::Run(mut claim) = ledger.begin("k", "pay", &args, &limits, now, 0) else {
            panic!("the first call runs");
        };
        let mut started = entry("k", "interrupted", now_ms());
        started.started = true;
        claim.started = Some(Box::new((started, limits)));
        claim.complete(entry("k", "paid", now_ms()), &limits);
        assert!(matches!(
            ledger.begin("k", "pay", &args, &limits, now, 0),
            Begin::Replay(e) if !e.started && e.result.content == "paid"
        ));
    }

    #[test]
    fn a_start_with_arguments_too_large_to_keep_still_says_interrupted() {
        let limits = IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_entries: 100,
            max_bytes: 4000,
        };
        let mut started = entry("k", "interrupted", now_ms());
        started.started = true;
        started.args = json!({"body": "b".repeat(5000)});
        let kept = started.within(&limits);
        assert_eq!(kept.args, Value::Null);
        assert!(kept.args_digest.is_some());
        assert_eq!(kept.result.content, "interrupted");
        assert!(kept.started);
    }

    #[test]
    fn a_new_turn_forgets_the_answers_of_the_earlier_ones() {
        let ledger = IdempotencyLedger::new();
        let limits = IdempotencyLimits::default();
        let mut old = entry("t1:a", "old", now_ms());
        old.turn = 1;
        let mut current = entry("t2:a", "current", now_ms());
        current.turn = 2;
        ledger.restore([old, current], &limits, 2);
        ledger.forget_before(2);
        let keys: Vec<String> = ledger.snapshot().into_iter().map(|e| e.key).collect();
        assert_eq!(keys, ["t2:a"]);
        assert!(ledger.bytes() > 0);
    }

    fn record(key: &str, value: Value) -> LedgerEntry {
        let mut e = entry(key, "", now_ms());
        e.tool = String::new();
        e.args = Value::Null;
        e.record = Some(value);
        e.turn = 1;
        e
    }

    #[test]
    fn a_seeded_entry_answers_its_call_once_asked_and_outlives_the_steps_before() {
        let ledger = IdempotencyLedger::new();
        let limits = IdempotencyLimits::default();
        ledger.seed([entry("t1:root:c2", "paid", now_ms())]);
        // A step before it is recorded: the seeded entry is not its.
        ledger.retain_only(&std::collections::HashSet::new());
        assert!(ledger.is_empty(), "seeds stay aside");
        let now = SystemTime::now();
        assert!(matches!(
            ledger.begin("t1:root:c2", "pay", &json!({"amount": 1}), &limits, now, 1),
            Begin::Replay(e) if e.result.content == "paid"
        ));
        assert_eq!(ledger.len(), 1, "taken into the ledger");
        assert!(matches!(
            ledger.begin("t1:root:c9", "pay", &json!({"amount": 1}), &limits, now, 1),
            Begin::Run(_)
        ));
    }

    #[test]
    fn records_are_read_by_namespace_last_write_first_kept_and_never_stubbed() {
        let limits = IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_entries: 100,
            max_bytes: 4000,
        };
        let ledger = IdempotencyLedger::new();
        let big = "r".repeat(5000);
        ledger.restore(
            [
                record("t1:root:c1@3>answer:a:1", json!(1)),
                record("t1:root:c1@30>answer:a:1", json!("another step's")),
                record("t1:root:c1@3>t1:a:x", json!(big)),
                record("t1:root:c1@3>answer:a:1", json!(2)),
            ],
            &limits,
            1,
        );
        ledger.seed([record("t1:root:c1@3>t1:a:x@2>answer:b:1", json!(3))]);
        assert_eq!(
            ledger.records_under("t1:root:c1@3"),
            [
                ("answer:a:1".to_owned(), json!(2)),
                ("t1:a:x".to_owned(), json!(big)),
                ("t1:a:x@2>answer:b:1".to_owned(), json!(3)),
            ]
        );
        assert!(ledger.records_under("t1:root:c1").is_empty());
    }

    #[test]
    fn keeping_a_calls_namespace_keeps_its_records() {
        let keep: std::collections::HashSet<String> =
            ["t1:root:c1".to_owned(), "t1:root:c1@3".to_owned()].into();
        assert!(kept_by(&keep, "t1:root:c1", false));
        assert!(kept_by(&keep, "t1:root:c1@3>answer:a:1", true));
        assert!(kept_by(&keep, "t1:root:c1@3>t1:a:x@2>t1:b:y", true));
        assert!(!kept_by(&keep, "t1:root:c1@4>answer:a:1", true));
        assert!(!kept_by(&keep, "t1:root:c2", false));
        assert!(
            !kept_by(&keep, "t1:root:c1@3>x", false),
            "an answered call is kept by its key alone"
        );
        assert_eq!(
            IdempotencyLedger::namespace_of("t1:r:c", Some(7)),
            "t1:r:c@7"
        );
        assert_eq!(IdempotencyLedger::namespace_of("t1:r:c", None), "t1:r:c");
    }

    /// A record an earlier release wrote for a call whose id holds `@`
    /// (its namespace then unescaped) is still read and kept.
    #[test]
    fn a_record_in_the_earlier_form_of_an_id_with_an_at_sign_still_reads() {
        let ledger = IdempotencyLedger::new();
        ledger.restore(
            [record("t1:root:a@b@3>answer:x:1", json!(1))],
            &IdempotencyLimits::default(),
            1,
        );
        let namespace = IdempotencyLedger::namespace_of("t1:root:a@b", Some(3));
        assert_eq!(namespace, "t1:root:a%40b@3");
        assert_eq!(
            ledger.records_under(&namespace),
            [("answer:x:1".to_owned(), json!(1))]
        );
        let keep = [namespace].into();
        assert!(kept_by(&keep, "t1:root:a@b@3>answer:x:1", true));
        ledger.retain_only(&keep);
        assert_eq!(ledger.snapshot().len(), 1, "kept");
    }

    proptest::proptest! {
        /// Whatever the call ids hold, a record's key names its call and
        /// answer and no other: namespaces are one per call and answer,
        /// and a record is read and kept under its own alone.
        #[test]
        fn a_records_key_names_its_call_and_answer_and_no_other(
            ids in proptest::collection::vec("[ab@>%:0-9E]{0,5}", 2),
            lens in proptest::collection::vec(proptest::option::of(0u64..12), 2),
            names in proptest::collection::vec("[ab@>%:0-9]{0,5}", 2),
        ) {
            let root = InstanceId::from("root");
            let calls: Vec<(String, Option<u64>)> = ids
                .iter()
                .zip(&lens)
                .map(|(id, len)| {
                    let key = IdempotencyLedger::key_of(1, Some(&root), &ToolCallId::from(id.as_str()));
                    (key, *len)
                })
                .collect();
            let spaces: Vec<String> = calls
                .iter()
                .map(|(key, len)| IdempotencyLedger::namespace_of(key, *len))
                .collect();
            let same = calls[0] == calls[1];
            proptest::prop_assert_eq!(spaces[0] == spaces[1], same, "{:?}", spaces);
            for space in &spaces {
                proptest::prop_assert_eq!(parse_namespace(space).map(|(k, l)| IdempotencyLedger::namespace_of(&k, l)), Some(space.clone()));
            }
            let ledger = IdempotencyLedger::new();
            let keys: Vec<String> = spaces
                .iter()
                .zip(&names)
                .map(|(space, name)| format!("{space}{RECORD_SEPARATOR}{name}"))
                .collect();
            ledger.restore(
                keys.iter().enumerate().map(|(i, key)| record(key, json!(i))),
                &IdempotencyLimits::default(),
                1,
            );
            let mut mine = vec![(names[0].clone(), json!(0))];
            if same {
                match names[0] == names[1] {
                    true => mine = vec![(names[0].clone(), json!(1))],
                    false => mine.push((names[1].clone(), json!(1))),
                }
            }
            proptest::prop_assert_eq!(ledger.records_under(&spaces[0]), mine);
            let keep: std::collections::HashSet<String> = [spaces[0].clone()].into();
            proptest::prop_assert!(kept_by(&keep, &keys[0], true));
            proptest::prop_assert_eq!(kept_by(&keep, &keys[1], true), same);
        }
    }

    #[test]
    fn entries_of_the_current_turn_are_never_evicted() {
        let limits = IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_entries: 2,
            max_bytes: 1000,
        };
        let ledger = IdempotencyLedger::new();
        let big = "y".repeat(200);
        let mut entries: Vec<LedgerEntry> = (0..6)
            .map(|i| entry(&format!("k{i}"), &big, now_ms() - 120_000))
            .collect();
        for e in &mut entries[3..] {
            e.turn = 4;
        }
        ledger.restore(entries, &limits, 4);
        let keys: Vec<String> = ledger.snapshot().into_iter().map(|e| e.key).collect();
        assert_eq!(
            keys,
            ["k3", "k4", "k5"],
            "earlier turns went (expired and over the bounds), the current turn stayed"
        );
    }

    #[test]
    fn a_result_too_large_to_keep_leaves_a_stub_that_still_replays() {
        let limits = IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_entries: 100,
            max_bytes: 4000,
        };
        let ledger = IdempotencyLedger::new();
        ledger.restore([entry("k", &"z".repeat(5000), now_ms())], &limits, 0);
        assert_eq!(ledger.len(), 1, "the stub is kept");
        let stub = &ledger.snapshot()[0];
        assert_eq!(stub.args, Value::Null);
        assert_eq!(
            stub.args_digest.as_deref(),
            Some(digest_of(&json!({"amount": 1})).as_str())
        );
        let now = SystemTime::now();
        assert!(matches!(
            ledger.begin("k", "pay", &json!({"amount": 1}), &limits, now, 0),
            Begin::Replay(e) if e.result.content.contains("already completed")
        ));
        assert!(matches!(
            ledger.begin("k", "pay", &json!({"amount": 2}), &limits, now, 0),
            Begin::Conflict
        ));
    }
}
