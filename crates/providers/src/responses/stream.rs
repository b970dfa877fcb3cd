//! Decoding of streamed Responses: typed events (`response.output_item.added`,
//! `response.output_text.delta`, `response.function_call_arguments.delta`,
//! `response.reasoning_summary_text.delta`, `response.output_item.done`,
//! `response.completed`, ...), one output item per `output_index`, or per
//! item id where a server leaves the index out (llama.cpp's server): two
//! items are never merged into one.
//!
//! Content indexes in the emitted [`StreamEvent`]s are positions in the final
//! [`ModelResponse::content`], given in order of first appearance: a call or
//! a reasoning item gets its position when it is added, a message when its
//! first text arrives. The final answer takes each item as its
//! `output_item.done` event gives it whole (the encrypted reasoning, the
//! whole arguments), and what the deltas said where a server sends no such
//! event.

use std::collections::{HashMap, VecDeque};

use markov_core::{Item, ModelError, ModelResponse, StreamEvent};
use serde::Deserialize;

use super::wire::{self, OutputItem, WireResponse};
use crate::convert;
use crate::sse::{Event, SseDecoder, parse_data};

/// One event, read in one pass into the fields any event type uses.
#[derive(Deserialize)]
struct WireEvent {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    output_index: Option<usize>,
    /// The item a delta belongs to (llama.cpp's server sends this and no
    /// `output_index`).
    #[serde(default)]
    item_id: Option<String>,
    #[serde(default)]
    delta: Option<String>,
    #[serde(default)]
    item: Option<OutputItem>,
    #[serde(default)]
    response: Option<WireResponse>,
    /// An `error` event's own fields.
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default)]
    message: Option<String>,
}

/// One output item being streamed.
#[derive(Default)]
struct Slot {
    kind: String,
    /// Its position in the answer, once it has one.
    index: Option<usize>,
    text: String,
    refused: bool,
    call_id: Option<String>,
    name: String,
    arguments: String,
    reasoning_id: Option<String>,
    done: Option<OutputItem>,
    /// Whether an event named the item by its id.
    has_id: bool,
}

/// Which output item an event is about: its `output_index`, as OpenAI
/// sends it, else the item's id (`item_id` on a delta, `item.id` on an
/// added or done item), as a server that leaves the index out
/// (llama.cpp's) still sends.
struct Key {
    output_index: Option<usize>,
    item_id: Option<String>,
}

/// The answer assembled so far.
#[derive(Default)]
pub(crate) struct Decoder {
    slots: Vec<Slot>,
    /// `output_index` → position in `slots`.
    by_output: HashMap<usize, usize>,
    /// Item id → position in `slots`.
    by_item: HashMap<String, usize>,
    /// The position of the item added last: where an event that names no
    /// item belongs.
    last: Option<usize>,
    /// Positions given out so far.
    next_index: usize,
}

impl Decoder {
    /// The slot `key` names, made now (of `kind`) if it names none yet.
    /// `fresh` (an added item): an item that names neither index nor id is
    /// a new one, never merged into the last; any other event that names
    /// neither belongs to the item added last.
    fn locate(&mut self, key: &Key, kind: &str, fresh: bool) -> usize {
        let found = key
            .output_index
            .and_then(|index| self.by_output.get(&index).copied())
            .or_else(|| {
                let id = key.item_id.as_ref()?;
                self.by_item.get(id).copied()
            })
            .or(match (key.output_index, &key.item_id, fresh) {
                (None, None, false) => self.last,
                // An id never seen, on an item added without one: that
                // item's.
                (None, Some(_), false) => self.last.filter(|&at| !self.slots[at].has_id),
                _ => None,
            });
        let position = found.unwrap_or_else(|| {
            self.slots.push(Slot {
                kind: kind.to_owned(),
                ..Slot::default()
            });
            let position = self.slots.len() - 1;
            self.last = Some(position);
            position
        });
        if let Some(id) = &key.item_id {
            self.by_item.entry(id.clone()).or_insert(position);
            self.slots[position].has_id = true;
        }
        if let Some(index) = key.output_index {
            self.by_output.entry(index).or_insert(position);
        }
        position
    }

    /// The answer position of the slot at `position`, given out now if it
    /// has none yet.
    fn index(&mut self, position: usize) -> usize {
        let mut next = self.next_index;
        let index = *self.slots[position].index.get_or_insert_with(|| {
            next += 1;
            next - 1
        });
        self.next_index = next;
        index
    }

    fn added(&mut self, key: &Key, item: OutputItem, out: &mut VecDeque<StreamEvent>) {
        let kind = item.kind.clone();
        let position = self.locate(key, &kind, true);
        match kind.as_str() {
            "function_call" => {
                let index = self.index(position);
                let slot = &mut self.slots[position];
                let id = item
                    .call_id
                    .filter(|id| !id.is_empty())
                    .unwrap_or_else(|| convert::fallback_call_id(index));
                slot.call_id = Some(id.clone());
                slot.name = item.name.unwrap_or_default();
                slot.arguments = item.arguments.unwrap_or_default();
                out.push_back(StreamEvent::ToolCallStart {
                    index,
                    id: id.as_str().into(),
                    name: slot.name.clone(),
                });
                if !slot.arguments.is_empty() {
                    out.push_back(StreamEvent::ToolCallDelta {
                        index,
                        partial_json: slot.arguments.clone(),
                    });
                }
            }
            "reasoning" => {
                self.index(position);
                self.slots[position].reasoning_id = item.id;
            }
            _ => {}
        }
    }

    fn text(&mut self, key: &Key, delta: String, refusal: bool, out: &mut VecDeque<StreamEvent>) {
        if delta.is_empty() {
            return;
        }
        let position = self.locate(key, "message", false);
        let index = self.index(position);
        let slot = &mut self.slots[position];
        slot.text.push_str(&delta);
        slot.refused |= refusal;
        out.push_back(StreamEvent::TextDelta { index, text: delta });
    }

    fn done(&mut self, key: &Key, item: OutputItem, out: &mut VecDeque<StreamEvent>) {
        let kind = item.kind.clone();
        let position = self.locate(key, &kind, false);
        let has_index = self.slots[position].index.is_some();
        if kind == "message" && !has_index {
            // A message whose text came in no delta: it has its place now.
            if let (Some(Item::Text { text }), _) = wire::item_of(item.clone(), 0) {
                let index = self.index(position);
                out.push_back(StreamEvent::TextDelta { index, text });
            }
        }
        self.slots[position].done = Some(item);
    }

    fn response(&mut self, finished: WireResponse) -> Result<ModelResponse, ModelError> {
        if let Some(error) = finished.error.as_ref().filter(|e| !e.is_null()) {
            return Err(wire::error_of(error));
        }
        let mut slots: Vec<Slot> = std::mem::take(&mut self.slots)
            .into_iter()
            .filter(|s| s.index.is_some())
            .collect();
        slots.sort_by_key(|s| s.index);
        let mut refused = false;
        let mut content = Vec::with_capacity(slots.len());
        for (position, slot) in slots.into_iter().enumerate() {
            let from_done = slot.done.clone().and_then(|done| {
                let (item, refusal) = wire::item_of(done, position);
                refused |= refusal && item.is_some();
                item
            });
            let item = from_done.or_else(|| {
                refused |= slot.refused;
                match slot.kind.as_str() {
                    "function_call" => Some(Item::tool_use(
                        slot.call_id
                            .unwrap_or_else(|| convert::fallback_call_id(position)),
                        slot.name,
                        convert::parse_tool_arguments(&slot.arguments),
                    )),
                    "reasoning" => Some(Item::Thinking {
                        thinking: slot.text,
                        signature: slot
                            .reasoning_id
                            .map(|id| wire::reasoning_signature(&id, None)),
                    }),
                    _ => (!slot.text.is_empty()).then_some(Item::Text { text: slot.text }),
                }
            });
            content.extend(item);
        }
        Ok(wire::answer(content, refused, finished))
    }
}

impl SseDecoder for Decoder {
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Option<ModelResponse>, ModelError> {
        let data = event.data.trim();
        if data.is_empty() || data == "[DONE]" {
            return Ok(None);
        }
        let parsed: WireEvent = parse_data(event)?;
        let key = Key {
            output_index: parsed.output_index,
            item_id: parsed
                .item_id
                .clone()
                .or_else(|| parsed.item.as_ref().and_then(|item| item.id.clone()))
                .filter(|id| !id.is_empty()),
        };
        match parsed.kind.as_str() {
            "response.output_item.added" => {
                if let Some(item) = parsed.item {
                    self.added(&key, item, out);
                }
            }
            "response.output_text.delta" => {
                self.text(&key, parsed.delta.unwrap_or_default(), false, out);
            }
            "response.refusal.delta" => {
                self.text(&key, parsed.delta.unwrap_or_default(), true, out);
            }
            "response.function_call_arguments.delta" => {
                let delta = parsed.delta.unwrap_or_default();
                let position = self.locate(&key, "function_call", false);
                let index = self.index(position);
                self.slots[position].arguments.push_str(&delta);
                if !delta.is_empty() {
                    out.push_back(StreamEvent::ToolCallDelta {
                        index,
                        partial_json: delta,
                    });
                }
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                let delta = parsed.delta.unwrap_or_default();
                if !delta.is_empty() {
                    let position = self.locate(&key, "reasoning", false);
                    let index = self.index(position);
                    self.slots[position].text.push_str(&delta);
                    out.push_back(StreamEvent::ThinkingDelta {
                        index,
                        thinking: delta,
                    });
                }
            }
            "response.output_item.done" => {
                if let Some(item) = parsed.item {
                    self.done(&key, item, out);
                }
            }
            "response.completed" | "response.incomplete" => {
                return self.response(parsed.response.unwrap_or_default()).map(Some);
            }
            "response.failed" => {
                let error = parsed
                    .response
                    .and_then(|r| r.error)
                    .unwrap_or_else(|| serde_json::json!({"message": "the response failed"}));
                return Err(wire::error_of(&error));
            }
            "error" => {
                let error = serde_json::json!({
                    "code": parsed.code.unwrap_or(serde_json::Value::Null),
                    "message": parsed.message.unwrap_or_default(),
                });
                return Err(wire::error_of(&error));
            }
            _ => {}
        }
        Ok(None)
    }

    fn on_end(&mut self) -> Result<ModelResponse, ModelError> {
        Err(ModelError::InvalidResponse(
            "the stream ended before response.completed".into(),
        ))
    }
}
