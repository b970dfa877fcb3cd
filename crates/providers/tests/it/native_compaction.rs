//! OpenAI's native compaction through the real Responses client against
//! the fake API: a long conversation under `Summarize::native` compacts
//! once per crossing of the threshold, the next request sends the
//! compaction's items verbatim in place of the turns they stand for, the
//! compaction call counts in usage, a restored session sends the same
//! body, and no other client — Anthropic's, another Responses server's —
//! ever receives the items.
#![cfg(all(feature = "anthropic", feature = "responses"))]

use std::sync::Arc;
use std::time::Duration;

use expect_test::expect;
use markov_charter::context::{ContextPolicy, Summarize};
use markov_core::{Message, Model, Role};
use markov_executor::{Agent, BuildError, Machine, YieldReason, serialize_machine};
use markov_providers::{Anthropic, Fallback, Responses};
use markov_testkit::ScriptedModel;
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic, responses};
use serde_json::Value;

/// The estimated tokens past which the view is compacted.
const THRESHOLD: u64 = 900;

/// How many turns the first conversation has.
const TURNS: usize = 24;

/// The model's long answer: about 200 estimated tokens a turn.
fn answer(n: usize) -> String {
    format!(
        "About topic {n}: {}",
        "a long and careful answer. ".repeat(22)
    )
}

/// A fake Responses API: compactions answered as OpenAI shapes them
/// (`responses::compacted`), calls with the long answer of the turn the
/// request's last user message asks about.
fn responses_server(server: &FakeServer) {
    server.answer_with(|request| {
        if request.path.ends_with("/responses/compact") {
            return Reply::json(200, responses::compacted(&request.body));
        }
        let asked = last_user_text(&request.body["input"]);
        let n: usize = asked
            .trim_start_matches("Topic ")
            .trim_end_matches('?')
            .parse()
            .unwrap_or(0);
        Reply::json(200, responses::text(&answer(n)))
    });
}

/// The text of the last user message of an `input` array.
fn last_user_text(input: &Value) -> String {
    input
        .as_array()
        .and_then(|items| items.iter().rev().find(|i| i["role"] == "user"))
        .and_then(|i| i["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

fn client(server: &FakeServer) -> Responses {
    Responses::builder()
        .api_key("sk-proj-compaction-test")
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

fn native_policy(model: Arc<dyn Model>) -> ContextPolicy {
    ContextPolicy::builder()
        .summarize(Summarize::native(model, THRESHOLD).keep_last_turns(2))
        .build()
        .expect("a valid policy")
}

fn librarian(model: Arc<dyn Model>, policy: Option<ContextPolicy>) -> Result<Agent, BuildError> {
    let mut builder = Agent::builder("librarian")
        .instructions("You answer at length.")
        .shared_model(model);
    if let Some(policy) = policy {
        builder = builder.context_policy(policy);
    }
    builder.build()
}

async fn converse(machine: &mut Machine, turns: std::ops::Range<usize>) {
    for n in turns {
        machine.enqueue_user(format!("Topic {n}?"));
        let last = machine.run().await.expect("the turn runs");
        assert_eq!(last.yield_reason, YieldReason::EndTurn, "turn {n}");
    }
}

/// `C` for a compaction, `R` for a call, in the order they came.
fn sequence(requests: &[Recorded]) -> String {
    requests
        .iter()
        .map(|r| {
            if r.path.ends_with("/responses/compact") {
                'C'
            } else {
                assert_eq!(r.path, "/v1/responses");
                'R'
            }
        })
        .collect()
}

/// A Responses body is valid as markov sends it: a non-empty input whose
/// items all have a type, at most one compaction item, and only before the
/// first item that is not part of a compaction's output.
fn assert_valid_responses(body: &Value) {
    let input = body["input"].as_array().expect("an input array");
    assert!(!input.is_empty());
    assert!(input.iter().all(|i| i["type"].is_string()), "{body}");
    let compactions: Vec<usize> = (0..input.len())
        .filter(|&at| input[at]["type"] == "compaction")
        .collect();
    assert!(compactions.len() <= 1, "one compaction at most: {body}");
    if let Some(&at) = compactions.first() {
        assert!(
            input[..at].iter().all(|i| i["role"] == "user"),
            "only the kept user messages come before it"
        );
    }
    assert_eq!(input.last().map(|i| &i["role"]), Some(&Value::from("user")));
}

#[tokio::test]
async fn a_long_conversation_is_compacted_once_per_crossing_and_sends_the_items_verbatim() {
    let server = FakeServer::start().await;
    responses_server(&server);
    let model: Arc<dyn Model> = Arc::new(client(&server));
    let agent = librarian(Arc::clone(&model), Some(native_policy(model))).expect("agent builds");
    let mut machine = agent.machine();
    converse(&mut machine, 0..TURNS).await;
    let requests = server.requests();

    // Once per crossing: a compaction, then calls until the view has grown
    // past the threshold again, never two compactions in a row.
    expect!["RRRRRCRRRCRRRCRRRCRRCRRCRRCRRCRR"].assert_eq(&sequence(&requests));
    let compactions: Vec<&Recorded> = requests
        .iter()
        .filter(|r| r.path.ends_with("/responses/compact"))
        .collect();
    let summaries: Vec<&Message> = machine
        .history()
        .iter()
        .filter(|m| m.role == Role::Summary)
        .collect();
    assert_eq!(summaries.len(), compactions.len());
    // The history is whole: every turn, then the summaries beside them.
    assert_eq!(machine.history().len(), 2 * TURNS + summaries.len());

    for request in requests.iter().filter(|r| r.path == "/v1/responses") {
        assert_valid_responses(&request.body);
    }

    // The call after the first compaction sends its items verbatim first,
    // then the turns kept, then the new question.
    let first = requests
        .iter()
        .position(|r| r.path.ends_with("/responses/compact"))
        .expect("a compaction");
    let answered = responses::compacted(&requests[first].body);
    let next = &requests[first + 1].body;
    let output = answered["output"].as_array().expect("items");
    assert_eq!(
        &next["input"].as_array().expect("input")[..output.len()],
        &output[..]
    );
    expect![[r#"
        {
          "input": [
            {
              "content": "Topic 0?",
              "role": "user",
              "type": "message"
            },
            {
              "content": "Topic 1?",
              "role": "user",
              "type": "message"
            },
            {
              "content": "Topic 2?",
              "role": "user",
              "type": "message"
            },
            {
              "content": "Topic 3?",
              "role": "user",
              "type": "message"
            },
            {
              "encrypted_content": "enc:8-items",
              "id": "cmp_8",
              "type": "compaction"
            },
            {
              "content": "Topic 4?",
              "role": "user",
              "type": "message"
            },
            {
              "content": "About topic 4: a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. a long and careful answer. ",
              "role": "assistant",
              "type": "message"
            },
            {
              "content": "Topic 5?",
              "role": "user",
              "type": "message"
            }
          ],
          "instructions": "You answer at length.",
          "max_output_tokens": 2048,
          "model": "gpt-test",
          "prompt_cache_key": "<view>",
          "store": false
        }"#]]
    .assert_eq(&shown(next));

    // The compaction was sent the turns it stands for, as a call shows
    // them, with the instructions and nothing else.
    let compact = &requests[first].body;
    assert_eq!(compact["model"], "gpt-test");
    assert_eq!(compact["instructions"], "You answer at length.");
    let keys: Vec<&String> = compact.as_object().expect("an object").keys().collect();
    assert_eq!(keys, ["input", "instructions", "model"]);
    // A later compaction folds the earlier one's items in.
    let second = requests
        .iter()
        .skip(first + 1)
        .find(|r| r.path.ends_with("/responses/compact"))
        .expect("a second compaction");
    assert!(
        second.body["input"]
            .as_array()
            .expect("input")
            .iter()
            .any(|i| i == output.last().expect("the compaction item")),
        "the earlier compaction is compacted again"
    );

    // Usage counts every request, the compactions included.
    let usage = &machine.usage().session;
    assert_eq!(usage.requests, requests.len() as u64);
    // The fake reports 100 fresh and 20 cached input tokens, 30 output.
    assert_eq!(usage.input_tokens, 100 * requests.len() as u64);
    assert_eq!(usage.output_tokens, 30 * requests.len() as u64);
}

/// `body` pretty-printed, its prompt cache key (the view's fresh id)
/// written as `<view>`.
fn shown(body: &Value) -> String {
    let mut body = body.clone();
    if body.get("prompt_cache_key").is_some() {
        body["prompt_cache_key"] = Value::from("<view>");
    }
    serde_json::to_string_pretty(&body).expect("json")
}

/// The input of a recorded call, without its cache key.
fn input(request: &Recorded) -> (Value, Value) {
    (
        request.body["instructions"].clone(),
        request.body["input"].clone(),
    )
}

#[tokio::test]
async fn a_restored_session_sends_the_same_body_and_other_clients_never_get_the_items() {
    let server = FakeServer::start().await;
    responses_server(&server);
    let model: Arc<dyn Model> = Arc::new(client(&server));
    let agent = librarian(Arc::clone(&model), Some(native_policy(model))).expect("agent builds");
    let mut machine = agent.machine();
    converse(&mut machine, 0..7).await;
    assert!(
        machine.history().iter().any(|m| m.role == Role::Summary),
        "compacted"
    );
    let snapshot =
        serde_json::to_string(&serialize_machine(&machine).expect("serializes")).expect("json");

    // The same next turn, in the machine and in its restored copy.
    let before = server.requests().len();
    converse(&mut machine, 7..8).await;
    let original = server.requests()[before..].to_vec();
    let mut restored = agent
        .restore(serde_json::from_str(&snapshot).expect("reads"))
        .expect("restores");
    let before = server.requests().len();
    converse(&mut restored, 7..8).await;
    let again = server.requests()[before..].to_vec();
    assert_eq!(original.len(), 1, "no compaction on this turn");
    assert_eq!(again.len(), 1);
    assert_eq!(input(&original[0]), input(&again[0]));
    assert!(original[0].body.to_string().contains("enc:"));

    // Anthropic, on the same session, is shown the turns themselves.
    let other = FakeServer::start().await;
    other.answer_with(|_| Reply::json(200, anthropic::text("Noted.")));
    let claude: Arc<dyn Model> = Arc::new(
        Anthropic::builder()
            .api_key("sk-ant-compaction-test")
            .base_url(other.base_url())
            .model("claude-test")
            .build()
            .expect("a valid client"),
    );
    let summarizer = Arc::new(
        ScriptedModel::builder()
            .text("They spoke of topics.")
            .build(),
    );
    let text_policy = ContextPolicy::builder()
        .summarize(Summarize::new(summarizer, 100_000))
        .build()
        .expect("a valid policy");
    for policy in [None, Some(text_policy)] {
        let foreign = librarian(Arc::clone(&claude), policy).expect("agent builds");
        let mut moved = foreign
            .restore(serde_json::from_str(&snapshot).expect("reads"))
            .expect("restores");
        converse(&mut moved, 7..8).await;
    }
    // A Responses client of another server reads its own items only.
    let third = FakeServer::start().await;
    responses_server(&third);
    let elsewhere: Arc<dyn Model> = Arc::new(client(&third));
    let own = librarian(Arc::clone(&elsewhere), Some(native_policy(elsewhere))).expect("builds");
    let mut moved = own
        .restore(serde_json::from_str(&snapshot).expect("reads"))
        .expect("restores");
    converse(&mut moved, 7..8).await;
    // Its first request (a compaction of its own: the whole turns are
    // past the threshold) and Anthropic's two carry the turns themselves.
    let sent: Vec<Recorded> = other
        .requests()
        .into_iter()
        .chain(third.requests().into_iter().take(1))
        .collect();
    assert_eq!(sent.len(), 3);
    for request in &sent {
        let body = request.body.to_string();
        assert!(!body.contains("enc:") && !body.contains("cmp_"), "{body}");
        assert!(body.contains("Topic 0?"), "the turns themselves: {body}");
    }
}

#[tokio::test]
async fn native_compaction_that_cannot_serve_the_model_fails_when_the_agent_is_built() {
    let server = FakeServer::start().await;
    let openai: Arc<dyn Model> = Arc::new(client(&server));
    let claude: Arc<dyn Model> = Arc::new(
        Anthropic::builder()
            .api_key("sk-ant-compaction-test")
            .base_url(server.base_url())
            .build()
            .expect("a valid client"),
    );
    // Anthropic has no compaction of its own.
    let err = librarian(
        Arc::clone(&claude),
        Some(native_policy(Arc::clone(&claude))),
    )
    .expect_err("refused");
    assert!(
        matches!(&err, BuildError::NativeCompaction { makes: None, .. }),
        "{err}"
    );
    // OpenAI's items, read by Anthropic.
    let err = librarian(
        Arc::clone(&claude),
        Some(native_policy(Arc::clone(&openai))),
    )
    .expect_err("refused");
    assert!(
        matches!(&err, BuildError::NativeCompaction { makes: Some(m), reads: None, .. } if m.starts_with("openai.responses@127.0.0.1:")),
        "{err}"
    );
    // A fallback across vendors reads none: a request may reach either.
    let mixed = Fallback::new(Arc::clone(&openai)).or(Arc::clone(&claude));
    assert_eq!(mixed.native_summaries(), None);
    let err =
        librarian(Arc::new(mixed), Some(native_policy(Arc::clone(&openai)))).expect_err("refused");
    assert!(matches!(err, BuildError::NativeCompaction { .. }), "{err}");
    // Two clients of the same server read each other's items.
    let same = Fallback::new(Arc::clone(&openai)).or(Arc::new(client(&server)));
    assert_eq!(same.native_summaries(), openai.native_summaries());
    assert!(librarian(Arc::new(same), Some(native_policy(openai))).is_ok());
    assert!(server.requests().is_empty(), "nothing was called");
}
