//! The client against the reference MCP servers a user starts with:
//! `@modelcontextprotocol/server-everything` and
//! `@modelcontextprotocol/server-filesystem` (npm), `mcp-server-time`
//! (PyPI, on the Python SDK). `.ci/run` installs them; the tests find them
//! on `PATH`. Under `CI=true` a missing server is a failure; elsewhere the
//! test says why it skipped.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_core::ToolCallId;
use markov_core::tool::{Delivery, NoState, SharedTool, ToolCallError, ToolContext, ToolOutcome};
use markov_mcp::{McpClient, McpError, McpServerConfig};
use markov_policy::{Budget, Mode, PolicyConfig, ToolRegistry, TurnBudgetState};
use markov_testkit::required_program;
use serde_json::{Value, json};

use crate::common::error_type;

fn everything() -> Option<McpServerConfig> {
    let program = required_program(
        "mcp-server-everything",
        "npm install -g @modelcontextprotocol/server-everything",
    )?;
    Some(McpServerConfig::stdio(program, ["stdio"]).connect_timeout(Duration::from_secs(30)))
}

/// `mcp-server-everything` serving Streamable HTTP on a free port, killed
/// when dropped.
struct EverythingOverHttp {
    url: String,
    _process: tokio::process::Child,
}

/// Starts `mcp-server-everything streamableHttp` and waits, bounded, until
/// its port takes connections.
async fn everything_over_http() -> Option<EverythingOverHttp> {
    let program = required_program(
        "mcp-server-everything",
        "npm install -g @modelcontextprotocol/server-everything",
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    let process = tokio::process::Command::new(program)
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("starts mcp-server-everything");
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "mcp-server-everything did not listen on port {port} within 30s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Some(EverythingOverHttp {
        url: format!("http://127.0.0.1:{port}/mcp"),
        _process: process,
    })
}

fn filesystem() -> Option<PathBuf> {
    required_program(
        "mcp-server-filesystem",
        "npm install -g @modelcontextprotocol/server-filesystem",
    )
}

/// A fresh directory with `hello.txt` ("hello world") and `dot.png` (a
/// 1×1 PNG).
fn workdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("markov-mcp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creates a directory");
    std::fs::write(dir.join("hello.txt"), "hello world").expect("writes");
    std::fs::write(dir.join("dot.png"), PNG).expect("writes");
    dir
}

/// A 1×1 PNG, 70 bytes.
const PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0x15, 0xc4,
    0x89, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x44, 0x41, 0x54, 0x78, 0xda, 0x63, 0x64, 0xf8, 0xcf, 0x50,
    0x0f, 0x00, 0x03, 0x86, 0x01, 0x80, 0x5a, 0x34, 0x7d, 0x6b, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

fn find(tools: &[SharedTool], name: &str) -> SharedTool {
    tools
        .iter()
        .find(|t| t.definition().name.as_str() == name)
        .cloned()
        .unwrap_or_else(|| panic!("{name} is offered"))
}

fn names(tools: &[SharedTool]) -> Vec<String> {
    tools
        .iter()
        .map(|t| t.definition().name.as_str().to_owned())
        .collect()
}

async fn call(tool: &SharedTool, input: Value) -> Result<ToolOutcome, ToolCallError> {
    let id = ToolCallId::new("c1");
    let state = NoState::default();
    tool.call_json(&input, ToolContext::new(&id, &[], &state))
        .await
}

/// The text the model reads of a successful call.
async fn read(tool: &SharedTool, input: Value) -> String {
    call(tool, input)
        .await
        .expect("the call succeeds")
        .model_text("")
}

#[tokio::test]
async fn a_stdio_server_sees_the_default_environment_and_what_is_configured_only() {
    let Some(config) = everything() else { return };
    // Cargo sets it for the test process: a variable of ours the server
    // must not see, as it must not see an API key.
    let ours = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let client = McpClient::connect(config.env("MARKOV_GIVEN", "passed on"))
        .await
        .expect("connects");
    let tools = client.tools().await.expect("lists");
    let text = read(&find(&tools, "get-env"), json!({})).await;
    let env: serde_json::Map<String, Value> =
        serde_json::from_str(&text).expect("get-env answers a JSON object");
    assert!(!text.contains(&ours), "{text}");
    assert!(!env.contains_key("CARGO_MANIFEST_DIR"), "{text}");
    assert_eq!(env.get("MARKOV_GIVEN"), Some(&json!("passed on")));
    assert!(env.contains_key("PATH"), "{text}");
    // Any other variable the server sees, its runtime set itself: none
    // holds our value.
    for (key, value) in &env {
        if markov_mcp::DEFAULT_INHERITED_ENV.contains(&key.as_str()) || key == "MARKOV_GIVEN" {
            continue;
        }
        let ours = std::env::var(key).ok();
        assert!(
            ours.is_none() || ours.as_deref() != value.as_str(),
            "{key} was passed from markov's environment: {text}"
        );
    }
    client.close().await;
}

#[tokio::test]
async fn a_task_only_tool_is_not_offered() {
    let Some(config) = everything() else { return };
    let client = McpClient::connect(config).await.expect("connects");
    let tools = names(&client.tools().await.expect("lists"));
    assert!(
        !tools.iter().any(|n| n == "simulate-research-query"),
        "{tools:?}"
    );
    // The server's other tools are offered as before.
    assert!(tools.iter().any(|n| n == "get-sum"), "{tools:?}");
    client.close().await;
}

#[tokio::test]
async fn a_task_only_tool_is_not_offered_over_streamable_http_either() {
    let Some(server) = everything_over_http().await else {
        return;
    };
    let (logs, _capture) = crate::common::Logs::capture();
    let client = McpClient::connect(
        McpServerConfig::http(&server.url).connect_timeout(Duration::from_secs(30)),
    )
    .await
    .expect("connects");
    let tools = client.tools().await.expect("lists");
    let offered = names(&tools);
    assert!(
        !offered.iter().any(|n| n == "simulate-research-query"),
        "{offered:?}"
    );
    let log = logs.text();
    assert!(
        log.contains("WARN")
            && log.contains("tool=simulate-research-query")
            && log.contains("only as a task"),
        "{log}"
    );
    // The server's other tools are offered, and work over HTTP.
    assert!(offered.iter().any(|n| n == "get-sum"), "{offered:?}");
    let echoed = read(&find(&tools, "echo"), json!({"message": "over http"})).await;
    assert_eq!(echoed, "Echo: over http");
    assert_eq!(
        read(&find(&tools, "get-sum"), json!({"a": 2, "b": 3})).await,
        "The sum of 2 and 3 is 5."
    );
    client.close().await;
}

#[tokio::test]
async fn an_image_is_an_image_part_of_the_result_never_base64_text() {
    let Some(config) = everything() else { return };
    let client = McpClient::connect(config).await.expect("connects");
    let tools = client.tools().await.expect("lists");
    let outcome = call(&find(&tools, "get-tiny-image"), json!({}))
        .await
        .expect("the call succeeds");
    let ToolOutcome::Images { text, images } = outcome else {
        panic!("no image part: {outcome:?}");
    };
    assert_eq!(images.len(), 1, "{images:?}");
    assert_eq!(images[0].mime_type, "image/png");
    assert!(images[0].data.starts_with("iVBORw0KGgo"), "not a PNG");
    // The image goes as an image, so the text needs no note for it.
    assert!(!text.contains("iVBORw0KGgo"), "{text}");
    assert!(!text.contains("[image "), "{text}");
    client.close().await;
}

#[tokio::test]
async fn text_blocks_reach_the_model_unwrapped_and_images_as_image_parts() {
    let Some(program) = filesystem() else { return };
    let dir = workdir("content");
    let client = McpClient::connect(McpServerConfig::stdio(&program, [&dir]))
        .await
        .expect("connects");
    let tools = client.tools().await.expect("lists");
    // The server also sends `{"content": "hello world"}` as structured content.
    let text = read(
        &find(&tools, "read_text_file"),
        json!({"path": dir.join("hello.txt")}),
    )
    .await;
    assert_eq!(text, "hello world");
    let media = call(
        &find(&tools, "read_media_file"),
        json!({"path": dir.join("dot.png")}),
    )
    .await
    .expect("the call succeeds");
    let ToolOutcome::Images { text, images } = media else {
        panic!("no image part: {media:?}");
    };
    assert_eq!(text, "", "nothing but the image");
    assert_eq!(images.len(), 1, "{images:?}");
    assert_eq!(images[0].mime_type, "image/png");
    assert_eq!(images[0].byte_len(), PNG.len());
    client.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn declared_structured_output_that_matches_the_text_is_a_json_value() {
    let Some(program) = required_program("mcp-server-time", "pip install mcp-server-time") else {
        return;
    };
    let client = McpClient::connect(
        McpServerConfig::stdio(program, Vec::<String>::new())
            .connect_timeout(Duration::from_secs(30)),
    )
    .await
    .expect("connects");
    let tools = client.tools().await.expect("lists");
    let ToolOutcome::Value(value) = call(
        &find(&tools, "get_current_time"),
        json!({"timezone": "UTC"}),
    )
    .await
    .expect("succeeds") else {
        panic!("not a value")
    };
    assert_eq!(value["timezone"], "UTC", "{value}");
    client.close().await;
}

#[tokio::test]
async fn destructive_tools_need_approval_and_read_only_ones_do_not() {
    let Some(program) = filesystem() else { return };
    let dir = workdir("approval");
    let client = McpClient::connect(McpServerConfig::stdio(&program, [&dir]))
        .await
        .expect("connects");
    let needs = std::sync::Mutex::new(std::collections::BTreeMap::new());
    let deliveries = std::sync::Mutex::new(std::collections::BTreeMap::new());
    let registry = client
        .register(
            ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED)),
            |tool| {
                needs
                    .lock()
                    .expect("not poisoned")
                    .insert(tool.remote_name().to_owned(), tool.approval());
                deliveries.lock().expect("not poisoned").insert(
                    tool.remote_name().to_owned(),
                    tool.definition().effective_delivery(),
                );
                McpClient::default_metadata(tool)
            },
        )
        .await
        .expect("registers")
        .lock()
        .expect("locks");
    let needs = needs.into_inner().expect("not poisoned");
    for name in ["write_file", "edit_file", "move_file"] {
        let decision = needs[name];
        assert!(decision.required, "{name}");
        assert_eq!(decision.reason, "the server marks it destructive");
    }
    // The hints state the side-effect contract too: a destructive change
    // that is not idempotent (an edit, a move) never runs twice after a
    // crash; a read, or a write of the same bytes (marked idempotent), may.
    let deliveries = deliveries.into_inner().expect("not poisoned");
    for name in ["edit_file", "move_file"] {
        assert_eq!(deliveries[name], Delivery::AtMostOnce, "{name}");
    }
    for name in ["write_file", "read_text_file", "list_directory"] {
        assert_eq!(deliveries[name], Delivery::AtLeastOnce, "{name}");
    }
    // Not destructive, but not read-only either: it changes things.
    assert!(needs["create_directory"].required);
    for name in ["read_text_file", "list_directory", "read_media_file"] {
        assert!(!needs[name].required, "{name}");
    }
    // A write is held for approval and never reaches the server.
    let registry = Arc::new(registry);
    let call_id = ToolCallId::new("w1");
    let state = NoState::default();
    let target = dir.join("new.txt");
    let executed = registry
        .execute(
            (&Mode::TEXT, &TurnBudgetState::new()),
            &call_id,
            "write_file",
            json!({"path": target, "content": "x"}),
            ToolContext::new(&call_id, &[], &state),
        )
        .await;
    assert_eq!(
        error_type(&executed.result.content).as_deref(),
        Some("CONFIRMATION_PENDING"),
        "{}",
        executed.result.content
    );
    assert!(!target.exists());
    client.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_filesystem_server_without_arguments_works_in_the_configured_root() {
    let Some(program) = filesystem() else { return };
    let dir = workdir("roots");
    let client =
        McpClient::connect(McpServerConfig::stdio(&program, Vec::<String>::new()).root(&dir))
            .await
            .expect("connects");
    let tools = client.tools().await.expect("lists");
    let read_file = find(&tools, "read_text_file");
    // The server asks for the roots after the handshake; give it a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        match call(&read_file, json!({"path": dir.join("hello.txt")})).await {
            Ok(outcome) => break outcome.model_text(""),
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("the root was not granted: {err}"),
        }
    };
    assert_eq!(text, "hello world");
    // Outside the root, the server refuses.
    let outside = call(&read_file, json!({"path": "/etc/hostname"})).await;
    assert!(outside.is_err(), "{outside:?}");
    client.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_legacy_sse_url_is_refused_with_a_sentence() {
    let Some(program) = required_program(
        "mcp-server-everything",
        "npm install -g @modelcontextprotocol/server-everything",
    ) else {
        return;
    };
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        probe.local_addr().expect("address").port()
    };
    let mut server = tokio::process::Command::new(program)
        .arg("sse")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("starts the SSE server");
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the SSE server did not listen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let url = format!("http://127.0.0.1:{port}/sse");
    let err = McpClient::connect(McpServerConfig::http(&url))
        .await
        .expect_err("the legacy transport is not spoken");
    let text = err.to_string();
    assert!(
        text.contains("legacy HTTP+SSE transport") && text.contains(&url),
        "{text}"
    );
    assert!(!text.contains("rmcp::"), "{text}");
    let _ = server.kill().await;
}

#[tokio::test]
async fn connection_failures_say_what_failed_where_without_type_names() {
    // Nothing listens on this port.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        probe.local_addr().expect("address").port()
    };
    let url = format!("http://127.0.0.1:{port}/mcp");
    let err = McpClient::connect(McpServerConfig::http(&url))
        .await
        .expect_err("nothing to connect to")
        .to_string();
    assert!(err.contains(&url) && err.contains("check the URL"), "{err}");
    assert!(
        !err.contains("rmcp::") && !err.contains("Transport ["),
        "{err}"
    );
    // A command that is no MCP server: it exits at once.
    let err = McpClient::connect(McpServerConfig::stdio("sh", ["-c", "exit 3"]))
        .await
        .expect_err("no server")
        .to_string();
    assert!(
        err.contains("the server's process stopped before answering the MCP handshake"),
        "{err}"
    );
    assert!(!err.contains("rmcp::"), "{err}");
}

#[tokio::test]
async fn a_listing_nested_too_deep_fails_at_once_with_a_clear_error() {
    let config = McpServerConfig::stdio(
        env!("CARGO_BIN_EXE_markov-mcp-test-server"),
        ["deep-schema"],
    )
    .list_timeout(Duration::from_secs(60));
    let started = Instant::now();
    let err = McpClient::connect(config)
        .await
        .expect_err("the listing cannot be read");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?}",
        started.elapsed()
    );
    assert!(matches!(err, McpError::Disconnected(_)), "{err:?}");
    assert!(err.to_string().contains("nested deeper than"), "{err}");
}

/// Every tool of `mcp-server-everything` deferred: the model is offered
/// only `search_tools`, finds `echo` by what it does, and calls it on the
/// real server through the registry's policies.
#[tokio::test]
async fn the_everything_servers_tools_deferred_are_found_by_search_and_called() {
    use markov_charter::node::Node;
    use markov_executor::Agent;
    use markov_policy::ToolMetadata;
    use markov_testkit::ScriptedModel;

    let Some(config) = everything() else {
        return;
    };
    let client = McpClient::connect(config).await.expect("connects");
    let deferred: Vec<(SharedTool, ToolMetadata)> = client
        .mcp_tools()
        .await
        .expect("lists")
        .into_iter()
        .map(|tool| {
            let metadata = McpClient::default_metadata(&tool).deferred();
            (tool as SharedTool, metadata)
        })
        .collect();
    let listed = deferred.len();
    assert!(listed > 5, "the server lists its tools: {listed}");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "echo back a message"}))
            .tool_call("echo", json!({"message": "found and called"}))
            .text("done")
            .build(),
    );
    let mut machine = Agent::builder("mcp")
        .node(
            "main",
            Node::builder("Use your tools.")
                .name("main")
                .build()
                .expect("node builds"),
        )
        .shared_model(model.clone())
        .tools_with(deferred)
        // The echo tool is not marked read-only: trusted here.
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .build()
        .expect("agent builds")
        .machine();
    machine.enqueue_user("echo something");
    machine.run().await.expect("runs");
    let requests = model.requests();
    assert_eq!(requests[0].tool_names(), ["search_tools"]);
    assert_eq!(requests[1].tool_names().first(), Some(&"search_tools"));
    assert!(
        requests[1].tool_names().contains(&"echo"),
        "{:?}",
        requests[1].tool_names()
    );
    assert!(requests[1].tools.len() < listed, "only what was found");
    let results = crate::common::results(machine.history());
    assert!(
        results[0].0.contains(r#""name":"echo""#),
        "{}",
        results[0].0
    );
    assert!(
        results[1].0.contains("found and called") && !results[1].1,
        "{:?}",
        results[1]
    );
    client.close().await;
}
