//! The service on a real loopback port, driven over HTTP: sessions, a run
//! streamed as server-sent events, calls that wait for approval and the
//! decisions that resume them, and bad input.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{BoxStream, StreamExt};
use markov_charter::node::Node;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StreamEvent};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::Agent;
use markov_policy::{ApprovalFlow, Budget, Category, PolicyConfig, ToolMetadata};
use markov_server::{Limits, Server, ServerBuilder, create_api_key};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

pub(crate) use markov_testkit::sse::events;

#[derive(Deserialize, JsonSchema)]
pub(crate) struct PayArgs {
    amount: u32,
    /// What the payment is for.
    #[allow(dead_code)]
    memo: Option<String>,
}

/// Pays, counting its executions; needs the user's approval.
pub(crate) struct Pay(pub(crate) Arc<AtomicUsize>);

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

/// A model that thinks for a while before each answer.
#[derive(Debug)]
pub(crate) struct Slow(pub(crate) ScriptedModel, pub(crate) Duration);

#[async_trait]
impl markov_core::ModelLayer for Slow {
    type Inner = ScriptedModel;

    fn inner(&self) -> &ScriptedModel {
        &self.0
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        tokio::time::sleep(self.1).await;
        self.0.complete(request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let pause = tokio::time::sleep(self.1);
        futures::stream::once(pause)
            .flat_map(move |()| self.0.stream(request))
            .boxed()
    }
}

pub(crate) struct Fixture {
    pub(crate) base: String,
    pub(crate) pays: Arc<AtomicUsize>,
    pub(crate) client: reqwest::Client,
    /// The key requests are made with (alice's, an approver, unless
    /// changed).
    pub(crate) key: String,
    /// Keys of the other principals: bob (no role), carol (no role).
    pub(crate) keys: std::collections::HashMap<&'static str, String>,
    pub(crate) store: Arc<dyn markov_store::KeyStore>,
    /// Stops the server gracefully.
    pub(crate) shutdown: tokio_util::sync::CancellationToken,
    /// Ends once the server has shut down.
    pub(crate) stopped: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

/// Counts the model calls of the model it wraps.
#[derive(Debug)]
pub(crate) struct Counted<M>(pub(crate) M, pub(crate) Arc<AtomicUsize>);

#[async_trait]
impl<M: Model> markov_core::ModelLayer for Counted<M> {
    type Inner = M;

    fn inner(&self) -> &M {
        &self.0
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.complete(request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.stream(request)
    }
}

pub(crate) async fn serve(model: impl Model + 'static) -> Fixture {
    serve_with(model, PolicyConfig::new(Budget::UNLIMITED)).await
}

pub(crate) async fn serve_with(model: impl Model + 'static, config: PolicyConfig) -> Fixture {
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        // The registry's own result format (JSON envelopes).
        .policies(config)
        .model(model)
        .build()
        .expect("the agent builds");
    serve_agent(agent, pays).await
}

/// Serves `agent` on a loopback port, its sessions in memory.
pub(crate) async fn serve_agent(agent: Agent, pays: Arc<AtomicUsize>) -> Fixture {
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    start(
        Server::builder().agent(agent).worker(WorkerId::new("test")),
        store,
        pays,
    )
    .await
}

/// Builds `builder` over `store` (with keys for alice, an approver, bob
/// and carol) and serves it on a loopback port until the fixture's
/// shutdown. The server's worker name is the builder's (a random one
/// unless set).
pub(crate) async fn start<S>(
    builder: ServerBuilder,
    store: Arc<S>,
    pays: Arc<AtomicUsize>,
) -> Fixture
where
    S: markov_store::Store + markov_store::KeyStore + 'static,
{
    let mut keys = std::collections::HashMap::new();
    for (name, roles) in [
        ("alice", vec!["approver".to_owned()]),
        ("bob", vec![]),
        ("carol", vec![]),
    ] {
        let key = create_api_key(&*store, name, &roles).await.expect("a key");
        keys.insert(name, key.key);
    }
    let server = builder
        .store(store.clone())
        .build()
        .expect("the server builds");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (base, stopped) = crate::fixtures::listen(server, shutdown.clone().cancelled_owned()).await;
    Fixture {
        base,
        pays,
        client: crate::fixtures::client(),
        key: keys["alice"].clone(),
        keys,
        store: store as Arc<dyn markov_store::KeyStore>,
        shutdown,
        stopped: Some(stopped),
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Fixture {
    pub(crate) async fn create(&self) -> String {
        let response = self
            .client
            .post(format!("{}/sessions", self.base))
            .bearer_auth(&self.key)
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.expect("json");
        body["id"].as_str().expect("an id").to_owned()
    }

    /// Posts a message and reads the whole event stream: (event, data) pairs.
    pub(crate) async fn say(&self, id: &str, text: &str) -> Vec<(String, Value)> {
        let response = self
            .client
            .post(format!("{}/sessions/{id}/messages", self.base))
            .bearer_auth(&self.key)
            .json(&json!({"text": text}))
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status(), 200, "{:?}", response.text().await);
        events(&response.text().await.expect("the stream"))
    }

    /// Posts a decision: its status, and the event stream (or the error).
    pub(crate) async fn decide(
        &self,
        id: &str,
        request: &str,
        decision: Value,
    ) -> (u16, Vec<(String, Value)>) {
        let response = self
            .client
            .post(format!("{}/sessions/{id}/approvals/{request}", self.base))
            .bearer_auth(&self.key)
            .json(&decision)
            .send()
            .await
            .expect("sent");
        let status = response.status().as_u16();
        let body = response.text().await.expect("a body");
        if status == 200 {
            (status, events(&body))
        } else {
            let error = serde_json::from_str(&body).unwrap_or(Value::String(body));
            (status, vec![("error".to_owned(), error)])
        }
    }

    /// The ids of the requests waiting for a decision.
    pub(crate) async fn pending(&self, id: &str) -> Vec<String> {
        let (_, pending) = self.get(&format!("/sessions/{id}/approvals")).await;
        pending
            .as_array()
            .expect("a list")
            .iter()
            .map(|r| r["request_id"].as_str().expect("an id").to_owned())
            .collect()
    }

    pub(crate) async fn get(&self, path: &str) -> (u16, Value) {
        let response = self
            .client
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.key)
            .send()
            .await
            .expect("sent");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

pub(crate) fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// The tool results of a session's history, in order.
pub(crate) fn results(session: &Value) -> Vec<String> {
    session["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|m| m["items"].as_array())
        .flatten()
        .filter(|i| i["type"] == "tool_result")
        .map(|i| i["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_event_names_the_model_that_answered() {
    use markov_core::message::Item;
    use markov_core::model::StopReason;

    let model = ScriptedModel::builder()
        .response(
            ModelResponse::new(vec![Item::text("Hello.")], StopReason::EndTurn)
                .with_model("served-model-2025"),
        )
        .text("Again.")
        .build();
    let f = serve(model).await;
    let id = f.create().await;
    let step = |events: &[(String, Value)]| {
        let steps: Vec<Value> = events
            .iter()
            .filter(|(n, _)| n == "step")
            .map(|(_, d)| d.clone())
            .collect();
        assert_eq!(steps.len(), 1, "{events:?}");
        steps[0].clone()
    };
    let events = f.say(&id, "hi").await;
    assert_eq!(step(&events)["model"], "served-model-2025");
    // An answer that names no model: the event has no `model`.
    let events = f.say(&id, "hi again").await;
    assert!(step(&events).get("model").is_none(), "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_limit_ends_the_turn_with_its_reason_and_the_session_shows_its_usage() {
    use markov_context::{Limit, UsageLimits};
    use markov_core::message::Item;
    use markov_core::model::StopReason;
    let calls = Arc::new(AtomicUsize::new(0));
    let model = ScriptedModel::builder()
        .response(
            ModelResponse::new(vec![Item::text("One.")], StopReason::EndTurn).with_usage(
                markov_core::Usage {
                    input_tokens: 10,
                    output_tokens: 2,
                    ..markov_core::Usage::default()
                },
            ),
        )
        .text("Never asked for.")
        .build();
    let limits = UsageLimits::builder()
        .per_session(Limit::new().requests(1))
        .build()
        .expect("limits");
    let agent = Agent::builder("frugal")
        .instructions("Answer.")
        .model(Counted(model, calls.clone()))
        .limits(markov_executor::RunOptions::default().usage_limits(limits))
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, Arc::new(AtomicUsize::new(0))).await;
    let id = f.create().await;
    let events = f.say(&id, "hi").await;
    let step = &events.iter().find(|(n, _)| n == "step").expect("a step").1;
    assert_eq!(step["usage"]["input_tokens"], 10);
    assert_eq!(step["usage"]["requests"], 1);
    assert_eq!(step["totals"]["session"]["requests"], 1);

    let events = f.say(&id, "again").await;
    let done = events.iter().find(|(n, _)| n == "done").expect("done");
    assert_eq!(done.1["yield_reason"], "usage_limit", "{events:?}");
    let why = done.1["usage_limit"].as_str().expect("the limit, said");
    assert!(why.contains("per-session limit on requests"), "{why}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no second model call");

    let (status, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(session["usage"]["session"]["requests"], 1);
    assert_eq!(session["usage"]["session"]["output_tokens"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_too_long_for_the_model_ends_the_turn_clearly_and_the_session_goes_on() {
    let model = ScriptedModel::builder()
        .error(markov_core::ModelError::ContextLength(
            "prompt is too long: 210000 tokens > 200000 maximum".into(),
        ))
        .text("Fits again.")
        .build();
    let f = serve(model).await;
    let id = f.create().await;
    let events = f.say(&id, "a very long question").await;
    let done = events.iter().find(|(n, _)| n == "done").expect("done");
    assert_eq!(done.1["yield_reason"], "context_exhausted", "{events:?}");
    // The session is not stuck: the next message is answered.
    let events = f.say(&id, "shorter").await;
    let done = events.iter().find(|(n, _)| n == "done").expect("done");
    assert_eq!(done.1["yield_reason"], "end_turn", "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_call_needs_approval_is_streamed_and_stored_waiting() {
    let model = ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 5}))
        .text("Paid 5.")
        .build();
    let f = serve(model).await;
    let id = f.create().await;
    let events = f.say(&id, "pay 5").await;
    assert_eq!(names(&events), ["step", "done"], "{events:?}");
    let step = &events[0].1;
    assert_eq!(step["yield_reason"], "awaiting_approval");
    assert_eq!(step["approvals"][0]["tool"], "pay");
    assert_eq!(step["approvals"][0]["args"], json!({"amount": 5}));
    assert_eq!(step["approvals"][0]["call_id"], "call_1");
    assert!(step["approvals"][0]["expires"].is_u64());
    assert_eq!(events[1].1["awaiting_approval"], true);
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);

    let (status, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(
        session["history"].as_array().map(Vec::len),
        Some(1),
        "{session}"
    );
    assert_eq!(session["awaiting_approval"], true);
    assert_eq!(
        session["pending_approvals"].as_array().map(Vec::len),
        Some(1)
    );
    let (_, listed) = f.get("/sessions").await;
    assert_eq!(listed.as_array().map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approving_the_last_waiting_call_resumes_the_run_and_streams_it() {
    let calls = Arc::new(AtomicUsize::new(0));
    let model = ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 7}))
        .text("Paid 7.")
        .build();
    let f = serve(Counted(model, calls.clone())).await;
    let id = f.create().await;
    f.say(&id, "pay 7").await;
    let pending = f.pending(&id).await;
    assert_eq!(pending.len(), 1);

    let (status, _) = f
        .decide(&id, "apr_nope", json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 404, "an unknown request");
    let other = f.create().await;
    let (status, _) = f
        .decide(&other, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 404, "another session's request");
    let (status, _) = f
        .decide(&id, &pending[0], json!({"decision": "maybe"}))
        .await;
    assert_eq!(status, 400, "a decision that is none");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let (status, events) = f
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        names(&events),
        ["decided", "step", "delta", "step", "done"],
        "{events:?}"
    );
    assert_eq!(events[0].1["decision"], "approve");
    assert_eq!(events[0].1["waiting"], 0);
    let resumed = events[1].1.to_string();
    assert!(
        resumed.contains("paid 7"),
        "the call's result streams: {resumed}"
    );
    assert_eq!(events[3].1["yield_reason"], "end_turn");
    assert_eq!(events[4].1["done"], true);
    assert_eq!(events[4].1["awaiting_approval"], false);
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "paid once");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "no model call between the decision and the payment"
    );
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["awaiting_approval"], false);
    assert_eq!(results(&session), [r#"{"ok":true,"data":"paid 7"}"#]);
    let (status, body) = f
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 409, "decided twice: {body:?}");
    let message = body[0].1["error"].as_str().expect("an error").to_owned();
    assert!(
        message.contains(&pending[0]) && message.contains("already"),
        "{message}"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "still paid once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_deny_and_respond_over_http_and_the_run_resumes_after_the_last() {
    let calls = Arc::new(AtomicUsize::new(0));
    let model = ScriptedModel::builder()
        .tool_calls([
            ("pay", json!({"amount": 1})),
            ("pay", json!({"amount": 2})),
            ("pay", json!({"amount": 4})),
        ])
        .text("Handled.")
        .build();
    let f = serve(Counted(model, calls.clone())).await;
    let id = f.create().await;
    f.say(&id, "pay three bills").await;
    let pending = f.pending(&id).await;
    assert_eq!(pending.len(), 3);

    let (status, error) = f
        .decide(
            &id,
            &pending[0],
            json!({"decision": "edit", "args": {"amount": "three"}}),
        )
        .await;
    assert_eq!(status, 400, "{error:?}");
    let (status, events) = f
        .decide(
            &id,
            &pending[0],
            json!({"decision": "edit", "args": {"amount": 3}}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(names(&events), ["decided"], "two still wait: {events:?}");
    assert_eq!(events[0].1["waiting"], 2);
    let (status, _) = f
        .decide(&id, &pending[0], json!({"decision": "deny"}))
        .await;
    assert_eq!(status, 409, "already decided");
    let refused = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.key)
        .json(&json!({"text": "hello?"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(refused.status(), 409, "a message waits for the decisions");
    let (status, events) = f
        .decide(
            &id,
            &pending[1],
            json!({"decision": "deny", "message": "That one is paid already."}),
        )
        .await;
    assert_eq!((status, names(&events)), (200, vec!["decided"]));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let (status, events) = f
        .decide(
            &id,
            &pending[2],
            json!({"decision": "respond", "result": "paid in cash"}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        events.last().map(|(n, _)| n.as_str()),
        Some("done"),
        "{events:?}"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "only the edited call ran");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(
        results(&session),
        [
            r#"{"ok":true,"data":"paid 3"}"#.to_owned(),
            r#"{"ok":false,"error":{"type":"CONFIRMATION_DENIED","message":"The user declined this action: That one is paid already.","retryable":false}}"#.to_owned(),
            r#"{"ok":true,"data":"paid in cash"}"#.to_owned(),
        ]
    );
    assert!(
        session["history"].to_string().contains(r#""amount":3"#),
        "the history records the edited call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_racing_decisions_one_wins_and_the_other_is_an_error() {
    let model = Slow(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Done.")
            .build(),
        Duration::from_millis(200),
    );
    let f = serve(model).await;
    let id = f.create().await;
    f.say(&id, "pay 5").await;
    let request = f.pending(&id).await.remove(0);
    let (approve, deny) = tokio::join!(
        f.decide(&id, &request, json!({"decision": "approve"})),
        f.decide(&id, &request, json!({"decision": "deny"})),
    );
    let statuses = [approve.0, deny.0];
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "{approve:?} {deny:?}"
    );
    assert!(
        statuses.iter().any(|s| [404, 409].contains(s)),
        "{statuses:?}"
    );
    let paid = f.pays.load(Ordering::SeqCst);
    assert_eq!(paid, usize::from(approve.0 == 200), "the winner decided");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_request_is_gone_and_the_next_message_answers_it_as_expired() {
    let calls = Arc::new(AtomicUsize::new(0));
    let model = ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 5}))
        .text("The approval expired; nothing was paid.")
        .text("You are welcome.")
        .build();
    let config = PolicyConfig::new(Budget::UNLIMITED).confirmation_ttl(Duration::ZERO);
    let f = serve_with(Counted(model, calls.clone()), config).await;
    let id = f.create().await;
    let events = f.say(&id, "pay 5").await;
    assert_eq!(events[0].1["yield_reason"], "awaiting_approval");
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["awaiting_approval"], true);
    assert!(f.pending(&id).await.is_empty(), "nothing left to decide");
    let events = f.say(&id, "thanks").await;
    assert_eq!(
        events.last().map(|(n, _)| n.as_str()),
        Some("done"),
        "{events:?}"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    assert!(results(&session)[0].contains("CONFIRMATION_EXPIRED"));
    assert!(session["history"].to_string().contains("You are welcome."));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_flow_still_works_over_http() {
    let model = ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 7}))
        .text("Please approve.")
        .build();
    // The second turn presents the request id the first one received.
    let f = serve_with(
        Later(model, std::sync::OnceLock::new()),
        PolicyConfig::new(Budget::UNLIMITED).approval_flow(ApprovalFlow::Token),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "pay 7").await;
    let request = f.pending(&id).await.remove(0);
    let (status, events) = f
        .decide(&id, &request, json!({"decision": "approve"}))
        .await;
    assert_eq!((status, names(&events)), (200, vec!["decided"]));
    assert!(f.pending(&id).await.is_empty());

    *NEXT.lock().expect("lock") = Some(request);
    let events = f.say(&id, "approved, go").await;
    assert_eq!(
        events.last().map(|(n, _)| n.as_str()),
        Some("done"),
        "{events:?}"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "paid once");
}

/// The request id the second turn presents.
static NEXT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// A scripted first turn, then a second turn that pays with the approved
/// request id (known only once the first turn ran).
#[derive(Debug)]
struct Later(ScriptedModel, std::sync::OnceLock<ScriptedModel>);

#[async_trait]
impl Model for Later {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        if self.0.remaining() > 0 {
            return self.0.complete(request).await;
        }
        let second = self.1.get_or_init(|| {
            let token = NEXT.lock().expect("lock").clone().unwrap_or_default();
            ScriptedModel::builder()
                .tool_call("pay", json!({"amount": 7, "confirmationToken": token}))
                .text("Paid.")
                .build()
        });
        second.complete(request).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors() {
    let f = serve(ScriptedModel::builder().text("hi").build()).await;
    let id = f.create().await;
    let post = |path: String, body: reqwest::Body| {
        f.client
            .post(format!("{}{path}", f.base))
            .bearer_auth(&f.key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let malformed = post(format!("/sessions/{id}/messages"), "{\"text\": ".into())
        .await
        .expect("sent");
    assert_eq!(malformed.status(), 400);
    let body: Value = malformed.json().await.expect("json");
    assert!(body["error"].is_string(), "{body}");

    let unknown = post(
        "/sessions/nope/messages".into(),
        "{\"text\": \"hi\"}".into(),
    )
    .await
    .expect("sent");
    assert_eq!(unknown.status(), 404);

    let huge = format!(
        "{{\"text\": \"{}\"}}",
        "x".repeat(Limits::default().max_body_bytes + 10)
    );
    let too_large = post(format!("/sessions/{id}/messages"), huge.into())
        .await
        .expect("sent");
    assert_eq!(too_large.status(), 413);

    let (status, _) = f.get("/sessions/nope").await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_message_while_running_is_a_conflict_and_a_client_that_leaves_does_not_stop_the_run()
 {
    let model = Slow(
        ScriptedModel::builder().text("Done thinking.").build(),
        Duration::from_millis(300),
    );
    let f = serve(model).await;
    let id = f.create().await;
    let first = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.key)
        .json(&json!({"text": "think"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(first.status(), 200);
    let second = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.key)
        .json(&json!({"text": "and again"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(second.status(), 409);
    // Whose the session is comes first: to another principal it does not
    // exist, running or not.
    let theirs = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .bearer_auth(&f.keys["bob"])
        .json(&json!({"text": "mine now"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(
        theirs.status(),
        404,
        "bob's message to alice's running session"
    );
    // The first client goes away mid-run.
    drop(first);
    let mut waited = Duration::ZERO;
    loop {
        let (_, session) = f.get(&format!("/sessions/{id}")).await;
        let done = session["history"]
            .as_array()
            .is_some_and(|h| h.iter().any(|m| m.to_string().contains("Done thinking.")));
        if done {
            break;
        }
        assert!(
            waited < Duration::from_secs(15),
            "the run never finished: {session}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += Duration::from_millis(50);
    }
    // Nothing was lost: the second message was refused, not queued.
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    assert!(!session.to_string().contains("and again"));
    assert!(!session.to_string().contains("mine now"));
}

#[derive(serde::Serialize, Deserialize, JsonSchema)]
struct Counter {
    count: i64,
}

#[derive(Deserialize, JsonSchema)]
struct By {
    by: i64,
}

/// Adds `by` to the counter.
struct Bump;

#[async_trait]
impl markov_charter::command::Command for Bump {
    const NAME: &'static str = "bump";
    type Input = By;
    type Error = markov_charter::command::CommandError;
    fn description(&self) -> String {
        "Bump the counter".into()
    }
    async fn execute(
        &self,
        input: By,
        cx: &markov_charter::command::CommandContext<'_>,
    ) -> Result<markov_charter::command::CommandResult, Self::Error> {
        let Counter { count } = cx
            .state()
            .map_err(markov_charter::command::CommandError::failed)?;
        cx.update_state(json!({"count": count + input.by}))?;
        Ok(markov_charter::command::CommandResult::with_payload(json!(
            count + input.by
        )))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_runs_without_the_model_and_is_stored() {
    let node = Node::builder("Count.")
        .name("main")
        .state(Counter { count: 0 })
        .command(Bump)
        .build()
        .expect("node");
    let agent = Agent::builder("counter")
        .node("main", node)
        .state(json!({"count": 0}))
        .model(ScriptedModel::builder().build())
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, Arc::new(AtomicUsize::new(0))).await;
    let id = f.create().await;
    let run = |name: &'static str, input: Value| {
        f.client
            .post(format!("{}/sessions/{id}/commands", f.base))
            .bearer_auth(&f.key)
            .json(&json!({"name": name, "input": input}))
            .send()
    };
    let response = run("bump", json!({"by": 2})).await.expect("sent");
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["success"], true, "{body}");
    assert_eq!(body["value"], 2);
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["state"], json!({"count": 2}), "{session}");
    assert!(session["history"].to_string().contains("bump"), "{session}");

    let unknown: Value = run("nope", json!({}))
        .await
        .expect("sent")
        .json()
        .await
        .expect("json");
    assert_eq!(unknown["success"], false);
    assert!(unknown["error"].is_string(), "{unknown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_a_decision_resumes_records_who_decided() {
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(
            ScriptedModel::builder()
                .tool_call("pay", json!({"amount": 7}))
                .text("Paid 7.")
                .build(),
        )
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(
        Server::builder().agent(agent).worker(WorkerId::new("test")),
        store.clone(),
        pays,
    )
    .await;
    let id = f.create().await;
    f.say(&id, "pay 7").await;
    let pending = f.pending(&id).await;
    let (status, _) = f
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 200);
    let steps = markov_store::Store::steps(&*store, &markov_store::SessionId::new(&id), 0, 10)
        .await
        .expect("steps read");
    let approval = steps
        .iter()
        .flat_map(|s| &s.calls)
        .flat_map(|c| &c.tool_calls)
        .find_map(|c| c.approval.clone())
        .expect("the resumed call's decision is recorded");
    assert_eq!(approval.decision, "approve");
    assert_eq!(
        approval.by.as_deref(),
        Some("alice"),
        "the principal that decided"
    );
}
