//! Dropping a run mid-step, or enqueueing while tools run, never separates a
//! tool call from its result.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::async_trait;
use markov_core::message::Message;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Instance, Machine, RunOptions, StandardExecutor, run_to_completion};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::Hang;
use serde_json::json;

/// A tool that takes a little while.
struct Slow;

#[async_trait]
impl Tool for Slow {
    const NAME: &'static str = "slow";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Sleeps briefly".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok("slept".into())
    }
}

fn streaming_machine(model: ScriptedModel) -> Machine {
    let node = Node::builder("Tools.")
        .tool(Hang)
        .tool(Slow)
        .build()
        .expect("node");
    let charter = Charter::builder("t").build().expect("charter");
    let executor = StandardExecutor::new(model).with_streaming(|_| {});
    machine_on(charter, executor, Instance::new(node, json!({}))).expect("machine")
}

fn everything(m: &Machine) -> Vec<Message> {
    let mut all = m.history().to_vec();
    all.extend(m.queue().messages());
    all
}

#[tokio::test]
async fn a_run_dropped_while_tools_run_leaves_no_unanswered_call() {
    let model = ScriptedModel::builder()
        .tool_call("hang", json!({}))
        .text("never")
        .build();
    let mut m = streaming_machine(model);
    m.enqueue_user("go");
    let timed_out = tokio::time::timeout(
        Duration::from_millis(50),
        run_to_completion(&mut m, RunOptions::default()),
    )
    .await;
    assert!(timed_out.is_err(), "the tool hangs, so the run times out");
    // Nothing queued or recorded holds a call without its result.
    assert_paired(&everything(&m));
}

#[tokio::test]
async fn messages_enqueued_while_tools_run_do_not_split_calls_from_results() {
    let model = ScriptedModel::builder()
        .tool_call("slow", json!({}))
        .text("done")
        .build();
    let mut m = streaming_machine(model);
    m.enqueue_user("go");
    let queue = m.queue().clone();
    let intruder = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        queue.enqueue([Message::user("meanwhile")]);
    });
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    intruder.await.expect("task");
    let all = everything(&m);
    assert_paired(&all);
    // The call is immediately followed by its results.
    let call_at = all
        .iter()
        .position(|msg| msg.tool_uses().next().is_some())
        .expect("a call");
    assert!(
        !results(&all[call_at + 1]).is_empty(),
        "{:?}",
        all[call_at + 1]
    );
}

#[tokio::test]
async fn without_streaming_a_dropped_run_leaves_nothing_half_done() {
    // Without streaming the assistant message never waits in the queue.
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("hang", json!({}))
            .build(),
    );
    let node = Node::builder("Tools.").tool(Hang).build().expect("node");
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("go");
    let _ = tokio::time::timeout(
        Duration::from_millis(30),
        run_to_completion(&mut m, RunOptions::default()),
    )
    .await;
    assert_paired(&everything(&m));
}
