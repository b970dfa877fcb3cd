//! A whole machine for the provider tests: a calculator node with a typed
//! `add` tool, the terminal `respond` tool and `finish`, run by the
//! standard executor over whichever client a test passes in.

use async_trait::async_trait;
use futures::StreamExt;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::model::collect_stream;
use markov_core::tool::TerminateResponse;
use markov_core::{Model, ModelError, ModelRequest, ModelResponse};
use markov_executor::{
    Machine, MachineStep, RunOptions, StandardExecutor, YieldReason, run_machine,
};
use markov_tools_std::{Finish, Respond};
use serde_json::{Value, json};

pub use markov_testkit::fixtures::Add;

/// The first user turn.
pub const QUESTION: &str = "What is 2 + 3?";
/// The exact answer the model hands back through `respond`.
pub const ANSWER: &str = "2 + 3 = 5";
/// The second user turn.
pub const THANKS: &str = "Thanks, that is all.";
/// The note the model gives `finish`.
pub const NOTE: &str = "Added 2 and 3 for the user.";

/// The arguments of the scripted calls.
pub fn add_args() -> Value {
    json!({"a": 2, "b": 3})
}

/// The arguments of the scripted `respond` call.
pub fn respond_args() -> Value {
    json!({"text": ANSWER})
}

/// The arguments of the scripted `finish` call.
pub fn finish_args() -> Value {
    json!({"note": NOTE})
}

/// A calculator machine over `model`.
pub fn calculator(model: impl Model + 'static) -> Machine {
    let node = Node::builder("You do arithmetic with your tools.")
        .name("calc")
        .tool(Add)
        .tool(Respond)
        .tool(Finish)
        .build()
        .expect("node builds");
    let charter = Charter::builder("calculator")
        .node("calc", node.clone())
        .build()
        .expect("charter builds");
    markov_executor::Agent::on_charter_with_executor(
        charter,
        std::sync::Arc::new(StandardExecutor::new(model)),
    )
    .state(json!({}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine builds")
}

/// Enqueues `text` as a user message and runs until the machine stops,
/// returning every step; a run error fails the test with its message.
pub async fn turn(machine: &mut Machine, text: &str) -> Vec<MachineStep> {
    machine.enqueue_user(text);
    let mut steps = Vec::new();
    let mut stream = std::pin::pin!(run_machine(machine, RunOptions::default()));
    while let Some(step) = stream.next().await {
        match step {
            Ok(step) => steps.push(step),
            Err(err) => panic!("the run failed after {} step(s): {err}", steps.len()),
        }
    }
    steps
}

/// A client whose `complete` goes through its own `stream`, collected by
/// [`collect_stream`], so the standard executor runs on server-sent events.
#[derive(Debug)]
pub struct Streamed<M>(pub M);

#[async_trait]
impl<M: Model> markov_core::ModelLayer for Streamed<M> {
    type Inner = M;

    fn inner(&self) -> &M {
        &self.0
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        collect_stream(self.0.stream(request)).await
    }
}

/// Runs the calculator over `model` (through its event streams when
/// `streamed`) for two turns: the question, answered through `add` and
/// `respond`, then the thanks, ended through `finish`.
pub async fn two_turns<M: Model + 'static>(model: M, streamed: bool) {
    let mut machine = if streamed {
        calculator(Streamed(model))
    } else {
        calculator(model)
    };

    let steps = turn(&mut machine, QUESTION).await;
    let reasons: Vec<YieldReason> = steps.iter().map(|s| s.yield_reason).collect();
    assert_eq!(reasons, [YieldReason::ToolUse, YieldReason::EndTurn]);
    assert!(!steps[0].done);
    let last = steps.last().expect("a step");
    assert!(last.done);
    assert_eq!(last.response.as_deref(), Some(ANSWER));
    assert_eq!(last.termination, None);

    let steps = turn(&mut machine, THANKS).await;
    assert_eq!(steps.len(), 1, "{steps:?}");
    let last = &steps[0];
    assert!(last.done);
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(
        last.termination,
        Some(TerminateResponse::new(Some(NOTE.to_owned())))
    );
    assert_eq!(last.response, None);
}
