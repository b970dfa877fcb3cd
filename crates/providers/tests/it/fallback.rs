//! [`Fallback`] against fake servers on loopback: the models are asked in
//! order, the next only when the service failed, never on a request the
//! provider refused or a refusal; a stream moves on only before its first
//! event.
#![cfg(feature = "openai")]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelSettings, StopReason, StreamEvent,
};
use markov_providers::{Fallback, OpenAi};
use markov_testkit::http::{FakeServer, MODEL, Reply, openai};
use serde_json::json;

fn client(server: &FakeServer, model: &str) -> Arc<dyn Model> {
    Arc::new(
        OpenAi::builder()
            .base_url(format!("{}/v1", server.base_url()))
            .model(model)
            .max_retries(0)
            .build()
            .expect("a valid client"),
    )
}

async fn ask(model: &dyn Model) -> Result<markov_core::ModelResponse, ModelError> {
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    model
        .complete(ModelRequest::new("", &history, &settings))
        .await
}

#[tokio::test]
async fn the_models_are_tried_in_order_while_the_service_fails() {
    let overloaded = FakeServer::scripted(vec![Reply::json(
        503,
        json!({"error": {"message": "overloaded"}}),
    )])
    .await;
    let out_of_quota = FakeServer::scripted(vec![Reply::json(
        429,
        json!({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}}),
    )])
    .await;
    let third = FakeServer::scripted(vec![Reply::json(200, openai::text("from the third"))]).await;
    let unused = FakeServer::start().await;
    let model = Fallback::new(client(&overloaded, "first"))
        .or(client(&out_of_quota, "second"))
        .or_named(client(&third, "third-default"), "third-named")
        .or(client(&unused, "fourth"));
    let answer = ask(&model).await.expect("the third answers");
    assert_eq!(answer.content, vec![Item::text("from the third")]);
    assert_eq!(
        answer.model.as_deref(),
        Some(MODEL),
        "the name the server reported"
    );
    assert_eq!(overloaded.requests().len(), 1);
    assert_eq!(out_of_quota.requests().len(), 1);
    assert_eq!(third.single().body["model"], "third-named");
    assert!(unused.requests().is_empty(), "the list stops at the answer");
}

#[tokio::test]
async fn the_last_failure_is_returned_when_every_model_fails() {
    let first =
        FakeServer::scripted(vec![Reply::json(500, json!({"error": {"message": "a"}}))]).await;
    let second =
        FakeServer::scripted(vec![Reply::json(502, json!({"error": {"message": "b"}}))]).await;
    let model = Fallback::new(client(&first, "a")).or(client(&second, "b"));
    let error = ask(&model).await.expect_err("both failed");
    assert!(
        matches!(&error, ModelError::Http { status: 502, message, .. } if message.starts_with('b')),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_refused_request_or_a_refusal_never_falls_back() {
    let invalid = FakeServer::scripted(vec![Reply::json(
        400,
        openai::error("invalid_request_error", "bad schema"),
    )])
    .await;
    let refusing = FakeServer::scripted(vec![Reply::json(
        200,
        openai::completion(
            "r",
            json!({"role": "assistant", "content": null, "refusal": "I can't help with that."}),
            "stop",
        ),
    )])
    .await;
    let backup = FakeServer::start().await;
    let model = Fallback::new(client(&invalid, "a")).or(client(&backup, "b"));
    let error = ask(&model).await.expect_err("the 400 is returned");
    assert!(
        matches!(error, ModelError::Http { status: 400, .. }),
        "{error:?}"
    );
    let model = Fallback::new(client(&refusing, "a")).or(client(&backup, "b"));
    let answer = ask(&model).await.expect("a refusal is an answer");
    assert_eq!(answer.stop_reason, StopReason::Refusal);
    assert!(backup.requests().is_empty());
}

#[tokio::test]
async fn a_stream_moves_on_only_before_its_first_event() {
    let down = FakeServer::scripted(vec![Reply::json(
        503,
        json!({"error": {"message": "down"}}),
    )])
    .await;
    let up = FakeServer::scripted(vec![Reply::sse(&openai::text_events("streamed"))]).await;
    let model = Fallback::new(client(&down, "a")).or(client(&up, "b"));
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let events: Vec<_> = model
        .stream(ModelRequest::new("", &history, &settings))
        .collect()
        .await;
    let Some(Ok(StreamEvent::Done(answer))) = events.last() else {
        panic!("{events:?}")
    };
    assert_eq!(answer.content, vec![Item::text("streamed")]);
    assert_eq!(answer.model.as_deref(), Some(MODEL));
    assert!(events.iter().all(Result::is_ok));
    // Once events flow, a failure ends the stream: no second model.
    let cut = FakeServer::scripted(vec![
        Reply::sse_chunks(vec![openai::text_events("never ends")[..150].to_owned()])
            .then_stall(Duration::from_millis(10)),
    ])
    .await;
    let spare = FakeServer::start().await;
    let model = Fallback::new(client(&cut, "a")).or(client(&spare, "b"));
    let last = model
        .stream(ModelRequest::new("", &history, &settings))
        .collect::<Vec<_>>()
        .await
        .pop();
    assert!(matches!(last, Some(Err(_))), "{last:?}");
    assert!(spare.requests().is_empty());
}

/// A text answer that names `model`, as a dated snapshot of a model does.
fn answer_of(model: &str, text: &str) -> Reply {
    let mut body = openai::text(text);
    body["model"] = json!(model);
    Reply::json(200, body)
}

#[tokio::test]
async fn the_step_names_the_model_that_answered_when_the_first_is_overloaded() {
    let overloaded = FakeServer::scripted(vec![Reply::json(
        529,
        json!({"error": {"message": "Overloaded", "type": "overloaded_error"}}),
    )])
    .await;
    let spare = FakeServer::scripted(vec![answer_of("gpt-spare-2025-04-14", "5")]).await;
    let model = Fallback::new(client(&overloaded, "gpt-main")).or(client(&spare, "gpt-spare"));
    let agent = markov_executor::Agent::builder("adder")
        .instructions("Add.")
        .model(model)
        .build()
        .expect("the agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    let step = machine.run().await.expect("the spare answers");
    assert_eq!(step.output().as_deref(), Some("5"));
    assert_eq!(step.model.as_deref(), Some("gpt-spare-2025-04-14"));
    assert_eq!(overloaded.requests().len(), 1);
    assert_eq!(spare.single().body["model"], "gpt-spare");

    // A server that names no model: the step names the one asked for.
    let overloaded = FakeServer::scripted(vec![Reply::json(
        503,
        json!({"error": {"message": "busy"}}),
    )])
    .await;
    let mut nameless = openai::text("5");
    nameless.as_object_mut().unwrap().remove("model");
    let spare = FakeServer::scripted(vec![Reply::json(200, nameless)]).await;
    let model = Fallback::new(client(&overloaded, "gpt-main"))
        .or_named(client(&spare, "gpt-spare"), "gpt-spare-mini");
    let agent = markov_executor::Agent::builder("adder")
        .instructions("Add.")
        .model(model)
        .build()
        .expect("the agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    let step = machine.run().await.expect("the spare answers");
    assert_eq!(step.model.as_deref(), Some("gpt-spare-mini"));
}

/// A list of one model is that model: every method reaches it (a method
/// added to `Model` later included, as `Fallback` is a layer over its
/// first model).
#[tokio::test]
async fn every_method_of_a_one_model_list_reaches_the_model() {
    use markov_testkit::ProbeModel;
    ProbeModel::assert_reached_through(&Fallback::new(Arc::new(ProbeModel))).await;
}

/// A list answers its first model's configured name: what a call that
/// names no model is priced and limited by.
#[tokio::test]
async fn a_list_names_its_first_models_configured_model() {
    use markov_testkit::ProbeModel;
    let list = Fallback::new(Arc::new(ProbeModel)).or_named(Arc::new(ProbeModel), "other");
    assert_eq!(list.model_name(), Some(ProbeModel::MODEL));
}
