//! Agents as tools: one agent offered to another as a tool. The
//! sub-agent runs its own loop (its own instructions, tools, history and
//! limits) and its answer is the call's result; what its model calls
//! spend counts in the caller's step and usage limits.
//!
//! `cargo run -p markov --example agents_as_tools`
use markov::prelude::*;

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
    let mut machine = assistant.machine();
    machine.enqueue_user("Do I need an umbrella in Paris?");
    let last = machine.run().await?;
    println!("answer: {}", last.output().unwrap_or_default());
    // The assistant's two model calls and the forecaster's two.
    println!("model calls: {}", machine.usage().session.requests);
    Ok(())
}
