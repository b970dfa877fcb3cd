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

/// Receives one [`AuditRecord`] per call (e.g. to persist them).
pub trait AuditSink: Send + Sync + fmt::Debug {
    /// Records one call. Called on the task that ran the call: keep it quick.
    fn record(&self, record: &AuditRecord);
}
