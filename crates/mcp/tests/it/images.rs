//! An MCP tool's image, end to end: from the server's content block,
//! through a machine's history, to the provider's request: an image block
//! of the tool result for Anthropic, the type-and-size note for Chat
//! Completions, never the base64 data as text.

use markov_executor::Agent;
use markov_mcp::{McpClient, McpServerConfig};
use markov_providers::{Anthropic, OpenAi};
use markov_testkit::http::{FakeServer, Reply, anthropic, openai};
use serde_json::{Value, json};

use crate::common::*;

/// The base64 of the raw server's `image` tool's picture.
const DATA: &str = "aGVsbG8=";

/// Runs one turn that calls the raw server's `image` tool with `model`,
/// and returns the body of the model's second request (the one that
/// carries the tool's result).
async fn second_request(model: impl markov_core::Model + 'static, fake: &FakeServer) -> Value {
    let server = raw_server("127.0.0.1:0", None).await;
    let client = McpClient::connect(McpServerConfig::http(&server.url))
        .await
        .expect("connects");
    let mut machine = Agent::builder("mcp")
        .instructions("Use your tools.")
        .tools(client.tools().await.expect("lists"))
        .model(model)
        .build()
        .expect("builds")
        .machine();
    machine.enqueue_user("show me the chart");
    machine.run().await.expect("runs");
    client.close().await;
    server.shutdown().await;
    let requests = fake.requests();
    assert_eq!(requests.len(), 2, "a call, then the answer");
    requests[1].body.clone()
}

#[tokio::test]
async fn an_mcp_image_reaches_anthropic_as_an_image_block_of_the_tool_result() {
    let fake = FakeServer::scripted(vec![
        Reply::json(200, anthropic::tool_use("toolu_1", "image", &json!({}))),
        Reply::json(200, anthropic::text("a chart of five bytes")),
    ])
    .await;
    let model = Anthropic::builder()
        .api_key("sk-ant-test")
        .base_url(fake.base_url())
        .build()
        .expect("client");
    let body = second_request(model, &fake).await;
    let result = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .map(|m| m["content"][0].clone())
        .unwrap_or_default();
    assert_eq!(result["type"], "tool_result", "{body}");
    let blocks = result["content"].as_array().cloned().unwrap_or_default();
    let images: Vec<&Value> = blocks.iter().filter(|b| b["type"] == "image").collect();
    assert_eq!(images.len(), 1, "{result}");
    assert_eq!(images[0]["source"]["media_type"], "image/png");
    assert_eq!(images[0]["source"]["data"], DATA);
    // The text blocks hold the text, not the data (nor a note the image
    // makes needless).
    for text in blocks.iter().filter(|b| b["type"] == "text") {
        let text = text["text"].as_str().unwrap_or_default();
        assert!(text.contains("a chart"), "{text}");
        assert!(!text.contains(DATA) && !text.contains("[image"), "{text}");
    }
}

#[tokio::test]
async fn an_mcp_image_reaches_chat_completions_as_its_note_only() {
    let fake = FakeServer::scripted(vec![
        Reply::json(200, openai::tool_call("call_1", "image", &json!({}))),
        Reply::json(200, openai::text("a chart of five bytes")),
    ])
    .await;
    let model = OpenAi::builder()
        .api_key("sk-test")
        .base_url(format!("{}/v1", fake.base_url()))
        .build()
        .expect("client");
    let body = second_request(model, &fake).await;
    let sent = body.to_string();
    assert!(!sent.contains(DATA), "the image data was sent: {sent}");
    assert!(
        !sent.contains("image_url"),
        "an image part was sent: {sent}"
    );
    let tool = body["messages"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["role"] == "tool"))
        .cloned()
        .unwrap_or_default();
    let content = tool["content"].as_str().unwrap_or_default();
    assert!(content.contains("a chart"), "{content}");
    assert!(
        content.contains("[image image/png, 5 bytes]"),
        "the note says the image's type and size: {content}"
    );
}
