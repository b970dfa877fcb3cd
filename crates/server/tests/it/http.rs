//! The service on a real loopback port, driven over HTTP: sessions, a run
//! streamed as server-sent events, approvals, and bad input.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::Agent;
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata};
use markov_runtime::node::Node;
use markov_server::{MAX_BODY_BYTES, router};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize, JsonSchema)]
struct PayArgs {
    amount: u32,
}

/// Pays, counting its executions; needs the user's approval.
struct Pay(Arc<AtomicUsize>);

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
struct Slow(ScriptedModel, Duration);

#[async_trait]
impl Model for Slow {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        tokio::time::sleep(self.1).await;
        self.0.complete(request).await
    }
}

pub(crate) struct Fixture {
    pub(crate) base: String,
    pub(crate) pays: Arc<AtomicUsize>,
    client: reqwest::Client,
}

pub(crate) async fn serve(model: impl Model + 'static) -> Fixture {
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        // The registry's own result format (JSON envelopes) and the
        // model-mediated approval flow these tests exercise.
        .policies(
            PolicyConfig::new(Budget::UNLIMITED).approval_flow(markov_policy::ApprovalFlow::Token),
        )
        .model(model)
        .build()
        .expect("the agent builds");
    serve_agent(agent, pays).await
}

/// Serves `agent` on a loopback port, its sessions in memory.
async fn serve_agent(agent: Agent, pays: Arc<AtomicUsize>) -> Fixture {
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let app = router(agent, store, WorkerId::new("test"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    // reqwest is built without a default TLS provider; loopback is plain
    // HTTP, but the client wants one all the same.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Fixture {
        base,
        pays,
        client: reqwest::Client::new(),
    }
}

impl Fixture {
    async fn create(&self) -> String {
        let response = self
            .client
            .post(format!("{}/sessions", self.base))
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.expect("json");
        body["id"].as_str().expect("an id").to_owned()
    }

    /// Posts a message and reads the whole event stream: (event, data) pairs.
    async fn say(&self, id: &str, text: &str) -> Vec<(String, Value)> {
        let response = self
            .client
            .post(format!("{}/sessions/{id}/messages", self.base))
            .json(&json!({"text": text}))
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status(), 200, "{:?}", response.text().await);
        events(&response.text().await.expect("the stream"))
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let response = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("sent");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

fn events(stream: &str) -> Vec<(String, Value)> {
    stream
        .split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = Some(n.trim().to_owned());
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            let name = name?;
            let data = serde_json::from_str(&data).unwrap_or(Value::String(data));
            Some((name, data))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_streamed_step_by_step_and_stored() {
    let model = ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 5}))
        .text("Please approve the payment of 5.")
        .build();
    let f = serve(model).await;
    let id = f.create().await;
    let events = f.say(&id, "pay 5").await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["step", "delta", "step", "done"], "{events:?}");
    // The answer's text arrives as the model writes it, then in its step.
    assert_eq!(events[1].1["text"], "Please approve the payment of 5.");
    let first = &events[0].1;
    assert_eq!(first["yield_reason"], "tool_use");
    let text = first.to_string();
    assert!(
        text.contains("\"pay\""),
        "the tool call is in the step: {text}"
    );
    assert!(
        text.contains("CONFIRMATION_REQUIRED"),
        "and its result: {text}"
    );
    assert_eq!(events[3].1["done"], true);

    let (status, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(status, 200);
    let history = session["history"].as_array().expect("history");
    assert_eq!(history.len(), 4, "{history:?}");
    assert_eq!(
        session["pending_approvals"].as_array().map(Vec::len),
        Some(1)
    );
    let (_, listed) = f.get("/sessions").await;
    assert_eq!(listed.as_array().map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_given_over_http_lets_the_payment_run_once() {
    let model = ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 7}))
        .text("Please approve.")
        .build();
    // The second turn presents the request id the first one received.
    let f = serve(Later(model, std::sync::OnceLock::new())).await;
    let id = f.create().await;
    f.say(&id, "pay 7").await;
    let (_, pending) = f.get(&format!("/sessions/{id}/approvals")).await;
    let request = pending[0]["request_id"]
        .as_str()
        .expect("a request")
        .to_owned();

    let unknown = f
        .client
        .post(format!("{}/sessions/{id}/approvals/apr_nope", f.base))
        .json(&json!({"decision": "approve"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(unknown.status(), 404);
    let approved = f
        .client
        .post(format!("{}/sessions/{id}/approvals/{request}", f.base))
        .json(&json!({"decision": "approve"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(approved.status(), 200);
    let (_, pending) = f.get(&format!("/sessions/{id}/approvals")).await;
    assert_eq!(pending.as_array().map(Vec::len), Some(0));

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

    let huge = format!("{{\"text\": \"{}\"}}", "x".repeat(MAX_BODY_BYTES + 10));
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
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 1}))
            .text("Done thinking.")
            .build(),
        Duration::from_millis(300),
    );
    let f = serve(model).await;
    let id = f.create().await;
    let first = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .json(&json!({"text": "think"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(first.status(), 200);
    let second = f
        .client
        .post(format!("{}/sessions/{id}/messages", f.base))
        .json(&json!({"text": "and again"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(second.status(), 409);
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

impl markov_runtime::command::Command for Bump {
    const NAME: &'static str = "bump";
    type Input = By;
    type Error = markov_runtime::command::CommandError;
    fn description(&self) -> String {
        "Bump the counter".into()
    }
    async fn execute(
        &self,
        input: By,
        cx: &markov_runtime::command::CommandContext<'_>,
    ) -> Result<markov_runtime::command::CommandResult, Self::Error> {
        let Counter { count } = cx
            .state()
            .map_err(markov_runtime::command::CommandError::failed)?;
        cx.update_state(json!({"count": count + input.by}))?;
        Ok(markov_runtime::command::CommandResult::with_payload(json!(
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
