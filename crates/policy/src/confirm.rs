//! The confirmation stage: a call of a tool that needs the user's approval
//! waits for the application's decision, in one of two flows
//! ([`ApprovalFlow`]).
//!
//! - The pause flow (the default, in `pause.rs`): the call does not run, a
//!   request bound to the call is recorded, and the machine pauses its run
//!   until the application has decided; resuming runs the approved call
//!   without asking the model again.
//! - The token flow (in `token.rs`), for callers that cannot pause: the
//!   call is answered `CONFIRMATION_REQUIRED`, and after the application's
//!   approval the model calls again with the request's id.
//!
//! The requests and decisions themselves are the conversation's
//! [`Approvals`](crate::Approvals).

use std::time::Duration;

use markov_core::async_trait;
use markov_core::tool::ToolExecutionResult;

use crate::approvals::ApprovalFlow;
use crate::error::{EnvelopeMode, ErrorFormat};
use crate::service::{ToolLayer, ToolRequest, ToolService};
use crate::{pause, token};

/// The confirmation stage's layer.
#[derive(Debug, Clone, Copy)]
pub struct ConfirmLayer {
    ttl: Duration,
    flow: ApprovalFlow,
    envelope: EnvelopeMode,
    errors: ErrorFormat,
}

impl ConfirmLayer {
    /// A layer whose requests live for `ttl`, pausing calls
    /// ([`ApprovalFlow::Pause`]) and answering in envelopes.
    pub fn new(ttl: Duration) -> Self {
        ConfirmLayer {
            ttl,
            flow: ApprovalFlow::Pause,
            envelope: EnvelopeMode::On,
            errors: ErrorFormat::Envelope,
        }
    }

    /// Sets how a call waits for its approval.
    #[must_use]
    pub fn flow(mut self, flow: ApprovalFlow) -> Self {
        self.flow = flow;
        self
    }

    /// Sets how the stage writes the results it gives itself: the
    /// application's answer (`envelope`) and a refusal (`errors`; the token
    /// flow's are always envelopes, which carry the request).
    #[must_use]
    pub fn format(mut self, envelope: EnvelopeMode, errors: ErrorFormat) -> Self {
        self.envelope = envelope;
        self.errors = errors;
        self
    }
}

impl<S> ToolLayer<S> for ConfirmLayer {
    type Service = Confirm<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Confirm {
            inner,
            layer: *self,
        }
    }
}

/// A service behind the confirmation stage.
#[derive(Debug, Clone)]
pub struct Confirm<S> {
    inner: S,
    layer: ConfirmLayer,
}

#[async_trait]
impl<S: ToolService> ToolService for Confirm<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        if !req.needs_approval() {
            return self.inner.call(req).await;
        }
        let ConfirmLayer {
            ttl,
            flow,
            envelope,
            errors,
        } = self.layer;
        match flow {
            ApprovalFlow::Token => token::call(&self.inner, req, ttl).await,
            ApprovalFlow::Pause => pause::call(&self.inner, req, ttl, envelope, errors).await,
        }
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("confirm");
        self.inner.stages(out);
    }
}
