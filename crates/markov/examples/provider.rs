//! A real model from the environment: `ANTHROPIC_API_KEY` (or
//! `ANTHROPIC_BASE_URL` for a local server such as llama.cpp's), else
//! `GEMINI_API_KEY`, else `OPENAI_API_KEY` or `OPENAI_BASE_URL` for any
//! OpenAI-compatible server (`MARKOV_OPENAI_API=responses` for the
//! Responses API). `MARKOV_MODEL` names the model; without it a local
//! server is asked which one it serves.
//!
//! `ANTHROPIC_API_KEY=… cargo run -p markov --example provider --features providers`
use markov::prelude::*;

/// Adds two integers.
#[tool]
async fn add(a: i64, b: i64) -> i64 {
    a + b
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(configured) = markov::providers::from_env()? else {
        println!("No provider configured: set ANTHROPIC_API_KEY, GEMINI_API_KEY or OPENAI_API_KEY");
        println!("(or ANTHROPIC_BASE_URL / OPENAI_BASE_URL for a local server).");
        return Ok(());
    };
    let configured = configured.settle_model().await?;
    println!("model: {}", configured.description());
    let agent = Agent::builder("calculator")
        .instructions("You do arithmetic with your tools, then answer in one sentence.")
        .tool(Add)
        .shared_model(configured.model())
        .limits(RunOptions::default().max_steps(8))
        .build()?;
    let mut machine = agent.machine();
    machine.enqueue_user("What is 1234 + 4321?");
    let last = machine.run().await?;
    println!("{}", last.output().unwrap_or_default());
    Ok(())
}
