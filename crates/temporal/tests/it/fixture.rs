//! The worker the crash tests kill and restart, run in a child process as
//! this ignored test (see `support::Fixture`): the testkit's fixture agent
//! served as `MarkovSession` workflows, its model call and tool calls as
//! activities. Connects to `MARKOV_TEMPORAL_ADDRESS`, polls the task queue
//! `MARKOV_FIXTURE_QUEUE`, continues a workflow as new after a turn once
//! its history has `MARKOV_FIXTURE_CONTINUE_AFTER` events (if set), and
//! prints `ready` once its worker is made.

use std::time::Duration;

use markov_core::async_trait;
use markov_core::message::Role;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use markov_core::{Item, tool::Erased};
use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_temporal::{SessionClient, SessionWorker, StepOptions, Steps};
use markov_testkit::engine::{FixtureConfig, FixtureModel, Guarded, Record, Tally};

/// Set in the environment: the worker's agent is [`caller`], which asks
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

/// An agent whose one tool is the fixture agent as a sub-agent, `clerk`,
/// an activity. The sub-agent's model and its at-most-once `record` are
/// not steps of their own: they run inside the clerk's activity, and
/// what they do is kept in its call's journal.
fn caller(config: &FixtureConfig, steps: &Steps) -> Result<Agent, Box<dyn std::error::Error>> {
    let clerk = Agent::builder("clerk")
        .instructions(config.instructions())
        .model(FixtureModel::new(config))
        .tools_with([(
            Erased::shared(Record::new(config))?,
            ToolMetadata::new(Category::Action),
        )])
        .build()?;
    let tool = clerk.as_tool("clerk", "Records what it is asked to.")?;
    Ok(Agent::builder("caller")
        .instructions("Ask the clerk.")
        .model(steps.model(CallerModel))
        .tools_with([(
            steps.shared_tool(std::sync::Arc::new(tool)),
            ToolMetadata::new(Category::Action),
        )])
        .build()?)
}

fn agent(config: &FixtureConfig, steps: &Steps) -> Result<Agent, Box<dyn std::error::Error>> {
    if std::env::var_os(SUB_AGENT).is_some() {
        return caller(config, steps);
    }
    let mut tools = vec![(
        steps.tool(Record::new(config))?,
        ToolMetadata::new(Category::Action),
    )];
    if config.has_guarded() {
        tools.push((
            steps.tool(Guarded::new(config))?,
            ToolMetadata::new(Category::Action).with_confirmation(),
        ));
    }
    if config.has_tally() {
        tools.push((steps.tool(Tally)?, ToolMetadata::new(Category::Retrieval)));
    }
    Ok(Agent::builder("fixture")
        .instructions(config.instructions())
        .model(steps.model(FixtureModel::new(config)))
        .tools_with(tools)
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the crash tests' child process, not a test of its own"]
async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::var("MARKOV_TEMPORAL_ADDRESS")
        .map_err(|_| "MARKOV_TEMPORAL_ADDRESS is not set")?;
    let queue = std::env::var("MARKOV_FIXTURE_QUEUE").unwrap_or_else(|_| "markov".to_owned());
    let steps = Steps::new();
    let agent = agent(&FixtureConfig::from_env()?, &steps)?;
    let client = SessionClient::connect(&address, "default", &queue).await?;
    let mut options = StepOptions::default()
        .with_heartbeat_timeout(Duration::from_secs(2))
        .with_sticky_timeout(Duration::from_secs(2));
    if let Some(events) = std::env::var("MARKOV_FIXTURE_CONTINUE_AFTER")
        .ok()
        .and_then(|e| e.parse().ok())
    {
        options = options.with_continue_after_events(events);
    }
    println!("ready");
    SessionWorker::new(agent, steps)
        .with_options(options)
        .run(&client)
        .await?;
    Ok(())
}
