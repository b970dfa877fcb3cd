//! The loopback fake provider over a raw TCP client: scripted JSON and
//! event-stream replies, recorded requests, the canned vendor answers, the
//! `418` for a request beyond the script, kept-alive connections, answers
//! beyond the script and requests not recorded.
#![cfg(feature = "http")]

use markov_testkit::Recording;
use markov_testkit::http::{FakeServer, Reply, anthropic, openai};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends one POST with `body` on a connection of its own (asking the
/// server to close it after the reply) and returns the whole raw response.
async fn post(server: &FakeServer, path: &str, body: &Value) -> String {
    let mut socket = TcpStream::connect(server.addr()).await.expect("connect");
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: fake\r\nX-Api-Key: k\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
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

/// Reads one response from a kept-alive connection: its head and its body,
/// by `content-length` or as a chunked body (the chunks joined).
async fn read_response(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> (String, String) {
    async fn fill(socket: &mut TcpStream, buffer: &mut Vec<u8>) {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the server closed a kept-alive connection");
        buffer.extend_from_slice(&chunk[..n]);
    }
    let find = |buffer: &[u8], what: &[u8]| buffer.windows(what.len()).position(|w| w == what);
    let head_end = loop {
        match find(buffer, b"\r\n\r\n") {
            Some(i) => break i,
            None => fill(socket, buffer).await,
        }
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    buffer.drain(..head_end + 4);
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|n| n.parse::<usize>().ok());
    let mut body = Vec::new();
    if let Some(length) = length {
        while buffer.len() < length {
            fill(socket, buffer).await;
        }
        body.extend(buffer.drain(..length));
    } else {
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        loop {
            let line_end = loop {
                match find(buffer, b"\r\n") {
                    Some(i) => break i,
                    None => fill(socket, buffer).await,
                }
            };
            let size = usize::from_str_radix(
                std::str::from_utf8(&buffer[..line_end]).expect("a size"),
                16,
            )
            .expect("a hex size");
            while buffer.len() < line_end + 2 + size + 2 {
                fill(socket, buffer).await;
            }
            body.extend_from_slice(&buffer[line_end + 2..line_end + 2 + size]);
            buffer.drain(..line_end + 2 + size + 2);
            if size == 0 {
                break;
            }
        }
    }
    (head, String::from_utf8(body).expect("UTF-8"))
}

#[tokio::test]
async fn one_connection_serves_request_after_request_and_streams_chunked() {
    let server = FakeServer::start().await;
    server
        .reply(Reply::json(200, anthropic::text("one")))
        .reply(Reply::sse_split(&openai::text_events("héllo"), 3))
        .reply(Reply::text(503, "busy"));
    let mut socket = TcpStream::connect(server.addr()).await.expect("connect");
    let mut buffer = Vec::new();
    let mut bodies = Vec::new();
    for _ in 0..3 {
        let body = "{}";
        let request = format!(
            "POST /v1/x HTTP/1.1\r\nHost: fake\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(request.as_bytes()).await.expect("write");
        let (head, body) = read_response(&mut socket, &mut buffer).await;
        assert!(head.contains("connection: keep-alive"), "{head}");
        bodies.push(body);
    }
    assert!(bodies[0].contains("\"one\""), "{}", bodies[0]);
    assert_eq!(bodies[1], openai::text_events("héllo"));
    assert_eq!(bodies[2], "busy");
    assert_eq!(server.connections(), 1);
    assert_eq!(server.served(), 3);
}

#[tokio::test]
async fn requests_beyond_the_script_are_answered_and_can_go_unrecorded() {
    let server = FakeServer::start().await;
    server
        .answer_with(|request| Reply::json(200, anthropic::text(&format!("to {}", request.path))))
        .recording(Recording::Off);
    for path in ["/a", "/b"] {
        let response = post(&server, path, &json!({"n": 1})).await;
        assert!(response.contains(&format!("to {path}")), "{response}");
    }
    assert!(server.requests().is_empty(), "nothing kept");
    assert_eq!(server.served(), 2);
    server.recording(Recording::On);
    post(&server, "/c", &json!(null)).await;
    assert_eq!(server.single().path, "/c");
}
