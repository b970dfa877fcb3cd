//! MCP tools in a registry: the policies apply to them as to any tool.

use std::sync::Arc;

use markov_charter::node::Node;
use markov_core::ToolCallId;
use markov_core::tool::{NoState, ToolContext};
use markov_executor::Agent;
use markov_mcp::{Approval, McpClient};
use markov_policy::{
    ApprovalFlow, ApprovalId, Budget, CONFIRMATION_TOKEN, Mode, PolicyConfig, ToolMetadata,
    ToolRegistry, ToolRegistryBuilder, TurnBudgetState,
};
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

use crate::common::*;

async fn registry_builder(
    client: &McpClient,
    budget: Budget,
    metadata: impl Fn(&markov_mcp::McpTool) -> ToolMetadata,
) -> ToolRegistryBuilder {
    client
        .register(ToolRegistry::builder(PolicyConfig::new(budget)), metadata)
        .await
        .expect("registers")
}

async fn registry(
    client: &McpClient,
    budget: Budget,
    metadata: impl Fn(&markov_mcp::McpTool) -> ToolMetadata,
) -> Arc<ToolRegistry> {
    registry_with(client, PolicyConfig::new(budget), metadata).await
}

async fn registry_with(
    client: &McpClient,
    config: PolicyConfig,
    metadata: impl Fn(&markov_mcp::McpTool) -> ToolMetadata,
) -> Arc<ToolRegistry> {
    Arc::new(
        client
            .register(ToolRegistry::builder(config), metadata)
            .await
            .expect("registers")
            .lock()
            .expect("locks"),
    )
}

#[tokio::test]
async fn a_mode_refusal_and_a_schema_invalid_call_never_reach_the_server() {
    // The test server gives no annotations: trusted here, so no call waits
    // for an approval.
    let client = McpClient::connect(stdio_config().approval(Approval::None))
        .await
        .expect("connects");
    let registry = registry_builder(&client, Budget::UNLIMITED, |tool| {
        let meta = McpClient::default_metadata(tool);
        if tool.remote_name() == "die" {
            meta.with_modes([Mode::VOICE])
        } else {
            meta
        }
    })
    .await;
    let mut node = Node::builder("Use your tools.").name("main");
    for tool in client.tools().await.expect("lists") {
        node = node.shared_tool(tool);
    }
    let model = ScriptedModel::builder()
        .tool_calls([
            ("die", json!({})),
            ("add", json!({"a": 1})),
            ("add", json!({"a": 1, "b": 2})),
        ])
        .text("done")
        .build();
    let mut machine = Agent::builder("mcp")
        .node("main", node.build().expect("node builds"))
        .model(model)
        .registry(registry)
        .build()
        .expect("agent builds")
        .machine();
    machine.enqueue_user("go");
    machine.run().await.expect("runs");
    let results = results(machine.history());
    assert_eq!(
        error_type(&results[0].0).as_deref(),
        Some("MODE_RESTRICTED")
    );
    assert_eq!(error_type(&results[1].0).as_deref(), Some("INVALID_INPUT"));
    // `die` never ran: the server still answers.
    assert_eq!(results[2], (r#"{"ok":true,"data":"3"}"#.to_owned(), false));
    client.close().await;
}

#[tokio::test]
async fn an_mcp_tool_that_needs_confirmation_runs_only_after_the_approval() {
    let client = McpClient::connect(stdio_config()).await.expect("connects");
    // Called without a machine that could pause: the model-mediated flow.
    let registry = registry_with(
        &client,
        PolicyConfig::new(Budget::UNLIMITED).approval_flow(ApprovalFlow::Token),
        |tool| McpClient::default_metadata(tool).with_confirmation(),
    )
    .await;
    let turn = TurnBudgetState::new();
    let state = NoState::default();
    let run = |id: &'static str, input: Value| {
        let registry = Arc::clone(&registry);
        let turn = &turn;
        let state = &state;
        async move {
            let call_id = ToolCallId::new(id);
            registry
                .execute(
                    (&Mode::TEXT, turn),
                    &call_id,
                    "add",
                    input,
                    ToolContext::new(&call_id, &[], state),
                )
                .await
                .result
        }
    };
    let first = run("c1", json!({"a": 1, "b": 2})).await;
    assert!(first.is_error);
    assert_eq!(
        error_type(&first.content).as_deref(),
        Some("CONFIRMATION_REQUIRED")
    );
    let envelope: Value = serde_json::from_str(&first.content).expect("json");
    let id = envelope["error"]["confirmation_request"]["request_id"]
        .as_str()
        .expect("a request id")
        .to_owned();
    registry
        .policy_state()
        .approvals()
        .approve(&ApprovalId::from(id.as_str()))
        .expect("the user approves");
    let second = run("c2", json!({"a": 1, "b": 2, CONFIRMATION_TOKEN: id})).await;
    assert!(!second.is_error, "{}", second.content);
    assert_eq!(second.content, r#"{"ok":true,"data":"3"}"#);
    client.close().await;
}

#[tokio::test]
async fn a_budget_caps_mcp_calls_per_turn() {
    let client = McpClient::connect(stdio_config().approval(Approval::None))
        .await
        .expect("connects");
    let registry = registry(
        &client,
        Budget::UNLIMITED.max_calls(1),
        McpClient::default_metadata,
    )
    .await;
    let turn = TurnBudgetState::new();
    let state = NoState::default();
    let mut kinds = Vec::new();
    for id in ["c1", "c2"] {
        let call_id = ToolCallId::new(id);
        let executed = registry
            .execute(
                (&Mode::TEXT, &turn),
                &call_id,
                "pid",
                json!({}),
                ToolContext::new(&call_id, &[], &state),
            )
            .await;
        kinds.push(error_type(&executed.result.content));
    }
    assert_eq!(kinds[0], None);
    assert!(kinds[1].is_some(), "the second call is over budget");
    client.close().await;
}
