//! A server-sent events parser whose cost is linear in its input, with a cap
//! on what it buffers.
//!
//! It follows the WHATWG event-stream grammar (lines end with CRLF, LF or
//! CR; a blank line dispatches; `:` starts a comment; one space after a
//! field's colon is dropped; a leading byte-order mark is skipped) and keeps
//! only what the providers read: the `event` and `data` fields (`id`,
//! `retry` and unknown fields are ignored). An event the body ends in the
//! middle of is dropped, as the standard says.
//!
//! Each byte is handled a fixed number of times: a line split over many chunks is
//! accumulated, never scanned again from its start, and a chunk of many
//! lines is never copied per line. (The `eventsource-stream` crate used
//! before did both: a 4 MiB event in 1 KiB chunks cost it 6 s, where this
//! parser takes 5 ms in any chunk size; `benches/sse.rs` has the figures.)
//!
//! The bytes it holds for the event in progress (its data and the line not
//! yet ended) never exceed the cap given to [`Parser::new`]; past it, the
//! stream is refused with [`ParseError::TooLarge`].
//!
//! This file depends on nothing but `std` and `thiserror`, so that the
//! benchmark can include it as it is.

use std::collections::VecDeque;

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Event {
    /// Its type: the last `event` field, else `message`.
    pub(crate) event: String,
    /// Its `data` fields, joined by `\n`.
    pub(crate) data: String,
}

/// Why an event stream was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ParseError {
    /// One event grew past the cap (in bytes).
    #[error("a server-sent event exceeded {0} bytes (the client's max_event_bytes)")]
    TooLarge(usize),
    /// A field the providers read is not UTF-8.
    #[error("the event stream is not utf-8")]
    NotUtf8,
}

/// The position of the first line break (CR or LF) in `bytes`.
///
/// Eight bytes at a time: a word has a byte equal to `b` when
/// `(w ^ b…b) - 0x01…01 & !(w ^ b…b) & 0x80…80` is not zero (the test is
/// exact for whether, not where, so the word found is searched byte by
/// byte). This is the scan over every byte of the body; byte by byte, it
/// was a third of the cost of decoding a stream.
fn line_end(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    const LF: u64 = u64::from_ne_bytes([b'\n'; 8]);
    const CR: u64 = u64::from_ne_bytes([b'\r'; 8]);
    let is_break = |b: &u8| *b == b'\n' || *b == b'\r';
    let has_zero = |w: u64| w.wrapping_sub(ONES) & !w & HIGHS != 0;
    let mut words = bytes.chunks_exact(8);
    let mut offset = 0;
    for word in &mut words {
        let mut eight = [0; 8];
        eight.copy_from_slice(word);
        let w = u64::from_ne_bytes(eight);
        if has_zero(w ^ LF) || has_zero(w ^ CR) {
            return word.iter().position(is_break).map(|p| offset + p);
        }
        offset += 8;
    }
    words
        .remainder()
        .iter()
        .position(is_break)
        .map(|p| offset + p)
}

/// The byte-order mark a stream may start with.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// An incremental parser: [`Parser::feed`] it the body's chunks as they
/// come.
#[derive(Debug)]
pub(crate) struct Parser {
    /// The most bytes held for one event.
    max_event_bytes: usize,
    /// The line in progress, when a chunk ended inside it.
    line: Vec<u8>,
    /// The event type buffer.
    event: String,
    /// The data buffer: the `data` fields joined by `\n`. It is handed over
    /// whole when the event is dispatched, so an event of one `data` line
    /// (every event the providers send) costs one allocation of its exact
    /// size and one copy.
    data: String,
    /// Whether a `data` field was read: an empty buffer may hold one empty
    /// field.
    has_data: bool,
    /// The last chunk ended with CR: an LF opening the next one belongs to
    /// that line break.
    after_cr: bool,
    /// No line has been read yet (a byte-order mark may open it).
    first_line: bool,
}

impl Parser {
    /// A parser holding at most `max_event_bytes` for one event.
    pub(crate) fn new(max_event_bytes: usize) -> Self {
        Parser {
            max_event_bytes,
            line: Vec::new(),
            event: String::new(),
            data: String::new(),
            has_data: false,
            after_cr: false,
            first_line: true,
        }
    }

    /// Reads one chunk of the body, appending each event it completes to
    /// `out`. On an error, the events completed before it are in `out`; the
    /// parser must not be fed again.
    pub(crate) fn feed(
        &mut self,
        mut chunk: &[u8],
        out: &mut VecDeque<Event>,
    ) -> Result<(), ParseError> {
        if self.after_cr && !chunk.is_empty() {
            self.after_cr = false;
            if let Some((b'\n', rest)) = chunk.split_first() {
                chunk = rest;
            }
        }
        while let Some(end) = line_end(chunk) {
            let (line, rest) = chunk.split_at(end);
            chunk = match rest.split_first() {
                Some((b'\r', after)) => match after.split_first() {
                    Some((b'\n', after_lf)) => after_lf,
                    Some(_) => after,
                    None => {
                        self.after_cr = true;
                        after
                    }
                },
                Some((_, after)) => after,
                None => rest,
            };
            if self.line.is_empty() {
                self.check(line.len())?;
                self.on_line(line, out)?;
            } else {
                self.check(self.line.len() + line.len())?;
                let mut whole = std::mem::take(&mut self.line);
                whole.extend_from_slice(line);
                let result = self.on_line(&whole, out);
                whole.clear();
                self.line = whole;
                result?;
            }
        }
        self.check(self.line.len() + chunk.len())?;
        self.line.extend_from_slice(chunk);
        Ok(())
    }

    /// Refuses an event whose data and `pending` bytes of line pass the cap.
    fn check(&self, pending: usize) -> Result<(), ParseError> {
        if self.data.len().saturating_add(pending) > self.max_event_bytes {
            return Err(ParseError::TooLarge(self.max_event_bytes));
        }
        Ok(())
    }

    /// One whole line, without its end.
    fn on_line(&mut self, mut line: &[u8], out: &mut VecDeque<Event>) -> Result<(), ParseError> {
        if std::mem::take(&mut self.first_line) {
            line = line.strip_prefix(BOM).unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        if line.first() == Some(&b':') {
            return Ok(());
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let (name, value) = line.split_at(colon);
                let value = value.get(1..).unwrap_or_default();
                (name, value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        let text = || std::str::from_utf8(value).map_err(|_| ParseError::NotUtf8);
        match name {
            b"event" => {
                let value = text()?;
                self.event.clear();
                self.event.push_str(value);
            }
            b"data" => {
                let value = text()?;
                if std::mem::replace(&mut self.has_data, true) {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.check(0)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// A blank line: the event so far, if it has data.
    fn dispatch(&mut self, out: &mut VecDeque<Event>) {
        let mut event = std::mem::take(&mut self.event);
        if !std::mem::take(&mut self.has_data) {
            return;
        }
        let data = std::mem::take(&mut self.data);
        if event.is_empty() {
            event.push_str("message");
        }
        out.push_back(Event { event, data });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(chunks: &[&[u8]], cap: usize) -> (Vec<Event>, Result<(), ParseError>) {
        let mut parser = Parser::new(cap);
        let mut out = VecDeque::new();
        let mut result = Ok(());
        for chunk in chunks {
            result = parser.feed(chunk, &mut out);
            if result.is_err() {
                break;
            }
        }
        (out.into(), result)
    }

    fn event(event: &str, data: &str) -> Event {
        Event {
            event: event.to_owned(),
            data: data.to_owned(),
        }
    }

    /// Every split of `input` into two chunks, and byte by byte, gives the
    /// same events as the whole.
    fn same_in_any_chunks(input: &[u8], expected: &[Event]) {
        assert_eq!(parse(&[input], 1 << 20), (expected.to_vec(), Ok(())));
        for cut in 0..=input.len() {
            let (a, b) = input.split_at(cut);
            assert_eq!(
                parse(&[a, b], 1 << 20),
                (expected.to_vec(), Ok(())),
                "cut at {cut}"
            );
        }
        let mut bytes: Vec<&[u8]> = Vec::new();
        for byte in input.chunks(1) {
            bytes.push(byte);
            bytes.push(b"");
        }
        assert_eq!(parse(&bytes, 1 << 20), (expected.to_vec(), Ok(())));
    }

    #[test]
    fn events_fields_and_comments() {
        same_in_any_chunks(
            b"event: ping\ndata: {}\n\n: keep-alive\n\ndata:a\ndata: b\nid: 7\nretry: 10\nother\n\n",
            &[event("ping", "{}"), event("message", "a\nb")],
        );
    }

    #[test]
    fn every_line_end_and_a_byte_order_mark() {
        let expected = [event("x", "1"), event("message", "2"), event("y", "3")];
        same_in_any_chunks(
            b"\xEF\xBB\xBFevent: x\r\ndata: 1\r\n\r\ndata: 2\r\rdata: 3\nevent: y\n\n",
            &expected,
        );
    }

    #[test]
    fn no_data_is_no_event_and_an_unfinished_event_is_dropped() {
        // An event type alone is dropped (and forgotten); `data` with no
        // value is an empty line of data; the body ends inside an event.
        same_in_any_chunks(
            b"event: x\n\ndata\n\ndata\ndata\n\ndata: cut short\n",
            &[event("message", ""), event("message", "\n")],
        );
    }

    #[test]
    fn an_event_past_the_cap_is_refused_however_it_is_cut() {
        let mut input = b"data: ".to_vec();
        input.extend(std::iter::repeat_n(b'y', 100));
        input.extend_from_slice(b"\n\n");
        let whole: [&[u8]; 1] = [&input];
        assert_eq!(parse(&whole, 64), (vec![], Err(ParseError::TooLarge(64))));
        let small: Vec<&[u8]> = input.chunks(3).collect();
        assert_eq!(parse(&small, 64), (vec![], Err(ParseError::TooLarge(64))));
        // Many data lines add up.
        let lines = b"data: 0123456789\n".repeat(10);
        assert_eq!(
            parse(&[&lines], 64),
            (vec![], Err(ParseError::TooLarge(64)))
        );
        // Under the cap, and after events that each fit, all is well.
        assert_eq!(
            parse(&[&input], 200),
            (vec![event("message", &"y".repeat(100))], Ok(()))
        );
        let many = b"data: 0123456789\n\n".repeat(100);
        assert_eq!(parse(&[&many], 64).0.len(), 100);
    }

    #[test]
    fn line_ends_are_found_at_every_offset() {
        for len in 0..40 {
            for at in 0..len {
                for byte in [b'\n', b'\r'] {
                    let mut bytes = vec![b'a'; len];
                    bytes[at] = byte;
                    // Bytes one off the breaks, and bytes with the high bit set.
                    if at > 0 {
                        bytes[at - 1] = if at % 2 == 0 { 0x0B } else { 0x8A };
                    }
                    assert_eq!(line_end(&bytes), Some(at), "{len} {at} {byte}");
                    bytes.push(b'\n');
                    assert_eq!(line_end(&bytes), Some(at));
                }
            }
            let none: Vec<u8> = (0..len)
                .map(|i| [b'a', 0x0C, 0x09, 0x8D, 0xFF][i % 5])
                .collect();
            assert_eq!(line_end(&none), None, "{len}");
        }
    }

    #[test]
    fn events_before_an_error_are_kept() {
        assert_eq!(
            parse(&[b"data: a\n\ndata: \xFF\n\n"], 64),
            (vec![event("message", "a")], Err(ParseError::NotUtf8))
        );
    }
}
