//! The executor contract: one inference for one leaf.

use async_trait::async_trait;
use markov_charter::charter::Charter;
use markov_core::Message;
use markov_core::ids::{InstanceId, ToolCallId};
use markov_core::message::Source;
use markov_core::tool::TerminateResponse;
use markov_policy::PolicyState;
use serde_json::Value;

use crate::effect::Entry;
use crate::error::RunError;
use crate::instance::{ActiveLeaf, Instance};
use crate::queue::Queue;
use crate::step::{TurnState, YieldReason};
use markov_context::ContextViews;

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
        }
    }
}

/// A pluggable inference engine for one leaf.
#[async_trait]
pub trait Executor: Send + Sync {
    /// Performs one inference for `cx.leaf` and reports what it produced.
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError>;
}
