//! The cost of a step on Temporal, measured as Restate's is (its crate's
//! `overhead` test): the same three-step turn (a tool call, a second tool
//! call, an answer) in memory and on Temporal (the fixture worker, each
//! model and tool call an activity), in one run. Run both crates' tests in
//! one command to compare the engines on one machine:
//! `cargo test -p markov-restate -p markov-temporal --test it -- overhead --nocapture`.

use std::time::{Duration, Instant};

use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_testkit::engine::{FixtureConfig, FixtureModel, Record};

use crate::support::{Fixture, Server, TempDir};

const TURNS: usize = 30;
const STEPS_PER_TURN: u32 = 3;

fn per_step(total: Duration) -> Duration {
    total / (TURNS as u32 * STEPS_PER_TURN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_step_overhead_of_temporal_in_one_run() {
    let Some(server) = Server::start() else {
        return;
    };
    let agent = Agent::builder("overhead")
        .instructions("Record.")
        .model(FixtureModel::new(&FixtureConfig::quiet()))
        .tool_with(
            Record::new(&FixtureConfig::quiet()),
            ToolMetadata::new(Category::Action),
        )
        .build()
        .expect("agent");

    let start = Instant::now();
    for _ in 0..TURNS {
        let mut machine = agent.machine();
        machine.enqueue_user("go");
        let last = machine.run().await.expect("a turn");
        assert!(last.done);
        assert_eq!(machine.history().len(), 6);
    }
    let memory = per_step(start.elapsed());

    let dir = TempDir::new("overhead-temporal");
    let fixture = Fixture::start_quiet(&server, &dir.0);
    let client = server.client(&fixture.queue).await;
    // One warm-up turn: the worker's first poll and the first workflow.
    client.send("warm-up", "go").await.expect("sent");
    crate::support::turns_done(&client, "warm-up", 1).await;
    let start = Instant::now();
    for turn in 0..TURNS {
        let session = format!("overhead-{turn}");
        client.send(&session, "go").await.expect("sent");
        // Asked every 2 ms: the wait adds at most that much per turn.
        let deadline = Instant::now() + Duration::from_secs(60);
        let last = loop {
            if let Ok(status) = client.status(&session).await
                && let Some(last) = status.last
            {
                break last;
            }
            assert!(Instant::now() < deadline, "the turn did not finish");
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        assert!(last.done, "{last:?}");
        assert_eq!(last.history_len, 6, "{last:?}");
    }
    let temporal = per_step(start.elapsed());

    println!("per step, {TURNS} turns of {STEPS_PER_TURN} steps (two at-most-once tool calls):");
    println!("  in memory:            {memory:?}");
    println!("  Temporal (loopback):  {temporal:?}");
    assert!(
        memory < temporal,
        "a step run as an activity costs more than one in memory"
    );
}
