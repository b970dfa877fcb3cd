//! Anthropic Messages API answers: complete response bodies for
//! [`Reply::json`](super::Reply::json) and event streams for
//! [`Reply::sse`](super::Reply::sse) or
//! [`Reply::sse_split`](super::Reply::sse_split), in the shapes of
//! Anthropic's public API documentation.
//!
//! ```
//! use markov_testkit::http::{Reply, anthropic};
//! use serde_json::json;
//!
//! let answer = anthropic::tool_use("toolu_1", "add", &json!({"a": 2, "b": 3}));
//! assert_eq!(answer["stop_reason"], "tool_use");
//! assert_eq!(answer["content"][0]["input"], json!({"a": 2, "b": 3}));
//! let _reply = Reply::json(200, answer);
//! let _streamed = Reply::sse_split(&anthropic::text_events("Hello."), 5);
//! ```

use serde_json::{Value, json};

use super::{MODEL, split_in_two, sse_event};

/// The usage every canned answer reports.
const INPUT_TOKENS: u64 = 120;
const OUTPUT_TOKENS: u64 = 30;

/// A complete Messages API response (`"type": "message"`) with `content`
/// blocks and `stop_reason`, its id `msg_<id>`.
pub fn message(id: &str, content: Vec<Value>, stop_reason: &str) -> Value {
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS}
    })
}

/// A complete text answer: one `text` block, `stop_reason` `end_turn`.
pub fn text(text: &str) -> Value {
    message(
        "text",
        vec![json!({"type": "text", "text": text})],
        "end_turn",
    )
}

/// A complete answer with one tool call: one `tool_use` block with `id`,
/// `name` and `input`, `stop_reason` `tool_use`.
pub fn tool_use(id: &str, name: &str, input: &Value) -> Value {
    message(
        id,
        vec![json!({"type": "tool_use", "id": id, "name": name, "input": input})],
        "tool_use",
    )
}

/// The answer of `/v1/messages/count_tokens`: `{"input_tokens": N}`.
pub fn count(input_tokens: u64) -> Value {
    json!({"input_tokens": input_tokens})
}

/// `answer` (a complete message) reporting that context editing cleared
/// `tool_uses` tool uses, `input_tokens` tokens, before the model read
/// the request (`context_management.applied_edits`).
///
/// ```
/// use markov_testkit::http::anthropic;
///
/// let answer = anthropic::with_cleared_tool_uses(anthropic::text("Done."), 4, 12_000);
/// assert_eq!(answer["context_management"]["applied_edits"][0]["cleared_tool_uses"], 4);
/// ```
pub fn with_cleared_tool_uses(mut answer: Value, tool_uses: u64, input_tokens: u64) -> Value {
    answer["context_management"] = json!({"applied_edits": [{
        "type": "clear_tool_uses_20250919",
        "cleared_tool_uses": tool_uses,
        "cleared_input_tokens": input_tokens
    }]});
    answer
}

/// An error body, such as
/// `{"type": "error", "error": {"type": "overloaded_error", "message": ...}}`.
pub fn error(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The `message_start` event of a stream.
fn message_start(id: &str) -> String {
    sse_event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": format!("msg_{id}"), "type": "message", "role": "assistant",
            "content": [], "model": MODEL, "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": 1}
        }}),
    )
}

/// The events that close a stream's only block and the message.
fn stream_end(stop_reason: &str) -> [String; 3] {
    [
        sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        sse_event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                   "usage": {"output_tokens": OUTPUT_TOKENS}}),
        ),
        sse_event("message_stop", json!({"type": "message_stop"})),
    ]
}

/// [`text`] as an event stream: `message_start`, one text block whose text
/// comes in two `text_delta`s, a `ping`, then `message_delta` with
/// `end_turn` and `message_stop`.
pub fn text_events(text: &str) -> String {
    let (head, tail) = split_in_two(text);
    let delta = |part: &str| {
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": part}}),
        )
    };
    let mut events = vec![
        message_start("text"),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        sse_event("ping", json!({"type": "ping"})),
        delta(head),
        delta(tail),
    ];
    events.extend(stream_end("end_turn"));
    events.concat()
}

/// [`tool_use`] as an event stream: `message_start`, a `tool_use` block
/// whose input JSON comes in two `input_json_delta`s, a `ping`, then
/// `message_delta` with `tool_use` and `message_stop`.
pub fn tool_use_events(id: &str, name: &str, input: &Value) -> String {
    let json = input.to_string();
    let (head, tail) = split_in_two(&json);
    let delta = |part: &str| {
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "input_json_delta", "partial_json": part}}),
        )
    };
    let mut events = vec![
        message_start(id),
        sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
        ),
        sse_event("ping", json!({"type": "ping"})),
        delta(head),
        delta(tail),
    ];
    events.extend(stream_end("tool_use"));
    events.concat()
}
