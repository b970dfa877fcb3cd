//! Provider built-in tools (Anthropic server tools) against fake APIs on
//! loopback: the request's `tools` entry, the parsing of `server_tool_use`
//! and `web_search_tool_result` blocks (complete and streamed), their return
//! in the next request, and OpenAI's refusal. The fixtures follow the shapes
//! in Anthropic's public web search tool documentation.
#![cfg(all(feature = "anthropic", feature = "openai"))]

use std::time::Duration;

use futures::StreamExt;
use markov_core::tool::ProviderTool;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelResponse, ModelSettings, StopReason,
    StreamEvent, ToolDefinition, Usage,
};
use markov_testkit::http::{FakeServer, Reply, sse_event};
use serde_json::{Value, json};

fn web_search() -> ProviderTool {
    ProviderTool::new("web_search_20250305", "web_search")
        .expect("valid name")
        .with("max_uses", json!(5))
}

fn add() -> ToolDefinition {
    ToolDefinition::new(
        "add",
        "Adds two numbers.",
        json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
    )
    .expect("valid name")
}

fn request<'a>(
    messages: &'a [Message],
    tools: &'a [ToolDefinition],
    provider_tools: &'a [ProviderTool],
    settings: &'a ModelSettings,
) -> ModelRequest<'a> {
    ModelRequest::new("", messages, settings)
        .with_tools(tools)
        .with_provider_tools(provider_tools)
}

fn search_results() -> Value {
    json!([{
        "type": "web_search_result",
        "url": "https://en.wikipedia.org/wiki/Claude_Shannon",
        "title": "Claude Shannon - Wikipedia",
        "encrypted_content": "EqgfCioIARgBIiQ3YTAwMjY1Mi1mZjM5LTQ1NGUtODgxNC1kNjNjNTk1ZWI3Y",
        "page_age": "April 30, 2025"
    }])
}

/// A complete answer as the web search documentation shows it.
fn searched_answer() -> Value {
    json!({
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [
            {"type": "text", "text": "I'll search for when Claude Shannon was born."},
            {"type": "server_tool_use", "id": "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
             "name": "web_search", "input": {"query": "claude shannon birth date"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
             "content": search_results()},
            {"type": "text", "text": "Claude Shannon was born on April 30, 1916."}
        ],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {"input_tokens": 6039, "output_tokens": 931,
                  "server_tool_use": {"web_search_requests": 1}}
    })
}

fn expected_items() -> Vec<Item> {
    vec![
        Item::text("I'll search for when Claude Shannon was born."),
        Item::provider_tool_use(
            "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
            "web_search",
            json!({"query": "claude shannon birth date"}),
        ),
        Item::provider_tool_result(
            "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
            "web_search_tool_result",
            search_results(),
        ),
        Item::text("Claude Shannon was born on April 30, 1916."),
    ]
}

fn anthropic(server: &FakeServer) -> markov_providers::Anthropic {
    markov_providers::Anthropic::builder()
        .api_key("sk-ant-test")
        .base_url(server.base_url())
        .model("claude-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

#[tokio::test]
async fn anthropic_offers_parses_and_returns_server_tool_blocks() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, searched_answer()),
        Reply::json(
            200,
            json!({
                "id": "msg_02", "type": "message", "role": "assistant", "model": "claude-test",
                "content": [{"type": "text", "text": "You're welcome."}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 3}
            }),
        ),
    ])
    .await;
    let model = anthropic(&server);
    let settings = ModelSettings::default();
    let tools = [add()];
    let provider_tools = [web_search()];
    let mut history = vec![Message::user("When was Claude Shannon born?")];

    let answer = model
        .complete(request(&history, &tools, &provider_tools, &settings))
        .await
        .expect("the answer parses");
    assert_eq!(answer.content, expected_items());
    assert_eq!(answer.stop_reason, StopReason::EndTurn);
    assert!(!answer.has_tool_calls());

    history.push(Message::assistant_items(answer.content));
    history.push(Message::user("Thanks!"));
    model
        .complete(request(&history, &tools, &provider_tools, &settings))
        .await
        .expect("the second call succeeds");

    let sent = server.requests();
    assert_eq!(
        sent[0].body["tools"],
        json!([
            {"name": "add", "description": "Adds two numbers.",
             "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
             "cache_control": {"type": "ephemeral"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
        ])
    );
    assert_eq!(sent[0].body["tool_choice"], json!({"type": "auto"}));
    // The provider's blocks go back unchanged.
    assert_eq!(
        sent[1].body["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "When was Claude Shannon born?"}]},
            {"role": "assistant", "content": searched_answer()["content"]},
            {"role": "user", "content": [
                {"type": "text", "text": "Thanks!", "cache_control": {"type": "ephemeral"}}
            ]}
        ])
    );
}

#[tokio::test]
async fn anthropic_offers_provider_tools_alone() {
    let server = FakeServer::scripted(vec![Reply::json(200, searched_answer())]).await;
    let settings = ModelSettings::default();
    let history = [Message::user("When was Claude Shannon born?")];
    let provider_tools =
        [ProviderTool::new("code_execution_20250522", "code_execution").expect("valid name")];
    anthropic(&server)
        .complete(request(&history, &[], &provider_tools, &settings))
        .await
        .expect("the answer parses");
    let sent = server.single().body;
    assert_eq!(
        sent["tools"],
        json!([{"type": "code_execution_20250522", "name": "code_execution"}])
    );
}

/// The same answer, streamed: the `server_tool_use` input arrives as
/// `input_json_delta` fragments, the result whole in its start event.
fn searched_stream() -> String {
    let id = "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE";
    [
        sse_event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": "msg_01", "type": "message", "role": "assistant", "content": [],
                "model": "claude-test", "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 6039, "output_tokens": 1}
            }}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta",
                             "text": "I'll search for when Claude Shannon was born."}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
                   "content_block": {"type": "server_tool_use", "id": id,
                                     "name": "web_search", "input": {}}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "input_json_delta", "partial_json": "{\"query\": \"claude "}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "input_json_delta", "partial_json": "shannon birth date\"}"}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 2,
                   "content_block": {"type": "web_search_tool_result", "tool_use_id": id,
                                     "content": search_results()}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 2}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 3,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 3,
                   "delta": {"type": "text_delta",
                             "text": "Claude Shannon was born on April 30, 1916."}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 3}),
        ),
        sse_event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                   "usage": {"output_tokens": 931}}),
        ),
        sse_event("message_stop", json!({"type": "message_stop"})),
    ]
    .concat()
}

#[tokio::test]
async fn anthropic_streams_server_tool_blocks() {
    let server = FakeServer::scripted(vec![Reply::sse_split(&searched_stream(), 11)]).await;
    let settings = ModelSettings::default();
    let history = [Message::user("When was Claude Shannon born?")];
    let provider_tools = [web_search()];
    let model = anthropic(&server);
    let events: Vec<StreamEvent> = model
        .stream(request(&history, &[], &provider_tools, &settings))
        .map(|e| e.expect("no stream error"))
        .collect()
        .await;
    assert_eq!(
        events,
        vec![
            StreamEvent::TextDelta {
                index: 0,
                text: "I'll search for when Claude Shannon was born.".into()
            },
            StreamEvent::TextDelta {
                index: 3,
                text: "Claude Shannon was born on April 30, 1916.".into()
            },
            StreamEvent::Done(
                ModelResponse::new(expected_items(), StopReason::EndTurn)
                    .with_usage(Usage {
                        input_tokens: 6039,
                        output_tokens: 931,
                        ..Usage::default()
                    })
                    .with_model("claude-test")
            ),
        ]
    );
    assert_eq!(
        server.single().body["tools"],
        json!([{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}])
    );
}

#[tokio::test]
async fn openai_refuses_provider_tools_before_sending() {
    let server = FakeServer::start().await;
    let model = markov_providers::OpenAi::builder()
        .api_key("sk-proj-test")
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
        .build()
        .expect("a valid client");
    let settings = ModelSettings::default();
    let history = [Message::user("Search the web.")];
    let provider_tools = [web_search()];
    let tools = [add()];
    let error = model
        .complete(request(&history, &tools, &provider_tools, &settings))
        .await
        .expect_err("refused");
    match &error {
        ModelError::InvalidRequest(message) => {
            assert!(message.contains("web_search"), "{message}");
            assert!(message.contains("provider"), "{message}");
        }
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
    let mut stream = model.stream(request(&history, &tools, &provider_tools, &settings));
    let streamed = stream.next().await.expect("one event");
    assert!(
        matches!(streamed, Err(ModelError::InvalidRequest(_))),
        "{streamed:?}"
    );
    assert!(server.requests().is_empty(), "nothing was sent");

    // Provider items left in the history by another client are not sent.
    let server = FakeServer::scripted(vec![Reply::json(
        200,
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-test",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        }),
    )])
    .await;
    let model = markov_providers::OpenAi::builder()
        .api_key("sk-proj-test")
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
        .build()
        .expect("a valid client");
    let history = [
        Message::user("When was Claude Shannon born?"),
        Message::assistant_items(expected_items()),
        Message::user("Thanks!"),
    ];
    model
        .complete(request(&history, &[], &[], &settings))
        .await
        .expect("sent without the provider items");
    assert_eq!(
        server.single().body["messages"][1],
        json!({"role": "assistant",
               "content": "I'll search for when Claude Shannon was born.\nClaude Shannon was born on April 30, 1916."})
    );
}
