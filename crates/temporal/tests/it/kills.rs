//! The worker killed with SIGKILL mid-tool, mid-model-call and while a call
//! waits for approval: nothing repeated, nothing lost.

use std::time::{Duration, Instant};

use markov_policy::Decision;
use serde_json::json;

use crate::support::{
    Fixture, Server, TempDir, history, tool_result_text, turns_done, user_messages,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_tool_the_at_most_once_call_is_not_run_again() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("mid-tool");
    let mut fixture = Fixture::start(&server, &dir.0, Some("tool"));
    let client = server.client(&fixture.queue).await;

    client
        .send("mid-tool", "record please")
        .await
        .expect("sent");
    fixture.wait_for_stall("effects.log", "effect record first");
    let killed = Instant::now();
    fixture.kill_and_restart();
    let status = turns_done(&client, "mid-tool", 1).await;
    println!(
        "failover, killed mid-tool to the turn's end: {:?}",
        killed.elapsed()
    );

    let last = status.last.expect("a turn result");
    assert_eq!(
        last.response.as_deref(),
        Some("done after 2 steps"),
        "{last:?}"
    );
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    // The model call before the kill was recorded: never made again.
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert_eq!(fixture.count("model.log", "begin 1"), 1);
    let history = history(&client, "mid-tool").await;
    assert_eq!(user_messages(&history), 1, "{history:?}");
    assert!(
        tool_result_text(&history, "call_1").contains("INTERRUPTED"),
        "the interrupted call is answered as such: {history:?}"
    );
    assert!(tool_result_text(&history, "call_2").contains("recorded second"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_model_call_no_finished_call_or_effect_is_repeated() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("mid-model");
    let mut fixture = Fixture::start(&server, &dir.0, Some("model:1"));
    let client = server.client(&fixture.queue).await;

    client
        .send("mid-model", "record please")
        .await
        .expect("sent");
    fixture.wait_for_stall("model.log", "begin 1");
    let killed = Instant::now();
    fixture.kill_and_restart();
    let status = turns_done(&client, "mid-model", 1).await;
    println!(
        "failover, killed mid-model-call to the turn's end: {:?}",
        killed.elapsed()
    );

    let last = status.last.expect("a turn result");
    assert_eq!(
        last.response.as_deref(),
        Some("done after 2 steps"),
        "{last:?}"
    );
    // Step 0's call finished and was recorded; step 1's was cut off and
    // made again, once.
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert_eq!(fixture.count("model.log", "begin 1"), 2);
    assert_eq!(fixture.count("model.log", "end 1"), 1);
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    let history = history(&client, "mid-model").await;
    assert_eq!(user_messages(&history), 1, "{history:?}");
    assert!(tool_result_text(&history, "call_1").contains("recorded first"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_waits_across_a_restart_of_the_worker() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("approval");
    let mut fixture = Fixture::start(&server, &dir.0, None);
    let client = server.client(&fixture.queue).await;

    client
        .send("approval", "guarded please")
        .await
        .expect("sent");
    let status = client
        .wait_until("approval", Duration::from_secs(60), |s| {
            !s.pending.is_empty()
        })
        .await
        .expect("an approval is asked for");
    let pending = &status.pending[0];
    assert_eq!(pending.tool, "guarded");
    assert_eq!(pending.args, json!({"note": "first"}));
    assert_eq!(
        fixture.count("effects.log", "effect guarded"),
        0,
        "nothing runs before approval"
    );

    fixture.kill_and_restart();
    client
        .decide("approval", &pending.id, Decision::Approve)
        .await
        .expect("decided");
    let status = turns_done(&client, "approval", 1).await;

    let last = status.last.expect("a turn result");
    assert_eq!(
        last.response.as_deref(),
        Some("done after 2 steps"),
        "{last:?}"
    );
    assert_eq!(fixture.count("effects.log", "effect guarded first"), 1);
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert!(status.pending.is_empty());
    let history = history(&client, "approval").await;
    assert!(tool_result_text(&history, "call_1").contains("guarded first"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_inside_a_sub_agent_it_resumes_inside_itself() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("sub-agent");
    let mut fixture = Fixture::start_sub_agent(&server, &dir.0, "tool");
    let client = server.client(&fixture.queue).await;

    client
        .send("sub-agent", "ask the clerk")
        .await
        .expect("sent");
    // The sub-agent's at-most-once `record` ran and stalls: killed there.
    fixture.wait_for_stall("effects.log", "effect record first");
    fixture.kill_and_restart();
    let status = turns_done(&client, "sub-agent", 1).await;

    let last = status.last.expect("a turn result");
    assert_eq!(
        last.response.as_deref(),
        Some("the clerk answered"),
        "{last:?}"
    );
    // The sub-agent's model answer before the kill was in its call's
    // journal: not asked again. Its later steps were asked once.
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert_eq!(fixture.count("model.log", "begin 1"), 1);
    assert_eq!(fixture.count("model.log", "begin 2"), 1);
    // The at-most-once call that was cut off did not run again.
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    let history = history(&client, "sub-agent").await;
    assert_eq!(user_messages(&history), 1, "{history:?}");
    assert!(
        tool_result_text(&history, "call_c").contains("done after 2 steps"),
        "the caller reads the sub-agent's real answer: {history:?}"
    );
}
