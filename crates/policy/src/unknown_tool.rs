//! `NOT_FOUND`: the tool is not registered, or the caller found no tool of
//! that name for this leaf.

use crate::error::Rejection;
use crate::gate::{Gate, GateLayer, Gated};
use crate::kind::ToolErrorKind;
use crate::service::ToolRequest;
use crate::turn::TurnBudgetState;

/// The gate: a call needs both registered metadata and a resolved tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnknownToolGate;

/// The layer of [`UnknownToolGate`].
pub type UnknownToolLayer = GateLayer<UnknownToolGate>;

/// A service behind [`UnknownToolGate`].
pub type UnknownTool<S> = Gated<S, UnknownToolGate>;

/// The kind this stage rejects with.
pub const REJECTION: ToolErrorKind = ToolErrorKind::NotFound;

impl UnknownToolLayer {
    /// The layer.
    pub fn unknown_tool() -> Self {
        GateLayer::new(UnknownToolGate)
    }
}

impl Gate for UnknownToolGate {
    const NAME: &'static str = "unknown_tool";

    fn check(&self, req: &ToolRequest<'_>, _turn: &TurnBudgetState) -> Result<(), Rejection> {
        if req.metadata.is_some() && req.tool.is_some() {
            Ok(())
        } else {
            Err(Rejection::new(REJECTION).with_detail(req.name))
        }
    }
}
