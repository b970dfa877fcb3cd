//! OpenTelemetry for markov.
//!
//! markov's `tracing` spans follow OpenTelemetry's GenAI semantic
//! conventions: a run is `invoke_agent` (`gen_ai.agent.name`, the run's
//! `gen_ai.usage.*` so far), each model call is `chat`
//! (`gen_ai.provider.name`, `gen_ai.request.model`, `gen_ai.usage.*`,
//! `gen_ai.response.finish_reasons`) and each tool call is `execute_tool`
//! (`gen_ai.tool.name`, `gen_ai.tool.call.id`); `otel.name` gives each its
//! OpenTelemetry span name (`chat claude-sonnet-4`, `execute_tool add`).
//! Prompts, messages and tool arguments and results are recorded only when
//! the executor is asked to (`StandardExecutor::with_content_capture`).
//!
//! This crate turns them into OpenTelemetry spans: add [`layer`] to a
//! `tracing_subscriber` registry with the tracer of your exporter (the
//! OpenTelemetry SDK and exporter are the application's choice).
//!
//! ```
//! use markov_otel::{layer, opentelemetry::trace::TracerProvider as _};
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
//! let subscriber = tracing_subscriber::registry().with(layer(provider.tracer("my-agent")));
//! let _guard = tracing::subscriber::set_default(subscriber);
//! ```
#![deny(missing_docs)]

pub use opentelemetry;
pub use tracing_opentelemetry;

use opentelemetry::trace::Tracer;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetryLayer;
use tracing_subscriber::registry::LookupSpan;

/// The layer that exports markov's spans through `tracer`.
pub fn layer<S, T>(tracer: T) -> OpenTelemetryLayer<S, T>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
    T: Tracer + 'static,
    T::Span: Send + Sync,
{
    tracing_opentelemetry::layer().with_tracer(tracer)
}
