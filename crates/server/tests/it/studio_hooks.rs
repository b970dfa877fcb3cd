//! The studio's routes that need the application's help: a step's request
//! as the wire body the application's encoder writes (redacted), and a
//! session as the case file its exporter writes; who may read each, and
//! what a server without them answers.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::model::{Model, ModelError, ModelLayer, ModelRequest, ModelResponse, StreamEvent};
use markov_server::{ApiError, Server};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

use crate::http::{Fixture, start};
use crate::studio::payments;

/// A GET as `key`: status, content type, content disposition and body.
async fn get(f: &Fixture, key: &str, path: &str) -> (u16, String, String, String) {
    let response = f
        .client
        .get(format!("{}{path}", f.base))
        .bearer_auth(key)
        .send()
        .await
        .expect("sent");
    let header = |name| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (kind, disposition) = (header("content-type"), header("content-disposition"));
    let status = response.status().as_u16();
    (
        status,
        kind,
        disposition,
        response.text().await.expect("a body"),
    )
}

/// The payments agent on `model`, served with an encoder that writes a
/// vendor-like body carrying a key field (refusing requests of more than
/// two messages), and an exporter that says what it was asked.
pub(crate) async fn hooked(model: ScriptedModel) -> Fixture {
    let model = Arc::new(model);
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    start(
        Server::builder()
            .agent(payments("You pay bills.", model))
            .wire_body("payments", |request| {
                if request.messages().len() > 2 {
                    return Err(ModelError::InvalidRequest(
                        "too many for this vendor".into(),
                    ));
                }
                Ok(json!({
                    "model": "vendor-model",
                    "system": request.system(),
                    "messages": request.messages().len(),
                    "api_key": "sk-secret-in-a-body",
                })
                .to_string()
                .into_bytes())
            })
            .case_export(|_store, id, steps| {
                Box::pin(async move {
                    match steps {
                        Some(steps) if steps.start > 5 => {
                            Err(ApiError::NotFound(format!("no steps {steps:?}")))
                        }
                        steps => Ok(format!("# case of {id}, steps {steps:?}\n")),
                    }
                })
            })
            .worker(WorkerId::new("test")),
        store,
        Arc::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steps_wire_body_is_the_encoders_with_keys_redacted_for_its_readers_only() {
    let f = hooked(ScriptedModel::builder().text("Hello.").text("Bye.").build()).await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    f.say(&id, "bye").await;
    let (status, _, _, page) = get(&f, &f.key, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let page: Value = serde_json::from_str(&page).expect("json");
    assert_eq!(page["wire"], true, "{page}");
    assert_eq!(page["exportable"], true, "{page}");

    let (status, _, _, wire) = get(&f, &f.key, &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 200, "{wire}");
    assert!(!wire.contains("sk-secret-in-a-body"), "{wire}");
    let wire: Value = serde_json::from_str(&wire).expect("json");
    assert_eq!(
        wire["body"],
        json!({"model": "vendor-model", "system": "You pay bills.", "messages": 1,
               "api_key": "<redacted>"})
    );
    // What the provider cannot carry is said, not shown as a body.
    let (status, _, _, refused) = get(&f, &f.key, &format!("/sessions/{id}/steps/1/wire")).await;
    assert_eq!(status, 409, "{refused}");
    assert!(refused.contains("too many for this vendor"), "{refused}");
    let (status, _, _, _) = get(&f, &f.keys["bob"], &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 404, "bob may not read alice's steps");
    let (status, _, _, _) = get(&f, &f.key, &format!("/sessions/{id}/steps/9/wire")).await;
    assert_eq!(status, 404, "no step 9");

    // A server without an encoder says so.
    let (g, id, _) = crate::studio::three_turns(crate::studio::script()).await;
    let (_, _, _, page) = get(&g, &g.key, &format!("/sessions/{id}/steps")).await;
    let page: Value = serde_json::from_str(&page).expect("json");
    assert_eq!(page["wire"], false, "{page}");
    assert_eq!(page["exportable"], false, "{page}");
    let (status, _, _, body) = get(&g, &g.key, &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 409, "{body}");
    let (status, _, _, body) = get(&g, &g.key, &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 409, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_or_a_range_of_its_steps_is_the_exporters_case_file() {
    let f = hooked(ScriptedModel::builder().text("Hello.").text("Bye.").build()).await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    let (status, kind, disposition, body) = get(&f, &f.key, &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(kind, "application/toml");
    assert_eq!(disposition, format!("attachment; filename=\"{id}.toml\""));
    assert_eq!(body, format!("# case of {id}, steps None\n"));
    let (status, _, disposition, body) =
        get(&f, &f.key, &format!("/sessions/{id}/case?from=1&to=3")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, format!("# case of {id}, steps Some(1..3)\n"));
    assert_eq!(
        disposition,
        format!("attachment; filename=\"{id}-steps-1-3.toml\"")
    );
    let (_, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/case?from=2")).await;
    assert_eq!(
        body,
        format!("# case of {id}, steps Some(2..18446744073709551615)\n"),
        "from a step to the end"
    );
    // The exporter's error is answered as it is.
    let (status, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/case?from=7&to=8")).await;
    assert_eq!(status, 404, "{body}");
    for bad in ["from=3&to=3", "from=x", "to=-1"] {
        let (status, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/case?{bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, _, _, _) = get(&f, &f.keys["bob"], &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 404, "bob may not export alice's session");
    let anonymous = f
        .client
        .get(format!("{}/sessions/{id}/case", f.base))
        .send()
        .await
        .expect("sent");
    assert_eq!(anonymous.status(), 401);
}

/// What a vendor's client sends for `request`: its system prompt,
/// messages (without markov's metadata, which no provider is sent),
/// tools, tool choice and settings, as compact JSON.
pub(crate) fn vendor_body(request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
    let messages: Vec<Value> = request
        .messages()
        .iter()
        .map(|m| {
            let mut value = serde_json::to_value(m).expect("a message is JSON");
            if let Some(object) = value.as_object_mut() {
                object.remove("metadata");
            }
            value
        })
        .collect();
    serde_json::to_vec(&json!({
        "model": "vendor-model",
        "system": request.system(),
        "messages": messages,
        "tools": request.tools(),
        "tool_choice": request.tool_choice(),
        "settings": request.settings(),
    }))
    .map_err(|e| ModelError::InvalidRequest(e.to_string()))
}

/// A fake provider: each request its client would send, as
/// [`vendor_body`] encodes it, is kept (the bytes the provider received),
/// and the scripted model answers.
#[derive(Debug)]
pub(crate) struct Wired {
    model: Arc<ScriptedModel>,
    received: Mutex<Vec<Vec<u8>>>,
}

impl Wired {
    pub(crate) fn new(model: Arc<ScriptedModel>) -> Arc<Self> {
        Arc::new(Wired {
            model,
            received: Mutex::default(),
        })
    }

    /// The bodies received, in order.
    pub(crate) fn received(&self) -> Vec<Vec<u8>> {
        self.received.lock().expect("not poisoned").clone()
    }

    fn receive(&self, request: &ModelRequest<'_>) -> Result<(), ModelError> {
        let body = vendor_body(request)?;
        self.received.lock().expect("not poisoned").push(body);
        Ok(())
    }
}

#[async_trait]
impl ModelLayer for Wired {
    type Inner = ScriptedModel;

    fn inner(&self) -> &ScriptedModel {
        &self.model
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.receive(&request)?;
        self.model.complete(request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        match self.receive(&request) {
            Ok(()) => self.model.stream(request),
            Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
        }
    }
}

/// The wire body the server shows at `path` (as `key`), as the bytes of
/// its JSON.
async fn wire_at(f: &Fixture, key: &str, path: &str) -> Vec<u8> {
    let (status, _, _, body) = get(f, key, path).await;
    assert_eq!(status, 200, "{path}: {body}");
    let body: Value = serde_json::from_str(&body).expect("json");
    serde_json::to_vec(&body["body"]).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agent_steps_wire_body_is_what_its_provider_received() {
    let models = crate::studio_agents::Nested::new();
    let (desk, clerk) = (
        Wired::new(Arc::clone(&models.desk)),
        Wired::new(Arc::clone(&models.clerk)),
    );
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(
        Server::builder()
            .agent(models.agent_on(Arc::clone(&desk), Arc::clone(&clerk)))
            .wire_body("desk", vendor_body)
            .wire_body("clerk", vendor_body)
            .worker(WorkerId::new("test")),
        store,
        Arc::default(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "Where is the atlas?").await;
    let (status, _, _, page) = get(&f, &f.key, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let page: Value = serde_json::from_str(&page).expect("json");
    // The assistant has no encoder: its own steps offer none.
    assert_eq!(page["wire"], false, "{page}");
    assert_eq!(page["steps"][0]["wire"], false, "{page}");
    let desk_steps = &page["steps"][0]["sub_agents"][0]["steps"];
    let clerk_steps = &desk_steps[0]["sub_agents"][0]["steps"];
    let all = [
        (&desk_steps[0], &desk, 0),
        (&desk_steps[1], &desk, 1),
        (&clerk_steps[0], &clerk, 0),
        (&clerk_steps[1], &clerk, 1),
    ];
    for (step, model, call) in all {
        assert_eq!(step["wire"], true, "{step}");
        let at = step["at"].as_u64().expect("its place");
        let shown = wire_at(
            &f,
            &f.key,
            &format!("/sessions/{id}/steps/0/sub_agents/{at}/wire"),
        )
        .await;
        let received = &model.received()[call];
        assert_eq!(
            String::from_utf8_lossy(&shown),
            String::from_utf8_lossy(received),
            "sub-agent step {at}"
        );
        assert_eq!(&shown, received, "byte for byte");
    }
    assert_eq!(desk.received().len(), 2);
    assert_eq!(clerk.received().len(), 2);

    // Not another principal's; no such sub-agent step; none for the
    // assistant's own step, which has no encoder.
    let (status, _, _, _) = get(
        &f,
        &f.keys["bob"],
        &format!("/sessions/{id}/steps/0/sub_agents/0/wire"),
    )
    .await;
    assert_eq!(status, 404, "bob");
    for path in ["0/sub_agents/99", "1/sub_agents/0", "7/sub_agents/0"] {
        let (status, _, _, body) =
            get(&f, &f.key, &format!("/sessions/{id}/steps/{path}/wire")).await;
        assert_eq!(status, 404, "{path}: {body}");
    }
    let (status, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 409, "{body}");

    // A sub-agent without an encoder says so.
    let models = crate::studio_agents::Nested::new();
    let g = start(
        Server::builder()
            .agent(models.agent())
            .wire_body("desk", vendor_body)
            .worker(WorkerId::new("test")),
        Arc::new(SqliteStore::in_memory().expect("a database")),
        Arc::default(),
    )
    .await;
    let id = g.create().await;
    g.say(&id, "Where is the atlas?").await;
    let (_, _, _, page) = get(&g, &g.key, &format!("/sessions/{id}/steps")).await;
    let page: Value = serde_json::from_str(&page).expect("json");
    let desk_steps = &page["steps"][0]["sub_agents"][0]["steps"];
    assert_eq!(desk_steps[0]["wire"], true, "{page}");
    let clerk_step = &desk_steps[0]["sub_agents"][0]["steps"][0];
    assert_eq!(clerk_step["wire"], false, "{page}");
    let at = clerk_step["at"].as_u64().expect("its place");
    let (status, _, _, body) = get(
        &g,
        &g.key,
        &format!("/sessions/{id}/steps/0/sub_agents/{at}/wire"),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("clerk"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_steps_wire_body_is_what_its_agents_provider_received() {
    let refunds = Arc::new(AtomicUsize::new(0));
    let triage = Wired::new(Arc::new(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .text("Glad it is sorted.")
            .build(),
    ));
    let billing = Wired::new(Arc::new(
        ScriptedModel::builder()
            .tool_call("refund", json!({"amount": 5}))
            .tool_call("hand_back", json!({"reason": "refunded"}))
            .build(),
    ));
    let team = crate::team::team(Arc::clone(&triage), Arc::clone(&billing), &refunds);
    let f = start(
        Server::builder()
            .team("support", team)
            .wire_body("triage", vendor_body)
            .wire_body("billing", vendor_body)
            .worker(WorkerId::new("server")),
        Arc::new(SqliteStore::in_memory().expect("a database")),
        refunds,
    )
    .await;
    let id = f.create().await;
    f.say(&id, "Refund my 5, please.").await;
    let (status, _, _, page) = get(&f, &f.key, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let page: Value = serde_json::from_str(&page).expect("json");
    assert_eq!(page["wire"], true, "{page}");
    let steps = page["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 4, "{page}");
    // Each agent's steps, in the order its provider received them.
    let mut seen = std::collections::HashMap::<String, usize>::new();
    for step in steps {
        assert_eq!(step["wire"], true, "{step}");
        let agent = step["team"]["agent"].as_str().expect("an agent");
        let session = step["team"]["session"].as_str().expect("a session");
        let n = step["team"]["step"].as_u64().expect("a step");
        let shown = wire_at(&f, &f.key, &format!("/sessions/{session}/steps/{n}/wire")).await;
        let call = seen.entry(agent.to_owned()).or_default();
        let model = if agent == "triage" { &triage } else { &billing };
        let received = &model.received()[*call];
        *call += 1;
        assert_eq!(
            String::from_utf8_lossy(&shown),
            String::from_utf8_lossy(received),
            "{agent}'s step {n}"
        );
        assert_eq!(&shown, received, "byte for byte");
    }
    assert_eq!(seen["triage"], 2);
    assert_eq!(seen["billing"], 2);
    let billing_session = format!("{id}~billing");
    let (status, _, _, _) = get(
        &f,
        &f.keys["bob"],
        &format!("/sessions/{billing_session}/steps/0/wire"),
    )
    .await;
    assert_eq!(status, 404, "bob may not read alice's agent's steps");
}
