//! A whole machine run through the OpenAI-compatible client against the
//! fake Chat Completions server: a typed tool, the terminal `respond` tool,
//! then on a second turn `finish`, once with complete answers and once with
//! event streams. The replies follow the shapes in OpenAI's public API
//! documentation.
#![cfg(feature = "openai")]

use std::time::Duration;

use crate::common::machine::{
    ANSWER, QUESTION, THANKS, add_args, finish_args, respond_args, turn, two_turns,
};
use markov_providers::OpenAi;
use markov_testkit::http::{FakeServer, Recorded, Reply, openai};
use serde_json::{Value, json};

fn client(server: &FakeServer) -> OpenAi {
    OpenAi::builder()
        .api_key("sk-proj-machine-test")
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

/// The scripted calls, in order: `add`, `respond`, then (second turn) `finish`.
fn calls() -> [(&'static str, &'static str, Value); 3] {
    [
        ("call_add", "add", add_args()),
        ("call_respond", "respond", respond_args()),
        ("call_finish", "finish", finish_args()),
    ]
}

/// The `tool` role messages of a request body: (tool_call_id, content text).
fn tool_results(body: &Value) -> Vec<(String, String)> {
    body["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            let content = match &m["content"] {
                Value::String(text) => text.clone(),
                Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
                other => panic!("unexpected tool content {other}"),
            };
            (
                m["tool_call_id"].as_str().expect("tool_call_id").to_owned(),
                content,
            )
        })
        .collect()
}

/// The tool call ids the request sends back in assistant messages.
fn tool_call_ids(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "assistant")
        .filter_map(|m| m["tool_calls"].as_array())
        .flatten()
        .map(|c| c["id"].as_str().expect("id").to_owned())
        .collect()
}

/// Checks what every recorded request carried, and what each one sent back.
fn check_requests(requests: &[Recorded], streamed: bool) {
    assert_eq!(requests.len(), 3, "one model call per scripted answer");
    for request in requests {
        assert_eq!(request.method, "POST");
        assert_eq!(request.path, "/v1/chat/completions");
        let body = request.body.clone();
        assert_eq!(body["model"], "gpt-test");
        assert_eq!(body["stream"].as_bool().unwrap_or(false), streamed);
        if streamed {
            assert_eq!(body["stream_options"], json!({"include_usage": true}));
        }
        let tools: Vec<&str> = body["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .map(|t| {
                assert_eq!(t["type"], "function");
                t["function"]["name"].as_str().expect("tool name")
            })
            .collect();
        assert!(
            !tools.contains(&"updateState"),
            "a node without state is offered updateState: {tools:?}"
        );
        for name in ["add", "respond", "finish"] {
            assert!(tools.contains(&name), "{name} missing from {tools:?}");
        }
        let system = &body["messages"][0];
        assert_eq!(system["role"], "system");
        let system = system["content"].as_str().expect("system text");
        assert!(
            system.contains("## Terminal Tools"),
            "no terminal tools section in {system}"
        );
        assert!(system.contains("respond"), "{system}");
        assert!(system.contains("You do arithmetic with your tools."));
    }

    let first = requests[0].body.clone();
    let messages = first["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 2, "system and user: {messages:?}");
    assert_eq!(messages[1]["role"], "user");
    assert!(messages[1].to_string().contains(QUESTION));
    assert!(tool_results(&first).is_empty());

    let second = requests[1].body.clone();
    assert_eq!(tool_call_ids(&second), ["call_add"]);
    assert_eq!(
        tool_results(&second),
        [("call_add".to_owned(), "5".to_owned())]
    );

    let third = requests[2].body.clone();
    assert_eq!(tool_call_ids(&third), ["call_add", "call_respond"]);
    assert_eq!(
        tool_results(&third),
        [
            ("call_add".to_owned(), "5".to_owned()),
            ("call_respond".to_owned(), ANSWER.to_owned()),
        ]
    );
    let last = third["messages"]
        .as_array()
        .and_then(|m| m.last())
        .expect("a last message");
    assert_eq!(last["role"], "user");
    assert!(last.to_string().contains(THANKS), "{last}");
}

async fn run(server: &FakeServer, streamed: bool) {
    two_turns(client(server), streamed).await;
    check_requests(&server.requests(), streamed);
}

#[tokio::test]
async fn a_machine_runs_tools_respond_and_finish_through_complete_answers() {
    let replies = calls()
        .iter()
        .map(|(id, name, args)| Reply::json(200, openai::tool_call(id, name, args)))
        .collect();
    let server = FakeServer::scripted(replies).await;
    run(&server, false).await;
}

#[tokio::test]
async fn a_machine_runs_tools_respond_and_finish_through_event_streams() {
    let replies = calls()
        .iter()
        .map(|(id, name, args)| Reply::sse_split(&openai::tool_call_events(id, name, args), 13))
        .collect();
    let server = FakeServer::scripted(replies).await;
    run(&server, true).await;
}

/// A price given for the client's own model (`.model(..)` on the builder)
/// is found: a request that names no model goes to it, and a cost limit
/// admits the call at its price.
#[tokio::test]
async fn a_price_given_for_the_clients_model_admits_a_call_under_a_cost_limit() {
    use markov_context::{Limit, ModelPrice, Prices, UsageLimits};
    use markov_core::Usd;

    let mut answer = openai::text("Hello.");
    answer["model"] = json!("house-local");
    let server = FakeServer::scripted(vec![Reply::json(200, answer)]).await;
    let model = OpenAi::builder()
        .api_key("sk-local")
        .base_url(format!("{}/v1", server.base_url()))
        .model("house-local")
        .build()
        .expect("a valid client");
    let node = markov_charter::node::Node::builder("Be brief.")
        .name("main")
        .build()
        .expect("node builds");
    let charter = markov_charter::charter::Charter::builder("local")
        .node("main", node)
        .build()
        .expect("charter builds");
    let limits = UsageLimits::builder()
        .per_run(Limit::new().cost(Usd::from_cents(1)))
        .build()
        .expect("limits");
    let prices = Prices::table().model(
        "house-local",
        ModelPrice::per_million_tokens(Usd::from_cents(100), Usd::from_cents(200)),
    );
    let mut machine = markov_executor::Agent::on_charter(charter)
        .model(model)
        .limits(markov_executor::RunOptions::default().usage_limits(limits))
        .prices(prices)
        .build()
        .expect("the agent builds")
        .machine();
    let steps = turn(&mut machine, "Hi.").await;
    assert!(steps.last().expect("a step").done);
    assert_eq!(server.requests().len(), 1, "the call was made");
    assert_eq!(server.requests()[0].body["model"], "house-local");
    // 120 input tokens at $1 and 30 output tokens at $2 per million.
    assert_eq!(machine.usage().session.cost, Usd::from_nanos(180_000));
    assert_eq!(machine.usage().session.unpriced_requests, 0);
}
