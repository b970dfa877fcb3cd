//! The service the crash tests kill and restart, run in a child process
//! as this ignored test (see `support::Fixture`): the testkit's fixture
//! agent, its model and tools journaled, served as `MarkovSession`.
//! Prints `listening <port>` once it serves on a loopback port (a free one,
//! or `MARKOV_FIXTURE_PORT`).

use std::time::Duration;

use markov_core::async_trait;
use markov_core::message::{Item, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_restate::{JournaledModel, SessionObject, journaled, journaled_shared};
use markov_testkit::engine::{FixtureConfig, FixtureModel, Guarded, Record, Tally};

/// Set in the environment: the service's agent is [`caller`], which asks
/// the fixture agent as a sub-agent.
pub(crate) const SUB_AGENT: &str = "MARKOV_FIXTURE_SUB_AGENT";

/// The caller's model: step 0 asks the `clerk` (call `call_c`) to record,
/// then it answers `the clerk answered`.
#[derive(Debug)]
struct CallerModel;

#[async_trait]
impl Model for CallerModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let asked = request.messages().iter().any(|m| m.role == Role::Assistant);
        Ok(if asked {
            ModelResponse::new(vec![Item::text("the clerk answered")], StopReason::EndTurn)
        } else {
            ModelResponse::new(
                vec![Item::tool_use(
                    "call_c",
                    "clerk",
                    serde_json::json!({"request": "record please"}),
                )],
                StopReason::ToolUse,
            )
        })
    }
}

/// An agent whose one tool is the fixture agent as a sub-agent, `clerk`.
/// The sub-agent's model and its at-most-once `record` are not journaled
/// on their own: what it does is kept in its call's journal.
fn caller(config: &FixtureConfig) -> Result<Agent, Box<dyn std::error::Error>> {
    let clerk = Agent::builder("clerk")
        .instructions(config.instructions())
        .model(FixtureModel::new(config))
        .tools_with([(
            markov_core::tool::Erased::shared(Record::new(config))?,
            ToolMetadata::new(Category::Action),
        )])
        .build()?;
    let tool = clerk.as_tool("clerk", "Records what it is asked to.")?;
    Ok(Agent::builder("caller")
        .instructions("Ask the clerk.")
        .model(JournaledModel::new(CallerModel))
        .tools_with([(
            journaled_shared(std::sync::Arc::new(tool)),
            ToolMetadata::new(Category::Action),
        )])
        .build()?)
}

fn agent(config: &FixtureConfig) -> Result<Agent, Box<dyn std::error::Error>> {
    if std::env::var_os(SUB_AGENT).is_some() {
        return caller(config);
    }
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
