//! Writing histories as JSON faster than serde_json's generic path.
//!
//! serde_json escapes a string byte by byte; in a history most of the bytes
//! are strings (ids, names, texts), so that loop was half the cost of
//! writing a snapshot. [`write_history_json`] writes the same bytes with a
//! string writer that looks at eight bytes at a time, for the shapes a
//! history is made of; anything else (arguments and other JSON values,
//! instance payloads, images, files, commands) is handed to serde_json.
//! Tests check the bytes against `serde_json::to_vec` for random messages.

use serde::Serialize;

use super::{Item, Items, Message, Metadata, Role, Source};

/// Appends `messages` as a JSON array, exactly as
/// `serde_json::to_vec(messages)` would write it.
///
/// ```
/// use markov_core::Message;
/// use markov_core::message::write_history_json;
///
/// let history = [Message::user("hi \"there\""), Message::assistant("hello")];
/// let mut out = Vec::new();
/// write_history_json(&history, &mut out).unwrap();
/// assert_eq!(out, serde_json::to_vec(&history).unwrap());
/// ```
///
/// # Errors
/// What serde_json reports for a JSON value that cannot be written (a map
/// with keys that are not strings cannot occur in a `serde_json::Value`, so
/// in practice none).
pub fn write_history_json(messages: &[Message], out: &mut Vec<u8>) -> serde_json::Result<()> {
    out.push(b'[');
    for (i, message) in messages.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_message(message, out)?;
    }
    out.push(b']');
    Ok(())
}

fn write_message(message: &Message, out: &mut Vec<u8>) -> serde_json::Result<()> {
    out.extend_from_slice(b"{\"role\":\"");
    out.extend_from_slice(match message.role {
        Role::User => b"user",
        Role::Assistant => b"assistant",
        Role::System => b"system",
        Role::Command => b"command",
        Role::Ephemeral => b"ephemeral",
        Role::Instance => b"instance",
    });
    out.extend_from_slice(b"\",\"items\":");
    match &message.items {
        Items::Text(text) => string(text, out),
        Items::List(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_item(item, out)?;
            }
            out.push(b']');
        }
        Items::Instance(payload) => serde(payload, out)?,
    }
    if let Some(metadata) = &message.metadata {
        out.extend_from_slice(b",\"metadata\":");
        write_metadata(metadata, out)?;
    }
    out.push(b'}');
    Ok(())
}

fn write_item(item: &Item, out: &mut Vec<u8>) -> serde_json::Result<()> {
    match item {
        Item::Text { text } => {
            out.extend_from_slice(b"{\"type\":\"text\",\"text\":");
            string(text, out);
        }
        Item::ToolUse { id, name, input } => {
            out.extend_from_slice(b"{\"type\":\"tool_use\",\"id\":");
            string(id.as_str(), out);
            out.extend_from_slice(b",\"name\":");
            string(name, out);
            out.extend_from_slice(b",\"input\":");
            serde(input, out)?;
        }
        Item::ToolResult {
            tool_use_id,
            content,
            is_error,
        } => {
            out.extend_from_slice(b"{\"type\":\"tool_result\",\"tool_use_id\":");
            string(tool_use_id.as_str(), out);
            out.extend_from_slice(b",\"content\":");
            string(content, out);
            if let Some(is_error) = is_error {
                out.extend_from_slice(b",\"is_error\":");
                boolean(*is_error, out);
            }
        }
        Item::Thinking {
            thinking,
            signature,
        } => {
            out.extend_from_slice(b"{\"type\":\"thinking\",\"thinking\":");
            string(thinking, out);
            if let Some(signature) = signature {
                out.extend_from_slice(b",\"signature\":");
                string(signature, out);
            }
        }
        // The rarer shapes, as serde writes them (already closed).
        other => return serde(other, out),
    }
    out.push(b'}');
    Ok(())
}

fn write_metadata(metadata: &Metadata, out: &mut Vec<u8>) -> serde_json::Result<()> {
    let Metadata {
        source,
        message_id,
        stream,
        silent,
        singleton,
        singleton_frame_count,
    } = metadata;
    let mut fields = Fields::open(out);
    if let Some(source) = source {
        fields.key("source");
        write_source(source, fields.out);
    }
    if let Some(id) = message_id {
        fields.key("messageId");
        string(id.as_str(), fields.out);
    }
    if let Some(stream) = stream {
        fields.key("stream");
        serde(stream, fields.out)?;
    }
    if let Some(silent) = silent {
        fields.key("silent");
        boolean(*silent, fields.out);
    }
    if let Some(singleton) = singleton {
        fields.key("singleton");
        string(singleton, fields.out);
    }
    if let Some(count) = singleton_frame_count {
        fields.key("singletonFrameCount");
        serde(count, fields.out)?;
    }
    fields.close();
    Ok(())
}

fn write_source(source: &Source, out: &mut Vec<u8>) {
    let Source {
        instance_id,
        is_primary,
        external,
    } = source;
    let mut fields = Fields::open(out);
    if let Some(id) = instance_id {
        fields.key("instanceId");
        string(id.as_str(), fields.out);
    }
    if let Some(primary) = is_primary {
        fields.key("isPrimary");
        boolean(*primary, fields.out);
    }
    if let Some(external) = external {
        fields.key("external");
        boolean(*external, fields.out);
    }
    fields.close();
}

/// An object being written: commas between its fields.
struct Fields<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl<'a> Fields<'a> {
    fn open(out: &'a mut Vec<u8>) -> Self {
        out.push(b'{');
        Fields { out, first: true }
    }

    /// A key that needs no escaping, and its colon.
    fn key(&mut self, key: &str) {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        self.out.push(b'"');
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\":");
    }

    fn close(self) {
        self.out.push(b'}');
    }
}

fn boolean(value: bool, out: &mut Vec<u8>) {
    out.extend_from_slice(if value { b"true" } else { b"false" });
}

fn serde<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> serde_json::Result<()> {
    serde_json::to_writer(out, value)
}

/// Appends `text` as a JSON string, quoted and escaped exactly as
/// serde_json writes it (`\"`, `\\`, the short forms `\b \f \n \r \t`,
/// `\u00XX` in lower-case hex for the other control characters, everything
/// else as it is), looking at eight bytes at a time where serde_json looks
/// at one. For writers of other JSON shapes made of a history's strings,
/// such as a provider's wire messages.
///
/// ```
/// use markov_core::message::write_json_string;
///
/// let mut out = Vec::new();
/// write_json_string("say \"hi\"\n", &mut out);
/// assert_eq!(out, serde_json::to_vec("say \"hi\"\n").unwrap());
/// ```
pub fn write_json_string(text: &str, out: &mut Vec<u8>) {
    string(text, out);
}

/// [`write_json_string`], under the short name this module uses.
fn string(text: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = text.as_bytes();
    let mut start = 0;
    let mut at = 0;
    while at < bytes.len() {
        // Eight bytes at a time while none of them needs escaping.
        if let Some(chunk) = bytes.get(at..at + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            if !needs_escape(u64::from_le_bytes(word)) {
                at += 8;
                continue;
            }
        }
        let byte = bytes[at];
        let escape: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => {
                out.extend_from_slice(&bytes[start..at]);
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(byte >> 4)]);
                out.push(HEX[usize::from(byte & 0xf)]);
                at += 1;
                start = at;
                continue;
            }
            _ => {
                at += 1;
                continue;
            }
        };
        out.extend_from_slice(&bytes[start..at]);
        out.extend_from_slice(escape);
        at += 1;
        start = at;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// Whether any of the eight bytes is `"`, `\` or below 0x20 (may say yes
/// for a word that needs none, never no for one that does).
pub(super) fn needs_escape(word: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let has_zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGH != 0;
    let control = word.wrapping_sub(ONES * 0x20) & !word & HIGH != 0;
    control
        || has_zero(word ^ (ONES * u64::from(b'"')))
        || has_zero(word ^ (ONES * u64::from(b'\\')))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn same(messages: &[Message]) {
        let mut out = Vec::new();
        write_history_json(messages, &mut out).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&serde_json::to_vec(messages).unwrap())
        );
    }

    #[test]
    fn every_shape_is_written_as_serde_writes_it() {
        same(&super::super::every_shape());
        same(&[]);
    }

    proptest! {
        #[test]
        fn strings_are_escaped_as_serde_escapes_them(text in "\\PC*|[\\x00-\\x7f]{0,40}") {
            let mut out = Vec::new();
            string(&text, &mut out);
            prop_assert_eq!(out, serde_json::to_vec(&text).unwrap());
        }
    }
}
