//! Outgoing limits against a fake server on loopback: a thousand calls at
//! once keep the bound on calls in flight and on connections, a call that
//! waits past the queue deadline fails without a request, the request and token rates
//! hold calls back, and an exhausted quota or a long `retry-after` is not
//! retried. Nothing here measures speed.
#![cfg(feature = "openai")]

use std::time::Duration;

use futures::future::join_all;
use markov_core::{Message, Model, ModelError, ModelRequest, ModelSettings};
use markov_providers::{Limits, OpenAi};
use markov_testkit::http::{FakeServer, Reply, openai};
use serde_json::json;

fn client(server: &FakeServer, limits: Limits) -> OpenAi {
    OpenAi::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .model("local")
        .limits(limits)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .build()
        .expect("a valid client")
}

async fn ask(model: &OpenAi, settings: &ModelSettings) -> Result<(), ModelError> {
    let history = [Message::user("hi")];
    model
        .complete(ModelRequest::new("", &history, settings))
        .await
        .map(|_| ())
}

fn queue_error(result: &Result<(), ModelError>) -> bool {
    matches!(result, Err(ModelError::Overloaded(message)) if message.contains("queue deadline") && message.contains("no request was sent"))
}

#[tokio::test]
async fn a_thousand_calls_at_once_keep_the_bound_on_calls_in_flight() {
    const CALLS: usize = 1_000;
    const BOUND: usize = 8;
    let reply = Reply::json(200, openai::text("ok")).delayed(Duration::from_millis(3));
    let server = FakeServer::scripted(vec![reply; CALLS]).await;
    let model = client(
        &server,
        Limits::default()
            .max_concurrent(BOUND)
            .queue_deadline(Duration::from_secs(600)),
    );
    let settings = ModelSettings::default();
    let results = join_all((0..CALLS).map(|_| ask(&model, &settings))).await;
    assert!(
        results.iter().all(Result::is_ok),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    assert_eq!(server.requests().len(), CALLS);
    let most = server.max_in_flight();
    assert!(most <= BOUND, "{most} requests were in flight at once");
    assert!(
        most > 1,
        "the calls ran one at a time: the test shows nothing"
    );
    // Kept alive and reused: the bound on calls is a bound on connections.
    let connections = server.connections();
    assert!(
        connections <= BOUND,
        "{CALLS} calls opened {connections} connections"
    );
}

#[tokio::test]
async fn a_call_that_waits_past_the_queue_deadline_fails_without_a_request() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, openai::text("slow")).delayed(Duration::from_millis(400)),
        Reply::json(200, openai::text("never asked")),
    ])
    .await;
    let model = client(
        &server,
        Limits::default()
            .max_concurrent(1)
            .queue_deadline(Duration::from_millis(50)),
    );
    let settings = ModelSettings::default();
    let results = join_all([ask(&model, &settings), ask(&model, &settings)]).await;
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    assert_eq!(
        results.iter().filter(|r| queue_error(r)).count(),
        1,
        "{results:?}"
    );
    assert_eq!(server.requests().len(), 1);
    assert_eq!(server.remaining(), 1);
    // The place is free again once the slow call is done.
    assert!(ask(&model, &settings).await.is_ok());
}

#[tokio::test]
async fn the_request_and_token_rates_hold_calls_back() {
    let server = FakeServer::scripted(vec![Reply::json(200, openai::text("ok")); 4]).await;
    let settings = ModelSettings::default();
    let by_requests = client(
        &server,
        Limits::default()
            .requests_per_minute(2)
            .queue_deadline(Duration::from_millis(50)),
    );
    assert!(ask(&by_requests, &settings).await.is_ok());
    assert!(ask(&by_requests, &settings).await.is_ok());
    let third = ask(&by_requests, &settings).await;
    assert!(queue_error(&third), "{third:?}");
    assert_eq!(server.requests().len(), 2);
    // A call's tokens count its answer's allowance: 800 of 1 000 leave
    // no room for a second.
    let by_tokens = client(
        &server,
        Limits::default()
            .tokens_per_minute(1_000)
            .queue_deadline(Duration::from_millis(50)),
    );
    let settings = ModelSettings {
        max_tokens: 800,
        ..ModelSettings::default()
    };
    assert!(ask(&by_tokens, &settings).await.is_ok());
    let second = ask(&by_tokens, &settings).await;
    assert!(queue_error(&second), "{second:?}");
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn an_exhausted_quota_and_a_long_retry_after_are_not_retried() {
    let server = FakeServer::scripted(vec![
        Reply::json(
            429,
            json!({"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
                             "type": "insufficient_quota", "code": "insufficient_quota"}}),
        )
        .header("retry-after", "0"),
        Reply::json(429, openai::error("rate_limit_error", "slow down")).header("retry-after", "3600"),
        Reply::json(200, openai::text("not reached")),
    ])
    .await;
    let model = client(&server, Limits::default());
    let settings = ModelSettings::default();
    let quota = ask(&model, &settings).await;
    assert!(
        matches!(&quota, Err(ModelError::Http { status: 429, message, .. }) if message.starts_with("quota exhausted")),
        "{quota:?}"
    );
    assert_eq!(server.requests().len(), 1);
    let long = ask(&model, &settings).await;
    assert!(
        matches!(long, Err(ModelError::Http { status: 429, .. })),
        "{long:?}"
    );
    assert_eq!(
        server.requests().len(),
        2,
        "a wait of an hour is not waited"
    );
}

#[tokio::test]
async fn a_stream_holds_its_place_until_its_last_event() {
    use futures::StreamExt;
    let server = FakeServer::scripted(vec![
        Reply::sse(&openai::text_events("streaming")).then_stall(Duration::from_millis(300)),
        Reply::json(200, openai::text("after")),
    ])
    .await;
    let model = client(
        &server,
        Limits::default()
            .max_concurrent(1)
            .queue_deadline(Duration::from_millis(50)),
    );
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let mut stream = model.stream(ModelRequest::new("", &history, &settings));
    assert!(matches!(stream.next().await, Some(Ok(_))));
    // The stream has not ended: its place is taken.
    let waiting = ask(&model, &settings).await;
    assert!(queue_error(&waiting), "{waiting:?}");
    while stream.next().await.is_some() {}
    drop(stream);
    assert!(ask(&model, &settings).await.is_ok());
    assert_eq!(server.requests().len(), 2);
}
