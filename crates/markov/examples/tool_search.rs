//! Tool search: tools registered deferred are not offered up front. The
//! model is offered `search_tools`, finds what it needs by what it does,
//! and the tools found are offered from then on, appended at the end of
//! the list; they run through the same policies as any other tool.
//!
//! `cargo run -p markov --example tool_search`
use markov::prelude::*;

/// Reads the weather of a city.
#[tool]
async fn weather(city: String) -> String {
    format!("Sunny in {city}")
}

/// Sends an email to someone.
#[tool]
async fn send_email(to: String, subject: String) -> String {
    format!("sent {subject:?} to {to}")
}

/// Books a meeting room for a time slot.
#[tool]
async fn book_room(room: String, slot: String) -> String {
    format!("{room} booked at {slot}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "send an email"}))
            .tool_call("send_email", json!({"to": "ada", "subject": "hello"}))
            .text("Sent.")
            .build(),
    );
    let deferred = || ToolMetadata::new(Category::Action).deferred();
    let agent = Agent::builder("assistant")
        .instructions("You help with your tools.")
        .tool_with(Weather, ToolMetadata::new(Category::Retrieval))
        .tool_with(SendEmail, deferred())
        .tool_with(BookRoom, deferred())
        .policies(
            PolicyConfig::new(Budget::UNLIMITED)
                .tool_search(ToolSearch::new().scope(FoundScope::Session)),
        )
        .shared_model(model.clone())
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("Email Ada hello.");
    machine.run().await?;
    for (i, request) in model.requests().iter().enumerate() {
        println!("request {i} offered {:?}", request.tool_names());
    }
    println!(
        "answer: {}",
        machine
            .history()
            .last()
            .map(|m| m.text())
            .unwrap_or_default()
    );
    Ok(())
}
