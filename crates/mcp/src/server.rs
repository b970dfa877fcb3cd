//! The server: a markov tool registry, with its policies, served over MCP.
//!
//! [`McpToolServer`] answers `tools/list` with the registry's definitions
//! (exactly what a model would be offered; a [`Category::Retrieval`] tool
//! marked `readOnlyHint: true`, any other `false`) and `tools/call`
//! through the registry's stack, so every policy applies to calls from
//! other agents and IDEs as to a machine's. A successful call's result is
//! the tool's output as one text block (the registry's `{"ok":true,..}`
//! envelope taken off, the value also as structured content when it is an
//! object); a refusal or a failure is the registry's error text (its error
//! envelope, with the error's type and whether a retry may help) with
//! `isError: true`.
//!
//! What one MCP session is to the registry:
//!
//! - the conversation is the registry's own ([`ToolRegistry::policy_state`]):
//!   its approvals and its ledger are shared by every session of the
//!   server. A caller over MCP cannot be paused, and each of its calls has
//!   a new id: serve tools that need approval from a registry configured
//!   with `ApprovalFlow::Token`, whose definitions offer the
//!   `confirmationToken` argument (the application approves a request the
//!   caller saw in an error result with
//!   `registry.policy_state().approvals()`, and the caller calls again with
//!   its id);
//! - the turn's budget counters belong to one MCP session (a stdio server
//!   has one; each Streamable HTTP session has its own);
//! - each call gets a fresh call id, and the idempotency key the caller sent
//!   in `_meta` under [`IDEMPOTENCY_META_KEY`], if any, is the tool's
//!   [`ToolContext::idempotency_key`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use markov_core::ToolCallId;
use markov_core::tool::{NoState, ToolContext};
use markov_policy::{Category, EnvelopeMode, Mode, ToolRegistry, TurnBudgetState};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::{IDEMPOTENCY_META_KEY, McpError};

/// A tool registry served over MCP (stdio or Streamable HTTP).
#[derive(Debug, Clone)]
pub struct McpToolServer {
    registry: Arc<ToolRegistry>,
    mode: Mode,
    name: String,
    turn: Arc<TurnBudgetState>,
    next_call: Arc<AtomicU64>,
}

impl McpToolServer {
    /// Serves `registry`'s tools, in mode [`Mode::TEXT`].
    pub fn new(registry: Arc<ToolRegistry>) -> Self {
        McpToolServer {
            registry,
            mode: Mode::TEXT,
            name: "markov".to_owned(),
            turn: Arc::new(TurnBudgetState::new()),
            next_call: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Runs calls in `mode` (the registry's mode rules apply).
    #[must_use]
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The name the server gives in the MCP handshake.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The registry served.
    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// The same server with counters of its own: one MCP session's.
    fn session(&self) -> Self {
        McpToolServer {
            turn: Arc::new(TurnBudgetState::new()),
            ..self.clone()
        }
    }

    /// Serves one MCP session on this process's stdin and stdout until the
    /// client leaves.
    pub async fn serve_stdio(self) -> Result<(), McpError> {
        let running = self
            .session()
            .serve(rmcp::transport::stdio())
            .await
            .map_err(|e| McpError::Serve(e.to_string()))?;
        running
            .waiting()
            .await
            .map_err(|e| McpError::Serve(e.to_string()))?;
        Ok(())
    }

    /// The Streamable HTTP endpoint as a Tower service, one session per
    /// client; mount it with `axum::Router::nest_service("/mcp", ..)`.
    /// Cancelling `shutdown` ends every session. Only loopback `Host`
    /// headers are accepted (rmcp's defence against DNS rebinding); a
    /// public server passes its own `config`
    /// ([`http_service_with`](Self::http_service_with)).
    pub fn http_service(
        &self,
        shutdown: CancellationToken,
    ) -> StreamableHttpService<McpToolServer, LocalSessionManager> {
        self.http_service_with(
            StreamableHttpServerConfig::default().with_cancellation_token(shutdown),
        )
    }

    /// [`http_service`](Self::http_service) with rmcp's whole configuration.
    pub fn http_service_with(
        &self,
        config: StreamableHttpServerConfig,
    ) -> StreamableHttpService<McpToolServer, LocalSessionManager> {
        let server = self.clone();
        StreamableHttpService::new(
            move || Ok(server.session()),
            LocalSessionManager::default().into(),
            config,
        )
    }

    /// Serves the endpoint at `/mcp` on `listener` until `shutdown` is
    /// cancelled, with `TCP_NODELAY` on every connection.
    pub async fn serve_http(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> Result<(), McpError> {
        use axum::serve::ListenerExt;

        let router =
            axum::Router::new().nest_service("/mcp", self.http_service(shutdown.child_token()));
        // Without TCP_NODELAY a small response waits for the client's
        // delayed acknowledgement: some 40 ms a call.
        let listener = listener.tap_io(|tcp| {
            if let Err(err) = tcp.set_nodelay(true) {
                tracing::debug!(%err, "cannot set TCP_NODELAY");
            }
        });
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
            .map_err(|e| McpError::Serve(e.to_string()))
    }

    /// The registry's definitions as MCP tools.
    fn list(&self) -> Vec<Tool> {
        self.registry
            .definitions()
            .into_iter()
            .map(|def| {
                let schema = match def.input_schema {
                    Value::Object(map) => map,
                    _ => serde_json::Map::from_iter([("type".to_owned(), Value::from("object"))]),
                };
                // A retrieval tool changes nothing: said as `readOnlyHint`,
                // so a client's approvals can follow it.
                let read_only = self
                    .registry
                    .metadata(def.name.as_str())
                    .is_some_and(|m| m.category() == Category::Retrieval);
                let mut annotations = ToolAnnotations::default();
                annotations.read_only_hint = Some(read_only);
                let mut tool = Tool::new(
                    def.name.as_str().to_owned(),
                    def.description,
                    Arc::new(schema),
                );
                tool.annotations = Some(annotations);
                tool
            })
            .collect()
    }

    /// One call through the registry's stack.
    async fn call(&self, request: CallToolRequestParams) -> CallToolResult {
        let key = request
            .meta
            .as_ref()
            .and_then(|meta| meta.0.0.get(IDEMPOTENCY_META_KEY))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let n = self.next_call.fetch_add(1, Ordering::Relaxed);
        let call_id = ToolCallId::new(format!("mcp-{n}"));
        let input = Value::Object(request.arguments.unwrap_or_default());
        let state = NoState::default();
        let make_key = move || key.clone().unwrap_or_default();
        let caller_key = markov_core::tool::IdempotencyKey::new(&make_key);
        let mut cx = ToolContext::new(&call_id, &[], &state);
        if !caller_key.get().is_empty() {
            cx = cx.with_idempotency_key(&caller_key);
        }
        let executed = self
            .registry
            .execute((&self.mode, &self.turn), &call_id, &request.name, input, cx)
            .await;
        if executed.result.is_error {
            return CallToolResult::error(vec![ContentBlock::text(executed.result.content)]);
        }
        let enveloped = self.registry.envelope() == EnvelopeMode::On;
        success(executed.result.content, enveloped)
    }
}

/// A successful result: the envelope's `data` (when the registry wraps
/// results) as the text, and as structured content when it is an object.
fn success(content: String, enveloped: bool) -> CallToolResult {
    let data = if enveloped {
        match serde_json::from_str::<Value>(&content) {
            Ok(Value::Object(mut envelope)) if envelope.get("ok") == Some(&Value::Bool(true)) => {
                envelope.remove("data")
            }
            _ => None,
        }
    } else {
        None
    };
    match data {
        Some(Value::String(text)) => CallToolResult::success(vec![ContentBlock::text(text)]),
        Some(data) => {
            let mut result = CallToolResult::success(vec![ContentBlock::text(data.to_string())]);
            if data.is_object() {
                result.structured_content = Some(data);
            }
            result
        }
        None => CallToolResult::success(vec![ContentBlock::text(content)]),
    }
}

impl ServerHandler for McpToolServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new(self.name.clone(), env!("CARGO_PKG_VERSION")),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.list()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(CallToolResponse::Complete(self.call(request).await))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.list().into_iter().find(|t| t.name == name)
    }
}
