//! The guard-stream figure: what holding streamed text back until the
//! output guards passed it adds to a streamed answer's latency.
//!
//! A model streams an answer of [`SENTENCES`] sentences of about 90
//! characters, in chunks of [`CHUNK`] characters, one every [`PACE`] (a
//! model writing about 200 tokens a second). The answer is streamed to a
//! callback three ways: unguarded; with `PiiRedactor` (held back per
//! sentence); with `PiiRedactor` and `MaxLength` (a length is judged on the
//! whole answer, so nothing streams before it is complete). For each, the
//! time from the model's first chunk to the first byte delivered, and per
//! sentence the time from the model's emitting its last character to the
//! callback's receiving it. Then, unpaced, the output guards' own time per
//! sentence (the stream's time with them minus without them, over the
//! sentences checked).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::async_trait;
use markov_core::message::Item;
use markov_core::model::{
    Model, ModelError, ModelRequest, ModelResponse, StopReason, StreamEvent, collect_stream,
};
use markov_executor::{Agent, MessageStreamEvent, StandardExecutor};
use markov_guard::{Guards, MaxLength, PiiRedactor};

/// Sentences per answer.
const SENTENCES: usize = 8;
/// Characters per streamed chunk (about one token).
const CHUNK: usize = 4;
/// The time between two chunks.
const PACE: Duration = Duration::from_millis(5);

/// One sentence of about 90 characters, with nothing a guard changes.
const SENTENCE: &str =
    "The quarterly report shows steady growth across all three regions, with costs held flat. ";

/// When each chunk of the answer was emitted: its end offset and instant.
type Emitted = Arc<Mutex<Vec<(usize, Instant)>>>;

/// A model that streams [`SENTENCES`] sentences, paced or not, noting when
/// each chunk left it.
#[derive(Debug)]
struct Paced {
    text: String,
    pace: Option<Duration>,
    emitted: Emitted,
}

#[async_trait]
impl Model for Paced {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        collect_stream(self.stream(request)).await
    }

    fn stream<'a>(&'a self, _: ModelRequest<'a>) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let chunks: Vec<(usize, String)> = self
            .text
            .as_bytes()
            .chunks(CHUNK)
            .scan(0, |end, chunk| {
                *end += chunk.len();
                Some((*end, String::from_utf8_lossy(chunk).into_owned()))
            })
            .collect();
        let done = ModelResponse::new(vec![Item::text(self.text.clone())], StopReason::EndTurn);
        let emitted = Arc::clone(&self.emitted);
        let pace = self.pace;
        let deltas = futures::stream::iter(chunks).then(move |(end, text)| {
            let emitted = Arc::clone(&emitted);
            async move {
                if let Some(pace) = pace {
                    tokio::time::sleep(pace).await;
                }
                emitted
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((end, Instant::now()));
                Ok(StreamEvent::TextDelta { index: 0, text })
            }
        });
        deltas
            .chain(futures::stream::once(
                async move { Ok(StreamEvent::Done(done)) },
            ))
            .boxed()
    }
}

/// The guards of a configuration.
fn guards(config: &str) -> Option<Guards> {
    match config {
        "pii" => Some(Guards::new().output(PiiRedactor::new())),
        "pii+max_length" => Some(
            Guards::new()
                .output(PiiRedactor::new())
                .output(MaxLength::new(4_000)),
        ),
        _ => None,
    }
}

/// What one streamed answer measured.
struct Streamed {
    /// The model's first chunk to the first byte delivered.
    first_byte: Duration,
    /// Per sentence: its last character emitted to its delivery.
    sentences: Vec<Duration>,
    /// The whole turn.
    total: Duration,
}

/// Streams one answer under `config`.
fn stream_once(
    runtime: &tokio::runtime::Runtime,
    config: &str,
    pace: Option<Duration>,
) -> Streamed {
    let text = SENTENCE.repeat(SENTENCES);
    let emitted: Emitted = Arc::default();
    let delivered: Arc<Mutex<Vec<(usize, Instant)>>> = Arc::default();
    let model = Paced {
        text: text.clone(),
        pace,
        emitted: Arc::clone(&emitted),
    };
    let seen = Arc::clone(&delivered);
    let mut executor = StandardExecutor::new(model);
    if let Some(guards) = guards(config) {
        executor = executor.with_guards(guards);
    }
    let executor = executor.with_streaming(move |event: &MessageStreamEvent| {
        if let MessageStreamEvent::Update { delta, .. } = event {
            let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
            let total = seen.last().map_or(0, |(n, _)| *n) + delta.delta.len();
            seen.push((total, Instant::now()));
        }
    });
    let node = Node::builder("Report.").build().expect("the node builds");
    let charter = Charter::builder("report")
        .node("main", node)
        .build()
        .expect("the charter builds");
    let agent = Agent::on_charter_with_executor(charter, Arc::new(executor))
        .build()
        .expect("the agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("The report, please.");
    let started = Instant::now();
    runtime
        .block_on(machine.run())
        .expect("the streamed turn runs");
    let total = started.elapsed();
    let emitted = emitted
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let delivered = delivered
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let first_emitted = emitted.first().map_or(started, |(_, at)| *at);
    let first_byte = delivered
        .first()
        .map_or(Duration::ZERO, |(_, at)| at.duration_since(first_emitted));
    let sentences = (1..=SENTENCES)
        .map(|i| {
            let end = SENTENCE.len() * i;
            // The sentence's end without its trailing space: the hold
            // releases it there.
            let end = end - 1;
            let made = emitted
                .iter()
                .find(|(n, _)| *n >= end)
                .map_or(first_emitted, |(_, at)| *at);
            let got = delivered
                .iter()
                .find(|(n, _)| *n >= end)
                .map_or(made, |(_, at)| *at);
            got.saturating_duration_since(made)
        })
        .collect();
    Streamed {
        first_byte,
        sentences,
        total,
    }
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values.get(values.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs the figure: `runs` paced answers per configuration, and
/// `unpaced` unpaced ones for the guards' own time. Prints one `bench=`
/// line per configuration.
pub(crate) fn figure(runs: usize, unpaced: usize) {
    let runtime = markov_bench::timed_runtime();
    println!(
        "guard-stream: {SENTENCES} sentences of {} characters, chunks of {CHUNK} every {} ms",
        SENTENCE.len(),
        PACE.as_millis()
    );
    let mut plain_unpaced = Duration::ZERO;
    for config in ["plain", "pii", "pii+max_length"] {
        let mut first = Vec::new();
        let mut per_sentence = Vec::new();
        let mut worst = Duration::ZERO;
        for _ in 0..runs {
            let streamed = stream_once(&runtime, config, Some(PACE));
            first.push(streamed.first_byte);
            worst = worst.max(streamed.sentences.iter().copied().max().unwrap_or_default());
            per_sentence.extend(streamed.sentences);
        }
        // Unpaced: the turn's time is the framework's and the guards'.
        let mut turns = Vec::new();
        for _ in 0..unpaced {
            turns.push(stream_once(&runtime, config, None).total);
        }
        let turn = median(turns);
        if config == "plain" {
            plain_unpaced = turn;
        }
        let guard_us_per_sentence =
            turn.saturating_sub(plain_unpaced).as_secs_f64() * 1e6 / SENTENCES as f64;
        println!(
            "bench=guard_stream guards={config} first_byte_ms={:.2} sentence_held_ms={:.2} sentence_held_max_ms={:.2} guard_us_per_sentence={:.1}",
            ms(median(first)),
            ms(median(per_sentence)),
            ms(worst),
            guard_us_per_sentence,
        );
    }
}
