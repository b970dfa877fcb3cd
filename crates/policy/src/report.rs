//! What a call produced besides its result: [`CallReport`], filled in by
//! the stages and read by audit and the caller, and [`AuditRecord`], what
//! the audit stage hands an [`AuditSink`].

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use markov_core::ids::ToolCallId;
use serde_json::Value;

use crate::approvals::ConfirmationRequest;
use crate::kind::ToolErrorKind;
use crate::metadata::{Category, Mode};

/// What a call produced besides its result: the error kind of a failure,
/// the intents of a success, and the request of a call that waits for the
/// application's approval. Filled in by the stages, read by audit and the
/// caller.
#[derive(Debug, Default)]
pub struct CallReport {
    inner: Mutex<ReportInner>,
}

#[derive(Debug, Default, Clone)]
struct ReportInner {
    error: Option<ToolErrorKind>,
    intents: Vec<Value>,
    awaiting: Option<ConfirmationRequest>,
}

impl CallReport {
    /// An empty report.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReportInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The kind of the failure, if the call failed.
    pub fn error_kind(&self) -> Option<ToolErrorKind> {
        self.lock().error
    }

    /// Records the kind of the call's failure.
    pub fn set_error(&self, kind: ToolErrorKind) {
        self.lock().error = Some(kind);
    }

    /// Records the intents of a successful call.
    pub fn set_intents(&self, intents: Vec<Value>) {
        self.lock().intents = intents;
    }

    /// A copy of the intents recorded so far.
    pub fn intents(&self) -> Vec<Value> {
        self.lock().intents.clone()
    }

    /// Takes the intents out of the report.
    pub fn take_intents(&self) -> Vec<Value> {
        std::mem::take(&mut self.lock().intents)
    }

    /// Records that the call did not run and waits for the application's
    /// decision on `request` (the pause flow).
    pub fn set_awaiting(&self, request: ConfirmationRequest) {
        self.lock().awaiting = Some(request);
    }

    /// The request the call waits for, if it was paused.
    pub fn awaiting(&self) -> Option<ConfirmationRequest> {
        self.lock().awaiting.clone()
    }
}

/// One call, as audited.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRecord {
    /// The call.
    pub call_id: ToolCallId,
    /// The tool name the model wrote.
    pub tool: String,
    /// The tool's version, if it is registered.
    pub tool_version: Option<String>,
    /// The registry's version.
    pub registry_version: Arc<str>,
    /// Time spent in the stack.
    pub duration: Duration,
    /// Whether the call succeeded.
    pub ok: bool,
    /// The tool's category, if it is registered.
    pub category: Option<Category>,
    /// The session's mode.
    pub mode: Mode,
    /// Why the call failed.
    pub error_type: Option<ToolErrorKind>,
}

/// Where a guard checked a text (see `markov-guard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GuardPoint {
    /// A user's message.
    Input,
    /// The model's answer, streamed text included.
    Output,
    /// A tool call's arguments.
    ToolCall,
    /// A tool's result.
    ToolResult,
}

impl GuardPoint {
    /// The point's name as audited: `input`, `output`, `tool_call` or
    /// `tool_result`.
    pub fn as_str(self) -> &'static str {
        match self {
            GuardPoint::Input => "input",
            GuardPoint::Output => "output",
            GuardPoint::ToolCall => "tool_call",
            GuardPoint::ToolResult => "tool_result",
        }
    }
}

/// What a guard did to a text, as audited. A pass is not audited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardAction {
    /// The text went on rewritten (a redaction).
    Rewrite,
    /// The text was blocked.
    Block {
        /// The guard that blocked.
        guard: String,
        /// Its reason.
        reason: String,
    },
}

/// A guard's rewrite or block, as audited: never the text itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardRecord {
    /// Where the guard checked.
    pub point: GuardPoint,
    /// What it did.
    pub action: GuardAction,
    /// The tool call, at [`GuardPoint::ToolCall`] and
    /// [`GuardPoint::ToolResult`].
    pub call_id: Option<ToolCallId>,
}

impl GuardRecord {
    /// Writes the record as a `tracing` event (`event = "guard"`): a
    /// warning for a block, information for a rewrite.
    pub fn trace(&self) {
        let call_id = self.call_id.as_ref().map(ToolCallId::as_str);
        match &self.action {
            GuardAction::Rewrite => tracing::info!(
                event = "guard",
                point = self.point.as_str(),
                call_id,
                action = "rewrite",
                "a guard rewrote a text"
            ),
            GuardAction::Block { guard, reason } => tracing::warn!(
                event = "guard",
                point = self.point.as_str(),
                call_id,
                action = "block",
                guard = guard.as_str(),
                reason = reason.as_str(),
                "a guard blocked a text"
            ),
        }
    }
}

/// Receives one [`AuditRecord`] per call, and one [`GuardRecord`] per
/// guard's rewrite or block (e.g. to persist them).
pub trait AuditSink: Send + Sync + fmt::Debug {
    /// Records one call. Called on the task that ran the call: keep it quick.
    fn record(&self, record: &AuditRecord);

    /// Records a guard's rewrite or block. Called on the task that ran the
    /// guard: keep it quick. Ignored unless implemented.
    fn guard(&self, record: &GuardRecord) {
        let _ = record;
    }
}
