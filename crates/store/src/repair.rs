//! Repairing a session whose stored data does not read back: what
//! [`Store::repair`](crate::Store::repair) keeps and drops, decided once for
//! every backend from the session's raw columns and rows.

#[cfg(any(feature = "sqlite", feature = "postgres"))]
use std::collections::HashSet;

#[cfg(any(feature = "sqlite", feature = "postgres"))]
use markov_core::message::{Item, Items};

use crate::SessionId;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use crate::{StoreError, message_from_json};

/// What a repair changed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RepairReport {
    /// The session.
    pub session: SessionId,
    /// Messages kept, from the first.
    pub messages_kept: u64,
    /// Messages dropped from the end of the history.
    pub messages_dropped: u64,
    /// The first message that did not read back, by position, with why.
    pub first_unreadable: Option<(u64, String)>,
    /// Ledger entries that did not read back and were dropped.
    pub ledger_dropped: u64,
    /// The parts that did not read back (or no longer fit the cut history)
    /// and were reset: "approvals", "loop guard counts", "counters", "usage",
    /// "answers", "run state".
    pub reset: Vec<&'static str>,
}

impl RepairReport {
    /// Whether the session was left as it was.
    pub fn is_clean(&self) -> bool {
        self.messages_dropped == 0 && self.ledger_dropped == 0 && self.reset.is_empty()
    }
}

impl std::fmt::Display for RepairReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_clean() {
            return write!(f, "session {} reads back: nothing to repair", self.session);
        }
        write!(
            f,
            "session {}: kept {} messages, dropped {}",
            self.session, self.messages_kept, self.messages_dropped
        )?;
        if let Some((at, why)) = &self.first_unreadable {
            write!(f, " (message {at} did not read back: {why})")?;
        }
        if self.ledger_dropped > 0 {
            write!(
                f,
                "; dropped {} unreadable ledger entries",
                self.ledger_dropped
            )?;
        }
        if !self.reset.is_empty() {
            write!(f, "; reset {}", self.reset.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// A session's stored data, as text.
#[derive(Debug)]
pub(crate) struct RawSession {
    pub(crate) tree: String,
    pub(crate) approvals: String,
    pub(crate) repeats: String,
    pub(crate) counters: String,
    pub(crate) answers: Option<String>,
    /// What the session used; `None` for one stored before it was kept.
    pub(crate) usage: Option<String>,
    pub(crate) run: Option<String>,
    /// Message bodies in order.
    pub(crate) messages: Vec<String>,
    /// Ledger entries: key and body.
    pub(crate) ledger: Vec<(String, String)>,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// What a backend must change.
#[derive(Debug)]
pub(crate) struct RepairPlan {
    pub(crate) report: RepairReport,
    /// Messages to keep (a prefix of the history).
    pub(crate) keep_messages: usize,
    /// Ledger keys to delete.
    pub(crate) drop_ledger: Vec<String>,
    pub(crate) reset_approvals: bool,
    pub(crate) reset_repeats: bool,
    pub(crate) reset_counters: bool,
    pub(crate) clear_answers: bool,
    pub(crate) clear_run: bool,
    pub(crate) clear_usage: bool,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn reads<T: serde::de::DeserializeOwned>(text: &str) -> bool {
    serde_json::from_str::<T>(text).is_ok()
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// Decides the repair of `raw`. A tree that does not read back cannot be
/// repaired (nothing else says where the conversation is).
pub(crate) fn plan(id: &SessionId, raw: &RawSession) -> Result<RepairPlan, StoreError> {
    use markov_policy::{
        ApprovalRecord, LedgerEntry, PolicyCounters, RecordedAnswer, RepeatRecord,
    };
    if !reads::<markov_executor::SerializedInstance>(&raw.tree) {
        return Err(StoreError::Corrupt {
            session: id.clone(),
            detail: "the instance tree does not read back and cannot be repaired".into(),
        });
    }
    let mut report = RepairReport {
        session: id.clone(),
        messages_kept: 0,
        messages_dropped: 0,
        first_unreadable: None,
        ledger_dropped: 0,
        reset: Vec::new(),
    };
    // The longest readable prefix, then back to the last point where every
    // tool call has its result: a history a provider accepts.
    let mut open_calls: HashSet<String> = HashSet::new();
    let mut keep = 0;
    for (at, body) in raw.messages.iter().enumerate() {
        let message = match message_from_json(id, body) {
            Ok(message) => message,
            Err(e) => {
                let detail = match e {
                    StoreError::Corrupt { detail, .. } => detail,
                    other => other.to_string(),
                };
                report.first_unreadable = Some((at as u64, detail));
                break;
            }
        };
        if let Items::List(items) = &message.items {
            for item in items {
                match item {
                    Item::ToolUse { id, .. } => {
                        open_calls.insert(id.to_string());
                    }
                    Item::ToolResult { tool_use_id, .. } => {
                        open_calls.remove(tool_use_id.as_str());
                    }
                    _ => {}
                }
            }
        }
        if open_calls.is_empty() {
            keep = at + 1;
        }
    }
    let cut = keep < raw.messages.len();
    report.messages_kept = keep as u64;
    report.messages_dropped = (raw.messages.len() - keep) as u64;
    let drop_ledger: Vec<String> = raw
        .ledger
        .iter()
        .filter(|(_, body)| !reads::<LedgerEntry>(body))
        .map(|(key, _)| key.clone())
        .collect();
    report.ledger_dropped = drop_ledger.len() as u64;
    let reset_approvals = !reads::<Vec<ApprovalRecord>>(&raw.approvals);
    let reset_repeats = !reads::<Vec<RepeatRecord>>(&raw.repeats);
    let reset_counters = !reads::<PolicyCounters>(&raw.counters);
    let answers_bad = raw
        .answers
        .as_deref()
        .is_some_and(|a| !reads::<Vec<RecordedAnswer>>(a));
    let run_bad = raw
        .run
        .as_deref()
        .is_some_and(|r| !reads::<markov_executor::RunState>(r));
    // Answers and a run in progress belong to the history as it was: once
    // it is cut, they no longer fit it.
    let clear_answers = answers_bad || (cut && raw.answers.is_some());
    let clear_run = run_bad || (cut && raw.run.is_some());
    let clear_usage = raw
        .usage
        .as_deref()
        .is_some_and(|u| !reads::<markov_context::UsageTotals>(u));
    for (reset, name) in [
        (reset_approvals, "approvals"),
        (reset_repeats, "loop guard counts"),
        (reset_counters, "counters"),
        (clear_answers, "answers"),
        (clear_run, "run state"),
        (clear_usage, "usage"),
    ] {
        if reset {
            report.reset.push(name);
        }
    }
    Ok(RepairPlan {
        report,
        keep_messages: keep,
        drop_ledger,
        reset_approvals,
        reset_repeats,
        reset_counters,
        clear_answers,
        clear_run,
        clear_usage,
    })
}
