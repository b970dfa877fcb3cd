//! The streaming driver both providers share: connect (with retries), read
//! server-sent events with the linear [`parser`], hand each event to the
//! provider's decoder, and end with [`StreamEvent::Done`].
//!
//! Retries cover the connection and the response head only: once events
//! have reached the caller, a failure ends the stream with its error (a
//! mid-stream `overloaded_error` is [`ModelError::Overloaded`], retryable by
//! the caller).

mod parser;

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{self, BoxStream, StreamExt};
use markov_core::{ModelError, ModelResponse, StreamEvent};
use reqwest::Response;
use tracing::Instrument;

pub(crate) use self::parser::Event;
use self::parser::{ParseError, Parser};
use crate::transport::{TransportConfig, naming_url, redact_url, transport_error};

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

/// An event stream being read.
struct Reader<D> {
    /// The response whose body is read.
    response: Response,
    parser: Parser,
    /// Events parsed but not yet decoded.
    events: VecDeque<Event>,
    /// Why the parser refused the body, once the events before are decoded.
    refused: Option<ParseError>,
    decoder: D,
    /// Stream events decoded but not yet delivered.
    pending: VecDeque<StreamEvent>,
}

impl<D> Reader<D> {
    /// Where the response came from, redacted, for an error: redacted only
    /// when one is named, since redacting parses the URL again.
    fn redacted_url(&self) -> String {
        redact_url(self.response.url().as_str())
    }
}

enum State<'a, D> {
    Connecting(BoxFuture<'a, Result<Response, ModelError>>, D),
    Reading(Box<Reader<D>>),
    Draining(VecDeque<StreamEvent>),
    Finished,
}

/// Streams one answer: `connect` yields a successful response whose body is
/// an event stream, `decoder` turns the events into [`StreamEvent`]s.
///
/// The whole call — connecting, retries and every event — is bounded by
/// `config.deadline`: a server that keeps the stream alive with pings
/// and never answers ends it with [`ModelError::Timeout`]. One event larger
/// than `config.max_event_bytes` ends it with
/// [`ModelError::InvalidResponse`]. Every other error of the body names the
/// response's URL, redacted.
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
        .checked_add(config.deadline)
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
    let late = || ModelError::Timeout(config.deadline);
    loop {
        state = match state {
            State::Finished => return None,
            State::Draining(mut pending) => {
                let event = pending.pop_front()?;
                return Some((Ok(event), State::Draining(pending)));
            }
            State::Connecting(connect, decoder) => {
                match tokio::time::timeout_at(deadline, connect).await {
                    Ok(Ok(response)) => State::Reading(Box::new(Reader {
                        response,
                        parser: Parser::new(config.max_event_bytes),
                        events: VecDeque::new(),
                        refused: None,
                        decoder,
                        pending: VecDeque::new(),
                    })),
                    Ok(Err(error)) => return fail(error),
                    Err(_) => return fail(late()),
                }
            }
            State::Reading(mut reader) => {
                if let Some(event) = reader.pending.pop_front() {
                    return Some((Ok(event), State::Reading(reader)));
                }
                let done = if let Some(event) = reader.events.pop_front() {
                    match reader.decoder.on_event(&event, &mut reader.pending) {
                        Ok(done) => done,
                        Err(error) => return fail(naming_url(error, &reader.redacted_url())),
                    }
                } else if let Some(refused) = reader.refused.take() {
                    return fail(ModelError::InvalidResponse(refused.to_string()));
                } else {
                    let Ok(chunk) =
                        tokio::time::timeout_at(deadline, reader.response.chunk()).await
                    else {
                        return fail(late());
                    };
                    match chunk {
                        Ok(Some(bytes)) => {
                            let Reader { parser, events, .. } = &mut *reader;
                            reader.refused = parser.feed(&bytes, events).err();
                            None
                        }
                        Ok(None) => match reader.decoder.on_end() {
                            Ok(response) => Some(response),
                            Err(error) => return fail(naming_url(error, &reader.redacted_url())),
                        },
                        Err(error) => {
                            let error = transport_error(error, config.timeout);
                            return fail(naming_url(error, &reader.redacted_url()));
                        }
                    }
                };
                match done {
                    Some(response) => {
                        log_done(&response);
                        let Reader {
                            response: body,
                            mut pending,
                            ..
                        } = *reader;
                        pending.push_back(StreamEvent::Done(response));
                        finish_body(body);
                        State::Draining(pending)
                    }
                    None => State::Reading(reader),
                }
            }
        };
    }
}

/// The most of a body read after its answer's last event.
const MAX_BODY_AFTER_ANSWER: usize = 64 * 1024;

/// How long the rest of a body is waited for after its answer's last event.
const BODY_AFTER_ANSWER_DEADLINE: Duration = Duration::from_secs(10);

/// Reads what is left of an event stream's body after the answer's last
/// event (the end of the body, and perhaps a trailing event), so that its
/// connection goes back to the client's pool: a body dropped unread closes
/// its connection, and the next call would pay a new one (a TLS handshake,
/// at a real provider). The end is usually there already; when it is not,
/// a task of its own waits for it, bounded in bytes and time, so the answer
/// is never held back.
fn finish_body(mut body: Response) {
    use futures::FutureExt;
    loop {
        match body.chunk().now_or_never() {
            // Ended (or broken, and then not reusable anyway).
            Some(Ok(None) | Err(_)) => return,
            Some(Ok(Some(_))) => {}
            None => break,
        }
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    tokio::spawn(async move {
        let rest = async {
            let mut read = 0;
            while let Ok(Some(bytes)) = body.chunk().await {
                read += bytes.len();
                if read > MAX_BODY_AFTER_ANSWER {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(BODY_AFTER_ANSWER_DEADLINE, rest).await;
    });
}

fn fail<'a, D>(error: ModelError) -> Step<'a, D> {
    tracing::warn!(%error, "model stream failed");
    Some((Err(error), State::Finished))
}

/// Decodes a complete event-stream body as a streamed call would: the
/// stream events, ending with [`StreamEvent::Done`].
pub(crate) fn decode_body<D: SseDecoder>(
    mut decoder: D,
    body: &[u8],
    max_event_bytes: usize,
) -> Result<Vec<StreamEvent>, ModelError> {
    let mut parser = Parser::new(max_event_bytes);
    let mut events = VecDeque::new();
    let refused = parser.feed(body, &mut events).err();
    let mut out = VecDeque::new();
    for event in events {
        if let Some(done) = decoder.on_event(&event, &mut out)? {
            out.push_back(StreamEvent::Done(done));
            return Ok(out.into());
        }
    }
    if let Some(refused) = refused {
        return Err(ModelError::InvalidResponse(refused.to_string()));
    }
    out.push_back(StreamEvent::Done(decoder.on_end()?));
    Ok(out.into())
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

/// Parses one event's JSON data, naming the event in the error.
pub(crate) fn parse_data<T: serde::de::DeserializeOwned>(event: &Event) -> Result<T, ModelError> {
    serde_json::from_str(&event.data).map_err(|error| {
        ModelError::InvalidResponse(format!(
            "cannot parse stream event {:?}: {error}",
            event.event
        ))
    })
}
