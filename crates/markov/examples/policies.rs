//! Tools under the policy pipeline: each tool has a category, and a budget
//! caps how many calls a turn may make. A call past the budget is not run;
//! the model reads why, as the call's result.
//!
//! `cargo run -p markov --example policies`
use markov::prelude::*;

/// Searches the web.
#[tool]
async fn search(query: String) -> String {
    format!("3 results for {query:?}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ScriptedModel::builder()
        .tool_call("search", json!({"query": "rust agents"}))
        .tool_call("search", json!({"query": "rust agents 2026"}))
        .tool_call("search", json!({"query": "rust agents again"}))
        .text("Here is what I found.")
        .build();
    let agent = Agent::builder("researcher")
        .instructions("You research with your tools.")
        .tool_with(Search, ToolMetadata::new(Category::Retrieval))
        .policies(PolicyConfig::new(
            Budget::UNLIMITED.max_for(Category::Retrieval, 2),
        ))
        .model(model)
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("What is new in Rust agents?");
    machine.run().await?;
    // Every call has its result; the third one says why it did not run.
    for message in machine.history() {
        for item in message.item_list() {
            if let markov::core::message::Item::ToolResult { content, .. } = item {
                println!("result: {content}");
            }
        }
    }
    Ok(())
}
