//! A tool result that carries an image, as each client sends it: inside
//! the tool result where the API takes images there (Anthropic, Responses,
//! Gemini), a note with the image's type and size where it does not (Chat
//! Completions), never the base64 data as text. `UPDATE_EXPECT=1 cargo
//! test` rewrites the snapshots after a deliberate change (review the
//! diff).
#![cfg(all(
    feature = "anthropic",
    feature = "openai",
    feature = "responses",
    feature = "gemini"
))]

use expect_test::{Expect, expect};
use markov_core::message::ImageData;
use markov_core::{Item, Message, Model, ModelRequest, ModelSettings};
use markov_providers::{Anthropic, Gemini, OpenAi, Responses};
use markov_testkit::http::{FakeServer, Reply, anthropic, gemini, openai, responses};
use serde_json::{Value, json};

/// A PNG's base64 text (its 8-byte signature and a little more).
const PNG: &str = "iVBORw0KGgoAAAANSUhEUg==";

fn history() -> Vec<Message> {
    vec![
        Message::user("What is in /tmp/a.png?"),
        Message::assistant_items(vec![Item::tool_use(
            "call_1",
            "read_media_file",
            json!({"path": "/tmp/a.png"}),
        )]),
        Message::user_items(vec![Item::tool_result_with_images(
            "call_1",
            "/tmp/a.png",
            Some(false),
            vec![ImageData::new("image/png", PNG)],
        )]),
    ]
}

/// The body `model` sends for [`history`].
async fn sent(model: &dyn Model, server: &FakeServer) -> Value {
    let history = history();
    let settings = ModelSettings {
        model: Some("golden-model".into()),
        max_tokens: 64,
        ..ModelSettings::default()
    };
    model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .expect("answered");
    server.single().body
}

fn check(part: &Value, golden: Expect) {
    golden.assert_eq(&serde_json::to_string_pretty(part).expect("json"));
}

#[tokio::test]
async fn anthropic_sends_the_image_as_a_block_of_the_tool_result() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, anthropic::text("a red square")));
    let model = Anthropic::builder()
        .api_key("sk-ant-golden")
        .base_url(server.base_url())
        .build()
        .expect("client");
    let body = sent(&model, &server).await;
    check(
        &body["messages"][2],
        expect![[r#"
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "content": [
                    {
                      "text": "/tmp/a.png",
                      "type": "text"
                    },
                    {
                      "source": {
                        "data": "iVBORw0KGgoAAAANSUhEUg==",
                        "media_type": "image/png",
                        "type": "base64"
                      },
                      "type": "image"
                    }
                  ],
                  "is_error": false,
                  "tool_use_id": "call_1",
                  "type": "tool_result"
                }
              ],
              "role": "user"
            }"#]],
    );
}

#[tokio::test]
async fn chat_completions_sends_the_note_only() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, openai::text("a red square")));
    let model = OpenAi::builder()
        .api_key("sk-golden")
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("client");
    let body = sent(&model, &server).await;
    let text = body.to_string();
    assert!(!text.contains(PNG), "the image data was sent: {text}");
    assert!(
        !text.contains("image_url"),
        "an image part was sent: {text}"
    );
    check(
        &body["messages"][2],
        expect![[r#"
            {
              "content": "/tmp/a.png\n[image image/png, 16 bytes]",
              "role": "tool",
              "tool_call_id": "call_1"
            }"#]],
    );
}

#[tokio::test]
async fn responses_sends_the_image_as_an_input_image_of_the_output() {
    let server =
        FakeServer::scripted(vec![Reply::json(200, responses::text("a red square"))]).await;
    let model = Responses::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .build()
        .expect("client");
    let body = sent(&model, &server).await;
    check(
        &body["input"][2],
        expect![[r#"
            {
              "call_id": "call_1",
              "output": [
                {
                  "text": "/tmp/a.png",
                  "type": "input_text"
                },
                {
                  "image_url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==",
                  "type": "input_image"
                }
              ],
              "type": "function_call_output"
            }"#]],
    );
}

#[tokio::test]
async fn gemini_sends_the_image_as_a_part_of_the_function_response() {
    let server = FakeServer::scripted(vec![Reply::json(200, gemini::text("a red square"))]).await;
    let model = Gemini::builder()
        .base_url(server.base_url())
        .build()
        .expect("client");
    let body = sent(&model, &server).await;
    check(
        &body["contents"][2],
        expect![[r#"
            {
              "parts": [
                {
                  "functionResponse": {
                    "id": "call_1",
                    "name": "read_media_file",
                    "parts": [
                      {
                        "inlineData": {
                          "data": "iVBORw0KGgoAAAANSUhEUg==",
                          "mimeType": "image/png"
                        }
                      }
                    ],
                    "response": {
                      "content": "/tmp/a.png"
                    }
                  }
                }
              ],
              "role": "user"
            }"#]],
    );
}
