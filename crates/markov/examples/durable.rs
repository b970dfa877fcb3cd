//! A durable session: every step is written to SQLite before the next model
//! call, so another process (here: a second opening) carries on where the
//! first stopped.
//!
//! `cargo run -p markov --example durable --features store`
use markov::prelude::*;

/// Takes a note.
#[tool]
async fn note(text: String) -> String {
    format!("noted: {text}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ScriptedModel::builder()
        .tool_call("note", json!({"text": "buy milk"}))
        .text("Noted: buy milk.")
        .text("You asked me to remember to buy milk.")
        .build();
    let agent = Agent::builder("notes")
        .instructions("You keep notes.")
        .tool(Note)
        .model(model)
        .build()?;
    let dir = std::env::temp_dir().join(format!("markov-durable-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db"))?);
    let id = SessionId::new("alice");

    // The first worker creates the session and runs a turn.
    let first = WorkerId::new("worker-1");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), first, agent.machine()).await?;
    session.machine().enqueue_user("Remember to buy milk.");
    session.run().await?;
    session.release().await?;

    // Another worker opens it from the store, history and all.
    let mut session = DurableMachine::open(store, id, WorkerId::new("worker-2"), &agent).await?;
    println!(
        "reopened with {} messages",
        session.machine().history().len()
    );
    session.machine().enqueue_user("What did I ask you?");
    let last = session.run().await?;
    println!("{}", last.output().unwrap_or_default());
    session.release().await?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
