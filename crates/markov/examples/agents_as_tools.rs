//! Agents as tools: one agent offered to another as a tool. The
//! sub-agent runs its own loop (its own instructions, tools, history and
//! limits) and its answer is the call's result; what its model calls
//! spend counts in the caller's step and usage limits. In a stored
//! session the sub-agent is durable too: its answers and answered calls
//! are kept with the caller's, so a crash inside it resumes inside it,
//! and its steps are recorded under the call that ran it.
//!
//! `cargo run -p markov --example agents_as_tools --features store`
use markov::prelude::*;
use markov::store::Store;

/// Reads the weather of a city.
#[tool]
async fn weather(city: String) -> String {
    format!("sunny in {city}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let forecaster = Agent::builder("forecaster")
        .instructions("You forecast the weather with your tool.")
        .tool(Weather)
        .model(
            ScriptedModel::builder()
                .tool_call("weather", json!({"city": "Paris"}))
                .text("Paris: sunny all day.")
                .build(),
        )
        .build()?;
    let assistant = Agent::builder("assistant")
        .instructions("You help; ask the forecaster about the weather.")
        .tools([
            Arc::new(forecaster.as_tool("forecaster", "Forecasts the weather of a city.")?) as _,
        ])
        .model(
            ScriptedModel::builder()
                .tool_call(
                    "forecaster",
                    json!({"request": "The weather in Paris today?"}),
                )
                .text("It will be sunny in Paris.")
                .build(),
        )
        .build()?;
    let dir = std::env::temp_dir().join(format!("markov-agents-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db"))?);
    let id = SessionId::new("umbrella");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("worker-1"),
        assistant.machine(),
    )
    .await?;
    session
        .machine()
        .enqueue_user("Do I need an umbrella in Paris?");
    let last = session.run().await?;
    println!("answer: {}", last.output().unwrap_or_default());
    // The assistant's two model calls and the forecaster's two.
    println!(
        "model calls: {}",
        session.machine().usage().session.requests
    );
    // The forecaster's steps, recorded with the assistant's step that
    // called it.
    for step in store.steps(&id, 0, 10).await? {
        for sub in &step.sub_agents {
            println!(
                "step {} call {}: {} added {} messages ({:?})",
                step.index,
                sub.calls[0],
                sub.step.agent,
                sub.step.messages.len(),
                sub.step.yield_reason
            );
        }
    }
    session.release().await?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
