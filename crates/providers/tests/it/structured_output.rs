//! A node with an output type and tools, on servers that cannot combine a
//! schema-constrained answer with tool calls (llama.cpp's server, vLLM):
//! the structured answer is asked for through the output tool, so the
//! model can still call the node's tools, and the answer parses.
#![cfg(all(feature = "openai", feature = "anthropic"))]

use std::time::Duration;

use markov_core::{Message, Model, ModelRequest, ModelSettings, ToolChoice, ToolDefinition};
use markov_executor::Agent;
use markov_providers::{Anthropic, OpenAi, StructuredOutput};
use markov_testkit::fixtures::Add;
use markov_testkit::http::{FakeServer, Reply, anthropic, openai};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize, schemars::JsonSchema, PartialEq)]
struct Sum {
    total: i64,
}

fn local_openai(server: &FakeServer, mode: StructuredOutput) -> OpenAi {
    OpenAi::builder()
        .base_url(format!("{}/v1", server.base_url()))
        .model("local")
        .structured_output(mode)
        .backoff(Duration::from_millis(1), Duration::from_millis(4))
        .build()
        .expect("a valid client")
}

fn tool_names(body: &Value) -> Vec<String> {
    body["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .map(|t| {
                    t["function"]["name"]
                        .as_str()
                        .or(t["name"].as_str())
                        .unwrap_or_default()
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn run_sum(model: impl Model + 'static) -> Sum {
    let agent = Agent::builder("summer")
        .instructions("You add with your tool and answer in JSON.")
        .tool(Add)
        .output::<Sum>()
        .model(model)
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("What is 2 + 3?");
    let typed = machine.run_typed::<Sum>().await.expect("a typed answer");
    assert_eq!(typed.attempts, 1, "the first answer parsed");
    typed.value
}

#[tokio::test]
async fn openai_output_type_with_tools_uses_the_output_tool_on_a_local_server() {
    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            openai::tool_call("call_1", "add", &json!({"a": 2, "b": 3})),
        ),
        Reply::json(
            200,
            openai::tool_call("call_2", "final_answer", &json!({"total": 5})),
        ),
    ])
    .await;
    let sum = run_sum(local_openai(&server, StructuredOutput::Auto)).await;
    assert_eq!(sum, Sum { total: 5 });
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for request in &requests {
        let body = &request.body;
        assert!(
            body.get("response_format").is_none(),
            "no grammar that rules tool calls out: {body}"
        );
        assert_eq!(tool_names(body), ["add", "final_answer"]);
        assert_eq!(body["tool_choice"], "required");
        let output_tool = &body["tools"][1]["function"];
        assert_eq!(output_tool["parameters"]["required"], json!(["total"]));
    }
    // The add call got its result; the output call needed none.
    let messages = requests[1].body["messages"].as_array().unwrap().clone();
    assert!(
        messages
            .iter()
            .any(|m| m["role"] == "tool" && m["content"] == "5")
    );
}

#[tokio::test]
async fn anthropic_output_type_with_tools_uses_the_output_tool_on_a_local_server() {
    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            anthropic::tool_use("toolu_1", "add", &json!({"a": 2, "b": 3})),
        ),
        Reply::json(
            200,
            anthropic::tool_use("toolu_2", "final_answer", &json!({"total": 5})),
        ),
    ])
    .await;
    let client = Anthropic::builder()
        .base_url(server.base_url())
        .model("local")
        .build()
        .expect("a valid client");
    let sum = run_sum(client).await;
    assert_eq!(sum, Sum { total: 5 });
    for request in server.requests() {
        assert!(request.body.get("output_format").is_none());
        assert_eq!(request.header("anthropic-beta"), None);
        assert_eq!(tool_names(&request.body), ["add", "final_answer"]);
        assert_eq!(request.body["tool_choice"]["type"], "any");
    }
}

#[tokio::test]
async fn a_call_without_tools_sends_the_schema_field() {
    let server = FakeServer::scripted(vec![Reply::json(200, openai::text(r#"{"total":5}"#))]).await;
    let client = local_openai(&server, StructuredOutput::Auto);
    let schema = json!({"type": "object", "properties": {"total": {"type": "integer"}}});
    let history = [Message::user("2 + 3?")];
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings).with_output_schema(Some(&schema));
    client.complete(request).await.expect("an answer");
    let body = server.single().body;
    assert_eq!(body["response_format"]["json_schema"]["schema"], schema);
    assert!(body.get("tools").is_none());
}

#[tokio::test]
async fn tool_choice_none_and_the_schema_field_mode_send_the_schema_with_tools() {
    let server = FakeServer::scripted(vec![
        Reply::json(200, openai::text(r#"{"total":5}"#)),
        Reply::json(200, openai::text(r#"{"total":5}"#)),
    ])
    .await;
    let schema = json!({"type": "object"});
    let tools = [ToolDefinition::new("add", "Adds.", json!({"type": "object"})).unwrap()];
    let history = [Message::user("2 + 3?")];
    let settings = ModelSettings::default();
    let base = ModelRequest::new("", &history, &settings)
        .with_tools(&tools)
        .with_output_schema(Some(&schema));
    let auto = local_openai(&server, StructuredOutput::Auto);
    auto.complete(base.with_tool_choice(&ToolChoice::None))
        .await
        .expect("an answer");
    let native = local_openai(&server, StructuredOutput::SchemaField);
    native.complete(base).await.expect("an answer");
    for request in server.requests() {
        assert_eq!(request.body["response_format"]["type"], "json_schema");
        assert_eq!(tool_names(&request.body), ["add"]);
    }
}

#[tokio::test]
async fn a_streamed_call_under_the_output_tool_yields_the_answer_as_text() {
    use futures::StreamExt;
    use markov_core::{Item, StreamEvent};
    let server = FakeServer::scripted(vec![Reply::json(
        200,
        openai::tool_call("call_9", "final_answer", &json!({"total": 5})),
    )])
    .await;
    let client = local_openai(&server, StructuredOutput::OutputTool);
    let schema = json!({"type": "object"});
    let tools = [ToolDefinition::new("add", "Adds.", json!({"type": "object"})).unwrap()];
    let history = [Message::user("2 + 3?")];
    let settings = ModelSettings::default();
    let request = ModelRequest::new("", &history, &settings)
        .with_tools(&tools)
        .with_output_schema(Some(&schema));
    let events: Vec<_> = client.stream(request).collect().await;
    let Some(Ok(StreamEvent::Done(answer))) = events.last() else {
        panic!("no final answer: {events:?}")
    };
    assert_eq!(answer.content, vec![Item::text(r#"{"total":5}"#)]);
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, Ok(StreamEvent::ToolCallStart { .. })))
    );
}

#[tokio::test]
async fn a_cut_output_tool_call_on_a_local_server_is_an_error_not_a_guess() {
    // llama-server cuts the output tool's call at the token limit; the
    // recovery call would go out under the schema grammar, and the model
    // would have to shape a guess like an answer.
    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            openai::completion(
                "cut",
                json!({
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "final_answer", "arguments": "{\"total\": 12"}
                    }]
                }),
                "length",
            ),
        ),
        Reply::json(200, openai::text(r#"{"total": 99}"#)),
    ])
    .await;
    let agent = Agent::builder("summer")
        .instructions("You add with your tool and answer in JSON.")
        .tool(Add)
        .output::<Sum>()
        .model(local_openai(&server, StructuredOutput::Auto))
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("What is 2 + 3?");
    let error = machine
        .run_typed::<Sum>()
        .await
        .expect_err("a cut answer is not a success");
    assert!(
        matches!(error, markov_executor::TypedRunError::Cut { .. }),
        "{error}"
    );
    assert_eq!(
        server.requests().len(),
        1,
        "no schema-constrained recovery call"
    );
}
