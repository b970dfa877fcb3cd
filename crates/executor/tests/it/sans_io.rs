//! The run loop as a plain value: driven by hand, with no runtime and no model.

use std::sync::Arc;

use crate::common::*;
use markov_charter::node::Node;
use markov_core::message::Message;
use markov_executor::{
    Action, Entry, LeafOutcome, RunError, RunOptions, RunState, TurnState, YieldReason,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn outcome(text: &str, reason: YieldReason) -> LeafOutcome {
    LeafOutcome::new(
        vec![Entry::message(Message::assistant(text))],
        reason,
        TurnState::default(),
    )
}

#[test]
fn the_state_says_what_to_do_and_the_caller_does_it() {
    let node = Node::builder("Hand-driven.").build().expect("node");
    // The executor is never called: the test plays its part.
    let model = Arc::new(ScriptedModel::builder().build());
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("hi");
    let mut state = RunState::new(RunOptions::default().max_steps(3));

    let Action::RunLeaves(tasks) = state.next(&mut m).expect("first action") else {
        panic!("expected leaves to run");
    };
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].current_step, 1);
    assert_eq!(
        m.history().len(),
        1,
        "the input is recorded before the step"
    );

    // Pause between the action and its results: the state survives serialization.
    let saved = serde_json::to_string(&state).expect("serializes");
    let mut state: RunState = serde_json::from_str(&saved).expect("deserializes");

    let step = state
        .on_leaf_results(
            &mut m,
            &tasks,
            vec![Ok(outcome("working", YieldReason::ToolUse))],
        )
        .expect("step");
    assert!(!step.done);
    assert_eq!(step.history.len(), 2, "input then the leaf's message");

    let Action::RunLeaves(tasks) = state.next(&mut m).expect("second action") else {
        panic!("expected leaves to run");
    };
    assert_eq!(tasks[0].current_step, 2);
    let step = state
        .on_leaf_results(
            &mut m,
            &tasks,
            vec![Ok(outcome("done", YieldReason::EndTurn))],
        )
        .expect("step");
    assert!(step.done);
    assert_eq!(m.history().len(), 3);
    assert_eq!(model.calls(), 0);
}

#[test]
fn the_step_limit_is_the_states_decision() {
    let node = Node::builder("x").build().expect("node");
    let mut m = machine(
        |c| c,
        node,
        json!({}),
        Arc::new(ScriptedModel::builder().build()),
    );
    m.enqueue_user("hi");
    let mut state = RunState::new(RunOptions::default().max_steps(1));
    let Action::RunLeaves(tasks) = state.next(&mut m).expect("action") else {
        panic!("expected leaves to run");
    };
    state
        .on_leaf_results(
            &mut m,
            &tasks,
            vec![Ok(outcome("more", YieldReason::ToolUse))],
        )
        .expect("step");
    assert_eq!(state.next(&mut m).unwrap_err(), RunError::MaxSteps(1));
}

#[test]
fn a_leaf_error_keeps_what_other_leaves_produced() {
    let node = Node::builder("x").build().expect("node");
    let mut m = machine(
        |c| c,
        node,
        json!({}),
        Arc::new(ScriptedModel::builder().build()),
    );
    m.enqueue_user("hi");
    let mut state = RunState::new(RunOptions::default());
    let Action::RunLeaves(tasks) = state.next(&mut m).expect("action") else {
        panic!("expected leaves to run");
    };
    let err = state
        .on_leaf_results(&mut m, &tasks, vec![Err(RunError::NoSteps)])
        .unwrap_err();
    assert_eq!(err, RunError::NoSteps);
    assert!(m.queue().is_empty());
}
