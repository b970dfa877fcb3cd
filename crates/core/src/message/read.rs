//! Reading histories from JSON text without serde's per-token work.
//!
//! A snapshot is mostly its history, and serde_json reads a history one
//! token at a time through visitors: every key is matched through an
//! identifier visitor, every optional field through `Option`'s impl, every
//! string scanned and then copied. [`read_history_json`] reads the shapes
//! [`write_history_json`](super::write_history_json) writes — keys in the
//! written order, no white space inside a message — straight from the text,
//! and hands a message in any other form (white space, another key order,
//! unknown keys, the rarer item kinds, metadata beyond the common fields,
//! instance payloads) to the `Deserialize` impls, from where that message
//! starts. Either way the message is the one serde's reading gives, and
//! what serde refuses is refused with serde's own words: the fast path
//! never decides that something is wrong, it only steps aside.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::{self, value::BorrowedStrDeserializer};
use serde_json::Value;

use super::ser::needs_escape;
use super::{Item, Items, Message, MessageShapeError, Metadata, Role, Source};

/// Reads a JSON array of messages that is the whole of `json` (white space
/// around it allowed): the inverse of
/// [`write_history_json`](super::write_history_json), and what
/// `serde_json::from_str::<Vec<Message>>` reads, several times faster for
/// the shapes a history is written in.
///
/// ```
/// use markov_core::Message;
/// use markov_core::message::{read_history_json, write_history_json};
///
/// let history = [Message::user("hi \"there\""), Message::assistant("hello")];
/// let mut out = Vec::new();
/// write_history_json(&history, &mut out).unwrap();
/// let text = String::from_utf8(out).unwrap();
/// assert_eq!(read_history_json(&text).unwrap(), history);
/// assert!(read_history_json("[{\"role\":\"user\"}]").is_err());
/// ```
///
/// # Errors
/// Text that is not a JSON array of messages: serde's error for the first
/// message it cannot read (prefixed with the message's index and byte
/// offset), or one naming the byte where the array's syntax breaks.
pub fn read_history_json(json: &str) -> serde_json::Result<Vec<Message>> {
    let (messages, end) = read_history_json_prefix(json)?;
    let mut reader = Reader::new(json);
    reader.pos = end;
    reader.skip_ws();
    if reader.pos < json.len() {
        return Err(reader.error("trailing characters after the history"));
    }
    Ok(messages)
}

/// Reads the JSON array of messages that `json` starts with (after white
/// space) and returns it with the number of bytes it took; what follows is
/// not looked at. For readers of documents that hold a history among other
/// fields, such as a machine snapshot.
///
/// ```
/// use markov_core::message::read_history_json_prefix;
///
/// let text = r#"[{"role":"user","items":"hi"}], "next": 1}"#;
/// let (history, used) = read_history_json_prefix(text).unwrap();
/// assert_eq!(history.len(), 1);
/// assert_eq!(&text[used..], r#", "next": 1}"#);
/// ```
///
/// # Errors
/// As [`read_history_json`], for the array alone.
pub fn read_history_json_prefix(json: &str) -> serde_json::Result<(Vec<Message>, usize)> {
    let mut reader = Reader::new(json);
    let history = reader.history()?;
    Ok((history, reader.pos))
}

/// Reads one message that is the whole of `json` (white space around it
/// allowed): what `serde_json::from_str::<Message>` reads, faster for the
/// shapes the history writer writes. For stores that keep a message per
/// row.
///
/// ```
/// use markov_core::Message;
/// use markov_core::message::read_message_json;
///
/// let text = serde_json::to_string(&Message::assistant("hello")).unwrap();
/// assert_eq!(read_message_json(&text).unwrap(), Message::assistant("hello"));
/// assert!(read_message_json(r#"{"role":"user"}"#).is_err());
/// ```
///
/// # Errors
/// Text that is not one message: serde's error, or one naming the byte
/// where something follows the message.
pub fn read_message_json(json: &str) -> serde_json::Result<Message> {
    let mut reader = Reader::new(json);
    reader.skip_ws();
    let message = reader.message()?;
    reader.skip_ws();
    if reader.pos < json.len() {
        return Err(reader.error("trailing characters after the message"));
    }
    Ok(message)
}

/// A position in the text being read.
struct Reader<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
}

/// A message takes at least about this many bytes of JSON: the history's
/// list is sized from the text's length, so thousands of messages are not
/// grown and copied again and again.
const MIN_MESSAGE_BYTES: usize = 150;

impl<'a> Reader<'a> {
    fn new(text: &'a str) -> Self {
        Reader {
            text,
            bytes: text.as_bytes(),
            pos: 0,
        }
    }

    fn error(&self, what: &str) -> serde_json::Error {
        de::Error::custom(format_args!("{what} at byte {}", self.pos))
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    /// Steps over `literal` if the text continues with it.
    fn eat(&mut self, literal: &[u8]) -> bool {
        let found = self.bytes[self.pos..].starts_with(literal);
        if found {
            self.pos += literal.len();
        }
        found
    }

    fn history(&mut self) -> serde_json::Result<Vec<Message>> {
        self.skip_ws();
        if !self.eat(b"[") {
            return Err(self.error("expected a list of messages"));
        }
        // The guess comes from the input: capped, and given back when far
        // too large.
        let guess = ((self.bytes.len() - self.pos) / MIN_MESSAGE_BYTES).min(1 << 16);
        let mut history = Vec::with_capacity(guess);
        self.skip_ws();
        if !self.eat(b"]") {
            loop {
                let start = self.pos;
                let message = self.message().map_err(|e| {
                    de::Error::custom(format_args!(
                        "message {} (at byte {start}): {e}",
                        history.len()
                    ))
                })?;
                history.push(message);
                self.skip_ws();
                if self.eat(b",") {
                    self.skip_ws();
                } else if self.eat(b"]") {
                    break;
                } else {
                    return Err(self.error("expected `,` or `]` after a message"));
                }
            }
        }
        if history.capacity() > history.len() * 2 + 16 {
            history.shrink_to_fit();
        }
        Ok(history)
    }

    /// The message that starts here: read directly when it has the written
    /// shape, else by serde from its first byte (serde's error as it is).
    fn message(&mut self) -> serde_json::Result<Message> {
        let start = self.pos;
        if let Some(message) = self.written_message() {
            return Ok(message);
        }
        self.pos = start;
        let mut stream = serde_json::Deserializer::from_str(&self.text[start..]).into_iter();
        match stream.next() {
            Some(Ok(message)) => {
                self.pos = start + stream.byte_offset();
                Ok(message)
            }
            Some(Err(e)) => Err(e),
            None => Err(self.error("expected a message")),
        }
    }

    /// `{"role":…,"items":…,"metadata":…}` as the history writer writes it;
    /// `None` (and a position to be reset) for anything else.
    fn written_message(&mut self) -> Option<Message> {
        if !self.eat(b"{\"role\":\"") {
            return None;
        }
        let role = [
            (&b"user\""[..], Role::User),
            (b"assistant\"", Role::Assistant),
            (b"system\"", Role::System),
            (b"command\"", Role::Command),
            (b"ephemeral\"", Role::Ephemeral),
        ]
        .into_iter()
        .find_map(|(word, role)| self.eat(word).then_some(role))?;
        if !self.eat(b",\"items\":") {
            return None;
        }
        let items = match self.bytes.get(self.pos)? {
            b'"' => Items::Text(self.string()?.into_owned()),
            b'[' => Items::List(self.items()?),
            // An instance payload (or not items at all): serde's.
            _ => return None,
        };
        let metadata = if self.eat(b",\"metadata\":") {
            Some(self.metadata()?)
        } else {
            None
        };
        if !self.eat(b"}") {
            return None;
        }
        MessageShapeError::check(role, &items).ok()?;
        Some(Message {
            role,
            items,
            metadata,
        })
    }

    fn items(&mut self) -> Option<Vec<Item>> {
        self.eat(b"[");
        // Most messages hold one item.
        let mut items = Vec::with_capacity(1);
        if self.eat(b"]") {
            return Some(items);
        }
        loop {
            items.push(self.item()?);
            if self.eat(b"]") {
                return Some(items);
            }
            if !self.eat(b",") {
                return None;
            }
        }
    }

    fn item(&mut self) -> Option<Item> {
        if !self.eat(b"{\"type\":\"") {
            return None;
        }
        let item = if self.eat(b"text\",\"text\":") {
            Item::Text {
                text: self.string()?.into_owned(),
            }
        } else if self.eat(b"tool_use\",\"id\":") {
            let id = self.id()?;
            let name = self.field(b",\"name\":")?;
            if !self.eat(b",\"input\":") {
                return None;
            }
            Item::ToolUse {
                id,
                name,
                input: self.value()?,
            }
        } else if self.eat(b"tool_result\",\"tool_use_id\":") {
            let tool_use_id = self.id()?;
            let content = self.field(b",\"content\":")?;
            let is_error = if self.eat(b",\"is_error\":") {
                Some(self.boolean()?)
            } else {
                None
            };
            Item::ToolResult {
                tool_use_id,
                content,
                is_error,
            }
        } else if self.eat(b"thinking\",\"thinking\":") {
            let thinking = self.string()?.into_owned();
            let signature = if self.bytes[self.pos..].starts_with(b",\"signature\":") {
                Some(self.field(b",\"signature\":")?)
            } else {
                None
            };
            Item::Thinking {
                thinking,
                signature,
            }
        } else {
            // The rarer kinds: serde's.
            return None;
        };
        self.eat(b"}").then_some(item)
    }

    /// Metadata with the fields the loop writes (an instance source, a
    /// message id, `silent`, `singleton`), in the written order.
    fn metadata(&mut self) -> Option<Metadata> {
        if !self.eat(b"{") {
            return None;
        }
        let mut metadata = Metadata::default();
        let mut first = true;
        if self.key(b"source", &mut first) {
            metadata.source = Some(self.source()?);
        }
        if self.key(b"messageId", &mut first) {
            metadata.message_id = Some(self.id()?);
        }
        if self.key(b"silent", &mut first) {
            metadata.silent = Some(self.boolean()?);
        }
        if self.key(b"singleton", &mut first) {
            metadata.singleton = Some(self.string()?.into_owned());
        }
        self.eat(b"}").then_some(metadata)
    }

    fn source(&mut self) -> Option<Source> {
        if !self.eat(b"{") {
            return None;
        }
        let mut source = Source::default();
        let mut first = true;
        if self.key(b"instanceId", &mut first) {
            source.instance_id = Some(self.id()?);
        }
        if self.key(b"isPrimary", &mut first) {
            source.is_primary = Some(self.boolean()?);
        }
        if self.key(b"external", &mut first) {
            source.external = Some(self.boolean()?);
        }
        self.eat(b"}").then_some(source)
    }

    /// Steps over `"key":` (after a comma unless it is the object's first).
    fn key(&mut self, key: &[u8], first: &mut bool) -> bool {
        let start = self.pos;
        let found =
            (*first || self.eat(b",")) && self.eat(b"\"") && self.eat(key) && self.eat(b"\":");
        if found {
            *first = false;
        } else {
            self.pos = start;
        }
        found
    }

    /// `prefix` (a comma and a key) and the string after it.
    fn field(&mut self, prefix: &[u8]) -> Option<String> {
        self.eat(prefix)
            .then(|| self.string())
            .flatten()
            .map(Cow::into_owned)
    }

    fn boolean(&mut self) -> Option<bool> {
        if self.eat(b"true") {
            Some(true)
        } else if self.eat(b"false") {
            Some(false)
        } else {
            None
        }
    }

    /// An id, through its own `Deserialize` (which shares repeated ids).
    fn id<T: Deserialize<'a>>(&mut self) -> Option<T> {
        match self.string()? {
            Cow::Borrowed(id) => {
                T::deserialize(BorrowedStrDeserializer::<serde_json::Error>::new(id)).ok()
            }
            Cow::Owned(id) => {
                T::deserialize(de::value::StrDeserializer::<serde_json::Error>::new(&id)).ok()
            }
        }
    }

    /// Any JSON value (tool arguments), by serde_json.
    fn value(&mut self) -> Option<Value> {
        let mut stream = serde_json::Deserializer::from_str(&self.text[self.pos..]).into_iter();
        let value = stream.next()?.ok()?;
        self.pos += stream.byte_offset();
        Some(value)
    }

    /// A string: borrowed from the text when it has no escapes.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        if !self.eat(b"\"") {
            return None;
        }
        let start = self.pos;
        let end = self.plain_run(start);
        match self.bytes.get(end)? {
            b'"' => {
                self.pos = end + 1;
                // Both ends are ASCII quotes, so char boundaries.
                self.text.get(start..end).map(Cow::Borrowed)
            }
            b'\\' => self.escaped(start, end).map(Cow::Owned),
            // A raw control character: serde refuses it, with its words.
            _ => None,
        }
    }

    /// Where the run of bytes from `at` that need no unescaping ends: the
    /// first `"`, `\` or control character (or the text's end).
    fn plain_run(&self, mut at: usize) -> usize {
        while let Some(chunk) = self.bytes.get(at..at + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            if needs_escape(u64::from_le_bytes(word)) {
                break;
            }
            at += 8;
        }
        while let Some(&byte) = self.bytes.get(at) {
            if byte == b'"' || byte == b'\\' || byte < 0x20 {
                break;
            }
            at += 1;
        }
        at
    }

    /// A string with escapes, from `start` (after its quote); `plain` is
    /// where its first escape is.
    fn escaped(&mut self, start: usize, mut plain: usize) -> Option<String> {
        let mut out = String::with_capacity(plain - start + 16);
        let mut from = start;
        loop {
            out.push_str(self.text.get(from..plain)?);
            match self.bytes.get(plain)? {
                b'"' => {
                    self.pos = plain + 1;
                    return Some(out);
                }
                b'\\' => {}
                _ => return None,
            }
            let escape = *self.bytes.get(plain + 1)?;
            let mut next = plain + 2;
            match escape {
                b'"' => out.push('"'),
                b'\\' => out.push('\\'),
                b'/' => out.push('/'),
                b'b' => out.push('\u{8}'),
                b'f' => out.push('\u{c}'),
                b'n' => out.push('\n'),
                b'r' => out.push('\r'),
                b't' => out.push('\t'),
                b'u' => {
                    // Surrogates (pairs or lone) are left to serde.
                    let hex = self.text.get(next..next + 4)?;
                    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return None;
                    }
                    let code = u32::from_str_radix(hex, 16).ok()?;
                    out.push(char::from_u32(code)?);
                    next += 4;
                }
                _ => return None,
            }
            from = next;
            plain = self.plain_run(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `text` both ways and checks that they agree.
    fn both(text: &str) -> Result<Vec<Message>, String> {
        let fast = read_history_json(text).map_err(|e| e.to_string());
        let serde = serde_json::from_str::<Vec<Message>>(text).map_err(|e| e.to_string());
        assert_eq!(fast.is_ok(), serde.is_ok(), "{text}: {fast:?} vs {serde:?}");
        if let (Ok(fast), Ok(serde)) = (&fast, &serde) {
            assert_eq!(fast, serde, "{text}");
        }
        fast
    }

    #[test]
    fn written_shapes_and_others_read_as_serde_reads_them() {
        let history = super::super::every_shape();
        let mut out = Vec::new();
        crate::message::write_history_json(&history, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(both(&text).unwrap(), history);
        let pretty = serde_json::to_string_pretty(&history).unwrap();
        assert_eq!(both(&pretty).unwrap(), history);
        assert_eq!(both(" [ ] ").unwrap(), vec![]);
    }

    /// A user message whose items are a plain string.
    fn plain(text: &str) -> Message {
        Message {
            role: Role::User,
            items: Items::Text(text.into()),
            metadata: None,
        }
    }

    #[test]
    fn escapes_are_decoded() {
        let text = r#"[{"role":"user","items":"a\"\\\/\b\f\n\r\t\u00e9\u0041z"}]"#;
        assert_eq!(
            both(text).unwrap(),
            vec![plain("a\"\\/\u{8}\u{c}\n\r\t\u{e9}Az")]
        );
        // A surrogate pair, and lone surrogates serde refuses.
        assert_eq!(
            both(r#"[{"role":"user","items":"\ud83d\ude00"}]"#).unwrap(),
            vec![plain("😀")]
        );
        assert!(both(r#"[{"role":"user","items":"\ud83d"}]"#).is_err());
        assert!(both(r#"[{"role":"user","items":"\q"}]"#).is_err());
        assert!(both(r#"[{"role":"user","items":"\u00g1"}]"#).is_err());
        assert!(both("[{\"role\":\"user\",\"items\":\"a\u{1}\"}]").is_err());
    }

    #[test]
    fn what_serde_refuses_is_refused() {
        for text in [
            "",
            "{}",
            "[",
            "[,]",
            r#"[{"role":"user","items":"a"},]"#,
            r#"[{"role":"user","items":"a"} {"role":"user","items":"b"}]"#,
            r#"[{"role":"user"}]"#,
            r#"[{"role":"instance","items":"a"}]"#,
            r#"[{"role":"robot","items":"a"}]"#,
            r#"[{"role":"user","items":[{"type":"tool_use","id":"t","name":"x"}]}]"#,
            r#"[{"role":"user","items":[{"type":"tool_result","tool_use_id":"t","content":3}]}]"#,
            r#"[{"role":"user","items":"a","role":"user"}]"#,
            r#"[{"role":"user","items":"a","metadata":{"source":{"instanceId":1}}}]"#,
            r#"[{"role":"user","items":"a"}] x"#,
            r#"[{"role":"user","items":"unterminated}]"#,
        ] {
            assert!(both(text).is_err(), "{text}");
        }
        let err = read_history_json(r#"[{"role":"user","items":"a"},{"role":"user"}]"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("message 1") && err.contains("missing field `items`"),
            "{err}"
        );
    }

    #[test]
    fn unknown_keys_null_metadata_and_other_orders_read_through_serde() {
        for text in [
            r#"[{"items":"a","role":"user"}]"#,
            r#"[{"role":"user","items":"a","extra":[1]}]"#,
            r#"[{"role":"user","items":"a","metadata":null}]"#,
            r#"[{"role":"user","items":[{"text":"a","type":"text"}]}]"#,
            r#"[{"role":"user","items":[{"type":"text","text":"a","x":1}]}]"#,
            r#"[{"role":"user","items":"a","metadata":{"silent":true,"source":{}}}]"#,
            r#"[{"role":"user","items":[{"type":"tool_result","tool_use_id":"t","content":"c","is_error":null}]}]"#,
        ] {
            both(text).unwrap();
        }
    }

    #[test]
    fn one_message_reads_as_serde_reads_it() {
        for text in [
            r#"{"role":"user","items":"a"}"#,
            r#" {"items":"a","role":"user"} "#,
            r#"{"role":"assistant","items":[{"type":"tool_use","id":"t","name":"n","input":[1]}],"metadata":{"source":{"instanceId":"i"}}}"#,
        ] {
            let serde: Message = serde_json::from_str(text).unwrap();
            assert_eq!(read_message_json(text).unwrap(), serde, "{text}");
        }
        for text in [
            "",
            "[]",
            r#"{"role":"user"}"#,
            r#"{"role":"user","items":"a"} {}"#,
        ] {
            assert!(read_message_json(text).is_err(), "{text}");
            assert!(serde_json::from_str::<Message>(text).is_err(), "{text}");
        }
    }

    #[test]
    fn repeated_ids_are_shared() {
        let text = r#"[{"role":"assistant","items":[{"type":"tool_use","id":"t1","name":"a","input":{}}]},{"role":"user","items":[{"type":"tool_result","tool_use_id":"t1","content":"x"}]}]"#;
        let history = read_history_json(text).unwrap();
        let (Items::List(call), Items::List(result)) = (&history[0].items, &history[1].items)
        else {
            panic!("lists");
        };
        let (Item::ToolUse { id, .. }, Item::ToolResult { tool_use_id, .. }) =
            (&call[0], &result[0])
        else {
            panic!("a call and its result");
        };
        assert!(std::ptr::eq(id.as_str(), tool_use_id.as_str()));
    }
}
