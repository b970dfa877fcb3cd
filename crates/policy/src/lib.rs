//! The tool registry and its policy pipeline.
//!
//! See the crate documentation below (`docs/policy.md`) for the onion order,
//! the error envelope and the budget scope. This crate depends on
//! `markov-core` only.
#![doc = include_str!("../docs/policy.md")]
#![deny(missing_docs)]

pub mod answers;
pub mod audit;
pub mod budget;
pub mod confirm;
mod error;
mod execute;
mod gate;
pub mod idempotency;
pub mod latency;
mod metadata;
pub mod mode;
pub mod repeat;
mod service;
mod stack;
mod state;
pub mod timeout;
mod tools;
pub mod unknown_tool;
pub mod validate;

pub use answers::{PendingAnswers, RecordedAnswer};
pub use audit::{AuditLayer, AuditRecord, AuditSink};
pub use budget::{Budget, BudgetRecord, TurnBudgetState, TurnBudgets};
pub use confirm::{
    ApprovalError, ApprovalFlow, ApprovalId, ApprovalRecord, ApprovalStatus, Approvals,
    CONFIRMATION_TOKEN, ConfirmLayer, ConfirmationRequest, DEFAULT_CONFIRMATION_TTL, Decision,
    HeldCall, HeldCheck,
};
pub use error::{Rejection, ToolErrorKind};
pub use execute::{
    EnvelopeMode, ErrorFormat, ExecuteService, INTENTS_KEY, WithIntents, into_result,
};
pub use gate::{Gate, GateLayer, Gated};
pub use idempotency::{
    IdempotencyLayer, IdempotencyLedger, IdempotencyLimits, InterruptedCall, LedgerEntry,
    StoredResult,
};
pub use latency::LatencyLayer;
pub use metadata::{Category, Mode, ToolMetadata};
pub use repeat::{LoopGuard, Repeat, RepeatCounts, RepeatRecord};
pub use service::{BoxToolService, CallReport, ToolLayer, ToolOrigin, ToolRequest, ToolService};
pub use stack::{Either, Identity, OptionLayer, PolicyStack, Stack, StandardLayers};
pub use state::{Journal, LeafMark, PolicyCounters, PolicySnapshot, PolicyState};
pub use timeout::TimeoutLayer;
pub use tools::{
    Executed, PolicyConfig, RegistryBinding, RegistryError, RegistrySession, ToolRegistry,
    ToolRegistryBuilder, plain_registry, unrecorded_registry,
};
