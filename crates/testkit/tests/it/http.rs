//! The loopback fake provider over a raw TCP client: scripted JSON and
//! event-stream replies, recorded requests, the canned vendor answers and
//! the `418` for a request beyond the script.
#![cfg(feature = "http")]

use markov_testkit::http::{FakeServer, Reply, anthropic, openai};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends one POST with `body` and returns the whole raw response.
async fn post(server: &FakeServer, path: &str, body: &Value) -> String {
    let mut socket = TcpStream::connect(server.addr()).await.expect("connect");
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: fake\r\nX-Api-Key: k\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    socket.read_to_string(&mut response).await.expect("read");
    response
}

#[tokio::test]
async fn replies_come_in_order_and_requests_are_recorded() {
    let server = FakeServer::start().await;
    server
        .reply(Reply::json(200, anthropic::text("hi")))
        .reply(Reply::sse_split(&openai::text_events("héllo"), 3).header("x-extra", "1"));
    assert_eq!(server.remaining(), 2);

    let first = post(&server, "/v1/messages", &json!({"stream": false})).await;
    assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{first}");
    assert!(first.contains("content-type: application/json"), "{first}");
    let json_body = first.split("\r\n\r\n").nth(1).expect("a body");
    let answer: Value = serde_json::from_str(json_body).expect("JSON");
    assert_eq!(answer["content"][0]["text"], "hi");

    let second = post(&server, "/v1/chat/completions", &json!({"stream": true})).await;
    assert!(
        second.contains("content-type: text/event-stream"),
        "{second}"
    );
    assert!(second.contains("x-extra: 1"), "{second}");
    assert!(second.ends_with("data: [DONE]\n\n"), "{second}");
    assert!(
        second.contains("\"hé\"") && second.contains("\"llo\""),
        "{second}"
    );

    let third = post(&server, "/", &json!({})).await;
    assert!(third.starts_with("HTTP/1.1 418 "), "{third}");

    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[0].method, "POST");
    assert_eq!(requests[0].path, "/v1/messages");
    assert_eq!(requests[0].header("x-api-key"), Some("k"));
    assert_eq!(requests[0].body, json!({"stream": false}));
    assert_eq!(requests[1].body["stream"], true);
    assert_eq!(server.remaining(), 0);
}

#[tokio::test]
async fn canned_answers_have_the_vendor_shapes() {
    let input = json!({"a": 2, "b": 3});
    let answer = anthropic::tool_use("toolu_1", "add", &input);
    assert_eq!(answer["content"][0]["id"], "toolu_1");
    assert_eq!(answer["stop_reason"], "tool_use");
    let events = anthropic::tool_use_events("toolu_1", "add", &input);
    let partial: String = events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|d| d["delta"]["partial_json"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).expect("JSON"),
        input
    );
    assert!(events.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"));

    let answer = openai::tool_call("call_1", "add", &input);
    let call = &answer["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["arguments"], input.to_string());
    let text = openai::text("hello");
    assert_eq!(text["choices"][0]["message"]["content"], "hello");
    assert_eq!(text["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn a_scripted_server_starts_with_its_replies() {
    let server = FakeServer::scripted(vec![Reply::text(503, "busy")]).await;
    assert!(server.base_url().starts_with("http://127.0.0.1:"));
    let response = post(&server, "/x", &json!(null)).await;
    assert!(response.starts_with("HTTP/1.1 503 "), "{response}");
    assert!(response.ends_with("busy"), "{response}");
    assert_eq!(server.single().path, "/x");
}
