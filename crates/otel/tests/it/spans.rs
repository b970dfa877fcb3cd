//! A two-step run with one tool call, exported through an in-memory
//! OpenTelemetry exporter: the span tree and its GenAI attributes.

use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::Item;
use markov_core::model::{ModelResponse, ModelSettings, StopReason, Usage};
use markov_executor::{RunOptions, StandardExecutor, run_to_completion};
use markov_otel::opentelemetry::trace::TracerProvider as _;
use markov_otel::opentelemetry::{KeyValue, Value};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::Add;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::json;
use tracing_subscriber::layer::SubscriberExt;

fn answer(content: Vec<Item>, stop: StopReason, input: u64, output: u64) -> ModelResponse {
    ModelResponse::new(content, stop)
        .with_usage(Usage {
            input_tokens: input,
            output_tokens: output,
            ..Usage::default()
        })
        // The dated snapshot a provider reports for the name asked for.
        .with_model("test-model-2025-01-01")
}

/// Runs "2 + 3" (a tool step, then the answer) and returns the spans.
fn traced_run(capture: bool) -> Vec<SpanData> {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber =
        tracing_subscriber::registry().with(markov_otel::layer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let model = ScriptedModel::builder()
        .response(answer(
            vec![Item::tool_use("c1", "add", json!({"a": 2, "b": 3}))],
            StopReason::ToolUse,
            100,
            20,
        ))
        .response(answer(vec![Item::text("5")], StopReason::EndTurn, 130, 2))
        .build();
    let node = Node::builder("Add.").tool(Add).build().expect("node");
    let charter = Charter::builder("calculator")
        .node("calc", node.clone())
        .build()
        .expect("charter");
    let settings = ModelSettings {
        model: Some("test-model".into()),
        ..ModelSettings::default()
    };
    let executor = StandardExecutor::new(model)
        .with_settings(settings)
        .with_content_capture(capture);
    let mut machine = markov_executor::Agent::on_charter(charter)
        .executor(executor)
        .state(json!({}))
        .build()
        .map(|agent| agent.machine())
        .expect("machine");
    machine.enqueue_user("What is 2 + 3?");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    runtime
        .block_on(run_to_completion(&mut machine, RunOptions::default()))
        .expect("the run ends");
    drop(_guard);
    provider.force_flush().expect("flushed");
    exporter.get_finished_spans().expect("spans")
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv: &&KeyValue| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn text(span: &SpanData, key: &str) -> Option<String> {
    attr(span, key).map(|v| v.as_str().into_owned())
}

fn int(span: &SpanData, key: &str) -> Option<i64> {
    match attr(span, key)? {
        Value::I64(n) => Some(*n),
        other => other.as_str().parse().ok(),
    }
}

fn by_operation<'a>(spans: &'a [SpanData], op: &str) -> Vec<&'a SpanData> {
    spans
        .iter()
        .filter(|s| text(s, "gen_ai.operation.name").as_deref() == Some(op))
        .collect()
}

/// The operation of the nearest ancestor that has one.
fn ancestor_operation(spans: &[SpanData], span: &SpanData) -> Option<String> {
    let mut parent = span.parent_span_id;
    while let Some(p) = spans.iter().find(|s| s.span_context.span_id() == parent) {
        if let Some(op) = text(p, "gen_ai.operation.name") {
            return Some(op);
        }
        parent = p.parent_span_id;
    }
    None
}

#[test]
fn a_two_step_run_with_one_tool_call_follows_the_genai_conventions() {
    let spans = traced_run(false);
    let agents = by_operation(&spans, "invoke_agent");
    let chats = by_operation(&spans, "chat");
    let tools = by_operation(&spans, "execute_tool");
    assert_eq!(
        (agents.len(), chats.len(), tools.len()),
        (1, 2, 1),
        "{spans:#?}"
    );

    let agent = agents[0];
    assert_eq!(agent.name, "invoke_agent calculator");
    assert_eq!(
        text(agent, "gen_ai.agent.name").as_deref(),
        Some("calculator")
    );
    assert_eq!(int(agent, "gen_ai.usage.input_tokens"), Some(230));
    assert_eq!(int(agent, "gen_ai.usage.output_tokens"), Some(22));

    for chat in &chats {
        assert_eq!(chat.name, "chat test-model");
        assert_eq!(
            text(chat, "gen_ai.provider.name").as_deref(),
            Some("scripted")
        );
        assert_eq!(
            text(chat, "gen_ai.request.model").as_deref(),
            Some("test-model")
        );
        assert_eq!(
            text(chat, "gen_ai.response.model").as_deref(),
            Some("test-model-2025-01-01")
        );
        assert_eq!(
            ancestor_operation(&spans, chat).as_deref(),
            Some("invoke_agent")
        );
        assert!(
            attr(chat, "gen_ai.input.messages").is_none(),
            "content is opt-in"
        );
    }
    let first = chats
        .iter()
        .find(|c| int(c, "gen_ai.usage.input_tokens") == Some(100))
        .expect("the first call");
    assert_eq!(int(first, "gen_ai.usage.output_tokens"), Some(20));
    assert!(
        text(first, "gen_ai.response.finish_reasons").is_some_and(|r| r.contains("ToolUse")),
        "{first:?}"
    );

    let tool = tools[0];
    assert_eq!(tool.name, "execute_tool add");
    assert_eq!(text(tool, "gen_ai.tool.name").as_deref(), Some("add"));
    assert_eq!(text(tool, "gen_ai.tool.call.id").as_deref(), Some("c1"));
    assert_eq!(
        ancestor_operation(&spans, tool).as_deref(),
        Some("invoke_agent")
    );
    assert!(
        attr(tool, "gen_ai.tool.call.arguments").is_none(),
        "content is opt-in"
    );
    // The two model calls are distinct spans (not two `model_call`s).
    assert_ne!(
        chats[0].span_context.span_id(),
        chats[1].span_context.span_id()
    );
}

#[test]
fn contents_are_recorded_only_when_asked_for() {
    let spans = traced_run(true);
    let chats = by_operation(&spans, "chat");
    assert!(
        chats
            .iter()
            .all(|c| text(c, "gen_ai.input.messages").is_some_and(|m| m.contains("2 + 3")))
    );
    let tool = by_operation(&spans, "execute_tool")[0];
    assert_eq!(
        text(tool, "gen_ai.tool.call.arguments").as_deref(),
        Some(r#"{"a":2,"b":3}"#)
    );
    assert_eq!(text(tool, "gen_ai.tool.call.result").as_deref(), Some("5"));
}
