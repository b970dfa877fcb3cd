//! The executor contract: one inference for one leaf.

use std::sync::Arc;

use async_trait::async_trait;
use markov_charter::charter::Charter;
use markov_core::Message;
use markov_core::ids::{InstanceId, ToolCallId};
use markov_core::message::Source;
use markov_core::tool::TerminateResponse;
use markov_guard::GuardStack;
use markov_policy::AuditSink;
use markov_policy::PolicyState;
use serde_json::Value;

use crate::effect::Entry;
use crate::error::RunError;
use crate::instance::{ActiveLeaf, Instance};
use crate::queue::Queue;
use crate::step::{TurnState, YieldReason};
use markov_context::ContextViews;

/// The input guards an executor runs where a run drains user messages
/// ([`Executor::input_guard`]), and the audit
/// sink that hears of their rewrites and blocks.
#[derive(Debug, Clone)]
pub struct InputGuard {
    guards: GuardStack,
    audit: Option<Arc<dyn AuditSink>>,
}

impl InputGuard {
    /// `guards`, audited by tracing only.
    pub fn new(guards: GuardStack) -> Self {
        InputGuard {
            guards,
            audit: None,
        }
    }

    /// Sends each rewrite and block to `sink` too ([`AuditSink::guard`]).
    #[must_use]
    pub fn audited(mut self, sink: Option<Arc<dyn AuditSink>>) -> Self {
        self.audit = sink;
        self
    }

    /// Whether there is no guard.
    pub fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }

    /// The guards.
    pub fn guards(&self) -> &GuardStack {
        &self.guards
    }

    /// The audit sink, if any.
    pub fn audit(&self) -> Option<&Arc<dyn AuditSink>> {
        self.audit.as_ref()
    }
}

/// Everything an executor may read for one leaf in one step. It may not
/// change the tree: it reports messages and effects in a [`LeafOutcome`].
#[derive(Debug, Clone, Copy)]
pub struct LeafContext<'a> {
    /// The charter.
    pub charter: &'a Charter,
    /// The leaf and its path from the root.
    pub leaf: &'a ActiveLeaf,
    /// The history so far (borrowed, never copied).
    pub history: &'a [Message],
    /// The identity of that history, for the model request (it is only
    /// ever appended to).
    pub history_id: markov_core::model::HistoryId,
    /// The 1-based step number.
    pub current_step: usize,
    /// The step limit.
    pub max_steps: usize,
    /// This leaf's turn bookkeeping.
    pub turn: TurnState,
    /// The tool result of a `TerminateResponse` without a message.
    pub terminate_message: &'a str,
    /// The machine's queue, for what must be seen while the leaf still runs
    /// (a streaming vessel and its updates). Everything else is reported in
    /// the [`LeafOutcome`].
    pub queue: &'a Queue,
    /// The conversation's approvals, idempotency ledger and budget counters.
    pub policy: &'a PolicyState,
    /// The usage limits and what the run, turn and session have used: a
    /// model call is made only if [`UsageMeter::admit`](markov_context::UsageMeter::admit)
    /// admits its estimate.
    pub usage: &'a markov_context::UsageMeter,
    /// The machine's context views (what a context policy shows of the
    /// history; see [`ContextViews`]).
    pub views: &'a ContextViews,
    /// Whether the leaf's outcome should say what its model call was made
    /// of ([`LeafOutcome::call`]): set for a store that records every step.
    pub record_calls: bool,
}

impl<'a> LeafContext<'a> {
    /// The leaf instance.
    pub fn instance(&self) -> &'a Instance {
        self.leaf.leaf()
    }

    /// The root instance.
    pub fn root(&self) -> &'a Instance {
        self.leaf.root()
    }

    /// Whether the leaf is a worker.
    pub fn is_worker(&self) -> bool {
        self.leaf.is_worker()
    }

    /// The source every message of this leaf carries.
    pub fn source(&self) -> Source {
        Source {
            instance_id: Some(self.instance().id().clone()),
            is_primary: Some(!self.leaf.is_worker()),
            external: None,
        }
    }
}

/// What one leaf's inference produced.
#[derive(Debug, Clone)]
pub struct LeafOutcome {
    /// Messages and effects, in enqueue order.
    pub entries: Vec<Entry>,
    /// Why the leaf stopped.
    pub yield_reason: YieldReason,
    /// The leaf's turn bookkeeping after this step.
    pub turn: TurnState,
    /// The exact response a terminal tool produced.
    pub response: Option<String>,
    /// Set when a tool ended the run.
    pub termination: Option<TerminateResponse>,
    /// The intents tools returned, in call order.
    pub intents: Vec<Intent>,
    /// What the leaf's model call used (tokens, one request, its cost).
    pub usage: markov_core::model::Usage,
    /// The limit the leaf's model call could have passed, when it was not
    /// made (with yield reason [`YieldReason::UsageLimit`]).
    pub usage_limit: Option<markov_context::LimitExceeded>,
    /// The model that answered the leaf's call, as the answer names it
    /// ([`ModelResponse::model`](markov_core::ModelResponse::model)).
    pub model: Option<String>,
    /// What the leaf's model call was made of and how long it took, when
    /// the machine records calls ([`LeafContext::record_calls`]).
    pub call: Option<Box<crate::step::ModelCall>>,
}

/// An intent a tool returned for the application (through the registry's
/// `WithIntents`), with the call that returned it.
#[derive(Debug, Clone, PartialEq)]
pub struct Intent {
    /// The leaf the call ran for.
    pub instance_id: InstanceId,
    /// The call.
    pub call_id: ToolCallId,
    /// The intent, as the tool wrote it (e.g. `{"type":"end_session"}`).
    pub value: Value,
}

impl LeafOutcome {
    /// An outcome with these entries and reason, leaving the turn unchanged.
    pub fn new(entries: Vec<Entry>, yield_reason: YieldReason, turn: TurnState) -> Self {
        LeafOutcome {
            entries,
            yield_reason,
            turn,
            response: None,
            termination: None,
            intents: Vec::new(),
            usage: markov_core::model::Usage::default(),
            usage_limit: None,
            model: None,
            call: None,
        }
    }
}

/// A pluggable inference engine for one leaf.
#[async_trait]
pub trait Executor: Send + Sync {
    /// Performs one inference for `cx.leaf` and reports what it produced.
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError>;

    /// The guards that check each user message where a run takes it from
    /// the queue, before it enters the history, when the message goes to
    /// a leaf of `node` (the tree's primary leaf): a rewrite is what the
    /// history keeps, a blocked message is replaced by markov's note and
    /// the run ends with [`YieldReason::Blocked`]. `None`, the default,
    /// checks nothing and costs nothing.
    fn input_guard(&self, node: &markov_charter::node::Node) -> Option<InputGuard> {
        let _ = node;
        None
    }

    /// Whether the thinking a stored message keeps may be shown to the
    /// user as it is. The history keeps thinking as the provider signed it
    /// (it is sent back verbatim); an executor that checks what leaves it
    /// (output guards) checks the copy it streams, never the stored one,
    /// so it says `false`, and a service then shows no stored thinking.
    /// `true`, the default.
    fn shows_stored_thinking(&self) -> bool {
        true
    }
}
