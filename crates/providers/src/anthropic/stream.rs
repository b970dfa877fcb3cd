//! Decoding of the Messages API's event stream: `message_start`,
//! `content_block_start/delta/stop`, `message_delta`, `message_stop`, `ping`
//! and `error`.
//!
//! Content indexes in the emitted [`StreamEvent`]s are positions in the final
//! [`ModelResponse::content`]; they differ from the API's indexes only when a
//! block is dropped (redacted thinking).
//!
//! Server tool blocks emit no events of their own (a `ToolCallStart` would
//! announce a call the caller must run): a `server_tool_use` collects its
//! `input_json_delta` fragments like a client call, a `*_tool_result` arrives
//! whole in its `content_block_start`, and both are items of the final
//! response.

use std::collections::{HashMap, VecDeque};

use markov_core::{Item, ModelError, ModelResponse, StreamEvent, Usage};
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny};
use serde_json::Value;

use super::wire::{self, Converted, KnownBlock, WireUsage};
use crate::convert;
use crate::sse::{Event, SseDecoder, parse_data};
use markov_core::tagged::{self, Tagged};

/// One event of the stream. Read in one pass (see [`markov_core::tagged`]): the
/// text and argument fragments are most of a stream's events.
enum WireEvent {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: usize,
        content_block: Value,
    },
    ContentBlockDelta {
        index: usize,
        delta: Delta,
    },
    ContentBlockStop {
        index: usize,
    },
    MessageDelta {
        delta: MessageDelta,
        usage: Option<WireUsage>,
    },
    MessageStop,
    Ping,
    Error {
        error: ErrorBody,
    },
    Unknown,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum EventType {
    MessageStart,
    ContentBlockStart,
    ContentBlockDelta,
    ContentBlockStop,
    MessageDelta,
    MessageStop,
    Ping,
    Error,
    #[serde(other)]
    Unknown,
}

#[derive(Deserialize)]
struct MessageStartFields {
    message: StartMessage,
}

#[derive(Deserialize)]
struct BlockStartFields {
    index: usize,
    content_block: Value,
}

#[derive(Deserialize)]
struct BlockDeltaFields {
    index: usize,
    delta: Delta,
}

#[derive(Deserialize)]
struct BlockStopFields {
    index: usize,
}

#[derive(Deserialize)]
struct MessageDeltaFields {
    delta: MessageDelta,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    context_management: Option<super::wire::AppliedEdits>,
}

#[derive(Deserialize)]
struct ErrorFields {
    error: ErrorBody,
}

impl Tagged for WireEvent {
    type Tag = EventType;

    fn from_fields<'de, D: Deserializer<'de>>(tag: EventType, fields: D) -> Result<Self, D::Error> {
        Ok(match tag {
            EventType::MessageStart => WireEvent::MessageStart {
                message: MessageStartFields::deserialize(fields)?.message,
            },
            EventType::ContentBlockStart => {
                let f = BlockStartFields::deserialize(fields)?;
                WireEvent::ContentBlockStart {
                    index: f.index,
                    content_block: f.content_block,
                }
            }
            EventType::ContentBlockDelta => {
                let f = BlockDeltaFields::deserialize(fields)?;
                WireEvent::ContentBlockDelta {
                    index: f.index,
                    delta: f.delta,
                }
            }
            EventType::ContentBlockStop => WireEvent::ContentBlockStop {
                index: BlockStopFields::deserialize(fields)?.index,
            },
            EventType::MessageDelta => {
                let f = MessageDeltaFields::deserialize(fields)?;
                if let Some(edits) = &f.context_management {
                    edits.record();
                }
                WireEvent::MessageDelta {
                    delta: f.delta,
                    usage: f.usage,
                }
            }
            EventType::Error => WireEvent::Error {
                error: ErrorFields::deserialize(fields)?.error,
            },
            tag => {
                IgnoredAny::deserialize(fields)?;
                match tag {
                    EventType::MessageStop => WireEvent::MessageStop,
                    EventType::Ping => WireEvent::Ping,
                    _ => WireEvent::Unknown,
                }
            }
        })
    }
}

impl<'de> Deserialize<'de> for WireEvent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        tagged::deserialize(deserializer)
    }
}

#[derive(Deserialize)]
struct StartMessage {
    #[serde(default)]
    usage: WireUsage,
    #[serde(default)]
    model: Option<String>,
}

/// A content block's delta (read in one pass, as the event).
enum Delta {
    Text { text: String },
    InputJson { partial_json: String },
    Thinking { thinking: String },
    Signature { signature: String },
    Unknown,
}

#[derive(Deserialize)]
enum DeltaType {
    #[serde(rename = "text_delta")]
    Text,
    #[serde(rename = "input_json_delta")]
    InputJson,
    #[serde(rename = "thinking_delta")]
    Thinking,
    #[serde(rename = "signature_delta")]
    Signature,
    #[serde(other)]
    Unknown,
}

#[derive(Deserialize)]
struct TextFields {
    text: String,
}

#[derive(Deserialize)]
struct InputJsonFields {
    partial_json: String,
}

#[derive(Deserialize)]
struct ThinkingFields {
    thinking: String,
}

#[derive(Deserialize)]
struct SignatureFields {
    signature: String,
}

impl Tagged for Delta {
    type Tag = DeltaType;

    fn from_fields<'de, D: Deserializer<'de>>(tag: DeltaType, fields: D) -> Result<Self, D::Error> {
        Ok(match tag {
            DeltaType::Text => Delta::Text {
                text: TextFields::deserialize(fields)?.text,
            },
            DeltaType::InputJson => Delta::InputJson {
                partial_json: InputJsonFields::deserialize(fields)?.partial_json,
            },
            DeltaType::Thinking => Delta::Thinking {
                thinking: ThinkingFields::deserialize(fields)?.thinking,
            },
            DeltaType::Signature => Delta::Signature {
                signature: SignatureFields::deserialize(fields)?.signature,
            },
            DeltaType::Unknown => {
                IgnoredAny::deserialize(fields)?;
                Delta::Unknown
            }
        })
    }
}

impl<'de> Deserialize<'de> for Delta {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        tagged::deserialize(deserializer)
    }
}

#[derive(Deserialize)]
struct MessageDelta {
    #[serde(default)]
    stop_reason: Option<String>,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default)]
    message: String,
}

/// One content block being assembled.
enum Slot {
    Text(String),
    Tool {
        id: String,
        name: String,
        json: String,
        input: Option<Value>,
    },
    Thinking {
        thinking: String,
        signature: Option<String>,
    },
    ServerTool {
        id: String,
        name: String,
        json: String,
        input: Option<Value>,
    },
    /// A complete block: a server tool's result.
    Done(Item),
    Other(Value),
}

/// The answer assembled so far.
#[derive(Default)]
pub(crate) struct Decoder {
    slots: Vec<Slot>,
    /// The API's block index → position in `slots`.
    positions: HashMap<usize, usize>,
    stop_reason: Option<String>,
    usage: Usage,
    /// The model `message_start` named.
    model: Option<String>,
    started: bool,
}

impl Decoder {
    fn slot(&mut self, index: usize) -> Option<(usize, &mut Slot)> {
        let position = *self.positions.get(&index)?;
        self.slots.get_mut(position).map(|slot| (position, slot))
    }

    fn start_block(
        &mut self,
        index: usize,
        block: Value,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<(), ModelError> {
        let position = self.slots.len();
        let slot = match wire::classify(block)? {
            Converted::Known(KnownBlock::Text { text }) => {
                if !text.is_empty() {
                    out.push_back(StreamEvent::TextDelta {
                        index: position,
                        text: text.clone(),
                    });
                }
                Slot::Text(text)
            }
            Converted::Known(KnownBlock::ToolUse { id, name, input }) => {
                out.push_back(StreamEvent::ToolCallStart {
                    index: position,
                    id: id.as_str().into(),
                    name: name.clone(),
                });
                // The start block carries `input: {}`; the arguments follow
                // as `input_json_delta` fragments.
                let given = wire::tool_input(input);
                let input = match &given {
                    Value::Object(map) if map.is_empty() => None,
                    _ => Some(given),
                };
                Slot::Tool {
                    id,
                    name,
                    json: String::new(),
                    input,
                }
            }
            Converted::Known(KnownBlock::Thinking {
                thinking,
                signature,
            }) => {
                if !thinking.is_empty() {
                    out.push_back(StreamEvent::ThinkingDelta {
                        index: position,
                        thinking: thinking.clone(),
                    });
                }
                Slot::Thinking {
                    thinking,
                    signature: signature.filter(|s| !s.is_empty()),
                }
            }
            Converted::Known(KnownBlock::RedactedThinking {}) => return Ok(()),
            Converted::Known(KnownBlock::ServerToolUse { id, name, input }) => {
                let given = wire::tool_input(input);
                let input = match &given {
                    Value::Object(map) if map.is_empty() => None,
                    _ => Some(given),
                };
                Slot::ServerTool {
                    id,
                    name,
                    json: String::new(),
                    input,
                }
            }
            converted @ Converted::ServerToolResult { .. } => match wire::item(converted) {
                Some(item) => Slot::Done(item),
                None => return Ok(()),
            },
            Converted::Unknown(block) => Slot::Other(block),
        };
        self.positions.insert(index, position);
        self.slots.push(slot);
        Ok(())
    }

    fn delta(
        &mut self,
        index: usize,
        delta: Delta,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<(), ModelError> {
        let Some((position, slot)) = self.slot(index) else {
            // A delta of a dropped block (redacted thinking) or of an unknown index.
            return Ok(());
        };
        match (slot, delta) {
            (_, Delta::Text { text: more }) if more.is_empty() => {}
            (_, Delta::InputJson { partial_json }) if partial_json.is_empty() => {}
            (_, Delta::Thinking { thinking }) if thinking.is_empty() => {}
            (Slot::Text(text), Delta::Text { text: more }) => {
                text.push_str(&more);
                out.push_back(StreamEvent::TextDelta {
                    index: position,
                    text: more,
                });
            }
            (Slot::Tool { json, .. }, Delta::InputJson { partial_json }) => {
                json.push_str(&partial_json);
                out.push_back(StreamEvent::ToolCallDelta {
                    index: position,
                    partial_json,
                });
            }
            (Slot::ServerTool { json, .. }, Delta::InputJson { partial_json }) => {
                json.push_str(&partial_json);
            }
            (Slot::Thinking { thinking, .. }, Delta::Thinking { thinking: more }) => {
                thinking.push_str(&more);
                out.push_back(StreamEvent::ThinkingDelta {
                    index: position,
                    thinking: more,
                });
            }
            (Slot::Thinking { signature, .. }, Delta::Signature { signature: more }) => {
                signature.get_or_insert_with(String::new).push_str(&more);
            }
            (Slot::Other(_) | Slot::Done(_), _) | (_, Delta::Unknown) => {}
            (_, _) => {
                return Err(ModelError::InvalidResponse(format!(
                    "a delta does not match content block {index}"
                )));
            }
        }
        Ok(())
    }

    fn stop_block(&mut self, index: usize) {
        if let Some((_, Slot::Tool { json, input, .. } | Slot::ServerTool { json, input, .. })) =
            self.slot(index)
            && !json.is_empty()
        {
            *input = Some(convert::parse_tool_arguments(json));
        }
    }

    fn response(&mut self) -> ModelResponse {
        let content: Vec<Item> = std::mem::take(&mut self.slots)
            .into_iter()
            .map(|slot| match slot {
                Slot::Text(text) => Item::Text { text },
                Slot::Tool {
                    id,
                    name,
                    json,
                    input,
                } => {
                    // A block never stopped still has its arguments unparsed.
                    let input = input.unwrap_or_else(|| convert::parse_tool_arguments(&json));
                    Item::tool_use(id, name, input)
                }
                Slot::Thinking {
                    thinking,
                    signature,
                } => Item::Thinking {
                    thinking,
                    signature,
                },
                Slot::ServerTool {
                    id,
                    name,
                    json,
                    input,
                } => {
                    let input = input.unwrap_or_else(|| convert::parse_tool_arguments(&json));
                    Item::provider_tool_use(id, name, input)
                }
                Slot::Done(item) => item,
                Slot::Other(block) => Item::text(block.to_string()),
            })
            .collect();
        let has_tool_calls = content.iter().any(|i| matches!(i, Item::ToolUse { .. }));
        let mut response = ModelResponse::new(
            content,
            wire::stop_reason(self.stop_reason.as_deref(), has_tool_calls),
        )
        .with_usage(self.usage);
        response.model = self.model.take();
        response
    }
}

impl SseDecoder for Decoder {
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Option<ModelResponse>, ModelError> {
        if event.data.is_empty() {
            return Ok(None);
        }
        match parse_data::<WireEvent>(event)? {
            WireEvent::MessageStart { message } => {
                self.started = true;
                message.usage.apply_to(&mut self.usage);
                self.model = convert::model_name(message.model);
            }
            WireEvent::ContentBlockStart {
                index,
                content_block,
            } => self.start_block(index, content_block, out)?,
            WireEvent::ContentBlockDelta { index, delta } => self.delta(index, delta, out)?,
            WireEvent::ContentBlockStop { index } => self.stop_block(index),
            WireEvent::MessageDelta { delta, usage } => {
                if delta.stop_reason.is_some() {
                    self.stop_reason = delta.stop_reason;
                }
                if let Some(usage) = usage {
                    usage.apply_to(&mut self.usage);
                }
            }
            WireEvent::MessageStop => return Ok(Some(self.response())),
            WireEvent::Ping | WireEvent::Unknown => {}
            WireEvent::Error { error } => {
                let message = if error.message.is_empty() {
                    error.kind.clone()
                } else {
                    error.message
                };
                return Err(match error.kind.as_str() {
                    "overloaded_error" => ModelError::Overloaded(message),
                    "rate_limit_error" => http(429, message),
                    "api_error" => http(500, message),
                    "timeout_error" => http(504, message),
                    kind => ModelError::InvalidResponse(format!("stream error {kind}: {message}")),
                });
            }
        }
        Ok(None)
    }

    fn on_end(&mut self) -> Result<ModelResponse, ModelError> {
        Err(ModelError::InvalidResponse(if self.started {
            "the stream ended before message_stop".into()
        } else {
            "the stream ended before message_start".into()
        }))
    }
}

fn http(status: u16, message: String) -> ModelError {
    ModelError::Http {
        status,
        message,
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(json: &str) -> Result<WireEvent, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn events_read_with_type_first_or_later() {
        for json in [
            r#"{"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"hi"}}"#,
            r#"{"index":2,"delta":{"text":"hi","type":"text_delta"},"type":"content_block_delta"}"#,
            r#"{"type":"content_block_delta","extra":[1,{"a":null}],"index":2,"delta":{"type":"text_delta","text":"hi","more":1}}"#,
        ] {
            let Ok(WireEvent::ContentBlockDelta {
                index: 2,
                delta: Delta::Text { text },
            }) = event(json)
            else {
                panic!("{json}");
            };
            assert_eq!(text, "hi");
        }
    }

    #[test]
    fn unknown_events_and_deltas_are_skipped_whatever_they_hold() {
        assert!(matches!(
            event(r#"{"type":"future_event","delta":5,"index":"x"}"#),
            Ok(WireEvent::Unknown)
        ));
        assert!(matches!(
            event(
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"citations_delta","citation":{"a":[1]}}}"#
            ),
            Ok(WireEvent::ContentBlockDelta {
                delta: Delta::Unknown,
                ..
            })
        ));
        assert!(matches!(event(r#"{"type":"ping"}"#), Ok(WireEvent::Ping)));
        assert!(matches!(
            event(
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#
            ),
            Ok(WireEvent::MessageDelta { .. })
        ));
    }

    #[test]
    fn malformed_events_are_errors() {
        for json in [
            r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"hi"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":3}}"#,
            r#"{"index":0}"#,
            r#"{}"#,
            r#"[1]"#,
            r#"{"type":7}"#,
        ] {
            assert!(event(json).is_err(), "{json}");
        }
    }
}
