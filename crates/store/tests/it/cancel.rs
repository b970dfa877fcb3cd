//! Cancelling a durable run: the step in flight ends with one result per
//! call, is stored, and the session takes the next message at once.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_core::Item;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse};
use markov_executor::{CANCELLED_TOOL_CALL, YieldReason};
use markov_store::{DurableMachine, SessionId, Store, WorkerId};
use serde_json::json;

/// Waits (at most ten seconds) until `path` exists.
async fn until_exists(path: &std::path::Path) {
    for _ in 0..1000 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} never appeared", path.display());
}

/// Every tool call in `history` has exactly one result, after it.
fn assert_each_call_answered_once(history: &[markov_core::Message]) {
    let mut open = Vec::new();
    for item in history.iter().flat_map(|m| m.item_list()) {
        match item {
            Item::ToolUse { id, .. } => open.push(id.clone()),
            Item::ToolResult { tool_use_id, .. } => {
                let at = open
                    .iter()
                    .position(|id| id == tool_use_id)
                    .unwrap_or_else(|| panic!("a result without its call: {tool_use_id}"));
                open.remove(at);
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "calls without a result: {open:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cancelled_inside_a_hanging_tool_records_every_call_and_the_session_goes_on() {
    let dir = Dir::new("cancel-tools");
    let store = store(&dir);
    let model = Arc::new(ProviderLike::new(
        vec![vec![("pay", json!({"amount": 2})), ("hang", json!({}))]],
        "Paid 2.",
    ));
    let machine = machine(model.clone(), &dir);
    let id = SessionId::new("cancelled");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    let cancel = session.cancel_token();
    session.machine().enqueue_user("pay 2, then wait");
    let run = tokio::spawn(async move {
        let mut steps = Vec::new();
        let last = session
            .run_each_step(|step| steps.push(step.yield_reason))
            .await;
        (session, steps, last)
    });
    until_exists(&dir.path("marker")).await;
    cancel.cancel();
    let (session, steps, last) = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the cancelled run returns")
        .expect("joins");
    let last = last.expect("a cancelled run is not an error");
    assert_eq!(last.yield_reason, YieldReason::Cancelled);
    assert!(last.done, "the turn is over");
    assert_eq!(steps, [YieldReason::Cancelled], "the step was handed on");

    let history = session.machine().history().to_vec();
    assert_each_call_answered_once(&history);
    let results = tool_results(&history);
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].contains("paid 2"), "{results:?}");
    assert!(results[1].contains(CANCELLED_TOOL_CALL), "{results:?}");
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");

    // What the store holds is that same history, with no run to continue
    // and no answer to replay.
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.history, history);
    assert!(stored.run.is_none(), "no run left in progress");
    assert!(stored.snapshot.policy.answers.is_empty());
    session.release().await.expect("released");

    // Another worker opens it and the conversation goes on, nothing repeated.
    let (charter, _) = charter();
    let agent = agent_on(
        &charter,
        Arc::new(executor(
            model.clone(),
            dir.path("effects"),
            dir.path("marker"),
        )),
    );
    let mut session = open_when_free(store.clone(), "cancelled", "other", &agent).await;
    assert!(!session.is_interrupted());
    session.machine().enqueue_user("what happened?");
    let last = session.run().await.expect("the session runs again");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(last.output().as_deref(), Some("You said: what happened?"));
    let history = session.machine().history();
    assert_each_call_answered_once(history);
    assert_eq!(tool_results(history).len(), 2, "no call ran again");
    assert_eq!(lines(&dir.path("effects")), 1, "still paid once");
}

/// Never answers its first request; answers the others with their last text.
#[derive(Debug, Default)]
struct StuckOnce(std::sync::atomic::AtomicUsize);

#[async_trait::async_trait]
impl Model for StuckOnce {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            std::future::pending::<()>().await;
        }
        let text = request
            .messages()
            .last()
            .map(|m| m.text())
            .unwrap_or_default();
        Ok(markov_testkit::text_response(format!("You said: {text}")))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cancelled_while_the_model_thinks_keeps_the_message_and_answers_the_next() {
    let dir = Dir::new("cancel-model");
    let store = store(&dir);
    let model = Arc::new(StuckOnce::default());
    let machine = machine(model.clone(), &dir);
    let id = SessionId::new("stuck");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    let cancel = session.cancel_token();
    session.machine().enqueue_user("hello?");
    let run = tokio::spawn(async move {
        let last = session.run().await;
        (session, last)
    });
    while model.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cancel.cancel();
    let (mut session, last) = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the cancelled run returns")
        .expect("joins");
    let last = last.expect("a cancelled run is not an error");
    assert_eq!(last.yield_reason, YieldReason::Cancelled);
    let texts: Vec<String> = last.history.iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["hello?"], "the step holds what the run recorded");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.history.len(), 1, "the message is kept");
    assert!(stored.run.is_none());

    // The token of the stopped run is spent: the next run goes through.
    session.machine().enqueue_user("still there?");
    let last = session.run().await.expect("runs");
    assert_eq!(last.output().as_deref(), Some("You said: still there?"));
    assert!(!session.cancel_token().is_cancelled());
}

#[tokio::test]
async fn a_token_cancelled_between_runs_stops_the_next_before_its_model_call() {
    let dir = Dir::new("cancel-early");
    let store = store(&dir);
    let model = Arc::new(ProviderLike::new(Vec::new(), "unused"));
    let machine = machine(model.clone(), &dir);
    let mut session = DurableMachine::create(
        store.clone(),
        SessionId::new("early"),
        WorkerId::new("w"),
        machine,
    )
    .await
    .expect("created");
    session.cancel_token().cancel();
    session.machine().enqueue_user("hi");
    let last = session.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::Cancelled);
    assert_eq!(model.served(), 0, "no model call");
    session.machine().enqueue_user("hi again");
    let last = session.run().await.expect("runs");
    assert_eq!(
        last.output().as_deref(),
        Some("You said: hi again"),
        "the next run is not stopped"
    );
    assert_eq!(model.served(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_run_stops_after_its_stored_step_and_another_worker_continues_it() {
    let dir = Dir::new("interrupt");
    let store = store(&dir);
    let model = Arc::new(ProviderLike::new(
        vec![
            vec![("note", json!({}))],
            vec![("pay", json!({"amount": 4}))],
        ],
        "Paid 4.",
    ));
    let machine = machine(model.clone(), &dir);
    let id = SessionId::new("interrupted");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    let shutdown = tokio_util::sync::CancellationToken::new();
    session.interrupt_when(shutdown.clone());
    session.machine().enqueue_user("note, then pay 4");
    let last = session
        .run_each_step(|_| shutdown.cancel())
        .await
        .expect("an interrupted run is not an error");
    assert_eq!(
        last.yield_reason,
        YieldReason::ToolUse,
        "after its first step"
    );
    assert!(session.is_interrupted());
    assert_eq!(lines(&dir.path("effects")), 0, "nothing paid yet");
    assert!(
        store.load(&id).await.expect("loads").run.is_some(),
        "stored as in progress"
    );
    session.release().await.expect("released");

    let (charter, _) = charter();
    let agent = agent_on(
        &charter,
        Arc::new(executor(
            model.clone(),
            dir.path("effects"),
            dir.path("marker"),
        )),
    );
    let claimed = store
        .claim_interrupted(&WorkerId::new("other"), Duration::from_secs(60))
        .await
        .expect("claims")
        .expect("the interrupted run is there to claim");
    assert_eq!(claimed.session, id);
    let mut session = open_when_free(store.clone(), "interrupted", "other", &agent).await;
    assert!(session.is_interrupted());
    let last = session.run().await.expect("continues");
    assert_eq!(last.output().as_deref(), Some("Paid 4."));
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    assert_each_call_answered_once(session.machine().history());
}
