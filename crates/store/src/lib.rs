//! Durable sessions for markov machines.
//!
//! A [`Store`] keeps sessions: a machine's history as an append-only table
//! of messages, its instance tree (written when it changes), its pending and
//! approved confirmation requests (and those of calls waiting for approval,
//! with the paused answer that made them), its idempotency ledger, and the
//! state of a run in progress. [`DurableMachine`] drives a machine and writes each
//! step before the next model call, so a process that dies loses at most
//! the step in flight — and a tool call of that step that already ran is
//! not run again on resume: its ledger entry was written before its result
//! was used.
//!
//! Appending a step costs the size of the step, never of the history.
//!
//! - [`SqliteStore`] (feature `sqlite`, the default): SQLite compiled in, a
//!   file in WAL mode or in memory. One process.
//! - `PostgresStore` (feature `postgres`): several worker processes share
//!   one database; a session is leased by one worker at a time (see
//!   `docs/WORKERS.md`). `testing::TempPostgres` starts a throwaway server
//!   for tests.
//!
//! # Leases
//!
//! Every write names its writer ([`WorkerId`]) and is refused
//! ([`StoreError::LeaseLost`]) unless that worker holds the session's
//! unexpired lease ([`Store::acquire`]). Two workers therefore never run
//! the same machine, and a crashed worker's lease expires so that another
//! can resume the session.
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn demo(machine: markov_executor::Machine) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use markov_store::{DurableMachine, SessionId, SqliteStore, WorkerId};
//!
//! let store = Arc::new(SqliteStore::open("sessions.db")?);
//! let mut session =
//!     DurableMachine::create(store, SessionId::random(), WorkerId::new("web-1"), machine).await?;
//! session.machine().enqueue_user("hello");
//! let last = session.run().await?;
//! # let _ = last;
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use markov_context::UsageTotals;
use markov_core::Message;
use markov_executor::{RunState, SerializedInstance, SerializedMachine};
use markov_policy::{ApprovalRecord, LedgerEntry, PolicyCounters, RecordedAnswer, RepeatRecord};
use serde::{Deserialize, Serialize};

mod cache;
mod durable;
mod fork;
#[cfg(feature = "postgres")]
mod postgres;
mod repair;
mod replay;
#[cfg(feature = "sqlite")]
mod sqlite;
mod team;
#[cfg(feature = "postgres")]
pub mod testing;

pub use cache::SessionCache;
pub use durable::{CreateOptions, DEFAULT_LEASE, DurableError, DurableMachine, OpenOptions};
pub use fork::ForkOptions;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
pub use repair::RepairReport;
pub use replay::{
    AnswerSource, ReplayMode, ReplayOptions, ReplayReport, StepDiff, StepSide, ToolCallReplay,
    ToolCallSource, ToolEffect, replay,
};
#[cfg(feature = "sqlite")]
pub use sqlite::{Durability, SqliteStore};
pub use team::{DurableTeam, TeamEvent, TeamRecord, TeamReply, agent_session, member_session};

/// A session's id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(String);

impl SessionId {
    /// The id `id`.
    pub fn new(id: impl Into<String>) -> Self {
        SessionId(id.into())
    }

    /// A new random id.
    pub fn random() -> Self {
        SessionId(uuid::Uuid::new_v4().to_string())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who a session belongs to: the principal that created it (an API key's
/// principal, a token's subject). A service shows and changes a session
/// only for its owner.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Owner(String);

impl Owner {
    /// The owner `id`.
    pub fn new(id: impl Into<String>) -> Self {
        Owner(id.into())
    }

    /// The owner as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The name of a process (or task) that writes sessions.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(String);

impl WorkerId {
    /// The worker `id`.
    pub fn new(id: impl Into<String>) -> Self {
        WorkerId(id.into())
    }

    /// A new random worker id (`worker-<uuid>`).
    pub fn random() -> Self {
        WorkerId(format!("worker-{}", uuid::Uuid::new_v4().simple()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A worker's right to write a session until `expires_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The session.
    pub session: SessionId,
    /// The worker holding it.
    pub holder: WorkerId,
    /// When it expires unless renewed, in Unix milliseconds.
    pub expires_at: u64,
    /// The session's revision when the lease was granted.
    pub revision: Revision,
    /// The name of the charter the session runs (its agent's), so that a
    /// worker that leased it knows what to restore it over.
    pub charter: String,
}

/// Which writes a session has seen: every write after its creation (a
/// step, a journaled call or answer, a repair) makes a new revision, and a
/// session created again under the same id starts from a new random one.
///
/// A worker that kept a session's machine in memory after releasing it
/// ([`SessionCache`]) may use it again only if the revision it released
/// is still the session's revision when it leases it again: nobody wrote
/// in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Revision(u64);

impl Revision {
    /// The revision numbered `n`, as a store reads it from its database.
    pub fn new(n: u64) -> Self {
        Revision(n)
    }

    /// A random first revision for a new session (below 2^62, so that a
    /// database's signed 64-bit column counts up from it for ever).
    pub fn first() -> Self {
        Revision(uuid::Uuid::new_v4().as_u64_pair().0 >> 2)
    }

    /// Its number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A session as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Its id.
    pub id: SessionId,
    /// The charter it runs on.
    pub charter: String,
    /// Who it belongs to; `None` for a session created without an owner.
    pub owner: Option<Owner>,
    /// Steps written.
    pub steps: u64,
    /// Messages in its history.
    pub messages: u64,
    /// Whether a run was in progress at its last write.
    pub running: bool,
    /// When it was created, in Unix milliseconds.
    pub created_at: u64,
    /// When it was last written, in Unix milliseconds.
    pub updated_at: u64,
}

/// What one step adds to a session.
#[derive(Debug, Clone, Copy)]
pub struct StepRecord<'a> {
    /// The messages recorded since the last write, in order.
    pub messages: &'a [Message],
    /// The instance tree, if it changed since the last write.
    pub tree: Option<&'a SerializedInstance>,
    /// The pending and approved confirmation requests, if they changed.
    pub approvals: Option<&'a [ApprovalRecord]>,
    /// The loop guard's counts of the current user turn, if they changed.
    pub repeats: Option<&'a [RepeatRecord]>,
    /// The conversation's turn and budget counters, if they changed.
    pub counters: Option<&'a PolicyCounters>,
    /// The model's answers whose tools may have started and whose step is
    /// not recorded yet: empty once their step is (the common case); a step
    /// paused for approval keeps its answer here, marked paused, until it
    /// is resumed.
    pub answers: &'a [RecordedAnswer],
    /// The run in progress, or `None` when no run is in progress.
    pub run: Option<&'a RunState>,
    /// What the session and its current user turn have used, if it changed.
    pub usage: Option<&'a UsageTotals>,
    /// What the step was made of, when it is a step of a run and the
    /// machine records its steps: kept beside the step, in the same
    /// transaction. `None` for a write that is not a step (an approval, a
    /// command, the write before a model call).
    pub trace: Option<&'a StepTrace>,
}

/// How long recorded step detail ([`StepTrace`]) is kept, for
/// [`Store::prune_steps`]: a step is dropped when either limit says so.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRetention {
    /// Keep the steps recorded in the last this many days.
    pub days: Option<u32>,
    /// Keep the steps of the this many most recently written sessions.
    pub sessions: Option<u32>,
}

/// What one step of a session recorded, to see why the run did what it
/// did and to rebuild the exact request of any step: the model calls'
/// system prompts, tools, tool choice and settings (kept once per distinct
/// content by the store), the history the step added, the usage and
/// latency, the yield reason, and the instance tree when the step changed
/// it. Read back with [`Store::steps`].
///
/// Holds what the model was sent and answered; never a provider's key or
/// an HTTP header (those are the provider client's, and a request does not
/// carry them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepTrace {
    /// The step's place in the session, from 0, in the order recorded
    /// (the store numbers steps when it writes them).
    pub index: u64,
    /// When it was recorded, in Unix milliseconds.
    pub recorded_at: u64,
    /// Why the step ended.
    pub yield_reason: markov_executor::YieldReason,
    /// Whether the run ended with it.
    pub done: bool,
    /// The model that answered, as the answer named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What the step's model calls used (tokens, requests, cost).
    pub usage: markov_core::model::Usage,
    /// Milliseconds from the step's start to its end.
    pub step_ms: u64,
    /// The history before the step had this many messages: the step added
    /// those from here to [`history_to`](Self::history_to).
    pub history_from: u64,
    /// The history after the step had this many messages.
    pub history_to: u64,
    /// Each leaf's model call, in leaf order (empty on a step that called
    /// no model: a resume, a cancelled step).
    pub calls: Vec<markov_executor::ModelCall>,
    /// The calls that waited for a person's approval when the step ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<markov_policy::ConfirmationRequest>,
    /// The instance tree after the step, when the step changed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<SerializedInstance>,
    /// The instance tree before the step, on the first step a worker
    /// recorded after creating or opening the session (the steps after it
    /// say only what they changed, in [`tree`](Self::tree)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_before: Option<SerializedInstance>,
    /// The conversation's turn and budget counters before the step.
    #[serde(default)]
    pub counters_before: PolicyCounters,
    /// What the session and its user turn had used before the step.
    #[serde(default)]
    pub usage_before: UsageTotals,
    /// The steps of the sub-agents the step's tool calls ran
    /// ([`Agent::as_tool`](markov_executor::Agent::as_tool)), in the order
    /// they ended, each tied to the call that ran it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sub_agents: Vec<SubAgentTrace>,
    /// The loop guard's counts of the user turn before the step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats_before: Vec<RepeatRecord>,
    /// The conversation's policy state the step left for the steps after
    /// it, when it left any: a fork at the next step starts from it.
    #[serde(default, skip_serializing_if = "Waiting::is_empty")]
    pub waiting: Waiting,
}

/// One step of a sub-agent run by a tool call of a recorded step
/// ([`StepTrace::sub_agents`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubAgentTrace {
    /// The call that ran the sub-agent: first the call of the recorded
    /// step, then, for a sub-agent nested in another, the call of each
    /// sub-agent inside it, outermost first.
    pub calls: Vec<markov_core::ids::ToolCallId>,
    /// The sub-agent's step.
    pub step: markov_executor::SubAgentStep,
}

/// The policy state a step left for the steps after it ([`StepTrace::waiting`]):
/// the confirmation requests still open, and — when the step paused for
/// approval — its paused answer and the answered calls of that answer,
/// which resuming it replays from the idempotency ledger. Empty after most
/// steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Waiting {
    /// The confirmation requests still open (pending, or approved and not
    /// used yet).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<ApprovalRecord>,
    /// The paused answers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<RecordedAnswer>,
    /// The idempotency ledger: the calls of the paused answers that ran.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger: Vec<LedgerEntry>,
}

impl Waiting {
    /// Whether the step left nothing waiting.
    pub fn is_empty(&self) -> bool {
        self.approvals.is_empty() && self.answers.is_empty() && self.ledger.is_empty()
    }
}

impl StepTrace {
    /// The trace of `step`, which ran for `step_ms` over a history of
    /// `history_from` messages. The store gives it its
    /// [`index`](Self::index) and time when it writes it.
    pub fn of_step(step: &markov_executor::MachineStep, history_from: u64, step_ms: u64) -> Self {
        StepTrace {
            index: 0,
            recorded_at: 0,
            yield_reason: step.yield_reason,
            done: step.done,
            model: step.model.clone(),
            usage: step.usage,
            step_ms,
            history_from,
            history_to: history_from.saturating_add(step.history.len() as u64),
            calls: step.calls.clone(),
            approvals: step.approvals.clone(),
            tree: None,
            tree_before: None,
            counters_before: PolicyCounters::default(),
            usage_before: UsageTotals::default(),
            sub_agents: Vec::new(),
            repeats_before: Vec::new(),
            waiting: Waiting::default(),
        }
    }

    /// The request of this step's first model call (the primary leaf's) as
    /// the model received it, over the session's `history` (as
    /// [`Store::load`] reads it back), under a context policy the view it
    /// was shown rebuilt from its recorded shape
    /// ([`ModelCall::view`](markov_executor::ModelCall::view)): `None` when
    /// the step made no model call, when the history is shorter than the
    /// call saw, or when the call was recorded before views were.
    pub fn request<'a>(
        &'a self,
        history: &'a [Message],
    ) -> Option<markov_executor::SentRequest<'a>> {
        self.calls.first()?.request(history)
    }
}

/// A session as loaded.
#[derive(Debug, Clone)]
pub struct StoredSession {
    /// What the list shows.
    pub info: SessionInfo,
    /// The machine as a snapshot (tree, whole history, approvals, ledger).
    pub snapshot: SerializedMachine,
    /// The run that was in progress at the last write, to continue.
    pub run: Option<RunState>,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No session with this id.
    #[error("no session {0}")]
    NotFound(SessionId),
    /// A session with this id exists already.
    #[error("session {0} exists already")]
    AlreadyExists(SessionId),
    /// Another worker holds the session's lease.
    #[error("session {session} is leased by {holder} until {expires_at}")]
    Leased {
        /// The session.
        session: SessionId,
        /// Who holds it.
        holder: WorkerId,
        /// Until when (Unix milliseconds).
        expires_at: u64,
    },
    /// The writer does not hold the session's lease (it expired, or another
    /// worker took it): the write was refused.
    #[error("worker {worker} does not hold the lease of session {session}")]
    LeaseLost {
        /// The session.
        session: SessionId,
        /// The writer.
        worker: WorkerId,
    },
    /// What was stored does not read back.
    #[error("session {session} is corrupt: {detail}")]
    Corrupt {
        /// The session.
        session: SessionId,
        /// What is wrong.
        detail: String,
    },
    /// The database failed.
    #[error("store backend failed: {0}")]
    Backend(String),
}

/// Where sessions live.
///
/// Implementations keep the history append-only and write in one
/// transaction per call; every write after [`create`](Store::create) is
/// fenced by the writer's lease and makes a new [`Revision`].
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Creates session `id`, belonging to `owner` (if any), from a whole
    /// snapshot, leased to `holder` for `ttl`.
    async fn create(
        &self,
        id: &SessionId,
        owner: Option<&Owner>,
        charter: &str,
        snapshot: &SerializedMachine<&[Message]>,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError>;

    /// Appends one step.
    async fn append(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<(), StoreError>;

    /// Writes one answered call of the ledger, at once (before the result
    /// is used).
    async fn journal(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        entry: &LedgerEntry,
    ) -> Result<(), StoreError>;

    /// Writes the model's answers of the step in flight (replacing those
    /// written before), at once: before any of their tools runs.
    async fn journal_answers(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        answers: &[RecordedAnswer],
    ) -> Result<(), StoreError>;

    /// Up to `limit` recorded steps of session `id`, from step index
    /// `from` on, in order (an empty list past the last). Steps whose
    /// detail retention dropped are left out.
    async fn steps(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<StepTrace>, StoreError>;

    /// Up to `limit` messages of session `id`'s history, from message
    /// `from` on, in order (an empty list past the last): the messages of
    /// a page of steps (from the first one's
    /// [`history_from`](StepTrace::history_from) to the last one's
    /// [`history_to`](StepTrace::history_to)) without reading the rest of a
    /// long history.
    async fn messages(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError>;

    /// Drops the recorded step detail `retention` does not keep (the
    /// sessions themselves stay whole) and returns how many steps were
    /// dropped. Call it now and then (a service's housekeeping).
    async fn prune_steps(&self, retention: &StepRetention) -> Result<u64, StoreError>;

    /// Loads a session.
    async fn load(&self, id: &SessionId) -> Result<StoredSession, StoreError>;

    /// Makes a session whose stored data does not read back
    /// ([`StoreError::Corrupt`]) open again, and says what it changed: the
    /// history is cut before its first unreadable message, back to the
    /// last point where every tool call has its result; unreadable
    /// approvals, counters, answers and ledger entries are dropped; the run
    /// in progress is given up when the history was cut. A session that
    /// reads back is left as it is. Fenced like every write: `holder` must
    /// hold the lease ([`Store::acquire`] works on a corrupt session).
    async fn repair(&self, id: &SessionId, holder: &WorkerId) -> Result<RepairReport, StoreError>;

    /// Lists the sessions, most recently written first: those of `owner`,
    /// or all of them when `owner` is `None`.
    async fn list(&self, owner: Option<&Owner>) -> Result<Vec<SessionInfo>, StoreError>;

    /// What the list shows of session `id`, without its history (to check
    /// who owns it before opening it).
    async fn info(&self, id: &SessionId) -> Result<SessionInfo, StoreError>;

    /// Deletes a session; `false` if there was none.
    async fn delete(&self, id: &SessionId) -> Result<bool, StoreError>;

    /// Leases session `id` to `holder` for `ttl` (renewing a lease it holds),
    /// or says who holds it.
    async fn acquire(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError>;

    /// [`acquire`](Store::acquire) on behalf of `owner`: a session that is
    /// not `owner`'s is [`StoreError::NotFound`], as if it did not exist,
    /// and its lease is left as it was. For a service acting for a
    /// signed-in principal: the ownership is checked and the lease taken
    /// in one go. This default reads the session's [`info`](Store::info),
    /// then leases it; a store that can do both in one transaction does
    /// so (a session's owner never changes, so both ways answer the same).
    async fn acquire_owned(
        &self,
        id: &SessionId,
        owner: &Owner,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let info = self.info(id).await?;
        if info.owner.as_ref() != Some(owner) {
            return Err(StoreError::NotFound(id.clone()));
        }
        self.acquire(id, holder, ttl).await
    }

    /// Gives up `holder`'s lease on `id` and returns the session's revision
    /// at that moment, or `None` (and does nothing) if `holder` does not
    /// hold the lease.
    async fn release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
    ) -> Result<Option<Revision>, StoreError>;

    /// Appends one step and gives up `holder`'s lease in the same write,
    /// and returns the session's revision after it (`None` if the lease
    /// was given up already). For a run's last write when the session is
    /// released right after: one write instead of two, and no moment where
    /// the step is stored and the lease still held by a worker that is
    /// done with it. Fenced like [`append`](Store::append): nothing is
    /// written without the lease. This default appends, then releases; a
    /// store that can do both in one transaction does so.
    async fn append_and_release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<Option<Revision>, StoreError> {
        self.append(id, holder, step).await?;
        self.release(id, holder).await
    }

    /// Leases to `holder` a session whose run was in progress at its last
    /// write and whose lease is free or expired (a crashed worker's), if
    /// there is one.
    async fn claim_interrupted(
        &self,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError>;

    /// The team state kept beside session `id` (the session of a team
    /// conversation's entry agent, see [`DurableTeam`]), or `None` for a
    /// session that is not a team's.
    async fn team_state(&self, id: &SessionId) -> Result<Option<TeamRecord>, StoreError>;

    /// Writes the team state kept beside session `id`, replacing the one
    /// before: fenced like every write, `holder` must hold `id`'s lease.
    async fn write_team_state(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        state: &TeamRecord,
    ) -> Result<(), StoreError>;
}

/// An API key as stored: never the key itself, only its hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyRecord {
    /// The key's public id (the part of the key before its secret), to
    /// find it and to revoke it.
    pub id: String,
    /// The principal it signs in as.
    pub principal: String,
    /// The principal's roles with this key (`approver`, ...).
    pub roles: Vec<String>,
    /// The hash of its secret, as the service computed it.
    pub hash: String,
    /// When it was created, in Unix milliseconds.
    pub created_at: u64,
    /// When it was revoked, if it was.
    pub revoked_at: Option<u64>,
}

/// Where a service keeps its API keys (hashed), beside its sessions, so
/// that every worker on one database knows them and an operator's command
/// line creates and revokes them.
#[async_trait]
pub trait KeyStore: Send + Sync + fmt::Debug {
    /// Adds a key (its id must be new: a taken id is a
    /// [`StoreError::Backend`] error).
    async fn add_key(&self, key: &ApiKeyRecord) -> Result<(), StoreError>;

    /// The key with public id `id`, revoked or not.
    async fn key(&self, id: &str) -> Result<Option<ApiKeyRecord>, StoreError>;

    /// Revokes key `id` (from now on it signs nobody in); `false` if there
    /// is no such key or it was revoked already.
    async fn revoke_key(&self, id: &str) -> Result<bool, StoreError>;

    /// A number that every revocation raises, in the revocation's own
    /// transaction: a cache of keys read while it had one value stays
    /// true while it keeps it. Reading it is far cheaper than reading a
    /// key, so that a server can ask it on every request and refuse a key
    /// revoked by any worker on this database from the next request on.
    async fn key_generation(&self) -> Result<u64, StoreError>;

    /// Every key, oldest first.
    async fn keys(&self) -> Result<Vec<ApiKeyRecord>, StoreError>;

    /// Records the browser sign-in `id` as ended (signed out) until
    /// `expires_at`, in Unix seconds (when its cookie expires anyway), so
    /// that every worker on this database refuses it from its next request
    /// on, and after a restart too. Recording an id again keeps the later
    /// expiry. Records whose expiry has passed are deleted on the way (a
    /// bounded number per call).
    async fn end_sign_in(&self, id: &str, expires_at: u64) -> Result<(), StoreError>;

    /// Whether the browser sign-in `id` was ended with
    /// [`end_sign_in`](Self::end_sign_in). A record is kept at least until
    /// its expiry; after it, it may be forgotten (its cookie has expired
    /// by then).
    async fn sign_in_ended(&self, id: &str) -> Result<bool, StoreError>;
}

/// How many expired ended sign-ins one [`KeyStore::end_sign_in`] deletes
/// at most: the sweep's cost stays bounded however many expired at once.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) const ENDED_SIGN_INS_SWEPT: i64 = 100;

/// Now, in Unix milliseconds.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `ttl` in milliseconds, saturating.
pub(crate) fn ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

/// Text for a JSON column.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Backend(format!("cannot encode: {e}")))
}

/// A new session's columns, encoded once for either database: the tree,
/// the policy state, the usage and each message as JSON text.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) struct NewSessionColumns {
    pub(crate) tree: String,
    pub(crate) approvals: String,
    pub(crate) repeats: String,
    pub(crate) counters: String,
    /// `None` when no answers are recorded.
    pub(crate) answers: Option<String>,
    /// `None` when nothing was used yet.
    pub(crate) usage: Option<String>,
    pub(crate) messages: Vec<String>,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl NewSessionColumns {
    pub(crate) fn of(snapshot: &SerializedMachine<&[Message]>) -> Result<Self, StoreError> {
        Ok(NewSessionColumns {
            tree: to_json(&snapshot.instance)?,
            approvals: to_json(&snapshot.policy.approvals)?,
            repeats: to_json(&snapshot.policy.repeats)?,
            counters: to_json(&snapshot.policy.counters())?,
            answers: (!snapshot.policy.answers.is_empty())
                .then(|| to_json(&snapshot.policy.answers))
                .transpose()?,
            usage: (!snapshot.usage.is_empty())
                .then(|| to_json(&snapshot.usage))
                .transpose()?,
            messages: snapshot
                .history
                .iter()
                .map(to_json)
                .collect::<Result<_, _>>()?,
        })
    }
}

/// A message's JSON column read back.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn message_from_json(
    session: &SessionId,
    text: &str,
) -> Result<markov_core::Message, StoreError> {
    from_json(session, "a message", text)
}

/// The policy part of a snapshot from its columns. A session written before
/// conversations had ids gets its session id as one: stable across loads.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn policy_snapshot(
    session: &SessionId,
    approvals: &str,
    repeats: &str,
    counters: &str,
    answers: Option<&str>,
    ledger: Vec<LedgerEntry>,
) -> Result<markov_policy::PolicySnapshot, StoreError> {
    let counters: PolicyCounters = from_json(session, "the counters", counters)?;
    let mut snapshot = markov_policy::PolicySnapshot {
        conversation: Some(
            counters
                .conversation
                .unwrap_or_else(|| session.as_str().to_owned()),
        ),
        turn: counters.turn,
        approvals: from_json(session, "the approvals", approvals)?,
        ledger,
        repeats: from_json(session, "the loop guard's counts", repeats)?,
        budgets: counters.budgets,
        answers: answers
            .map(|text| from_json(session, "the recorded answers", text))
            .transpose()?
            .unwrap_or_default(),
        found: counters.found,
    };
    snapshot.retain_replayable();
    Ok(snapshot)
}

/// The usage column read back: none for a session stored before usage was
/// kept.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn usage_totals(
    session: &SessionId,
    usage: Option<&str>,
) -> Result<UsageTotals, StoreError> {
    usage
        .map(|text| from_json(session, "the usage", text))
        .transpose()
        .map(Option::unwrap_or_default)
}

/// A JSON column read back.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn from_json<T: serde::de::DeserializeOwned>(
    session: &SessionId,
    what: &str,
    text: &str,
) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
        session: session.clone(),
        detail: format!("{what}: {e}"),
    })
}

/// A step trace as a store keeps it: its JSON with each call's system
/// prompt, tool list and view's summary replaced by the hash of their
/// content, and those contents (hash, JSON) to keep once each.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) struct EncodedTrace {
    /// The trace's JSON, contents by hash.
    pub body: String,
    /// Each content the body names: its hash and its JSON.
    pub blobs: Vec<(String, String)>,
}

/// The contents a store has committed, by hash, so that a step's write
/// offers only the contents that may not be kept yet: a long tool list is
/// written once, not looked up again at every step. Sound because no
/// store ever deletes a content once kept (pruning removes traces, not the
/// contents they name, each a few kilobytes shared by every step naming
/// it); a store that comes to delete contents must forget them here too.
/// At most [`KEPT_REMEMBERED`] hashes, after which the memory starts again
/// empty and a write offers its contents once more (the store ignores one
/// it has).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[derive(Debug, Clone, Default)]
pub(crate) struct KeptContents(std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>);

/// How many content hashes [`KeptContents`] remembers.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
const KEPT_REMEMBERED: usize = 4096;

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl KeptContents {
    fn known(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Leaves out of `trace` (a step's, if it has one) the contents known
    /// kept; the hashes of those it still offers, for
    /// [`committed`](Self::committed).
    pub(crate) fn offer(&self, trace: Option<&mut EncodedTrace>) -> Vec<String> {
        let Some(trace) = trace else {
            return Vec::new();
        };
        let known = self.known();
        trace.blobs.retain(|(hash, _)| !known.contains(hash));
        trace.blobs.iter().map(|(hash, _)| hash.clone()).collect()
    }

    /// Remembers `offered` as kept, once the write that offered them has
    /// committed (never before: a write rolled back keeps nothing).
    pub(crate) fn committed(&self, offered: Vec<String>) {
        if offered.is_empty() {
            return;
        }
        let mut known = self.known();
        if known.len().saturating_add(offered.len()) > KEPT_REMEMBERED {
            known.clear();
        }
        known.extend(offered);
    }
}

/// The key under which a trace's JSON names a content kept apart.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
const BLOB_KEY: &str = markov_core::kept::CONTENT_KEY;

/// The fields of a model call's JSON kept apart by content (JSON
/// pointers): what stays the same from one step to the next. They are the
/// fields marked `serialize_with = "markov_core::kept::serialize"` in
/// `ModelCall` and `ViewShape`, which [`encode_trace`] writes as
/// references; the store's tests read back traces with each (a sub-agent's
/// calls, a view's summary), so a marked field missing here fails them.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
const BLOB_FIELDS: [&str; 3] = ["/system", "/tools", "/view/summary"];

#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn content_hash(text: &str) -> String {
    use sha2::Digest;
    markov_core::ids::hex(&sha2::Sha256::digest(text.as_bytes()))
}

/// The model calls of a trace's JSON whose contents are kept apart: the
/// step's own, then those of each sub-agent step it holds.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn model_calls_mut(value: &mut serde_json::Value) -> impl Iterator<Item = &mut serde_json::Value> {
    let (own, subs) = match value {
        serde_json::Value::Object(map) => {
            let mut own = None;
            let mut subs = None;
            for (key, field) in map.iter_mut() {
                match key.as_str() {
                    "calls" => own = field.as_array_mut(),
                    "sub_agents" => subs = field.as_array_mut(),
                    _ => {}
                }
            }
            (own, subs)
        }
        _ => (None, None),
    };
    let sub_calls = subs.into_iter().flatten().flat_map(|sub| {
        sub.get_mut("step")
            .and_then(|step| step.get_mut("calls"))
            .and_then(|calls| calls.as_array_mut())
            .into_iter()
            .flatten()
    });
    own.into_iter().flatten().chain(sub_calls)
}

/// [`model_calls_mut`], read only.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn model_calls(value: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    let own = value.get("calls").and_then(|c| c.as_array());
    let sub_calls = value
        .get("sub_agents")
        .and_then(|s| s.as_array())
        .into_iter()
        .flatten()
        .flat_map(|sub| {
            sub.get("step")
                .and_then(|step| step.get("calls"))
                .and_then(|calls| calls.as_array())
                .into_iter()
                .flatten()
        });
    own.into_iter().flatten().chain(sub_calls)
}

/// `trace` as a store keeps it (see [`EncodedTrace`]): written in one
/// pass, each model call's kept contents (system prompt, tools, a view's
/// summary) written as references by their serializer
/// ([`markov_core::kept`]), where [`decode_trace`] finds them
/// ([`BLOB_FIELDS`] of each model call).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn encode_trace(trace: &StepTrace) -> Result<EncodedTrace, StoreError> {
    let (body, blobs) =
        markov_core::kept::keep_contents(content_hash, || serde_json::to_string(trace));
    Ok(EncodedTrace {
        body: body.map_err(|e| StoreError::Backend(format!("cannot encode: {e}")))?,
        blobs,
    })
}

/// The hashes of the contents a kept trace's JSON names.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn trace_blob_hashes(value: &serde_json::Value) -> Vec<String> {
    let mut hashes = Vec::new();
    for call in model_calls(value) {
        for field in BLOB_FIELDS {
            if let Some(hash) = call
                .pointer(field)
                .and_then(|c| c.get(BLOB_KEY))
                .and_then(|h| h.as_str())
                && !hashes.iter().any(|h| h == hash)
            {
                hashes.push(hash.to_owned());
            }
        }
    }
    hashes
}

/// A kept trace read back: its JSON `value` (with index and time set by
/// the store), contents looked up in `blobs` (hash → JSON).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn decode_trace(
    session: &SessionId,
    mut value: serde_json::Value,
    blobs: &std::collections::HashMap<String, String>,
) -> Result<StepTrace, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        session: session.clone(),
        detail,
    };
    for call in model_calls_mut(&mut value) {
        for field in BLOB_FIELDS {
            let Some(slot) = call.pointer_mut(field) else {
                continue;
            };
            let Some(hash) = slot.get(BLOB_KEY).and_then(|h| h.as_str()) else {
                continue;
            };
            let text = blobs
                .get(hash)
                .ok_or_else(|| corrupt(format!("a step names content {hash}, not kept")))?;
            *slot = serde_json::from_str(text)
                .map_err(|e| corrupt(format!("step content {hash}: {e}")))?;
        }
    }
    serde_json::from_value(value).map_err(|e| corrupt(format!("a step trace: {e}")))
}

#[cfg(all(test, any(feature = "sqlite", feature = "postgres")))]
mod content_hash_tests {
    #[test]
    fn a_content_s_hash_is_its_sha256_in_lowercase_hex() {
        assert_eq!(
            super::content_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            super::content_hash(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
