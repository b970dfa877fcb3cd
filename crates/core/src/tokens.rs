//! A cheap, conservative estimate of how many tokens a conversation takes.
//!
//! Exact counts need the model's own tokenizer (or a call to the
//! provider). Deciding whether a history still fits a context window, or
//! whether a call may pass a spending limit, needs only a bound that is
//! rarely below the truth and costs no I/O: this module counts one token
//! per three bytes of text (tokenizers average three and a half to four
//! bytes of English per token, fewer for code and other scripts, so a
//! third errs on the high side), a few tokens of framing per message and
//! per item, and a fixed allowance per image or file.
//!
//! ```
//! use markov_core::message::Message;
//! use markov_core::tokens;
//!
//! let history = [Message::user("What is 2 + 3?"), Message::assistant("5")];
//! let estimate = tokens::estimate_messages(&history);
//! assert!(estimate >= 6, "at least one token per word: {estimate}");
//! assert_eq!(tokens::estimate_text(""), 0);
//! assert_eq!(tokens::estimate_text("abcdef"), 2);
//! ```

use std::io;

use serde_json::Value;

use crate::message::{Item, Items, Message, Role};
use crate::model::ModelRequest;
use crate::tool::ToolDefinition;

/// Tokens counted for the framing of each message (its role and
/// separators).
pub const MESSAGE_OVERHEAD: u64 = 4;

/// Tokens counted for the framing of each item of a message.
pub const ITEM_OVERHEAD: u64 = 3;

/// Tokens counted for an image or a file, whatever its size: providers
/// scale images down to about this many tokens (Anthropic's largest image
/// is some 1 600 tokens).
pub const ATTACHMENT_TOKENS: u64 = 1_600;

/// The estimated tokens of `text`: one per three bytes, rounded up.
pub fn estimate_text(text: &str) -> u64 {
    bytes_to_tokens(text.len() as u64)
}

/// The estimated tokens of `value` written as JSON (tool arguments,
/// schemas), without building the text.
pub fn estimate_json(value: &Value) -> u64 {
    let mut counter = ByteCounter(0);
    // Writing a `Value` into a counter cannot fail.
    let _ = serde_json::to_writer(&mut counter, value);
    bytes_to_tokens(counter.0)
}

/// The estimated tokens of one item.
pub fn estimate_item(item: &Item) -> u64 {
    ITEM_OVERHEAD
        + match item {
            Item::Text { text } => estimate_text(text),
            Item::Image { .. } | Item::File { .. } => ATTACHMENT_TOKENS,
            Item::ToolUse { id, name, input } | Item::ProviderToolUse { id, name, input } => {
                estimate_text(id.as_str()) + estimate_text(name) + estimate_json(input)
            }
            Item::ToolResult {
                tool_use_id,
                content,
                images,
                ..
            } => {
                // An image counts as an image, never as its base64 text.
                estimate_text(tool_use_id.as_str())
                    + estimate_text(content)
                    + ATTACHMENT_TOKENS * images.len() as u64
            }
            Item::ProviderToolResult {
                tool_use_id,
                content,
                ..
            } => estimate_text(tool_use_id.as_str()) + estimate_json(content),
            Item::Thinking {
                thinking,
                signature,
            } => estimate_text(thinking) + signature.as_deref().map_or(0, estimate_text),
            Item::Output { data } => estimate_json(data),
            Item::Command { name, input, .. } => estimate_text(name) + estimate_json(input),
            Item::Summary { text, .. } => estimate_text(text),
            Item::Native { items, .. } => items.iter().map(|i| estimate_text(i.as_str())).sum(),
            Item::Resume { .. } => 0,
        }
}

/// The estimated tokens `message` adds to a request. `command` and
/// `instance` records are never sent and count nothing; a summary counts
/// its text (as a context view shows it).
pub fn estimate_message(message: &Message) -> u64 {
    match message.role {
        Role::Command | Role::Instance => 0,
        _ => {
            MESSAGE_OVERHEAD
                + match &message.items {
                    Items::Text(text) => estimate_text(text),
                    Items::List(items) => items.iter().map(estimate_item).sum(),
                    Items::Instance(_) => 0,
                }
        }
    }
}

/// The estimated tokens of a list of messages.
pub fn estimate_messages(messages: &[Message]) -> u64 {
    messages.iter().map(estimate_message).sum()
}

/// The estimated tokens of a tool's definition as offered to a model.
pub fn estimate_tool(tool: &ToolDefinition) -> u64 {
    ITEM_OVERHEAD
        + estimate_text(tool.name.as_str())
        + estimate_text(&tool.description)
        + estimate_json(&tool.input_schema)
}

/// The estimated input tokens of a whole request: its system prompt, its
/// messages, its tools and its output schema (not the answer it asks for,
/// which [`ModelSettings::max_tokens`](crate::ModelSettings::max_tokens)
/// bounds). Always [`estimate_framing`] plus [`estimate_messages`] of its
/// messages, so a caller that keeps the messages' sum as they are
/// appended adds the framing alone.
pub fn estimate_request(request: &ModelRequest<'_>) -> u64 {
    estimate_framing(request) + estimate_messages(request.messages())
}

/// The estimated input tokens of a request's parts other than its
/// messages: its system prompt, its tools and its output schema. They do
/// not grow with the conversation.
pub fn estimate_framing(request: &ModelRequest<'_>) -> u64 {
    estimate_text(request.system())
        + request.tools().iter().map(estimate_tool).sum::<u64>()
        + request.output_schema().map_or(0, estimate_json)
}

fn bytes_to_tokens(bytes: u64) -> u64 {
    bytes.div_ceil(3)
}

/// Counts the bytes written to it.
struct ByteCounter(u64);

impl io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_counts_a_token_per_three_bytes_rounded_up() {
        assert_eq!(estimate_text("abc"), 1);
        assert_eq!(estimate_text("abcd"), 2);
        // Bytes, not characters: other scripts take more tokens.
        assert_eq!(estimate_text("ééé"), 2);
    }

    #[test]
    fn json_counts_its_written_form() {
        let value = json!({"a": [1, 2, "x"]});
        let written = serde_json::to_string(&value).unwrap();
        assert_eq!(estimate_json(&value), estimate_text(&written));
    }

    #[test]
    fn records_never_sent_count_nothing_and_images_a_fixed_amount() {
        let command = Message::from(crate::message::MessageData {
            role: Role::Command,
            items: Items::List(vec![Item::text("reset everything")]),
            metadata: None,
        });
        assert_eq!(estimate_message(&command), 0);
        let image = Message::user_items(vec![Item::Image {
            mime_type: "image/png".into(),
            data: "A".repeat(1_000_000),
            detail: None,
        }]);
        assert_eq!(
            estimate_message(&image),
            MESSAGE_OVERHEAD + ITEM_OVERHEAD + ATTACHMENT_TOKENS
        );
    }

    #[test]
    fn an_image_in_a_tool_result_counts_as_an_image_not_its_base64() {
        let note = "[image image/png, 750000 bytes]";
        let result = Item::tool_result_with_images(
            "t1",
            note,
            None,
            vec![crate::message::ImageData::new(
                "image/png",
                "A".repeat(1_000_000),
            )],
        );
        assert_eq!(
            estimate_item(&result),
            ITEM_OVERHEAD + estimate_text("t1") + estimate_text(note) + ATTACHMENT_TOKENS
        );
    }

    #[test]
    fn the_estimate_is_above_a_real_tokenizer_for_english() {
        // A sentence that OpenAI's o200k tokenizer makes 10 tokens of.
        let text = "The quick brown fox jumps over the lazy dog again.";
        assert!(estimate_text(text) >= 10, "{}", estimate_text(text));
    }

    #[test]
    fn a_request_counts_system_messages_and_tools() {
        let history = [Message::user("hello there")];
        let settings = crate::ModelSettings::default();
        let bare = ModelRequest::new("", &history, &settings);
        let with_system = ModelRequest::new("You are terse.", &history, &settings);
        assert_eq!(estimate_request(&bare), estimate_messages(&history));
        assert!(estimate_request(&with_system) > estimate_request(&bare));
    }
}
