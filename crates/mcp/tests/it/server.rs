//! markov tools served over MCP: a registry behind `McpToolServer`, over
//! Streamable HTTP on a loopback port, read back with markov's client.

use std::sync::Arc;

use markov_core::ToolCallId;
use markov_core::tool::{NoState, SharedTool, ToolContext, ToolDefinition, ToolOutcome};
use markov_mcp::{McpClient, McpServerConfig, McpToolServer};
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata, ToolRegistry};
use serde_json::json;

use crate::common::*;

/// `upper`: the text in capitals, registered as a plain markov tool.
#[derive(Debug)]
struct Upper(ToolDefinition);

#[markov_core::async_trait]
impl markov_core::tool::DynTool for Upper {
    fn definition(&self) -> &ToolDefinition {
        &self.0
    }

    async fn call_json(
        &self,
        input: &serde_json::Value,
        _cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, markov_core::tool::ToolCallError> {
        let text = input["text"].as_str().unwrap_or_default().to_uppercase();
        Ok(ToolOutcome::Value(json!(text)))
    }
}

#[tokio::test]
async fn a_registry_served_over_http_lists_and_runs_its_tools_under_its_policies() {
    let upper = ToolDefinition::new(
        "upper",
        "Capitals.",
        json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
    )
    .expect("a valid name");
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register_shared(Arc::new(Upper(upper)), ToolMetadata::new(Category::Other))
        .lock()
        .expect("locks");
    let server = McpToolServer::new(Arc::new(registry));
    let running = serve("127.0.0.1:0", None, |stop| {
        axum::Router::new().nest_service("/mcp", server.http_service(stop))
    })
    .await;

    let client = McpClient::connect(McpServerConfig::http(&running.url))
        .await
        .expect("connects");
    let tools: Vec<SharedTool> = client.tools().await.expect("lists");
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0].definition().name.as_str(), "upper");
    assert_eq!(
        tools[0].definition().input_schema["required"],
        json!(["text"])
    );
    let id = ToolCallId::new("c1");
    let state = NoState::default();
    let cx = || ToolContext::new(&id, &[], &state);
    assert_eq!(
        tools[0].call_json(&json!({"text": "mcp"}), cx()).await,
        Ok(ToolOutcome::Value(json!("MCP")))
    );
    // The served registry validates: an error result, the tool never ran.
    let invalid = tools[0].call_json(&json!({}), cx()).await;
    assert!(
        matches!(&invalid, Err(markov_core::tool::ToolCallError::Execution(t)) if t.contains("INVALID_INPUT")),
        "{invalid:?}"
    );
    // An unknown tool is the registry's answer too.
    let raw = client
        .call_raw("nope", serde_json::Map::new(), None)
        .await
        .expect("answers");
    assert_eq!(raw.is_error, Some(true));
    client.close().await;
    running.shutdown().await;
}

#[tokio::test]
async fn a_served_retrieval_tool_is_read_only_and_runs_without_approval_on_the_client() {
    let tool = |name: &str| {
        Arc::new(Upper(
            ToolDefinition::new(name, "Capitals.", json!({"type": "object"})).expect("valid"),
        ))
    };
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register_shared(tool("peek"), ToolMetadata::new(Category::Retrieval))
        .register_shared(tool("poke"), ToolMetadata::new(Category::Action))
        .lock()
        .expect("locks");
    let server = McpToolServer::new(Arc::new(registry));
    let running = serve("127.0.0.1:0", None, |stop| {
        axum::Router::new().nest_service("/mcp", server.http_service(stop))
    })
    .await;
    let client = McpClient::connect(McpServerConfig::http(&running.url))
        .await
        .expect("connects");
    let tools = client.mcp_tools().await.expect("lists");
    let decided: Vec<(&str, Option<bool>, bool)> = tools
        .iter()
        .map(|t| (t.remote_name(), t.read_only(), t.approval().required))
        .collect();
    assert_eq!(
        decided,
        [("peek", Some(true), false), ("poke", Some(false), true)]
    );
    client.close().await;
    running.shutdown().await;
}
