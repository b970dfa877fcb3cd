//! MCP call results as markov tool results.
//!
//! A markov tool result is one text the model reads, for every provider;
//! an MCP result is a list of content blocks, optional structured content
//! and an `isError` flag. The mapping:
//!
//! - `isError: true` is a failed call: the model reads
//!   `Tool execution error: <the blocks' text>`;
//! - the content blocks are what the model reads, as the official clients
//!   show them: one text block is the result's text, verbatim; several
//!   are written one per line: text as it is, an embedded text resource
//!   as its text, and what a text cannot hold (an image, an audio clip, a
//!   binary resource) as a one-line note with its MIME type and size,
//!   never its base64 data; a resource link keeps its name and URI;
//! - structured content is the result (a JSON value, its compact JSON text
//!   for the model) only when the tool declares an output schema and its
//!   one text block is the same JSON, or when there are no blocks; a
//!   structured value that wraps the text (`{"content": "…"}`) or carries
//!   an image's data is never what the model reads. An image or audio
//!   object inside structured content (`{"type": "image", "data": …}`) is
//!   replaced by the same note.
//!
//! A markov tool result is text, so an image never reaches the model as
//! an image part from an MCP tool; it is the note. The application still
//! sees every block and the structured content through
//! [`McpClient::call_raw`](crate::McpClient::call_raw).

use std::fmt::Write as _;

use markov_core::tool::{ToolCallError, ToolOutcome};
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents};
use serde_json::Value;

/// Turns an MCP result into the outcome of a markov tool call;
/// `output_schema` says whether the tool declares one (see the module
/// docs).
pub fn to_outcome(
    result: CallToolResult,
    output_schema: bool,
) -> Result<ToolOutcome, ToolCallError> {
    if result.is_error == Some(true) {
        let text = blocks_text(&result.content);
        let text = if text.is_empty() {
            "the MCP tool reported an error".to_owned()
        } else {
            text
        };
        return Err(ToolCallError::Execution(text));
    }
    if let Some(structured) = result.structured_content {
        let same = match result.content.as_slice() {
            [] => true,
            [ContentBlock::Text(text)] => {
                output_schema
                    && serde_json::from_str::<Value>(&text.text).ok() == Some(structured.clone())
            }
            _ => false,
        };
        if same {
            return Ok(ToolOutcome::Value(without_media(structured)));
        }
    }
    if let [ContentBlock::Text(text)] = result.content.as_slice() {
        return Ok(ToolOutcome::Value(Value::String(text.text.clone())));
    }
    Ok(ToolOutcome::Value(Value::String(blocks_text(
        &result.content,
    ))))
}

/// The blocks, one per line, as described in the module docs.
pub fn blocks_text(blocks: &[ContentBlock]) -> String {
    let mut out = String::new();
    for block in blocks {
        if !out.is_empty() {
            out.push('\n');
        }
        // Writing to a `String` cannot fail.
        let _ = write_block(&mut out, block);
    }
    out
}

/// One block as one line of text.
fn write_block(out: &mut String, block: &ContentBlock) -> std::fmt::Result {
    match block {
        ContentBlock::Text(t) => out.write_str(&t.text),
        ContentBlock::Image(i) => write!(
            out,
            "[image {}, {} bytes]",
            i.mime_type,
            decoded_len(&i.data)
        ),
        ContentBlock::Audio(a) => write!(
            out,
            "[audio {}, {} bytes]",
            a.mime_type,
            decoded_len(&a.data)
        ),
        ContentBlock::Resource(r) => match &r.resource {
            ResourceContents::TextResourceContents { text, .. } => out.write_str(text),
            ResourceContents::BlobResourceContents {
                uri,
                mime_type,
                blob,
                ..
            } => write!(
                out,
                "[resource {uri}, {}, {} bytes]",
                mime_type.as_deref().unwrap_or("application/octet-stream"),
                decoded_len(blob)
            ),
            _ => out.write_str("[unsupported resource]"),
        },
        ContentBlock::ResourceLink(link) => {
            write!(out, "[resource link {} <{}>", link.name, link.uri)?;
            if let Some(mime) = &link.mime_type {
                write!(out, ", {mime}")?;
            }
            if let Some(d) = &link.description {
                write!(out, ": {d}")?;
            }
            out.write_str("]")
        }
        // A block kind added by a later protocol version.
        _ => out.write_str("[unsupported content]"),
    }
}

/// `value` with each image or audio object (`{"type": "image", "data":
/// "…", "mimeType": "…"}`) replaced by its note.
fn without_media(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let kind = map.get("type").and_then(Value::as_str);
            let data = map.get("data").and_then(Value::as_str);
            if let (Some(kind @ ("image" | "audio")), Some(data)) = (kind, data) {
                let mime = map
                    .get("mimeType")
                    .and_then(Value::as_str)
                    .unwrap_or("application/octet-stream");
                return Value::String(format!("[{kind} {mime}, {} bytes]", decoded_len(data)));
            }
            Value::Object(
                map.into_iter()
                    .map(|(k, v)| (k, without_media(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(without_media).collect()),
        other => other,
    }
}

/// The size of base64 `data` once decoded.
fn decoded_len(data: &str) -> usize {
    let padding = data.bytes().rev().take_while(|&b| b == b'=').count();
    (data.len() / 4 * 3).saturating_sub(padding)
}

#[cfg(test)]
mod tests {
    use rmcp::model::Resource;
    use serde_json::json;

    use super::*;

    fn result(content: Vec<ContentBlock>) -> CallToolResult {
        CallToolResult::success(content)
    }

    #[test]
    fn one_text_block_is_the_text() {
        let out = to_outcome(result(vec![ContentBlock::text("5")]), false).expect("ok");
        assert_eq!(out, ToolOutcome::Value(json!("5")));
    }

    #[test]
    fn structured_content_is_the_value_when_declared_and_the_text_says_the_same() {
        let mut r = result(vec![ContentBlock::text("{\"sum\": 5}")]);
        r.structured_content = Some(json!({"sum": 5}));
        assert_eq!(
            to_outcome(r, true).expect("ok"),
            ToolOutcome::Value(json!({"sum": 5}))
        );
    }

    #[test]
    fn the_text_wins_over_a_wrapping_structured_value() {
        for declared in [false, true] {
            let mut r = result(vec![ContentBlock::text("hello world")]);
            r.structured_content = Some(json!({"content": "hello world"}));
            assert_eq!(
                to_outcome(r, declared).expect("ok"),
                ToolOutcome::Value(json!("hello world"))
            );
        }
        // Undeclared, even the same JSON is read as the text.
        let mut r = result(vec![ContentBlock::text("{\"sum\":5}")]);
        r.structured_content = Some(json!({"sum": 5}));
        assert_eq!(
            to_outcome(r, false).expect("ok"),
            ToolOutcome::Value(json!("{\"sum\":5}"))
        );
    }

    #[test]
    fn media_in_structured_content_is_a_note() {
        let mut r = result(vec![]);
        r.structured_content = Some(json!({"content": [
            {"type": "image", "data": "aGVsbG8=", "mimeType": "image/png"}
        ]}));
        assert_eq!(
            to_outcome(r, true).expect("ok"),
            ToolOutcome::Value(json!({"content": ["[image image/png, 5 bytes]"]}))
        );
    }

    #[test]
    fn is_error_is_an_execution_error() {
        let r = CallToolResult::error(vec![ContentBlock::text("no such city")]);
        assert_eq!(
            to_outcome(r, false),
            Err(ToolCallError::Execution("no such city".into()))
        );
    }

    #[test]
    fn images_and_links_are_described() {
        let link = Resource::new("file:///tmp/report.pdf", "report");
        let r = result(vec![
            ContentBlock::text("here"),
            ContentBlock::image("aGVsbG8=", "image/png"),
            ContentBlock::resource_link(link),
        ]);
        let ToolOutcome::Value(Value::String(text)) = to_outcome(r, false).expect("ok") else {
            panic!("not text");
        };
        assert_eq!(
            text,
            "here\n[image image/png, 5 bytes]\n[resource link report <file:///tmp/report.pdf>]"
        );
    }
}
