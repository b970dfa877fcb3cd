//! Terminal tools: a tool whose output is the agent's answer, word for word.
//! The model picks the tool and its arguments; the text the user reads is
//! the tool's, and the model is not called again in that turn.
//!
//! `cargo run -p markov --example terminal`
use markov::prelude::*;

/// Confirms an order to the customer; its text is the answer they read.
#[tool(terminal)]
async fn confirm_order(
    /// The order number.
    order: String,
    /// What was ordered, one entry per item.
    items: Vec<String>,
) -> String {
    let mut text = format!("Order {order} is confirmed:");
    for item in items {
        text.push_str(&format!("\n- {item}"));
    }
    text
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call(
                "confirm_order",
                json!({"order": "A-1001", "items": ["2 × espresso cups", "1 × grinder"]}),
            )
            .build(),
    );
    let agent = Agent::builder("orders")
        .instructions("You confirm orders with confirm_order.")
        .tool(ConfirmOrder)
        .shared_model(model.clone())
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("Please confirm my order A-1001.");
    let last = machine.run().await?;
    println!("{}", last.output().unwrap_or_default());
    println!("(model calls: {})", model.calls());
    Ok(())
}
