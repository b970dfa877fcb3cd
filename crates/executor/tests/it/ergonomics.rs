//! What users of other agent frameworks expect: token usage per step and
//! per run, tools that own the application's value, typed answers.

use std::sync::Arc;

use crate::common::*;
use markov_charter::node::{Node, OutputConfig};
use markov_core::Item;
use markov_core::message::{Message, Role};
use markov_core::model::{ModelResponse, StopReason, Usage};
use markov_core::tool;
use markov_executor::{RunOptions, StandardExecutor, TypedRunError, retry_prompt};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

fn used(input: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
        ..Usage::default()
    }
}

#[tokio::test]
async fn usage_is_summed_per_step_and_per_run() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(
                ModelResponse::new(
                    vec![Item::tool_use("c1", "add", json!({"a": 1, "b": 2}))],
                    StopReason::ToolUse,
                )
                .with_usage(used(100, 10)),
            )
            .response(
                ModelResponse::new(vec![Item::text("3")], StopReason::EndTurn)
                    .with_usage(used(120, 5)),
            )
            .build(),
    );
    let node = Node::builder("Add.").tool(Add).build().expect("node");
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("1 + 2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 2);
    // Each call is one request; the scripted model names no model, so it
    // has no price.
    let called = |input, output, calls| Usage {
        requests: calls,
        unpriced_requests: calls,
        ..used(input, output)
    };
    assert_eq!(steps[0].usage, called(100, 10, 1));
    assert_eq!(steps[0].run_usage, called(100, 10, 1));
    assert_eq!(steps[1].usage, called(120, 5, 1));
    assert_eq!(steps[1].run_usage, called(220, 15, 2));
    assert_eq!(steps[1].totals.turn, called(220, 15, 2));
    assert_eq!(m.usage().session, called(220, 15, 2));
}

/// The application's value: a tenant and its price list.
#[derive(Clone)]
struct Shop {
    tenant: &'static str,
}

/// A tool that owns what it needs of the application: given when the node
/// is built, never looked up when the tool runs.
struct WhoAmI {
    shop: Shop,
}

#[tool]
impl WhoAmI {
    /// Which shop is this.
    async fn who_am_i(&self) -> String {
        self.shop.tenant.to_owned()
    }
}

#[tokio::test]
async fn tools_own_the_applications_value() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("who_am_i", json!({}))
            .text("You are acme.")
            .tool_call("who_am_i", json!({}))
            .text("Still acme.")
            .build(),
    );
    let shop = Shop { tenant: "acme" };
    let node = Node::builder("Shop.")
        .tool(WhoAmI { shop: shop.clone() })
        .build()
        .expect("node");
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("who am I?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    m.enqueue_user("and now?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let results = all_results(m.history());
    assert_eq!(results.len(), 2);
    assert!(
        results.iter().all(|(_, text, _)| text == "acme"),
        "{results:?}"
    );
}

#[derive(Debug, Deserialize, JsonSchema, PartialEq)]
struct Answer {
    value: i64,
}

fn typed_node() -> Node {
    Node::builder("Answer in JSON.")
        .output(OutputConfig::of::<Answer>())
        .build()
        .expect("node")
}

#[tokio::test]
async fn a_typed_run_asks_again_when_the_answer_does_not_parse() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text(r#"{"value": "forty-two"}"#)
            .text(r#"{"value": 42}"#)
            .build(),
    );
    let mut m = machine(|c| c, typed_node(), json!({}), model.clone());
    m.enqueue_user("six times seven?");
    let typed = m.run_typed::<Answer>().await.expect("a typed answer");
    assert_eq!(typed.value, Answer { value: 42 });
    assert_eq!(typed.attempts, 2);
    let asked_again = &model.requests()[1].messages;
    let last = asked_again.last().expect("a message");
    assert!(
        last.text().starts_with("Your answer did not match"),
        "{}",
        last.text()
    );
    // The follow-up is markov's words, not the user's: a system message.
    assert_eq!(last.role, Role::System, "{last:?}");
    let users: Vec<String> = m
        .history()
        .iter()
        .filter(|msg| msg.role == Role::User)
        .map(Message::text)
        .collect();
    assert_eq!(users, ["six times seven?"], "the user wrote one message");
    let follow_ups: Vec<&Message> = m
        .history()
        .iter()
        .filter(|msg| msg.text().starts_with("Your answer did not match"))
        .collect();
    assert_eq!(follow_ups.len(), 1, "{:?}", m.history());
    assert_eq!(follow_ups[0].role, Role::System);

    // A snapshot and its restore keep the role.
    let text = serde_json::to_string(&markov_executor::serialize_machine(&m).expect("serializes"))
        .expect("writes");
    let snapshot: markov_executor::SerializedMachine = serde_json::from_str(&text).expect("reads");
    let charter = m.charter().clone();
    let restored = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(model.clone())),
        snapshot,
    )
    .expect("restores");
    assert_eq!(restored.history(), m.history());
    let roles: Vec<Role> = restored.history().iter().map(|msg| msg.role).collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::System, Role::Assistant]
    );
}

#[tokio::test]
async fn markovs_follow_up_starts_a_run_within_the_users_turn() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("first")
            .text("second")
            .build(),
    );
    let mut m = machine(
        |c| c,
        Node::builder("Answer.").build().expect("node"),
        json!({}),
        model.clone(),
    );
    m.enqueue_user("hello");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(model.calls(), 1);

    // A system message enqueued as a plain message records and calls no
    // model; markov's instruction calls one.
    m.enqueue([Message::system("a note")]);
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(model.calls(), 1, "a plain system message starts no run");
    m.enqueue_instruction("Say it again.");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(model.calls(), 2, "markov's instruction runs the model");
    assert!(steps.last().is_some_and(|s| s.done));
    let last = model.requests()[1]
        .messages
        .last()
        .cloned()
        .expect("a message");
    assert_eq!(last, Message::system("Say it again."));
    assert_eq!(
        m.history().last().map(Message::text).as_deref(),
        Some("second")
    );
    assert_eq!(
        m.history()
            .iter()
            .filter(|msg| msg.role == Role::User)
            .count(),
        1,
        "{:?}",
        m.history()
    );
}

#[tokio::test]
async fn a_cut_typed_answer_is_an_error_not_a_guess() {
    // The answer is cut mid-JSON; a recovery call under the output schema
    // would have the model shape a guess like an answer (the second one).
    let model = Arc::new(
        ScriptedModel::builder()
            .max_tokens(r#"{"value": 4"#)
            .text(r#"{"value": 7}"#)
            .build(),
    );
    let mut m = machine(|c| c, typed_node(), json!({}), model.clone());
    m.enqueue_user("six times seven?");
    let err = m.run_typed::<Answer>().await.expect_err("cut, not guessed");
    match &err {
        TypedRunError::Cut { attempts, answer } => {
            assert_eq!(*attempts, 1);
            assert_eq!(answer, &json!(r#"{"value": 4"#));
        }
        other => panic!("unexpected: {other}"),
    }
    assert!(err.to_string().contains("cut by the token limit"), "{err}");
    assert_eq!(model.calls(), 1, "no recovery call, no retry");
    assert!(
        m.history()
            .iter()
            .all(|msg| msg.text() != markov_executor::RECOVERY_TEXT),
        "no reminder was injected"
    );
}

#[tokio::test]
async fn a_typed_run_gives_up_after_its_retries() {
    let model = Arc::new(ScriptedModel::builder().text("no").text("still no").build());
    let mut m = machine(|c| c, typed_node(), json!({}), model.clone());
    m.enqueue_user("six times seven?");
    let err = m
        .run_typed_with::<Answer>(RunOptions::default(), 1)
        .await
        .expect_err("never parses");
    match err {
        TypedRunError::Invalid {
            attempts, answer, ..
        } => {
            assert_eq!(attempts, 2, "one re-ask, then it stops");
            assert_eq!(answer, json!("still no"));
        }
        other => panic!("unexpected: {other}"),
    }
    assert_eq!(model.calls(), 2, "bounded");
    assert!(retry_prompt("x").contains("x"));
}
