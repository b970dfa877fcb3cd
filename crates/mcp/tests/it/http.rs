//! The client over Streamable HTTP, against an rmcp server (not markov's)
//! on a loopback port.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use markov_core::ToolCallId;
use markov_core::message::ImageData;
use markov_core::tool::{NoState, SharedTool, ToolCallError, ToolContext, ToolOutcome};
use markov_mcp::{McpClient, McpError, McpServerConfig};
use serde_json::{Value, json};

use crate::common::*;

async fn call(
    tools: &[SharedTool],
    name: &str,
    input: Value,
) -> Result<ToolOutcome, ToolCallError> {
    let tool = tools
        .iter()
        .find(|t| t.definition().name.as_str() == name)
        .unwrap_or_else(|| panic!("{name} is offered"));
    let id = ToolCallId::new("c1");
    let state = NoState::default();
    tool.call_json(&input, ToolContext::new(&id, &[], &state))
        .await
}

#[tokio::test]
async fn lists_and_calls_with_a_bearer_token_and_maps_the_content() {
    let server = raw_server("127.0.0.1:0", Some("s3cret")).await;
    let client = McpClient::connect(McpServerConfig::http(&server.url).bearer("s3cret"))
        .await
        .expect("connects with the token");
    let tools = client.tools().await.expect("lists");
    let names: Vec<&str> = tools.iter().map(|t| t.definition().name.as_str()).collect();
    // A name providers refuse is offered with `_`.
    assert_eq!(names, ["add", "grow", "boom", "image", "hang", "ns_dotted"]);
    // Structured content is the result.
    assert_eq!(
        call(&tools, "add", json!({"a": 2, "b": 3})).await,
        Ok(ToolOutcome::Value(json!({"sum": 5})))
    );
    assert_eq!(
        call(&tools, "ns_dotted", json!({})).await,
        Ok(ToolOutcome::Value(json!("dotted")))
    );
    // An image is an image part beside the text, never pasted as base64.
    assert_eq!(
        call(&tools, "image", json!({})).await,
        Ok(ToolOutcome::Images {
            text: "a chart".into(),
            images: vec![ImageData::new("image/png", "aGVsbG8=")],
        })
    );
    client.close().await;
    server.shutdown().await;
}

#[tokio::test]
async fn a_wrong_token_fails_to_connect_within_the_timeout() {
    let server = raw_server("127.0.0.1:0", Some("s3cret")).await;
    let err = McpClient::connect(
        McpServerConfig::http(&server.url)
            .bearer("wrong")
            .connect_timeout(Duration::from_secs(5)),
    )
    .await
    .expect_err("refused");
    assert!(
        matches!(err, McpError::Connect { .. } | McpError::Timeout { .. }),
        "{err}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn server_errors_invalid_params_and_timeouts_are_error_results() {
    let server = raw_server("127.0.0.1:0", None).await;
    let client = McpClient::connect(
        McpServerConfig::http(&server.url).call_timeout(Duration::from_millis(300)),
    )
    .await
    .expect("connects");
    let tools = client.tools().await.expect("lists");
    let boom = call(&tools, "boom", json!({})).await;
    assert!(
        matches!(&boom, Err(ToolCallError::Execution(t)) if t.contains("the server broke")),
        "{boom:?}"
    );
    // The server's invalid-params error reads as invalid input.
    let bad = call(&tools, "add", json!({"a": "two"})).await;
    assert_eq!(
        bad,
        Err(ToolCallError::InvalidInput(
            "a and b must be integers".into()
        ))
    );
    let hang = call(&tools, "hang", json!({})).await;
    assert!(
        matches!(&hang, Err(ToolCallError::Execution(t)) if t.contains("did not finish within 300 ms")),
        "{hang:?}"
    );
    assert_eq!(
        call(&tools, "add", json!({"a": 1, "b": 1})).await,
        Ok(ToolOutcome::Value(json!({"sum": 2})))
    );
    client.close().await;
    server.shutdown().await;
}

#[tokio::test]
async fn list_changed_refreshes_the_cached_tools() {
    let server = raw_server("127.0.0.1:0", None).await;
    let client = McpClient::connect(McpServerConfig::http(&server.url))
        .await
        .expect("connects");
    let mut changed = client.list_changed();
    let tools = client.tools().await.expect("lists");
    assert!(
        !tools
            .iter()
            .any(|t| t.definition().name.as_str() == "extra")
    );
    assert_eq!(
        call(&tools, "grow", json!({})).await,
        Ok(ToolOutcome::Value(json!("grown")))
    );
    tokio::time::timeout(Duration::from_secs(10), changed.changed())
        .await
        .expect("the notification arrives")
        .expect("the client lives");
    let tools = client.tools().await.expect("lists again");
    assert_eq!(
        call(&tools, "extra", json!({})).await,
        Ok(ToolOutcome::Value(json!("extra")))
    );
    client.close().await;
    server.shutdown().await;
}

#[tokio::test]
async fn a_dropped_server_is_an_error_result_and_the_client_reconnects_when_it_is_back() {
    let server = raw_server("127.0.0.1:0", None).await;
    let addr = server.addr;
    let client = McpClient::connect(
        McpServerConfig::http(&server.url)
            .call_timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(5)),
    )
    .await
    .expect("connects");
    let tools = client.tools().await.expect("lists");
    server.shutdown().await;
    let gone = tokio::time::timeout(
        Duration::from_secs(20),
        call(&tools, "add", json!({"a": 1, "b": 2})),
    )
    .await
    .expect("a gone server does not hang the call");
    // What the model reads says what happened, in words, without the
    // SDK's type names.
    let Err(ToolCallError::Execution(said)) = &gone else {
        panic!("not an execution error: {gone:?}")
    };
    assert!(said.starts_with("the MCP connection closed: "), "{said}");
    assert!(
        !said.contains("rmcp::") && !said.contains("Transport ["),
        "{said}"
    );

    let again = raw_server(&addr.to_string(), None).await;
    let mut answer = call(&tools, "add", json!({"a": 1, "b": 2})).await;
    // The first call after the loss may still see the old session's end.
    if answer.is_err() {
        answer = call(&tools, "add", json!({"a": 1, "b": 2})).await;
    }
    assert_eq!(answer, Ok(ToolOutcome::Value(json!({"sum": 3}))));
    client.close().await;
    again.shutdown().await;
}

/// A loopback server that answers every request with a `307` to `to`.
async fn redirecting_to(to: String) -> Running {
    serve("127.0.0.1:0", None, move |_| {
        let to = to.clone();
        axum::Router::new().fallback(move || {
            let to = to.clone();
            async move {
                (
                    axum::http::StatusCode::TEMPORARY_REDIRECT,
                    [(axum::http::header::LOCATION, to)],
                )
            }
        })
    })
    .await
}

#[tokio::test]
async fn a_redirect_to_another_origin_is_refused_and_the_headers_never_reach_it() {
    // The other origin: an MCP server that would answer, whose every
    // request is counted.
    let reached = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&reached);
    let elsewhere = serve("127.0.0.1:0", None, move |_| {
        let counted = Arc::clone(&counted);
        axum::Router::new().fallback(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { axum::http::StatusCode::OK }
        })
    })
    .await;
    let redirector = redirecting_to(elsewhere.url.clone()).await;

    let err = McpClient::connect(
        McpServerConfig::http(&redirector.url)
            .header("x-api-key", "s3cret")
            .connect_timeout(Duration::from_secs(5)),
    )
    .await
    .expect_err("the redirect is refused");
    assert!(matches!(err, McpError::Connect { .. }), "{err}");
    let said = err.to_string();
    assert!(
        said.contains("refused a redirect") && said.contains(&elsewhere.addr.to_string()),
        "{said}"
    );
    assert_eq!(reached.load(Ordering::SeqCst), 0, "nothing was sent there");
    redirector.shutdown().await;
    elsewhere.shutdown().await;
}

#[tokio::test]
async fn a_redirect_within_the_server_s_origin_is_followed() {
    // An MCP server at `/mcp` whose old address `/old` redirects there,
    // with the bearer token required on both.
    let server = serve("127.0.0.1:0", Some("s3cret"), |stop| {
        let mcp = raw_server_router(stop);
        mcp.route(
            "/old",
            axum::routing::any(|| async {
                (
                    axum::http::StatusCode::PERMANENT_REDIRECT,
                    [(axum::http::header::LOCATION, "/mcp")],
                )
            }),
        )
    })
    .await;
    let old = server.url.replace("/mcp", "/old");
    let client = McpClient::connect(McpServerConfig::http(&old).bearer("s3cret"))
        .await
        .expect("connects through the redirect");
    let tools = client.tools().await.expect("lists");
    assert_eq!(
        call(&tools, "add", json!({"a": 2, "b": 3})).await,
        Ok(ToolOutcome::Value(json!({"sum": 5})))
    );
    client.close().await;
    server.shutdown().await;
}

/// A Streamable HTTP endpoint written by hand that answers the handshake
/// and lists one tool whose schema nests 3 000 levels deep.
async fn deep_schema_server() -> Running {
    serve("127.0.0.1:0", None, |_| {
        axum::Router::new().route(
            "/mcp",
            axum::routing::post(|body: String| async move {
                let request: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                let id = request.get("id").cloned().unwrap_or(Value::Null);
                let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
                match request.get("method").and_then(Value::as_str) {
                    Some("initialize") => (
                        axum::http::StatusCode::OK,
                        json,
                        json!({"jsonrpc": "2.0", "id": id, "result": {
                            "protocolVersion": "2025-06-18",
                            "capabilities": {"tools": {}},
                            "serverInfo": {"name": "deep", "version": "0"}
                        }})
                        .to_string(),
                    ),
                    Some("tools/list") => {
                        let depth = 3000;
                        (
                            axum::http::StatusCode::OK,
                            json,
                            format!(
                                r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":[{{"name":"deep","inputSchema":{{"type":"object","properties":{{"x":{}1{}}}}}}}]}}}}"#,
                                r#"{"a":"#.repeat(depth),
                                "}".repeat(depth)
                            ),
                        )
                    }
                    _ => (axum::http::StatusCode::ACCEPTED, json, String::new()),
                }
            }),
        )
    })
    .await
}

#[tokio::test]
async fn a_listing_nested_too_deep_fails_at_once_over_http_too() {
    let server = deep_schema_server().await;
    let started = std::time::Instant::now();
    let err = McpClient::connect(
        McpServerConfig::http(&server.url).list_timeout(Duration::from_secs(60)),
    )
    .await
    .expect_err("the listing cannot be read");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?}: {err}",
        started.elapsed()
    );
    assert!(matches!(err, McpError::Disconnected(_)), "{err:?}");
    assert!(err.to_string().contains("nested deeper than"), "{err}");
    server.shutdown().await;
}

/// A Streamable HTTP endpoint written by hand that answers in JSON bodies
/// (never SSE) and lists `only_task` (task-only), `maybe_task` (task
/// optional) and `plain`; it keeps the ids of its `tools/list` requests
/// and, when `fail_repeats` is set, answers a repeated id with HTTP 500.
async fn json_task_server(lists: Arc<std::sync::Mutex<Vec<Value>>>, fail_repeats: bool) -> Running {
    serve("127.0.0.1:0", None, move |_| {
        let lists = Arc::clone(&lists);
        axum::Router::new().route(
            "/mcp",
            axum::routing::post(move |body: String| async move {
                let request: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                let id = request.get("id").cloned().unwrap_or(Value::Null);
                let json = || [(axum::http::header::CONTENT_TYPE, "application/json")];
                let ok = |result: Value| {
                    (
                        axum::http::StatusCode::OK,
                        json(),
                        json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string(),
                    )
                };
                match request.get("method").and_then(Value::as_str) {
                    Some("initialize") => ok(json!({
                        "protocolVersion": "2025-06-18",
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "tasks", "version": "0"}
                    })),
                    Some("tools/list") => {
                        let repeated = {
                            let mut ids = lists.lock().unwrap_or_else(|p| p.into_inner());
                            let repeated = ids.contains(&id);
                            ids.push(id.clone());
                            repeated
                        };
                        if repeated && fail_repeats {
                            return (
                                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                                json(),
                                String::new(),
                            );
                        }
                        let schema = json!({"type": "object", "properties": {}});
                        ok(json!({"tools": [
                            {"name": "only_task", "inputSchema": schema,
                             "execution": {"taskSupport": "required"}},
                            {"name": "maybe_task", "inputSchema": schema,
                             "execution": {"taskSupport": "optional"}},
                            {"name": "plain", "inputSchema": schema},
                        ]}))
                    }
                    Some("tools/call") => ok(json!({
                        "content": [{"type": "text", "text": "called"}]
                    })),
                    _ => (axum::http::StatusCode::ACCEPTED, json(), String::new()),
                }
            }),
        )
    })
    .await
}

#[tokio::test]
async fn a_task_only_tool_in_a_json_answer_is_not_offered() {
    let lists = Arc::new(std::sync::Mutex::new(Vec::new()));
    let server = json_task_server(Arc::clone(&lists), false).await;
    let (logs, _capture) = Logs::capture();
    let client = McpClient::connect(McpServerConfig::http(&server.url))
        .await
        .expect("connects");
    let tools = client.tools().await.expect("lists");
    let names: Vec<&str> = tools.iter().map(|t| t.definition().name.as_str()).collect();
    assert_eq!(names, ["maybe_task", "plain"]);
    let log = logs.text();
    assert!(
        log.contains("WARN") && log.contains("tool=only_task") && log.contains("only as a task"),
        "{log}"
    );
    // Each JSON answer was parsed before the client saw it: each request
    // was sent a second time, once.
    let ids = lists.lock().expect("lock").clone();
    assert!(!ids.is_empty());
    for id in &ids {
        assert_eq!(ids.iter().filter(|i| *i == id).count(), 2, "{ids:?}");
    }
    assert_eq!(
        call(&tools, "plain", json!({})).await,
        Ok(ToolOutcome::Value(json!("called")))
    );
    client.close().await;
    server.shutdown().await;
}

#[tokio::test]
async fn a_failed_second_read_of_a_json_listing_is_a_warning_and_the_listing_stands() {
    let lists = Arc::new(std::sync::Mutex::new(Vec::new()));
    let server = json_task_server(Arc::clone(&lists), true).await;
    let (logs, _capture) = Logs::capture();
    let client = McpClient::connect(McpServerConfig::http(&server.url))
        .await
        .expect("connects");
    let tools = client.tools().await.expect("lists");
    let names: Vec<&str> = tools.iter().map(|t| t.definition().name.as_str()).collect();
    // Unseen, the task-only mark cannot be acted on; the log says so.
    assert_eq!(names, ["only_task", "maybe_task", "plain"]);
    let log = logs.text();
    assert!(
        log.contains("WARN")
            && log.contains("not inspected for task-only tools")
            && log.contains("HTTP 500"),
        "{log}"
    );
    client.close().await;
    server.shutdown().await;
}
