//! Offered names: two of a server's tools whose names clash once made safe
//! for providers are both offered, the second under a stable suffix.

use std::sync::Arc;

use markov_core::ToolCallId;
use markov_core::tool::{NoState, ToolContext};
use markov_mcp::McpClient;
use markov_mcp::McpServerConfig;
use markov_mcp::rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use markov_mcp::rmcp::service::RequestContext;
use markov_mcp::rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use markov_mcp::rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService,
};
use markov_mcp::rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::json;

use crate::common::serve;

/// A server with `files_read` and `files.read`, in this order unless `reversed`.
#[derive(Debug, Clone)]
struct Clashing {
    reversed: bool,
}

impl ServerHandler for Clashing {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("clashing", "0.0.0"))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = Arc::new(
            json!({"type": "object", "properties": {}})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        );
        let mut tools = vec![
            Tool::new("files_read", "Underscored.", Arc::clone(&schema)),
            Tool::new("files.read", "Dotted.", schema),
        ];
        if self.reversed {
            tools.reverse();
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(CallToolResponse::Complete(CallToolResult::success(vec![
            ContentBlock::text(format!("called {}", request.name)),
        ])))
    }
}

/// The offered names and what each calls, sorted.
async fn offered(reversed: bool) -> Vec<(String, String)> {
    let server = serve("127.0.0.1:0", None, move |stop| {
        axum::Router::new().nest_service(
            "/mcp",
            StreamableHttpService::new(
                move || Ok(Clashing { reversed }),
                Arc::new(LocalSessionManager::default()),
                StreamableHttpServerConfig::default()
                    .with_cancellation_token(stop)
                    .with_sse_keep_alive(None),
            ),
        )
    })
    .await;
    let client = McpClient::connect(McpServerConfig::http(&server.url))
        .await
        .expect("connects");
    let mut out = Vec::new();
    for tool in client.tools().await.expect("lists") {
        let id = ToolCallId::new("c1");
        let state = NoState::default();
        let answer = tool
            .call_json(&json!({}), ToolContext::new(&id, &[], &state))
            .await
            .expect("calls")
            .model_text("");
        out.push((tool.definition().name.as_str().to_owned(), answer));
    }
    out.sort();
    client.close().await;
    server.shutdown().await;
    out
}

#[tokio::test]
async fn clashing_names_are_both_offered_the_same_way_in_any_order() {
    let first = offered(false).await;
    assert_eq!(first.len(), 2, "{first:?}");
    // `files.read` sorts before `files_read`: it keeps the plain name.
    assert_eq!(
        first[0],
        ("files_read".to_owned(), "called files.read".to_owned())
    );
    assert!(
        first[1].0.starts_with("files_read_") && first[1].1 == "called files_read",
        "{first:?}"
    );
    assert_eq!(offered(true).await, first);
}
