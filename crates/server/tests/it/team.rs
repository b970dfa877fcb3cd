//! A team served: a session is a team conversation, driven over HTTP —
//! a message handed from triage to billing, which answers, then hands
//! back; the events and the session say which agent answered and where
//! the handoffs were; a server started again on the same SQLite file goes
//! on with the agent that held the conversation, and one stopped mid-turn
//! finishes the turn when it is back; a call that needs approval pauses
//! the team's turn, shows in the session, is decided on the
//! conversation's decision route (after a restart too) and the turn goes
//! on with the same agent, and its handoff after it.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use markov_core::model::Model;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Agent, Handoff, Team};
use markov_policy::{Category, ToolMetadata};
use markov_server::Server;
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::{Fixture, Slow, names, start};

#[derive(Deserialize, JsonSchema)]
struct RefundArgs {
    amount: u32,
}

/// Refunds, counting its executions.
struct Refund(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Refund {
    const NAME: &'static str = "refund";
    type Args = RefundArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Refund an amount".into()
    }
    async fn call(&self, args: RefundArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!("refunded {}", args.amount))
    }
}

pub(crate) fn team(
    triage: impl Model + 'static,
    billing: impl Model + 'static,
    refunds: &Arc<AtomicUsize>,
) -> Team {
    team_with(
        triage,
        billing,
        refunds,
        ToolMetadata::new(Category::Action),
    )
}

/// [`team`] with billing's `refund` described by `refund`.
pub(crate) fn team_with(
    triage: impl Model + 'static,
    billing: impl Model + 'static,
    refunds: &Arc<AtomicUsize>,
    refund: ToolMetadata,
) -> Team {
    let triage = Agent::builder("triage")
        .instructions("You are triage: hand refunds to billing.")
        .tools([Handoff::tool("billing", "For refunds.").expect("valid")])
        .model(triage)
        .build()
        .expect("builds");
    let billing = Agent::builder("billing")
        .instructions("You are billing.")
        .tool_with(Refund(refunds.clone()), refund)
        .tools([Handoff::back().expect("valid")])
        .model(billing)
        .build()
        .expect("builds");
    Team::builder()
        .agent("triage", triage)
        .agent("billing", billing)
        .build()
        .expect("the team builds")
}

fn database(name: &str) -> PathBuf {
    crate::fixtures::scratch_dir(&format!("team-{name}")).join("sessions.db")
}

async fn serve(path: &PathBuf, team: Team, refunds: &Arc<AtomicUsize>) -> Fixture {
    let store = Arc::new(SqliteStore::open(path).expect("the database opens"));
    start(
        Server::builder()
            .team("support", team)
            .worker(WorkerId::new("server"))
            .lease(Duration::from_secs(2)),
        store,
        refunds.clone(),
    )
    .await
}

async fn stop(mut fixture: Fixture) {
    fixture.shutdown.cancel();
    if let Some(stopped) = fixture.stopped.take() {
        tokio::time::timeout(Duration::from_secs(30), stopped)
            .await
            .expect("the server stops")
            .expect("joins")
            .expect("serves");
    }
}

/// The data of the events named `name`.
fn all<'a>(events: &'a [(String, Value)], name: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, d)| d)
        .collect()
}

fn texts(session: &Value) -> Vec<String> {
    session["history"]
        .as_array()
        .expect("a history")
        .iter()
        .map(|m| {
            m["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|i| i["text"].as_str())
                .collect::<String>()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_conversation_hands_off_and_back_over_http_and_goes_on_after_a_restart() {
    let path = database("restart");
    let refunds = Arc::new(AtomicUsize::new(0));
    let fixture = serve(
        &path,
        team(
            ScriptedModel::builder()
                .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                .build(),
            ScriptedModel::builder()
                .tool_call("refund", json!({"amount": 5}))
                .text("Refunded 5.")
                .build(),
            &refunds,
        ),
        &refunds,
    )
    .await;
    let (status, agents) = fixture.get("/agents").await;
    assert_eq!(status, 200);
    assert_eq!(
        agents,
        json!([{"name": "support", "default": true, "model": null, "team": ["billing", "triage"]}])
    );
    // The document describes the handoff event and the team's part of a
    // session.
    let (status, document) = fixture.get("/openapi.json").await;
    assert_eq!(status, 200);
    let schemas = &document["components"]["schemas"];
    let handoff = &schemas["HandoffEvent"]["properties"];
    for field in ["from", "to", "reason", "at"] {
        assert!(handoff[field].is_object(), "{field}: {handoff}");
    }
    let detail = &schemas["TeamDetail"]["properties"];
    for field in ["agents", "current_agent", "speakers", "handoffs"] {
        assert!(detail[field].is_object(), "{field}: {detail}");
    }
    assert!(schemas["StepEvent"]["properties"]["agent"].is_object());
    assert!(schemas["DoneEvent"]["properties"]["agent"].is_object());
    let id = fixture.create().await;

    let events = fixture.say(&id, "Refund my 5, please.").await;
    assert_eq!(
        names(&events),
        ["step", "handoff", "step", "delta", "step", "done"],
        "{events:?}"
    );
    // The answer's text arrives as it is written.
    assert_eq!(all(&events, "delta")[0]["text"], "Refunded 5.");
    let steps = all(&events, "step");
    assert_eq!(steps[0]["agent"], "triage");
    assert_eq!(steps[1]["agent"], "billing");
    assert_eq!(steps[2]["agent"], "billing");
    // Billing's first step starts with what the handoff gave it (the
    // user's message and the handoff's note, as one message).
    assert_eq!(steps[0].get("handoff_context"), None);
    assert_eq!(steps[1]["handoff_context"], 1);
    assert_eq!(steps[2].get("handoff_context"), None);
    assert_eq!(
        *all(&events, "handoff")[0],
        json!({"from": "triage", "to": "billing", "reason": "a refund", "at": 1})
    );
    let done = all(&events, "done")[0];
    assert_eq!(done["agent"], "billing");
    assert_eq!(done["response"], "Refunded 5.");
    assert_eq!(refunds.load(Ordering::SeqCst), 1);

    let (status, session) = fixture.get(&format!("/sessions/{id}")).await;
    assert_eq!(status, 200, "{session}");
    assert_eq!(session["agent"], "support");
    assert_eq!(texts(&session), ["Refund my 5, please.", "Refunded 5."]);
    assert_eq!(
        session["team"],
        json!({
            "agents": ["billing", "triage"],
            "current_agent": "billing",
            "speakers": [null, "billing"],
            "handoffs": [{"from": "triage", "to": "billing", "reason": "a refund", "at": 1}],
        })
    );
    assert_eq!(session["interrupted"], false);
    // One conversation in the list, of the team (billing's own session is
    // not the user's business).
    let (_, list) = fixture.get("/sessions").await;
    let list = list.as_array().expect("a list");
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["agent"], "support");
    // No call waits: a decision names no request of the conversation's;
    // commands are refused, with why.
    let (status, _) = fixture
        .decide(&id, "nothing", json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 404);
    let response = fixture
        .client
        .post(format!("{}/sessions/{id}/commands", fixture.base))
        .bearer_auth(&fixture.key)
        .json(&json!({"name": "anything"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 409);
    let body: Value = response.json().await.expect("an error");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("team") && error.contains("no commands"),
        "{error}"
    );
    // Billing's own session is the team's: not a session to talk to.
    let billing = format!("{id}~billing");
    let response = fixture
        .client
        .post(format!("{}/sessions/{billing}/messages", fixture.base))
        .bearer_auth(&fixture.key)
        .json(&json!({"text": "hi"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 404);
    stop(fixture).await;

    // The same file, a new process's models: billing holds the
    // conversation, then hands it back.
    let fixture = serve(
        &path,
        team(
            ScriptedModel::builder().text("Glad it is sorted.").build(),
            ScriptedModel::builder()
                .text("It arrives in three days.")
                .tool_call("hand_back", json!({"reason": "refund done"}))
                .build(),
            &refunds,
        ),
        &refunds,
    )
    .await;
    let events = fixture.say(&id, "When does it arrive?").await;
    assert_eq!(names(&events), ["delta", "step", "done"], "{events:?}");
    assert_eq!(all(&events, "step")[0]["agent"], "billing");
    let done = all(&events, "done")[0];
    assert_eq!(
        (done["agent"].as_str(), done["response"].as_str()),
        (Some("billing"), Some("It arrives in three days."))
    );

    let events = fixture.say(&id, "Thanks, that is all.").await;
    assert_eq!(
        names(&events),
        ["step", "handoff", "delta", "step", "done"],
        "{events:?}"
    );
    assert_eq!(
        *all(&events, "handoff")[0],
        json!({"from": "billing", "to": "triage", "reason": "refund done", "at": 5})
    );
    // Triage is given what came after its part: billing's answer, the
    // user's question, billing's next answer, the last message with the
    // handoff's note.
    let steps = all(&events, "step");
    assert_eq!(steps[1]["agent"], "triage");
    assert_eq!(steps[1]["handoff_context"], 4);
    let done = all(&events, "done")[0];
    assert_eq!(
        (done["agent"].as_str(), done["response"].as_str()),
        (Some("triage"), Some("Glad it is sorted."))
    );
    let (_, session) = fixture.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["team"]["current_agent"], "triage");
    assert_eq!(
        session["team"]["speakers"],
        json!([null, "billing", null, "billing", null, "triage"])
    );
    assert_eq!(
        texts(&session).last().map(String::as_str),
        Some("Glad it is sorted.")
    );
    assert_eq!(refunds.load(Ordering::SeqCst), 1, "no refund twice");
    stop(fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_turn_stopped_by_a_shutdown_is_finished_when_the_server_is_back() {
    let path = database("shutdown");
    let refunds = Arc::new(AtomicUsize::new(0));
    let fixture = serve(
        &path,
        team(
            ScriptedModel::builder()
                .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                .build(),
            // Billing thinks a while: the server is asked to stop meanwhile.
            Slow(
                ScriptedModel::builder()
                    .tool_call("refund", json!({"amount": 5}))
                    .build(),
                Duration::from_millis(800),
            ),
            &refunds,
        ),
        &refunds,
    )
    .await;
    let id = fixture.create().await;
    let say = {
        let (client, base, key, id) = (
            fixture.client.clone(),
            fixture.base.clone(),
            fixture.key.clone(),
            id.clone(),
        );
        tokio::spawn(async move {
            let response = client
                .post(format!("{base}/sessions/{id}/messages"))
                .bearer_auth(&key)
                .json(&json!({"text": "Refund my 5."}))
                .send()
                .await
                .expect("sent");
            crate::http::events(&response.text().await.expect("the stream"))
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop(fixture).await;
    let events = say.await.expect("the stream ends");
    assert_eq!(
        names(&events),
        ["step", "handoff", "step", "interrupted"],
        "{events:?}"
    );
    assert_eq!(refunds.load(Ordering::SeqCst), 1);

    // Back: billing's run is continued on its own (its refund is not made
    // again) and the turn ends with its answer.
    let fixture = serve(
        &path,
        team(
            ScriptedModel::builder().build(),
            ScriptedModel::builder().text("Refunded 5.").build(),
            &refunds,
        ),
        &refunds,
    )
    .await;
    let mut session = Value::Null;
    for _ in 0..100 {
        let (_, shown) = fixture.get(&format!("/sessions/{id}")).await;
        session = shown;
        if session["interrupted"] == false && session["running"] == false {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        texts(&session),
        ["Refund my 5.", "Refunded 5."],
        "{session}"
    );
    assert_eq!(session["team"]["current_agent"], "billing");
    assert_eq!(
        session["team"]["handoffs"].as_array().map(Vec::len),
        Some(1)
    );
    assert_eq!(refunds.load(Ordering::SeqCst), 1, "no refund twice");
    stop(fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_turn_is_cancelled_like_an_agents_and_the_conversation_goes_on() {
    let path = database("cancel");
    let refunds = Arc::new(AtomicUsize::new(0));
    let fixture = serve(
        &path,
        team(
            ScriptedModel::builder()
                .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                .build(),
            // Billing thinks a long while before each answer (a call cut
            // short takes nothing from its script).
            Slow(
                ScriptedModel::builder().text("Refunded 5.").build(),
                Duration::from_millis(1500),
            ),
            &refunds,
        ),
        &refunds,
    )
    .await;
    let id = fixture.create().await;
    let say = {
        let (client, base, key, id) = (
            fixture.client.clone(),
            fixture.base.clone(),
            fixture.key.clone(),
            id.clone(),
        );
        tokio::spawn(async move {
            let response = client
                .post(format!("{base}/sessions/{id}/messages"))
                .bearer_auth(&key)
                .json(&json!({"text": "Refund my 5."}))
                .send()
                .await
                .expect("sent");
            crate::http::events(&response.text().await.expect("the stream"))
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let response = fixture
        .client
        .post(format!("{}/sessions/{id}/cancel", fixture.base))
        .bearer_auth(&fixture.key)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 202);
    let events = tokio::time::timeout(Duration::from_secs(10), say)
        .await
        .expect("the turn stops at once")
        .expect("the stream ends");
    assert_eq!(
        names(&events),
        ["step", "handoff", "step", "done"],
        "{events:?}"
    );
    let done = all(&events, "done")[0];
    assert_eq!(done["stopped"], "cancelled");
    assert_eq!(done["agent"], "billing");
    // Billing holds the conversation and answers the next message.
    let events = fixture.say(&id, "Please go on.").await;
    let done = all(&events, "done")[0];
    assert_eq!(
        (done["agent"].as_str(), done["response"].as_str()),
        (Some("billing"), Some("Refunded 5."))
    );
    stop(fixture).await;
}

/// A team like [`team`]'s whose entry agent is also named `triage`, and
/// answers itself.
fn sales(triage: impl Model + 'static) -> Team {
    let triage = Agent::builder("triage")
        .instructions("You are sales' triage.")
        .model(triage)
        .build()
        .expect("builds");
    Team::builder()
        .agent("triage", triage)
        .build()
        .expect("the team builds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_teams_whose_entry_agents_share_a_name_are_served_side_by_side() {
    let path = database("side-by-side");
    let refunds = Arc::new(AtomicUsize::new(0));
    let store = Arc::new(SqliteStore::open(&path).expect("the database opens"));
    let fixture = start(
        Server::builder()
            .team(
                "support",
                team(
                    ScriptedModel::builder()
                        .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                        .build(),
                    ScriptedModel::builder().text("Billing here.").build(),
                    &refunds,
                ),
            )
            .team(
                "sales",
                sales(ScriptedModel::builder().text("Sales here.").build()),
            )
            .worker(WorkerId::new("server")),
        store,
        refunds.clone(),
    )
    .await;
    let mut ids = Vec::new();
    for name in ["sales", "support"] {
        let response = fixture
            .client
            .post(format!("{}/agents/{name}/sessions", fixture.base))
            .bearer_auth(&fixture.key)
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.expect("json");
        assert_eq!(body["agent"], name);
        ids.push(body["id"].as_str().expect("an id").to_owned());
    }
    let (sales_id, support_id) = (&ids[0], &ids[1]);
    // Each conversation runs on its own team, though both start with an
    // agent named triage.
    let events = fixture.say(sales_id, "Hello.").await;
    assert!(all(&events, "handoff").is_empty(), "{events:?}");
    assert_eq!(all(&events, "done")[0]["response"], "Sales here.");
    let events = fixture.say(support_id, "Refund my 5.").await;
    assert_eq!(all(&events, "handoff").len(), 1, "{events:?}");
    let done = all(&events, "done")[0];
    assert_eq!(
        (done["agent"].as_str(), done["response"].as_str()),
        (Some("billing"), Some("Billing here."))
    );
    for (id, name, agents) in [
        (sales_id, "sales", json!(["triage"])),
        (support_id, "support", json!(["billing", "triage"])),
    ] {
        let (status, session) = fixture.get(&format!("/sessions/{id}")).await;
        assert_eq!(status, 200, "{session}");
        assert_eq!(session["agent"], name, "{session}");
        assert_eq!(session["team"]["agents"], agents, "{session}");
    }
    let (status, listed) = fixture.get("/sessions").await;
    assert_eq!(status, 200, "{listed}");
    let mut listed: Vec<(String, String)> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap_or_default().to_owned(),
                s["agent"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    listed.sort();
    let mut expected = vec![
        (sales_id.clone(), "sales".to_owned()),
        (support_id.clone(), "support".to_owned()),
    ];
    expected.sort();
    assert_eq!(listed, expected);
    stop(fixture).await;
}

#[test]
fn a_team_served_under_a_name_taken_is_refused() {
    let refunds = Arc::new(AtomicUsize::new(0));
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let make = || team(ScriptedModel::new([]), ScriptedModel::new([]), &refunds);
    let built = Server::builder()
        .team("support", make())
        .team("support", make())
        .store(store.clone())
        .build();
    assert!(
        matches!(built, Err(markov_server::BuildError::DuplicateAgent(ref name)) if name == "support"),
        "{built:?}"
    );
    let agent = Agent::builder("support")
        .instructions("Hi.")
        .model(ScriptedModel::new([]))
        .build()
        .expect("builds");
    let built = Server::builder()
        .agent(agent)
        .team("support", make())
        .store(store)
        .build();
    assert!(
        matches!(built, Err(markov_server::BuildError::DuplicateAgent(ref name)) if name == "support"),
        "{built:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_needs_approval_pauses_the_team_turn_and_the_decision_after_a_restart_resumes_it()
 {
    let path = database("approval");
    let refunds = Arc::new(AtomicUsize::new(0));
    let confirmed = || ToolMetadata::new(Category::Action).with_confirmation();
    let fixture = serve(
        &path,
        team_with(
            ScriptedModel::builder()
                .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                .build(),
            ScriptedModel::builder()
                .tool_call("refund", json!({"amount": 5}))
                .build(),
            &refunds,
            confirmed(),
        ),
        &refunds,
    )
    .await;
    let id = fixture.create().await;
    let events = fixture.say(&id, "Refund my 5, please.").await;
    assert_eq!(
        names(&events),
        ["step", "handoff", "step", "done"],
        "{events:?}"
    );
    let steps = all(&events, "step");
    assert_eq!(steps[1]["agent"], "billing");
    assert_eq!(steps[1]["yield_reason"], "awaiting_approval");
    assert_eq!(steps[1]["approvals"][0]["tool"], "refund");
    assert_eq!(steps[1]["approvals"][0]["args"], json!({"amount": 5}));
    let done = all(&events, "done")[0];
    assert_eq!(done["agent"], "billing");
    assert_eq!(done["awaiting_approval"], true);
    assert_eq!(done["done"], false);
    assert_eq!(done["yield_reason"], "awaiting_approval");
    assert_eq!(refunds.load(Ordering::SeqCst), 0, "not before the decision");

    let (_, session) = fixture.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["awaiting_approval"], true, "{session}");
    assert_eq!(session["interrupted"], false, "paused, not interrupted");
    assert_eq!(session["running"], false);
    assert_eq!(session["team"]["current_agent"], "billing");
    let waiting = session["pending_approvals"].as_array().expect("a list");
    assert_eq!(waiting.len(), 1, "{session}");
    assert_eq!(waiting[0]["tool"], "refund");
    let pending = fixture.pending(&id).await;
    assert_eq!(pending.len(), 1);
    assert_eq!(json!(pending[0]), waiting[0]["request_id"]);
    // A message waits for the decision, as an agent's does.
    let response = fixture
        .client
        .post(format!("{}/sessions/{id}/messages", fixture.base))
        .bearer_auth(&fixture.key)
        .json(&json!({"text": "Hello?"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 409);
    let body: Value = response.json().await.expect("an error");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("decide them first") && e.contains("billing")),
        "{body}"
    );
    // Another principal cannot decide on it (it is not theirs to see).
    let response = fixture
        .client
        .post(format!(
            "{}/sessions/{id}/approvals/{}",
            fixture.base, pending[0]
        ))
        .bearer_auth(&fixture.keys["bob"])
        .json(&json!({"decision": "approve"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 404);
    stop(fixture).await;

    // A new process: the call still waits; the decision resumes billing's
    // run (the refund is made once, before any model call), billing hands
    // back and triage answers.
    let calls = Arc::new(AtomicUsize::new(0));
    let fixture = serve(
        &path,
        team_with(
            ScriptedModel::builder().text("Anything else?").build(),
            crate::http::Counted(
                ScriptedModel::builder()
                    .tool_call("hand_back", json!({"reason": "refund done"}))
                    .build(),
                calls.clone(),
            ),
            &refunds,
            confirmed(),
        ),
        &refunds,
    )
    .await;
    let (_, session) = fixture.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["awaiting_approval"], true, "{session}");
    assert_eq!(fixture.pending(&id).await, pending);
    let (status, _) = fixture
        .decide(&id, "apr_nope", json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 404, "an unknown request");
    let (status, events) = fixture
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 200, "{events:?}");
    assert_eq!(
        names(&events),
        [
            "decided", "step", "step", "handoff", "delta", "step", "done"
        ],
        "{events:?}"
    );
    let decided = &events[0].1;
    assert_eq!(decided["decision"], "approve");
    assert_eq!(decided["tool"], "refund");
    assert_eq!(decided["waiting"], 0);
    let steps = all(&events, "step");
    assert_eq!(steps[0]["agent"], "billing");
    assert!(steps[0].to_string().contains("refunded 5"), "{}", steps[0]);
    assert_eq!(steps[1]["agent"], "billing");
    assert_eq!(steps[2]["agent"], "triage");
    assert_eq!(
        *all(&events, "handoff")[0],
        json!({"from": "billing", "to": "triage", "reason": "refund done", "at": 1})
    );
    let done = all(&events, "done")[0];
    assert_eq!(
        (done["agent"].as_str(), done["response"].as_str()),
        (Some("triage"), Some("Anything else?"))
    );
    assert_eq!(done["awaiting_approval"], false);
    assert_eq!(refunds.load(Ordering::SeqCst), 1, "refunded once");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "billing was asked once, after the refund"
    );
    let (_, session) = fixture.get(&format!("/sessions/{id}")).await;
    assert_eq!(session["awaiting_approval"], false);
    assert_eq!(session["pending_approvals"], json!([]));
    assert_eq!(session["team"]["current_agent"], "triage");
    assert_eq!(texts(&session), ["Refund my 5, please.", "Anything else?"]);
    let (status, body) = fixture
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    // Decided once: the conversation has moved on to triage, and says so.
    assert_eq!(status, 409, "decided twice: {body:?}");
    let error = body[0].1["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("already decided") && error.contains("billing"),
        "{error}"
    );
    // Who decided is recorded in billing's step.
    let store = SqliteStore::open(&path).expect("the database opens");
    let steps = markov_store::Store::steps(
        &store,
        &markov_store::agent_session(&markov_store::SessionId::new(&id), "billing"),
        0,
        10,
    )
    .await
    .expect("steps read");
    let approval = steps
        .iter()
        .flat_map(|s| &s.calls)
        .flat_map(|c| &c.tool_calls)
        .find_map(|c| c.approval.clone())
        .expect("the decision is recorded");
    assert_eq!(approval.decision, "approve");
    assert_eq!(approval.by.as_deref(), Some("alice"));
    stop(fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_call_whose_tool_needs_a_role_is_not_decided_by_a_principal_without_it() {
    let refunds = Arc::new(AtomicUsize::new(0));
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let mut fixture = start(
        Server::builder()
            .team(
                "support",
                team_with(
                    ScriptedModel::builder()
                        .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                        .build(),
                    ScriptedModel::builder()
                        .tool_call("refund", json!({"amount": 5}))
                        .build(),
                    &refunds,
                    ToolMetadata::new(Category::Action).with_confirmation(),
                ),
            )
            .approval_role("refund", "approver"),
        store,
        refunds.clone(),
    )
    .await;
    // Bob has no role.
    fixture.key = fixture.keys["bob"].clone();
    let id = fixture.create().await;
    let events = fixture.say(&id, "Refund my 5, please.").await;
    assert_eq!(all(&events, "done")[0]["awaiting_approval"], true);
    let pending = fixture.pending(&id).await;
    assert_eq!(pending.len(), 1);
    let (status, body) = fixture
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 403, "{body:?}");
    assert!(
        body[0].1["error"]
            .as_str()
            .is_some_and(|e| e.contains("approver")),
        "{body:?}"
    );
    assert_eq!(fixture.pending(&id).await, pending, "still waiting");
    assert_eq!(refunds.load(Ordering::SeqCst), 0);
}
