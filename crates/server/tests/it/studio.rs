//! The studio over HTTP: a session's recorded steps, paged; one step's
//! exact request; forking at a step; and who may do each.

use std::time::Duration;

use markov_server::create_api_key;
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

use crate::http::{Fixture, serve};

/// A session of alice's with three turns (three steps), and a developer's
/// key (dave's).
pub(crate) async fn three_turns(model: ScriptedModel) -> (Fixture, String, String) {
    let f = serve(model).await;
    let dave = create_api_key(&*f.store, "dave", &["developer".to_owned()])
        .await
        .expect("a key")
        .key;
    let id = f.create().await;
    for text in ["hi", "again", "once more"] {
        f.say(&id, text).await;
    }
    (f, id, dave)
}

pub(crate) fn script() -> ScriptedModel {
    ScriptedModel::builder()
        .text("Hello.")
        .text("Again.")
        .text("Once more.")
        .text("Forked.")
        .text("Edited.")
        .build()
}

async fn get_as(f: &Fixture, key: Option<&str>, path: &str) -> (u16, Value) {
    let mut request = f.client.get(format!("{}{path}", f.base));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.expect("sent");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn fork_as(f: &Fixture, key: &str, id: &str, n: u64, body: Value) -> (u16, Value) {
    let response = f
        .client
        .post(format!("{}/sessions/{id}/steps/{n}/fork", f.base))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("sent");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Waits (bounded) until session `id`'s run has ended.
async fn settled(f: &Fixture, key: &str, id: &str) {
    for _ in 0..200 {
        let (status, session) = get_as(f, Some(key), &format!("/sessions/{id}")).await;
        assert_eq!(status, 200, "{session}");
        if session["running"] == false && session["interrupted"] == false {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("session {id} still runs after 5 s");
}

fn texts(step: &Value) -> Vec<String> {
    step["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .flat_map(|m| m["items"].as_array().cloned().unwrap_or_default())
        .filter_map(|i| i["text"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_are_paged_with_what_each_step_added() {
    let (f, id, _) = three_turns(script()).await;
    let (status, first) = get_as(&f, Some(&f.key), &format!("/sessions/{id}/steps?limit=2")).await;
    assert_eq!(status, 200, "{first}");
    let steps = first["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 2, "{first}");
    assert_eq!(first["next"], 2, "{first}");
    assert_eq!(steps[0]["index"], 0);
    assert_eq!(steps[0]["yield_reason"], "end_turn");
    assert_eq!(steps[0]["done"], true);
    assert_eq!(steps[0]["has_request"], true);
    assert_eq!(steps[0]["tools"], 1, "the pay tool was offered");
    assert!(texts(&steps[0]).contains(&"Hello.".to_owned()), "{first}");
    assert!(texts(&steps[1]).contains(&"Again.".to_owned()), "{first}");

    let (status, last) = get_as(&f, Some(&f.key), &format!("/sessions/{id}/steps?from=2")).await;
    assert_eq!(status, 200, "{last}");
    assert_eq!(last["steps"].as_array().expect("steps").len(), 1, "{last}");
    assert_eq!(last["steps"][0]["index"], 2);
    assert!(last.get("next").is_none(), "the last page: {last}");

    for bad in ["limit=0", "limit=201", "from=x"] {
        let (status, body) = get_as(&f, Some(&f.key), &format!("/sessions/{id}/steps?{bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_and_developers_read_a_sessions_steps() {
    let (f, id, dave) = three_turns(script()).await;
    let steps = format!("/sessions/{id}/steps");
    let request = format!("/sessions/{id}/steps/0/request");
    for path in [&steps, &request] {
        assert_eq!(
            get_as(&f, Some(&f.key), path).await.0,
            200,
            "the owner: {path}"
        );
        assert_eq!(
            get_as(&f, Some(&dave), path).await.0,
            200,
            "a developer: {path}"
        );
        // Another user without the role: as if the session did not exist.
        assert_eq!(
            get_as(&f, Some(&f.keys["bob"]), path).await.0,
            404,
            "bob: {path}"
        );
        assert_eq!(get_as(&f, None, path).await.0, 401, "anonymous: {path}");
        let foreign = f
            .client
            .get(format!("{}{path}", f.base))
            .bearer_auth(&dave)
            .header("host", "evil.example")
            .send()
            .await
            .expect("sent");
        assert_eq!(foreign.status(), 403, "a foreign host: {path}");
    }
    let (status, _) = fork_as(&f, &f.keys["bob"], &id, 0, json!({})).await;
    assert_eq!(status, 404, "bob cannot fork alice's session");
    let (status, _) = get_as(&f, Some(&dave), "/sessions/nope/steps").await;
    assert_eq!(status, 404);
    let (status, _) = get_as(&f, Some(&dave), &format!("/sessions/{id}/steps/9/request")).await;
    assert_eq!(status, 404, "no step 9");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_request_is_what_the_model_received() {
    let (f, id, _) = three_turns(script()).await;
    let (status, body) = get_as(&f, Some(&f.key), &format!("/sessions/{id}/steps/1/request")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["step"], 1);
    let request = &body["request"];
    assert_eq!(request["system"], "You pay bills.");
    assert_eq!(request["tools"][0]["name"], "pay");
    let messages = request["messages"].as_array().expect("messages");
    // hi, Hello., again: the second step's request, not the whole history.
    assert_eq!(messages.len(), 3, "{request}");
    assert_eq!(messages[2]["role"], "user");
    assert_eq!(messages[2]["items"][0]["text"], "again");
    assert!(
        messages.iter().all(|m| m.get("metadata").is_none()),
        "no machine bookkeeping, which no provider is sent: {request}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_at_a_step_asks_the_same_request_and_belongs_to_whoever_forked() {
    let (f, id, dave) = three_turns(script()).await;
    let (status, fork) = fork_as(&f, &dave, &id, 1, json!({})).await;
    assert_eq!(status, 201, "{fork}");
    let fork = fork["id"].as_str().expect("an id").to_owned();
    assert_ne!(fork, id);
    settled(&f, &dave, &fork).await;

    // The fork's first request is the forked step's.
    let (_, original) = get_as(&f, Some(&dave), &format!("/sessions/{id}/steps/1/request")).await;
    let (status, again) = get_as(
        &f,
        Some(&dave),
        &format!("/sessions/{fork}/steps/0/request"),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["request"], original["request"]);
    let (_, steps) = get_as(&f, Some(&dave), &format!("/sessions/{fork}/steps")).await;
    assert!(
        texts(&steps["steps"][0]).contains(&"Forked.".to_owned()),
        "{steps}"
    );

    // The fork is dave's: alice, who owns the source, does not see it.
    let (status, _) = get_as(&f, Some(&f.key), &format!("/sessions/{fork}")).await;
    assert_eq!(status, 404);
    let (_, mine) = get_as(&f, Some(&dave), "/sessions").await;
    assert!(
        mine.as_array()
            .expect("a list")
            .iter()
            .any(|s| s["id"] == fork.as_str()),
        "{mine}"
    );

    // The owner forks with the question edited.
    let (status, edited) = fork_as(&f, &f.key, &id, 1, json!({"edit_user": "pay instead"})).await;
    assert_eq!(status, 201, "{edited}");
    let edited = edited["id"].as_str().expect("an id").to_owned();
    settled(&f, &f.key, &edited).await;
    let (_, request) = get_as(
        &f,
        Some(&f.key),
        &format!("/sessions/{edited}/steps/0/request"),
    )
    .await;
    let messages = request["request"]["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 3, "{request}");
    assert_eq!(messages[2]["items"][0]["text"], "pay instead");

    let (status, body) = fork_as(&f, &dave, &id, 7, json!({})).await;
    assert_eq!(status, 404, "no step 7: {body}");
}

/// An agent like the fixture's, with `instructions`, over `model`.
pub(crate) fn payments(
    instructions: &str,
    model: std::sync::Arc<dyn markov_core::model::Model>,
) -> markov_executor::Agent {
    markov_executor::Agent::builder("payments")
        .instructions(instructions)
        .tool_with(
            crate::http::Pay(std::sync::Arc::default()),
            markov_policy::ToolMetadata::new(markov_policy::Category::Action),
        )
        .model(model)
        .build()
        .expect("the agent builds")
}

/// Serves the payments agent, replayable against `changed` instructions
/// with `live` answering where the recording does not.
async fn replayable(changed: &'static str, live: ScriptedModel) -> Fixture {
    let recorded = std::sync::Arc::new(ScriptedModel::builder().text("Hello.").build());
    let store = std::sync::Arc::new(markov_store::SqliteStore::in_memory().expect("a database"));
    crate::http::start(
        markov_server::Server::builder()
            .agent(payments("You pay bills.", recorded))
            .replay_agent("payments", std::sync::Arc::new(live), move |model| {
                payments(changed, model)
            })
            .worker(markov_store::WorkerId::new("test")),
        store,
        std::sync::Arc::default(),
    )
    .await
}

async fn replay_as(f: &Fixture, key: &str, id: &str, body: Value) -> (u16, Value) {
    let response = f
        .client
        .post(format!("{}/sessions/{id}/replay", f.base))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("sent");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_against_changed_instructions_says_where_the_runs_part() {
    let f = replayable(
        "You pay bills, carefully.",
        ScriptedModel::builder().text("Carefully: hello.").build(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    let (_, page) = get_as(&f, Some(&f.key), &format!("/sessions/{id}/steps")).await;
    assert_eq!(page["replayable"], true, "{page}");
    let (status, report) = replay_as(&f, &f.key, &id, json!({})).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["parted_at"], 0, "{report}");
    let step = &report["steps"][0];
    assert_eq!(step["request_changed"], true);
    assert_eq!(step["answered_from"], "live");
    assert_eq!(step["recorded"]["text"], "Hello.");
    assert_eq!(step["replayed"]["text"], "Carefully: hello.");
    assert_eq!(
        step["replayed"]["request"]["system"],
        "You pay bills, carefully."
    );
    let (status, _) = replay_as(&f, &f.keys["bob"], &id, json!({})).await;
    assert_eq!(status, 404, "bob may not replay alice's session");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_an_unchanged_agent_plays_the_recording_back_and_an_unreplayable_agent_is_a_conflict()
 {
    let f = replayable("You pay bills.", ScriptedModel::builder().build()).await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    let (status, report) =
        replay_as(&f, &f.key, &id, json!({"mode": "recorded_where_unchanged"})).await;
    assert_eq!(status, 200, "{report}");
    assert!(report["parted_at"].is_null(), "{report}");
    assert_eq!(report["steps"][0]["answered_from"], "recorded");

    let (g, id, _) = three_turns(script()).await;
    let (_, page) = get_as(&g, Some(&g.key), &format!("/sessions/{id}/steps")).await;
    assert_eq!(page["replayable"], false);
    let (status, body) = replay_as(&g, &g.key, &id, json!({})).await;
    assert_eq!(status, 409, "{body}");
}
