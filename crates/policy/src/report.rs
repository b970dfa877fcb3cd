//! What a call produced besides its result: [`CallReport`], filled in by
//! the stages and read by audit and the caller, and [`AuditRecord`], what
//! the audit stage hands an [`AuditSink`].

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use markov_core::ids::ToolCallId;
use serde_json::Value;

use serde::{Deserialize, Serialize};

use crate::approvals::{ApprovalId, ConfirmationRequest, DecidedApproval};
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
    /// The stage that answered the call without running its tool.
    stage: Option<&'static str>,
    /// Whether the tool was started.
    ran: bool,
    /// Whether the idempotency ledger answered the call.
    replayed: bool,
    /// The application's decision the call went on with.
    approval: Option<DecidedApproval>,
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

    /// Records that the stage `stage` answered the call without running
    /// its tool (a refusal, mostly).
    pub fn set_stage(&self, stage: &'static str) {
        self.lock().stage.get_or_insert(stage);
    }

    /// Records that the tool was started.
    pub fn set_ran(&self) {
        self.lock().ran = true;
    }

    /// Records that the idempotency ledger answered the call: it had run
    /// (or started) before, and its tool did not run again.
    pub fn set_replayed(&self) {
        self.lock().replayed = true;
    }

    /// Records the application's decision the call went on with.
    pub fn set_approval(&self, approval: DecidedApproval) {
        self.lock().approval = Some(approval);
    }

    /// The application's decision the call went on with, if it needed one.
    pub fn approval(&self) -> Option<DecidedApproval> {
        self.lock().approval.clone()
    }

    /// How the call was answered, for a result that `is_error` or not.
    pub fn outcome(&self, is_error: bool) -> CallOutcome {
        self.lock().outcome(is_error)
    }

    /// Everything the report holds, taken apart without a lock (the call
    /// is over): the error kind, the intents, the request the call waits
    /// for, how it was answered (for a result that `is_error` or not) and
    /// the decision it went on with.
    pub(crate) fn into_parts(self, is_error: bool) -> ReportParts {
        let inner = self.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        let outcome = inner.outcome(is_error);
        ReportParts {
            error: inner.error,
            intents: inner.intents,
            awaiting: inner.awaiting,
            outcome,
            approval: inner.approval,
        }
    }
}

/// A finished call's report, taken apart ([`CallReport::into_parts`]).
pub(crate) struct ReportParts {
    pub(crate) error: Option<ToolErrorKind>,
    pub(crate) intents: Vec<Value>,
    pub(crate) awaiting: Option<ConfirmationRequest>,
    pub(crate) outcome: CallOutcome,
    pub(crate) approval: Option<DecidedApproval>,
}

impl ReportInner {
    fn outcome(&self, is_error: bool) -> CallOutcome {
        let inner = self;
        // Names, not copies: a machine that records nothing pays no
        // allocation for them.
        let error = inner.error.map(|kind| Cow::Borrowed(kind.as_str()));
        if let Some(request) = &inner.awaiting {
            CallOutcome::Awaiting {
                request: request.request_id.clone(),
            }
        } else if inner.replayed {
            CallOutcome::Ledger {
                ok: !is_error,
                error,
            }
        } else if inner.ran {
            CallOutcome::Ran {
                ok: !is_error,
                error,
            }
        } else if is_error {
            CallOutcome::Refused {
                stage: Cow::Borrowed(inner.stage.unwrap_or("policy")),
                error,
            }
        } else {
            CallOutcome::Answered
        }
    }
}

/// How one tool call was answered, as a step's trace records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[non_exhaustive]
pub enum CallOutcome {
    /// The tool ran: it succeeded, or failed (`error`: the kind the
    /// envelope named, when it named one).
    Ran {
        /// Whether it succeeded.
        ok: bool,
        /// The kind of its failure (`"TIMEOUT"`, ...), if it had one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<Cow<'static, str>>,
    },
    /// A stage answered the call with an error and its tool did not run.
    Refused {
        /// The stage (`"mode"`, `"budget"`, `"confirm"`, `"loop_guard"`,
        /// ...).
        stage: Cow<'static, str>,
        /// The kind the envelope named (`"BUDGET_EXCEEDED"`, ...), if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<Cow<'static, str>>,
    },
    /// The call did not run: it waits for the application's decision on
    /// `request`.
    Awaiting {
        /// The confirmation request.
        request: ApprovalId,
    },
    /// The idempotency ledger answered the call with the result of the
    /// time it ran (or started, for an interrupted at-most-once call): the
    /// tool did not run again.
    Ledger {
        /// Whether the recorded result is a success.
        ok: bool,
        /// The kind of the recorded failure, if it had one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<Cow<'static, str>>,
    },
    /// Answered with a result no tool made (the application's own result
    /// for a paused call, or a gate's): the tool did not run.
    Answered,
}

impl CallOutcome {
    /// Whether the call's tool ran in this step.
    pub fn ran(&self) -> bool {
        matches!(self, CallOutcome::Ran { .. })
    }
}

/// One tool call of a step, as its trace records it: which call, how long
/// it took, and what the policy decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallTrace {
    /// The call's id.
    pub call_id: ToolCallId,
    /// The tool name the model wrote.
    pub tool: String,
    /// Milliseconds from the call's start to its result.
    pub ms: u64,
    /// How it was answered.
    #[serde(flatten)]
    pub outcome: CallOutcome,
    /// The application's decision it went on with, if it needed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<DecidedApproval>,
    /// The error result the model read, when a stage refused the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envelope: Option<String>,
    /// The state patch the call wrote (its patches merged), when it wrote
    /// one: what a replay plays back instead of running the tool again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
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
