//! `CONFIRMATION_REQUIRED` / `_PENDING` / `_DENIED` / `_INVALID`: tools that
//! need the user's approval before they run.
//!
//! An approval is a decision of the application, never of the model:
//!
//! 1. A call of such a tool without a `confirmationToken` argument is
//!    answered `CONFIRMATION_REQUIRED` with a [`ConfirmationRequest`]: a
//!    random request id (from the operating system's CSPRNG), the tool, the
//!    exact arguments, a preview and an expiry. The request is recorded as
//!    pending in the conversation's [`Approvals`].
//! 2. The application shows it ([`Approvals::pending`]) and records the
//!    user's answer with [`Approvals::approve`] or [`Approvals::deny`].
//! 3. The model calls again with the same arguments and
//!    `confirmationToken` set to the request id. Only an approved, unexpired
//!    request for this tool and these exact arguments lets the call through,
//!    once; the token is removed from the arguments before anything inside
//!    this stage sees them.
//!
//! The request id is no secret: it is worth nothing until the application
//! approves it, so a model that copies, guesses or replays one gets
//! `CONFIRMATION_PENDING` (not yet approved), `CONFIRMATION_DENIED` or
//! `CONFIRMATION_INVALID` (unknown, used, expired, or issued for another
//! call). A used, denied or expired request stays invalid for good; asking
//! again issues a new id. The approvals belong to one conversation (a
//! machine's [`PolicyState`](crate::PolicyState)): an id approved in one is
//! unknown in every other.
//!
//! At most [`MAX_PENDING`] requests wait for a decision at once; a call that
//! would issue one more gets its error result without a request. An approved
//! request is never forgotten before it expires, however many calls follow.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use markov_core::tool::ToolExecutionResult;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Rejection, ToolErrorKind};
use crate::service::{ToolLayer, ToolRequest, ToolService};

/// The argument that carries the id of an approved confirmation request.
pub const CONFIRMATION_TOKEN: &str = "confirmationToken";

/// Records kept per conversation before used, denied and expired ones are
/// forgotten. Approved requests are never forgotten before they expire, and
/// pending ones are bounded by [`MAX_PENDING`], so the set stays bounded by
/// what the application itself approves.
const MAX_REQUESTS: usize = 1024;

/// Requests waiting for the application's decision at most per conversation.
/// A call that would issue one more is refused without a request, so a model
/// that floods the conversation with calls cannot push out an approval or a
/// request the user is looking at; room comes back as requests are decided or
/// expire.
pub const MAX_PENDING: usize = 64;

/// The default lifetime of a confirmation request.
pub const DEFAULT_CONFIRMATION_TTL: Duration = Duration::from_secs(300);

/// The opaque id of a confirmation request (`apr_` and 32 hex digits).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ApprovalId(String);

impl ApprovalId {
    /// A new id from the operating system's CSPRNG (a v4 UUID's 122 random bits).
    fn random() -> Self {
        ApprovalId(format!("apr_{}", uuid::Uuid::new_v4().simple()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for ApprovalId {
    fn from(id: &str) -> Self {
        ApprovalId(id.to_owned())
    }
}

impl From<String> for ApprovalId {
    fn from(id: String) -> Self {
        ApprovalId(id)
    }
}

impl fmt::Display for ApprovalId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the user is asked to approve; the model reads it in the envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfirmationRequest {
    /// The request's id: what the model sends back as `confirmationToken`
    /// once the application has approved it.
    pub request_id: ApprovalId,
    /// When the request expires, in Unix milliseconds.
    pub expires: u64,
    /// The tool.
    pub tool: String,
    /// The exact arguments, without any token.
    pub args: Value,
    /// A one-line preview of the action (the tool and its arguments, keys
    /// sorted).
    pub preview: String,
}

/// Where a confirmation request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ApprovalStatus {
    /// Waiting for the application's decision.
    Pending,
    /// Approved: the next matching call runs.
    Approved,
    /// Denied by the application.
    Denied,
    /// Approved and used by a call.
    Used,
}

impl fmt::Display for ApprovalStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Denied => "denied",
            ApprovalStatus::Used => "used",
        })
    }
}

/// A confirmation request and where it stands: what a snapshot keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalRecord {
    /// The request.
    pub request: ConfirmationRequest,
    /// Its status.
    pub status: ApprovalStatus,
}

/// Why the application's decision on a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApprovalError {
    /// No such request in this conversation (never issued, or forgotten
    /// after it was used or expired).
    #[error("no confirmation request {0} in this conversation")]
    NotFound(ApprovalId),
    /// The request was already decided.
    #[error("confirmation request {id} is already {status}")]
    AlreadyDecided {
        /// The request.
        id: ApprovalId,
        /// Its status.
        status: ApprovalStatus,
    },
    /// The request expired before the decision.
    #[error("confirmation request {0} has expired")]
    Expired(ApprovalId),
}

/// The confirmation requests of one conversation.
#[derive(Debug, Default)]
pub struct Approvals {
    records: Mutex<BTreeMap<ApprovalId, (ApprovalRecord, u64)>>,
    /// Bumped by every change, so a store writes the set only when it changed.
    revision: std::sync::atomic::AtomicU64,
}

fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Approvals {
    /// No requests.
    pub fn new() -> Self {
        Self::default()
    }

    /// The records, to read.
    fn read(&self) -> std::sync::MutexGuard<'_, BTreeMap<ApprovalId, (ApprovalRecord, u64)>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The records, to change: bumps the revision (a spurious bump only
    /// costs a store one extra write).
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ApprovalId, (ApprovalRecord, u64)>> {
        self.revision
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.read()
    }

    /// A number that changes whenever the requests may have changed.
    pub fn revision(&self) -> u64 {
        self.revision.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The requests waiting for a decision and not expired, oldest first.
    pub fn pending(&self) -> Vec<ConfirmationRequest> {
        self.pending_at(SystemTime::now())
    }

    /// [`pending`](Self::pending) at `now`.
    pub fn pending_at(&self, now: SystemTime) -> Vec<ConfirmationRequest> {
        let now = unix_millis(now);
        let mut pending: Vec<_> = self
            .read()
            .values()
            .filter(|(r, _)| r.status == ApprovalStatus::Pending && now < r.request.expires)
            .map(|(r, seq)| (*seq, r.request.clone()))
            .collect();
        pending.sort_by_key(|(seq, _)| *seq);
        pending.into_iter().map(|(_, r)| r).collect()
    }

    /// The record of `id`, if this conversation has it.
    pub fn get(&self, id: &ApprovalId) -> Option<ApprovalRecord> {
        self.read().get(id).map(|(r, _)| r.clone())
    }

    /// Approves the pending request `id`: the next call of its tool with its
    /// exact arguments and `confirmationToken: id` runs, once.
    pub fn approve(&self, id: &ApprovalId) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide(id, ApprovalStatus::Approved, SystemTime::now())
    }

    /// Denies the pending request `id`: a call presenting it is answered
    /// `CONFIRMATION_DENIED`, for good.
    pub fn deny(&self, id: &ApprovalId) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide(id, ApprovalStatus::Denied, SystemTime::now())
    }

    /// Records a decision at `now` (what [`approve`](Self::approve) and
    /// [`deny`](Self::deny) do with the current time).
    pub fn decide(
        &self,
        id: &ApprovalId,
        decision: ApprovalStatus,
        now: SystemTime,
    ) -> Result<ConfirmationRequest, ApprovalError> {
        let mut records = self.lock();
        let Some((record, _)) = records.get_mut(id) else {
            return Err(ApprovalError::NotFound(id.clone()));
        };
        if record.status != ApprovalStatus::Pending {
            return Err(ApprovalError::AlreadyDecided {
                id: id.clone(),
                status: record.status,
            });
        }
        if unix_millis(now) >= record.request.expires {
            return Err(ApprovalError::Expired(id.clone()));
        }
        if matches!(decision, ApprovalStatus::Approved | ApprovalStatus::Denied) {
            record.status = decision;
        }
        Ok(record.request.clone())
    }

    /// The requests worth keeping (pending or approved, not expired), for a
    /// snapshot.
    pub fn snapshot(&self) -> Vec<ApprovalRecord> {
        let now = unix_millis(SystemTime::now());
        let mut kept: Vec<_> = self
            .read()
            .values()
            .filter(|(r, _)| {
                matches!(r.status, ApprovalStatus::Pending | ApprovalStatus::Approved)
                    && now < r.request.expires
            })
            .map(|(r, seq)| (*seq, r.clone()))
            .collect();
        kept.sort_by_key(|(seq, _)| *seq);
        kept.into_iter().map(|(_, r)| r).collect()
    }

    /// Adds the records of a snapshot (in their order).
    pub fn restore(&self, records: impl IntoIterator<Item = ApprovalRecord>) {
        let mut map = self.lock();
        for record in records {
            let seq = next_seq(&map);
            map.insert(record.request.request_id.clone(), (record, seq));
        }
        trim(&mut map, 0);
    }

    /// A request for `tool` with `args`: the pending one for the same call
    /// if there is one, else a new one, or `None` when [`MAX_PENDING`]
    /// requests already wait for a decision.
    fn request(
        &self,
        tool: &str,
        args: &Value,
        ttl: Duration,
        now: SystemTime,
    ) -> Option<ConfirmationRequest> {
        let now_ms = unix_millis(now);
        let mut records = self.lock();
        if let Some((record, _)) = records.values().find(|(r, _)| {
            r.status == ApprovalStatus::Pending
                && now_ms < r.request.expires
                && r.request.tool == tool
                && r.request.args == *args
        }) {
            return Some(record.request.clone());
        }
        let pending = records
            .values()
            .filter(|(r, _)| r.status == ApprovalStatus::Pending && now_ms < r.request.expires)
            .count();
        if pending >= MAX_PENDING {
            return None;
        }
        // A lifetime too long for the clock ("never expires") saturates.
        let expires = now.checked_add(ttl).map_or(u64::MAX, unix_millis);
        let request = ConfirmationRequest {
            request_id: ApprovalId::random(),
            expires,
            tool: tool.to_owned(),
            args: args.clone(),
            preview: format!("{tool} {}", canonical(args)),
        };
        trim(&mut records, now_ms);
        let seq = next_seq(&records);
        records.insert(
            request.request_id.clone(),
            (
                ApprovalRecord {
                    request: request.clone(),
                    status: ApprovalStatus::Pending,
                },
                seq,
            ),
        );
        Some(request)
    }

    /// The stage's decision for a call of `tool` (sans-IO): strips the token
    /// from `input`, then passes the call (`Ok`, consuming an approval) or
    /// says why not.
    pub fn check(
        &self,
        tool: &str,
        input: &mut Value,
        ttl: Duration,
        now: SystemTime,
    ) -> Result<(), Rejection> {
        let token = match input {
            Value::Object(map) => map.remove(CONFIRMATION_TOKEN),
            _ => None,
        };
        let fresh = |kind: ToolErrorKind, detail: &str| {
            match self.request(tool, input, ttl, now) {
            Some(request) => Rejection::new(kind)
                .with_detail(detail)
                .with_confirmation(request),
            None => Rejection::new(kind).with_detail(format!(
                "{detail}; no new request was issued: {MAX_PENDING} requests already wait for the user's decision"
            )),
        }
        };
        let token = match token {
            None => {
                return Err(fresh(
                    ToolErrorKind::ConfirmationRequired,
                    "ask the user to approve it; once the application has recorded the approval, call again with the same arguments and confirmationToken set to the request_id",
                ));
            }
            Some(Value::String(token)) => ApprovalId(token),
            Some(_) => {
                return Err(fresh(
                    ToolErrorKind::ConfirmationInvalid,
                    "confirmationToken must be a request_id",
                ));
            }
        };
        let now_ms = unix_millis(now);
        let mut records = self.lock();
        let Some((record, _)) = records.get_mut(&token) else {
            drop(records);
            return Err(fresh(
                ToolErrorKind::ConfirmationInvalid,
                "no such request in this conversation",
            ));
        };
        if record.request.tool != tool || record.request.args != *input {
            drop(records);
            return Err(fresh(
                ToolErrorKind::ConfirmationInvalid,
                "the request was issued for another call",
            ));
        }
        if now_ms >= record.request.expires {
            records.remove(&token);
            drop(records);
            return Err(fresh(
                ToolErrorKind::ConfirmationInvalid,
                "the request expired",
            ));
        }
        match record.status {
            ApprovalStatus::Approved => {
                record.status = ApprovalStatus::Used;
                Ok(())
            }
            ApprovalStatus::Pending => Err(Rejection::new(ToolErrorKind::ConfirmationPending)
                .with_confirmation(record.request.clone())),
            ApprovalStatus::Denied => Err(Rejection::new(ToolErrorKind::ConfirmationDenied)),
            ApprovalStatus::Used => {
                drop(records);
                Err(fresh(
                    ToolErrorKind::ConfirmationInvalid,
                    "the approval was already used",
                ))
            }
        }
    }
}

fn next_seq(map: &BTreeMap<ApprovalId, (ApprovalRecord, u64)>) -> u64 {
    map.values().map(|(_, s)| *s + 1).max().unwrap_or(0)
}

/// Makes room for one more record: expired records go first, then the
/// oldest used or denied ones. Pending and approved requests are never
/// evicted: pending ones are bounded by [`MAX_PENDING`] where they are
/// issued, approved ones by the application that approves them.
fn trim(map: &mut BTreeMap<ApprovalId, (ApprovalRecord, u64)>, now_ms: u64) {
    if map.len() < MAX_REQUESTS {
        return;
    }
    map.retain(|_, (r, _)| now_ms < r.request.expires);
    if map.len() < MAX_REQUESTS {
        return;
    }
    let mut settled: Vec<(u64, ApprovalId)> = map
        .iter()
        .filter(|(_, (r, _))| matches!(r.status, ApprovalStatus::Used | ApprovalStatus::Denied))
        .map(|(id, (_, seq))| (*seq, id.clone()))
        .collect();
    settled.sort_unstable();
    let excess = map.len() + 1 - MAX_REQUESTS;
    for (_, id) in settled.into_iter().take(excess) {
        map.remove(&id);
    }
}

/// `v` as text with object keys sorted at every level (independent of
/// serde_json's `preserve_order`).
fn canonical(v: &Value) -> String {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(map) => {
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_by(|a, b| a.0.cmp(b.0));
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), sorted(v)))
                        .collect(),
                )
            }
            Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

/// The confirmation stage's layer.
#[derive(Debug, Clone, Copy)]
pub struct ConfirmLayer {
    ttl: Duration,
}

impl ConfirmLayer {
    /// A layer whose requests live for `ttl`.
    pub fn new(ttl: Duration) -> Self {
        ConfirmLayer { ttl }
    }
}

impl<S> ToolLayer<S> for ConfirmLayer {
    type Service = Confirm<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Confirm {
            inner,
            ttl: self.ttl,
        }
    }
}

/// A service behind the confirmation stage.
#[derive(Debug, Clone)]
pub struct Confirm<S> {
    inner: S,
    ttl: Duration,
}

impl<S: ToolService> ToolService for Confirm<S> {
    fn call<'a>(&'a self, mut req: ToolRequest<'a>) -> BoxFuture<'a, ToolExecutionResult> {
        if !req.metadata.is_some_and(|m| m.requires_confirmation()) {
            return self.inner.call(req);
        }
        match req.policy.approvals().check(
            req.name,
            req.input.to_mut(),
            self.ttl,
            SystemTime::now(),
        ) {
            Ok(()) => self.inner.call(req),
            Err(rejection) => {
                let result = rejection.respond(&req);
                Box::pin(std::future::ready(result))
            }
        }
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("confirm");
        self.inner.stages(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TTL: Duration = DEFAULT_CONFIRMATION_TTL;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn required(approvals: &Approvals, args: Value, now: SystemTime) -> ConfirmationRequest {
        let mut input = args;
        let err = approvals
            .check("pay", &mut input, TTL, now)
            .expect_err("needs an approval");
        assert_eq!(err.kind(), ToolErrorKind::ConfirmationRequired);
        err.confirmation().expect("a request").clone()
    }

    fn present(
        approvals: &Approvals,
        id: &ApprovalId,
        args: Value,
        now: SystemTime,
    ) -> Result<Value, ToolErrorKind> {
        let mut input = args;
        if let Value::Object(map) = &mut input {
            map.insert(CONFIRMATION_TOKEN.into(), json!(id.as_str()));
        }
        approvals
            .check("pay", &mut input, TTL, now)
            .map(|()| input)
            .map_err(|r| r.kind())
    }

    #[test]
    fn an_approved_request_lets_exactly_one_identical_call_through() {
        let approvals = Approvals::new();
        let request = required(&approvals, json!({"b": 2, "a": 1}), at(1_000));
        assert_eq!(request.expires, 1_300_000);
        assert_eq!(request.preview, r#"pay {"a":1,"b":2}"#);
        assert_eq!(approvals.pending_at(at(1_000)), vec![request.clone()]);

        let id = request.request_id;
        assert_eq!(
            present(&approvals, &id, json!({"a": 1, "b": 2}), at(1_001)),
            Err(ToolErrorKind::ConfirmationPending),
            "the model cannot approve its own call"
        );
        approvals
            .decide(&id, ApprovalStatus::Approved, at(1_002))
            .expect("approve");
        assert_eq!(
            present(&approvals, &id, json!({"a": 1, "b": 3}), at(1_003)),
            Err(ToolErrorKind::ConfirmationInvalid),
            "other arguments"
        );
        assert_eq!(
            present(&approvals, &id, json!({"a": 1, "b": 2}), at(1_003)),
            Ok(json!({"a": 1, "b": 2})),
            "the token is stripped"
        );
        assert_eq!(
            present(&approvals, &id, json!({"a": 1, "b": 2}), at(1_004)),
            Err(ToolErrorKind::ConfirmationInvalid),
            "used"
        );
        assert_eq!(
            present(&approvals, &id, json!({"a": 1, "b": 2}), at(1_005)),
            Err(ToolErrorKind::ConfirmationInvalid),
            "used stays invalid"
        );
    }

    #[test]
    fn ids_are_random_and_a_reissue_is_a_new_id() {
        let approvals = Approvals::new();
        let first = required(&approvals, json!({"a": 1}), at(10));
        assert!(first.request_id.as_str().starts_with("apr_"));
        assert_eq!(first.request_id.as_str().len(), 36);
        // Asking again while it is pending shows the same request.
        assert_eq!(
            required(&approvals, json!({"a": 1}), at(11)).request_id,
            first.request_id
        );
        approvals
            .decide(&first.request_id, ApprovalStatus::Denied, at(12))
            .expect("deny");
        assert_eq!(
            present(&approvals, &first.request_id, json!({"a": 1}), at(13)),
            Err(ToolErrorKind::ConfirmationDenied)
        );
        let second = required(&approvals, json!({"a": 1}), at(14));
        assert_ne!(second.request_id, first.request_id);
        // Another conversation's store knows neither.
        let other = Approvals::new();
        assert_eq!(
            present(&other, &second.request_id, json!({"a": 1}), at(15)),
            Err(ToolErrorKind::ConfirmationInvalid)
        );
        assert_ne!(
            required(&other, json!({"a": 1}), at(16)).request_id,
            second.request_id
        );
    }

    #[test]
    fn expired_requests_can_be_neither_approved_nor_used() {
        let approvals = Approvals::new();
        let late = required(&approvals, json!({"a": 1}), at(0)).request_id;
        assert_eq!(
            approvals.decide(&late, ApprovalStatus::Approved, at(301)),
            Err(ApprovalError::Expired(late.clone()))
        );
        let used_late = required(&approvals, json!({"a": 2}), at(400)).request_id;
        approvals
            .decide(&used_late, ApprovalStatus::Approved, at(401))
            .expect("approve");
        assert_eq!(
            present(&approvals, &used_late, json!({"a": 2}), at(701)),
            Err(ToolErrorKind::ConfirmationInvalid)
        );
        assert_eq!(
            present(&approvals, &used_late, json!({"a": 2}), at(402)),
            Err(ToolErrorKind::ConfirmationInvalid),
            "an expired approval stays invalid"
        );
        assert_eq!(
            approvals.decide(
                &ApprovalId::from("apr_0"),
                ApprovalStatus::Approved,
                at(402)
            ),
            Err(ApprovalError::NotFound(ApprovalId::from("apr_0")))
        );
    }

    #[test]
    fn null_arguments_are_not_rewritten() {
        let approvals = Approvals::new();
        let mut input = Value::Null;
        let err = approvals
            .check("pay", &mut input, TTL, at(0))
            .expect_err("needs approval");
        assert_eq!(
            err.confirmation().map(|r| r.args.clone()),
            Some(Value::Null)
        );
    }

    #[test]
    fn a_snapshot_keeps_pending_and_approved_requests() {
        let approvals = Approvals::new();
        let now = SystemTime::now();
        let pending = required(&approvals, json!({"a": 1}), now);
        let approved = required(&approvals, json!({"a": 2}), now);
        approvals
            .decide(&approved.request_id, ApprovalStatus::Approved, now)
            .expect("approve");
        let denied = required(&approvals, json!({"a": 3}), now);
        approvals
            .decide(&denied.request_id, ApprovalStatus::Denied, now)
            .expect("deny");
        let records = approvals.snapshot();
        assert_eq!(records.len(), 2);
        let restored = Approvals::new();
        restored.restore(records);
        assert_eq!(restored.pending_at(now), vec![pending]);
        assert_eq!(
            present(&restored, &approved.request_id, json!({"a": 2}), now),
            Ok(json!({"a": 2}))
        );
    }

    #[test]
    fn a_flood_of_requests_never_evicts_an_approval() {
        let approvals = Approvals::new();
        let approved = required(&approvals, json!({"n": -1}), at(0)).request_id;
        approvals
            .decide(&approved, ApprovalStatus::Approved, at(1))
            .expect("approve");
        let mut refused = 0;
        for n in 0..2_000 {
            let mut input = json!({ "n": n });
            let err = approvals
                .check("pay", &mut input, TTL, at(2))
                .expect_err("needs an approval");
            assert_eq!(err.kind(), ToolErrorKind::ConfirmationRequired);
            if err.confirmation().is_none() {
                refused += 1;
            }
        }
        assert_eq!(
            present(&approvals, &approved, json!({"n": -1}), at(3)),
            Ok(json!({"n": -1})),
            "the approval survives the flood"
        );
        assert!(refused > 0, "a flood is refused, not stored");
        assert!(approvals.pending_at(at(2)).len() <= MAX_PENDING);
    }

    #[test]
    fn a_lifetime_longer_than_the_clock_does_not_panic() {
        let approvals = Approvals::new();
        let mut input = json!({"amount": 1});
        let err = approvals
            .check("pay", &mut input, Duration::MAX, SystemTime::now())
            .expect_err("needs approval");
        assert_eq!(err.confirmation().map(|r| r.expires), Some(u64::MAX));
    }
}
