//! The worker replaced, mid-turn, by one whose agent changed: what happens
//! to the sessions in flight.
//!
//! The workflow replays its history on the new worker: recorded model
//! answers and tool results are read back, not made again. An activity
//! scheduled before the redeploy and cut off is retried with the input it
//! was scheduled with (the old agent's request); the calls scheduled after
//! the redeploy see the new agent (its instructions, its tools). A tool the
//! new agent removed, named by a recorded model answer whose call was not
//! yet scheduled, is answered to the model as an unknown tool; one whose
//! call was scheduled makes the replay take another path, which Temporal
//! refuses as nondeterministic and retries until a worker with the tool
//! takes the task.

use markov_policy::Decision;

use crate::support::{
    Fixture, Server, TempDir, history, tool_result_text, turns_done, user_messages,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redeploy_with_new_instructions_and_a_tool_added_finishes_the_turn_in_flight() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("redeploy");
    let mut fixture = Fixture::start(&server, &dir.0, Some("model:1"));
    let client = server.client(&fixture.queue).await;

    client
        .send("redeploy", "record please")
        .await
        .expect("sent");
    fixture.wait_for_stall("model.log", "begin 1 v1");
    fixture.redeploy("v2");
    let status = turns_done(&client, "redeploy", 1).await;

    let last = status.last.expect("a turn result");
    assert_eq!(
        last.response.as_deref(),
        Some("done after 2 steps"),
        "{last:?}"
    );
    // The recorded call of the old agent is not made again. The cut-off
    // one was scheduled before the redeploy: its activity is retried with
    // the input it was scheduled with (the old instructions). The call
    // scheduled after the redeploy sees the new agent.
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert_eq!(fixture.count("model.log", "begin 0 v1"), 1);
    assert_eq!(fixture.count("model.log", "begin 1 v1"), 2);
    assert_eq!(fixture.count("model.log", "begin 1 v2"), 0);
    assert_eq!(fixture.count("model.log", "begin 2 v2"), 1);
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    let history = history(&client, "redeploy").await;
    assert_eq!(user_messages(&history), 1, "{history:?}");
    assert!(tool_result_text(&history, "call_1").contains("recorded first"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redeploy_that_removes_a_tool_a_recorded_answer_names_gives_the_model_an_error() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("removed");
    let mut fixture = Fixture::start(&server, &dir.0, None);
    let client = server.client(&fixture.queue).await;

    // The first answer names `guarded`, which waits for approval: recorded,
    // its call not yet scheduled.
    client
        .send("removed", "guarded please")
        .await
        .expect("sent");
    let status = client
        .wait_until("removed", std::time::Duration::from_secs(60), |s| {
            !s.pending.is_empty()
        })
        .await
        .expect("an approval is asked for");
    let id = status.pending[0].id.clone();

    // The new agent has no `guarded`... and the old approval is decided
    // meanwhile, as an application would.
    fixture.redeploy("v3");
    client
        .decide("removed", &id, Decision::Approve)
        .await
        .expect("decided");
    let status = turns_done(&client, "removed", 1).await;

    let last = status.last.expect("a turn result");
    assert_eq!(last.error, None, "{last:?}");
    assert_eq!(fixture.count("effects.log", "effect guarded"), 0);
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    let history = history(&client, "removed").await;
    let result = tool_result_text(&history, "call_1");
    assert!(
        result.contains("Unknown tool: guarded"),
        "the model reads that the tool is gone: {result}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_removed_after_its_call_was_scheduled_stops_the_turn_until_it_returns() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("removed-scheduled");
    let mut fixture = Fixture::start(&server, &dir.0, Some("model:1"));
    let client = server.client(&fixture.queue).await;

    client
        .send("removed-scheduled", "guarded please")
        .await
        .expect("sent");
    let status = client
        .wait_until(
            "removed-scheduled",
            std::time::Duration::from_secs(60),
            |s| !s.pending.is_empty(),
        )
        .await
        .expect("an approval is asked for");
    client
        .decide(
            "removed-scheduled",
            &status.pending[0].id,
            Decision::Approve,
        )
        .await
        .expect("decided");
    // The approved call ran as an activity; the next model call stalls.
    fixture.wait_for_stall("model.log", "begin 1");
    assert_eq!(fixture.count("effects.log", "effect guarded first"), 1);

    // A worker without `guarded`: its replay schedules no activity where
    // the history has one, which Temporal refuses as nondeterministic.
    fixture.redeploy("v3");
    let stuck = client
        .wait_until(
            "removed-scheduled",
            std::time::Duration::from_secs(10),
            |s| s.turns >= 1,
        )
        .await;
    assert!(
        stuck.is_err(),
        "the turn went on without the tool: {stuck:?}"
    );
    assert_eq!(fixture.count("effects.log", "effect guarded"), 1);
    // The cut-off model call was retried and answered meanwhile: what
    // waits is the workflow task, not the activity.
    assert_eq!(fixture.count("model.log", "end 1"), 1);

    // The tool back: the turn goes on from its history.
    fixture.redeploy("v1");
    let status = turns_done(&client, "removed-scheduled", 1).await;
    let last = status.last.expect("a turn result");
    assert_eq!(
        last.response.as_deref(),
        Some("done after 2 steps"),
        "{last:?}"
    );
    assert_eq!(fixture.count("effects.log", "effect guarded first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    let history = history(&client, "removed-scheduled").await;
    assert!(tool_result_text(&history, "call_1").contains("guarded first"));
}
