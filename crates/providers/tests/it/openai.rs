//! The OpenAI-compatible client against a fake Chat Completions server on
//! loopback. The fixtures follow the shapes in OpenAI's public API
//! documentation.
#![cfg(feature = "openai")]

use std::time::{Duration, Instant};

use futures::StreamExt;
use markov_core::message::Items;
use markov_core::model::collect_stream;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelResponse, ModelSettings, Role, StopReason,
    StreamEvent, ToolChoice, ToolDefinition, Usage,
};
use markov_providers::{MaxTokensField, OpenAi, SchemaStrictness, StructuredOutput};
use markov_testkit::http::{FakeServer, Reply, sse_data};
use serde_json::{Value, json};

const KEY: &str = "sk-proj-test-secret-key";

fn client(server: &FakeServer) -> OpenAi {
    OpenAi::builder()
        .api_key(KEY)
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
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

fn completion(message: Value, finish_reason: &str) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_741_569_952,
        "model": "gpt-test",
        "choices": [{"index": 0, "message": message, "logprobs": null,
                     "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
                  "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0}}
    })
}

fn text_answer(text: &str) -> Value {
    completion(
        json!({"role": "assistant", "content": text, "refusal": null}),
        "stop",
    )
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
        Message::from(markov_core::message::MessageData {
            role: Role::Command,
            items: Items::List(vec![Item::Command {
                name: "reset".into(),
                input: json!({}),
                instance_id: None,
                client_id: None,
            }]),
            metadata: None,
        }),
        Message::assistant_items(vec![
            Item::Thinking {
                thinking: "hidden".into(),
                signature: Some("sig".into()),
            },
            Item::text("Calling add"),
            Item::tool_use("call_1", "add", json!({"a": 1, "b": 2})),
            Item::tool_use("call_2", "add", json!({"a": 3, "b": 4})),
        ]),
        Message::user_items(vec![
            Item::text("by the way"),
            Item::tool_result("call_1", "3", Some(false)),
            Item::tool_result("call_2", "7", None),
        ]),
        Message::system("Only answer with numbers."),
        Message::assistant_items(vec![Item::Output {
            data: json!({"n": 3}),
        }]),
        Message::user_items(vec![
            Item::text("Look:"),
            Item::Image {
                mime_type: "image/png".into(),
                data: "aGVsbG8=".into(),
                detail: None,
            },
            Item::File {
                url: "https://files.example/report.pdf".into(),
                media_type: "application/pdf".into(),
                filename: Some("report.pdf".into()),
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
    assert_eq!(sent.path, "/v1/chat/completions");
    assert_eq!(
        sent.header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
    assert_eq!(sent.header("content-type"), Some("application/json"));
    assert_eq!(
        sent.body,
        json!({
            "model": "gpt-test",
            "messages": [
                {"role": "system", "content": "You are a calculator."},
                {"role": "user", "content": "Hello"},
                {"role": "user", "content": "camera frame note"},
                {"role": "assistant", "content": "Calling add", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\":1,\"b\":2}"}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\":3,\"b\":4}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                {"role": "tool", "tool_call_id": "call_2", "content": "7"},
                {"role": "user", "content": "by the way"},
                {"role": "system", "content": "Only answer with numbers."},
                {"role": "assistant", "content": "{\n  \"n\": 3\n}"},
                {"role": "user", "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                    {"type": "text", "text": "[file: report.pdf (application/pdf)] https://files.example/report.pdf"}
                ]}
            ],
            "tools": [
                {"type": "function", "function": {
                    "name": "add", "description": "Adds two numbers.",
                    "parameters": tools[0].input_schema}},
                {"type": "function", "function": {
                    "name": "finish", "description": "Ends the run.",
                    "parameters": {"type": "object"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "finish"}},
            "parallel_tool_calls": false,
            "max_completion_tokens": 1024,
            "temperature": 0.5
        })
    );
}

#[tokio::test]
async fn tool_choice_modes_are_mapped() {
    let cases = [
        (ToolChoice::Auto, json!("auto")),
        (ToolChoice::Any, json!("required")),
        (ToolChoice::None, json!("none")),
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
    for ((_, expected), sent) in cases.iter().zip(server.requests()) {
        let body = sent.body.clone();
        assert_eq!(&body["tool_choice"], expected);
        assert!(body.get("parallel_tool_calls").is_none());
    }
}

#[tokio::test]
async fn older_servers_strict_schemas_and_structured_output() {
    let server = FakeServer::scripted(vec![Reply::json(200, text_answer(r#"{"n":1}"#))]).await;
    let model = OpenAi::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .model("local-model")
        .max_tokens_field(MaxTokensField::MaxTokens)
        .schema_strictness(SchemaStrictness::Strict)
        // A server known to keep tool calls possible under `response_format`.
        .structured_output(StructuredOutput::SchemaField)
        .build()
        .unwrap();
    let history = [Message::user("count")];
    let tools = tools();
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": false});
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings)
        .with_tools(&tools[1..])
        .with_output_schema(Some(&schema));
    model.complete(request).await.unwrap();
    let sent = server.single();
    assert_eq!(sent.header("authorization"), None, "no key, no header");
    assert_eq!(
        sent.body,
        json!({
            "model": "local-model",
            "messages": [{"role": "user", "content": "count"}],
            "tools": [{"type": "function", "function": {
                "name": "finish", "description": "Ends the run.",
                "parameters": {"type": "object"}, "strict": true}}],
            "tool_choice": "auto",
            "max_tokens": 4096,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "output", "schema": schema, "strict": true}}
        })
    );
}

#[tokio::test]
async fn a_complete_answer_with_tool_calls_is_parsed() {
    let body = json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-test",
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": null,
                "reasoning_content": "Two sums.",
                "tool_calls": [
                    {"id": "call_abc", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}},
                    {"id": "call_def", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": "}},
                    {"id": "call_ghi", "type": "function",
                     "function": {"name": "finish", "arguments": ""}},
                    {"id": "call_jkl", "type": "function",
                     "function": {"name": "add", "arguments": {"a": 5, "b": 6}}}
                ]
            },
            "finish_reason": "tool_calls"
        }],
        "usage": {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                  "prompt_tokens_details": {"cached_tokens": 1920},
                  "completion_tokens_details": {"reasoning_tokens": 120}}
    });
    let server = FakeServer::scripted(vec![Reply::json(200, body)]).await;
    let history = [Message::user("2 + 3?")];
    let settings = ModelSettings::default();
    let answer = client(&server)
        .complete(request(&history, &[], &ToolChoice::Auto, &settings))
        .await
        .unwrap();
    let Item::ToolUse { input: bad, .. } = &answer.content[2] else {
        panic!("a tool call");
    };
    assert_eq!(bad["__invalid_arguments"], json!("{\"a\": 2, \"b\": "));
    assert!(bad["__error"].is_string());
    assert_eq!(
        answer,
        ModelResponse::new(
            vec![
                Item::Thinking {
                    thinking: "Two sums.".into(),
                    signature: None
                },
                Item::tool_use("call_abc", "add", json!({"a": 2, "b": 3})),
                Item::tool_use("call_def", "add", bad.clone()),
                Item::tool_use("call_ghi", "finish", json!({})),
                Item::tool_use("call_jkl", "add", json!({"a": 5, "b": 6})),
            ],
            StopReason::ToolUse
        )
        .with_usage(Usage {
            input_tokens: 86,
            output_tokens: 300,
            cache_read_input_tokens: 1920,
            reasoning_tokens: 120,
            ..Usage::default()
        })
        .with_model("gpt-test")
    );
}

#[tokio::test]
async fn finish_reasons_and_refusals_are_mapped() {
    let call = json!([{"id": "c1", "type": "function",
                       "function": {"name": "add", "arguments": "{}"}}]);
    let cases = [
        (
            json!({"role": "assistant", "content": "x"}),
            "stop",
            StopReason::EndTurn,
        ),
        (
            json!({"role": "assistant", "tool_calls": call}),
            "tool_calls",
            StopReason::ToolUse,
        ),
        // Some servers say `stop` while calling tools.
        (
            json!({"role": "assistant", "tool_calls": call}),
            "stop",
            StopReason::ToolUse,
        ),
        (
            json!({"role": "assistant", "content": "x"}),
            "length",
            StopReason::MaxTokens,
        ),
        (
            json!({"role": "assistant", "content": ""}),
            "content_filter",
            StopReason::ContentFilter,
        ),
        (
            json!({"role": "assistant", "content": null, "refusal": "I can't help with that."}),
            "stop",
            StopReason::Refusal,
        ),
    ];
    let replies = cases
        .iter()
        .map(|(message, reason, _)| Reply::json(200, completion(message.clone(), reason)))
        .collect();
    let server = FakeServer::scripted(replies).await;
    let model = client(&server);
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    for (_, _, expected) in &cases {
        let answer = model
            .complete(request(&history, &[], &ToolChoice::Auto, &settings))
            .await
            .unwrap();
        assert_eq!(&answer.stop_reason, expected);
    }
}

fn chunk(delta: Value, finish_reason: Value) -> String {
    sse_data(
        &json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-test",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
            "usage": null
        })
        .to_string(),
    )
}

/// Two tool calls streamed as the documentation shows them: the first
/// delta of each carries id and name, later ones argument fragments (here
/// split mid-number and mid-key); usage arrives in a last chunk with no
/// choices, then `[DONE]`.
fn tool_stream() -> String {
    let call = |index: usize, id: Option<&str>, name: Option<&str>, args: &str| {
        let mut function = json!({"arguments": args});
        if let Some(name) = name {
            function["name"] = json!(name);
        }
        let mut call = json!({"index": index, "function": function});
        if let Some(id) = id {
            call["id"] = json!(id);
            call["type"] = json!("function");
        }
        chunk(json!({"tool_calls": [call]}), Value::Null)
    };
    [
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"reasoning_content": "Sum them."}), Value::Null),
        chunk(json!({"content": "Adding"}), Value::Null),
        chunk(json!({"content": " both."}), Value::Null),
        call(0, Some("call_a"), Some("add"), ""),
        call(0, None, None, "{\"a\": 1"),
        call(1, Some("call_b"), Some("add"), "{\"a\""),
        call(0, None, None, "2, \"b\": 30}"),
        call(1, None, None, ": 5, \"b\": 6}"),
        chunk(json!({}), json!("tool_calls")),
        sse_data(
            &json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [],
                    "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70,
                              "prompt_tokens_details": {"cached_tokens": 10}}})
            .to_string(),
        ),
        sse_data("[DONE]"),
    ]
    .concat()
}

#[tokio::test]
async fn a_stream_is_decoded_across_arbitrary_chunk_boundaries() {
    let server = FakeServer::scripted(vec![Reply::sse_split(&tool_stream(), 5)]).await;
    let history = [Message::user("12 + 30 and 5 + 6?")];
    let tools = tools();
    let settings = ModelSettings::default();
    let model = client(&server);
    let events: Vec<StreamEvent> = model
        .stream(request(&history, &tools, &ToolChoice::Auto, &settings))
        .map(|e| e.unwrap())
        .collect()
        .await;
    let response = ModelResponse::new(
        vec![
            Item::Thinking {
                thinking: "Sum them.".into(),
                signature: None,
            },
            Item::text("Adding both."),
            Item::tool_use("call_a", "add", json!({"a": 12, "b": 30})),
            Item::tool_use("call_b", "add", json!({"a": 5, "b": 6})),
        ],
        StopReason::ToolUse,
    )
    .with_usage(Usage {
        input_tokens: 40,
        output_tokens: 20,
        cache_read_input_tokens: 10,
        cache_creation_input_tokens: 0,
        ..Usage::default()
    })
    // The model the chunks name.
    .with_model("gpt-test");
    let delta = |index: usize, json: &str| StreamEvent::ToolCallDelta {
        index,
        partial_json: json.into(),
    };
    assert_eq!(
        events,
        vec![
            StreamEvent::ThinkingDelta {
                index: 0,
                thinking: "Sum them.".into()
            },
            StreamEvent::TextDelta {
                index: 1,
                text: "Adding".into()
            },
            StreamEvent::TextDelta {
                index: 1,
                text: " both.".into()
            },
            StreamEvent::ToolCallStart {
                index: 2,
                id: "call_a".into(),
                name: "add".into()
            },
            delta(2, "{\"a\": 1"),
            StreamEvent::ToolCallStart {
                index: 3,
                id: "call_b".into(),
                name: "add".into()
            },
            delta(3, "{\"a\""),
            delta(2, "2, \"b\": 30}"),
            delta(3, ": 5, \"b\": 6}"),
            StreamEvent::Done(response),
        ]
    );
    let sent = server.single().body;
    assert_eq!(sent["stream"], json!(true));
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn a_stream_without_done_ends_at_its_finish_reason() {
    let stream = [
        chunk(json!({"content": "Hi"}), Value::Null),
        chunk(json!({}), json!("stop")),
    ]
    .concat();
    let server = FakeServer::scripted(vec![Reply::sse_chunks(vec![stream])]).await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let model = client(&server);
    let answer = collect_stream(model.stream(request(&history, &[], &ToolChoice::Auto, &settings)))
        .await
        .unwrap();
    assert_eq!(answer.content, vec![Item::text("Hi")]);
    assert_eq!(answer.stop_reason, StopReason::EndTurn);
}

#[tokio::test]
async fn a_cut_stream_and_a_mid_stream_error_fail() {
    let cut = chunk(json!({"content": "Hi"}), Value::Null);
    let error = [
        chunk(json!({"content": "Hi"}), Value::Null),
        sse_data(r#"{"error":{"message":"The server had an error while processing your request.","type":"server_error"}}"#),
    ]
    .concat();
    let server = FakeServer::scripted(vec![
        Reply::sse_chunks(vec![cut]),
        Reply::sse_chunks(vec![error]),
    ])
    .await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let model = client(&server);
    let result =
        collect_stream(model.stream(request(&history, &[], &ToolChoice::Auto, &settings))).await;
    assert!(
        matches!(result, Err(ModelError::InvalidResponse(_))),
        "{result:?}"
    );
    let events: Vec<_> = model
        .stream(request(&history, &[], &ToolChoice::Auto, &settings))
        .collect()
        .await;
    assert_eq!(
        events,
        vec![
            Ok(StreamEvent::TextDelta {
                index: 0,
                text: "Hi".into()
            }),
            // A mid-stream error names the URL it came from.
            Err(ModelError::Http {
                status: 500,
                message: format!(
                    "The server had an error while processing your request. \
                     (from {}/v1/chat/completions)",
                    server.base_url()
                ),
                retry_after: None
            })
        ]
    );
    assert_eq!(server.requests().len(), 2);
}

fn rate_limited() -> Reply {
    Reply::json(
        429,
        json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}),
    )
    .header("retry-after-ms", "20")
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_retried() {
    let server = FakeServer::scripted(vec![
        rate_limited(),
        Reply::text(502, "bad gateway"),
        Reply::json(200, text_answer("ok")),
    ])
    .await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let started = Instant::now();
    let answer = client(&server)
        .complete(request(&history, &[], &ToolChoice::Auto, &settings))
        .await
        .unwrap();
    assert_eq!(answer.content, vec![Item::text("ok")]);
    assert_eq!(server.requests().len(), 3);
    assert!(started.elapsed() >= Duration::from_millis(20));
}

#[tokio::test]
async fn a_stalled_stream_times_out() {
    let server = FakeServer::scripted(vec![Reply::hang(Duration::from_secs(5))]).await;
    let model = OpenAi::builder()
        .base_url(server.base_url())
        .max_retries(0)
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let result =
        collect_stream(model.stream(request(&history, &[], &ToolChoice::Auto, &settings))).await;
    assert_eq!(result, Err(ModelError::Timeout(Duration::from_millis(200))));
}

#[tokio::test]
async fn a_stream_that_stalls_mid_body_times_out() {
    let first = chunk(json!({"content": "Hi"}), Value::Null);
    let server = FakeServer::scripted(vec![
        Reply::sse_chunks(vec![first]).then_stall(Duration::from_secs(5)),
    ])
    .await;
    let model = OpenAi::builder()
        .base_url(server.base_url())
        .max_retries(0)
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let started = Instant::now();
    let events: Vec<_> = model
        .stream(request(&history, &[], &ToolChoice::Auto, &settings))
        .collect()
        .await;
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[0].is_ok());
    assert_eq!(
        events[1],
        Err(ModelError::Timeout(Duration::from_millis(300)))
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn a_model_list_names_each_model_once() {
    // llama.cpp's server lists its one model twice: in `data` and again
    // in Ollama's shape under `models`.
    let llama_cpp = json!({
        "models": [{"name": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "model": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "type": "model"}],
        "object": "list",
        "data": [{"id": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "object": "model",
                  "owned_by": "llamacpp"}]
    });
    let twice =
        json!({"object": "list", "data": [{"id": "qwen3"}, {"id": "qwen3"}, {"id": "llama3.2"}]});
    let server =
        FakeServer::scripted(vec![Reply::json(200, llama_cpp), Reply::json(200, twice)]).await;
    let model = client(&server);
    assert_eq!(
        model.served_models().await.expect("a list"),
        ["/models/SmolLM2-135M-Instruct.Q4_1.gguf"]
    );
    assert_eq!(
        model.served_models().await.expect("a list"),
        ["qwen3", "llama3.2"]
    );
}

#[tokio::test]
async fn a_streamed_text_answer_to_a_forced_call_says_the_model_chose_text() {
    let server = FakeServer::scripted(vec![Reply::sse(
        &markov_testkit::http::openai::text_events("A confident guess."),
    )])
    .await;
    let history = [Message::user("Use the tool.")];
    let tools = tools();
    let settings = ModelSettings::default();
    let events: Vec<_> = client(&server)
        .stream(request(&history, &tools, &ToolChoice::Any, &settings))
        .collect()
        .await;
    match events.last() {
        Some(Err(ModelError::InvalidResponse(message))) => {
            assert!(
                message.contains(markov_providers::TEXT_INSTEAD_OF_TOOL_CALL),
                "{message}"
            );
            assert!(message.contains("--jinja"), "{message}");
        }
        other => panic!("the made-up answer was accepted: {other:?}"),
    }
}

#[tokio::test]
async fn a_tool_call_left_in_the_text_says_the_server_does_not_parse_calls() {
    // Qwen's, Mistral's and Llama's call markers, and a bare JSON call.
    for text in [
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>",
        "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}}]",
        "<|python_tag|>add(a=1, b=2)",
        "{\"name\": \"add\", \"parameters\": {\"a\": 1}}",
    ] {
        let server = FakeServer::scripted(vec![Reply::json(
            200,
            markov_testkit::http::openai::text(text),
        )])
        .await;
        let history = [Message::user("Use the tool.")];
        let tools = tools();
        let settings = ModelSettings::default();
        match client(&server)
            .complete(request(&history, &tools, &ToolChoice::Any, &settings))
            .await
        {
            Err(ModelError::InvalidResponse(message)) => {
                assert!(
                    message.contains(markov_providers::TOOL_CALL_AS_TEXT),
                    "{message}"
                );
                assert!(
                    !message.contains(markov_providers::TEXT_INSTEAD_OF_TOOL_CALL),
                    "{message}"
                );
                assert!(message.contains("--tool-call-parser"), "{message}");
            }
            other => panic!("{text}: the text call was accepted: {other:?}"),
        }
    }
}
