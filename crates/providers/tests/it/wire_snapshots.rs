//! The request bodies both clients send for one small conversation, as
//! snapshots: `UPDATE_EXPECT=1 cargo test` rewrites them after a deliberate
//! change to the wire format (review the diff).
#![cfg(all(feature = "anthropic", feature = "openai"))]

use expect_test::{Expect, expect};
use markov_core::{Item, Message, Model, ModelRequest, ModelSettings, ToolChoice, ToolDefinition};
use markov_providers::{Anthropic, OpenAi};
use markov_testkit::http::{FakeServer, Reply, anthropic, openai};
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
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}),
        )
        .expect("a valid name"),
    ]
}

async fn sent_body(model: &dyn Model, server: &FakeServer, golden: Expect) {
    let history = conversation();
    let tools = tools();
    let settings = ModelSettings {
        model: Some("golden-model".into()),
        max_tokens: 256,
        ..ModelSettings::default()
    };
    let request = ModelRequest::new("You do arithmetic.", &history, &settings)
        .with_tools(&tools)
        .with_tool_choice(&ToolChoice::Auto);
    model.complete(request).await.expect("answered");
    let body = serde_json::to_string_pretty(&server.single().body).expect("json");
    golden.assert_eq(&body);
}

#[tokio::test]
async fn the_anthropic_request_body() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, anthropic::text("5")));
    let model = Anthropic::builder()
        .api_key("sk-ant-golden")
        .base_url(server.base_url())
        .build()
        .expect("client");
    sent_body(
        &model,
        &server,
        expect![[r#"
        {
          "max_tokens": 256,
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
            }
          ]
        }"#]],
    )
    .await;
}

#[tokio::test]
async fn the_openai_request_body() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, openai::text("5")));
    let model = OpenAi::builder()
        .api_key("sk-golden")
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("client");
    sent_body(
        &model,
        &server,
        expect![[r#"
        {
          "max_completion_tokens": 256,
          "messages": [
            {
              "content": "You do arithmetic.",
              "role": "system"
            },
            {
              "content": "What is 2 + 3?",
              "role": "user"
            },
            {
              "content": "Let me add.",
              "role": "assistant",
              "tool_calls": [
                {
                  "function": {
                    "arguments": "{\"a\":2,\"b\":3}",
                    "name": "add"
                  },
                  "id": "call_1",
                  "type": "function"
                }
              ]
            },
            {
              "content": "5",
              "role": "tool",
              "tool_call_id": "call_1"
            }
          ],
          "model": "golden-model",
          "tool_choice": "auto",
          "tools": [
            {
              "function": {
                "description": "Add two integers",
                "name": "add",
                "parameters": {
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
                }
              },
              "type": "function"
            }
          ]
        }"#]],
    )
    .await;
}

#[cfg(feature = "responses")]
#[tokio::test]
async fn the_responses_request_body() {
    use markov_testkit::http::responses;
    let server = FakeServer::scripted(vec![Reply::json(200, responses::text("5"))]).await;
    let client = markov_providers::Responses::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("builds");
    sent_body(
        &client,
        &server,
        expect![[r#"
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
          "max_output_tokens": 256,
          "model": "golden-model",
          "store": false,
          "tool_choice": "auto",
          "tools": [
            {
              "description": "Add two integers",
              "name": "add",
              "parameters": {
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
              "strict": false,
              "type": "function"
            }
          ]
        }"#]],
    )
    .await;
}

#[cfg(feature = "gemini")]
#[tokio::test]
async fn the_gemini_request_body() {
    use markov_testkit::http::gemini;
    let server = FakeServer::scripted(vec![Reply::json(200, gemini::text("5"))]).await;
    let client = markov_providers::Gemini::builder()
        .base_url(server.base_url())
        .build()
        .expect("builds");
    sent_body(
        &client,
        &server,
        expect![[r#"
        {
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
            "maxOutputTokens": 256
          },
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
                      },
                      "b": {
                        "type": "INTEGER"
                      }
                    },
                    "required": [
                      "a",
                      "b"
                    ],
                    "type": "OBJECT"
                  }
                }
              ]
            }
          ]
        }"#]],
    )
    .await;
}

/// A typed run's history when markov asks again: the user's question, the
/// answer that did not fit, and markov's follow-up, a system message last.
fn asked_again() -> Vec<Message> {
    vec![
        Message::user("What is six times seven?"),
        Message::assistant("forty-two"),
        Message::system(
            "Your answer did not match the required format: expected a number. Answer again.",
        ),
    ]
}

/// The messages part (`field`) of the body `model` sends for [`asked_again`].
async fn sent_messages(model: &dyn Model, server: &FakeServer, field: &str, golden: Expect) {
    let history = asked_again();
    let settings = ModelSettings {
        model: Some("golden-model".into()),
        max_tokens: 256,
        ..ModelSettings::default()
    };
    model
        .complete(ModelRequest::new("Answer in JSON.", &history, &settings))
        .await
        .expect("answered");
    let body = serde_json::to_string_pretty(&server.single().body[field]).expect("json");
    golden.assert_eq(&body);
}

// markov's follow-up is never sent as the user's words: a system message
// where the vendor has one mid-conversation, else user text marked as
// markov's instruction (Anthropic, and Gemini, whose contents have only
// user and model roles).

#[tokio::test]
async fn markovs_follow_up_reaches_anthropic_marked_as_its_instruction() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, anthropic::text("{}")));
    let model = Anthropic::builder()
        .api_key("sk-ant-golden")
        .base_url(server.base_url())
        .build()
        .expect("client");
    sent_messages(&model, &server, "messages", expect![[r#"
        [
          {
            "content": [
              {
                "text": "What is six times seven?",
                "type": "text"
              }
            ],
            "role": "user"
          },
          {
            "content": [
              {
                "text": "forty-two",
                "type": "text"
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
                "text": "[System instruction] Your answer did not match the required format: expected a number. Answer again.",
                "type": "text"
              }
            ],
            "role": "user"
          }
        ]"#]]).await;
}

#[tokio::test]
async fn markovs_follow_up_reaches_openai_as_a_system_message() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, openai::text("{}")));
    let model = OpenAi::builder()
        .api_key("sk-golden")
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("client");
    sent_messages(&model, &server, "messages", expect![[r#"
        [
          {
            "content": "Answer in JSON.",
            "role": "system"
          },
          {
            "content": "What is six times seven?",
            "role": "user"
          },
          {
            "content": "forty-two",
            "role": "assistant"
          },
          {
            "content": "Your answer did not match the required format: expected a number. Answer again.",
            "role": "system"
          }
        ]"#]]).await;
}

#[cfg(feature = "responses")]
#[tokio::test]
async fn markovs_follow_up_reaches_responses_as_a_system_message() {
    use markov_testkit::http::responses;
    let server = FakeServer::scripted(vec![Reply::json(200, responses::text("{}"))]).await;
    let client = markov_providers::Responses::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("builds");
    sent_messages(&client, &server, "input", expect![[r#"
        [
          {
            "content": "What is six times seven?",
            "role": "user",
            "type": "message"
          },
          {
            "content": "forty-two",
            "role": "assistant",
            "type": "message"
          },
          {
            "content": "Your answer did not match the required format: expected a number. Answer again.",
            "role": "system",
            "type": "message"
          }
        ]"#]]).await;
}

#[cfg(feature = "gemini")]
#[tokio::test]
async fn markovs_follow_up_reaches_gemini_marked_as_its_instruction() {
    use markov_testkit::http::gemini;
    let server = FakeServer::scripted(vec![Reply::json(200, gemini::text("{}"))]).await;
    let client = markov_providers::Gemini::builder()
        .base_url(server.base_url())
        .build()
        .expect("builds");
    sent_messages(&client, &server, "contents", expect![[r#"
        [
          {
            "parts": [
              {
                "text": "What is six times seven?"
              }
            ],
            "role": "user"
          },
          {
            "parts": [
              {
                "text": "forty-two"
              }
            ],
            "role": "model"
          },
          {
            "parts": [
              {
                "text": "[System instruction] Your answer did not match the required format: expected a number. Answer again."
              }
            ],
            "role": "user"
          }
        ]"#]]).await;
}
