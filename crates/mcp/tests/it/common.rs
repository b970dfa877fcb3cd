//! Shared helpers: the stdio test server's configuration, an rmcp server
//! of our own on a loopback port, and a machine over MCP tools.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use markov_core::message::{Item, Message};
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
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The crate's stdio test server.
pub(crate) fn stdio_config() -> McpServerConfig {
    McpServerConfig::stdio(
        env!("CARGO_BIN_EXE_markov-mcp-test-server"),
        Vec::<String>::new(),
    )
    .connect_timeout(Duration::from_secs(20))
}

/// An MCP server written on rmcp alone (not markov's), to test the
/// client against: `add` (structured content), `grow` (adds `extra` and
/// says the list changed), `boom` (a JSON-RPC error), `image`, `hang`.
#[derive(Debug, Clone, Default)]
pub(crate) struct RawServer {
    grown: Arc<AtomicBool>,
}

fn object(schema: Value) -> Arc<serde_json::Map<String, Value>> {
    match schema {
        Value::Object(map) => Arc::new(map),
        _ => Arc::new(serde_json::Map::new()),
    }
}

impl RawServer {
    fn tools(&self) -> Vec<Tool> {
        let none = json!({"type": "object", "properties": {}});
        // `add` declares its output, so its structured content is the value.
        let mut add = Tool::new(
            "add",
            "Adds two integers.",
            object(json!({
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"]
            })),
        );
        add.output_schema = Some(object(json!({
            "type": "object",
            "properties": {"sum": {"type": "integer"}},
            "required": ["sum"]
        })));
        let mut tools = vec![
            add,
            Tool::new("grow", "Adds a tool.", object(none.clone())),
            Tool::new("boom", "Fails with a protocol error.", object(none.clone())),
            Tool::new("image", "Returns a picture.", object(none.clone())),
            Tool::new("hang", "Never answers.", object(none.clone())),
            Tool::new(
                "ns.dotted",
                "A name providers refuse.",
                object(none.clone()),
            ),
        ];
        if self.grown.load(Ordering::SeqCst) {
            tools.push(Tool::new("extra", "Added by grow.", object(none)));
        }
        tools
    }
}

impl ServerHandler for RawServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_tool_list_changed()
                .build(),
        )
        .with_server_info(Implementation::new("raw", "0.0.0"))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let result = match &*request.name {
            "add" => {
                let (Some(a), Some(b)) = (
                    args.get("a").and_then(Value::as_i64),
                    args.get("b").and_then(Value::as_i64),
                ) else {
                    return Err(ErrorData::invalid_params("a and b must be integers", None));
                };
                let mut r = CallToolResult::success(vec![ContentBlock::text(
                    json!({"sum": a + b}).to_string(),
                )]);
                r.structured_content = Some(json!({"sum": a + b}));
                r
            }
            "grow" => {
                self.grown.store(true, Ordering::SeqCst);
                let _ = context.peer.notify_tool_list_changed().await;
                CallToolResult::success(vec![ContentBlock::text("grown")])
            }
            "boom" => return Err(ErrorData::internal_error("the server broke", None)),
            "image" => CallToolResult::success(vec![
                ContentBlock::text("a chart"),
                ContentBlock::image("aGVsbG8=", "image/png"),
            ]),
            "hang" => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                CallToolResult::success(vec![])
            }
            "ns.dotted" => CallToolResult::success(vec![ContentBlock::text("dotted")]),
            "extra" => CallToolResult::success(vec![ContentBlock::text("extra")]),
            other => {
                return Err(ErrorData::invalid_params(format!("no tool {other}"), None));
            }
        };
        Ok(CallToolResponse::Complete(result))
    }
}

/// A running loopback HTTP server.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) url: String,
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) stop: CancellationToken,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops the server and waits until it has.
    pub(crate) async fn shutdown(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

/// Serves the router `make` builds on `addr` (a loopback address), requiring
/// `Authorization: Bearer <bearer>` when given.
pub(crate) async fn serve(
    addr: &str,
    bearer: Option<&'static str>,
    make: impl Fn(CancellationToken) -> axum::Router,
) -> Running {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .expect("binds a loopback port");
    let addr = listener.local_addr().expect("an address");
    let stop = CancellationToken::new();
    let mut router = make(stop.child_token());
    if let Some(token) = bearer {
        router = router.layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| async move {
                let expected = format!("Bearer {token}");
                let ok = req
                    .headers()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    == Some(expected.as_str());
                if ok {
                    next.run(req).await
                } else {
                    axum::response::IntoResponse::into_response(
                        axum::http::StatusCode::UNAUTHORIZED,
                    )
                }
            },
        ));
    }
    let shutdown = stop.clone();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    });
    Running {
        url: format!("http://{addr}/mcp"),
        addr,
        stop,
        task,
    }
}

/// [`RawServer`] on a loopback port.
pub(crate) async fn raw_server(addr: &str, bearer: Option<&'static str>) -> Running {
    serve(addr, bearer, raw_server_router).await
}

/// A router serving [`RawServer`] at `/mcp`, until `stop`.
pub(crate) fn raw_server_router(stop: CancellationToken) -> axum::Router {
    let server = RawServer::default();
    axum::Router::new().nest_service(
        "/mcp",
        StreamableHttpService::new(
            move || Ok(server.clone()),
            Arc::new(LocalSessionManager::default()),
            StreamableHttpServerConfig::default()
                .with_cancellation_token(stop)
                .with_sse_keep_alive(None),
        ),
    )
}

/// Every tool result in `history`: (content, is_error).
pub(crate) fn results(history: &[Message]) -> Vec<(String, bool)> {
    history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|item| match item {
            Item::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error == Some(true))),
            _ => None,
        })
        .collect()
}

/// The `error.type` of an envelope.
pub(crate) fn error_type(content: &str) -> Option<String> {
    let v: Value = serde_json::from_str(content).ok()?;
    v["error"]["type"].as_str().map(str::to_owned)
}

/// What the log says while a [`Logs::capture`] guard is held, on this
/// thread (a `#[tokio::test]` runs its tasks there).
#[derive(Clone, Default)]
pub(crate) struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    /// Captures this thread's log, plain text, until the guard drops.
    pub(crate) fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(logs.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// Everything written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}
