//! Errors that end a run.

use markov_charter::ConfigError;
use markov_charter::transition::TransitionError;
use markov_core::InstanceId;
use markov_core::model::ModelError;

/// Why a run stopped without finishing. The history stays consistent either
/// way: every recorded tool call has its result.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The model call of step `step` failed.
    #[error("model call failed at step {step}: {source}")]
    Model {
        /// The 1-based step.
        step: usize,
        /// The model's error.
        #[source]
        source: ModelError,
    },
    /// The run used all its steps without finishing.
    #[error("Max steps ({0}) exceeded")]
    MaxSteps(usize),
    /// The model's answer could not be recorded durably before its tools
    /// ran, so none of them ran (the conversation's journal — a store —
    /// failed or refused the write).
    #[error(
        "the model's answer at step {step} could not be recorded, so its tools did not run: {reason}"
    )]
    AnswerNotRecorded {
        /// The 1-based step.
        step: usize,
        /// The journal's error.
        reason: String,
    },
    /// The stream ended without a step.
    #[error("No steps produced")]
    NoSteps,
    /// Nothing to run and nothing suspended.
    #[error("No active instances found")]
    NoActiveInstances,
    /// More than one leaf would receive user input.
    #[error(
        "Invalid state: {0} non-worker active leaves. At most one instance can receive user input per step."
    )]
    TooManyPrimaryLeaves(usize),
    /// A resume named an unknown instance.
    #[error("Instance not found: {0}")]
    InstanceNotFound(InstanceId),
    /// A resume named an instance that is not suspended.
    #[error("Instance {0} is not suspended")]
    NotSuspended(InstanceId),
    /// A resume named the wrong suspend id.
    #[error("Suspend ID mismatch: expected {expected}, got {got}")]
    SuspendIdMismatch {
        /// The stored id.
        expected: String,
        /// The given id.
        got: String,
    },
    /// The tree revisits an instance.
    #[error("Cycle detected in instance tree: instance \"{0}\" was already visited.")]
    Cycle(InstanceId),
    /// The tree is deeper than traversal allows.
    #[error("Max depth (100) exceeded in instance tree traversal. Possible cycle detected.")]
    TreeTooDeep,
    /// A state does not fit its node's schema.
    #[error("Invalid state for node \"{node}\": {message}")]
    InvalidState {
        /// The node's name or id.
        node: String,
        /// The validator's message.
        message: String,
    },
    /// The executor cannot call a model with no conversation.
    #[error(
        "Cannot call API with empty messages. This typically happens when runMachine is called before any user messages have been enqueued and there is no prior conversation history."
    )]
    EmptyMessages,
    /// A configuration problem found while running (a ref, tool generation).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A queued instance message could not be applied.
    #[error("invalid instance message: {0}")]
    InvalidInstanceMessage(String),
    /// A queued instance message could not be resolved (an unknown node ref,
    /// a malformed payload). It was taken out of the queue, so later runs are
    /// not stuck on it, and is handed back here; the rest of its batch stays
    /// queued, in order.
    #[error("{reason}")]
    RefusedInstanceMessage {
        /// Why it was refused (e.g. `Unknown node ref: <r>`).
        reason: String,
        /// The refused message.
        message: Box<markov_core::Message>,
    },
    /// A transition failed in a way the model cannot fix.
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// An executor failed.
    #[error("executor failed: {0}")]
    Executor(String),
    /// A step waits for the application's decisions on calls that need
    /// approval: new input waits (it stays queued) until they are decided
    /// and the run resumed ([`Machine::resume`](crate::Machine::resume)).
    #[error(
        "the run waits for the application's decision on {pending} tool call(s): decide them, then resume the run"
    )]
    AwaitingApproval {
        /// Calls still to decide (0 when every one is decided or expired).
        pending: usize,
    },
    /// A resume found no step waiting for approval.
    #[error("nothing to resume: no step waits for the application's approval")]
    NotAwaitingApproval,
    /// A limit on money is set, but the model of the next call has no
    /// price: the call was not made. Give it one with
    /// [`Prices::model`](crate::Prices::model).
    #[error(
        "a cost limit is set but model {} has no price: give it one with Prices::model",
        .model.as_deref().map_or_else(|| "(none named: neither the request nor the client names one)".to_owned(), |m| format!("{m:?}"))
    )]
    NoPrice {
        /// The model the call goes to (asked for, else the client's
        /// own); `None` when neither names one.
        model: Option<String>,
    },
}
