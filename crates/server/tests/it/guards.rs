//! A guarded answer over real loopback HTTP: an answer the output guard
//! blocks mid-way reaches the SSE client only up to what the guard passed.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use markov_core::Item;
use markov_core::model::{
    Model, ModelError, ModelRequest, ModelResponse, StopReason, StreamEvent, collect_stream,
};
use markov_executor::Agent;
use markov_guard::{Guard, Guards, Hold, Verdict};
use serde_json::json;

use crate::http::{events, serve_agent};

/// A model whose calls stream scripted text pieces.
#[derive(Debug)]
struct Pieces(Mutex<Vec<Vec<&'static str>>>);

#[async_trait]
impl Model for Pieces {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        collect_stream(self.stream(request)).await
    }

    fn stream<'a>(&'a self, _: ModelRequest<'a>) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let mut calls = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let pieces = if calls.is_empty() {
            Vec::new()
        } else {
            calls.remove(0)
        };
        let mut events: Vec<Result<StreamEvent, ModelError>> = pieces
            .iter()
            .map(|p| {
                Ok(StreamEvent::TextDelta {
                    index: 0,
                    text: (*p).to_owned(),
                })
            })
            .collect();
        events.push(Ok(StreamEvent::Done(ModelResponse::new(
            vec![Item::text(pieces.concat())],
            StopReason::EndTurn,
        ))));
        stream::iter(events).boxed()
    }
}

/// Blocks a sentence with a card number in it.
#[derive(Debug)]
struct NoCards;

#[async_trait]
impl Guard for NoCards {
    fn name(&self) -> &str {
        "no-cards"
    }
    fn hold(&self) -> Hold {
        Hold::Sentence
    }
    async fn check(&self, text: &str) -> Verdict {
        if text.contains("4111") {
            Verdict::block("a card number")
        } else {
            Verdict::Pass
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_blocked_mid_way_sends_no_blocked_byte_to_the_sse_client() {
    let model = Pieces(Mutex::new(vec![
        vec![
            "Hello there. ",
            "Your card ",
            "is 4111 1111 ",
            "1111 1111",
            ". Bye.",
        ],
        vec!["All ", "good."],
    ]));
    let agent = Agent::builder("support")
        .instructions("Help.")
        .guards(Guards::new().output(NoCards))
        .model(model)
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, Arc::new(AtomicUsize::new(0))).await;
    let id = f.create().await;
    let response = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.key)
        .json(&json!({"text": "what is my card?"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    let raw = response.text().await.expect("the stream");
    // Not one byte of the blocked sentence, in any event.
    assert!(!raw.contains("4111") && !raw.contains("card is"), "{raw}");
    assert!(!raw.contains("Your card"), "{raw}");
    let events = events(&raw);
    let deltas: String = events
        .iter()
        .filter(|(name, _)| name == "delta")
        .filter_map(|(_, data)| data["text"].as_str())
        .collect();
    assert_eq!(deltas, "Hello there.");
    let blocked = events
        .iter()
        .find(|(name, data)| name == "step" && data["yield_reason"] == "blocked");
    assert!(blocked.is_some(), "a blocked step: {raw}");

    // The session takes the next message.
    let next = f.say(&id, "thanks").await;
    assert!(
        next.iter()
            .any(|(name, data)| name == "step" && data["yield_reason"] == "end_turn"),
        "{next:?}"
    );
}

/// Redacts card numbers sentence by sentence: the redaction is longer or
/// shorter than what it replaces.
#[derive(Debug)]
struct RedactCards;

#[async_trait]
impl Guard for RedactCards {
    fn name(&self) -> &str {
        "redact-cards"
    }
    fn hold(&self) -> Hold {
        Hold::Sentence
    }
    async fn check(&self, text: &str) -> Verdict {
        if text.contains("4111") || text.contains("ok") {
            Verdict::Rewrite(
                text.replace("4111 1111 1111 1111", "[CARD]")
                    .replace("ok", "understood, as asked"),
            )
        } else {
            Verdict::Pass
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_that_changes_a_pieces_length_streams_what_the_step_and_the_history_say() {
    let model = Pieces(Mutex::new(vec![vec![
        "Ok, ok. ",
        "Your card is 4111 1111 ",
        "1111 1111. Bye, ",
        "ok?",
    ]]));
    let agent = Agent::builder("support")
        .instructions("Help.")
        .guards(Guards::new().output(RedactCards))
        .model(model)
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, Arc::new(AtomicUsize::new(0))).await;
    let id = f.create().await;
    let raw = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.key)
        .json(&json!({"text": "what is my card?"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    assert!(!raw.contains("4111"), "{raw}");
    let events = events(&raw);
    let delivered: String = events
        .iter()
        .filter(|(name, _)| name == "delta")
        .filter_map(|(_, data)| data["text"].as_str())
        .collect();
    assert_eq!(
        delivered,
        "Ok, understood, as asked. Your card is [CARD]. Bye, understood, as asked?"
    );
    let step_text: String = events
        .iter()
        .filter(|(name, _)| name == "step")
        .flat_map(|(_, data)| data["messages"].as_array().cloned().unwrap_or_default())
        .filter(|m| m["role"] == "assistant")
        .flat_map(|m| m["items"].as_array().cloned().unwrap_or_default())
        .filter_map(|i| i["text"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(step_text, delivered, "the step shows what was streamed");
    let session: serde_json::Value = f
        .client
        .get(format!("{}/sessions/{id}", f.base))
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("the session");
    let kept = session["history"]
        .as_array()
        .and_then(|h| h.iter().find(|m| m["role"] == "assistant"))
        .map(|m| m["items"][0]["text"].clone());
    assert_eq!(kept, Some(json!(delivered)), "and the history keeps it");
}

/// A model that thinks (signed) before it answers, streaming both.
#[derive(Debug)]
struct Thinker {
    thoughts: Vec<&'static str>,
    answer: &'static str,
}

#[async_trait]
impl Model for Thinker {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        collect_stream(self.stream(request)).await
    }

    fn stream<'a>(&'a self, _: ModelRequest<'a>) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let mut events: Vec<Result<StreamEvent, ModelError>> = self
            .thoughts
            .iter()
            .map(|t| {
                Ok(StreamEvent::ThinkingDelta {
                    index: 0,
                    thinking: (*t).to_owned(),
                })
            })
            .collect();
        events.push(Ok(StreamEvent::TextDelta {
            index: 1,
            text: self.answer.to_owned(),
        }));
        events.push(Ok(StreamEvent::Done(ModelResponse::new(
            vec![
                Item::Thinking {
                    thinking: self.thoughts.concat(),
                    signature: Some("signed".into()),
                },
                Item::text(self.answer),
            ],
            StopReason::EndTurn,
        ))));
        stream::iter(events).boxed()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_a_guard_blocks_partway_streams_what_passed_and_the_step_shows_it_with_the_withheld_mark()
 {
    let thoughts = vec![
        "The user asks. ",
        "Their card is 4111 1111 1111 1111. ",
        "Answer briefly. ",
    ];
    let model = Thinker {
        thoughts: thoughts.clone(),
        answer: "I cannot show card numbers.",
    };
    let agent = Agent::builder("support")
        .instructions("Help.")
        .guards(Guards::new().output(NoCards))
        .model(model)
        .build()
        .expect("the agent builds");
    let store = Arc::new(markov_store::SqliteStore::in_memory().expect("a database"));
    let f = crate::http::start(
        markov_server::Server::builder()
            .agent(agent)
            .worker(markov_store::WorkerId::new("test")),
        Arc::clone(&store),
        Arc::new(AtomicUsize::new(0)),
    )
    .await;
    let id = f.create().await;
    let response = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.key)
        .json(&json!({"text": "what is my card?"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    let raw = response.text().await.expect("the stream");
    assert!(raw.contains("event: done"), "{raw}");
    assert!(
        !raw.contains("4111"),
        "no byte of the blocked thinking: {raw}"
    );
    assert!(raw.contains("I cannot show card numbers."), "{raw}");
    // What passed was streamed, up to the block; the step's message shows
    // the part as it was streamed, then the mark that the rest was
    // withheld, never the provider's signature.
    let events = events(&raw);
    let delivered: String = events
        .iter()
        .filter(|(name, _)| name == "thinking")
        .filter_map(|(_, data)| data["text"].as_str())
        .collect();
    assert_eq!(delivered, "The user asks.");
    let shown: Vec<serde_json::Value> = events
        .iter()
        .filter(|(name, _)| name == "step")
        .flat_map(|(_, data)| data["messages"].as_array().cloned().unwrap_or_default())
        .filter(|m| m["role"] == "assistant")
        .collect();
    assert_eq!(shown.len(), 1, "{raw}");
    assert_eq!(
        shown[0]["items"][0],
        json!({
            "type": "thinking",
            "thinking": format!("{delivered}\n\n{}", markov_executor::THINKING_WITHHELD),
        }),
        "what was streamed, then the mark: {raw}"
    );
    assert_eq!(shown[0]["items"][1]["text"], "I cannot show card numbers.");
    assert!(!raw.contains("\"signed\""), "{raw}");

    // Neither in what the page reads back.
    let shown = f
        .client
        .get(format!("{}/sessions/{id}", f.base))
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the session");
    assert!(!shown.contains("4111"), "{shown}");
    // Nor in the studio's steps, which its owner reads too.
    let steps: serde_json::Value = f
        .client
        .get(format!("{}/sessions/{id}/steps", f.base))
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("the steps");
    let answered = steps["steps"]
        .as_array()
        .expect("a page of steps")
        .iter()
        .any(|step| {
            step["messages"]
                .to_string()
                .contains("I cannot show card numbers.")
        });
    assert!(answered, "the step with the answer is shown: {steps}");
    assert!(!steps.to_string().contains("4111"), "{steps}");

    // The store keeps the thinking as the provider signed it.
    let session = markov_store::SessionId::new(id.clone());
    let stored = markov_store::Store::load(&*store, &session)
        .await
        .expect("the session loads");
    let kept = stored
        .snapshot
        .history
        .iter()
        .flat_map(|m| m.item_list().iter().cloned())
        .find(|i| matches!(i, Item::Thinking { .. }));
    assert_eq!(
        kept,
        Some(Item::Thinking {
            thinking: thoughts.concat(),
            signature: Some("signed".into()),
        })
    );
}
