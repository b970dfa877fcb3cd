//! [`Fallback`]: a model that tries a list of models in order.
//!
//! Each client retries a failing call itself (its own backoff, its own
//! `retry-after` cap); what reaches the fallback is the failure left after
//! those retries. The next model is tried only when that failure says the
//! *service* could not answer — an overload, a `5xx`, a timeout, a
//! connection failure, a `408`, or a `429` (a rate limit past the client's
//! retry budget, or a quota that is exhausted) — never when the request
//! itself is at fault (`400`, `401`, `403`, `404`, `422`, a redirect, an
//! invalid request or an answer that cannot be read), since another model
//! would be asked the same thing. A refusal is an answer (stop reason
//! `refusal`), and is returned as it is.
//!
//! The answer names the model that gave it
//! ([`ModelResponse::model`]): the name its provider reported, else the
//! name the fallback asked for (the entry's own, or the request's), so a
//! machine's step says which model of the list answered.

use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::StreamEvent;
use markov_core::model::{
    Compaction, Model, ModelError, ModelRequest, ModelResponse, ModelSettings,
};
use markov_core::model::{Thinking, ThinkingAllowance, Unsupported};
use markov_core::tool::ToolDefinition;
use serde_json::Value;
use tracing::Instrument;

/// One model of the list, with the model name it is asked for.
#[derive(Debug, Clone)]
struct Entry {
    model: Arc<dyn Model>,
    /// The model name this entry sends instead of the request's, if any.
    name: Option<String>,
}

/// A model that answers with the first of its models that can: the first
/// is asked, and on a failure of the service (see the module docs) the
/// next, in order. The answer's [`ModelResponse::model`] names the model
/// that answered: as its provider reported it, else the name it was asked
/// for. Every call runs in a `fallback` span whose `gen_ai.response.model`
/// and `fallback.index` name the model that answered (the reported name,
/// else the name asked for, else its provider's); the caller's span gets
/// the same `gen_ai.response.model` when it declares the field, as the
/// loop's `chat` span of each step does.
///
/// [`check_tools`](Model::check_tools) asks every model of the list: the
/// request may reach any of them.
/// [`count_tokens`](Model::count_tokens) asks the first model only: the model that answers while the
/// service is well, whose context window a count is measured against. Its
/// failure is the count's failure (the caller estimates instead); another
/// model of the list, another tokenizer, is not asked.
///
/// [`native_summaries`](Model::native_summaries) is the vendor tag every
/// model of the list shares, else `None`, and
/// [`compact`](Model::compact) asks the first model only when there is
/// one: a list that mixes vendors (Anthropic then OpenAI, or two
/// Responses servers) reads no native summaries, so a context view never
/// sends one model's compaction items to another (an agent with
/// `Summarize::native` on such a list fails when it is built; a text
/// summary serves every model of a list).
///
/// ```no_run
/// use std::sync::Arc;
/// use markov_providers::{Anthropic, Fallback, OpenAi};
///
/// # fn build() -> Result<(), markov_providers::ConfigError> {
/// let model = Fallback::new(Arc::new(Anthropic::from_env()?))
///     .or_named(Arc::new(OpenAi::from_env()?), "gpt-4.1-mini");
/// # let _ = model;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Fallback {
    entries: Vec<Entry>,
}

/// Whether `error`, left after a client's own retries, is a failure of the
/// service that another model may not share.
pub fn falls_back(error: &ModelError) -> bool {
    match error {
        ModelError::Http { status, .. } => matches!(status, 408 | 429) || *status >= 500,
        ModelError::Overloaded(_) | ModelError::Timeout(_) | ModelError::Connection(_) => true,
        _ => false,
    }
}

impl Fallback {
    /// A fallback list that starts with `first`, asked with the request's
    /// own model name.
    pub fn new(first: Arc<dyn Model>) -> Self {
        Fallback {
            entries: vec![Entry {
                model: first,
                name: None,
            }],
        }
    }

    /// Adds `model`, asked with the request's own model name, after those
    /// given so far.
    #[must_use]
    pub fn or(mut self, model: Arc<dyn Model>) -> Self {
        self.entries.push(Entry { model, name: None });
        self
    }

    /// Adds `model`, asked for the model `name` whatever the request names
    /// (a smaller model of the same provider, another provider's model).
    #[must_use]
    pub fn or_named(mut self, model: Arc<dyn Model>, name: impl Into<String>) -> Self {
        self.entries.push(Entry {
            model,
            name: Some(name.into()),
        });
        self
    }

    /// How many models the list holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the list is empty (never: it starts with one model).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The name `entry` is asked for with `request`, if any names one.
    fn asked<'a>(entry: &'a Entry, request: &ModelRequest<'a>) -> Option<&'a str> {
        entry
            .name
            .as_deref()
            .or(request.settings().model.as_deref())
    }
}

/// `response`, naming `asked` as the model that answered when its
/// provider named none.
fn named(mut response: ModelResponse, asked: Option<&str>) -> ModelResponse {
    if response.model.is_none() {
        response.model = asked.map(str::to_owned);
    }
    response
}

/// Records on the fallback's span and on the caller's which model of the
/// list answered.
fn record(caller: &tracing::Span, label: &str, index: usize) {
    let span = tracing::Span::current();
    span.record("gen_ai.response.model", label);
    span.record("fallback.index", index);
    caller.record("gen_ai.response.model", label);
}

fn span() -> tracing::Span {
    tracing::info_span!(
        "fallback",
        gen_ai.response.model = tracing::field::Empty,
        fallback.index = tracing::field::Empty,
    )
}

/// A layer over the first model of the list: what the list changes is
/// here; every other method (the provider's name, the configured model,
/// the default answer tokens, a count) is the first model's, the one that
/// answers while the service is well.
#[async_trait]
impl markov_core::model::ModelLayer for Fallback {
    type Inner = dyn Model;

    fn inner(&self) -> &Self::Inner {
        &*self.entries[0].model
    }

    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&Value>,
    ) -> Result<(), Unsupported> {
        // The request may reach any model of the list.
        self.entries
            .iter()
            .try_for_each(|e| e.model.check_tools(tools, output_schema))
    }

    fn thinking_allowance(
        &self,
        settings: &ModelSettings,
        thinking: Thinking,
    ) -> ThinkingAllowance {
        // What every model of the list allows: the request may reach any.
        self.entries
            .iter()
            .map(|e| e.model.thinking_allowance(settings, thinking))
            .fold(
                ThinkingAllowance {
                    forced_tool_choice: true,
                    temperature: true,
                },
                |all, one| ThinkingAllowance {
                    forced_tool_choice: all.forced_tool_choice && one.forced_tool_choice,
                    temperature: all.temperature && one.temperature,
                },
            )
    }

    fn native_summaries(&self) -> Option<&str> {
        // A request may reach any model of the list: the items are shown
        // only if every one reads them.
        let first = self.entries[0].model.native_summaries()?;
        self.entries[1..]
            .iter()
            .all(|e| e.model.native_summaries() == Some(first))
            .then_some(first)
    }

    fn native_tool_search(&self) -> bool {
        // A request with deferred tools may reach any model of the list.
        self.entries.iter().all(|e| e.model.native_tool_search())
    }

    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        // Only items every model of the list reads are worth making; the
        // first model makes them, as it counts.
        if Model::native_summaries(self).is_none() {
            return Ok(Compaction::NotOffered);
        }
        self.entries[0].model.compact(request).await
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        // The caller's span (the loop's `chat` span of the step) hears which
        // model answered too, when it declares the field.
        let caller = tracing::Span::current();
        let span = span();
        let call = async {
            let mut last = None;
            for (index, entry) in self.entries.iter().enumerate() {
                let renamed;
                let request = match &entry.name {
                    Some(name) => {
                        renamed = ModelSettings {
                            model: Some(name.clone()),
                            ..request.settings().clone()
                        };
                        request.with_settings(&renamed)
                    }
                    None => request,
                };
                match entry.model.complete(request).await {
                    Ok(response) => {
                        let response = named(response, Self::asked(entry, &request));
                        let label = response
                            .model
                            .as_deref()
                            .unwrap_or_else(|| entry.model.provider_name());
                        record(&caller, label, index);
                        if index > 0 {
                            tracing::info!(index, "answered by a fallback model");
                        }
                        return Ok(response);
                    }
                    Err(error) if falls_back(&error) && index + 1 < self.entries.len() => {
                        tracing::warn!(%error, index, "model failed; trying the next");
                        last = Some(error);
                    }
                    Err(error) => return Err(error),
                }
            }
            Err(last.unwrap_or_else(|| ModelError::InvalidRequest("no model to ask".into())))
        };
        call.instrument(span).await
    }

    /// Streams from the first model whose stream starts: a model whose
    /// stream fails before its first event (the connection, the response
    /// head) with a failure of the service is passed over; once events
    /// flow, a failure ends the stream. A model given its own name is asked
    /// without streaming and its answer replayed. The spans name the model
    /// when the stream starts, before the answer reports its name: the name
    /// asked for, else the provider's.
    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let caller = tracing::Span::current();
        let span = span();
        let start = async move {
            for (index, entry) in self.entries.iter().enumerate() {
                let mut events = match &entry.name {
                    Some(_) => crate::fallback::replayed(self, index, request),
                    None => entry.model.stream(request),
                };
                match events.next().await {
                    Some(Err(error)) if falls_back(&error) && index + 1 < self.entries.len() => {
                        tracing::warn!(%error, index, "model stream failed; trying the next");
                    }
                    first => {
                        let asked = Self::asked(entry, &request);
                        if matches!(first, Some(Ok(_))) {
                            let label = asked.unwrap_or_else(|| entry.model.provider_name());
                            record(&caller, label, index);
                        }
                        return futures::stream::iter(first)
                            .chain(events)
                            .map(move |event| match event {
                                Ok(StreamEvent::Done(response)) => {
                                    Ok(StreamEvent::Done(named(response, asked)))
                                }
                                other => other,
                            })
                            .boxed();
                    }
                }
            }
            futures::stream::empty().boxed()
        };
        futures::stream::once(start.instrument(span))
            .flatten()
            .boxed()
    }
}

/// The answer of the entry at `index` (which names its model) as events.
fn replayed<'a>(
    fallback: &'a Fallback,
    index: usize,
    request: ModelRequest<'a>,
) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
    let entry = &fallback.entries[index];
    let name = entry.name.clone();
    markov_core::model::replay_stream(async move {
        let settings = ModelSettings {
            model: name,
            ..request.settings().clone()
        };
        entry.model.complete(request.with_settings(&settings)).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn only_failures_of_the_service_fall_back() {
        let http = |status| ModelError::Http {
            status,
            message: String::new(),
            retry_after: None,
        };
        for error in [
            http(500),
            http(503),
            http(529),
            http(429),
            http(408),
            ModelError::Overloaded("busy".into()),
            ModelError::Timeout(Duration::from_secs(1)),
            ModelError::Connection("refused".into()),
        ] {
            assert!(falls_back(&error), "{error:?}");
        }
        for error in [
            http(400),
            http(401),
            http(403),
            http(404),
            http(422),
            ModelError::InvalidRequest("bad".into()),
            ModelError::InvalidResponse("garbled".into()),
            ModelError::Redirect {
                status: 301,
                location: None,
            },
        ] {
            assert!(!falls_back(&error), "{error:?}");
        }
    }
}
