//! Figure 9: decoding a streamed answer. A recorded-like event stream for
//! each vendor — N text fragments, then a tool call whose arguments arrive
//! in 20 fragments — decoded by the client's own decoder
//! (`replay_stream`) into stream events and the final response, against
//! parsing each event's JSON once into a `serde_json::Value` (the least a
//! decoder can do).

use std::hint::black_box;
use std::time::{Duration, Instant};

use markov_core::{ModelError, StreamEvent};

use crate::Stats;

/// One vendor at one N.
#[derive(Debug)]
pub(crate) struct StreamFigure {
    pub(crate) vendor: &'static str,
    pub(crate) fragments: usize,
    pub(crate) events: usize,
    pub(crate) bytes: usize,
    pub(crate) decode: Stats,
    pub(crate) values: Stats,
}

impl StreamFigure {
    /// Nanoseconds per event, decoding.
    pub(crate) fn decode_ns_per_event(&self) -> f64 {
        self.decode.median_us * 1000.0 / self.events as f64
    }

    /// Decoding against parsing every event into a `Value`.
    pub(crate) fn decode_over_values(&self) -> f64 {
        self.decode.median_us / self.values.median_us
    }

    /// Decoding throughput in MB/s.
    pub(crate) fn decode_mb_per_s(&self) -> f64 {
        self.bytes as f64 / self.decode.median_us
    }
}

/// The argument fragments of the tool call.
const ARGUMENT_FRAGMENTS: usize = 20;

fn sse(out: &mut String, event: Option<&str>, data: &str) {
    if let Some(event) = event {
        out.push_str("event: ");
        out.push_str(event);
        out.push('\n');
    }
    out.push_str("data: ");
    out.push_str(data);
    out.push_str("\n\n");
}

/// The tool call's arguments, `{"text": "..."}`, cut into fragments.
fn argument_fragments() -> Vec<String> {
    let arguments = format!(r#"{{"text": "{}"}}"#, "lorem ipsum ".repeat(10));
    let step = arguments.len().div_ceil(ARGUMENT_FRAGMENTS);
    arguments
        .as_bytes()
        .chunks(step)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect()
}

/// An Anthropic Messages stream with `n` text fragments and a tool call.
pub(crate) fn anthropic_body(n: usize) -> String {
    let mut body = String::new();
    sse(
        &mut body,
        Some("message_start"),
        r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude","usage":{"input_tokens":25,"output_tokens":1}}}"#,
    );
    sse(
        &mut body,
        Some("content_block_start"),
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    // Keys in the API's order (`type` first), which `json!` would sort.
    for i in 0..n {
        let data = format!(
            r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"word{i} "}}}}"#
        );
        sse(&mut body, Some("content_block_delta"), &data);
    }
    sse(
        &mut body,
        Some("content_block_stop"),
        r#"{"type":"content_block_stop","index":0}"#,
    );
    sse(
        &mut body,
        Some("content_block_start"),
        r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"echo","input":{}}}"#,
    );
    for fragment in argument_fragments() {
        let data = format!(
            r#"{{"type":"content_block_delta","index":1,"delta":{{"type":"input_json_delta","partial_json":{}}}}}"#,
            serde_json::Value::String(fragment)
        );
        sse(&mut body, Some("content_block_delta"), &data);
    }
    sse(
        &mut body,
        Some("content_block_stop"),
        r#"{"type":"content_block_stop","index":1}"#,
    );
    sse(
        &mut body,
        Some("message_delta"),
        r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":40}}"#,
    );
    sse(
        &mut body,
        Some("message_stop"),
        r#"{"type":"message_stop"}"#,
    );
    body
}

/// A Chat Completions stream with `n` text fragments and a tool call.
pub(crate) fn openai_body(n: usize) -> String {
    let mut body = String::new();
    for i in 0..n {
        let data = serde_json::json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt",
            "choices": [{"index": 0, "delta": {"content": format!("word{i} ")}, "finish_reason": null}],
        });
        sse(&mut body, None, &data.to_string());
    }
    for (i, fragment) in argument_fragments().into_iter().enumerate() {
        let call = if i == 0 {
            serde_json::json!({"index": 0, "id": "call_1", "type": "function", "function": {"name": "echo", "arguments": fragment}})
        } else {
            serde_json::json!({"index": 0, "function": {"arguments": fragment}})
        };
        let data = serde_json::json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt",
            "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": null}],
        });
        sse(&mut body, None, &data.to_string());
    }
    sse(
        &mut body,
        None,
        r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":25,"completion_tokens":40,"total_tokens":65}}"#,
    );
    sse(&mut body, None, "[DONE]");
    body
}

type Replay = fn(&[u8]) -> Result<Vec<StreamEvent>, ModelError>;

/// A vendor: its name, its stream of N fragments, its decoder.
type Vendor = (&'static str, fn(usize) -> String, Replay);

fn vendors() -> [Vendor; 2] {
    [
        (
            "anthropic",
            anthropic_body,
            markov_providers::anthropic::replay_stream,
        ),
        (
            "openai",
            openai_body,
            markov_providers::openai::replay_stream,
        ),
    ]
}

/// Each event's `data`, parsed once into a `Value`.
fn parse_values(body: &str) -> usize {
    body.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .map(|value| black_box(value).is_object() as usize)
        .sum()
}

/// Both vendors at each N, `reps` timed decodings of each kind.
pub(crate) fn stream_figures(ns: &[usize], reps: usize) -> Vec<StreamFigure> {
    let mut figures = Vec::new();
    for &n in ns {
        for (vendor, body, replay) in vendors() {
            let body = body(n);
            let events = replay(body.as_bytes()).expect("the stream decodes");
            assert!(
                matches!(events.last(), Some(StreamEvent::Done(r)) if r.content.len() == 2),
                "the stream decodes to a text and a tool call"
            );
            let sse_events = body.matches("\n\n").count();
            let mut decode = Vec::with_capacity(reps);
            let mut values = Vec::with_capacity(reps);
            for _ in 0..reps {
                decode.push(time(|| {
                    black_box(replay(black_box(body.as_bytes())).ok());
                }));
                values.push(time(|| {
                    black_box(parse_values(black_box(&body)));
                }));
            }
            figures.push(StreamFigure {
                vendor,
                fragments: n,
                events: sse_events,
                bytes: body.len(),
                decode: Stats::of(&decode),
                values: Stats::of(&values),
            });
        }
    }
    figures
}

fn time(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// Decodes a stream of `n` fragments `reps` times, untimed: the workload to
/// profile (`markov-bench profile-stream <anthropic|openai> <N> <REPS>`).
pub(crate) fn profile(vendor: &str, n: usize, reps: usize) -> Result<(), String> {
    let (_, body, replay) = vendors()
        .into_iter()
        .find(|(name, _, _)| *name == vendor)
        .ok_or_else(|| format!("unknown vendor {vendor}"))?;
    let body = body(n);
    for _ in 0..reps {
        black_box(replay(black_box(body.as_bytes())).map_err(|e| e.to_string())?);
    }
    Ok(())
}
