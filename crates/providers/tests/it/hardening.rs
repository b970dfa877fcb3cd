//! Both clients against servers that misbehave: a stream kept alive with
//! pings that never answers, an endless error body, an event too large to
//! buffer, an address that refuses connections, and a local server that
//! needs no key.
#![cfg(all(feature = "anthropic", feature = "openai"))]

use std::time::Duration;

use futures::StreamExt;
use markov_core::{Message, Model, ModelError, ModelRequest, ModelSettings};
use markov_providers::{Anthropic, OpenAi};
use markov_testkit::http::{FakeServer, Reply, anthropic, openai, sse_event};
use serde_json::json;

/// Long enough to mean "hung", short enough to fail a test quickly.
const HANG: Duration = Duration::from_secs(20);

fn anthropic_client(server: &FakeServer) -> markov_providers::anthropic::AnthropicBuilder {
    Anthropic::builder()
        .api_key("sk-ant-test")
        .base_url(server.base_url())
        .max_retries(0)
}

fn openai_client(server: &FakeServer) -> markov_providers::openai::OpenAiBuilder {
    OpenAi::builder()
        .api_key("sk-test")
        .base_url(format!("{}/v1", server.base_url()))
        .max_retries(0)
}

/// The last item of a streamed call, bounded by [`HANG`].
async fn last_event(model: &dyn Model) -> Result<(), ModelError> {
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings);
    let run = async {
        let mut events = model.stream(request);
        let mut last = Ok(());
        while let Some(event) = events.next().await {
            last = event.map(|_| ());
        }
        last
    };
    tokio::time::timeout(HANG, run)
        .await
        .expect("the stream ended by itself")
}

#[tokio::test]
async fn a_stream_of_pings_ends_at_the_stream_deadline() {
    let deadline = Duration::from_millis(300);
    let server = FakeServer::start().await;
    server.reply(Reply::sse_repeating(
        &sse_event("ping", json!({"type": "ping"})),
        Duration::from_millis(10),
        HANG,
    ));
    let model = anthropic_client(&server)
        .stream_deadline(deadline)
        .build()
        .expect("client");
    assert_eq!(last_event(&model).await, Err(ModelError::Timeout(deadline)));

    let server = FakeServer::start().await;
    server.reply(Reply::sse_repeating(
        ": keep-alive\n\n",
        Duration::from_millis(10),
        HANG,
    ));
    let model = openai_client(&server)
        .stream_deadline(deadline)
        .build()
        .expect("client");
    assert_eq!(last_event(&model).await, Err(ModelError::Timeout(deadline)));
}

/// A non-streamed call, bounded by [`HANG`].
async fn complete(model: &dyn Model) -> Result<(), ModelError> {
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings);
    tokio::time::timeout(HANG, model.complete(request))
        .await
        .expect("the call ended by itself")
        .map(|_| ())
}

#[tokio::test]
async fn retried_complete_calls_end_at_the_call_deadline() {
    let deadline = Duration::from_millis(500);
    // Slow overloads, retried again and again: each attempt is short, so
    // only a bound on the whole call (retries and waits included) ends it.
    let slow_overload = |status: u16| {
        Reply::json(status, anthropic::error("overloaded_error", "Overloaded"))
            .delayed(Duration::from_millis(100))
    };
    let server = FakeServer::scripted((0..200).map(|_| slow_overload(529)).collect()).await;
    let model = anthropic_client(&server)
        .max_retries(u32::MAX)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .stream_deadline(deadline)
        .build()
        .expect("client");
    assert_eq!(complete(&model).await, Err(ModelError::Timeout(deadline)));
    assert!(server.remaining() > 0, "retries stopped at the deadline");

    let server = FakeServer::scripted((0..200).map(|_| slow_overload(503)).collect()).await;
    let model = openai_client(&server)
        .max_retries(u32::MAX)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .stream_deadline(deadline)
        .build()
        .expect("client");
    assert_eq!(complete(&model).await, Err(ModelError::Timeout(deadline)));
    assert!(server.remaining() > 0, "retries stopped at the deadline");

    // A server that never answers, under a per-attempt timeout longer than
    // the deadline.
    for openai in [false, true] {
        let server = FakeServer::scripted(vec![Reply::hang(HANG)]).await;
        let model: Box<dyn Model> = if openai {
            Box::new(
                openai_client(&server)
                    .timeout(HANG * 2)
                    .stream_deadline(deadline)
                    .build()
                    .expect("client"),
            )
        } else {
            Box::new(
                anthropic_client(&server)
                    .timeout(HANG * 2)
                    .stream_deadline(deadline)
                    .build()
                    .expect("client"),
            )
        };
        assert_eq!(complete(&*model).await, Err(ModelError::Timeout(deadline)));
    }
}

#[tokio::test]
async fn a_redirect_to_another_origin_never_receives_the_key() {
    for (openai, streamed) in [(false, false), (false, true), (true, false), (true, true)] {
        // Another port of the same host is another origin.
        let elsewhere = FakeServer::start().await;
        let answer = if openai {
            Reply::json(200, openai::text("redirected"))
        } else {
            Reply::json(200, anthropic::text("redirected"))
        };
        elsewhere.reply(answer.clone()).reply(answer);
        let target = format!("{}/stolen?token=sk-in-query", elsewhere.base_url());
        let server = FakeServer::scripted(vec![
            Reply::json(307, json!({})).header("location", &target),
        ])
        .await;
        let model: Box<dyn Model> = if openai {
            Box::new(openai_client(&server).build().expect("client"))
        } else {
            Box::new(anthropic_client(&server).build().expect("client"))
        };
        let result = if streamed {
            last_event(&*model).await
        } else {
            complete(&*model).await
        };
        for request in elsewhere.requests() {
            assert_eq!(request.header("x-api-key"), None, "{request:?}");
            assert_eq!(request.header("authorization"), None, "{request:?}");
        }
        assert!(
            elsewhere.requests().is_empty(),
            "the redirect is not followed"
        );
        let error = result.expect_err("a redirect is an error");
        let text = error.to_string();
        assert!(
            text.contains(&elsewhere.base_url()),
            "names the target: {text}"
        );
        assert!(!text.contains("sk-"), "no secret in {text}");
        assert!(
            matches!(&error, ModelError::Redirect { status: 307, .. }),
            "{error:?}"
        );
        assert!(!error.is_retryable());
    }
}

/// `depth` objects, one inside the other, built without recursion.
fn nested(depth: usize) -> serde_json::Value {
    let mut value = json!({});
    for _ in 1..depth {
        let mut outer = serde_json::Map::new();
        outer.insert("a".to_owned(), value);
        value = serde_json::Value::Object(outer);
    }
    value
}

#[tokio::test]
async fn deeply_nested_tool_arguments_never_panic_a_client() {
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    for depth in [126, 1_000] {
        let input = nested(depth);
        for (openai, streamed) in [(false, false), (false, true), (true, false), (true, true)] {
            let reply = match (openai, streamed) {
                (false, false) => Reply::json(200, anthropic::tool_use("t1", "keep", &input)),
                (false, true) => Reply::sse(&anthropic::tool_use_events("t1", "keep", &input)),
                (true, false) => Reply::json(200, openai::tool_call("t1", "keep", &input)),
                (true, true) => Reply::sse(&openai::tool_call_events("t1", "keep", &input)),
            };
            let server = FakeServer::scripted(vec![reply]).await;
            let model: Box<dyn Model> = if openai {
                Box::new(openai_client(&server).build().expect("client"))
            } else {
                Box::new(anthropic_client(&server).build().expect("client"))
            };
            let request = ModelRequest::new("", &history, &settings);
            let answer = if streamed {
                let stream = model.stream(request);
                tokio::time::timeout(HANG, markov_core::model::collect_stream(stream))
                    .await
                    .expect("the stream ended by itself")
            } else {
                tokio::time::timeout(HANG, model.complete(request))
                    .await
                    .expect("the call ended by itself")
            };
            // An answer (the executor refuses arguments this deep) or a
            // typed error: never a panic.
            match answer {
                Ok(response) => assert!(!response.content.is_empty()),
                Err(error) => assert!(
                    matches!(error, ModelError::InvalidResponse(_)),
                    "{depth} deep, openai {openai}, streamed {streamed}: {error:?}"
                ),
            }
        }
    }
}

#[tokio::test]
async fn an_endless_error_body_is_read_only_a_few_kilobytes() {
    let piece = "x".repeat(1024);
    for provider in ["anthropic", "openai"] {
        let server = FakeServer::start().await;
        server.reply(Reply::endless(400, &piece, Duration::ZERO, HANG));
        let model: Box<dyn Model> = match provider {
            "anthropic" => Box::new(anthropic_client(&server).build().expect("client")),
            _ => Box::new(openai_client(&server).build().expect("client")),
        };
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let answer = tokio::time::timeout(
            HANG,
            model.complete(ModelRequest::new("", &history, &settings)),
        )
        .await
        .expect("the call ends without reading the whole body");
        match answer {
            Err(ModelError::Http {
                status, message, ..
            }) => {
                assert_eq!(status, 400);
                assert!(message.len() < 3_000, "{provider}: {} bytes", message.len());
                assert!(message.contains("… (truncated)"), "{message}");
                assert!(message.contains(&server.base_url()), "{message}");
            }
            other => panic!("{provider}: not an HTTP error: {other:?}"),
        }
    }
}

#[tokio::test]
async fn retries_read_only_a_few_kilobytes_of_each_error_body() {
    let piece = "x".repeat(1024);
    let server = FakeServer::start().await;
    for _ in 0..3 {
        server.reply(Reply::endless(503, &piece, Duration::ZERO, HANG));
    }
    let model = Anthropic::builder()
        .api_key("sk-ant-test")
        .base_url(server.base_url())
        .max_retries(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .build()
        .expect("client");
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    // Streamed: the retries happen before the response head is accepted.
    let mut events = model.stream(ModelRequest::new("", &history, &settings));
    let first = tokio::time::timeout(HANG, events.next())
        .await
        .expect("every attempt ends without reading the whole body");
    match first {
        Some(Err(ModelError::Http {
            status, message, ..
        })) => {
            assert_eq!(status, 503);
            assert!(message.len() < 3_000, "{} bytes", message.len());
            assert!(message.contains("… (truncated)"), "{message}");
        }
        other => panic!("not an HTTP error: {other:?}"),
    }
    assert_eq!(server.requests().len(), 3, "the first try and two retries");
}

#[tokio::test]
async fn an_event_past_the_size_cap_is_a_clear_error() {
    let server = FakeServer::start().await;
    server.reply(Reply::sse_split(
        &anthropic::text_events(&"y".repeat(5_000)),
        512,
    ));
    let model = anthropic_client(&server)
        .max_event_bytes(1_024)
        .build()
        .expect("client");
    match last_event(&model).await {
        Err(ModelError::InvalidResponse(message)) => {
            assert!(message.contains("exceeded 1024 bytes"), "{message}");
        }
        other => panic!("not refused: {other:?}"),
    }

    let server = FakeServer::start().await;
    server.reply(Reply::sse_split(
        &openai::text_events(&"y".repeat(5_000)),
        512,
    ));
    let model = openai_client(&server)
        .max_event_bytes(1_024)
        .build()
        .expect("client");
    assert!(matches!(
        last_event(&model).await,
        Err(ModelError::InvalidResponse(m)) if m.contains("exceeded 1024 bytes")
    ));
    // Under the default cap (16 MiB) the same answer streams fine, and so
    // do events of 5 MiB (`text_events` sends the text in two halves).
    let server = FakeServer::start().await;
    server.reply(Reply::sse_split(
        &openai::text_events(&"y".repeat(5_000)),
        512,
    ));
    let model = openai_client(&server).build().expect("client");
    assert_eq!(last_event(&model).await, Ok(()));
    let server = FakeServer::start().await;
    server.reply(Reply::sse_split(
        &openai::text_events(&"y".repeat(10 << 20)),
        64 << 10,
    ));
    let model = openai_client(&server).build().expect("client");
    assert_eq!(last_event(&model).await, Ok(()));
}

#[tokio::test]
async fn a_refused_connection_names_the_url() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let model = Anthropic::builder()
        .api_key("sk-ant-test")
        .base_url(format!("http://127.0.0.1:{port}"))
        .max_retries(0)
        .build()
        .expect("client");
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let error = model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .expect_err("nothing listens");
    match error {
        ModelError::Connection(text) => assert!(
            text.contains(&format!("http://127.0.0.1:{port}/v1/messages")),
            "{text}"
        ),
        other => panic!("not a connection error: {other:?}"),
    }
}

#[tokio::test]
async fn a_local_messages_server_needs_no_key() {
    let server = FakeServer::start().await;
    server.reply(Reply::json(200, anthropic::text("hello from llama.cpp")));
    let model = Anthropic::builder()
        .base_url(server.base_url())
        .build()
        .expect("another address needs no key");
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let answer = model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .expect("answered");
    assert_eq!(answer.content.len(), 1);
    assert_eq!(server.single().header("x-api-key"), None);
    assert!(matches!(
        Anthropic::builder().build(),
        Err(markov_providers::ConfigError::MissingApiKey)
    ));
}
