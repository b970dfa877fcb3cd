//! [`PolicyState`]: what one conversation keeps between tool calls — its
//! confirmation requests, its idempotency ledger and its per-turn budget
//! counters — and [`PolicySnapshot`], the part of it a snapshot keeps.
//!
//! A registry is shared by many conversations; this state is not. A machine
//! owns one (`Machine::policy_state`), hands it to every tool call, writes
//! it into its snapshot and reads it back, so approvals and answered calls
//! survive a restart.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::budget::TurnBudgets;
use crate::confirm::{ApprovalRecord, Approvals};
use crate::idempotency::{IdempotencyLedger, IdempotencyLimits, LedgerEntry};
use crate::repeat::{RepeatCounts, RepeatRecord};

/// Where answered calls are written before their result is used: a store
/// implements it so that a crash between a tool's side effect and the step's
/// commit cannot make a resumed conversation run the call again.
pub trait LedgerJournal: Send + Sync {
    /// Writes `entry` durably. An error is logged; the result is still
    /// used (the side effect already happened).
    fn write<'a>(&'a self, entry: &'a LedgerEntry) -> BoxFuture<'a, Result<(), String>>;
}

/// The policy state of one conversation.
#[derive(Default)]
pub struct PolicyState {
    approvals: Approvals,
    ledger: IdempotencyLedger,
    budgets: TurnBudgets,
    repeats: RepeatCounts,
    journal: Mutex<Option<Arc<dyn LedgerJournal>>>,
}

impl std::fmt::Debug for PolicyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyState")
            .field("approvals", &self.approvals)
            .field("ledger", &self.ledger)
            .field("budgets", &self.budgets)
            .field("repeats", &self.repeats)
            .field("journal", &self.journal().is_some())
            .finish()
    }
}

impl PolicyState {
    /// Empty: no requests, no answers, fresh budgets.
    pub fn new() -> Self {
        Self::default()
    }

    /// A state holding what `snapshot` kept.
    pub fn restored(snapshot: PolicySnapshot, limits: &IdempotencyLimits) -> Self {
        let state = Self::new();
        state.approvals.restore(snapshot.approvals);
        state.ledger.restore(snapshot.ledger, limits);
        state.repeats.restore(snapshot.repeats);
        state
    }

    /// The confirmation requests: list them, approve or deny them.
    pub fn approvals(&self) -> &Approvals {
        &self.approvals
    }

    /// The answered calls.
    pub fn ledger(&self) -> &IdempotencyLedger {
        &self.ledger
    }

    /// The per-leaf budget counters of the current user turn.
    pub fn budgets(&self) -> &TurnBudgets {
        &self.budgets
    }

    /// The identical-call counts of the current user turn (the loop guard).
    pub fn repeats(&self) -> &RepeatCounts {
        &self.repeats
    }

    /// Writes every answered call to `journal` before its result is used.
    pub fn set_journal(&self, journal: Arc<dyn LedgerJournal>) {
        *self.journal.lock().unwrap_or_else(|p| p.into_inner()) = Some(journal);
    }

    /// The journal, if one is set.
    pub fn journal(&self) -> Option<Arc<dyn LedgerJournal>> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Starts a user turn: every leaf's budget counters start over.
    pub fn begin_user_turn(&self) {
        self.budgets.clear();
        self.repeats.clear();
    }

    /// What a snapshot keeps: pending and approved requests, and the ledger.
    pub fn snapshot(&self) -> PolicySnapshot {
        PolicySnapshot {
            approvals: self.approvals.snapshot(),
            ledger: self.ledger.snapshot(),
            repeats: self.repeats.snapshot(),
        }
    }
}

/// The durable part of a [`PolicyState`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySnapshot {
    /// Pending and approved confirmation requests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<ApprovalRecord>,
    /// Answered calls, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger: Vec<LedgerEntry>,
    /// The loop guard's counts of the current user turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats: Vec<RepeatRecord>,
}

impl PolicySnapshot {
    /// Whether there is nothing to keep.
    pub fn is_empty(&self) -> bool {
        self.approvals.is_empty() && self.ledger.is_empty() && self.repeats.is_empty()
    }
}
