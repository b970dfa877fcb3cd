//! The tool registry and its policy stack: order, envelopes, budgets,
//! confirmation, idempotency, timeouts, audit, provider schemas, intents.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::{NoState, Tool, ToolContext, ToolExecutionResult};
use markov_policy::{
    ApprovalError, ApprovalFlow, ApprovalId, AuditRecord, AuditSink, Budget, CONFIRMATION_TOKEN,
    Category, Decision, EnvelopeMode, ExecuteService, Executed, Mode, PolicyConfig, PolicyStack,
    ToolErrorKind, ToolLayer, ToolMetadata, ToolRegistry, ToolRequest, ToolService,
    TurnBudgetState, WithIntents,
};
use markov_testkit::fixtures::{Add, Counted, Explode};
use proptest::prelude::*;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize, JsonSchema)]
struct QueryArgs {
    query: String,
}

/// A retrieval tool.
#[derive(Debug, Clone, Copy)]
struct Search;

#[async_trait]
impl Tool for Search {
    const NAME: &'static str = "search";
    type Args = QueryArgs;
    type Output = String;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "Search the knowledge base".into()
    }
    async fn call(&self, args: QueryArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        Ok(format!("found {}", args.query))
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct PayArgs {
    amount: u32,
}

/// An action that needs confirmation; its args deny unknown fields, so a
/// token left in the arguments would fail.
#[derive(Debug, Clone, Default)]
struct Pay(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Pay {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(&self, args: PayArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!("paid {}", args.amount))
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
struct SleepArgs {
    ms: u64,
}

/// Sleeps, then answers, counting its executions.
#[derive(Debug, Clone, Default)]
struct Sleep(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Sleep {
    const NAME: &'static str = "sleep";
    type Args = SleepArgs;
    type Output = String;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "Sleep".into()
    }
    async fn call(&self, args: SleepArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        self.0.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(args.ms)).await;
        Ok("awake".into())
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
struct NoArgs {}

/// Voice only.
#[derive(Debug, Clone, Copy)]
struct Hangup;

#[async_trait]
impl Tool for Hangup {
    const NAME: &'static str = "hangup";
    type Args = NoArgs;
    type Output = WithIntents<String>;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "End the call".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<Self::Output, Self::Error> {
        Ok(WithIntents::new(
            "bye".to_owned(),
            [json!({"type": "end_session"})],
        ))
    }
}

#[derive(Debug, Default)]
struct Sink(Mutex<Vec<AuditRecord>>);

impl AuditSink for Sink {
    fn record(&self, record: &AuditRecord) {
        self.0.lock().expect("sink").push(record.clone());
    }
}

struct Fixture {
    registry: ToolRegistry,
    adds: Counted<Add>,
    pays: Arc<AtomicUsize>,
    sleeps: Arc<AtomicUsize>,
    sink: Arc<Sink>,
}

fn fixture_with(config: PolicyConfig) -> Fixture {
    let adds = Counted::new(Add);
    let pays = Arc::new(AtomicUsize::new(0));
    let sleeps = Arc::new(AtomicUsize::new(0));
    let sink = Arc::new(Sink::default());
    let registry = ToolRegistry::builder(config.audit_sink(sink.clone()))
        .register(adds.clone(), ToolMetadata::new(Category::Other))
        .register(Search, ToolMetadata::new(Category::Retrieval))
        .register(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .register(Explode, ToolMetadata::new(Category::Other))
        .register(
            Sleep(sleeps.clone()),
            ToolMetadata::new(Category::Other)
                .with_timeout(Duration::from_millis(50))
                .with_latency_budget(Duration::from_millis(1)),
        )
        .register(
            Hangup,
            ToolMetadata::new(Category::Action)
                .with_modes([Mode::VOICE])
                .with_version("2.0.0"),
        )
        .lock()
        .expect("the registry locks");
    Fixture {
        registry,
        adds,
        pays,
        sleeps,
        sink,
    }
}

fn fixture() -> Fixture {
    fixture_with(PolicyConfig::new(Budget::TEXT))
}

/// The fixture with the model-mediated flow: the model presents the token.
fn token_fixture() -> Fixture {
    fixture_with(PolicyConfig::new(Budget::TEXT).approval_flow(ApprovalFlow::Token))
}

async fn call(
    registry: &ToolRegistry,
    mode: &Mode,
    turn: &TurnBudgetState,
    id: &str,
    name: &str,
    input: Value,
) -> Executed {
    let id = ToolCallId::new(id);
    let state = NoState::default();
    let cx = ToolContext::new(&id, &[], &state);
    registry.execute((mode, turn), &id, name, input, cx).await
}

fn error_type(e: &Executed) -> Option<String> {
    let v: Value = serde_json::from_str(&e.result.content).ok()?;
    v["error"]["type"].as_str().map(str::to_owned)
}

#[test]
fn the_standard_stack_is_in_onion_order() {
    let f = fixture();
    let mut stages = Vec::new();
    f.registry.service().stages(&mut stages);
    assert_eq!(
        stages,
        [
            "audit",
            "unknown_tool",
            "mode",
            "budget",
            "validate",
            "confirm",
            "idempotency",
            "latency",
            "timeout",
            "execute"
        ]
    );
}

/// Records the order in which requests pass and results return.
#[derive(Debug, Clone)]
struct Recording {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
}

struct Recorded<S> {
    inner: S,
    layer: Recording,
}

impl<S> ToolLayer<S> for Recording {
    type Service = Recorded<S>;
    fn layer(&self, inner: S) -> Recorded<S> {
        Recorded {
            inner,
            layer: self.clone(),
        }
    }
}

#[async_trait]
impl<S: ToolService> ToolService for Recorded<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        self.layer
            .log
            .lock()
            .expect("log")
            .push(format!("> {}", self.layer.name));
        let r = self.inner.call(req).await;
        self.layer
            .log
            .lock()
            .expect("log")
            .push(format!("< {}", self.layer.name));
        r
    }
}

#[tokio::test]
async fn the_first_layer_added_sees_the_request_first() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let rec = |name| Recording {
        name,
        log: log.clone(),
    };
    let service = PolicyStack::new()
        .layer(rec("outer"))
        .option_layer(None::<Recording>)
        .option_layer(Some(rec("middle")))
        .layer(rec("inner"))
        .service(ExecuteService::new(EnvelopeMode::Off));
    let tool = markov_core::tool::Erased::shared(Add).expect("tool");
    let id = ToolCallId::new("c1");
    let state = NoState::default();
    let report = markov_policy::CallReport::new();
    let turn = TurnBudgetState::new();
    let result = service
        .call(ToolRequest {
            call_id: &id,
            name: "add",
            input: std::borrow::Cow::Owned(json!({"a": 1, "b": 2})),
            tool: Some(&tool),
            metadata: None,
            mode: &Mode::TEXT,
            turn: &turn,
            policy: &markov_policy::PolicyState::new(),
            report: &report,
            cx: ToolContext::new(&id, &[], &state),
            terminate_message: "Finished",
            origin: Default::default(),
        })
        .await;
    assert_eq!(result.content, "3");
    assert_eq!(
        *log.lock().expect("log"),
        [
            "> outer", "> middle", "> inner", "< inner", "< middle", "< outer"
        ]
    );
}

#[tokio::test]
async fn earlier_gates_win_over_later_ones() {
    let f = fixture_with(PolicyConfig::new(Budget::UNLIMITED.max_calls(1)));
    let turn = TurnBudgetState::new();
    let text = Mode::TEXT;
    // Mode before budget: a restricted call uses no budget.
    let e = call(&f.registry, &text, &turn, "c1", "hangup", json!({})).await;
    assert_eq!(error_type(&e).as_deref(), Some("MODE_RESTRICTED"));
    assert_eq!(turn.total(), 0);
    // Budget before validation: the invalid call is charged...
    let e = call(&f.registry, &text, &turn, "c2", "add", json!({"a": "x"})).await;
    assert_eq!(error_type(&e).as_deref(), Some("INVALID_INPUT"));
    assert_eq!(turn.total(), 1);
    // ...so the next one is over budget, even one needing confirmation.
    let e = call(&f.registry, &text, &turn, "c3", "pay", json!({"amount": 1})).await;
    assert_eq!(error_type(&e).as_deref(), Some("BUDGET_EXCEEDED"));
    // Unknown before everything.
    let e = call(&f.registry, &text, &turn, "c4", "nope", json!({})).await;
    assert_eq!(error_type(&e).as_deref(), Some("NOT_FOUND"));
}

#[tokio::test]
async fn envelopes_are_exact() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let text = Mode::TEXT;
    let e = call(&f.registry, &text, &turn, "c1", "nope", json!({})).await;
    assert!(e.result.is_error);
    assert_eq!(e.error, Some(ToolErrorKind::NotFound));
    assert_eq!(
        e.result.content,
        r#"{"ok":false,"error":{"type":"NOT_FOUND","message":"Unknown tool: nope","retryable":false}}"#
    );
    let e = call(&f.registry, &text, &turn, "c2", "hangup", json!({})).await;
    assert_eq!(
        e.result.content,
        r#"{"ok":false,"error":{"type":"MODE_RESTRICTED","message":"Tool not available in this mode: hangup is not available in text mode","retryable":false}}"#
    );
    let e = call(&f.registry, &text, &turn, "c3", "add", json!({"a": 1})).await;
    assert_eq!(
        e.result.content,
        r#"{"ok":false,"error":{"type":"INVALID_INPUT","message":"Invalid tool input: missing field `b`","retryable":true}}"#
    );
    let e = call(
        &f.registry,
        &text,
        &turn,
        "c4",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    assert!(!e.result.is_error);
    assert_eq!(e.result.content, r#"{"ok":true,"data":3}"#);
    let voice = Mode::VOICE;
    let e = call(&f.registry, &voice, &turn, "c5", "hangup", json!({})).await;
    assert_eq!(
        e.result.content,
        r#"{"ok":true,"data":"bye","intents":[{"type":"end_session"}]}"#
    );
    assert_eq!(e.intents, [json!({"type": "end_session"})]);
}

#[tokio::test]
async fn without_the_envelope_a_success_is_the_plain_text() {
    let f = fixture_with(PolicyConfig::new(Budget::TEXT).envelope(EnvelopeMode::Off));
    let turn = TurnBudgetState::new();
    let e = call(&f.registry, &Mode::VOICE, &turn, "c1", "hangup", json!({})).await;
    assert_eq!(e.result.content, "bye");
    assert_eq!(e.intents, [json!({"type": "end_session"})]);
}

#[tokio::test]
async fn the_retrieval_budget_runs_out_within_a_turn() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let text = Mode::TEXT;
    for i in 0..5 {
        let e = call(
            &f.registry,
            &text,
            &turn,
            &format!("s{i}"),
            "search",
            json!({"query": "q"}),
        )
        .await;
        assert!(!e.result.is_error, "{i}: {}", e.result.content);
    }
    let e = call(
        &f.registry,
        &text,
        &turn,
        "s5",
        "search",
        json!({"query": "q"}),
    )
    .await;
    assert_eq!(
        e.result.content,
        r#"{"ok":false,"error":{"type":"BUDGET_EXCEEDED","message":"Tool call budget exceeded for this turn: retrieval calls (max 5 per turn)","retryable":false}}"#
    );
    // Other categories still run, up to 10 calls in all.
    for i in 0..5 {
        let e = call(
            &f.registry,
            &text,
            &turn,
            &format!("a{i}"),
            "add",
            json!({"a": 1, "b": 1}),
        )
        .await;
        assert!(!e.result.is_error, "{i}");
    }
    let e = call(
        &f.registry,
        &text,
        &turn,
        "a5",
        "add",
        json!({"a": 1, "b": 1}),
    )
    .await;
    assert_eq!(error_type(&e).as_deref(), Some("BUDGET_EXCEEDED"));
    assert!(e.result.content.contains("tool calls (max 10 per turn)"));
    // A new turn starts over.
    let next = TurnBudgetState::new();
    let e = call(
        &f.registry,
        &text,
        &next,
        "s6",
        "search",
        json!({"query": "q"}),
    )
    .await;
    assert!(!e.result.is_error);
}

#[tokio::test]
async fn confirmation_needs_the_applications_approval() {
    let f = token_fixture();
    let turn = TurnBudgetState::new();
    let text = Mode::TEXT;
    let first = call(&f.registry, &text, &turn, "p1", "pay", json!({"amount": 5})).await;
    assert_eq!(first.error, Some(ToolErrorKind::ConfirmationRequired));
    let envelope: Value = serde_json::from_str(&first.result.content).expect("json");
    let request = &envelope["error"]["confirmation_request"];
    assert_eq!(request["tool"], "pay");
    assert_eq!(request["args"], json!({"amount": 5}));
    assert_eq!(request["preview"], r#"pay {"amount":5}"#);
    assert!(request["expires"].as_u64().is_some());
    assert!(
        request.get("token").is_none(),
        "no usable secret in the envelope"
    );
    let id = request["request_id"]
        .as_str()
        .expect("request id")
        .to_owned();
    let pending = f.registry.policy_state().approvals().pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].request_id.as_str(), id);

    // The model presents the id before the user approved: pending, not run.
    let e = call(
        &f.registry,
        &text,
        &turn,
        "p2",
        "pay",
        json!({"amount": 5, CONFIRMATION_TOKEN: id}),
    )
    .await;
    assert_eq!(e.error, Some(ToolErrorKind::ConfirmationPending));
    // A made-up token is invalid.
    let e = call(
        &f.registry,
        &text,
        &turn,
        "p3",
        "pay",
        json!({"amount": 5, CONFIRMATION_TOKEN: "apr_00000000000000000000000000000000"}),
    )
    .await;
    assert_eq!(e.error, Some(ToolErrorKind::ConfirmationInvalid));
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);

    f.registry
        .policy_state()
        .approvals()
        .approve(&ApprovalId::from(id.as_str()))
        .expect("the application approves");
    // Approved, but for other arguments: refused.
    let e = call(
        &f.registry,
        &text,
        &turn,
        "p4",
        "pay",
        json!({"amount": 6, CONFIRMATION_TOKEN: id}),
    )
    .await;
    assert_eq!(e.error, Some(ToolErrorKind::ConfirmationInvalid));
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);

    // The approved call runs once (the token is stripped: `PayArgs` denies unknown fields).
    let e = call(
        &f.registry,
        &text,
        &turn,
        "p5",
        "pay",
        json!({"amount": 5, CONFIRMATION_TOKEN: id}),
    )
    .await;
    assert_eq!(e.result.content, r#"{"ok":true,"data":"paid 5"}"#);
    assert_eq!(f.pays.load(Ordering::SeqCst), 1);
    // Used: presenting it again never runs the tool again.
    let e = call(
        &f.registry,
        &text,
        &turn,
        "p6",
        "pay",
        json!({"amount": 5, CONFIRMATION_TOKEN: id}),
    )
    .await;
    assert_eq!(e.error, Some(ToolErrorKind::ConfirmationInvalid));
    let fresh: Value = serde_json::from_str(&e.result.content).expect("json");
    assert_ne!(
        fresh["error"]["confirmation_request"]["request_id"].as_str(),
        Some(id.as_str()),
        "a re-issue is a new request"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_denied_request_stays_denied() {
    let f = token_fixture();
    let turn = TurnBudgetState::new();
    let first = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 5}),
    )
    .await;
    let envelope: Value = serde_json::from_str(&first.result.content).expect("json");
    let id = envelope["error"]["confirmation_request"]["request_id"].clone();
    let approvals = f.registry.policy_state().approvals();
    let id_text = ApprovalId::from(id.as_str().expect("id"));
    approvals.deny(&id_text).expect("deny");
    assert!(approvals.approve(&id_text).is_err(), "a decision is final");
    for n in 0..2 {
        let e = call(
            &f.registry,
            &Mode::TEXT,
            &turn,
            &format!("p{}", n + 2),
            "pay",
            json!({"amount": 5, CONFIRMATION_TOKEN: id}),
        )
        .await;
        assert_eq!(e.error, Some(ToolErrorKind::ConfirmationDenied));
    }
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_expired_token_is_refused() {
    let f = fixture_with(
        PolicyConfig::new(Budget::TEXT)
            .approval_flow(ApprovalFlow::Token)
            .confirmation_ttl(Duration::ZERO),
    );
    let turn = TurnBudgetState::new();
    let first = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 5}),
    )
    .await;
    let envelope: Value = serde_json::from_str(&first.result.content).expect("json");
    let token = envelope["error"]["confirmation_request"]["request_id"].clone();
    let approvals = f.registry.policy_state().approvals();
    assert!(
        approvals
            .approve(&ApprovalId::from(token.as_str().expect("id")))
            .is_err(),
        "expired before the decision"
    );
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p2",
        "pay",
        json!({"amount": 5, CONFIRMATION_TOKEN: token}),
    )
    .await;
    assert_eq!(e.error, Some(ToolErrorKind::ConfirmationInvalid));
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_replay_does_not_execute_again() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let a = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "same",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    let b = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "same",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    assert_eq!(
        (&a.result, a.error, &a.intents),
        (&b.result, b.error, &b.intents)
    );
    // The second answer says where it came from.
    assert_eq!(
        a.outcome,
        markov_policy::CallOutcome::Ran {
            ok: true,
            error: None
        }
    );
    assert_eq!(
        b.outcome,
        markov_policy::CallOutcome::Ledger {
            ok: true,
            error: None
        }
    );
    assert_eq!(f.adds.calls(), 1);
    let _ = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "other",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    assert_eq!(f.adds.calls(), 2);
}

#[tokio::test]
async fn a_reused_call_id_with_other_arguments_is_a_conflict_not_a_replay() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let a = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "same",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    assert!(!a.result.is_error);
    let b = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "same",
        "add",
        json!({"a": 5, "b": 5}),
    )
    .await;
    assert_eq!(b.error, Some(ToolErrorKind::IdempotencyConflict));
    assert!(
        !b.result.content.contains('3'),
        "never another call's answer: {}",
        b.result.content
    );
    let c = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "same",
        "search",
        json!({"query": "q"}),
    )
    .await;
    assert_eq!(c.error, Some(ToolErrorKind::IdempotencyConflict));
    assert_eq!(f.adds.calls(), 1);
}

#[tokio::test]
async fn a_second_concurrent_call_with_one_key_waits_for_the_first() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let (a, b) = tokio::join!(
        call(
            &f.registry,
            &Mode::TEXT,
            &turn,
            "k",
            "sleep",
            json!({"ms": 20})
        ),
        call(
            &f.registry,
            &Mode::TEXT,
            &turn,
            "k",
            "sleep",
            json!({"ms": 20})
        ),
    );
    assert_eq!(a.result, b.result);
    assert_eq!(f.sleeps.load(Ordering::SeqCst), 1, "the tool ran once");
}

/// A registry of [`Sleep`] with `metadata`, and the call `k` of it,
/// dropped while the tool runs, then made again: its result, unless it is
/// still running after a while (it ran again), and the tool's runs.
async fn dropped_then_again(metadata: ToolMetadata) -> (Option<Executed>, usize) {
    let sleeps = Arc::new(AtomicUsize::new(0));
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(Sleep(sleeps.clone()), metadata)
        .lock()
        .expect("the registry locks");
    let turn = TurnBudgetState::new();
    let args = || json!({"ms": 10_000});
    let dropped = tokio::time::timeout(
        Duration::from_millis(20),
        call(&registry, &Mode::TEXT, &turn, "k", "sleep", args()),
    )
    .await;
    assert!(dropped.is_err(), "dropped while the tool ran");
    let again = tokio::time::timeout(
        Duration::from_millis(100),
        call(&registry, &Mode::TEXT, &turn, "k", "sleep", args()),
    )
    .await
    .ok();
    (again, sleeps.load(Ordering::SeqCst))
}

#[tokio::test]
async fn an_at_most_once_call_dropped_while_it_ran_is_answered_interrupted_and_never_runs_again() {
    let (again, runs) = dropped_then_again(
        ToolMetadata::new(Category::Action).with_delivery(markov_core::tool::Delivery::AtMostOnce),
    )
    .await;
    assert_eq!(runs, 1, "the tool ran once");
    let again = again.expect("answered at once");
    assert_eq!(again.error, Some(ToolErrorKind::Interrupted));
    assert_eq!(error_type(&again).as_deref(), Some("INTERRUPTED"));
    assert!(again.result.is_error);
}

/// Sleeps like [`Sleep`], as a tool that keeps its side effects in its
/// call's journal (a sub-agent does).
#[derive(Debug)]
struct JournaledSleep {
    definition: markov_core::tool::ToolDefinition,
    sleeps: Arc<AtomicUsize>,
}

#[async_trait]
impl markov_core::tool::DynTool for JournaledSleep {
    fn definition(&self) -> &markov_core::tool::ToolDefinition {
        &self.definition
    }

    fn resumes_from_journal(&self) -> bool {
        true
    }

    async fn call_json(
        &self,
        input: &Value,
        _cx: ToolContext<'_>,
    ) -> Result<markov_core::tool::ToolOutcome, markov_core::tool::ToolCallError> {
        // Only its first run sleeps: run again, it answers from its
        // journal at once.
        if self.sleeps.fetch_add(1, Ordering::SeqCst) == 0 {
            let ms = input["ms"].as_u64().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        Ok(markov_core::tool::ToolOutcome::Value(json!("awake")))
    }
}

/// A journal that keeps nothing and refuses nothing.
struct NoJournal;

#[async_trait]
impl markov_policy::Journal for NoJournal {
    async fn write(&self, _: &markov_policy::LedgerEntry) -> Result<(), String> {
        Ok(())
    }

    async fn write_answers(&self, _: &[markov_policy::RecordedAnswer]) -> Result<(), String> {
        Ok(())
    }
}

/// [`JournaledSleep`] at most once, its call `k` dropped while it runs,
/// then made again: the second call's result and the tool's runs, with or
/// without a journal.
async fn journaled_dropped_then_again(journal: bool) -> (Executed, usize) {
    let sleeps = Arc::new(AtomicUsize::new(0));
    let tool = JournaledSleep {
        definition: markov_core::tool::ToolDefinition::new(
            "sleep",
            "Sleep",
            json!({"type": "object", "properties": {"ms": {"type": "integer"}}}),
        )
        .expect("a valid name"),
        sleeps: sleeps.clone(),
    };
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register_shared(
            Arc::new(tool),
            ToolMetadata::new(Category::Action)
                .with_delivery(markov_core::tool::Delivery::AtMostOnce),
        )
        .lock()
        .expect("the registry locks");
    if journal {
        registry.policy_state().set_journal(Arc::new(NoJournal));
    }
    let turn = TurnBudgetState::new();
    let dropped = tokio::time::timeout(
        Duration::from_millis(20),
        call(
            &registry,
            &Mode::TEXT,
            &turn,
            "k",
            "sleep",
            json!({"ms": 10_000}),
        ),
    )
    .await;
    assert!(dropped.is_err(), "dropped while the tool ran");
    let again = tokio::time::timeout(
        Duration::from_secs(5),
        call(
            &registry,
            &Mode::TEXT,
            &turn,
            "k",
            "sleep",
            json!({"ms": 10_000}),
        ),
    )
    .await
    .expect("answered at once");
    (again, sleeps.load(Ordering::SeqCst))
}

#[tokio::test]
async fn an_at_most_once_call_of_a_tool_that_resumes_from_its_journal_runs_again_with_a_journal() {
    let (again, runs) = journaled_dropped_then_again(true).await;
    assert_eq!(runs, 2, "resumed: the tool ran again");
    assert_eq!(again.error, None, "{again:?}");
    assert!(
        again.result.content.contains("awake"),
        "{}",
        again.result.content
    );
    assert!(!again.result.is_error);
}

#[tokio::test]
async fn an_at_most_once_call_of_a_tool_that_resumes_from_its_journal_is_interrupted_without_one() {
    let (again, runs) = journaled_dropped_then_again(false).await;
    assert_eq!(runs, 1, "never run again");
    assert_eq!(again.error, Some(ToolErrorKind::Interrupted));
    assert_eq!(error_type(&again).as_deref(), Some("INTERRUPTED"));
}

#[tokio::test]
async fn an_at_least_once_call_dropped_while_it_ran_runs_again() {
    let (again, runs) = dropped_then_again(ToolMetadata::new(Category::Retrieval)).await;
    assert!(again.is_none(), "running again: {again:?}");
    assert_eq!(runs, 2, "the call ran again");
}

#[tokio::test]
async fn garbled_arguments_reach_no_stage_and_no_tool() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let garbled = markov_core::tool::parse_tool_arguments(r#"{"amount": 5"#);
    let e = call(&f.registry, &Mode::TEXT, &turn, "g1", "pay", garbled).await;
    assert_eq!(e.error, Some(ToolErrorKind::InvalidInput));
    assert!(
        f.registry.policy_state().approvals().pending().is_empty(),
        "no stage ran"
    );
    let e = call(&f.registry, &Mode::TEXT, &turn, "g2", "add", json!(null)).await;
    assert_eq!(e.error, Some(ToolErrorKind::InvalidInput));
    assert_eq!(f.adds.calls(), 0);
}

#[tokio::test]
async fn a_panicking_tool_is_an_execution_failure() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let e = call(&f.registry, &Mode::TEXT, &turn, "x1", "explode", json!({})).await;
    assert_eq!(e.error, Some(ToolErrorKind::ExecutionFailed));
    assert!(
        e.result.content.contains("the tool panicked"),
        "{}",
        e.result.content
    );
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "x2",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    assert!(!e.result.is_error, "the registry lives on");
}

#[tokio::test]
async fn a_timeout_is_an_error_and_the_next_call_works() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "t1",
        "sleep",
        json!({"ms": 2_000}),
    )
    .await;
    assert_eq!(
        e.result.content,
        r#"{"ok":false,"error":{"type":"TIMEOUT","message":"Tool timed out: sleep did not finish within 50 ms","retryable":true}}"#
    );
    assert!(!e.result.is_terminal);
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "t2",
        "sleep",
        json!({"ms": 1}),
    )
    .await;
    assert_eq!(e.result.content, r#"{"ok":true,"data":"awake"}"#);
}

#[tokio::test]
async fn audit_receives_one_record_per_call() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let _ = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "c1",
        "add",
        json!({"a": 1, "b": 2}),
    )
    .await;
    let _ = call(&f.registry, &Mode::TEXT, &turn, "c2", "nope", json!({})).await;
    let _ = call(&f.registry, &Mode::TEXT, &turn, "c3", "hangup", json!({})).await;
    let _ = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "c4",
        "pay",
        json!({"amount": 1}),
    )
    .await;
    let records = f.sink.0.lock().expect("sink").clone();
    let summary: Vec<(&str, bool, Option<ToolErrorKind>, Option<Category>)> = records
        .iter()
        .map(|r| (r.tool.as_str(), r.ok, r.error_type, r.category))
        .collect();
    assert_eq!(
        summary,
        [
            ("add", true, None, Some(Category::Other)),
            ("nope", false, Some(ToolErrorKind::NotFound), None),
            (
                "hangup",
                false,
                Some(ToolErrorKind::ModeRestricted),
                Some(Category::Action)
            ),
            (
                "pay",
                false,
                Some(ToolErrorKind::ConfirmationPending),
                Some(Category::Action)
            ),
        ]
    );
    assert!(
        records
            .iter()
            .all(|r| &*r.registry_version == f.registry.version())
    );
    assert_eq!(records[2].tool_version.as_deref(), Some("2.0.0"));
    assert_eq!(records[0].mode, Mode::TEXT);
}

#[test]
fn the_version_follows_names_and_versions() {
    let a = fixture().registry;
    let b = fixture().registry;
    assert_eq!(a.version(), b.version());
    assert!(a.version().starts_with("6."), "{}", a.version());
    let c = ToolRegistry::builder(PolicyConfig::new(Budget::TEXT))
        .register(
            Search,
            ToolMetadata::new(Category::Retrieval).with_version("1.1.0"),
        )
        .lock()
        .expect("locks");
    let d = ToolRegistry::builder(PolicyConfig::new(Budget::TEXT))
        .register(Search, ToolMetadata::new(Category::Retrieval))
        .lock()
        .expect("locks");
    assert_ne!(c.version(), d.version());
    assert_eq!(
        d.metadata("search").map(|m| m.category()),
        Some(Category::Retrieval)
    );
    assert!(d.metadata("add").is_none());
    let dup = ToolRegistry::builder(PolicyConfig::new(Budget::TEXT))
        .register(Search, ToolMetadata::new(Category::Retrieval))
        .register(Search, ToolMetadata::new(Category::Retrieval))
        .lock()
        .expect_err("duplicate");
    assert_eq!(dup.to_string(), r#"tool "search" is registered twice"#);
}

#[test]
fn a_paused_call_is_offered_without_a_token() {
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::TEXT))
        .register(
            Pay::default(),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .lock()
        .expect("locks");
    let defs = registry.definitions();
    assert!(
        defs[0].input_schema["properties"]
            .get(CONFIRMATION_TOKEN)
            .is_none(),
        "nothing to approve with: {}",
        defs[0].input_schema
    );
}

#[test]
fn definitions_offer_the_confirmation_token() {
    let registry =
        ToolRegistry::builder(PolicyConfig::new(Budget::TEXT).approval_flow(ApprovalFlow::Token))
            .register(Search, ToolMetadata::new(Category::Retrieval))
            .register(
                Pay::default(),
                ToolMetadata::new(Category::Action).with_confirmation(),
            )
            .lock()
            .expect("locks");
    let defs = registry.definitions();
    let names: Vec<_> = defs.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["search", "pay"]);
    assert_eq!(
        defs[0].input_schema,
        json!({
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"]
        })
    );
    assert_eq!(
        defs[1].input_schema,
        json!({
            "type": "object",
            "properties": {
                "amount": {"type": "integer", "format": "uint32", "minimum": 0},
                "confirmationToken": {
                    "type": "string",
                    "description": "The request_id of a confirmation request the user has approved. Leave it out until then."
                }
            },
            "required": ["amount"],
            "additionalProperties": false
        })
    );
}

#[derive(Debug, Clone)]
enum Kind {
    Known,
    Unknown,
    Retrieval,
    NeedsConfirmation,
    Restricted,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Known),
        Just(Kind::Unknown),
        Just(Kind::Retrieval),
        Just(Kind::NeedsConfirmation),
        Just(Kind::Restricted),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn every_call_gets_exactly_one_result_in_order(kinds in proptest::collection::vec(kind(), 0..30)) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let f = fixture();
        let turn = TurnBudgetState::new();
        let results = runtime.block_on(async {
            let mut out = Vec::new();
            for (i, k) in kinds.iter().enumerate() {
                let (name, input) = match k {
                    Kind::Known => ("add", json!({"a": 1, "b": 1})),
                    Kind::Unknown => ("nope", json!({})),
                    Kind::Retrieval => ("search", json!({"query": "q"})),
                    Kind::NeedsConfirmation => ("pay", json!({"amount": 1})),
                    Kind::Restricted => ("hangup", json!({})),
                };
                out.push(call(&f.registry, &Mode::TEXT, &turn, &format!("c{i}"), name, input).await);
            }
            out
        });
        prop_assert_eq!(results.len(), kinds.len());
        let mut charged = 0u32;
        let mut retrievals = 0u32;
        for (i, (k, e)) in kinds.iter().zip(&results).enumerate() {
            prop_assert_eq!(e.result.call_id.as_str(), format!("c{i}"));
            let expected = match k {
                Kind::Unknown => Some("NOT_FOUND"),
                Kind::Restricted => Some("MODE_RESTRICTED"),
                _ if charged >= 10 => Some("BUDGET_EXCEEDED"),
                Kind::Retrieval if retrievals >= 5 => Some("BUDGET_EXCEEDED"),
                Kind::NeedsConfirmation => { charged += 1; Some("CONFIRMATION_PENDING") }
                Kind::Retrieval => { charged += 1; retrievals += 1; None }
                Kind::Known => { charged += 1; None }
            };
            let got = error_type(e);
            prop_assert_eq!(got.as_deref(), expected);
            prop_assert_eq!(e.result.is_error, expected.is_some());
            prop_assert_eq!(e.awaiting.is_some(), matches!(k, Kind::NeedsConfirmation) && expected == Some("CONFIRMATION_PENDING"));
        }
        prop_assert_eq!(f.sink.0.lock().expect("sink").len(), kinds.len());
    }
}

/// The pause flow, as a caller that does not pause sees it: the call waits
/// (its result says so, without any request id), and the same call, once
/// the application decided, gets the decision's outcome.
#[tokio::test]
async fn a_paused_call_runs_once_after_the_approval_with_the_same_call_id() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let text = Mode::TEXT;
    let first = call(&f.registry, &text, &turn, "p1", "pay", json!({"amount": 5})).await;
    assert_eq!(first.error, Some(ToolErrorKind::ConfirmationPending));
    let request = first.awaiting.clone().expect("the call waits");
    assert_eq!(request.call_id.as_ref().map(|c| c.as_str()), Some("p1"));
    assert_eq!(request.args, json!({"amount": 5}));
    assert!(
        !first.result.content.contains(request.request_id.as_str())
            && !first.result.content.contains("apr_"),
        "the caller's result holds no request id: {}",
        first.result.content
    );
    let again = call(&f.registry, &text, &turn, "p1", "pay", json!({"amount": 5})).await;
    assert_eq!(
        again.awaiting.map(|r| r.request_id),
        Some(request.request_id.clone()),
        "still the same request"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);
    let approvals = f.registry.policy_state().approvals();
    assert_eq!(approvals.pending(), vec![request.clone()]);
    approvals
        .approve(&request.request_id)
        .expect("the application approves");
    for _ in 0..2 {
        let run = call(&f.registry, &text, &turn, "p1", "pay", json!({"amount": 5})).await;
        assert_eq!(run.result.content, r#"{"ok":true,"data":"paid 5"}"#);
        assert!(run.awaiting.is_none());
    }
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "paid once: then replayed");
    // Another call (another id) is another request: an approval is for one call.
    let other = call(&f.registry, &text, &turn, "p2", "pay", json!({"amount": 5})).await;
    assert!(other.awaiting.is_some());
    assert_ne!(
        other.awaiting.map(|r| r.request_id),
        Some(request.request_id)
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 1);
}

/// Waits for a decision on the call `id` of `pay` with `args` and returns
/// its request.
async fn paused(f: &Fixture, turn: &TurnBudgetState, id: &str, args: Value) -> ApprovalId {
    let e = call(&f.registry, &Mode::TEXT, turn, id, "pay", args).await;
    e.awaiting.expect("the call waits").request_id
}

#[tokio::test]
async fn an_edit_runs_the_call_with_the_approved_arguments_once_they_fit() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let id = paused(&f, &turn, "p1", json!({"amount": 500})).await;
    let approvals = f.registry.policy_state().approvals();
    let refused = approvals.decide(
        &id,
        Decision::Edit {
            args: json!({"amount": "lots"}),
        },
    );
    assert!(
        matches!(&refused, Err(ApprovalError::InvalidArguments { reason, .. }) if reason.contains("amount")),
        "{refused:?}"
    );
    assert!(matches!(
        approvals.decide(&id, Decision::Edit { args: json!([1]) }),
        Err(ApprovalError::InvalidArguments { .. })
    ));
    assert_eq!(
        approvals.pending().len(),
        1,
        "a refused edit changes nothing"
    );
    approvals
        .decide(
            &id,
            Decision::Edit {
                args: json!({"amount": 50}),
            },
        )
        .expect("an edit that fits");
    let run = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 500}),
    )
    .await;
    assert_eq!(run.result.content, r#"{"ok":true,"data":"paid 50"}"#);
    assert_eq!(f.pays.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_denial_or_an_answer_of_the_application_is_the_result_and_nothing_runs() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let denied = paused(&f, &turn, "p1", json!({"amount": 5})).await;
    let answered = paused(&f, &turn, "p2", json!({"amount": 6})).await;
    let approvals = f.registry.policy_state().approvals();
    approvals
        .decide(
            &denied,
            Decision::Deny {
                message: Some("Not this month.".into()),
            },
        )
        .expect("deny");
    approvals
        .decide(
            &answered,
            Decision::Respond {
                result: json!("paid by cheque"),
            },
        )
        .expect("respond");
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 5}),
    )
    .await;
    assert_eq!(
        e.result.content,
        r#"{"ok":false,"error":{"type":"CONFIRMATION_DENIED","message":"The user declined this action: Not this month.","retryable":false}}"#
    );
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p2",
        "pay",
        json!({"amount": 6}),
    )
    .await;
    assert!(!e.result.is_error);
    assert_eq!(e.result.content, r#"{"ok":true,"data":"paid by cheque"}"#);
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);
    assert!(matches!(
        approvals.approve(&denied),
        Err(ApprovalError::AlreadyDecided { .. })
    ));
}

#[tokio::test]
async fn a_paused_call_whose_request_expired_is_answered_as_expired() {
    let f = fixture_with(PolicyConfig::new(Budget::TEXT).confirmation_ttl(Duration::ZERO));
    let turn = TurnBudgetState::new();
    let id = paused(&f, &turn, "p1", json!({"amount": 5})).await;
    let approvals = f.registry.policy_state().approvals();
    assert_eq!(
        approvals.approve(&id),
        Err(ApprovalError::Expired(id.clone()))
    );
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 5}),
    )
    .await;
    assert_eq!(e.error, Some(ToolErrorKind::ConfirmationExpired));
    assert!(e.awaiting.is_none());
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_token_request_cannot_be_edited_or_answered() {
    let f = token_fixture();
    let turn = TurnBudgetState::new();
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 5}),
    )
    .await;
    let id = f.registry.policy_state().approvals().pending()[0]
        .request_id
        .clone();
    assert!(e.awaiting.is_none(), "the token flow does not pause");
    let approvals = f.registry.policy_state().approvals();
    for decision in [
        Decision::Edit {
            args: json!({"amount": 1}),
        },
        Decision::Respond {
            result: json!("done"),
        },
    ] {
        assert!(matches!(
            approvals.decide(&id, decision),
            Err(ApprovalError::Unsupported { .. })
        ));
    }
    assert_eq!(approvals.pending().len(), 1);
}

#[tokio::test]
async fn of_two_decisions_racing_one_wins_and_the_other_is_refused() {
    let f = fixture();
    let turn = TurnBudgetState::new();
    let id = paused(&f, &turn, "p1", json!({"amount": 5})).await;
    let state = f.registry.policy_state();
    let barrier = std::sync::Barrier::new(2);
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let approve = s.spawn(|| {
            barrier.wait();
            state.approvals().approve(&id)
        });
        let deny = s.spawn(|| {
            barrier.wait();
            state.approvals().deny(&id)
        });
        vec![
            approve.join().expect("no panic"),
            deny.join().expect("no panic"),
        ]
    });
    assert_eq!(
        outcomes.iter().filter(|o| o.is_ok()).count(),
        1,
        "{outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .any(|o| matches!(o, Err(ApprovalError::AlreadyDecided { .. })))
    );
    let record = state.approvals().get(&id).expect("kept");
    let e = call(
        &f.registry,
        &Mode::TEXT,
        &turn,
        "p1",
        "pay",
        json!({"amount": 5}),
    )
    .await;
    match record.decision {
        Some(Decision::Approve) => assert_eq!(f.pays.load(Ordering::SeqCst), 1),
        _ => {
            assert_eq!(e.error, Some(ToolErrorKind::ConfirmationDenied));
            assert_eq!(f.pays.load(Ordering::SeqCst), 0);
        }
    }
    // Another conversation knows nothing of it.
    let other = fixture();
    assert_eq!(
        other.registry.policy_state().approvals().approve(&id),
        Err(ApprovalError::NotFound(id))
    );
}
