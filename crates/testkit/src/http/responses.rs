//! OpenAI Responses API answers: complete response objects for
//! [`Reply::json`](super::Reply::json) and typed event streams for
//! [`Reply::sse`](super::Reply::sse) or
//! [`Reply::sse_split`](super::Reply::sse_split), in the shapes of OpenAI's
//! public API documentation (`response.output_item.added`, the deltas,
//! `response.output_item.done`, `response.completed`), and the answers of
//! `/responses/compact` ([`compaction`], [`compacted`]).
//!
//! ```
//! use markov_testkit::http::{Reply, responses};
//! use serde_json::json;
//!
//! let answer = responses::function_call("call_1", "add", &json!({"a": 2, "b": 3}));
//! assert_eq!(answer["output"][0]["type"], "function_call");
//! assert_eq!(answer["output"][0]["arguments"], r#"{"a":2,"b":3}"#);
//! let _reply = Reply::json(200, answer);
//! let _streamed = Reply::sse_split(&responses::text_events("Hello."), 5);
//! ```

use serde_json::{Value, json};

use super::{MODEL, split_in_two, sse_event};

/// When every canned answer was created (seconds since the epoch).
const CREATED: u64 = 1_741_476_542;

/// The usage every canned answer reports.
fn usage() -> Value {
    json!({
        "input_tokens": 120,
        "input_tokens_details": {"cached_tokens": 20},
        "output_tokens": 30,
        "output_tokens_details": {"reasoning_tokens": 8},
        "total_tokens": 150
    })
}

/// The answer of `/responses/input_tokens`:
/// `{"object": "response.input_tokens", "input_tokens": N}`.
pub fn input_tokens(input_tokens: u64) -> Value {
    json!({"object": "response.input_tokens", "input_tokens": input_tokens})
}

/// A complete response object (`"object": "response"`, status
/// `completed`) whose `output` is `output`, its id `resp_<id>`.
pub fn response(id: &str, output: Vec<Value>) -> Value {
    json!({
        "id": format!("resp_{id}"),
        "object": "response",
        "created_at": CREATED,
        "status": "completed",
        "error": null,
        "incomplete_details": null,
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": true,
        "store": false,
        "usage": usage()
    })
}

/// An assistant `message` output item holding `text`.
pub fn message_item(id: &str, text: &str) -> Value {
    json!({
        "type": "message", "id": format!("msg_{id}"), "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]
    })
}

/// A `function_call` output item, its `arguments` serialized to a string
/// as the API sends them.
pub fn function_call_item(call_id: &str, name: &str, arguments: &Value) -> Value {
    json!({
        "type": "function_call", "id": format!("fc_{call_id}"), "call_id": call_id,
        "name": name, "arguments": arguments.to_string(), "status": "completed"
    })
}

/// A `reasoning` output item with one summary text and encrypted content,
/// as `include: ["reasoning.encrypted_content"]` asks for.
pub fn reasoning_item(id: &str, summary: &str, encrypted: &str) -> Value {
    json!({
        "type": "reasoning", "id": id,
        "summary": [{"type": "summary_text", "text": summary}],
        "encrypted_content": encrypted
    })
}

/// A complete text answer.
pub fn text(text: &str) -> Value {
    response("text", vec![message_item("text", text)])
}

/// A complete answer with one function call.
pub fn function_call(call_id: &str, name: &str, arguments: &Value) -> Value {
    response(call_id, vec![function_call_item(call_id, name, arguments)])
}

/// A `compaction` output item of `/responses/compact`: an id and
/// encrypted content, opaque to the client.
pub fn compaction_item(id: &str, encrypted: &str) -> Value {
    json!({"type": "compaction", "id": format!("cmp_{id}"), "encrypted_content": encrypted})
}

/// The answer of `/responses/compact` (`"object": "response.compaction"`)
/// whose `output` is `output`, with the usage every canned answer reports.
pub fn compaction(output: Vec<Value>) -> Value {
    json!({
        "id": "resp_compact",
        "object": "response.compaction",
        "created_at": CREATED,
        "output": output,
        "usage": usage()
    })
}

/// The answer a compaction of `body` (a recorded `/responses/compact`
/// request's) gets, as OpenAI shapes it: the user messages of its `input`
/// kept as they were sent, then one [`compaction_item`] whose id and
/// encrypted content are made from the number of input items (so each
/// compaction of a growing conversation is told apart). Deterministic: a
/// test snapshots what the next request sends.
///
/// ```
/// use markov_testkit::http::responses;
/// use serde_json::json;
///
/// let body = json!({"model": "m", "input": [
///     {"type": "message", "role": "user", "content": "hi"},
///     {"type": "message", "role": "assistant", "content": "hello"},
/// ]});
/// let answer = responses::compacted(&body);
/// assert_eq!(answer["output"][0], body["input"][0]);
/// assert_eq!(answer["output"][1]["encrypted_content"], "enc:2-items");
/// ```
pub fn compacted(body: &Value) -> Value {
    let input = body["input"].as_array().cloned().unwrap_or_default();
    let mut output: Vec<Value> = input
        .iter()
        .filter(|item| item["type"] == "message" && item["role"] == "user")
        .cloned()
        .collect();
    let n = input.len();
    output.push(compaction_item(&n.to_string(), &format!("enc:{n}-items")));
    compaction(output)
}

/// An error body, such as `{"error": {"message", "type", "code"}}`.
pub fn error(kind: &str, code: &str, message: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// One event: `event: <type>` and its data, the type repeated inside as the
/// API sends it.
fn event(kind: &str, mut data: Value) -> String {
    if let Some(object) = data.as_object_mut() {
        object.insert("type".to_owned(), json!(kind));
    }
    sse_event(kind, data)
}

/// The events around the output items: `response.created` first, and
/// `response.completed` with the whole response last.
fn framed(id: &str, output: Vec<Value>, middle: Vec<String>) -> String {
    let mut created = response(id, Vec::new());
    created["status"] = json!("in_progress");
    created["usage"] = Value::Null;
    let mut events = vec![event("response.created", json!({"response": created}))];
    events.extend(middle);
    events.push(event(
        "response.completed",
        json!({"response": response(id, output)}),
    ));
    events.concat()
}

/// The events of one output item at `index`: added (without its content),
/// the deltas, done (whole).
fn item_events(index: usize, item: &Value) -> Vec<String> {
    let mut added = item.clone();
    let mut deltas = Vec::new();
    match item["type"].as_str() {
        Some("message") => {
            added["content"] = json!([]);
            let text = item["content"][0]["text"].as_str().unwrap_or_default();
            let (head, tail) = split_in_two(text);
            for piece in [head, tail] {
                deltas.push(event(
                    "response.output_text.delta",
                    json!({"output_index": index, "content_index": 0, "item_id": item["id"], "delta": piece}),
                ));
            }
        }
        Some("function_call") => {
            added["arguments"] = json!("");
            let arguments = item["arguments"].as_str().unwrap_or_default();
            let (head, tail) = split_in_two(arguments);
            for piece in [head, tail] {
                deltas.push(event(
                    "response.function_call_arguments.delta",
                    json!({"output_index": index, "item_id": item["id"], "delta": piece}),
                ));
            }
        }
        Some("reasoning") => {
            added["summary"] = json!([]);
            added["encrypted_content"] = Value::Null;
            let summary = item["summary"][0]["text"].as_str().unwrap_or_default();
            deltas.push(event(
                "response.reasoning_summary_text.delta",
                json!({"output_index": index, "summary_index": 0, "item_id": item["id"], "delta": summary}),
            ));
        }
        _ => {}
    }
    let mut events = vec![event(
        "response.output_item.added",
        json!({"output_index": index, "item": added}),
    )];
    events.extend(deltas);
    events.push(event(
        "response.output_item.done",
        json!({"output_index": index, "item": item}),
    ));
    events
}

/// `output` as an event stream: each item added, its deltas, done; then
/// `response.completed`.
pub fn events(id: &str, output: Vec<Value>) -> String {
    let middle = output
        .iter()
        .enumerate()
        .flat_map(|(index, item)| item_events(index, item))
        .collect();
    framed(id, output, middle)
}

/// [`text`] as an event stream.
pub fn text_events(text: &str) -> String {
    events("text", vec![message_item("text", text)])
}

/// [`function_call`] as an event stream.
pub fn function_call_events(call_id: &str, name: &str, arguments: &Value) -> String {
    events(call_id, vec![function_call_item(call_id, name, arguments)])
}

/// `output` as an event stream the way llama.cpp's server sends it: as
/// [`events`], but no event carries an `output_index`, so only the item
/// ids (`item_id` on a delta, `item.id` on an added or done item) tell the
/// items apart.
pub fn events_without_output_index(id: &str, output: Vec<Value>) -> String {
    let middle = output
        .iter()
        .enumerate()
        .flat_map(|(index, item)| item_events(index, item))
        .map(|event| {
            event
                .lines()
                .map(|line| match line.strip_prefix("data: ") {
                    Some(data) => match serde_json::from_str::<Value>(data) {
                        Ok(mut data) => {
                            if let Some(object) = data.as_object_mut() {
                                object.remove("output_index");
                            }
                            format!("data: {data}")
                        }
                        Err(_) => line.to_owned(),
                    },
                    None => line.to_owned(),
                })
                .collect::<Vec<_>>()
                .join("\n")
                + "\n\n"
        })
        .collect();
    framed(id, output, middle)
}
