//! One table, every vendor: each row is a vendor's client over its fake on
//! loopback (the testkit's canned answers, in the vendor's own JSON), and
//! every case runs against every row. What the clients share — a plain
//! answer, a tool call, streaming, usage, retries and what is not retried,
//! the per-attempt timeout and the whole call's deadline, outgoing limits,
//! where the key goes and that it never shows — is asserted here once;
//! what only one vendor does stays in that vendor's module.
//!
//! A new vendor is one more row.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use markov_core::model::collect_stream;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelResponse, ModelSettings, StopReason,
    StreamEvent, ToolChoice, ToolDefinition,
};
use markov_providers::{Anthropic, Gemini, Limits, OpenAi, Responses};
use markov_testkit::http::{FakeServer, Reply, anthropic, gemini, openai, responses};
use serde_json::{Value, json};

/// The settings a case may change on a row's builder.
#[derive(Debug, Clone, Default)]
struct Tweaks {
    max_retries: Option<u32>,
    timeout: Option<Duration>,
    deadline: Option<Duration>,
    limits: Option<Limits>,
}

/// A row's client, built.
struct Built {
    model: Arc<dyn Model>,
    /// What `endpoint()` says: where a call goes, as errors name it.
    endpoint: String,
    /// The client's and its builder's `Debug` output.
    debug: Vec<String>,
}

/// One vendor.
struct Row {
    name: &'static str,
    provider: &'static str,
    /// The API key the row's client is built with.
    key: &'static str,
    /// The header the key goes in, and its value there.
    key_header: (&'static str, &'static str),
    /// The path of a call of `model` on the fake.
    path: &'static str,
    build: fn(&FakeServer, &Tweaks) -> Built,
    /// A whole text answer.
    text: fn(&str) -> Value,
    /// A whole answer calling `add` with these arguments.
    call: fn(&Value) -> Value,
    /// The same two as event streams.
    text_events: fn(&str) -> String,
    call_events: fn(&Value) -> String,
    /// An answer the client retries (overloaded, rate limited, unavailable).
    retryable: fn() -> Reply,
    /// A client error's body (400, 401, 403) carrying `message`.
    refusal: fn(u16, &str) -> Value,
}

/// Applies `tweaks` to a builder, whatever its vendor.
macro_rules! tweaked {
    ($builder:expr, $tweaks:expr) => {{
        let mut builder = $builder.backoff(Duration::from_millis(1), Duration::from_millis(4));
        if let Some(retries) = $tweaks.max_retries {
            builder = builder.max_retries(retries);
        }
        if let Some(timeout) = $tweaks.timeout {
            builder = builder.timeout(timeout);
        }
        if let Some(deadline) = $tweaks.deadline {
            builder = builder.stream_deadline(deadline);
        }
        if let Some(limits) = $tweaks.limits {
            builder = builder.limits(limits);
        }
        let debug = format!("{builder:?}");
        let client = builder.build().expect("a valid client");
        Built {
            endpoint: client.endpoint(),
            debug: vec![debug, format!("{client:?}"), format!("{client:#?}")],
            model: Arc::new(client),
        }
    }};
}

fn rows() -> Vec<Row> {
    vec![
        Row {
            name: "anthropic",
            provider: "anthropic",
            key: "sk-ant-conformance-secret",
            key_header: ("x-api-key", "sk-ant-conformance-secret"),
            path: "/v1/messages",
            build: |server, tweaks| {
                tweaked!(
                    Anthropic::builder()
                        .api_key("sk-ant-conformance-secret")
                        .base_url(server.base_url())
                        .model("claude-test"),
                    tweaks
                )
            },
            text: anthropic::text,
            call: |args| anthropic::tool_use("toolu_1", "add", args),
            text_events: anthropic::text_events,
            call_events: |args| anthropic::tool_use_events("toolu_1", "add", args),
            retryable: || Reply::json(529, anthropic::error("overloaded_error", "Overloaded")),
            refusal: |_, message| anthropic::error("invalid_request_error", message),
        },
        Row {
            name: "openai",
            provider: "openai",
            key: "sk-proj-conformance-secret",
            key_header: ("authorization", "Bearer sk-proj-conformance-secret"),
            path: "/v1/chat/completions",
            build: |server, tweaks| {
                tweaked!(
                    OpenAi::builder()
                        .api_key("sk-proj-conformance-secret")
                        .base_url(format!("{}/v1", server.base_url()))
                        .model("gpt-test"),
                    tweaks
                )
            },
            text: openai::text,
            call: |args| openai::tool_call("call_1", "add", args),
            text_events: openai::text_events,
            call_events: |args| openai::tool_call_events("call_1", "add", args),
            retryable: || {
                Reply::json(429, openai::error("requests", "Rate limit reached"))
                    .header("retry-after-ms", "5")
            },
            refusal: |_, message| openai::error("invalid_request_error", message),
        },
        Row {
            name: "responses",
            provider: "openai",
            key: "sk-proj-responses-conformance",
            key_header: ("authorization", "Bearer sk-proj-responses-conformance"),
            path: "/v1/responses",
            build: |server, tweaks| {
                tweaked!(
                    Responses::builder()
                        .api_key("sk-proj-responses-conformance")
                        .base_url(format!("{}/v1", server.base_url()))
                        .model("gpt-test"),
                    tweaks
                )
            },
            text: responses::text,
            call: |args| responses::function_call("call_1", "add", args),
            text_events: responses::text_events,
            call_events: |args| responses::function_call_events("call_1", "add", args),
            retryable: || {
                Reply::json(
                    503,
                    responses::error("server_error", "unavailable", "The server is busy"),
                )
            },
            refusal: |_, message| responses::error("invalid_request_error", "invalid", message),
        },
        Row {
            name: "gemini",
            provider: "gcp.gemini",
            key: "AIza-gemini-conformance",
            key_header: ("x-goog-api-key", "AIza-gemini-conformance"),
            path: "/v1beta/models/gemini-test:generateContent",
            build: |server, tweaks| {
                tweaked!(
                    Gemini::builder()
                        .api_key("AIza-gemini-conformance")
                        .base_url(server.base_url())
                        .model("gemini-test"),
                    tweaks
                )
            },
            text: gemini::text,
            call: |args| gemini::function_call("add", args),
            text_events: gemini::text_events,
            call_events: |args| {
                gemini::events(vec![gemini::function_call_part("add", args, None)], "STOP")
            },
            retryable: || {
                Reply::json(
                    503,
                    gemini::error(503, "UNAVAILABLE", "The model is overloaded."),
                )
            },
            refusal: |status, message| gemini::error(status, "INVALID_ARGUMENT", message),
        },
    ]
}

fn add_tool() -> Vec<ToolDefinition> {
    vec![
        ToolDefinition::new(
            "add",
            "Adds two numbers.",
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}),
        )
        .expect("a valid tool"),
    ]
}

/// The one call of `add` an answer holds, as (name, input).
fn the_call(answer: &ModelResponse) -> (String, Value) {
    let calls: Vec<(String, Value)> = answer
        .content
        .iter()
        .filter_map(|item| match item {
            Item::ToolUse { name, input, .. } => Some((name.as_str().to_owned(), input.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 1, "{:?}", answer.content);
    calls.into_iter().next().expect("one call")
}

#[tokio::test]
async fn a_plain_answer_names_its_provider_and_reports_usage() {
    for row in rows() {
        let server = FakeServer::scripted(vec![
            Reply::json(200, (row.text)("hello")),
            Reply::sse(&(row.text_events)("hello")),
        ])
        .await;
        let built = (row.build)(&server, &Tweaks::default());
        assert_eq!(built.model.provider_name(), row.provider, "{}", row.name);
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let answer = built
            .model
            .complete(ModelRequest::new("Be brief.", &history, &settings))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        assert_eq!(answer.content, vec![Item::text("hello")], "{}", row.name);
        assert_eq!(answer.stop_reason, StopReason::EndTurn, "{}", row.name);
        assert!(
            answer.usage.input_tokens > 0 && answer.usage.output_tokens > 0,
            "{}: {:?}",
            row.name,
            answer.usage
        );
        // The stream of the same answer: deltas, then the same answer and
        // usage.
        let events: Vec<StreamEvent> = built
            .model
            .stream(ModelRequest::new("Be brief.", &history, &settings))
            .map(|event| event.unwrap_or_else(|e| panic!("{}: {e}", row.name)))
            .collect()
            .await;
        let deltas: String = events
            .iter()
            .filter_map(|event| match event {
                StreamEvent::TextDelta { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(deltas, "hello", "{}: {events:?}", row.name);
        let Some(StreamEvent::Done(streamed)) = events.last() else {
            panic!("{}: no final answer: {events:?}", row.name)
        };
        assert_eq!(streamed.content, answer.content, "{}", row.name);
        assert_eq!(streamed.usage, answer.usage, "{}", row.name);
        let requests = server.requests();
        assert_eq!(requests.len(), 2, "{}", row.name);
        assert_eq!(requests[0].path, row.path, "{}", row.name);
        assert!(
            built.endpoint.ends_with(row.path),
            "{}: {}",
            row.name,
            built.endpoint
        );
    }
}

#[tokio::test]
async fn a_tool_call_comes_back_whole_and_streamed() {
    let args = json!({"a": 2, "b": 3});
    for row in rows() {
        let server = FakeServer::scripted(vec![
            Reply::json(200, (row.call)(&args)),
            // A stream cut into small chunks: events split anywhere.
            Reply::sse_split(&(row.call_events)(&args), 7),
        ])
        .await;
        let built = (row.build)(&server, &Tweaks::default());
        let history = [Message::user("What is 2 + 3?")];
        let settings = ModelSettings::default();
        let tools = add_tool();
        let request = || ModelRequest::new("", &history, &settings).with_tools(&tools);
        let answer = built
            .model
            .complete(request())
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        assert_eq!(
            the_call(&answer),
            ("add".into(), args.clone()),
            "{}",
            row.name
        );
        assert_eq!(answer.stop_reason, StopReason::ToolUse, "{}", row.name);
        let streamed = collect_stream(built.model.stream(request()))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        assert_eq!(
            the_call(&streamed),
            ("add".into(), args.clone()),
            "{}",
            row.name
        );
        assert_eq!(streamed.stop_reason, StopReason::ToolUse, "{}", row.name);
    }
}

#[tokio::test]
async fn retryable_errors_are_retried_whole_and_streamed() {
    for row in rows() {
        let server = FakeServer::scripted(vec![
            (row.retryable)(),
            Reply::text(502, "bad gateway"),
            Reply::json(200, (row.text)("finally")),
            (row.retryable)(),
            Reply::sse(&(row.text_events)("streamed")),
        ])
        .await;
        let built = (row.build)(&server, &Tweaks::default());
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let answer = built
            .model
            .complete(ModelRequest::new("", &history, &settings))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        assert_eq!(answer.content, vec![Item::text("finally")], "{}", row.name);
        assert_eq!(server.requests().len(), 3, "{}", row.name);
        // A stream retries until its response head arrives.
        let streamed = collect_stream(
            built
                .model
                .stream(ModelRequest::new("", &history, &settings)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        assert_eq!(
            streamed.content,
            vec![Item::text("streamed")],
            "{}",
            row.name
        );
        assert_eq!(server.requests().len(), 5, "{}", row.name);
    }
}

#[tokio::test]
async fn retries_stop_at_the_configured_count() {
    for row in rows() {
        let server = FakeServer::scripted(vec![
            Reply::text(500, "boom"),
            Reply::text(500, "boom"),
            Reply::text(500, "boom"),
            Reply::json(200, (row.text)("too late")),
        ])
        .await;
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        // The default: one call and two retries.
        let built = (row.build)(&server, &Tweaks::default());
        let error = built
            .model
            .complete(ModelRequest::new("", &history, &settings))
            .await
            .expect_err(row.name);
        assert_eq!(
            error,
            ModelError::Http {
                status: 500,
                message: format!("boom (from {})", built.endpoint),
                retry_after: None
            },
            "{}",
            row.name
        );
        assert_eq!(server.requests().len(), 3, "{}", row.name);
        let server = FakeServer::scripted(vec![
            (row.retryable)(),
            (row.retryable)(),
            Reply::json(200, (row.text)("too late")),
        ])
        .await;
        let once = Tweaks {
            max_retries: Some(1),
            ..Tweaks::default()
        };
        let error = (row.build)(&server, &once)
            .model
            .complete(ModelRequest::new("", &history, &settings))
            .await
            .expect_err(row.name);
        assert!(error.is_retryable(), "{}: {error:?}", row.name);
        assert_eq!(server.requests().len(), 2, "{}", row.name);
    }
}

#[tokio::test]
async fn client_errors_are_not_retried_and_carry_the_providers_message() {
    for row in rows() {
        for (status, message) in [
            (400, "messages: text content blocks must be non-empty"),
            (401, "invalid api key"),
            (403, "Your API key does not have permission"),
        ] {
            let server = FakeServer::scripted(vec![
                Reply::json(status, (row.refusal)(status, message)),
                Reply::json(200, (row.text)("never")),
            ])
            .await;
            let built = (row.build)(&server, &Tweaks::default());
            let history = [Message::user("hi")];
            let settings = ModelSettings::default();
            let error = built
                .model
                .complete(ModelRequest::new("", &history, &settings))
                .await
                .expect_err(row.name);
            assert_eq!(
                error,
                ModelError::Http {
                    status,
                    // The provider's own message, and the URL it came from.
                    message: format!("{message} (from {})", built.endpoint),
                    retry_after: None
                },
                "{}",
                row.name
            );
            assert_eq!(server.requests().len(), 1, "{}", row.name);
        }
    }
}

#[tokio::test]
async fn an_attempt_times_out_and_a_call_ends_at_its_deadline() {
    for row in rows() {
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        // The timeout bounds one attempt.
        let server = FakeServer::scripted(vec![Reply::hang(Duration::from_secs(5))]).await;
        let built = (row.build)(
            &server,
            &Tweaks {
                max_retries: Some(0),
                timeout: Some(Duration::from_millis(200)),
                ..Tweaks::default()
            },
        );
        let started = Instant::now();
        assert_eq!(
            built
                .model
                .complete(ModelRequest::new("", &history, &settings))
                .await,
            Err(ModelError::Timeout(Duration::from_millis(200))),
            "{}",
            row.name
        );
        assert!(started.elapsed() < Duration::from_secs(4), "{}", row.name);
        // The deadline bounds the whole call, however the server keeps it
        // alive.
        let server = FakeServer::scripted(vec![
            Reply::hang(Duration::from_secs(30)),
            Reply::sse_repeating(
                ": ping\n\n",
                Duration::from_millis(5),
                Duration::from_secs(30),
            ),
        ])
        .await;
        let built = (row.build)(
            &server,
            &Tweaks {
                max_retries: Some(0),
                deadline: Some(Duration::from_millis(200)),
                ..Tweaks::default()
            },
        );
        assert_eq!(
            built
                .model
                .complete(ModelRequest::new("", &history, &settings))
                .await,
            Err(ModelError::Timeout(Duration::from_millis(200))),
            "{}",
            row.name
        );
        let streamed = built
            .model
            .stream(ModelRequest::new("", &history, &settings))
            .collect::<Vec<_>>()
            .await;
        assert_eq!(
            streamed.last(),
            Some(&Err(ModelError::Timeout(Duration::from_millis(200)))),
            "{}",
            row.name
        );
    }
}

#[tokio::test]
async fn dropping_the_future_cancels_the_call() {
    for row in rows() {
        let server = FakeServer::scripted(vec![Reply::hang(Duration::from_secs(5))]).await;
        let built = (row.build)(&server, &Tweaks::default());
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let started = Instant::now();
        let call = built
            .model
            .complete(ModelRequest::new("", &history, &settings));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), call)
                .await
                .is_err(),
            "{}",
            row.name
        );
        assert!(started.elapsed() < Duration::from_secs(2), "{}", row.name);
    }
}

#[tokio::test]
async fn the_limits_hold_the_calls_in_flight() {
    for row in rows() {
        let server = FakeServer::start().await;
        let text = (row.text)("ok");
        server.answer_with(move |_| {
            Reply::json(200, text.clone()).delayed(Duration::from_millis(50))
        });
        let built = (row.build)(
            &server,
            &Tweaks {
                limits: Some(Limits::default().max_concurrent(1)),
                ..Tweaks::default()
            },
        );
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let calls = (0..3).map(|_| {
            built
                .model
                .complete(ModelRequest::new("", &history, &settings))
        });
        for answer in futures::future::join_all(calls).await {
            assert_eq!(
                answer.map(|a| a.content),
                Ok(vec![Item::text("ok")]),
                "{}",
                row.name
            );
        }
        assert_eq!(server.requests().len(), 3, "{}", row.name);
        assert_eq!(server.max_in_flight(), 1, "{}", row.name);
    }
}

#[tokio::test]
async fn the_key_goes_in_its_header_and_never_shows() {
    for row in rows() {
        let server = FakeServer::scripted(vec![Reply::json(200, (row.text)("hi"))]).await;
        let built = (row.build)(&server, &Tweaks::default());
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        built
            .model
            .complete(ModelRequest::new("", &history, &settings))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        let sent = server.single();
        let (header, value) = row.key_header;
        assert_eq!(sent.header(header), Some(value), "{}", row.name);
        assert_eq!(
            sent.header("content-type"),
            Some("application/json"),
            "{}",
            row.name
        );
        for shown in &built.debug {
            assert!(!shown.contains(row.key), "{}: {shown}", row.name);
        }
        assert!(built.debug[1].contains("redacted"), "{}", row.name);
    }
}

#[tokio::test]
async fn a_forced_call_answered_in_text_is_an_error() {
    for row in rows() {
        let server = FakeServer::scripted(vec![
            Reply::json(200, (row.text)("A confident guess.")),
            Reply::sse(&(row.text_events)("A confident guess.")),
        ])
        .await;
        let built = (row.build)(&server, &Tweaks::default());
        let history = [Message::user("What is 2 + 3?")];
        let settings = ModelSettings::default();
        let tools = add_tool();
        let request = || {
            ModelRequest::new("", &history, &settings)
                .with_tools(&tools)
                .with_tool_choice(&ToolChoice::Any)
        };
        for result in [
            built.model.complete(request()).await,
            collect_stream(built.model.stream(request())).await,
        ] {
            assert!(
                matches!(&result, Err(ModelError::InvalidResponse(m))
                    if m.contains(markov_providers::TEXT_INSTEAD_OF_TOOL_CALL)),
                "{}: {result:?}",
                row.name
            );
        }
    }
}
