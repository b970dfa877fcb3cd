//! The error envelope: [`ToolErrorKind`] (one table) and [`Rejection`].

use std::fmt;

use markov_core::ids::ToolCallId;
use markov_core::tool::ToolExecutionResult;
use serde::Serialize;
use serde_json::Value;

use crate::confirm::ConfirmationRequest;
use crate::service::{CallReport, ToolRequest};

macro_rules! kinds {
    ($(
        $(#[$doc:meta])*
        $variant:ident => $name:literal, retryable: $retry:literal, $message:literal;
    )*) => {
        /// Why a call failed: the `type` of the error envelope.
        ///
        /// Each kind's wire name, default retryability and model-facing
        /// message come from one table.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum ToolErrorKind {
            $( $(#[$doc])* $variant, )*
        }

        impl ToolErrorKind {
            /// Every kind, in table order.
            pub const ALL: &'static [ToolErrorKind] = &[$(ToolErrorKind::$variant),*];

            /// The wire name (`"NOT_FOUND"`, ...).
            pub fn as_str(self) -> &'static str {
                match self { $(ToolErrorKind::$variant => $name,)* }
            }

            /// Whether the model may retry the same call as it is.
            pub fn retryable(self) -> bool {
                match self { $(ToolErrorKind::$variant => $retry,)* }
            }

            /// The kind of a wire name (`"NOT_FOUND"`, ...).
            pub fn from_wire(name: &str) -> Option<Self> {
                match name { $($name => Some(ToolErrorKind::$variant),)* _ => None }
            }

            /// The message the model reads (before any detail).
            pub fn message(self) -> &'static str {
                match self { $(ToolErrorKind::$variant => $message,)* }
            }
        }
    };
}

kinds! {
    /// The tool is not registered, or not available to this leaf.
    NotFound => "NOT_FOUND", retryable: false, "Unknown tool";
    /// The tool is not allowed in the session's mode.
    ModeRestricted => "MODE_RESTRICTED", retryable: false, "Tool not available in this mode";
    /// A per-turn call budget is used up.
    BudgetExceeded => "BUDGET_EXCEEDED", retryable: false, "Tool call budget exceeded for this turn";
    /// The tool needs the user's approval; a request was issued.
    ConfirmationRequired => "CONFIRMATION_REQUIRED", retryable: false, "This action requires the user's approval";
    /// The confirmation token names a request the application has not approved yet.
    ConfirmationPending => "CONFIRMATION_PENDING", retryable: false, "The user has not approved this action yet";
    /// The application denied the request the token names.
    ConfirmationDenied => "CONFIRMATION_DENIED", retryable: false, "The user declined this action";
    /// The confirmation token is unknown, used, expired, or for another call.
    ConfirmationInvalid => "CONFIRMATION_INVALID", retryable: false, "The confirmation token is invalid, used or expired";
    /// A paused call's request expired before an approval was used.
    ConfirmationExpired => "CONFIRMATION_EXPIRED", retryable: false, "The user's approval expired before this action ran";
    /// The leaf repeated an identical call too often in this user turn.
    RepeatedCall => "REPEATED_CALL", retryable: false, "Not run: this exact call was repeated too often";
    /// The call id was already used by a call with another tool or other arguments.
    IdempotencyConflict => "IDEMPOTENCY_CONFLICT", retryable: false, "Duplicate call id";
    /// The arguments do not fit the tool's input.
    InvalidInput => "INVALID_INPUT", retryable: true, "Invalid tool input";
    /// The tool did not finish within its timeout.
    Timeout => "TIMEOUT", retryable: true, "Tool timed out";
    /// The tool ran and failed.
    ExecutionFailed => "EXECUTION_FAILED", retryable: false, "Tool execution failed";
    /// An at-most-once call started and its result was never recorded (the
    /// process died): its outcome is unknown, and it was not run again.
    Interrupted => "INTERRUPTED", retryable: false, "Interrupted: this call started, its outcome is unknown, and it was not run again";
}

impl fmt::Display for ToolErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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

    /// [`into_result`](Self::into_result) for a request.
    pub fn respond(self, req: &ToolRequest<'_>) -> ToolExecutionResult {
        self.into_result(req.call_id, req.report)
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tool call rejected ({})", self.kind.as_str())
    }
}

impl std::error::Error for Rejection {}

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
