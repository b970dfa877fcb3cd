//! Scenario tests of the basic loop with a scripted model.

use std::convert::Infallible;

use markov_core::message::{Item, Message, Role};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Agent, RunError};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

struct Add;

#[derive(Deserialize, JsonSchema)]
struct AddArgs {
    a: i64,
    b: i64,
}

impl Tool for Add {
    const NAME: &'static str = "add";
    type Args = AddArgs;
    type Output = i64;
    type Error = Infallible;
    fn description(&self) -> String {
        "Add two integers".into()
    }
    async fn call(&self, args: AddArgs, _cx: &ToolContext<'_>) -> Result<i64, Infallible> {
        Ok(args.a + args.b)
    }
}

fn results(message: &Message) -> Vec<(String, String, Option<bool>)> {
    message
        .item_list()
        .iter()
        .filter_map(|i| match i {
            Item::ToolResult {
                tool_use_id,
                content,
                is_error,
            } => Some((tool_use_id.to_string(), content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn runs_tools_and_feeds_results_back() {
    let model = ScriptedModel::builder()
        .tool_call("add", json!({"a": 2, "b": 3}))
        .text("5")
        .build();
    let agent = Agent::builder(model).tool(Add).expect("valid tool").build();
    let mut history = vec![Message::user("2+3?")];
    let out = agent.run(&mut history).await.expect("run succeeds");
    assert_eq!(out.response, "5");
    assert_eq!(out.steps, 2);
    assert_eq!(history.len(), 4);
    assert_eq!(
        results(&history[2]),
        vec![("call_1".into(), "5".into(), Some(false))]
    );
}

#[tokio::test]
async fn unknown_tools_and_invalid_input_become_error_results() {
    let model = ScriptedModel::builder()
        .tool_calls([
            ("nope", json!({})),
            ("add", json!({"a": "two"})),
            ("add", json!({"a": 1, "b": 1})),
        ])
        .text("sorry")
        .build();
    let agent = Agent::builder(model).tool(Add).expect("valid tool").build();
    let mut history = vec![Message::user("go")];
    agent.run(&mut history).await.expect("run succeeds");
    let r = results(&history[2]);
    assert_eq!(r.len(), 3, "one result per call");
    assert_eq!(
        r[0],
        ("call_1".into(), "Unknown tool: nope".into(), Some(true))
    );
    assert!(r[1].1.starts_with("Invalid tool input: "), "{}", r[1].1);
    assert_eq!(r[1].2, Some(true));
    assert_eq!(r[2], ("call_3".into(), "2".into(), Some(false)));
}

#[tokio::test]
async fn the_step_limit_is_an_error_naming_the_limit() {
    let model = ScriptedModel::builder()
        .tool_call("add", json!({"a": 1, "b": 1}))
        .tool_call("add", json!({"a": 1, "b": 1}))
        .tool_call("add", json!({"a": 1, "b": 1}))
        .build();
    let agent = Agent::builder(model)
        .tool(Add)
        .expect("valid tool")
        .max_steps(2)
        .build();
    let mut history = vec![Message::user("loop")];
    let err = agent.run(&mut history).await.unwrap_err();
    assert_eq!(err, RunError::MaxSteps(2));
    assert_eq!(err.to_string(), "Max steps (2) exceeded");
    // Every tool call made before the limit has its result.
    assert_eq!(history.len(), 5);
    assert_eq!(history[4].role, Role::User);
}

#[tokio::test]
async fn a_model_error_keeps_the_history_consistent() {
    let model = ScriptedModel::builder()
        .tool_call("add", json!({"a": 1, "b": 1}))
        .build();
    let agent = Agent::builder(model).tool(Add).expect("valid tool").build();
    let mut history = vec![Message::user("go")];
    let err = agent.run(&mut history).await.unwrap_err();
    assert!(matches!(err, RunError::Model { step: 2, .. }), "{err}");
    assert_eq!(history.len(), 3, "the call and its result were recorded");
}

#[test]
fn a_bad_tool_name_is_rejected_when_the_agent_is_built() {
    struct Bad;
    impl Tool for Bad {
        const NAME: &'static str = "bad name!";
        type Args = AddArgs;
        type Output = i64;
        type Error = Infallible;
        fn description(&self) -> String {
            String::new()
        }
        async fn call(&self, _: AddArgs, _: &ToolContext<'_>) -> Result<i64, Infallible> {
            Ok(0)
        }
    }
    let err = Agent::builder(ScriptedModel::new([]))
        .tool(Bad)
        .unwrap_err();
    assert!(err.to_string().contains("invalid tool name"), "{err}");
    let dup = Agent::builder(ScriptedModel::new([]))
        .tool(Add)
        .and_then(|b| b.tool(Add))
        .unwrap_err();
    assert!(dup.to_string().contains("duplicate tool name"), "{dup}");
}
