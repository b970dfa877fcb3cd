//! [`DurableMachine`]: a machine whose every step is written to a [`Store`]
//! before the next model call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use markov_core::async_trait;
use markov_executor::{
    Action, Agent, CommandOptions, CommandOutcome, DeserializeError, Instance, Machine,
    MachineStep, RunError, RunOptions, RunState, SerializeError, SerializedInstance, YieldReason,
    run_command, run_leaves, serialize_instance_tree, serialize_machine,
};
use markov_policy::{
    ApprovalError, ApprovalId, ConfirmationRequest, Decision, Journal, LedgerEntry, PolicyCounters,
    RecordedAnswer,
};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cache::Parked;
use crate::{Lease, Owner, SessionCache, SessionId, StepRecord, Store, StoreError, WorkerId};

/// How long a lease lasts unless renewed; every write renews it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// Why a durable run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DurableError {
    /// The store failed or refused the write.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The run failed (what was recorded before is stored).
    #[error(transparent)]
    Run(#[from] RunError),
    /// The machine could not be written.
    #[error(transparent)]
    Serialize(#[from] SerializeError),
    /// The stored session does not read back into a machine.
    #[error(transparent)]
    Deserialize(#[from] DeserializeError),
    /// A decision on a confirmation request was refused (nothing changed).
    #[error(transparent)]
    Approval(#[from] ApprovalError),
}

/// What a worker knows of its lease while a step runs: until when it holds
/// it, and whether a renewal found it taken.
#[derive(Debug, Default)]
struct LeaseWatch {
    /// When the lease expires (Unix milliseconds).
    until: AtomicU64,
    /// Why the lease is lost, once a renewal was refused.
    lost: Mutex<Option<String>>,
}

impl LeaseWatch {
    fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_lost(&self, reason: String) {
        *self.lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
    }
}

/// Writes a session's answered calls and model answers ahead of their use,
/// and lets a call start only while the lease holds.
struct StoreJournal<S: ?Sized> {
    store: Arc<S>,
    id: SessionId,
    holder: WorkerId,
    lease: Arc<LeaseWatch>,
    /// The sub-agents' steps of the step in flight, for its trace.
    sub_steps: SubSteps,
}

/// The sub-agents' steps kept for the trace of the step in flight.
type SubSteps = Arc<Mutex<Vec<crate::SubAgentTrace>>>;

#[async_trait]
impl<S: Store + ?Sized> Journal for StoreJournal<S> {
    async fn write(&self, entry: &LedgerEntry) -> Result<(), String> {
        self.store
            .journal(&self.id, &self.holder, entry)
            .await
            .map_err(|e| e.to_string())
    }

    fn check(&self) -> Result<(), String> {
        if let Some(reason) = self.lease.lost() {
            return Err(reason);
        }
        if crate::now_ms() >= self.lease.until.load(Ordering::Acquire) {
            return Err(format!(
                "the lease of worker {} on session {} expired",
                self.holder, self.id
            ));
        }
        Ok(())
    }

    async fn write_answers(&self, answers: &[RecordedAnswer]) -> Result<(), String> {
        self.store
            .journal_answers(&self.id, &self.holder, answers)
            .await
            .map_err(|e| e.to_string())
    }

    fn keep_step(&self, calls: &[markov_core::ids::ToolCallId], step: serde_json::Value) {
        match serde_json::from_value(step) {
            Ok(step) => self
                .sub_steps
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(crate::SubAgentTrace {
                    calls: calls.to_vec(),
                    step,
                }),
            Err(error) => {
                tracing::warn!(%error, "a sub-agent's step does not read as one: not in the trace");
            }
        }
    }
}

/// Renews the lease every third of its time-to-live while a step's model
/// call and tools run; returns (and marks the lease lost) once a renewal is
/// refused.
async fn heartbeat<S: Store + ?Sized>(
    store: &S,
    id: &SessionId,
    holder: &WorkerId,
    ttl: Duration,
    watch: &LeaseWatch,
) {
    let period = (ttl / 3).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(period).await;
        match store.acquire(id, holder, ttl).await {
            Ok(lease) => watch.until.store(lease.expires_at, Ordering::Release),
            Err(StoreError::Backend(error)) => {
                // The database may be back before the lease runs out; the
                // calls check the expiry themselves meanwhile.
                tracing::warn!(%error, "the lease could not be renewed; trying again");
            }
            Err(error) => {
                tracing::error!(%error, "the lease is lost: no further tool call starts");
                watch.set_lost(error.to_string());
                return;
            }
        }
    }
}

/// How [`DurableMachine::create_with`] creates a session.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CreateOptions {
    /// The lease's length ([`DEFAULT_LEASE`] unless set).
    pub lease: Duration,
    /// Who the session belongs to (nobody unless set).
    pub owner: Option<Owner>,
    /// Where [`DurableMachine::release`] parks the new machine, and the
    /// agent it was made by (none unless set).
    pub cache: Option<(SessionCache, Agent)>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            lease: DEFAULT_LEASE,
            owner: None,
            cache: None,
        }
    }
}

impl CreateOptions {
    /// Sets the lease's length.
    #[must_use]
    pub fn lease(mut self, ttl: Duration) -> Self {
        self.lease = ttl;
        self
    }

    /// Sets the owner.
    #[must_use]
    pub fn owner(mut self, owner: Owner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// Parks the new session's machine in `cache` when it is released, as
    /// [`OpenOptions::cache`] does for a session opened, so that its first
    /// message does not read back what was just created. `agent` is the
    /// agent the machine was made by (`agent.machine()`): the parked
    /// machine is taken only by a session opened over that same agent.
    #[must_use]
    pub fn cache(mut self, cache: SessionCache, agent: &Agent) -> Self {
        self.cache = Some((cache, agent.clone()));
        self
    }
}

/// How [`DurableMachine::open_with`] opens a session.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OpenOptions {
    /// The lease's length ([`DEFAULT_LEASE`] unless set).
    pub lease: Duration,
    /// Where the machine is parked when released, and taken from when
    /// nobody wrote the session since (none unless set).
    pub cache: Option<SessionCache>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            lease: DEFAULT_LEASE,
            cache: None,
        }
    }
}

impl OpenOptions {
    /// Sets the lease's length.
    #[must_use]
    pub fn lease(mut self, ttl: Duration) -> Self {
        self.lease = ttl;
        self
    }

    /// Keeps the machine in `cache` between leases (see [`SessionCache`]).
    #[must_use]
    pub fn cache(mut self, cache: SessionCache) -> Self {
        self.cache = Some(cache);
        self
    }
}

/// A machine bound to a session of a [`Store`], leased to one worker.
///
/// [`run`](Self::run) drives the machine like `run_to_completion` and writes
/// what each step added — its messages, the tree if it changed, the
/// approvals if they changed, the run's progress — before the next model
/// call. A run interrupted by a crash continues where its last write left
/// it when the session is [`open`](Self::open)ed again.
pub struct DurableMachine<S: Store + ?Sized> {
    store: Arc<S>,
    id: SessionId,
    holder: WorkerId,
    lease_ttl: Duration,
    machine: Machine,
    /// History messages already written.
    written: usize,
    /// Their size as JSON: the machine's weight in a [`SessionCache`].
    history_bytes: u64,
    /// The tree last written.
    tree: Arc<Instance>,
    /// The approvals' revision last written.
    approvals: u64,
    /// The loop guard's counts last written.
    repeats: Vec<markov_policy::RepeatRecord>,
    /// The turn and budget counters last written.
    counters: PolicyCounters,
    /// The usage last written.
    usage: markov_context::UsageTotals,
    /// A run to continue.
    interrupted: Option<RunState>,
    /// The lease, as renewals keep it.
    lease: Arc<LeaseWatch>,
    /// Stops the run in progress (see [`DurableMachine::cancel_token`]).
    cancel: CancellationToken,
    /// Interrupts the run in progress after its step (see
    /// [`DurableMachine::interrupt_when`]).
    interrupt: CancellationToken,
    /// The trace of the step the next write records, if it records one.
    trace: Option<crate::StepTrace>,
    /// Whether a step was traced since the session was created or opened
    /// here (the first one records the tree it started from).
    traced: bool,
    /// The sub-agents' steps of the step in flight (the journal keeps
    /// them), for its trace.
    sub_steps: SubSteps,
    /// Where [`release`](DurableMachine::release) parks the machine, and
    /// the agent it runs on.
    cache: Option<(SessionCache, Agent)>,
    /// Whether the machine was taken from the cache.
    kept: bool,
    /// Whether the next run's last write gives up the lease too (see
    /// [`DurableMachine::release_with_run`]).
    release_with_run: bool,
    /// The session's revision, once a run's last write gave up the lease
    /// (`Some(None)`: it was not held any more).
    released: Option<Option<crate::Revision>>,
}

impl<S: Store + ?Sized> std::fmt::Debug for DurableMachine<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableMachine")
            .field("session", &self.id)
            .field("holder", &self.holder)
            .field("written", &self.written)
            .field("interrupted", &self.interrupted.is_some())
            .finish_non_exhaustive()
    }
}

impl<S: Store + ?Sized + 'static> DurableMachine<S> {
    /// Stores `machine` as the new session `id`, leased to `holder` for
    /// [`DEFAULT_LEASE`], with no owner.
    pub async fn create(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        machine: Machine,
    ) -> Result<Self, DurableError> {
        Self::create_with(store, id, holder, machine, CreateOptions::default()).await
    }

    /// [`create`](Self::create) with `options`: the lease's length (renewed
    /// by every write; a crashed worker's sessions are free again after
    /// it) and the session's owner.
    pub async fn create_with(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        machine: Machine,
        options: CreateOptions,
    ) -> Result<Self, DurableError> {
        let snapshot = serialize_machine(&machine)?;
        let lease = store
            .create(
                &id,
                options.owner.as_ref(),
                machine.charter().name(),
                &snapshot,
                &holder,
                options.lease,
            )
            .await?;
        let history_bytes = options
            .cache
            .as_ref()
            .map_or(0, |_| json_len(machine.history()));
        let mut session = Self::bind(store, lease, machine, None, options.lease);
        session.cache = options.cache;
        session.history_bytes = history_bytes;
        Ok(session)
    }

    /// Leases session `id` to `holder` for [`DEFAULT_LEASE`] and restores
    /// its machine over `agent`, with the run that was in progress, if
    /// any. Refused with [`StoreError::Leased`] while another worker's
    /// lease is live.
    pub async fn open(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        agent: &Agent,
    ) -> Result<Self, DurableError> {
        Self::open_with(store, id, holder, agent, OpenOptions::default()).await
    }

    /// [`open`](Self::open) with `options`: the lease's length, and a
    /// [`SessionCache`] that keeps the machine between leases.
    pub async fn open_with(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        agent: &Agent,
        options: OpenOptions,
    ) -> Result<Self, DurableError> {
        let lease = store.acquire(&id, &holder, options.lease).await?;
        Self::open_leased(store, lease, agent, options).await
    }

    /// [`open_with`](Self::open_with) for a session whose `lease` its
    /// holder took already ([`Store::acquire_owned`], say, which checks
    /// who the session belongs to in the same store call, or
    /// [`Store::claim_interrupted`]): restores its machine over `agent`
    /// without leasing it again. `options.lease` is the length each renewal
    /// asks for.
    pub async fn open_leased(
        store: Arc<S>,
        lease: Lease,
        agent: &Agent,
        options: OpenOptions,
    ) -> Result<Self, DurableError> {
        let OpenOptions { lease: ttl, cache } = options;
        let id = lease.session.clone();
        let parked = cache
            .as_ref()
            .and_then(|cache| cache.take(&id))
            .filter(|parked| {
                parked.revision == lease.revision && Agent::ptr_eq(&parked.agent, agent)
            });
        let kept = parked.is_some();
        let (machine, run, history_bytes) = match parked {
            Some(parked) => {
                #[cfg(debug_assertions)]
                check_parked(&*store, &id, agent, &parked.machine).await?;
                (parked.machine, None, parked.bytes)
            }
            None => {
                let stored = store.load(&id).await?;
                let machine = agent.restore(stored.snapshot)?;
                let bytes = cache.as_ref().map_or(0, |_| json_len(machine.history()));
                (machine, stored.run, bytes)
            }
        };
        let mut session = Self::bind(store, lease, machine, run, ttl);
        session.cache = cache.map(|cache| (cache, agent.clone()));
        session.kept = kept;
        session.history_bytes = history_bytes;
        Ok(session)
    }

    pub(crate) fn bind(
        store: Arc<S>,
        lease: Lease,
        mut machine: Machine,
        interrupted: Option<RunState>,
        lease_ttl: Duration,
    ) -> Self {
        let Lease {
            session: id,
            holder,
            expires_at,
            revision: _,
            charter: _,
        } = lease;
        let lease = Arc::new(LeaseWatch {
            until: AtomicU64::new(expires_at),
            lost: Mutex::new(None),
        });
        let sub_steps = SubSteps::default();
        machine.policy_state().set_journal(Arc::new(StoreJournal {
            store: Arc::clone(&store),
            id: id.clone(),
            holder: holder.clone(),
            lease: Arc::clone(&lease),
            sub_steps: Arc::clone(&sub_steps),
        }));
        // Every step is recorded with what it was made of.
        machine.set_record_calls(true);
        DurableMachine {
            lease,
            written: machine.history().len(),
            history_bytes: 0,
            tree: Arc::clone(machine.instance()),
            approvals: machine.approvals().revision(),
            repeats: machine.policy_state().repeats().snapshot(),
            counters: machine.policy_state().counters(),
            usage: *machine.usage(),
            store,
            id,
            holder,
            lease_ttl,
            machine,
            interrupted,
            cancel: CancellationToken::new(),
            interrupt: CancellationToken::new(),
            cache: None,
            kept: false,
            release_with_run: false,
            released: None,
            trace: None,
            traced: false,
            sub_steps,
        }
    }

    /// Whether the machine was kept in memory since the session was last
    /// released (taken from a [`SessionCache`], its history not read back).
    pub fn was_kept(&self) -> bool {
        self.kept
    }

    /// The session's id.
    pub fn id(&self) -> &SessionId {
        &self.id
    }

    /// The machine (enqueue input, read history, decide approvals).
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// Whether a run interrupted (by a crash, a failed step, or
    /// [`interrupt_when`](Self::interrupt_when)) waits to be continued by
    /// [`run`](Self::run).
    pub fn is_interrupted(&self) -> bool {
        self.interrupted.is_some()
    }

    /// A token that stops this session's run in progress from another task
    /// (a user's cancel, a deadline): the model call it waits for, or the
    /// tools it runs, are dropped where they are; the step is recorded with
    /// one result per call (see `RunState::cancel`) and written, and the
    /// run returns that step, with yield reason `cancelled`. The session is
    /// usable again at once. A token cancelled while no run is in progress
    /// stops the next run before its first model call. Once a run has
    /// stopped, later runs use a new token: ask for it again.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Interrupts the run in progress once `token` is cancelled (a server
    /// shutting down): the step it is in finishes and is stored, then the
    /// run returns that step, still recorded as in progress —
    /// [`is_interrupted`](Self::is_interrupted) says so — for the next
    /// [`run`](Self::run) to continue here, or for another worker to claim
    /// once this one has released the session.
    pub fn interrupt_when(&mut self, token: CancellationToken) {
        self.interrupt = token;
    }

    /// Renews the lease (a long tool call should not let it expire; a run
    /// renews it before a model call once half of it has passed).
    pub async fn renew(&mut self) -> Result<Lease, DurableError> {
        let lease = self
            .store
            .acquire(&self.id, &self.holder, self.lease_ttl)
            .await?;
        self.lease.until.store(lease.expires_at, Ordering::Release);
        self.released = None;
        Ok(lease)
    }

    /// Lets the next run ([`run`](Self::run), [`resume`](Self::resume) and
    /// their `_each_step` forms) give up the lease with its last write — one
    /// store write instead of two — for a caller that
    /// [`release`](Self::release)s the session as soon as the run returns.
    /// `release` then gives nothing up again; it parks the machine as
    /// usual. What is stored is the same as with a write and a release:
    /// the step, then the lease given up, committed together. A write
    /// after that (a persist, another run) takes the lease again first.
    pub fn release_with_run(&mut self) {
        self.release_with_run = true;
    }

    /// Writes what changed since the last write (after an approval or a
    /// command outside a run, say).
    pub async fn persist(&mut self) -> Result<(), DurableError> {
        // A run still to continue stays recorded as in progress.
        let run = self.interrupted.clone();
        self.write(run.as_ref(), false).await
    }

    /// Whether the machine changed since the last write.
    fn dirty(&self) -> bool {
        self.machine.history().len() != self.written
            || !Arc::ptr_eq(&self.tree, self.machine.instance())
            || self.machine.approvals().revision() != self.approvals
    }

    /// Writes what changed, and gives up the lease in the same store write
    /// when `release` is set.
    async fn write(&mut self, run: Option<&RunState>, release: bool) -> Result<(), DurableError> {
        if self.released.is_some() {
            // A run's last write gave the lease up; a write after it (which
            // the server's paths never make) needs it back first.
            tracing::debug!("the lease was given up with the last write: taking it again");
            self.renew().await?;
        }
        let history = self.machine.history();
        let messages = history.get(self.written..).unwrap_or_default();
        let added_bytes = self.cache.as_ref().map_or(0, |_| json_len(messages));
        let tree_changed = !Arc::ptr_eq(&self.tree, self.machine.instance());
        let tree = if tree_changed {
            Some(serialize_instance_tree(&self.machine)?)
        } else {
            None
        };
        let revision = self.machine.approvals().revision();
        let approvals = (revision != self.approvals).then(|| self.machine.approvals().snapshot());
        let repeats = self.machine.policy_state().repeats().snapshot();
        let repeats = (repeats != self.repeats).then_some(repeats);
        let counters = self.machine.policy_state().counters();
        let counters = (counters != self.counters).then_some(counters);
        // The answers of a step not recorded yet (empty once it is), and
        // those of a step paused for approval (until it is resumed).
        let answers = self.machine.policy_state().answers().snapshot();
        let usage = *self.machine.usage();
        let usage_changed = usage != self.usage;
        let mut trace = self.trace.take();
        if let Some(trace) = &mut trace {
            trace.tree.clone_from(&tree);
        }
        let record = StepRecord {
            messages,
            tree: tree.as_ref(),
            approvals: approvals.as_deref(),
            repeats: repeats.as_deref(),
            counters: counters.as_ref(),
            answers: &answers,
            run,
            usage: usage_changed.then_some(&usage),
            trace: trace.as_ref(),
        };
        if release {
            let revision = self
                .store
                .append_and_release(&self.id, &self.holder, record)
                .await?;
            self.released = Some(revision);
        } else {
            self.store.append(&self.id, &self.holder, record).await?;
        }
        self.written = history.len();
        self.history_bytes = self.history_bytes.saturating_add(added_bytes);
        self.tree = Arc::clone(self.machine.instance());
        self.approvals = revision;
        if let Some(repeats) = repeats {
            self.repeats = repeats;
        }
        if let Some(counters) = counters {
            self.counters = counters;
        }
        self.usage = usage;
        Ok(())
    }

    /// Runs the machine to the end of the turn (or continues an interrupted
    /// run) within its agent's limits, writing every step before the next
    /// model call. Returns the last step.
    pub async fn run(&mut self) -> Result<MachineStep, DurableError> {
        self.run_each_step(|_| {}).await
    }

    /// [`run`](Self::run), handing each step to `on_step` once it is stored
    /// (to stream it to a client, say).
    pub async fn run_each_step(
        &mut self,
        on_step: impl FnMut(&MachineStep),
    ) -> Result<MachineStep, DurableError> {
        let options = self.machine.run_options().clone();
        let span = tracing::info_span!(
            "invoke_agent",
            otel.name = %format_args!("invoke_agent {}", self.machine.charter().name()),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = self.machine.charter().name(),
            session = %self.id,
            worker = %self.holder,
        );
        self.run_inner(options, on_step).instrument(span).await
    }

    async fn run_inner(
        &mut self,
        options: RunOptions,
        mut on_step: impl FnMut(&MachineStep),
    ) -> Result<MachineStep, DurableError> {
        let release = std::mem::take(&mut self.release_with_run);
        if let Some(state) = self.interrupted.take() {
            // New input waits until the interrupted run is finished: its
            // answer comes first in the history, and the model then sees
            // the new input after it, in order.
            let held = self.machine.queue().hold_back();
            tracing::info!(held = held.len(), "continuing an interrupted run");
            let has_input = !held.is_empty();
            // Its last write is the run's last only when no input follows.
            let finished = self.drive(state, &mut on_step, release && !has_input).await;
            drop(held);
            let last = finished?;
            if !has_input || last.yield_reason == YieldReason::Cancelled {
                return Ok(last);
            }
        }
        self.drive(RunState::new(options), &mut on_step, release)
            .await
    }

    /// Keeps `step`'s trace for the write that records it, when the
    /// machine records its steps.
    fn trace_step(
        &mut self,
        step: &MachineStep,
        took: Duration,
        before: Option<SerializedInstance>,
    ) {
        let sub_agents =
            std::mem::take(&mut *self.sub_steps.lock().unwrap_or_else(|p| p.into_inner()));
        if !self.machine.records_calls() {
            return;
        }
        let to = self.machine.history().len() as u64;
        let from = to.saturating_sub(step.history.len() as u64);
        let millis = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        let mut trace = crate::StepTrace::of_step(step, from, millis);
        trace.sub_agents = sub_agents;
        // What was last written is what the step started from.
        trace.counters_before = self.counters.clone();
        trace.usage_before = self.usage;
        trace.repeats_before.clone_from(&self.repeats);
        // What it leaves for the next step (nothing, after most steps).
        let policy = self.machine.policy_state();
        trace.waiting = crate::Waiting {
            approvals: policy
                .approvals()
                .snapshot()
                .into_iter()
                .filter(|r| {
                    matches!(
                        r.status,
                        markov_policy::ApprovalStatus::Pending
                            | markov_policy::ApprovalStatus::Approved
                    )
                })
                .collect(),
            answers: policy.answers().snapshot(),
            ledger: policy.ledger().snapshot(),
        };
        if before.is_some() {
            trace.tree_before = before;
            self.traced = true;
        }
        self.trace = Some(trace);
    }

    /// Drives one run to its end, writing every step; the write that ends
    /// the run gives up the lease too when `release` is set.
    async fn drive(
        &mut self,
        mut state: RunState,
        on_step: &mut impl FnMut(&MachineStep),
        release: bool,
    ) -> Result<MachineStep, DurableError> {
        let mut last = None;
        loop {
            let action = match state.next(&mut self.machine) {
                Ok(action) => action,
                Err(e) => {
                    self.write(None, release).await?;
                    return Err(e.into());
                }
            };
            match action {
                Action::CheckInput(check) => {
                    // Before the drain writes anything: the history is
                    // written with what the input guards let through.
                    if self.cancel.is_cancelled() {
                        return self.stopped(&mut state, on_step, release).await;
                    }
                    // The input waiting for its check is written with the
                    // run, outside the history: a worker that dies during
                    // the check leaves it to the one that continues the run.
                    self.write(Some(&state), false).await?;
                    let cancel = self.cancel.clone();
                    let checked = {
                        let checking = check.run();
                        futures::pin_mut!(checking);
                        match futures::future::select(checking, std::pin::pin!(cancel.cancelled()))
                            .await
                        {
                            futures::future::Either::Left((checked, _)) => Some(checked),
                            futures::future::Either::Right(((), _)) => None,
                        }
                    };
                    let Some(checked) = checked else {
                        return self.stopped(&mut state, on_step, release).await;
                    };
                    state.on_input_checked(checked);
                }
                Action::RunLeaves(tasks) => {
                    let half = crate::ms(self.lease_ttl) / 2;
                    if crate::now_ms().saturating_add(half)
                        >= self.lease.until.load(Ordering::Acquire)
                    {
                        self.renew().await?;
                    }
                    // Durable before the model is called (what the last step
                    // left is written already; the run state it wrote leads
                    // to this same step).
                    if self.dirty() {
                        self.write(Some(&state), false).await?;
                    }
                    if self.cancel.is_cancelled() {
                        return self.stopped(&mut state, on_step, release).await;
                    }
                    let cancel = self.cancel.clone();
                    let started = std::time::Instant::now();
                    // A failed step's sub-agent steps are not this one's.
                    self.sub_steps
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clear();
                    // The first step recorded here says what tree it
                    // started from (the later ones say what they changed).
                    let before = if self.machine.records_calls() && !self.traced {
                        serialize_instance_tree(&self.machine)
                            .inspect_err(|error| {
                                tracing::warn!(%error, "the tree a step started from is not recorded: no fork can start before it");
                            })
                            .ok()
                    } else {
                        None
                    };
                    let results = {
                        let leaves = self.run_leaves_leased(&state, &tasks);
                        futures::pin_mut!(leaves);
                        // Stopped only while the step waits for its model
                        // or its tools: never inside a store write.
                        match futures::future::select(leaves, std::pin::pin!(cancel.cancelled()))
                            .await
                        {
                            futures::future::Either::Left((results, _)) => Some(results),
                            futures::future::Either::Right(((), _)) => None,
                        }
                    };
                    let Some(results) = results else {
                        return self.stopped(&mut state, on_step, release).await;
                    };
                    if let Some(reason) = self.lease.lost() {
                        tracing::error!(%reason, "this worker lost the session: it stops here");
                        return Err(StoreError::LeaseLost {
                            session: self.id.clone(),
                            worker: self.holder.clone(),
                        }
                        .into());
                    }
                    match state.on_leaf_results(&mut self.machine, &tasks, results) {
                        Ok(step) => {
                            self.trace_step(&step, started.elapsed(), before);
                            let run = (!state.is_finished()).then_some(&state);
                            self.write(run, release && run.is_none()).await?;
                            on_step(&step);
                            if self.interrupt.is_cancelled() && !state.is_finished() {
                                tracing::info!(
                                    "the run is interrupted after a stored step: the next run continues it"
                                );
                                self.interrupted = Some(state);
                                return Ok(step);
                            }
                            last = Some(step);
                        }
                        Err(e) => {
                            // An answer whose tools may have run keeps the run
                            // in progress: the next run finishes it (replaying
                            // the answer) before it takes new input.
                            let unfinished = !self.machine.policy_state().answers().is_empty();
                            self.write(unfinished.then_some(&state), release).await?;
                            if unfinished {
                                self.interrupted = Some(state);
                            }
                            return Err(e.into());
                        }
                    }
                }
                Action::Yield(step) => {
                    self.trace_step(&step, Duration::ZERO, None);
                    let run = (!state.is_finished()).then_some(&state);
                    self.write(run, release && run.is_none()).await?;
                    on_step(&step);
                    last = Some(step);
                }
                // `Finished`, and whatever a later version adds: nothing to do.
                _ => break,
            }
        }
        last.ok_or(DurableError::Run(RunError::NoSteps))
    }

    /// Ends a stopped run: records the cancelled step (see
    /// `RunState::cancel`), writes it as the end of the run, and arms a new
    /// token for the runs after it.
    async fn stopped(
        &mut self,
        state: &mut RunState,
        on_step: &mut impl FnMut(&MachineStep),
        release: bool,
    ) -> Result<MachineStep, DurableError> {
        tracing::info!("the run was cancelled: the step in flight is recorded and the run ends");
        self.cancel = CancellationToken::new();
        let step = state.cancel(&mut self.machine);
        self.trace_step(&step, Duration::ZERO, None);
        self.write(None, release).await?;
        on_step(&step);
        Ok(step)
    }

    /// Runs a step's leaves while a heartbeat keeps the lease: a long tool
    /// must not let it lapse and another worker run the same calls.
    async fn run_leaves_leased(
        &self,
        state: &RunState,
        tasks: &[markov_executor::LeafTask],
    ) -> Vec<Result<markov_executor::LeafOutcome, RunError>> {
        let leaves = run_leaves(&self.machine, state, tasks);
        let beat = heartbeat(
            &*self.store,
            &self.id,
            &self.holder,
            self.lease_ttl,
            &self.lease,
        );
        futures::pin_mut!(leaves, beat);
        match futures::future::select(leaves, beat).await {
            futures::future::Either::Left((results, _)) => results,
            // The lease is lost: the calls that have not started refuse to;
            // the ones running finish.
            futures::future::Either::Right(((), leaves)) => leaves.await,
        }
    }

    /// Records the application's decision on the request `id` (see
    /// `Approvals::decide`) and writes it before returning: a decision
    /// given is never lost, and a refused one changes nothing.
    pub async fn decide(
        &mut self,
        id: &ApprovalId,
        decision: Decision,
    ) -> Result<ConfirmationRequest, DurableError> {
        let request = self.machine.approvals().decide(id, decision)?;
        self.persist().await?;
        Ok(request)
    }

    /// [`decide`](Self::decide), naming who decided (a principal's id):
    /// the request keeps it, and the trace of the step that goes on with
    /// the call says it.
    pub async fn decide_by(
        &mut self,
        id: &ApprovalId,
        decision: Decision,
        by: &str,
    ) -> Result<ConfirmationRequest, DurableError> {
        let request = self.machine.approvals().decide_by(id, decision, by)?;
        self.persist().await?;
        Ok(request)
    }

    /// Resumes the step that waits for approval, once its calls are
    /// decided (see `Machine::resume`): the paused answers are replayed —
    /// no model call — the approved calls run once, every call's result is
    /// recorded, and the run goes on, each step written before the next
    /// model call. The run is written as in progress before anything runs,
    /// so a crash in between leaves a run that [`run`](Self::run) continues
    /// (an interrupted run is continued here too). Input queued meanwhile
    /// is held back and left queued for the next run.
    pub async fn resume(&mut self) -> Result<MachineStep, DurableError> {
        self.resume_each_step(|_| {}).await
    }

    /// [`resume`](Self::resume), handing each step to `on_step` once it is
    /// stored.
    pub async fn resume_each_step(
        &mut self,
        mut on_step: impl FnMut(&MachineStep),
    ) -> Result<MachineStep, DurableError> {
        let options = self.machine.run_options().clone();
        let span = tracing::info_span!(
            "invoke_agent",
            otel.name = %format_args!("invoke_agent {}", self.machine.charter().name()),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = self.machine.charter().name(),
            session = %self.id,
            worker = %self.holder,
            resumed = true,
        );
        async move {
            let release = std::mem::take(&mut self.release_with_run);
            let _held = self.machine.queue().hold_back();
            if let Some(state) = self.interrupted.take() {
                return self.drive(state, &mut on_step, release).await;
            }
            if !self.machine.is_awaiting_approval() {
                return Err(RunError::NotAwaitingApproval.into());
            }
            let state = RunState::resume(options);
            self.write(Some(&state), false).await?;
            self.drive(state, &mut on_step, release).await
        }
        .instrument(span)
        .await
    }

    /// Runs the command `name` (see `markov_executor::run_command`) and
    /// stores its effects: the tree changes at once, and the `command`
    /// message with whatever the command enqueued is recorded by a run
    /// that calls no model (unless a queued user message asks for one).
    pub async fn command(
        &mut self,
        name: &str,
        input: serde_json::Value,
        options: CommandOptions,
    ) -> Result<CommandOutcome, DurableError> {
        let outcome = run_command(&mut self.machine, name, input, options).await;
        self.run().await?;
        Ok(outcome)
    }

    /// Gives up the lease. A session opened with a [`SessionCache`] leaves
    /// its machine there when it is at rest: everything written, no run to
    /// continue, no input queued.
    pub async fn release(self) -> Result<(), DurableError> {
        // Everything the next write would carry is written already (the
        // loop guard's counts and the counters included, which `dirty`
        // leaves to the step that writes them).
        let policy = self.machine.policy_state();
        let at_rest = !self.dirty()
            && policy.counters() == self.counters
            && *self.machine.usage() == self.usage
            && policy.repeats().snapshot() == self.repeats
            && policy.answers().is_empty()
            && self.interrupted.is_none()
            && self.machine.queue().is_empty();
        let revision = match self.released {
            // Given up by the run's last write, in the same store write.
            Some(revision) => revision,
            None => self.store.release(&self.id, &self.holder).await?,
        };
        if let (Some((cache, agent)), Some(revision), true) = (self.cache, revision, at_rest) {
            cache.park(
                self.id,
                Parked {
                    machine: self.machine,
                    revision,
                    agent,
                    bytes: self.history_bytes,
                },
            );
        }
        Ok(())
    }

    /// Gives up the lease and returns the machine (never parked). The
    /// machine runs in memory from then on: its steps are no longer
    /// written to the store (which another worker may now lease).
    pub async fn into_machine(self) -> Result<Machine, DurableError> {
        if self.released.is_none() {
            self.store.release(&self.id, &self.holder).await?;
        }
        self.machine.policy_state().clear_journal();
        Ok(self.machine)
    }
}

/// Checks that a machine taken from a [`SessionCache`] is the one the store
/// holds: the cache's correctness rests on every write going through a
/// fenced store call, which the compiler cannot check, so test and debug
/// builds compare the two on every reuse.
#[cfg(debug_assertions)]
async fn check_parked<S: Store + ?Sized>(
    store: &S,
    id: &SessionId,
    agent: &Agent,
    parked: &Machine,
) -> Result<(), DurableError> {
    let stored = store.load(id).await?;
    let run = stored.run.is_some();
    let loaded = agent.restore(stored.snapshot)?;
    let text = |machine: &Machine| -> Result<String, DurableError> {
        serde_json::to_string(&serialize_machine(machine)?)
            .map_err(|e| DurableError::Serialize(SerializeError::Json(e.to_string())))
    };
    let (parked, loaded) = (text(parked)?, text(&loaded)?);
    assert!(
        !run && parked == loaded,
        "session {id}: the machine kept in the session cache differs from the stored one\n\
         kept:   {parked}\nstored: {loaded}"
    );
    Ok(())
}

/// The size of `messages` written as JSON one by one, without keeping
/// the text: summed over a history's steps, the history's.
fn json_len(messages: &[markov_core::message::Message]) -> u64 {
    struct Counter(u64);
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(bytes.len() as u64);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    for message in messages {
        // Writing a message into a counter cannot fail.
        let _ = serde_json::to_writer(&mut counter, message);
    }
    counter.0
}
