//! [`PolicyState`]: what one conversation keeps between tool calls — its
//! identity, its user-turn count, its confirmation requests, its
//! idempotency ledger and its per-turn budget and loop-guard counters — and
//! [`PolicySnapshot`], the part of it a snapshot keeps.
//!
//! A registry is shared by many conversations; this state is not. A machine
//! owns one (`Machine::policy_state`), hands it to every tool call, writes
//! it into its snapshot and reads it back, so approvals and answered calls
//! survive a restart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use markov_core::async_trait;
use serde::{Deserialize, Serialize};

use markov_core::ids::{InstanceId, ToolCallId};
use sha2::{Digest, Sha256};

use crate::answers::{PendingAnswers, RecordedAnswer};
use crate::approvals::{ApprovalRecord, Approvals};
use crate::ledger::{IdempotencyLedger, IdempotencyLimits, InterruptedCall, LedgerEntry};
use crate::repeat::{RepeatCounts, RepeatRecord};
use crate::search::{FoundScope, FoundTool, MAX_FOUND};
use crate::turn::{BudgetRecord, TurnBudgets};

/// Where a conversation writes, ahead of their use, the model's answers
/// before their tools run and the answered calls before their results are
/// used: a store implements it so that a crash between a tool's side effect
/// and the step's commit cannot make a resumed conversation run the call
/// again, nor ask the model for new calls.
///
/// Implemented with `#[async_trait]` (`markov_core::async_trait`), like
/// every markov trait with async methods.
#[async_trait]
pub trait Journal: Send + Sync {
    /// Writes `entry` durably. An error is logged; the result is still
    /// used (the side effect already happened).
    async fn write(&self, entry: &LedgerEntry) -> Result<(), String>;

    /// Whether a call may start now: `Err` with the reason when the
    /// conversation's writer has lost the right to write it (a store's
    /// lease taken by another worker), so that nothing more runs here. The
    /// default allows every call.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    /// Writes the answers of the step in flight durably (all of them: the
    /// last write replaces the earlier ones). Called before any tool of the
    /// newest answer runs; an error keeps those tools from running.
    async fn write_answers(&self, answers: &[RecordedAnswer]) -> Result<(), String>;

    /// Keeps `step`, a step of a sub-agent run by the call `calls[0]` of
    /// the step in flight (nested in it through the rest of `calls`), for
    /// that step's trace (see
    /// [`CallJournal::keep_step`](markov_core::tool::CallJournal::keep_step)).
    /// The default keeps nothing.
    fn keep_step(&self, calls: &[ToolCallId], step: serde_json::Value) {
        let _ = (calls, step);
    }
}

/// The policy state of one conversation.
pub struct PolicyState {
    /// A random id, kept by snapshots: what makes the keys handed to tools
    /// unique across conversations.
    conversation: String,
    /// User turns begun so far.
    turn: AtomicU64,
    approvals: Approvals,
    ledger: IdempotencyLedger,
    budgets: TurnBudgets,
    repeats: RepeatCounts,
    answers: PendingAnswers,
    journal: Mutex<Option<Arc<dyn Journal>>>,
    /// Decides each call before it runs, when set (a replay).
    call_gate: Mutex<Option<Arc<dyn CallGate>>>,
    /// Whether `call_gate` was ever set: a call of a conversation without
    /// a gate reads this flag rather than taking the lock.
    gated: AtomicBool,
    /// At-most-once calls answered `INTERRUPTED` since the application
    /// last took them.
    interrupted: Mutex<Vec<InterruptedCall>>,
    /// The deferred tools `search_tools` found, in the order found.
    found: Mutex<Arc<[FoundTool]>>,
}

impl std::fmt::Debug for PolicyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyState")
            .field("conversation", &self.conversation)
            .field("turn", &self.turn())
            .field("approvals", &self.approvals)
            .field("ledger", &self.ledger)
            .field("budgets", &self.budgets)
            .field("repeats", &self.repeats)
            .field("answers", &self.answers)
            .field("journal", &self.journal().is_some())
            .field("found", &self.found())
            .finish()
    }
}

impl Default for PolicyState {
    fn default() -> Self {
        PolicyState {
            conversation: uuid::Uuid::new_v4().simple().to_string(),
            turn: AtomicU64::new(0),
            approvals: Approvals::default(),
            ledger: IdempotencyLedger::default(),
            budgets: TurnBudgets::default(),
            repeats: RepeatCounts::default(),
            answers: PendingAnswers::default(),
            journal: Mutex::new(None),
            call_gate: Mutex::new(None),
            gated: AtomicBool::new(false),
            interrupted: Mutex::new(Vec::new()),
            found: Mutex::new(Arc::from([])),
        }
    }
}

impl PolicyState {
    /// Empty: a new conversation id, no requests, no answers, fresh budgets.
    pub fn new() -> Self {
        Self::default()
    }

    /// A state holding what `snapshot` kept (a snapshot without a
    /// conversation id gets a new one).
    pub fn restored(mut snapshot: PolicySnapshot, limits: &IdempotencyLimits) -> Self {
        // Only the calls of answers still to be replayed can be asked for
        // again (a store may hold the answered calls of steps it has since
        // recorded, and every kept key names the current turn).
        snapshot.retain_replayable();
        let mut state = Self::new();
        if let Some(conversation) = snapshot.conversation {
            state.conversation = conversation;
        }
        state.turn = AtomicU64::new(snapshot.turn);
        state.approvals.restore(snapshot.approvals);
        state.ledger.restore(snapshot.ledger, limits, snapshot.turn);
        state.repeats.restore(snapshot.repeats);
        state.budgets.restore(snapshot.budgets);
        state.answers.restore(snapshot.answers);
        *state.found.get_mut().unwrap_or_else(|p| p.into_inner()) =
            snapshot.found.into_iter().take(MAX_FOUND).collect();
        // A paused call's request lives as long as its paused answer: one
        // without it (a repaired session) can never be resumed.
        let paused = state.answers.paused();
        state.approvals.forget_held(|i| paused.contains(i));
        state
    }

    /// Empty, as [`new`](Self::new), with the conversation id
    /// `conversation` (a sub-agent's, derived from the call that runs it,
    /// so that the keys its tools hand out are the same when it runs
    /// again).
    pub fn with_conversation(conversation: impl Into<String>) -> Self {
        PolicyState {
            conversation: conversation.into(),
            ..Self::default()
        }
    }

    /// Seeds what an earlier run of this conversation recorded and nothing
    /// else keeps (a sub-agent run again after a crash): its model's
    /// answers, each replayed by the step that asks for it again
    /// ([`PendingAnswers::seed`]), and its answered calls, each answered
    /// from the ledger when it is made again
    /// ([`IdempotencyLedger::seed`]).
    ///
    /// Only the answered calls (and the records) of calls made by these
    /// answers, or by the answers still to be replayed here, are seeded:
    /// no other call can ask for them, and a provider that reuses a call
    /// id in a later step must not find an earlier call's result.
    pub fn seed(&self, mut entries: Vec<LedgerEntry>, answers: Vec<RecordedAnswer>) {
        if !entries.is_empty() {
            let mut relevant = self.answers.snapshot();
            relevant.extend(answers.iter().cloned());
            let calls = calls_of(&relevant);
            entries.retain(|entry| {
                // The key without its turn: the seeds' turn is the one the
                // answers were asked in, which this state may not have
                // begun yet.
                let key = entry.key.split_once(':').map_or("", |(_, rest)| rest);
                crate::ledger::kept_by(&calls, key, entry.record.is_some())
            });
            self.ledger.seed(entries);
        }
        if !answers.is_empty() {
            self.answers.seed(answers);
        }
    }

    /// The model's answers of the step in flight whose tools may have
    /// started.
    pub fn answers(&self) -> &PendingAnswers {
        &self.answers
    }

    /// Records `answer` before any of its tools runs: in memory, then
    /// through the journal when one is set. `Err` (the journal failed)
    /// means the tools must not run: nothing durable says they were asked
    /// for.
    pub async fn record_answer(&self, answer: RecordedAnswer) -> Result<(), String> {
        self.answers.push(answer);
        let Some(journal) = self.journal() else {
            return Ok(());
        };
        let _writing = self.answers.writing.lock().await;
        let answers = self.answers.snapshot();
        journal.write_answers(&answers).await
    }

    /// The conversation's id.
    pub fn conversation(&self) -> &str {
        &self.conversation
    }

    /// The user turns begun so far (0 before the first).
    pub fn turn(&self) -> u64 {
        self.turn.load(Ordering::Acquire)
    }

    /// The key a call hands to the outside world (a payment provider's
    /// idempotency header): the hex SHA-256 of the conversation, the user
    /// turn, the instance, the answer that made the call (the length of the
    /// history it was asked over, which a replay of that answer keeps) and
    /// the call id. It is the same on every retry and resume of that call,
    /// and different for any other call, even one whose provider reused the
    /// id in a later step.
    pub fn tool_key(&self, instance: Option<&InstanceId>, call_id: &ToolCallId) -> String {
        let answer = self
            .answers
            .snapshot()
            .iter()
            .find(|answer| Some(&answer.instance) == instance)
            .map(|answer| answer.history_len);
        self.tool_key_at(instance, answer, call_id)
    }

    /// [`tool_key`](Self::tool_key) of a call made by the answer asked over
    /// a history of `answer` messages (`None`: no answer is recorded for
    /// the instance), for a call whose answer was not recorded because
    /// nothing can replay it: the same key it would have had.
    pub fn tool_key_at(
        &self,
        instance: Option<&InstanceId>,
        answer: Option<u64>,
        call_id: &ToolCallId,
    ) -> String {
        let answer = answer.map_or_else(String::new, |len| len.to_string());
        let mut hasher = Sha256::new();
        for part in [
            "markov-tool-call",
            &self.conversation,
            &self.turn().to_string(),
            instance.map_or("", InstanceId::as_str),
            &answer,
            call_id.as_str(),
        ] {
            hasher.update(part.as_bytes());
            // A separator no part can contain in this position, so two
            // different lists of parts never hash alike.
            hasher.update([0u8]);
        }
        markov_core::ids::hex(&hasher.finalize())
    }

    /// The deferred tools found by `search_tools` and still offered, in the
    /// order found (the order they are offered in, after every other tool).
    pub fn found(&self) -> Arc<[FoundTool]> {
        Arc::clone(&self.found.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Records that `names` were found, to be offered for `scope`: a name
    /// found already keeps its place (and takes the longer scope). Beyond
    /// the most a conversation keeps, the oldest are dropped, with a log
    /// line.
    pub fn note_found(&self, names: impl IntoIterator<Item = String>, scope: FoundScope) {
        let mut found = self.found.lock().unwrap_or_else(|p| p.into_inner());
        let mut list = found.to_vec();
        let before = list.clone();
        for name in names {
            match list.iter_mut().find(|f| f.name == name) {
                Some(f) => {
                    if scope == FoundScope::Session {
                        f.scope = FoundScope::Session;
                    }
                }
                None => list.push(FoundTool { name, scope }),
            }
        }
        if list.len() > MAX_FOUND {
            let dropped = list.len() - MAX_FOUND;
            tracing::warn!(
                dropped,
                kept = MAX_FOUND,
                "found tools: the oldest are no longer offered"
            );
            list.drain(..dropped);
        }
        if list != before {
            *found = list.into();
        }
    }

    /// The confirmation requests: list them, decide them.
    pub fn approvals(&self) -> &Approvals {
        &self.approvals
    }

    /// Whether a step of this conversation ended with calls waiting for the
    /// application's approval, and waits to be resumed.
    pub fn is_paused(&self) -> bool {
        !self.answers.paused().is_empty()
    }

    /// Called once a step is recorded: the answers it replayed or recorded
    /// are forgotten, but those still paused; so are the requests of the
    /// paused calls it answered.
    pub fn settle_step(&self) {
        self.answers.settle();
        // The step's results are in the history now: its answered calls are
        // never asked for again, but those of a paused answer are. (A step
        // whose calls kept no ledger entries has nothing to sort out.)
        if !self.ledger.is_empty() {
            self.ledger.retain_only(&self.replayable_keys());
        }
        let paused = self.answers.paused();
        self.approvals
            .forget_held(|instance| paused.contains(instance));
    }

    /// The ledger keys of the calls of the answers still to be replayed.
    fn replayable_keys(&self) -> HashSet<String> {
        replayable_keys(self.turn(), &self.answers.snapshot())
    }

    /// Forgets the paused answer of `instance` and the requests of its
    /// calls (the leaf is gone: nothing can resume it).
    pub fn abandon_paused(&self, instance: &InstanceId) {
        self.answers.forget(instance);
        let paused = self.answers.paused();
        self.approvals.forget_held(|i| paused.contains(i));
    }

    /// The arguments the application approved for the paused call
    /// `call_id` of `tool` made by `instance` in the current user turn,
    /// when it edited them.
    pub fn edited_args(
        &self,
        instance: &InstanceId,
        call_id: &ToolCallId,
        tool: &str,
    ) -> Option<serde_json::Value> {
        let key = IdempotencyLedger::key_of(self.turn(), Some(instance), call_id);
        self.approvals.edited_args(&key, tool)
    }

    /// The budget and loop-guard counters of `leaf`, to put back with
    /// [`rewind_leaf`](Self::rewind_leaf) when its step pauses: resuming
    /// replays the step's calls, and they must not count twice.
    pub fn mark_leaf(&self, leaf: &InstanceId) -> LeafMark {
        LeafMark {
            leaf: leaf.clone(),
            budget: self.budgets.mark(leaf),
            repeats: self.repeats.mark(leaf),
        }
    }

    /// Puts back the counters of a leaf as [`mark_leaf`](Self::mark_leaf)
    /// took them.
    pub fn rewind_leaf(&self, mark: LeafMark) {
        self.budgets.for_leaf(&mark.leaf).rewind(mark.budget);
        self.repeats.rewind(&mark.leaf, mark.repeats);
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
    pub fn set_journal(&self, journal: Arc<dyn Journal>) {
        *self.journal.lock().unwrap_or_else(|p| p.into_inner()) = Some(journal);
    }

    /// Sets the gate every tool call of this conversation passes before it
    /// runs (a replay answering calls from a recording).
    pub fn set_call_gate(&self, gate: Arc<dyn CallGate>) {
        *self.call_gate.lock().unwrap_or_else(|p| p.into_inner()) = Some(gate);
        self.gated.store(true, Ordering::Release);
    }

    /// The gate set by [`set_call_gate`](Self::set_call_gate), if any.
    pub fn call_gate(&self) -> Option<Arc<dyn CallGate>> {
        if !self.gated.load(Ordering::Acquire) {
            return None;
        }
        self.call_gate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Removes the journal: answers and answered calls are kept in memory
    /// only from now on (a machine taken out of a store's hands).
    pub fn clear_journal(&self) {
        *self.journal.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Takes the at-most-once calls answered `INTERRUPTED` since the last
    /// take, oldest first: calls that started and whose result was never
    /// recorded, which were not run again. A machine puts them in its next
    /// step (`MachineStep::interrupted`), for a person to reconcile.
    pub fn take_interrupted(&self) -> Vec<InterruptedCall> {
        std::mem::take(&mut *self.interrupted.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Records a call answered `INTERRUPTED`.
    pub(crate) fn note_interrupted(&self, call: InterruptedCall) {
        self.interrupted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(call);
    }

    /// The journal, if one is set.
    pub fn journal(&self) -> Option<Arc<dyn Journal>> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Starts a user turn: the turn count goes up, every leaf's budget and
    /// loop-guard counters start over, and the ledger forgets the earlier
    /// turns' answers.
    pub fn begin_user_turn(&self) {
        let turn = self.turn.fetch_add(1, Ordering::AcqRel) + 1;
        self.budgets.clear();
        self.repeats.clear();
        // The ledger's keys name their turn: the earlier turns' answers can
        // never be matched again, so they are not kept (nor stored).
        self.ledger.forget_before(turn);
        // Tools found for the turn are no longer offered.
        let mut found = self.found.lock().unwrap_or_else(|p| p.into_inner());
        if found.iter().any(|f| f.scope == FoundScope::Turn) {
            *found = found
                .iter()
                .filter(|f| f.scope == FoundScope::Session)
                .cloned()
                .collect();
        }
    }

    /// The counters a store rewrites when they change: the conversation,
    /// its turn, and the current turn's budget counters.
    pub fn counters(&self) -> PolicyCounters {
        PolicyCounters {
            conversation: Some(self.conversation.clone()),
            turn: self.turn(),
            budgets: self.budgets.snapshot(),
            found: self.found().to_vec(),
        }
    }

    /// What a snapshot keeps: the conversation and its turn, pending and
    /// approved requests, the ledger and the current turn's counters.
    pub fn snapshot(&self) -> PolicySnapshot {
        PolicySnapshot {
            conversation: Some(self.conversation.clone()),
            turn: self.turn(),
            approvals: self.approvals.snapshot(),
            ledger: self.ledger.snapshot(),
            repeats: self.repeats.snapshot(),
            budgets: self.budgets.snapshot(),
            answers: self.answers.snapshot(),
            found: self.found().to_vec(),
        }
    }
}

/// The calls `answers` made, as `<instance>:<call id>` (a ledger key
/// without its turn), and their namespaces.
fn calls_of(answers: &[RecordedAnswer]) -> HashSet<String> {
    answers
        .iter()
        .flat_map(|answer| {
            answer.response.tool_calls().flat_map(|(id, _, _)| {
                let call = format!("{}:{id}", answer.instance);
                let namespace = IdempotencyLedger::namespace_of(&call, Some(answer.history_len));
                [call, namespace]
            })
        })
        .collect()
}

/// The ledger keys of the calls `answers` made in user turn `turn`, and
/// their namespaces (the records they kept): the only answered calls and
/// records a replay can ask for again.
fn replayable_keys(turn: u64, answers: &[RecordedAnswer]) -> HashSet<String> {
    answers
        .iter()
        .flat_map(|answer| {
            answer.response.tool_calls().flat_map(|(id, _, _)| {
                let key = IdempotencyLedger::key_of(turn, Some(&answer.instance), id);
                let namespace = IdempotencyLedger::namespace_of(&key, Some(answer.history_len));
                [key, namespace]
            })
        })
        .collect()
}

impl PolicySnapshot {
    /// Drops the answered calls no replay can ask for: those not made by
    /// one of [`answers`](Self::answers) (a paused step's, or the step in
    /// flight's). A store may still hold the answered calls of steps it
    /// has since recorded; read back, they are dropped as a machine drops
    /// them when a step is recorded.
    pub fn retain_replayable(&mut self) {
        let keep = replayable_keys(self.turn, &self.answers);
        self.ledger
            .retain(|entry| crate::ledger::kept_by(&keep, &entry.key, entry.record.is_some()));
    }
}

/// One leaf's budget and loop-guard counters at a point of its step (see
/// [`PolicyState::mark_leaf`]).
#[derive(Debug, Clone)]
pub struct LeafMark {
    leaf: InstanceId,
    budget: (u32, [u32; 3]),
    repeats: Vec<((String, u64), (u32, u32))>,
}

/// The small, often rewritten part of a [`PolicySnapshot`]: the
/// conversation's identity, its turn and the current turn's budgets.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicyCounters {
    /// The conversation's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
    /// User turns begun so far.
    #[serde(default)]
    pub turn: u64,
    /// The budget counters of the current user turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetRecord>,
    /// The deferred tools found and still offered, in the order found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub found: Vec<FoundTool>,
}

/// The durable part of a [`PolicyState`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySnapshot {
    /// The conversation's id (new when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
    /// User turns begun so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub turn: u64,
    /// Pending and approved confirmation requests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<ApprovalRecord>,
    /// Answered calls, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger: Vec<LedgerEntry>,
    /// The loop guard's counts of the current user turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats: Vec<RepeatRecord>,
    /// The budget counters of the current user turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetRecord>,
    /// The model's answers of a step in flight whose tools may have
    /// started (replayed, not asked again, when the step is resumed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<RecordedAnswer>,
    /// The deferred tools found and still offered, in the order found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub found: Vec<FoundTool>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl PolicySnapshot {
    /// Whether there is nothing to keep.
    pub fn is_empty(&self) -> bool {
        self.conversation.is_none()
            && self.turn == 0
            && self.approvals.is_empty()
            && self.ledger.is_empty()
            && self.repeats.is_empty()
            && self.budgets.is_empty()
            && self.answers.is_empty()
            && self.found.is_empty()
    }

    /// The counters part.
    pub fn counters(&self) -> PolicyCounters {
        PolicyCounters {
            conversation: self.conversation.clone(),
            turn: self.turn,
            budgets: self.budgets.clone(),
            found: self.found.clone(),
        }
    }
}

/// What a [`CallGate`] decided about one tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallDecision {
    /// The tool runs.
    Run,
    /// The call is answered with this result; the tool does not run.
    Answer {
        /// The text the model sees.
        content: String,
        /// Whether the result is an error.
        is_error: bool,
        /// State patches written for the call, in order, to the state the
        /// tool would have written (a recorded call's own, played back).
        state_updates: Vec<serde_json::Value>,
    },
}

/// Decides each tool call of a conversation before its tool runs: lets it
/// run, or answers it without running the tool (a replay answers calls
/// from the recording and refuses ones with effects).
pub trait CallGate: Send + Sync + std::fmt::Debug {
    /// The decision on a call of `tool` with `args`; `metadata` is the
    /// registry's facts about the tool (`None` for a tool the registry
    /// does not register, such as a node's own), `delivery` the delivery
    /// contract the tool states (the registry's, else its definition's,
    /// else at most once for a tool that needs approval; `None` when it
    /// states none).
    fn decide(
        &self,
        tool: &str,
        args: &serde_json::Value,
        metadata: Option<&crate::ToolMetadata>,
        delivery: Option<markov_core::tool::Delivery>,
    ) -> CallDecision;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::StoredResult;
    use markov_core::model::{ModelResponse, StopReason};

    fn entry(key: &str) -> LedgerEntry {
        LedgerEntry {
            key: key.into(),
            tool: "pay".into(),
            args: serde_json::json!({}),
            result: StoredResult {
                content: "paid".into(),
                is_error: false,
                is_terminal: false,
                terminate: None,
                user_message: None,
            },
            error: None,
            intents: Vec::new(),
            recorded_at: 0,
            turn: 1,
            args_digest: None,
            state_updates: Vec::new(),
            started: false,
            record: None,
        }
    }

    #[test]
    fn only_the_calls_of_seeded_answers_are_seeded() {
        let mut with_record = entry("t1:root:c1@1>answer:x:1");
        with_record.record = Some(serde_json::json!(1));
        let mut stale = entry("t1:root:c1@7>answer:x:1");
        stale.record = Some(serde_json::json!(7));
        let state = PolicyState::new();
        state.seed(
            vec![entry("t1:root:c1"), with_record, entry("t1:root:c0"), stale],
            vec![RecordedAnswer {
                instance: InstanceId::from("root"),
                history_len: 1,
                response: ModelResponse::new(
                    vec![markov_core::Item::tool_use(
                        "c1",
                        "pay",
                        serde_json::json!({}),
                    )],
                    StopReason::ToolUse,
                ),
                paused: false,
            }],
        );
        assert_eq!(
            state.ledger().records_under("t1:root:c1@1"),
            [("answer:x:1".to_owned(), serde_json::json!(1))]
        );
        assert!(state.ledger().records_under("t1:root:c1@7").is_empty());
        let limits = IdempotencyLimits::default();
        let now = std::time::SystemTime::now();
        let args = serde_json::json!({});
        assert!(matches!(
            state
                .ledger()
                .begin("t1:root:c1", "pay", &args, &limits, now, 1),
            crate::ledger::Begin::Replay(_)
        ));
        assert!(
            matches!(
                state
                    .ledger()
                    .begin("t1:root:c0", "pay", &args, &limits, now, 1),
                crate::ledger::Begin::Run(_)
            ),
            "a call no seeded answer made is not answered from the seeds"
        );
    }
}
