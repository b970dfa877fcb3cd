//! Figure 10: the cost of a tool call through MCP beside a native one.
//!
//! The same `add` tool is called through its `DynTool` form three ways,
//! sequentially, with the same arguments: natively (the tool in process),
//! through markov-mcp over stdio (this binary started again as a child,
//! `markov-bench mcp-server`, serving the tool with `McpToolServer`), and
//! over Streamable HTTP on a loopback port (the same server in process).
//! What the MCP columns add to the native one is the protocol's cost:
//! JSON-RPC encoding, the pipe or the HTTP round trip, the server's
//! registry stack and the result's mapping.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::{
    DynTool, NoState, SharedTool, ToolCallError, ToolContext, ToolDefinition, ToolOutcome,
};
use markov_mcp::{McpClient, McpServerConfig, McpToolServer};
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata, ToolRegistry};
use serde_json::{Value, json};

use crate::Stats;

/// The figure: per-call statistics of each path.
#[derive(Debug)]
pub(crate) struct McpFigure {
    pub(crate) native: Stats,
    pub(crate) stdio: Option<Stats>,
    pub(crate) http: Option<Stats>,
}

/// `add`, written against the erased trait so both sides share it.
#[derive(Debug)]
struct Add(ToolDefinition);

#[async_trait]
impl DynTool for Add {
    fn definition(&self) -> &ToolDefinition {
        &self.0
    }

    async fn call_json(
        &self,
        input: &Value,
        _cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let sum = input["a"].as_i64().unwrap_or(0) + input["b"].as_i64().unwrap_or(0);
        Ok(ToolOutcome::Value(json!(sum)))
    }
}

fn add() -> SharedTool {
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]
    });
    match ToolDefinition::new("add", "Adds two integers.", schema) {
        Ok(def) => Arc::new(Add(def)),
        // A constant, valid name.
        Err(err) => unreachable!("{err}"),
    }
}

fn server() -> Result<McpToolServer, String> {
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register_shared(add(), ToolMetadata::new(Category::Other))
        .lock()
        .map_err(|e| e.to_string())?;
    Ok(McpToolServer::new(Arc::new(registry)))
}

/// A single-threaded runtime with I/O and timers (pipes, sockets, timeouts).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread tokio runtime starts")
}

/// `markov-bench mcp-server`: the stdio side of the figure.
pub(crate) fn serve_stdio() -> ExitCode {
    let runtime = runtime();
    let served =
        server().and_then(|s| runtime.block_on(s.serve_stdio()).map_err(|e| e.to_string()));
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Times `calls` sequential calls of `tool`, after a few untimed ones.
async fn time(tool: &SharedTool, calls: usize) -> Result<Stats, String> {
    let id = ToolCallId::new("bench");
    let state = NoState::default();
    let input = json!({"a": 2, "b": 3});
    let mut times = Vec::with_capacity(calls);
    for i in 0..calls + 20 {
        let start = Instant::now();
        let out = tool
            .call_json(&input, ToolContext::new(&id, &[], &state))
            .await
            .map_err(|e| e.to_string())?;
        let elapsed = start.elapsed();
        std::hint::black_box(out);
        if i >= 20 {
            times.push(elapsed);
        }
    }
    Ok(Stats::of(&times))
}

/// The first tool of an MCP client.
async fn first_tool(client: &McpClient) -> Result<SharedTool, String> {
    client
        .tools()
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .next()
        .ok_or_else(|| "the server offers no tool".to_owned())
}

/// Figure 10, printing its machine-readable line.
pub(crate) fn figure(calls: usize) -> McpFigure {
    let runtime = runtime();
    runtime.block_on(async {
        let native = time(&add(), calls).await.unwrap_or_else(|e| {
            eprintln!("native add failed: {e}");
            Stats::of(&[])
        });
        let stdio = async {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let client = McpClient::connect(
                McpServerConfig::stdio(exe, ["mcp-server"]).call_timeout(Duration::from_secs(10)),
            )
            .await
            .map_err(|e| e.to_string())?;
            let stats = time(&first_tool(&client).await?, calls).await;
            client.close().await;
            stats
        }
        .await;
        let http = async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| e.to_string())?;
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            let stop = tokio_util::sync::CancellationToken::new();
            let serving = tokio::spawn(server()?.serve_http(listener, stop.clone()));
            let client = McpClient::connect(
                McpServerConfig::http(format!("http://{addr}/mcp"))
                    .call_timeout(Duration::from_secs(10)),
            )
            .await
            .map_err(|e| e.to_string())?;
            let stats = time(&first_tool(&client).await?, calls).await;
            client.close().await;
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), serving).await;
            stats
        }
        .await;
        let report = |name: &str, r: &Result<Stats, String>| match r {
            Ok(s) => format!(
                "{name}_median_us={:.1} {name}_p90_us={:.1}",
                s.median_us, s.p90_us
            ),
            Err(e) => {
                eprintln!("mcp {name} failed: {e}");
                format!("{name}_skipped=\"{e}\"")
            }
        };
        println!(
            "bench=mcp calls={calls} native_median_us={:.2} {} {}",
            native.median_us,
            report("stdio", &stdio),
            report("http", &http)
        );
        McpFigure {
            native,
            stdio: stdio.ok(),
            http: http.ok(),
        }
    })
}
