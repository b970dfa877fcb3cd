//! The envelopes: [`Rejection`] (a refused or failed call as the error
//! envelope), the success envelope, and the two settings of how results
//! are written ([`EnvelopeMode`], [`ErrorFormat`]).

use std::fmt;

use markov_core::ids::ToolCallId;
use markov_core::tool::ToolExecutionResult;
use serde::Serialize;
use serde_json::Value;

use crate::approvals::ConfirmationRequest;
use crate::kind::ToolErrorKind;
use crate::report::CallReport;

/// A stage's refusal of a call (or a failed execution), turned into the
/// error envelope by [`Rejection::into_result`].
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    kind: ToolErrorKind,
    detail: Option<String>,
    retryable: bool,
    confirmation: Option<Box<ConfirmationRequest>>,
}

impl Rejection {
    /// A rejection of `kind` with its default retryability and no detail.
    pub fn new(kind: ToolErrorKind) -> Self {
        Rejection {
            kind,
            detail: None,
            retryable: kind.retryable(),
            confirmation: None,
        }
    }

    /// Adds a detail the model may read (never an internal error string).
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Attaches a confirmation request.
    #[must_use]
    pub fn with_confirmation(mut self, request: ConfirmationRequest) -> Self {
        self.confirmation = Some(Box::new(request));
        self
    }

    /// The kind.
    pub fn kind(&self) -> ToolErrorKind {
        self.kind
    }

    /// The detail, if any.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }

    /// Whether the model may retry.
    pub fn retryable(&self) -> bool {
        self.retryable
    }

    /// The confirmation request, if any.
    pub fn confirmation(&self) -> Option<&ConfirmationRequest> {
        self.confirmation.as_deref()
    }

    /// The message the model reads: the kind's message, then the detail.
    pub fn message(&self) -> String {
        match &self.detail {
            Some(d) => format!("{}: {d}", self.kind.message()),
            None => self.kind.message().to_owned(),
        }
    }

    /// The envelope JSON the model reads.
    pub fn to_envelope(&self) -> String {
        let message = self.message();
        let envelope = ErrorEnvelope {
            ok: false,
            error: ErrorBody {
                kind: self.kind.as_str(),
                message: &message,
                retryable: self.retryable,
                confirmation_request: self.confirmation.as_deref(),
            },
        };
        serde_json::to_string(&envelope).unwrap_or_else(|_| {
            // Only the confirmation's `args` could fail to serialize; they came from JSON.
            format!(
                r#"{{"ok":false,"error":{{"type":"{}","message":"{}","retryable":{}}}}}"#,
                self.kind.as_str(),
                self.kind.message(),
                self.retryable
            )
        })
    }

    /// The error result for `call_id`; records the kind in `report`.
    pub fn into_result(self, call_id: &ToolCallId, report: &CallReport) -> ToolExecutionResult {
        report.set_error(self.kind);
        tracing::debug!(
            call_id = %call_id,
            error_type = self.kind.as_str(),
            detail = self.detail.as_deref().unwrap_or(""),
            "tool call rejected"
        );
        ToolExecutionResult::error(call_id.clone(), self.to_envelope())
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tool call rejected ({})", self.kind.as_str())
    }
}

impl std::error::Error for Rejection {}

/// Whether successful results are wrapped in `{"ok":true,"data":..}`.
///
/// Errors always are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvelopeMode {
    /// `{"ok":true,"data":..,"intents":[..]?}` (a registry's default).
    On,
    /// The tool's text as without a registry.
    Off,
}

/// How the execute stage words the errors it produces itself (an unknown
/// tool, arguments that do not fit, a failing tool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorFormat {
    /// The error envelope, `{"ok":false,"error":{"type":..}}`: the default
    /// of a registry.
    Envelope,
    /// Plain texts — `Unknown tool: <name>`, `Invalid tool input: ..`,
    /// `Tool execution error: ..` (for pack tools `Invalid pack tool input:
    /// ..`, `Tool error: ..`): the default of a machine without a registry,
    /// so that its transcripts read as they always have.
    PlainText,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    ok: bool,
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
    retryable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    confirmation_request: Option<&'a ConfirmationRequest>,
}

#[derive(Serialize)]
struct SuccessEnvelope<'a> {
    ok: bool,
    data: &'a Value,
    #[serde(skip_serializing_if = "<[Value]>::is_empty")]
    intents: &'a [Value],
}

/// The success envelope `{"ok":true,"data":..,"intents":[..]?}`.
pub(crate) fn success_envelope(data: &Value, intents: &[Value]) -> String {
    serde_json::to_string(&SuccessEnvelope {
        ok: true,
        data,
        intents,
    })
    .unwrap_or_else(|_| r#"{"ok":true,"data":null}"#.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_table_names_every_kind() {
        let names: Vec<&str> = ToolErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "NOT_FOUND",
                "MODE_RESTRICTED",
                "BUDGET_EXCEEDED",
                "CONFIRMATION_REQUIRED",
                "CONFIRMATION_PENDING",
                "CONFIRMATION_DENIED",
                "CONFIRMATION_INVALID",
                "CONFIRMATION_EXPIRED",
                "REPEATED_CALL",
                "IDEMPOTENCY_CONFLICT",
                "INVALID_INPUT",
                "TIMEOUT",
                "EXECUTION_FAILED",
                "INTERRUPTED"
            ]
        );
        assert!(ToolErrorKind::Timeout.retryable());
        for kind in ToolErrorKind::ALL {
            assert_eq!(ToolErrorKind::from_wire(kind.as_str()), Some(*kind));
        }
        assert!(!ToolErrorKind::BudgetExceeded.retryable());
    }

    #[test]
    fn error_envelope_snapshot() {
        let r = Rejection::new(ToolErrorKind::BudgetExceeded)
            .with_detail("retrieval calls (max 5 per turn)");
        assert_eq!(
            r.to_envelope(),
            r#"{"ok":false,"error":{"type":"BUDGET_EXCEEDED","message":"Tool call budget exceeded for this turn: retrieval calls (max 5 per turn)","retryable":false}}"#
        );
        assert_eq!(
            Rejection::new(ToolErrorKind::NotFound).to_envelope(),
            r#"{"ok":false,"error":{"type":"NOT_FOUND","message":"Unknown tool","retryable":false}}"#
        );
    }

    #[test]
    fn success_envelope_snapshot() {
        assert_eq!(success_envelope(&json!(5), &[]), r#"{"ok":true,"data":5}"#);
        assert_eq!(
            success_envelope(&json!("hi"), &[json!({"type": "end_session"})]),
            r#"{"ok":true,"data":"hi","intents":[{"type":"end_session"}]}"#
        );
    }

    #[test]
    fn rejections_record_their_kind() {
        let report = CallReport::new();
        let r = Rejection::new(ToolErrorKind::Timeout).into_result(&ToolCallId::new("c"), &report);
        assert!(r.is_error);
        assert_eq!(report.error_kind(), Some(ToolErrorKind::Timeout));
    }
}
