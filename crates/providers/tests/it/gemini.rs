//! The Gemini client against the fake Gemini server on loopback: a tool
//! round trip through a whole machine with thought signatures sent back,
//! tool choices, schemas the dialect cannot express, structured output,
//! streams cut anywhere, errors, retries and the deadline. The fixtures
//! follow the shapes in Google's public API documentation.
#![cfg(feature = "gemini")]

use std::time::Duration;

use futures::StreamExt;
use markov_core::{
    Item, Message, Model, ModelError, ModelRequest, ModelSettings, StopReason, StreamEvent,
    ToolChoice, ToolDefinition,
};
use markov_providers::{Gemini, GeminiBuilder};
use markov_testkit::http::{FakeServer, MODEL, Reply, gemini};
use serde_json::{Value, json};

use crate::common::machine::{ANSWER, QUESTION, add_args, calculator, respond_args, turn};

const KEY: &str = "AIza-gemini-test-secret";

fn builder(server: &FakeServer) -> GeminiBuilder {
    Gemini::builder()
        .api_key(KEY)
        .base_url(server.base_url())
        .model("gemini-test")
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
}

fn client(server: &FakeServer) -> Gemini {
    builder(server).build().expect("a valid client")
}

fn add_tool() -> Vec<ToolDefinition> {
    vec![
        ToolDefinition::new(
            "add",
            "Adds two numbers.",
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}),
        )
        .expect("valid name"),
    ]
}

fn parts(content: &Value) -> &Vec<Value> {
    content["parts"].as_array().expect("parts")
}

#[tokio::test]
async fn a_tool_round_trip_sends_signed_calls_and_named_responses_back() {
    let first = gemini::response(
        vec![
            gemini::thought_part("I should add them.", "sig-thought"),
            gemini::function_call_part("add", &add_args(), Some("sig-call")),
        ],
        "STOP",
    );
    let server = FakeServer::scripted(vec![
        Reply::json(200, first),
        Reply::json(200, gemini::function_call("respond", &respond_args())),
    ])
    .await;
    let mut machine = calculator(client(&server));
    let steps = turn(&mut machine, QUESTION).await;
    assert_eq!(
        steps.last().and_then(|s| s.response.clone()),
        Some(ANSWER.to_owned())
    );
    // Each step names the model the answer's `modelVersion` named.
    for step in &steps {
        assert_eq!(step.model.as_deref(), Some(MODEL), "{step:?}");
    }
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for request in &requests {
        assert_eq!(request.path, "/v1beta/models/gemini-test:generateContent");
        assert_eq!(request.header("x-goog-api-key"), Some(KEY));
        assert!(
            !request.path.contains(KEY),
            "the key never rides in the URL"
        );
        let declarations = &request.body["tools"][0]["functionDeclarations"];
        let add = declarations
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == "add")
            .expect("add is declared");
        assert_eq!(add["parameters"]["type"], "OBJECT");
        assert_eq!(add["parameters"]["properties"]["a"]["type"], "INTEGER");
        assert_eq!(
            request.body["toolConfig"]["functionCallingConfig"]["mode"],
            "AUTO"
        );
        assert!(request.body["systemInstruction"]["parts"][0]["text"].is_string());
    }
    let contents = requests[1].body["contents"].as_array().expect("contents");
    assert_eq!(contents[0]["role"], "user");
    assert_eq!(contents[1]["role"], "model");
    assert_eq!(
        parts(&contents[1])[0],
        json!({"text": "I should add them.", "thought": true, "thoughtSignature": "sig-thought"})
    );
    assert_eq!(
        parts(&contents[1])[1],
        json!({"functionCall": {"name": "add", "args": {"a": 2, "b": 3}}, "thoughtSignature": "sig-call"}),
        "the signature goes back on its call, and a made-up id is not sent"
    );
    assert_eq!(contents[2]["role"], "user");
    assert_eq!(
        parts(&contents[2])[0],
        json!({"functionResponse": {"name": "add", "response": {"content": "5"}}})
    );
}

#[tokio::test]
async fn tool_choices_map_to_function_calling_modes() {
    let cases = [
        (ToolChoice::Auto, json!({"mode": "AUTO"})),
        (ToolChoice::Any, json!({"mode": "ANY"})),
        (ToolChoice::None, json!({"mode": "NONE"})),
        (
            ToolChoice::Tool(add_tool()[0].name.clone()),
            json!({"mode": "ANY", "allowedFunctionNames": ["add"]}),
        ),
    ];
    let call = gemini::function_call("add", &json!({"a": 1, "b": 2}));
    let server = FakeServer::scripted(vec![
        Reply::json(200, gemini::text("ok")),
        Reply::json(200, call.clone()),
        Reply::json(200, gemini::text("ok")),
        Reply::json(200, call),
    ])
    .await;
    let model = client(&server);
    let tools = add_tool();
    let history = [Message::user("1 + 2?")];
    let settings = ModelSettings::default();
    for (choice, _) in &cases {
        model
            .complete(
                ModelRequest::new("", &history, &settings)
                    .with_tools(&tools)
                    .with_tool_choice(choice),
            )
            .await
            .expect("an answer");
    }
    for ((_, expected), sent) in cases.iter().zip(server.requests()) {
        assert_eq!(&sent.body["toolConfig"]["functionCallingConfig"], expected);
    }
}

#[tokio::test]
async fn a_schema_the_dialect_cannot_express_is_refused_before_sending() {
    let server = FakeServer::start().await;
    let map = ToolDefinition::new(
        "tag",
        "Tags.",
        json!({"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "string"}}}}),
    )
    .unwrap();
    let tools = [map];
    assert!(markov_providers::gemini::check_tools(&tools).is_err());
    // The hook an agent's builder calls names the tool and the place.
    let refused = client(&server)
        .check_tools(&tools, None)
        .expect_err("a map is refused");
    assert_eq!(refused.tool.as_ref().map(|t| t.as_str()), Some("tag"));
    assert!(
        refused
            .reason
            .contains("#/properties/tags/additionalProperties"),
        "{refused}"
    );
    let map_output = json!({"type": "object", "additionalProperties": {"type": "integer"}});
    let refused = client(&server)
        .check_tools(&add_tool(), Some(&map_output))
        .expect_err("a map as the output type is refused");
    assert_eq!(refused.tool, None);
    assert!(refused.reason.contains("the output type"), "{refused}");
    assert_eq!(client(&server).check_tools(&add_tool(), None), Ok(()));
    let history = [Message::user("tag it")];
    let settings = ModelSettings::default();
    let error = client(&server)
        .complete(ModelRequest::new("", &history, &settings).with_tools(&tools))
        .await
        .expect_err("refused");
    let ModelError::InvalidRequest(message) = error else {
        panic!("{error:?}")
    };
    assert!(message.contains("tool \"tag\""), "{message}");
    assert!(
        message.contains("#/properties/tags/additionalProperties"),
        "{message}"
    );
    assert!(server.requests().is_empty());
}

/// Labels things (its arguments are a map, which Gemini's dialect lacks).
#[markov_core::tool]
async fn label(
    /// The labels, by thing.
    labels: std::collections::BTreeMap<String, String>,
) -> usize {
    labels.len()
}

#[tokio::test]
async fn an_agent_offering_gemini_a_map_fails_when_it_is_built() {
    let server = FakeServer::start().await;
    let error = markov_executor::Agent::builder("labeller")
        .instructions("Label things.")
        .tool(Label)
        .model(client(&server))
        .build()
        .expect_err("Gemini cannot be offered a map");
    let markov_executor::BuildError::Unsupported { node, source, .. } = &error else {
        panic!("{error:?}")
    };
    assert_eq!(node, "labeller");
    assert_eq!(source.tool.as_ref().map(|t| t.as_str()), Some("label"));
    let message = error.to_string();
    assert!(
        message.contains("Gemini's schema dialect at #/properties/labels/additionalProperties"),
        "{message}"
    );
    // Behind a fallback, any model of the list may be asked: the same.
    let fallback = markov_providers::Fallback::new(std::sync::Arc::new(
        markov_testkit::ScriptedModel::builder().build(),
    ))
    .or(std::sync::Arc::new(client(&server)));
    let error = markov_executor::Agent::builder("labeller")
        .instructions("Label things.")
        .tool(Label)
        .model(fallback)
        .build()
        .expect_err("the fallback's Gemini cannot be offered a map");
    assert!(
        matches!(error, markov_executor::BuildError::Unsupported { .. }),
        "{error:?}"
    );
    assert!(server.requests().is_empty(), "nothing was sent");
}

#[tokio::test]
async fn structured_output_uses_the_response_schema_or_the_output_tool() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, gemini::text(r#"{"total": 3}"#)),
        Reply::json(
            200,
            gemini::function_call("final_answer", &json!({"total": 3})),
        ),
    ])
    .await;
    let model = client(&server);
    let schema = json!({"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"]});
    let history = [Message::user("1 + 2?")];
    let settings = ModelSettings::default();
    let bare = ModelRequest::new("", &history, &settings).with_output_schema(Some(&schema));
    model.complete(bare).await.expect("an answer");
    let tools = add_tool();
    let answer = model
        .complete(bare.with_tools(&tools))
        .await
        .expect("an answer");
    assert_eq!(answer.content, vec![Item::text(r#"{"total":3}"#)]);
    assert_eq!(answer.stop_reason, StopReason::EndTurn);
    let requests = server.requests();
    let config = &requests[0].body["generationConfig"];
    assert_eq!(config["responseMimeType"], "application/json");
    assert_eq!(
        config["responseSchema"],
        json!({"type": "OBJECT", "properties": {"total": {"type": "INTEGER"}}, "required": ["total"]})
    );
    let with_tools = &requests[1].body;
    assert!(
        with_tools["generationConfig"]
            .get("responseSchema")
            .is_none()
    );
    let names: Vec<&str> = with_tools["tools"][0]["functionDeclarations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect();
    assert_eq!(names, ["add", "final_answer"]);
    assert_eq!(
        with_tools["toolConfig"]["functionCallingConfig"]["mode"],
        "ANY"
    );
}

fn stream_parts() -> Vec<Value> {
    vec![
        gemini::thought_part("Sum them.", "sig-1"),
        gemini::text_part("Adding both."),
        gemini::function_call_part("add", &json!({"a": 12, "b": 30}), Some("sig-2")),
        gemini::function_call_part("add", &json!({"a": 5, "b": 6}), None),
    ]
}

async fn streamed(server: &FakeServer) -> Vec<StreamEvent> {
    let history = [Message::user("12 + 30 and 5 + 6?")];
    let tools = add_tool();
    let settings = ModelSettings::default();
    let model = client(server);
    model
        .stream(ModelRequest::new("", &history, &settings).with_tools(&tools))
        .map(|event| event.expect("no error"))
        .collect()
        .await
}

#[tokio::test]
async fn a_stream_is_decoded_however_it_is_cut() {
    let whole = gemini::events(stream_parts(), "STOP");
    let expected = markov_providers::gemini::replay_stream(whole.as_bytes()).expect("decodes");
    let Some(StreamEvent::Done(answer)) = expected.last() else {
        panic!("no final answer")
    };
    let [thought, text, first, signature, second] = answer.content.as_slice() else {
        panic!("{:?}", answer.content)
    };
    assert_eq!(
        thought,
        &Item::Thinking {
            thinking: "Sum them.".into(),
            signature: Some("gemini|sig-1".into())
        }
    );
    assert_eq!(text, &Item::text("Adding both."));
    assert!(
        matches!(first, Item::ToolUse { name, input, .. } if name == "add" && input["a"] == 12)
    );
    assert_eq!(
        signature,
        &Item::Thinking {
            thinking: String::new(),
            signature: Some("gemini|sig-2".into())
        }
    );
    assert!(matches!(second, Item::ToolUse { input, .. } if input["a"] == 5));
    assert_eq!(answer.stop_reason, StopReason::ToolUse);
    assert_eq!(answer.usage.input_tokens, 100);
    // Thoughts are output, and counted apart too.
    assert_eq!(answer.usage.output_tokens, 30);
    assert_eq!(answer.usage.reasoning_tokens, 8);
    assert_eq!(
        answer.model.as_deref(),
        Some(MODEL),
        "the chunks' modelVersion"
    );
    // Made-up call ids differ between decodes: compare the events without them.
    let without_ids = |events: Vec<StreamEvent>| -> Vec<String> {
        events
            .into_iter()
            .map(|e| match e {
                StreamEvent::ToolCallStart { index, name, .. } => format!("start {index} {name}"),
                StreamEvent::Done(done) => {
                    format!("done {} by {:?}", done.content.len(), done.model)
                }
                other => format!("{other:?}"),
            })
            .collect()
    };
    let expected = without_ids(expected);
    let short = gemini::text_events("Hi there");
    let short_expected =
        without_ids(markov_providers::gemini::replay_stream(short.as_bytes()).expect("decodes"));
    let server = FakeServer::scripted(vec![Reply::sse_split(&short, 1)]).await;
    assert_eq!(without_ids(streamed(&server).await), short_expected);
    for size in [5, 13, 64] {
        let server = FakeServer::scripted(vec![Reply::sse_split(&whole, size)]).await;
        assert_eq!(
            without_ids(streamed(&server).await),
            expected,
            "cut every {size} bytes"
        );
        assert!(
            server
                .single()
                .path
                .ends_with(":streamGenerateContent?alt=sse"),
            "{}",
            server.single().path
        );
    }
}

#[tokio::test]
async fn a_stream_without_a_finish_reason_and_a_blocked_prompt() {
    let unfinished = markov_testkit::http::sse_data(
        &json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "half"}]}}]})
            .to_string(),
    );
    let blocked = json!({"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 3}});
    let server =
        FakeServer::scripted(vec![Reply::sse(&unfinished), Reply::json(200, blocked)]).await;
    let model = client(&server);
    let history = [Message::user("hi")];
    let settings = ModelSettings::default();
    let last = model
        .stream(ModelRequest::new("", &history, &settings))
        .collect::<Vec<_>>()
        .await
        .pop();
    assert!(
        matches!(&last, Some(Err(ModelError::InvalidResponse(m))) if m.contains("finish reason")),
        "{last:?}"
    );
    let answer = model
        .complete(ModelRequest::new("", &history, &settings))
        .await
        .expect("a blocked prompt is an answer");
    assert_eq!(answer.stop_reason, StopReason::ContentFilter);
}

mod wire_form {
    use std::collections::HashMap;

    use markov_core::{Item, Message, ModelRequest, ModelSettings, Role};
    use markov_providers::Gemini;
    use proptest::prelude::*;
    use serde_json::Value;

    use crate::body_cache::message;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Any history encodes (or is refused as empty) without a panic,
        /// into contents that alternate roles, one `functionCall` per call
        /// and one `functionResponse` per result, each naming the function
        /// of its call.
        #[test]
        fn every_call_and_result_keeps_its_part_and_name(
            history in prop::collection::vec(message(), 0..24),
        ) {
            let client = Gemini::builder()
                .base_url("http://127.0.0.1:1")
                .build()
                .expect("builds");
            let settings = ModelSettings::default();
            let request = ModelRequest::new("", &history, &settings);
            let body = match client.request_body(&request, false) {
                Ok(body) => body,
                Err(error) => {
                    prop_assert!(error.to_string().contains("no content to send"), "{error}");
                    return Ok(());
                }
            };
            let body: Value = serde_json::from_slice(&body).expect("valid JSON");
            let contents = body["contents"].as_array().expect("contents");
            for pair in contents.windows(2) {
                prop_assert_ne!(&pair[0]["role"], &pair[1]["role"]);
            }
            let parts: Vec<&Value> = contents
                .iter()
                .flat_map(|c| c["parts"].as_array().into_iter().flatten())
                .collect();
            let calls: Vec<(&str, &str)> = history
                .iter()
                .filter(|m| m.role == Role::Assistant)
                .flat_map(Message::item_list)
                .filter_map(|item| match item {
                    Item::ToolUse { id, name, .. } => Some((id.as_str(), name.as_str())),
                    _ => None,
                })
                .collect();
            let names: HashMap<&str, &str> = calls.iter().copied().collect();
            let results: Vec<&str> = history
                .iter()
                .filter(|m| m.role == Role::User)
                .flat_map(Message::item_list)
                .filter_map(|item| match item {
                    Item::ToolResult { tool_use_id, .. } => Some(tool_use_id.as_str()),
                    _ => None,
                })
                .collect();
            let sent_calls = parts.iter().filter(|p| p.get("functionCall").is_some()).count();
            prop_assert_eq!(sent_calls, calls.len());
            let responses: Vec<&Value> = parts
                .iter()
                .filter_map(|p| p.get("functionResponse"))
                .collect();
            prop_assert_eq!(responses.len(), results.len());
            for (response, id) in responses.iter().zip(&results) {
                let expected = names.get(id).copied().unwrap_or("unknown_function");
                prop_assert_eq!(response["name"].as_str(), Some(expected));
            }
        }
    }
}

#[cfg(all(feature = "anthropic", feature = "responses"))]
#[test]
fn signatures_go_back_only_to_the_provider_that_made_them() {
    use markov_providers::{Anthropic, Responses};

    let thinking = |signature: &str| Item::Thinking {
        thinking: "a thought".into(),
        signature: Some(signature.into()),
    };
    let history = vec![
        Message::user("hi"),
        Message::assistant_items(vec![
            thinking("EqQBCkgIARABGAIiQLanthropic"),
            thinking("rs_1|encrypted"),
            thinking("gemini|sig-g"),
            Item::text("hello"),
        ]),
        Message::user("again"),
    ];
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings);
    let body = |bytes: Vec<u8>| String::from_utf8(bytes).expect("utf-8");
    let anthropic = Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .unwrap();
    let sent = body(anthropic.request_body(&request, false).unwrap());
    assert!(sent.contains("EqQBCkgIARABGAIiQLanthropic"), "{sent}");
    assert!(!sent.contains("rs_1") && !sent.contains("sig-g"), "{sent}");
    let responses = Responses::builder()
        .base_url("http://127.0.0.1:1/v1")
        .build()
        .unwrap();
    let sent = body(responses.request_body(&request, false).unwrap());
    assert!(sent.contains(r#""id":"rs_1""#), "{sent}");
    assert!(!sent.contains("EqQB") && !sent.contains("sig-g"), "{sent}");
    let gemini = Gemini::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .unwrap();
    let sent = body(gemini.request_body(&request, false).unwrap());
    assert!(sent.contains("sig-g"), "{sent}");
    assert!(!sent.contains("EqQB") && !sent.contains("rs_1"), "{sent}");
}
