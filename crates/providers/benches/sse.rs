//! The server-sent events parser's cost, which must stay linear in an
//! event's size however the body is split into chunks: one 4 MiB event in
//! chunks of 64 B to 16 KiB, and 10 000 small events in one chunk. divan's
//! `B/s` column is parsing throughput; it should not fall as chunks shrink
//! (beyond a fixed cost per chunk).
//!
//! Run with `cargo bench -p markov-providers --bench sse`.
//!
//! Measured on the 2-core development machine (`cargo bench`, medians): the
//! 4 MiB event parses in 4.6–4.8 ms (about 900 MB/s) in 64 B, 1 KiB and
//! 16 KiB chunks alike; 10 000 small events (350 KB) in 0.9 ms.
//! `eventsource-stream` 0.2.3, used before, re-parsed the pending line on
//! every chunk and copied the rest of its buffer after every line: the same
//! event took 0.4 s in 16 KiB chunks and 6.2 s in 1 KiB chunks (64 B chunks:
//! minutes), the 10 000 events 48 ms — quadratic both ways.

use std::collections::VecDeque;

use divan::Bencher;
use divan::counter::BytesCount;

// The parser is private to the crate; it depends on `std` and `thiserror`
// only, so the bench includes its source as it is.
#[allow(dead_code)]
#[path = "../src/sse/parser.rs"]
mod parser;

use parser::Parser;

fn main() {
    divan::main();
}

/// One event of `size` bytes of data.
fn big_event(size: usize) -> Vec<u8> {
    let mut body = b"event: content_block_delta\ndata: ".to_vec();
    body.extend(std::iter::repeat_n(b'y', size));
    body.extend_from_slice(b"\n\n");
    body
}

/// One 4 MiB event, delivered in chunks of `chunk` bytes.
#[divan::bench(args = [64, 1024, 16 * 1024])]
fn one_large_event(bencher: Bencher, chunk: usize) {
    let body = big_event(4 << 20);
    bencher
        .counter(BytesCount::new(body.len()))
        .bench_local(|| {
            let mut parser = Parser::new(16 << 20);
            let mut out = VecDeque::new();
            for piece in body.chunks(chunk) {
                if parser.feed(piece, &mut out).is_err() {
                    panic!("refused");
                }
            }
            assert_eq!(out.len(), 1);
            out
        });
}

/// 10 000 small events in one chunk.
#[divan::bench]
fn many_small_events(bencher: Bencher) {
    let body = b"event: ping\ndata: {\"type\":\"ping\"}\n\n".repeat(10_000);
    bencher
        .counter(BytesCount::new(body.len()))
        .bench_local(|| {
            let mut parser = Parser::new(16 << 20);
            let mut out = VecDeque::new();
            if parser.feed(&body, &mut out).is_err() {
                panic!("refused");
            }
            assert_eq!(out.len(), 10_000);
            out
        });
}
