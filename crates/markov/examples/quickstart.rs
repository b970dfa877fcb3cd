//! The smallest agent: instructions, one tool, a model.
//!
//! `cargo run -p markov --example quickstart` (a scripted model: no key
//! needed; see the `provider` example for a real one).
use markov::prelude::*;

/// Adds two integers.
#[tool]
async fn add(a: i64, b: i64) -> i64 {
    a + b
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ScriptedModel::builder()
        .tool_call("add", json!({"a": 2, "b": 3}))
        .text("2 + 3 = 5")
        .build();
    let agent = Agent::builder("calculator")
        .instructions("You do arithmetic with your tools.")
        .tool(Add)
        .model(model)
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("What is 2 + 3?");
    let last = machine.run().await?;
    println!("{}", last.output().unwrap_or_default());
    println!(
        "({} messages, {:?})",
        machine.history().len(),
        last.yield_reason
    );
    Ok(())
}
