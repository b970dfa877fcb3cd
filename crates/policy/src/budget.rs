//! `BUDGET_EXCEEDED`: the budget stage. [`BudgetGate`] checks the call
//! against the [`Budget`] of the session's mode and charges the turn's
//! counters ([`TurnBudgetState`]) when it passes.

use std::sync::Arc;

use crate::config::PolicyConfig;
use crate::error::Rejection;
use crate::gate::{Gate, GateLayer, Gated};
use crate::kind::ToolErrorKind;
use crate::metadata::{Category, Mode};
use crate::service::ToolRequest;
use crate::turn::{Budget, TurnBudgetState};

/// The gate: the budget of the request's mode (or the default one).
#[derive(Debug, Clone)]
pub struct BudgetGate {
    default: Budget,
    per_mode: Arc<[(Mode, Budget)]>,
}

impl BudgetGate {
    /// A gate applying `default` in every mode without its own budget.
    pub fn new(default: Budget, per_mode: impl IntoIterator<Item = (Mode, Budget)>) -> Self {
        BudgetGate {
            default,
            per_mode: per_mode.into_iter().collect(),
        }
    }

    /// The budget in `mode`.
    pub fn budget_for(&self, mode: &Mode) -> &Budget {
        self.per_mode
            .iter()
            .find(|(m, _)| m == mode)
            .map_or(&self.default, |(_, b)| b)
    }
}

/// The layer of [`BudgetGate`].
pub type BudgetLayer = GateLayer<BudgetGate>;

/// A service behind [`BudgetGate`].
pub type BudgetCheck<S> = Gated<S, BudgetGate>;

/// The kind this stage rejects with.
pub const REJECTION: ToolErrorKind = ToolErrorKind::BudgetExceeded;

impl Gate for BudgetGate {
    const NAME: &'static str = "budget";

    fn check(&self, req: &ToolRequest<'_>, turn: &TurnBudgetState) -> Result<(), Rejection> {
        let category = req.metadata.map_or(Category::Other, |m| m.category());
        turn.try_charge(category, self.budget_for(req.mode))
    }
}

impl PolicyConfig {
    /// The budget gate of these settings: the default budget, and each
    /// mode's own.
    pub fn budget_gate(&self) -> BudgetGate {
        BudgetGate::new(self.budget, self.mode_budgets.iter().cloned())
    }
}
