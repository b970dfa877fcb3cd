//! The service replaced, mid-turn, by one whose agent changed: what
//! happens to the sessions in flight.
//!
//! The new service registers at the same address, so Restate sends the
//! in-flight invocation's retry to it, and it replays the journal:
//! journaled model answers and tool results are read back, not made
//! again. A step cut off before its result was journaled is run again by
//! the new code, so the cut-off model call already sees the new agent's
//! instructions (Temporal retries it with the request it was scheduled
//! with).
//!
//! A tool removed in place under a journaled answer that names it changes
//! the code path the replay takes: Restate refuses it as a journal mismatch
//! (RT0016) and retries the invocation until a service that has the tool
//! answers at that address; nothing runs twice meanwhile. The way to
//! change an agent under sessions in flight is Restate's versioning: the
//! changed service at a new address, registered as a new deployment, takes
//! the new invocations, and the old one finishes those it started.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{Client, Fixture, Server, TempDir, deployed, history, tool_result_text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redeploy_with_new_instructions_and_a_tool_added_finishes_the_turn_in_flight() {
    let Some((_server, _dir, mut fixture, client)) = deployed("redeploy", Some("model:1")).await
    else {
        return;
    };

    let invocation = client.send_async("redeploy", "record please").await;
    fixture.wait_for_stall("model.log", "begin 1 v1");
    fixture.redeploy("v2");
    client.register(fixture.port).await;
    let result = client.attach(&invocation).await;

    assert_eq!(result["response"], "done after 2 steps", "{result}");
    // The journaled call of the old agent is not made again; the cut-off
    // one is made again by the new code, with the new instructions.
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert_eq!(fixture.count("model.log", "begin 1 v1"), 1);
    assert_eq!(fixture.count("model.log", "begin 1 v2"), 1);
    assert_eq!(fixture.count("model.log", "begin 2 v2"), 1);
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    let history = history(&client, "redeploy").await;
    assert!(tool_result_text(&history, "call_1").contains("recorded first"));
}

/// Starts a `guarded` turn on `fixture` and waits for its approval; the
/// invocation and the awakeable to resolve.
async fn waiting_for_approval(client: &Client, session: &str) -> (String, String) {
    let invocation = client.send_async(session, "guarded please").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pending = client.shared(session, "approvals").await;
        if let Some(awakeable) = pending[0]["awakeable"].as_str() {
            return (invocation, awakeable.to_owned());
        }
        assert!(Instant::now() < deadline, "no approval was asked for");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_removed_in_place_under_a_journaled_call_stops_the_turn_until_it_returns() {
    let Some((_server, _dir, mut fixture, client)) = deployed("removed", None).await else {
        return;
    };
    let (invocation, awakeable) = waiting_for_approval(&client, "removed").await;

    // The same address now serves an agent without `guarded`: its replay
    // of the journaled answer takes another path (no approval), which
    // Restate refuses as a journal mismatch and retries.
    fixture.redeploy("v3");
    client.register(fixture.port).await;
    client
        .resolve(&awakeable, json!({"decision": "approve"}))
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let state = loop {
        let state = client.invocation_state(&invocation).await;
        if state["rows"][0]["last_failure_error_code"] == "RT0016" {
            break state;
        }
        assert!(Instant::now() < deadline, "no journal mismatch: {state}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(state["rows"][0]["status"], "backing-off", "{state}");
    assert_eq!(fixture.count("effects.log", "effect guarded"), 0);
    assert_eq!(
        fixture.count("model.log", "begin"),
        1,
        "no model call made again"
    );

    // The tool back at the same address: the turn goes on from its journal.
    fixture.redeploy("v1");
    client.register(fixture.port).await;
    let result = client.attach(&invocation).await;
    assert_eq!(result["response"], "done after 2 steps", "{result}");
    assert_eq!(fixture.count("effects.log", "effect guarded first"), 1);
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_agent_at_a_new_address_leaves_in_flight_turns_on_the_old_one() {
    let Some(server) = Server::start() else {
        return;
    };
    let old_dir = TempDir::new("versioned-old");
    let new_dir = TempDir::new("versioned-new");
    let old = Fixture::start(&old_dir.0, None);
    let client = Client::new(&server);
    client.register(old.port).await;
    let (invocation, awakeable) = waiting_for_approval(&client, "pinned").await;

    // The changed agent (no `guarded`) registered as a new deployment: new
    // invocations go to it, the one in flight stays where it started.
    let mut new = Fixture::start(&new_dir.0, None);
    new.redeploy("v3");
    client.register(new.port).await;
    client
        .resolve(&awakeable, json!({"decision": "approve"}))
        .await;
    let result = client.attach(&invocation).await;
    assert_eq!(result["response"], "done after 2 steps", "{result}");
    assert_eq!(old.count("effects.log", "effect guarded first"), 1);
    assert_eq!(new.count("model.log", "begin"), 0);

    let fresh = client.send("fresh", "record please").await;
    assert_eq!(fresh["response"], "done after 2 steps", "{fresh}");
    assert_eq!(new.count("model.log", "begin 0 v2"), 1);
    assert_eq!(
        old.count("model.log", "begin"),
        3,
        "the old deployment took no new turn"
    );
}
