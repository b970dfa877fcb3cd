//! The pause flow of the confirmation stage (the default).
//!
//! A call of a tool that needs approval does not run: a request is recorded
//! as pending in the conversation's [`Approvals`](crate::Approvals), bound
//! to the call itself (its user turn, its instance and its call id), and
//! the call is reported as awaiting
//! ([`CallReport::awaiting`](crate::CallReport::awaiting)). A machine then
//! ends its step without recording the response (the calls of the response
//! that need no approval have run; their results wait in the ledger) and
//! yields `AwaitingApproval`. Resuming replays the response: the calls that
//! ran are answered from the ledger, an approved call runs once, through
//! every stage inside the confirmation stage, with the approved arguments;
//! the others get the denial, the application's result, or — when the
//! request expired before an approval was used — an expiry error. The model
//! never sees a request id, so there is nothing it could present.

use std::time::{Duration, SystemTime};

use markov_core::tool::ToolExecutionResult;
use serde_json::Value;

use crate::approvals::{HeldCheck, MAX_PENDING};
use crate::error::{EnvelopeMode, ErrorFormat, Rejection, success_envelope};
use crate::kind::ToolErrorKind;
use crate::service::{ToolRequest, ToolService};

/// Runs `req` through the pause flow: on to `inner` once the application
/// has approved it, else the result the flow gives it. Requests live for
/// `ttl`; `envelope` and `errors` say how the flow writes its own results.
pub(crate) async fn call<S: ToolService>(
    inner: &S,
    mut req: ToolRequest<'_>,
    ttl: Duration,
    envelope: EnvelopeMode,
    errors: ErrorFormat,
) -> ToolExecutionResult {
    let key = req.ledger_key();
    let tool = req.tool;
    let check = req.policy.approvals().check_held(
        &key,
        req.cx.instance_id(),
        req.call_id,
        req.name,
        &req.input,
        || tool.map_or(Value::Null, |t| t.definition().input_schema.clone()),
        ttl,
        SystemTime::now(),
    );
    let refuse = |req: &ToolRequest<'_>, kind, detail| refuse(req, errors, kind, detail);
    if matches!(
        check,
        HeldCheck::Run(_) | HeldCheck::Denied(_) | HeldCheck::Answered(_)
    ) && let Some(approval) = req.policy.approvals().decided(&key, req.name)
    {
        req.report.set_approval(approval);
    }
    match check {
        HeldCheck::Run(edited) => {
            if let Some(args) = edited {
                req.input = std::borrow::Cow::Owned(args);
            }
            inner.call(req).await
        }
        HeldCheck::Wait(request) => {
            // Never recorded when the machine pauses: the step is not.
            // It is the result only of a run cancelled while it waits,
            // or of a caller that does not pause.
            let result = refuse(
                &req,
                ToolErrorKind::ConfirmationPending,
                Some("the call was not run: it waits for the user's decision".into()),
            );
            req.report.set_awaiting(request);
            result
        }
        HeldCheck::Denied(message) => refuse(&req, ToolErrorKind::ConfirmationDenied, message),
        HeldCheck::Answered(result) => answered(&req, envelope, &result),
        HeldCheck::Expired => refuse(
            &req,
            ToolErrorKind::ConfirmationExpired,
            Some("the call was not run".into()),
        ),
        HeldCheck::Full => refuse(
            &req,
            ToolErrorKind::ConfirmationRequired,
            Some(format!(
                "the call was not run: {MAX_PENDING} calls already wait for the user's decision"
            )),
        ),
    }
}

/// The error result of a call the flow answers itself.
fn refuse(
    req: &ToolRequest<'_>,
    errors: ErrorFormat,
    kind: ToolErrorKind,
    detail: Option<String>,
) -> ToolExecutionResult {
    req.report.set_stage("confirm");
    let mut rejection = Rejection::new(kind);
    if let Some(detail) = detail {
        rejection = rejection.with_detail(detail);
    }
    match errors {
        ErrorFormat::PlainText => {
            req.report.set_error(kind);
            ToolExecutionResult::error(req.call_id.clone(), rejection.message())
        }
        _ => rejection.respond(req),
    }
}

/// The application's own result for a call.
fn answered(req: &ToolRequest<'_>, envelope: EnvelopeMode, result: &Value) -> ToolExecutionResult {
    let content = match envelope {
        EnvelopeMode::On => success_envelope(result, &[]),
        EnvelopeMode::Off => match result {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        },
    };
    ToolExecutionResult::success(req.call_id.clone(), content)
}
