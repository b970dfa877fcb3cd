//! The cost of a step on each engine, measured in one run: the same
//! three-step turn (a tool call, a second tool call, an answer) in
//! memory, in markov's own SQLite store, and on Restate (the fixture
//! service over loopback, each model and tool call journaled).

use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_store::{DurableMachine, SessionId, SqliteStore, WorkerId};
use markov_testkit::engine::{FixtureConfig, FixtureModel, Record};

use crate::support::{Client, Fixture, Server, TempDir};

const TURNS: usize = 30;
const STEPS_PER_TURN: u32 = 3;

fn agent() -> Agent {
    Agent::builder("overhead")
        .instructions("Record.")
        .model(FixtureModel::new(&FixtureConfig::quiet()))
        .tool_with(
            Record::new(&FixtureConfig::quiet()),
            ToolMetadata::new(Category::Action),
        )
        .build()
        .expect("agent")
}

fn per_step(total: Duration) -> Duration {
    total / (TURNS as u32 * STEPS_PER_TURN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_step_overhead_of_each_engine_in_one_run() {
    let Some(server) = Server::start() else {
        return;
    };
    let agent = agent();

    let start = Instant::now();
    for _ in 0..TURNS {
        let mut machine = agent.machine();
        machine.enqueue_user("go");
        let last = machine.run().await.expect("a turn");
        assert!(last.done);
        assert_eq!(machine.history().len(), 6);
    }
    let memory = per_step(start.elapsed());

    let dir = TempDir::new("overhead-sqlite");
    let store = Arc::new(SqliteStore::open(dir.0.join("s.db")).expect("store"));
    let start = Instant::now();
    for turn in 0..TURNS {
        let mut durable = DurableMachine::create(
            Arc::clone(&store),
            SessionId::new(format!("s{turn}")),
            WorkerId::new("w"),
            agent.machine(),
        )
        .await
        .expect("create");
        durable.machine().enqueue_user("go");
        let last = durable.run().await.expect("a turn");
        assert!(last.done);
    }
    let sqlite = per_step(start.elapsed());

    let fixture_dir = TempDir::new("overhead-restate");
    let fixture = Fixture::start_quiet(&fixture_dir.0);
    let client = Client::new(&server);
    client.register(fixture.port).await;
    // One warm-up turn: the first connection to the service.
    client.send("warm-up", "go").await;
    let start = Instant::now();
    for turn in 0..TURNS {
        let result = client.send(&format!("overhead-{turn}"), "go").await;
        assert_eq!(result["done"], true, "{result}");
        assert_eq!(result["history_len"], 6, "{result}");
    }
    let restate = per_step(start.elapsed());

    println!("per step, {TURNS} turns of {STEPS_PER_TURN} steps (two at-most-once tool calls):");
    println!("  in memory:          {memory:?}");
    println!("  markov SQLite store: {sqlite:?}");
    println!("  Restate (loopback):  {restate:?}");
    assert!(
        memory < restate,
        "a journaled step costs more than one in memory"
    );
}
