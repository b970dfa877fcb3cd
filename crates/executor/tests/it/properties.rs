//! Properties of the loop over random scripts: every tool call keeps exactly
//! one result, and every run ends within its step limit.

use std::sync::Arc;

use crate::common::*;
use markov_charter::node::Node;
use markov_charter::transition::Transition;
use markov_executor::{RunError, RunOptions};
use markov_testkit::ScriptedModel;
use proptest::prelude::*;
use serde_json::{Value, json};

#[derive(Debug, Clone)]
enum Call {
    Add,
    BadInput,
    Unknown,
    Increment,
    UpdateState,
    TransitionA,
    TransitionB,
    UnknownTransition,
}

#[derive(Debug, Clone)]
enum Response {
    Calls(Vec<Call>),
    Text,
    MaxTokens,
}

fn arb_call() -> impl Strategy<Value = Call> {
    prop_oneof![
        Just(Call::Add),
        Just(Call::BadInput),
        Just(Call::Unknown),
        Just(Call::Increment),
        Just(Call::UpdateState),
        Just(Call::TransitionA),
        Just(Call::TransitionB),
        Just(Call::UnknownTransition),
    ]
}

fn arb_response() -> impl Strategy<Value = Response> {
    prop_oneof![
        6 => prop::collection::vec(arb_call(), 1..4).prop_map(Response::Calls),
        1 => Just(Response::Text),
        1 => Just(Response::MaxTokens),
    ]
}

fn call(c: &Call) -> (&'static str, Value) {
    match c {
        Call::Add => ("add", json!({"a": 1, "b": 2})),
        Call::BadInput => ("add", json!({"a": "x"})),
        Call::Unknown => ("nope", json!({})),
        Call::Increment => ("increment", json!({})),
        Call::UpdateState => ("updateState", json!({"patch": {"count": 3}})),
        Call::TransitionA => ("transition", json!({"to": "a", "reason": "r"})),
        Call::TransitionB => ("transition", json!({"to": "b", "reason": "r"})),
        Call::UnknownTransition => ("transition", json!({"to": "zzz", "reason": "r"})),
    }
}

/// Node `a` (node `b` mirrors it).
fn nodes() -> Node {
    let make = |name: &str| {
        Node::builder(format!("Node {name}."))
            .name(name)
            .state(Counter {
                count: 0,
                label: String::new(),
            })
            .tool(Add)
            .tool(Increment)
            .transition("a", Transition::to_ref("to a", "a"))
            .transition("b", Transition::to_ref("to b", "b"))
            .build()
            .expect("node")
    };
    make("a")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn tool_calls_stay_paired_and_runs_end_within_the_limit(
        script in prop::collection::vec(arb_response(), 0..12),
        max_steps in 1usize..8,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        rt.block_on(async {
            let mut b = ScriptedModel::builder();
            for r in &script {
                b = match r {
                    Response::Calls(calls) => b.tool_calls(calls.iter().map(call)),
                    Response::Text => b.text("answer"),
                    Response::MaxTokens => b.max_tokens("cut"),
                };
            }
            let model = Arc::new(b.build());
            let a = nodes();
            let b_node = Node::builder("Node b.")
                .name("b")
                .state(Counter { count: 0, label: String::new() })
                .tool(Add)
                .tool(Increment)
                .transition("a", Transition::to_ref("to a", "a"))
                .transition("b", Transition::to_ref("to b", "b"))
                .build()
                .expect("node");
            let mut m = machine(
                |c| c.node("a", a.clone()).node("b", b_node),
                a.clone(),
                json!({"count": 0, "label": ""}),
                model.clone(),
            );
            m.enqueue_user("go");
            let (steps, err) = run_all(&mut m, RunOptions::default().max_steps(max_steps)).await;
            assert_paired(m.history());
            prop_assert!(steps.len() <= max_steps + 1);
            prop_assert!(model.calls() <= max_steps);
            match err {
                None => prop_assert!(steps.last().is_some_and(|s| s.done)),
                Some(RunError::MaxSteps(n)) => prop_assert_eq!(n, max_steps),
                // The script ran out: the scripted model's error ends the run.
                Some(RunError::Model { .. }) => {}
                Some(other) => prop_assert!(false, "unexpected error {other}"),
            }
            Ok(())
        })?;
    }
}
