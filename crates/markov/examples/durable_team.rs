//! A team conversation kept in SQLite: triage hands it to billing, the
//! process "restarts" (the session is opened again, with new models), and
//! billing, which still holds it, answers, then hands it back.
//!
//! `cargo run -p markov --example durable_team --features store`
use markov::prelude::*;

fn team(triage: ScriptedModel, billing: ScriptedModel) -> Result<Team, Box<dyn std::error::Error>> {
    let triage = Agent::builder("triage")
        .instructions("You route customers.")
        .tools([Handoff::tool("billing", "For refunds.")?])
        .model(triage)
        .build()?;
    let billing = Agent::builder("billing")
        .instructions("You handle refunds.")
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
    let dir = std::env::temp_dir().join(format!("markov-team-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db"))?);
    let id = SessionId::new("alice");

    let before = team(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .build(),
        ScriptedModel::builder().text("Refunded.").build(),
    )?;
    let mut session =
        DurableTeam::create(store.clone(), id.clone(), WorkerId::new("w1"), before).await?;
    let reply = session.send("Refund order A-1, please.").await?;
    println!("{}: {}", reply.agent, reply.answer.unwrap_or_default());
    session.release().await?;

    // After a restart: the conversation, its holder and its handoffs are read back.
    let after = team(
        ScriptedModel::builder().text("Anything else?").build(),
        ScriptedModel::builder()
            .tool_call("hand_back", json!({"reason": "refund done"}))
            .build(),
    )?;
    let mut session = DurableTeam::open(store, id, WorkerId::new("w2"), after).await?;
    println!("held by {}", session.current());
    let reply = session.send("Thanks!").await?;
    for handoff in &reply.handoffs {
        println!("{} -> {}: {}", handoff.from, handoff.to, handoff.reason);
    }
    println!("{}: {}", reply.agent, reply.answer.unwrap_or_default());
    session.release().await?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
