//! The loop guard: identical calls within a user turn are refused past the
//! limit, and the run ends after a few more; other arguments, a new user
//! turn and `LoopGuard::OFF` are not loops; the counts survive a snapshot.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{
    Action, Executor, Instance, Machine, RunOptions, RunState, StandardExecutor, YieldReason,
    run_leaves, serialize_machine,
};
use markov_policy::LoopGuard;
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize, JsonSchema)]
struct Query {
    q: String,
}

/// Searches, counting its executions.
#[derive(Clone)]
struct Search(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Search {
    const NAME: &'static str = "search";
    type Args = Query;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Search".into()
    }
    async fn call(&self, args: Query, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!("nothing about {}", args.q))
    }
}

fn search_node(runs: &Arc<AtomicUsize>, guard: Option<LoopGuard>) -> Node {
    let mut builder = Node::builder("Search.")
        .name("main")
        .tool(Search(runs.clone()))
        .tool(Add);
    if let Some(guard) = guard {
        builder = builder.loop_guard(guard);
    }
    builder.build().expect("node builds")
}

fn search(q: &str) -> serde_json::Value {
    json!({"q": q})
}

#[tokio::test]
async fn the_fourth_identical_call_is_refused_even_between_other_calls() {
    let runs = Arc::new(AtomicUsize::new(0));
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search", search("x"))
            .tool_call("add", json!({"a": 1, "b": 1}))
            .tool_call("search", search("x"))
            .tool_call("search", search("y"))
            .tool_call("search", search("x"))
            .tool_call("search", search("x"))
            .text("I could not find it.")
            .build(),
    );
    let mut m = machine(|c| c, search_node(&runs, None), json!({}), model);
    m.enqueue_user("find x");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 4, "three x and one y ran");
    let last = all_results(m.history()).pop().expect("a result");
    assert_eq!(last.2, Some(true));
    assert!(last.1.contains("4 times in this turn"), "{}", last.1);
    assert_eq!(
        steps.last().map(|s| s.yield_reason),
        Some(YieldReason::EndTurn)
    );
}

#[tokio::test]
async fn a_model_that_keeps_repeating_ends_the_run_with_a_clear_reason() {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut script = ScriptedModel::builder();
    for _ in 0..10 {
        script = script.tool_call("search", search("x"));
    }
    let model = Arc::new(script.build());
    let mut m = machine(|c| c, search_node(&runs, None), json!({}), model.clone());
    m.enqueue_user("find x");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let last = steps.last().expect("steps");
    assert_eq!(last.yield_reason, YieldReason::LoopDetected);
    assert!(last.done);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(
        model.calls(),
        6,
        "three ran, two refused, the sixth ended the run"
    );
    assert_paired(m.history());
}

#[tokio::test]
async fn other_arguments_a_new_turn_and_off_are_not_loops() {
    // Other arguments.
    let runs = Arc::new(AtomicUsize::new(0));
    let mut script = ScriptedModel::builder();
    for n in 0..6 {
        script = script.tool_call("search", search(&n.to_string()));
    }
    let model = Arc::new(script.text("done").build());
    let mut m = machine(|c| c, search_node(&runs, None), json!({}), model);
    m.enqueue_user("find");
    run_all(&mut m, RunOptions::default()).await;
    assert_eq!(runs.load(Ordering::SeqCst), 6);

    // A new user turn starts the count over.
    let runs = Arc::new(AtomicUsize::new(0));
    let mut script = ScriptedModel::builder();
    for _ in 0..2 {
        for _ in 0..3 {
            script = script.tool_call("search", search("x"));
        }
        script = script.text("done");
    }
    let model = Arc::new(script.build());
    let mut m = machine(|c| c, search_node(&runs, None), json!({}), model);
    for turn in ["first", "second"] {
        m.enqueue_user(turn);
        run_all(&mut m, RunOptions::default()).await;
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        6,
        "three per turn, none refused"
    );

    // Off: no limit (the step limit still applies).
    let runs = Arc::new(AtomicUsize::new(0));
    let mut script = ScriptedModel::builder();
    for _ in 0..8 {
        script = script.tool_call("search", search("x"));
    }
    let model = Arc::new(script.text("done").build());
    let mut m = machine(
        |c| c,
        search_node(&runs, Some(LoopGuard::OFF)),
        json!({}),
        model,
    );
    m.enqueue_user("find");
    run_all(&mut m, RunOptions::default()).await;
    assert_eq!(runs.load(Ordering::SeqCst), 8);

    // The charter's guard applies to a node that sets none.
    let runs = Arc::new(AtomicUsize::new(0));
    let mut script = ScriptedModel::builder();
    for _ in 0..3 {
        script = script.tool_call("search", search("x"));
    }
    let model = Arc::new(script.text("done").build());
    let mut m = machine(
        |c| c.loop_guard(LoopGuard::repeats(1)),
        search_node(&runs, None),
        json!({}),
        model,
    );
    m.enqueue_user("find");
    run_all(&mut m, RunOptions::default()).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the charter allows one");
}

/// Drives `state` until it yields a step or finishes.
async fn step(machine: &mut Machine, state: &mut RunState) -> Option<markov_executor::MachineStep> {
    match state.next(machine).expect("next") {
        Action::RunLeaves(tasks) => {
            let results = run_leaves(machine, state, &tasks).await;
            Some(
                state
                    .on_leaf_results(machine, &tasks, results)
                    .expect("step"),
            )
        }
        Action::Yield(step) => Some(step),
        _ => None,
    }
}

#[tokio::test]
async fn the_counts_survive_a_snapshot_in_the_middle_of_a_turn() {
    let runs = Arc::new(AtomicUsize::new(0));
    let node = search_node(&runs, None);
    let charter = Charter::builder("loops")
        .node("main", node.clone())
        .build()
        .expect("charter");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search", search("x"))
            .tool_call("search", search("x"))
            .tool_call("search", search("x"))
            .build(),
    );
    let mut m = machine_on(
        charter.clone(),
        StandardExecutor::shared(model),
        Instance::new(node, json!({})),
    )
    .expect("machine");
    m.enqueue_user("find x");
    let mut state = RunState::new(RunOptions::default());
    for _ in 0..3 {
        step(&mut m, &mut state).await.expect("a step");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // Stop here: the machine and the run state go to disk.
    let machine_json =
        serde_json::to_string(&serialize_machine(&m).expect("serializes")).expect("json");
    let run_json = serde_json::to_string(&state).expect("the run state serializes");
    assert!(
        machine_json.contains("\"repeats\""),
        "the counts are in the snapshot"
    );

    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search", search("x"))
            .text("I give up.")
            .build(),
    );
    let executor: Arc<dyn Executor> = Arc::new(StandardExecutor::shared(model));
    let mut m = restore_on(
        charter,
        executor,
        serde_json::from_str::<markov_executor::SerializedMachine>(&machine_json).expect("reads"),
    )
    .expect("restores");
    let mut state: RunState = serde_json::from_str(&run_json).expect("the run state reads");
    while let Some(step) = step(&mut m, &mut state).await {
        if step.done {
            break;
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "the fourth identical call was refused"
    );
    let refused = all_results(m.history()).pop().expect("a result");
    assert!(refused.1.contains("4 times in this turn"), "{}", refused.1);
}
