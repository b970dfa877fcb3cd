//! Conversions both providers share: stored items that no provider has a
//! block for, the marking of mid-conversation system instructions, and the
//! parsing of tool arguments.

use markov_core::{Item, Items, Message};
use serde_json::{Map, Value};

/// The key holding the raw text of tool arguments that are not valid JSON.
pub(crate) const INVALID_ARGUMENTS_KEY: &str = "__invalid_arguments";

/// The key holding the parse error of tool arguments that are not valid JSON.
pub(crate) const INVALID_ARGUMENTS_ERROR_KEY: &str = "__error";

/// A message's content as a plain string, or as its item list.
pub(crate) enum Content<'a> {
    Text(&'a str),
    Items(&'a [Item]),
}

/// The content of a message. Instance payloads have none.
pub(crate) fn content(message: &Message) -> Content<'_> {
    match &message.items {
        Items::Text(text) => Content::Text(text),
        Items::List(items) => Content::Items(items),
        Items::Instance(_) => Content::Items(&[]),
    }
}

/// A file reference as the text line the model sees:
/// `[file: <filename> (<mediaType>)] <url>`, or `[file: <mediaType>] <url>`.
pub(crate) fn file_reference(url: &str, media_type: &str, filename: Option<&str>) -> String {
    match filename {
        Some(name) => format!("[file: {name} ({media_type})] {url}"),
        None => format!("[file: {media_type}] {url}"),
    }
}

/// An `output` item's data as the model sees it: JSON with a 2-space indent.
pub(crate) fn output_text(data: &Value) -> String {
    serde_json::to_string_pretty(data).unwrap_or_else(|_| data.to_string())
}

/// The text of a `system` message as one instruction for providers without a
/// mid-conversation system role, or `None` when it holds no text.
pub(crate) fn system_text(message: &Message) -> Option<String> {
    let texts: Vec<&str> = match content(message) {
        Content::Text(text) => vec![text],
        Content::Items(items) => items
            .iter()
            .filter_map(|item| match item {
                Item::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect(),
    };
    let texts: Vec<&str> = texts.into_iter().filter(|t| !t.is_empty()).collect();
    (!texts.is_empty()).then(|| texts.join("\n"))
}

/// The stop reason when the provider gives none (or one this crate does not
/// know): tool use if the answer calls tools, else the end of the turn.
pub(crate) fn implied_stop_reason(has_tool_calls: bool) -> markov_core::StopReason {
    if has_tool_calls {
        markov_core::StopReason::ToolUse
    } else {
        markov_core::StopReason::EndTurn
    }
}

/// Tool arguments from their JSON text. Empty text is `{}`; text that is not
/// JSON becomes `{"__invalid_arguments": <text>, "__error": <parse error>}`,
/// which no tool's typed arguments accept, so the model gets an error result
/// instead of the call crashing the run.
pub(crate) fn parse_tool_arguments(raw: &str) -> Value {
    if raw.trim().is_empty() {
        return Value::Object(Map::new());
    }
    match serde_json::from_str(raw) {
        Ok(value) => value,
        Err(error) => {
            let mut map = Map::new();
            map.insert(INVALID_ARGUMENTS_KEY.into(), Value::String(raw.to_owned()));
            map.insert(
                INVALID_ARGUMENTS_ERROR_KEY.into(),
                Value::String(error.to_string()),
            );
            Value::Object(map)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_parse_or_are_wrapped() {
        assert_eq!(parse_tool_arguments(""), json!({}));
        assert_eq!(parse_tool_arguments(r#"{"a":1}"#), json!({"a":1}));
        let bad = parse_tool_arguments(r#"{"a":"#);
        assert_eq!(bad[INVALID_ARGUMENTS_KEY], json!(r#"{"a":"#));
        assert!(bad[INVALID_ARGUMENTS_ERROR_KEY].is_string());
    }

    #[test]
    fn files_and_outputs_become_text() {
        assert_eq!(
            file_reference("https://x/a.pdf", "application/pdf", Some("a.pdf")),
            "[file: a.pdf (application/pdf)] https://x/a.pdf"
        );
        assert_eq!(
            file_reference("https://x/a", "text/plain", None),
            "[file: text/plain] https://x/a"
        );
        assert_eq!(
            output_text(&json!({"a":[1]})),
            "{\n  \"a\": [\n    1\n  ]\n}"
        );
    }
}
