//! Handoffs across agents: a team's triage agent hands the conversation
//! to billing, which continues with its own instructions and tools, shown
//! the last turn of the conversation, until it hands back.
//!
//! `cargo run -p markov --example handoffs`
use markov::prelude::*;

/// Refunds an order.
#[tool]
async fn refund(order: String) -> String {
    format!("refunded {order}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let triage = Agent::builder("triage")
        .instructions("You route customers.")
        .tools([Handoff::tool("billing", "For refunds and invoices.")?])
        .model(
            ScriptedModel::builder()
                .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
                .text("Your parcel arrives tomorrow.")
                .build(),
        )
        .build()?;
    let billing = Agent::builder("billing")
        .instructions("You handle refunds.")
        .tool(Refund)
        .tools([Handoff::back()?])
        .model(
            ScriptedModel::builder()
                .tool_call("refund", json!({"order": "A-1"}))
                .text("Order A-1 is refunded.")
                .tool_call("hand_back", json!({"reason": "a delivery question"}))
                .build(),
        )
        .build()?;
    let team = Team::builder()
        .agent("triage", triage)
        .agent("billing", billing)
        .history("billing", HistoryFilter::LastTurns(1))
        .build()?;
    let mut session = team.session();
    for text in ["Refund order A-1, please.", "And where is my parcel?"] {
        let turn = session.send(text).await?;
        for handoff in &turn.handoffs {
            println!("{} -> {}: {}", handoff.from, handoff.to, handoff.reason);
        }
        println!("{}: {}", turn.agent, turn.step.output().unwrap_or_default());
    }
    Ok(())
}
