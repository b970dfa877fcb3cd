//! The two traits of the pipeline, [`ToolService`] and [`ToolLayer`], and the
//! request a stage sees.

use std::fmt;
use std::sync::Arc;

use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::{SharedTool, ToolContext, ToolExecutionResult};
use serde_json::Value;

use crate::error::Rejection;
use crate::ledger::IdempotencyLedger;
use crate::metadata::{Mode, ToolMetadata};
use crate::report::CallReport;
use crate::state::PolicyState;
use crate::turn::TurnBudgetState;

/// One tool call on its way through the stack.
///
/// The caller resolves `tool` (the pipeline finds node, ancestor, charter and
/// pack tools; [`ToolRegistry::execute`](crate::ToolRegistry) uses its own)
/// and `metadata` (the registry's). Stages may rewrite `input` (confirmation
/// strips its token).
#[derive(Debug)]
pub struct ToolRequest<'a> {
    /// The call's id.
    pub call_id: &'a ToolCallId,
    /// The tool name the model wrote.
    pub name: &'a str,
    /// The arguments, borrowed from the call while no stage changes them:
    /// the execute stage makes the one copy the tool consumes.
    pub input: std::borrow::Cow<'a, Value>,
    /// The tool to run, if one was found.
    pub tool: Option<&'a SharedTool>,
    /// The tool's registered metadata, if it is registered.
    pub metadata: Option<&'a ToolMetadata>,
    /// The mode the session runs in.
    pub mode: &'a Mode,
    /// The counters of the current turn.
    pub turn: &'a TurnBudgetState,
    /// The conversation's approvals and idempotency ledger.
    pub policy: &'a PolicyState,
    /// Where stages report the error kind and the intents of this call.
    pub report: &'a CallReport,
    /// The context the tool runs with (state, history, instance).
    pub cx: ToolContext<'a>,
    /// The tool result of a `TerminateResponse` without a message.
    pub terminate_message: &'a str,
    /// Where the tool was found (it decides the wording of plain-text errors).
    pub origin: ToolOrigin,
}

impl ToolRequest<'_> {
    /// Whether the call's tool needs the application's approval: its
    /// registry metadata says so, or its own definition does.
    pub(crate) fn needs_approval(&self) -> bool {
        self.metadata.is_some_and(|m| m.requires_confirmation())
            || self.tool.is_some_and(|t| t.definition().needs_approval)
    }

    /// The call's key in the idempotency ledger: its user turn, instance
    /// and call id.
    pub(crate) fn ledger_key(&self) -> String {
        IdempotencyLedger::key_of(self.policy.turn(), self.cx.instance_id(), self.call_id)
    }
}

impl Rejection {
    /// [`into_result`](Self::into_result) for a request.
    pub fn respond(self, req: &ToolRequest<'_>) -> ToolExecutionResult {
        self.into_result(req.call_id, req.report)
    }
}

/// Where a tool was found for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ToolOrigin {
    /// The node, an ancestor, the charter or the registry.
    #[default]
    Node,
    /// A pack of the node.
    Pack,
}

/// A stage of the pipeline, or the tool execution at its centre.
///
/// hyper 1.x's shape: `call(&self)`, no readiness, and no error channel (every
/// call resolves to exactly one [`ToolExecutionResult`]; a rejection is an
/// error result carrying the envelope).
///
/// Implemented with `#[async_trait]` (`markov_core::async_trait`), like
/// every markov trait with async methods.
#[async_trait]
pub trait ToolService: Send + Sync {
    /// Handles one call.
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult;

    /// Appends the names of the stages from this one inwards (for diagnostics
    /// and the test that pins the order).
    fn stages(&self, out: &mut Vec<&'static str>) {
        let _ = out;
    }
}

/// A type-erased, shared service.
pub type BoxToolService = Arc<dyn ToolService>;

#[async_trait]
impl<S: ToolService + ?Sized> ToolService for Box<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        (**self).call(req).await
    }
    fn stages(&self, out: &mut Vec<&'static str>) {
        (**self).stages(out);
    }
}

#[async_trait]
impl<S: ToolService + ?Sized> ToolService for Arc<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        (**self).call(req).await
    }
    fn stages(&self, out: &mut Vec<&'static str>) {
        (**self).stages(out);
    }
}

#[async_trait]
impl<S: ToolService + ?Sized> ToolService for &S {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        (**self).call(req).await
    }
    fn stages(&self, out: &mut Vec<&'static str>) {
        (**self).stages(out);
    }
}

/// Wraps a service in a stage (tower's `Layer`).
pub trait ToolLayer<S> {
    /// The wrapped service.
    type Service;

    /// Wraps `inner`.
    fn layer(&self, inner: S) -> Self::Service;
}

impl<S, L: ToolLayer<S>> ToolLayer<S> for &L {
    type Service = L::Service;
    fn layer(&self, inner: S) -> Self::Service {
        (**self).layer(inner)
    }
}

impl fmt::Debug for dyn ToolService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut stages = Vec::new();
        self.stages(&mut stages);
        f.debug_struct("ToolService")
            .field("stages", &stages)
            .finish()
    }
}
