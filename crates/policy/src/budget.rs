//! `BUDGET_EXCEEDED`: per-turn call budgets, total and per category.
//!
//! [`TurnBudgetState`] holds one turn's counters; [`BudgetGate`] checks the
//! call against the [`Budget`] of the session's mode and charges the counters
//! when it passes. [`TurnBudgets`] keeps one state per leaf for an executor.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use markov_core::ids::InstanceId;
use serde::{Deserialize, Serialize};

use crate::error::{Rejection, ToolErrorKind};
use crate::gate::{Gate, GateLayer, Gated};
use crate::metadata::{Category, Mode};
use crate::service::ToolRequest;

/// Call limits per turn. `None` is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    max_calls: Option<u32>,
    per_category: [Option<u32>; 3],
}

impl Budget {
    /// No limits.
    pub const UNLIMITED: Budget = Budget {
        max_calls: None,
        per_category: [None; 3],
    };

    /// The text-mode budget: 10 calls per turn, 5 of them retrieval.
    pub const TEXT: Budget = Budget {
        max_calls: Some(10),
        per_category: [Some(5), None, None],
    };

    /// Limits the calls per turn.
    #[must_use]
    pub fn max_calls(mut self, max: u32) -> Self {
        self.max_calls = Some(max);
        self
    }

    /// Limits the calls of one category per turn.
    #[must_use]
    pub fn max_for(mut self, category: Category, max: u32) -> Self {
        self.per_category[category.index()] = Some(max);
        self
    }

    /// The limit on all calls.
    pub fn calls_limit(&self) -> Option<u32> {
        self.max_calls
    }

    /// The limit on one category.
    pub fn category_limit(&self, category: Category) -> Option<u32> {
        self.per_category[category.index()]
    }
}

/// The counters of one turn (interior mutability: the gate charges them
/// through a shared reference).
#[derive(Debug, Default)]
pub struct TurnBudgetState {
    counts: Mutex<Counts>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    total: u32,
    per_category: [u32; 3],
}

impl TurnBudgetState {
    /// Fresh counters.
    pub fn new() -> Self {
        Self::default()
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls charged this turn.
    pub fn total(&self) -> u32 {
        self.counts().total
    }

    /// Calls of `category` charged this turn.
    pub fn count(&self, category: Category) -> u32 {
        self.counts().per_category[category.index()]
    }

    /// The counters as they are, to put back with [`rewind`](Self::rewind).
    pub(crate) fn mark(&self) -> (u32, [u32; 3]) {
        let counts = *self.counts();
        (counts.total, counts.per_category)
    }

    /// Puts back counters taken with [`mark`](Self::mark).
    pub(crate) fn rewind(&self, (total, per_category): (u32, [u32; 3])) {
        *self.counts() = Counts {
            total,
            per_category,
        };
    }

    /// Charges one call of `category` if `budget` allows it; otherwise leaves
    /// the counters alone and says which limit was hit.
    pub fn try_charge(&self, category: Category, budget: &Budget) -> Result<(), Rejection> {
        let mut counts = self.counts();
        if let Some(max) = budget.category_limit(category)
            && counts.per_category[category.index()] >= max
        {
            return Err(Rejection::new(ToolErrorKind::BudgetExceeded)
                .with_detail(format!("{category} calls (max {max} per turn)")));
        }
        if let Some(max) = budget.max_calls
            && counts.total >= max
        {
            return Err(Rejection::new(ToolErrorKind::BudgetExceeded)
                .with_detail(format!("tool calls (max {max} per turn)")));
        }
        counts.total += 1;
        counts.per_category[category.index()] += 1;
        Ok(())
    }
}

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

/// Bound on the leaves [`TurnBudgets`] remembers.
const MAX_LEAVES: usize = 4096;

/// One [`TurnBudgetState`] per leaf instance for the current user turn of
/// one conversation (part of its [`PolicyState`](crate::PolicyState)).
///
/// A leaf keeps its counters through every step and transition of the user
/// turn (a leaf that goes a → b → a does not get its budget three times);
/// [`clear`](Self::clear) starts them all over when the next user turn
/// begins.
#[derive(Debug, Default)]
pub struct TurnBudgets {
    leaves: Mutex<HashMap<InstanceId, Arc<TurnBudgetState>>>,
}

impl TurnBudgets {
    /// No leaf yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counters of `leaf` in the current user turn.
    ///
    /// At most 4 096 leaves are remembered; beyond that the table is cleared
    /// before the new leaf is added (their turns start over).
    pub fn for_leaf(&self, leaf: &InstanceId) -> Arc<TurnBudgetState> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(state) = leaves.get(leaf) {
            return Arc::clone(state);
        }
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        let state = Arc::new(TurnBudgetState::new());
        leaves.insert(leaf.clone(), Arc::clone(&state));
        state
    }

    /// Starts a new user turn: every leaf's counters start over.
    pub fn clear(&self) {
        self.leaves
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// The counters of the current user turn, one record per leaf that has
    /// charged a call, ordered by instance (so two snapshots of the same
    /// counters compare equal).
    pub fn snapshot(&self) -> Vec<BudgetRecord> {
        let leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        let mut records: Vec<BudgetRecord> = leaves
            .iter()
            .filter_map(|(instance, state)| {
                let counts = *state.counts();
                (counts.total > 0).then(|| BudgetRecord {
                    instance: instance.clone(),
                    total: counts.total,
                    per_category: counts.per_category,
                })
            })
            .collect();
        records.sort_by(|a, b| a.instance.as_str().cmp(b.instance.as_str()));
        records
    }

    /// Replaces the counters with `records` (a restored conversation keeps
    /// what its user turn has already spent).
    pub fn restore(&self, records: impl IntoIterator<Item = BudgetRecord>) {
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        leaves.clear();
        for record in records.into_iter().take(MAX_LEAVES) {
            let state = TurnBudgetState {
                counts: Mutex::new(Counts {
                    total: record.total,
                    per_category: record.per_category,
                }),
            };
            leaves.insert(record.instance, Arc::new(state));
        }
    }
}

/// One leaf's budget counters in the current user turn, as a snapshot keeps
/// them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BudgetRecord {
    /// The leaf instance.
    pub instance: InstanceId,
    /// Calls charged this turn.
    pub total: u32,
    /// Calls charged per category (retrieval, action, other).
    pub per_category: [u32; 3],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_category_limit_comes_first_and_rejections_do_not_count() {
        let turn = TurnBudgetState::new();
        let budget = Budget::UNLIMITED
            .max_calls(3)
            .max_for(Category::Retrieval, 1);
        assert!(turn.try_charge(Category::Retrieval, &budget).is_ok());
        let err = turn
            .try_charge(Category::Retrieval, &budget)
            .expect_err("second retrieval");
        assert_eq!(err.kind(), ToolErrorKind::BudgetExceeded);
        assert_eq!(err.detail(), Some("retrieval calls (max 1 per turn)"));
        assert_eq!(turn.total(), 1);
        assert!(turn.try_charge(Category::Action, &budget).is_ok());
        assert!(turn.try_charge(Category::Other, &budget).is_ok());
        let err = turn
            .try_charge(Category::Action, &budget)
            .expect_err("fourth call");
        assert_eq!(err.detail(), Some("tool calls (max 3 per turn)"));
        assert_eq!(turn.total(), 3);
        assert_eq!(turn.count(Category::Retrieval), 1);
    }

    #[test]
    fn per_mode_budgets_override_the_default() {
        let gate = BudgetGate::new(Budget::UNLIMITED, [(Mode::VOICE, Budget::TEXT)]);
        assert_eq!(gate.budget_for(&Mode::TEXT), &Budget::UNLIMITED);
        assert_eq!(gate.budget_for(&Mode::VOICE).calls_limit(), Some(10));
    }

    #[test]
    fn leaves_keep_their_turn_until_it_starts_over() {
        let budgets = TurnBudgets::new();
        let leaf = InstanceId::new("a");
        let first = budgets.for_leaf(&leaf);
        assert!(first.try_charge(Category::Other, &Budget::TEXT).is_ok());
        assert_eq!(budgets.for_leaf(&leaf).total(), 1);
        budgets.clear();
        assert_eq!(budgets.for_leaf(&leaf).total(), 0);
    }

    #[test]
    fn a_snapshot_restores_the_counters_it_was_taken_from() {
        let budgets = TurnBudgets::new();
        let (a, b) = (InstanceId::new("a"), InstanceId::new("b"));
        let _ = budgets
            .for_leaf(&a)
            .try_charge(Category::Retrieval, &Budget::TEXT);
        let _ = budgets
            .for_leaf(&a)
            .try_charge(Category::Action, &Budget::TEXT);
        let _ = budgets.for_leaf(&b);
        let records = budgets.snapshot();
        assert_eq!(records.len(), 1, "a leaf that charged nothing is not kept");
        let restored = TurnBudgets::new();
        restored.restore(records.clone());
        assert_eq!(restored.for_leaf(&a).total(), 2);
        assert_eq!(restored.for_leaf(&a).count(Category::Retrieval), 1);
        assert_eq!(restored.snapshot(), records);
    }
}
