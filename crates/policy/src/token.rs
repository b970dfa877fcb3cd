//! The token flow of the confirmation stage, for callers that cannot pause
//! (another agent over MCP, say):
//!
//! 1. A call of a tool that needs approval without a `confirmationToken`
//!    argument is answered `CONFIRMATION_REQUIRED` with a
//!    [`ConfirmationRequest`]; the request is recorded as pending.
//! 2. The application shows it ([`Approvals::pending`]) and records the
//!    user's answer with [`Approvals::approve`] or [`Approvals::deny`].
//! 3. The model calls again with the same arguments and
//!    `confirmationToken` set to the request id. Only an approved, unexpired
//!    request for this tool and these exact arguments lets the call through,
//!    once; the token is removed from the arguments before anything inside
//!    the confirmation stage sees them.
//!
//! The request id is no secret: it is worth nothing until the application
//! approves it, so a model that copies, guesses or replays one gets
//! `CONFIRMATION_PENDING` (not yet approved), `CONFIRMATION_DENIED` or
//! `CONFIRMATION_INVALID` (unknown, used, expired, or issued for another
//! call). A used, denied or expired request stays invalid for good; asking
//! again issues a new id.

use std::time::{Duration, SystemTime};

use markov_core::tool::ToolExecutionResult;
use serde_json::Value;

use crate::approvals::{
    ApprovalId, ApprovalStatus, Approvals, CONFIRMATION_TOKEN, ConfirmationRequest, Decision,
    MAX_PENDING, issue, unix_millis,
};
use crate::error::Rejection;
use crate::kind::ToolErrorKind;
use crate::service::{ToolRequest, ToolService};

/// Runs `req` through the token flow: on to `inner` when it presents an
/// approved token, else its refusal.
pub(crate) async fn call<S: ToolService>(
    inner: &S,
    mut req: ToolRequest<'_>,
    ttl: Duration,
) -> ToolExecutionResult {
    let approvals = req.policy.approvals();
    match approvals.check(req.name, req.input.to_mut(), ttl, SystemTime::now()) {
        Ok(()) => inner.call(req).await,
        Err(rejection) => {
            req.report.set_stage("confirm");
            rejection.respond(&req)
        }
    }
}

impl Approvals {
    /// A request for `tool` with `args` (the token flow): the pending one
    /// for the same call if there is one, else a new one, or `None` when
    /// [`MAX_PENDING`] requests already wait for a decision.
    fn request(
        &self,
        tool: &str,
        args: &Value,
        ttl: Duration,
        now: SystemTime,
    ) -> Option<ConfirmationRequest> {
        let now_ms = unix_millis(now);
        let mut records = self.lock();
        if let Some((record, _)) = records.values().find(|(r, _)| {
            r.held.is_none() && r.open(now_ms) && r.request.tool == tool && r.request.args == *args
        }) {
            return Some(record.request.clone());
        }
        issue(&mut records, tool, args, ttl, now, None)
    }

    /// The token flow's decision for a call of `tool` (sans-IO): strips the
    /// token from `input`, then passes the call (`Ok`, consuming an
    /// approval) or says why not.
    pub fn check(
        &self,
        tool: &str,
        input: &mut Value,
        ttl: Duration,
        now: SystemTime,
    ) -> Result<(), Rejection> {
        let token = match input {
            Value::Object(map) => map.remove(CONFIRMATION_TOKEN),
            _ => None,
        };
        let fresh = |kind: ToolErrorKind, detail: &str| {
            match self.request(tool, input, ttl, now) {
            Some(request) => Rejection::new(kind)
                .with_detail(detail)
                .with_confirmation(request),
            None => Rejection::new(kind).with_detail(format!(
                "{detail}; no new request was issued: {MAX_PENDING} requests already wait for the user's decision"
            )),
        }
        };
        let token = match token {
            None => {
                return Err(fresh(
                    ToolErrorKind::ConfirmationRequired,
                    "ask the user to approve it; once the application has recorded the approval, call again with the same arguments and confirmationToken set to the request_id",
                ));
            }
            Some(Value::String(token)) => ApprovalId::from(token),
            Some(_) => {
                return Err(fresh(
                    ToolErrorKind::ConfirmationInvalid,
                    "confirmationToken must be a request_id",
                ));
            }
        };
        let now_ms = unix_millis(now);
        let mut records = self.lock();
        // A paused call's request is the application's alone: no token
        // names it.
        let Some((record, _)) = records.get_mut(&token).filter(|(r, _)| r.held.is_none()) else {
            drop(records);
            return Err(fresh(
                ToolErrorKind::ConfirmationInvalid,
                "no such request in this conversation",
            ));
        };
        if record.request.tool != tool || record.request.args != *input {
            drop(records);
            return Err(fresh(
                ToolErrorKind::ConfirmationInvalid,
                "the request was issued for another call",
            ));
        }
        if now_ms >= record.request.expires {
            records.remove(&token);
            drop(records);
            return Err(fresh(
                ToolErrorKind::ConfirmationInvalid,
                "the request expired",
            ));
        }
        match record.status {
            ApprovalStatus::Approved => {
                record.status = ApprovalStatus::Used;
                Ok(())
            }
            ApprovalStatus::Pending => Err(Rejection::new(ToolErrorKind::ConfirmationPending)
                .with_confirmation(record.request.clone())),
            ApprovalStatus::Denied => {
                let rejection = Rejection::new(ToolErrorKind::ConfirmationDenied);
                Err(match &record.decision {
                    Some(Decision::Deny {
                        message: Some(message),
                    }) => rejection.with_detail(message.clone()),
                    _ => rejection,
                })
            }
            ApprovalStatus::Used | ApprovalStatus::Answered => {
                drop(records);
                Err(fresh(
                    ToolErrorKind::ConfirmationInvalid,
                    "the approval was already used",
                ))
            }
        }
    }
}
