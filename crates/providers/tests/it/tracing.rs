//! Every call runs in a `provider_request` span naming provider, model and
//! attempt, and nothing logged shows the API key.
#![cfg(all(feature = "anthropic", feature = "openai"))]

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use markov_core::{Message, Model, ModelRequest, ModelSettings};
use markov_providers::{Anthropic, OpenAi};
use markov_testkit::http::{FakeServer, Reply};
use serde_json::json;

const ANTHROPIC_KEY: &str = "sk-ant-tracing-secret";
const OPENAI_KEY: &str = "sk-proj-tracing-secret";

/// A log sink the test can read back.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }
}

/// The sink of the capture under way, if any.
static CURRENT: Mutex<Option<Sink>> = Mutex::new(None);

/// Held by a test while it captures: the tests of this module take turns,
/// so that each reads only what it logged.
static TURN: Mutex<()> = Mutex::new(());

/// Writes to the capture under way, or nowhere.
struct Current;

impl Write for Current {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let current = CURRENT.lock().expect("lock").clone();
        match current {
            Some(mut sink) => sink.write(buf),
            None => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures everything logged while the returned sink is current. One
/// global subscriber serves the whole test binary: tracing caches each
/// callsite's interest globally, and a thread-local subscriber coming and
/// going beside other tests can leave a span disabled for this one.
fn capture() -> (Sink, std::sync::MutexGuard<'static, ()>) {
    let turn = TURN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(|| Current)
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        tracing::callsite::rebuild_interest_cache();
    });
    let sink = Sink::default();
    *CURRENT.lock().expect("lock") = Some(sink.clone());
    (sink, turn)
}

// The turn is held across the calls on purpose: see `TURN`.
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn calls_are_traced_per_attempt_without_keys() {
    let (sink, _turn) = capture();

    let overloaded = Reply::json(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    );
    let anthropic_answer = json!({
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1}
    });
    let server = FakeServer::scripted(vec![overloaded, Reply::json(200, anthropic_answer)]).await;
    let anthropic = Anthropic::builder()
        .api_key(ANTHROPIC_KEY)
        .base_url(server.base_url())
        .model("claude-traced")
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings);
    anthropic.complete(request).await.unwrap();

    let openai_answer = json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}]
    });
    let server = FakeServer::scripted(vec![
        Reply::json(
            401,
            json!({"error": {"message": "Incorrect API key provided"}}),
        ),
        Reply::json(200, openai_answer),
    ])
    .await;
    let openai = OpenAi::builder()
        .api_key(OPENAI_KEY)
        .base_url(server.base_url())
        .model("gpt-traced")
        .build()
        .unwrap();
    assert!(openai.complete(request).await.is_err());

    let logs = sink.text();
    assert!(
        logs.contains(r#"provider_request{gen_ai.provider.name="anthropic" gen_ai.request.model="claude-traced" attempt=1}"#),
        "{logs}"
    );
    // The attempt is recorded on the call's span as it advances (fmt
    // prints each recorded value: `attempt=1 attempt=2`).
    assert!(logs.contains("attempt=2}"), "{logs}");
    assert!(logs.contains("retrying"), "{logs}");
    assert!(
        logs.contains(r#"provider_request{gen_ai.provider.name="openai" gen_ai.request.model="gpt-traced" attempt=1}"#),
        "{logs}"
    );
    assert!(!logs.contains(ANTHROPIC_KEY), "{logs}");
    assert!(!logs.contains(OPENAI_KEY), "{logs}");
}

#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn a_fallback_span_names_the_model_that_answered() {
    let (sink, _turn) = capture();
    let down = FakeServer::scripted(vec![Reply::json(
        503,
        json!({"error": {"message": "down"}}),
    )])
    .await;
    let up = FakeServer::scripted(vec![Reply::json(
        200,
        json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop"}]}),
    )])
    .await;
    let client = |server: &FakeServer| {
        Arc::new(
            OpenAi::builder()
                .base_url(server.base_url())
                .max_retries(0)
                .build()
                .unwrap(),
        )
    };
    let model = markov_providers::Fallback::new(client(&down)).or_named(client(&up), "gpt-spare");
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    // The loop's span of a model call, as markov-executor declares it.
    let chat = tracing::info_span!("chat", gen_ai.response.model = tracing::field::Empty);
    {
        use tracing::Instrument;
        model
            .complete(ModelRequest::new("", &history, &settings))
            .instrument(chat.clone())
            .await
            .unwrap();
    }
    tracing::info!(parent: &chat, "step done");
    let logs = sink.text();
    assert!(
        logs.contains(r#"chat{gen_ai.response.model="gpt-spare"}: "#),
        "{logs}"
    );
    assert!(logs.contains("trying the next"), "{logs}");
    assert!(
        logs.contains(r#"gen_ai.response.model="gpt-spare" fallback.index=1"#),
        "{logs}"
    );
}

/// What Anthropic's context editing cleared is recorded in the trace,
/// from a complete answer and from a stream's `message_delta`, inside
/// the call's span.
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn the_edits_of_anthropic_context_editing_are_traced() {
    let (sink, _turn) = capture();
    let cleared = markov_testkit::http::anthropic::with_cleared_tool_uses(
        markov_testkit::http::anthropic::text("ok"),
        3,
        12_000,
    );
    let stream = markov_testkit::http::anthropic::text_events("ok").replace(
        r#""type":"message_delta","#,
        r#""type":"message_delta","context_management":{"applied_edits":[{"type":"clear_tool_uses_20250919","cleared_tool_uses":5,"cleared_input_tokens":20000}]},"#,
    );
    assert!(stream.contains("cleared_tool_uses"), "{stream}");
    let server = FakeServer::scripted(vec![Reply::json(200, cleared), Reply::sse(&stream)]).await;
    let model = Anthropic::builder()
        .base_url(server.base_url())
        .model("claude-edited")
        .clear_tool_uses(markov_providers::ClearToolUses::new())
        .build()
        .unwrap();
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .unwrap();
    markov_core::model::collect_stream(model.stream(ModelRequest::new("", &history, &settings)))
        .await
        .unwrap();
    let logs = sink.text();
    let edits: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains("context editing cleared"))
        .collect();
    assert_eq!(edits.len(), 2, "{logs}");
    assert!(
        edits[0].contains(r#"gen_ai.request.model="claude-edited""#)
            && edits[0].contains("cleared_tool_uses=3 cleared_input_tokens=12000"),
        "{logs}"
    );
    assert!(
        edits[1].contains("cleared_tool_uses=5 cleared_input_tokens=20000"),
        "{logs}"
    );
}
