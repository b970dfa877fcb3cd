//! The approvals of one conversation: confirmation requests, the
//! application's decisions on them, and the store that keeps them
//! ([`Approvals`]).
//!
//! An approval is a decision of the application, never of the model. A
//! request has a random id (from the operating system's CSPRNG), the tool,
//! the exact arguments, a preview and an expiry; a request of a paused call
//! is also bound to the call itself ([`HeldCall`]: its user turn, its
//! instance and its call id). The application decides each request with
//! [`Approvals::decide`]: approve, approve with edited arguments (checked
//! against the tool's schema), deny with a message the model reads, or
//! answer with a result of its own.
//!
//! The approvals belong to one conversation (a machine's
//! [`PolicyState`](crate::PolicyState)): an id issued in one is unknown in
//! every other. At most [`MAX_PENDING`] requests wait for a decision at
//! once; a call that would issue one more gets its error result without a
//! request. An approved request is never forgotten before it expires, and a
//! request holding a paused call is kept (expired or not) until the step
//! that answers the call is recorded.
//!
//! How a call waits for its approval is the confirmation stage's
//! ([`ApprovalFlow`]): the pause flow and the token flow each have a file
//! of their own.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use markov_core::ids::{InstanceId, ToolCallId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::schema::check_schema;

/// The argument that carries the id of an approved confirmation request
/// (the token flow only).
pub const CONFIRMATION_TOKEN: &str = "confirmationToken";

/// Records kept per conversation before used, denied and expired ones are
/// forgotten. Approved requests are never forgotten before they expire,
/// pending ones are bounded by [`MAX_PENDING`], and the requests of a
/// paused call go when its step is recorded, so the set stays bounded by
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

/// How a call of a tool that needs approval waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ApprovalFlow {
    /// The call does not run and the machine pauses its run
    /// (`YieldReason::AwaitingApproval`); once the application has decided,
    /// resuming runs the approved call without asking the model again.
    #[default]
    Pause,
    /// The call is answered `CONFIRMATION_REQUIRED`; after the
    /// application's approval the model calls again with
    /// `confirmationToken` set to the request id. For callers that cannot
    /// pause (another agent over MCP, say).
    Token,
}

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

/// What the user is asked to approve. In the token flow the model reads
/// it in the envelope; a paused call's request reaches only the
/// application.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfirmationRequest {
    /// The request's id: what the application decides; in the token flow,
    /// what the model sends back as `confirmationToken` once the
    /// application has approved it.
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
    /// The paused call's id (the pause flow only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<ToolCallId>,
}

/// Where a confirmation request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ApprovalStatus {
    /// Waiting for the application's decision.
    Pending,
    /// Approved (as asked or with edited arguments): the call runs.
    Approved,
    /// Denied by the application.
    Denied,
    /// Approved and used by a call.
    Used,
    /// Answered by the application with a result of its own: the tool
    /// does not run.
    Answered,
}

impl fmt::Display for ApprovalStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Denied => "denied",
            ApprovalStatus::Used => "used",
            ApprovalStatus::Answered => "answered",
        })
    }
}

/// The application's decision on a confirmation request. As JSON it is
/// tagged by `decision`: `{"decision": "approve"}`,
/// `{"decision": "edit", "args": {..}}`,
/// `{"decision": "deny", "message": ".."}`,
/// `{"decision": "respond", "result": ..}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Decision {
    /// Run the call as the model asked.
    Approve,
    /// Run the call with these arguments instead (checked against the
    /// tool's input schema when decided). The pause flow only.
    Edit {
        /// The arguments the call runs with.
        args: Value,
    },
    /// Do not run the call; the model reads that the user declined, and
    /// the message if there is one.
    Deny {
        /// What the model reads beside the refusal.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// Do not run the call; the model reads `result` as its result. The
    /// pause flow only.
    Respond {
        /// The result (a string is the text the model reads; any other
        /// value is written as JSON).
        result: Value,
    },
}

impl Decision {
    /// The status a request takes with this decision.
    fn status(&self) -> ApprovalStatus {
        match self {
            Decision::Approve | Decision::Edit { .. } => ApprovalStatus::Approved,
            Decision::Deny { .. } => ApprovalStatus::Denied,
            Decision::Respond { .. } => ApprovalStatus::Answered,
        }
    }

    /// The decision's name (`"approve"`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            Decision::Approve => "approve",
            Decision::Edit { .. } => "edit",
            Decision::Deny { .. } => "deny",
            Decision::Respond { .. } => "respond",
        }
    }
}

/// The paused call a request holds: what binds the decision to that call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HeldCall {
    /// The call's key in the idempotency ledger: its user turn, instance
    /// and call id.
    pub key: String,
    /// The leaf instance the call runs for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<InstanceId>,
    /// The tool's input schema, which edited arguments must fit.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub schema: Value,
    /// What a call that asked for this decision while it ran kept to
    /// continue from when it runs again (a sub-agent's machine), stored
    /// with the request.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub state: Value,
}

/// A confirmation request and where it stands: what a snapshot keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalRecord {
    /// The request.
    pub request: ConfirmationRequest,
    /// Its status.
    pub status: ApprovalStatus,
    /// The application's decision, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
    /// The paused call it holds (the pause flow only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<HeldCall>,
    /// Who decided, when the decision named its decider
    /// ([`Approvals::decide_by`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
}

impl ApprovalRecord {
    /// Whether the application may still decide it at `now_ms`.
    pub(crate) fn open(&self, now_ms: u64) -> bool {
        self.status == ApprovalStatus::Pending && now_ms < self.request.expires
    }
}

/// The application's decision a paused call went on with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecidedApproval {
    /// The confirmation request.
    pub request: ApprovalId,
    /// The decision's name (`"approve"`, `"edit"`, `"deny"`, `"respond"`).
    pub decision: String,
    /// Who decided, when the decision named its decider
    /// ([`Approvals::decide_by`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// Why the application's decision on a request was refused. A refused
/// decision changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApprovalError {
    /// No such request in this conversation (never issued, issued in
    /// another conversation, or forgotten after it was used or expired).
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
    /// The edited arguments do not fit the tool's input schema.
    #[error("the edited arguments of {id} do not fit the tool: {reason}")]
    InvalidArguments {
        /// The request.
        id: ApprovalId,
        /// What does not fit.
        reason: String,
    },
    /// The decision needs a paused call (editing or answering a request of
    /// the token flow, where the model makes the call).
    #[error(
        "confirmation request {id} cannot be decided with {decision}: the model makes its call"
    )]
    Unsupported {
        /// The request.
        id: ApprovalId,
        /// The decision's name.
        decision: &'static str,
    },
}

/// What the pause flow does with one call (see [`Approvals::check_held`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum HeldCheck {
    /// Run the call, with these arguments when the application edited them.
    Run(Option<Value>),
    /// Wait for the application's decision on this request.
    Wait(ConfirmationRequest),
    /// The application denied the call, with this message.
    Denied(Option<String>),
    /// The application answered the call with this result.
    Answered(Value),
    /// The request expired before an approval was used.
    Expired,
    /// [`MAX_PENDING`] requests already wait: no request was issued.
    Full,
}

/// The confirmation requests of one conversation.
#[derive(Debug, Default)]
pub struct Approvals {
    records: Mutex<BTreeMap<ApprovalId, (ApprovalRecord, u64)>>,
    /// Bumped by every change, so a store writes the set only when it changed.
    revision: std::sync::atomic::AtomicU64,
}

pub(crate) fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) type Records = BTreeMap<ApprovalId, (ApprovalRecord, u64)>;

impl Approvals {
    /// No requests.
    pub fn new() -> Self {
        Self::default()
    }

    /// The records, to read.
    fn read(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The records, to change: bumps the revision (a spurious bump only
    /// costs a store one extra write).
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
        self.revision
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.read()
    }

    /// Keeps `state` with the newest request held for the call `key`
    /// (see [`HeldCall::state`]); `false` when the call holds none.
    pub fn keep_held_state(&self, key: &str, state: Value) -> bool {
        let mut records = self.lock();
        let newest = records
            .values_mut()
            .filter(|(r, _)| r.held.as_ref().is_some_and(|h| h.key == key))
            .max_by_key(|(_, order)| *order)
            .and_then(|(r, _)| r.held.as_mut());
        match newest {
            Some(held) => {
                held.state = state;
                true
            }
            None => false,
        }
    }

    /// The state kept with a request held for the call `key`, if any
    /// (the newest).
    pub fn held_state(&self, key: &str) -> Option<Value> {
        self.read()
            .values()
            .filter(|(r, _)| {
                r.held
                    .as_ref()
                    .is_some_and(|h| h.key == key && !h.state.is_null())
            })
            .max_by_key(|(_, order)| *order)
            .and_then(|(r, _)| r.held.as_ref())
            .map(|h| h.state.clone())
    }

    /// A number that changes whenever the requests may have changed.
    pub fn revision(&self) -> u64 {
        self.revision.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The requests waiting for a decision and not expired, oldest first
    /// (the paused calls' and the token flow's).
    pub fn pending(&self) -> Vec<ConfirmationRequest> {
        self.pending_at(SystemTime::now())
    }

    /// [`pending`](Self::pending) at `now`.
    pub fn pending_at(&self, now: SystemTime) -> Vec<ConfirmationRequest> {
        self.pending_where(unix_millis(now), |_| true)
    }

    /// The undecided, unexpired requests of paused calls, oldest first.
    pub fn held_pending_at(&self, now: SystemTime) -> Vec<ConfirmationRequest> {
        self.pending_where(unix_millis(now), |r| r.held.is_some())
    }

    fn pending_where(
        &self,
        now_ms: u64,
        keep: impl Fn(&ApprovalRecord) -> bool,
    ) -> Vec<ConfirmationRequest> {
        let mut pending: Vec<_> = self
            .read()
            .values()
            .filter(|(r, _)| r.open(now_ms) && keep(r))
            .map(|(r, seq)| (*seq, r.request.clone()))
            .collect();
        pending.sort_by_key(|(seq, _)| *seq);
        pending.into_iter().map(|(_, r)| r).collect()
    }

    /// The record of `id`, if this conversation has it.
    pub fn get(&self, id: &ApprovalId) -> Option<ApprovalRecord> {
        self.read().get(id).map(|(r, _)| r.clone())
    }

    /// Approves the pending request `id`: the call runs as the model asked
    /// (in the token flow: the next call of its tool with its exact
    /// arguments and `confirmationToken: id` runs, once).
    pub fn approve(&self, id: &ApprovalId) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide(id, Decision::Approve)
    }

    /// Denies the pending request `id` without a message: the call does
    /// not run, for good.
    pub fn deny(&self, id: &ApprovalId) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide(id, Decision::Deny { message: None })
    }

    /// Records the application's decision on the pending request `id`.
    /// Refused, changing nothing, when the request is unknown in this
    /// conversation, already decided or expired, when edited arguments do
    /// not fit the tool's schema, and when a token-flow request is edited
    /// or answered. Of two decisions racing on one request, exactly one is
    /// recorded; the other is refused as already decided.
    pub fn decide(
        &self,
        id: &ApprovalId,
        decision: Decision,
    ) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide_at(id, decision, SystemTime::now())
    }

    /// [`decide`](Self::decide), naming who decided (a principal's id): the
    /// request keeps it ([`ApprovalRecord::decided_by`]), and the trace of
    /// the step that goes on with the call says it.
    pub fn decide_by(
        &self,
        id: &ApprovalId,
        decision: Decision,
        by: &str,
    ) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide_inner(id, decision, Some(by), SystemTime::now())
    }

    /// [`decide`](Self::decide) at `now`.
    pub fn decide_at(
        &self,
        id: &ApprovalId,
        decision: Decision,
        now: SystemTime,
    ) -> Result<ConfirmationRequest, ApprovalError> {
        self.decide_inner(id, decision, None, now)
    }

    fn decide_inner(
        &self,
        id: &ApprovalId,
        decision: Decision,
        by: Option<&str>,
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
        match (&decision, &record.held) {
            (Decision::Edit { .. } | Decision::Respond { .. }, None) => {
                return Err(ApprovalError::Unsupported {
                    id: id.clone(),
                    decision: decision.as_str(),
                });
            }
            (Decision::Edit { args }, Some(held)) => {
                let invalid = |reason: String| ApprovalError::InvalidArguments {
                    id: id.clone(),
                    reason,
                };
                markov_core::tool::check_tool_arguments(args)
                    .map_err(|e| invalid(e.to_string()))?;
                if !args.is_object() {
                    return Err(invalid("arguments must be an object".into()));
                }
                check_schema(&held.schema, args).map_err(invalid)?;
            }
            _ => {}
        }
        record.status = decision.status();
        record.decision = Some(decision);
        record.decided_by = by.map(str::to_owned);
        Ok(record.request.clone())
    }

    /// The decision the paused call `key` of `tool` was decided with, if
    /// it was.
    pub(crate) fn decided(&self, key: &str, tool: &str) -> Option<DecidedApproval> {
        self.read().values().find_map(|(r, _)| {
            let held = r.held.as_ref()?;
            let decision = r.decision.as_ref()?;
            (held.key == key && r.request.tool == tool).then(|| DecidedApproval {
                request: r.request.request_id.clone(),
                decision: decision.as_str().to_owned(),
                by: r.decided_by.clone(),
            })
        })
    }

    /// The requests worth keeping, for a snapshot: the ones that have not
    /// expired — pending and approved ones to act on, decided ones so that
    /// a second decision is refused as already decided rather than unknown
    /// — and every request holding a paused call.
    pub fn snapshot(&self) -> Vec<ApprovalRecord> {
        let now = unix_millis(SystemTime::now());
        let mut kept: Vec<_> = self
            .read()
            .values()
            .filter(|(r, _)| r.held.is_some() || now < r.request.expires)
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

    /// Forgets the paused calls whose instance `still_paused` does not
    /// name: their step is recorded, so the calls are answered. A request
    /// that was decided stays, without its call, until it expires, so that
    /// deciding it again is refused as already decided rather than
    /// unknown; an undecided one goes.
    pub fn forget_held(&self, still_paused: impl Fn(&InstanceId) -> bool) {
        let mut records = self.read();
        let before = records.len();
        let mut settled = false;
        records.retain(|_, (r, _)| match &r.held {
            Some(HeldCall {
                instance: Some(instance),
                ..
            }) if !still_paused(instance) => {
                let decided = matches!(
                    r.status,
                    ApprovalStatus::Used | ApprovalStatus::Denied | ApprovalStatus::Answered
                );
                if decided {
                    r.held = None;
                    settled = true;
                }
                decided
            }
            _ => true,
        });
        if settled || records.len() != before {
            self.revision
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The arguments the application approved for the paused call `key` of
    /// `tool`, when it edited them.
    pub fn edited_args(&self, key: &str, tool: &str) -> Option<Value> {
        self.read()
            .values()
            .find_map(|(r, _)| match (&r.held, &r.decision) {
                (Some(held), Some(Decision::Edit { args }))
                    if held.key == key && r.request.tool == tool =>
                {
                    Some(args.clone())
                }
                _ => None,
            })
    }

    /// The pause flow's decision for the call `key` (its ledger key) of
    /// `tool` with `args` (sans-IO): its request when it has one (the
    /// arguments are the model's, or the ones the application approved),
    /// else a new pending request. An approval is used here: a call that
    /// gets [`HeldCheck::Run`] runs, and a used approval keeps letting the
    /// same call through, so that a step resumed after a crash reaches the
    /// ledger, which answers it without running it twice.
    #[allow(clippy::too_many_arguments)]
    pub fn check_held(
        &self,
        key: &str,
        instance: Option<&InstanceId>,
        call_id: &ToolCallId,
        tool: &str,
        args: &Value,
        schema: impl FnOnce() -> Value,
        ttl: Duration,
        now: SystemTime,
    ) -> HeldCheck {
        let now_ms = unix_millis(now);
        let mut records = self.lock();
        let found = records.values_mut().find(|(r, _)| {
            r.held.as_ref().is_some_and(|h| h.key == key)
                && r.request.tool == tool
                && (r.request.args == *args
                    || matches!(&r.decision, Some(Decision::Edit { args: edited }) if edited == args))
        });
        if let Some((record, _)) = found {
            let edited = match &record.decision {
                Some(Decision::Edit { args }) => Some(args.clone()),
                _ => None,
            };
            return match record.status {
                ApprovalStatus::Used => HeldCheck::Run(edited),
                ApprovalStatus::Approved if now_ms < record.request.expires => {
                    record.status = ApprovalStatus::Used;
                    HeldCheck::Run(edited)
                }
                ApprovalStatus::Pending if now_ms < record.request.expires => {
                    HeldCheck::Wait(record.request.clone())
                }
                ApprovalStatus::Approved | ApprovalStatus::Pending => HeldCheck::Expired,
                ApprovalStatus::Denied => HeldCheck::Denied(match &record.decision {
                    Some(Decision::Deny { message }) => message.clone(),
                    _ => None,
                }),
                ApprovalStatus::Answered => HeldCheck::Answered(match &record.decision {
                    Some(Decision::Respond { result }) => result.clone(),
                    _ => Value::Null,
                }),
            };
        }
        let held = HeldCall {
            key: key.to_owned(),
            instance: instance.cloned(),
            schema: schema(),
            state: Value::Null,
        };
        match issue(&mut records, tool, args, ttl, now, Some((call_id, held))) {
            Some(request) => HeldCheck::Wait(request),
            None => HeldCheck::Full,
        }
    }
}

/// Records a new pending request for `tool` with `args` (for the paused
/// call `held` names, if any) and returns it, or `None` when
/// [`MAX_PENDING`] requests already wait for a decision.
pub(crate) fn issue(
    records: &mut Records,
    tool: &str,
    args: &Value,
    ttl: Duration,
    now: SystemTime,
    held: Option<(&ToolCallId, HeldCall)>,
) -> Option<ConfirmationRequest> {
    let now_ms = unix_millis(now);
    if open_count(records, now_ms) >= MAX_PENDING {
        return None;
    }
    let (call_id, held) = held.map_or((None, None), |(id, held)| (Some(id.clone()), Some(held)));
    let request = new_request(tool, args, ttl, now, call_id);
    insert(
        records,
        ApprovalRecord {
            request: request.clone(),
            status: ApprovalStatus::Pending,
            decision: None,
            held,
            decided_by: None,
        },
        now_ms,
    );
    Some(request)
}

/// Requests that wait for a decision and have not expired.
fn open_count(records: &Records, now_ms: u64) -> usize {
    records.values().filter(|(r, _)| r.open(now_ms)).count()
}

/// A new request with a random id.
fn new_request(
    tool: &str,
    args: &Value,
    ttl: Duration,
    now: SystemTime,
    call_id: Option<ToolCallId>,
) -> ConfirmationRequest {
    // A lifetime too long for the clock ("never expires") saturates.
    let expires = now.checked_add(ttl).map_or(u64::MAX, unix_millis);
    ConfirmationRequest {
        request_id: ApprovalId::random(),
        expires,
        tool: tool.to_owned(),
        args: args.clone(),
        preview: format!("{tool} {}", canonical(args)),
        call_id,
    }
}

fn insert(records: &mut Records, record: ApprovalRecord, now_ms: u64) {
    trim(records, now_ms);
    let seq = next_seq(records);
    records.insert(record.request.request_id.clone(), (record, seq));
}

fn next_seq(map: &Records) -> u64 {
    map.values().map(|(_, s)| *s + 1).max().unwrap_or(0)
}

/// Whether a record may be evicted to make room at all: not one holding a
/// paused call of a machine, which goes when the call's step is recorded
/// (a resumed step must find its decision).
fn evictable(record: &ApprovalRecord) -> bool {
    let machine_held = record.held.as_ref().is_some_and(|h| h.instance.is_some());
    !machine_held
}

/// Makes room for one more record: expired records go first, then the
/// oldest used, denied or answered ones. Pending and approved requests are
/// never evicted: pending ones are bounded by [`MAX_PENDING`] where they
/// are issued, approved ones by the application that approves them.
fn trim(map: &mut Records, now_ms: u64) {
    if map.len() < MAX_REQUESTS {
        return;
    }
    map.retain(|_, (r, _)| !evictable(r) || now_ms < r.request.expires);
    if map.len() < MAX_REQUESTS {
        return;
    }
    let mut settled: Vec<(u64, ApprovalId)> = map
        .iter()
        .filter(|(_, (r, _))| {
            evictable(r)
                && matches!(
                    r.status,
                    ApprovalStatus::Used | ApprovalStatus::Denied | ApprovalStatus::Answered
                )
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kind::ToolErrorKind;
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
            .decide_at(&id, Decision::Approve, at(1_002))
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
            .decide_at(&first.request_id, Decision::Deny { message: None }, at(12))
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
            approvals.decide_at(&late, Decision::Approve, at(301)),
            Err(ApprovalError::Expired(late.clone()))
        );
        let used_late = required(&approvals, json!({"a": 2}), at(400)).request_id;
        approvals
            .decide_at(&used_late, Decision::Approve, at(401))
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
            approvals.decide_at(&ApprovalId::from("apr_0"), Decision::Approve, at(402)),
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
    fn a_snapshot_keeps_unexpired_requests_and_a_decided_one_stays_decided() {
        let approvals = Approvals::new();
        let now = SystemTime::now();
        let pending = required(&approvals, json!({"a": 1}), now);
        let approved = required(&approvals, json!({"a": 2}), now);
        approvals
            .decide_at(&approved.request_id, Decision::Approve, now)
            .expect("approve");
        let denied = required(&approvals, json!({"a": 3}), now);
        approvals
            .decide_at(&denied.request_id, Decision::Deny { message: None }, now)
            .expect("deny");
        let expired = required(&approvals, json!({"a": 4}), at(0));
        let records = approvals.snapshot();
        assert_eq!(records.len(), 3, "all but the expired one");
        let restored = Approvals::new();
        restored.restore(records);
        assert_eq!(restored.pending_at(now), vec![pending]);
        assert_eq!(
            present(&restored, &approved.request_id, json!({"a": 2}), now),
            Ok(json!({"a": 2}))
        );
        assert_eq!(
            restored.decide_at(&denied.request_id, Decision::Approve, now),
            Err(ApprovalError::AlreadyDecided {
                id: denied.request_id.clone(),
                status: ApprovalStatus::Denied
            }),
            "a second decision is refused as such"
        );
        assert_eq!(
            restored.decide_at(&expired.request_id, Decision::Approve, now),
            Err(ApprovalError::NotFound(expired.request_id.clone()))
        );
    }

    #[test]
    fn a_flood_of_requests_never_evicts_an_approval() {
        let approvals = Approvals::new();
        let approved = required(&approvals, json!({"n": -1}), at(0)).request_id;
        approvals
            .decide_at(&approved, Decision::Approve, at(1))
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

    fn hold(approvals: &Approvals, key: &str, now: SystemTime) -> HeldCheck {
        approvals.check_held(
            key,
            Some(&InstanceId::new("leaf")),
            &ToolCallId::new("c1"),
            "pay",
            &json!({"a": 1}),
            || json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
            TTL,
            now,
        )
    }

    #[test]
    fn a_held_request_outlives_its_expiry_until_its_step_is_recorded() {
        let approvals = Approvals::new();
        let HeldCheck::Wait(request) = hold(&approvals, "t1:leaf:c1", at(0)) else {
            panic!("a new call waits");
        };
        assert_eq!(request.call_id, Some(ToolCallId::new("c1")));
        assert_eq!(approvals.held_pending_at(at(1)), vec![request.clone()]);
        // Long expired, still in the snapshot: a restored step answers it
        // as expired instead of asking again.
        let records = approvals.snapshot();
        assert_eq!(records.len(), 1);
        let restored = Approvals::new();
        restored.restore(records);
        assert_eq!(hold(&restored, "t1:leaf:c1", at(1_000)), HeldCheck::Expired);
        assert_eq!(
            restored.held_pending_at(at(1_000)),
            Vec::new(),
            "nothing to decide"
        );
        // A paused leaf keeps it; once its step is recorded it goes.
        restored.forget_held(|i| i.as_str() == "leaf");
        assert_eq!(restored.snapshot().len(), 1);
        restored.forget_held(|_| false);
        assert!(restored.snapshot().is_empty());
    }

    #[test]
    fn a_used_approval_keeps_letting_its_own_call_through_and_no_other() {
        let approvals = Approvals::new();
        let HeldCheck::Wait(request) = hold(&approvals, "t1:leaf:c1", at(0)) else {
            panic!("waits");
        };
        approvals
            .decide_at(&request.request_id, Decision::Approve, at(1))
            .expect("approve");
        assert_eq!(hold(&approvals, "t1:leaf:c1", at(2)), HeldCheck::Run(None));
        // Used: a resumed step after a crash reaches the ledger again, even
        // after the expiry.
        assert_eq!(
            hold(&approvals, "t1:leaf:c1", at(10_000)),
            HeldCheck::Run(None)
        );
        // Another call (another key) is another request.
        assert!(matches!(
            hold(&approvals, "t1:leaf:c2", at(3)),
            HeldCheck::Wait(r) if r.request_id != request.request_id
        ));
        // A token names no held request.
        let mut input = json!({"a": 1, CONFIRMATION_TOKEN: request.request_id.as_str()});
        assert_eq!(
            approvals
                .check("pay", &mut input, TTL, at(4))
                .map_err(|r| r.kind()),
            Err(ToolErrorKind::ConfirmationInvalid)
        );
    }

    #[test]
    fn a_flood_never_evicts_a_paused_call() {
        let approvals = Approvals::new();
        let HeldCheck::Wait(request) = hold(&approvals, "t1:leaf:c1", at(0)) else {
            panic!("waits");
        };
        approvals
            .decide_at(&request.request_id, Decision::Approve, at(1))
            .expect("approve");
        assert_eq!(hold(&approvals, "t1:leaf:c1", at(2)), HeldCheck::Run(None));
        for n in 0..2_000 {
            let id = approvals
                .check("pay", &mut json!({ "n": n }), TTL, at(3))
                .err()
                .and_then(|r| r.confirmation().map(|c| c.request_id.clone()));
            if let Some(id) = id {
                let _ = approvals.decide_at(&id, Decision::Deny { message: None }, at(3));
            }
        }
        assert_eq!(
            approvals.get(&request.request_id).map(|r| r.status),
            Some(ApprovalStatus::Used)
        );
    }
}
