//! The streaming driver both providers share: connect (with retries), read
//! server-sent events with `eventsource-stream`, hand each event to the
//! provider's decoder, and end with [`StreamEvent::Done`].
//!
//! Retries cover the connection and the response head only: once events
//! have reached the caller, a failure ends the stream with its error (a
//! mid-stream `overloaded_error` is [`ModelError::Overloaded`], retryable by
//! the caller).

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::future::BoxFuture;
use futures::stream::{self, BoxStream, StreamExt};
use markov_core::{ModelError, ModelResponse, StreamEvent};
use reqwest::Response;
use tracing::Instrument;

use crate::transport::transport_error;

/// A provider's incremental decoder of one streamed answer.
pub(crate) trait SseDecoder: Send {
    /// Handles one server-sent event, queueing the stream events it yields.
    /// Returns the final response when the event ends the answer.
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Option<ModelResponse>, ModelError>;

    /// The final response when the body ended without the provider's
    /// closing event, or why that is an error.
    fn on_end(&mut self) -> Result<ModelResponse, ModelError>;
}

type SseEvents = BoxStream<'static, Result<Event, EventStreamError<reqwest::Error>>>;

enum State<'a, D> {
    Connecting(BoxFuture<'a, Result<Response, ModelError>>, D),
    Reading {
        events: SseEvents,
        decoder: D,
        pending: VecDeque<StreamEvent>,
    },
    Draining(VecDeque<StreamEvent>),
    Finished,
}

/// Streams one answer: `connect` yields a successful response whose body is
/// an event stream, `decoder` turns the events into [`StreamEvent`]s.
pub(crate) fn sse_stream<'a, D, Fut>(
    span: tracing::Span,
    timeout: Duration,
    connect: Fut,
    decoder: D,
) -> BoxStream<'a, Result<StreamEvent, ModelError>>
where
    D: SseDecoder + 'a,
    Fut: Future<Output = Result<Response, ModelError>> + Send + 'a,
{
    let start = State::Connecting(Box::pin(connect), decoder);
    stream::unfold(start, move |state| {
        step(state, timeout).instrument(span.clone())
    })
    .boxed()
}

type Step<'a, D> = Option<(Result<StreamEvent, ModelError>, State<'a, D>)>;

async fn step<D: SseDecoder>(mut state: State<'_, D>, timeout: Duration) -> Step<'_, D> {
    loop {
        state = match state {
            State::Finished => return None,
            State::Draining(mut pending) => {
                let event = pending.pop_front()?;
                return Some((Ok(event), State::Draining(pending)));
            }
            State::Connecting(connect, decoder) => match connect.await {
                Ok(response) => State::Reading {
                    events: response.bytes_stream().eventsource().boxed(),
                    decoder,
                    pending: VecDeque::new(),
                },
                Err(error) => return fail(error),
            },
            State::Reading {
                mut events,
                mut decoder,
                mut pending,
            } => {
                if let Some(event) = pending.pop_front() {
                    return Some((
                        Ok(event),
                        State::Reading {
                            events,
                            decoder,
                            pending,
                        },
                    ));
                }
                let done = match events.next().await {
                    Some(Ok(event)) => match decoder.on_event(&event, &mut pending) {
                        Ok(done) => done,
                        Err(error) => return fail(error),
                    },
                    Some(Err(error)) => return fail(sse_error(error, timeout)),
                    None => match decoder.on_end() {
                        Ok(response) => Some(response),
                        Err(error) => return fail(error),
                    },
                };
                match done {
                    Some(response) => {
                        log_done(&response);
                        pending.push_back(StreamEvent::Done(response));
                        State::Draining(pending)
                    }
                    None => State::Reading {
                        events,
                        decoder,
                        pending,
                    },
                }
            }
        };
    }
}

fn fail<'a, D>(error: ModelError) -> Step<'a, D> {
    tracing::warn!(%error, "model stream failed");
    Some((Err(error), State::Finished))
}

/// Records the outcome of a call on its span.
pub(crate) fn log_done(response: &ModelResponse) {
    tracing::debug!(
        stop_reason = ?response.stop_reason,
        input_tokens = response.usage.input_tokens,
        output_tokens = response.usage.output_tokens,
        "model call done"
    );
}

fn sse_error(error: EventStreamError<reqwest::Error>, timeout: Duration) -> ModelError {
    match error {
        EventStreamError::Transport(error) => transport_error(error, timeout),
        EventStreamError::Utf8(error) => {
            ModelError::InvalidResponse(format!("the event stream is not utf-8: {error}"))
        }
        EventStreamError::Parser(error) => {
            ModelError::InvalidResponse(format!("malformed event stream: {error}"))
        }
    }
}

/// Parses one event's JSON data, naming the event in the error.
pub(crate) fn parse_data<T: serde::de::DeserializeOwned>(event: &Event) -> Result<T, ModelError> {
    serde_json::from_str(&event.data).map_err(|error| {
        ModelError::InvalidResponse(format!(
            "cannot parse stream event {:?}: {error}",
            event.event
        ))
    })
}
