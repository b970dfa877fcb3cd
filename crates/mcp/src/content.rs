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
//! An image block goes to the model as an image, beside the result's
//! text ([`ToolOutcome::Images`]): each provider that takes images in a
//! tool result sends it there, and one that does not (Chat Completions)
//! sends the same note instead, so the text keeps no note for it. An
//! image stays a note in the text when it cannot go as an image: a type
//! other than PNG, JPEG, GIF or WebP (the ones every such provider takes),
//! data that is not base64, or more than [`MAX_IMAGE_BYTES`]; each such
//! case is said in a warning log. Audio is always a note: no provider
//! takes audio in a tool result. The application still sees every block
//! and the structured content through
//! [`McpClient::call_raw`](crate::McpClient::call_raw).

use std::fmt::Write as _;

use markov_core::message::ImageData;
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
    let images: Vec<ImageData> = result.content.iter().filter_map(image_part).collect();
    if !images.is_empty() {
        // The images go as images: the text holds the other blocks.
        let rest: Vec<&ContentBlock> = result
            .content
            .iter()
            .filter(|block| image_part(block).is_none())
            .collect();
        let text = match rest.as_slice() {
            [ContentBlock::Text(text)] => text.text.clone(),
            _ => lines(rest.into_iter()),
        };
        return Ok(ToolOutcome::Images { text, images });
    }
    if let [ContentBlock::Text(text)] = result.content.as_slice() {
        return Ok(ToolOutcome::Value(Value::String(text.text.clone())));
    }
    Ok(ToolOutcome::Value(Value::String(blocks_text(
        &result.content,
    ))))
}

/// The largest image, in bytes once decoded, that goes to the model as an
/// image; a larger one is a note. Anthropic takes at most 5 MB of base64
/// per image, which is this many bytes.
pub const MAX_IMAGE_BYTES: usize = 3_750_000;

/// The image types every provider that takes images in a tool result
/// accepts.
const IMAGE_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// `block` as an image part, when it is an image that can go as one (see
/// the module docs); a refused image is said in a warning.
fn image_part(block: &ContentBlock) -> Option<ImageData> {
    let ContentBlock::Image(image) = block else {
        return None;
    };
    let mime = image.mime_type.to_ascii_lowercase();
    let bytes = decoded_len(&image.data);
    let why = if !IMAGE_TYPES.contains(&mime.as_str()) {
        "its type is not PNG, JPEG, GIF or WebP"
    } else if bytes > MAX_IMAGE_BYTES {
        "it is larger than the cap"
    } else if !is_base64(&image.data) {
        "its data is not base64"
    } else {
        return Some(ImageData::new(mime, image.data.clone()));
    };
    tracing::warn!(
        mime_type = %image.mime_type,
        bytes,
        cap = MAX_IMAGE_BYTES,
        "an MCP tool's image goes to the model as a note, since {why}"
    );
    None
}

/// Whether `data` is standard base64 (padded or not), as providers take it.
fn is_base64(data: &str) -> bool {
    let body = data.trim_end_matches('=');
    data.len() - body.len() <= 2
        && body.len() % 4 != 1
        && !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

/// The blocks, one per line, as described in the module docs.
pub fn blocks_text(blocks: &[ContentBlock]) -> String {
    lines(blocks.iter())
}

/// `blocks`, one per line.
fn lines<'a>(blocks: impl Iterator<Item = &'a ContentBlock>) -> String {
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
    markov_core::message::base64_decoded_len(data)
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
    fn an_image_goes_as_an_image_and_links_are_described() {
        let link = Resource::new("file:///tmp/report.pdf", "report");
        let r = result(vec![
            ContentBlock::text("here"),
            ContentBlock::image("aGVsbG8=", "image/png"),
            ContentBlock::resource_link(link),
        ]);
        assert_eq!(
            to_outcome(r, false).expect("ok"),
            ToolOutcome::Images {
                text: "here\n[resource link report <file:///tmp/report.pdf>]".into(),
                images: vec![ImageData::new("image/png", "aGVsbG8=")],
            }
        );
        let alone = result(vec![ContentBlock::image("aGVsbG8=", "image/png")]);
        assert_eq!(
            to_outcome(alone, false).expect("ok"),
            ToolOutcome::Images {
                text: String::new(),
                images: vec![ImageData::new("image/png", "aGVsbG8=")],
            }
        );
    }

    #[test]
    fn an_image_that_cannot_go_as_one_and_audio_are_notes() {
        let big = "A".repeat((MAX_IMAGE_BYTES / 3 + 1) * 4);
        let r = result(vec![
            ContentBlock::image(big, "image/png"),
            ContentBlock::image("PHN2Zz4=", "image/svg+xml"),
            ContentBlock::image("not base64!", "image/png"),
            ContentBlock::audio("aGVsbG8=", "audio/wav"),
        ]);
        let ToolOutcome::Value(Value::String(text)) = to_outcome(r, false).expect("ok") else {
            panic!("not text");
        };
        assert_eq!(
            text,
            format!(
                "[image image/png, {} bytes]\n[image image/svg+xml, 5 bytes]\n\
                 [image image/png, 8 bytes]\n[audio audio/wav, 5 bytes]",
                MAX_IMAGE_BYTES + 3
            )
        );
    }
}
