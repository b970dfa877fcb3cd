//! The tool registry's policy stack inside a machine: envelopes in the
//! history, budgets per user turn, state updates through the stack.

use std::sync::Arc;

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_executor::{Instance, Machine, RunOptions, StandardExecutor};
use markov_policy::{Budget, Category, Mode, PolicyConfig, ToolMetadata, ToolRegistry};
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

fn registry(budget: Budget) -> Arc<ToolRegistry> {
    Arc::new(
        ToolRegistry::builder(PolicyConfig::new(budget))
            .register(Add, ToolMetadata::new(Category::Other))
            .register(Increment, ToolMetadata::new(Category::Action))
            .register(
                FormatResult,
                ToolMetadata::new(Category::Action).with_modes([Mode::VOICE]),
            )
            .lock()
            .expect("the registry locks"),
    )
}

fn policed_machine(
    model: Arc<ScriptedModel>,
    registry: Arc<ToolRegistry>,
    state: Value,
) -> Machine {
    let node = Node::builder("Use your tools.")
        .name("main")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .tool(Add)
        .tool(Increment)
        .tool(FormatResult)
        .build()
        .expect("node builds");
    let charter = Charter::builder("test")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    machine_on(
        charter,
        StandardExecutor::shared(model).with_registry(registry, Mode::TEXT),
        Instance::new(node, state),
    )
    .expect("machine builds")
}

#[tokio::test]
async fn a_mode_restricted_tool_is_answered_with_the_envelope_and_the_run_goes_on() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("add", json!({"a": 2, "b": 3})),
                ("formatResult", json!({"items": ["a"]})),
                ("nope", json!({})),
            ])
            .text("done")
            .build(),
    );
    let mut m = policed_machine(model.clone(), registry(Budget::TEXT), json!({"count": 0}));
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_paired(m.history());
    let results: Vec<(String, Option<bool>)> = all_results(m.history())
        .into_iter()
        .map(|(_, content, is_error)| (content, is_error))
        .collect();
    assert_eq!(
        results,
        [
            (r#"{"ok":true,"data":5}"#.to_owned(), Some(false)),
            (
                r#"{"ok":false,"error":{"type":"MODE_RESTRICTED","message":"Tool not available in this mode: formatResult is not available in text mode","retryable":false}}"#
                    .to_owned(),
                Some(true)
            ),
            (
                r#"{"ok":false,"error":{"type":"NOT_FOUND","message":"Unknown tool: nope","retryable":false}}"#
                    .to_owned(),
                Some(true)
            ),
        ]
    );
    // The terminal tool was rejected, so it is not the response: the model is called again.
    assert_eq!(model.calls(), 2);
    let last = steps.last().expect("a step");
    assert!(last.done);
    assert_eq!(last.response, None);
    assert_eq!(
        m.history().last().map(|msg| msg.text()),
        Some("done".to_owned())
    );
}

#[tokio::test]
async fn budgets_count_across_the_responses_of_a_user_turn_and_start_over_with_the_next() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("add", json!({"a": 1, "b": 1})),
                ("add", json!({"a": 1, "b": 2})),
            ])
            .tool_call("add", json!({"a": 1, "b": 3}))
            .text("first turn done")
            .tool_call("add", json!({"a": 1, "b": 4}))
            .text("second turn done")
            .build(),
    );
    let mut m = policed_machine(
        model,
        registry(Budget::UNLIMITED.max_calls(2)),
        json!({"count": 0}),
    );
    m.enqueue_user("go");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    m.enqueue_user("again");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_paired(m.history());
    let contents: Vec<String> = all_results(m.history())
        .into_iter()
        .map(|(_, c, _)| c)
        .collect();
    assert_eq!(
        contents,
        [
            r#"{"ok":true,"data":2}"#,
            r#"{"ok":true,"data":3}"#,
            r#"{"ok":false,"error":{"type":"BUDGET_EXCEEDED","message":"Tool call budget exceeded for this turn: tool calls (max 2 per turn)","retryable":false}}"#,
            r#"{"ok":true,"data":5}"#,
        ]
    );
}

#[tokio::test]
async fn state_updates_still_apply_through_the_stack() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([("increment", json!({})), ("increment", json!({}))])
            .text("done")
            .build(),
    );
    let mut m = policed_machine(model, registry(Budget::TEXT), json!({"count": 0}));
    m.enqueue_user("go");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(m.instance().state()["count"], 2);
    assert!(
        all_results(m.history())
            .iter()
            .all(|(_, c, e)| c.starts_with(r#"{"ok":true"#) && *e == Some(false))
    );
}
