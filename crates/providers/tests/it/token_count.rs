//! Token counts from the providers' counting endpoints, and Anthropic's
//! context editing: the path and body each client sends (snapshots), the
//! answer read, the clients without an endpoint, errors classified as for
//! calls.
#![cfg(all(
    feature = "anthropic",
    feature = "openai",
    feature = "responses",
    feature = "gemini"
))]

use std::sync::Arc;
use std::time::Duration;

use expect_test::{Expect, expect};
use markov_core::model::{HistoryId, InputTokenCount};
use markov_core::tool::ProviderTool;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelSettings, ToolChoice, ToolDefinition,
};
use markov_providers::{
    Anthropic, ClearToolUses, ConfigError, Fallback, Gemini, OpenAi, Responses,
};
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic, gemini, responses};
use serde_json::json;

fn conversation() -> Vec<Message> {
    vec![
        Message::user("What is 2 + 3?"),
        Message::assistant_items(vec![
            Item::text("Let me add."),
            Item::tool_use("call_1", "add", json!({"a": 2, "b": 3})),
        ]),
        Message::user_items(vec![Item::tool_result("call_1", "5", Some(false))]),
    ]
}

fn tools() -> Vec<ToolDefinition> {
    vec![
        ToolDefinition::new(
            "add",
            "Add two integers",
            json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
        )
        .expect("a valid name"),
    ]
}

/// Settings with what a count leaves out (`max_tokens`, a temperature).
fn settings() -> ModelSettings {
    ModelSettings {
        model: Some("golden-model".into()),
        max_tokens: 256,
        temperature: Some(0.5),
        ..ModelSettings::default()
    }
}

/// Counts the conversation with `model`; the count, and the one request
/// the server got, its path and body checked against `golden`.
async fn count(model: &dyn Model, server: &FakeServer, golden: Expect) -> InputTokenCount {
    let history = conversation();
    let tools = tools();
    let settings = settings();
    let request = ModelRequest::new("You do arithmetic.", &history, &settings)
        .with_tools(&tools)
        .with_tool_choice(&ToolChoice::Auto)
        .with_history_id(HistoryId::fresh());
    let counted = model.count_tokens(request).await.expect("counted");
    let sent = server.single();
    let shown = format!(
        "{} {}\n{}",
        sent.method,
        sent.path,
        serde_json::to_string_pretty(&sent.body).expect("json")
    );
    golden.assert_eq(&shown);
    counted
}

#[tokio::test]
async fn anthropic_counts_with_the_calls_body_less_what_the_endpoint_takes_not() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, anthropic::count(1_234)));
    let model = Anthropic::builder()
        .api_key("sk-ant-golden")
        .base_url(server.base_url())
        .build()
        .expect("client");
    let counted = count(
        &model,
        &server,
        expect![[r#"
        POST /v1/messages/count_tokens
        {
          "messages": [
            {
              "content": [
                {
                  "text": "What is 2 + 3?",
                  "type": "text"
                }
              ],
              "role": "user"
            },
            {
              "content": [
                {
                  "text": "Let me add.",
                  "type": "text"
                },
                {
                  "id": "call_1",
                  "input": {
                    "a": 2,
                    "b": 3
                  },
                  "name": "add",
                  "type": "tool_use"
                }
              ],
              "role": "assistant"
            },
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "content": "5",
                  "is_error": false,
                  "tool_use_id": "call_1",
                  "type": "tool_result"
                }
              ],
              "role": "user"
            }
          ],
          "model": "golden-model",
          "system": [
            {
              "cache_control": {
                "type": "ephemeral"
              },
              "text": "You do arithmetic.",
              "type": "text"
            }
          ],
          "tool_choice": {
            "type": "auto"
          },
          "tools": [
            {
              "cache_control": {
                "type": "ephemeral"
              },
              "description": "Add two integers",
              "input_schema": {
                "properties": {
                  "a": {
                    "type": "integer"
                  }
                },
                "type": "object"
              },
              "name": "add"
            }
          ]
        }"#]],
    )
    .await;
    assert_eq!(counted, InputTokenCount::Counted(1_234));
    let sent = server.single();
    assert_eq!(sent.header("x-api-key"), Some("sk-ant-golden"));
    assert_eq!(sent.header("anthropic-beta"), None);
}

#[tokio::test]
async fn gemini_counts_the_whole_generate_content_request() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, gemini::count(987)));
    let model = Gemini::builder()
        .api_key("AIza-golden")
        .base_url(server.base_url())
        .build()
        .expect("client");
    let counted = count(
        &model,
        &server,
        expect![[r#"
        POST /v1beta/models/golden-model:countTokens
        {
          "generateContentRequest": {
            "contents": [
              {
                "parts": [
                  {
                    "text": "What is 2 + 3?"
                  }
                ],
                "role": "user"
              },
              {
                "parts": [
                  {
                    "text": "Let me add."
                  },
                  {
                    "functionCall": {
                      "args": {
                        "a": 2,
                        "b": 3
                      },
                      "id": "call_1",
                      "name": "add"
                    }
                  }
                ],
                "role": "model"
              },
              {
                "parts": [
                  {
                    "functionResponse": {
                      "id": "call_1",
                      "name": "add",
                      "response": {
                        "content": "5"
                      }
                    }
                  }
                ],
                "role": "user"
              }
            ],
            "generationConfig": {
              "maxOutputTokens": 256,
              "temperature": 0.5
            },
            "model": "models/golden-model",
            "systemInstruction": {
              "parts": [
                {
                  "text": "You do arithmetic."
                }
              ]
            },
            "toolConfig": {
              "functionCallingConfig": {
                "mode": "AUTO"
              }
            },
            "tools": [
              {
                "functionDeclarations": [
                  {
                    "description": "Add two integers",
                    "name": "add",
                    "parameters": {
                      "properties": {
                        "a": {
                          "type": "INTEGER"
                        }
                      },
                      "type": "OBJECT"
                    }
                  }
                ]
              }
            ]
          }
        }"#]],
    )
    .await;
    assert_eq!(counted, InputTokenCount::Counted(987));
    assert_eq!(
        server.single().header("x-goog-api-key"),
        Some("AIza-golden")
    );
}

#[tokio::test]
async fn responses_counts_at_input_tokens_without_the_calls_own_fields() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, responses::input_tokens(55)));
    let model = Responses::builder()
        .api_key("sk-proj-golden")
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("client");
    let counted = count(
        &model,
        &server,
        expect![[r#"
        POST /v1/responses/input_tokens
        {
          "input": [
            {
              "content": "What is 2 + 3?",
              "role": "user",
              "type": "message"
            },
            {
              "content": "Let me add.",
              "role": "assistant",
              "type": "message"
            },
            {
              "arguments": "{\"a\":2,\"b\":3}",
              "call_id": "call_1",
              "name": "add",
              "type": "function_call"
            },
            {
              "call_id": "call_1",
              "output": "5",
              "type": "function_call_output"
            }
          ],
          "instructions": "You do arithmetic.",
          "model": "golden-model",
          "tool_choice": "auto",
          "tools": [
            {
              "description": "Add two integers",
              "name": "add",
              "parameters": {
                "properties": {
                  "a": {
                    "type": "integer"
                  }
                },
                "type": "object"
              },
              "strict": false,
              "type": "function"
            }
          ]
        }"#]],
    )
    .await;
    assert_eq!(counted, InputTokenCount::Counted(55));
}

#[tokio::test]
async fn chat_completions_offers_no_count_and_sends_nothing() {
    let server = FakeServer::start().await;
    let model = OpenAi::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("client");
    let history = conversation();
    let settings = settings();
    let counted = model
        .count_tokens(ModelRequest::new("", &history, &settings))
        .await;
    assert_eq!(counted, Ok(InputTokenCount::NotOffered));
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn anthropic_does_not_count_server_tools_its_endpoint_refuses() {
    let server = FakeServer::start().await;
    let model = Anthropic::builder()
        .base_url(server.base_url())
        .build()
        .expect("client");
    let history = conversation();
    let settings = settings();
    let search = [ProviderTool::new("web_search_20250305", "web_search").expect("a valid tool")];
    let request = ModelRequest::new("", &history, &settings).with_provider_tools(&search);
    assert_eq!(
        model.count_tokens(request).await,
        Ok(InputTokenCount::NotOffered)
    );
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn a_failed_count_is_classified_and_retried_like_a_call() {
    let server = FakeServer::scripted(vec![
        Reply::json(529, anthropic::error("overloaded_error", "Overloaded")),
        Reply::json(200, anthropic::count(7)),
        Reply::json(400, anthropic::error("invalid_request_error", "bad model")),
        Reply::json(200, json!({"tokens": "many"})),
    ])
    .await;
    let model = Anthropic::builder()
        .base_url(server.base_url())
        .max_retries(1)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .build()
        .expect("client");
    let history = conversation();
    let settings = settings();
    let request = ModelRequest::new("", &history, &settings);
    // An overload is retried, as a call's is.
    assert_eq!(
        model.count_tokens(request).await,
        Ok(InputTokenCount::Counted(7))
    );
    // A refusal is not, and keeps the provider's words.
    match model.count_tokens(request).await {
        Err(ModelError::Http {
            status: 400,
            message,
            ..
        }) => assert!(message.contains("bad model"), "{message}"),
        other => panic!("{other:?}"),
    }
    // An answer without the count is an invalid response.
    assert!(matches!(
        model.count_tokens(request).await,
        Err(ModelError::InvalidResponse(_))
    ));
    let paths: Vec<String> = server.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/v1/messages/count_tokens"; 4]);
}

#[tokio::test]
async fn a_count_waits_no_longer_than_the_clients_timeout() {
    let server = FakeServer::scripted(vec![Reply::hang(Duration::from_secs(30))]).await;
    let model = Anthropic::builder()
        .base_url(server.base_url())
        .max_retries(0)
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let history = conversation();
    let settings = settings();
    let counted = model
        .count_tokens(ModelRequest::new("", &history, &settings))
        .await;
    assert!(
        matches!(counted, Err(ModelError::Timeout(_))),
        "{counted:?}"
    );
}

#[tokio::test]
async fn a_fallback_counts_with_its_first_model_only() {
    let first = FakeServer::scripted(vec![Reply::json(200, anthropic::count(11))]).await;
    let second = FakeServer::start().await;
    let model = Fallback::new(Arc::new(
        Anthropic::builder()
            .base_url(first.base_url())
            .build()
            .expect("client"),
    ))
    .or_named(
        Arc::new(
            Responses::builder()
                .base_url(format!("{}/v1", second.base_url()))
                .build()
                .expect("client"),
        ),
        "gpt-4.1-mini",
    );
    let history = conversation();
    let settings = settings();
    assert_eq!(
        model
            .count_tokens(ModelRequest::new("", &history, &settings))
            .await,
        Ok(InputTokenCount::Counted(11))
    );
    assert_eq!(first.single().path, "/v1/messages/count_tokens");
    assert!(second.requests().is_empty());
}

fn editing() -> ClearToolUses {
    ClearToolUses::new()
        .trigger_input_tokens(30_000)
        .keep_tool_uses(2)
        .clear_at_least(5_000)
        .exclude_tools(["memory"])
        .clear_tool_inputs(true)
}

/// The beta header and the `context_management` field ride on every
/// request of a client that edits context, calls and counts alike; the
/// messages are encoded as without it.
#[tokio::test]
async fn anthropic_context_editing_is_sent_on_every_request() {
    let server = FakeServer::start().await;
    server.answer_with(|request: &Recorded| {
        if request.path.ends_with("/count_tokens") {
            Reply::json(200, anthropic::count(40_000))
        } else {
            Reply::json(
                200,
                anthropic::with_cleared_tool_uses(anthropic::text("5"), 3, 12_000),
            )
        }
    });
    let model = Anthropic::builder()
        .base_url(server.base_url())
        .prompt_caching(markov_providers::PromptCaching::Off)
        .clear_tool_uses(editing())
        .build()
        .expect("client");
    let history = conversation();
    let settings = settings();
    let request = ModelRequest::new("", &history, &settings);
    let answer = model.complete(request).await.expect("answered");
    assert_eq!(answer.content, vec![Item::text("5")]);
    model.count_tokens(request).await.expect("counted");
    let sent = server.requests();
    assert_eq!(sent.len(), 2);
    for request in &sent {
        assert_eq!(
            request.header("anthropic-beta"),
            Some("context-management-2025-06-27"),
            "{}",
            request.path
        );
        assert_eq!(
            request.body["context_management"],
            sent[0].body["context_management"]
        );
    }
    expect![[r#"
        {
          "edits": [
            {
              "clear_at_least": {
                "type": "input_tokens",
                "value": 5000
              },
              "clear_tool_inputs": true,
              "exclude_tools": [
                "memory"
              ],
              "keep": {
                "type": "tool_uses",
                "value": 2
              },
              "trigger": {
                "type": "input_tokens",
                "value": 30000
              },
              "type": "clear_tool_uses_20250919"
            }
          ]
        }"#]]
    .assert_eq(&serde_json::to_string_pretty(&sent[0].body["context_management"]).unwrap());
    // Without editing, the same messages.
    let plain = Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .prompt_caching(markov_providers::PromptCaching::Off)
        .build()
        .expect("client");
    let body: serde_json::Value =
        serde_json::from_slice(&plain.request_body(&request, false).unwrap()).unwrap();
    assert_eq!(body["messages"], sent[0].body["messages"]);

    // Structured output adds its beta beside it.
    let schema = json!({"type": "object", "properties": {"sum": {"type": "integer"}}});
    let structured = ModelRequest::new("", &history, &settings).with_output_schema(Some(&schema));
    model.count_tokens(structured).await.expect("counted");
    assert_eq!(
        server.requests()[2].header("anthropic-beta"),
        Some("structured-outputs-2025-11-13,context-management-2025-06-27")
    );
}

/// Context editing is a field beside the messages: the client's cache of
/// encoded messages serves calls and counts of a growing history as
/// before, each body equal to the one encoded afresh (the debug check of
/// every cached body runs too).
#[test]
fn context_editing_keeps_the_request_cache_working() {
    let model = Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .clear_tool_uses(editing())
        .build()
        .expect("client");
    let settings = settings();
    let tools = tools();
    let id = HistoryId::fresh();
    let mut history = Vec::new();
    for n in 0..12 {
        history.push(Message::user(format!("question {n}")));
        history.push(Message::assistant_items(vec![Item::tool_use(
            format!("call_{n}"),
            "add",
            json!({"a": n}),
        )]));
        history.push(Message::user_items(vec![Item::tool_result(
            format!("call_{n}"),
            "a result",
            Some(false),
        )]));
        let request = ModelRequest::new("Add.", &history, &settings)
            .with_tools(&tools)
            .with_history_id(id);
        let cached = model.request_body(&request, n % 2 == 0).expect("body");
        assert_eq!(
            cached,
            model.request_body_uncached(&request, n % 2 == 0).unwrap()
        );
        // A count between calls takes its messages from the same cache.
        let counted: serde_json::Value =
            serde_json::from_slice(&model.count_body(&request).expect("count body")).unwrap();
        let called: serde_json::Value = serde_json::from_slice(&cached).unwrap();
        assert_eq!(counted["messages"], called["messages"]);
        assert_eq!(counted["context_management"], called["context_management"]);
        assert!(counted.get("max_tokens").is_none() && counted.get("stream").is_none());
    }
}

#[test]
fn context_editing_that_could_never_clear_is_refused_when_built() {
    let build = |editing: ClearToolUses| {
        Anthropic::builder()
            .base_url("http://127.0.0.1:1")
            .clear_tool_uses(editing)
            .build()
    };
    for (editing, words) in [
        (ClearToolUses::new().trigger_input_tokens(0), "trigger of 0"),
        (ClearToolUses::new().trigger_tool_uses(0), "trigger of 0"),
        (
            ClearToolUses::new().clear_at_least(0),
            "clear_at_least of 0",
        ),
        (
            ClearToolUses::new()
                .trigger_input_tokens(10_000)
                .clear_at_least(10_000),
            "not below the trigger",
        ),
        (ClearToolUses::new().exclude_tools([" "]), "no name"),
    ] {
        match build(editing) {
            Err(error @ ConfigError::InvalidOption { option, .. }) => {
                assert_eq!(option, "clear_tool_uses");
                assert!(error.to_string().contains(words), "{error}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(build(ClearToolUses::new()).is_ok());
}
