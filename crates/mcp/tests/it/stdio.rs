//! The client over stdio, against the crate's test server started as a
//! child process.

use std::sync::Arc;
use std::time::Duration;

use markov_charter::node::Node;
use markov_core::ToolCallId;
use markov_core::tool::{NoState, SharedTool, ToolCallError, ToolContext, ToolOutcome};
use markov_executor::Agent;
use markov_mcp::{McpClient, McpError, ToolFilter};
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

use crate::common::*;

fn find(tools: &[SharedTool], name: &str) -> SharedTool {
    tools
        .iter()
        .find(|t| t.definition().name.as_str() == name)
        .cloned()
        .unwrap_or_else(|| panic!("{name} is offered"))
}

async fn call(tool: &SharedTool, input: Value) -> Result<ToolOutcome, ToolCallError> {
    let id = ToolCallId::new("c1");
    let state = NoState::default();
    tool.call_json(&input, ToolContext::new(&id, &[], &state))
        .await
}

#[tokio::test]
async fn lists_the_servers_tools_with_their_schemas_and_calls_them() {
    let client = McpClient::connect(stdio_config()).await.expect("connects");
    let tools = client.tools().await.expect("lists");
    let names: Vec<&str> = tools.iter().map(|t| t.definition().name.as_str()).collect();
    assert_eq!(names, ["add", "echo_key", "fail", "sleep", "die", "pid"]);
    let add = find(&tools, "add");
    assert_eq!(add.definition().description, "Adds two integers.");
    assert_eq!(add.definition().input_schema["required"], json!(["a", "b"]));
    assert_eq!(
        call(&add, json!({"a": 2, "b": 3})).await,
        Ok(ToolOutcome::Value(json!("5")))
    );
    client.close().await;
}

#[tokio::test]
async fn prefix_and_filter_choose_the_offered_names() {
    let client = McpClient::connect(
        stdio_config().prefix("t_").filter(
            ToolFilter::default()
                .allow(["add", "fail", "die"])
                .deny(["die"]),
        ),
    )
    .await
    .expect("connects");
    let tools = client.tools().await.expect("lists");
    let names: Vec<&str> = tools.iter().map(|t| t.definition().name.as_str()).collect();
    assert_eq!(names, ["t_add", "t_fail"]);
    // The server is called by its own name.
    assert_eq!(
        call(&find(&tools, "t_add"), json!({"a": 1, "b": 1})).await,
        Ok(ToolOutcome::Value(json!("2")))
    );
    client.close().await;
}

#[tokio::test]
async fn a_schema_invalid_call_and_an_erroring_tool_are_error_results() {
    let client = McpClient::connect(stdio_config()).await.expect("connects");
    let tools = client.tools().await.expect("lists");
    // The server's registry refuses the call before its tool runs.
    let Err(ToolCallError::Execution(text)) = call(&find(&tools, "add"), json!({"a": 1})).await
    else {
        panic!("a missing argument is an error");
    };
    assert!(text.contains("INVALID_INPUT"), "{text}");
    let Err(ToolCallError::Execution(text)) = call(&find(&tools, "fail"), json!({})).await else {
        panic!("fail fails");
    };
    assert!(text.contains("the tool failed on purpose"), "{text}");
    client.close().await;
}

#[tokio::test]
async fn a_server_that_dies_mid_call_is_an_error_result_and_the_next_call_restarts_it() {
    let client = McpClient::connect(stdio_config()).await.expect("connects");
    let tools = client.tools().await.expect("lists");
    let Ok(ToolOutcome::Value(first_pid)) = call(&find(&tools, "pid"), json!({})).await else {
        panic!("pid answers");
    };
    let died = tokio::time::timeout(
        Duration::from_secs(10),
        call(&find(&tools, "die"), json!({})),
    )
    .await
    .expect("a dead child does not hang the call");
    let Err(ToolCallError::Execution(text)) = died else {
        panic!("a dead child is an error result: {died:?}");
    };
    assert!(text.contains("closed"), "{text}");
    let Ok(ToolOutcome::Value(second_pid)) = call(&find(&tools, "pid"), json!({})).await else {
        panic!("the next call restarts the child");
    };
    assert_ne!(first_pid, second_pid);
    client.close().await;
}

#[tokio::test]
async fn a_call_past_its_timeout_is_an_error_result_and_the_session_goes_on() {
    let client = McpClient::connect(stdio_config().call_timeout(Duration::from_millis(200)))
        .await
        .expect("connects");
    let tools = client.tools().await.expect("lists");
    let Err(ToolCallError::Execution(text)) =
        call(&find(&tools, "sleep"), json!({"ms": 5000})).await
    else {
        panic!("a slow call times out");
    };
    assert!(text.contains("did not finish within 200 ms"), "{text}");
    assert_eq!(
        call(&find(&tools, "add"), json!({"a": 1, "b": 2})).await,
        Ok(ToolOutcome::Value(json!("3")))
    );
    client.close().await;
}

#[tokio::test]
async fn a_closed_client_refuses_calls_and_a_bad_command_is_an_error() {
    let client = McpClient::connect(stdio_config()).await.expect("connects");
    let tools = client.tools().await.expect("lists");
    client.close().await;
    let Err(ToolCallError::Execution(text)) = call(&find(&tools, "pid"), json!({})).await else {
        panic!("closed");
    };
    assert!(text.contains("closed"), "{text}");

    let err = McpClient::connect(markov_mcp::McpServerConfig::stdio(
        "/nonexistent/markov-mcp-server",
        Vec::<String>::new(),
    ))
    .await
    .expect_err("no such program");
    assert!(matches!(err, McpError::Spawn { .. }), "{err}");
}

#[tokio::test]
async fn a_machine_offers_and_calls_mcp_tools_and_passes_the_idempotency_key() {
    let client = McpClient::connect(stdio_config()).await.expect("connects");
    let mut node = Node::builder("Use your tools.").name("main");
    for tool in client.tools().await.expect("lists") {
        node = node.shared_tool(tool);
    }
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([("add", json!({"a": 20, "b": 22})), ("echo_key", json!({}))])
            .text("42")
            .build(),
    );
    let mut machine = Agent::builder("mcp")
        .node("main", node.build().expect("node builds"))
        .shared_model(model.clone())
        .build()
        .expect("agent builds")
        .machine();
    machine.enqueue_user("add");
    let last = machine.run().await.expect("runs");
    assert!(last.done);
    let offered: Vec<String> = model.requests()[0]
        .tools
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    assert!(offered.contains(&"add".to_owned()), "{offered:?}");
    let results = results(machine.history());
    assert_eq!(results[0], ("42".to_owned(), false));
    let (key, is_error) = &results[1];
    assert!(!is_error);
    assert!(
        !key.is_empty() && key != "null",
        "the idempotency key reached the server: {key}"
    );
    client.close().await;
}
