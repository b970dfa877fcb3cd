//! Asks a real model one question and streams the answer.
//!
//! It uses Anthropic when `ANTHROPIC_API_KEY` is set, else an
//! OpenAI-compatible server when `OPENAI_API_KEY` or `OPENAI_BASE_URL` is
//! set, and says which; with neither it says so and exits.
//!
//! ```text
//! ANTHROPIC_API_KEY=... cargo run -p markov-providers --example chat -- "What is 2 + 3?"
//! OPENAI_BASE_URL=http://localhost:11434/v1 cargo run -p markov-providers --example chat
//! ```

use std::io::Write;

use futures::StreamExt;
use markov_core::{Message, Model, ModelRequest, ModelSettings, StreamEvent};
use markov_providers::{Anthropic, ConfigError, OpenAi};

/// A client and a line saying which it is.
type Picked = (Box<dyn Model>, String);

fn pick() -> Result<Option<Picked>, ConfigError> {
    let set = |var: &str| std::env::var(var).is_ok_and(|v| !v.trim().is_empty());
    if set("ANTHROPIC_API_KEY") {
        let model = Anthropic::from_env()?;
        let label = format!("anthropic ({})", model.default_model());
        return Ok(Some((Box::new(model), label)));
    }
    if set("OPENAI_API_KEY") || set("OPENAI_BASE_URL") {
        let model = OpenAi::from_env()?;
        let base = std::env::var("OPENAI_BASE_URL").unwrap_or_else(|_| "OpenAI".into());
        let label = format!("openai-compatible at {base} ({})", model.default_model());
        return Ok(Some((Box::new(model), label)));
    }
    Ok(None)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some((model, label)) = pick()? else {
        println!(
            "no provider configured: set ANTHROPIC_API_KEY, OPENAI_API_KEY or OPENAI_BASE_URL"
        );
        return Ok(());
    };
    println!("using {label}");
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is 2 + 3? Answer in one sentence.".into());
    let history = [Message::user(question)];
    let settings = ModelSettings {
        max_tokens: 512,
        ..ModelSettings::default()
    };
    let request = ModelRequest::new("You are terse.", &history, &settings);
    let mut events = model.stream(request);
    while let Some(event) = events.next().await {
        match event? {
            StreamEvent::TextDelta { text, .. } => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            StreamEvent::Done(response) => {
                println!(
                    "\n[{:?}; {} tokens in, {} out]",
                    response.stop_reason, response.usage.input_tokens, response.usage.output_tokens
                );
            }
            _ => {}
        }
    }
    Ok(())
}
