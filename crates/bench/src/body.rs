//! Figure 8: building a provider's request body. A client sends the whole
//! conversation on every call; with its cache of encoded messages (the
//! history is append-only) a body should cost about a copy of its bytes.
//! Measured without a network, for both vendors, at K tool steps: the
//! cached body of a step (two new messages since the previous call), the
//! plain body (`serde_json::to_vec` of the whole request, every message
//! encoded), and a copy of the body's bytes into a new buffer.

use std::hint::black_box;
use std::time::{Duration, Instant};

use markov_core::model::HistoryId;
use markov_core::{Item, Message, ModelError, ModelRequest, ModelSettings, ToolDefinition};
use markov_providers::{Anthropic, OpenAi};
use serde_json::json;

use crate::Stats;

/// One vendor at one K.
#[derive(Debug)]
pub(crate) struct BodyFigure {
    pub(crate) vendor: &'static str,
    pub(crate) k: usize,
    pub(crate) messages: usize,
    pub(crate) bytes: usize,
    pub(crate) cached: Stats,
    pub(crate) plain: Stats,
    pub(crate) copy: Stats,
}

impl BodyFigure {
    /// The cached body against a copy of its bytes.
    pub(crate) fn cached_over_copy(&self) -> f64 {
        self.cached.median_us / self.copy.median_us
    }

    /// Nanoseconds per history message of the cached body.
    pub(crate) fn cached_ns_per_message(&self) -> f64 {
        self.cached.median_us * 1000.0 / self.messages as f64
    }

    /// Nanoseconds per history message of the plain body.
    pub(crate) fn plain_ns_per_message(&self) -> f64 {
        self.plain.median_us * 1000.0 / self.messages as f64
    }
}

/// The figure's scenario history (K >= 2): a user message, then K steps of an
/// assistant tool call and its result (cycling the three tools of figure 1).
pub(crate) fn history(k: usize) -> Vec<Message> {
    let mut history = Vec::with_capacity(2 * k + 1);
    history.push(Message::user("Please work through the list."));
    for i in 0..k {
        let id = format!("toolu_{i:08}");
        let (name, input, output) = match i % 3 {
            0 => ("add", json!({"a": i, "b": 2}), (i + 2).to_string()),
            1 => ("echo", json!({"text": "hello"}), "hello".to_owned()),
            _ => ("lookup", json!({"key": "k"}), "a constant value".to_owned()),
        };
        history.push(Message::assistant_items(vec![Item::tool_use(
            id.as_str(),
            name,
            input,
        )]));
        history.push(Message::user_items(vec![Item::tool_result(
            id.as_str(),
            output,
            Some(false),
        )]));
    }
    history
}

fn tools() -> Vec<ToolDefinition> {
    ["add", "echo", "lookup"]
        .into_iter()
        .filter_map(|name| {
            ToolDefinition::new(
                name,
                "A tool of the scenario.",
                json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
            )
            .ok()
        })
        .collect()
}

type Encode<'c> = Box<dyn Fn(&ModelRequest<'_>) -> Result<Vec<u8>, ModelError> + 'c>;

/// Both vendors' figures at each K, `reps` timed calls of each kind.
pub(crate) fn body_figures(ks: &[usize], reps: usize) -> Vec<BodyFigure> {
    let anthropic = Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("the client builds");
    let openai = OpenAi::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("the client builds");
    let vendors: [(&str, Encode<'_>, Encode<'_>); 2] = [
        (
            "anthropic",
            Box::new(|r| anthropic.request_body(r, false)),
            Box::new(|r| anthropic.request_body_uncached(r, false)),
        ),
        (
            "openai",
            Box::new(|r| openai.request_body(r, false)),
            Box::new(|r| openai.request_body_uncached(r, false)),
        ),
    ];
    let settings = ModelSettings::default();
    let tools = tools();
    let mut figures = Vec::new();
    for &k in ks {
        let history = history(k);
        let request = |len: usize| {
            ModelRequest::new("You work through lists.", &history[..len], &settings)
                .with_tools(&tools)
        };
        for (vendor, cached, plain) in &vendors {
            let full = history.len();
            let body = plain(&request(full)).expect("the body encodes");
            let cached_body = {
                let id = HistoryId::fresh();
                cached(&request(full - 2).with_history_id(id)).expect("the body encodes");
                cached(&request(full).with_history_id(id)).expect("the body encodes")
            };
            assert_eq!(body, cached_body, "the cached body is the plain body");
            let mut cached_times = Vec::with_capacity(reps);
            let mut plain_times = Vec::with_capacity(reps);
            let mut copy_times = Vec::with_capacity(reps);
            for _ in 0..reps {
                // A step in a run: the two calls before it sent all but the
                // last four and all but the last two messages under this
                // history's id (the first of them encodes everything).
                let id = HistoryId::fresh();
                for earlier in [full - 4, full - 2] {
                    black_box(cached(&request(earlier).with_history_id(id)).ok());
                }
                let step = request(full).with_history_id(id);
                cached_times.push(time(|| black_box(cached(&step)).ok()));
                let whole = request(full);
                plain_times.push(time(|| black_box(plain(&whole)).ok()));
                copy_times.push(time(|| Some(black_box(black_box(&body).to_vec()))));
            }
            figures.push(BodyFigure {
                vendor,
                k,
                messages: full,
                bytes: body.len(),
                cached: Stats::of(&cached_times),
                plain: Stats::of(&plain_times),
                copy: Stats::of(&copy_times),
            });
        }
    }
    figures
}

fn time<T>(f: impl FnOnce() -> Option<T>) -> Duration {
    let start = Instant::now();
    let out = f();
    let elapsed = start.elapsed();
    drop(black_box(out));
    elapsed
}

/// Builds the bodies of `reps` steps after K = `k`, untimed: the workload to
/// profile (`markov-bench profile-body <VENDOR> <K> <REPS> [plain]`);
/// `plain` encodes every message of every body, as before the cache.
pub(crate) fn profile(vendor: &str, k: usize, reps: usize, plain: bool) -> Result<(), String> {
    let (cached, uncached): (Encode<'_>, Encode<'_>) = match vendor {
        "anthropic" => {
            let client = Anthropic::builder()
                .base_url("http://127.0.0.1:1")
                .build()
                .map_err(|e| e.to_string())?;
            let other = client.clone();
            (
                Box::new(move |r| client.request_body(r, false)),
                Box::new(move |r| other.request_body_uncached(r, false)),
            )
        }
        "openai" => {
            let client = OpenAi::builder()
                .base_url("http://127.0.0.1:1")
                .build()
                .map_err(|e| e.to_string())?;
            let other = client.clone();
            (
                Box::new(move |r| client.request_body(r, false)),
                Box::new(move |r| other.request_body_uncached(r, false)),
            )
        }
        other => return Err(format!("unknown vendor {other}")),
    };
    let settings = ModelSettings::default();
    let tools = tools();
    let history = history(k + reps);
    let id = HistoryId::fresh();
    for len in (2 * k + 1..=history.len()).step_by(2) {
        let request = ModelRequest::new("You work through lists.", &history[..len], &settings)
            .with_tools(&tools)
            .with_history_id(id);
        let body = if plain {
            uncached(&request)
        } else {
            cached(&request)
        };
        black_box(body.ok());
    }
    Ok(())
}
