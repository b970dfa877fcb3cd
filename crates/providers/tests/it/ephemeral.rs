//! Ephemeral messages on the wire: both clients render each
//! ephemeral as the silent user messages of `Message::ephemeral_view`, read
//! here from the request bodies a loopback fake provider received.
#![cfg(all(feature = "anthropic", feature = "openai"))]

use std::time::Duration;

use markov_core::message::{Item, Items, Message, Metadata, Role};
use markov_core::{Model, ModelRequest, ModelSettings};
use markov_providers::{Anthropic, OpenAi};
use markov_testkit::http::{FakeServer, Reply, anthropic, openai};
use serde_json::{Value, json};

const PREAMBLE: &str = "[Camera frame] This is a snapshot from the user's live camera (not an uploaded file). Frames since last turn: ";

fn frame(data: &str) -> Item {
    Item::Image {
        mime_type: "image/jpeg".into(),
        data: data.into(),
        detail: None,
    }
}

fn ephemeral(items: Items, frames: Option<u64>) -> Message {
    Message::from(markov_core::message::MessageData {
        role: Role::Ephemeral,
        items,
        metadata: Some(Metadata {
            singleton: Some("camera".into()),
            singleton_frame_count: frames,
            ..Metadata::default()
        }),
    })
}

/// A history with every shape of ephemeral: camera frames (with a text item
/// that is dropped), a string, and a list without images.
fn history() -> Vec<Message> {
    vec![
        Message::user("Look at this."),
        Message::assistant("Looking."),
        ephemeral(
            Items::List(vec![frame("AAA"), Item::text("dropped"), frame("BBB")]),
            Some(2),
        ),
        ephemeral(Items::Text("The user is smiling.".into()), None),
        ephemeral(Items::List(vec![Item::text("Lighting: dim")]), None),
        Message::user("What now?"),
    ]
}

/// The same history with each ephemeral replaced by its view.
fn viewed_history() -> Vec<Message> {
    history().iter().flat_map(Message::ephemeral_view).collect()
}

fn preamble(frames: u64) -> String {
    format!("{PREAMBLE}{frames}.")
}

/// The `messages` of the request body `model` sends for `messages`.
async fn sent(
    model: impl Fn(&FakeServer) -> Box<dyn Model>,
    answer: Value,
    messages: &[Message],
) -> Value {
    let server = FakeServer::scripted(vec![Reply::json(200, answer)]).await;
    let settings = ModelSettings::default();
    let request = ModelRequest::new("You watch the camera.", messages, &settings);
    model(&server)
        .complete(request)
        .await
        .expect("the fake answers");
    server.single().body["messages"].clone()
}

fn anthropic_client(server: &FakeServer) -> Box<dyn Model> {
    Box::new(
        Anthropic::builder()
            .api_key("sk-ant-test")
            .base_url(server.base_url())
            .model("claude-test")
            .backoff(Duration::from_millis(1), Duration::from_millis(4))
            .build()
            .expect("a valid client"),
    )
}

fn openai_client(server: &FakeServer) -> Box<dyn Model> {
    Box::new(
        OpenAi::builder()
            .api_key("sk-test")
            .base_url(format!("{}/v1", server.base_url()))
            .model("gpt-test")
            .backoff(Duration::from_millis(1), Duration::from_millis(4))
            .build()
            .expect("a valid client"),
    )
}

#[tokio::test]
async fn anthropic_sends_ephemerals_as_silent_user_content() {
    let messages = sent(anthropic_client, anthropic::text("ok"), &history()).await;
    let image = |data: &str| json!({"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}});
    let text = |t: &str| json!({"type": "text", "text": t});
    // Consecutive user messages merge into one, as for any user content.
    assert_eq!(
        messages,
        json!([
            {"role": "user", "content": [text("Look at this.")]},
            {"role": "assistant", "content": [text("Looking.")]},
            {"role": "user", "content": [
                text(&preamble(2)), image("AAA"),
                text(&preamble(2)), image("BBB"),
                text("The user is smiling."),
                text("Lighting: dim"),
                // The conversation's cache breakpoint.
                json!({"type": "text", "text": "What now?", "cache_control": {"type": "ephemeral"}}),
            ]},
        ])
    );
    let viewed = sent(anthropic_client, anthropic::text("ok"), &viewed_history()).await;
    assert_eq!(messages, viewed, "the wire form is the view's");
}

#[tokio::test]
async fn openai_sends_one_user_message_per_camera_frame() {
    let messages = sent(openai_client, openai::text("ok"), &history()).await;
    let image = |data: &str| json!({"type": "image_url", "image_url": {"url": format!("data:image/jpeg;base64,{data}")}});
    let text = |t: &str| json!({"type": "text", "text": t});
    assert_eq!(
        messages,
        json!([
            {"role": "system", "content": "You watch the camera."},
            {"role": "user", "content": "Look at this."},
            {"role": "assistant", "content": "Looking."},
            {"role": "user", "content": [text(&preamble(2)), image("AAA")]},
            {"role": "user", "content": [text(&preamble(2)), image("BBB")]},
            {"role": "user", "content": "The user is smiling."},
            {"role": "user", "content": "Lighting: dim"},
            {"role": "user", "content": "What now?"},
        ])
    );
    let viewed = sent(openai_client, openai::text("ok"), &viewed_history()).await;
    assert_eq!(messages, viewed, "the wire form is the view's");
}

#[tokio::test]
async fn a_frame_without_a_count_counts_as_one() {
    let messages = [
        ephemeral(Items::List(vec![frame("AAA")]), None),
        Message::user("Hi"),
    ];
    let sent = sent(openai_client, openai::text("ok"), &messages).await;
    assert_eq!(sent[1]["content"][0]["text"], json!(preamble(1)));
}
