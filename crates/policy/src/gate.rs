//! Pass/reject stages as predicates: [`Gate`] and the one [`GateLayer`].

use markov_core::async_trait;
use markov_core::tool::ToolExecutionResult;

use crate::error::Rejection;
use crate::service::{ToolLayer, ToolRequest, ToolService};
use crate::turn::TurnBudgetState;

/// A predicate over a call (tower's `filter::Predicate`, without IO): it
/// passes the call on or rejects it. Gates are plain values, tested without
/// a runtime.
pub trait Gate: Send + Sync {
    /// The stage's name, for [`ToolService::stages`].
    const NAME: &'static str;

    /// Passes `req` or rejects it. A gate may charge `turn` (the budget gate
    /// does, when it passes a call).
    fn check(&self, req: &ToolRequest<'_>, turn: &TurnBudgetState) -> Result<(), Rejection>;
}

/// Turns a [`Gate`] into a stage.
#[derive(Debug, Clone)]
pub struct GateLayer<G> {
    gate: G,
}

impl<G> GateLayer<G> {
    /// A layer running `gate`.
    pub fn new(gate: G) -> Self {
        GateLayer { gate }
    }
}

impl<S, G: Clone> ToolLayer<S> for GateLayer<G> {
    type Service = Gated<S, G>;
    fn layer(&self, inner: S) -> Self::Service {
        Gated {
            inner,
            gate: self.gate.clone(),
        }
    }
}

/// A service behind a gate: a rejected call never reaches `inner`.
#[derive(Debug, Clone)]
pub struct Gated<S, G> {
    inner: S,
    gate: G,
}

impl<S, G> Gated<S, G> {
    /// The gate.
    pub fn gate(&self) -> &G {
        &self.gate
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

#[async_trait]
impl<S: ToolService, G: Gate> ToolService for Gated<S, G> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        match self.gate.check(&req, req.turn) {
            Ok(()) => self.inner.call(req).await,
            Err(rejection) => {
                req.report.set_stage(G::NAME);
                rejection.respond(&req)
            }
        }
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push(G::NAME);
        self.inner.stages(out);
    }
}
