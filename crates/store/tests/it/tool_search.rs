//! Tool search, durably: the tools a session found are stored with it, and
//! the session reopened by another worker offers them again.

use std::sync::Arc;

use crate::common::*;
use markov_core::model::Model;
use markov_executor::StandardExecutor;
use markov_policy::{
    Budget, Category, FoundScope, Mode, PolicyConfig, ToolMetadata, ToolRegistry, ToolSearch,
};
use markov_store::{DurableMachine, SessionId, SqliteStore, Store, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn executor(model: Arc<dyn Model>, dir: &Dir) -> StandardExecutor {
    let registry = ToolRegistry::builder(
        PolicyConfig::new(Budget::UNLIMITED)
            .tool_search(ToolSearch::new().scope(FoundScope::Session)),
    )
    .register(Note, ToolMetadata::new(Category::Other))
    .register(
        Pay(dir.path("effects")),
        ToolMetadata::new(Category::Action).deferred(),
    )
    .lock()
    .expect("the registry locks");
    StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)
}

#[tokio::test]
async fn the_tools_a_session_found_are_stored_and_offered_when_it_is_reopened() {
    let dir = Dir::new("tool-search");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let (charter, _) = charter();
    let first = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "pay an amount"}))
            .text("Found a way to pay.")
            .build(),
    );
    let agent = agent_on(&charter, Arc::new(executor(first.clone(), &dir)));
    let mut session = DurableMachine::create(
        store.clone(),
        SessionId::new("found"),
        WorkerId::new("first"),
        agent.machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("find a way to pay");
    session.run().await.expect("runs");
    session.release().await.expect("released");
    let stored = store.load(&SessionId::new("found")).await.expect("loads");
    assert_eq!(
        stored
            .snapshot
            .policy
            .found
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>(),
        ["pay"]
    );

    let second = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 2}))
            .text("Paid.")
            .build(),
    );
    let agent = agent_on(&charter, Arc::new(executor(second.clone(), &dir)));
    let mut session = open_when_free(store, "found", "second", &agent).await;
    session.machine().enqueue_user("pay 2");
    session.run().await.expect("runs");
    assert_eq!(
        second.requests()[0].tool_names(),
        ["updateState", "note", "search_tools", "pay"],
        "offered at once, at the end"
    );
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
}
