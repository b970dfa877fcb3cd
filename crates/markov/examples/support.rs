//! A support agent: two tools, one of which waits for a person's approval,
//! its sessions in SQLite, served over HTTP with a web page.
//!
//! `cargo run -p markov --example support --features server,providers`,
//! then open http://127.0.0.1:8080 and sign in with the key it prints (made
//! on the first start and kept in `support-api-key`, beside the database).
//! A real model when `ANTHROPIC_API_KEY` or `OPENAI_API_KEY` (or a base
//! URL) is set, else a scripted rehearsal.
use markov::prelude::*;

/// Looks up where an order is.
#[tool]
async fn order_status(
    /// The order number, e.g. "A-1001".
    order: String,
) -> String {
    format!("order {order} left the warehouse on Monday")
}

/// Refunds part or all of an order.
#[tool(needs_approval)]
async fn refund(
    /// The order number.
    order: String,
    /// How much to give back, in cents.
    cents: u32,
) -> String {
    format!("refunded {cents} cents on order {order}")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = match markov::providers::from_env()? {
        Some(configured) => configured.model(),
        None => rehearsal(),
    };
    let store = Arc::new(SqliteStore::open("support-sessions.db")?);
    let key = api_key(&store, "support-api-key").await?;
    let server = Server::builder()
        .agent(agent(model)?)
        .store(store)
        .build()?;
    let listener = markov::server::bind("127.0.0.1:8080").await?;
    println!("serving on http://127.0.0.1:8080: sign in with {key}");
    server.serve(listener).await?;
    Ok(())
}

/// The support agent, on `model`.
pub fn agent(model: Arc<dyn Model>) -> Result<Agent, BuildError> {
    Agent::builder("support")
        .instructions("You help customers with their orders. A person approves every refund.")
        .tool(OrderStatus)
        .tool(Refund)
        .shared_model(model)
        .build()
}

/// The API key to sign in with: made on the first start and kept in
/// `file`, readable by its owner alone; read from there on later starts.
pub async fn api_key(
    store: &SqliteStore,
    file: &str,
) -> Result<String, Box<dyn std::error::Error>> {
    match std::fs::read_to_string(file) {
        Ok(key) => return Ok(key.trim().to_owned()),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        Err(_) => {}
    }
    let key = create_api_key(store, "support", &[]).await?.key;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    std::io::Write::write_all(&mut options.open(file)?, key.as_bytes())?;
    Ok(key)
}

/// Without a provider configured: a scripted model, said to be one, that
/// plays the same three answers in every turn of every conversation.
pub fn rehearsal() -> Arc<dyn Model> {
    println!("model: scripted (no provider configured; a rehearsal, not a real model)");
    Arc::new(
        ScriptedModel::builder()
            .tool_call("order_status", json!({"order": "A-1001"}))
            .tool_call("refund", json!({"order": "A-1001", "cents": 1500}))
            .text("(rehearsal) Your refund of 15.00 is on its way.")
            .build()
            .per_turn()
            .fresh_call_ids(),
    )
}
