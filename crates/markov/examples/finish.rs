//! Ending a run on purpose: with output restriction on, an answer without a
//! tool call is met with a reminder; the agent ends its turn by calling
//! `finish`, whose note is the response.
//!
//! `cargo run -p markov --example finish`
use markov::prelude::*;
use markov::tools::Finish;

/// Files a ticket and returns its number.
#[tool]
async fn file_ticket(summary: String) -> String {
    format!("ticket 318 filed: {summary}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let node = Node::builder("You file tickets. Call finish when you are done.")
        .tool(FileTicket)
        .tool(Finish)
        .restriction(OutputRestriction::enabled())
        .build()?;
    let model = ScriptedModel::builder()
        .text("Sure, let me do that.") // no tool call: reminded, not ended
        .tool_call("file_ticket", json!({"summary": "printer on fire"}))
        .tool_call("finish", json!({"note": "Filed as ticket 318."}))
        .build();
    let agent = Agent::builder("tickets")
        .node("tickets", node)
        .model(model)
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("The printer is on fire.");
    let last = machine.run().await?;
    let note = last.termination.and_then(|t| t.message);
    println!(
        "finished ({:?}): {}",
        last.yield_reason,
        note.unwrap_or_default()
    );
    Ok(())
}
