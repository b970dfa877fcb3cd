//! `finish`, `TerminateResponse` and output restriction.

use std::convert::Infallible;
use std::sync::Arc;

use crate::common::*;
use markov_charter::node::Node;
use markov_charter::tool_choice::{DEFAULT_RESTRICTION_MESSAGE, OutputRestriction};
use markov_charter::transition::Transition;
use markov_core::async_trait;
use markov_core::message::{Message, Role};
use markov_core::tool::{TerminateResponse, Tool, ToolContext};
use markov_executor::{Machine, MachineStep, RunError, RunOptions, YieldReason};
use markov_testkit::ScriptedModel;
use markov_tools_std::Finish;
use proptest::prelude::*;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

/// The seed's custom completion tool.
struct CompleteTask;

#[derive(Deserialize, JsonSchema)]
struct CompleteTaskArgs {
    summary: String,
}

#[async_trait]
impl Tool for CompleteTask {
    const NAME: &'static str = "complete_task";
    type Args = CompleteTaskArgs;
    type Output = TerminateResponse;
    type Error = Infallible;
    fn description(&self) -> String {
        "Mark the current task as complete".into()
    }
    async fn call(
        &self,
        args: CompleteTaskArgs,
        _cx: &ToolContext<'_>,
    ) -> Result<TerminateResponse, Infallible> {
        Ok(TerminateResponse::new(Some(format!(
            "Task completed: {}",
            args.summary
        ))))
    }
}

fn node(restriction: OutputRestriction) -> Node {
    Node::builder("Act through tools.")
        .tool(Add)
        .tool(Finish)
        .tool(CompleteTask)
        .tool(FormatResult)
        .restriction(restriction)
        .build()
        .expect("node builds")
}

fn restricted(max: u32) -> OutputRestriction {
    OutputRestriction {
        restriction_max_injections: max,
        ..OutputRestriction::enabled()
    }
}

async fn run(
    node: Node,
    model: Arc<ScriptedModel>,
    options: RunOptions,
) -> (Machine, Vec<MachineStep>, Option<RunError>) {
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("do the task");
    let (steps, err) = run_all(&mut m, options).await;
    (m, steps, err)
}

fn injections(history: &[Message], text: &str) -> usize {
    history
        .iter()
        .filter(|m| m.role == Role::System && m.text() == text)
        .count()
}

#[tokio::test]
async fn finish_ends_the_run_with_its_note() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("finish", json!({"note": "all done"}))
            .build(),
    );
    let (m, steps, err) = run(
        node(OutputRestriction::default()),
        model.clone(),
        RunOptions::default(),
    )
    .await;
    assert!(err.is_none(), "{err:?}");
    let last = steps.last().expect("step");
    assert!(last.done);
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(
        last.termination,
        Some(TerminateResponse::new(Some("all done".into())))
    );
    assert!(last.response.is_none());
    assert_eq!(all_results(m.history())[0].1, "all done");
    assert_eq!(model.calls(), 1, "the model is not called again");
}

#[tokio::test]
async fn finish_without_a_note_records_the_configured_default() {
    for (options, expected) in [
        (RunOptions::default(), "Finished"),
        (
            RunOptions::default().terminate_message("Task completed."),
            "Task completed.",
        ),
    ] {
        let model = Arc::new(
            ScriptedModel::builder()
                .tool_call("finish", json!({}))
                .build(),
        );
        let (m, steps, _) = run(node(OutputRestriction::default()), model, options).await;
        assert_eq!(all_results(m.history())[0].1, expected);
        assert_eq!(
            steps.last().and_then(|s| s.termination.clone()),
            Some(TerminateResponse::new(None))
        );
    }
}

#[tokio::test]
async fn a_custom_tool_can_terminate() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("complete_task", json!({"summary": "wrote the report"}))
            .build(),
    );
    let (m, steps, _) = run(
        node(OutputRestriction::default()),
        model,
        RunOptions::default(),
    )
    .await;
    assert!(steps.last().expect("step").done);
    assert_eq!(
        all_results(m.history())[0].1,
        "Task completed: wrote the report"
    );
}

#[tokio::test]
async fn a_transition_wins_over_termination() {
    let other = Node::builder("Other.").build().expect("node");
    let n = Node::builder("Start.")
        .tool(Finish)
        .transition("next", Transition::to("go", other.clone()))
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("finish", json!({})),
                ("transition", json!({"to": "next", "reason": "r"})),
            ])
            .text("hello from other")
            .build(),
    );
    let (m, steps, err) = run(n, model, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert!(!steps[0].done);
    assert!(steps[0].termination.is_none());
    assert_eq!(m.instance().node().id(), other.id());
    assert_eq!(steps.len(), 2);
}

#[tokio::test]
async fn a_terminal_tool_and_termination_together_give_the_response_and_end() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("formatResult", json!({"items": ["x"]})),
                ("finish", json!({"note": "n"})),
            ])
            .build(),
    );
    let (_, steps, _) = run(
        node(OutputRestriction::default()),
        model.clone(),
        RunOptions::default(),
    )
    .await;
    let last = steps.last().expect("step");
    assert!(last.done);
    assert_eq!(last.response.as_deref(), Some("1. x"));
    assert!(last.termination.is_some());
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn restriction_injects_until_the_model_calls_finish() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("here is my answer")
            .text("really, here it is")
            .tool_call("finish", json!({"note": "ok"}))
            .build(),
    );
    let (m, steps, err) = run(
        node(OutputRestriction::enabled()),
        model.clone(),
        RunOptions::default(),
    )
    .await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(injections(m.history(), DEFAULT_RESTRICTION_MESSAGE), 2);
    assert_eq!(
        steps.iter().map(|s| s.yield_reason).collect::<Vec<_>>(),
        vec![
            YieldReason::Restricted,
            YieldReason::Restricted,
            YieldReason::EndTurn
        ]
    );
    assert!(steps[2].termination.is_some());
    // The reminder reached the model as the last message of the next call.
    let second = &model.requests()[1].messages;
    assert_eq!(
        second.last().map(|m| (m.role, m.text())),
        Some((Role::System, DEFAULT_RESTRICTION_MESSAGE.to_owned()))
    );
}

#[tokio::test]
async fn limited_injections_end_the_turn_after_the_limit() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("a")
            .text("b")
            .text("c")
            .text("never asked")
            .build(),
    );
    let (m, steps, err) = run(node(restricted(2)), model.clone(), RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(injections(m.history(), DEFAULT_RESTRICTION_MESSAGE), 2);
    assert_eq!(model.calls(), 3);
    let last = steps.last().expect("step");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(last.done);
}

#[tokio::test]
async fn unlimited_injections_end_at_the_step_limit_with_history_whole() {
    let mut builder = ScriptedModel::builder();
    for i in 0..10 {
        builder = builder.text(format!("answer {i}"));
    }
    let model = Arc::new(builder.build());
    let (m, steps, err) = run(
        node(restricted(0)),
        model,
        RunOptions::default().max_steps(4),
    )
    .await;
    assert_eq!(err, Some(RunError::MaxSteps(4)));
    assert_eq!(
        err.map(|e| e.to_string()).as_deref(),
        Some("Max steps (4) exceeded")
    );
    assert_eq!(steps.len(), 4);
    // user + 4 × (assistant + reminder)
    assert_eq!(m.history().len(), 9);
    assert_eq!(injections(m.history(), DEFAULT_RESTRICTION_MESSAGE), 4);
}

#[tokio::test]
async fn counters_reset_after_a_tool_runs() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("a")
            .tool_call("add", json!({"a": 1, "b": 1}))
            .text("b")
            .text("c")
            .build(),
    );
    let (m, steps, err) = run(node(restricted(1)), model, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    // One reminder before the tool, one after: the count starts over.
    assert_eq!(injections(m.history(), DEFAULT_RESTRICTION_MESSAGE), 2);
    assert_eq!(
        steps.last().map(|s| s.yield_reason),
        Some(YieldReason::EndTurn)
    );
}

#[tokio::test]
async fn counters_reset_at_a_new_turn() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("a")
            .text("b")
            .text("c")
            .text("d")
            .build(),
    );
    let mut m = machine(|c| c, node(restricted(1)), json!({}), model);
    m.enqueue_user("first");
    run_all(&mut m, RunOptions::default()).await;
    assert_eq!(injections(m.history(), DEFAULT_RESTRICTION_MESSAGE), 1);
    m.enqueue_user("second");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(injections(m.history(), DEFAULT_RESTRICTION_MESSAGE), 2);
}

#[tokio::test]
async fn a_custom_restriction_message_is_injected() {
    let custom = OutputRestriction {
        restriction_message: "Please call a tool or use 'finish' to complete.".into(),
        ..restricted(1)
    };
    let model = Arc::new(ScriptedModel::builder().text("a").text("b").build());
    let (m, _, _) = run(node(custom), model, RunOptions::default()).await;
    assert_eq!(
        injections(
            m.history(),
            "Please call a tool or use 'finish' to complete."
        ),
        1
    );
}

#[tokio::test]
async fn the_system_prompt_is_identical_with_and_without_restriction() {
    let a = Arc::new(ScriptedModel::builder().text("x").build());
    let b = Arc::new(ScriptedModel::builder().text("x").text("y").build());
    run(
        node(OutputRestriction::default()),
        a.clone(),
        RunOptions::default(),
    )
    .await;
    run(node(restricted(1)), b.clone(), RunOptions::default()).await;
    assert_eq!(a.requests()[0].system, b.requests()[0].system);
    assert_eq!(b.requests()[0].system, b.requests()[1].system);
    assert!(!a.requests()[0].system.contains(DEFAULT_RESTRICTION_MESSAGE));
}

/// A scripted call: a tool call, or a final text.
fn arb_script() -> impl Strategy<Value = Vec<Option<i64>>> {
    prop::collection::vec(proptest::option::of(0i64..100), 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn restriction_off_behaves_exactly_as_before(script in arb_script()) {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        rt.block_on(async {
            let build = || {
                let mut b = ScriptedModel::builder();
                // Tool calls, then one final text: no tool-less retry is needed.
                for n in script.iter().flatten() {
                    b = b.tool_call("add", json!({"a": n, "b": 1}));
                }
                Arc::new(b.text("final").build())
            };
            let off = OutputRestriction {
                restrict_output: false,
                restriction_message: "ignored".into(),
                restriction_max_injections: 3,
            };
            let (m1, s1, e1) = run(node(OutputRestriction::default()), build(), RunOptions::default()).await;
            let (m2, s2, e2) = run(node(off), build(), RunOptions::default()).await;
            prop_assert_eq!(e1, e2);
            prop_assert_eq!(s1.len(), s2.len());
            for (a, b) in s1.iter().zip(&s2) {
                prop_assert_eq!(a.yield_reason, b.yield_reason);
                prop_assert_eq!(a.done, b.done);
            }
            let strip = |h: &[Message]| h.iter().map(|m| (m.role, m.text(), results(m))).collect::<Vec<_>>();
            prop_assert_eq!(strip(m1.history()), strip(m2.history()));
            Ok(())
        })?;
    }
}
