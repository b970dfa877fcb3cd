//! Long conversations through real clients against the fake APIs: under a
//! context policy every request of 500 turns is a valid request of its
//! vendor and stays within a budget, and a context-length refusal — in
//! the words of Anthropic and of llama.cpp's server — is compacted and
//! answered, or ends the run with a reason that says what to set; a
//! summarized view keeps roles alternating on the wire.
#![cfg(all(feature = "anthropic", feature = "openai"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use expect_test::expect;
use markov_charter::context::{ContextPolicy, Summarize};
use markov_core::Model;
use markov_executor::{Agent, Machine, YieldReason};
use markov_providers::{Anthropic, OpenAi};
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic, openai};
use serde_json::{Value, json};

/// Looks something up (its answer is long, so old ones are worth trimming).
#[markov_core::tool]
async fn look_up(
    /// What to look up.
    topic: String,
) -> String {
    format!("{topic}: {}", "a long and detailed entry. ".repeat(20))
}

const TURNS: usize = 500;

/// The most a request's body may hold, in bytes: the system prompt and
/// tool, and the kept turns with their stubs.
const BUDGET_BYTES: usize = 12_000;

fn policy() -> ContextPolicy {
    ContextPolicy::builder()
        .keep_last_turns(6)
        .trim_tool_results(2)
        .build()
        .expect("a valid policy")
}

fn agent(model: impl Model + 'static, policy: Option<ContextPolicy>) -> Agent {
    let mut builder = Agent::builder("librarian")
        .instructions("You look things up.")
        .tool(LookUp)
        .model(model);
    if let Some(policy) = policy {
        builder = builder.context_policy(policy);
    }
    builder.build().expect("agent builds")
}

fn anthropic_client(server: &FakeServer) -> Anthropic {
    Anthropic::builder()
        .api_key("sk-ant-context-test")
        .base_url(server.base_url())
        .model("claude-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

fn openai_client(server: &FakeServer) -> OpenAi {
    OpenAi::builder()
        .api_key("sk-proj-context-test")
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

async fn converse(machine: &mut Machine, turns: usize) {
    for n in 0..turns {
        machine.enqueue_user(format!("Tell me about topic {n}."));
        let last = machine.run().await.expect("the turn runs");
        assert_eq!(last.yield_reason, YieldReason::EndTurn, "turn {n}");
    }
}

/// Checks a Messages API body: the first message is the user's, roles
/// alternate, each `tool_use` is answered in the next message and each
/// `tool_result` answers a call of the message before.
fn assert_valid_anthropic(body: &Value) {
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(messages[0]["role"], "user");
    for pair in messages.windows(2) {
        assert_ne!(pair[0]["role"], pair[1]["role"], "roles alternate");
    }
    let blocks = |m: &Value, kind: &str, key: &str| -> Vec<String> {
        m["content"]
            .as_array()
            .map(|c| {
                c.iter()
                    .filter(|b| b["type"] == kind)
                    .map(|b| b[key].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    for (at, message) in messages.iter().enumerate() {
        let calls = blocks(message, "tool_use", "id");
        if !calls.is_empty() {
            let answered = messages
                .get(at + 1)
                .map(|next| blocks(next, "tool_result", "tool_use_id"))
                .unwrap_or_default();
            assert_eq!(calls, answered, "each call answered next");
        }
        let results = blocks(message, "tool_result", "tool_use_id");
        if !results.is_empty() {
            assert_eq!(results, blocks(&messages[at - 1], "tool_use", "id"));
        }
    }
}

/// Checks a Chat Completions body: the system prompt first, then a user
/// message; each call answered by the tool messages right after it, and
/// each tool message answering a call of the assistant message before.
fn assert_valid_openai(body: &Value) {
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages[1]["role"], "user");
    let mut open: Vec<String> = Vec::new();
    for message in messages {
        match message["role"].as_str() {
            Some("tool") => {
                let id = message["tool_call_id"].as_str().expect("a call id");
                let at = open.iter().position(|o| o == id);
                assert!(at.is_some(), "a result of an unknown call {id}");
                open.retain(|o| o != id);
            }
            role => {
                assert!(
                    open.is_empty(),
                    "calls unanswered before a {role:?} message"
                );
                if let Some(calls) = message["tool_calls"].as_array() {
                    open = calls
                        .iter()
                        .map(|c| c["id"].as_str().unwrap_or_default().to_owned())
                        .collect();
                }
            }
        }
    }
    assert!(open.is_empty());
}

/// The last message of a body is tool results (the model answers them
/// with text), or not (the model calls the tool).
fn answers_results(request: &Recorded) -> bool {
    let last = request.body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or(Value::Null);
    last["role"] == "tool"
        || last["content"]
            .as_array()
            .is_some_and(|c| c.iter().any(|b| b["type"] == "tool_result"))
}

#[tokio::test]
async fn five_hundred_turns_stay_within_the_budget_with_valid_anthropic_requests() {
    let server = FakeServer::start().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    server.answer_with(move |request| {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        if answers_results(request) {
            Reply::json(200, anthropic::text("Here is what I found."))
        } else {
            let id = format!("toolu_{n}");
            Reply::json(
                200,
                anthropic::tool_use(&id, "look_up", &json!({"topic": format!("t{n}")})),
            )
        }
    });
    let mut machine = agent(anthropic_client(&server), Some(policy())).machine();
    converse(&mut machine, TURNS).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 2 * TURNS);
    for request in &requests {
        assert_valid_anthropic(&request.body);
        let size = request.body.to_string().len();
        assert!(size < BUDGET_BYTES, "{size} bytes");
    }
    // The history has every turn.
    assert_eq!(machine.history().len(), 4 * TURNS);
    // Old results are stubs that name what was left out.
    let last = requests.last().unwrap().body.to_string();
    assert!(
        last.contains("[Result left out of the context: look_up, call toolu_"),
        "{last}"
    );
}

#[tokio::test]
async fn five_hundred_turns_stay_within_the_budget_with_valid_openai_requests() {
    let server = FakeServer::start().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    server.answer_with(move |request| {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        if answers_results(request) {
            Reply::json(200, openai::text("Here is what I found."))
        } else {
            let id = format!("call_{n}");
            Reply::json(
                200,
                openai::tool_call(&id, "look_up", &json!({"topic": format!("t{n}")})),
            )
        }
    });
    let mut machine = agent(openai_client(&server), Some(policy())).machine();
    converse(&mut machine, TURNS).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 2 * TURNS);
    for request in &requests {
        assert_valid_openai(&request.body);
        let size = request.body.to_string().len();
        assert!(size < BUDGET_BYTES, "{size} bytes");
    }
    assert_eq!(machine.history().len(), 4 * TURNS);
}

fn too_long_for_anthropic() -> Reply {
    Reply::json(
        400,
        anthropic::error(
            "invalid_request_error",
            "prompt is too long: 210000 tokens > 200000 maximum",
        ),
    )
}

fn too_long_for_llama_cpp() -> Reply {
    Reply::json(
        400,
        json!({"error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 5000,
            "n_ctx": 4096
        }}),
    )
}

#[tokio::test]
async fn an_anthropic_refusal_is_compacted_and_answered_with_a_policy() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, anthropic::text("First answer.")),
        too_long_for_anthropic(),
        Reply::json(200, anthropic::text("Second answer.")),
    ])
    .await;
    let policy = ContextPolicy::builder()
        .keep_last_turns(20)
        .build()
        .unwrap();
    let mut machine = agent(anthropic_client(&server), Some(policy)).machine();
    converse(&mut machine, 2).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    // The retry sends the current turn only.
    let retried = &requests[2].body["messages"];
    assert_eq!(retried.as_array().map(Vec::len), Some(1));
    assert_eq!(retried[0]["content"][0]["text"], "Tell me about topic 1.");
    assert_valid_anthropic(&requests[2].body);
}

#[tokio::test]
async fn a_llama_cpp_refusal_is_compacted_and_answered_with_a_policy() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, openai::text("First answer.")),
        too_long_for_llama_cpp(),
        Reply::json(200, openai::text("Second answer.")),
    ])
    .await;
    let policy = ContextPolicy::builder()
        .keep_last_turns(20)
        .build()
        .unwrap();
    let mut machine = agent(openai_client(&server), Some(policy)).machine();
    converse(&mut machine, 2).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    let retried = requests[2].body["messages"].as_array().unwrap().clone();
    assert_eq!(retried.len(), 2, "the system prompt and the question");
    assert_eq!(retried[1]["content"], "Tell me about topic 1.");
}

#[tokio::test]
async fn without_a_policy_a_refusal_ends_the_run_and_the_session_goes_on() {
    let server = FakeServer::scripted(vec![
        too_long_for_llama_cpp(),
        Reply::json(200, openai::text("Answered.")),
    ])
    .await;
    let mut machine = agent(openai_client(&server), None).machine();
    machine.enqueue_user("A question.");
    let step = machine.run().await.expect("a step, not an error");
    assert_eq!(step.yield_reason, YieldReason::ContextExhausted);
    assert!(step.done);
    // The refusal was not retried (the same request would fail again).
    assert_eq!(server.requests().len(), 1);
    machine.enqueue_user("Another.");
    let step = machine.run().await.expect("runs");
    assert_eq!(step.yield_reason, YieldReason::EndTurn);
}

#[tokio::test]
async fn an_unknown_model_is_asked_for_fewer_tokens_than_a_small_context() {
    let server = FakeServer::scripted(vec![Reply::json(200, openai::text("Hi."))]).await;
    let mut machine = agent(openai_client(&server), None).machine();
    converse(&mut machine, 1).await;
    let body = &server.single().body;
    let asked = body["max_completion_tokens"]
        .as_u64()
        .or_else(|| body["max_tokens"].as_u64())
        .expect("a token limit");
    assert_eq!(asked, 2_048);
}

/// Chat templates that insist on alternating roles (llama.cpp's, say)
/// take a compacted view as it is: the summary is the first text of the
/// first user message, never a user message of its own before it.
#[tokio::test]
async fn a_summarized_view_alternates_roles_on_the_chat_completions_wire() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, openai::text("First answer.")),
        Reply::json(
            200,
            openai::tool_call("call_1", "look_up", &json!({"topic": "t1"})),
        ),
        Reply::json(200, openai::text("Here.")),
    ])
    .await;
    let summarizer = Arc::new(
        markov_testkit::ScriptedModel::builder()
            .text("The user asked about topic 0.")
            .build(),
    );
    let policy = ContextPolicy::builder()
        .summarize(Summarize::new(summarizer as Arc<dyn Model>, 20).keep_last_turns(1))
        .build()
        .unwrap();
    let mut machine = agent(openai_client(&server), Some(policy)).machine();
    converse(&mut machine, 2).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    for request in &requests {
        assert_valid_openai(&request.body);
        let roles: Vec<&str> = request.body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["role"].as_str())
            .filter(|r| *r != "tool")
            .collect();
        assert!(
            roles.windows(2).all(|w| w[0] != w[1]),
            "roles alternate: {roles:?}"
        );
    }
    let mut last = requests[2].body["messages"].clone();
    // The tool's long answer is not the point here.
    last[3]["content"] = json!("…");
    expect![[r#"
        [
          {
            "content": "You look things up.",
            "role": "system"
          },
          {
            "content": [
              {
                "text": "[Summary of the earlier conversation, whose messages are left out here]\n\nThe user asked about topic 0.",
                "type": "text"
              },
              {
                "text": "Tell me about topic 1.",
                "type": "text"
              }
            ],
            "role": "user"
          },
          {
            "role": "assistant",
            "tool_calls": [
              {
                "function": {
                  "arguments": "{\"topic\":\"t1\"}",
                  "name": "look_up"
                },
                "id": "call_1",
                "type": "function"
              }
            ]
          },
          {
            "content": "…",
            "role": "tool",
            "tool_call_id": "call_1"
          }
        ]"#]].assert_eq(&serde_json::to_string_pretty(&last).unwrap());
}
