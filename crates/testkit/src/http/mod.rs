//! A loopback fake model provider: a minimal HTTP/1.1 server on
//! `127.0.0.1` that answers each request with the next scripted [`Reply`]
//! and records every request it sees.
//!
//! Point a real client (the Anthropic Messages or OpenAI Chat Completions
//! client of `markov-providers`, or your own) at [`FakeServer::base_url`]
//! and script what the "provider" says: complete JSON answers, server-sent
//! event streams cut into arbitrary pieces, error statuses, delays and
//! replies that never come. The [`anthropic`], [`openai`] (Chat
//! Completions), [`responses`] (OpenAI's Responses API) and [`gemini`]
//! modules build
//! the vendors' response bodies and event streams for the common cases (a
//! text answer, a tool call), so a test need not write vendor JSON.
//!
//! The server speaks just enough HTTP/1.1 for ordinary clients: a
//! connection stays open for the client's next request (keep-alive; event
//! streams are sent as chunked bodies), except after a reply that hangs or
//! never ends. A request beyond the script is answered `418`, which no
//! client retries, unless [`FakeServer::answer_with`] says how to answer
//! it: with that, and [`FakeServer::recording`] off so that memory stays
//! flat, it serves load tests too. Dropping the server stops it. It needs
//! a running tokio runtime.
//!
//! Enabled by the `http` feature.
//!
//! ```no_run
//! use markov_testkit::http::{FakeServer, Reply, anthropic};
//! use serde_json::json;
//!
//! # async fn example() {
//! let server = FakeServer::start().await;
//! server
//!     .reply(Reply::json(200, anthropic::tool_use("toolu_1", "add", &json!({"a": 2, "b": 3}))))
//!     .reply(Reply::sse_split(&anthropic::text_events("2 + 3 = 5"), 7));
//!
//! // Build the client under test with `server.base_url()` as its base URL
//! // (for OpenAI-compatible clients, `format!("{}/v1", server.base_url())`)
//! // and run it, then check what it sent:
//! let requests = server.requests();
//! assert_eq!(requests[0].method, "POST");
//! assert_eq!(requests[0].path, "/v1/messages");
//! assert_eq!(requests[0].body["stream"], json!(true));
//! assert_eq!(requests[0].header("x-api-key"), Some("sk-test"));
//! # }
//! ```

pub mod anthropic;
pub mod gemini;
pub mod openai;
pub mod responses;
mod server;

pub use server::{FakeServer, Recorded, Reply};

/// The model name every canned answer reports ([`anthropic`]'s and
/// [`openai`]'s `model`, [`responses`]' response object's, [`gemini`]'s
/// `modelVersion`).
pub const MODEL: &str = "fake-model";

/// One named server-sent event with JSON data, as Anthropic sends them:
/// `event: <name>\ndata: <json>\n\n`.
pub fn sse_event(name: &str, data: serde_json::Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// One unnamed server-sent event, as OpenAI sends them: `data: <data>\n\n`.
pub fn sse_data(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// `text` cut near its middle, on a character boundary.
fn split_in_two(text: &str) -> (&str, &str) {
    let mut middle = text.len() / 2;
    while !text.is_char_boundary(middle) {
        middle -= 1;
    }
    text.split_at(middle)
}
