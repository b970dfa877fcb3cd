//! The answer assembled from `GenerateContentResponse` chunks: a streamed
//! call's (`streamGenerateContent?alt=sse`, one chunk per event, no end
//! marker) and a complete call's (one chunk).
//!
//! Adjacent text parts make one text item, adjacent thought parts one
//! thinking item; a call is whole in its part. A thought signature on a
//! part becomes a thinking item right after that part's item (see
//! [`super::wire`]). Content indexes in the emitted [`StreamEvent`]s are
//! positions in the final answer.

use std::collections::VecDeque;

use markov_core::{Item, ModelError, ModelResponse, StopReason, StreamEvent};

use super::wire::{self, ResponsePart, UsageMetadata, WireResponse};
use crate::convert;
use crate::sse::{Event, SseDecoder, parse_data};

/// The answer assembled so far.
#[derive(Default)]
pub(crate) struct Decoder {
    items: Vec<Item>,
    /// Whether the last item may still grow (text or thought text).
    open: bool,
    finish_reason: Option<String>,
    blocked: bool,
    usage: Option<UsageMetadata>,
    /// The `modelVersion` the chunks named (each names it; the first is kept).
    model: Option<String>,
}

impl Decoder {
    /// Takes one chunk.
    pub(super) fn chunk(
        &mut self,
        chunk: WireResponse,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<(), ModelError> {
        if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
            return Err(wire::error_of(&error));
        }
        if let Some(usage) = chunk.usage_metadata {
            self.usage = Some(usage);
        }
        if self.model.is_none() {
            self.model = convert::model_name(chunk.model_version);
        }
        if chunk
            .prompt_feedback
            .is_some_and(|f| f.block_reason.is_some())
        {
            self.blocked = true;
        }
        if let Some(candidate) = chunk.candidates.into_iter().next() {
            for part in candidate.content.map(|c| c.parts).unwrap_or_default() {
                self.part(part, out);
            }
            if candidate.finish_reason.is_some() {
                self.finish_reason = candidate.finish_reason;
            }
        }
        Ok(())
    }

    fn part(&mut self, part: ResponsePart, out: &mut VecDeque<StreamEvent>) {
        let signature = part.thought_signature.filter(|s| !s.is_empty());
        if let Some(call) = part.function_call {
            let index = self.items.len();
            let id = call
                .id
                .filter(|id| !id.is_empty())
                .unwrap_or_else(|| wire::made_call_id(index));
            let args = match call.args {
                Some(args @ serde_json::Value::Object(_)) => args,
                _ => serde_json::json!({}),
            };
            out.push_back(StreamEvent::ToolCallStart {
                index,
                id: id.as_str().into(),
                name: call.name.clone(),
            });
            out.push_back(StreamEvent::ToolCallDelta {
                index,
                partial_json: args.to_string(),
            });
            self.items.push(Item::tool_use(id, call.name, args));
            self.open = false;
            self.sign(signature, wire::ATTACHED);
            return;
        }
        let text = part.text.unwrap_or_default();
        let thought = part.thought == Some(true);
        if text.is_empty() {
            // A part that only carries a signature.
            self.sign(signature, wire::STANDALONE);
            return;
        }
        let grows = self.open
            && match self.items.last() {
                Some(Item::Thinking {
                    signature: None, ..
                }) => thought,
                Some(Item::Text { .. }) => !thought,
                _ => false,
            };
        if !grows {
            self.items.push(if thought {
                Item::Thinking {
                    thinking: String::new(),
                    signature: None,
                }
            } else {
                Item::text("")
            });
        }
        let index = self.items.len() - 1;
        match self.items.last_mut() {
            Some(Item::Thinking { thinking, .. }) => thinking.push_str(&text),
            Some(Item::Text { text: whole }) => whole.push_str(&text),
            _ => {}
        }
        out.push_back(if thought {
            StreamEvent::ThinkingDelta {
                index,
                thinking: text,
            }
        } else {
            StreamEvent::TextDelta { index, text }
        });
        self.open = true;
        if let Some(signature) = signature {
            if thought {
                // A thought part's signature is its own.
                if let Some(Item::Thinking { signature: own, .. }) = self.items.last_mut() {
                    *own = Some(format!("{}{signature}", wire::ATTACHED));
                }
                self.open = false;
            } else {
                self.sign(Some(signature), wire::ATTACHED);
            }
        }
    }

    /// Records `signature` as a thinking item after the last item.
    fn sign(&mut self, signature: Option<String>, prefix: &str) {
        if let Some(signature) = signature {
            self.items.push(Item::Thinking {
                thinking: String::new(),
                signature: Some(format!("{prefix}{signature}")),
            });
            self.open = false;
        }
    }

    /// The whole answer.
    pub(super) fn response(&mut self) -> Result<ModelResponse, ModelError> {
        let content = std::mem::take(&mut self.items);
        let has_tool_calls = content.iter().any(|i| matches!(i, Item::ToolUse { .. }));
        let stop_reason = match self.finish_reason.as_deref() {
            _ if self.blocked && content.is_empty() => StopReason::ContentFilter,
            Some("MAX_TOKENS") => StopReason::MaxTokens,
            Some(
                "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII"
                | "IMAGE_SAFETY" | "LANGUAGE",
            ) => StopReason::ContentFilter,
            Some("MALFORMED_FUNCTION_CALL" | "UNEXPECTED_TOOL_CALL") => {
                return Err(ModelError::InvalidResponse(format!(
                    "the model's function call could not be read ({})",
                    self.finish_reason.as_deref().unwrap_or_default()
                )));
            }
            _ => convert::implied_stop_reason(has_tool_calls),
        };
        let mut response = ModelResponse::new(content, stop_reason)
            .with_usage(self.usage.map(UsageMetadata::usage).unwrap_or_default());
        response.model = self.model.take();
        Ok(response)
    }
}

impl SseDecoder for Decoder {
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Option<ModelResponse>, ModelError> {
        if event.data.trim().is_empty() {
            return Ok(None);
        }
        let chunk: WireResponse = parse_data(event)?;
        self.chunk(chunk, out)?;
        Ok(None)
    }

    fn on_end(&mut self) -> Result<ModelResponse, ModelError> {
        // The stream has no end marker: a finish reason (or a blocked
        // prompt) says the answer is whole.
        if self.finish_reason.is_some() || self.blocked {
            self.response()
        } else {
            Err(ModelError::InvalidResponse(
                "the stream ended before a finish reason".into(),
            ))
        }
    }
}

/// A complete answer from its body.
pub(super) fn decode(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let chunk: WireResponse = serde_json::from_slice(body)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the answer: {e}")))?;
    let mut decoder = Decoder::default();
    decoder.chunk(chunk, &mut VecDeque::new())?;
    decoder.response()
}
