//! The service the crash tests kill and restart, run in a child process
//! as this ignored test (see `support::Fixture`): the testkit's fixture
//! agent, its model and tools journaled, served as `MarkovSession`.
//! Prints `listening <port>` once it serves on a loopback port (a free one,
//! or `MARKOV_FIXTURE_PORT`).

use std::time::Duration;

use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_restate::{JournaledModel, SessionObject, journaled};
use markov_testkit::engine::{FixtureConfig, FixtureModel, Guarded, Record, Tally};

fn agent(config: &FixtureConfig) -> Result<Agent, Box<dyn std::error::Error>> {
    let mut tools = vec![(
        journaled(Record::new(config))?,
        ToolMetadata::new(Category::Action),
    )];
    if config.has_guarded() {
        tools.push((
            journaled(Guarded::new(config))?,
            ToolMetadata::new(Category::Action).with_confirmation(),
        ));
    }
    if config.has_tally() {
        tools.push((journaled(Tally)?, ToolMetadata::new(Category::Retrieval)));
    }
    Ok(Agent::builder("fixture")
        .instructions(config.instructions())
        .model(JournaledModel::new(FixtureModel::new(config)))
        .tools_with(tools)
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the crash tests' child process, not a test of its own"]
async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let agent = agent(&FixtureConfig::from_env()?)?;
    let port: u16 = std::env::var("MARKOV_FIXTURE_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let mut tries = 0;
    let listener = loop {
        match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            Ok(listener) => break listener,
            Err(error) if tries < 50 => {
                tries += 1;
                eprintln!("port {port} not free yet: {error}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.into()),
        }
    };
    println!("listening {}", listener.local_addr()?.port());
    SessionObject::new(agent).serve(listener).await;
    Ok(())
}
