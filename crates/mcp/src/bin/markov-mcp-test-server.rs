//! `markov-mcp-test-server`: a markov tool registry served over MCP on
//! stdio, for the crate's own tests and benchmarks (and as the smallest
//! example of [`McpToolServer`]).
//!
//! Its tools: `add` (two integers), `echo_key` (the idempotency key the
//! call carried), `fail` (always an error), `sleep` (waits `ms`
//! milliseconds), `die` (the process exits in the middle of the call) and
//! `pid` (the server's process id, to tell a restarted child from the
//! first).
//!
//! With the argument `deep-schema` it is no registry but a misbehaving
//! server written by hand: it answers the handshake, then lists one tool
//! whose input schema nests 3 000 levels deep, a message no JSON parser
//! with a recursion limit reads.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use markov_core::async_trait;
use markov_core::tool::{DynTool, ToolCallError, ToolContext, ToolDefinition, ToolOutcome};
use markov_mcp::McpToolServer;
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata, ToolRegistry};
use serde_json::{Value, json};

/// What a test tool does with its arguments and context: a plain function
/// pointer per tool (so the table below is a list of closures without
/// captures), its future boxed because each closure's has its own type.
type Run = fn(&Value, Option<&str>) -> BoxFuture<'static, Result<Value, String>>;

/// A tool written as a function over JSON.
struct FnTool {
    definition: ToolDefinition,
    run: Run,
}

impl std::fmt::Debug for FnTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnTool")
            .field("name", &self.definition.name)
            .finish()
    }
}

#[async_trait]
impl DynTool for FnTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        (self.run)(input, cx.idempotency_key())
            .await
            .map(ToolOutcome::Value)
            .map_err(ToolCallError::Execution)
    }
}

fn int(input: &Value, key: &str) -> i64 {
    input.get(key).and_then(Value::as_i64).unwrap_or_default()
}

fn tools() -> Vec<(&'static str, &'static str, Value, Run)> {
    let none = json!({"type": "object", "properties": {}});
    vec![
        (
            "add",
            "Adds two integers.",
            json!({
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"]
            }),
            |input, _| {
                let sum = int(input, "a") + int(input, "b");
                Box::pin(async move { Ok(json!(sum)) })
            },
        ),
        (
            "echo_key",
            "Returns the idempotency key of the call.",
            none.clone(),
            |_, key| {
                let key = json!(key);
                Box::pin(async move { Ok(key) })
            },
        ),
        ("fail", "Always fails.", none.clone(), |_, _| {
            Box::pin(async { Err("the tool failed on purpose".to_owned()) })
        }),
        (
            "sleep",
            "Waits `ms` milliseconds.",
            json!({"type": "object", "properties": {"ms": {"type": "integer"}}, "required": ["ms"]}),
            |input, _| {
                let ms = int(input, "ms").max(0) as u64;
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(json!("slept"))
                })
            },
        ),
        ("die", "Exits the server mid-call.", none.clone(), |_, _| {
            Box::pin(async { std::process::exit(3) })
        }),
        ("pid", "The server's process id.", none, |_, _| {
            let pid = std::process::id();
            Box::pin(async move { Ok(json!(pid)) })
        }),
    ]
}

/// The `deep-schema` server: reads requests line by line on stdin and
/// answers `initialize` and `tools/list`, the listing nested too deep.
fn deep_schema() -> ExitCode {
    use std::io::{BufRead, Write};
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else {
            return ExitCode::FAILURE;
        };
        let Ok(request) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        let answer = match request.get("method").and_then(Value::as_str) {
            Some("initialize") => json!({
                "jsonrpc": "2.0", "id": id,
                "result": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "deep-schema", "version": "0"}
                }
            })
            .to_string(),
            Some("tools/list") => {
                // Written as text: building the value would recurse as deep.
                let depth = 3000;
                format!(
                    r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":[{{"name":"deep","inputSchema":{{"type":"object","properties":{{"x":{}1{}}}}}}}]}}}}"#,
                    r#"{"a":"#.repeat(depth),
                    "}".repeat(depth)
                )
            }
            _ => continue,
        };
        if writeln!(stdout, "{answer}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("deep-schema") {
        return deep_schema();
    }
    let mut builder = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED));
    for (name, description, schema, run) in tools() {
        let definition = match ToolDefinition::new(name, description, schema) {
            Ok(d) => d,
            Err(err) => {
                eprintln!("bad tool {name}: {err}");
                return ExitCode::FAILURE;
            }
        };
        builder = builder.register_shared(
            Arc::new(FnTool { definition, run }),
            ToolMetadata::new(Category::Other),
        );
    }
    let registry = match builder.lock() {
        Ok(r) => r,
        Err(err) => {
            eprintln!("bad registry: {err}");
            return ExitCode::FAILURE;
        }
    };
    match McpToolServer::new(Arc::new(registry))
        .name("markov-mcp-test-server")
        .serve_stdio()
        .await
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{err}");
            ExitCode::FAILURE
        }
    }
}
