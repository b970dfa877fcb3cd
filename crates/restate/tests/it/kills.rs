//! The service killed with SIGKILL mid-tool, mid-model-call and while a
//! call waits for approval: nothing repeated, nothing lost.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{
    Client, Fixture, Server, TempDir, deployed, history, tool_result_text, user_messages,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_tool_the_at_most_once_call_is_not_run_again() {
    let Some((_server, _dir, mut fixture, client)) = deployed("mid-tool", Some("tool")).await
    else {
        return;
    };

    let invocation = client.send_async("mid-tool", "record please").await;
    fixture.wait_for_stall("effects.log", "effect record first");
    let killed = Instant::now();
    fixture.kill_and_restart();
    let result = client.attach(&invocation).await;
    println!(
        "failover, killed mid-tool to the turn's end: {:?}",
        killed.elapsed()
    );

    assert_eq!(result["response"], "done after 2 steps", "{result}");
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    // The model call before the kill was journaled: never made again.
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
    let Some((_server, _dir, mut fixture, client)) = deployed("mid-model", Some("model:1")).await
    else {
        return;
    };

    let invocation = client.send_async("mid-model", "record please").await;
    fixture.wait_for_stall("model.log", "begin 1");
    let killed = Instant::now();
    fixture.kill_and_restart();
    let result = client.attach(&invocation).await;
    println!(
        "failover, killed mid-model-call to the turn's end: {:?}",
        killed.elapsed()
    );

    assert_eq!(result["response"], "done after 2 steps", "{result}");
    // Step 0's call finished and was journaled; step 1's was cut off and
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
async fn an_approval_waits_across_a_restart_of_the_service() {
    let Some((_server, _dir, mut fixture, client)) = deployed("approval", None).await else {
        return;
    };

    let invocation = client.send_async("approval", "guarded please").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let pending = loop {
        let pending = client.shared("approval", "approvals").await;
        if pending.as_array().is_some_and(|p| !p.is_empty()) {
            break pending;
        }
        assert!(Instant::now() < deadline, "no approval was asked for");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(pending[0]["tool"], "guarded");
    assert_eq!(pending[0]["args"], json!({"note": "first"}));
    assert_eq!(
        fixture.count("effects.log", "effect guarded"),
        0,
        "nothing runs before approval"
    );

    fixture.kill_and_restart();
    let awakeable = pending[0]["awakeable"].as_str().expect("an awakeable id");
    client
        .resolve(awakeable, json!({"decision": "approve"}))
        .await;
    let result = client.attach(&invocation).await;

    assert_eq!(result["response"], "done after 2 steps", "{result}");
    assert_eq!(fixture.count("effects.log", "effect guarded first"), 1);
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
    assert_eq!(client.shared("approval", "approvals").await, json!([]));
    let history = history(&client, "approval").await;
    assert!(tool_result_text(&history, "call_1").contains("guarded first"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_inside_a_sub_agent_it_resumes_inside_itself() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("sub-agent");
    let mut fixture = Fixture::start_sub_agent(&dir.0, "tool");
    let client = Client::new(&server);
    client.register(fixture.port).await;

    let invocation = client.send_async("sub-agent", "ask the clerk").await;
    // The sub-agent's at-most-once `record` ran and stalls: killed there.
    fixture.wait_for_stall("effects.log", "effect record first");
    fixture.kill_and_restart();
    let result = client.attach(&invocation).await;

    assert_eq!(result["response"], "the clerk answered", "{result}");
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
