//! `MODE_RESTRICTED`: the tool is not allowed in the session's mode.

use crate::error::Rejection;
use crate::gate::{Gate, GateLayer, Gated};
use crate::kind::ToolErrorKind;
use crate::service::ToolRequest;
use crate::turn::TurnBudgetState;

/// The gate: the tool's metadata must allow the request's mode.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModeGate;

/// The layer of [`ModeGate`].
pub type ModeLayer = GateLayer<ModeGate>;

/// A service behind [`ModeGate`].
pub type ModeRestriction<S> = Gated<S, ModeGate>;

/// The kind this stage rejects with.
pub const REJECTION: ToolErrorKind = ToolErrorKind::ModeRestricted;

impl ModeLayer {
    /// The layer.
    pub fn mode() -> Self {
        GateLayer::new(ModeGate)
    }
}

impl Gate for ModeGate {
    const NAME: &'static str = "mode";

    fn check(&self, req: &ToolRequest<'_>, _turn: &TurnBudgetState) -> Result<(), Rejection> {
        match req.metadata {
            Some(m) if !m.allows(req.mode) => Err(Rejection::new(REJECTION).with_detail(format!(
                "{} is not available in {} mode",
                req.name, req.mode
            ))),
            _ => Ok(()),
        }
    }
}
