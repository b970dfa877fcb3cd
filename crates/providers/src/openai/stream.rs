//! Decoding of streamed Chat Completions: `data:` chunks with deltas, tool
//! calls accumulated per index with their argument strings concatenated,
//! usage from the last chunk (`stream_options.include_usage`), and `[DONE]`.
//!
//! Content indexes in the emitted [`StreamEvent`]s are positions in the final
//! [`ModelResponse::content`], given in order of first appearance: reasoning,
//! text and each tool call get theirs when their first delta arrives.

use std::collections::{HashMap, VecDeque};

use markov_core::{Item, ModelError, ModelResponse, StreamEvent};
use serde::Deserialize;

use super::wire::{self, WireUsage};
use crate::convert;
use crate::sse::{Event, SseDecoder, parse_data};
use crate::transport::parse_error_body;

/// One chunk, read in one pass into typed fields; the fields not named here
/// (`id`, `model`, `logprobs`, ...) are skipped unread.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: Option<ChunkDelta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ChunkDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: Option<usize>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

enum Slot {
    Thinking(String),
    Text(String),
    Tool {
        id: Option<String>,
        name: String,
        arguments: String,
        /// Whether `ToolCallStart` was emitted (it waits for the name).
        started: bool,
    },
}

/// The answer assembled so far.
#[derive(Default)]
pub(crate) struct Decoder {
    slots: Vec<Slot>,
    thinking: Option<usize>,
    text: Option<usize>,
    /// The API's tool call index → position in `slots`.
    calls: HashMap<usize, usize>,
    refused: bool,
    finish_reason: Option<String>,
    usage: Option<WireUsage>,
    /// The model the chunks named (each names it; the first is kept).
    model: Option<String>,
}

impl Decoder {
    fn push_text(&mut self, thinking: bool, more: String, out: &mut VecDeque<StreamEvent>) {
        if more.is_empty() {
            return;
        }
        let existing = if thinking { self.thinking } else { self.text };
        let index = match existing {
            Some(index) => index,
            None => {
                let index = self.slots.len();
                self.slots.push(if thinking {
                    Slot::Thinking(String::new())
                } else {
                    Slot::Text(String::new())
                });
                if thinking {
                    self.thinking = Some(index);
                } else {
                    self.text = Some(index);
                }
                index
            }
        };
        if let Some(Slot::Thinking(text) | Slot::Text(text)) = self.slots.get_mut(index) {
            text.push_str(&more);
        }
        out.push_back(if thinking {
            StreamEvent::ThinkingDelta {
                index,
                thinking: more,
            }
        } else {
            StreamEvent::TextDelta { index, text: more }
        });
    }

    fn tool_delta(&mut self, delta: ToolCallDelta, order: usize, out: &mut VecDeque<StreamEvent>) {
        let key = delta.index.unwrap_or(order);
        let index = *self.calls.entry(key).or_insert_with(|| {
            self.slots.push(Slot::Tool {
                id: None,
                name: String::new(),
                arguments: String::new(),
                started: false,
            });
            self.slots.len() - 1
        });
        let Some(Slot::Tool {
            id,
            name,
            arguments,
            started,
        }) = self.slots.get_mut(index)
        else {
            return;
        };
        if let Some(new_id) = delta.id.filter(|i| !i.is_empty()) {
            id.get_or_insert(new_id);
        }
        let (new_name, fragment) = match delta.function {
            Some(function) => (function.name, function.arguments.unwrap_or_default()),
            None => (None, String::new()),
        };
        if let Some(new_name) = new_name.filter(|n| !n.is_empty())
            && !*started
        {
            name.push_str(&new_name);
        }
        arguments.push_str(&fragment);
        if !*started && !name.is_empty() {
            *started = true;
            out.push_back(StreamEvent::ToolCallStart {
                index,
                id: id
                    .get_or_insert_with(|| wire::fallback_call_id(key))
                    .as_str()
                    .into(),
                name: name.clone(),
            });
            // Arguments that came before the name are sent now, in one piece.
            if !arguments.is_empty() {
                out.push_back(StreamEvent::ToolCallDelta {
                    index,
                    partial_json: arguments.clone(),
                });
            }
        } else if *started && !fragment.is_empty() {
            out.push_back(StreamEvent::ToolCallDelta {
                index,
                partial_json: fragment,
            });
        }
    }

    fn response(&mut self) -> ModelResponse {
        let mut has_tool_calls = false;
        let content = std::mem::take(&mut self.slots)
            .into_iter()
            .enumerate()
            .map(|(position, slot)| match slot {
                Slot::Thinking(thinking) => Item::Thinking {
                    thinking,
                    signature: None,
                },
                Slot::Text(text) => Item::Text { text },
                Slot::Tool {
                    id,
                    name,
                    arguments,
                    ..
                } => {
                    has_tool_calls = true;
                    let id = id.unwrap_or_else(|| wire::fallback_call_id(position));
                    Item::tool_use(id, name, convert::parse_tool_arguments(&arguments))
                }
            })
            .collect();
        let mut response = ModelResponse::new(
            content,
            wire::stop_reason(self.finish_reason.as_deref(), has_tool_calls, self.refused),
        )
        .with_usage(self.usage.map(WireUsage::usage).unwrap_or_default());
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
        let data = event.data.trim();
        if data.is_empty() {
            return Ok(None);
        }
        if data == "[DONE]" {
            return Ok(Some(self.response()));
        }
        let chunk: Chunk = parse_data(event)?;
        if let Some(error) = chunk.error {
            let message = parse_error_body(&serde_json::json!({ "error": error }).to_string())
                .map(|(_, message)| message)
                .unwrap_or_else(|| error.to_string());
            return Err(ModelError::Http {
                status: 500,
                message,
                retry_after: None,
            });
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage);
        }
        if self.model.is_none() {
            self.model = convert::model_name(chunk.model);
        }
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(delta) = choice.delta {
                if let Some(thinking) = delta.reasoning_content {
                    self.push_text(true, thinking, out);
                }
                if let Some(text) = delta.content {
                    self.push_text(false, text, out);
                }
                if let Some(refusal) = delta.refusal.filter(|r| !r.is_empty()) {
                    self.refused = true;
                    self.push_text(false, refusal, out);
                }
                for (order, call) in delta.tool_calls.unwrap_or_default().into_iter().enumerate() {
                    self.tool_delta(call, order, out);
                }
            }
            if choice.finish_reason.is_some() {
                self.finish_reason = choice.finish_reason;
            }
        }
        Ok(None)
    }

    fn on_end(&mut self) -> Result<ModelResponse, ModelError> {
        // Some servers close the stream without `[DONE]`; a finish reason
        // says the answer is whole.
        if self.finish_reason.is_some() {
            Ok(self.response())
        } else {
            Err(ModelError::InvalidResponse(
                "the stream ended before a finish reason or [DONE]".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use markov_core::StopReason;

    use super::*;
    use crate::sse::decode_body;

    fn decode(chunks: &[&str]) -> Result<ModelResponse, ModelError> {
        let body: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
        let events = decode_body(Decoder::default(), body.as_bytes(), usize::MAX)?;
        match events.into_iter().last() {
            Some(StreamEvent::Done(response)) => Ok(response),
            _ => Err(ModelError::InvalidResponse("no response".into())),
        }
    }

    #[test]
    fn only_choices_of_index_zero_are_read_in_any_number() {
        let answer = decode(&[
            r#"{"id":"x","choices":[{"index":1,"delta":{"content":"other"}},{"delta":{"content":"a"},"index":0,"extra":{"deep":[1]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"b"}},{"index":0,"delta":{"content":"c"}}],"unknown":null}"#,
            r#"{"choices":[]}"#,
            r#"{"object":"chat.completion.chunk"}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            "[DONE]",
        ])
        .unwrap();
        assert_eq!(answer.content, vec![Item::text("abc")]);
        assert_eq!(answer.stop_reason, StopReason::EndTurn);
    }

    #[test]
    fn malformed_chunks_are_typed_errors() {
        for chunk in [
            r#"{"choices":{"index":0}}"#,
            r#"{"choices":null}"#,
            r#"{"choices":[{"index":"0"}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":1}}]}"#,
            r#"{"choices":[{"index":0}"#,
        ] {
            match decode(&[chunk, "[DONE]"]) {
                Err(ModelError::InvalidResponse(message)) => {
                    assert!(
                        message.starts_with("cannot parse stream event"),
                        "{message}"
                    )
                }
                other => panic!("{chunk}: {other:?}"),
            }
        }
    }
}
