//! Streaming vessels: how a streamed answer reaches the queue and
//! the application while the model is still writing it.
//!
//! With streaming configured ([`StandardExecutor::with_streaming`]), each
//! model call of a leaf gets a fresh `messageId` and a **vessel**: an
//! assistant message with empty items and `metadata.stream = {state:
//! "streaming", seq: 0}`, enqueued at once. Each text or thinking delta
//! raises `seq` and is reported as a [`MessageStreamEvent::Update`]; the
//! final answer (or the failure) is enqueued again under the same
//! `messageId`, so the queue replaces the vessel in place: step history
//! holds only the final version, while the queue's `on_enqueue` callback
//! sees every enqueued version.
//!
//! ```text
//! message_start (seq 0) → message_update (seq 1..=n) → message_end (seq n+1)
//!                                                    ↘ message_error (seq n+1)
//! ```
//!
//! [`VesselState`] is the protocol as a plain value: the executor feeds it
//! the model's [`StreamEvent`]s and enqueues or reports what it returns.
//!
//! [`StandardExecutor::with_streaming`]: crate::StandardExecutor::with_streaming

use std::fmt;
use std::sync::Arc;

use markov_core::MessageId;
use markov_core::message::{Item, Message, Metadata, Source, StreamInfo, StreamState};
use markov_core::model::StreamEvent;
use serde::Serialize;

/// What kind of text a delta adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DeltaKind {
    /// Answer text.
    Text,
    /// Reasoning text.
    Thinking,
}

/// Text added to one content item of a streamed message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamDelta {
    /// Text or thinking.
    pub kind: DeltaKind,
    /// The index of the content item in the model's answer.
    pub content_index: usize,
    /// The added text.
    pub delta: String,
}

/// Why a streamed message failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamFailure {
    /// The error's message.
    pub message: String,
}

/// One event of a streamed assistant message, as given to the
/// [`OnMessageStream`] callback. Serializes as upstream's events:
/// `{"type": "message_start", "messageId", "seq", "source", "message"}`, ….
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum MessageStreamEvent {
    /// The vessel was enqueued (`seq` 0).
    #[serde(rename = "message_start", rename_all = "camelCase")]
    Start {
        /// The stable id of the message.
        message_id: MessageId,
        /// The sequence number.
        seq: u64,
        /// The leaf that writes it.
        source: Source,
        /// The vessel.
        message: Message,
    },
    /// A text or thinking delta arrived.
    #[serde(rename = "message_update", rename_all = "camelCase")]
    Update {
        /// The stable id of the message.
        message_id: MessageId,
        /// The sequence number.
        seq: u64,
        /// The leaf that writes it.
        source: Source,
        /// What was added.
        delta: StreamDelta,
    },
    /// The final message replaced the vessel.
    #[serde(rename = "message_end", rename_all = "camelCase")]
    End {
        /// The stable id of the message.
        message_id: MessageId,
        /// The sequence number.
        seq: u64,
        /// The leaf that writes it.
        source: Source,
        /// The final message.
        message: Message,
    },
    /// The model call failed; the vessel was enqueued again in state `error`.
    #[serde(rename = "message_error", rename_all = "camelCase")]
    Error {
        /// The stable id of the message.
        message_id: MessageId,
        /// The sequence number.
        seq: u64,
        /// The leaf that writes it.
        source: Source,
        /// Why.
        error: StreamFailure,
    },
}

impl MessageStreamEvent {
    /// The id of the message this event is about.
    pub fn message_id(&self) -> &MessageId {
        match self {
            MessageStreamEvent::Start { message_id, .. }
            | MessageStreamEvent::Update { message_id, .. }
            | MessageStreamEvent::End { message_id, .. }
            | MessageStreamEvent::Error { message_id, .. } => message_id,
        }
    }

    /// The event's sequence number.
    pub fn seq(&self) -> u64 {
        match self {
            MessageStreamEvent::Start { seq, .. }
            | MessageStreamEvent::Update { seq, .. }
            | MessageStreamEvent::End { seq, .. }
            | MessageStreamEvent::Error { seq, .. } => *seq,
        }
    }

    /// The event's upstream name: `message_start`, `message_update`,
    /// `message_end` or `message_error`.
    pub fn kind(&self) -> &'static str {
        match self {
            MessageStreamEvent::Start { .. } => "message_start",
            MessageStreamEvent::Update { .. } => "message_update",
            MessageStreamEvent::End { .. } => "message_end",
            MessageStreamEvent::Error { .. } => "message_error",
        }
    }
}

/// The callback told of every [`MessageStreamEvent`]. It runs on the
/// executor's task, between two reads of the model's stream: keep it short.
pub type OnMessageStream = dyn Fn(&MessageStreamEvent) + Send + Sync;

/// Streaming settings of a [`StandardExecutor`](crate::StandardExecutor).
#[derive(Clone)]
pub struct StreamOptions {
    /// Told of every streaming event of every leaf.
    pub on_message_stream: Arc<OnMessageStream>,
}

impl StreamOptions {
    /// Options reporting to `callback`.
    pub fn new(callback: impl Fn(&MessageStreamEvent) + Send + Sync + 'static) -> Self {
        StreamOptions {
            on_message_stream: Arc::new(callback),
        }
    }
}

impl fmt::Debug for StreamOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamOptions").finish_non_exhaustive()
    }
}

/// A partial content item of the running snapshot.
#[derive(Debug, Clone, PartialEq)]
enum Partial {
    Text(String),
    Thinking(String),
}

/// One streamed message: its id, sequence number and running content.
///
/// Pure: it never enqueues and never awaits. The executor enqueues the
/// messages it returns (each carries the same `messageId`, so the queue
/// replaces in place) and reports the events.
#[derive(Debug, Clone, PartialEq)]
pub struct VesselState {
    message_id: MessageId,
    source: Source,
    seq: u64,
    state: StreamState,
    /// Text and thinking received so far, by content index.
    snapshot: Vec<(usize, Partial)>,
}

impl VesselState {
    /// A vessel for a new message of `source`, with a fresh uuid as `messageId`.
    pub fn new(source: Source) -> Self {
        Self::with_id(MessageId::new(uuid::Uuid::new_v4().to_string()), source)
    }

    /// A vessel with a given `messageId`.
    pub fn with_id(message_id: MessageId, source: Source) -> Self {
        VesselState {
            message_id,
            source,
            seq: 0,
            state: StreamState::Streaming,
            snapshot: Vec::new(),
        }
    }

    /// The message's id.
    pub fn message_id(&self) -> &MessageId {
        &self.message_id
    }

    /// The leaf that writes the message.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The current sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Where the stream is.
    pub fn state(&self) -> StreamState {
        self.state
    }

    fn metadata(&self) -> Metadata {
        Metadata {
            source: Some(self.source.clone()),
            message_id: Some(self.message_id.clone()),
            stream: Some(StreamInfo {
                state: self.state,
                seq: Some(self.seq),
            }),
            ..Metadata::default()
        }
    }

    /// The text and thinking received so far, in content order (thinking
    /// without a signature). Partial tool calls are left out: a call without
    /// its result must not reach history.
    pub fn snapshot(&self) -> Vec<Item> {
        let mut parts: Vec<&(usize, Partial)> = self.snapshot.iter().collect();
        parts.sort_by_key(|(index, _)| *index);
        parts
            .into_iter()
            .map(|(_, partial)| match partial {
                Partial::Text(text) => Item::text(text.clone()),
                Partial::Thinking(thinking) => Item::Thinking {
                    thinking: thinking.clone(),
                    signature: None,
                },
            })
            .collect()
    }

    /// The vessel to enqueue first (empty items, state `streaming`, seq 0)
    /// and its `message_start` event.
    pub fn start(&self) -> (Message, MessageStreamEvent) {
        let message = Message::assistant_items(Vec::new()).with_metadata(self.metadata());
        let event = MessageStreamEvent::Start {
            message_id: self.message_id.clone(),
            seq: self.seq,
            source: self.source.clone(),
            message: message.clone(),
        };
        (message, event)
    }

    /// Takes one model event into the running snapshot. A text or thinking
    /// delta raises `seq` and gives its `message_update`; other events give
    /// nothing.
    pub fn on_event(&mut self, event: &StreamEvent) -> Option<MessageStreamEvent> {
        let (index, kind, delta) = match event {
            StreamEvent::TextDelta { index, text } => (*index, DeltaKind::Text, text),
            StreamEvent::ThinkingDelta { index, thinking } => {
                (*index, DeltaKind::Thinking, thinking)
            }
            _ => return None,
        };
        match self.snapshot.iter_mut().find(|(i, _)| *i == index) {
            Some((_, Partial::Text(s) | Partial::Thinking(s))) => s.push_str(delta),
            None => self.snapshot.push((
                index,
                match kind {
                    DeltaKind::Text => Partial::Text(delta.clone()),
                    DeltaKind::Thinking => Partial::Thinking(delta.clone()),
                },
            )),
        }
        self.seq += 1;
        Some(MessageStreamEvent::Update {
            message_id: self.message_id.clone(),
            seq: self.seq,
            source: self.source.clone(),
            delta: StreamDelta {
                kind,
                content_index: index,
                delta: delta.clone(),
            },
        })
    }

    /// Completes the message: `seq` raised, state `complete`. Returns
    /// `message` (the final assistant message, converted) with the vessel's
    /// metadata, to enqueue in the vessel's place, and its `message_end`.
    pub fn complete(&mut self, message: Message) -> (Message, MessageStreamEvent) {
        self.seq += 1;
        self.state = StreamState::Complete;
        let mut metadata = message.metadata.clone().unwrap_or_default();
        let vessel = self.metadata();
        metadata.source = vessel.source;
        metadata.message_id = vessel.message_id;
        metadata.stream = vessel.stream;
        let message = message.with_metadata(metadata);
        let event = MessageStreamEvent::End {
            message_id: self.message_id.clone(),
            seq: self.seq,
            source: self.source.clone(),
            message: message.clone(),
        };
        (message, event)
    }

    /// Fails the message: `seq` raised, state `error`. Returns the vessel
    /// holding the snapshot so far, to enqueue again, and its `message_error`.
    pub fn fail(&mut self, error: impl Into<String>) -> (Message, MessageStreamEvent) {
        self.seq += 1;
        self.state = StreamState::Error;
        let message = Message::assistant_items(self.snapshot()).with_metadata(self.metadata());
        let event = MessageStreamEvent::Error {
            message_id: self.message_id.clone(),
            seq: self.seq,
            source: self.source.clone(),
            error: StreamFailure {
                message: error.into(),
            },
        };
        (message, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn source() -> Source {
        Source {
            instance_id: Some("leaf".into()),
            is_primary: Some(true),
            external: None,
        }
    }

    fn vessel() -> VesselState {
        VesselState::with_id("m1".into(), source())
    }

    #[test]
    fn the_vessel_is_empty_and_streaming_at_seq_zero() {
        let v = vessel();
        let (message, event) = v.start();
        assert_eq!(
            serde_json::to_value(&message).unwrap(),
            json!({"role": "assistant", "items": [], "metadata": {
                "source": {"instanceId": "leaf", "isPrimary": true},
                "messageId": "m1",
                "stream": {"state": "streaming", "seq": 0}
            }})
        );
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"type": "message_start", "messageId": "m1", "seq": 0,
                   "source": {"instanceId": "leaf", "isPrimary": true},
                   "message": serde_json::to_value(&message).unwrap()})
        );
    }

    #[test]
    fn deltas_raise_seq_and_build_the_snapshot() {
        let mut v = vessel();
        let e1 = v
            .on_event(&StreamEvent::ThinkingDelta {
                index: 0,
                thinking: "hmm".into(),
            })
            .unwrap();
        let e2 = v
            .on_event(&StreamEvent::TextDelta {
                index: 1,
                text: "Hel".into(),
            })
            .unwrap();
        let e3 = v
            .on_event(&StreamEvent::TextDelta {
                index: 1,
                text: "lo".into(),
            })
            .unwrap();
        assert!(
            v.on_event(&StreamEvent::ToolCallStart {
                index: 2,
                id: "c".into(),
                name: "add".into(),
            })
            .is_none()
        );
        assert_eq!((e1.seq(), e2.seq(), e3.seq()), (1, 2, 3));
        assert_eq!(
            serde_json::to_value(&e3).unwrap(),
            json!({"type": "message_update", "messageId": "m1", "seq": 3,
                   "source": {"instanceId": "leaf", "isPrimary": true},
                   "delta": {"kind": "text", "contentIndex": 1, "delta": "lo"}})
        );
        assert_eq!(
            v.snapshot(),
            vec![
                Item::Thinking {
                    thinking: "hmm".into(),
                    signature: None
                },
                Item::text("Hello")
            ]
        );
    }

    #[test]
    fn completion_replaces_the_content_and_keeps_the_id() {
        let mut v = vessel();
        v.on_event(&StreamEvent::TextDelta {
            index: 0,
            text: "Hi".into(),
        });
        let final_message = Message::assistant("Hi").with_metadata(Metadata::with_source(source()));
        let (message, event) = v.complete(final_message);
        assert_eq!(v.state(), StreamState::Complete);
        assert_eq!(event.seq(), 2);
        assert_eq!(event.kind(), "message_end");
        let meta = message.metadata.as_ref().unwrap();
        assert_eq!(meta.message_id, Some("m1".into()));
        assert_eq!(
            meta.stream,
            Some(StreamInfo {
                state: StreamState::Complete,
                seq: Some(2)
            })
        );
        assert_eq!(message.text(), "Hi");
    }

    #[test]
    fn failure_keeps_the_partial_text() {
        let mut v = vessel();
        v.on_event(&StreamEvent::TextDelta {
            index: 0,
            text: "Hal".into(),
        });
        let (message, event) = v.fail("boom");
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"type": "message_error", "messageId": "m1", "seq": 2,
                   "source": {"instanceId": "leaf", "isPrimary": true},
                   "error": {"message": "boom"}})
        );
        assert_eq!(message.text(), "Hal");
        assert_eq!(
            message.metadata.clone().unwrap().stream,
            Some(StreamInfo {
                state: StreamState::Error,
                seq: Some(2)
            })
        );
    }

    #[test]
    fn fresh_vessels_get_distinct_ids() {
        assert_ne!(
            VesselState::new(source()).message_id(),
            VesselState::new(source()).message_id()
        );
    }
}
