//! A whole machine run through the Anthropic client against the fake
//! Messages API: a typed tool, the terminal `respond` tool, then on a second
//! turn `finish`, once with complete answers and once with event streams.
//! The replies follow the shapes in Anthropic's public API documentation.
#![cfg(feature = "anthropic")]

use std::time::Duration;

use crate::common::machine::{
    ANSWER, QUESTION, THANKS, add_args, finish_args, respond_args, two_turns,
};
use markov_providers::Anthropic;
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic};
use serde_json::Value;

fn client(server: &FakeServer) -> Anthropic {
    Anthropic::builder()
        .api_key("sk-ant-machine-test")
        .base_url(server.base_url())
        .model("claude-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

/// The scripted calls, in order: `add`, `respond`, then (second turn) `finish`.
fn calls() -> [(&'static str, &'static str, Value); 3] {
    [
        ("toolu_add", "add", add_args()),
        ("toolu_respond", "respond", respond_args()),
        ("toolu_finish", "finish", finish_args()),
    ]
}

/// The `tool_result` blocks of a request body: (tool_use_id, content text).
fn tool_results(body: &Value) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for message in body["messages"].as_array().expect("messages") {
        let Some(blocks) = message["content"].as_array() else {
            continue;
        };
        for block in blocks.iter().filter(|b| b["type"] == "tool_result") {
            assert_eq!(message["role"], "user", "a tool result is user content");
            let content = match &block["content"] {
                Value::String(text) => text.clone(),
                Value::Array(parts) => parts
                    .iter()
                    .filter_map(|p| p["text"].as_str())
                    .collect::<String>(),
                other => panic!("unexpected tool_result content {other}"),
            };
            found.push((
                block["tool_use_id"]
                    .as_str()
                    .expect("tool_use_id")
                    .to_owned(),
                content,
            ));
        }
    }
    found
}

/// The `tool_use` ids the request sends back in assistant messages.
fn tool_use_ids(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "assistant")
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| b["id"].as_str().expect("id").to_owned())
        .collect()
}

/// The system prompt, whether sent as a string or as text blocks.
fn system_text(body: &Value) -> String {
    match &body["system"] {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks.iter().filter_map(|b| b["text"].as_str()).collect(),
        other => panic!("unexpected system {other}"),
    }
}

/// Checks what every recorded request carried, and what each one sent back.
fn check_requests(requests: &[Recorded], streamed: bool) {
    assert_eq!(requests.len(), 3, "one model call per scripted answer");
    for request in requests {
        assert_eq!(request.method, "POST");
        assert_eq!(request.path, "/v1/messages");
        let body = request.body.clone();
        assert_eq!(body["model"], "claude-test");
        assert_eq!(body["stream"].as_bool().unwrap_or(false), streamed);
        let tools: Vec<&str> = body["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .map(|t| t["name"].as_str().expect("tool name"))
            .collect();
        assert!(
            !tools.contains(&"updateState"),
            "a node without state is offered updateState: {tools:?}"
        );
        for name in ["add", "respond", "finish"] {
            assert!(tools.contains(&name), "{name} missing from {tools:?}");
        }
        let system = system_text(&body);
        assert!(
            system.contains("## Terminal Tools"),
            "no terminal tools section in {system}"
        );
        assert!(system.contains("respond"), "{system}");
        assert!(system.contains("You do arithmetic with your tools."));
    }

    let first = requests[0].body.clone();
    let messages = first["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0]["role"], "user");
    assert!(messages[0].to_string().contains(QUESTION));
    assert!(tool_results(&first).is_empty());

    let second = requests[1].body.clone();
    assert_eq!(tool_use_ids(&second), ["toolu_add"]);
    assert_eq!(
        tool_results(&second),
        [("toolu_add".to_owned(), "5".to_owned())]
    );

    let third = requests[2].body.clone();
    assert_eq!(tool_use_ids(&third), ["toolu_add", "toolu_respond"]);
    assert_eq!(
        tool_results(&third),
        [
            ("toolu_add".to_owned(), "5".to_owned()),
            ("toolu_respond".to_owned(), ANSWER.to_owned()),
        ]
    );
    let last = third["messages"]
        .as_array()
        .and_then(|m| m.last())
        .expect("a last message");
    assert_eq!(last["role"], "user");
    assert!(last.to_string().contains(THANKS), "{last}");
}

async fn run(server: &FakeServer, streamed: bool) {
    two_turns(client(server), streamed).await;
    check_requests(&server.requests(), streamed);
}

#[tokio::test]
async fn a_machine_runs_tools_respond_and_finish_through_complete_answers() {
    let replies = calls()
        .iter()
        .map(|(id, name, input)| Reply::json(200, anthropic::tool_use(id, name, input)))
        .collect();
    let server = FakeServer::scripted(replies).await;
    run(&server, false).await;
}

#[tokio::test]
async fn a_machine_runs_tools_respond_and_finish_through_event_streams() {
    let replies = calls()
        .iter()
        .map(|(id, name, input)| Reply::sse_split(&anthropic::tool_use_events(id, name, input), 11))
        .collect();
    let server = FakeServer::scripted(replies).await;
    run(&server, true).await;
}
