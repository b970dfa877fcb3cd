//! Agents as tools, durably: a sub-agent waiting for an approval is stored
//! with the caller's session, and the session reopened by another worker
//! continues it once the request is decided, running nothing twice.

use std::sync::Arc;

use crate::common::*;
use markov_executor::{Agent, YieldReason};
use markov_policy::{Budget, Category, Decision, PolicyConfig, ToolMetadata};
use markov_store::{DurableMachine, SessionId, SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// The assistant, whose `cashier` tool is a sub-agent with `pay`, which
/// needs approval; both answer from scripts.
fn assistant(dir: &Dir, sub: ScriptedModel, caller: ScriptedModel) -> Agent {
    let cashier = Agent::builder("cashier")
        .instructions("You pay.")
        .tool_with(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(sub)
        .build()
        .expect("builds")
        .as_tool("cashier", "Pays.")
        .expect("a valid name");
    Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(cashier) as markov_core::tool::SharedTool])
        .model(caller)
        .build()
        .expect("builds")
}

#[tokio::test]
async fn a_sub_agent_waiting_for_approval_is_stored_with_the_session_and_continued_by_another_worker()
 {
    let dir = Dir::new("sub-agent");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let agent = assistant(
        &dir,
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .build(),
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .build(),
    );
    let mut session = DurableMachine::create(
        store.clone(),
        SessionId::new("sub"),
        WorkerId::new("first"),
        agent.machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("Pay 5.");
    let paused = session.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    let request = paused.approvals[0].request_id.clone();
    assert_eq!(paused.approvals[0].tool, "cashier.pay");
    session.release().await.expect("released");
    assert_eq!(lines(&dir.path("effects")), 0, "nothing paid yet");

    // Another worker, the agents built again: nothing waits in memory.
    let sub = ScriptedModel::builder().text("Paid 5.").build();
    let caller = ScriptedModel::builder().text("Done: paid 5.").build();
    let agent = assistant(&dir, sub, caller);
    let mut session = open_when_free(store, "sub", "second", &agent).await;
    session
        .decide(&request, Decision::Approve)
        .await
        .expect("decided");
    let last = session.resume().await.expect("resumes");
    assert_eq!(last.output().as_deref(), Some("Done: paid 5."));
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
}
