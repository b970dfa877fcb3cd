//! The Responses API client against the fake Responses server on loopback:
//! a tool round trip through a whole machine, reasoning items handed back
//! with their calls, streams cut anywhere, errors, retries and the
//! deadline. The fixtures follow the shapes in OpenAI's public API
//! documentation.
#![cfg(feature = "responses")]

use std::time::Duration;

use futures::StreamExt;
use markov_core::model::Thinking;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelSettings, StopReason, StreamEvent,
    ToolChoice, ToolDefinition,
};
use markov_providers::{PromptCacheKey, Responses, ResponsesBuilder};
use markov_testkit::http::{FakeServer, MODEL, Reply, responses};
use serde_json::{Value, json};

use crate::common::machine::{ANSWER, QUESTION, add_args, calculator, respond_args, turn};

const KEY: &str = "sk-proj-responses-secret";

fn builder(server: &FakeServer) -> ResponsesBuilder {
    Responses::builder()
        .api_key(KEY)
        .base_url(format!("{}/v1", server.base_url()))
        .model("gpt-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
}

fn client(server: &FakeServer) -> Responses {
    builder(server).build().expect("a valid client")
}

fn add_tool() -> Vec<ToolDefinition> {
    vec![
        ToolDefinition::new(
            "add",
            "Adds two numbers.",
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
        )
        .expect("valid name"),
    ]
}

/// The input items of a request body of the given type.
fn items<'a>(body: &'a Value, kind: &str) -> Vec<&'a Value> {
    body["input"]
        .as_array()
        .expect("input")
        .iter()
        .filter(|item| item["type"] == kind)
        .collect()
}

#[tokio::test]
async fn a_tool_round_trip_sends_calls_and_their_outputs_back_with_store_false() {
    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            responses::function_call("call_add", "add", &add_args()),
        ),
        Reply::json(
            200,
            responses::function_call("call_respond", "respond", &respond_args()),
        ),
    ])
    .await;
    let mut machine = calculator(client(&server));
    let steps = turn(&mut machine, QUESTION).await;
    assert_eq!(
        steps.last().and_then(|s| s.response.clone()),
        Some(ANSWER.to_owned())
    );
    // Each step names the model the response object named.
    for step in &steps {
        assert_eq!(step.model.as_deref(), Some(MODEL), "{step:?}");
    }
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for request in &requests {
        assert_eq!(request.path, "/v1/responses");
        assert_eq!(
            request.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        assert_eq!(request.body["store"], false);
        assert_eq!(request.body["model"], "gpt-test");
        assert!(
            request.body["instructions"]
                .as_str()
                .is_some_and(|i| !i.is_empty())
        );
        assert_eq!(request.body["tools"][0]["type"], "function");
        assert_eq!(
            request.body["tools"][0]["strict"], false,
            "lenient unless asked"
        );
    }
    // One conversation, one cache key.
    let key = &requests[0].body["prompt_cache_key"];
    assert!(
        key.as_str().is_some_and(|k| k.starts_with("markov-")),
        "{key}"
    );
    assert_eq!(&requests[1].body["prompt_cache_key"], key);
    let second = &requests[1].body;
    let calls = items(second, "function_call");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["call_id"], "call_add");
    assert_eq!(calls[0]["name"], "add");
    assert_eq!(calls[0]["arguments"], r#"{"a":2,"b":3}"#);
    let outputs = items(second, "function_call_output");
    assert_eq!(outputs.len(), 1);
    assert_eq!(outputs[0]["call_id"], "call_add");
    assert_eq!(outputs[0]["output"], "5");
    assert_eq!(
        second["input"][0],
        json!({"type": "message", "role": "user", "content": QUESTION})
    );
    // Every input item names its type: llama.cpp's server refuses an
    // assistant message without one ("Cannot determine type of 'item'").
    for item in second["input"].as_array().expect("input items") {
        assert!(item["type"].is_string(), "{item}");
    }
}

#[tokio::test]
async fn reasoning_items_are_handed_back_right_before_their_calls() {
    let first = responses::response(
        "r1",
        vec![
            responses::reasoning_item("rs_1", "Add 2 and 3 with the tool.", "enc-opaque-1"),
            responses::function_call_item("call_add", "add", &add_args()),
        ],
    );
    let server = FakeServer::scripted(vec![
        Reply::json(200, first),
        Reply::json(
            200,
            responses::function_call("call_respond", "respond", &respond_args()),
        ),
    ])
    .await;
    let mut machine = calculator(client(&server));
    turn(&mut machine, QUESTION).await;
    let recorded = machine
        .history()
        .iter()
        .flat_map(|m| m.item_list())
        .find_map(|item| match item {
            Item::Thinking {
                thinking,
                signature,
            } => Some((thinking.clone(), signature.clone())),
            _ => None,
        })
        .expect("the reasoning is in the history");
    assert_eq!(recorded.0, "Add 2 and 3 with the tool.");
    let second = &server.requests()[1].body;
    let input = second["input"].as_array().expect("input");
    let reasoning = input
        .iter()
        .position(|i| i["type"] == "reasoning")
        .expect("the reasoning item is sent back");
    assert_eq!(input[reasoning + 1]["type"], "function_call", "{input:?}");
    assert_eq!(
        input[reasoning],
        json!({"type": "reasoning", "id": "rs_1",
               "summary": [{"type": "summary_text", "text": "Add 2 and 3 with the tool."}],
               "encrypted_content": "enc-opaque-1"})
    );
}

#[tokio::test]
async fn thinking_asks_for_encrypted_reasoning_and_an_effort() {
    let server = FakeServer::scripted(vec![Reply::json(200, responses::text("ok"))]).await;
    let history = [Message::user("hi")];
    let settings = ModelSettings {
        thinking: Some(Thinking::Enabled {
            budget_tokens: 20_000,
        }),
        ..ModelSettings::default()
    };
    client(&server)
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .expect("an answer");
    let body = server.single().body;
    assert_eq!(
        body["reasoning"],
        json!({"effort": "high", "summary": "auto"})
    );
    assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
    assert!(body.get("instructions").is_none(), "no empty instructions");
    assert!(body.get("prompt_cache_key").is_none(), "no history, no key");
}

#[tokio::test]
async fn cache_keys_and_store_follow_the_builder() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, responses::text("ok")),
        Reply::json(200, responses::text("ok")),
    ])
    .await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let fixed = builder(&server)
        .prompt_cache_key(PromptCacheKey::Fixed("agent-7".into()))
        .store(true)
        .build()
        .unwrap();
    fixed
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .unwrap();
    let off = builder(&server)
        .prompt_cache_key(PromptCacheKey::Off)
        .build()
        .unwrap();
    let request = ModelRequest::new("", &history, &settings)
        .with_history_id(markov_core::model::HistoryId::fresh());
    off.complete(request).await.unwrap();
    let requests = server.requests();
    assert_eq!(requests[0].body["prompt_cache_key"], "agent-7");
    assert_eq!(requests[0].body["store"], true);
    assert!(requests[1].body.get("prompt_cache_key").is_none());
}

/// Reasoning, text and two calls, as an event stream.
fn full_stream() -> String {
    responses::events(
        "s1",
        vec![
            responses::reasoning_item("rs_9", "Sum them.", "enc-9"),
            responses::message_item("m1", "Adding both."),
            responses::function_call_item("call_a", "add", &json!({"a": 12, "b": 30})),
            responses::function_call_item("call_b", "add", &json!({"a": 5, "b": 6})),
        ],
    )
}

async fn streamed(server: &FakeServer) -> Vec<StreamEvent> {
    let history = [Message::user("12 + 30 and 5 + 6?")];
    let tools = add_tool();
    let settings = ModelSettings::default();
    let model = client(server);
    let request = ModelRequest::new("", &history, &settings)
        .with_tools(&tools)
        .with_tool_choice(&ToolChoice::Auto);
    model
        .stream(request)
        .map(|event| event.expect("no error"))
        .collect()
        .await
}

#[tokio::test]
async fn a_stream_is_decoded_however_it_is_cut() {
    let whole = full_stream();
    let expected = markov_providers::responses::replay_stream(whole.as_bytes()).expect("decodes");
    let Some(StreamEvent::Done(answer)) = expected.last() else {
        panic!("no final answer")
    };
    assert_eq!(
        answer.content,
        vec![
            Item::Thinking {
                thinking: "Sum them.".into(),
                signature: Some("rs_9|enc-9".into()),
            },
            Item::text("Adding both."),
            Item::tool_use("call_a", "add", json!({"a": 12, "b": 30})),
            Item::tool_use("call_b", "add", json!({"a": 5, "b": 6})),
        ]
    );
    assert_eq!(answer.stop_reason, StopReason::ToolUse);
    assert_eq!(answer.usage.input_tokens, 100);
    assert_eq!(answer.usage.cache_read_input_tokens, 20);
    // `output_tokens_details.reasoning_tokens`, part of the output.
    assert_eq!(answer.usage.output_tokens, 30);
    assert_eq!(answer.usage.reasoning_tokens, 8);
    // As `response.completed` names it.
    assert_eq!(answer.model.as_deref(), Some(MODEL));
    // Deltas name the positions the final answer has.
    for event in &expected {
        match event {
            StreamEvent::ThinkingDelta { index, .. } => assert_eq!(*index, 0),
            StreamEvent::TextDelta { index, .. } => assert_eq!(*index, 1),
            StreamEvent::ToolCallStart { index, id, .. } => {
                assert_eq!(id.as_str(), if *index == 2 { "call_a" } else { "call_b" })
            }
            _ => {}
        }
    }
    // Every byte a chunk of its own, then a few other cuts: the same events.
    let short = responses::function_call_events("call_x", "add", &json!({"a": 1, "b": 2}));
    let short_expected =
        markov_providers::responses::replay_stream(short.as_bytes()).expect("decodes");
    let server = FakeServer::scripted(vec![Reply::sse_split(&short, 1)]).await;
    assert_eq!(streamed(&server).await, short_expected);
    for size in [5, 13, 64] {
        let server = FakeServer::scripted(vec![Reply::sse_split(&whole, size)]).await;
        assert_eq!(streamed(&server).await, expected, "cut every {size} bytes");
    }
}

#[tokio::test]
async fn parallel_calls_streamed_without_output_index_stay_two_calls() {
    // llama.cpp's server leaves `output_index` out of its events: the item
    // ids tell the items apart.
    let stream = responses::events_without_output_index(
        "s2",
        vec![
            responses::message_item("m1", "Adding both."),
            responses::function_call_item("call_a", "add", &json!({"a": 12, "b": 30})),
            responses::function_call_item("call_b", "add", &json!({"a": 5, "b": 6})),
        ],
    );
    assert!(!stream.contains("output_index"), "{stream}");
    let server = FakeServer::scripted(vec![Reply::sse_split(&stream, 7)]).await;
    let events = streamed(&server).await;
    let Some(StreamEvent::Done(answer)) = events.last() else {
        panic!("no final answer: {events:?}")
    };
    assert_eq!(
        answer.content,
        vec![
            Item::text("Adding both."),
            Item::tool_use("call_a", "add", json!({"a": 12, "b": 30})),
            Item::tool_use("call_b", "add", json!({"a": 5, "b": 6})),
        ]
    );
    // The deltas name the same positions.
    let starts: Vec<(usize, String)> = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::ToolCallStart { index, id, .. } => Some((*index, id.to_string())),
            _ => None,
        })
        .collect();
    assert_eq!(starts, [(1, "call_a".to_owned()), (2, "call_b".to_owned())]);
    let mut arguments = [String::new(), String::new()];
    for event in &events {
        if let StreamEvent::ToolCallDelta {
            index,
            partial_json,
        } = event
        {
            arguments[index - 1].push_str(partial_json);
        }
    }
    assert_eq!(arguments, [r#"{"a":12,"b":30}"#, r#"{"a":5,"b":6}"#]);
}

#[test]
fn calls_added_without_ids_or_indexes_keep_their_deltas() {
    // The leanest server: items added with neither index nor id, deltas
    // naming an id the added item did not have.
    let event = |data: Value| {
        let kind = data["type"].as_str().unwrap_or_default().to_owned();
        markov_testkit::http::sse_event(&kind, data)
    };
    let call = |call_id: &str, item_id: &str, args: &str| {
        [
            event(json!({"type": "response.output_item.added",
                "item": {"type": "function_call", "call_id": call_id, "name": "add", "arguments": ""}})),
            event(json!({"type": "response.function_call_arguments.delta", "item_id": item_id, "delta": args})),
            event(json!({"type": "response.output_item.done",
                "item": {"type": "function_call", "id": item_id, "call_id": call_id, "name": "add", "arguments": args}})),
        ]
        .concat()
    };
    let stream = [
        call("call_a", "fc_a", r#"{"a":1,"b":2}"#),
        call("call_b", "fc_b", r#"{"a":3,"b":4}"#),
        event(
            json!({"type": "response.completed", "response": responses::response("r", Vec::new())}),
        ),
    ]
    .concat();
    let events = markov_providers::responses::replay_stream(stream.as_bytes()).expect("decodes");
    let Some(StreamEvent::Done(answer)) = events.last() else {
        panic!("no final answer: {events:?}")
    };
    assert_eq!(
        answer.content,
        vec![
            Item::tool_use("call_a", "add", json!({"a": 1, "b": 2})),
            Item::tool_use("call_b", "add", json!({"a": 3, "b": 4})),
        ]
    );
}

#[tokio::test]
async fn stream_errors_and_cut_streams_fail_with_typed_errors() {
    let failed = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\n",
        "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"status\":\"failed\",\"error\":{\"code\":\"server_error\",\"message\":\"boom\"}}}\n\n",
    );
    let error = "event: error\ndata: {\"type\":\"error\",\"code\":\"server_is_overloaded\",\"message\":\"busy\"}\n\n";
    let cut = &responses::text_events("never finished")[..200];
    let server =
        FakeServer::scripted(vec![Reply::sse(failed), Reply::sse(error), Reply::sse(cut)]).await;
    let model = client(&server);
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let mut errors = Vec::new();
    for _ in 0..3 {
        let last = model
            .stream(ModelRequest::new("", &history, &settings))
            .collect::<Vec<_>>()
            .await
            .pop()
            .expect("an event");
        errors.push(last.expect_err("an error"));
    }
    assert!(
        matches!(&errors[0], ModelError::Http { status: 500, message, .. } if message.contains("boom")),
        "{:?}",
        errors[0]
    );
    assert!(
        matches!(&errors[1], ModelError::Overloaded(m) if m.contains("busy")),
        "{:?}",
        errors[1]
    );
    assert!(
        matches!(&errors[2], ModelError::InvalidResponse(m) if m.contains("response.completed")),
        "{:?}",
        errors[2]
    );
}

#[tokio::test]
async fn an_incomplete_answer_is_cut_by_the_token_limit() {
    let mut body = responses::text("partial");
    body["status"] = json!("incomplete");
    body["incomplete_details"] = json!({"reason": "max_output_tokens"});
    let server = FakeServer::scripted(vec![Reply::json(200, body)]).await;
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let answer = client(&server)
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .unwrap();
    assert_eq!(answer.stop_reason, StopReason::MaxTokens);
}

#[tokio::test]
async fn a_completed_answer_that_spent_every_token_is_cut_by_the_limit() {
    // llama.cpp's server reports `completed` for an answer its
    // `max_output_tokens` cut; the canned answers spend 30 tokens.
    let cut = || {
        let mut body = responses::text("1234 + 4321 is a classic problem that");
        body["usage"]["output_tokens"] = json!(30);
        body
    };
    let server = FakeServer::scripted(vec![
        Reply::json(200, cut()),
        Reply::json(200, cut()),
        Reply::sse(&responses::text_events(
            "1234 + 4321 is a classic problem that",
        )),
        Reply::json(200, responses::text("5555")),
    ])
    .await;
    let model = client(&server);
    let history = [Message::user("What is 1234 + 4321?")];
    let settings = ModelSettings {
        max_tokens: 30,
        ..ModelSettings::default()
    };
    let answer = model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .unwrap();
    assert_eq!(answer.stop_reason, StopReason::MaxTokens);
    // A forced call cut before it began is cut, not a server that ignores
    // its tools.
    let tools = add_tool();
    let forced = ModelRequest::new("", &history, &settings)
        .with_tools(&tools)
        .with_tool_choice(&ToolChoice::Any);
    let answer = model.complete(forced).await.expect("a cut answer");
    assert_eq!(answer.stop_reason, StopReason::MaxTokens);
    let events: Vec<StreamEvent> = model
        .stream(forced)
        .map(|event| event.expect("no error"))
        .collect()
        .await;
    let Some(StreamEvent::Done(answer)) = events.last() else {
        panic!("{events:?}")
    };
    assert_eq!(answer.stop_reason, StopReason::MaxTokens);
    // An answer that ends before the limit ends the turn.
    let settings = ModelSettings {
        max_tokens: 31,
        ..ModelSettings::default()
    };
    let answer = model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .unwrap();
    assert_eq!(answer.stop_reason, StopReason::EndTurn);
}
