//! [`Machine`]: a charter, an executor, the instance tree, the history and the queue.

use std::fmt;
use std::sync::Arc;

use markov_charter::charter::Charter;
use markov_core::Message;
use markov_policy::{Approvals, PolicyState};
use serde_json::Value;

use crate::error::RunError;
use crate::executor::Executor;
use crate::externalize::Externals;
use crate::instance::Instance;
use crate::queue::Queue;
use crate::run::RunOptions;
use markov_context::UsageTotals;

/// The unit of persistence: definitions plus everything a conversation accumulated.
pub struct Machine {
    pub(crate) charter: Charter,
    pub(crate) executor: Arc<dyn Executor>,
    pub(crate) root: Arc<Instance>,
    pub(crate) history: Vec<Message>,
    /// The history's identity for the model requests made over it (it is
    /// only appended to; see [`HistoryId`](markov_core::model::HistoryId)).
    pub(crate) history_id: markov_core::model::HistoryId,
    pub(crate) queue: Queue,
    /// Externalized-state registrations; never serialized.
    pub(crate) externals: Externals,
    /// The conversation's approvals, idempotency ledger and budget counters.
    pub(crate) policy: Arc<PolicyState>,
    /// The limits of [`Machine::run`] (the agent's).
    pub(crate) run_options: RunOptions,
    /// What the session and the current user turn have used.
    pub(crate) usage: UsageTotals,
    /// What context policies show of the history; derived from it, never
    /// serialized.
    pub(crate) views: markov_context::ContextViews,
    /// Whether each step says what its model calls were made of
    /// ([`MachineStep::calls`](crate::MachineStep::calls)).
    pub(crate) record_calls: bool,
    /// Whether an instance spawned in a step is named after where it was
    /// spawned (its parent, the history's length, its place among the
    /// children spawned) rather than given a fresh uuid: a machine run
    /// again from its records (a sub-agent, from its caller's journal)
    /// then spawns the same instances, whose recorded answers and calls
    /// are theirs again. Never serialized.
    pub(crate) replayable_ids: bool,
}

impl fmt::Debug for Machine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Machine")
            .field("charter", &self.charter.name())
            .field("root", &self.root.id())
            .field("history", &self.history.len())
            .field("queue", &self.queue.len())
            .field("externalized", &self.externals.len())
            .finish_non_exhaustive()
    }
}

impl Machine {
    /// A machine whose instance tree is `root`, checked by
    /// [`check_tree`](Self::check_tree): the packs declared on the tree's
    /// nodes are hoisted to the root and the externalized scopes registered
    /// (see [`markov_charter::externalize`]).
    pub(crate) fn from_tree(
        charter: Charter,
        executor: Arc<dyn Executor>,
        root: Instance,
        run_options: RunOptions,
    ) -> Result<Self, RunError> {
        let root = Arc::new(root);
        let nodes = Self::check_tree(&charter, &root)?;
        Ok(Self::assemble(charter, executor, root, &nodes, run_options))
    }

    /// Checks every state of the tree under `root` against its node and
    /// every node against `charter`, without running anything (no
    /// externalized handler is called); the tree's nodes in tree order.
    pub(crate) fn check_tree(
        charter: &Charter,
        root: &Arc<Instance>,
    ) -> Result<Vec<markov_charter::node::Node>, RunError> {
        let all = root.all()?;
        for instance in &all {
            instance
                .node()
                .schema()
                .parse(instance.state())
                .map_err(|message| RunError::InvalidState {
                    node: instance.node().id().to_string(),
                    message,
                })?;
            // Nodes the charter does not register were not checked when it was built.
            charter.check(instance.node())?;
        }
        Ok(all.iter().map(|i| i.node().clone()).collect())
    }

    /// A machine on an agent's validated start: its node and state were
    /// checked when the agent was built.
    pub(crate) fn fresh(
        charter: Charter,
        executor: Arc<dyn Executor>,
        root: Instance,
        run_options: RunOptions,
    ) -> Self {
        let nodes = [root.node().clone()];
        Self::assemble(charter, executor, Arc::new(root), &nodes, run_options)
    }

    /// The machine over a checked tree whose nodes, in tree order, are
    /// `nodes`: their packs hoisted to the root and the externalized scopes
    /// registered.
    fn assemble(
        charter: Charter,
        executor: Arc<dyn Executor>,
        mut root: Arc<Instance>,
        nodes: &[markov_charter::node::Node],
        run_options: RunOptions,
    ) -> Self {
        hoist_packs(&mut root, nodes.iter());
        let mut machine = Machine {
            charter,
            executor,
            root,
            history: Vec::new(),
            history_id: markov_core::model::HistoryId::fresh(),
            queue: Queue::new(),
            externals: Externals::default(),
            policy: Arc::new(PolicyState::new()),
            run_options,
            usage: UsageTotals::default(),
            views: markov_context::ContextViews::default(),
            record_calls: false,
            replayable_ids: false,
        };
        machine.sync_externalized();
        machine
    }

    /// Synchronises externalized state with the tree: writes
    /// made with [`ExternalContext::set_state`] outside a callback are
    /// copied into the tree, scopes that left the tree are unregistered
    /// (their cleanup runs) and new ones are registered.
    ///
    /// The machine does this itself when it is created or deserialized,
    /// after every apply phase of a run and around [`run_command`](crate::run_command);
    /// call it to see an external write in [`Machine::instance`] sooner.
    ///
    /// [`ExternalContext::set_state`]: markov_charter::externalize::ExternalContext::set_state
    pub fn sync_externalized(&mut self) {
        self.externals.sync(&self.charter, &mut self.root);
    }

    /// The charter.
    pub fn charter(&self) -> &Charter {
        &self.charter
    }

    /// The instance tree's root.
    pub fn instance(&self) -> &Arc<Instance> {
        &self.root
    }

    /// Everything recorded so far.
    pub fn history(&self) -> &[Message] {
        &self.history
    }

    /// The conversation's policy state: confirmation requests, the
    /// idempotency ledger and the budget counters of the current user turn.
    /// It is part of the machine's snapshot.
    pub fn policy_state(&self) -> &PolicyState {
        &self.policy
    }

    /// A shared handle on the policy state, for deciding approvals while a
    /// run holds the machine (e.g. from a request handler).
    pub fn policy_handle(&self) -> Arc<PolicyState> {
        Arc::clone(&self.policy)
    }

    /// The requests of the calls that need approval: list the pending ones
    /// ([`Approvals::pending`]), decide them ([`Approvals::decide`]: approve,
    /// edit, deny with a message, answer). Only the application decides:
    /// a paused call's request never reaches the model, and in the token
    /// flow the model can present an approved request's id, never approve
    /// one.
    pub fn approvals(&self) -> &Approvals {
        self.policy.approvals()
    }

    /// What the session and its current user turn have used: tokens,
    /// requests and cost. Part of the snapshot.
    pub fn usage(&self) -> &UsageTotals {
        &self.usage
    }

    /// Whether each step says what its model calls were made of and how
    /// long they took ([`MachineStep::calls`](crate::MachineStep::calls)):
    /// off by default (nothing is built for it); a store that records
    /// every step turns it on.
    pub fn set_record_calls(&mut self, record: bool) {
        self.record_calls = record;
    }

    /// Whether steps record their model calls (see
    /// [`set_record_calls`](Self::set_record_calls)).
    pub fn records_calls(&self) -> bool {
        self.record_calls
    }

    /// The limits of [`run`](Self::run) (its agent's, else the defaults).
    pub fn run_options(&self) -> &RunOptions {
        &self.run_options
    }

    pub(crate) fn set_run_options(&mut self, options: RunOptions) {
        self.run_options = options;
    }

    /// Runs the machine to the end of the turn within its agent's limits
    /// and returns the last step. Input must be enqueued first.
    ///
    /// A run ends with a step whose yield reason is
    /// [`AwaitingApproval`](crate::YieldReason::AwaitingApproval) when calls
    /// need the application's approval; while it waits, new input is
    /// refused with [`RunError::AwaitingApproval`] (it stays queued).
    pub async fn run(&mut self) -> Result<crate::MachineStep, RunError> {
        let options = self.run_options.clone();
        crate::run::run_to_completion(self, options).await
    }

    /// [`run`](Self::run) with other limits.
    pub async fn run_with(&mut self, options: RunOptions) -> Result<crate::MachineStep, RunError> {
        crate::run::run_to_completion(self, options).await
    }

    /// Resumes the step that waits for approval, once the application has
    /// decided its calls ([`Machine::approvals`]), and runs to the end of
    /// the turn within its agent's limits; returns the last step.
    ///
    /// No model is called before the calls are answered: the paused
    /// answers are replayed, the calls that ran before the pause are
    /// answered from the ledger, each approved call runs once with the
    /// arguments approved, and the denied, answered and expired ones get
    /// their results; then the model reads them all. A call still undecided
    /// pauses the run again. Input queued while the step waited stays
    /// queued for the next run. [`RunError::NotAwaitingApproval`] when no
    /// step waits.
    pub async fn resume(&mut self) -> Result<crate::MachineStep, RunError> {
        let options = self.run_options.clone();
        crate::run::resume_to_completion(self, options).await
    }

    /// [`resume`](Self::resume) with other limits.
    pub async fn resume_with(
        &mut self,
        options: RunOptions,
    ) -> Result<crate::MachineStep, RunError> {
        crate::run::resume_to_completion(self, options).await
    }

    /// Whether the thinking its stored messages keep may be shown to the
    /// user (see [`Agent::shows_stored_thinking`](crate::Agent::shows_stored_thinking)).
    pub fn shows_stored_thinking(&self) -> bool {
        self.executor.shows_stored_thinking()
    }

    /// Whether a step waits for the application's approval of its calls
    /// (and for [`resume`](Self::resume)).
    pub fn is_awaiting_approval(&self) -> bool {
        if !self.policy.is_paused() {
            return false;
        }
        let paused = self.policy.answers().paused();
        let mut waiting = false;
        self.root.for_each_active_leaf(&mut |leaf| {
            waiting |= paused.contains(leaf.leaf().id());
        });
        waiting
    }

    /// The active leaves whose answer is paused. A paused answer whose leaf
    /// left the tree (a command, say) can never be resumed: it is dropped
    /// here, with the requests of its calls (none of them is recorded).
    pub(crate) fn paused_leaves(&self) -> Vec<markov_core::InstanceId> {
        let paused = self.policy.answers().paused();
        if paused.is_empty() {
            return paused;
        }
        let mut active = Vec::new();
        self.root
            .for_each_active_leaf(&mut |leaf| active.push(leaf.leaf().id().clone()));
        for gone in paused.iter().filter(|i| !active.contains(i)) {
            tracing::warn!(instance = %gone, "a paused answer's leaf is gone: it is dropped");
            self.policy.abandon_paused(gone);
        }
        paused.into_iter().filter(|i| active.contains(i)).collect()
    }

    /// The queue (clone it to enqueue from another task).
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Enqueues messages for the next run.
    pub fn enqueue(&self, messages: impl IntoIterator<Item = Message>) {
        self.queue.enqueue(messages);
    }

    /// Enqueues one user message.
    pub fn enqueue_user(&self, text: impl Into<String>) {
        self.queue.enqueue([Message::user(text)]);
    }

    /// Enqueues markov's own instruction to the model (see
    /// [`Entry::instruction`](crate::Entry::instruction)): a system message
    /// that starts the next run like user input, without being the user's
    /// words.
    pub fn enqueue_instruction(&self, text: impl Into<String>) {
        self.queue
            .enqueue_entries([crate::effect::Entry::instruction(text)]);
    }
}

/// Appends to the root's pack list every pack of `nodes` not yet there, and
/// initialises its state from `initial_state` when missing.
pub(crate) fn hoist_packs<'a>(
    root: &mut Arc<Instance>,
    nodes: impl Iterator<Item = &'a markov_charter::node::Node>,
) {
    let new: Vec<_> = nodes
        .flat_map(|n| n.packs().iter())
        .filter(|p| !root.packs.iter().any(|q| q.name() == p.name()))
        .cloned()
        .collect();
    if new.is_empty() {
        return;
    }
    let r = Arc::make_mut(root);
    for pack in new {
        if r.packs.iter().any(|q| q.name() == pack.name()) {
            continue;
        }
        if !r.pack_states.contains_key(pack.name()) {
            let state = pack.initial_state().cloned().unwrap_or(Value::Null);
            r.pack_states.insert(pack.name().to_owned(), state);
        }
        r.packs.push(pack);
    }
}
