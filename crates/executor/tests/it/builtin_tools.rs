//! Provider built-in tools in a machine run: the provider answers their calls
//! in the same response, so the loop runs nothing, writes no result, ends the
//! turn, and sends the blocks back with the next request.

use std::sync::Arc;

use crate::common::*;
use markov_charter::node::Node;
use markov_core::message::{Item, Role};
use markov_core::model::{ModelResponse, StopReason};
use markov_core::tool::ProviderTool;
use markov_executor::{RunOptions, YieldReason};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn web_search() -> ProviderTool {
    ProviderTool::new("web_search_20250305", "web_search")
        .expect("valid name")
        .with("max_uses", json!(5))
}

fn node() -> Node {
    Node::builder("Answer with sources.")
        .name("main")
        .tool(Add)
        .provider_tool(web_search())
        .build()
        .expect("node builds")
}

/// What Anthropic answers after running its web search: the call, the
/// provider's result and the text, in one response.
fn searched_answer() -> Vec<Item> {
    vec![
        Item::text("Let me look that up."),
        Item::provider_tool_use("srvtoolu_1", "web_search", json!({"query": "rust 1.95"})),
        Item::provider_tool_result(
            "srvtoolu_1",
            "web_search_tool_result",
            json!([{
                "type": "web_search_result",
                "url": "https://blog.rust-lang.org/",
                "title": "Rust Blog",
                "encrypted_content": "EqgfCioIARgBIiQ3YTAw",
                "page_age": "April 30, 2026"
            }]),
        ),
        Item::text("Rust 1.95 is out."),
    ]
}

#[tokio::test]
async fn a_provider_tool_call_ends_the_turn_and_round_trips() {
    let first = ModelResponse::new(searched_answer(), StopReason::EndTurn);
    assert!(!first.has_tool_calls(), "no call for the loop to run");
    assert_eq!(first.tool_calls().count(), 0);
    assert_eq!(first.provider_tool_calls().count(), 1);
    let model = Arc::new(
        ScriptedModel::builder()
            .response(first)
            .tool_call("add", json!({"a": 2, "b": 3}))
            .text("5")
            .build(),
    );
    let mut m = machine(|c| c, node(), json!({}), model.clone());
    m.enqueue_user("What's new in Rust?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        model.calls(),
        1,
        "the turn ends after the provider's answer"
    );
    let last = steps.last().expect("a step");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(last.done);
    assert!(all_results(m.history()).is_empty(), "no result is written");
    assert_paired(m.history());
    let assistant = m
        .history()
        .iter()
        .find(|msg| msg.role == Role::Assistant)
        .expect("the answer is recorded");
    assert_eq!(assistant.item_list(), searched_answer().as_slice());

    // The next turn: the provider tool is offered again and the blocks go back.
    m.enqueue_user("And 2 + 3?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_paired(m.history());
    assert_eq!(
        all_results(m.history()),
        [("call_1".to_owned(), "5".to_owned(), Some(false))]
    );
    let requests = model.requests();
    assert_eq!(requests.len(), 3);
    for request in &requests {
        assert_eq!(request.provider_tools, vec![web_search()]);
        assert_eq!(request.tool_names(), ["add"]);
    }
    let sent: Vec<&Item> = requests[1]
        .messages
        .iter()
        .filter(|msg| msg.role == Role::Assistant)
        .flat_map(|msg| msg.item_list())
        .collect();
    assert_eq!(sent, searched_answer().iter().collect::<Vec<_>>());
}

#[tokio::test]
async fn a_plain_call_of_a_provider_tool_is_not_run() {
    // A client that reports the provider's call as an ordinary tool call.
    let model = Arc::new(
        ScriptedModel::builder()
            .text_and_tool_calls("Searching.", [("web_search", json!({"query": "x"}))])
            .build(),
    );
    let mut m = machine(|c| c, node(), json!({}), model.clone());
    m.enqueue_user("Search something.");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(model.calls(), 1);
    assert_eq!(
        steps.last().map(|s| &s.yield_reason),
        Some(&YieldReason::EndTurn)
    );
    assert!(all_results(m.history()).is_empty());
    assert_paired(m.history());
    let recorded: Vec<&Item> = m
        .history()
        .iter()
        .flat_map(|msg| msg.item_list())
        .filter(|i| matches!(i, Item::ProviderToolUse { .. }))
        .collect();
    assert_eq!(
        recorded,
        [&Item::provider_tool_use(
            "call_1",
            "web_search",
            json!({"query": "x"})
        )]
    );
}
