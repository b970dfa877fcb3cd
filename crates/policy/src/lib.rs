//! The tool registry and its policy pipeline.
//!
//! See the crate documentation below (`docs/policy.md`) for the onion order,
//! the error envelope and the budget scope. This crate depends on
//! `markov-core` only.
#![doc = include_str!("../docs/policy.md")]
#![deny(missing_docs)]

pub mod answers;
pub mod approvals;
pub mod audit;
pub mod budget;
mod config;
pub mod confirm;
mod error;
mod execute;
mod gate;
pub mod idempotency;
mod kind;
pub mod latency;
mod ledger;
mod metadata;
pub mod mode;
mod pause;
mod records;
pub mod repeat;
mod report;
pub mod schema;
pub mod search;
mod service;
mod stack;
mod state;
pub mod timeout;
mod token;
mod tools;
mod turn;
pub mod unknown_tool;
pub mod validate;

pub use answers::{PendingAnswers, RecordedAnswer};
pub use approvals::{
    ApprovalError, ApprovalFlow, ApprovalId, ApprovalRecord, ApprovalStatus, Approvals,
    CONFIRMATION_TOKEN, ConfirmationRequest, DEFAULT_CONFIRMATION_TTL, DecidedApproval, Decision,
    HeldCall, HeldCheck,
};
pub use audit::AuditLayer;
pub use config::PolicyConfig;
pub use confirm::ConfirmLayer;
pub use error::{EnvelopeMode, ErrorFormat, Rejection};
pub use execute::{ExecuteService, INTENTS_KEY, WithIntents, into_result};
pub use gate::{Gate, GateLayer, Gated};
pub use idempotency::IdempotencyLayer;
pub use kind::ToolErrorKind;
pub use latency::LatencyLayer;
pub use ledger::{
    IdempotencyLedger, IdempotencyLimits, InterruptedCall, LedgerEntry, StoredResult,
};
pub use metadata::{Category, Mode, ToolMetadata};
pub use records::CallRecords;
pub use repeat::{Repeat, RepeatCounts, RepeatRecord};
pub use report::{
    AuditRecord, AuditSink, CallOutcome, CallReport, CallTrace, GuardAction, GuardPoint,
    GuardRecord,
};
pub use search::{FoundScope, FoundTool, SEARCH_TOOLS, SearchIndex, ToolSearch};
pub use service::{BoxToolService, ToolLayer, ToolOrigin, ToolRequest, ToolService};
pub use stack::{Either, Identity, OptionLayer, PolicyStack, Stack, StandardLayers};
pub use state::{
    CallDecision, CallGate, Journal, LeafMark, PolicyCounters, PolicySnapshot, PolicyState,
};
pub use timeout::TimeoutLayer;
pub use tools::{
    Executed, RegistryBinding, RegistryError, RegistrySession, ToolRegistry, ToolRegistryBuilder,
    plain_registry, unrecorded_registry,
};
pub use turn::{Budget, BudgetRecord, TurnBudgetState, TurnBudgets};
