//! Tool choice per node: `RequiredFirst` makes the first call of each turn
//! use a tool (the model looks something up before it answers) and leaves
//! the later calls free to answer in text.
//!
//! `cargo run -p markov --example tool_choice`
use markov::prelude::*;

/// The weather in a city.
#[tool]
async fn weather(city: String) -> String {
    format!("{city}: 18 °C, light rain")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let node = Node::builder("You answer questions about the weather.")
        .tool(Weather)
        .tool_choice(ToolChoiceRule::RequiredFirst)
        .build()?;
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("weather", json!({"city": "Porto"}))
            .text("It is 18 °C and raining lightly in Porto.")
            .build(),
    );
    let agent = Agent::builder("weather")
        .node("weather", node)
        .shared_model(model.clone())
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("Do I need an umbrella in Porto?");
    machine.run().await?;
    for (i, request) in model.requests().iter().enumerate() {
        println!("call {}: tool choice {:?}", i + 1, request.tool_choice);
    }
    Ok(())
}
