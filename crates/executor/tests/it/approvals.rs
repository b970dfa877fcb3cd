//! Human in the loop: a call that needs approval pauses the run; the
//! application approves, edits, denies or answers it; resuming runs the
//! approved call once, records every call's result and only then calls the
//! model. The model calls are counted: there is no extra round trip.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::Item;
use markov_core::async_trait;
use markov_core::message::Message;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{
    Instance, Machine, MachineStep, RunError, StandardExecutor, YieldReason, serialize_machine,
};
use markov_policy::{
    ApprovalError, ApprovalFlow, Budget, CONFIRMATION_TOKEN, Category, Decision, Mode,
    PolicyConfig, ToolMetadata, ToolRegistry,
};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::{Pay, Wire};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

// --- fixtures ---------------------------------------------------------------

#[derive(Debug, Deserialize, JsonSchema)]
struct LookupArgs {
    who: String,
}

/// Reads a balance; counts its executions and bumps the node's counter.
#[derive(Clone, Default)]
struct Lookup(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Lookup {
    const NAME: &'static str = "lookup";
    type Args = LookupArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Look up a balance".into()
    }
    async fn call(&self, args: LookupArgs, cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        let count = cx.state_json()["count"].as_i64().unwrap_or(0);
        let _ = cx.update_state(json!({"count": count + 1}));
        Ok(format!("{} has 100", args.who))
    }
}

struct Bank {
    pay: Pay,
    lookups: Arc<AtomicUsize>,
    model: Arc<ScriptedModel>,
    machine: Machine,
    charter: Charter,
}

fn registry(config: PolicyConfig, pay: &Pay, lookups: &Arc<AtomicUsize>) -> Arc<ToolRegistry> {
    Arc::new(
        ToolRegistry::builder(config)
            .register(
                pay.clone(),
                ToolMetadata::new(Category::Action).with_confirmation(),
            )
            .register(
                Lookup(lookups.clone()),
                ToolMetadata::new(Category::Retrieval),
            )
            .lock()
            .expect("the registry locks"),
    )
}

fn bank_node() -> Node {
    Node::builder("You move money.")
        .name("main")
        .state_type::<Counter>()
        .build()
        .expect("node builds")
}

/// A machine whose registry has `pay` (needs approval) and `lookup`.
fn bank(config: PolicyConfig, model: ScriptedModel) -> Bank {
    let pay = Pay::default();
    let lookups = Arc::new(AtomicUsize::new(0));
    let model = Arc::new(model);
    let node = bank_node();
    let charter = Charter::builder("bank")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    let machine = machine_on(
        charter.clone(),
        StandardExecutor::shared(model.clone())
            .with_registry(registry(config, &pay, &lookups), Mode::TEXT),
        Instance::new(node, json!({"count": 0})),
    )
    .expect("machine builds");
    Bank {
        pay,
        lookups,
        model,
        machine,
        charter,
    }
}

/// The model asks for a lookup, a payment of 5 and another lookup in one
/// response, then answers with text once it has read the results.
fn mixed_script() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_calls([
            ("lookup", json!({"who": "alice"})),
            ("pay", json!({"amount": 5})),
            ("lookup", json!({"who": "bob"})),
        ])
        .text("All done.")
        .build()
}

/// Runs a turn that pauses and returns its last step.
async fn pause(machine: &mut Machine, text: &str) -> MachineStep {
    machine.enqueue_user(text);
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::AwaitingApproval);
    assert!(last.done, "the run waits for the application");
    assert!(machine.is_awaiting_approval());
    last
}

/// The calls and results of a history, as (call id, tool, input) and
/// (call id, content).
fn calls_of(history: &[Message]) -> Vec<(String, String, Value)> {
    history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|i| match i {
            Item::ToolUse { id, name, input } => {
                Some((id.to_string(), name.to_string(), input.clone()))
            }
            _ => None,
        })
        .collect()
}

fn contents(history: &[Message]) -> Vec<String> {
    all_results(history)
        .into_iter()
        .map(|(_, c, _)| c)
        .collect()
}

/// Everything the model was ever sent, as one string.
fn all_the_model_saw(model: &ScriptedModel) -> String {
    model
        .requests()
        .iter()
        .map(|r| {
            format!(
                "{}\n{}\n{}",
                r.system,
                serde_json::to_string(&r.messages).expect("json"),
                serde_json::to_string(&r.tools).expect("json")
            )
        })
        .collect()
}

// --- the pause --------------------------------------------------------------

/// A step that pauses for approval made its model call: the step reports
/// what that call used, and the session counts it then; the resumed step
/// replays the answer and counts nothing for it again.
#[tokio::test]
async fn a_paused_step_reports_its_model_calls_usage_and_the_resume_counts_it_once() {
    use markov_core::model::{ModelResponse, StopReason, Usage};
    let used = |input, output| Usage {
        input_tokens: input,
        output_tokens: output,
        ..Usage::default()
    };
    let script = ScriptedModel::builder()
        .response(
            ModelResponse::new(
                vec![Item::tool_use("call_1", "pay", json!({"amount": 5}))],
                StopReason::ToolUse,
            )
            .with_usage(used(100, 10)),
        )
        .response(
            ModelResponse::new(vec![Item::text("Paid.")], StopReason::EndTurn)
                .with_usage(used(200, 20)),
        )
        .build();
    let mut b = bank(PolicyConfig::new(Budget::UNLIMITED), script);
    let paused = pause(&mut b.machine, "pay 5").await;
    assert_eq!(
        (
            paused.usage.requests,
            paused.usage.input_tokens,
            paused.usage.output_tokens
        ),
        (1, 100, 10),
        "the paused step reports the call it made"
    );
    assert_eq!(paused.run_usage.input_tokens, 100);
    assert_eq!(b.machine.usage().session.input_tokens, 100);

    let request = paused.approvals[0].request_id.clone();
    b.machine
        .approvals()
        .approve(&request)
        .expect("the application approves");
    let last = b.machine.resume().await.expect("resumes");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(b.model.calls(), 2);
    assert_eq!(b.pay.paid(), [5]);
    let session = b.machine.usage().session;
    assert_eq!(
        (
            session.requests,
            session.input_tokens,
            session.output_tokens
        ),
        (2, 300, 30),
        "each model call counted once: the replayed answer is not counted again"
    );
}

#[tokio::test]
async fn an_approved_call_runs_once_on_resume_without_another_model_call() {
    let mut b = bank(PolicyConfig::new(Budget::UNLIMITED), mixed_script());
    let step = pause(&mut b.machine, "pay alice 5").await;

    // The pending call, as the application sees it.
    assert_eq!(step.approvals.len(), 1);
    let request = &step.approvals[0];
    assert_eq!(request.tool, "pay");
    assert_eq!(request.args, json!({"amount": 5}));
    assert_eq!(request.preview, r#"pay {"amount":5}"#);
    assert_eq!(request.call_id.as_ref().map(|c| c.as_str()), Some("call_2"));
    assert!(request.expires > 0);
    assert_eq!(b.machine.approvals().pending(), step.approvals);
    // The other calls of the response ran; the payment did not; the
    // response is not in the history yet.
    assert_eq!(b.lookups.load(Ordering::SeqCst), 2);
    assert!(b.pay.paid().is_empty());
    assert_eq!(b.machine.history().len(), 1, "only the user's message");
    assert_eq!(step.history, b.machine.history());
    assert_eq!(b.model.calls(), 1);

    b.machine
        .approvals()
        .approve(&request.request_id)
        .expect("the application approves");
    // No model call yet: deciding is not running.
    assert_eq!(b.model.calls(), 1);
    let last = b.machine.resume().await.expect("resumes");
    assert!(last.done);
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(!b.machine.is_awaiting_approval());
    assert_eq!(b.pay.paid(), [5], "paid once");
    assert_eq!(
        b.lookups.load(Ordering::SeqCst),
        2,
        "the calls that ran before the pause are answered from the ledger"
    );
    assert_eq!(
        b.model.calls(),
        2,
        "one model call before the pause, one after the tools: no extra round trip"
    );
    let history = b.machine.history();
    assert_paired(history);
    expect_test::expect![[r#"
        user: pay alice 5
        assistant: call lookup {"who":"alice"} [call_1]
        assistant: call pay {"amount":5} [call_2]
        assistant: call lookup {"who":"bob"} [call_3]
        instance: {"kind":"state","patch":{"count":2}}
        user: result [call_1]: {"ok":true,"data":"alice has 100"}
        user: result [call_2]: {"ok":true,"data":"paid 5"}
        user: result [call_3]: {"ok":true,"data":"bob has 100"}
        assistant: All done.
    "#]]
    .assert_eq(&transcript(history));
    // The second request is the whole history but its final answer: the
    // first request's plus the answer and every result.
    let requests = b.model.requests();
    assert_eq!(requests[1].messages[..], history[..history.len() - 1]);
    // The state updates of the lookups apply once each, replayed or not.
    assert_eq!(b.machine.instance().state()["count"], 2);
    // Their step is recorded: the paused call is gone; the request stays,
    // decided, until it expires (a second decision is refused as such).
    assert!(b.machine.approvals().pending().is_empty());
    let kept = serialize_machine(&b.machine)
        .expect("serializes")
        .policy
        .approvals;
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].request.request_id, request.request_id);
    assert_eq!(kept[0].status, markov_policy::ApprovalStatus::Used);
    assert!(kept[0].held.is_none(), "the call is not kept");
    assert!(matches!(
        b.machine
            .approvals()
            .approve(&request.request_id)
            .expect_err("decided already"),
        markov_policy::ApprovalError::AlreadyDecided { .. }
    ));
}

#[tokio::test]
async fn an_edited_call_runs_with_the_approved_arguments_and_is_recorded_with_them() {
    let mut b = bank(PolicyConfig::new(Budget::UNLIMITED), mixed_script());
    let step = pause(&mut b.machine, "pay alice 5").await;
    let id = &step.approvals[0].request_id;
    let approvals = b.machine.approvals();
    assert!(matches!(
        approvals.decide(
            id,
            Decision::Edit {
                args: json!({"amount": -3})
            }
        ),
        Err(ApprovalError::InvalidArguments { .. })
    ));
    assert!(matches!(
        approvals.decide(id, Decision::Edit { args: json!({}) }),
        Err(ApprovalError::InvalidArguments { reason, .. }) if reason.contains("amount")
    ));
    approvals
        .decide(
            id,
            Decision::Edit {
                args: json!({"amount": 3}),
            },
        )
        .expect("an edit that fits");
    b.machine.resume().await.expect("resumes");
    assert_eq!(b.pay.paid(), [3], "the approved arguments, once");
    let history = b.machine.history();
    assert_paired(history);
    assert_eq!(
        calls_of(history)[1],
        ("call_2".to_owned(), "pay".to_owned(), json!({"amount": 3})),
        "the history records the call as it ran"
    );
    assert_eq!(contents(history)[1], r#"{"ok":true,"data":"paid 3"}"#);
    assert_eq!(b.model.calls(), 2);
}

#[tokio::test]
async fn a_denial_with_a_message_is_what_the_model_reads() {
    let mut b = bank(PolicyConfig::new(Budget::UNLIMITED), mixed_script());
    let step = pause(&mut b.machine, "pay alice 5").await;
    b.machine
        .approvals()
        .decide(
            &step.approvals[0].request_id,
            Decision::Deny {
                message: Some("Alice was paid yesterday.".into()),
            },
        )
        .expect("deny");
    b.machine.resume().await.expect("resumes");
    assert!(b.pay.paid().is_empty(), "nothing paid");
    let history = b.machine.history();
    assert_paired(history);
    assert_eq!(
        contents(history)[1],
        r#"{"ok":false,"error":{"type":"CONFIRMATION_DENIED","message":"The user declined this action: Alice was paid yesterday.","retryable":false}}"#
    );
    let seen = &b.model.requests()[1].messages;
    assert!(
        contents(seen)[1].contains("Alice was paid yesterday."),
        "the model reads the message"
    );
    assert_eq!(b.model.calls(), 2);
}

#[tokio::test]
async fn the_applications_own_result_answers_the_call_and_the_tool_never_runs() {
    let mut b = bank(PolicyConfig::new(Budget::UNLIMITED), mixed_script());
    let step = pause(&mut b.machine, "pay alice 5").await;
    b.machine
        .approvals()
        .decide(
            &step.approvals[0].request_id,
            Decision::Respond {
                result: json!({"status": "paid by cheque"}),
            },
        )
        .expect("respond");
    b.machine.resume().await.expect("resumes");
    assert!(b.pay.paid().is_empty());
    assert_eq!(
        contents(b.machine.history())[1],
        r#"{"ok":true,"data":{"status":"paid by cheque"}}"#
    );
    assert_eq!(b.model.calls(), 2);
}

#[tokio::test]
async fn a_request_that_expires_while_paused_is_answered_as_expired() {
    // Requests that expire at once: deterministic, no clock in the test.
    let config = PolicyConfig::new(Budget::UNLIMITED).confirmation_ttl(std::time::Duration::ZERO);
    let mut b = bank(config, mixed_script());
    let step = pause(&mut b.machine, "pay alice 5").await;
    assert!(step.approvals.is_empty(), "nothing left to decide");
    let request = b
        .machine
        .approvals()
        .held_pending_at(std::time::UNIX_EPOCH)
        .pop()
        .expect("the request, seen from before its expiry");
    assert_eq!(
        b.machine.approvals().approve(&request.request_id),
        Err(ApprovalError::Expired(request.request_id.clone()))
    );
    b.machine.resume().await.expect("resumes");
    assert!(b.pay.paid().is_empty());
    let history = b.machine.history();
    assert_paired(history);
    assert!(
        contents(history)[1].contains("CONFIRMATION_EXPIRED"),
        "{}",
        contents(history)[1]
    );
    assert_eq!(b.model.calls(), 2);
}

#[tokio::test]
async fn an_approval_that_expires_before_the_resume_is_answered_as_expired() {
    let config = PolicyConfig::new(Budget::UNLIMITED).confirmation_ttl(std::time::Duration::ZERO);
    let mut b = bank(config, mixed_script());
    pause(&mut b.machine, "pay alice 5").await;
    let request = b
        .machine
        .approvals()
        .held_pending_at(std::time::UNIX_EPOCH)
        .pop()
        .expect("the request");
    // Approved in time (as of the epoch), used after its expiry (now).
    b.machine
        .approvals()
        .decide_at(
            &request.request_id,
            Decision::Approve,
            std::time::UNIX_EPOCH,
        )
        .expect("approved before the expiry");
    b.machine.resume().await.expect("resumes");
    assert!(b.pay.paid().is_empty(), "an expired approval runs nothing");
    assert!(contents(b.machine.history())[1].contains("CONFIRMATION_EXPIRED"));
}

#[tokio::test]
async fn an_undecided_call_pauses_the_resumed_run_again_without_a_model_call() {
    let mut b = bank(
        PolicyConfig::new(Budget::UNLIMITED),
        ScriptedModel::builder()
            .tool_calls([("pay", json!({"amount": 1})), ("pay", json!({"amount": 2}))])
            .text("Both handled.")
            .build(),
    );
    let step = pause(&mut b.machine, "pay twice").await;
    assert_eq!(step.approvals.len(), 2);
    let (first, second) = (
        step.approvals[0].request_id.clone(),
        step.approvals[1].request_id.clone(),
    );
    b.machine.approvals().approve(&first).expect("approve one");
    let again = b.machine.resume().await.expect("resumes");
    assert_eq!(again.yield_reason, YieldReason::AwaitingApproval);
    assert_eq!(
        again
            .approvals
            .iter()
            .map(|r| &r.request_id)
            .collect::<Vec<_>>(),
        [&second]
    );
    assert_eq!(b.pay.paid(), [1], "the approved call ran");
    assert_eq!(b.model.calls(), 1, "no model call while a call waits");
    assert_eq!(b.machine.history().len(), 1);

    b.machine.approvals().deny(&second).expect("deny the other");
    b.machine.resume().await.expect("resumes");
    assert_eq!(b.pay.paid(), [1], "the first is not paid twice");
    assert_paired(b.machine.history());
    assert_eq!(b.model.calls(), 2);
}

#[tokio::test]
async fn new_input_waits_while_a_step_waits_for_approval() {
    let mut b = bank(
        PolicyConfig::new(Budget::UNLIMITED),
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid.")
            .text("You are welcome.")
            .build(),
    );
    let step = pause(&mut b.machine, "pay 5").await;
    b.machine.enqueue_user("thanks");
    let refused = b.machine.run().await;
    assert_eq!(
        refused.err(),
        Some(RunError::AwaitingApproval { pending: 1 }),
    );
    assert_eq!(b.machine.queue().len(), 1, "the input stays queued");
    b.machine
        .approvals()
        .approve(&step.approvals[0].request_id)
        .expect("approve");
    let resumed = b.machine.resume().await.expect("resumes");
    assert_eq!(
        resumed.history.last().map(Message::text).as_deref(),
        Some("Paid.")
    );
    assert_eq!(b.machine.queue().len(), 1, "still queued for its own turn");
    let last = b.machine.run().await.expect("runs");
    assert_eq!(
        last.history.last().map(Message::text).as_deref(),
        Some("You are welcome.")
    );
    assert_eq!(b.pay.paid(), [5]);
    assert_paired(b.machine.history());
    assert_eq!(
        b.machine.resume().await.err(),
        Some(RunError::NotAwaitingApproval)
    );
}

#[tokio::test]
async fn a_paused_step_costs_its_budget_once() {
    let mut b = bank(
        PolicyConfig::new(Budget::UNLIMITED.max_calls(2)),
        ScriptedModel::builder()
            .tool_calls([
                ("lookup", json!({"who": "alice"})),
                ("pay", json!({"amount": 5})),
            ])
            .text("Done.")
            .build(),
    );
    let step = pause(&mut b.machine, "pay").await;
    b.machine
        .approvals()
        .approve(&step.approvals[0].request_id)
        .expect("approve");
    b.machine.resume().await.expect("resumes");
    assert_eq!(
        b.pay.paid(),
        [5],
        "within the budget: the replay is not charged again"
    );
    assert!(
        contents(b.machine.history())
            .iter()
            .all(|c| !c.contains("BUDGET"))
    );
}

#[tokio::test]
async fn a_paused_step_counts_its_calls_once_for_the_loop_guard() {
    // Three identical lookups are allowed in a turn, a fourth is not: the
    // replayed ones must not count again.
    let lookup = || ("lookup", json!({"who": "alice"}));
    let mut b = bank(
        PolicyConfig::new(Budget::UNLIMITED),
        ScriptedModel::builder()
            .tool_calls([lookup(), lookup(), lookup(), ("pay", json!({"amount": 5}))])
            .text("Done.")
            .build(),
    );
    let step = pause(&mut b.machine, "look thrice, then pay").await;
    b.machine
        .approvals()
        .approve(&step.approvals[0].request_id)
        .expect("approve");
    b.machine.resume().await.expect("resumes");
    let results = contents(b.machine.history());
    assert!(
        results.iter().all(|r| !r.contains("REPEATED_CALL")),
        "{results:?}"
    );
    assert_eq!(b.pay.paid(), [5]);
}

// --- the model cannot approve ------------------------------------------------

#[tokio::test]
async fn the_model_never_sees_anything_it_could_approve_with() {
    // It even tries: its second payment presents the first one's request id.
    let mut b = bank(
        PolicyConfig::new(Budget::UNLIMITED),
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid 5.")
            .text("Paid 7.")
            .build(),
    );
    let step = pause(&mut b.machine, "pay 5").await;
    let id = step.approvals[0].request_id.clone();
    b.machine.approvals().approve(&id).expect("approve");
    b.machine.resume().await.expect("resumes");
    let seen = all_the_model_saw(&b.model);
    assert!(!seen.contains("apr_"), "no request id reaches the model");
    assert!(!seen.contains(id.as_str()));
    assert!(
        !seen.contains(CONFIRMATION_TOKEN),
        "no token argument is offered"
    );

    // A model that presents an approved id (it cannot know one: this test
    // hands it over) gets no further: the call waits like any other.
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 7, CONFIRMATION_TOKEN: id.as_str()}))
            .text("Paid 7.")
            .build(),
    );
    let pay = Pay::default();
    let lookups = Arc::new(AtomicUsize::new(0));
    let snapshot = serialize_machine(&b.machine).expect("serializes");
    let mut m = restore_on(
        b.charter.clone(),
        Arc::new(StandardExecutor::shared(model.clone()).with_registry(
            registry(PolicyConfig::new(Budget::UNLIMITED), &pay, &lookups),
            Mode::TEXT,
        )),
        snapshot.into_owned(),
    )
    .expect("restores");
    m.enqueue_user("pay 7");
    let last = m.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::AwaitingApproval);
    assert!(pay.paid().is_empty());
    assert_ne!(last.approvals[0].request_id, id);
}

// --- durability ---------------------------------------------------------------

#[tokio::test]
async fn a_paused_machine_is_restored_from_its_snapshot_and_resumed() {
    let mut b = bank(PolicyConfig::new(Budget::UNLIMITED), mixed_script());
    let step = pause(&mut b.machine, "pay alice 5").await;
    let text =
        serde_json::to_string(&serialize_machine(&b.machine).expect("serializes")).expect("json");
    drop(b.machine);

    // Another process: new tools, a new model that has not been asked yet.
    let model = Arc::new(ScriptedModel::builder().text("All done.").build());
    let pay = Pay::default();
    let lookups = Arc::new(AtomicUsize::new(0));
    let mut m = restore_on(
        b.charter.clone(),
        Arc::new(StandardExecutor::shared(model.clone()).with_registry(
            registry(PolicyConfig::new(Budget::UNLIMITED), &pay, &lookups),
            Mode::TEXT,
        )),
        serde_json::from_str(&text).expect("reads"),
    )
    .expect("restores");
    assert!(m.is_awaiting_approval());
    assert_eq!(m.approvals().pending(), step.approvals);
    m.approvals()
        .approve(&step.approvals[0].request_id)
        .expect("approve after the restore");
    m.resume().await.expect("resumes");
    assert_eq!(pay.paid(), [5]);
    assert_eq!(
        lookups.load(Ordering::SeqCst),
        0,
        "the lookups ran before the restore"
    );
    assert_eq!(b.lookups.load(Ordering::SeqCst), 2);
    assert_eq!(model.calls(), 1, "the answer is replayed, not asked again");
    assert_paired(m.history());
    assert_eq!(m.instance().state()["count"], 2);
    assert_eq!(
        contents(m.history()),
        [
            r#"{"ok":true,"data":"alice has 100"}"#,
            r#"{"ok":true,"data":"paid 5"}"#,
            r#"{"ok":true,"data":"bob has 100"}"#,
        ]
    );
}

// --- without a registry, and the token flow ---------------------------------

#[tokio::test]
async fn a_tool_that_needs_approval_pauses_a_machine_without_a_registry() {
    let wire = Wire::default();
    let node = Node::builder("You wire money.")
        .name("main")
        .tool(wire.clone())
        .tool(Add)
        .build()
        .expect("node builds");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("add", json!({"a": 1, "b": 2})),
                ("wire", json!({"amount": 9})),
            ])
            .text("Wired.")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    let step = pause(&mut m, "wire 9").await;
    assert_eq!(step.approvals[0].tool, "wire");
    assert!(
        model.requests()[0]
            .tools
            .iter()
            .all(|t| t.input_schema["properties"]
                .get(CONFIRMATION_TOKEN)
                .is_none()),
        "nothing to approve with"
    );
    m.approvals()
        .decide(
            &step.approvals[0].request_id,
            Decision::Deny {
                message: Some("not now".into()),
            },
        )
        .expect("deny");
    m.resume().await.expect("resumes");
    assert!(wire.paid().is_empty());
    let results = contents(m.history());
    assert_eq!(results[0], "3");
    assert_eq!(results[1], "The user declined this action: not now");
    assert_eq!(model.calls(), 2);
    assert_paired(m.history());
}

#[tokio::test]
async fn a_streamed_answer_that_pauses_leaves_nothing_half_recorded() {
    let pay = Pay::default();
    let lookups = Arc::new(AtomicUsize::new(0));
    let model = Arc::new(mixed_script());
    let node = bank_node();
    let charter = Charter::builder("bank")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    let mut m = machine_on(
        charter,
        StandardExecutor::shared(model.clone())
            .with_registry(
                registry(PolicyConfig::new(Budget::UNLIMITED), &pay, &lookups),
                Mode::TEXT,
            )
            .with_streaming(|_| {}),
        Instance::new(node, json!({"count": 0})),
    )
    .expect("machine builds");
    let step = pause(&mut m, "pay alice 5").await;
    assert_eq!(m.history().len(), 1, "no vessel left behind");
    assert!(m.queue().is_empty());
    m.approvals()
        .approve(&step.approvals[0].request_id)
        .expect("approve");
    m.resume().await.expect("resumes");
    assert_paired(m.history());
    assert_eq!(pay.paid(), [5]);
    assert_eq!(model.calls(), 2);
    assert_eq!(
        m.history().last().map(Message::text).as_deref(),
        Some("All done.")
    );
}

#[tokio::test]
async fn the_token_flow_stays_available_and_does_not_pause() {
    let mut b = bank(
        PolicyConfig::new(Budget::UNLIMITED).approval_flow(ApprovalFlow::Token),
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Please approve.")
            .build(),
    );
    b.machine.enqueue_user("pay 5");
    let last = b.machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(!b.machine.is_awaiting_approval());
    assert!(contents(b.machine.history())[0].contains("CONFIRMATION_REQUIRED"));
    let id = b.machine.approvals().pending()[0].request_id.clone();
    assert!(matches!(
        b.machine.approvals().decide(
            &id,
            Decision::Edit {
                args: json!({"amount": 1})
            }
        ),
        Err(ApprovalError::Unsupported { .. })
    ));
}

/// Needs approval; once running it says so and never finishes.
#[derive(Clone, Default)]
struct Stuck(Arc<tokio::sync::Notify>);

#[async_trait]
impl Tool for Stuck {
    const NAME: &'static str = "stuck";
    const NEEDS_APPROVAL: bool = true;
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Never finishes".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.notify_one();
        std::future::pending::<()>().await;
        Ok("never".into())
    }
}

#[tokio::test]
async fn a_cancelled_resume_records_what_ran_and_loses_no_input() {
    let stuck = Stuck::default();
    let node = Node::builder("You do things.")
        .name("main")
        .tool(stuck.clone())
        .tool(Add)
        .build()
        .expect("node builds");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([("add", json!({"a": 2, "b": 3})), ("stuck", json!({}))])
            .text("Noted.")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    let step = pause(&mut m, "add, then get stuck").await;
    m.approvals()
        .approve(&step.approvals[0].request_id)
        .expect("approve");
    m.enqueue_user("later");
    {
        let resume = m.resume();
        futures::pin_mut!(resume);
        tokio::select! {
            done = &mut resume => panic!("it cannot finish: {:?}", done.map(|s| s.yield_reason)),
            () = stuck.0.notified() => {}
        }
        // Dropped here, as a run cancelled by its caller.
    }
    assert!(
        !m.is_awaiting_approval(),
        "the cancelled step records the answer"
    );
    let queued: Vec<String> = m.queue().messages().iter().map(Message::text).collect();
    assert_eq!(
        queued.last().map(String::as_str),
        Some("later"),
        "{queued:?}"
    );
    m.run().await.expect("runs");
    let history = m.history();
    assert_paired(history);
    assert_eq!(calls_of(history).len(), 2, "the answer is recorded once");
    assert_eq!(
        contents(history),
        [
            "5".to_owned(),
            markov_executor::CANCELLED_TOOL_CALL.to_owned()
        ]
    );
    let said: Vec<String> = history
        .iter()
        .filter(|m| m.role == markov_core::Role::User)
        .map(Message::text)
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(said, ["add, then get stuck", "later"], "in order");
    assert_eq!(model.calls(), 2);
}

// --- the invariant over random answers and decisions -----------------------

/// One call of a random answer: a plain lookup, or a payment of `amount`
/// and what the application decides on it.
#[derive(Debug, Clone)]
enum Planned {
    Lookup,
    Pay(u32, Choice),
}

#[derive(Debug, Clone)]
enum Choice {
    Approve,
    Edit(u32),
    Deny,
    Respond,
}

fn planned() -> impl proptest::strategy::Strategy<Value = Planned> {
    use proptest::prelude::*;
    let choice = prop_oneof![
        Just(Choice::Approve),
        (1u32..1000).prop_map(Choice::Edit),
        Just(Choice::Deny),
        Just(Choice::Respond),
    ];
    prop_oneof![
        Just(Planned::Lookup),
        ((1u32..1000), choice).prop_map(|(amount, choice)| Planned::Pay(amount, choice)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Whatever the answer and the decisions: the step pauses after one
    /// model call, the plain calls run once, each approved call runs once
    /// with the arguments approved and no other payment runs, every call
    /// gets its result in place, and the model is asked once more.
    #[test]
    fn an_approved_call_runs_once_with_the_arguments_approved(
        plan in proptest::collection::vec(planned(), 1..6)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            // Distinct arguments: the loop guard has no say here.
            let calls: Vec<(&str, Value)> = plan
                .iter()
                .enumerate()
                .map(|(i, p)| match p {
                    Planned::Lookup => ("lookup", json!({"who": format!("p{i}")})),
                    Planned::Pay(amount, _) => ("pay", json!({"amount": amount * 8 + i as u32})),
                })
                .collect();
            let mut b = bank(
                PolicyConfig::new(Budget::UNLIMITED),
                ScriptedModel::builder().tool_calls(calls).text("Done.").build(),
            );
            let lookups = plan.iter().filter(|p| matches!(p, Planned::Lookup)).count();
            let choices: Vec<&Choice> = plan
                .iter()
                .filter_map(|p| match p {
                    Planned::Pay(_, choice) => Some(choice),
                    Planned::Lookup => None,
                })
                .collect();
            b.machine.enqueue_user("go");
            let step = b.machine.run().await.expect("runs");
            if choices.is_empty() {
                assert_eq!(step.yield_reason, YieldReason::EndTurn);
                assert_eq!(b.lookups.load(Ordering::SeqCst), lookups);
                return;
            }
            assert_eq!(step.yield_reason, YieldReason::AwaitingApproval);
            assert_eq!(step.approvals.len(), choices.len());
            assert_eq!(b.lookups.load(Ordering::SeqCst), lookups);
            assert!(b.pay.paid().is_empty());
            let mut expected_paid = Vec::new();
            for (request, choice) in step.approvals.iter().zip(&choices) {
                let amount = request.args["amount"].as_u64().expect("an amount") as u32;
                let decision = match choice {
                    Choice::Approve => {
                        expected_paid.push(amount);
                        Decision::Approve
                    }
                    Choice::Edit(to) => {
                        expected_paid.push(*to);
                        Decision::Edit { args: json!({"amount": to}) }
                    }
                    Choice::Deny => Decision::Deny { message: Some("no".into()) },
                    Choice::Respond => Decision::Respond { result: json!("by hand") },
                };
                b.machine
                    .approvals()
                    .decide(&request.request_id, decision)
                    .expect("decided");
            }
            assert_eq!(b.model.calls(), 1);
            let last = b.machine.resume().await.expect("resumes");
            assert!(last.done);
            assert_eq!(b.model.calls(), 2, "one model call after the results");
            assert_eq!(b.pay.paid(), expected_paid, "each approved call once, as approved");
            assert_eq!(b.lookups.load(Ordering::SeqCst), lookups, "no plain call twice");
            let history = b.machine.history();
            assert_paired(history);
            let recorded = calls_of(history);
            assert_eq!(recorded.len(), plan.len());
            let results = contents(history);
            let mut choice = choices.iter();
            for ((_, tool, input), result) in recorded.iter().zip(&results) {
                if tool == "lookup" {
                    assert_eq!(
                        *result,
                        format!(r#"{{"ok":true,"data":"{} has 100"}}"#, input["who"].as_str().unwrap_or_default())
                    );
                    continue;
                }
                match choice.next().expect("a payment") {
                    Choice::Approve | Choice::Edit(_) => assert_eq!(
                        *result,
                        format!(r#"{{"ok":true,"data":"paid {}"}}"#, input["amount"]),
                        "recorded with the arguments it ran with"
                    ),
                    Choice::Deny => assert!(result.contains("CONFIRMATION_DENIED")),
                    Choice::Respond => assert_eq!(result, r#"{"ok":true,"data":"by hand"}"#),
                }
            }
        });
    }
}
