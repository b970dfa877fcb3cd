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

use crate::transport::{TransportConfig, transport_error};

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

type SseEvents = BoxStream<'static, Result<Event, EventStreamError<BodyError>>>;

/// Why the body of an event stream stopped.
#[derive(Debug)]
enum BodyError {
    /// The connection failed.
    Http(reqwest::Error),
    /// One event grew past the cap.
    EventTooLarge(usize),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Http(e) => e.fmt(f),
            BodyError::EventTooLarge(cap) => write!(f, "a server-sent event exceeded {cap} bytes"),
        }
    }
}

impl std::error::Error for BodyError {}

/// The body's chunks, refused once one event (the bytes since the last
/// blank line) passes `cap`: the parser buffers an event whole, so an
/// unbounded one would cost unbounded memory and time. The count is one
/// pass over each byte.
fn capped<S, B>(body: S, cap: usize) -> impl futures::Stream<Item = Result<B, BodyError>>
where
    S: futures::Stream<Item = Result<B, reqwest::Error>>,
    B: AsRef<[u8]>,
{
    let mut run = 0usize;
    let mut after_newline = false;
    body.map(move |chunk| {
        let chunk = chunk.map_err(BodyError::Http)?;
        for &byte in chunk.as_ref() {
            match byte {
                b'\n' if after_newline => run = 0,
                b'\n' => after_newline = true,
                b'\r' => {}
                _ => after_newline = false,
            }
            run += 1;
            if run > cap {
                return Err(BodyError::EventTooLarge(cap));
            }
        }
        Ok(chunk)
    })
}

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
///
/// The whole call — connecting, retries and every event — is bounded by
/// `config.stream_deadline`: a server that keeps the stream alive with pings
/// and never answers ends it with [`ModelError::Timeout`]. One event larger
/// than `config.max_event_bytes` ends it with
/// [`ModelError::InvalidResponse`].
pub(crate) fn sse_stream<'a, D, Fut>(
    span: tracing::Span,
    config: TransportConfig,
    connect: Fut,
    decoder: D,
) -> BoxStream<'a, Result<StreamEvent, ModelError>>
where
    D: SseDecoder + 'a,
    Fut: Future<Output = Result<Response, ModelError>> + Send + 'a,
{
    let now = tokio::time::Instant::now();
    // A deadline too far for the clock is no deadline (a year is plenty).
    let deadline = now
        .checked_add(config.stream_deadline)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600));
    let start = State::Connecting(Box::pin(connect), decoder);
    stream::unfold(start, move |state| {
        step(state, config, deadline).instrument(span.clone())
    })
    .boxed()
}

type Step<'a, D> = Option<(Result<StreamEvent, ModelError>, State<'a, D>)>;

async fn step<D: SseDecoder>(
    mut state: State<'_, D>,
    config: TransportConfig,
    deadline: tokio::time::Instant,
) -> Step<'_, D> {
    let timeout = config.timeout;
    let late = || ModelError::Timeout(config.stream_deadline);
    loop {
        state = match state {
            State::Finished => return None,
            State::Draining(mut pending) => {
                let event = pending.pop_front()?;
                return Some((Ok(event), State::Draining(pending)));
            }
            State::Connecting(connect, decoder) => {
                match tokio::time::timeout_at(deadline, connect).await {
                    Ok(Ok(response)) => State::Reading {
                        events: capped(response.bytes_stream(), config.max_event_bytes)
                            .eventsource()
                            .boxed(),
                        decoder,
                        pending: VecDeque::new(),
                    },
                    Ok(Err(error)) => return fail(error),
                    Err(_) => return fail(late()),
                }
            }
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
                let Ok(next) = tokio::time::timeout_at(deadline, events.next()).await else {
                    return fail(late());
                };
                let done = match next {
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

fn sse_error(error: EventStreamError<BodyError>, timeout: Duration) -> ModelError {
    match error {
        EventStreamError::Transport(BodyError::Http(error)) => transport_error(error, timeout),
        EventStreamError::Transport(too_large @ BodyError::EventTooLarge(_)) => {
            ModelError::InvalidResponse(too_large.to_string())
        }
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
