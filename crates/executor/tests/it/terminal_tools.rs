//! Terminal tools: a tool's successful output is the machine's exact response.

use std::convert::Infallible;
use std::sync::Arc;

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::transition::Transition;
use markov_core::async_trait;
use markov_core::message::{Message, Role};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Instance, Machine, RunOptions, StandardExecutor, YieldReason};
use markov_testkit::ScriptedModel;
use proptest::prelude::*;
use serde::Serialize;
use serde_json::json;

fn node_with(probe: &Probe) -> Node {
    Node::builder("Answer with your tools.")
        .name("main")
        .tool(Add)
        .tool(FormatResult)
        .tool(MaybeFail)
        .tool(TerminalProbe(probe.clone()))
        .build()
        .expect("node builds")
}

async fn run_one(
    node: Node,
    model: Arc<ScriptedModel>,
) -> (Machine, Vec<markov_executor::MachineStep>) {
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    (m, steps)
}

#[tokio::test]
async fn terminal_output_is_the_exact_response() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("formatResult", json!({"items": ["Apple", "Banana"]}))
            .build(),
    );
    let (m, steps) = run_one(node_with(&Probe::default()), model.clone()).await;
    let last = steps.last().expect("a step");
    assert_eq!(last.response.as_deref(), Some("1. Apple\n2. Banana"));
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(last.done);
    assert_eq!(
        model.calls(),
        1,
        "the model is not called again in this turn"
    );
    // The response is recorded as the assistant's answer, after the result.
    let tail = &m.history()[m.history().len() - 1];
    assert_eq!(tail.role, Role::Assistant);
    assert_eq!(tail.text(), "1. Apple\n2. Banana");
    assert_paired(m.history());
}

#[derive(Serialize)]
struct Summary {
    total: i64,
    items: Vec<String>,
}

struct Summarize;

#[async_trait]
impl Tool for Summarize {
    const NAME: &'static str = "summarize";
    const TERMINAL: bool = true;
    type Args = NoArgs;
    type Output = Summary;
    type Error = Infallible;
    fn description(&self) -> String {
        "Structured summary".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<Summary, Infallible> {
        Ok(Summary {
            total: 2,
            items: vec!["a".into(), "b".into()],
        })
    }
}

#[tokio::test]
async fn a_structured_terminal_output_is_its_json() {
    let node = Node::builder("x").tool(Summarize).build().expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("summarize", json!({}))
            .build(),
    );
    let (_, steps) = run_one(node, model).await;
    assert_eq!(
        steps.last().and_then(|s| s.response.clone()).as_deref(),
        Some(r#"{"items":["a","b"],"total":2}"#)
    );
}

#[tokio::test]
async fn a_failing_terminal_tool_lets_the_loop_continue() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("maybe_fail", json!({"fail": true}))
            .tool_call("maybe_fail", json!({"wrong": 1}))
            .text("I could not do it")
            .build(),
    );
    let (m, steps) = run_one(node_with(&Probe::default()), model.clone()).await;
    assert_eq!(steps.len(), 3);
    assert_eq!(steps[0].yield_reason, YieldReason::ToolUse);
    assert!(steps[0].response.is_none());
    assert_eq!(steps[1].yield_reason, YieldReason::ToolUse);
    assert!(steps.last().expect("step").response.is_none());
    let r = all_results(m.history());
    assert_eq!(
        r[0],
        (
            "call_1".into(),
            "Tool execution error: asked to fail".into(),
            Some(true)
        )
    );
    assert!(r[1].1.starts_with("Invalid tool input: "), "{}", r[1].1);
    assert_eq!(model.calls(), 3);
}

#[tokio::test]
async fn regular_tools_all_run_and_the_terminal_response_wins() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("add", json!({"a": 1, "b": 2})),
                ("formatResult", json!({"items": ["x"]})),
                ("add", json!({"a": 3, "b": 4})),
            ])
            .build(),
    );
    let (m, steps) = run_one(node_with(&Probe::default()), model.clone()).await;
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].response.as_deref(), Some("1. x"));
    let r = all_results(m.history());
    assert_eq!(
        r.iter().map(|r| r.1.as_str()).collect::<Vec<_>>(),
        vec!["3", "1. x", "7"]
    );
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn a_second_terminal_call_is_refused_and_not_run() {
    let probe = Probe::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("formatResult", json!({"items": ["first"]})),
                ("terminal_probe", json!({})),
            ])
            .build(),
    );
    let (m, steps) = run_one(node_with(&probe), model).await;
    assert_eq!(steps[0].response.as_deref(), Some("1. first"));
    assert_eq!(probe.count(), 0, "the second terminal tool did not run");
    let r = all_results(m.history());
    assert_eq!(r[1].2, Some(true));
    assert!(
        r[1].1
            .contains("Only one terminal tool may be called per turn")
            && r[1].1.contains("formatResult"),
        "{}",
        r[1].1
    );
}

#[tokio::test]
async fn a_failed_terminal_call_does_not_block_a_later_one() {
    let probe = Probe::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("maybe_fail", json!({"fail": true})),
                ("terminal_probe", json!({})),
            ])
            .build(),
    );
    let (_, steps) = run_one(node_with(&probe), model).await;
    assert_eq!(steps[0].response.as_deref(), Some("probe"));
    assert_eq!(probe.count(), 1);
}

#[tokio::test]
async fn a_transition_in_the_same_response_wins() {
    let other = Node::builder("Other node.").build().expect("node");
    let node = Node::builder("Start.")
        .tool(FormatResult)
        .transition("next", Transition::to("Go on", other.clone()))
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("formatResult", json!({"items": ["ignored"]})),
                ("transition", json!({"to": "next", "reason": "r"})),
            ])
            .text("now in the other node")
            .build(),
    );
    let (m, steps) = run_one(node, model).await;
    assert_eq!(steps[0].yield_reason, YieldReason::ToolUse);
    assert!(steps[0].response.is_none());
    assert_eq!(m.instance().node().id(), other.id());
    // The terminal output stays in history as a tool result only.
    assert_eq!(all_results(m.history())[0].1, "1. ignored");
    assert!(
        !m.history()
            .iter()
            .any(|msg| msg.role == Role::Assistant && msg.text() == "1. ignored")
    );
    assert_eq!(
        steps.last().expect("step").yield_reason,
        YieldReason::EndTurn
    );
}

#[tokio::test]
async fn a_packs_terminal_tool_is_terminal() {
    let pack = Pack::builder("formatting", "Formats answers")
        .tool(FormatResult)
        .build()
        .expect("pack");
    let node = Node::builder("Use the pack.")
        .pack(pack)
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("formatResult", json!({"items": ["p"]}))
            .build(),
    );
    let (_, steps) = run_one(node, model).await;
    assert_eq!(steps[0].response.as_deref(), Some("1. p"));
    assert!(steps[0].done);
}

#[tokio::test]
async fn an_ancestors_terminal_tool_is_terminal() {
    let child = Node::builder("Child.").build().expect("node");
    let parent = Node::builder("Parent.")
        .tool(FormatResult)
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("formatResult", json!({"items": ["from child"]}))
            .build(),
    );
    let charter = Charter::builder("t").build().expect("charter");
    let root = Instance::new(parent, json!({})).with_child(Instance::new(child, json!({})));
    let mut m =
        machine_on(charter, StandardExecutor::shared(model.clone()), root).expect("machine");
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps[0].response.as_deref(), Some("1. from child"));
    assert!(model.requests()[0].system.starts_with("Child."));
}

#[tokio::test]
async fn the_system_prompt_lists_terminal_tools_only_when_offered() {
    let model = Arc::new(ScriptedModel::builder().text("a").text("b").build());
    let (_, _) = run_one(node_with(&Probe::default()), model.clone()).await;
    let system = &model.requests()[0].system;
    assert!(
        system.contains(
            "## Terminal Tools\nThese tools generate your final response:\n- formatResult: Format items into the final response\n- maybe_fail: Terminal unless it fails\n- terminal_probe: A second terminal tool\n\nWhen you call a terminal tool, its output IS your response. Do not add text after calling one."
        ),
        "{system}"
    );
    let plain = Node::builder("No terminal tools.")
        .tool(Add)
        .build()
        .expect("node");
    let model = Arc::new(ScriptedModel::builder().text("a").build());
    let (_, _) = run_one(plain, model.clone()).await;
    assert!(!model.requests()[0].system.contains("## Terminal Tools"));
}

#[tokio::test]
async fn the_next_turn_after_a_terminal_response_is_accepted() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("formatResult", json!({"items": ["a"]})),
                ("add", json!({"a": 1, "b": 1})),
            ])
            .text("second turn answer")
            .build(),
    );
    let mut m = machine(
        |c| c,
        node_with(&Probe::default()),
        json!({}),
        model.clone(),
    );
    m.enqueue_user("first");
    run_all(&mut m, RunOptions::default()).await;
    m.enqueue_user("second");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        steps.last().expect("step").yield_reason,
        YieldReason::EndTurn
    );
    assert_paired(m.history());
    // The second request continues a conversation that alternates properly:
    // the terminal response is an assistant message before the new user input.
    let sent = &model.requests()[1].messages;
    let roles: Vec<Role> = sent.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        vec![
            Role::User,
            Role::Assistant,
            Role::User,
            Role::Assistant,
            Role::User
        ]
    );
}

/// One scripted call kind.
#[derive(Debug, Clone)]
enum Call {
    Terminal,
    Regular,
    Failing,
    Unknown,
}

fn arb_call() -> impl Strategy<Value = Call> {
    prop_oneof![
        Just(Call::Terminal),
        Just(Call::Regular),
        Just(Call::Failing),
        Just(Call::Unknown),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn history_stays_paired_over_random_mixes(
        turns in prop::collection::vec(prop::collection::vec(arb_call(), 1..5), 1..4),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        rt.block_on(async {
            let mut builder = ScriptedModel::builder();
            for calls in &turns {
                let calls: Vec<(&str, serde_json::Value)> = calls
                    .iter()
                    .map(|c| match c {
                        Call::Terminal => ("formatResult", json!({"items": ["t"]})),
                        Call::Regular => ("add", json!({"a": 1, "b": 2})),
                        Call::Failing => ("maybe_fail", json!({"fail": true})),
                        Call::Unknown => ("no_such_tool", json!({})),
                    })
                    .collect();
                builder = builder.tool_calls(calls);
            }
            let model = Arc::new(builder.text("done").build());
            // Identical calls repeat freely in random scripts: the loop guard
            // (tested on its own) stays out of this property.
            let mut m = machine(
                |c| c.loop_guard(markov_policy::LoopGuard::OFF),
                node_with(&Probe::default()),
                json!({}),
                model,
            );
            m.enqueue_user("go");
            let (steps, err) = run_all(&mut m, RunOptions::default().max_steps(10)).await;
            prop_assert!(err.is_none(), "{:?}", err);
            assert_paired(m.history());
            let last = steps.last().expect("a step");
            prop_assert!(last.done);
            // A response is given exactly when some terminal call succeeded.
            let first_terminal_turn = turns.iter().position(|t| t.iter().any(|c| matches!(c, Call::Terminal)));
            match first_terminal_turn {
                Some(i) => {
                    prop_assert_eq!(steps.len(), i + 1);
                    prop_assert_eq!(last.response.as_deref(), Some("1. t"));
                }
                None => prop_assert!(last.response.is_none()),
            }
            // The next turn is accepted.
            m.enqueue([Message::user("again")]);
            // Whatever the rest of the script does (it may run out), nothing is lost.
            let _ = run_all(&mut m, RunOptions::default().max_steps(10)).await;
            assert_paired(m.history());
            Ok(())
        })?;
    }
}
