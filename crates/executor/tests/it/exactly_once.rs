//! The snapshot path of exactly-once: an application that keeps its own
//! snapshots (a journal of answers and answered calls, the run state) and
//! resumes a step interrupted while its tools ran answers the recorded
//! calls — never asks the model for new ones — and runs no completed call
//! again.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::Item;
use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{
    Action, Instance, RunOptions, RunState, StandardExecutor, run_leaves, serialize_machine,
};
use markov_policy::{Journal, LedgerEntry, RecordedAnswer};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// What an application's journal kept.
#[derive(Default)]
struct Kept {
    answers: Mutex<Vec<RecordedAnswer>>,
    ledger: Mutex<Vec<LedgerEntry>>,
}

struct AppJournal(Arc<Kept>);

#[async_trait]
impl Journal for AppJournal {
    async fn write(&self, entry: &LedgerEntry) -> Result<(), String> {
        self.0.ledger.lock().expect("lock").push(entry.clone());
        Ok(())
    }

    async fn write_answers(&self, answers: &[RecordedAnswer]) -> Result<(), String> {
        *self.0.answers.lock().expect("lock") = answers.to_vec();
        Ok(())
    }
}

/// Counts its executions.
struct Charge(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Charge {
    const NAME: &'static str = "charge";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Charge the card".into()
    }
    async fn call(&self, _: NoArgs, cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!(
            "charged with key {}",
            cx.idempotency_key().unwrap_or("none")
        ))
    }
}

/// Hangs the first time (the moment the process dies), answers after.
struct HangOnce(Arc<AtomicBool>);

#[async_trait]
impl Tool for HangOnce {
    const NAME: &'static str = "wait";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Wait".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        if !self.0.swap(true, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok("waited".into())
    }
}

fn parts(charges: &Arc<AtomicUsize>, hung: &Arc<AtomicBool>) -> (Charter, Node) {
    let node = Node::builder("Charge cards.")
        .tool(Charge(Arc::clone(charges)))
        .tool(HangOnce(Arc::clone(hung)))
        .build()
        .expect("node");
    let charter = Charter::builder("cards")
        .node("cards", node.clone())
        .build()
        .expect("charter");
    (charter, node)
}

#[tokio::test]
async fn a_restored_snapshot_answers_the_recorded_calls_and_runs_no_completed_one_again() {
    let charges = Arc::new(AtomicUsize::new(0));
    let hung = Arc::new(AtomicBool::new(false));
    let (charter, node) = parts(&charges, &hung);
    let first_model = ScriptedModel::builder()
        .tool_calls([("charge", json!({})), ("wait", json!({}))])
        .build()
        .fresh_call_ids();
    let mut machine = machine_on(
        charter.clone(),
        StandardExecutor::new(first_model),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    let kept = Arc::new(Kept::default());
    machine
        .policy_state()
        .set_journal(Arc::new(AppJournal(Arc::clone(&kept))));
    machine.enqueue_user("charge it");

    // What the application saved before the step: the snapshot, the run.
    let mut state = RunState::new(RunOptions::default());
    let Action::RunLeaves(tasks) = state.next(&mut machine).expect("a step") else {
        panic!("the step runs a leaf");
    };
    let mut saved = serialize_machine(&machine)
        .expect("serializes")
        .into_owned();
    let saved_run = state.clone();
    // The step charges, then hangs; the process dies there.
    let interrupted = tokio::time::timeout(
        Duration::from_millis(300),
        run_leaves(&machine, &state, &tasks),
    )
    .await;
    assert!(interrupted.is_err(), "the step never finished");
    assert_eq!(charges.load(Ordering::SeqCst), 1);
    drop(machine);

    // A fresh process restores the snapshot with what the journal kept.
    saved.policy.answers = kept.answers.lock().expect("lock").clone();
    saved.policy.ledger = kept.ledger.lock().expect("lock").clone();
    assert_eq!(
        saved.policy.answers.len(),
        1,
        "the answer was journaled before its tools ran"
    );
    let recorded: Vec<String> = saved.policy.answers[0]
        .response
        .tool_calls()
        .map(|(id, _, _)| id.to_string())
        .collect();
    let second_model = Arc::new(
        ScriptedModel::builder()
            .text("Charged.")
            .build()
            .fresh_call_ids(),
    );
    let mut restored = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(second_model.clone())),
        saved,
    )
    .expect("restores");
    let mut state = saved_run;
    loop {
        match state.next(&mut restored).expect("steps") {
            Action::RunLeaves(tasks) => {
                let results = run_leaves(&restored, &state, &tasks).await;
                state
                    .on_leaf_results(&mut restored, &tasks, results)
                    .expect("recorded");
            }
            Action::Yield(_) => {}
            _ => break,
        }
    }
    assert_eq!(
        charges.load(Ordering::SeqCst),
        1,
        "the completed charge did not run again"
    );
    assert_eq!(
        second_model.calls(),
        1,
        "the model was asked only after the tools"
    );
    let history = restored.history();
    let ids: Vec<String> = history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|i| match i {
            Item::ToolUse { id, .. } => Some(id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, recorded, "the recorded calls, with their ids");
    assert_paired(history);
    assert_eq!(
        history.last().map(|m| m.text()).as_deref(),
        Some("Charged.")
    );
    assert!(
        restored.policy_state().answers().is_empty(),
        "the answer is forgotten once its step is recorded"
    );
}

#[tokio::test]
async fn a_call_id_reused_in_a_later_step_is_a_new_call_with_its_own_key() {
    use markov_core::model::{ModelResponse, StopReason};
    let charges = Arc::new(AtomicUsize::new(0));
    let hung = Arc::new(AtomicBool::new(true));
    let (charter, node) = parts(&charges, &hung);
    // Some servers number the calls of each answer from zero: the same id
    // in two steps of one turn names two different calls.
    let charge = || {
        ModelResponse::new(
            vec![Item::tool_use("call_0", "charge", json!({}))],
            StopReason::ToolUse,
        )
    };
    let model = ScriptedModel::new([
        charge(),
        charge(),
        markov_testkit::text_response("Charged twice."),
    ]);
    let mut machine = machine_on(
        charter,
        StandardExecutor::new(model),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    machine.enqueue_user("charge me twice");
    machine.run().await.expect("runs");
    assert_eq!(
        charges.load(Ordering::SeqCst),
        2,
        "the model asked twice: the card is charged twice"
    );
    let results = all_results(machine.history());
    assert_eq!(results.len(), 2);
    assert_ne!(
        results[0].1, results[1].1,
        "each call hands the outside world its own idempotency key"
    );
}

/// A step whose at-most-once call hangs after its effect is abandoned there
/// (the process dies); a fresh machine restored from what the
/// application's journal kept answers the call `INTERRUPTED`, names it on
/// a step, and never runs it again.
#[tokio::test]
async fn an_at_most_once_call_interrupted_in_a_journaled_step_is_answered_interrupted_after_a_restore()
 {
    let sent = Arc::new(AtomicUsize::new(0));
    let hung = Arc::new(AtomicBool::new(false));
    let node = Node::builder("Send emails.")
        .tool(SendEmail {
            sent: Arc::clone(&sent),
            hung: Arc::clone(&hung),
        })
        .build()
        .expect("node");
    let charter = Charter::builder("mail")
        .node("mail", node.clone())
        .build()
        .expect("charter");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("send_email", json!({}))
            .text("Not sure it went.")
            .build()
            .fresh_call_ids(),
    );
    let mut machine = machine_on(
        charter.clone(),
        StandardExecutor::shared(model.clone()),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    let kept = Arc::new(Kept::default());
    machine
        .policy_state()
        .set_journal(Arc::new(AppJournal(Arc::clone(&kept))));
    machine.enqueue_user("send it");
    let mut state = RunState::new(RunOptions::default());
    let Action::RunLeaves(tasks) = state.next(&mut machine).expect("a step") else {
        panic!("the step runs a leaf");
    };
    let mut saved = serialize_machine(&machine)
        .expect("serializes")
        .into_owned();
    let saved_run = state.clone();
    let interrupted = tokio::time::timeout(
        Duration::from_millis(300),
        run_leaves(&machine, &state, &tasks),
    )
    .await;
    assert!(interrupted.is_err(), "the step never finished");
    assert_eq!(sent.load(Ordering::SeqCst), 1);

    drop(machine);
    saved.policy.answers = kept.answers.lock().expect("lock").clone();
    saved.policy.ledger = kept.ledger.lock().expect("lock").clone();
    assert!(
        saved.policy.ledger.iter().any(|e| e.started),
        "the start was journaled before the tool ran"
    );
    let mut machine = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(model.clone())),
        saved,
    )
    .expect("restores");
    let mut state = saved_run;
    let mut named = Vec::new();
    loop {
        match state.next(&mut machine).expect("steps") {
            Action::RunLeaves(tasks) => {
                let results = run_leaves(&machine, &state, &tasks).await;
                let step = state
                    .on_leaf_results(&mut machine, &tasks, results)
                    .expect("recorded");
                named.extend(step.interrupted);
            }
            Action::Yield(step) => named.extend(step.interrupted),
            _ => break,
        }
    }
    assert_eq!(
        sent.load(Ordering::SeqCst),
        1,
        "the email was not sent again"
    );
    let history = machine.history();
    assert_paired(history);
    let results: Vec<&str> = history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|i| match i {
            Item::ToolResult { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 1, "one result: {results:?}");
    assert!(results[0].contains("\"INTERRUPTED\""), "{}", results[0]);
    assert_eq!(named.len(), 1, "the call is named to the application");
    assert_eq!(named[0].tool, "send_email");
    assert_eq!(
        model.calls(),
        2,
        "the model was asked once more: after the interrupted result"
    );
}

/// A journal that cannot write the start of an at-most-once call.
struct NoStarts;

#[async_trait]
impl Journal for NoStarts {
    async fn write(&self, entry: &LedgerEntry) -> Result<(), String> {
        if entry.started {
            return Err("the disk is full".into());
        }
        Ok(())
    }

    async fn write_answers(&self, _: &[RecordedAnswer]) -> Result<(), String> {
        Ok(())
    }
}

#[tokio::test]
async fn an_at_most_once_call_whose_start_cannot_be_journaled_does_not_run() {
    let sent = Arc::new(AtomicUsize::new(0));
    let node = Node::builder("Send emails.")
        .tool(SendEmail {
            sent: Arc::clone(&sent),
            hung: Arc::new(AtomicBool::new(true)),
        })
        .build()
        .expect("node");
    let charter = Charter::builder("mail")
        .node("mail", node.clone())
        .build()
        .expect("charter");
    let model = ScriptedModel::builder()
        .tool_call("send_email", json!({}))
        .text("It could not be sent.")
        .build();
    let mut machine = machine_on(
        charter,
        StandardExecutor::new(model),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    machine.policy_state().set_journal(Arc::new(NoStarts));
    machine.enqueue_user("send it");
    let last = machine.run().await.expect("runs");
    assert!(last.done);
    assert_eq!(sent.load(Ordering::SeqCst), 0, "the tool never ran");
    let results: Vec<String> = machine
        .history()
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|i| match i {
            Item::ToolResult { content, .. } => Some(content.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(
        results[0].contains("EXECUTION_FAILED") && results[0].contains("could not be recorded"),
        "{}",
        results[0]
    );
}

/// Charges once its caller says it may: a tool that needs approval.
struct ApprovedCharge;

#[async_trait]
impl Tool for ApprovedCharge {
    const NAME: &'static str = "approved_charge";
    const NEEDS_APPROVAL: bool = true;
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Charge the card, once approved".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok("charged".into())
    }
}

/// Interrupts a machine's first step after `charge` ran and while `wait`
/// hangs, and returns the machine: what the step kept is what a resumed
/// step could replay.
async fn interrupted_after_a_charge(
    calls: Vec<(&'static str, serde_json::Value)>,
    journal: Option<Arc<Kept>>,
) -> (markov_executor::Machine, Arc<AtomicUsize>) {
    let charges = Arc::new(AtomicUsize::new(0));
    let hung = Arc::new(AtomicBool::new(false));
    let node = Node::builder("Charge cards.")
        .tool(Charge(Arc::clone(&charges)))
        .tool(HangOnce(Arc::clone(&hung)))
        .tool(ApprovedCharge)
        .build()
        .expect("node");
    let charter = Charter::builder("cards")
        .node("cards", node.clone())
        .build()
        .expect("charter");
    let model = ScriptedModel::builder().tool_calls(calls).build();
    let mut machine = machine_on(
        charter,
        StandardExecutor::new(model),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    if let Some(kept) = journal {
        machine
            .policy_state()
            .set_journal(Arc::new(AppJournal(kept)));
    }
    machine.enqueue_user("charge it");
    let mut state = RunState::new(RunOptions::default());
    let Action::RunLeaves(tasks) = state.next(&mut machine).expect("a step") else {
        panic!("the step runs a leaf");
    };
    let interrupted = tokio::time::timeout(
        Duration::from_millis(200),
        run_leaves(&machine, &state, &tasks),
    )
    .await;
    assert!(interrupted.is_err(), "the step never finished");
    assert_eq!(charges.load(Ordering::SeqCst), 1, "the charge ran");
    (machine, charges)
}

#[tokio::test]
async fn without_a_journal_an_answer_that_cannot_pause_is_not_recorded_and_its_calls_keep_no_ledger()
 {
    let (machine, _) =
        interrupted_after_a_charge(vec![("charge", json!({})), ("wait", json!({}))], None).await;
    let policy = machine.policy_state();
    assert!(
        policy.answers().is_empty(),
        "nothing can replay the answer: it is not recorded"
    );
    assert!(
        policy.ledger().is_empty(),
        "the completed charge has no ledger entry"
    );
}

#[tokio::test]
async fn an_answer_kept_by_a_journal_or_with_a_call_that_may_pause_is_recorded_with_its_ledger() {
    // A journal keeps it: a restarted process may resume the step.
    let kept = Arc::new(Kept::default());
    let (journaled, _) = interrupted_after_a_charge(
        vec![("charge", json!({})), ("wait", json!({}))],
        Some(Arc::clone(&kept)),
    )
    .await;
    assert_eq!(journaled.policy_state().answers().snapshot().len(), 1);
    assert_eq!(journaled.policy_state().ledger().len(), 1);
    assert_eq!(kept.ledger.lock().expect("lock").len(), 1);

    // No journal, but a call of the answer needs approval: the step may
    // pause and its resumption replays the answer.
    let (pausable, _) = interrupted_after_a_charge(
        vec![
            ("charge", json!({})),
            ("wait", json!({})),
            ("approved_charge", json!({})),
        ],
        None,
    )
    .await;
    assert_eq!(pausable.policy_state().answers().snapshot().len(), 1);
    assert_eq!(
        pausable.policy_state().ledger().len(),
        1,
        "the charge that ran is answered from the ledger on resume"
    );
}

#[tokio::test]
async fn a_call_of_an_unrecorded_answer_gets_the_idempotency_key_a_recorded_one_would() {
    let charges = Arc::new(AtomicUsize::new(0));
    let hung = Arc::new(AtomicBool::new(true));
    let (charter, node) = parts(&charges, &hung);
    let model = ScriptedModel::builder()
        .tool_calls([("charge", json!({}))])
        .text("Charged.")
        .build();
    let mut machine = machine_on(
        charter,
        StandardExecutor::new(model),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    machine.enqueue_user("charge it");
    machine.run().await.expect("the turn runs");
    let (call_id, content) = machine
        .history()
        .iter()
        .flat_map(|m| m.item_list())
        .find_map(|item| match item {
            Item::ToolResult {
                tool_use_id,
                content,
                ..
            } => Some((tool_use_id.clone(), content.clone())),
            _ => None,
        })
        .expect("the charge's result");
    let policy = machine.policy_state();
    let instance = machine.instance().id().clone();
    // The answer was asked over the user's message alone.
    let recorded = policy.tool_key_at(Some(&instance), Some(1), &call_id);
    assert_eq!(
        content,
        format!("charged with key {recorded}"),
        "the key names the answer as a recorded answer's key does"
    );
    assert_ne!(
        recorded,
        policy.tool_key_at(Some(&instance), None, &call_id),
        "a key that did not name the answer would repeat for a reused call id"
    );
}
