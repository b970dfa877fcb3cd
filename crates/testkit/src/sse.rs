//! Server-sent event streams as a test reads them back.
//!
//! ```
//! use markov_testkit::sse::events;
//! use serde_json::json;
//!
//! let stream = "event: step\ndata: {\"n\":1}\n\n: a comment\n\nevent: done\ndata: bye\n\n";
//! assert_eq!(
//!     events(stream),
//!     [("step".to_owned(), json!({"n": 1})), ("done".to_owned(), json!("bye"))]
//! );
//! ```

use serde_json::Value;

/// The `(event, data)` pairs of a server-sent event stream, in order: a
/// block's `data:` lines joined and read as JSON (as a JSON string when
/// they are not JSON); a block without an `event:` line (a comment, a
/// keep-alive) is left out.
pub fn events(stream: &str) -> Vec<(String, Value)> {
    stream
        .split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = Some(n.trim().to_owned());
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            let name = name?;
            let data = serde_json::from_str(&data).unwrap_or(Value::String(data));
            Some((name, data))
        })
        .collect()
}
