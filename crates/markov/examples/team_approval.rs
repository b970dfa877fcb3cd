//! A call that needs approval inside a team conversation: billing's refund
//! pauses the turn, the process "restarts" (the session is opened again,
//! with new models), a person approves, and the turn goes on with
//! billing, which refunds once and hands back.
//!
//! `cargo run -p markov --example team_approval --features store`
use markov::prelude::*;

/// Refunds an order.
#[tool]
async fn refund(order: String) -> String {
    format!("refunded {order}")
}

fn team(triage: ScriptedModel, billing: ScriptedModel) -> Result<Team, Box<dyn std::error::Error>> {
    let triage = Agent::builder("triage")
        .instructions("You route customers.")
        .tools([Handoff::tool("billing", "For refunds.")?])
        .model(triage)
        .build()?;
    let billing = Agent::builder("billing")
        .instructions("You handle refunds.")
        .tool_with(
            Refund,
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .tools([Handoff::back()?])
        .model(billing)
        .build()?;
    Ok(Team::builder()
        .agent("triage", triage)
        .agent("billing", billing)
        .build()?)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("markov-team-approval-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db"))?);
    let id = SessionId::new("alice");

    let before = team(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .build(),
        ScriptedModel::builder()
            .tool_call("refund", json!({"order": "A-1"}))
            .build(),
    )?;
    let mut session =
        DurableTeam::create(store.clone(), id.clone(), WorkerId::new("w1"), before).await?;
    let reply = session.send("Refund order A-1, please.").await?;
    println!(
        "{} waits for approval: {}",
        reply.agent, reply.awaiting_approval
    );
    session.release().await?;

    // After a restart: the call still waits; a person approves it.
    let after = team(
        ScriptedModel::builder().text("Anything else?").build(),
        ScriptedModel::builder()
            .tool_call("hand_back", json!({"reason": "refund done"}))
            .build(),
    )?;
    let mut session = DurableTeam::open(store, id, WorkerId::new("w2"), after).await?;
    for request in session.pending() {
        println!("{}: {}", request.request_id, request.preview);
        session
            .decide_by(&request.request_id, Decision::Approve, "alice")
            .await?;
    }
    if let Some(reply) = session.resume().await? {
        for handoff in &reply.handoffs {
            println!("{} -> {}: {}", handoff.from, handoff.to, handoff.reason);
        }
        println!("{}: {}", reply.agent, reply.answer.unwrap_or_default());
    }
    session.release().await?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
