//! A session under a context policy keeps its summaries in the store: a
//! reopened session shows the same summary first, and makes no new one.

use std::sync::Arc;

use crate::common::Dir;
use markov_charter::context::{ContextPolicy, Summarize};
use markov_core::{Item, Model};
use markov_executor::{Agent, SUMMARY_PREAMBLE};
use markov_store::{DurableMachine, SessionId, SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::Add;
use serde_json::json;

fn agent(model: Arc<ScriptedModel>, summarizer: Arc<ScriptedModel>) -> Agent {
    let policy = ContextPolicy::builder()
        .summarize(Summarize::new(summarizer as Arc<dyn Model>, 100).keep_last_turns(1))
        .build()
        .expect("a valid policy");
    Agent::builder("calculator")
        .instructions("Add numbers with your tool.")
        .tool(Add)
        .shared_model(model)
        .context_policy(policy)
        .build()
        .expect("the agent builds")
}

fn turns(n: usize) -> ScriptedModel {
    let mut script = ScriptedModel::builder();
    for i in 0..n {
        script = script
            .tool_call("add", json!({"a": i, "b": 1}))
            .text(format!("The sum is {}.", i + 1));
    }
    script.build()
}

#[tokio::test]
async fn a_reopened_session_keeps_its_summary() {
    let dir = Dir::new("context");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("the database opens"));
    let summarizer = Arc::new(ScriptedModel::builder().text("Two sums so far.").build());
    let first = agent(Arc::new(turns(3)), Arc::clone(&summarizer));
    let id = SessionId::new("long");
    let mut session = DurableMachine::create(
        Arc::clone(&store),
        id.clone(),
        WorkerId::new("a"),
        first.machine(),
    )
    .await
    .expect("created");
    for n in 0..3 {
        session.machine().enqueue_user(format!("question {n}"));
        session.run().await.expect("runs");
    }
    assert_eq!(summarizer.calls(), 1, "the threshold was crossed once");
    let kept = session.machine().history().to_vec();
    drop(session.into_machine().await.expect("released"));

    // Another worker, another process's agent: the stored history holds
    // the summary, and the next request shows it first.
    let model = Arc::new(ScriptedModel::builder().text("Done.").build());
    let idle = Arc::new(ScriptedModel::builder().build());
    let second = agent(Arc::clone(&model), Arc::clone(&idle));
    let mut reopened = DurableMachine::open(store, id, WorkerId::new("b"), &second)
        .await
        .expect("opens");
    assert_eq!(reopened.machine().history(), kept.as_slice());
    let summaries: Vec<_> = kept.iter().filter_map(|m| m.as_summary()).collect();
    assert_eq!(summaries.len(), 1);
    assert_eq!(summaries[0].0, "Two sums so far.");
    reopened.machine().enqueue_user("question 3");
    reopened.run().await.expect("runs");
    // The summary is the first text of the first user message kept.
    let request = &model.requests()[0];
    let first = request.messages[0].item_list();
    assert!(
        matches!(first.first(), Some(Item::Text { text }) if *text == format!("{SUMMARY_PREAMBLE}Two sums so far.")),
        "{first:?}"
    );
    assert!(request.messages[0].text().ends_with("question 2"));
    assert_eq!(idle.calls(), 0, "no summary made again");
}
