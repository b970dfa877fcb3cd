//! One safe tool path: approvals only the application can give, idempotency
//! that survives a restore, budgets per user turn, and no panic, garbled
//! argument, duplicate id or cancellation that loses or repeats a call.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_charter::tool_choice::{ToolChoiceRule, TurnPolicy};
use markov_charter::transition::Transition;
use markov_core::Item;
use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::message::{MAX_ARGUMENT_DEPTH, Message};
use markov_core::model::{ModelResponse, StopReason, ToolChoice};
use markov_core::tool::{Tool, ToolContext, parse_tool_arguments};
use markov_executor::{
    CANCELLED_TOOL_CALL, DUPLICATE_TOOL_CALL, Instance, Machine, RunOptions, StandardExecutor,
    YieldReason, serialize_machine,
};
use markov_policy::{
    ApprovalFlow, ApprovalId, Budget, CONFIRMATION_TOKEN, Category, Mode, PolicyConfig,
    ToolMetadata, ToolRegistry, WithIntents,
};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::{Explode, Hang};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

// --- fixtures ---------------------------------------------------------------

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct PayArgs {
    amount: u32,
}

/// Moves money: counts its executions.
#[derive(Clone)]
struct Pay(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Pay {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(&self, args: PayArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!("paid {}", args.amount))
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
struct DeleteArgs {
    /// Which records; none deletes every record.
    filter: Option<String>,
}

/// Deletes records: the kind of tool that must never run on garbled input.
#[derive(Clone)]
struct DeleteRecords(Arc<AtomicUsize>);

#[async_trait]
impl Tool for DeleteRecords {
    const NAME: &'static str = "delete_records";
    type Args = DeleteArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Delete records".into()
    }
    async fn call(&self, args: DeleteArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!(
            "deleted {}",
            args.filter.as_deref().unwrap_or("everything")
        ))
    }
}

/// Returns an intent for the application.
struct EndSession;

#[async_trait]
impl Tool for EndSession {
    const NAME: &'static str = "end_session";
    type Args = NoArgs;
    type Output = WithIntents<String>;
    type Error = Infallible;
    fn description(&self) -> String {
        "End the session".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<Self::Output, Infallible> {
        Ok(WithIntents::new(
            "bye".to_owned(),
            [json!({"type": "end_session"})],
        ))
    }
}

/// A response calling tools with the given ids.
fn calls(list: &[(&str, &str, Value)]) -> ModelResponse {
    ModelResponse::new(
        list.iter()
            .map(|(id, name, input)| Item::tool_use(*id, *name, input.clone()))
            .collect(),
        StopReason::ToolUse,
    )
}

fn registry(config: PolicyConfig, pays: &Arc<AtomicUsize>) -> Arc<ToolRegistry> {
    Arc::new(
        ToolRegistry::builder(config)
            .register(
                Pay(pays.clone()),
                ToolMetadata::new(Category::Action).with_confirmation(),
            )
            .register(EndSession, ToolMetadata::new(Category::Other))
            .register(Add, ToolMetadata::new(Category::Other))
            .lock()
            .expect("the registry locks"),
    )
}

/// A machine whose node declares no tools: the registry's are its tools.
fn registry_machine(model: Arc<ScriptedModel>, registry: Arc<ToolRegistry>) -> (Charter, Machine) {
    let node = Node::builder("Help with payments.")
        .name("main")
        .build()
        .expect("node builds");
    let charter = Charter::builder("payments")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    let machine = machine_on(
        charter.clone(),
        StandardExecutor::shared(model).with_registry(registry, Mode::TEXT),
        Instance::new(node, json!({})),
    )
    .expect("machine builds");
    (charter, machine)
}

fn error_type(content: &str) -> Option<String> {
    let v: Value = serde_json::from_str(content).ok()?;
    v["error"]["type"].as_str().map(str::to_owned)
}

// --- approvals --------------------------------------------------------------

/// The model-mediated flow: the model calls again with the approved token.
fn token_flow() -> PolicyConfig {
    PolicyConfig::new(Budget::UNLIMITED).approval_flow(ApprovalFlow::Token)
}

#[tokio::test]
async fn in_the_token_flow_the_model_is_offered_the_token_and_cannot_approve_its_own_payment() {
    let pays = Arc::new(AtomicUsize::new(0));
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("c1", "pay", json!({"amount": 50}))]))
            .text("Please approve the payment.")
            .build(),
    );
    let (_, mut m) = registry_machine(model.clone(), registry(token_flow(), &pays));
    m.enqueue_user("pay 50");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");

    // One registration: the tool list comes from the registry, with the
    // argument the stack reads.
    let request = &model.requests()[0];
    let pay = request
        .tools
        .iter()
        .find(|t| t.name.as_str() == "pay")
        .expect("pay is offered");
    assert!(pay.input_schema["properties"][CONFIRMATION_TOKEN].is_object());
    assert!(request.tool_names().contains(&"add"));

    let content = &all_results(m.history())[0].1;
    assert_eq!(
        error_type(content).as_deref(),
        Some("CONFIRMATION_REQUIRED")
    );
    let envelope: Value = serde_json::from_str(content).expect("json");
    let id = envelope["error"]["confirmation_request"]["request_id"]
        .as_str()
        .expect("an opaque request id")
        .to_owned();
    assert_eq!(m.approvals().pending().len(), 1);
    assert_eq!(pays.load(Ordering::SeqCst), 0);

    // The model presents the id without the user's approval: pending.
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[(
                "c2",
                "pay",
                json!({"amount": 50, CONFIRMATION_TOKEN: id}),
            )]))
            .text("Still waiting.")
            .build(),
    );
    let (charter, _) = registry_machine(model.clone(), registry(token_flow(), &pays));
    let snapshot = serialize_machine(&m).expect("serializes");
    assert_eq!(
        snapshot.policy.approvals.len(),
        1,
        "the pending approval is in the snapshot"
    );
    let registry_again = registry(token_flow(), &pays);
    let mut m = restore_on(
        charter.clone(),
        Arc::new(StandardExecutor::shared(model).with_registry(registry_again.clone(), Mode::TEXT)),
        snapshot.into_owned(),
    )
    .expect("restores");
    m.enqueue_user("go on");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let last = all_results(m.history()).pop().expect("a result");
    assert_eq!(error_type(&last.1).as_deref(), Some("CONFIRMATION_PENDING"));
    assert_eq!(pays.load(Ordering::SeqCst), 0);

    // The application approves (after the restore): the call runs once.
    m.approvals()
        .approve(&ApprovalId::from(id.as_str()))
        .expect("the user approves");
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[(
                "c3",
                "pay",
                json!({"amount": 50, CONFIRMATION_TOKEN: id}),
            )]))
            .response(calls(&[(
                "c4",
                "pay",
                json!({"amount": 50, CONFIRMATION_TOKEN: id}),
            )]))
            .text("Paid.")
            .build(),
    );
    let snapshot = serialize_machine(&m).expect("serializes");
    let mut m = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(model).with_registry(registry_again, Mode::TEXT)),
        snapshot.into_owned(),
    )
    .expect("restores");
    m.enqueue_user("approved");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let results = all_results(m.history());
    let n = results.len();
    assert_eq!(results[n - 2].1, r#"{"ok":true,"data":"paid 50"}"#);
    assert_eq!(
        error_type(&results[n - 1].1).as_deref(),
        Some("CONFIRMATION_INVALID"),
        "single use"
    );
    assert_eq!(pays.load(Ordering::SeqCst), 1);
    assert_paired(m.history());
}

// --- idempotency --------------------------------------------------------------

/// The ledger travels in the snapshot and holds only the calls of answers
/// still to be replayed: a provider that reuses an id in a later turn, or
/// in a later step of the same turn, makes a new call (an earlier answer
/// would be stale), whatever its arguments. (Replaying an interrupted step
/// after a restore is `exactly_once`'s test.)
#[tokio::test]
async fn a_call_id_reused_in_a_later_turn_after_a_restore_is_a_new_call() {
    let pays = Arc::new(AtomicUsize::new(0));
    let config = || PolicyConfig::new(Budget::UNLIMITED);
    // No confirmation here: the ledger is what is tested.
    let reg = |pays: &Arc<AtomicUsize>| {
        Arc::new(
            ToolRegistry::builder(config())
                .register(Pay(pays.clone()), ToolMetadata::new(Category::Action))
                .lock()
                .expect("locks"),
        )
    };
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("call_1", "pay", json!({"amount": 7}))]))
            .text("Done.")
            .build(),
    );
    let (charter, mut m) = registry_machine(model, reg(&pays));
    m.enqueue_user("pay 7");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(pays.load(Ordering::SeqCst), 1);
    let text = serde_json::to_string(&serialize_machine(&m).expect("serializes")).expect("json");

    // A fresh process: new registry, new tool counter, the snapshot's ledger.
    let pays_after = Arc::new(AtomicUsize::new(0));
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("call_1", "pay", json!({"amount": 7}))]))
            .response(calls(&[("call_1", "pay", json!({"amount": 9}))]))
            .text("Done again.")
            .build(),
    );
    let snapshot =
        serde_json::from_str::<markov_executor::SerializedMachine>(&text).expect("reads");
    let mut m = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(model).with_registry(reg(&pays_after), Mode::TEXT)),
        snapshot,
    )
    .expect("restores");
    m.enqueue_user("pay 7 again");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        pays_after.load(Ordering::SeqCst),
        2,
        "both calls of the new turn ran: the earlier turn's answer is not replayed, \
         nor is the first step's answer in the second step"
    );
    let results = all_results(m.history());
    let n = results.len();
    assert_eq!(results[n - 2].1, r#"{"ok":true,"data":"paid 7"}"#);
    assert_eq!(results[n - 1].1, r#"{"ok":true,"data":"paid 9"}"#);
}

// --- budgets --------------------------------------------------------------------

#[tokio::test]
async fn transitions_inside_a_user_turn_do_not_refill_the_budget() {
    let a = Node::builder("Node a.")
        .name("a")
        .transition("toB", Transition::to_ref("Go to b", "b"))
        .build()
        .expect("a builds");
    let b = Node::builder("Node b.")
        .name("b")
        .transition("toA", Transition::to_ref("Go to a", "a"))
        .build()
        .expect("b builds");
    let charter = Charter::builder("ab")
        .node("a", a.clone())
        .node("b", b)
        .build()
        .expect("charter builds");
    let registry = Arc::new(
        ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED.max_calls(2)))
            .register(Add, ToolMetadata::new(Category::Other))
            .lock()
            .expect("locks"),
    );
    let add = json!({"a": 1, "b": 1});
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("add", add.clone())
            .tool_call("transition", json!({"to": "toB", "reason": "go"}))
            .tool_call("transition", json!({"to": "toA", "reason": "back"}))
            .tool_call("add", add.clone())
            .tool_call("add", add.clone())
            .text("done")
            .tool_call("add", add.clone())
            .text("done again")
            .build(),
    );
    let mut m = machine_on(
        charter,
        StandardExecutor::shared(model).with_registry(registry, Mode::TEXT),
        Instance::new(a, json!({})),
    )
    .expect("machine builds");
    m.enqueue_user("add thrice");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let adds: Vec<_> = all_results(m.history())
        .into_iter()
        .filter(|(_, content, _)| content.starts_with('{'))
        .collect();
    assert_eq!(adds.len(), 3);
    assert_eq!(adds[0].1, r#"{"ok":true,"data":2}"#);
    assert_eq!(adds[1].1, r#"{"ok":true,"data":2}"#);
    assert_eq!(
        error_type(&adds[2].1).as_deref(),
        Some("BUDGET_EXCEEDED"),
        "a → b → a kept the count"
    );

    // The next user turn starts over.
    m.enqueue_user("once more");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let last = all_results(m.history()).pop().expect("a result");
    assert_eq!(last.1, r#"{"ok":true,"data":2}"#);
}

// --- a node's own tools beside a registry ----------------------------------------

#[tokio::test]
async fn a_nodes_own_unregistered_tools_are_callable_beside_a_registry() {
    for last in ["respond", "finish"] {
        let pays = Arc::new(AtomicUsize::new(0));
        let registry = Arc::new(
            ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
                .register(Pay(pays.clone()), ToolMetadata::new(Category::Action))
                .lock()
                .expect("the registry locks"),
        );
        let keeps = Arc::new(AtomicUsize::new(0));
        let node = Node::builder("Pay and keep.")
            .name("main")
            .tool(Keep(keeps.clone()))
            .tool(markov_tools_std::Respond)
            .tool(markov_tools_std::Finish)
            .build()
            .expect("node builds");
        let end = if last == "respond" {
            json!({"text": "all done"})
        } else {
            json!({"note": "all done"})
        };
        let model = Arc::new(
            ScriptedModel::builder()
                .response(calls(&[
                    ("c1", "keep", json!({"filter": "x"})),
                    ("c2", "pay", json!({"amount": 3})),
                ]))
                .response(calls(&[("c3", last, end)]))
                .text("unused")
                .build(),
        );
        let charter = Charter::builder("t")
            .node("main", node.clone())
            .build()
            .expect("charter");
        let executor = StandardExecutor::shared(model.clone()).with_registry(registry, Mode::TEXT);
        let mut m = machine_on(charter, executor, Instance::new(node, json!({}))).expect("machine");
        m.enqueue_user("go");
        let (steps, err) = run_all(&mut m, RunOptions::default()).await;
        assert!(err.is_none(), "{err:?}");
        assert!(steps.last().is_some_and(|s| s.done), "{last} ends the run");
        // What was offered is what could be called.
        let offered: Vec<String> = model.requests()[0]
            .tools
            .iter()
            .map(|t| t.name.to_string())
            .collect();
        for name in ["keep", "respond", "finish", "pay"] {
            assert!(
                offered.iter().any(|o| o == name),
                "{name} offered: {offered:?}"
            );
        }
        assert_eq!(keeps.load(Ordering::SeqCst), 1, "the node's own tool ran");
        assert_eq!(pays.load(Ordering::SeqCst), 1, "the registered tool ran");
        let results = all_results(m.history());
        assert_eq!(results.len(), 3, "{results:?}");
        for (id, content, is_error) in &results {
            assert_eq!(*is_error, Some(false), "{id}: {content}");
        }
        assert_eq!(results[0].1, "kept", "plain, as without a registry");
        assert_eq!(
            results[1].1, r#"{"ok":true,"data":"paid 3"}"#,
            "through the registry's stack"
        );
        assert_paired(m.history());
    }
}

// --- panics, garbled arguments, duplicates ------------------------------------

#[tokio::test]
async fn a_panicking_tool_is_an_error_result_and_the_rest_of_the_response_runs() {
    for with_registry in [false, true] {
        let model = Arc::new(
            ScriptedModel::builder()
                .response(calls(&[
                    ("c1", "add", json!({"a": 1, "b": 2})),
                    ("c2", "explode", json!({})),
                    ("c3", "add", json!({"a": 3, "b": 4})),
                ]))
                .text("one tool failed")
                .build(),
        );
        let node = Node::builder("Tools.")
            .name("main")
            .tool(Add)
            .tool(Explode)
            .build()
            .expect("node builds");
        let charter = Charter::builder("t")
            .node("main", node.clone())
            .build()
            .expect("charter");
        let mut executor = StandardExecutor::shared(model);
        if with_registry {
            let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
                .register(Add, ToolMetadata::new(Category::Other))
                .register(Explode, ToolMetadata::new(Category::Other))
                .lock()
                .expect("locks");
            executor = executor.with_registry(Arc::new(registry), Mode::TEXT);
        }
        let mut m = machine_on(charter, executor, Instance::new(node, json!({}))).expect("machine");
        m.enqueue_user("go");
        let (steps, err) = run_all(&mut m, RunOptions::default()).await;
        assert!(err.is_none(), "{err:?}");
        assert!(steps.last().is_some_and(|s| s.done));
        let results = all_results(m.history());
        assert_eq!(results.len(), 3);
        assert_eq!(results[0].2, Some(false));
        assert_eq!(results[1].2, Some(true));
        assert!(
            results[1].1.contains("the tool panicked"),
            "{}",
            results[1].1
        );
        if with_registry {
            assert_eq!(
                error_type(&results[1].1).as_deref(),
                Some("EXECUTION_FAILED")
            );
        }
        assert_eq!(results[2].2, Some(false), "the call after the panic ran");
        assert_paired(m.history());
    }
}

#[tokio::test]
async fn garbled_arguments_never_reach_a_tool() {
    for with_registry in [false, true] {
        let deletes = Arc::new(AtomicUsize::new(0));
        let cut_off = parse_tool_arguments(r#"{"filter": "id = 4"#);
        let model = Arc::new(
            ScriptedModel::builder()
                .response(calls(&[
                    ("c1", "delete_records", cut_off.clone()),
                    ("c2", "delete_records", json!(null)),
                    ("c3", "transition", cut_off.clone()),
                ]))
                .text("I could not delete anything")
                .build(),
        );
        let node = Node::builder("Records.")
            .name("main")
            .tool(DeleteRecords(deletes.clone()))
            .build()
            .expect("node builds");
        let charter = Charter::builder("t")
            .node("main", node.clone())
            .build()
            .expect("charter");
        let mut executor = StandardExecutor::shared(model);
        if with_registry {
            let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
                .register(
                    DeleteRecords(deletes.clone()),
                    ToolMetadata::new(Category::Action),
                )
                .lock()
                .expect("locks");
            executor = executor.with_registry(Arc::new(registry), Mode::TEXT);
        }
        let mut m = machine_on(charter, executor, Instance::new(node, json!({}))).expect("machine");
        m.enqueue_user("delete record 4");
        let (_, err) = run_all(&mut m, RunOptions::default()).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(deletes.load(Ordering::SeqCst), 0, "nothing was deleted");
        let results = all_results(m.history());
        assert_eq!(results.len(), 3);
        for (_, content, is_error) in &results {
            assert_eq!(*is_error, Some(true));
            if with_registry {
                assert_eq!(
                    error_type(content).as_deref(),
                    Some("INVALID_INPUT"),
                    "{content}"
                );
            } else {
                assert!(content.starts_with("Invalid tool input:"), "{content}");
            }
        }
        assert!(results[0].1.contains("not valid JSON"), "{}", results[0].1);
        assert!(
            results[1].1.contains("must be a JSON object"),
            "{}",
            results[1].1
        );
    }
}

/// Keeps anything: counts its executions.
struct Keep(Arc<AtomicUsize>);

#[derive(Deserialize, JsonSchema)]
struct KeepArgs {
    #[allow(dead_code)]
    filter: Value,
}

#[async_trait]
impl Tool for Keep {
    const NAME: &'static str = "keep";
    type Args = KeepArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Keep a filter".into()
    }
    async fn call(&self, _: KeepArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok("kept".into())
    }
}

/// `{"filter": {"a": {"a": ... }}}`, `depth` containers deep in all,
/// built without recursion.
fn nested_filter(depth: usize) -> Value {
    // `json!` would serialize the inner value again at every level.
    let wrap = |key: &str, inner: Value| {
        let mut map = serde_json::Map::new();
        map.insert(key.to_owned(), inner);
        Value::Object(map)
    };
    let mut value = json!("x");
    for _ in 1..depth {
        value = wrap("a", value);
    }
    wrap("filter", value)
}

#[tokio::test]
async fn arguments_nested_too_deep_are_refused_and_the_history_reads_back() {
    for with_registry in [false, true] {
        let deletes = Arc::new(AtomicUsize::new(0));
        let model = Arc::new(
            ScriptedModel::builder()
                .response(calls(&[
                    ("c1", "keep", nested_filter(126)),
                    ("c2", "keep", nested_filter(1_000)),
                    ("c3", "keep", nested_filter(MAX_ARGUMENT_DEPTH + 1)),
                ]))
                .text("I could not delete anything")
                .build(),
        );
        let node = Node::builder("Records.")
            .name("main")
            .tool(Keep(deletes.clone()))
            .build()
            .expect("node builds");
        let charter = Charter::builder("t")
            .node("main", node.clone())
            .build()
            .expect("charter");
        let mut executor = StandardExecutor::shared(model);
        if with_registry {
            let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
                .register(Keep(deletes.clone()), ToolMetadata::new(Category::Action))
                .lock()
                .expect("locks");
            executor = executor.with_registry(Arc::new(registry), Mode::TEXT);
        }
        let mut m = machine_on(charter, executor, Instance::new(node, json!({}))).expect("machine");
        m.enqueue_user("delete record 4");
        let (_, err) = run_all(&mut m, RunOptions::default()).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(deletes.load(Ordering::SeqCst), 0, "the tool never ran");
        let results = all_results(m.history());
        assert_eq!(results.len(), 3);
        for (_, content, is_error) in &results {
            assert_eq!(*is_error, Some(true));
            if with_registry {
                assert_eq!(
                    error_type(content).as_deref(),
                    Some("INVALID_INPUT"),
                    "{content}"
                );
            } else {
                assert!(content.starts_with("Invalid tool input:"), "{content}");
            }
            assert!(content.contains("nested deeper than"), "{content}");
        }
        for (_, _, input) in m.history().iter().flat_map(|msg| msg.tool_uses()) {
            assert_eq!(*input, json!({}), "a refused input is recorded as {{}}");
        }
        assert_paired(m.history());
        for message in m.history() {
            let json = serde_json::to_string(message).expect("writes");
            let read: Message = serde_json::from_str(&json).expect("reads back");
            assert_eq!(&read, message);
        }
        // The whole machine too: its snapshot nests the history deeper.
        let snapshot = serialize_machine(&m).expect("serializes");
        let text = serde_json::to_string(&snapshot).expect("writes");
        let back: Value = serde_json::from_str(&text).expect("the snapshot reads back");
        assert!(back.is_object());
    }
}

#[tokio::test]
async fn duplicate_call_ids_in_one_response_get_unique_ids_and_run_once() {
    let pays = Arc::new(AtomicUsize::new(0));
    let node = Node::builder("Pay.")
        .name("main")
        .tool(Pay(pays.clone()))
        .build()
        .expect("node builds");
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[
                ("dup", "pay", json!({"amount": 1})),
                ("dup", "pay", json!({"amount": 1})),
                ("dup", "pay", json!({"amount": 2})),
            ]))
            .text("paid")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("pay");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(pays.load(Ordering::SeqCst), 1);
    let ids: Vec<String> = m
        .history()
        .iter()
        .flat_map(|msg| {
            msg.tool_uses()
                .map(|(id, _, _)| id.to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        ids,
        ["dup", "dup_2", "dup_3"],
        "ids are unique in the history"
    );
    let results = all_results(m.history());
    assert_eq!(results[0].1, "paid 1");
    assert_eq!(
        results[1],
        ("dup_2".into(), DUPLICATE_TOOL_CALL.into(), Some(true))
    );
    assert_eq!(
        results[2],
        ("dup_3".into(), DUPLICATE_TOOL_CALL.into(), Some(true))
    );
    assert_paired(m.history());
    // The next request carries the unique ids, so a provider accepts it.
    let sent = &model.requests()[1].messages;
    let sent_ids: Vec<ToolCallId> = sent
        .iter()
        .flat_map(|msg| {
            msg.tool_uses()
                .map(|(id, _, _)| id.clone())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(sent_ids.len(), 3);
}

#[test]
fn many_calls_sharing_one_id_are_renamed_in_linear_time() {
    // Renaming used to scan every earlier call for every candidate name
    // (cubic in the calls): 20 000 calls took far longer than the bound
    // below, which only detects such a blow-up.
    const CALLS: usize = 20_000;
    let pays = Arc::new(AtomicUsize::new(0));
    let (done, finished) = std::sync::mpsc::channel();
    let worker_pays = pays.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let history = runtime.block_on(async move {
            let node = Node::builder("Pay.")
                .name("main")
                .tool(Pay(worker_pays))
                .build()
                .expect("node builds");
            let list: Vec<(&str, &str, Value)> = (0..CALLS)
                .map(|_| ("dup", "pay", json!({"amount": 1})))
                .collect();
            let model = Arc::new(
                ScriptedModel::builder()
                    .response(calls(&list))
                    .text("paid")
                    .build(),
            );
            let mut m = machine(|c| c, node, json!({}), model);
            m.enqueue_user("pay");
            let (_, err) = run_all(&mut m, RunOptions::default()).await;
            assert!(err.is_none(), "{err:?}");
            m.history().to_vec()
        });
        let _ = done.send(history);
    });
    let history = finished
        .recv_timeout(Duration::from_secs(60))
        .expect("20 000 repeated ids are renamed without a blow-up");
    assert_eq!(pays.load(Ordering::SeqCst), 1, "only the first call runs");
    let mut ids = std::collections::HashSet::new();
    let mut uses = 0;
    for msg in &history {
        for (id, _, _) in msg.tool_uses() {
            uses += 1;
            assert!(ids.insert(id.to_string()), "{id} is repeated");
        }
    }
    assert_eq!(uses, CALLS);
    assert!(ids.contains("dup") && ids.contains("dup_2") && ids.contains("dup_20000"));
    let mut answered = std::collections::HashSet::new();
    for (id, _, _) in all_results(&history) {
        assert!(ids.contains(&id), "{id} answers no call");
        assert!(answered.insert(id.clone()), "{id} is answered twice");
    }
    assert_eq!(answered.len(), CALLS, "every call has exactly one result");
}

// --- cancellation ----------------------------------------------------------------

#[tokio::test]
async fn a_cancelled_run_still_records_the_calls_that_completed() {
    let pays = Arc::new(AtomicUsize::new(0));
    let node = Node::builder("Pay, then wait.")
        .name("main")
        .tool(Pay(pays.clone()))
        .tool(Hang)
        .build()
        .expect("node builds");
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[
                ("p", "pay", json!({"amount": 3})),
                ("h", "hang", json!({})),
            ]))
            .text("Sorry, that took too long.")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("pay and wait");
    let cancelled = tokio::time::timeout(
        Duration::from_millis(100),
        run_all(&mut m, RunOptions::default()),
    )
    .await;
    assert!(cancelled.is_err(), "the outer timeout cancelled the run");
    assert_eq!(pays.load(Ordering::SeqCst), 1);

    // The next run records what the cancelled step did before anything else.
    m.enqueue_user("what happened?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let h = m.history();
    assert_paired(h);
    let results = all_results(h);
    assert_eq!(results[0], ("p".into(), "paid 3".into(), Some(false)));
    assert_eq!(
        results[1],
        ("h".into(), CANCELLED_TOOL_CALL.into(), Some(true))
    );
    let user_texts: Vec<String> = h
        .iter()
        .filter(|msg| msg.role == markov_core::Role::User && !msg.text().is_empty())
        .map(|msg| msg.text())
        .collect();
    assert_eq!(user_texts, ["pay and wait", "what happened?"]);
    assert_eq!(
        pays.load(Ordering::SeqCst),
        1,
        "the payment did not run again"
    );
}

// --- recovery, intents ---------------------------------------------------------

#[tokio::test]
async fn the_max_tokens_recovery_call_forces_no_tool() {
    let node = Node::builder("Use a tool first.")
        .name("main")
        .tool(Add)
        .policy(TurnPolicy {
            tool_choice: ToolChoiceRule::RequiredFirst,
            ..TurnPolicy::default()
        })
        .build()
        .expect("node builds");
    let cut = ModelResponse::new(
        vec![Item::tool_use("c1", "add", json!({"a": 1}))],
        StopReason::MaxTokens,
    );
    let model = Arc::new(
        ScriptedModel::builder()
            .response(cut)
            .text("A short answer.")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("a long question");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let requests = model.requests();
    assert_eq!(requests[0].tool_choice, ToolChoice::Any);
    assert_eq!(
        requests[1].tool_choice,
        ToolChoice::None,
        "no tool is forced on the recovery call"
    );
    assert_eq!(
        steps.last().map(|s| s.yield_reason),
        Some(YieldReason::EndTurn)
    );
}

#[tokio::test]
async fn intents_reach_the_step_as_typed_data() {
    let pays = Arc::new(AtomicUsize::new(0));
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("bye", "end_session", json!({}))]))
            .text("Goodbye.")
            .build(),
    );
    let (_, mut m) = registry_machine(model, registry(PolicyConfig::new(Budget::UNLIMITED), &pays));
    m.enqueue_user("bye");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let intents: Vec<_> = steps.iter().flat_map(|s| s.intents.iter()).collect();
    assert_eq!(intents.len(), 1);
    assert_eq!(intents[0].call_id, ToolCallId::new("bye"));
    assert_eq!(&intents[0].instance_id, m.instance().id());
    assert_eq!(intents[0].value, json!({"type": "end_session"}));
}
