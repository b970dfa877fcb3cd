//! The Anthropic client against a fake Messages API on loopback. The fixtures
//! follow the shapes in Anthropic's public API documentation.
#![cfg(feature = "anthropic")]

use std::time::{Duration, Instant};

use futures::StreamExt;
use markov_core::message::{InstancePayload, Items};
use markov_core::model::collect_stream;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelResponse, ModelSettings, Role, StopReason,
    StreamEvent, Thinking, ToolChoice, ToolDefinition, Usage,
};
use markov_providers::{Anthropic, PromptCaching};
use markov_testkit::http::{FakeServer, Reply, sse_event};
use serde_json::{Value, json};

const KEY: &str = "sk-ant-test-secret-key";

fn client(server: &FakeServer) -> Anthropic {
    Anthropic::builder()
        .api_key(KEY)
        .base_url(server.base_url())
        .model("claude-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

fn tools() -> Vec<ToolDefinition> {
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]
    });
    vec![
        ToolDefinition::new("add", "Adds two numbers.", schema).expect("valid name"),
        ToolDefinition::new("finish", "Ends the run.", json!({"type": "object"}))
            .expect("valid name")
            .terminal(true),
    ]
}

fn request<'a>(
    messages: &'a [Message],
    tools: &'a [ToolDefinition],
    tool_choice: &'a ToolChoice,
    settings: &'a ModelSettings,
) -> ModelRequest<'a> {
    ModelRequest::new("You are a calculator.", messages, settings)
        .with_tools(tools)
        .with_tool_choice(tool_choice)
}

fn text_answer(text: &str) -> Value {
    json!({
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 3}
    })
}

fn message(role: Role, items: Vec<Item>) -> Message {
    Message::from(markov_core::message::MessageData {
        role,
        items: Items::List(items),
        metadata: None,
    })
}

#[tokio::test]
async fn request_body_covers_messages_tools_and_tool_choice() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("42"))]).await;
    let history = vec![
        Message::user("Hello"),
        Message::from(markov_core::message::MessageData {
            role: Role::Ephemeral,
            items: Items::Text("camera frame note".into()),
            metadata: None,
        }),
        message(
            Role::Command,
            vec![Item::Command {
                name: "reset".into(),
                input: json!({}),
                instance_id: None,
                client_id: None,
            }],
        ),
        Message::assistant_items(vec![
            Item::Thinking {
                thinking: "Let me think".into(),
                signature: Some("sig-1".into()),
            },
            Item::Thinking {
                thinking: "unsigned".into(),
                signature: None,
            },
            Item::text("Calling add"),
            Item::tool_use("t1", "add", json!({"a": 1, "b": 2})),
            Item::tool_use("t2", "add", json!({"a": "x"})),
        ]),
        Message::user_items(vec![
            Item::text("by the way"),
            Item::tool_result("t1", "3", Some(false)),
            Item::tool_result("t2", "invalid input", None),
        ]),
        Message::system("Only answer with numbers."),
        message(
            Role::System,
            vec![Item::Resume {
                instance_id: "i1".into(),
                suspend_id: "s1".into(),
            }],
        ),
        Message::instance(InstancePayload::State {
            instance_id: "i1".into(),
            patch: json!({"n": 1}),
        }),
        Message::assistant_items(vec![
            Item::text(""),
            Item::Output {
                data: json!({"n": 3}),
            },
        ]),
        Message::user_items(vec![
            Item::Image {
                mime_type: "image/png".into(),
                data: "aGVsbG8=".into(),
                detail: Some("high".into()),
            },
            Item::File {
                url: "https://files.example/report.pdf".into(),
                media_type: "application/pdf".into(),
                filename: Some("report.pdf".into()),
                byte_size: Some(10),
                storage_id: None,
            },
            Item::File {
                url: "https://files.example/data.csv".into(),
                media_type: "text/csv".into(),
                filename: None,
                byte_size: None,
                storage_id: None,
            },
        ]),
    ];
    let tools = tools();
    let choice = ToolChoice::Tool(tools[1].name.clone());
    let settings = ModelSettings {
        model: None,
        max_tokens: 1024,
        temperature: Some(0.5),
        thinking: None,
        parallel_tool_calls: false,
    };
    // A text answer to a forced tool choice: the server ignored the tools.
    let refused = client(&server)
        .complete(request(&history, &tools, &choice, &settings))
        .await;
    match refused {
        Err(ModelError::InvalidResponse(message)) => {
            assert!(
                message.contains(markov_providers::TEXT_INSTEAD_OF_TOOL_CALL),
                "{message}"
            )
        }
        other => panic!("a text answer to a forced call was accepted: {other:?}"),
    }

    let sent = server.single();
    assert_eq!(sent.method, "POST");
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.header("x-api-key"), Some(KEY));
    assert_eq!(sent.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(sent.header("content-type"), Some("application/json"));
    assert_eq!(sent.header("anthropic-beta"), None);
    let add_schema = &tools[0].input_schema;
    assert_eq!(
        sent.body,
        json!({
            "model": "claude-test",
            "max_tokens": 1024,
            "system": [{
                "type": "text",
                "text": "You are a calculator.",
                "cache_control": {"type": "ephemeral"}
            }],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Hello"},
                    {"type": "text", "text": "camera frame note"}
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Let me think", "signature": "sig-1"},
                    {"type": "text", "text": "Calling add"},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}},
                    {"type": "tool_use", "id": "t2", "name": "add", "input": {"a": "x"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "3", "is_error": false},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "invalid input"},
                    {"type": "text", "text": "by the way"},
                    {"type": "text", "text": "[System instruction] Only answer with numbers."}
                ]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "{\n  \"n\": 3\n}"}
                ]},
                {"role": "user", "content": [
                    {"type": "image", "source": {
                        "type": "base64", "media_type": "image/png", "data": "aGVsbG8="
                    }},
                    {"type": "text", "text": "[file: report.pdf (application/pdf)] https://files.example/report.pdf"},
                    // The conversation's cache breakpoint: the last block
                    // of the last message.
                    {"type": "text", "text": "[file: text/csv] https://files.example/data.csv",
                     "cache_control": {"type": "ephemeral"}}
                ]}
            ],
            "tools": [
                {"name": "add", "description": "Adds two numbers.", "input_schema": add_schema},
                {"name": "finish", "description": "Ends the run.",
                 "input_schema": {"type": "object"},
                 "cache_control": {"type": "ephemeral"}}
            ],
            "tool_choice": {"type": "tool", "name": "finish", "disable_parallel_tool_use": true},
            "temperature": 0.5
        })
    );
}

#[tokio::test]
async fn tool_choice_modes_are_mapped() {
    let cases = [
        (ToolChoice::Auto, json!({"type": "auto"})),
        (ToolChoice::Any, json!({"type": "any"})),
        (ToolChoice::None, json!({"type": "none"})),
    ];
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("ok")); cases.len()]).await;
    let model = client(&server);
    let history = [Message::user("hi")];
    let tools = tools();
    let settings = ModelSettings::default();
    for (choice, _) in &cases {
        // The text answers a forced choice only when tools are ignored.
        let result = model
            .complete(request(&history, &tools, choice, &settings))
            .await;
        assert_eq!(result.is_ok(), !choice.forces_tool_use(), "{result:?}");
    }
    let sent = server.requests();
    for ((_, expected), sent) in cases.iter().zip(sent) {
        assert_eq!(&sent.body["tool_choice"], expected);
    }
}

#[tokio::test]
async fn thinking_drops_temperature_and_caching_can_be_off() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("ok"))]).await;
    let model = Anthropic::builder()
        .api_key(KEY)
        .base_url(server.base_url())
        .model("claude-test")
        .prompt_caching(PromptCaching::Off)
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let tools = tools();
    let settings = ModelSettings {
        model: Some("claude-other".into()),
        max_tokens: 2048,
        temperature: Some(0.2),
        thinking: Some(Thinking::Enabled {
            budget_tokens: 1024,
        }),
        parallel_tool_calls: true,
    };
    model
        .complete(request(&history, &tools[..1], &ToolChoice::Auto, &settings))
        .await
        .unwrap();
    assert_eq!(
        server.single().body,
        json!({
            "model": "claude-other",
            "max_tokens": 2048,
            "system": [{"type": "text", "text": "You are a calculator."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"name": "add", "description": "Adds two numbers.",
                       "input_schema": tools[0].input_schema}],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024}
        })
    );
}

#[tokio::test]
async fn adaptive_thinking_and_no_tools() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("ok"))]).await;
    let history = [Message::user("hi")];
    let settings = ModelSettings {
        thinking: Some(Thinking::Adaptive),
        ..ModelSettings::default()
    };
    let request = ModelRequest::new("", &history, &settings).with_tool_choice(&ToolChoice::Any);
    client(&server).complete(request).await.unwrap();
    assert_eq!(
        server.single().body,
        json!({
            "model": "claude-test",
            "max_tokens": 4096,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
            ]}],
            "thinking": {"type": "adaptive"}
        })
    );
}

#[tokio::test]
async fn forced_tool_use_with_a_thinking_budget_is_refused_before_sending() {
    let server = FakeServer::start().await;
    let history = [Message::user("hi")];
    let tools = tools();
    let settings = ModelSettings {
        thinking: Some(Thinking::Enabled {
            budget_tokens: 1024,
        }),
        ..ModelSettings::default()
    };
    let error = client(&server)
        .complete(request(&history, &tools, &ToolChoice::Any, &settings))
        .await
        .unwrap_err();
    assert!(matches!(error, ModelError::InvalidRequest(_)), "{error:?}");
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn structured_output_uses_output_format_and_the_beta_header() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer(r#"{"n":1}"#))]).await;
    let history = [Message::user("count")];
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings).with_output_schema(Some(&schema));
    client(&server).complete(request).await.unwrap();
    let sent = server.single();
    assert_eq!(
        sent.header("anthropic-beta"),
        Some("structured-outputs-2025-11-13")
    );
    assert_eq!(
        sent.body["output_format"],
        json!({"type": "json_schema", "schema": schema})
    );
}

#[tokio::test]
async fn a_complete_answer_is_parsed() {
    let body = json!({
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [
            {"type": "thinking", "thinking": "2 + 3 is 5.", "signature": "EqQBCgIYAhIM"},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
            {"type": "text", "text": "Adding."},
            {"type": "tool_use", "id": "toolu_01", "name": "add", "input": {"a": 2, "b": 3}},
            {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {"query": "x"}},
            {"type": "mcp_tool_use", "id": "mcptoolu_01", "name": "echo", "server_name": "s", "input": {}}
        ],
        "stop_reason": "tool_use",
        "stop_sequence": null,
        "usage": {
            "input_tokens": 2095,
            "output_tokens": 503,
            "cache_creation_input_tokens": 2051,
            "cache_read_input_tokens": 1800
        }
    });
    let server = FakeServer::scripted(vec![Reply::json(200, body)]).await;
    let history = [Message::user("2 + 3?")];
    let settings = ModelSettings::default();
    let answer = client(&server)
        .complete(request(&history, &[], &ToolChoice::Auto, &settings))
        .await
        .unwrap();
    assert_eq!(
        answer,
        ModelResponse::new(
            vec![
                Item::Thinking {
                    thinking: "2 + 3 is 5.".into(),
                    signature: Some("EqQBCgIYAhIM".into()),
                },
                Item::text("Adding."),
                Item::tool_use("toolu_01", "add", json!({"a": 2, "b": 3})),
                Item::provider_tool_use("srvtoolu_01", "web_search", json!({"query": "x"})),
                // A block type this client does not know is kept as its JSON text.
                Item::text(
                    json!({"type": "mcp_tool_use", "id": "mcptoolu_01", "name": "echo",
                           "server_name": "s", "input": {}})
                    .to_string()
                ),
            ],
            StopReason::ToolUse
        )
        .with_usage(Usage {
            input_tokens: 2095,
            output_tokens: 503,
            cache_read_input_tokens: 1800,
            cache_creation_input_tokens: 2051,
            ..Usage::default()
        })
        .with_model("claude-test")
    );
}

#[tokio::test]
async fn every_stop_reason_is_mapped() {
    let cases = [
        ("end_turn", StopReason::EndTurn),
        ("tool_use", StopReason::ToolUse),
        ("max_tokens", StopReason::MaxTokens),
        ("stop_sequence", StopReason::StopSequence),
        ("pause_turn", StopReason::PauseTurn),
        ("refusal", StopReason::Refusal),
    ];
    let replies = cases
        .iter()
        .map(|(reason, _)| {
            let mut body = text_answer("x");
            body["stop_reason"] = json!(reason);
            Reply::json(200, body)
        })
        .collect();
    let server = FakeServer::scripted(replies).await;
    let model = client(&server);
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    for (_, expected) in cases {
        let answer = model
            .complete(request(&history, &[], &ToolChoice::Auto, &settings))
            .await
            .unwrap();
        assert_eq!(answer.stop_reason, expected);
    }
}

/// The stream from the documentation's shapes: thinking with a signature,
/// text, a tool call whose argument JSON is split mid-number, a ping, and
/// usage in `message_delta`.
fn tool_stream() -> String {
    [
        sse_event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": "msg_01", "type": "message", "role": "assistant", "content": [],
                "model": "claude-test", "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 472, "output_tokens": 2,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100}
            }}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "thinking_delta", "thinking": "I need to add."}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9G"}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        sse_event("ping", json!({"type": "ping"})),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "text_delta", "text": "Let me "}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "text_delta", "text": "add."}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 2,
                   "content_block": {"type": "tool_use", "id": "toolu_01", "name": "add", "input": {}}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 2,
                   "delta": {"type": "input_json_delta", "partial_json": ""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 2,
                   "delta": {"type": "input_json_delta", "partial_json": "{\"a\": 1"}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 2,
                   "delta": {"type": "input_json_delta", "partial_json": "2, \"b\""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 2,
                   "delta": {"type": "input_json_delta", "partial_json": ": 30}"}}),
        ),
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 2}),
        ),
        sse_event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                   "usage": {"output_tokens": 89}}),
        ),
        sse_event("message_stop", json!({"type": "message_stop"})),
    ]
    .concat()
}

#[tokio::test]
async fn a_stream_is_decoded_across_arbitrary_chunk_boundaries() {
    let server = FakeServer::scripted(vec![Reply::sse_split(&tool_stream(), 7)]).await;
    let history = [Message::user("12 + 30?")];
    let tools = tools();
    let settings = ModelSettings::default();
    let model = client(&server);
    let events: Vec<StreamEvent> = model
        .stream(request(&history, &tools, &ToolChoice::Auto, &settings))
        .map(|e| e.unwrap())
        .collect()
        .await;
    let expected_response = ModelResponse::new(
        vec![
            Item::Thinking {
                thinking: "I need to add.".into(),
                signature: Some("EqQBCgIYAhIM1gbcDa9G".into()),
            },
            Item::text("Let me add."),
            Item::tool_use("toolu_01", "add", json!({"a": 12, "b": 30})),
        ],
        StopReason::ToolUse,
    )
    .with_usage(Usage {
        input_tokens: 472,
        output_tokens: 89,
        cache_read_input_tokens: 100,
        cache_creation_input_tokens: 0,
        ..Usage::default()
    })
    // The model `message_start` names.
    .with_model("claude-test");
    assert_eq!(
        events,
        vec![
            StreamEvent::ThinkingDelta {
                index: 0,
                thinking: "I need to add.".into()
            },
            StreamEvent::TextDelta {
                index: 1,
                text: "Let me ".into()
            },
            StreamEvent::TextDelta {
                index: 1,
                text: "add.".into()
            },
            StreamEvent::ToolCallStart {
                index: 2,
                id: "toolu_01".into(),
                name: "add".into()
            },
            StreamEvent::ToolCallDelta {
                index: 2,
                partial_json: "{\"a\": 1".into()
            },
            StreamEvent::ToolCallDelta {
                index: 2,
                partial_json: "2, \"b\"".into()
            },
            StreamEvent::ToolCallDelta {
                index: 2,
                partial_json: ": 30}".into()
            },
            StreamEvent::Done(expected_response),
        ]
    );
    let sent = server.single().body;
    assert_eq!(sent["stream"], json!(true));
}

#[tokio::test]
async fn a_mid_stream_overload_ends_the_stream_with_its_error() {
    let stream = [
        sse_event(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_01", "usage": {"input_tokens": 5, "output_tokens": 1}}}),
        ),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}),
        ),
        sse_event(
            "error",
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        ),
    ]
    .concat();
    let server = FakeServer::scripted(vec![Reply::sse_chunks(vec![stream])]).await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let model = client(&server);
    let events: Vec<_> = model
        .stream(request(&history, &[], &ToolChoice::Auto, &settings))
        .collect()
        .await;
    assert_eq!(events.len(), 2);
    assert_eq!(
        events[0],
        Ok(StreamEvent::TextDelta {
            index: 0,
            text: "Hel".into()
        })
    );
    // A mid-stream error names the URL it came from.
    assert_eq!(
        events[1],
        Err(ModelError::Overloaded(format!(
            "Overloaded (from {}/v1/messages)",
            server.base_url()
        )))
    );
    assert_eq!(server.requests().len(), 1, "no retry once events were seen");
}

#[tokio::test]
async fn a_stream_cut_before_message_stop_is_an_error() {
    let stream = sse_event(
        "message_start",
        json!({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 1}}}),
    );
    let server = FakeServer::scripted(vec![Reply::sse_chunks(vec![stream])]).await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let model = client(&server);
    let result =
        collect_stream(model.stream(request(&history, &[], &ToolChoice::Auto, &settings))).await;
    assert!(
        matches!(result, Err(ModelError::InvalidResponse(_))),
        "{result:?}"
    );
}

fn overloaded() -> Reply {
    Reply::json(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    )
}

#[tokio::test]
async fn retries_stop_at_the_configured_count() {
    let server = FakeServer::scripted(vec![overloaded(), overloaded(), overloaded()]).await;
    let model = Anthropic::builder()
        .api_key(KEY)
        .base_url(server.base_url())
        .max_retries(1)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let error = model
        .complete(request(&history, &[], &ToolChoice::Auto, &settings))
        .await
        .unwrap_err();
    assert_eq!(
        error,
        ModelError::Overloaded(format!(
            "Overloaded (from {}/v1/messages)",
            server.base_url()
        ))
    );
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let server = FakeServer::scripted(vec![
        Reply::json(
            429,
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
        )
        .header("retry-after", "1"),
        Reply::json(200, text_answer("ok")),
    ])
    .await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let started = Instant::now();
    client(&server)
        .complete(request(&history, &[], &ToolChoice::Auto, &settings))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn streamed_calls_reuse_their_connection() {
    const CALLS: usize = 20;
    let server = FakeServer::start().await;
    server.answer_with(|_| Reply::sse(&markov_testkit::http::anthropic::text_events("ok")));
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let model = client(&server);
    for _ in 0..CALLS {
        let answer =
            collect_stream(model.stream(request(&history, &[], &ToolChoice::Auto, &settings)))
                .await
                .unwrap();
        assert_eq!(answer.stop_reason, StopReason::EndTurn);
    }
    // A body dropped unread after `message_stop` would close its
    // connection: one connection per call. Its end is read instead, so the
    // connection goes back to the pool (the odd call may still find it not
    // yet back and open another).
    let connections = server.connections();
    assert!(
        connections <= CALLS / 2,
        "{CALLS} streamed calls opened {connections} connections"
    );
}

/// Where `cache_control` is in a body: (message, block) of each message
/// block that carries one, and how many the whole body carries.
fn breakpoints(body: &Value) -> (Vec<(usize, usize)>, usize) {
    let mut in_messages = Vec::new();
    for (m, message) in body["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .enumerate()
    {
        for (b, block) in message["content"]
            .as_array()
            .expect("content")
            .iter()
            .enumerate()
        {
            if block.get("cache_control").is_some() {
                in_messages.push((m, b));
            }
        }
    }
    let total = body.to_string().matches("\"cache_control\"").count();
    (in_messages, total)
}

#[tokio::test]
async fn the_conversation_breakpoint_moves_to_the_last_message_as_the_history_grows() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("ok")); 3]).await;
    let model = client(&server);
    let tools = tools();
    let settings = ModelSettings::default();
    // One history, named as a machine names it: the client encodes its
    // messages once and keeps them (in test builds every body built from
    // those bytes is checked against the body encoded afresh).
    let id = markov_core::model::HistoryId::fresh();
    let mut history = vec![Message::user("What is 1 + 2?")];
    let choice = ToolChoice::Auto;
    model
        .complete(request(&history, &tools, &choice, &settings).with_history_id(id))
        .await
        .expect("answers");
    history.push(Message::assistant_items(vec![
        Item::text("Adding."),
        Item::tool_use("t1", "add", json!({"a": 1, "b": 2})),
    ]));
    history.push(Message::user_items(vec![Item::tool_result(
        "t1", "3", None,
    )]));
    model
        .complete(request(&history, &tools, &choice, &settings).with_history_id(id))
        .await
        .expect("answers");
    history.push(Message::assistant("3."));
    history.push(Message::user("And 3 + 4?"));
    model
        .complete(request(&history, &tools, &choice, &settings).with_history_id(id))
        .await
        .expect("answers");

    let sent = server.requests();
    let found: Vec<_> = sent.iter().map(|r| breakpoints(&r.body)).collect();
    // The last block of the last message each time, and three in all:
    // system, last tool, last message (the API allows four).
    assert_eq!(found[0], (vec![(0, 0)], 3));
    assert_eq!(found[1], (vec![(2, 0)], 3));
    assert_eq!(found[2], (vec![(4, 0)], 3));
    // Earlier messages are sent as they were, without the breakpoint they
    // once carried.
    assert_eq!(
        sent[2].body["messages"][0],
        json!({"role": "user", "content": [{"type": "text", "text": "What is 1 + 2?"}]})
    );
    assert_eq!(
        sent[2].body["messages"][2]["content"][0]["type"],
        "tool_result"
    );
    assert!(
        sent[2].body["messages"][2]["content"][0]
            .get("cache_control")
            .is_none()
    );
}

#[tokio::test]
async fn system_and_tools_caching_leaves_the_messages_without_a_breakpoint() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("ok"))]).await;
    let model = Anthropic::builder()
        .api_key(KEY)
        .base_url(server.base_url())
        .model("claude-test")
        .prompt_caching(PromptCaching::SystemAndTools)
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let tools = tools();
    let settings = ModelSettings::default();
    model
        .complete(request(&history, &tools, &ToolChoice::Auto, &settings))
        .await
        .unwrap();
    assert_eq!(breakpoints(&server.single().body), (vec![], 2));
}

/// Deferred tools go out with `defer_loading`, the API's tool search tool
/// after them and its beta; the cache breakpoint stays on the last tool
/// the prompt holds. The model's search and its result come back as
/// provider items, and the found tool's call as a client call.
#[tokio::test]
async fn deferred_tools_are_sent_for_the_apis_tool_search_and_its_blocks_read_back() {
    use expect_test::expect;
    use markov_core::ToolName;

    let answer = json!({
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [
            {"type": "server_tool_use", "id": "srvtoolu_01", "name": "tool_search_tool_bm25", "input": {"query": "add numbers"}},
            {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_01", "content": {"type": "tool_search_tool_search_result", "tool_references": [{"type": "tool_reference", "tool_name": "add"}]}},
            {"type": "tool_use", "id": "toolu_01", "name": "add", "input": {"a": 2, "b": 3}}
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 10, "output_tokens": 5}
    });
    let server = FakeServer::scripted(vec![Reply::json(200, answer)]).await;
    let history = [Message::user("2 + 3?")];
    let tools = tools();
    let deferred = [ToolName::new("add").expect("valid name")];
    let settings = ModelSettings::default();
    let client = Anthropic::builder()
        .api_key(KEY)
        .base_url(server.base_url())
        .model("claude-test")
        .prompt_caching(PromptCaching::SystemAndTools)
        .build()
        .expect("a valid client");
    assert!(client.native_tool_search());
    let response = client
        .complete(
            request(&history, &tools, &ToolChoice::Auto, &settings).with_deferred_tools(&deferred),
        )
        .await
        .expect("answers");
    let sent = server.single();
    assert_eq!(
        sent.header("anthropic-beta"),
        Some("advanced-tool-use-2025-11-20")
    );
    expect![[r#"
        [
          {
            "defer_loading": true,
            "description": "Adds two numbers.",
            "input_schema": {
              "properties": {
                "a": {
                  "type": "integer"
                },
                "b": {
                  "type": "integer"
                }
              },
              "required": [
                "a",
                "b"
              ],
              "type": "object"
            },
            "name": "add"
          },
          {
            "cache_control": {
              "type": "ephemeral"
            },
            "description": "Ends the run.",
            "input_schema": {
              "type": "object"
            },
            "name": "finish"
          },
          {
            "name": "tool_search_tool_bm25",
            "type": "tool_search_tool_bm25_20251119"
          }
        ]"#]]
    .assert_eq(&serde_json::to_string_pretty(&sent.body["tools"]).expect("json"));
    assert_eq!(
        response
            .provider_tool_calls()
            .map(|c| c.1)
            .collect::<Vec<_>>(),
        ["tool_search_tool_bm25"]
    );
    assert_eq!(
        response.tool_calls().map(|c| c.1).collect::<Vec<_>>(),
        ["add"]
    );
}

#[tokio::test]
async fn a_request_without_deferred_tools_sends_no_tool_search() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer("5"))]).await;
    let history = [Message::user("2 + 3?")];
    let tools = tools();
    let settings = ModelSettings::default();
    client(&server)
        .complete(request(&history, &tools, &ToolChoice::Auto, &settings))
        .await
        .expect("answers");
    let sent = server.single();
    assert_eq!(sent.header("anthropic-beta"), None);
    let text = sent.body["tools"].to_string();
    assert!(
        !text.contains("defer_loading") && !text.contains("tool_search"),
        "{text}"
    );
}
