//! Human in the loop through the real clients, against the fake Anthropic
//! and OpenAI servers: an answer with a plain call and a call that needs
//! approval pauses the run after one request; once approved, resuming sends
//! exactly one more request, whose history is valid for the vendor (each
//! call answered once, in order, right after the answer that made it) and
//! holds nothing the model could approve with.

use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::Model;
use markov_executor::{Machine, StandardExecutor, YieldReason};
use markov_testkit::fixtures::Wire;
use serde_json::Value;

use crate::common::machine::Add;

fn bank(model: impl Model + 'static, wire: &Wire) -> Machine {
    let node = Node::builder("You move money.")
        .name("bank")
        .tool(Add)
        .tool(wire.clone())
        .build()
        .expect("node builds");
    let charter = Charter::builder("bank")
        .node("bank", node.clone())
        .build()
        .expect("charter builds");
    markov_executor::Agent::on_charter(charter)
        .executor(StandardExecutor::new(model))
        .state(serde_json::json!({}))
        .build()
        .map(|agent| agent.machine())
        .expect("machine builds")
}

/// Pauses on the answer, approves and resumes, checking every request sent
/// (`requests` reads their bodies).
async fn pause_approve_resume(model: impl Model + 'static, requests: impl Fn() -> Vec<Value>) {
    let wire = Wire::default();
    let mut machine = bank(model, &wire);
    machine.enqueue_user("add 2 and 3, then wire 5");
    let paused = machine.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    assert_eq!(requests().len(), 1);
    assert_eq!(wire.payments.count(), 0);
    machine
        .approvals()
        .approve(&paused.approvals[0].request_id)
        .expect("approve");
    let last = machine.resume().await.expect("resumes");
    assert!(last.done);
    assert_eq!(wire.payments.count(), 1);
    let bodies = requests();
    assert_eq!(bodies.len(), 2, "exactly one request after the approval");
    for body in &bodies {
        let text = body.to_string();
        assert!(!text.contains("apr_"), "no request id reaches the model");
        assert!(!text.contains("confirmationToken"));
    }
}

#[cfg(feature = "anthropic")]
mod anthropic {
    use super::*;
    use markov_providers::Anthropic;
    use markov_testkit::http::{FakeServer, Reply, anthropic};
    use serde_json::json;

    #[tokio::test]
    async fn a_paused_call_is_answered_in_place_in_the_messages_api_history() {
        let answer = anthropic::message(
            "msg_1",
            vec![
                json!({"type": "text", "text": "Adding, then wiring."}),
                json!({"type": "tool_use", "id": "toolu_add", "name": "add", "input": {"a": 2, "b": 3}}),
                json!({"type": "tool_use", "id": "toolu_wire", "name": "wire", "input": {"amount": 5}}),
            ],
            "tool_use",
        );
        let server = FakeServer::scripted(vec![
            Reply::json(200, answer),
            Reply::json(200, anthropic::text("Done: 5, and 5 wired.")),
        ])
        .await;
        let client = Anthropic::builder()
            .api_key("sk-ant-hitl-test")
            .base_url(server.base_url())
            .model("claude-test")
            .build()
            .expect("a client");
        pause_approve_resume(client, || {
            server.requests().into_iter().map(|r| r.body).collect()
        })
        .await;
        let second = &server.requests()[1].body;
        let messages = second["messages"].as_array().expect("messages");
        assert_eq!(messages.len(), 3, "{messages:?}");
        let calls: Vec<&str> = messages[1]["content"]
            .as_array()
            .expect("blocks")
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| b["id"].as_str().expect("id"))
            .collect();
        assert_eq!(calls, ["toolu_add", "toolu_wire"]);
        assert_eq!(messages[2]["role"], "user");
        let results: Vec<(&str, &Value)> = messages[2]["content"]
            .as_array()
            .expect("blocks")
            .iter()
            .map(|b| {
                assert_eq!(b["type"], "tool_result", "only results follow the calls");
                (b["tool_use_id"].as_str().expect("id"), &b["content"])
            })
            .collect();
        assert_eq!(
            results.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            calls,
            "one result per call, in order, right after them"
        );
        assert!(results[1].1.to_string().contains("wired 5"));
    }
}

#[cfg(feature = "openai")]
mod openai {
    use super::*;
    use markov_providers::OpenAi;
    use markov_testkit::http::{FakeServer, Reply, openai};
    use serde_json::json;

    #[tokio::test]
    async fn a_paused_call_is_answered_in_place_in_the_chat_completions_history() {
        let answer = openai::completion(
            "1",
            json!({
                "role": "assistant",
                "content": null,
                "refusal": null,
                "tool_calls": [
                    {"id": "call_add", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\":2,\"b\":3}"}},
                    {"id": "call_wire", "type": "function",
                     "function": {"name": "wire", "arguments": "{\"amount\":5}"}}
                ]
            }),
            "tool_calls",
        );
        let server = FakeServer::scripted(vec![
            Reply::json(200, answer),
            Reply::json(200, openai::text("Done: 5, and 5 wired.")),
        ])
        .await;
        let client = OpenAi::builder()
            .api_key("sk-proj-hitl-test")
            .base_url(format!("{}/v1", server.base_url()))
            .model("gpt-test")
            .build()
            .expect("a client");
        pause_approve_resume(client, || {
            server.requests().into_iter().map(|r| r.body).collect()
        })
        .await;
        let second = &server.requests()[1].body;
        let messages: Vec<&Value> = second["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .filter(|m| m["role"] != "system")
            .collect();
        assert_eq!(messages.len(), 4, "{messages:?}");
        let calls: Vec<&str> = messages[1]["tool_calls"]
            .as_array()
            .expect("tool calls")
            .iter()
            .map(|c| c["id"].as_str().expect("id"))
            .collect();
        assert_eq!(calls, ["call_add", "call_wire"]);
        let answered: Vec<&str> = messages[2..]
            .iter()
            .map(|m| {
                assert_eq!(m["role"], "tool", "only results follow the calls");
                m["tool_call_id"].as_str().expect("id")
            })
            .collect();
        assert_eq!(
            answered, calls,
            "one result per call, in order, right after them"
        );
        assert!(messages[3]["content"].to_string().contains("wired 5"));
    }
}
