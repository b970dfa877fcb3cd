//! An agent of two nodes: a triage node hands the conversation to a
//! billing node through a transition, which the model calls like a tool.
//!
//! `cargo run -p markov --example transitions`
use markov::prelude::*;

/// Looks up an invoice's amount.
#[tool]
async fn invoice(number: u32) -> String {
    format!("invoice {number}: 42.00 EUR, paid")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let billing = Node::builder("You answer billing questions with your tools.")
        .tool(Invoice)
        .build()?;
    let triage = Node::builder("You find out what the customer needs and hand over.")
        .transition(
            "billing",
            Transition::to("Questions about invoices", billing.clone()),
        )
        .build()?;
    let model = ScriptedModel::builder()
        .tool_call(
            "transition_billing",
            json!({"reason": "an invoice question"}),
        )
        .tool_call("invoice", json!({"number": 7}))
        .text("Invoice 7 was 42.00 EUR and it is paid.")
        .build();
    let agent = Agent::builder("helpdesk")
        .node("triage", triage)
        .node("billing", billing)
        .model(model)
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("Was invoice 7 paid?");
    let last = machine.run().await?;
    let node = machine.charter().node_name(machine.instance().node());
    println!("now at node {:?}", node.unwrap_or("(inline)"));
    println!("{}", last.output().unwrap_or_default());
    Ok(())
}
