//! MCP call results as markov tool results.
//!
//! A markov tool result is one text the model reads, for every provider;
//! an MCP result is a list of content blocks, optional structured content
//! and an `isError` flag. The mapping:
//!
//! - `isError: true` is a failed call: the model reads
//!   `Tool execution error: <the blocks' text>`;
//! - structured content, when the server gives it, is the result, as JSON
//!   (the model reads its compact JSON text);
//! - else one text block is the result's text, verbatim;
//! - else the blocks are written one per line: text as it is, an embedded
//!   text resource as its text, and what a text cannot hold (an image, an
//!   audio clip, a binary resource) as a one-line note with its MIME type
//!   and size, never its base64 data; a resource link keeps its name and
//!   URI. The application still sees every block through
//!   [`McpClient::call_raw`](crate::McpClient::call_raw).

use std::fmt::Write as _;

use markov_core::tool::{ToolCallError, ToolOutcome};
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents};
use serde_json::Value;

/// Turns an MCP result into the outcome of a markov tool call.
pub fn to_outcome(result: CallToolResult) -> Result<ToolOutcome, ToolCallError> {
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
        return Ok(ToolOutcome::Value(structured));
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
        let out = to_outcome(result(vec![ContentBlock::text("5")])).expect("ok");
        assert_eq!(out, ToolOutcome::Value(json!("5")));
    }

    #[test]
    fn structured_content_wins() {
        let mut r = result(vec![ContentBlock::text("{\"sum\":5}")]);
        r.structured_content = Some(json!({"sum": 5}));
        assert_eq!(
            to_outcome(r).expect("ok"),
            ToolOutcome::Value(json!({"sum": 5}))
        );
    }

    #[test]
    fn is_error_is_an_execution_error() {
        let r = CallToolResult::error(vec![ContentBlock::text("no such city")]);
        assert_eq!(
            to_outcome(r),
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
        let ToolOutcome::Value(Value::String(text)) = to_outcome(r).expect("ok") else {
            panic!("not text");
        };
        assert_eq!(
            text,
            "here\n[image image/png, 5 bytes]\n[resource link report <file:///tmp/report.pdf>]"
        );
    }
}
