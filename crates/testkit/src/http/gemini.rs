//! Gemini API answers: complete `GenerateContentResponse` bodies for
//! [`Reply::json`](super::Reply::json) and `streamGenerateContent?alt=sse`
//! event streams (one `data:` chunk per event, no end marker) for
//! [`Reply::sse`](super::Reply::sse) or
//! [`Reply::sse_split`](super::Reply::sse_split), in the shapes of Google's
//! public API documentation.
//!
//! ```
//! use markov_testkit::http::{Reply, gemini};
//! use serde_json::json;
//!
//! let answer = gemini::function_call("add", &json!({"a": 2, "b": 3}));
//! assert_eq!(answer["candidates"][0]["content"]["parts"][0]["functionCall"]["name"], "add");
//! let _reply = Reply::json(200, answer);
//! let _streamed = Reply::sse_split(&gemini::text_events("Hello."), 5);
//! ```

use serde_json::{Value, json};

use super::{MODEL, split_in_two, sse_data};

/// The usage every canned answer reports.
fn usage() -> Value {
    json!({"promptTokenCount": 120, "candidatesTokenCount": 22, "thoughtsTokenCount": 8,
           "totalTokenCount": 150, "cachedContentTokenCount": 20})
}

/// The answer of `models/{model}:countTokens`: `totalTokens`, all of
/// them text.
pub fn count(total_tokens: u64) -> Value {
    json!({
        "totalTokens": total_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total_tokens}]
    })
}

/// A complete answer whose one candidate holds `parts`, ending with
/// `finish_reason` (`STOP`, `MAX_TOKENS`, `SAFETY`, ...).
pub fn response(parts: Vec<Value>, finish_reason: &str) -> Value {
    json!({
        "candidates": [{
            "content": {"role": "model", "parts": parts},
            "finishReason": finish_reason,
            "index": 0
        }],
        "usageMetadata": usage(),
        "modelVersion": MODEL,
        "responseId": "fake-response"
    })
}

/// A text part.
pub fn text_part(text: &str) -> Value {
    json!({"text": text})
}

/// A thought summary part with its signature.
pub fn thought_part(text: &str, signature: &str) -> Value {
    json!({"text": text, "thought": true, "thoughtSignature": signature})
}

/// A function call part (the API gives no id), signed when `signature`
/// is given, as the first call of a thinking model's turn is.
pub fn function_call_part(name: &str, args: &Value, signature: Option<&str>) -> Value {
    let mut part = json!({"functionCall": {"name": name, "args": args}});
    if let Some(signature) = signature {
        part["thoughtSignature"] = json!(signature);
    }
    part
}

/// A complete text answer.
pub fn text(text: &str) -> Value {
    response(vec![text_part(text)], "STOP")
}

/// A complete answer with one unsigned function call.
pub fn function_call(name: &str, args: &Value) -> Value {
    response(vec![function_call_part(name, args, None)], "STOP")
}

/// An error body: `{"error": {"code", "message", "status"}}`.
pub fn error(code: u16, status: &str, message: &str) -> Value {
    json!({"error": {"code": code, "message": message, "status": status}})
}

/// `parts` as a stream: each text part in two chunks, every other part in
/// one, the finish reason and usage on a last chunk of its own.
pub fn events(parts: Vec<Value>, finish_reason: &str) -> String {
    let chunk = |parts: Vec<Value>| {
        sse_data(
            &json!({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
                    "modelVersion": MODEL})
            .to_string(),
        )
    };
    let mut out = Vec::new();
    for part in parts {
        match part.get("text").and_then(Value::as_str) {
            Some(text) if !text.is_empty() && part.get("thoughtSignature").is_none() => {
                let (head, tail) = split_in_two(text);
                for piece in [head, tail] {
                    let mut piece_part = part.clone();
                    piece_part["text"] = json!(piece);
                    out.push(chunk(vec![piece_part]));
                }
            }
            _ => out.push(chunk(vec![part])),
        }
    }
    out.push(sse_data(
        &json!({"candidates": [{"content": {"role": "model", "parts": [{"text": ""}]},
                                "finishReason": finish_reason, "index": 0}],
                "usageMetadata": usage(), "modelVersion": MODEL})
        .to_string(),
    ));
    out.concat()
}

/// [`text`] as a stream.
pub fn text_events(text: &str) -> String {
    events(vec![text_part(text)], "STOP")
}
